#include "fuse.h"

#include <algorithm>
#include <map>
#include <set>
#include <unordered_map>

#include <fmt/format.h>

#include "plan.h"  // view_pairs

namespace cudagen {

namespace {

bool is_view(const BoundTask& bt) { return !bt.op->view.first.empty(); }

// The one output slot of a task, or nullptr.
const BoundTensor* only_output(const BoundTask& bt) {
  const BoundTensor* out = nullptr;
  for (const auto& b : bt.tensors)
    if (b.sig != nullptr && b.sig->role == SlotRole::output) {
      if (out != nullptr) return nullptr;
      out = &b;
    }
  return out;
}

// The rule under which a chain of elementwise tasks may follow task `t` in
// its kernel, as an epilogue on the elements of its op's epilogue slot
// (OpSignature::epilogue). Empty for other ops.
FusionRule epilogue_rule(const BoundTask& bt) {
  if (bt.op->epilogue.empty() || bt.find_tensor(bt.op->epilogue) == nullptr) return FusionRule::none;
  // A row op's block stores its row; anything else with the hook (a matmul,
  // a convolution's implicit GEMM) stores from its tile's accumulators.
  return bt.op->pattern == PatternKind::reduction ? FusionRule::reduction_epilogue : FusionRule::matmul_epilogue;
}

// The value of a task that the next task of its kernel may read: an
// elementwise task's one output, an epilogue anchor's epilogue slot.
const BoundTensor* group_value(const BoundTask& bt) {
  if (epilogue_rule(bt) != FusionRule::none) return bt.find_tensor(bt.op->epilogue);
  return only_output(bt);
}

// The first argument of task `t` that lives in the scalars region (a kernel
// parameter of its own, named after the argument), or empty.
std::string runtime_arg(const Program& p, int t) {
  for (const auto& a : p.tasks[size_t(t)].args)
    if (const BoundArg* root = root_arg(p, t, a.name).second; root != nullptr && root->runtime) return a.name;
  return {};
}

// Why task `t` cannot be part of an elementwise chain (empty when it can);
// `front`: as the chain's first task.
std::string chain_gap(const Program& p, int t, bool front = false) {
  const BoundTask& bt = p.tasks[size_t(t)];
  const OpSignature& op = *bt.op;
  if (op.pattern != PatternKind::elementwise && op.pattern != PatternKind::broadcast)
    return fmt::format("'{}' is a {} op", bt.task->id, to_string(op.pattern));
  if (op.source_file.empty()) return fmt::format("'{}' ({}) has no template", bt.task->id, op.name);
  for (const auto& sig : op.tensors)
    if (sig.writes || sig.role == SlotRole::scratch)
      return fmt::format("'{}' ({}) updates slot '{}' in place", bt.task->id, op.name, sig.name);
  if (only_output(bt) == nullptr) return fmt::format("'{}' ({}) has more than one output", bt.task->id, op.name);
  // One task's run-time arguments per kernel for now: the first's (the
  // kernel reads them into locals named as the arguments; dropout's mask).
  if (const std::string a = runtime_arg(p, t); !a.empty() && !front)
    return fmt::format("'{}' reads run-time argument '{}', and only a kernel's first task may", bt.task->id, a);
  return {};
}

// The notes on why tasks stay apart, as the passes write and withdraw them,
// indexed by the task each is about and by the task before it: finding or
// withdrawing a task's notes costs what that task has, not what the graph
// has (scanning the list made fusing 10^5 matmul chains quadratic).
class NoteBook {
 public:
  void add(FusionNote note) {
    by_task_[note.task].push_back(notes_.size());
    by_previous_[note.previous].push_back(notes_.size());
    notes_.push_back(std::move(note));
    live_.push_back(true);
  }
  // The first live note about `task` that `match` accepts, or nullptr.
  template <class Match>
  FusionNote* find(int task, Match match) {
    if (const auto at = by_task_.find(task); at != by_task_.end())
      for (size_t i : at->second)
        if (live_[i] && match(notes_[i])) return &notes_[i];
    return nullptr;
  }
  // Withdraws the live notes about `task` that `match` accepts.
  template <class Match>
  void withdraw(int task, Match match) {
    if (const auto at = by_task_.find(task); at != by_task_.end())
      for (size_t i : at->second)
        if (match(notes_[i])) live_[i] = false;
  }
  void withdraw(int task) {
    withdraw(task, [](const FusionNote&) { return true; });
  }
  // Withdraws the notes whose task before is `previous`.
  void withdraw_after(int previous) {
    if (const auto at = by_previous_.find(previous); at != by_previous_.end())
      for (size_t i : at->second) live_[i] = false;
  }
  // The live notes, in the order they were written.
  std::vector<FusionNote> take() {
    std::vector<FusionNote> kept;
    for (size_t i = 0; i < notes_.size(); ++i)
      if (live_[i]) kept.push_back(std::move(notes_[i]));
    return kept;
  }

 private:
  std::vector<FusionNote> notes_;
  std::vector<bool> live_;
  std::unordered_map<int, std::vector<size_t>> by_task_, by_previous_;
};

class Fuser {
 public:
  Fuser(const Program& p, const FuseOptions& options) : p_(p), options_(options), readers_(p.buffers.size()) {
    for (const auto& [view, source] : view_pairs(p_)) view_source_[view] = source;
    for (size_t t = 0; t < p.tasks.size(); ++t)
      for (const auto& b : p.tasks[t].tensors)
        if (b.buffer >= 0 && p.buffers[size_t(b.buffer)].owner_task != int(t)) readers_[size_t(b.buffer)].push_back(int(t));
  }

  Fusion run(const Schedule& schedule) {
    for (int t : schedule.order) {
      if (is_view(p_.tasks[size_t(t)])) continue;  // storage only, no kernel
      if (const int into = host_kernel(t); into >= 0 && options_.enabled) {
        KernelGroup& group = out_.kernels[size_t(into)];
        const std::string reason = why_not_join(group, t);
        if (reason.empty()) {
          if (group.rule != FusionRule::attention)
            group.rule = is_op(p_.tasks[size_t(t)], BundledOp::softmax) ? FusionRule::attention : group_rule(group.tasks.front());
          group.tasks.push_back(t);
          note_writes(t, into);
          continue;
        }
        notes_.add(FusionNote{t, group.tasks.back(), reason});
      }
      const Task& task = *p_.tasks[size_t(t)].task;
      if (out_.kernels.empty() || out_.kernels.back().phase != task.phase) phase_start_ = int(out_.kernels.size());
      out_.kernels.push_back(KernelGroup{"k" + std::to_string(out_.kernels.size()) + "_" + task.id, task.phase, {t}, {}, {}});
      note_writes(t, int(out_.kernels.size()) - 1);
    }
    for (auto& group : out_.kernels) find_internal(group);
    if (options_.enabled) {
      fold_prologues();
      fuse_attention_backward();
      sum_matmuls();
      chain_matmuls();
      reduce_rows();
      project_into_attention();
    }
    for (size_t k = 0; k < out_.kernels.size(); ++k) {
      KernelGroup& kernel = out_.kernels[k];
      kernel.name = "k" + std::to_string(k) + "_" + p_.tasks[size_t(kernel.tasks.front())].task->id;
      kernel.ir = kir::build(p_, kernel);
      kernel.flash = flash_tile(kernel, kernel.flash_roles, kernel.why_not_flash);
      kernel.gemm = gemm_mainloop(kernel);
    }
    batch_launches();
    out_.notes = notes_.take();
    return std::move(out_);
  }

  private:
  bool rule_on(FusionRule rule) const {
    return std::find(options_.disabled_rules.begin(), options_.disabled_rules.end(), to_string(rule)) ==
           options_.disabled_rules.end();
  }

  const BufferInfo& value_of(int t) const { return p_.buffers[size_t(group_value(p_.tasks[size_t(t)])->buffer)]; }

  // The rule of a kernel that starts with task `t`: an elementwise chain, or
  // an epilogue after a matmul or a row op; empty when nothing may follow it.
  FusionRule group_rule(int t) const {
    if (chain_gap(p_, t, /*front=*/true).empty()) return FusionRule::elementwise_chain;
    return epilogue_rule(p_.tasks[size_t(t)]);
  }

  // Whether task `t` is a gather whose inverse map the registry has a
  // template for (rule permuted_store).
  bool permutation(int t) const {
    const std::string& inverse = p_.tasks[size_t(t)].op->inverse;
    if (inverse.empty()) return false;
    const OpSignature* op = p_.registry.find(inverse);
    return op != nullptr && !op->source_file.empty();
  }

  // Rule permuted_store: gather `t` after a matmul or row op's kernel, on a
  // value it computes.
  std::string why_not_store_permuted(const KernelGroup& group, FusionRule rule, int t) const {
    if (rule == FusionRule::elementwise_chain)
      return fmt::format("'{}' is a gather op; only a matmul's or a row op's kernel stores permuted",
                         p_.tasks[size_t(t)].task->id);
    if (!rule_on(FusionRule::permuted_store)) return "rule permuted_store is off (--no-fuse-rule)";
    const BoundTensor* x = nullptr;
    for (const auto& b : p_.tasks[size_t(t)].tensors)
      if (b.sig != nullptr && !b.sig->written()) x = &b;
    for (int task : group.tasks)
      if (x != nullptr && group_value(p_.tasks[size_t(task)])->buffer == x->buffer) return {};
    return "it reads nothing the kernel computes";
  }

  // The task whose value an epilogue chain runs on: the first, or in an
  // attention kernel the matmul by the values (the softmax until it joins).
  int anchor(const KernelGroup& group) const {
    if (group.rule != FusionRule::attention) return group.tasks.front();
    const size_t softmax = attention_softmax_at(group);
    return group.tasks[std::min(softmax + 1, group.tasks.size() - 1)];
  }
  // Where an attention kernel's softmax lies in its tasks: after its scores
  // (and the add of a bias to them, where there is one).
  size_t attention_softmax_at(const KernelGroup& group) const {
    for (size_t i = 0; i < group.tasks.size(); ++i)
      if (is_op(p_.tasks[size_t(group.tasks[i])], BundledOp::softmax)) return i;
    return group.tasks.size() - 1;
  }

  // Whether every argument of task `t` is a constant (the attention
  // kernel's arguments decide its code).
  bool constant_args(int t) const { return runtime_arg(p_, t).empty(); }
  bool flag(int t, const char* arg) const { return flag_value(root_arg(p_, t, arg).second); }
  const BufferInfo& slot_buffer(int t, const char* slot) const {
    return p_.buffers[size_t(p_.tasks[size_t(t)].find_tensor(slot)->buffer)];
  }

