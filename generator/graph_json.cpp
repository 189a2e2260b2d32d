#include "graph_json.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>

#include <fmt/format.h>

#include "file_util.h"

namespace cudagen {

namespace {

// Reads one JSON document into a TaskGraph, reporting every structural
// problem it meets rather than stopping at the first.
class GraphReader {
 public:
  explicit GraphReader(Diagnostics& diags) : diags_(diags) {}

  TaskGraph read(const JsonValue& root) {
    TaskGraph graph;
    if (!expect_kind(root, JsonValue::Kind::Object, "", "the document")) return graph;
    check_fields(root, "", {"format", "name", "tasks", "training"});
    const JsonValue* format = root.find("format");
    if (format == nullptr) {
      error(root.loc, "", fmt::format("missing \"format\"; a task graph starts with \"format\": \"{}\"", kTaskGraphFormat));
    } else if (!format->is_string() || format->as_string() != kTaskGraphFormat) {
      error(format->loc, "/format",
            fmt::format("unsupported format {}; this cudagen reads \"{}\"",
                        format->is_string() ? json_quote(format->as_string()) : json_kind_name(format->kind()),
                        kTaskGraphFormat));
    }
    if (const JsonValue* name = root.find("name")) {
      if (expect_kind(*name, JsonValue::Kind::String, "/name", "\"name\"")) {
        graph.name = name->as_string();
        // The name is printed into the generated file's comments and into
        // diagnostics: refuse what could end a line there or drive a terminal.
        for (size_t i = 0; i < graph.name.size(); ++i) {
          const unsigned char c = static_cast<unsigned char>(graph.name[i]);
          if (c < 0x20 || c == 0x7f) {
            error(name->loc, "/name",
                  fmt::format("the graph's name has a control character (byte 0x{:02x} at offset {})", c, i),
                  "a graph name is one line of printable text: remove newlines, tabs and other control characters");
            break;
          }
        }
      }
    }
    const JsonValue* tasks = root.find("tasks");
    if (tasks == nullptr) {
      error(root.loc, "", "missing \"tasks\": a task graph needs an array of tasks");
      return graph;
    }
    if (!expect_kind(*tasks, JsonValue::Kind::Array, "/tasks", "\"tasks\"")) return graph;
    if (const JsonValue* training = root.find("training")) graph.training = read_training(*training);
    graph.tasks.reserve(tasks->items().size());
    for (size_t i = 0; i < tasks->items().size(); ++i) {
      if (diags_.full()) break;
      graph.tasks.push_back(read_task(tasks->items()[i], fmt::format("/tasks/{}", i)));
    }
    return graph;
  }

 private:
  void error(SourceLoc loc, std::string path, std::string message, std::string hint = {}, std::string task = {},
             std::string slot = {}) {
    diags_.add(Diagnostic{{}, loc, std::move(path), std::move(task), std::move(slot), std::move(message), std::move(hint)});
  }

  bool expect_kind(const JsonValue& v, JsonValue::Kind kind, const std::string& path, std::string_view what,
                   const std::string& task = {}, const std::string& slot = {}) {
    if (v.kind() == kind) return true;
    error(v.loc, path, fmt::format("{} must be {}, not {}", what, json_kind_name(kind), json_kind_name(v.kind())), {},
          task, slot);
    return false;
  }

  void check_fields(const JsonValue& obj, const std::string& path, std::initializer_list<std::string_view> known,
                    const std::string& task = {}, const std::string& slot = {}) {
    for (const auto& [key, value] : obj.members()) {
      if (std::find(known.begin(), known.end(), key) != known.end()) continue;
      std::vector<std::string> names(known.begin(), known.end());
      error(value.loc, path + "/" + key, fmt::format("unknown field \"{}\"{}", key, did_you_mean(key, names)),
            fmt::format("the fields allowed here are: {}", fmt::join(names, ", ")), task, slot);
    }
  }

