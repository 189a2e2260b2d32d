// The emulator's scheduler: blocks in a seeded shuffled order, the threads of
// a block as Boost.Context fibers that switch only at barriers.
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <boost/context/detail/fcontext.hpp>

#include "cudagen_emu.h"

namespace fctx = boost::context::detail;

namespace cudagen_emu {
namespace {

constexpr size_t kStackBytes = 256 * 1024;
// The most dynamic shared memory a block can opt in to on any target cudagen
// compiles for (sm_90: 227 KiB).
constexpr unsigned long long kMaxDynamicSmem = 227 * 1024;
constexpr size_t kGuardBytes = 4096;

// A cp.async in flight: its 16 bytes, read from global memory when issued,
// and the group it was committed in (-1 until cp.async.commit_group).
struct AsyncCopy {
  unsigned char* dst;
  unsigned char data[16];
  long long group;
  bool landed;
};

// A wgmma in flight: the accumulators it will write where a wait covers its
// group (-1 until wgmma.commit_group), and the shared bytes its operands
// read (no copy may land there before then).
struct PendingWgmma {
  float* d;
  std::vector<float> values;
  long long group;
  std::vector<std::pair<const unsigned char*, const unsigned char*>> reads;  // [first, last) of each operand
};

// A wgmma as one thread issued it: wgmma is .sync.aligned, so every thread
// of the warpgroup must issue the same one, the same k-th time.
struct WgmmaIssue {
  unsigned long long desc_a, desc_b;  // desc_a 0 where A is in registers
  int n;
  bool scale_d, bf16, trans_b;
  unsigned thread;  // the first to issue it
  bool same(const WgmmaIssue& o) const {
    return desc_a == o.desc_a && desc_b == o.desc_b && n == o.n && scale_d == o.scale_d && bf16 == o.bf16 &&
           trans_b == o.trans_b;
  }
};

// An mbarrier (sm_90's transaction barrier), by its shared address.
struct Mbarrier {
  unsigned expected = 0;  // arrivals a phase expects
  unsigned pending = 0;   // arrivals still to come in the phase in progress
  long long tx = 0;       // bytes still to come in it (expect_tx adds, a landing copy takes off)
  unsigned phase = 0;     // phases completed
};

// A TMA copy in flight: the bytes it will land at dst (the swizzled box,
// read when issued), and the barrier whose transactions it completes.
struct TmaCopy {
  unsigned block;
  unsigned char* dst;
  std::vector<unsigned char> image;
  unsigned char* bar;
};

// What a tensor map's 128 bytes hold in the emulation (encode_tensor_map_2d,
// encode_tensor_map_3d).
struct TensorMapShadow {
  unsigned magic;
  unsigned element_bytes;
  const unsigned char* base;
  unsigned long long width, height, row_stride;
  unsigned box_width, box_height;
  unsigned swizzle;  // bytes of the span; 0: none
  unsigned rank;     // 2, or 3: `depth` planes `plane_stride` bytes apart (a box one plane deep)
  unsigned long long depth, plane_stride;
};
constexpr unsigned kTensorMapMagic = 0x636d6170u;
// Where the block's dynamic shared memory starts in the .shared window.
constexpr unsigned kSharedWindowBase = 16;

struct Fiber {
  enum class State { Ready, AtBlockBarrier, AtWarpBarrier, Spinning, AtMbarrier, Done };
  fctx::fcontext_t ctx = nullptr;
  ThreadContext thread{};
  State state = State::Ready;
  unsigned block = 0;  // which block of the blocks running together
  uint64_t exchange = 0;
  int predicate = 0;       // its __syncthreads_or operand, then the block's result
  // While Spinning: what it waits for (wait_at_least), then whether it came.
  const volatile unsigned long long* counter = nullptr;
  unsigned long long target = 0;
  const volatile unsigned int* stopped = nullptr;
  bool arrived = false;
  std::vector<AsyncCopy> copies;  // its cp.async not yet waited for
  long long next_group = 0;       // the group its next cp.async.commit_group closes
  // While AtMbarrier: the barrier and the parity of the phase it waits for.
  const unsigned char* mbarrier = nullptr;
  unsigned parity = 0;
  std::vector<PendingWgmma> wgmmas;  // not yet covered by a wgmma.wait_group
  long long next_wgmma_group = 0;
  size_t wgmmas_issued = 0;          // in all: the k-th must be its warpgroup's k-th
  bool wgmma_fenced = false;         // a wgmma.fence since its last wgmma.commit_group
  // How many global and checked shared accesses it has made: the k-th of
  // each lane of a warp make one warp-wide request (the lanes run in lockstep).
  unsigned long long load_seq = 0, store_seq = 0, shared_seq = 0;
};

// One lane's part of a warp-wide request.
struct LaneAccess {
  unsigned long long seq;
  uintptr_t address;  // global: from the arena's start (a 256-byte-aligned allocation on a GPU)
  unsigned bytes;
  unsigned lane;
  bool operator<(const LaneAccess& o) const { return seq != o.seq ? seq < o.seq : address < o.address; }
};

// A warp's accesses since its last barrier, counted at the next one.
struct WarpAccesses {
  std::vector<LaneAccess> loads, stores, shared;
};

// What the emulator knows of each byte of shared memory that a cp.async
// wrote: which thread issued the copy (0: none), the barrier epoch of the
// block when that thread waited for it (kNotWaited before), and the last
// thread to read it through a checked read, and in which epoch.
constexpr unsigned kNotWaited = ~0u;
struct SharedByte {
  unsigned owner = 0;
  unsigned waited_epoch = kNotWaited;
  unsigned reader = 0;
  unsigned read_epoch = ~0u;  // none
};

// More fibers than this at once (a persistent launch runs every block's
// threads together) would exhaust the process's memory maps.
constexpr unsigned kMaxFibers = 16384;

struct KernelStats {
  std::string kernel;
  unsigned long long bytes_read = 0;
  unsigned long long bytes_written = 0;
  // Warp-wide requests: global loads, then stores, each with the 32-byte
  // sectors they touch and the fewest that could hold their bytes; checked
  // shared ones (ldmatrix reads, cp.async writes), the bank wavefronts they
  // take (the most distinct 4-byte words any bank serves) and the fewest
  // their words need.
  unsigned long long counters[9] = {};
  double seconds = 0;  // the emulation's own time on the host CPU, not a GPU's
  unsigned grid[3] = {1, 1, 1};  // as launched
};

// One emulator per OS thread: it owns the fiber stacks (reused by every
// block), the shared memory, and the state of the launch in progress.
class Emulator {
 public:
  ~Emulator() {
    for (void* s : stacks_) munmap(s, kStackBytes);
  }

  void configure(uint64_t seed) { seed_ = seed; }
  // An error before any launch (a host launcher's refused tensor map).
  int refuse(std::string why) {
    error_ = std::move(why);
    return 1;
  }
  const std::string& last_error() const { return error_; }
  const std::vector<KernelStats>& stats() const { return stats_; }
  void clear_stats() { stats_.clear(); }
  // Gives back the fiber stacks and shared memory kept for the next launch.
  void release() {
    trim_stacks(0);
    std::vector<Fiber>().swap(fibers_);
    std::vector<unsigned char>().swap(smem_);
    stats_.clear();
  }

