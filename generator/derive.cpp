#include "derive.h"

#include <algorithm>
#include <map>
#include <set>

#include <fmt/format.h>

#include "diagnostics.h"
#include "schedule.h"

namespace cudagen {

namespace {

// The loss's gradient before any task has made it a tensor: d loss / d loss = 1.
const SlotRef kSeed{"", ""};

class Deriver {
 public:
  Deriver(const Program& p, const TrainingSpec& spec)
      : p_(p),
        spec_(spec),
        scaling_(spec.loss_scale           ? spec.loss_scale
                 : spec.precision == DType::f16 ? std::optional<LossScaling>(LossScaling{})
                                                : std::nullopt) {
    out_.graph = p.graph;
    out_.graph.training.reset();
    for (const auto& t : p.graph.tasks) ids_.insert(t.id);
  }

  DerivedGraph run() {
    // What clipping, accumulation and loss scaling act on: the gradients this pass derives, as an optimizer
    // reads them.
    std::vector<std::pair<std::string, std::string>> needs_derived;  // field, what it does
    if (spec_.clip_grad_norm) needs_derived.emplace_back("clip_grad_norm", "clips");
    if (spec_.accumulate_gradients) needs_derived.emplace_back("accumulate_gradients", "accumulates");
    if (spec_.loss_scale) needs_derived.emplace_back("loss_scale", "scales the loss for");
    else if (scaling_) needs_derived.emplace_back("precision", "(f16) scales the loss for");
    for (const auto& t : p_.graph.tasks)
      if (t.phase == Phase::backward) {  // written by hand: taken as it is
        for (const auto& [field, does] : needs_derived)
          training_error("/training/" + field,
                         fmt::format("\"{}\" {} the gradients the derive pass writes, but task '{}' is a backward task "
                                     "written by hand",
                                     field, does, t.id),
                         fmt::format("remove the backward and update tasks and let \"training\" derive them, or drop "
                                     "\"{}\"",
                                     field));
        return std::move(out_);
      }
    for (const auto& [field, does] : needs_derived)
      if (spec_.optimizer.empty())
        training_error("/training/" + field, fmt::format("\"{}\" {} what an optimizer reads, but there is none", field, does),
                       fmt::format("name one in \"optimizer\" (sgd, adam or adamw), or drop \"{}\"", field));
    const int loss = loss_buffer();
    weights_ = weights(p_);
    const Schedule order = schedule(p_);
    std::vector<int> forward;
    for (int t : order.order)
      if (p_.tasks[size_t(t)].task->phase == Phase::forward) forward.push_back(t);
    mark_requires_grad(forward);
    if (scaling_) add_loss_scale_state();
    contributions_[loss].push_back(kSeed);
    for (auto it = forward.rbegin(); it != forward.rend(); ++it) differentiate(*it);
    for (int w : weights_) {
      const BufferInfo& b = p_.buffers[size_t(w)];
      if (contributions_[w].empty())
        fail(b.owner_task, b.owner_slot,
             fmt::format("weight '{}' receives no gradient: no path leads from it to the loss '{}'", ref(w).str(),
                         spec_.loss.str()),
             "remove it, or make it persistent only if it is not trained");
      out_.gradients.emplace_back(ref(w), gradient_of(w));
    }
    if (!spec_.optimizer.empty()) {
      std::vector<SlotRef> read;  // what each weight's optimizer reads as its gradient
      for (const auto& [weight, grad] : out_.gradients)
        read.push_back(spec_.accumulate_gradients ? accumulate(weight, grad) : grad);
      const std::optional<SlotRef> scale = gradient_scale(read);
      for (size_t i = 0; i < read.size(); ++i) add_update(out_.gradients[i].first, read[i], scale);
    }
    return std::move(out_);
  }

 private:
  [[noreturn]] void fail(int task, const std::string& slot, const std::string& message, const std::string& hint = {}) {
    Diagnostics d;
    d.add(Diagnostic{{}, {}, fmt::format("/tasks/{}", task), p_.tasks[size_t(task)].task->id, slot, message, hint});
    throw CompileError(std::move(d));
  }

  [[noreturn]] void training_error(const std::string& path, const std::string& message, const std::string& hint) {
    Diagnostics d;
    d.add(Diagnostic{{}, {}, path, {}, {}, message, hint});
    throw CompileError(std::move(d));
  }

  int task_index(const std::string& id) const {
    for (size_t i = 0; i < p_.tasks.size(); ++i)
      if (p_.tasks[i].task->id == id) return int(i);
    return -1;
  }

  int loss_buffer() {
    const int t = task_index(spec_.loss.task);
    if (t < 0)
      training_error("/training/loss", fmt::format("the loss '{}' names no task", spec_.loss.str()),
                     "name a forward task's scalar output, as \"loss.loss\"");
    const BoundTensor* slot = p_.tasks[size_t(t)].find_tensor(spec_.loss.slot);
    if (slot == nullptr || !slot->sig->written())
      fail(t, spec_.loss.slot, fmt::format("the loss '{}' is not an output of task '{}'", spec_.loss.str(), spec_.loss.task));
    const BufferInfo& b = p_.buffers[size_t(slot->buffer)];
    if (numel(b.shape) != 1 || !is_floating(b.dtype))
      fail(t, spec_.loss.slot,
           fmt::format("the loss must be a floating scalar, but '{}' is {} {}", spec_.loss.str(), to_string(b.dtype),
                       shape_to_string(b.shape)),
           "reduce it first (mean, sum, or a loss op such as cross_entropy)");
    if (p_.tasks[size_t(t)].task->phase != Phase::forward)
      fail(t, spec_.loss.slot, "the loss must be computed in the forward phase");
    return slot->buffer;
  }


