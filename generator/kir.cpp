#include "kir.h"

#include <algorithm>
#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "kernels.h"

namespace cudagen::kir {

const char* to_string(Mainloop m) {
  switch (m) {
    case Mainloop::elements: return "elements";
    case Mainloop::reduction: return "reduction";
    case Mainloop::gemm: return "gemm";
    case Mainloop::gemm_sum: return "gemm_sum";
    case Mainloop::gemm_chain: return "gemm_chain";
    case Mainloop::gemm_row_reduction: return "gemm_row_reduction";
    case Mainloop::attention: return "attention";
    case Mainloop::attention_backward: return "attention_backward";
    case Mainloop::gather: return "gather";
    case Mainloop::opaque: return "opaque";
  }
  return "";
}

namespace {

bool elementwise(const OpSignature& op) {
  return op.pattern == PatternKind::elementwise || op.pattern == PatternKind::broadcast;
}

// The mainloop of a kernel of one task (and its prologue and epilogue), by its op's pattern.
Mainloop task_mainloop(const OpSignature& op) {
  switch (op.pattern) {
    case PatternKind::elementwise:
    case PatternKind::broadcast: return Mainloop::elements;
    case PatternKind::matmul: return Mainloop::gemm;
    case PatternKind::reduction: return Mainloop::reduction;
    case PatternKind::gather: return Mainloop::gather;
    case PatternKind::opaque: return Mainloop::opaque;
  }
  return Mainloop::opaque;
}

Mainloop kernel_mainloop(const Program& p, const KernelGroup& k) {
  switch (k.rule) {
    case FusionRule::elementwise_chain: return Mainloop::elements;
    case FusionRule::matmul_sum: return Mainloop::gemm_sum;
    case FusionRule::matmul_chain: return Mainloop::gemm_chain;
    case FusionRule::row_reduction: return Mainloop::gemm_row_reduction;
    case FusionRule::attention: return Mainloop::attention;
    case FusionRule::attention_backward: return Mainloop::attention_backward;
    default: return task_mainloop(*p.tasks[size_t(k.tasks.front())].op);
  }
}

// The role of the stage at index `i` of k.tasks, where the rule gives stages roles.
std::string stage_role(const Program& p, const KernelGroup& k, size_t i) {
  const std::string& op = p.tasks[size_t(k.tasks[i])].op->name;
  switch (k.rule) {
    case FusionRule::attention: {
      // (An add of a bias to the scores is an epilogue of theirs: no stage.)
      const size_t scores = attention_scores(p, k);
      return i < scores ? "projection" : i == scores ? "scores" : op == "softmax" ? "softmax" : "context";
    }
    case FusionRule::attention_backward: {
      const AttentionGradient g = attention_gradient(p, k);
      return i == g.dp ? "dp" : i == g.ds ? "ds" : i == g.dq ? "dq" : i == g.dk ? "dk" : i == g.dv ? "dv" : op;
    }
    case FusionRule::matmul_sum: return op == "matmul" ? "term" : "sum";
    case FusionRule::matmul_chain: return i == 0 ? "product" : "second product";
    case FusionRule::row_reduction: return i == 0 ? "product" : "row reduction";
    default: return op;
  }
}

class Builder {
 public:
  Builder(const Program& p, const KernelGroup& k) : p_(p), k_(k) {}

  Kernel run() {
    ir_.mainloop = kernel_mainloop(p_, k_);
    // Rule matmul_sum: the adds of the terms, which the mainloop's one
    // accumulator computes, are stages of their own (the last one's result
    // is the sum the epilogue runs on).
    const std::vector<size_t> sum_adds =
        k_.rule == FusionRule::matmul_sum ? matmul_sum_terms(p_, k_).adds : std::vector<size_t>{};
    for (int t : k_.prologue) prologue_task(t);
    for (size_t i = 0; i < k_.tasks.size(); ++i) {
      const int t = k_.tasks[i];
      const OpSignature& op = *p_.tasks[size_t(t)].op;
      const bool sums_terms = std::find(sum_adds.begin(), sum_adds.end(), i) != sum_adds.end();
      if (elementwise(op) && !sums_terms) {
        if (ir_.stages.empty()) ir_.stages.push_back(Stage{"elements", -1, {}, {}, {}});
        epilogue_op(t);
      } else if (!op.inverse.empty() && !ir_.stages.empty()) {
        permuted_store(t);
      } else {
        stage(t, stage_role(p_, k_, i));
      }
    }
    return std::move(ir_);
  }

 private:
  int add(Node n) {
    ir_.nodes.push_back(std::move(n));
    return int(ir_.nodes.size()) - 1;
  }
  bool internal(int buffer) const { return contains(k_.internal_buffers, buffer); }