  // Rule attention, first step: softmax `t` after the scores matmul
  // alpha * q k^T, each of [..., T, D] with the same leading axes (k's 1
  // where a group of query heads shares them), or after an add of a bias to
  // the scores (an attention mask or a position bias: the epilogue of the
  // scores so far, group [scores, add]), which the row kernels add to each
  // score as they compute it.
  std::string why_not_attention_softmax(const KernelGroup& group, int t) const {
    const int scores = group.tasks.front(), bias = group.tasks.size() == 2 ? group.tasks[1] : -1;
    const std::string& id = p_.tasks[size_t(t)].task->id;
    const int scores_out = p_.tasks[size_t(scores)].find_tensor("out")->buffer;
    if (p_.tasks[size_t(t)].find_tensor("x")->buffer != p_.tasks[size_t(bias >= 0 ? bias : scores)].find_tensor("out")->buffer)
      return "it reads nothing the kernel computes";
    if (!rule_on(FusionRule::attention)) return "rule attention is off (--no-fuse-rule)";
    if (bias >= 0) {
      const BoundTask& add = p_.tasks[size_t(bias)];
      if (add.find_tensor("a")->buffer == add.find_tensor("b")->buffer)
        return fmt::format("'{}' is a reduction op; attention adds a bias to its scores, not the scores to themselves", id);
      if (slot_buffer(scores, "out").storage != Storage::transient || readers_[size_t(scores_out)].size() != 1)
        return fmt::format("'{}' is a reduction op; attention keeps the scores before their bias, which are read elsewhere",
                           id);
    }
    if (!flag(scores, "trans_b") || flag(scores, "trans_a"))
      return fmt::format("'{}' is a reduction op; attention fuses a softmax after a * b^T only", id);
    const Shape& q = slot_buffer(scores, "a").shape;
    const Shape& k = slot_buffer(scores, "b").shape;
    // (k with 1 where q has a group of heads is grouped-query attention: each
    // query head reads its group's head of keys and values.)
    if (q.size() < 2 || k.size() != q.size() || !shared_by_groups(q, k))
      return fmt::format("'{}' is a reduction op; attention needs keys with q's leading axes, or 1 where a group of "
                         "query heads shares them",
                         id);
    if (slot_buffer(scores, "out").storage != Storage::transient || readers_[size_t(p_.tasks[size_t(t)].find_tensor("x")->buffer)].size() != 1)
      return fmt::format("'{}' is a reduction op; attention keeps the scores, which are read elsewhere", id);
    if (!constant_args(scores) || !constant_args(t)) return fmt::format("'{}' reads a run-time argument", id);
    // The row kernel holds a row of scores, and the query row, in one warp's
    // shared memory; the flash kernel takes any number of keys, and so does
    // the streamed row kernel, with query and output rows of up to 1024.
    if (k[k.size() - 2] > kMaxAttentionKeys || q.back() > kMaxAttentionKeys) {
      std::string why_not_flash;
      const bool flash = flash_attention_tile_of(p_, scores, t, options_.megakernel, &why_not_flash, options_.target, false,
                                                 options_.allow_tf32)
                             .has_value();
      if (!flash && q.back() > kMaxAttentionKeys)
        return fmt::format("'{}' is a reduction op; the row kernels hold a query row of at most {} values per warp, and "
                           "the flash kernel does not apply: {}",
                           id, kMaxAttentionKeys, why_not_flash);
      // Only the values' matmul completes the kernel: it must join.
      const std::vector<int>& readers = readers_[size_t(p_.tasks[size_t(t)].find_tensor("out")->buffer)];
      KernelGroup so_far;
      so_far.rule = FusionRule::attention;
      so_far.tasks = bias >= 0 ? std::vector<int>{scores, bias, t} : std::vector<int>{scores, t};
      std::string reason = readers.empty() ? "nothing reads the probabilities" : why_not_attention_values(so_far, readers.front());
      if (!reason.empty())
        return fmt::format("'{}' is a reduction op; over {} keys an attention kernel must take the values' matmul, and {}",
                           id, kMaxAttentionKeys, reason);
      if (!flash && slot_buffer(readers.front(), "b").shape.back() > kMaxAttentionKeys)
        return fmt::format("'{}' is a reduction op; the streamed row kernel holds an output row of at most {} values per "
                           "warp, and the flash kernel does not apply: {}",
                           id, kMaxAttentionKeys, why_not_flash);
    }
    return {};
  }

  // Rule attention, second step: the matmul of the probabilities by the
  // values, [..., T, Dv] with the same leading axes.
  std::string why_not_attention_values(const KernelGroup& group, int t) const {
    const BoundTask& bt = p_.tasks[size_t(t)];
    const int softmax = group.tasks.back();
    if (!is_op(bt, BundledOp::matmul) || bt.find_tensor("a")->buffer != p_.tasks[size_t(softmax)].find_tensor("out")->buffer)
      return fmt::format("an attention kernel takes the matmul of its probabilities next, not '{}'", bt.task->id);
    if (flag(t, "trans_a") || flag(t, "trans_b"))
      return fmt::format("'{}' transposes an operand; attention multiplies the probabilities by the values as they are",
                         bt.task->id);
    const Shape& v = slot_buffer(t, "b").shape;
    const Shape& q = slot_buffer(group.tasks.front(), "a").shape;
    const Shape& k = slot_buffer(group.tasks.front(), "b").shape;
    if (v.size() != q.size() || !std::equal(k.begin(), k.end() - 2, v.begin()) || v[v.size() - 2] != k[k.size() - 2])
      return fmt::format("'{}' reads values of another shape than the keys'", bt.task->id);
    if (!constant_args(t)) return fmt::format("'{}' reads a run-time argument", bt.task->id);
    return {};
  }

  std::string why_not_join(const KernelGroup& group, int t) const {
    if (is_op(p_.tasks[size_t(t)], BundledOp::softmax) && is_op(p_.tasks[size_t(group.tasks.front())], BundledOp::matmul) &&
        (group.tasks.size() == 1 || (group.tasks.size() == 2 && is_op(p_.tasks[size_t(group.tasks[1])], BundledOp::add))))
      return why_not_attention_softmax(group, t);
    if (group.rule == FusionRule::attention && is_op(p_.tasks[size_t(group.tasks.back())], BundledOp::softmax))
      return why_not_attention_values(group, t);
    const int front = anchor(group);
    const FusionRule rule = group_rule(front);
    if (rule == FusionRule::none) return "the kernel before takes no more tasks: " + chain_gap(p_, front, /*front=*/true);
    if (group.tasks.size() > 1 && permutation(group.tasks.back()))
      return "the kernel before ends with a permuted store: its elements are no longer the task's";
    if (permutation(t)) return why_not_store_permuted(group, rule, t);
    if (std::string gap = chain_gap(p_, t); !gap.empty()) return gap;
    if (!rule_on(rule)) return fmt::format("rule {} is off (--no-fuse-rule)", to_string(rule));
    const Shape& domain = value_of(front).shape;
    const Shape& shape = value_of(t).shape;
    if (shape != domain)
      return fmt::format("its output is {}, the kernel's elements are {}", shape_to_string(shape), shape_to_string(domain));
    bool reads_group = false;
    for (const auto& b : p_.tasks[size_t(t)].tensors) {
      if (b.buffer < 0 || b.source_task < 0) continue;
      const int producer = p_.buffers[size_t(b.buffer)].owner_task;
      // (An input the owner only reads, such as a graph input another task
      // reads too, is no value the kernel computes: shares_input below.)
      if (contains(group.tasks, producer) && writes(producer, b.buffer)) {
        // An attention kernel's scores and probabilities live per row, in one warp's shared memory.
        if (const auto kept_per_row = group.tasks.begin() + attention_softmax_at(group) + 1;
            group.rule == FusionRule::attention && std::find(group.tasks.begin(), kept_per_row, producer) != kept_per_row)
          return fmt::format("it reads '{}', which the attention kernel keeps per row", buffer_name(p_, b.buffer));
        // Another output of a row op (rmsnorm's rstd) is stored by one thread
        // of the row's block: not a value the element's thread holds.
        if (group_value(p_.tasks[size_t(producer)])->buffer != b.buffer)
          return fmt::format("it reads '{}', which the kernel stores from another thread", buffer_name(p_, b.buffer));
        reads_group = true;
      }
      // A view of a value the kernel computes would be a second pointer to memory it writes.
      if (is_view(p_.tasks[size_t(producer)]))
        for (const auto& source : p_.tasks[size_t(producer)].tensors)
          if (source.buffer >= 0 && contains(group.tasks, p_.buffers[size_t(source.buffer)].owner_task) &&
              source.buffer != b.buffer)
            return fmt::format("it reads '{}', a view of what the kernel computes", b.name);
    }
    if (!reads_group) {
      // A sibling: it reads, at its own elements, an input that a task of the
      // loop reads too; the loop loads it once for both (multi-output).
      if (rule == FusionRule::elementwise_chain && shares_input(group, t, domain)) return {};
      return rule == FusionRule::elementwise_chain ? "it reads nothing the kernel computes or reads"
                                         : "it reads nothing the kernel computes";
    }
    return {};
  }

  bool writes(int t, int buffer) const {
    for (const auto& b : p_.tasks[size_t(t)].tensors)
      if (b.buffer == buffer && b.sig != nullptr && b.sig->written()) return true;
    return false;
  }

  // Whether task `t` reads a tensor of shape `domain` (element i at index i)
  // that a task of `group` reads too.
  bool shares_input(const KernelGroup& group, int t, const Shape& domain) const {
    auto inputs = [&](int task) {
      std::vector<int> buffers;
      for (const auto& b : p_.tasks[size_t(task)].tensors)
        if (b.buffer >= 0 && b.sig != nullptr && !b.sig->written() && p_.buffers[size_t(b.buffer)].shape == domain)
          buffers.push_back(b.buffer);
      return buffers;
    };
    const std::vector<int> mine = inputs(t);
    for (int task : group.tasks)
      for (int b : inputs(task))
        if (contains(mine, b)) return true;
    return false;
  }

  // The kernel task `t` may join: the latest kernel of its phase that
  // computes something it reads, even with kernels after it (the schedule
  // interleaves independent work: a gradient's matmul, then another matmul,
  // then the activation gradient that reads the first). Moving `t` ahead of
  // those kernels is safe when it reads nothing they write, in place
  // included; they cannot read what `t` writes, coming before it. Without
  // such a producer, the last kernel of the phase (whose note then says why
  // not). -1 for the first kernel of a phase.
  int host_kernel(int t) const {
    const Phase phase = p_.tasks[size_t(t)].task->phase;
    if (out_.kernels.empty() || out_.kernels.back().phase != phase) return -1;
    const int last = int(out_.kernels.size()) - 1;
    // The latest kernel of the phase that writes a buffer `t` reads (a view's
    // storage included), and whether it computes one of them there (an
    // output, not an in-place update). Looked up per buffer, so that joining
    // costs what the task reads, not what the phase holds.
    int writer = -1;
    bool produces = false;
    for (const auto& b : p_.tasks[size_t(t)].tensors) {
      if (b.buffer < 0 || b.sig == nullptr || b.sig->written()) continue;
      for (int x = b.buffer;;) {
        if (const auto w = last_writer_.find(x); w != last_writer_.end() && w->second.kernel >= phase_start_) {
          if (w->second.kernel > writer) {
            writer = w->second.kernel;
            produces = false;
          }
          if (w->second.kernel == writer) produces = produces || w->second.as_output;
        }
        const auto source = view_source_.find(x);
        if (source == view_source_.end()) break;
        x = source->second;
      }
    }
    if (writer < 0) return last;
    return produces ? writer : last;  // updated in place there: `t` must stay after it
  }

  // Records the buffers task `t` writes, now in kernel `k`, for host_kernel.
  void note_writes(int t, int k) {
    for (const auto& b : p_.tasks[size_t(t)].tensors) {
      if (b.buffer < 0 || b.sig == nullptr || !b.sig->written()) continue;
      const bool as_output = b.sig->role == SlotRole::output;
      auto [w, added] = last_writer_.try_emplace(b.buffer, Writer{k, as_output});
      if (added) continue;
      if (w->second.kernel == k) {
        w->second.as_output = w->second.as_output || as_output;
      } else {
        w->second = Writer{k, as_output};
      }
    }
  }

  // The storage a buffer stands for: a view's is its source's.
  int storage_of(int b) const {
    for (auto it = view_source_.find(b); it != view_source_.end(); it = view_source_.find(b)) b = it->second;
    return b;
  }

  // What a kernel reads and writes in the arena, as storage (not its
  // internal values, which no other kernel sees).
  struct Access {
    std::vector<int> reads, writes;
    // Its run-time arguments, each as the (task, argument) that holds it: an
    // argument that follows another's (`from`) is that one's scalar.
    std::set<std::pair<int, std::string>> scalars;
  };
  Access access_of(const KernelGroup& k) const {
    Access a;
    for (int t : kernel_tasks(k)) {
      for (const auto& b : p_.tasks[size_t(t)].tensors) {
        if (b.buffer < 0 || b.sig == nullptr || contains(k.internal_buffers, b.buffer)) continue;
        const int storage = storage_of(b.buffer);
        if (b.sig->written()) a.writes.push_back(storage);
        if (!b.sig->written() || b.sig->writes) a.reads.push_back(storage);
      }
      for (const auto& arg : p_.tasks[size_t(t)].args)
        if (arg.runtime) a.scalars.insert(arg.source_task >= 0 ? std::make_pair(arg.source_task, arg.source_arg)
                                                                : std::make_pair(t, arg.name));
    }
    return a;
  }

