// The megakernel's schedule (docs/architecture.md §10): each phase as tile tasks on a
// fixed number of persistent blocks, in an order decided here and written
// into the .cu as constant tables.
//
// Every kernel of a phase becomes tile tasks, one per block of its grid (a
// grid-stride kernel, whose body covers any grid, takes at most one tile per
// block of the megakernel). Kernel B depends on an earlier kernel A when
// their arena ranges overlap and one of them writes (read after write, and
// the write-after-read and write-after-write hazards that memory reuse
// creates), kept after transitive reduction. A tile of B waits until every
// tile of A is done, except by rows: where B waits for A alone, only reads
// rows that A writes, and both split those rows among their tiles
// (EmittedKernel::rows: a matmul's rows of output tiles, a row per block),
// A's event is one counter per chunk of rows (the larger of the two tiles'
// rows, when one divides the other) and B's tile waits for its chunk only,
// as Mirage's persistent kernel sets event granularity from the producer and
// consumer partitions. That is sound when whatever else B conflicts with is
// finished before any tile of A starts.
//
// Events are counters that only grow. Each task waits on at most one event
// and triggers at most one, as in Mirage's persistent kernel: every tile of A
// triggers A's event; a kernel with one dependence waits on it; a kernel with
// several gets one join task per dependence, each waiting on that kernel's
// event and triggering the dependent kernel's join event. At the n-th launch
// a task waits until its event has counted n times its triggers per launch,
// so nothing is reset between launches.
//
// The order is list scheduling along the critical path: among the kernels
// whose dependences are placed, the one with the longest estimated path to
// the phase's end goes next; each of its tasks goes to the block that is
// free first. Each block's list is in increasing estimated start time, and a
// task starts after everything it waits on has finished, so the schedule
// cannot deadlock. Deterministic: ties go to the lower index.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "graph.h"

namespace cudagen {

struct EmittedKernel;

struct MegakernelTask {
  int kernel = -1;       // an index into EmittedProgram::tile_kernels, or -1: a join task
  int64_t tile = 0;      // which tile of the kernel's grid (x fastest)
  int wait = -1;         // the event it waits on, or -1
  int64_t wait_count = 0;  // that event's triggers per launch
  int trigger = -1;      // the event it triggers when done, or -1
  int64_t start = 0;     // the list scheduler's estimates, in cost units
  int64_t cost = 1;
};

struct MegakernelEvent {
  std::string what;      // "k3_matmul done", "k5_add inputs"
  int64_t triggers = 0;  // per launch
};

struct MegakernelPhase {
  Phase phase = Phase::forward;
  std::vector<int> kernels;     // indices into EmittedProgram::kernels, in phase order
  std::vector<int64_t> tiles;   // tile tasks of each kernel (parallel to `kernels`)
  std::vector<std::vector<int>> dependences;  // per kernel: positions in `kernels` it waits for
  // Per kernel: 0 when it waits for whole kernels, else the rows per event
  // of its one dependence, whose tiles of its rows it waits for.
  std::vector<int64_t> chunk_rows;
  int blocks = 0;
  int threads = 0;              // per block: the largest block of its kernels
  int64_t smem_bytes = 0;       // the largest shared memory of its kernels
  std::vector<MegakernelTask> tasks;  // block by block, each block's in the order it runs them
  std::vector<int> queue_begin;       // blocks + 1 entries: block b runs tasks [queue_begin[b], queue_begin[b + 1])
  std::vector<MegakernelEvent> events;
  int critical_path_tasks = 0;  // the longest chain of tasks that wait on one another
  int64_t makespan = 0;         // estimated, in cost units
  double idle_fraction = 0;     // of blocks x makespan, estimated
};

struct MegakernelOptions {
  int blocks = 132;
  // Test only: drop the trigger of one task that another waits for, so that
  // the watchdog must stop the kernel.
  bool break_schedule = false;
};

// The estimated cost of one tile of a kernel: 1 plus a unit per KiB it
// moves and per 16 kFLOP it computes, the kernel's totals shared among its tiles.
int64_t megakernel_tile_cost(const EmittedKernel& kernel, int64_t tiles);

// The tile tasks of a kernel in a megakernel of `blocks` blocks.
int64_t megakernel_tiles(const EmittedKernel& kernel, int blocks);

std::vector<MegakernelPhase> schedule_megakernel(const std::vector<EmittedKernel>& kernels,
                                                 const MegakernelOptions& options);

// What `cudagen describe --megakernel` prints: per phase the blocks, the
// tasks of each block, the events, the critical path and the idle fraction.
std::string describe_megakernel(const std::vector<MegakernelPhase>& phases, const std::vector<EmittedKernel>& kernels);

}  // namespace cudagen