  // What the task reads through slot `b`: a value of the kernel, or a load.
  int read(const BoundTensor& b) {
    if (auto it = value_of_.find(b.buffer); it != value_of_.end()) return it->second;
    auto [it, fresh] = loads_.emplace(b.buffer, 0);
    if (fresh) it->second = add(Node{Node::Kind::load, -1, b.buffer, {}});
    return it->second;
  }

  // What a task reads: its inputs and weights, those it updates in place too.
  static bool reads(const BoundTensor& b) {
    return b.sig != nullptr && b.buffer >= 0 && (!b.sig->written() || b.sig->writes);
  }

  std::vector<int> inputs(int t) {
    std::vector<int> in;
    for (const auto& b : p_.tasks[size_t(t)].tensors)
      if (reads(b)) in.push_back(read(b));
    return in;
  }

  // A store of `value` to `buffer`, unless the buffer stays in the kernel.
  void store(std::vector<int>& roots, int value, int buffer) {
    if (!internal(buffer)) roots.push_back(add(Node{Node::Kind::store, -1, buffer, {value}}));
  }

  // A prologue task: its value is computed where a later stage loads it.
  void prologue_task(int t) {
    const BoundTask& bt = p_.tasks[size_t(t)];
    const Node::Kind kind = bt.op->norm.empty() ? Node::Kind::op : Node::Kind::norm;
    const int out = bt.find_tensor(bt.op->norm.empty() ? only_written_slot(bt) : "out")->buffer;
    const int node = add(Node{kind, t, out, inputs(t)});
    value_of_[out] = node;
    // A norm the kernel stores for later readers: its output and statistics.
    if (kind == Node::Kind::norm && stores_norm(p_, k_, t))
      for (const auto& b : bt.tensors)
        if (b.sig != nullptr && b.buffer >= 0 && b.sig->written())
          pending_stores_[node].push_back(add(Node{Node::Kind::store, -1, b.buffer, {node}}));
  }

  static std::string only_written_slot(const BoundTask& bt) {
    for (const auto& b : bt.tensors)
      if (b.sig != nullptr && b.sig->written()) return b.name;
    return "out";
  }

  void stage(int t, std::string role) {
    const BoundTask& bt = p_.tasks[size_t(t)];
    Stage s{std::move(role), t, {}, {}, {}};
    for (const auto& b : bt.tensors) {
      if (!reads(b)) continue;
      const int node = read(b);
      // A permuted store an earlier stage made, which this one reads: kept in shared memory.
      if (ir_.nodes[size_t(node)].kind == Node::Kind::store_permuted) ir_.nodes[size_t(node)].in_kernel = true;
      s.operands.push_back(Operand{b.name, node, {}});
      if (auto it = pending_stores_.find(node); it != pending_stores_.end()) {
        s.operands.back().stores = std::move(it->second);
        pending_stores_.erase(it);
      }
    }
    for (const auto& b : bt.tensors) {
      if (b.sig == nullptr || b.buffer < 0 || !b.sig->written()) continue;
      const int node = add(Node{Node::Kind::result, t, b.buffer, {}});
      s.results.push_back(node);
      value_of_[b.buffer] = node;
      store(s.epilogue, node, b.buffer);
    }
    ir_.stages.push_back(std::move(s));
  }

  void epilogue_op(int t) {
    const BoundTask& bt = p_.tasks[size_t(t)];
    std::vector<int> in = inputs(t);
    // One node for the task; its further outputs (an optimizer's state) are results of it.
    int op = -1;
    for (const auto& b : bt.tensors) {
      if (b.sig == nullptr || b.buffer < 0 || !b.sig->written()) continue;
      const int node = op < 0 ? op = add(Node{Node::Kind::op, t, b.buffer, in})
                              : add(Node{Node::Kind::result, t, b.buffer, {op}});
      value_of_[b.buffer] = node;
      store(ir_.stages.back().epilogue, node, b.buffer);
    }
    ir_.stages.back().chain.push_back(op);
  }

  void permuted_store(int t) {
    const BoundTask& bt = p_.tasks[size_t(t)];
    const std::vector<int> in = inputs(t);
    const int out = bt.find_tensor(only_written_slot(bt))->buffer;
    // Where a later stage reads it (an attention's projected heads), it is
    // kept in shared memory too (stage() marks it).
    const int node = add(Node{Node::Kind::store_permuted, t, out, {in.front()}});
    ir_.nodes[size_t(node)].to_memory = !internal(out);
    value_of_[out] = node;
    ir_.stages.back().epilogue.push_back(node);
    ir_.stages.back().chain.push_back(node);
  }

  const Program& p_;
  const KernelGroup& k_;
  Kernel ir_;
  std::map<int, int> value_of_;  // buffer -> the node computing it in this kernel
  std::map<int, int> loads_;     // buffer -> its load node
  std::map<int, std::vector<int>> pending_stores_;  // a prologue's node -> its stores, until a stage reads it
};

class Printer {
 public:
  Printer(const Program& p, const Kernel& k) : p_(p), k_(k), printed_(k.nodes.size(), false) {}