  // Why a kernel with access `a` cannot run at the same time as kernel
  // `other` (empty when it can).
  std::string conflict(const Access& a, const KernelGroup& other, const Access& o) const {
    for (int b : a.reads)
      if (contains(o.writes, b)) return fmt::format("it reads '{}', which {} writes", buffer_name(p_, b), other.name);
    for (int b : a.writes) {
      if (contains(o.writes, b)) return fmt::format("it writes '{}', which {} writes", buffer_name(p_, b), other.name);
      if (contains(o.reads, b)) return fmt::format("it writes '{}', which {} reads", buffer_name(p_, b), other.name);
    }
    return {};
  }

  // Rule horizontal: each kernel joins the launch of the kernel before it
  // when it is of the same phase and conflicts with no kernel of that launch.
  // Only adjacent kernels: the schedule's order stays, and with it the
  // buffers' lifetimes (the planner sees a launch as one step).
  void batch_launches() {
    std::vector<Access> access;
    for (const auto& k : out_.kernels) access.push_back(access_of(k));
    int launch = -1;
    size_t first = 0;    // the first kernel of the current launch
    int parameters = 0;  // the current launch's, about as the emitter passes them
    std::set<int> passed;  // the buffers the current launch takes: one parameter each, however many read them
    std::set<std::pair<int, std::string>> passed_scalars;  // and its run-time arguments, likewise
    for (size_t k = 0; k < out_.kernels.size(); ++k) {
      KernelGroup& kernel = out_.kernels[k];
      const Access& a = access[k];
      std::set<int> touched(a.reads.begin(), a.reads.end());  // a slot updated in place is one parameter
      touched.insert(a.writes.begin(), a.writes.end());
      const int alone = int(a.scalars.size() + touched.size());
      int own = 0;
      for (int b : touched) own += passed.count(b) ? 0 : 1;
      for (const auto& s : a.scalars) own += passed_scalars.count(s) ? 0 : 1;
      if (k > 0 && out_.kernels[k - 1].phase == kernel.phase && options_.enabled) {
        std::string reason;
        size_t against = k - 1;
        if (!rule_on(FusionRule::horizontal))
          reason = "rule horizontal is off (--no-fuse-rule)";
        else if (kernel.gemm.launched_alone())
          reason = fmt::format("it runs the {} matmul mainloop, in a launch of its own", kernel.gemm.name());
        else if (out_.kernels[first].gemm.launched_alone())
          reason = fmt::format("{} runs the {} matmul mainloop, in a launch of its own", out_.kernels[first].name,
                               out_.kernels[first].gemm.name());
        else if (splits_batchnorm(kernel))
          reason = "it runs a channels-last BatchNorm, whose statistics use the workspace, in a launch of its own";
        else if (splits_batchnorm(out_.kernels[first]))
          reason = fmt::format("{} runs a channels-last BatchNorm, in a launch of its own", out_.kernels[first].name);
        else if (runs_flash(kernel))
          reason = "it runs the flash attention kernel, in a launch of its own";
        else if (runs_flash(out_.kernels[first]))
          reason = fmt::format("{} runs the flash attention kernel, in a launch of its own", out_.kernels[first].name);
        else if (parameters + own > kMaxLaunchParameters)
          reason = fmt::format("the launch would take more than {} parameters", kMaxLaunchParameters);
        for (size_t j = first; j < k && reason.empty(); ++j) {
          reason = conflict(a, out_.kernels[j], access[j]);
          against = j;
        }
        if (reason.empty()) {
          kernel.launch = launch;
          parameters += own;
          passed.insert(touched.begin(), touched.end());
          passed_scalars.insert(a.scalars.begin(), a.scalars.end());
          continue;
        }
        out_.launch_notes.push_back(FusionNote{kernel.tasks.front(), out_.kernels[against].tasks.front(), reason});
      }
      kernel.launch = ++launch;
      first = k;
      parameters = alone;
      passed = std::move(touched);
      passed_scalars = a.scalars;
    }
  }
  // Whether kernel `k` is a channels-last BatchNorm (or its gradient) whose
  // pixels split over blocks: its partial statistics share the split-K
  // workspace, which another kernel of its launch could overwrite.
  bool splits_batchnorm(const KernelGroup& k) const {
    return is_batchnorm_nhwc(p_.tasks[size_t(k.tasks.front())]) &&
           batchnorm_nhwc_split(p_, k.tasks.front(), options_.target, options_.megakernel).splits > 1;
  }
  // The matmul mainloop settled kernel `k` runs (KernelGroup::gemm): a
  // matmul with at most an epilogue, reading its operands as stored.
  // A convolution on channels-last tensors, or one of its gradients, is
  // such a matmul too (its implicit GEMM), with at most an epilogue.
  GemmMainloop gemm_mainloop(const KernelGroup& k) const {
    const bool convolution = is_convolution_gemm(p_.tasks[size_t(k.tasks.front())]);
    if (k.ir.mainloop != kir::Mainloop::gemm && !convolution) return {};
    const std::string refused = options_.megakernel  ? "a megakernel's tiles share one block size"
                                : !k.prologue.empty() ? "a prologue computes its operand"
                                                      : std::string();
    return convolution ? conv_gemm_mainloop_of(p_, k.tasks.front(), gemm_options(), refused)
                       : gemm_mainloop_of(p_, k.tasks.front(), gemm_options(), refused);
  }
  GemmOptions gemm_options() const {
    return GemmOptions{.target = options_.target, .allow_tf32 = options_.allow_tf32, .allow_stream_k = options_.stream_k};
  }
  // The flash tile settled kernel `k` runs (KernelGroup::flash), or nullopt:
  // an attention kernel whose scores come first (no projections computed in
  // it) on the flash kernel; a flash_trained gradient kernel on the backward
  // kernel, in the atomic mode where asked for and it applies (dq and a key
  // or value gradient present, square tiles).
  // An attention kernel without one gets the reason in `why_not` (describe).
  std::optional<FlashAttentionTile> flash_tile(const KernelGroup& k, FlashTraining& roles, std::string& why_not) const {
    // (Its tasks by their stages' roles in its IR, kir.h.)
    if (k.rule == FusionRule::attention && !attention_alone(k)) why_not = "the kernel computes its projections' heads itself";
    if (attention_alone(k)) {
      const int scores = kir::role_task(k.ir, "scores"), softmax = kir::role_task(k.ir, "softmax");
      std::optional<FlashAttentionTile> tile = flash_attention_tile_of(
          p_, scores, softmax, options_.megakernel, &why_not, options_.target, k.flash_trained, options_.allow_tf32);
      // Probabilities saved for a backward pass: why the pair of flash
      // kernels does not apply says more than that the backward pass reads them.
      const BufferInfo& probs = p_.buffers[size_t(p_.tasks[size_t(softmax)].find_tensor("out")->buffer)];
      if (!tile && !k.flash_trained && probs.storage == Storage::saved) {
        std::string why_not_trained;
        why_not = !flash_attention_tile_of(p_, scores, softmax, options_.megakernel, &why_not_trained, options_.target,
                                           true, options_.allow_tf32)
                      ? why_not_trained
                      : "its gradient tasks do not run on the flash backward kernel, so the probabilities are stored "
                        "for them";
      }
      if (tile) why_not.clear();
      return tile;
    }
    if (!k.flash_trained || k.rule != FusionRule::attention_backward) return std::nullopt;
    auto task = [&](const char* role) { return kir::role_task(k.ir, role); };
    roles = FlashTraining{.dp = task("dp"), .ds = task("ds"), .dq = task("dq"), .dk = task("dk"), .dv = task("dv")};
    const bool atomic = options_.atomic_attention_backward && roles.dq >= 0 && (roles.dk >= 0 || roles.dv >= 0);
    return flash_backward_tile_of(p_, roles, options_.megakernel, nullptr, options_.target, atomic, options_.allow_tf32);
  }
  // Whether settled kernel `k` runs a flash attention kernel, forward or
  // (trained) backward: it has a flash tile (flash_tile, set before launches are batched).
  static bool runs_flash(const KernelGroup& k) { return k.flash.has_value(); }
  // "Hopper", "pipelined" or "SIMT" where matmul task `t` would run on that
  // mainloop given its kernel alone without a prologue; empty otherwise.
  std::string mainloop_of(int t) const {
    return gemm_mainloop_of(p_, t, gemm_options(), options_.megakernel ? "a megakernel" : "").name();
  }
  // A kernel's parameters are limited (4 KiB on every device since Volta);
  // far below that, a launch of this many pointers is no longer small.
  static constexpr int kMaxLaunchParameters = 64;

  // Rule norm_prologue: a kernel that is one rmsnorm or layernorm, whose
  // output only matmuls read in its phase, each as the left operand of the
  // first task of its kernel, runs in those kernels instead: each
  // normalises the rows of its tile
  // (emit_matmul.cpp: staged in shared memory, or element by element as it loads
  // them). Each element is then computed once per column tile of each
  // reader, as often as the matmul loads it anyway.
  void fold_prologues() {
    std::vector<bool> folded(out_.kernels.size(), false);
    for (size_t k = 0; k < out_.kernels.size(); ++k) {
      const KernelGroup& kernel = out_.kernels[k];
      const int norm = kernel.tasks.front();
      if (p_.tasks[size_t(norm)].op->norm.empty()) continue;
      const int value = p_.tasks[size_t(norm)].find_tensor("out")->buffer;
      std::vector<int> readers;  // the matmuls reading it as their `a`: what the rule is about
      for (int r : readers_[size_t(value)])
        if (is_op(p_.tasks[size_t(r)], BundledOp::matmul) && p_.tasks[size_t(r)].find_tensor("a")->buffer == value)
          readers.push_back(r);
      if (readers.empty()) continue;
      std::vector<size_t> hosts;
      const std::string reason = why_not_prologue(k, value, hosts);
      if (!reason.empty()) {
        note_prologue_refused({norm}, readers, reason);
        continue;
      }
      // Read later (saved for backward, or by the caller), with its
      // statistics: the first reader's kernel stores them, the others keep
      // them to themselves.
      const bool stored = stores_prologue(norm, value);
      for (size_t h : hosts) {
        out_.kernels[h].prologue.push_back(norm);
        if (stored && h == hosts.front()) continue;
        for (int b : written_buffers({norm}))  // out, and its statistics where bound
          out_.kernels[h].internal_buffers.push_back(b);
      }
      folded[k] = true;
      // The norm has no kernel left, to have joined another or for its readers to have joined.
      notes_.withdraw(norm);
      notes_.withdraw_after(norm);
    }
    // Then the elementwise chains, into matmuls and row ops (a norm folded
    // above is no host: prologues do not nest).
    for (size_t k = 0; k < out_.kernels.size(); ++k)
      if (!folded[k] && group_rule(out_.kernels[k].tasks.front()) == FusionRule::elementwise_chain)
        folded[k] = fold_elementwise_prologue(k, folded);
    drop_kernels(folded);
  }

  // Removes the kernels marked in `dropped` (folded into others).
  void drop_kernels(const std::vector<bool>& dropped) {
    std::vector<KernelGroup> kept;
    for (size_t k = 0; k < out_.kernels.size(); ++k)
      if (!dropped[k]) kept.push_back(std::move(out_.kernels[k]));
    out_.kernels = std::move(kept);
  }