  // "training": {"loss": "task.slot", "optimizer": "sgd", "args": {"lr": 0.1}, "precision": "bf16",
  //              "clip_grad_norm": 1.0, "accumulate_gradients": true}
  std::optional<TrainingSpec> read_training(const JsonValue& v) {
    if (!expect_kind(v, JsonValue::Kind::Object, "/training", "\"training\"")) return std::nullopt;
    check_fields(v, "/training", {"loss", "optimizer", "args", "precision", "clip_grad_norm", "accumulate_gradients",
                                      "loss_scale"});
    TrainingSpec spec;
    spec.loc = v.loc;
    const JsonValue* loss = v.find("loss");
    if (loss == nullptr) {
      error(v.loc, "/training", "\"training\" needs \"loss\": the scalar to minimise",
            "write \"loss\": \"task.slot\", a forward task's scalar output");
    } else if (auto r = read_ref(*loss, "/training/loss", {}, {})) {
      spec.loss = *r;
    }
    if (const JsonValue* optimizer = v.find("optimizer")) {
      if (expect_kind(*optimizer, JsonValue::Kind::String, "/training/optimizer", "\"optimizer\""))
        spec.optimizer = optimizer->as_string();
    }
    if (const JsonValue* args = v.find("args")) {
      if (expect_kind(*args, JsonValue::Kind::Object, "/training/args", "\"args\""))
        for (const auto& [name, value] : args->members())
          spec.optimizer_args.push_back(read_arg_slot(name, value, "/training/args/" + name, {}));
    }
    if (const JsonValue* precision = v.find("precision")) {
      if (expect_kind(*precision, JsonValue::Kind::String, "/training/precision", "\"precision\"")) {
        const auto dtype = parse_dtype(precision->as_string());
        if (dtype == DType::f32 || dtype == DType::bf16 || dtype == DType::f16)
          spec.precision = dtype;
        else
          error(precision->loc, "/training/precision", fmt::format("unknown precision {}", json_quote(precision->as_string())),
                "\"precision\" is the dtype the forward and backward compute in: \"bf16\" or \"f16\" (weights and "
                "optimizer stay f32), or \"f32\"");
      }
    }
    if (const JsonValue* clip = v.find("clip_grad_norm")) {
      const double max_norm = clip->as_double();
      if (!clip->is_number())
        error(clip->loc, "/training/clip_grad_norm",
              fmt::format("\"clip_grad_norm\" must be a number, not {}", json_kind_name(clip->kind())),
              "write the largest global L2 norm the gradients may have, as \"clip_grad_norm\": 1.0");
      else if (!(max_norm > 0 && max_norm <= double(std::numeric_limits<float>::max())))
        error(clip->loc, "/training/clip_grad_norm", fmt::format("\"clip_grad_norm\" is {}", json_format_double(max_norm)),
              "it is the largest global L2 norm the gradients may have: a positive number within f32's range");
      else
        spec.clip_grad_norm = max_norm;
    }
    if (const JsonValue* accumulate = v.find("accumulate_gradients")) {
      if (!accumulate->is_bool())
        error(accumulate->loc, "/training/accumulate_gradients",
              fmt::format("\"accumulate_gradients\" must be true or false, not {}", json_kind_name(accumulate->kind())),
              "write \"accumulate_gradients\": true to sum the gradients over a step's micro-batches");
      else
        spec.accumulate_gradients = accumulate->as_bool();
    }
    if (const JsonValue* scale = v.find("loss_scale")) spec.loss_scale = read_loss_scale(*scale);
    return spec;
  }