  int launch(const char* kernel, const cudagen_tensor_info* tensors, int tensor_count, unsigned char* arena, dim3 grid,
             dim3 block, unsigned long long smem_bytes, bool persistent, void (*body)(void*), void* closure) {
    kernel_ = kernel;
    tensors_ = tensors;
    tensor_count_ = tensor_count;
    arena_ = arena;
    body_ = body;
    closure_ = closure;
    error_.clear();
    stats_.push_back(KernelStats{kernel});
    stats_.back().grid[0] = grid.x;
    stats_.back().grid[1] = grid.y;
    stats_.back().grid[2] = grid.z;
    const unsigned threads = block.x * block.y * block.z;
    if (threads == 0 || threads > 1024) return fail("block of %u threads (1 to 1024 allowed)", threads);
    // What a GPU refuses, the emulator refuses too (CUDA's launch limits).
    if (block.z > 64) return fail("kernel %s: block z of %u (at most 64)", kernel, block.z);
    if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 2147483647u || grid.y > 65535 || grid.z > 65535)
      return fail("kernel %s: grid of %u x %u x %u blocks (x from 1 to 2147483647, y and z from 1 to 65535)", kernel,
                  grid.x, grid.y, grid.z);
    if (smem_bytes > kMaxDynamicSmem)
      return fail("kernel %s: %llu bytes of dynamic shared memory, over the %llu a block can have (sm_90)", kernel,
                  smem_bytes, (unsigned long long)kMaxDynamicSmem);
    const unsigned long long together = persistent ? (unsigned long long)grid.x * grid.y * grid.z : 1;
    if (together * threads > kMaxFibers)
      return fail("kernel %s: a persistent launch of %llu blocks x %u threads is more than the emulator runs at once "
                  "(%u threads); emulate it with fewer blocks (cudagen compile --megakernel-blocks)",
                  kernel, together, threads, kMaxFibers);
    ensure_stacks(unsigned(together) * threads);
    // Each block's dynamic shared memory starts 16 bytes past a 128-byte
    // boundary: the 16-byte alignment CUDA guarantees and no more, so code
    // that assumes more fails here rather than on some GPU.
    smem_bytes_ = smem_bytes;
    smem_stride_ = (smem_bytes + 16 + 127) / 128 * 128;
    smem_.assign(smem_stride_ * together + 256, 0);
    smem_offset_ = size_t((16 - reinterpret_cast<uintptr_t>(smem_.data()) % 128 + 128) % 128);
    async_rng_.seed(seed_ ^ (std::hash<std::string>()(kernel) * 31 + 7));
    std::vector<uint3> blocks;
    for (unsigned z = 0; z < grid.z; ++z)
      for (unsigned y = 0; y < grid.y; ++y)
        for (unsigned x = 0; x < grid.x; ++x) blocks.push_back(uint3{x, y, z});
    // A seeded shuffle: code that depends on block order fails here as it would on a GPU.
    std::mt19937_64 rng(seed_ ^ std::hash<std::string>()(kernel));
    std::shuffle(blocks.begin(), blocks.end(), rng);
    const auto start = std::chrono::steady_clock::now();
    if (persistent) {  // every block at once: blocks wait for one another's events
      run_blocks(blocks, grid, block, threads);
      // Each stack is two memory maps (the guard page splits it), and the
      // process has a limited number; modules are never unloaded, so keep
      // no more than a launch of 256-thread blocks needs.
      trim_stacks(256);
      if (!error_.empty()) return 1;
    } else {
      for (const uint3& b : blocks) {
        run_blocks({b}, grid, block, threads);
        if (!error_.empty()) return 1;
      }
    }
    stats_.back().seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return 0;
  }

  const ThreadContext& context() const { return current_->thread; }

  void syncthreads() { wait(Fiber::State::AtBlockBarrier); }

  int syncthreads_or(int predicate) {
    current_->predicate = predicate;
    wait(Fiber::State::AtBlockBarrier);
    return current_->predicate;  // the block's result, set when the barrier released
  }

  bool wait_at_least(const unsigned long long* counter, unsigned long long target, const unsigned int* stopped) {
    Fiber* self = current_;
    self->counter = counter;
    self->target = target;
    self->stopped = stopped;
    wait(Fiber::State::Spinning);
    return self->arrived;
  }

  uint64_t warp_exchange(uint64_t value, int src_lane) {
    Fiber* self = current_;
    self->exchange = value;
    wait(Fiber::State::AtWarpBarrier);  // every lane has deposited
    const size_t block_base = size_t(self->block) * threads_;
    const size_t local = local_index(self);
    const size_t src = local - local % 32 + size_t(src_lane);
    uint64_t result = (src_lane >= 0 && src_lane < 32 && src < threads_) ? fibers_[block_base + src].exchange : value;
    wait(Fiber::State::AtWarpBarrier);  // every lane has read before anyone deposits again
    return result;
  }

  unsigned char* dynamic_smem() { return smem_.data() + smem_offset_ + current_->block * smem_stride_; }

  void cp_async(void* smem_dst, const void* global_src, int src_bytes) {
    Fiber* self = current_;
    unsigned char* dst = static_cast<unsigned char*>(smem_dst);
    const ThreadContext& c = self->thread;
    const bool dst_misaligned = reinterpret_cast<uintptr_t>(dst) % 16 != 0;
    if (dst_misaligned || (src_bytes > 0 && reinterpret_cast<uintptr_t>(global_src) % 16 != 0)) {
      fail("kernel %s: cp.async of 16 bytes with a %s address that is not 16-byte aligned (%s), by thread (%u, %u, %u) "
           "of block (%u, %u, %u)",
           kernel_, dst_misaligned ? "shared" : "global",
           dst_misaligned ? ("offset " + std::to_string(dst - dynamic_smem()) + " of shared memory").c_str()
                          : ("address % 16 = " + std::to_string(reinterpret_cast<uintptr_t>(global_src) % 16)).c_str(),
           c.thread_idx.x, c.thread_idx.y, c.thread_idx.z, c.block_idx.x, c.block_idx.y, c.block_idx.z);
      return;
    }
    if (src_bytes < 0 || src_bytes > 16) {
      fail("kernel %s: cp.async with %d source bytes (0 to 16)", kernel_, src_bytes);
      return;
    }
    if (!in_shared(dst, 16, "cp.async into")) return;
    if (src_bytes > 0 && !check_access(global_src, 0, (unsigned long long)src_bytes, false)) return;
    const unsigned me = fiber_id(self), epoch = epochs_[self->block];
    for (int i = 0; i < 16; ++i) {
      SharedByte& b = shadow_at(dst + i);
      if (b.reader != 0 && b.reader != me && b.read_epoch == epoch) {
        fail("kernel %s: a cp.async by thread %u of block (%u, %u, %u) overwrites shared memory (offset %lld) that "
             "thread %u read with no barrier between: the stage is still being read",
             kernel_, local_id(me), c.block_idx.x, c.block_idx.y, c.block_idx.z, (long long)(dst + i - dynamic_smem()),
             local_id(b.reader));
        return;
      }
      if (b.owner != 0 && b.waited_epoch == kNotWaited) {
        fail("kernel %s: a cp.async by thread %u of block (%u, %u, %u) writes shared memory (offset %lld) that a "
             "cp.async of thread %u still has in flight (not waited for)",
             kernel_, local_id(me), c.block_idx.x, c.block_idx.y, c.block_idx.z, (long long)(dst + i - dynamic_smem()),
             local_id(b.owner));
        return;
      }
    }
    AsyncCopy copy{dst, {}, -1, false};
    const unsigned char* src = static_cast<const unsigned char*>(global_src);
    for (int i = 0; i < 16; ++i) copy.data[i] = i < src_bytes ? src[i] : 0;
    for (int i = 0; i < 16; ++i) {
      dst[i] = 0xFF;  // poison until it lands
      shadow_at(dst + i) = SharedByte{me, kNotWaited, 0, ~0u};
    }
    self->copies.push_back(copy);
    note_shared_request(dst, 16);
    land_some(self);
  }

  void cp_async_commit() {
    Fiber* self = current_;
    for (AsyncCopy& copy : self->copies)
      if (copy.group < 0) copy.group = self->next_group;
    ++self->next_group;
    land_some(self);
  }

  void cp_async_wait(int most_in_flight) {
    Fiber* self = current_;
    land_some(self);
    // Every committed group but the newest `most_in_flight` has landed.
    const long long complete_below = self->next_group - most_in_flight;
    const unsigned epoch = epochs_[self->block];
    auto done = [&](const AsyncCopy& copy) { return copy.group >= 0 && copy.group < complete_below; };
    for (AsyncCopy& copy : self->copies) {
      if (!done(copy)) continue;
      land(copy);
      for (int i = 0; i < 16; ++i) shadow_at(copy.dst + i).waited_epoch = epoch;
    }
    std::erase_if(self->copies, done);
  }

  bool check_shared_read(const void* smem, unsigned long long bytes) {
    const unsigned char* p = static_cast<const unsigned char*>(smem);
    if (!in_shared(p, bytes, "read of")) return false;
    Fiber* self = current_;
    const unsigned me = fiber_id(self), epoch = epochs_[self->block];
    for (unsigned long long i = 0; i < bytes; ++i) {
      SharedByte& b = shadow_at(p + i);
      const char* why = nullptr;
      if (b.owner != 0 && b.waited_epoch == kNotWaited)
        why = b.owner == me ? "before its cp.async.wait_group covers it"
                            : "before the copying thread's cp.async.wait_group covers it";
      else if (b.owner != 0 && b.owner != me && b.waited_epoch == epoch)
        why = "after the copying thread's cp.async.wait_group but with no barrier since";
      if (why != nullptr) {
        const ThreadContext& c = self->thread;
        fail("kernel %s: thread %u of block (%u, %u, %u) reads shared memory (offset %lld) that a cp.async of thread "
             "%u wrote, %s",
             kernel_, local_id(me), c.block_idx.x, c.block_idx.y, c.block_idx.z, (long long)(p + i - dynamic_smem()),
             local_id(b.owner), why);
        return false;
      }
      b.reader = me;
      b.read_epoch = epoch;
    }
    return true;
  }

  void note_shared_request(const void* smem, unsigned bytes) {
    warp_of(current_).shared.push_back(
        {current_->shared_seq++, reinterpret_cast<uintptr_t>(smem), bytes, lane_of(current_)});
  }