  // Rule matmul_sum: a matmul's kernel whose epilogue starts by adding
  // the product of another matmul of the same output shape (a tensor that
  // several matmuls read gets the sum of their gradients: a transformer's
  // normalised input, read by q, k and v) takes that matmul in: one product
  // over the concatenated inner dimensions, a @ b + c @ d, each tile's
  // accumulator taking every term's k in turn (emit_matmul.cpp). The other term
  // (itself a sum, where three or more add up) runs where the add did, and
  // neither product nor partial sum reaches memory.
  void sum_matmuls() {
    std::vector<bool> merged(out_.kernels.size(), false);
    for (size_t b = 0; b < out_.kernels.size(); ++b) {
      KernelGroup& kernel = out_.kernels[b];
      if (kernel.rule != FusionRule::matmul_epilogue || kernel.tasks.size() < 2) continue;
      const int mm = kernel.tasks[0], add = kernel.tasks[1];
      if (!is_op(p_.tasks[size_t(mm)], BundledOp::matmul) || !is_op(p_.tasks[size_t(add)], BundledOp::add)) continue;
      // The add's other operand: the value of an earlier kernel that is a matmul, or a sum of them.
      const int product = p_.tasks[size_t(mm)].find_tensor("out")->buffer;
      int other = -1;
      for (const char* slot : {"a", "b"})
        if (const int x = p_.tasks[size_t(add)].find_tensor(slot)->buffer; x != product) other = x;
      if (other < 0 || p_.buffers[size_t(other)].owner_task < 0) continue;
      const size_t a = kernel_of(p_.buffers[size_t(other)].owner_task, 0);
      if (a >= b || merged[a]) continue;
      const KernelGroup& term = out_.kernels[a];
      const bool a_sum = term.rule == FusionRule::matmul_sum && matmul_sum_terms(p_, term).epilogue == term.tasks.size();
      if ((term.tasks.size() != 1 && !a_sum) || !is_op(p_.tasks[size_t(term.tasks.front())], BundledOp::matmul) ||
          group_value(p_.tasks[size_t(term.tasks.back())])->buffer != other)
        continue;
      if (const std::string reason = why_not_sum_matmuls(a, b, other); !reason.empty()) {
        note_prologue_refused(term.tasks, {mm}, reason, "is not summed in its kernel");
        continue;
      }
      const std::vector<int> term_tasks = term.tasks;
      std::vector<int> tasks = term.tasks;
      tasks.insert(tasks.end(), kernel.tasks.begin(), kernel.tasks.end());
      kernel.tasks = std::move(tasks);
      kernel.rule = FusionRule::matmul_sum;
      kernel.internal_buffers.clear();
      find_internal(kernel);
      merged[a] = true;
      // It joined the term's kernel: its note on why not is moot (a prologue's refusal still holds).
      notes_.withdraw(mm, [&](const FusionNote& n) { return contains(term_tasks, n.previous); });
    }
    drop_kernels(merged);
  }

  // Why the matmul (or sum of matmuls) of kernel `a`, whose value `other`
  // the first epilogue task of matmul kernel `b` adds, cannot run in kernel
  // `b` (empty when it can).
  std::string why_not_sum_matmuls(size_t a, size_t b, int other) const {
    if (!rule_on(FusionRule::matmul_sum)) return "rule matmul_sum is off (--no-fuse-rule)";
    const KernelGroup& term = out_.kernels[a];
    const KernelGroup& kernel = out_.kernels[b];
    const int mm = kernel.tasks[0], add = kernel.tasks[1];
    const std::string& add_id = p_.tasks[size_t(add)].task->id;
    // Only the sum exists in the kernel: each term (or partial sum) must be read by its add alone.
    for (int value : {other, p_.tasks[size_t(mm)].find_tensor("out")->buffer}) {
      if (readers_[size_t(value)] != std::vector<int>{add})
        return fmt::format("'{}' is read by more than '{}', so it is stored", buffer_name(p_, value), add_id);
      if (p_.buffers[size_t(value)].storage != Storage::transient)
        return fmt::format("'{}' is read after its phase or by the caller, so it is stored", buffer_name(p_, value));
    }
    for (const KernelGroup* k : {&term, &kernel})
      if (!k->prologue.empty())
        return fmt::format("'{}' computes a prologue; a sum's loads compute none", p_.tasks[size_t(k->tasks.front())].task->id);
    const Shape& shape = slot_buffer(mm, "out").shape;
    if (slot_buffer(add, "out").shape != shape || p_.buffers[size_t(other)].shape != shape)
      return fmt::format("'{}' broadcasts: its operands and output are not all {}", add_id, shape_to_string(shape));
    std::vector<int> terms;
    for (int t : term.tasks)
      if (is_op(p_.tasks[size_t(t)], BundledOp::matmul)) terms.push_back(t);
    terms.push_back(mm);
    if (terms.size() > kMaxSumTerms)
      return fmt::format("the sum would have {} terms (at most {})", terms.size(), kMaxSumTerms);
    for (int t : terms) {
      const std::string& id = p_.tasks[size_t(t)].task->id;
      if (const std::string why = why_not_rows_matmul(t, "a sum of matmuls"); !why.empty()) return why;
      if (const std::string arg = runtime_arg(p_, t); !arg.empty())
        return fmt::format("'{}' reads run-time argument '{}'", id, arg);
      // One tile and one accumulator for all: the same operand types and alpha.
      if (slot_buffer(t, "a").dtype != slot_buffer(mm, "a").dtype || slot_buffer(t, "b").dtype != slot_buffer(mm, "b").dtype ||
          slot_buffer(t, "out").dtype != slot_buffer(mm, "out").dtype)
        return fmt::format("'{}' and '{}' multiply different types", id, p_.tasks[size_t(mm)].task->id);
      if (alpha_of(t) != alpha_of(mm))
        return fmt::format("'{}' and '{}' scale their products differently (alpha)", id, p_.tasks[size_t(mm)].task->id);
    }
    // The term runs where the add did: nothing between may write what it
    // reads, nor touch what it writes (only the add reads its value: checked
    // above; this also covers an in-place update).
    return conflict_when_moved(a, a + 1, b);
  }

  // Why kernel `moved` cannot run on the other side of the kernels in
  // [first, last), but those in `skip` (the rules that move a kernel into a
  // later or an earlier one): one writes what the other reads or writes.
  // Empty when it can.
  std::string conflict_when_moved(size_t moved, size_t first, size_t last, const std::vector<size_t>& skip = {}) const {
    const Access m = access_of(out_.kernels[moved]);
    const std::string& id = p_.tasks[size_t(out_.kernels[moved].tasks.front())].task->id;
    for (size_t j = first; j < last; ++j) {
      if (std::find(skip.begin(), skip.end(), j) != skip.end()) continue;
      const Access o = access_of(out_.kernels[j]);
      const std::string& other = p_.tasks[size_t(out_.kernels[j].tasks.front())].task->id;
      for (int b : m.reads)
        if (contains(o.writes, b))
          return fmt::format("'{}' reads '{}', which '{}' writes in between", id, buffer_name(p_, b), other);
      for (int b : m.writes)
        if (contains(o.writes, b) || contains(o.reads, b))
          return fmt::format("'{}' writes '{}', which '{}' uses in between", id, buffer_name(p_, b), other);
    }
    return {};
  }
  // The terms' loads pick each one's operands by k: a short chain of branches.
  static constexpr size_t kMaxSumTerms = 8;
  double alpha_of(int matmul) const { return number_value(root_arg(p_, matmul, "alpha").second, 1.0); }

  // Rule matmul_chain: a matmul's kernel (with its prologue and epilogue)
  // joins the kernel of the first matmul of its phase that reads its value
  // as the left operand: each block computes its rows of the value, every
  // column of them, into shared memory, then its rows of the second product
  // from there (emit_matmul.cpp). The value (an MLP's hidden activation) reaches
  // memory only where something else reads it. The merged kernel runs where
  // the second did: its other operands may come from the kernels between.
  void chain_matmuls() {
    std::vector<bool> merged(out_.kernels.size(), false);
    for (size_t a = 0; a < out_.kernels.size(); ++a) {
      const KernelGroup& first = out_.kernels[a];
      const int mm = first.tasks.front();
      if (!is_op(p_.tasks[size_t(mm)], BundledOp::matmul) || (first.tasks.size() > 1 && first.rule != FusionRule::matmul_epilogue) ||
          permutation(first.tasks.back()))
        continue;
      // The value: what the kernel's last task computes; the second matmul:
      // the first of its phase to read it as its left operand.
      const int value = group_value(p_.tasks[size_t(first.tasks.back())])->buffer;
      int r = -1;
      size_t b = out_.kernels.size();
      for (int reader : readers_[size_t(value)]) {
        // (prologue_operand: "a" for a matmul reading it as `a` alone.)
        if (p_.tasks[size_t(reader)].task->phase != first.phase || prologue_operand(reader, value) != "a") continue;
        if (const size_t k = kernel_of(reader, a + 1); k < b) {
          b = k;
          r = reader;
        }
      }
      if (r < 0) continue;
      if (const std::string reason = why_not_chain(a, b, r, value); !reason.empty()) {
        note_prologue_refused(first.tasks, {r}, reason, "is not chained to it");
        continue;
      }
      KernelGroup& second = out_.kernels[b];
      KernelGroup chain = first;
      chain.tasks.insert(chain.tasks.end(), second.tasks.begin(), second.tasks.end());
      chain.rule = FusionRule::matmul_chain;
      chain.internal_buffers.insert(chain.internal_buffers.end(), second.internal_buffers.begin(),
                                    second.internal_buffers.end());
      // Read by the second matmul alone, the value never reaches memory;
      // read later too (a weight gradient, the backward pass), it is stored
      // as well, once.
      if (readers_[size_t(value)] == std::vector<int>{r} && p_.buffers[size_t(value)].storage == Storage::transient)
        chain.internal_buffers.push_back(value);
      second = std::move(chain);
      merged[a] = true;
      notes_.withdraw(r);  // it joined
    }
    drop_kernels(merged);
  }

  // Rule row_reduction: the kernels that only reduce a matmul kernel's value
  // over its rows (a bias gradient's sum over rows, a weight gradient
  // a^T @ value) run in that kernel instead: each block keeps a column tile
  // of the value, walking every tile of rows in turn, and accumulates its
  // columns of each reduction as it goes (emit_matmul.cpp), so the value (an
  // activation's gradient) never reaches memory unless read elsewhere. The
  // merged kernel runs where the matmul's did: the reductions' other
  // operands must be ready by then.
  void reduce_rows() {
    std::vector<bool> merged(out_.kernels.size(), false);
    for (size_t a = 0; a < out_.kernels.size(); ++a) {
      KernelGroup& producer = out_.kernels[a];
      const int mm = producer.tasks.front();
      if (merged[a] || !is_op(p_.tasks[size_t(mm)], BundledOp::matmul) ||
          (producer.tasks.size() > 1 && producer.rule != FusionRule::matmul_epilogue) || permutation(producer.tasks.back()))
        continue;
      const int value = group_value(p_.tasks[size_t(producer.tasks.back())])->buffer;
      const std::vector<int> value_tasks = producer.tasks;  // the matmul and its epilogue; the last names the value
      int64_t registers = 0;  // per thread, the accumulators of the reductions taken so far
      for (int r : readers_[size_t(value)]) {
        const size_t at = kernel_of(r, a + 1);
        if (p_.tasks[size_t(r)].task->phase != producer.phase || at >= out_.kernels.size() || merged[at] ||
            !row_reduction_of(r, value))
          continue;
        const std::string reason = why_not_reduce_rows(a, at, r, value, registers);
        if (!reason.empty()) {
          note_prologue_refused(value_tasks, {r}, reason, "is not reduced in its kernel");
          continue;
        }
        registers += row_reduction_registers(row_reduction_outputs(r), slot_buffer(mm, "a").dtype);
        producer.tasks.push_back(r);
        producer.rule = FusionRule::row_reduction;
        merged[at] = true;
        notes_.withdraw(r);  // it joined
      }
      if (producer.rule == FusionRule::row_reduction) {
        producer.internal_buffers.clear();
        find_internal(producer);
      }
    }
    drop_kernels(merged);
  }

  // Whether task `r` reduces buffer `value` over its rows as rule
  // row_reduction takes it: a sum over every axis but the last
  // (sum_leading), or a weight gradient a^T @ value (`value` as the right
  // operand, `a` transposed), both of 2-D operands or a sum of any rank.
  bool row_reduction_of(int r, int value) const {
    const BoundTask& bt = p_.tasks[size_t(r)];
    if (is_op(bt, BundledOp::sum_leading)) return bt.find_tensor("x")->buffer == value;
    return is_op(bt, BundledOp::matmul) && bt.find_tensor("b")->buffer == value && flag(r, "trans_a") &&
           bt.find_tensor("a")->buffer != value;
  }
  // Its outputs per column of the value: 1 for a sum, K for a^T @ value.
  int64_t row_reduction_outputs(int r) const {
    if (is_op(p_.tasks[size_t(r)], BundledOp::sum_leading)) return 1;
    return slot_buffer(r, "out").shape.front();
  }

