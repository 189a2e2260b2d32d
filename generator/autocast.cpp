#include "autocast.h"

#include <algorithm>
#include <map>
#include <set>

#include <fmt/format.h>

#include "diagnostics.h"
#include "schedule.h"

namespace cudagen {

namespace {

// The dtype both of two floating dtypes convert to without loss: f64 over
// everything, f32 over the 16-bit ones (bf16 and f16 meet at f32).
DType widest(DType a, DType b) {
  if (a == b) return a;
  if (a == DType::f64 || b == DType::f64) return DType::f64;
  return DType::f32;
}

// The op's one floating type variable, or empty: ops with none (an integer
// gather) or several (cast itself) keep the dtypes the graph declares.
std::string float_type_var(const OpSignature& op) {
  std::string found;
  for (const auto& [name, dtypes] : op.type_vars) {
    if (std::none_of(dtypes.begin(), dtypes.end(), is_floating)) continue;
    if (!found.empty()) return {};
    found = name;
  }
  return found;
}

[[noreturn]] void fail(const std::string& path, const std::string& task, const std::string& slot, std::string message,
                       std::string hint) {
  Diagnostics d;
  d.add(Diagnostic{{}, {}, path, task, slot, std::move(message), std::move(hint)});
  throw CompileError(std::move(d));
}

class Autocast {
 public:
  explicit Autocast(const Program& p) : p_(p), low_(*p.graph.training->precision), graph_(p.graph) {
    for (const auto& b : p.buffers) dtype_.push_back(b.dtype);
    for (const auto& t : p.graph.tasks) ids_.insert(t.id);
  }

  TaskGraph run() {
    check_policy();
    for (int t : schedule(p_).order)
      if (p_.tasks[size_t(t)].task->phase == Phase::forward) convert(t);
    return assemble();
  }

 private:
  void check_policy() {
    for (const auto& bt : p_.tasks)
      if (bt.task->phase == Phase::backward || bt.task->phase == Phase::update)
        fail(fmt::format("/tasks/{}", &bt - p_.tasks.data()), bt.task->id, {},
             fmt::format("\"precision\" applies to the training the derive pass writes, but task '{}' is a {} task "
                         "written by hand",
                         bt.task->id, to_string(bt.task->phase)),
             "remove the backward and update tasks and let \"training\" derive them, or drop \"precision\"");
    for (int b : weights(p_)) {
      const BufferInfo& info = p_.buffers[size_t(b)];
      if (info.dtype == DType::f32 || info.dtype == DType::f64) continue;
      fail(fmt::format("/tasks/{}/tensors/{}", info.owner_task, info.owner_slot),
           p_.tasks[size_t(info.owner_task)].task->id, info.owner_slot,
           fmt::format("weight '{}' is {}, but under \"precision\" the weights are the optimizer's f32 master weights",
                       buffer_name(p_, b), to_string(info.dtype)),
           fmt::format("declare it f32: the forward converts it to {} where a matmul or convolution reads it",
                       to_string(low_)));
    }
  }

  // Retypes forward task `t` by its op's autocast fact, converting the
  // inputs whose dtype differs.
  void convert(int t) {
    const BoundTask& bt = p_.tasks[size_t(t)];
    const std::string var = float_type_var(*bt.op);
    const auto declared = bt.type_vars.find(var);
    if (var.empty() || declared == bt.type_vars.end()) return;
    std::vector<const BoundTensor*> inputs, outputs;
    for (const auto& b : bt.tensors) {
      if (b.sig->dtype != var) continue;
      (b.sig->role == SlotRole::output || b.sig->role == SlotRole::scratch ? outputs : inputs).push_back(&b);
    }
    DType target = declared->second;
    if (bt.op->autocast == "low") {
      target = low_;
    } else if (bt.op->autocast == "f32") {
      target = DType::f32;
    } else if (!inputs.empty()) {
      target = dtype_[size_t(inputs.front()->buffer)];
      for (const BoundTensor* b : inputs) target = widest(target, dtype_[size_t(b->buffer)]);
    }
    // A slot the op updates in place keeps its buffer: the task computes in its dtype.
    for (const BoundTensor* b : inputs)
      if (b->sig->writes) target = dtype_[size_t(b->buffer)];
    const std::vector<DType>& allowed = bt.op->type_vars.at(var);
    if (std::find(allowed.begin(), allowed.end(), target) == allowed.end()) target = declared->second;
    for (const BoundTensor* b : inputs)
      if (dtype_[size_t(b->buffer)] != target) convert_input(t, *b, target);
    for (const BoundTensor* b : outputs) {
      slot(t, b->name).dtype = target;
      dtype_[size_t(b->buffer)] = target;
    }
  }

  int first_forward() const {
    for (size_t t = 0; t < p_.tasks.size(); ++t)
      if (p_.tasks[t].task->phase == Phase::forward) return int(t);
    return 0;
  }