  // "loss_scale": "dynamic" (GradScaler's defaults), or {"initial": 65536,
  // "growth_factor": 2, "backoff_factor": 0.5, "growth_interval": 2000}, any
  // field left out at its default.
  std::optional<LossScaling> read_loss_scale(const JsonValue& v) {
    const std::string path = "/training/loss_scale";
    const std::string hint =
        "write \"loss_scale\": \"dynamic\", or an object of \"initial\", \"growth_factor\", \"backoff_factor\" "
        "and \"growth_interval\" (torch.cuda.amp.GradScaler's arguments)";
    LossScaling scaling;
    if (v.kind() == JsonValue::Kind::String) {
      if (v.as_string() == "dynamic") return scaling;
      error(v.loc, path, fmt::format("unknown loss scaling {}", json_quote(v.as_string())), hint);
      return std::nullopt;
    }
    if (v.kind() != JsonValue::Kind::Object) {
      error(v.loc, path, fmt::format("\"loss_scale\" must be \"dynamic\" or an object, not {}", json_kind_name(v.kind())),
            hint);
      return std::nullopt;
    }
    check_fields(v, path, {"initial", "growth_factor", "backoff_factor", "growth_interval"});
    bool ok = true;
    auto number = [&](const char* field, double& out, double low, double high, bool open_low, const char* what) {
      const JsonValue* f = v.find(field);
      if (f == nullptr) return;
      const double x = f->as_double();
      if (!f->is_number() || !(open_low ? x > low : x >= low) || !(x < high) || !std::isfinite(x)) {
        error(f->loc, path + "/" + field,
              fmt::format("\"{}\" is {}", field, f->is_number() ? json_format_double(x) : json_kind_name(f->kind())),
              fmt::format("it is {}", what));
        ok = false;
        return;
      }
      out = x;
    };
    const double f32_max = double(std::numeric_limits<float>::max());
    number("initial", scaling.initial, 0, f32_max, true, "the first scale: a positive number within f32's range");
    number("growth_factor", scaling.growth_factor, 1, f32_max, true, "what the scale is multiplied by to grow: above 1");
    number("backoff_factor", scaling.backoff_factor, 0, 1, true,
           "what the scale is multiplied by after an overflow: between 0 and 1");
    double interval = double(scaling.growth_interval);
    number("growth_interval", interval, 1, 1e15, false, "the number of steps without overflow before it grows: 1 or more");
    if (ok && interval != std::floor(interval)) {
      error(v.find("growth_interval")->loc, path + "/growth_interval",
            fmt::format("\"growth_interval\" is {}", json_format_double(interval)), "it is a whole number of steps");
      ok = false;
    }
    scaling.growth_interval = int64_t(interval);
    if (!ok) return std::nullopt;
    return scaling;
  }

  Task read_task(const JsonValue& v, const std::string& path) {
    Task task;
    task.loc = v.loc;
    if (!expect_kind(v, JsonValue::Kind::Object, path, "a task")) return task;
    const JsonValue* id = v.find("id");
    if (id == nullptr) {
      error(v.loc, path, "task has no \"id\"", "give every task a unique \"id\" (a C identifier)");
    } else if (expect_kind(*id, JsonValue::Kind::String, path + "/id", "\"id\"")) {
      task.id = id->as_string();
      if (!is_identifier(task.id))
        error(id->loc, path + "/id", fmt::format("task id {} is not an identifier", json_quote(task.id)),
              "ids become names in the generated CUDA: use letters, digits and '_', not starting with a digit");
    }
    check_fields(v, path, {"id", "op", "phase", "tensors", "args"}, task.id);
    const JsonValue* op = v.find("op");
    if (op == nullptr) {
      error(v.loc, path, "task has no \"op\"", "name the registry op this task runs, e.g. \"op\": \"matmul\"", task.id);
    } else if (expect_kind(*op, JsonValue::Kind::String, path + "/op", "\"op\"", task.id)) {
      task.op = op->as_string();
    }
    if (const JsonValue* phase = v.find("phase")) {
      if (expect_kind(*phase, JsonValue::Kind::String, path + "/phase", "\"phase\"", task.id)) {
        if (auto p = parse_phase(phase->as_string())) {
          task.phase = *p;
        } else {
          error(phase->loc, path + "/phase", fmt::format("unknown phase {}", json_quote(phase->as_string())),
                "a phase is one of: init, forward, backward, update", task.id);
        }
      }
    }
    if (const JsonValue* tensors = v.find("tensors")) {
      if (expect_kind(*tensors, JsonValue::Kind::Object, path + "/tensors", "\"tensors\"", task.id)) {
        for (const auto& [name, slot] : tensors->members())
          task.tensors.push_back(read_tensor_slot(name, slot, path + "/tensors/" + name, task.id));
      }
    }
    if (const JsonValue* args = v.find("args")) {
      if (expect_kind(*args, JsonValue::Kind::Object, path + "/args", "\"args\"", task.id)) {
        for (const auto& [name, arg] : args->members())
          task.args.push_back(read_arg_slot(name, arg, path + "/args/" + name, task.id));
      }
    }
    return task;
  }