  // Why reduction `r` (kernel `at`) cannot run in matmul kernel `a`, whose
  // value is `value` and whose reductions so far take `registers`
  // accumulators per thread (empty when it can).
  std::string why_not_reduce_rows(size_t a, size_t at, int r, int value, int64_t registers) const {
    if (!rule_on(FusionRule::row_reduction)) return "rule row_reduction is off (--no-fuse-rule)";
    const KernelGroup& producer = out_.kernels[a];
    const KernelGroup& reader = out_.kernels[at];
    const int mm = producer.tasks.front();
    const std::string& id = p_.tasks[size_t(r)].task->id;
    if (reader.tasks.size() != 1 || !reader.prologue.empty()) return fmt::format("'{}' is not alone in its kernel", id);
    if (!producer.prologue.empty())
      return fmt::format("'{}' computes a prologue, which each tile of rows would recompute", p_.tasks[size_t(mm)].task->id);
    if (const std::string why = why_not_rows_matmul(mm, "a row reduction"); !why.empty()) return why;
    for (int t : {mm, r})
      if (const std::string arg = runtime_arg(p_, t); !arg.empty())
        return fmt::format("'{}' reads run-time argument '{}'", p_.tasks[size_t(t)].task->id, arg);
    const BufferInfo& info = p_.buffers[size_t(value)];
    const int64_t N = info.shape.back(), rows = numel(info.shape) / N;
    // The reduction moves to the value's kernel: what it reads must not be
    // written from there to its own place (in place updates are writes too),
    // and the value must not be updated in place before it either.
    std::vector<int> read = {storage_of(value)};
    if (is_op(p_.tasks[size_t(r)], BundledOp::matmul)) {
      const Shape& x = slot_buffer(r, "a").shape;
      if (x.size() != 2 || info.shape.size() != 2)
        return fmt::format("'{}' multiplies batches of matrices; a weight gradient here is [R, K]^T @ [R, N]", id);
      if (flag(r, "trans_b")) return fmt::format("'{}' transposes '{}'", id, buffer_name(p_, value));
      read.push_back(storage_of(p_.tasks[size_t(r)].find_tensor("a")->buffer));
    }
    for (size_t j = a; j < at; ++j)
      for (int written : written_buffers(kernel_tasks(out_.kernels[j]))) {
        const int storage = storage_of(written);
        if (!contains(read, storage) || (j == a && storage == read.front())) continue;  // the value's own kernel computes it
        const std::string writer = j == a ? std::string("the value's kernel")
                                          : fmt::format("'{}'", p_.tasks[size_t(out_.kernels[j].tasks.front())].task->id);
        return fmt::format("'{}' reads '{}', which {} writes before it", id, buffer_name(p_, written), writer);
      }
    // Each block walks every tile of rows of its columns: bounded, as the
    // parallelism of the value's own tiles is lost.
    const DType a_type = slot_buffer(mm, "a").dtype;
    const int64_t tile = matmul_tile_rows(a_type), row_tiles = (rows + tile - 1) / tile;
    if (row_tiles > kMaxReductionRowTiles)
      return fmt::format("each block would walk {} tiles of rows of '{}' one after another (at most {}): the value's "
                         "parallel tiles are worth more than its traffic",
                         row_tiles, buffer_name(p_, value), kMaxReductionRowTiles);
    // A thread keeps its outputs of every reduction in registers.
    const int64_t per_thread = registers + row_reduction_registers(row_reduction_outputs(r), a_type);
    if (per_thread > kMaxReductionOutputsPerThread)
      return fmt::format("each thread would accumulate {} outputs of the reductions (at most {})", per_thread,
                         kMaxReductionOutputsPerThread);
    // Shared memory: the operand tiles, a tile of the value, and each weight
    // gradient's rows of x for the tile (the emitter's regions, 16-byte aligned).
    std::vector<int64_t> x_widths;
    for (int t : producer.tasks)
      if (t != mm && is_op(p_.tasks[size_t(t)], BundledOp::matmul)) x_widths.push_back(row_reduction_outputs(t));
    if (is_op(p_.tasks[size_t(r)], BundledOp::matmul)) x_widths.push_back(row_reduction_outputs(r));
    const int64_t bytes = row_reduction_shared(a_type, info.dtype, x_widths).layout.bytes();
    if (bytes > kSharedBytesWithoutOptIn)
      return fmt::format("the operand tiles, a tile of '{}' and the rows the weight gradients read take {} bytes of "
                         "shared memory, more than {}",
                         buffer_name(p_, value), bytes, kSharedBytesWithoutOptIn);
    return {};
  }
  static constexpr int64_t kMaxReductionRowTiles = 16;
  static constexpr int64_t kMaxReductionOutputsPerThread = 16;

  // Rule attention_backward: the gradient tasks of an attention, as the
  // derive pass writes them (kernels.h: dp = dcontext v^T, ds =
  // softmax_backward(probs, dp), then dq = ds k, dk = ds^T q, dv = probs^T
  // dcontext where derived), run in one kernel, a block per head (emit_attention.cpp):
  // dp and ds never leave it, and the block's sums over its query rows
  // give the key and value gradients without atomics. Their kernels (each
  // gradient's with its epilogue, such as its head merge) become one, which
  // runs where the first of them did.
  void fuse_attention_backward() {
    std::vector<bool> merged(out_.kernels.size(), false);
    for (size_t s = 0; s < out_.kernels.size(); ++s) {
      const int ds = out_.kernels[s].tasks.front();
      if (merged[s] || !is_op(p_.tasks[size_t(ds)], BundledOp::softmax_backward)) continue;
      // An attention's gradient: the softmax's dout is dcontext v^T.
      const int dp = p_.buffers[size_t(p_.tasks[size_t(ds)].find_tensor("dout")->buffer)].owner_task;
      if (dp < 0 || !is_op(p_.tasks[size_t(dp)], BundledOp::matmul) || !flag(dp, "trans_b") || flag(dp, "trans_a")) continue;
      std::vector<size_t> members;
      std::optional<FlashTraining> flash;
      if (const std::string reason = why_not_attention_backward(s, dp, merged, members, flash); !reason.empty()) {
        const std::string why = fmt::format("'{}' runs in no attention_backward kernel: {}", p_.tasks[size_t(ds)].task->id, reason);
        FusionNote* it = notes_.find(ds, [](const FusionNote&) { return true; });
        if (it == nullptr)
          notes_.add(FusionNote{ds, dp, why});
        else
          it->reason += "; " + why;
        continue;
      }
      std::sort(members.begin(), members.end());
      KernelGroup& host = out_.kernels[members.front()];
      std::vector<int> tasks;
      for (size_t m : members) {
        const std::vector<int>& more = out_.kernels[m].tasks;
        tasks.insert(tasks.end(), more.begin(), more.end());
        if (m != members.front()) {
          merged[m] = true;
          // It joined: why it did not join the kernel before it is moot.
          notes_.withdraw(more.front());
        }
      }
      host.tasks = std::move(tasks);
      host.rule = FusionRule::attention_backward;
      host.internal_buffers.clear();
      find_internal(host);
      if (flash) {  // the probabilities are recomputed, never stored
        const int probs = p_.tasks[size_t(flash->ds)].find_tensor("out")->buffer;
        KernelGroup& forward = out_.kernels[kernel_of(flash->scores, 0)];
        for (KernelGroup* k : {&host, &forward}) {
          k->flash_trained = true;
          if (!contains(k->internal_buffers, probs)) k->internal_buffers.push_back(probs);
        }
      }
    }
    drop_kernels(merged);
  }