  TensorSlot& slot(int t, const std::string& name) {
    for (auto& s : graph_.tasks[size_t(t)].tensors)
      if (s.name == name) return s;
    throw std::logic_error("autocast: no slot " + name);
  }

  std::string unique_id(const std::string& base) {
    std::string id = base;
    for (int k = 2; ids_.count(id); ++k) id = fmt::format("{}_{}", base, k);
    ids_.insert(id);
    return id;
  }

  // Makes input `b` of task `t` read its value converted to `dtype`: through
  // the cast of that value to `dtype` that an earlier reader made, or a new
  // one, placed before `t` (a weight's before the first forward task). An input the task declares itself (a graph input
  // bound by the caller) moves to the new cast, under the name the caller
  // knows it by.
  void convert_input(int t, const BoundTensor& b, DType dtype) {
    const auto key = std::make_pair(b.buffer, dtype);
    auto cached = casts_.find(key);
    TensorSlot& reader = slot(t, b.name);
    if (cached == casts_.end()) {
      const BufferInfo& info = p_.buffers[size_t(b.buffer)];
      const std::string owner = p_.tasks[size_t(info.owner_task)].task->id;
      Task cast;
      cast.id = unique_id(fmt::format("{}{}_to_{}", owner, info.owner_slot == "out" ? "" : "_" + info.owner_slot,
                                      to_string(dtype)));
      cast.op = "cast";
      cast.phase = Phase::forward;
      // (The task's own declaration also where `b` reads it through another of
      // its slots, `x @ x.T`: the declaration moves whichever slot converts first.)
      if (info.owner_task == t) {
        TensorSlot declared = slot(t, info.owner_slot);
        declared.name = "x";
        if (!declared.tensor_name) declared.tensor_name = buffer_name(p_, b.buffer);
        cast.tensors.push_back(std::move(declared));
        moved_[SlotRef{owner, info.owner_slot}.str()] = SlotRef{cast.id, "x"};
      } else {
        cast.tensors.push_back(TensorSlot{"x", {}, {}, {}, SlotRef{owner, info.owner_slot}, {}, {}, {}});
      }
      cast.tensors.push_back(TensorSlot{"out", dtype, info.shape, {}, {}, {}, {}, {}});
      cached = casts_.emplace(key, cast.id).first;
      // The weights' casts first in the forward, side by side: one launch
      // (rule horizontal) converts every weight.
      const bool weight = info.storage == Storage::persistent && b.source_task >= 0;
      before_[weight ? first_forward() : t].push_back(std::move(cast));
    }
    reader = TensorSlot{reader.name, {}, {}, {}, SlotRef{cached->second, "out"}, {}, {}, reader.loc};
    converted_.insert(SlotRef{graph_.tasks[size_t(t)].id, b.name}.str());
  }

  // The graph in its tasks' order with each cast before its first reader;
  // every dependency names the slot that owns its buffer (a slot that reads
  // through `from` may now read a cast), redirected where a declaration moved.
  TaskGraph assemble() {
    for (size_t t = 0; t < graph_.tasks.size(); ++t)
      for (auto& s : graph_.tasks[t].tensors) {
        if (!s.from || converted_.count(SlotRef{graph_.tasks[t].id, s.name}.str())) continue;
        const BoundTensor* b = p_.tasks[t].find_tensor(s.name);
        if (b == nullptr) continue;
        const BufferInfo& info = p_.buffers[size_t(b->buffer)];
        s.from = SlotRef{p_.tasks[size_t(info.owner_task)].task->id, info.owner_slot};
        s.dtype.reset();
      }
    TaskGraph out = graph_;
    out.tasks.clear();
    for (size_t t = 0; t < graph_.tasks.size(); ++t) {
      if (auto it = before_.find(int(t)); it != before_.end())
        for (auto& cast : it->second) out.tasks.push_back(std::move(cast));
      out.tasks.push_back(std::move(graph_.tasks[t]));
    }
    for (auto& task : out.tasks)
      for (auto& s : task.tensors)
        if (s.from)
          if (auto it = moved_.find(s.from->str()); it != moved_.end()) s.from = it->second;
    return out;
  }

  const Program& p_;
  const DType low_;
  TaskGraph graph_;            // the input's tasks, retyped and rebound in place
  std::vector<DType> dtype_;   // each buffer's dtype after the policy
  std::set<std::string> ids_;
  std::map<std::pair<int, DType>, std::string> casts_;  // (buffer, dtype) -> its cast task
  std::map<int, std::vector<Task>> before_;             // casts placed before a task
  std::map<std::string, SlotRef> moved_;                 // "task.slot" of a declaration moved to a cast's x
  std::set<std::string> converted_;                      // "task.slot" of the slots that now read a cast
};

}  // namespace

TaskGraph apply_precision(const Program& forward) {
  const auto& training = forward.graph.training;
  if (!training || !training->precision || *training->precision == DType::f32) return forward.graph;
  return Autocast(forward).run();
}

}  // namespace cudagen