  std::string run(const std::string& indent) {
    std::string out = fmt::format("{}{}\n", indent, to_string(k_.mainloop));
    for (const Stage& s : k_.stages) {
      if (s.task < 0) {  // a loop over elements: its chain and stores
        for (int st : s.epilogue) out += fmt::format("{}  {}\n", indent, store(st));
        continue;
      }
      const BoundTask& bt = p_.tasks[size_t(s.task)];
      out += s.role == bt.op->name ? fmt::format("{}  {} ({})\n", indent, bt.task->id, bt.op->name)
                                   : fmt::format("{}  {} {} ({})\n", indent, s.role, bt.task->id, bt.op->name);
      for (const Operand& o : s.operands) {
        out += fmt::format("{}    {} <- {}\n", indent, o.slot, expr(o.node));
        for (int st : o.stores) out += fmt::format("{}      {}\n", indent, store(st));
      }
      if (!s.epilogue.empty()) out += fmt::format("{}    epilogue\n", indent);
      for (int st : s.epilogue) out += fmt::format("{}      {}\n", indent, store(st));
    }
    return out;
  }

 private:
  std::string name(int buffer) const { return buffer_name(p_, buffer); }

  std::string store(int i) {
    const Node& n = k_.nodes[size_t(i)];
    if (n.kind == Node::Kind::store_permuted) {
      const BoundTask& bt = p_.tasks[size_t(n.task)];
      return fmt::format("store {} as {} ({}) moves it <- {}{}", name(n.buffer), bt.task->id, bt.op->name,
                         expr(n.inputs.front()),
                         !n.in_kernel ? "" : n.to_memory ? "  (in shared memory, and to memory)" : "  (in shared memory)");
    }
    return fmt::format("store {} <- {}", name(n.buffer), expr(n.inputs.front()));
  }

  // A value: a load, a stage's result, or an op on values; an op printed
  // before is named by its buffer.
  std::string expr(int i) {
    const Node& n = k_.nodes[size_t(i)];
    switch (n.kind) {
      case Node::Kind::load: return "load " + name(n.buffer);
      case Node::Kind::result:
        if (!n.inputs.empty()) {  // another output of an op: its slot, after the op where not printed yet
          const BoundTask& bt = p_.tasks[size_t(n.task)];
          std::string slot = name(n.buffer);
          for (const auto& b : bt.tensors)
            if (b.buffer == n.buffer && b.sig != nullptr && b.sig->written()) slot = bt.task->id + "." + b.name;
          return printed_[size_t(n.inputs.front())] ? slot : fmt::format("{} of {}", slot, expr(n.inputs.front()));
        }
        return name(n.buffer);
      case Node::Kind::store_permuted: return name(n.buffer);
      case Node::Kind::op:
      case Node::Kind::norm: {
        if (printed_[size_t(i)]) return name(n.buffer);
        printed_[size_t(i)] = true;
        std::vector<std::string> args;
        for (int in : n.inputs) args.push_back(expr(in));
        const BoundTask& bt = p_.tasks[size_t(n.task)];
        return fmt::format("{}:{}({})", bt.task->id, bt.op->name, fmt::join(args, ", "));
      }
      case Node::Kind::store: return expr(n.inputs.front());
    }
    return {};
  }

  const Program& p_;
  const Kernel& k_;
  std::vector<bool> printed_;
};

}  // namespace

Kernel build(const Program& program, const KernelGroup& k) { return Builder(program, k).run(); }

int role_task(const Kernel& kernel, std::string_view role) {
  for (const Stage& s : kernel.stages)
    if (s.role == role) return s.task;
  return -1;
}

int stage_of_result(const Kernel& kernel, int buffer) {
  for (size_t s = 0; s < kernel.stages.size(); ++s)
    for (int r : kernel.stages[s].results)
      if (kernel.nodes[size_t(r)].buffer == buffer) return int(s);
  return -1;
}

std::vector<int> tree_ops(const Kernel& kernel, int root) {
  std::vector<bool> in_tree(kernel.nodes.size(), false);
  std::vector<int> pending = {root};
  while (!pending.empty()) {
    const int i = pending.back();
    pending.pop_back();
    const Node& n = kernel.nodes[size_t(i)];
    if (in_tree[size_t(i)] || (n.kind != Node::Kind::op && n.kind != Node::Kind::norm)) continue;
    in_tree[size_t(i)] = true;
    pending.insert(pending.end(), n.inputs.begin(), n.inputs.end());
  }
  // Nodes are made in the order of their tasks, each after what it reads.
  std::vector<int> ops;
  for (size_t i = 0; i < in_tree.size(); ++i)
    if (in_tree[i]) ops.push_back(int(i));
  return ops;
}

std::string print(const Program& program, const Kernel& kernel, const std::string& indent) {
  return Printer(program, kernel).run(indent);
}

}  // namespace cudagen::kir
