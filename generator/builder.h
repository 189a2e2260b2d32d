// A C++ API that makes the same TaskGraph as the JSON format, with no JSON:
//
//   GraphBuilder b("mlp");
//   auto w = b.task("w1_init", "uniform", Phase::init)
//                .tensor("out", DType::f32, {64, 128})
//                .arg("low", -0.1).arg("high", 0.1);
//   auto fc = b.task("fc1", "matmul")
//                 .tensor("a", DType::f32, {32, 64}, Storage::external)
//                 .tensor("b", w["out"])
//                 .tensor("out", DType::f32, {32, 128});
//   TaskGraph g = b.graph();
//
// The builder only assembles; `validate` checks the result against the registry.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>

#include "graph.h"

namespace cudagen {

class GraphBuilder;

// named() or data() on a slot the task does not have.
struct TaskSlotNotFound : std::invalid_argument {
  TaskSlotNotFound(const std::string& task, const std::string& slot);
};

// A handle to one task being built. Stays valid while its builder lives.
class TaskBuilder {
 public:
  // A slot that owns storage (storage class: the default for its role when absent).
  TaskBuilder& tensor(const std::string& name, DType dtype, Shape shape, std::optional<Storage> storage = std::nullopt);
  // A slot that shares the storage of another task's slot.
  TaskBuilder& tensor(const std::string& name, SlotRef from);
  // The tensor's own name ("layers.0.fc.weight") and its value's .npy file,
  // on a slot added before (JSON "name" and "data").
  TaskBuilder& named(const std::string& slot, const std::string& tensor_name);
  TaskBuilder& data(const std::string& slot, const std::string& npy_path);
  TaskBuilder& arg(const std::string& name, ArgValue value);
  TaskBuilder& arg(const std::string& name, double value) { return arg(name, ArgValue(value)); }
  TaskBuilder& arg(const std::string& name, int value) { return arg(name, ArgValue(int64_t(value))); }
  TaskBuilder& arg(const std::string& name, int64_t value) { return arg(name, ArgValue(value)); }
  TaskBuilder& arg(const std::string& name, bool value) { return arg(name, ArgValue(value)); }
  TaskBuilder& arg(const std::string& name, const char* value) { return arg(name, ArgValue(std::string(value))); }
  TaskBuilder& arg(const std::string& name, SlotRef from);
  // An argument in the scalars region, changeable between calls without recompiling.
  TaskBuilder& runtime_arg(const std::string& name, ArgValue initial);

  // `task["out"]`: a reference to one of this task's slots, for `from`.
  SlotRef operator[](const std::string& slot) const;
  const std::string& id() const;

 private:
  friend class GraphBuilder;
  TaskBuilder(GraphBuilder* owner, size_t index) : owner_(owner), index_(index) {}
  Task& task() const;
  TensorSlot& slot(const std::string& name) const;

  GraphBuilder* owner_;
  size_t index_;
};

class GraphBuilder {
 public:
  explicit GraphBuilder(std::string name = {}) { graph_.name = std::move(name); }
  GraphBuilder(const GraphBuilder&) = delete;  // TaskBuilders point back here
  GraphBuilder& operator=(const GraphBuilder&) = delete;

  TaskBuilder task(std::string id, std::string op, Phase phase = Phase::forward);
  // The graph's "training" section: the loss, the optimizer and its
  // arguments, the precision policy (docs/taskgraph-format.md, "Training").
  GraphBuilder& training(TrainingSpec spec) {
    graph_.training = std::move(spec);
    return *this;
  }
  const TaskGraph& graph() const& { return graph_; }
  TaskGraph graph() && { return std::move(graph_); }

 private:
  friend class TaskBuilder;
  TaskGraph graph_;
};

}  // namespace cudagen