  void mark_requires_grad(const std::vector<int>& forward) {
    requires_grad_.insert(weights_.begin(), weights_.end());
    for (int t : forward) {
      const BoundTask& bt = p_.tasks[size_t(t)];
      if (bt.op->no_gradient) continue;  // a comparison's mask: constant almost everywhere
      bool any = false;
      for (const auto& b : bt.tensors)
        if (!b.sig->written() && requires_grad_.count(b.buffer)) any = true;
      if (!any) continue;
      for (const auto& b : bt.tensors)
        if (b.sig->written() && is_floating(p_.buffers[size_t(b.buffer)].dtype)) requires_grad_.insert(b.buffer);
    }
  }

  SlotRef ref(int buffer) const {
    const BufferInfo& b = p_.buffers[size_t(buffer)];
    return SlotRef{p_.tasks[size_t(b.owner_task)].task->id, b.owner_slot};
  }

  std::string unique_id(const std::string& base) {
    std::string id = base;
    for (int k = 2; ids_.count(id); ++k) id = fmt::format("{}_{}", base, k);
    ids_.insert(id);
    return id;
  }

  // A derived task: `inputs` bound by `from`, `outputs` owning new storage.
  struct Output {
    std::string name;
    DType dtype;
    Shape shape;
    std::optional<Storage> storage = std::nullopt;
  };
  std::string add_task(const std::string& base, const std::string& op, Phase phase,
                       const std::vector<std::pair<std::string, SlotRef>>& inputs, const std::vector<Output>& outputs,
                       const std::vector<std::pair<std::string, ArgValue>>& args = {}) {
    Task t;
    t.id = unique_id(base);
    t.op = op;
    t.phase = phase;
    for (const auto& [name, from] : inputs) t.tensors.push_back(TensorSlot{name, {}, {}, {}, from, {}});
    for (const auto& o : outputs) t.tensors.push_back(TensorSlot{o.name, o.dtype, o.shape, o.storage, {}, {}});
    for (const auto& [name, value] : args) t.args.push_back(ArgSlot{name, value, {}, false, {}});
    out_.graph.tasks.push_back(std::move(t));
    return out_.graph.tasks.back().id;
  }

  // The gradient of a buffer as one slot: its contributions summed, the seed
  // made a tensor of ones where a task must read it.
  SlotRef gradient_of(int buffer) {
    auto it = finished_.find(buffer);
    if (it != finished_.end()) return it->second;
    const BufferInfo& b = p_.buffers[size_t(buffer)];
    const std::string name = ref(buffer).task + "_" + ref(buffer).slot;
    std::vector<SlotRef> parts = contributions_[buffer];
    for (auto& part : parts)
      if (part == kSeed && scaling_)  // the loss scale: a scalar f32 like the loss, or cast to its dtype
        part = b.dtype == DType::f32 ? *loss_scale_
                                     : SlotRef{add_task("grad_" + name + "_seed", "cast", Phase::backward,
                                                        {{"x", *loss_scale_}}, {{"out", b.dtype, b.shape}}),
                                               "out"};
      else if (part == kSeed)
        part = SlotRef{add_task("grad_" + name + "_seed", "fill", Phase::backward, {}, {{"out", b.dtype, b.shape}},
                                {{"value", ArgValue(1.0)}}),
                       "out"};
    SlotRef sum = parts.front();
    for (size_t i = 1; i < parts.size(); ++i)
      sum = SlotRef{add_task("grad_" + name + "_sum", "add", Phase::backward, {{"a", sum}, {"b", parts[i]}},
                             {{"out", b.dtype, b.shape}}),
                    "out"};
    finished_[buffer] = sum;
    return sum;
  }