  unsigned shared_address(const void* smem) {
    return unsigned(static_cast<const unsigned char*>(smem) - dynamic_smem()) + kSharedWindowBase;
  }
  unsigned char* shared_pointer(unsigned address) { return dynamic_smem() + (long long)address - kSharedWindowBase; }

  // ---- mbarrier ----

  void mbarrier_init(void* bar, unsigned arrivals) {
    unsigned char* p = static_cast<unsigned char*>(bar);
    if (!in_shared(p, 8, "mbarrier.init of")) return;
    if (shared_address(p) % 8 != 0) {
      fail("kernel %s: mbarrier at shared address %u, not 8-byte aligned", kernel_, shared_address(p));
      return;
    }
    if (arrivals == 0 || arrivals > (1u << 20) - 1) {
      fail("kernel %s: mbarrier.init with %u arrivals (1 to 2^20 - 1)", kernel_, arrivals);
      return;
    }
    mbarriers_[p] = Mbarrier{arrivals, arrivals, 0, 0};
  }

  void mbarrier_expect_tx(void* bar, unsigned bytes) {
    if (Mbarrier* b = find_mbarrier(bar, "mbarrier.expect_tx on")) b->tx += bytes;
  }

  void mbarrier_arrive(void* bar) {
    Mbarrier* b = find_mbarrier(bar, "mbarrier.arrive on");
    if (b == nullptr) return;
    if (b->pending == 0) {
      fail("kernel %s: an arrival on the mbarrier at shared address %u beyond the %u its phase expects",
           kernel_, shared_address(bar), b->expected);
      return;
    }
    --b->pending;
    complete_phase(*b, static_cast<unsigned char*>(bar));
  }

  void mbarrier_wait(void* bar, unsigned parity) {
    Mbarrier* b = find_mbarrier(bar, "mbarrier.try_wait on");
    if (b == nullptr || (b->phase & 1u) != (parity & 1u)) return;  // that phase has completed
    current_->mbarrier = static_cast<const unsigned char*>(bar);
    current_->parity = parity & 1u;
    wait(Fiber::State::AtMbarrier);
  }

  // ---- TMA ----

  // A box of a 2-D map (rank 2, z 0) or of one plane of a 3-D map (rank 3).
  void tma_load(void* dst, const void* map, int x, int y, int z, unsigned rank, void* bar) {
    const TensorMapShadow& m = *static_cast<const TensorMapShadow*>(map);
    if (m.magic != kTensorMapMagic) {
      fail("kernel %s: cp.async.bulk.tensor with a tensor map that encode_tensor_map_2d/3d did not make", kernel_);
      return;
    }
    if (m.rank != rank) {
      fail("kernel %s: cp.async.bulk.tensor.%ud with a tensor map of rank %u (the instruction's dimensions are the "
           "map's)",
           kernel_, rank, m.rank);
      return;
    }
    // A plane outside the tensor: every element out of bounds (zeros).
    const bool plane_in = z >= 0 && (unsigned long long)z < m.depth;
    unsigned char* d = static_cast<unsigned char*>(dst);
    const unsigned long long box_bytes = (unsigned long long)m.box_width * m.box_height * m.element_bytes;
    if (!in_shared(d, box_bytes, "TMA copy into")) return;
    const unsigned address = shared_address(d);
    if (address % 128 != 0) {
      fail("kernel %s: TMA copy into shared address %u, not 128-byte aligned", kernel_, address);
      return;
    }
    // The 128-byte swizzle's pattern repeats every 1024 bytes and follows the
    // address bits: a box that starts elsewhere lands rotated on the GPU.
    if (m.swizzle == 128 && address % 1024 != 0) {
      fail("kernel %s: TMA copy with the 128-byte swizzle into shared address %u, not 1024-byte aligned (its "
           "pattern follows address bits 4 to 9)",
           kernel_, address);
      return;
    }
    Mbarrier* b = find_mbarrier(bar, "cp.async.bulk.tensor completing on");
    if (b == nullptr) return;
    const unsigned block = current_->block;
    if (const char* what = busy(block, d, d + box_bytes)) {
      fail("kernel %s: a TMA copy into shared memory (addresses %u to %llu) that %s", kernel_, address,
           address + box_bytes, what);
      return;
    }
    TmaCopy copy{block, d, std::vector<unsigned char>(box_bytes, 0), static_cast<unsigned char*>(bar)};
    const unsigned row_bytes = m.box_width * m.element_bytes;
    // Each element's bounds are checked; the profile's counters see the copy
    // as the copy engine reads it, a request per row of the box in the tensor.
    WarpAccesses& warp = warp_of(current_);
    const size_t loads_before = warp.loads.size();
    const unsigned long long seq_before = current_->load_seq;
    std::vector<LaneAccess> rows;
    for (unsigned j = 0; j < m.box_height; ++j) {
      const long long gy = (long long)y + j;
      unsigned in_row = 0;
      const unsigned char* first = nullptr;
      for (unsigned i = 0; i < m.box_width; ++i) {
        const long long gx = (long long)x + i;
        const unsigned at = swizzled(address + j * row_bytes + i * m.element_bytes, m.swizzle) - address;
        if (!plane_in || gx < 0 || gy < 0 || (unsigned long long)gx >= m.width || (unsigned long long)gy >= m.height)
          continue;
        const unsigned char* src = m.base + (unsigned long long)z * m.plane_stride + gy * m.row_stride + gx * m.element_bytes;
        if (!check_access(src, 0, m.element_bytes, false)) return;
        std::memcpy(copy.image.data() + at, src, m.element_bytes);
        if (first == nullptr) first = src;
        in_row += m.element_bytes;
      }
      if (first != nullptr) rows.push_back({0, uintptr_t(first - arena_), in_row, lane_of(current_)});
    }
    warp.loads.resize(loads_before);
    current_->load_seq = seq_before;
    for (LaneAccess& row : rows) {
      row.seq = current_->load_seq++;
      warp.loads.push_back(row);
    }
    std::memset(d, 0xFF, box_bytes);  // poison until it lands
    tma_in_flight_.push_back(std::move(copy));
  }

  // ---- wgmma ----