  std::optional<SlotRef> read_ref(const JsonValue& v, const std::string& path, const std::string& task,
                                  const std::string& slot) {
    if (!expect_kind(v, JsonValue::Kind::String, path, "\"from\"", task, slot)) return std::nullopt;
    auto ref = parse_slot_ref(v.as_string());
    if (!ref)
      error(v.loc, path, fmt::format("{} is not a slot reference", json_quote(v.as_string())),
            "write a dependency as \"task_id.slot_name\"", task, slot);
    return ref;
  }

  void check_slot_name(const std::string& name, const JsonValue& v, const std::string& path, const std::string& task) {
    if (!is_identifier(name))
      error(v.loc, path, fmt::format("slot name {} is not an identifier", json_quote(name)),
            "use letters, digits and '_', not starting with a digit", task, name);
  }

  TensorSlot read_tensor_slot(const std::string& name, const JsonValue& v, const std::string& path,
                              const std::string& task) {
    TensorSlot slot;
    slot.name = name;
    slot.loc = v.loc;
    check_slot_name(name, v, path, task);
    if (!expect_kind(v, JsonValue::Kind::Object, path, "a tensor slot", task, name)) return slot;
    check_fields(v, path, {"dtype", "shape", "storage", "from", "name", "data"}, task, name);
    if (const JsonValue* dtype = v.find("dtype")) {
      if (expect_kind(*dtype, JsonValue::Kind::String, path + "/dtype", "\"dtype\"", task, name)) {
        slot.dtype = parse_dtype(dtype->as_string());
        if (!slot.dtype)
          error(dtype->loc, path + "/dtype", fmt::format("unknown dtype {}", json_quote(dtype->as_string())),
                "a dtype is one of: f32, f16, bf16, f64, i32, i64", task, name);
      }
    }
    if (const JsonValue* shape = v.find("shape")) {
      if (expect_kind(*shape, JsonValue::Kind::Array, path + "/shape", "\"shape\"", task, name)) {
        Shape dims;
        bool good = true;
        for (size_t i = 0; i < shape->items().size(); ++i) {
          const JsonValue& d = shape->items()[i];
          if (!d.is_int() || d.as_int() < 1) {
            error(d.loc, fmt::format("{}/shape/{}", path, i),
                  "a dimension must be a positive integer (shapes are static)", {}, task, name);
            good = false;
            continue;
          }
          dims.push_back(d.as_int());
        }
        if (good) slot.shape = std::move(dims);
      }
    }
    if (const JsonValue* storage = v.find("storage")) {
      if (expect_kind(*storage, JsonValue::Kind::String, path + "/storage", "\"storage\"", task, name)) {
        slot.storage = parse_storage(storage->as_string());
        if (!slot.storage)
          error(storage->loc, path + "/storage", fmt::format("unknown storage class {}", json_quote(storage->as_string())),
                "a storage class is one of: external, persistent, saved, transient", task, name);
      }
    }
    if (const JsonValue* from = v.find("from")) slot.from = read_ref(*from, path + "/from", task, name);
    if (const JsonValue* tensor_name = v.find("name")) {
      if (expect_kind(*tensor_name, JsonValue::Kind::String, path + "/name", "\"name\"", task, name)) {
        if (is_tensor_name(tensor_name->as_string()))
          slot.tensor_name = tensor_name->as_string();
        else
          error(tensor_name->loc, path + "/name",
                fmt::format("tensor name {} is not a file name", json_quote(tensor_name->as_string())),
                "a tensor name uses letters, digits, '_', '.' and '-' (as \"layers.0.fc.weight\"), not starting with "
                "'.' or '-'",
                task, name);
      }
    }
    if (const JsonValue* data = v.find("data")) {
      if (expect_kind(*data, JsonValue::Kind::String, path + "/data", "\"data\"", task, name)) {
        if (data->as_string().empty())
          error(data->loc, path + "/data", "\"data\" is empty",
                "give the path of an .npy file, relative to the graph file's folder", task, name);
        else
          slot.data = data->as_string();
      }
    }
    return slot;
  }