  // Why softmax_backward kernel `s`, whose dout matmul `dp` computes, and
  // the kernels of the other gradients of its attention cannot be one
  // kernel (empty when they can; `members` then holds their kernels).
  std::string why_not_attention_backward(size_t s, int dp, const std::vector<bool>& merged, std::vector<size_t>& members,
                                         std::optional<FlashTraining>& flash) const {
    if (!rule_on(FusionRule::attention_backward)) return "rule attention_backward is off (--no-fuse-rule)";
    const int ds = out_.kernels[s].tasks.front();
    const BoundTask& softmax = p_.tasks[size_t(ds)];
    const Phase phase = softmax.task->phase;
    const int probs = softmax.find_tensor("out")->buffer, dp_value = softmax.find_tensor("dout")->buffer;
    const int ds_value = softmax.find_tensor("dx")->buffer;
    if (out_.kernels[s].tasks.size() > 1) return fmt::format("'{}' runs an epilogue", softmax.task->id);
    // dp and ds live in the kernel: read by nothing else.
    for (int value : {dp_value, ds_value})
      if (p_.buffers[size_t(value)].storage != Storage::transient)
        return fmt::format("'{}' is read after its phase or by the caller, so it is stored", buffer_name(p_, value));
    if (readers_[size_t(dp_value)] != std::vector<int>{ds})
      return fmt::format("'{}' is read by more than '{}'", buffer_name(p_, dp_value), softmax.task->id);
    int dq = -1, dk = -1, dv = -1;
    for (int r : readers_[size_t(ds_value)]) {
      const BoundTask& reader = p_.tasks[size_t(r)];
      int& role = flag(r, "trans_a") ? dk : dq;
      if (!is_op(reader, BundledOp::matmul) || reader.find_tensor("a")->buffer != ds_value ||
          reader.find_tensor("b")->buffer == ds_value || flag(r, "trans_b") || role >= 0)
        return fmt::format("'{}' reads '{}' otherwise than as ds k or ds^T q", reader.task->id, buffer_name(p_, ds_value));
      role = r;
    }
    if (dq < 0 && dk < 0) return fmt::format("nothing reads '{}'", buffer_name(p_, ds_value));
    const int dout = p_.tasks[size_t(dp)].find_tensor("a")->buffer;
    for (int r : readers_[size_t(probs)])
      if (dv < 0 && p_.tasks[size_t(r)].task->phase == phase && is_op(p_.tasks[size_t(r)], BundledOp::matmul) &&
          flag(r, "trans_a") && !flag(r, "trans_b") && p_.tasks[size_t(r)].find_tensor("a")->buffer == probs &&
          p_.tasks[size_t(r)].find_tensor("b")->buffer == dout)
        dv = r;
    // Shapes: probs [..., Tq, Tk], dcontext [..., Tq, Dv], v [..., Tk, Dv],
    // k [..., Tk, D], q [..., Tq, D], all with the same leading axes; k's
    // and v's may be 1 where q's are not (grouped-query attention: a head of
    // keys and values for a group of query heads; dk and dv come out per
    // query head, and the tasks after them sum each group).
    const Shape& sp = p_.buffers[size_t(probs)].shape;
    if (sp.size() < 2) return fmt::format("'{}' is not a batch of matrices", buffer_name(p_, probs));
    const int64_t Tq = sp[sp.size() - 2], Tk = sp.back();
    const Shape lead(sp.begin(), sp.end() - 2);
    auto fits = [&](int b, int64_t rows, bool shared_by_a_group = false) {
      const Shape& x = p_.buffers[size_t(b)].shape;
      if (x.size() != sp.size() || x[x.size() - 2] != rows) return false;
      return shared_by_a_group ? shared_by_groups(sp, x) : std::equal(lead.begin(), lead.end(), x.begin());
    };
    const int v = p_.tasks[size_t(dp)].find_tensor("b")->buffer;
    if (!fits(dout, Tq) || !fits(v, Tk, true) || p_.buffers[size_t(v)].shape.back() != p_.buffers[size_t(dout)].shape.back())
      return fmt::format("'{}' is not the gradient of a matmul of '{}' by values of its keys' rows",
                         p_.tasks[size_t(dp)].task->id, buffer_name(p_, probs));
    int64_t D = 0;
    for (int r : {dq, dk}) {
      if (r < 0) continue;
      const int operand = p_.tasks[size_t(r)].find_tensor("b")->buffer;
      if (!fits(operand, r == dq ? Tk : Tq, r == dq) || (D > 0 && p_.buffers[size_t(operand)].shape.back() != D))
        return fmt::format("'{}' multiplies '{}' by '{}', not the keys or queries of its rows", p_.tasks[size_t(r)].task->id,
                           buffer_name(p_, ds_value), buffer_name(p_, operand));
      // (The kernels read a query head's keys and values at one head: k's leading axes are v's.)
      const Shape& x = p_.buffers[size_t(operand)].shape;
      const Shape& values = p_.buffers[size_t(v)].shape;
      if (r == dq && !std::equal(x.begin(), x.end() - 2, values.begin()))
        return fmt::format("'{}' multiplies '{}' by keys '{}' of other heads than the values '{}'",
                           p_.tasks[size_t(r)].task->id, buffer_name(p_, ds_value), buffer_name(p_, operand),
                           buffer_name(p_, v));
      D = p_.buffers[size_t(operand)].shape.back();
    }
    const int64_t Dv = p_.buffers[size_t(v)].shape.back();
    // The kernels: each gradient first in its own, a matmul's followed by its epilogue at most.
    std::vector<int> anchors = {dp, ds};
    for (int r : {dq, dk, dv})
      if (r >= 0) anchors.push_back(r);
    for (int t : anchors) {
      const size_t at = kernel_of(t, 0);
      const KernelGroup& kernel = out_.kernels[at];
      const std::string& id = p_.tasks[size_t(t)].task->id;
      if (p_.tasks[size_t(t)].task->phase != phase) return fmt::format("'{}' runs in another phase", id);
      if (merged[at] || kernel.tasks.front() != t) return fmt::format("'{}' is not the first task of its kernel", id);
      if (!kernel.prologue.empty()) return fmt::format("'{}' computes a prologue", id);
      if ((kernel.tasks.size() > 1 && kernel.rule != FusionRule::matmul_epilogue) || (t == dp && kernel.tasks.size() > 1))
        return fmt::format("'{}' is followed by more than an epilogue on its gradient", id);
      if (!constant_args(t)) return fmt::format("'{}' reads a run-time argument", id);
      members.push_back(at);
    }
    // Within the kernel, values flow from dp to ds and from ds to dq and dk
    // only: an epilogue that reads another gradient (q and k one tensor: the
    // derive pass adds dq and dk), or an operand another gradient computes,
    // would read it before it exists.
    for (size_t m : members) {
      const std::vector<int> written = written_buffers(out_.kernels[m].tasks);
      for (size_t other : members) {
        if (other == m) continue;
        for (int t : out_.kernels[other].tasks)
          for (const auto& in : p_.tasks[size_t(t)].tensors) {
            if (in.buffer < 0 || in.sig == nullptr || in.sig->written()) continue;
            const bool flows = (t == ds && in.buffer == dp_value) || ((t == dq || t == dk) && in.buffer == ds_value);
            for (int w : written)
              if (!flows && storage_of(w) == storage_of(in.buffer))
                return fmt::format("'{}' reads '{}', which the kernel would compute for another gradient",
                                   p_.tasks[size_t(t)].task->id, buffer_name(p_, in.buffer));
          }
      }
    }
    // The kernel runs where the first of them did: nothing between may
    // write what a later one reads, nor touch what it writes.
    const size_t first = *std::min_element(members.begin(), members.end());
    for (size_t m : members)
      if (std::string reason = conflict_when_moved(m, first + 1, m, members); !reason.empty()) return reason;
    // Flash attention trained: the probabilities recomputed from each row's
    // log-sum-exp, at any length (its forward kernel must be the flash
    // kernel, alone: no projections computed in it).
    FlashTraining roles{.dp = dp, .ds = ds, .dq = dq, .dk = dk, .dv = dv};
    std::string why_not_flash;
    if (flash_backward_tile_of(p_, roles, options_.megakernel, &why_not_flash, options_.target, false, options_.allow_tf32)) {
      const size_t at = kernel_of(roles.scores, 0);
      const KernelGroup& forward = out_.kernels[std::min(at, out_.kernels.size() - 1)];
      if (at < out_.kernels.size() && forward.rule == FusionRule::attention && forward.tasks.size() >= 3 && forward.tasks[0] == roles.scores &&
          forward.tasks[1] == roles.softmax && forward.tasks[2] == roles.values) {
        flash = roles;
        return {};
      }
      why_not_flash = fmt::format("the kernel of '{}' is not the flash attention kernel", p_.tasks[size_t(roles.scores)].task->id);
    }
    // Otherwise the row kernel (why not flash: `describe` lists it). A block
    // walks its head's query rows: bounded (kernels.h).
    const int64_t row_tiles = (Tq + kAttentionBackwardRows - 1) / kAttentionBackwardRows;
    if (row_tiles > kMaxAttentionBackwardRowTiles)
      return fmt::format("each block would walk {} tiles of {} query rows one after another (at most {}); not the flash "
                         "backward kernel: {}",
                         row_tiles, kAttentionBackwardRows, kMaxAttentionBackwardRowTiles, why_not_flash);
    // A block holds its head's gradients of the keys and values in registers, and its rows in shared memory.
    const int64_t registers = attention_backward_registers(Tk, D, Dv, dk >= 0, dv >= 0);
    if (registers > kMaxAttentionBackwardRegisters)
      return fmt::format("each thread would accumulate {} elements of the key and value gradients (at most {}); not the "
                         "flash backward kernel: {}",
                         registers, kMaxAttentionBackwardRegisters, why_not_flash);
    const int64_t bytes = attention_backward_shared(Tk, D, Dv, dq >= 0, dk >= 0).layout.bytes();
    if (bytes > kSharedBytesWithoutOptIn)
      return fmt::format("the head's keys and values and a tile of {} query rows take {} bytes of shared memory, more "
                         "than {}; not the flash backward kernel: {}",
                         kAttentionBackwardRows, bytes, kSharedBytesWithoutOptIn, why_not_flash);
    return {};
  }
  static constexpr int64_t kMaxAttentionBackwardRegisters = 32;

  // Rule attention_projection: the kernel of a projection whose heads only
  // an attention kernel reads (a matmul, its norm prologue and epilogue,
  // then split_heads: q, k or v) runs in that kernel instead. Each block
  // stages its batch's input rows (normalised) in shared memory and computes
  // its head's keys and values, and its own query rows, from there
  // (emit_attention.cpp); the heads reach memory only where read later. A block then
  // runs a whole head, its warps taking the query rows in turn: bounded
  // below, with the projection outputs per block.
  void project_into_attention() {
    std::vector<bool> merged(out_.kernels.size(), false);
    for (size_t at = 0; at < out_.kernels.size(); ++at) {
      if (out_.kernels[at].rule != FusionRule::attention || out_.kernels[at].tasks.size() < 3) continue;
      const int scores = out_.kernels[at].tasks[0], context = anchor(out_.kernels[at]);
      ProjectedAttention projected = projected_attention(scores, context);
      std::vector<size_t> producers;
      const std::vector<int> operands = {p_.tasks[size_t(scores)].find_tensor("a")->buffer,
                                         p_.tasks[size_t(scores)].find_tensor("b")->buffer,
                                         p_.tasks[size_t(context)].find_tensor("b")->buffer};
      for (size_t i = 0; i < operands.size(); ++i) {
        const int heads = operands[i];
        const std::string role = i == 0 ? "q" : i == 1 ? "k" : "v";
        // (One tensor read as two operands would be computed for two shapes of block.)
        if (std::count(operands.begin(), operands.end(), heads) > 1) continue;
        const int owner = p_.buffers[size_t(heads)].owner_task;
        if (owner < 0 || !is_op(p_.tasks[size_t(owner)], BundledOp::split_heads)) continue;
        const size_t from = kernel_of(owner, 0);
        const KernelGroup& producer = out_.kernels[from];
        // Only a matmul's kernel that ends with this split is a projection.
        if (from >= at || merged[from] || producer.tasks.back() != owner ||
            !is_op(p_.tasks[size_t(producer.tasks.front())], BundledOp::matmul))
          continue;
        if (const std::string reason = why_not_projection(from, at, heads, role, projected); !reason.empty()) {
          note_prologue_refused(producer.tasks, {scores}, reason, "is not computed in the attention kernel");
          continue;
        }
        producers.push_back(from);
        merged[from] = true;
      }
      if (producers.empty()) continue;
      std::sort(producers.begin(), producers.end());
      KernelGroup& attention = out_.kernels[at];
      std::vector<int> tasks;
      for (size_t from : producers) {
        const KernelGroup& producer = out_.kernels[from];
        tasks.insert(tasks.end(), producer.tasks.begin(), producer.tasks.end());
        for (int norm : producer.prologue)
          if (!contains(attention.prologue, norm)) attention.prologue.push_back(norm);
        for (int b : producer.internal_buffers)
          if (!contains(attention.internal_buffers, b)) attention.internal_buffers.push_back(b);
        // What the split stored: read by the attention's two matmuls alone,
        // it never reaches memory; read later (saved for the backward pass)
        // or by the attention's epilogue, which loads it, it is stored as
        // well, once.
        const int heads = p_.tasks[size_t(producer.tasks.back())].find_tensor("out")->buffer;
        const std::vector<int> readers = readers_through_views(heads);
        if (p_.buffers[size_t(heads)].storage == Storage::transient &&
            std::all_of(readers.begin(), readers.end(), [&](int r) { return r == scores || r == context; }))
          attention.internal_buffers.push_back(heads);
        notes_.withdraw(scores, [&](const FusionNote& n) { return contains(producer.tasks, n.previous); });
      }
      // The kernel that stored a norm's output (and statistics) for later
      // readers is among them: the attention kernel stores them now.
      for (size_t from : producers)
        if (cudagen::stores_prologue(p_, out_.kernels[from]))
          for (int b : written_buffers(out_.kernels[from].prologue))
            std::erase(attention.internal_buffers, b);
      tasks.insert(tasks.end(), attention.tasks.begin(), attention.tasks.end());
      attention.tasks = std::move(tasks);
    }
    drop_kernels(merged);
  }

  // What an attention kernel computes of its operands so far (rule
  // attention_projection): its shapes, the projection inputs it stages (by
  // buffer, with their floats), the projection outputs per block.
  struct ProjectedAttention {
    int64_t Tq = 0, Tk = 0, D = 0, Dv = 0, rows_per_block = 1;
    bool q_computed = false, kv_computed = false;
    std::map<int, int64_t> source_floats;  // a staged input's buffer -> its floats
    int64_t outputs_per_block = 0;
    int64_t weight_floats = 0;  // the largest projection's weight columns for one head
  };
  ProjectedAttention projected_attention(int scores, int context) const {
    ProjectedAttention pa;
    const Shape& q = slot_buffer(scores, "a").shape;
    pa.Tq = q[q.size() - 2];
    pa.D = q.back();
    pa.Tk = slot_buffer(scores, "b").shape[q.size() - 2];
    pa.Dv = slot_buffer(context, "b").shape.back();
    pa.rows_per_block = attention_rows_per_block(pa.Tq, pa.D, pa.Tk);
    return pa;
  }

