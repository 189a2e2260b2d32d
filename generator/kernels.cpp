#include "kernels.h"

#include <algorithm>

namespace cudagen {

std::vector<KernelGroup> one_kernel_per_task(const Program& program, const Schedule& schedule) {
  std::vector<KernelGroup> kernels;
  for (int t : schedule.order) {
    if (!program.tasks[size_t(t)].op->view.first.empty()) continue;  // a view: storage only, no kernel
    const Task& task = *program.tasks[size_t(t)].task;
    const int index = int(kernels.size());
    kernels.push_back(KernelGroup{"k" + std::to_string(index) + "_" + task.id, task.phase, {t}, {}, {}, index});
  }
  return kernels;
}

std::vector<int> kernel_tasks(const KernelGroup& kernel) {
  std::vector<int> tasks = kernel.prologue;
  tasks.insert(tasks.end(), kernel.tasks.begin(), kernel.tasks.end());
  return tasks;
}

bool norm_prologue(const Program& program, const KernelGroup& k) {
  if (k.prologue.empty()) return false;
  const std::string& op = program.tasks[size_t(k.prologue.front())].op->name;
  return op == "rmsnorm" || op == "layernorm";
}

bool stores_prologue(const Program& program, const KernelGroup& k) {
  return norm_prologue(program, k) &&
         !contains(k.internal_buffers, program.tasks[size_t(k.prologue.front())].find_tensor("out")->buffer);
}

std::vector<std::string> kernel_rules(const Program& program, const KernelGroup& k) {
  std::vector<std::string> rules;
  if (!k.prologue.empty()) rules.push_back(norm_prologue(program, k) ? "norm_prologue" : "elementwise_prologue");
  if (!k.rule.empty()) rules.push_back(k.rule);
  return rules;
}

bool matmul_flattens_rows(const Shape& a, const Shape& b, const Shape& out, bool trans_a) {
  return !trans_a && numel(Shape(b.begin(), b.end() - 2)) == 1 &&
         std::equal(a.begin(), a.end() - 2, out.begin(), out.end() - 2);
}

size_t second_matmul(const Program& program, const KernelGroup& k) {
  if (k.rule != "matmul_chain") return 0;
  for (size_t i = 1; i < k.tasks.size(); ++i)
    if (program.tasks[size_t(k.tasks[i])].op->pattern == PatternKind::matmul) return i;
  return 0;
}

int launch_count(const std::vector<KernelGroup>& kernels) {
  int n = 0;
  for (const auto& k : kernels) n = std::max(n, k.launch + 1);
  return n;
}

std::vector<std::vector<int>> kernel_buffers(const Program& program, const std::vector<KernelGroup>& kernels) {
  std::vector<std::vector<int>> out;
  for (const auto& k : kernels) {
    std::vector<int> buffers;
    for (int t : kernel_tasks(k))
      for (const auto& bound : program.tasks[size_t(t)].tensors)
        if (bound.buffer >= 0 && !contains(k.internal_buffers, bound.buffer)) buffers.push_back(bound.buffer);
    std::sort(buffers.begin(), buffers.end());
    buffers.erase(std::unique(buffers.begin(), buffers.end()), buffers.end());
    out.push_back(std::move(buffers));
  }
  return out;
}

}  // namespace cudagen
