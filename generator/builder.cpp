#include "builder.h"

namespace cudagen {

Task& TaskBuilder::task() const { return owner_->graph_.tasks[index_]; }

const std::string& TaskBuilder::id() const { return task().id; }

SlotRef TaskBuilder::operator[](const std::string& slot) const { return SlotRef{task().id, slot}; }

TaskBuilder& TaskBuilder::tensor(const std::string& name, DType dtype, Shape shape, std::optional<Storage> storage) {
  TensorSlot slot;
  slot.name = name;
  slot.dtype = dtype;
  slot.shape = std::move(shape);
  slot.storage = storage;
  task().tensors.push_back(std::move(slot));
  return *this;
}

TaskBuilder& TaskBuilder::tensor(const std::string& name, SlotRef from) {
  TensorSlot slot;
  slot.name = name;
  slot.from = std::move(from);
  task().tensors.push_back(std::move(slot));
  return *this;
}

TaskSlotNotFound::TaskSlotNotFound(const std::string& task, const std::string& slot)
    : std::invalid_argument("task '" + task + "' has no tensor slot '" + slot + "' yet; add it with tensor() first") {}

TensorSlot& TaskBuilder::slot(const std::string& name) const {
  for (TensorSlot& s : task().tensors)
    if (s.name == name) return s;
  throw TaskSlotNotFound(task().id, name);
}

TaskBuilder& TaskBuilder::named(const std::string& slot_name, const std::string& tensor_name) {
  slot(slot_name).tensor_name = tensor_name;
  return *this;
}

TaskBuilder& TaskBuilder::data(const std::string& slot_name, const std::string& npy_path) {
  slot(slot_name).data = npy_path;
  return *this;
}

TaskBuilder& TaskBuilder::arg(const std::string& name, ArgValue value) {
  ArgSlot a;
  a.name = name;
  a.value = std::move(value);
  task().args.push_back(std::move(a));
  return *this;
}

TaskBuilder& TaskBuilder::arg(const std::string& name, SlotRef from) {
  ArgSlot a;
  a.name = name;
  a.from = std::move(from);
  task().args.push_back(std::move(a));
  return *this;
}

TaskBuilder& TaskBuilder::runtime_arg(const std::string& name, ArgValue initial) {
  ArgSlot a;
  a.name = name;
  a.value = std::move(initial);
  a.runtime = true;
  task().args.push_back(std::move(a));
  return *this;
}

TaskBuilder GraphBuilder::task(std::string id, std::string op, Phase phase) {
  Task t;
  t.id = std::move(id);
  t.op = std::move(op);
  t.phase = phase;
  graph_.tasks.push_back(std::move(t));
  return TaskBuilder(this, graph_.tasks.size() - 1);
}

}  // namespace cudagen