  // A from shared memory (desc_a), or where `a_registers` is given from the
  // warpgroup's registers: each warp its 16 rows, thread (g, c) of a warp
  // holding 4 registers of two 16-bit values (the first in the low half):
  // rows g and g + 8 at k 2c and 2c + 1, then at k 2c + 8 and 2c + 9 (the
  // layout of mma.sync's A fragment), gathered here from the quad that
  // holds a row.
  void wgmma(float* d, int n, const unsigned* a_registers, unsigned long long desc_a, unsigned long long desc_b,
             bool scale_d, bool bf16, bool trans_b) {
    Fiber* self = current_;
    // The project's rule, stricter than PTX's: each batch of wgmmas (a
    // commit group) starts with a wgmma.fence. PTX asks for one wherever
    // other instructions touched the registers a wgmma reads or writes (its
    // accumulators, a register-A fragment), which a loop's next batch nearly
    // always does; ptxas injects one where the source left it out (C7519),
    // so this keeps the source saying what runs. (A register-A fragment's
    // variables may change before the wait: ptxas keeps the registers the
    // wgmma reads live until then, which no source-level check can see.)
    if (!self->wgmma_fenced) {
      fail("kernel %s: a wgmma of thread %u with no wgmma.fence before it since the thread's last "
           "wgmma.commit_group (cg_wgmma_fence() first: the registers it reads or writes were touched by other "
           "instructions)",
           kernel_, unsigned(local_index(self)));
      return;
    }
    float a[2][16];
    if (a_registers != nullptr) {
      const unsigned lane_in_warp = unsigned(local_index(self)) % 32;
      for (int from = 0; from < 4; ++from)
        for (int pair = 0; pair < 2; ++pair) {
          const uint64_t packed = warp_exchange(uint64_t(a_registers[2 * pair]) | uint64_t(a_registers[2 * pair + 1]) << 32,
                                                int(lane_in_warp & ~3u) + from);
          for (int r = 0; r < 2; ++r)  // register 2 pair + r: row g + 8 r, k 8 pair + 2 from (+ 1)
            for (int e = 0; e < 2; ++e) {
              const unsigned short bits = (unsigned short)(packed >> (32 * r + 16 * e));
              a[r][8 * pair + 2 * from + e] = bf16 ? bf16_value(bits) : f16_value(bits);
            }
        }
      desc_a = 0;
    }
    if (n < 8 || n > 256 || n % 8 != 0) {
      fail("kernel %s: wgmma m64n%dk16 (n from 8 to 256, a multiple of 8)", kernel_, n);
      return;
    }
    if (threads_ % 128 != 0) {
      fail("kernel %s: wgmma in a block of %u threads, not whole warpgroups of 128", kernel_, threads_);
      return;
    }
    const unsigned t = unsigned(local_index(self)) % 128, warp = t / 32, lane = t % 32;
    // The warpgroup's threads issue the same wgmma, or it diverges.
    std::vector<WgmmaIssue>& issued = wgmma_issued_[self->block * (threads_ / 128) + unsigned(local_index(self)) / 128];
    const WgmmaIssue mine{desc_a, desc_b, n, scale_d, bf16, trans_b, unsigned(local_index(self))};
    if (self->wgmmas_issued < issued.size() && !issued[self->wgmmas_issued].same(mine)) {
      const WgmmaIssue& first = issued[self->wgmmas_issued];
      fail("kernel %s: wgmma %zu of warpgroup %u diverges: thread %u issued it as m64n%dk16 with descriptors %#llx and "
           "%#llx, scale-d %d, thread %u as m64n%dk16 with %#llx and %#llx, scale-d %d (wgmma is .sync.aligned: every "
           "thread of the warpgroup issues the same one)",
           kernel_, self->wgmmas_issued, unsigned(local_index(self)) / 128, first.thread, first.n, first.desc_a,
           first.desc_b, int(first.scale_d), mine.thread, n, desc_a, desc_b, int(scale_d));
      return;
    }
    if (self->wgmmas_issued == issued.size()) issued.push_back(mine);
    ++self->wgmmas_issued;
    // A wgmma on accumulators an earlier one still has in flight chains on
    // its values, as the tensor core does.
    const PendingWgmma* pending = nullptr;
    for (const PendingWgmma& w : self->wgmmas)
      if (w.d == d) pending = &w;
    std::vector<float> values(size_t(n) / 2);
    for (int i = 0; i < n / 2; ++i) values[size_t(i)] = pending != nullptr ? pending->values[size_t(i)] : d[i];
    // The shared bytes each operand reads (A's 64 rows, B's n, 16 k each):
    // no copy may be landing there, and none may start before a wait covers
    // this wgmma.
    const unsigned long long descs[2] = {desc_a, desc_b};
    std::vector<std::pair<const unsigned char*, const unsigned char*>> reads;
    for (int o = a_registers != nullptr ? 1 : 0; o < 2; ++o) {
      const int rows = o == 0 ? 64 : n;
      const unsigned char* lo = nullptr;
      const unsigned char* hi = nullptr;
      // K-major: a 16-byte chunk holds 8 k of one row; MN-major: each element.
      const bool mn_major = o == 1 && trans_b;
      const int step = mn_major ? 1 : 8, width = mn_major ? 2 : 16;
      for (int r = 0; r < rows; ++r)
        for (int k = 0; k < 16; k += step) {
          const unsigned char* p = shared_pointer(descriptor_address(descs[o], r, k, mn_major));
          if (!in_shared(p, unsigned(width), o == 0 ? "a wgmma's read (A) of" : "a wgmma's read (B) of")) return;
          lo = lo == nullptr || p < lo ? p : lo;
          hi = hi == nullptr || p + width > hi ? p + width : hi;
        }
      if (const char* what = busy(self->block, lo, hi, /*wgmma_reads=*/false)) {
        fail("kernel %s: a wgmma of thread %u reads its %s from shared memory (addresses %u to %u) that %s", kernel_,
             unsigned(local_index(self)), o == 0 ? "A" : "B", shared_address(lo), shared_address(hi), what);
        return;
      }
      reads.emplace_back(lo, hi);
    }
    // This thread's two rows of A and n / 4 columns of B, then its products.
    auto element = [&](unsigned long long desc, int row, int k, bool mn_major) {
      unsigned short bits;
      std::memcpy(&bits, shared_pointer(descriptor_address(desc, row, k, mn_major)), 2);
      return bf16 ? bf16_value(bits) : f16_value(bits);
    };
    std::vector<float> b(size_t(n) / 4 * 16);
    if (a_registers == nullptr)
      for (int h = 0; h < 2; ++h)
        for (int k = 0; k < 16; ++k) a[h][k] = element(desc_a, int(16 * warp + lane / 4 + 8 * h), k, false);
    for (int c = 0; c < n / 4; ++c)
      for (int k = 0; k < 16; ++k)
        b[size_t(c) * 16 + size_t(k)] = element(desc_b, 8 * (c / 2) + int(2 * (lane % 4)) + c % 2, k, trans_b);
    for (int i = 0; i < n / 2; ++i) {
      // Register i: row 16 warp + lane / 4 (+ 8 for bit 1 of i), column 8 (i / 4) + 2 (lane % 4) + (i % 2).
      const float* row = a[(i >> 1) & 1];
      const float* col = b.data() + size_t(2 * (i >> 2) + (i & 1)) * 16;
      float acc = scale_d ? values[size_t(i)] : 0.0f;
      for (int k = 0; k < 16; ++k) acc += row[k] * col[k];
      values[size_t(i)] = acc;
    }
    if (!error_.empty()) return;
    self->wgmmas.push_back(PendingWgmma{d, std::move(values), -1, std::move(reads)});
    for (int i = 0; i < n / 2; ++i) d[i] = std::nanf("");  // poison until a wait covers it
  }

  void wgmma_fence() { current_->wgmma_fenced = true; }

  void wgmma_commit() {
    Fiber* self = current_;
    self->wgmma_fenced = false;
    for (PendingWgmma& w : self->wgmmas)
      if (w.group < 0) w.group = self->next_wgmma_group;
    ++self->next_wgmma_group;
  }

  void wgmma_wait(int most_in_flight) {
    Fiber* self = current_;
    const long long complete_below = self->next_wgmma_group - most_in_flight;
    auto done = [&](const PendingWgmma& w) { return w.group >= 0 && w.group < complete_below; };
    // In issue order: the last completed wgmma on a set of accumulators
    // leaves its values; one still in flight on them keeps them poisoned.
    for (PendingWgmma& w : self->wgmmas)
      if (done(w)) std::copy(w.values.begin(), w.values.end(), w.d);
    std::erase_if(self->wgmmas, done);
    for (PendingWgmma& w : self->wgmmas) std::fill(w.d, w.d + w.values.size(), std::nanf(""));
  }

  bool check_vector_access(const void* p, unsigned bytes, bool write) {
    // Arena offsets: a GPU's arena starts on a 256-byte boundary.
    const uintptr_t offset = uintptr_t(static_cast<const unsigned char*>(p) - arena_);
    if (offset % bytes != 0) {
      const ThreadContext& c = current_->thread;
      fail("kernel %s: a %u-byte vector %s at arena offset %llu, not a multiple of %u (a GPU faults), by thread (%u, "
           "%u, %u) of block (%u, %u, %u)",
           kernel_, bytes, write ? "store" : "load", (unsigned long long)offset, bytes, c.thread_idx.x, c.thread_idx.y,
           c.thread_idx.z, c.block_idx.x, c.block_idx.y, c.block_idx.z);
      return false;
    }
    return check_access(p, 0, bytes, write);
  }

  bool check_access(const void* base, long long index, unsigned long long elem, bool write) {
    const unsigned char* p = static_cast<const unsigned char*>(base);
    // Where buffers share storage (memory reuse), the pointer may lie in
    // several tensors: the access is fine if it lies in one of them.
    const cudagen_tensor_info* first = nullptr;
    long long first_byte = 0;
    for (int i = 0; i < tensor_count_; ++i) {
      const cudagen_tensor_info& t = tensors_[i];
      const unsigned char* start = arena_ + t.offset;
      if (p < start || p >= start + t.bytes) continue;
      long long byte = (long long)(p - start) + index * (long long)elem;
      if (index < 0 || byte < 0 || (unsigned long long)byte + elem > t.bytes) {
        if (first == nullptr) {
          first = &t;
          first_byte = byte;
        }
        continue;
      }
      (write ? stats_.back().bytes_written : stats_.back().bytes_read) += elem;
      if (current_ != nullptr) {
        WarpAccesses& w = warp_of(current_);
        (write ? w.stores : w.loads)
            .push_back({(write ? current_->store_seq : current_->load_seq)++,
                        uintptr_t(p + index * (long long)elem - arena_), unsigned(elem), lane_of(current_)});
      }
      return true;
    }
    if (first != nullptr) {
      const ThreadContext& c = current_->thread;
      fail("kernel %s: out-of-bounds %s of tensor '%s' (buffer %s): element %lld of %llu, by thread (%u, %u, %u) of "
           "block (%u, %u, %u)",
           kernel_, write ? "store" : "load", first->slot, first->buffer, first_byte / (long long)elem,
           first->bytes / elem, c.thread_idx.x, c.thread_idx.y, c.thread_idx.z, c.block_idx.x, c.block_idx.y,
           c.block_idx.z);
      return false;
    }
    fail("kernel %s: %s through a pointer that lies in none of the kernel's tensors", kernel_, write ? "store" : "load");
    return false;
  }

 private:
  // ---- Hopper helpers ----

