// The oracle of cute_oracle.h: CuTe's layouts and descriptors, on the host.
//
// make_gmma_desc reads a shared-memory pointer's address in the .shared
// window through __cvta_generic_to_shared, which a host compiler lacks
// (CuTe then prints an error and uses 0). Here a pointer's integer value is
// its shared address: the tiles are made at the address the test names.
#include <cstddef>
#include <cstdint>

inline std::size_t __cvta_generic_to_shared(const void* p) { return reinterpret_cast<std::size_t>(p); }
#define CUTE_CVTA_GENERIC_TO_SHARED_ACTIVATED 1

#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>

#include <stdexcept>
#include <string>

#include "cute_oracle.h"

namespace cudagen::cute_oracle {
namespace {

using namespace cute;

template <int ROWS>
auto k_major_tile() {
  return tile_to_shape(GMMA::Layout_K_SW128_Atom<half_t>{}, make_shape(Int<ROWS>{}, Int<64>{}));
}

// k first: the 64 k of n 0-63 (one TMA box), then those of n 64-127.
auto mn_major_tile() {
  return tile_to_shape(GMMA::Layout_MN_SW128_Atom<half_t>{}, make_shape(Int<128>{}, Int<64>{}), Step<_2, _1>{});
}

half_t* at_address(unsigned base) { return reinterpret_cast<half_t*>(static_cast<std::uintptr_t>(base)); }

template <GMMA::Major MAJOR, typename Layout>
uint64_t descriptor_of(Layout layout, unsigned base, int kk) {
  auto tile = make_tensor(make_smem_ptr(at_address(base)), layout);
  auto step = local_tile(tile, make_shape(size<0>(layout), Int<16>{}), make_coord(0, kk));
  return SM90::GMMA::make_gmma_desc<MAJOR>(step).desc_;
}

// The element offset of coordinate (i, j) from the tile's start, through
// CuTe's pointer: the swizzle acts on the shared address (so the tile
// starts on a 1024-byte boundary, as the mainloop's stages do), not on the
// layout's offset alone.
template <typename Layout>
int offset_of(Layout layout, int i, int j) {
  constexpr unsigned kBase = 1024;
  auto tile = make_tensor(make_smem_ptr(at_address(kBase)), layout);
  return int(raw_pointer_cast(&tile(i, j)) - at_address(kBase));
}

[[noreturn]] void bad_rows(int rows) {
  throw std::invalid_argument("cute_oracle: a K-major tile of " + std::to_string(rows) + " rows (8, 64 or 128)");
}

}  // namespace

int k_major_offset(int rows, int row, int k) {
  switch (rows) {
    case 8: return offset_of(k_major_tile<8>(), row, k);
    case 64: return offset_of(k_major_tile<64>(), row, k);
    case 128: return offset_of(k_major_tile<128>(), row, k);
  }
  bad_rows(rows);
}

int mn_major_offset(int n, int k) { return offset_of(mn_major_tile(), n, k); }

uint64_t k_major_descriptor(int rows, unsigned base, int kk) {
  switch (rows) {
    case 64: return descriptor_of<GMMA::Major::K>(k_major_tile<64>(), base, kk);
    case 128: return descriptor_of<GMMA::Major::K>(k_major_tile<128>(), base, kk);
  }
  bad_rows(rows);
}

uint64_t mn_major_descriptor(unsigned base, int kk) {
  return descriptor_of<GMMA::Major::MN>(mn_major_tile(), base, kk);
}

int accumulator_index(int thread, int value) { return int(SM90::GMMA::CLayout_64x128{}(thread, value)); }

}  // namespace cudagen::cute_oracle