  // `grad` (shaped `from`) summed over the axes along which `to` was
  // broadcast, through views and sum_leading: leading axes directly; inner
  // ones (a head of keys shared by a group of query heads, [B, H, 1, T, D]
  // read as [B, H, G, T, D]) permuted to the front first.
  SlotRef unbroadcast(int task, const std::string& slot, SlotRef grad, const Shape& from, const Shape& to, DType dtype) {
    if (from == to) return grad;
    const std::string base = p_.tasks[size_t(task)].task->id + "_grad_" + slot;
    Shape core = to;
    while (!core.empty() && core.front() == 1) core.erase(core.begin());
    const bool suffix = core.size() <= from.size() && std::equal(core.begin(), core.end(), from.end() - long(core.size()));
    if (!suffix) {
      // `to` aligned to `from`'s rank; the broadcast axes, then the others.
      Shape aligned(from.size() - std::min(from.size(), to.size()), 1);
      aligned.insert(aligned.end(), to.begin(), to.end());
      if (aligned.size() != from.size())
        fail(task, slot, fmt::format("an operand of {} broadcast to {}", shape_to_string(to), shape_to_string(from)),
             "an internal error of cudagen's derive pass: please report it with the graph");
      std::vector<int64_t> dims;
      for (size_t i = 0; i < from.size(); ++i)
        if (aligned[i] == 1 && from[i] != 1) dims.push_back(int64_t(i));
      for (size_t i = 0; i < from.size(); ++i)
        if (!(aligned[i] == 1 && from[i] != 1)) dims.push_back(int64_t(i));
      Shape permuted, kept;
      for (int64_t d : dims) permuted.push_back(from[size_t(d)]);
      for (size_t i = 0; i < from.size(); ++i)
        if (!(aligned[i] == 1 && from[i] != 1)) kept.push_back(aligned[i]);
      grad = SlotRef{add_task(base + "_front", "permute", Phase::backward, {{"x", grad}}, {{"out", dtype, permuted}},
                              {{"dims", ArgValue(dims)}}),
                     "out"};
      grad = unbroadcast(task, slot, grad, permuted, kept, dtype);  // now along leading axes
      if (kept != to)
        grad = SlotRef{add_task(base + "_shape", "reshape", Phase::backward, {{"x", grad}}, {{"out", dtype, to}}), "out"};
      return grad;
    }
    const int64_t cols = numel(core), rows = numel(from) / std::max<int64_t>(cols, 1);
    const Shape matrix = {rows, cols};
    if (from != matrix)
      grad = SlotRef{add_task(base + "_rows", "reshape", Phase::backward, {{"x", grad}}, {{"out", dtype, matrix}}), "out"};
    grad = SlotRef{add_task(base + "_sum", "sum_leading", Phase::backward, {{"x", grad}}, {{"out", dtype, {cols}}}), "out"};
    if (to != Shape{cols})
      grad = SlotRef{add_task(base + "_shape", "reshape", Phase::backward, {{"x", grad}}, {{"out", dtype, to}}), "out"};
    return grad;
  }

  void contribute(int buffer, SlotRef grad) { contributions_[buffer].push_back(std::move(grad)); }

  void differentiate(int t) {
    const BoundTask& bt = p_.tasks[size_t(t)];
    bool reaches_loss = false, needs = false;
    for (const auto& b : bt.tensors) {
      if (b.sig->written() && !contributions_[b.buffer].empty()) reaches_loss = true;
      if (!b.sig->written() && requires_grad_.count(b.buffer)) needs = true;
    }
    if (!reaches_loss || !needs) return;
    // A slot updated in place holds its new value when backward runs: only
    // linked backward ops that do not read it (a BatchNorm's running
    // statistics) may follow.
    for (const auto& b : bt.tensors) {
      if (!b.sig->writes) continue;
      bool read_later = bt.op->backward.empty();
      for (const auto& name : bt.op->backward) {
        const OpSignature* linked = p_.registry.find(name);
        read_later = read_later || linked == nullptr || linked->find_tensor(b.name) != nullptr;
      }
      if (read_later)
        fail(t, b.name, fmt::format("op '{}' updates '{}' in place, so its input is gone when backward runs",
                                    bt.op->name, b.name));
    }
    if (!bt.op->backward.empty()) {
      for (const auto& name : bt.op->backward) linked_backward(t, name);
      return;
    }
    const std::string& op = bt.op->name;
    if (op == "matmul") return matmul(t);
    if (op == "add" || op == "sub" || op == "mul" || op == "div") return arithmetic(t);
    if (op == "maximum") return maximum(t);
    if (op == "reshape" || op == "transpose" || op == "split_heads" || op == "merge_heads" || op == "permute")
      return rearrangement(t);
    if (op == "concat" || op == "split") return concat_split(t);
    fail(t, "",
         fmt::format("op '{}' has no backward, and task '{}' lies on the path from a weight to the loss", op,
                     bt.task->id),
         "give its template a `backward:` op, or keep weights off this path");
  }

  const BoundTensor& slot(int t, const char* name) const {
    const BoundTensor* b = p_.tasks[size_t(t)].find_tensor(name);
    if (b == nullptr) throw std::logic_error(std::string("derive: no slot ") + name);
    return *b;
  }
  const BufferInfo& info(const BoundTensor& b) const { return p_.buffers[size_t(b.buffer)]; }
  const BufferInfo& info_of(int buffer) const { return p_.buffers[size_t(buffer)]; }
  bool needs(const BoundTensor& b) const { return requires_grad_.count(b.buffer) > 0; }

