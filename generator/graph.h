// The TaskGraph as the user wrote it (docs/architecture.md §2): tasks, their tensor
// slots and argument slots, and slot dependencies. Plain value types: the
// reader, the builder and the writer all produce or consume exactly this.
//
// Nothing here is checked against the op registry; `validate` does that and
// turns a TaskGraph into a typed Program.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "json.h"

namespace cudagen {

enum class DType { f32, f16, bf16, f64, i32, i64 };
enum class Phase { init, forward, backward, update };
enum class Storage { external, persistent, saved, transient };

const char* to_string(DType d);
const char* to_string(Phase p);
const char* to_string(Storage s);
std::optional<DType> parse_dtype(std::string_view s);
std::optional<Phase> parse_phase(std::string_view s);
std::optional<Storage> parse_storage(std::string_view s);
int64_t dtype_bytes(DType d);
inline bool is_floating(DType d) { return d != DType::i32 && d != DType::i64; }

using Shape = std::vector<int64_t>;
std::string shape_to_string(const Shape& shape);  // "[32, 64]"
int64_t numel(const Shape& shape);                // elements; 1 for a scalar []

// `task.slot`: the slot of another task that a slot depends on.
struct SlotRef {
  std::string task;
  std::string slot;
  std::string str() const { return task + "." + slot; }
  friend bool operator==(const SlotRef&, const SlotRef&) = default;
};
// Parses "task.slot"; nullopt when the text is not of that form.
std::optional<SlotRef> parse_slot_ref(std::string_view text);

// A tensor slot either owns storage (dtype, shape, storage class) or depends on
// another task's slot (`from`) and shares its storage. A dependent slot may
// still state dtype and shape: validation then checks them against the producer.
struct TensorSlot {
  std::string name;
  std::optional<DType> dtype;
  std::optional<Shape> shape;
  std::optional<Storage> storage;  // absent: the default for the slot's role
  std::optional<SlotRef> from;
  // An owning slot may name its tensor ("layers.0.fc.weight", as a PyTorch
  // module names its parameters): reports, the manifest, .npy files and the
  // runtime's Instance::set then use that name instead of `task.slot`.
  std::optional<std::string> tensor_name;
  // An owning slot's value, an .npy file (relative to the graph file's
  // folder): the runtime binds it before the first phase (imported weights).
  std::optional<std::string> data;
  SourceLoc loc;  // where the slot was written, when it was read from a file
};

// A typed scalar or small array given by value.
using ArgValue = std::variant<bool, int64_t, double, std::string, std::vector<int64_t>, std::vector<double>>;
std::string arg_value_to_string(const ArgValue& v);
// A bool, int or float value as a double (a bool as 0 or 1); 0 for the others.
double arg_number(const ArgValue& v);

// An argument slot is a constant, or depends on another task's argument.
// `runtime` arguments live in the arena's scalars region and may change
// between calls without recompiling (Adam's step count, a learning rate).
struct ArgSlot {
  std::string name;
  std::optional<ArgValue> value;
  std::optional<SlotRef> from;
  bool runtime = false;
  SourceLoc loc;
};

struct Task {
  std::string id;
  std::string op;
  Phase phase = Phase::forward;
  std::vector<TensorSlot> tensors;
  std::vector<ArgSlot> args;
  SourceLoc loc;

  const TensorSlot* find_tensor(std::string_view name) const;
  const ArgSlot* find_arg(std::string_view name) const;
};

// What to train (JSON "training"; docs/architecture.md §1 derive): the derive pass
// adds the backward tasks of `loss` and an optimizer task per weight.
// Dynamic loss scaling, as torch.cuda.amp.GradScaler does it: the loss's
// gradient starts at `scale` instead of 1, so that small gradients survive
// f16's range; the optimizer reads them divided by it again. A step whose
// scaled gradients overflowed is skipped and the scale multiplied by
// backoff_factor; after growth_interval steps without overflow it is
// multiplied by growth_factor. GradScaler's defaults.
struct LossScaling {
  double initial = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
};

struct TrainingSpec {
  SlotRef loss;                         // a scalar output of a forward task
  std::string optimizer;                // "sgd", "adam", "adamw"; empty: backward tasks only
  std::vector<ArgSlot> optimizer_args;  // lr, momentum, beta1, beta2, eps, weight_decay
  // The precision policy (generator/autocast.h): the 16-bit dtype the
  // forward and backward compute in where PyTorch's autocast would, with the
  // weights and the optimizer in f32. Absent (or f32): every task computes
  // in the dtypes the graph declares.
  std::optional<DType> precision;
  // Clips the gradients to this global L2 norm before the optimizer reads
  // them, as torch.nn.utils.clip_grad_norm_ does. Absent: no clipping.
  std::optional<double> clip_grad_norm;
  // Sums each gradient over a step's micro-batches in a persistent buffer
  // that the optimizer reads as their mean; the micro-batch count is chosen
  // at run time (Instance::step). Off: the optimizer reads each step's
  // gradients as backward leaves them.
  bool accumulate_gradients = false;
  // Absent: none, except under "precision": "f16", which scales dynamically
  // with the defaults.
  std::optional<LossScaling> loss_scale;
  SourceLoc loc;
};

struct TaskGraph {
  std::string name;
  std::vector<Task> tasks;
  std::optional<TrainingSpec> training;
  // The folder of the file the graph was read from ("" for the working
  // directory): relative `data` paths resolve against it. Not part of the
  // graph's text.
  std::string base_dir;

  const Task* find_task(std::string_view id) const;
};

// Ids of tasks and slots become C identifiers in generated code.
bool is_identifier(std::string_view s);
// A tensor's own name (`"name"` of a slot) becomes a file name: letters,
// digits, '_', '.', '-', not starting with '.' or '-'.
bool is_tensor_name(std::string_view s);

}  // namespace cudagen
