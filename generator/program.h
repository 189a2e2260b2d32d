// The typed program that validation produces from a TaskGraph: every task
// bound to its op signature, every tensor slot resolved to the buffer that
// holds it, every argument to a constant or a run-time scalar. The passes
// after validation (derive, schedule, fuse, plan, emit) read and return this.
#pragma once

#include <string>
#include <unordered_map>
#include <variant>
#include <vector>

#include "graph.h"
#include "registry.h"

namespace cudagen {

// One storage: a tensor slot that owns storage, with every slot that depends on it.
struct BufferInfo {
  int owner_task = -1;      // index into Program::tasks
  std::string owner_slot;
  DType dtype = DType::f32;
  Shape shape;
  int64_t bytes = 0;
  Storage storage = Storage::transient;
  bool promoted = false;    // transient that validation made saved: read in a later phase
  std::string name;         // the slot's "name", or empty: buffer_name() is then task.slot
  std::string data;         // the slot's "data" resolved against the graph's folder, or empty
};

struct BoundTensor {
  std::string name;
  const SlotSignature* sig = nullptr;
  int buffer = -1;          // index into Program::buffers
  int source_task = -1;     // the task named by `from`, or -1 for an owning slot
};

struct BoundArg {
  std::string name;
  const ArgSignature* sig = nullptr;
  ArgValue value;           // the constant (or initial run-time) value
  bool runtime = false;     // lives in the scalars region; may change between calls
  int source_task = -1;     // for `from`: the task whose argument this one follows
  std::string source_arg;
};

struct BoundTask {
  const Task* task = nullptr;  // into Program::graph
  const OpSignature* op = nullptr;
  std::vector<BoundTensor> tensors;
  std::vector<BoundArg> args;
  std::vector<int> deps;       // tasks this one must run after (sorted, unique)
  std::unordered_map<std::string, DType> type_vars;

  const BoundTensor* find_tensor(std::string_view name) const;
};

// Move-only: tasks point into `graph` and `registry`, whose elements stay put
// when the program is moved but not when it is copied.
struct Program {
  Program() = default;
  Program(Program&&) = default;
  Program& operator=(Program&&) = default;
  Program(const Program&) = delete;
  Program& operator=(const Program&) = delete;

  TaskGraph graph;
  OpRegistry registry;
  std::vector<BoundTask> tasks;       // same order as graph.tasks
  std::vector<BufferInfo> buffers;    // in order of their owning slots
};

// The argument that `arg` of task `task` follows through `from` links (itself
// when it follows none), as {task, argument}: where its value is held.
// {-1, nullptr} when the task has no such argument bound.
std::pair<int, const BoundArg*> root_arg(const Program& program, int task, const std::string& arg);

// A bound argument's value (root_arg's, typically): as a flag, false where
// unbound or not a bool; as a number, an int or a float, `fallback` where
// unbound or neither.
inline bool flag_value(const BoundArg* a) {
  return a != nullptr && std::holds_alternative<bool>(a->value) && std::get<bool>(a->value);
}
inline double number_value(const BoundArg* a, double fallback) {
  if (a == nullptr) return fallback;
  if (const auto* d = std::get_if<double>(&a->value)) return *d;
  if (const auto* i = std::get_if<int64_t>(&a->value)) return double(*i);
  return fallback;
}

// How a shape rule (or an op's FLOPs formula) sees task `task`: its slots'
// buffer shapes, its constant arguments (bool as 0/1; a run-time one has no
// value).
ShapeEnv task_shape_env(const Program& program, int task);

// A buffer's name, "task.slot" of the slot that owns it: how the manifest,
// the runtime and every message name it.
std::string buffer_name(const Program& program, int buffer);

// The trained weights: persistent floating buffers that forward tasks read
// and none writes, in buffer order.
std::vector<int> weights(const Program& program);

}  // namespace cudagen