  // An op its template links, slots bound by name (see derive.h); none where
  // it computes no gradient that is needed (of several linked ops, a
  // convolution's data gradient where x needs none).
  void linked_backward(int t, const std::string& name) {
    const BoundTask& bt = p_.tasks[size_t(t)];
    const OpSignature* bw = p_.registry.find(name);
    if (bw == nullptr) fail(t, "", fmt::format("op '{}' links backward op '{}', which the registry lacks", bt.op->name, name));
    const bool one_of_several = bt.op->backward.size() > 1;
    if (one_of_several) {
      bool computes_a_needed_gradient = false;
      for (const auto& sig : bw->tensors)
        if (const BoundTensor* of = sig.written() && sig.name.size() > 1 && sig.name[0] == 'd'
                                        ? bt.find_tensor(sig.name.substr(1))
                                        : nullptr)
          computes_a_needed_gradient = computes_a_needed_gradient || needs(*of);
      if (!computes_a_needed_gradient) return;
    }
    std::vector<std::pair<std::string, SlotRef>> inputs;
    std::vector<Output> outputs;
    std::vector<std::pair<int, std::string>> produced;  // forward buffer, backward slot
    bool reads_output_gradient = false;
    for (const auto& sig : bw->tensors) {
      const bool gradient = sig.name.size() > 1 && sig.name[0] == 'd';
      const BoundTensor* forward = bt.find_tensor(sig.name);
      const BoundTensor* of = gradient ? bt.find_tensor(sig.name.substr(1)) : nullptr;
      if (sig.written()) {
        if (of == nullptr) {
          if (sig.optional) continue;
          fail(t, sig.name, fmt::format("backward op '{}' writes '{}', which names no slot of '{}' (d + a slot's name)",
                                        bw->name, sig.name, bt.op->name));
        }
        const BufferInfo& target = info(*of);
        if (!needs(*of) && sig.optional) continue;
        const auto concrete = parse_dtype(sig.dtype);
        outputs.push_back(Output{sig.name, concrete ? *concrete : target.dtype, target.shape});
        if (needs(*of)) produced.emplace_back(of->buffer, sig.name);
      } else if (forward != nullptr) {
        inputs.emplace_back(sig.name, ref(forward->buffer));
      } else if (of != nullptr && of->sig->written()) {
        if (contributions_[of->buffer].empty()) {
          if (sig.optional) continue;
          fail(t, sig.name, fmt::format("'{}' needs the gradient of '{}', which does not reach the loss", bw->name, of->name));
        }
        inputs.emplace_back(sig.name, gradient_of(of->buffer));
        reads_output_gradient = true;
      } else if (sig.optional) {
        continue;
      } else if (bt.op->find_tensor(sig.name) != nullptr) {
        fail(t, sig.name,
             fmt::format("backward op '{}' reads '{}', which task '{}' leaves out", bw->name, sig.name, bt.task->id),
             fmt::format("bind the optional slot '{}' of the forward task, so that forward saves it for backward",
                         sig.name));
      } else {
        fail(t, sig.name, fmt::format("backward op '{}' reads '{}', which is neither a slot of '{}' nor d + one",
                                      bw->name, sig.name, bt.op->name));
      }
    }
    std::vector<std::pair<std::string, ArgValue>> args;
    for (const auto& a : bw->args)
      for (const auto& fa : bt.args)
        if (fa.name == a.name) args.emplace_back(a.name, fa.value);
    // A loss's backward takes no upstream gradient: its output must be the
    // loss itself, and the mean over the loss's elements folds into `scale`.
    if (!reads_output_gradient) {
      for (const auto& b : bt.tensors)
        if (b.sig->written() && !contributions_[b.buffer].empty() &&
            (contributions_[b.buffer].size() != 1 || !(contributions_[b.buffer].front() == kSeed)))
          fail(t, b.name, fmt::format("'{}' assumes its output '{}' is the loss, but the loss is '{}'", bw->name, b.name,
                                      spec_.loss.str()));
      if (bw->find_arg("scale") != nullptr) {
        const BoundTensor* per_element = bt.find_tensor(bt.op->name == "cross_entropy" ? "labels" : "pred");
        if (per_element != nullptr) args.emplace_back("scale", ArgValue(1.0 / double(numel(info(*per_element).shape))));
      }
    }
    // One of several: named by what its op adds to the forward op's name (conv1_backward_data).
    const std::string& forward_op = bt.op->name;
    const std::string suffix = !one_of_several ? "_backward"
                               : bw->name.rfind(forward_op + "_", 0) == 0 ? bw->name.substr(forward_op.size())
                                                                          : "_" + bw->name;
    const std::string id = add_task(bt.task->id + suffix, bw->name, Phase::backward, inputs, outputs, args);
    for (const auto& [buffer, slot] : produced) {
      SlotRef grad{id, slot};
      // A loss's own backward starts the chain at 1: under loss scaling, at the scale.
      if (!reads_output_gradient && scaling_)
        grad = SlotRef{add_task(id + "_scaled", "mul", Phase::backward, {{"a", grad}, {"b", *loss_scale_}},
                                {{"out", info_of(buffer).dtype, info_of(buffer).shape}}),
                       "out"};
      contribute(buffer, grad);
    }
  }

  // out = alpha * op(a) @ op(b): da = alpha * dout @ op(b)^T, db = alpha * op(a)^T @ dout,
  // as matmuls with the transposes folded into their flags, summed over
  // broadcast batch axes.
  void matmul(int t) {
    const BoundTask& bt = p_.tasks[size_t(t)];
    auto flag = [&](const char* name) {
      for (const auto& a : bt.args)
        if (a.name == name && std::holds_alternative<bool>(a.value)) return std::get<bool>(a.value);
      return false;
    };
    double alpha = 1.0;
    for (const auto& a : bt.args)
      if (a.name == "alpha") alpha = std::holds_alternative<double>(a.value) ? std::get<double>(a.value) : double(std::get<int64_t>(a.value));
    const bool ta = flag("trans_a"), tb = flag("trans_b");
    const BoundTensor &a = slot(t, "a"), &b = slot(t, "b"), &out = slot(t, "out");
    const SlotRef dout = gradient_of(out.buffer);
    const Shape& so = info(out).shape;
    const Shape batch(so.begin(), so.end() - 2);
    auto grad_matmul = [&](const BoundTensor& target, const char* which, SlotRef x, SlotRef y, bool tx, bool ty) {
      const Shape& st = info(target).shape;
      Shape shape = batch;
      shape.push_back(st[st.size() - 2]);
      shape.push_back(st.back());
      const std::string id =
          add_task(bt.task->id + "_grad_" + which, "matmul", Phase::backward, {{"a", x}, {"b", y}},
                   {{"out", info(target).dtype, shape}},
                   {{"trans_a", ArgValue(tx)}, {"trans_b", ArgValue(ty)}, {"alpha", ArgValue(alpha)}});
      contribute(target.buffer, unbroadcast(t, which, SlotRef{id, "out"}, shape, st, info(target).dtype));
    };
    if (needs(a)) {
      if (!ta) grad_matmul(a, "a", dout, ref(b.buffer), false, !tb);
      else grad_matmul(a, "a", ref(b.buffer), dout, tb, true);
    }
    if (needs(b) && shared_weight_gradient(t, a, b, dout, batch, alpha, ta, tb)) return;
    if (needs(b)) {
      if (!tb) grad_matmul(b, "b", ref(a.buffer), dout, !ta, false);
      else grad_matmul(b, "b", dout, ref(a.buffer), true, ta);
    }
  }