  Mbarrier* find_mbarrier(void* bar, const char* what) {
    unsigned char* p = static_cast<unsigned char*>(bar);
    if (!in_shared(p, 8, what)) return nullptr;
    auto it = mbarriers_.find(p);
    if (it != mbarriers_.end()) return &it->second;
    const ThreadContext& c = current_->thread;
    fail("kernel %s: %s the mbarrier at shared address %u before its mbarrier.init, by thread (%u, %u, %u) of block "
         "(%u, %u, %u)",
         kernel_, what, shared_address(p), c.thread_idx.x, c.thread_idx.y, c.thread_idx.z, c.block_idx.x,
         c.block_idx.y, c.block_idx.z);
    return nullptr;
  }

  // Completes the phase once its arrivals and bytes have all come; more
  // bytes than it expected (an expect_tx too small) is an error, as the
  // surplus would complete the next phase before its own copies land.
  void complete_phase(Mbarrier& b, const unsigned char* bar) {
    if (b.pending == 0 && b.tx < 0) {
      fail("kernel %s: the mbarrier at shared address %u received %lld transaction bytes more than its phase "
           "expected (an expect_tx smaller than the copies it covers)",
           kernel_, unsigned(bar - smem_.data() - smem_offset_) % unsigned(smem_stride_) + kSharedWindowBase, -b.tx);
      return;
    }
    if (b.pending != 0 || b.tx != 0) return;
    ++b.phase;
    b.pending = b.expected;
  }

  // The shared address of element (mn, k) of a wgmma operand of 16-bit
  // elements (mn: A's row or B's column), in the PTX ISA's canonical layouts
  // (T = 8 elements, 16 bytes; S the swizzle span in bytes):
  //   K-major, no swizzle   ((8, m), (T, 2k)) : ((T, SBO), (1, LBO))
  //   K-major, swizzled     ((8, m), (T, 2k)) : ((S / 2, SBO), (1, T))
  //   MN-major, no swizzle  ((T, 1, m), (8, k)) : ((1, T, SBO), (T, LBO))
  //   MN-major, swizzled    ((T, S / 16, m), (8, k)) : ((1, T, LBO), (S / 2, SBO))
  // in elements, LBO and SBO in bytes; then, swizzled, the address's 16-byte
  // chunk XORed with bits 7 and up (CuTe's Swizzle<log2(S / 16), 4, 3>, the
  // pattern TMA writes).
  static unsigned descriptor_address(unsigned long long desc, int mn, int k, bool mn_major) {
    const unsigned start = unsigned(desc & 0x3fff) << 4, lbo = unsigned((desc >> 16) & 0x3fff) << 4,
                   sbo = unsigned((desc >> 32) & 0x3fff) << 4;
    const unsigned mode = unsigned(desc >> 62), m = unsigned(mn), kk = unsigned(k);
    const unsigned span = mode == 1 ? 128 : mode == 2 ? 64 : mode == 3 ? 32 : 0;
    if (!mn_major) {
      if (span == 0) return start + m / 8 * sbo + m % 8 * 16 + kk / 8 * lbo + kk % 8 * 2;
      return swizzled(start + m / 8 * sbo + m % 8 * span + kk * 2, span);
    }
    if (span == 0) return start + m / 8 * sbo + m % 8 * 2 + kk / 8 * lbo + kk % 8 * 16;
    const unsigned row = span / 2;  // elements of mn in a span-wide row
    return swizzled(start + m / row * lbo + m % row * 2 + kk / 8 * sbo + kk % 8 * span, span);
  }

  // An address under a `span`-byte swizzle (0: none): its 16-byte chunk
  // within the span XORed with the span-row index (bits 7 and up) mod the
  // chunks a span holds.
  static unsigned swizzled(unsigned address, unsigned span) {
    if (span == 0) return address;
    const unsigned chunks = span / 16;
    return address ^ (((address >> 7) & (chunks - 1)) << 4);
  }

