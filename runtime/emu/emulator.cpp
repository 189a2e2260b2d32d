// The emulator's scheduler: blocks in a seeded shuffled order, the threads of
// a block as Boost.Context fibers that switch only at barriers.
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <cstdio>
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

struct Fiber {
  enum class State { Ready, AtBlockBarrier, AtWarpBarrier, Spinning, Done };
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
};

// One emulator per OS thread: it owns the fiber stacks (reused by every
// block), the shared memory, and the state of the launch in progress.
class Emulator {
 public:
  ~Emulator() {
    for (void* s : stacks_) munmap(s, kStackBytes);
  }

  void configure(uint64_t seed) { seed_ = seed; }
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
      const bool progress = release(done);
      if (done) {
        for (WarpAccesses& w : warp_accesses_) flush(w);
        return;
      }
      if (!error_.empty()) return;
      if (!progress && !time_out_one_wait()) {
        fail("kernel %s: no thread can go on: every block waits at a barrier or for an event that nothing will "
             "trigger",
             kernel_);
        return abandon();
      }
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
void cudagen_emu_clear_stats() { cudagen_emu::emulator().clear_stats(); }
void cudagen_emu_release() { cudagen_emu::emulator().release(); }
}