  // A weight b [K, N] shared by every batch of a [..., M, K]: its gradient
  // sum_i a_i^T dout_i is one matmul over the rows of all batches,
  // a[rows, K]^T dout[rows, N], so no per-batch [..., K, N] product is
  // written and summed afterwards (a linear layer on [batch, tokens, features]).
  // The reshapes are views. Returns false where the layout does not allow it:
  // a transposed `a` (its batches are not contiguous rows) or a broadcast `a`.
  bool shared_weight_gradient(int t, const BoundTensor& a, const BoundTensor& b, SlotRef dout, const Shape& batch,
                              double alpha, bool ta, bool tb) {
    const Shape &sa = info(a).shape, &sb = info(b).shape;
    if (batch.empty() || ta || sa.size() != batch.size() + 2 || !std::equal(batch.begin(), batch.end(), sa.begin()))
      return false;
    for (size_t i = 0; i + 2 < sb.size(); ++i)
      if (sb[i] != 1) return false;
    const BoundTask& bt = p_.tasks[size_t(t)];
    const BoundTensor& out = slot(t, "out");
    const std::string base = bt.task->id + "_grad_b";
    const int64_t rows = numel(sa) / sa.back();
    auto as_rows = [&](const std::string& id, SlotRef x, const BufferInfo& of) {
      return SlotRef{add_task(id, "reshape", Phase::backward, {{"x", x}}, {{"out", of.dtype, {rows, of.shape.back()}}}),
                     "out"};
    };
    const SlotRef a_rows = as_rows(base + "_a_rows", ref(a.buffer), info(a));
    const SlotRef dout_rows = as_rows(base + "_dout_rows", dout, info(out));
    const Shape matrix = {sb[sb.size() - 2], sb.back()};
    // db = a^T dout, or for out = a b^T: db = dout^T a.
    const std::string id = add_task(base, "matmul", Phase::backward,
                                    {{"a", tb ? dout_rows : a_rows}, {"b", tb ? a_rows : dout_rows}},
                                    {{"out", info(b).dtype, matrix}},
                                    {{"trans_a", ArgValue(true)}, {"trans_b", ArgValue(false)}, {"alpha", ArgValue(alpha)}});
    SlotRef grad{id, "out"};
    if (sb != matrix)
      grad = SlotRef{add_task(base + "_shape", "reshape", Phase::backward, {{"x", grad}}, {{"out", info(b).dtype, sb}}),
                     "out"};
    contribute(b.buffer, grad);
    return true;
  }

  // add, sub, mul, div with numpy broadcasting. For out = a / b:
  // da = dout / b, db = -(dout * out) / b.
  void arithmetic(int t) {
    const BoundTask& bt = p_.tasks[size_t(t)];
    const std::string& op = bt.op->name;
    const BoundTensor &a = slot(t, "a"), &b = slot(t, "b"), &out = slot(t, "out");
    const SlotRef dout = gradient_of(out.buffer);
    const Shape& so = info(out).shape;
    for (const BoundTensor* operand : {&a, &b}) {
      if (!needs(*operand)) continue;
      const std::string which = operand->name;
      const DType dtype = info(*operand).dtype;
      SlotRef grad = dout;
      const std::string base = bt.task->id + "_grad_" + which;
      auto binary = [&](const std::string& id, const char* name, SlotRef x, SlotRef y) {
        return SlotRef{add_task(id, name, Phase::backward, {{"a", x}, {"b", y}}, {{"out", dtype, so}}), "out"};
      };
      if (op == "mul") grad = binary(base, "mul", dout, ref((operand == &a ? b : a).buffer));
      if (op == "div" && operand == &a) grad = binary(base, "div", dout, ref(b.buffer));
      if (op == "div" && operand == &b)
        grad = binary(base, "div", binary(base + "_times_out", "mul", dout, ref(out.buffer)), ref(b.buffer));
      grad = unbroadcast(t, which, grad, so, info(*operand).shape, dtype);
      if ((op == "sub" || op == "div") && operand == &b)
        grad = SlotRef{add_task(bt.task->id + "_grad_b_neg", "neg", Phase::backward, {{"x", grad}},
                                {{"out", dtype, info(b).shape}}),
                       "out"};
      contribute(operand->buffer, grad);
    }
  }