  static float bf16_value(unsigned short bits) {
    const unsigned u = unsigned(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static float f16_value(unsigned short bits) {
    const int exponent = (bits >> 10) & 0x1f, mantissa = bits & 0x3ff;
    const float sign = bits & 0x8000 ? -1.0f : 1.0f;
    if (exponent == 0) return sign * std::ldexp(float(mantissa), -24);
    if (exponent == 31) return mantissa != 0 ? std::nanf("") : sign * INFINITY;
    return sign * std::ldexp(float(mantissa | 0x400), exponent - 25);
  }

  // Why [lo, hi) of block `block`'s shared memory may not be touched now:
  // a TMA copy lands there, or (wgmma_reads) an in-flight wgmma reads it.
  const char* busy(unsigned block, const unsigned char* lo, const unsigned char* hi, bool wgmma_reads = true) {
    for (const TmaCopy& copy : tma_in_flight_)
      if (copy.block == block && lo < copy.dst + copy.image.size() && copy.dst < hi) {
        busy_why_ = "a TMA copy has not landed in yet (wait on its mbarrier first)";
        return busy_why_.c_str();
      }
    if (!wgmma_reads) return nullptr;
    for (unsigned i = 0; i < threads_; ++i) {
      const Fiber& f = fibers_[size_t(block) * threads_ + i];
      for (const PendingWgmma& w : f.wgmmas)
        for (const auto& [first, last] : w.reads)
          if (lo < last && first < hi) {
            busy_why_ = "a wgmma of thread " + std::to_string(i) +
                        " still reads (the stage is reused before a wgmma.wait_group covers that wgmma)";
            return busy_why_.c_str();
          }
    }
    return nullptr;
  }

  // Lands TMA copies in flight: each with probability 1/2 (seeded), or all.
  bool land_tma(bool all) {
    bool landed = false;
    for (size_t i = 0; i < tma_in_flight_.size();) {
      TmaCopy& copy = tma_in_flight_[i];
      if (!all && async_rng_() % 2 != 0) {
        ++i;
        continue;
      }
      std::memcpy(copy.dst, copy.image.data(), copy.image.size());
      Mbarrier& b = mbarriers_.at(copy.bar);
      b.tx -= (long long)copy.image.size();
      complete_phase(b, copy.bar);
      tma_in_flight_.erase(tma_in_flight_.begin() + (long)i);
      landed = true;
    }
    return landed;
  }

  // Each mbarrier a thread waits on (the first waiter, how many wait) and
  // its state: the report of a kernel no thread of which can go on.
  std::string mbarrier_waiters() {
    std::string out;
    std::vector<const unsigned char*> seen;
    for (unsigned i = 0; i < blocks_ * threads_; ++i) {
      const Fiber& f = fibers_[i];
      if (f.state != Fiber::State::AtMbarrier || std::count(seen.begin(), seen.end(), f.mbarrier) > 0) continue;
      seen.push_back(f.mbarrier);
      unsigned waiters = 0;
      for (unsigned j = 0; j < blocks_ * threads_; ++j)
        waiters += fibers_[j].state == Fiber::State::AtMbarrier && fibers_[j].mbarrier == f.mbarrier;
      const Mbarrier& b = mbarriers_.at(f.mbarrier);
      const uint3 idx = f.thread.block_idx;
      char buf[512];
      std::snprintf(buf, sizeof buf,
                    "%sthread %u of block (%u, %u, %u) (and %u more) waits on the mbarrier at shared address %u for "
                    "its phase of parity %u, which has %u of %u arrivals and %lld transaction bytes still to come",
                    out.empty() ? ": " : "; ", i % threads_, idx.x, idx.y, idx.z, waiters - 1,
                    unsigned(f.mbarrier - (smem_.data() + smem_offset_ + size_t(f.block) * smem_stride_)) +
                        kSharedWindowBase,
                    f.parity, b.pending, b.expected, b.tx);
      out += buf;
    }
    return out.empty() ? out : out + " (an expect_tx that no copy fills, an arrival missing, or a parity off by one)";
  }

  template <typename... Args>
  int fail(const char* format, Args... args) {
    if (!error_.empty()) return 1;  // keep the first
    char buf[1024];
    std::snprintf(buf, sizeof buf, format, args...);
    error_ = buf;
    return 1;
  }

  unsigned fiber_id(const Fiber* f) const { return unsigned(f - fibers_.data()) + 1; }
  unsigned local_id(unsigned id) const { return (id - 1) % threads_; }

  SharedByte& shadow_at(const unsigned char* p) {
    return shadow_[size_t(p - (smem_.data() + smem_offset_))];
  }

  // Whether [p, p + bytes) lies in the running block's dynamic shared memory.
  bool in_shared(const unsigned char* p, unsigned long long bytes, const char* what) {
    const unsigned char* base = dynamic_smem();
    if (p >= base && p + bytes <= base + smem_bytes_) return true;
    const ThreadContext& c = current_->thread;
    fail("kernel %s: %s shared memory at offset %lld (%llu bytes) outside the block's %llu bytes, by thread (%u, %u, "
         "%u) of block (%u, %u, %u)",
         kernel_, what, (long long)(p - base), bytes, smem_bytes_, c.thread_idx.x, c.thread_idx.y, c.thread_idx.z,
         c.block_idx.x, c.block_idx.y, c.block_idx.z);
    return false;
  }

  // A fiber's thread within its block (linear), its lane, its warp's accesses.
  size_t local_index(const Fiber* f) const { return size_t(f - fibers_.data()) - size_t(f->block) * threads_; }
  unsigned lane_of(const Fiber* f) const { return unsigned(local_index(f) % 32); }
  WarpAccesses& warp_of(const Fiber* f) { return warp_accesses_[size_t(f->block) * warps_ + local_index(f) / 32]; }

  // Counts a warp's requests since its last barrier into the kernel's stats,
  // then starts its lanes' counts of requests afresh (fibers [first, end)):
  // lanes that diverged before the barrier (a store only lane 0 of a quad
  // makes) issue their next requests together again, as the GPU does.
  void flush(WarpAccesses& w, Fiber* first, Fiber* end) {
    flush(w);
    for (Fiber* f = first; f != end; ++f) f->load_seq = f->store_seq = f->shared_seq = 0;
  }
  void flush(WarpAccesses& w) {
    unsigned long long* c = stats_.back().counters;
    auto count_global = [](std::vector<LaneAccess>& accesses, unsigned long long* counters) {
      std::sort(accesses.begin(), accesses.end());
      for (size_t i = 0; i < accesses.size();) {
        size_t j = i;
        uintptr_t covered = 0;      // bytes below this are counted
        uintptr_t next_sector = 0;  // sectors below this are counted (accesses come by address)
        unsigned long long sectors = 0, bytes = 0;
        for (; j < accesses.size() && accesses[j].seq == accesses[i].seq; ++j) {
          const LaneAccess& a = accesses[j];
          const uintptr_t from = std::max(a.address, covered), to = a.address + a.bytes;
          if (to > from) bytes += to - from;
          covered = std::max(covered, to);
          const uintptr_t first = std::max<uintptr_t>(a.address / 32, next_sector), last = (a.address + a.bytes - 1) / 32;
          if (last >= first) {
            sectors += last - first + 1;
            next_sector = last + 1;
          }
        }
        counters[0] += 1;
        counters[1] += sectors;
        counters[2] += (bytes + 31) / 32;
        i = j;
      }
      accesses.clear();
    };
    count_global(w.loads, c);
    count_global(w.stores, c + 3);
    // Shared memory serves a warp's request in phases: all 32 lanes for 4-byte
    // accesses, 16 for 8-byte ones, 8 for 16-byte ones (an ldmatrix's 8 x 8
    // matrix is one); in each, a bank gives one 4-byte word per wavefront.
    std::sort(w.shared.begin(), w.shared.end(), [](const LaneAccess& x, const LaneAccess& y) {
      return x.seq != y.seq ? x.seq < y.seq : x.lane < y.lane;
    });
    std::vector<uintptr_t> words;
    for (size_t i = 0; i < w.shared.size();) {
      size_t j = i;
      for (; j < w.shared.size() && w.shared[j].seq == w.shared[i].seq; ++j) {
      }
      const unsigned per_phase = w.shared[i].bytes >= 16 ? 8 : w.shared[i].bytes >= 8 ? 16 : 32;
      for (size_t k = i; k < j;) {
        const unsigned phase = w.shared[k].lane / per_phase;
        words.clear();
        for (; k < j && w.shared[k].lane / per_phase == phase; ++k)
          for (uintptr_t word = w.shared[k].address / 4; word <= (w.shared[k].address + w.shared[k].bytes - 1) / 4; ++word)
            words.push_back(word);
        std::sort(words.begin(), words.end());
        words.erase(std::unique(words.begin(), words.end()), words.end());
        unsigned per_bank[32] = {};
        unsigned wavefronts = 0;
        for (uintptr_t word : words) wavefronts = std::max(wavefronts, ++per_bank[word % 32]);
        c[7] += wavefronts;
        c[8] += (words.size() + 31) / 32;
      }
      c[6] += 1;
      i = j;
    }
    w.shared.clear();
  }

  static void land(AsyncCopy& copy) {
    if (copy.landed) return;
    std::memcpy(copy.dst, copy.data, 16);
    copy.landed = true;
  }

  // The adversary: at each cp.async call, a thread's committed groups land
  // early, oldest first, each with probability 1/4 (seeded), so a kernel may
  // see a copy any time from its issue to its wait, as on a GPU.
  void land_some(Fiber* self) {
    if (self->copies.empty()) return;
    long long group = self->copies.front().group;
    while (group >= 0 && async_rng_() % 4 == 0) {
      for (AsyncCopy& copy : self->copies)
        if (copy.group == group) land(copy);
      ++group;
      if (group >= self->next_group) break;
    }
  }

  void ensure_stacks(unsigned threads) {
    while (stacks_.size() < threads) {
      void* s = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (s == MAP_FAILED) throw std::bad_alloc();
      mprotect(s, kGuardBytes, PROT_NONE);  // a stack overflow faults instead of corrupting a neighbour
      stacks_.push_back(s);
    }
    if (fibers_.size() < threads) fibers_.resize(threads);
  }

  void trim_stacks(size_t keep) {
    while (stacks_.size() > keep) {
      munmap(stacks_.back(), kStackBytes);
      stacks_.pop_back();
    }
  }

  static void fiber_entry(fctx::transfer_t t) {
    Emulator* self = static_cast<Emulator*>(t.data);
    self->scheduler_ = t.fctx;
    self->body_(self->closure_);
    if (!self->current_->copies.empty()) {
      const ThreadContext& c = self->current_->thread;
      self->fail("kernel %s: thread (%u, %u, %u) of block (%u, %u, %u) ends with %zu cp.async never waited for "
                 "(a missing cp.async.wait_group, or a cp.async.commit_group missing before it)",
                 self->kernel_, c.thread_idx.x, c.thread_idx.y, c.thread_idx.z, c.block_idx.x, c.block_idx.y,
                 c.block_idx.z, self->current_->copies.size());
    }
    if (!self->current_->wgmmas.empty()) {
      const ThreadContext& c = self->current_->thread;
      self->fail("kernel %s: thread (%u, %u, %u) of block (%u, %u, %u) ends with %zu wgmma never waited for (a "
                 "missing wgmma.wait_group, or a wgmma.commit_group missing before it)",
                 self->kernel_, c.thread_idx.x, c.thread_idx.y, c.thread_idx.z, c.block_idx.x, c.block_idx.y,
                 c.block_idx.z, self->current_->wgmmas.size());
    }
    self->current_->state = Fiber::State::Done;
    fctx::jump_fcontext(self->scheduler_, nullptr);  // never resumed
  }

  // Suspends the running fiber until the scheduler releases `barrier`.
  void wait(Fiber::State barrier) {
    current_->state = barrier;
    fctx::transfer_t t = fctx::jump_fcontext(scheduler_, nullptr);
    scheduler_ = t.fctx;
  }

  // Runs `batch` blocks together: one at a time for a normal launch, all of
  // them for a persistent one.
  void run_blocks(const std::vector<uint3>& batch, dim3 grid, dim3 block, unsigned threads) {
    std::fill(smem_.begin(), smem_.end(), 0xFF);  // poison: unwritten floats read as NaN
    mbarriers_.clear();
    tma_in_flight_.clear();
    wgmma_issued_.assign(size_t(threads % 128 == 0 ? threads / 128 : 0) * batch.size(), {});
    shadow_.assign(smem_stride_ * batch.size(), SharedByte{});
    epochs_.assign(batch.size(), 0);
    warps_ = (threads + 31) / 32;
    warp_accesses_.assign(size_t(warps_) * batch.size(), WarpAccesses{});
    threads_ = threads;
    blocks_ = unsigned(batch.size());
    const unsigned total = blocks_ * threads;
    for (unsigned i = 0; i < total; ++i) {
      Fiber& f = fibers_[i];
      const unsigned local = i % threads;
      f = Fiber{};
      f.block = i / threads;
      f.thread.thread_idx = uint3{local % block.x, (local / block.x) % block.y, local / (block.x * block.y)};
      f.thread.block_idx = batch[f.block];
      f.thread.block_dim = block;
      f.thread.grid_dim = grid;
      f.ctx = fctx::make_fcontext(static_cast<char*>(stacks_[i]) + kStackBytes, kStackBytes - kGuardBytes, fiber_entry);
    }
    for (;;) {
      for (unsigned i = 0; i < total; ++i) {
        if (fibers_[i].state != Fiber::State::Ready) continue;
        current_ = &fibers_[i];
        fctx::transfer_t t = fctx::jump_fcontext(fibers_[i].ctx, this);
        fibers_[i].ctx = t.fctx;
      }
      bool done = false;
      bool progress = release(done);
      if (done) {
        for (WarpAccesses& w : warp_accesses_) flush(w);
        check_wgmma_counts();
        if (!tma_in_flight_.empty())
          fail("kernel %s: a block ends with %zu TMA copies in flight (no thread waited on their mbarrier)", kernel_,
               tma_in_flight_.size());
        return;
      }
      if (!error_.empty()) return;
      // TMA copies land at seeded points; all of them before anything is
      // declared stuck.
      if (land_tma(/*all=*/!progress)) progress = true;
      if (!progress && !time_out_one_wait()) {
        fail("kernel %s: no thread can go on: every block waits at a barrier or for an event that nothing will "
             "trigger%s",
             kernel_, mbarrier_waiters().c_str());
        return abandon();
      }
    }
  }

  // Every thread of a warpgroup issued as many wgmma as the warpgroup's
  // first to issue each: one that skipped some ran a wgmma under divergent
  // control flow (the GPU's behaviour is undefined there: it may hang).
  void check_wgmma_counts() {
    if (threads_ % 128 != 0) return;  // no warpgroups: a wgmma there fails when issued
    for (unsigned i = 0; i < blocks_ * threads_ && error_.empty(); ++i) {
      const Fiber& f = fibers_[i];
      const unsigned local = i % threads_;
      const std::vector<WgmmaIssue>& issued = wgmma_issued_[f.block * (threads_ / 128) + local / 128];
      if (f.wgmmas_issued != issued.size())
        fail("kernel %s: thread %u of block (%u, %u, %u) issued %zu wgmma, its warpgroup's thread %u %zu (a wgmma "
             "under divergent control flow: wgmma is .sync.aligned, every thread of the warpgroup issues each)",
             kernel_, local, f.thread.block_idx.x, f.thread.block_idx.y, f.thread.block_idx.z, f.wgmmas_issued,
             issued.empty() ? local : issued.back().thread, issued.size());
    }
  }

  // After every ready fiber has run until it blocked or finished: release
  // the barriers whose participants have all arrived, and the waits whose
  // event has come. Returns whether any fiber can run again; `done` when
  // every fiber has finished.
  bool release(bool& done) {
    bool progress = false;
    done = true;
    for (unsigned b = 0; b < blocks_; ++b) {
      Fiber* f = fibers_.data() + size_t(b) * threads_;
      bool warp_released = false;
      for (unsigned w = 0; w < threads_; w += 32) {
        const unsigned end = std::min(threads_, w + 32);
        bool any_waiting = false, all_waiting = true;
        for (unsigned i = w; i < end; ++i) {
          Fiber::State s = f[i].state;
          if (s == Fiber::State::AtWarpBarrier) any_waiting = true;
          else if (s != Fiber::State::Done) all_waiting = false;
        }
        if (any_waiting && all_waiting) {
          for (unsigned i = w; i < end; ++i)
            if (f[i].state == Fiber::State::AtWarpBarrier) f[i].state = Fiber::State::Ready;
          flush(warp_accesses_[size_t(b) * warps_ + w / 32], f + w, f + end);
          warp_released = true;
        }
      }
      unsigned finished = 0, at_block = 0;
      int any_predicate = 0;
      for (unsigned i = 0; i < threads_; ++i) {
        finished += f[i].state == Fiber::State::Done;
        if (f[i].state == Fiber::State::AtBlockBarrier) {
          ++at_block;
          any_predicate |= f[i].predicate != 0;
        }
      }
      if (finished < threads_) done = false;
      if (warp_released) {
        progress = true;
      } else if (at_block == threads_) {
        for (unsigned i = 0; i < threads_; ++i) {
          f[i].state = Fiber::State::Ready;
          f[i].predicate = any_predicate;
        }
        ++epochs_[b];
        for (unsigned w = 0; w < warps_; ++w)
          flush(warp_accesses_[size_t(b) * warps_ + w], f + 32 * w, f + std::min(threads_, 32 * w + 32));
        progress = true;
      } else if (finished > 0 && at_block > 0 && at_block + finished == threads_) {
        const uint3 idx = f[0].thread.block_idx;
        fail("kernel %s: block (%u, %u, %u) is stuck: %u of %u threads finished while the others wait at a barrier "
             "(__syncthreads or a warp shuffle) that the finished ones never reached",
             kernel_, idx.x, idx.y, idx.z, finished, threads_);
        abandon();
        return false;
      }
    }
    for (unsigned i = 0; i < blocks_ * threads_; ++i) {
      Fiber& f = fibers_[i];
      if (f.state == Fiber::State::AtMbarrier && (mbarriers_.at(f.mbarrier).phase & 1u) != f.parity) {
        f.state = Fiber::State::Ready;
        progress = true;
      }
      if (f.state != Fiber::State::Spinning) continue;
      if (*f.counter >= f.target || *f.stopped != 0) {
        f.arrived = *f.counter >= f.target;
        f.state = Fiber::State::Ready;
        progress = true;
      }
    }
    return progress;
  }

  // Nothing can move: the first waiting fiber's wait ends without its event,
  // as a GPU's watchdog would end it after its time bound, and reports.
  bool time_out_one_wait() {
    for (unsigned i = 0; i < blocks_ * threads_; ++i)
      if (fibers_[i].state == Fiber::State::Spinning) {
        fibers_[i].arrived = false;
        fibers_[i].state = Fiber::State::Ready;
        return true;
      }
    return false;
  }

  // Fibers stuck at a barrier are never resumed; their stacks are reused by
  // the next block. Nothing on them needs destruction (kernels hold PODs).
  void abandon() {
    for (unsigned i = 0; i < blocks_ * threads_; ++i) fibers_[i].state = Fiber::State::Done;
  }

  uint64_t seed_ = 1;
  std::vector<void*> stacks_;
  std::vector<Fiber> fibers_;
  std::vector<unsigned char> smem_;
  size_t smem_stride_ = 0;  // bytes of shared memory per block, a multiple of 128
  size_t smem_offset_ = 0;  // where the first block's starts in smem_: 16 bytes past a 128-byte boundary
  unsigned long long smem_bytes_ = 0;  // what the launch asked for, per block
  std::vector<SharedByte> shadow_;     // per byte of shared memory, from the first block's start
  std::vector<unsigned> epochs_;       // per block running: its __syncthreads so far
  std::mt19937_64 async_rng_;          // when cp.async copies land
  std::map<const unsigned char*, Mbarrier> mbarriers_;  // of the blocks running, by address
  std::vector<TmaCopy> tma_in_flight_;                  // of the blocks running, in issue order
  std::vector<std::vector<WgmmaIssue>> wgmma_issued_;   // of each warpgroup of the blocks running, in issue order
  std::string busy_why_;                                // busy()'s answer
  unsigned warps_ = 0;                 // per block
  std::vector<WarpAccesses> warp_accesses_;  // per warp of the blocks running
  unsigned threads_ = 0;    // per block
  unsigned blocks_ = 0;     // running together
  Fiber* current_ = nullptr;
  fctx::fcontext_t scheduler_ = nullptr;
  const char* kernel_ = "";
  const cudagen_tensor_info* tensors_ = nullptr;
  int tensor_count_ = 0;
  unsigned char* arena_ = nullptr;
  void (*body_)(void*) = nullptr;
  void* closure_ = nullptr;
  std::string error_;
  std::vector<KernelStats> stats_;
};

// The emulator of this OS thread: emulated CUDA built-ins such as threadIdx
// are free functions, so they reach the running fiber through it.
Emulator& emulator() {
  thread_local std::unique_ptr<Emulator> instance = std::make_unique<Emulator>();
  return *instance;
}

}  // namespace

const ThreadContext& context() { return emulator().context(); }
void syncthreads() { emulator().syncthreads(); }
uint64_t warp_exchange(uint64_t value, int src_lane) { return emulator().warp_exchange(value, src_lane); }
unsigned char* dynamic_smem() { return emulator().dynamic_smem(); }
void cp_async(void* smem_dst, const void* global_src, int src_bytes) { emulator().cp_async(smem_dst, global_src, src_bytes); }
void cp_async_commit() { emulator().cp_async_commit(); }
void cp_async_wait(int most_in_flight) { emulator().cp_async_wait(most_in_flight); }
bool check_shared_read(const void* smem, unsigned long long bytes) { return emulator().check_shared_read(smem, bytes); }
void note_shared_request(const void* smem, unsigned bytes) { emulator().note_shared_request(smem, bytes); }
bool check_vector_access(const void* p, unsigned bytes, bool write) {
  return emulator().check_vector_access(p, bytes, write);
}
bool check_access(const void* base, long long index, unsigned long long elem_bytes, bool write) {
  return emulator().check_access(base, index, elem_bytes, write);
}
int syncthreads_or(int predicate) { return emulator().syncthreads_or(predicate); }
bool wait_at_least(const unsigned long long* counter, unsigned long long target, const unsigned int* stopped) {
  return emulator().wait_at_least(counter, target, stopped);
}
unsigned shared_address(const void* smem) { return emulator().shared_address(smem); }
unsigned char* shared_pointer(unsigned address) { return emulator().shared_pointer(address); }
void mbarrier_init(void* bar, unsigned arrivals) { emulator().mbarrier_init(bar, arrivals); }
void mbarrier_expect_tx(void* bar, unsigned bytes) { emulator().mbarrier_expect_tx(bar, bytes); }
void mbarrier_arrive(void* bar) { emulator().mbarrier_arrive(bar); }
void mbarrier_wait(void* bar, unsigned parity) { emulator().mbarrier_wait(bar, parity); }
void tma_load_2d(void* dst, const void* map, int x, int y, void* bar) { emulator().tma_load(dst, map, x, y, 0, 2, bar); }
void tma_load_3d(void* dst, const void* map, int x, int y, int z, void* bar) {
  emulator().tma_load(dst, map, x, y, z, 3, bar);
}
void wgmma(float* d, int n, unsigned long long desc_a, unsigned long long desc_b, bool scale_d, bool bf16,
           bool trans_b) {
  emulator().wgmma(d, n, nullptr, desc_a, desc_b, scale_d, bf16, trans_b);
}
void wgmma_rs(float* d, int n, const unsigned a[4], unsigned long long desc_b, bool scale_d, bool bf16, bool trans_b) {
  emulator().wgmma(d, n, a, 0, desc_b, scale_d, bf16, trans_b);
}
void wgmma_fence() { emulator().wgmma_fence(); }
void wgmma_commit() { emulator().wgmma_commit(); }
void wgmma_wait(int most_in_flight) { emulator().wgmma_wait(most_in_flight); }

int tensor_map_2d(void* map, const void* base, unsigned element_bytes, unsigned long long width,
                  unsigned long long height, unsigned long long row_stride_bytes, unsigned box_width,
                  unsigned box_height, const char* kernel) {
  const char* why = encode_tensor_map_2d(map, base, element_bytes, width, height, row_stride_bytes, box_width,
                                         box_height, TensorSwizzle::span128);
  if (*why == 0) return 0;
  return emulator().refuse(std::string("kernel ") + kernel + ": its TMA tensor map (" + std::to_string(width) + " x " +
                           std::to_string(height) + " elements, a " + std::to_string(box_width) + " x " +
                           std::to_string(box_height) + " box) is one the driver refuses: " + why);
}

int tensor_map_3d(void* map, const void* base, unsigned element_bytes, unsigned long long width,
                  unsigned long long height, unsigned long long depth, unsigned long long row_stride_bytes,
                  unsigned long long plane_stride_bytes, unsigned box_width, unsigned box_height,
                  const char* kernel) {
  const char* why = encode_tensor_map_3d(map, base, element_bytes, width, height, depth, row_stride_bytes,
                                         plane_stride_bytes, box_width, box_height, TensorSwizzle::span128);
  if (*why == 0) return 0;
  return emulator().refuse(std::string("kernel ") + kernel + ": its TMA tensor map (" + std::to_string(width) + " x " +
                           std::to_string(height) + " x " + std::to_string(depth) + " elements, a " +
                           std::to_string(box_width) + " x " + std::to_string(box_height) +
                           " box) is one the driver refuses: " + why);
}

// The limits cuTensorMapEncodeTiled documents for a tiled map of rank 2 or
// 3 (a box one plane deep), and the map's shadow.
static const char* encode_tensor_map(void* map, unsigned rank, const void* base, unsigned element_bytes,
                                     unsigned long long width, unsigned long long height, unsigned long long depth,
                                     unsigned long long row_stride_bytes, unsigned long long plane_stride_bytes,
                                     unsigned box_width, unsigned box_height, TensorSwizzle swizzle) {
  const unsigned span = unsigned(swizzle), row_bytes = box_width * element_bytes;
  if (element_bytes != 1 && element_bytes != 2 && element_bytes != 4 && element_bytes != 8)
    return "an element of 1, 2, 4 or 8 bytes";
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0) return "the tensor's base is not 16-byte aligned";
  if (width == 0 || height == 0 || depth == 0 || width > (1ull << 32) || height > (1ull << 32) || depth > (1ull << 32))
    return "each dimension from 1 to 2^32 elements";
  if (row_stride_bytes % 16 != 0 || row_stride_bytes >= (1ull << 40))
    return "the row stride is not a multiple of 16 bytes below 2^40 (TMA cannot take this operand)";
  if (row_stride_bytes < width * element_bytes) return "the row stride is shorter than a row";
  if (rank == 3) {
    if (plane_stride_bytes % 16 != 0 || plane_stride_bytes >= (1ull << 40))
      return "the plane stride is not a multiple of 16 bytes below 2^40 (TMA cannot take this operand)";
    if (plane_stride_bytes < height * row_stride_bytes) return "the plane stride is shorter than a plane";
  }
  if (box_width == 0 || box_height == 0 || box_width > 256 || box_height > 256) return "box sides from 1 to 256 elements";
  if (row_bytes % 16 != 0) return "the box's rows are not whole 16 bytes";
  if (span != 0 && row_bytes > span) return "the box's rows are wider than the swizzle span";
  // The emulation lays out swizzled rows as wide as the span only.
  if (span != 0 && row_bytes != span) return "a swizzled box whose rows are narrower than the span (not emulated)";
  TensorMapShadow m{kTensorMapMagic, element_bytes, static_cast<const unsigned char*>(base), width, height,
                    row_stride_bytes, box_width, box_height, span, rank, depth, plane_stride_bytes};
  static_assert(sizeof(TensorMapShadow) <= 128, "a tensor map is 128 bytes");
  std::memset(map, 0, 128);
  std::memcpy(map, &m, sizeof m);
  return "";
}

const char* encode_tensor_map_2d(void* map, const void* base, unsigned element_bytes, unsigned long long width,
                                 unsigned long long height, unsigned long long row_stride_bytes, unsigned box_width,
                                 unsigned box_height, TensorSwizzle swizzle) {
  return encode_tensor_map(map, 2, base, element_bytes, width, height, 1, row_stride_bytes, 0, box_width, box_height,
                           swizzle);
}

const char* encode_tensor_map_3d(void* map, const void* base, unsigned element_bytes, unsigned long long width,
                                 unsigned long long height, unsigned long long depth,
                                 unsigned long long row_stride_bytes, unsigned long long plane_stride_bytes,
                                 unsigned box_width, unsigned box_height, TensorSwizzle swizzle) {
  return encode_tensor_map(map, 3, base, element_bytes, width, height, depth, row_stride_bytes, plane_stride_bytes,
                           box_width, box_height, swizzle);
}

int launch(const char* kernel, const cudagen_tensor_info* tensors, int tensor_count, unsigned char* arena, dim3 grid,
           dim3 block, unsigned long long smem_bytes, void (*body)(void*), void* closure) {
  return emulator().launch(kernel, tensors, tensor_count, arena, grid, block, smem_bytes, false, body, closure);
}
int launch_persistent(const char* kernel, const cudagen_tensor_info* tensors, int tensor_count, unsigned char* arena,
                      dim3 grid, dim3 block, unsigned long long smem_bytes, void (*body)(void*), void* closure) {
  return emulator().launch(kernel, tensors, tensor_count, arena, grid, block, smem_bytes, true, body, closure);
}

}  // namespace cudagen_emu

