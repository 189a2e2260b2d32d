#include "validate.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <set>

#include <fmt/format.h>

#include "diagnostics.h"

namespace cudagen {

ShapeEnv task_shape_env(const Program& program, int task) {
  const BoundTask* bt = &program.tasks[size_t(task)];
  ShapeEnv env;
  env.shape_of = [&program, bt](std::string_view name) -> const Shape* {
    const BoundTensor* b = bt->find_tensor(name);
    return b && b->buffer >= 0 ? &program.buffers[size_t(b->buffer)].shape : nullptr;
  };
  env.is_arg = [bt](std::string_view name) { return bt->op->find_arg(name) != nullptr; };
  env.arg_of = [bt](std::string_view name) -> std::optional<int64_t> {
    for (const auto& a : bt->args) {
      if (a.name != name || a.runtime) continue;
      if (auto* b = std::get_if<bool>(&a.value)) return *b ? 1 : 0;
      if (auto* i = std::get_if<int64_t>(&a.value)) return *i;
    }
    return std::nullopt;
  };
  return env;
}

std::string buffer_name(const Program& program, int buffer) {
  const BufferInfo& b = program.buffers[size_t(buffer)];
  if (!b.name.empty()) return b.name;
  return program.tasks[size_t(b.owner_task)].task->id + "." + b.owner_slot;
}

std::vector<int> weights(const Program& program) {
  std::set<int> read, written;
  for (const auto& bt : program.tasks)
    if (bt.task->phase == Phase::forward)
      for (const auto& b : bt.tensors) (b.sig->written() ? written : read).insert(b.buffer);
  std::vector<int> out;
  for (int b : read) {
    const BufferInfo& info = program.buffers[size_t(b)];
    if (info.storage == Storage::persistent && is_floating(info.dtype) && !written.count(b)) out.push_back(b);
  }
  return out;
}

std::pair<int, const BoundArg*> root_arg(const Program& program, int task, const std::string& arg) {
  std::string name = arg;
  // A longer chain than the task list is a cycle, which the scheduler reports.
  for (size_t hops = 0; hops <= program.tasks.size(); ++hops) {
    const BoundArg* found = nullptr;
    for (const auto& a : program.tasks[size_t(task)].args)
      if (a.name == name) found = &a;
    if (found == nullptr) return {-1, nullptr};
    if (found->source_task < 0) return {task, found};
    task = found->source_task;
    name = found->source_arg;
  }
  return {-1, nullptr};
}

const BoundTensor* BoundTask::find_tensor(std::string_view name) const {
  for (const auto& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

namespace {

std::vector<std::string> slot_names(const OpSignature& op) {
  std::vector<std::string> out;
  for (const auto& s : op.tensors) out.push_back(s.name);
  return out;
}

std::vector<std::string> arg_names(const OpSignature& op) {
  std::vector<std::string> out;
  for (const auto& a : op.args) out.push_back(a.name);
  return out;
}

std::string list_or_none(const std::vector<std::string>& names) {
  return names.empty() ? "none" : fmt::format("{}", fmt::join(names, ", "));
}

Storage default_storage(SlotRole role, Phase phase) {
  switch (role) {
    case SlotRole::input: return Storage::external;
    case SlotRole::weight: return Storage::persistent;
    case SlotRole::output:
    case SlotRole::scratch: return phase == Phase::init ? Storage::persistent : Storage::transient;
  }
  return Storage::transient;
}

// Builds a JSON path on demand: paths are only needed for errors, and
// formatting one per slot would dominate validating a large graph.
using PathFn = std::function<std::string()>;

class Validator {
 public:
  Validator(Program& program, const ValidateOptions& options)
      : p_(program), options_(options), diags_(options.file, options.error_limit) {}

  void run() {
    const auto& tasks = p_.graph.tasks;
    if (tasks.empty()) error({}, "", "", "", "the graph has no tasks", "add at least one task to \"tasks\"");
    index_tasks();
    p_.tasks.resize(tasks.size());
    for (size_t i = 0; i < tasks.size(); ++i) bind_signature(int(i));
    for (size_t i = 0; i < tasks.size(); ++i) own_buffers(int(i));
    for (size_t i = 0; i < tasks.size(); ++i) resolve_dependencies(int(i));
    for (size_t i = 0; i < tasks.size(); ++i) bind_args(int(i));
    for (size_t i = 0; i < tasks.size(); ++i) check_types_and_shapes(int(i));
    promote_cross_phase_buffers();
    if (diags_.ok()) check_acyclic();
    if (!diags_.ok()) throw CompileError(std::move(diags_));
  }

 private:
  void error(SourceLoc loc, std::string path, std::string task, std::string slot, std::string message,
             std::string hint = {}) {
    diags_.add(Diagnostic{{}, loc, std::move(path), std::move(task), std::move(slot), std::move(message), std::move(hint)});
  }

  static std::string task_path(int t) { return fmt::format("/tasks/{}", t); }
  static std::string tensor_path(int t, const std::string& slot) { return fmt::format("/tasks/{}/tensors/{}", t, slot); }
  static std::string arg_path(int t, const std::string& arg) { return fmt::format("/tasks/{}/args/{}", t, arg); }

  const Task& task(int t) const { return p_.graph.tasks[size_t(t)]; }

  void index_tasks() {
    for (size_t i = 0; i < p_.graph.tasks.size(); ++i) {
      const Task& t = p_.graph.tasks[i];
      auto [it, inserted] = index_.emplace(t.id, int(i));
      if (!inserted)
        error(t.loc, task_path(int(i)) + "/id", t.id, "",
              fmt::format("duplicate task id '{}'; it is first used at {}", t.id, task_path(it->second)),
              "task ids must be unique: rename one of them");
    }
  }

  int find_task(const std::string& id) const {
    auto it = index_.find(id);
    return it == index_.end() ? -1 : it->second;
  }

  std::vector<std::string> all_task_ids() const {
    std::vector<std::string> ids;
    for (const auto& t : p_.graph.tasks) ids.push_back(t.id);
    return ids;
  }

  // Op exists; the task's slots are exactly the signature's (optional ones may be left out).
  void bind_signature(int t) {
    const Task& tk = task(t);
    BoundTask& bt = p_.tasks[size_t(t)];
    bt.task = &tk;
    bt.op = p_.registry.find(tk.op);
    if (bt.op == nullptr) {
      if (!tk.op.empty())
        error(tk.loc, task_path(t) + "/op", tk.id, "",
              fmt::format("unknown op '{}'{}", tk.op, did_you_mean(tk.op, p_.registry.names())),
              "`cudagen ops` lists the ops of the registry");
      return;
    }
    const OpSignature& op = *bt.op;
    for (const auto& slot : tk.tensors) {
      if (op.find_tensor(slot.name) != nullptr) continue;
      std::string hint = op.find_arg(slot.name) != nullptr
                             ? fmt::format("'{}' is an argument of {}: move it to \"args\"", slot.name, op.name)
                             : fmt::format("the tensor slots of {} are: {}", op.name, list_or_none(slot_names(op)));
      error(slot.loc, tensor_path(t, slot.name), tk.id, slot.name,
            fmt::format("op '{}' has no tensor slot '{}'{}", op.name, slot.name, did_you_mean(slot.name, slot_names(op))),
            hint);
    }
    for (const auto& sig : op.tensors) {
      if (sig.optional || tk.find_tensor(sig.name) != nullptr) continue;
      error(tk.loc, task_path(t) + "/tensors", tk.id, sig.name,
            fmt::format("missing tensor slot '{}' ({} of op '{}')", sig.name, to_string(sig.role), op.name),
            sig.role == SlotRole::output
                ? fmt::format("add \"{}\": {{\"dtype\": ..., \"shape\": [...]}}", sig.name)
                : fmt::format("add \"{}\": {{\"from\": \"producer.slot\"}}", sig.name));
    }
    for (const auto& arg : tk.args) {
      if (op.find_arg(arg.name) != nullptr) continue;
      std::string hint = op.find_tensor(arg.name) != nullptr
                             ? fmt::format("'{}' is a tensor slot of {}: move it to \"tensors\"", arg.name, op.name)
                             : fmt::format("the arguments of {} are: {}", op.name, list_or_none(arg_names(op)));
      error(arg.loc, arg_path(t, arg.name), tk.id, arg.name,
            fmt::format("op '{}' has no argument '{}'{}", op.name, arg.name, did_you_mean(arg.name, arg_names(op))), hint);
    }
    for (const auto& sig : op.args) {
      if (sig.default_value || tk.find_arg(sig.name) != nullptr) continue;
      error(tk.loc, task_path(t) + "/args", tk.id, sig.name,
            fmt::format("missing argument '{}' ({}) of op '{}'; it has no default", sig.name, to_string(sig.type), op.name),
            fmt::format("add \"args\": {{\"{}\": ...}}", sig.name));
    }
  }

  // Slots without `from` own a buffer: they need dtype and shape, and a size that fits.
  void own_buffers(int t) {
    const Task& tk = task(t);
    BoundTask& bt = p_.tasks[size_t(t)];
    for (const auto& slot : tk.tensors) {
      const SlotSignature* sig = bt.op ? bt.op->find_tensor(slot.name) : nullptr;
      BoundTensor bound{slot.name, sig, -1, -1};
      auto path = [&] { return tensor_path(t, slot.name); };  // built only for errors
      if (slot.from) {
        if (slot.storage)
          error(slot.loc, path() + "/storage", tk.id, slot.name,
                "a slot with \"from\" shares its producer's storage, so it cannot set \"storage\"",
                "remove \"storage\" here, or set it on the producing slot");
        if (sig && sig->role == SlotRole::output)
          error(slot.loc, path() + "/from", tk.id, slot.name,
                fmt::format("'{}' is an output of op '{}'; an output owns its storage", slot.name, bt.op->name),
                "remove \"from\" and give \"dtype\" and \"shape\"; consumers depend on this slot instead");
        if (slot.tensor_name || slot.data)
          error(slot.loc, path() + (slot.tensor_name ? "/name" : "/data"), tk.id, slot.name,
                fmt::format("a slot with \"from\" shares {}'s tensor, so it cannot give it {}", slot.from->str(),
                            slot.tensor_name ? "a name" : "data"),
                fmt::format("set \"{}\" on the owning slot", slot.tensor_name ? "name" : "data"));
        bt.tensors.push_back(bound);
        continue;
      }
      if (!slot.dtype || !slot.shape) {
        error(slot.loc, path(), tk.id, slot.name,
              fmt::format("slot owns storage but has no {}", !slot.dtype && !slot.shape ? "dtype or shape"
                                                               : !slot.dtype           ? "dtype"
                                                                                       : "shape"),
              "give \"dtype\" and \"shape\", or depend on another task's slot with \"from\": \"task.slot\"");
        bt.tensors.push_back(bound);
        continue;
      }
      int64_t elements = 1;
      bool overflow = false;
      for (int64_t d : *slot.shape) overflow = overflow || __builtin_mul_overflow(elements, d, &elements);
      int64_t bytes = 0;
      overflow = overflow || __builtin_mul_overflow(elements, dtype_bytes(*slot.dtype), &bytes);
      if (overflow) {
        error(slot.loc, path() + "/shape", tk.id, slot.name,
              fmt::format("shape {} has more elements than a 64-bit count can hold", shape_to_string(*slot.shape)),
              "check the dimensions for a typo");
        bt.tensors.push_back(bound);
        continue;
      }
      // The kernels index one axis, and the rows of a tensor (all axes but
      // the last), with 32-bit integers: refuse what they would wrap around.
      const int64_t last = slot.shape->empty() ? 1 : slot.shape->back();
      const int64_t rows = last > 0 ? elements / last : 0;
      if (const auto big = std::find_if(slot.shape->begin(), slot.shape->end(), [](int64_t d) { return d > kMaxKernelExtent; });
          big != slot.shape->end()) {
        error(slot.loc, fmt::format("{}/shape/{}", path(), big - slot.shape->begin()), tk.id, slot.name,
              fmt::format("dimension {} of shape {} is over {}, the most a kernel indexes along one axis",
                          *big, shape_to_string(*slot.shape), kMaxKernelExtent),
              "split the tensor along that axis into several tasks");
      } else if (rows > kMaxKernelExtent) {
        error(slot.loc, path() + "/shape", tk.id, slot.name,
              fmt::format("shape {} has {} rows (all axes but the last), over {}, the most a kernel indexes",
                          shape_to_string(*slot.shape), rows, kMaxKernelExtent),
              "split the tensor into several tasks, or make its rows longer (a larger last axis)");
      }
      if (bytes > options_.max_tensor_bytes) {
        error(slot.loc, path() + "/shape", tk.id, slot.name,
              fmt::format("{} {} takes {} bytes, over the limit of {} bytes for one tensor", to_string(*slot.dtype),
                          shape_to_string(*slot.shape), bytes, options_.max_tensor_bytes),
              "check the dimensions for a typo, or raise the limit (--max-tensor-bytes)");
      }
      Storage storage = slot.storage.value_or(sig ? default_storage(sig->role, tk.phase) : Storage::transient);
      if (sig && (sig->role == SlotRole::input || sig->role == SlotRole::weight) && storage == Storage::transient)
        error(slot.loc, path() + "/storage", tk.id, slot.name,
              fmt::format("'{}' is read by the op but owns transient storage that no task writes", slot.name),
              "depend on the task that produces it (\"from\": \"task.slot\"), or make it \"external\" (bound by the "
              "caller) or \"persistent\"");
      if (slot.data && sig && sig->role == SlotRole::output)
        error(slot.loc, path() + "/data", tk.id, slot.name,
              fmt::format("'{}' is an output of op '{}': the task computes it, so it cannot load \"data\"", slot.name,
                          bt.op->name),
              "give \"data\" to the inputs and weights the graph reads, not to what it computes");
      if (slot.tensor_name) {
        // Names and task.slot share one namespace (Instance::set takes either).
        // One exception: the slot the name denotes reads, through `from`, what
        // this task makes of the tensor (the precision policy's cast of a graph
        // input, generator/autocast.h, which keeps the caller's name for it).
        const std::optional<SlotRef> ref = parse_slot_ref(*slot.tensor_name);
        const int other = ref ? find_task(ref->task) : -1;
        const TensorSlot* named = other >= 0 ? task(other).find_tensor(ref->slot) : nullptr;
        const bool reads_this_task = named != nullptr && named->from && named->from->task == tk.id;
        if (named != nullptr && !reads_this_task && !(other == t && ref->slot == slot.name))
          error(slot.loc, path() + "/name", tk.id, slot.name,
                fmt::format("tensor name '{}' is another slot's task.slot", *slot.tensor_name),
                "choose a name that is not some task's id, a dot and its slot");
        auto [it, added] = tensor_names_.emplace(*slot.tensor_name, tk.id + "." + slot.name);
        if (!added)
          error(slot.loc, path() + "/name", tk.id, slot.name,
                fmt::format("tensor name '{}' is already the name of {}", *slot.tensor_name, it->second),
                "give each tensor its own name");
      }
      bound.buffer = int(p_.buffers.size());
      std::string data;
      if (slot.data)
        data = std::filesystem::path(*slot.data).is_absolute() || p_.graph.base_dir.empty()
                   ? *slot.data
                   : (std::filesystem::path(p_.graph.base_dir) / *slot.data).string();
      p_.buffers.push_back(BufferInfo{t, slot.name, *slot.dtype, *slot.shape, bytes, storage, false,
                                      slot.tensor_name.value_or(""), data});
      bt.tensors.push_back(bound);
    }
  }

  // Follows `from` chains to the owning slot; records the dependency edge.
  void resolve_dependencies(int t) {
    const Task& tk = task(t);
    BoundTask& bt = p_.tasks[size_t(t)];
    for (size_t i = 0; i < tk.tensors.size(); ++i) {
      const TensorSlot& slot = tk.tensors[i];
      if (!slot.from) continue;
      auto path = [&] { return tensor_path(t, slot.name) + "/from"; };
      int src = check_ref(*slot.from, t, slot.loc, path, slot.name, /*is_arg=*/false);
      if (src < 0) continue;
      bt.tensors[i].source_task = src;
      // A task may read one tensor through two of its input slots (`x * x`):
      // that is no dependency on itself. Reading its own output still is.
      if (src != t || !reads_only(t, slot.name) || !reads_only(t, slot.from->slot)) bt.deps.push_back(src);
      int buffer = resolve_buffer(t, slot.name, slot.loc, path);
      bt.tensors[i].buffer = buffer;
      if (buffer < 0) continue;
      const BufferInfo& b = p_.buffers[size_t(buffer)];
      const Task& owner = task(b.owner_task);
      if (slot.dtype && *slot.dtype != b.dtype)
        error(slot.loc, tensor_path(t, slot.name) + "/dtype", tk.id, slot.name,
              fmt::format("dtype mismatch: this slot says {}, but its producer {}.{} is {}", to_string(*slot.dtype),
                          owner.id, b.owner_slot, to_string(b.dtype)),
              "make the two agree, or insert a cast task");
      if (slot.shape && *slot.shape != b.shape)
        error(slot.loc, tensor_path(t, slot.name) + "/shape", tk.id, slot.name,
              fmt::format("shape mismatch: this slot says {}, but its producer {}.{} is {}", shape_to_string(*slot.shape),
                          owner.id, b.owner_slot, shape_to_string(b.shape)),
              "make the two agree, or insert a reshape task");
    }
    std::sort(bt.deps.begin(), bt.deps.end());
    bt.deps.erase(std::unique(bt.deps.begin(), bt.deps.end()), bt.deps.end());
  }

  // Whether task t's op only reads its slot `name` (not an output, scratch, or
  // a parameter the op updates in place).
  bool reads_only(int t, const std::string& name) const {
    const BoundTask& bt = p_.tasks[size_t(t)];
    const SlotSignature* sig = bt.op ? bt.op->find_tensor(name) : nullptr;
    return sig != nullptr && !sig->written();
  }

  // Checks that `ref` names an existing task and slot and respects phase order;
  // returns the referenced task's index, or -1 after reporting.
  int check_ref(const SlotRef& ref, int t, SourceLoc loc, const PathFn& path, const std::string& slot, bool is_arg) {
    const Task& tk = task(t);
    int src = find_task(ref.task);
    if (src < 0) {
      error(loc, path(), tk.id, slot,
            fmt::format("depends on '{}', but there is no task '{}'{}", ref.str(), ref.task,
                        did_you_mean(ref.task, all_task_ids())));
      return -1;
    }
    const Task& source = task(src);
    bool exists = is_arg ? source.find_arg(ref.slot) != nullptr : source.find_tensor(ref.slot) != nullptr;
    if (!exists) {
      std::vector<std::string> names;
      if (is_arg) {
        for (const auto& a : source.args) names.push_back(a.name);
      } else {
        for (const auto& s : source.tensors) names.push_back(s.name);
      }
      error(loc, path(), tk.id, slot,
            fmt::format("depends on '{}', but task '{}' has no {} slot '{}'{}", ref.str(), ref.task,
                        is_arg ? "argument" : "tensor", ref.slot, did_you_mean(ref.slot, names)),
            fmt::format("the {} slots of '{}' are: {}", is_arg ? "argument" : "tensor", ref.task, list_or_none(names)));
      return -1;
    }
    if (source.phase > tk.phase) {
      error(loc, path(), tk.id, slot,
            fmt::format("a {} task cannot depend on {} task '{}': phases run in the order init, forward, backward, "
                        "update",
                        to_string(tk.phase), to_string(source.phase), source.id),
            "move one of the two tasks to another phase, or break the dependency");
      return -1;
    }
    return src;
  }

  // The buffer behind slot (t, name): the owning slot at the end of its `from` chain.
  int resolve_buffer(int t, const std::string& name, SourceLoc loc, const PathFn& path) {
    struct Step {
      int task;
      const TensorSlot* slot;
    };
    std::vector<Step> chain;  // usually one or two steps; names are only formatted for a cycle
    int cur_task = t;
    const TensorSlot* slot = task(t).find_tensor(name);
    while (slot != nullptr) {
      if (!slot->from) {
        for (const auto& bt : p_.tasks[size_t(cur_task)].tensors)
          if (bt.name == slot->name) return bt.buffer;
        return -1;
      }
      chain.push_back({cur_task, slot});
      int next = find_task(slot->from->task);
      if (next < 0) return -1;  // reported by check_ref
      const TensorSlot* next_slot = task(next).find_tensor(slot->from->slot);
      for (size_t i = 0; i < chain.size(); ++i) {
        if (chain[i].slot != next_slot) continue;
        report_slot_cycle(chain, i, t, name, loc, path);
        return -1;
      }
      cur_task = next;
      slot = next_slot;
    }
    return -1;
  }

  // Every slot of a cycle reaches it; the one whose name sorts first reports it, once.
  template <typename Chain>
  void report_slot_cycle(const Chain& chain, size_t start, int t, const std::string& name, SourceLoc loc,
                         const PathFn& path) {
    if (start != 0) return;
    std::vector<std::string> names;
    for (const auto& step : chain) names.push_back(task(step.task).id + "." + step.slot->name);
    if (*std::min_element(names.begin(), names.end()) != names.front()) return;
    names.push_back(names.front());
    error(loc, path(), task(t).id, name,
          fmt::format("slot dependencies form a cycle with no producer: {}", fmt::join(names, " <- ")),
          "one slot of the cycle must own its storage (give it dtype and shape instead of \"from\")");
  }


  // Argument values: constants of the right type, or a dependency on another task's argument.
  void bind_args(int t) {
    const Task& tk = task(t);
    BoundTask& bt = p_.tasks[size_t(t)];
    if (bt.op == nullptr) return;
    for (const auto& sig : bt.op->args) {
      const ArgSlot* arg = tk.find_arg(sig.name);
      BoundArg bound{sig.name, &sig, {}, false, -1, {}};
      if (arg == nullptr) {
        if (!sig.default_value) continue;  // bind_signature reported it missing
        bound.value = *sig.default_value;
        bt.args.push_back(std::move(bound));
        continue;
      }
      auto path = [&] { return arg_path(t, sig.name); };
      bound.runtime = arg->runtime;
      if (arg->from) {
        int src = check_ref(*arg->from, t, arg->loc, [&] { return path() + "/from"; }, sig.name, /*is_arg=*/true);
        if (src < 0) continue;
        bound.source_task = src;
        bound.source_arg = arg->from->slot;
        bound.runtime = true;  // follows another task's argument at run time
        bt.deps.insert(std::lower_bound(bt.deps.begin(), bt.deps.end(), src), src);
        bt.deps.erase(std::unique(bt.deps.begin(), bt.deps.end()), bt.deps.end());
        const ArgSlot* source = task(src).find_arg(arg->from->slot);
        if (source && source->value) bound.value = *source->value;
      } else if (arg->value) {
        auto converted = convert_arg(*arg->value, sig, tk, path, arg->loc);
        if (!converted) continue;
        bound.value = std::move(*converted);
      }
      if (bound.runtime && (sig.type == ArgType::string_ || sig.type == ArgType::ints || sig.type == ArgType::floats))
        error(arg->loc, path(), tk.id, sig.name,
              fmt::format("argument '{}' is {}; only scalar (float, int, bool) arguments can change at run time",
                          sig.name, to_string(sig.type)));
      bt.args.push_back(std::move(bound));
    }
  }

  std::optional<ArgValue> convert_arg(const ArgValue& v, const ArgSignature& sig, const Task& tk,
                                      const PathFn& path, SourceLoc loc) {
    auto mismatch = [&]() -> std::optional<ArgValue> {
      error(loc, path(), tk.id, sig.name,
            fmt::format("argument '{}' must be {}, not {}", sig.name, to_string(sig.type), arg_value_to_string(v)));
      return std::nullopt;
    };
    // The kernels take float arguments as f32: a value beyond its range would
    // become an infinity in the generated code.
    auto in_f32_range = [&](double d) {
      if (std::abs(d) <= double(std::numeric_limits<float>::max())) return true;
      error(loc, path(), tk.id, sig.name,
            fmt::format("argument '{}' is {}, beyond f32's range (about 3.4e38): kernels take it as an f32", sig.name,
                        arg_value_to_string(v)),
            "give a value within f32's range");
      return false;
    };
    switch (sig.type) {
      case ArgType::float_:
        if (auto* d = std::get_if<double>(&v)) return in_f32_range(*d) ? std::optional<ArgValue>(ArgValue(*d)) : std::nullopt;
        if (auto* i = std::get_if<int64_t>(&v)) return ArgValue(double(*i));
        return mismatch();
      case ArgType::int_:
        if (auto* i = std::get_if<int64_t>(&v)) return ArgValue(*i);
        return mismatch();
      case ArgType::bool_:
        if (auto* b = std::get_if<bool>(&v)) return ArgValue(*b);
        return mismatch();
      case ArgType::string_:
        if (auto* s = std::get_if<std::string>(&v)) {
          if (!sig.choices.empty() && std::find(sig.choices.begin(), sig.choices.end(), *s) == sig.choices.end()) {
            error(loc, path(), tk.id, sig.name,
                  fmt::format("argument '{}' cannot be \"{}\"{}", sig.name, *s, did_you_mean(*s, sig.choices)),
                  fmt::format("it is one of: {}", fmt::join(sig.choices, ", ")));
            return std::nullopt;
          }
          return ArgValue(*s);
        }
        return mismatch();
      case ArgType::ints:
        if (auto* a = std::get_if<std::vector<int64_t>>(&v)) return ArgValue(*a);
        if (auto* d = std::get_if<std::vector<double>>(&v); d && d->empty()) return ArgValue(std::vector<int64_t>{});
        return mismatch();
      case ArgType::floats:
        if (auto* d = std::get_if<std::vector<double>>(&v)) {
          for (double x : *d)
            if (!in_f32_range(x)) return std::nullopt;
          return ArgValue(*d);
        }
        if (auto* a = std::get_if<std::vector<int64_t>>(&v)) return ArgValue(std::vector<double>(a->begin(), a->end()));
        return mismatch();
    }
    return mismatch();
  }

  void check_types_and_shapes(int t) {
    const Task& tk = task(t);
    BoundTask& bt = p_.tasks[size_t(t)];
    if (bt.op == nullptr) return;
    bool all_resolved = true;
    for (const auto& bound : bt.tensors) {
      if (bound.sig == nullptr || bound.buffer < 0) {
        all_resolved = false;
        continue;
      }
      const BufferInfo& b = p_.buffers[size_t(bound.buffer)];
      const std::string& want = bound.sig->dtype;
      auto path = [&] { return tensor_path(t, bound.name); };
      const TensorSlot* slot = tk.find_tensor(bound.name);
      if (auto concrete = parse_dtype(want)) {
        if (*concrete != b.dtype)
          error(slot->loc, path(), tk.id, bound.name,
                fmt::format("op '{}' wants {} for '{}', but it is {}", bt.op->name, want, bound.name, to_string(b.dtype)),
                slot->from ? "insert a cast task before this one" : fmt::format("set \"dtype\": \"{}\"", want));
        continue;
      }
      const auto& allowed = bt.op->type_vars.at(want);
      if (std::find(allowed.begin(), allowed.end(), b.dtype) == allowed.end()) {
        std::vector<std::string> names;
        for (DType d : allowed) names.push_back(to_string(d));
        error(slot->loc, path(), tk.id, bound.name,
              fmt::format("op '{}' does not support dtype {} for '{}'; it takes {}", bt.op->name, to_string(b.dtype),
                          bound.name, fmt::join(names, ", ")));
        all_resolved = false;
        continue;
      }
      auto [it, inserted] = bt.type_vars.emplace(want, b.dtype);
      if (!inserted && it->second != b.dtype) {
        std::string first;
        for (const auto& other : bt.tensors)
          if (other.sig && other.sig->dtype == want && other.buffer >= 0 &&
              p_.buffers[size_t(other.buffer)].dtype == it->second) {
            first = other.name;
            break;
          }
        error(slot->loc, path(), tk.id, bound.name,
              fmt::format("'{}' is {}, but '{}' is {}; op '{}' needs them to have the same dtype", bound.name,
                          to_string(b.dtype), first, to_string(it->second), bt.op->name),
              "insert a cast task");
      }
    }
    if (!all_resolved) return;
    for (const auto& m : check_shape_rule(bt.op->shape, task_shape_env(p_, t))) {
      const TensorSlot* slot = tk.find_tensor(m.slot);
      error(slot ? slot->loc : tk.loc, tensor_path(t, m.slot), tk.id, m.slot, "shape mismatch: " + m.message);
    }
  }

  // A transient buffer read in a later phase than its producer must survive
  // the phase boundary: it becomes saved (forward -> backward, for instance).
  void promote_cross_phase_buffers() {
    for (const auto& bt : p_.tasks) {
      for (const auto& bound : bt.tensors) {
        if (bound.buffer < 0 || bound.source_task < 0) continue;
        BufferInfo& b = p_.buffers[size_t(bound.buffer)];
        if (b.storage == Storage::transient && task(b.owner_task).phase < bt.task->phase) {
          b.storage = Storage::saved;
          b.promoted = true;
        }
      }
    }
  }

  // Depth-first search with an explicit stack (graphs have 100 000s of tasks).
  void check_acyclic() {
    enum Color : uint8_t { White, Grey, Black };
    std::vector<Color> color(p_.tasks.size(), White);
    std::vector<int> parent(p_.tasks.size(), -1);
    for (size_t root = 0; root < p_.tasks.size(); ++root) {
      if (color[root] != White) continue;
      std::vector<std::pair<int, size_t>> stack{{int(root), 0}};
      color[root] = Grey;
      while (!stack.empty()) {
        auto& [node, next] = stack.back();
        const auto& deps = p_.tasks[size_t(node)].deps;
        if (next == deps.size()) {
          color[size_t(node)] = Black;
          stack.pop_back();
          continue;
        }
        int dep = deps[next++];
        if (color[size_t(dep)] == Grey) {
          report_cycle(stack, dep);
          return;
        }
        if (color[size_t(dep)] == White) {
          color[size_t(dep)] = Grey;
          stack.push_back({dep, 0});
        }
      }
    }
  }

  void report_cycle(const std::vector<std::pair<int, size_t>>& stack, int start) {
    // The stack holds consumers before their producers; a cycle reads best in data-flow order.
    std::vector<std::string> ids;
    bool in_cycle = false;
    for (const auto& [node, next] : stack) {
      in_cycle = in_cycle || node == start;
      if (in_cycle) ids.push_back(task(node).id);
    }
    std::reverse(ids.begin(), ids.end());
    std::rotate(ids.begin(), ids.end() - 1, ids.end());  // begin where the search found it
    ids.push_back(ids.front());
    error(task(start).loc, task_path(start), task(start).id, "",
          fmt::format("tasks depend on each other in a cycle: {}", fmt::join(ids, " -> ")),
          "a task can only read what earlier tasks wrote: break one dependency of the cycle");
  }

  Program& p_;
  const ValidateOptions& options_;
  Diagnostics diags_;
  std::unordered_map<std::string, int> index_;
  std::map<std::string, std::string> tensor_names_;  // a slot's "name" -> task.slot that has it
};

}  // namespace

Program validate(TaskGraph graph, OpRegistry registry, const ValidateOptions& options) {
  Program program;
  program.graph = std::move(graph);
  program.registry = std::move(registry);
  Validator(program, options).run();
  return program;
}

}  // namespace cudagen