  // maximum: a maximum_backward task per operand that needs a gradient, at
  // the output's shape, then summed over the axes that operand was broadcast along.
  void maximum(int t) {
    const BoundTask& bt = p_.tasks[size_t(t)];
    const BoundTensor &a = slot(t, "a"), &b = slot(t, "b"), &out = slot(t, "out");
    const Shape& so = info(out).shape;
    for (const BoundTensor* operand : {&a, &b}) {
      if (!needs(*operand)) continue;
      const std::string which = operand->name;
      const DType dtype = info(*operand).dtype;
      const std::string id =
          add_task(bt.task->id + "_grad_" + which, "maximum_backward", Phase::backward,
                   {{"a", ref(a.buffer)}, {"b", ref(b.buffer)}, {"dout", gradient_of(out.buffer)}},
                   {{"dx", dtype, so}}, {{"wrt", ArgValue(which)}});
      contribute(operand->buffer, unbroadcast(t, which, SlotRef{id, "dx"}, so, info(*operand).shape, dtype));
    }
  }

  // concat's gradient is split along the same axis, split's is concat; a
  // split half that does not reach the loss contributes zeros.
  void concat_split(int t) {
    const BoundTask& bt = p_.tasks[size_t(t)];
    const BoundTensor &a = slot(t, "a"), &b = slot(t, "b");
    const std::string base = bt.task->id + "_grad_";
    if (bt.op->name == "concat") {
      const BoundTensor& out = slot(t, "out");
      const std::string id = add_task(base + "ab", "split", Phase::backward, {{"x", gradient_of(out.buffer)}},
                                      {{"a", info(a).dtype, info(a).shape}, {"b", info(b).dtype, info(b).shape}});
      if (needs(a)) contribute(a.buffer, SlotRef{id, "a"});
      if (needs(b)) contribute(b.buffer, SlotRef{id, "b"});
      return;
    }
    const BoundTensor& x = slot(t, "x");
    auto half = [&](const BoundTensor& h) {
      if (!contributions_[h.buffer].empty()) return gradient_of(h.buffer);
      return SlotRef{add_task(base + h.name + "_zero", "fill", Phase::backward, {}, {{"out", info(h).dtype, info(h).shape}},
                              {{"value", ArgValue(0.0)}}),
                     "out"};
    };
    const std::string id = add_task(base + "x", "concat", Phase::backward, {{"a", half(a)}, {"b", half(b)}},
                                    {{"out", info(x).dtype, info(x).shape}});
    contribute(x.buffer, SlotRef{id, "out"});
  }

  // Ops that move elements: the gradient moves them back.
  void rearrangement(int t) {
    const BoundTask& bt = p_.tasks[size_t(t)];
    const std::string& op = bt.op->name;
    const BoundTensor &x = slot(t, "x"), &out = slot(t, "out");
    const std::string inverse = op == "split_heads" ? "merge_heads" : op == "merge_heads" ? "split_heads" : op;
    std::vector<std::pair<std::string, ArgValue>> args;
    for (const auto& a : bt.args) {
      // permute's gradient permutes back: by the inverse permutation.
      const auto* dims = op == "permute" ? std::get_if<std::vector<int64_t>>(&a.value) : nullptr;
      if (dims == nullptr) {
        args.emplace_back(a.name, a.value);
        continue;
      }
      std::vector<int64_t> inverse_dims(dims->size());
      for (size_t j = 0; j < dims->size(); ++j)
        if ((*dims)[j] >= 0 && size_t((*dims)[j]) < dims->size()) inverse_dims[size_t((*dims)[j])] = int64_t(j);
      args.emplace_back(a.name, ArgValue(inverse_dims));
    }
    const std::string id = add_task(bt.task->id + "_grad_x", inverse, Phase::backward, {{"x", gradient_of(out.buffer)}},
                                    {{"out", info(x).dtype, info(x).shape}}, args);
    contribute(x.buffer, SlotRef{id, "out"});
  }

  // The buffer a weight's owning slot names.
  int buffer_of(const SlotRef& weight) const {
    for (size_t i = 0; i < p_.buffers.size(); ++i)
      if (ref(int(i)) == weight) return int(i);
    throw std::logic_error("derive: no buffer for weight " + weight.str());
  }

  // A weight's part in the ids of the tasks derived for it: its task's id,
  // with the slot where that is not "out" (w1, attn_wq).
  static std::string id_of(const SlotRef& weight) {
    return weight.slot == "out" ? weight.task : weight.task + "_" + weight.slot;
  }

  // A weight's gradient summed over a step's micro-batches: a persistent
  // buffer of the gradient's dtype (zero-filled at init, so that it has
  // storage and a defined value), which micro-batch 0 overwrites and the
  // others add to (the `accumulate` op). Every accumulate task follows the
  // first one's run-time `micro_batch`, so the caller sets it once per
  // micro-batch.
  SlotRef accumulate(const SlotRef& weight, const SlotRef& grad) {
    const BufferInfo& b = p_.buffers[size_t(buffer_of(weight))];
    const std::string name = id_of(weight);
    const SlotRef sum{add_task(name + "_grad_acc_init", "fill", Phase::init, {},
                               {{"out", b.dtype, b.shape, Storage::persistent}}, {{"value", ArgValue(0.0)}}),
                      "out"};
    Task t;
    t.id = unique_id(name + "_accumulate");
    t.op = "accumulate";
    t.phase = Phase::backward;
    t.tensors.push_back(TensorSlot{"acc", {}, {}, {}, sum, {}});
    t.tensors.push_back(TensorSlot{"grad", {}, {}, {}, grad, {}});
    if (first_accumulate_.empty()) {
      first_accumulate_ = t.id;
      t.args.push_back(ArgSlot{"micro_batch", ArgValue(int64_t(0)), {}, true, {}});
    } else {
      t.args.push_back(ArgSlot{"micro_batch", std::nullopt, SlotRef{first_accumulate_, "micro_batch"}, false, {}});
    }
    out_.graph.tasks.push_back(std::move(t));
    return sum;
  }