// The C interface the runtime uses after dlopen()ing an emulated module.
extern "C" {
void cudagen_emu_configure(unsigned long long seed) { cudagen_emu::emulator().configure(seed); }
const char* cudagen_emu_last_error() { return cudagen_emu::emulator().last_error().c_str(); }
int cudagen_emu_kernel_count() { return int(cudagen_emu::emulator().stats().size()); }
const char* cudagen_emu_kernel_stats(int i, unsigned long long* bytes_read, unsigned long long* bytes_written) {
  const auto& s = cudagen_emu::emulator().stats()[size_t(i)];
  *bytes_read = s.bytes_read;
  *bytes_written = s.bytes_written;
  return s.kernel.c_str();
}
double cudagen_emu_kernel_seconds(int i) { return cudagen_emu::emulator().stats()[size_t(i)].seconds; }
void cudagen_emu_kernel_counters(int i, unsigned long long counters[9]) {
  const auto& s = cudagen_emu::emulator().stats()[size_t(i)];
  for (int k = 0; k < 9; ++k) counters[k] = s.counters[k];
}
void cudagen_emu_kernel_grid(int i, unsigned grid[3]) {
  const auto& s = cudagen_emu::emulator().stats()[size_t(i)];
  for (int d = 0; d < 3; ++d) grid[d] = s.grid[d];
}
void cudagen_emu_clear_stats() { cudagen_emu::emulator().clear_stats(); }
void cudagen_emu_release() { cudagen_emu::emulator().release(); }
}