  std::optional<ArgValue> read_arg_value(const JsonValue& v, const std::string& path, const std::string& task,
                                         const std::string& slot) {
    switch (v.kind()) {
      case JsonValue::Kind::Bool: return ArgValue(v.as_bool());
      case JsonValue::Kind::Int: return ArgValue(v.as_int());
      case JsonValue::Kind::Float: return ArgValue(v.as_double());
      case JsonValue::Kind::String: return ArgValue(v.as_string());
      case JsonValue::Kind::Array: {
        bool all_int = true;
        for (const auto& item : v.items()) {
          if (!item.is_number()) {
            error(item.loc, path, "an array argument holds numbers only", {}, task, slot);
            return std::nullopt;
          }
          all_int = all_int && item.is_int();
        }
        if (all_int && !v.items().empty()) {
          std::vector<int64_t> ints;
          for (const auto& item : v.items()) ints.push_back(item.as_int());
          return ArgValue(std::move(ints));
        }
        std::vector<double> doubles;
        for (const auto& item : v.items()) doubles.push_back(item.as_double());
        return ArgValue(std::move(doubles));
      }
      default:
        error(v.loc, path, fmt::format("an argument value cannot be {}", json_kind_name(v.kind())),
              "give a number, boolean, string, array of numbers, or {\"from\": \"task.arg\"}", task, slot);
        return std::nullopt;
    }
  }

  ArgSlot read_arg_slot(const std::string& name, const JsonValue& v, const std::string& path, const std::string& task) {
    ArgSlot arg;
    arg.name = name;
    arg.loc = v.loc;
    check_slot_name(name, v, path, task);
    if (!v.is_object()) {
      arg.value = read_arg_value(v, path, task, name);
      return arg;
    }
    check_fields(v, path, {"value", "from", "runtime"}, task, name);
    if (const JsonValue* from = v.find("from")) arg.from = read_ref(*from, path + "/from", task, name);
    if (const JsonValue* value = v.find("value")) arg.value = read_arg_value(*value, path + "/value", task, name);
    if (const JsonValue* runtime = v.find("runtime")) {
      if (expect_kind(*runtime, JsonValue::Kind::Bool, path + "/runtime", "\"runtime\"", task, name))
        arg.runtime = runtime->as_bool();
    }
    if (arg.from && v.find("value") != nullptr)
      error(v.loc, path, "an argument has either \"value\" or \"from\", not both", {}, task, name);
    if (!arg.from && v.find("value") == nullptr)
      error(v.loc, path, "an argument object needs \"value\" or \"from\"",
            "write {\"value\": 0.001, \"runtime\": true} or {\"from\": \"task.arg\"}", task, name);
    return arg;
  }