  // The factor every optimizer multiplies its gradient by (`gradient_scale`,
  // templates/optimizers.cuh), where one is needed: the mean over
  // micro-batches (a run-time `micro_batches`) and clipping by global norm,
  // as torch.nn.utils.clip_grad_norm_ does, from the sum of the squares of
  // every gradient `read`. A gradient's squares are summed by two row
  // reductions over a [rows, columns] view of it, a block a row, so a large
  // weight's sum spreads over the GPU and a fixed order keeps it
  // deterministic. The tasks come level by level (every first reduction,
  // every second, the total), so fusion runs each level in one launch and
  // folds the squares into the first reduction's loads (docs/architecture.md
  // §1 derive).
  std::optional<SlotRef> gradient_scale(const std::vector<SlotRef>& read) {
    if (!spec_.clip_grad_norm && !spec_.accumulate_gradients && !scaling_) return std::nullopt;
    std::vector<std::pair<std::string, SlotRef>> inputs;
    std::vector<std::pair<std::string, ArgValue>> args;
    // Loss scaling's overflow test is the sum of the scaled gradients' squares: any inf or NaN carries into it.
    if (spec_.clip_grad_norm || scaling_) inputs.emplace_back("sq_norm", squared_norm(read));
    if (scaling_) inputs.emplace_back("loss_scale", *loss_scale_);
    if (spec_.clip_grad_norm) args.emplace_back("max_norm", ArgValue(*spec_.clip_grad_norm));
    const std::string id = add_task("gradient_scale", "gradient_scale", Phase::update, inputs, {{"out", DType::f32, {}}}, args);
    if (spec_.accumulate_gradients)
      out_.graph.tasks.back().args.push_back(ArgSlot{"micro_batches", ArgValue(int64_t(1)), {}, true, {}});
    const SlotRef factor{id, "out"};
    if (scaling_) update_loss_scale(factor);
    return factor;
  }

  // Loss scaling's state, persistent scalars: the scale (the seed of every
  // gradient), the steps since the last overflow, and the optimizer steps
  // taken (Adam's bias correction counts those, not the steps tried).
  void add_loss_scale_state() {
    auto state = [&](const std::string& id, double value) {
      return SlotRef{add_task(id, "fill", Phase::init, {}, {{"out", DType::f32, {}, Storage::persistent}},
                              {{"value", ArgValue(value)}}),
                     "out"};
    };
    loss_scale_ = state("loss_scale", scaling_->initial);
    good_steps_ = state("loss_scale_good_steps", 0.0);
    optimizer_steps_ = state("optimizer_steps", 0.0);
  }

  // After the factor: an overflow (a negative factor) halves the scale (by
  // backoff_factor) and skips the step; growth_interval steps without one
  // double it (by growth_factor). The optimizers read the steps taken from
  // this task, so they run after it.
  void update_loss_scale(const SlotRef& factor) {
    Task t;
    t.id = unique_id("loss_scale_update");
    t.op = "loss_scale_update";
    t.phase = Phase::update;
    t.tensors.push_back(TensorSlot{"factor", {}, {}, {}, factor, {}});
    t.tensors.push_back(TensorSlot{"scale", {}, {}, {}, *loss_scale_, {}});
    t.tensors.push_back(TensorSlot{"good_steps", {}, {}, {}, *good_steps_, {}});
    t.tensors.push_back(TensorSlot{"steps", {}, {}, {}, *optimizer_steps_, {}});
    t.args.push_back(ArgSlot{"growth_factor", ArgValue(scaling_->growth_factor), {}, false, {}});
    t.args.push_back(ArgSlot{"backoff_factor", ArgValue(scaling_->backoff_factor), {}, false, {}});
    t.args.push_back(ArgSlot{"growth_interval", ArgValue(scaling_->growth_interval), {}, false, {}});
    optimizer_steps_ = SlotRef{t.id, "steps"};
    out_.graph.tasks.push_back(std::move(t));
  }

  // The sum of the squares of every element of every gradient, in f32.
  SlotRef squared_norm(const std::vector<SlotRef>& read) {
    auto scalar_task = [&](const std::string& id, const std::string& op, std::vector<std::pair<std::string, SlotRef>> in) {
      return SlotRef{add_task(id, op, Phase::update, in, {{"out", DType::f32, {}}}), "out"};
    };
    std::vector<std::string> names;
    std::vector<SlotRef> row_sums, sums;
    for (size_t i = 0; i < weights_.size(); ++i) {
      const BufferInfo& w = p_.buffers[size_t(weights_[i])];
      const SlotRef& weight = out_.gradients[i].first;
      names.push_back("clip_" + id_of(weight));
      const int64_t n = numel(w.shape), columns = norm_row_length(n);
      const Shape view = {n / columns, columns};
      SlotRef grad = read[i];
      if (w.dtype != DType::f32)
        grad = SlotRef{add_task(names[i] + "_f32", "cast", Phase::update, {{"x", grad}}, {{"out", DType::f32, w.shape}}),
                       "out"};
      const SlotRef rows{add_task(names[i] + "_rows", "reshape", Phase::update, {{"x", grad}}, {{"out", DType::f32, view}}),
                         "out"};
      // pow's x * x: one load of each element, where mul(rows, rows) would load it twice.
      const SlotRef squares{add_task(names[i] + "_squares", "pow", Phase::update, {{"x", rows}},
                                     {{"out", DType::f32, view}}, {{"exponent", ArgValue(2.0)}}),
                            "out"};
      row_sums.push_back(SlotRef{
          add_task(names[i] + "_row_sums", "sum", Phase::update, {{"x", squares}}, {{"out", DType::f32, {view[0]}}}),
          "out"});
    }
    for (size_t i = 0; i < weights_.size(); ++i)
      sums.push_back(scalar_task(names[i] + "_sum", "sum", {{"x", row_sums[i]}}));
    SlotRef total = sums.front();
    for (size_t i = 1; i < sums.size(); ++i) total = scalar_task("clip_total", "add", {{"a", total}, {"b", sums[i]}});
    return total;
  }