  // Why the kernel at `from`, which ends by splitting `heads` (the
  // attention's operand `role`: q, k or v), cannot run in the attention
  // kernel at `at`, given what it computes already (empty when it can; it
  // then counts this projection too).
  std::string why_not_projection(size_t from, size_t at, int heads, const std::string& role,
                                 ProjectedAttention& projected) const {
    if (!rule_on(FusionRule::attention_projection)) return "rule attention_projection is off (--no-fuse-rule)";
    if (out_.kernels[at].flash_trained)
      return "the attention trains on the flash kernels, which read q, k and v from memory";
    // (Where projections join, the row kernel runs the attention: at most its keys.)
    const Shape& keys = p_.buffers[size_t(p_.tasks[size_t(out_.kernels[at].tasks[0])].find_tensor("b")->buffer)].shape;
    const Shape& queries = p_.buffers[size_t(p_.tasks[size_t(out_.kernels[at].tasks[0])].find_tensor("a")->buffer)].shape;
    if (!std::equal(queries.begin(), queries.end() - 2, keys.begin()))
      return "a group of query heads shares each head of keys (grouped-query attention): a block a query head would "
             "compute its group's keys and values again";
    if (keys[keys.size() - 2] > kMaxAttentionKeys)
      return fmt::format("the attention has more than {} keys: it runs the flash or the streamed row kernel, which read q, "
                         "k and v from memory",
                         kMaxAttentionKeys);
    const KernelGroup& producer = out_.kernels[from];
    const int mm = producer.tasks.front();
    const std::string& id = p_.tasks[size_t(mm)].task->id;
    // (An initialiser's projection runs once; in the attention it would run every step.)
    if (producer.phase != out_.kernels[at].phase)
      return fmt::format("'{}' runs in the {} phase, the attention in the {} phase", id, to_string(producer.phase),
                         to_string(out_.kernels[at].phase));
    if (producer.rule != FusionRule::matmul_epilogue) return fmt::format("'{}' is not a matmul with an epilogue", id);
    if (!producer.prologue.empty() && !norm_prologue(p_, producer))
      return fmt::format("'{}' computes an elementwise prologue", id);
    if (const std::string why = why_not_rows_matmul(mm); !why.empty()) return why;
    for (int t : kernel_tasks(producer))
      if (const std::string arg = runtime_arg(p_, t); !arg.empty())
        return fmt::format("'{}' reads run-time argument '{}'", p_.tasks[size_t(t)].task->id, arg);
    for (int b : written_buffers(producer.tasks))
      if (b != heads && !contains(producer.internal_buffers, b))
        return fmt::format("its kernel stores '{}' too", buffer_name(p_, b));
    // The projection moves to the attention kernel's place.
    for (int reader : readers_through_views(heads))
      if (p_.tasks[size_t(reader)].task->phase == producer.phase && kernel_of(reader, from + 1) < at)
        return fmt::format("'{}' reads '{}' before the attention kernel", p_.tasks[size_t(reader)].task->id,
                           buffer_name(p_, heads));
    if (std::string updated = updated_between(kernel_tasks(producer), from, at); !updated.empty())
      return updated + " before the attention kernel would run";
    // The rows the block stages: its batch's rows of the matmul's input,
    // normalised where a norm computes them (with its weight and bias, and
    // the rows' statistics where the kernel stores the norm's output).
    const int source = p_.tasks[size_t(mm)].find_tensor("a")->buffer;
    const Shape& a = p_.buffers[size_t(source)].shape;
    const bool norm = !producer.prologue.empty();
    const int64_t floats = projection_source_floats(
        a[a.size() - 2], a.back(), norm, norm && p_.tasks[size_t(producer.prologue.front())].op->norm == "layer",
        norm && cudagen::stores_prologue(p_, producer));
    ProjectedAttention with = projected;
    with.source_floats[source] = std::max(with.source_floats[source], floats);
    with.q_computed = with.q_computed || role == "q";
    with.kv_computed = with.kv_computed || role != "q";
    const int64_t rows = role == "q" ? with.Tq : with.Tk, columns = role == "v" ? with.Dv : with.D;
    with.outputs_per_block += rows * columns;
    with.weight_floats = std::max(with.weight_floats, a.back() * columns);
    // (The regions' order is the emitter's; their bytes are not: each starts on a 16-byte boundary.)
    std::vector<AttentionProjectionShared> regions;
    for (const auto& [buffer, n] : with.source_floats) regions.push_back({.source = buffer, .source_floats = n});
    if (with.q_computed) regions.push_back({.q_floats = with.Tq * with.D});
    const int64_t bytes = attention_shared(with.rows_per_block, with.Tk, with.D, with.Dv, with.kv_computed, regions,
                                           with.weight_floats)
                              .layout.bytes();
    if (bytes > kSharedBytesWithoutOptIn)
      return fmt::format("the block's rows of '{}' ({} x {}) with the attention's own would take {} bytes of shared "
                         "memory, more than {}",
                         buffer_name(p_, source), a[a.size() - 2], a.back(), bytes, kSharedBytesWithoutOptIn);
    if (with.outputs_per_block > kMaxProjectionOutputs)
      return fmt::format("each block would compute {} projection outputs one after another (at most {}): the "
                         "projection's parallel tiles are worth more than the traffic saved",
                         with.outputs_per_block, kMaxProjectionOutputs);
    if (with.Tq / with.rows_per_block > kMaxRowsPerWarp)
      return fmt::format("each warp would run {} of the head's {} query rows one after another (at most {})",
                         with.Tq / with.rows_per_block, with.Tq, kMaxRowsPerWarp);
    projected = with;
    return {};
  }
  // Four 32 x 32 tiles' outputs: beyond that a block serialises what the
  // projection's kernel ran on many.
  static constexpr int64_t kMaxProjectionOutputs = 4 * 32 * 32;
  // A block runs a whole head: each warp that many query rows in turn,
  // where the attention alone runs them on as many blocks.
  static constexpr int64_t kMaxRowsPerWarp = 4;

  // Why the kernel at `a`, whose value `value` matmul `t2` in kernel `b`
  // reads first (as its left operand), cannot run in that kernel (empty
  // when it can).
  std::string why_not_chain(size_t a, size_t b, int t2, int value) const {
    if (!rule_on(FusionRule::matmul_chain)) return "rule matmul_chain is off (--no-fuse-rule)";
    const KernelGroup& first = out_.kernels[a];
    const KernelGroup& second = out_.kernels[b];
    const int t1 = first.tasks.front();
    const BufferInfo& info = p_.buffers[size_t(value)];
    const std::string& id2 = p_.tasks[size_t(t2)].task->id;
    if (second.tasks.front() != t2) return fmt::format("'{}' is not the first task of its kernel", id2);
    // The first kernel's work moves to the second's place: what it stores
    // must not be read before.
    for (int stored : written_buffers(first.tasks))
      for (int reader : readers_through_views(stored))
        if (p_.tasks[size_t(reader)].task->phase == first.phase && !contains(first.tasks, reader) && reader != t2 &&
            kernel_of(reader, a + 1) < b)
          return fmt::format("'{}' reads '{}' before '{}' would run", p_.tasks[size_t(reader)].task->id,
                             buffer_name(p_, stored), id2);
    if (second.rule == FusionRule::attention) return fmt::format("'{}' starts an attention kernel", id2);
    if (second.rule != FusionRule::none && second.rule != FusionRule::matmul_epilogue)
      return fmt::format("'{}' starts a kernel of rule {}", id2, to_string(second.rule));
    if (!second.prologue.empty()) return fmt::format("'{}' already computes a prologue", id2);
    for (int t : {t1, t2}) {
      if (const std::string why = why_not_rows_matmul(t); !why.empty()) return why;
      if (const std::string arg = runtime_arg(p_, t); !arg.empty())
        return fmt::format("'{}' reads run-time argument '{}'", p_.tasks[size_t(t)].task->id, arg);
    }
    const DType a_type = slot_buffer(t1, "a").dtype;
    if (matmul_tile_rows(a_type) != matmul_tile_rows(info.dtype))
      return fmt::format("'{}' is {} and '{}' {}: their matmuls take tiles of different heights", buffer_name(p_, value),
                         to_string(info.dtype), buffer_name(p_, p_.tasks[size_t(t1)].find_tensor("a")->buffer),
                         to_string(a_type));
    const int64_t tile = matmul_tile_rows(a_type), H = info.shape.back(), N = slot_buffer(t2, "out").shape.back();
    const int64_t bytes = matmul_chain_shared(a_type, info.dtype, H).layout.bytes();
    if (bytes > kSharedBytesWithoutOptIn)
      return fmt::format("a block's {} rows of '{}' ({} x {} {}) and the operand tiles take {} bytes of shared memory, "
                         "more than {}",
                         tile, buffer_name(p_, value), tile, H, to_string(info.dtype), bytes, kSharedBytesWithoutOptIn);
    const int64_t tiles = (H + tile - 1) / tile + (N + tile - 1) / tile;
    if (tiles > kMaxChainTiles)
      return fmt::format("each block would compute {} tiles one after another (at most {}): the two matmuls' parallel "
                         "tiles are worth more than the traffic saved",
                         tiles, kMaxChainTiles);
    if (std::string updated = updated_between(kernel_tasks(first), a, b); !updated.empty())
      return updated + fmt::format(" before '{}' would run", p_.tasks[size_t(t1)].task->id);
    return {};
  }
  // The tasks that read buffer `b`, directly or through views of it (a view
  // runs no kernel: its readers read `b`'s storage).
  std::vector<int> readers_through_views(int b) const {
    std::vector<int> out, pending = {b};
    while (!pending.empty()) {
      const int buffer = pending.back();
      pending.pop_back();
      for (int r : readers_[size_t(buffer)]) {
        if (!is_view(p_.tasks[size_t(r)])) {
          if (!contains(out, r)) out.push_back(r);
          continue;
        }
        for (const auto& v : p_.tasks[size_t(r)].tensors)
          if (v.buffer >= 0 && v.sig != nullptr && v.sig->written()) pending.push_back(v.buffer);
      }
    }
    return out;
  }

  // A chain's block computes the column tiles of both products one after
  // another, where the two kernels ran them on as many blocks: worth it for
  // the few rows of a small batch, where the launch and the value's traffic
  // cost more than the lost parallelism.
  static constexpr int64_t kMaxChainTiles = 16;

  // Why matmul `t` is not of the form a chain takes, [..., M, K] @ [K, N]
  // (every row of `a` times one matrix, `b` transposed or not), or empty.
  std::string why_not_rows_matmul(int t, const char* taker = "a chain") const {
    const std::string& id = p_.tasks[size_t(t)].task->id;
    if (flag(t, "trans_a")) return fmt::format("'{}' transposes its left operand", id);
    if (!matmul_flattens_rows(slot_buffer(t, "a").shape, slot_buffer(t, "b").shape, slot_buffer(t, "out").shape, false))
      return fmt::format("'{}' multiplies by a batch of matrices; {} takes [..., M, K] @ [K, N]", id, taker);
    return {};
  }

  // Why the norm that kernel `norm_kernel` starts with, whose output is
  // buffer `value`, cannot be the prologue of its readers' kernels (empty
  // when it can; `hosts` then holds those kernels).
  std::string why_not_prologue(size_t norm_kernel, int value, std::vector<size_t>& hosts) const {
    const int norm = out_.kernels[norm_kernel].tasks.front();
    const BoundTask& bt = p_.tasks[size_t(norm)];
    if (!rule_on(FusionRule::norm_prologue)) return "rule norm_prologue is off (--no-fuse-rule)";
    if (const std::string a = runtime_arg(p_, norm); !a.empty())
      return fmt::format("'{}' reads run-time argument '{}'", bt.task->id, a);
    // Readers in later phases (the backward pass) read what the first host
    // stores; those of its own phase recompute it.
    std::vector<int> readers;
    for (int r : readers_[size_t(value)])
      if (p_.tasks[size_t(r)].task->phase == bt.task->phase) readers.push_back(r);
    if (readers.size() > kMaxPrologueReaders)
      return fmt::format("{} tasks read '{}': each would recompute it (at most {})", readers.size(),
                         buffer_name(p_, value), kMaxPrologueReaders);
    for (int r : readers) {
      const BoundTask& reader = p_.tasks[size_t(r)];
      // (An epilogue in the norm's kernel reads it too.)
      if (!is_op(reader, BundledOp::matmul))
        return fmt::format("'{}' ({}) reads '{}' too; only a matmul's operand load normalises", reader.task->id,
                           reader.op->name, buffer_name(p_, value));
      if (reader.find_tensor("a")->buffer != value || reader.find_tensor("b")->buffer == value)
        return fmt::format("'{}' reads '{}' as its right operand", reader.task->id, buffer_name(p_, value));
      if (flag(r, "trans_a")) return fmt::format("'{}' transposes it (trans_a)", reader.task->id);
      if (std::string pipelined = pipelined_instead(r); !pipelined.empty()) return pipelined;
      const size_t host = kernel_of(r, norm_kernel + 1);
      const KernelGroup& kernel = out_.kernels[host];
      if (kernel.tasks.front() != r || kernel.rule == FusionRule::attention)
        return fmt::format("'{}' is not the first task of its kernel", reader.task->id);
      if (std::string updated = updated_between({norm}, norm_kernel, host); !updated.empty())
        return updated + fmt::format(" before '{}' reads the norm", reader.task->id);
      hosts.push_back(host);
    }
    return {};
  }
  static constexpr size_t kMaxPrologueReaders = 4;