  Diagnostics& diags_;
};

void write_indent(std::string& out, int n) { out.append(size_t(n) * 2, ' '); }

std::string tensor_slot_json(const TensorSlot& s) {
  std::vector<std::string> fields;
  if (s.from) fields.push_back("\"from\": " + json_quote(s.from->str()));
  if (s.dtype) fields.push_back(fmt::format("\"dtype\": \"{}\"", to_string(*s.dtype)));
  if (s.shape) fields.push_back(fmt::format("\"shape\": [{}]", fmt::join(*s.shape, ", ")));
  if (s.storage) fields.push_back(fmt::format("\"storage\": \"{}\"", to_string(*s.storage)));
  if (s.tensor_name) fields.push_back("\"name\": " + json_quote(*s.tensor_name));
  if (s.data) fields.push_back("\"data\": " + json_quote(*s.data));
  return fmt::format("{{{}}}", fmt::join(fields, ", "));
}

std::string arg_slot_json(const ArgSlot& a) {
  if (a.from) return fmt::format("{{\"from\": {}}}", json_quote(a.from->str()));
  std::string value = a.value ? arg_value_to_string(*a.value) : "null";
  if (a.runtime) return fmt::format("{{\"value\": {}, \"runtime\": true}}", value);
  return value;
}

// `,\n      "key": {\n        "name": value, ...\n      }` for a task's slots, one per line; nothing when empty.
template <typename Slot>
void write_slot_object(std::string& out, const char* key, const std::vector<Slot>& slots,
                       std::string (*value)(const Slot&)) {
  if (slots.empty()) return;
  out += ",\n";
  write_indent(out, 3);
  out += fmt::format("\"{}\": {{", key);
  for (size_t j = 0; j < slots.size(); ++j) {
    out += j == 0 ? "\n" : ",\n";
    write_indent(out, 4);
    out += json_quote(slots[j].name) + ": " + value(slots[j]);
  }
  out += "\n";
  write_indent(out, 3);
  out += "}";
}

}  // namespace

TaskGraph read_graph(std::string_view text, const std::string& file) {
  JsonValue root = parse_json_document(text, file);
  Diagnostics diags(file);
  TaskGraph graph = GraphReader(diags).read(root);
  if (!diags.ok()) throw CompileError(std::move(diags));
  return graph;
}

TaskGraph read_graph_file(const std::string& path) {
  TaskGraph graph = read_graph(read_text_file(path), path);
  graph.base_dir = std::filesystem::path(path).parent_path().string();
  return graph;
}

std::string write_graph(const TaskGraph& graph) {
  std::string out = "{\n";
  write_indent(out, 1);
  out += fmt::format("\"format\": \"{}\",\n", kTaskGraphFormat);
  if (!graph.name.empty()) {
    write_indent(out, 1);
    out += fmt::format("\"name\": {},\n", json_quote(graph.name));
  }
  write_indent(out, 1);
  out += "\"tasks\": [";
  for (size_t i = 0; i < graph.tasks.size(); ++i) {
    const Task& t = graph.tasks[i];
    out += i == 0 ? "\n" : ",\n";
    write_indent(out, 2);
    out += "{\n";
    write_indent(out, 3);
    out += fmt::format("\"id\": {},\n", json_quote(t.id));
    write_indent(out, 3);
    out += fmt::format("\"op\": {},\n", json_quote(t.op));
    write_indent(out, 3);
    out += fmt::format("\"phase\": \"{}\"", to_string(t.phase));
    write_slot_object(out, "tensors", t.tensors, tensor_slot_json);
    write_slot_object(out, "args", t.args, arg_slot_json);
    out += "\n";
    write_indent(out, 2);
    out += "}";
  }
  out += graph.tasks.empty() ? "]" : "\n  ]";
  if (graph.training) {
    const TrainingSpec& t = *graph.training;
    std::vector<std::string> fields = {"\"loss\": " + json_quote(t.loss.str())};
    if (!t.optimizer.empty()) fields.push_back("\"optimizer\": " + json_quote(t.optimizer));
    std::vector<std::string> args;
    for (const auto& a : t.optimizer_args) args.push_back(json_quote(a.name) + ": " + arg_slot_json(a));
    if (!args.empty()) fields.push_back(fmt::format("\"args\": {{{}}}", fmt::join(args, ", ")));
    if (t.precision) fields.push_back(fmt::format("\"precision\": \"{}\"", to_string(*t.precision)));
    if (t.clip_grad_norm) fields.push_back(fmt::format("\"clip_grad_norm\": {}", json_format_double(*t.clip_grad_norm)));
    if (t.accumulate_gradients) fields.push_back("\"accumulate_gradients\": true");
    if (t.loss_scale)
      fields.push_back(fmt::format(
          "\"loss_scale\": {{\"initial\": {}, \"growth_factor\": {}, \"backoff_factor\": {}, \"growth_interval\": {}}}",
          json_format_double(t.loss_scale->initial), json_format_double(t.loss_scale->growth_factor),
          json_format_double(t.loss_scale->backoff_factor), t.loss_scale->growth_interval));
    out += fmt::format(",\n  \"training\": {{{}}}", fmt::join(fields, ", "));
  }
  out += "\n}\n";
  return out;
}

}  // namespace cudagen