  // The length of the rows a gradient of n elements is summed in: the largest
  // divisor of n up to 4096, or n itself (one row) where that is too short to
  // keep a block busy.
  static int64_t norm_row_length(int64_t n) {
    if (n <= 4096) return std::max<int64_t>(n, 1);
    for (int64_t c = 4096; c >= 256; --c)
      if (n % c == 0) return c;
    return n;
  }

  // The optimizer task of `weight`, with its state zero-filled at init, its
  // gradient multiplied by `grad_scale` where given (gradient_scale's factor).
  void add_update(const SlotRef& weight, const SlotRef& grad, const std::optional<SlotRef>& grad_scale) {
    const BufferInfo& b = p_.buffers[size_t(buffer_of(weight))];
    const std::string name = id_of(weight);
    const OpSignature* op = p_.registry.find(spec_.optimizer);
    if (op == nullptr || (spec_.optimizer != "sgd" && spec_.optimizer != "adam" && spec_.optimizer != "adamw"))
      training_error("/training/optimizer", fmt::format("unknown optimizer '{}'", spec_.optimizer), "use sgd, adam or adamw");
    auto state = [&](const std::string& slot_name, DType dtype) {
      return SlotRef{add_task(name + "_" + slot_name + "_init", "fill", Phase::init, {},
                              {{"out", dtype, b.shape, Storage::persistent}}, {{"value", ArgValue(0.0)}}),
                     "out"};
    };
    Task t;
    t.id = unique_id(name + "_" + spec_.optimizer);
    t.op = spec_.optimizer;
    t.phase = Phase::update;
    t.tensors.push_back(TensorSlot{"param", {}, {}, {}, weight, {}});
    t.tensors.push_back(TensorSlot{"grad", {}, {}, {}, grad, {}});
    if (grad_scale) t.tensors.push_back(TensorSlot{"grad_scale", {}, {}, {}, *grad_scale, {}});
    t.args = spec_.optimizer_args;
    if (spec_.optimizer == "sgd") {
      bool momentum = false;
      for (const auto& a : spec_.optimizer_args)
        if (a.name == "momentum" && a.value) {
          if (auto* d = std::get_if<double>(&*a.value)) momentum = *d != 0.0;
          if (auto* i = std::get_if<int64_t>(&*a.value)) momentum = *i != 0;
        }
      if (momentum) t.tensors.push_back(TensorSlot{"momentum_buf", {}, {}, {}, state("momentum", b.dtype), {}});
    } else {
      t.tensors.push_back(TensorSlot{"m", {}, {}, {}, state("m", DType::f32), {}});
      t.tensors.push_back(TensorSlot{"v", {}, {}, {}, state("v", DType::f32), {}});
      bool has_step = false;
      for (const auto& a : t.args) has_step = has_step || a.name == "step";
      // Adam's bias correction counts steps: a run-time scalar the caller advances.
      if (!has_step) t.args.push_back(ArgSlot{"step", ArgValue(int64_t(1)), {}, true, {}});
      // Under loss scaling a step may be skipped, which only the device knows: it counts them.
      if (scaling_) t.tensors.push_back(TensorSlot{"step_count", {}, {}, {}, *optimizer_steps_, {}});
    }
    // One value per run-time argument for the whole optimizer: the first
    // optimizer task holds it and the others follow it, so a caller sets the
    // learning rate or the step once.
    if (first_optimizer_.empty()) {
      first_optimizer_ = t.id;
    } else {
      for (auto& a : t.args)
        if (a.runtime) a = ArgSlot{a.name, std::nullopt, SlotRef{first_optimizer_, a.name}, false, a.loc};
    }
    out_.graph.tasks.push_back(std::move(t));
  }

  const Program& p_;
  const TrainingSpec& spec_;
  const std::optional<LossScaling> scaling_;  // spec_'s, or f16's default
  std::optional<SlotRef> loss_scale_, good_steps_, optimizer_steps_;  // its state
  DerivedGraph out_;
  std::set<std::string> ids_;
  std::string first_optimizer_;   // the task that holds the optimizer's run-time arguments
  std::string first_accumulate_;  // the task that holds the run-time `micro_batch`
  std::vector<int> weights_;
  std::set<int> requires_grad_;
  std::map<int, std::vector<SlotRef>> contributions_;
  std::map<int, SlotRef> finished_;
};

}  // namespace

DerivedGraph derive_training(const Program& forward, const TrainingSpec& spec) { return Deriver(forward, spec).run(); }

}  // namespace cudagen