  // A prologue makes its host matmul load operands element by element, on
  // the 64 x 64 tile. Where the pipelined mainloop could take the matmul and
  // the product is large, the prologue's own kernel (one pass over its rows)
  // costs less than giving the mainloop up: the reason, or empty.
  std::string pipelined_instead(int r) const {
    const BoundTask& reader = p_.tasks[size_t(r)];
    if (reader.op->pattern != PatternKind::matmul) return {};
    const std::string mainloop = mainloop_of(r);
    if (mainloop.empty()) return {};
    const int64_t flops = matmul_dims(p_, r).flops();
    if (flops < kPipelinedPrologueFlops) return {};
    return fmt::format(
        "'{}' ({} MFLOP) runs the {} matmul mainloop, which reads its operands as stored: at this size a "
        "kernel of their own costs less than the element-by-element tile a prologue needs",
        reader.task->id, flops / 1000000, mainloop);
  }
  // From this many FLOPs a norm's or chain's own kernel and a mainloop cost
  // less than the element-by-element tile a prologue needs: on an H200 a GPT-2
  // block's q/k/v at 64 rows (7.5e7 FLOPs each) took 200 us together with the
  // norm as their prologue, where the output projection of the same shape
  // ran pipelined in 15.7 us and a norm alone in 4.8 us (bench/RESULTS.md,
  // 2026-11-27). Below 2^24 the products are launch-bound either way, and the
  // SIMT mainloop starts there too (kSimtMainloopMinFlops).
  static constexpr int64_t kPipelinedPrologueFlops = kSimtMainloopMinFlops;

  // The kernel, at index `from` or after, that holds task `t`.
  size_t kernel_of(int t, size_t from) const {
    while (from < out_.kernels.size() && !contains(out_.kernels[from].tasks, t)) ++from;
    return from;
  }

  // A prologue runs as late as its reader: what a kernel strictly between
  // `from` and `to` (the prologue's own kernel and its reader's) updates in
  // place of the prologue `tasks`' inputs ("'adam' updates 'w.out'"), or
  // empty.
  std::string updated_between(const std::vector<int>& tasks, size_t from, size_t to) const {
    for (size_t j = from + 1; j < to; ++j)
      for (int t : out_.kernels[j].tasks)
        for (const auto& b : p_.tasks[size_t(t)].tensors)
          if (b.sig != nullptr && b.sig->writes && b.buffer >= 0)
            for (int p : tasks)
              for (const auto& in : p_.tasks[size_t(p)].tensors)
                if (in.buffer == b.buffer && in.sig != nullptr && !in.sig->written())
                  return fmt::format("'{}' updates '{}'", p_.tasks[size_t(t)].task->id, buffer_name(p_, b.buffer));
    return {};
  }

  // The buffers tasks `tasks` write, each once.
  std::vector<int> written_buffers(const std::vector<int>& tasks) const {
    std::vector<int> buffers;
    for (int t : tasks)
      for (const auto& b : p_.tasks[size_t(t)].tensors)
        if (b.buffer >= 0 && b.sig != nullptr && b.sig->written() && !contains(buffers, b.buffer))
          buffers.push_back(b.buffer);
    return buffers;
  }

  // Whether norm task `norm`'s output `value` or its statistics (rstd, a
  // layernorm's mean) are read outside the kernels that take the norm as
  // their prologue: by a later phase or the caller.
  bool stores_prologue(int norm, int value) const {
    if (p_.buffers[size_t(value)].storage != Storage::transient) return true;
    for (const auto& b : p_.tasks[size_t(norm)].tensors)
      if (b.buffer >= 0 && b.buffer != value && b.sig != nullptr && b.sig->written()) return true;
    return false;
  }

  // The note of each matmul that reads the prologue candidate's value (it
  // did not join that kernel, being a matmul) says why that kernel is not its
  // prologue either. `tasks`: the candidate's tasks; the last names it.
  void note_prologue_refused(const std::vector<int>& tasks, const std::vector<int>& readers, const std::string& reason,
                             const std::string& what = "is not its prologue") {
    const int named = tasks.back();
    for (int r : readers) {
      FusionNote* it = notes_.find(r, [&](const FusionNote& n) { return contains(tasks, n.previous); });
      const std::string why = fmt::format("'{}' {}: {}", p_.tasks[size_t(named)].task->id, what, reason);
      if (it == nullptr)
        notes_.add(FusionNote{r, named, why});
      else
        it->reason += "; " + why;
    }
  }

  // Rule elementwise_prologue: an elementwise kernel (a chain, or one task)
  // that stores one value, read only by matmuls and row ops (softmax, the
  // norms, row sums) of its phase, each the first task of its kernel, runs in
  // those kernels instead: each computes the value element by element where
  // its operand load would read it, from the chain's inputs. An element is
  // computed as often as the reader loads it (a matmul's `a` once per column
  // tile of output, a softmax's row once per pass), no more. Returns whether
  // it folded kernel `k` (`folded`: the norms folded before, no hosts).
  bool fold_elementwise_prologue(size_t k, const std::vector<bool>& folded) {
    const KernelGroup& chain = out_.kernels[k];
    std::vector<int> stored = written_buffers(chain.tasks);  // what the kernel writes to memory
    std::erase_if(stored, [&](int b) { return contains(chain.internal_buffers, b); });
    if (stored.size() != 1) return false;
    const int value = stored.front();
    std::vector<int> readers = readers_[size_t(value)];  // once each (x @ x^T reads it twice)
    readers.erase(std::unique(readers.begin(), readers.end()), readers.end());
    // The rule is about the operand loads of matmuls and row ops of its
    // phase: a value something else reads (an initialiser's weight, read by
    // every later phase) is no candidate, and gets no note.
    const Phase phase = p_.tasks[size_t(chain.tasks.front())].task->phase;
    if (readers.empty() || !std::all_of(readers.begin(), readers.end(), [&](int r) {
          return !prologue_operand(r, value).empty() && p_.tasks[size_t(r)].task->phase == phase;
        }))
      return false;
    std::vector<size_t> hosts;
    std::vector<std::string> operands;
    if (const std::string reason = why_not_elementwise_prologue(k, value, readers, folded, hosts, operands);
        !reason.empty()) {
      note_prologue_refused(chain.tasks, readers, reason);
      return false;
    }
    for (size_t i = 0; i < hosts.size(); ++i) {
      KernelGroup& host = out_.kernels[hosts[i]];
      host.prologue = chain.tasks;
      host.prologue_operand = operands[i];
      for (int b : written_buffers(chain.tasks))
        if (!contains(host.internal_buffers, b)) host.internal_buffers.push_back(b);
    }
    // A reader's note on why it did not join the chain is moot now; why the
    // chain did not join the kernel before it (an epilogue) still holds.
    for (int r : readers) notes_.withdraw(r, [&](const FusionNote& n) { return contains(chain.tasks, n.previous); });
    return true;
  }

  // Whether matmul task `t` is an attention gradient's dp = dcontext v^T:
  // what a softmax_backward reads as its dout. Its kernel (rule
  // attention_backward, later) takes no prologue: the row kernel stages
  // dcontext's rows and the flash kernel copies them asynchronously, so a
  // chain before it runs in a kernel of its own.
  bool attention_dp(int t) const {
    if (!is_op(p_.tasks[size_t(t)], BundledOp::matmul) || !flag(t, "trans_b") || flag(t, "trans_a")) return false;
    const int value = p_.tasks[size_t(t)].find_tensor("out")->buffer;
    for (int r : readers_[size_t(value)])
      if (is_op(p_.tasks[size_t(r)], BundledOp::softmax_backward) && p_.tasks[size_t(r)].find_tensor("dout")->buffer == value)
        return rule_on(FusionRule::attention_backward);
    return false;
  }

  // Why elementwise kernel `k`, which stores buffer `value` and only
  // matmuls and row ops read (`readers`, each once), cannot be their
  // prologue (empty when it can; `hosts` and `operands` then hold each
  // reader's kernel and the operand it reads).
  std::string why_not_elementwise_prologue(size_t k, int value, const std::vector<int>& readers,
                                           const std::vector<bool>& folded, std::vector<size_t>& hosts,
                                           std::vector<std::string>& operands) const {
    const std::vector<int>& chain = out_.kernels[k].tasks;
    const BufferInfo& info = p_.buffers[size_t(value)];
    if (!rule_on(FusionRule::elementwise_prologue)) return "rule elementwise_prologue is off (--no-fuse-rule)";
    if (info.storage != Storage::transient)
      return fmt::format("'{}' is read after its phase or by the caller, so it is stored", buffer_name(p_, value));
    if (info.dtype != DType::f32 && info.dtype != DType::f16 && info.dtype != DType::bf16)
      return fmt::format("'{}' is {}; matmul operand loads compute f32, f16 and bf16 values", buffer_name(p_, value),
                         to_string(info.dtype));
    if (readers.size() > kMaxPrologueReaders)
      return fmt::format("{} tasks read '{}': each would recompute it (at most {})", readers.size(),
                         buffer_name(p_, value), kMaxPrologueReaders);
    // (A chain's first task may read run-time arguments; a host kernel reads only its own.)
    for (int t : chain)
      if (const std::string a = runtime_arg(p_, t); !a.empty())
        return fmt::format("'{}' reads run-time argument '{}', which the reading kernel does not", p_.tasks[size_t(t)].task->id, a);
    for (int r : readers) {
      const BoundTask& reader = p_.tasks[size_t(r)];
      const std::string operand = prologue_operand(r, value);
      if (operand == "both") return fmt::format("'{}' reads it as both operands", reader.task->id);
      if (std::string pipelined = pipelined_instead(r); !pipelined.empty()) return pipelined;
      const size_t host = kernel_of(r, k + 1);
      const KernelGroup& kernel = out_.kernels[host];
      if (folded[host]) return fmt::format("'{}' is itself the prologue of its readers' kernels", reader.task->id);
      if (kernel.tasks.front() != r) return fmt::format("'{}' is not the first task of its kernel", reader.task->id);
      if (kernel.rule == FusionRule::attention)
        return fmt::format("'{}' starts an attention kernel, whose warps load their rows themselves", reader.task->id);
      if (attention_dp(r))
        return fmt::format("'{}' is an attention's dp = dcontext v^T, whose kernel (rule attention_backward) reads "
                           "dcontext from memory", reader.task->id);
      if (!kernel.prologue.empty())
        return fmt::format("'{}' already computes a prologue", reader.task->id);
      if (std::string updated = updated_between(chain, k, host); !updated.empty())
        return updated + fmt::format(" before '{}' reads the chain", reader.task->id);
      hosts.push_back(host);
      operands.push_back(operand);
    }
    return {};
  }

  // The slot through which task `r` reads buffer `value` as an operand whose
  // loads a prologue may compute ("both" for a matmul reading it twice), or
  // empty where it reads it otherwise: every slot reading it must be one of
  // the op's prologue slots (OpSignature::prologue), which its skeleton reads
  // only through element loads (emit.cpp, load()).
  std::string prologue_operand(int r, int value) const {
    const BoundTask& reader = p_.tasks[size_t(r)];
    std::vector<std::string> slots;
    for (const auto& b : reader.tensors)
      if (b.buffer == value && b.sig != nullptr && !b.sig->written()) slots.push_back(b.name);
    for (const auto& slot : slots)
      if (std::find(reader.op->prologue.begin(), reader.op->prologue.end(), slot) == reader.op->prologue.end()) return {};
    return slots.size() == 2 ? "both" : slots.size() == 1 ? slots.front() : "";
  }

  // A value the group computes and only the group reads needs no storage.
  void find_internal(KernelGroup& group) {
    if (group.tasks.size() < 2) return;
    for (int t : group.tasks) {
      const int b = group_value(p_.tasks[size_t(t)])->buffer;
      if (p_.buffers[size_t(b)].storage != Storage::transient) continue;
      const auto& readers = readers_[size_t(b)];
      if (!readers.empty() &&
          std::all_of(readers.begin(), readers.end(), [&](int r) { return contains(group.tasks, r); }))
        group.internal_buffers.push_back(b);
    }
  }

  const Program& p_;
  const FuseOptions& options_;
  std::vector<std::vector<int>> readers_;  // per buffer: the tasks that read it (through `from`)
  std::map<int, int> view_source_;         // a view's buffer -> its source's
  // While tasks are grouped (run): per buffer, the latest kernel that writes
  // it and whether as an output; and where the trailing run of kernels of one
  // phase starts.
  struct Writer {
    int kernel = -1;
    bool as_output = false;
  };
  std::unordered_map<int, Writer> last_writer_;
  int phase_start_ = 0;
  NoteBook notes_;  // becomes out_.notes
  Fusion out_;
};

}  // namespace

Fusion fuse(const Program& program, const Schedule& schedule, const FuseOptions& options) {
  return Fuser(program, options).run(schedule);
}

}  // namespace cudagen
