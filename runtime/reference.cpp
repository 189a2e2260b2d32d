#include "reference.h"

#include "counter_rng.h"
#include "half.h"
#include "runner.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include <fmt/format.h>

namespace cudagen {

namespace {

// Index into `in` of element `i` of `out` under numpy broadcasting.
int64_t broadcast_source(const Shape& out, const Shape& in, int64_t i) {
  int64_t index = 0, in_stride = 1;
  size_t offset = out.size() - in.size();
  for (size_t d = out.size(); d-- > 0;) {
    int64_t coord = i % out[d];
    i /= out[d];
    if (d >= offset) {
      int64_t in_dim = in[d - offset];
      if (in_dim != 1) index += coord * in_stride;
      in_stride *= in_dim;
    }
  }
  return index;
}

class Evaluator {
 public:
  Evaluator(const Program& p, ReferenceBuffers& r, const RunTimeArgs& args, const UserOpReferences& user,
            const std::vector<double>& carried_error = {})
      : p_(p), r_(r), args_(args), user_(user), carried_error_(carried_error) {}

  void run(int t) {
    const BoundTask& bt = p_.tasks[size_t(t)];
    const std::string& op = bt.op->name;
    if (op == "relu") return unary(bt, [](double x) { return x > 0 ? x : 0.0; });
    if (op == "sigmoid") return unary(bt, [](double x) { return sigmoid(x); });
    if (op == "silu") return unary(bt, [](double x) { return x * sigmoid(x); });
    if (op == "tanh") return unary(bt, [](double x) { return std::tanh(x); });
    if (op == "exp") return unary(bt, [](double x) { return std::exp(x); });
    if (op == "log") return unary(bt, [](double x) { return std::log(x); });
    if (op == "sqrt") return unary(bt, [](double x) { return std::sqrt(x); });
    if (op == "rsqrt") return unary(bt, [](double x) { return 1 / std::sqrt(x); });
    if (op == "pow") {
      const double e = arg_double(bt, "exponent", 2.0);
      return unary(bt, [e](double x) { return std::pow(x, e); });
    }
    if (op == "neg") return unary(bt, [](double x) { return -x; });
    if (op == "gelu") {
      const bool erf_form = arg_string(bt, "approximate") == "erf";
      return unary(bt, [erf_form](double x) { return gelu(x, erf_form); });
    }
    if (op == "gradient_scale") return gradient_scale(bt);
    if (op == "loss_scale_update") return loss_scale_update(bt);
    if (op == "affine") {
      double scale = arg_double(bt, "scale", 1.0), shift = arg_double(bt, "shift", 0.0);
      return unary(bt, [=](double x) { return scale * x + shift; });
    }
    if (op == "add") return binary(bt, [](double a, double b) { return a + b; });
    if (op == "sub") return binary(bt, [](double a, double b) { return a - b; });
    if (op == "mul") return binary(bt, [](double a, double b) { return a * b; });
    if (op == "div") return binary(bt, [](double a, double b) { return a / b; });
    if (op == "maximum") return binary(bt, [](double a, double b) { return std::max(a, b); });
    if (op == "eq" || op == "ne") return comparison(bt, op == "eq");
    if (op == "relu_backward") return gradient(bt, [](double x, double d) { return x > 0 ? d : 0.0; });
    if (op == "sigmoid_backward")
      return gradient(bt, [](double x, double d) { return d * sigmoid(x) * sigmoid(-x); });
    if (op == "silu_backward")
      return gradient(bt, [](double x, double d) { return d * sigmoid(x) * (1 + x * sigmoid(-x)); });
    if (op == "tanh_backward")
      return gradient(bt, [](double x, double d) { double t = std::tanh(x); return d * (1 - t * t); });
    if (op == "gelu_backward") {
      // The derivative of gelu by central differences of the forward formula,
      // independent of the template's analytic one.
      const bool erf_form = arg_string(bt, "approximate") == "erf";
      return gradient(bt, [erf_form](double x, double d) {
        const double h = 1e-5;
        return d * (gelu(x + h, erf_form) - gelu(x - h, erf_form)) / (2 * h);
      });
    }
    if (op == "cast" || op == "reshape") return unary(bt, [](double x) { return x; });
    if (op == "cast_backward") return unary(bt, [](double x) { return x; }, "dout", "dx");
    if (op == "neg_backward") return unary(bt, [](double x) { return -x; }, "dout", "dx");
    if (op == "affine_backward") {
      const double scale = arg_double(bt, "scale", 1.0);
      return unary(bt, [scale](double d) { return scale * d; }, "dout", "dx");
    }
    if (op == "log_backward") return gradient(bt, [](double x, double d) { return d / x; });
    if (op == "sqrt_backward") return gradient(bt, [](double x, double d) { return d / (2 * std::sqrt(x)); });
    if (op == "rsqrt_backward") return gradient(bt, [](double x, double d) { return -d / (2 * x * std::sqrt(x)); });
    if (op == "pow_backward") {
      const double e = arg_double(bt, "exponent", 2.0);
      return gradient(bt, [e](double x, double d) { return e == 0 ? 0.0 : d * e * std::pow(x, e - 1); });
    }
    if (op == "exp_backward") return gradient(bt, [](double out, double d) { return d * out; }, "out");
    if (op == "mse_backward") return mse_backward(bt);
    if (op == "concat" || op == "split") return concat_split(bt, op == "concat");
    if (op == "matmul") return matmul(bt);
    if (op == "softmax") return softmax(bt);
    if (op == "embedding") return embedding(bt);
    if (op == "transpose") return transpose(bt);
    if (op == "relu6") return unary(bt, [](double x) { return std::min(std::max(x, 0.0), 6.0); });
    if (op == "hardswish") return unary(bt, [](double x) { return x * std::min(std::max(x + 3, 0.0), 6.0) / 6; });
    if (op == "hardsigmoid") return unary(bt, [](double x) { return std::min(std::max(x + 3, 0.0), 6.0) / 6; });
    if (op == "hardsigmoid_backward")
      return gradient(bt, [](double x, double d) { return x > -3 && x < 3 ? d / 6 : 0.0; });
    if (op == "relu6_backward") return gradient(bt, [](double x, double d) { return x > 0 && x < 6 ? d : 0.0; });
    if (op == "hardswish_backward")
      return gradient(bt, [](double x, double d) { return x < -3 ? 0.0 : x <= 3 ? d * (2 * x + 3) / 6 : d; });
    if (op == "conv2d" || op == "conv2d_nhwc") return conv2d(bt, op == "conv2d_nhwc");
    if (op == "max_pool2d" || op == "avg_pool2d") return pool2d(bt, op == "max_pool2d");
    if (op == "adaptive_avg_pool2d" || op == "adaptive_avg_pool2d_nhwc")
      return adaptive_avg_pool2d(bt, op == "adaptive_avg_pool2d_nhwc");
    if (op == "max_pool2d_nhwc" || op == "avg_pool2d_nhwc") return pool2d(bt, op == "max_pool2d_nhwc", true);
    if (op == "conv2d_backward") return conv2d_backward(bt, false);
    if (op == "conv2d_nhwc_backward_data" || op == "conv2d_nhwc_backward_weight") return conv2d_backward(bt, true);
    if (op == "max_pool2d_backward" || op == "avg_pool2d_backward") return pool2d_backward(bt, op == "max_pool2d_backward");
    if (op == "max_pool2d_nhwc_backward" || op == "avg_pool2d_nhwc_backward")
      return pool2d_backward(bt, op == "max_pool2d_nhwc_backward", true);
    if (op == "adaptive_avg_pool2d_backward" || op == "adaptive_avg_pool2d_nhwc_backward")
      return adaptive_avg_pool2d_backward(bt, op == "adaptive_avg_pool2d_nhwc_backward");
    if (op == "batchnorm2d" || op == "batchnorm2d_nhwc") return batchnorm2d(bt, op == "batchnorm2d_nhwc");
    if (op == "batchnorm2d_backward" || op == "batchnorm2d_nhwc_backward")
      return batchnorm2d_backward(bt, op == "batchnorm2d_nhwc_backward");
    if (op == "permute") return permute(bt);
    if (op == "slice" || op == "slice_backward") return slice(bt, op == "slice_backward");
    if (op == "rmsnorm") return rmsnorm(bt);
    if (op == "layernorm") return layernorm(bt);
    if (op == "accumulate") return accumulate(bt);
    if (op == "sgd") return sgd(bt);
    if (op == "adam" || op == "adamw") return adam(bt, op == "adamw");
    if (op == "cross_entropy" || op == "cross_entropy_backward") return cross_entropy(bt, op == "cross_entropy");
    if (op == "sum" || op == "mean" || op == "max" || op == "log_softmax") return row_op(bt, op);
    if (op == "sum_leading") return sum_leading(bt);
    if (op == "sum_backward" || op == "mean_backward") return row_gradient(bt, op == "mean_backward");
    if (op == "max_backward") return max_backward(bt);
    if (op == "sum_leading_backward") return sum_leading_backward(bt);
    if (op == "maximum_backward") return maximum_backward(bt);
    if (op == "softmax_backward" || op == "log_softmax_backward") return softmax_backward(bt, op == "log_softmax_backward");
    if (op == "rmsnorm_backward" || op == "layernorm_backward") return norm_backward(bt, op == "layernorm_backward");
    if (op == "embedding_backward") return embedding_backward(bt);
    if (op == "mse") return mse(bt);
    if (op == "fill" || op == "uniform" || op == "normal" || op == "dropout_mask") return init(bt);
    if (op == "split_heads" || op == "merge_heads") return heads(bt, op == "split_heads");
    if (const auto f = user_.functions.find(op); f != user_.functions.end()) return user_element(bt, f->second);
    if (bt.op->reference == "none") return device_values(bt);
    throw std::runtime_error(fmt::format(
        "no float64 reference for op '{}' (task '{}'): a user's op gives one in its template (`reference: FUNCTION`, "
        "or `reference: none` to run it unchecked; docs/templates.md)",
        op, bt.task->id));
  }

 private:
  int buf(const BoundTask& bt, const char* slot) const { return bt.find_tensor(slot)->buffer; }
  const Shape& shape(int b) const { return p_.buffers[size_t(b)].shape; }
  const std::vector<double>& val(int b) const {
    if (r_.value[size_t(b)].empty() && numel(shape(b)) > 0)
      throw std::runtime_error(fmt::format("reference: buffer {} read before it is written", b));
    return r_.value[size_t(b)];
  }
  // A stored value carries its dtype's absolute error near zero (f16's
  // subnormal spacing, a flushed f32): as a floor of the error scale,
  // atol / rtol, it reaches what later tasks compute from it (a cast of an
  // f16 value that stored as 0 to bf16, whose own floor is far smaller).
  // A value beyond the dtype's range is stored as the infinity it rounds to,
  // and later tasks read that, as the kernels do: an f16 gradient that a loss
  // scale overflows makes the sum of squares infinite and the step skipped.
  void out(int b, std::vector<double> v, std::vector<double> a) {
    const DType dtype = p_.buffers[size_t(b)].dtype;
    if (dtype != DType::i32 && dtype != DType::i64) {
      const double floor = absolute_tolerance(dtype) / relative_tolerance(dtype), overflow = overflow_threshold(dtype);
      for (double& x : a) x = std::max(x, floor);
      for (size_t i = 0; i < v.size(); ++i)
        if (std::abs(v[i]) >= overflow) {
          v[i] = std::copysign(INFINITY, v[i]);
          if (i < a.size()) a[i] = INFINITY;
        }
    }
    r_.value[size_t(b)] = std::move(v);
    r_.abs[size_t(b)] = std::move(a);
  }
  // An argument's value: where it follows another task's, that one's; where
  // that is a run-time argument given a value for this run, the value.
  const ArgValue* arg(const BoundTask& bt, const char* name) const {
    auto [task, root] = root_arg(p_, int(&bt - p_.tasks.data()), name);
    if (root == nullptr) return nullptr;
    if (root->runtime) {
      auto it = args_.find(p_.tasks[size_t(task)].task->id + "." + root->name);
      if (it != args_.end()) return &it->second;
    }
    return &root->value;
  }
  // A float argument reaches the kernels as f32 (a literal or a scalar), so
  // the reference computes with the same rounded value, as it does with
  // tensor inputs: Adam's 1 - beta2 from 0.999f is 1.3e-5 off 0.001, which
  // is the argument's rounding, not the kernel's arithmetic.
  double arg_double(const BoundTask& bt, const char* name, double fallback) const {
    const ArgValue* a = arg(bt, name);
    if (a == nullptr) return fallback;
    const ArgSignature* sig = bt.op->find_arg(name);
    if (auto* d = std::get_if<double>(a)) return sig != nullptr && sig->type == ArgType::float_ ? double(float(*d)) : *d;
    if (auto* i = std::get_if<int64_t>(a)) return double(*i);
    if (auto* b = std::get_if<bool>(a)) return *b ? 1 : 0;
    return fallback;
  }
  std::string arg_string(const BoundTask& bt, const char* name) const {
    const ArgValue* a = arg(bt, name);
    return a != nullptr && std::holds_alternative<std::string>(*a) ? std::get<std::string>(*a) : std::string();
  }
  bool arg_bool(const BoundTask& bt, const char* name) const { return arg_double(bt, name, 0) != 0; }

  // Error scales by first-order propagation: |f'(x)| times the input's scale
  // (what an error already in x becomes), plus |f(x)| (the op's own rounding,
  // relative to its result). Derivatives by central differences in float64.
  // gelu without cancellation: 0.5 * (1 + tanh(u)) is 1 / (1 + exp(-2u)),
  // and 1 + erf(z) is erfc(-z). The textbook forms lose every digit for
  // negative x even in float64 (gelu(-6.5) is 6e-13 and 1 + tanh(u) rounds at
  // 1e-16), and the error bounds take central differences of this function,
  // so those rounding steps made a bound as wrong as the value.
  // 1 / (1 + exp(-x)) with exp taken of -|x| only; 1 - sigmoid(x) is
  // sigmoid(-x), which a difference would round to 0 from x > 37 in float64.
  static double sigmoid(double x) {
    const double e = std::exp(-std::abs(x));
    return x >= 0 ? 1 / (1 + e) : e / (1 + e);
  }

  static double gelu(double x, bool erf_form) {
    if (erf_form) return 0.5 * x * std::erfc(-x / std::sqrt(2.0));
    return x / (1 + std::exp(-2 * std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
  }

  template <typename F>
  static double derivative(F f, double x) {
    double h = 1e-6 * std::max(1.0, std::abs(x));
    return (f(x + h) - f(x - h)) / (2 * h);
  }

  // How much f moves per unit of an error of up to `delta` in x: |f'(x)|
  // where f is smooth across [x - delta, x + delta]; where that interval
  // holds a kink or a jump (relu at 0, a gradient's branch on x > 0), the
  // secant across it. A value computed a little below 0 may come out of a
  // kernel a little above it, and relu then passes it on: the first-order
  // scale, 0 there, failed correct TF32 convolutions whose residual added
  // such an element. (Secants that leave f's domain, log below 0, are skipped.)
  template <typename F>
  static double slope(F f, double x, double delta) {
    double s = std::abs(derivative(f, x));
    if (!(delta > 0)) return s;
    for (double side : {x - delta, x + delta}) {
      const double secant = std::abs(f(side) - f(x)) / delta;
      if (std::isfinite(secant)) s = std::max(s, secant);
    }
    return s;
  }

  // The error a computed buffer's values may carry into a task, relative to
  // their scale: the end-to-end tolerance it is checked to (0 for inputs,
  // which are exact, and wherever the caller gives none).
  double carried_error(int buffer) const {
    return size_t(buffer) < carried_error_.size() ? carried_error_[size_t(buffer)] : 0.0;
  }

  template <typename F>
  void unary(const BoundTask& bt, F f, const char* in = "x", const char* result = "out") {
    int x = buf(bt, in), o = buf(bt, result);
    const auto& xv = val(x);
    const auto& xa = r_.abs[size_t(x)];
    std::vector<double> v(xv.size()), a(xv.size());
    for (size_t i = 0; i < xv.size(); ++i) {
      v[i] = f(xv[i]);
      a[i] = slope(f, xv[i], carried_error(x) * xa[i]) * xa[i] + std::abs(v[i]);
    }
    out(o, std::move(v), std::move(a));
  }

  // Error scales: the op applied to absolute values, where that bounds the
  // result's sensitivity (sums, products, monotone activations); otherwise the
  // scale of the inputs themselves (see each caller).
  template <typename F>
  void binary(const BoundTask& bt, F f) {
    int x = buf(bt, "a"), y = buf(bt, "b"), o = buf(bt, "out");
    const std::string& op = bt.op->name;
    int64_t n = numel(shape(o));
    std::vector<double> v(static_cast<size_t>(n)), a(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      int64_t ia = broadcast_source(shape(o), shape(x), i), ib = broadcast_source(shape(o), shape(y), i);
      double xv = val(x)[size_t(ia)], yv = val(y)[size_t(ib)];
      double xa = r_.abs[size_t(x)][size_t(ia)], ya = r_.abs[size_t(y)][size_t(ib)];
      v[size_t(i)] = f(xv, yv);
      if (op == "mul") a[size_t(i)] = xa * ya;
      else if (op == "div") a[size_t(i)] = (xa + std::abs(xv / yv) * ya) / std::abs(yv);  // first order
      else if (op == "maximum") a[size_t(i)] = std::max(xa, ya);
      else a[size_t(i)] = xa + ya;
    }
    out(o, std::move(v), std::move(a));
  }

  // A value as a buffer of `dtype` holds it.
  static double round_to(DType dtype, double x) {
    switch (dtype) {
      case DType::f32: return double(float(x));
      case DType::f16: return double(f16_to_float(float_to_f16(float(x))));
      case DType::bf16: return double(bf16_to_float(float_to_bf16(float(x))));
      default: return x;
    }
  }

  // eq, ne: exact. The operands compared as stored, rounded to their dtype
  // (the reference's own values of a computed operand carry no rounding; a
  // fused 16-bit kernel compares the f32 value it holds, which can differ
  // from that in its last bits); 0 or 1, with no error scale: a comparison
  // of two values within rounding of each other can come out either way,
  // and then fails the check, as it should be looked at.
  void comparison(const BoundTask& bt, bool equal) {
    int x = buf(bt, "a"), y = buf(bt, "b"), o = buf(bt, "out");
    const DType dx = p_.buffers[size_t(x)].dtype, dy = p_.buffers[size_t(y)].dtype;
    int64_t n = numel(shape(o));
    std::vector<double> v(static_cast<size_t>(n)), a(static_cast<size_t>(n), 0.0);
    for (int64_t i = 0; i < n; ++i) {
      const double xv = round_to(dx, val(x)[size_t(broadcast_source(shape(o), shape(x), i))]);
      const double yv = round_to(dy, val(y)[size_t(broadcast_source(shape(o), shape(y), i))]);
      v[size_t(i)] = (xv == yv) == equal ? 1.0 : 0.0;
    }
    out(o, std::move(v), std::move(a));
  }

  // dx = f(x, dout), scaled as unary ops are, through both partial derivatives.
  template <typename F>
  void gradient(const BoundTask& bt, F f, const char* forward_slot = "x") {
    int x = buf(bt, forward_slot), d = buf(bt, "dout"), o = buf(bt, "dx");
    int64_t n = numel(shape(o));
    std::vector<double> v(static_cast<size_t>(n)), a(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      double xv = val(x)[size_t(i)], dv = val(d)[size_t(i)];
      const double xa = r_.abs[size_t(x)][size_t(i)], da = r_.abs[size_t(d)][size_t(i)];
      double dfdx = slope([&](double t) { return f(t, dv); }, xv, carried_error(x) * xa);
      double dfdd = slope([&](double t) { return f(xv, t); }, dv, carried_error(d) * da);
      v[size_t(i)] = f(xv, dv);
      a[size_t(i)] = dfdx * xa + dfdd * da + std::abs(v[size_t(i)]);
    }
    out(o, std::move(v), std::move(a));
  }

  // Along the last axis: out[r, j] = j < A ? a[r, j] : b[r, j - A], and its inverse.
  void concat_split(const BoundTask& bt, bool concat) {
    int a = buf(bt, "a"), b = buf(bt, "b"), whole = buf(bt, concat ? "out" : "x");
    const int64_t A = shape(a).back(), B = shape(b).back(), rows = numel(shape(whole)) / (A + B);
    std::vector<double> wv(size_t(rows * (A + B))), wa(wv.size()), av(size_t(rows * A)), aa(av.size()),
        bv(size_t(rows * B)), ba(bv.size());
    if (!concat) {
      wv = val(whole);
      wa = r_.abs[size_t(whole)];
    } else {
      av = val(a), aa = r_.abs[size_t(a)], bv = val(b), ba = r_.abs[size_t(b)];
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < A + B; ++j) {
        const size_t w = size_t(r * (A + B) + j), part = size_t(j < A ? r * A + j : r * B + j - A);
        double& pv = j < A ? av[part] : bv[part];
        double& pa = j < A ? aa[part] : ba[part];
        if (concat) {
          wv[w] = pv;
          wa[w] = pa;
        } else {
          pv = wv[w];
          pa = wa[w];
        }
      }
    if (concat) {
      out(whole, std::move(wv), std::move(wa));
    } else {
      out(a, std::move(av), std::move(aa));
      out(b, std::move(bv), std::move(ba));
    }
  }

  // dpred = 2 * (pred - target) * scale.
  void mse_backward(const BoundTask& bt) {
    int p = buf(bt, "pred"), t = buf(bt, "target"), o = buf(bt, "dpred");
    const double scale = arg_double(bt, "scale", 1.0);
    int64_t n = numel(shape(o));
    std::vector<double> v(static_cast<size_t>(n)), a(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      v[size_t(i)] = 2 * (val(p)[size_t(i)] - val(t)[size_t(i)]) * scale;
      a[size_t(i)] = 2 * (r_.abs[size_t(p)][size_t(i)] + r_.abs[size_t(t)][size_t(i)]) * std::abs(scale);
    }
    out(o, std::move(v), std::move(a));
  }

  void matmul(const BoundTask& bt) {
    int ba = buf(bt, "a"), bb = buf(bt, "b"), bo = buf(bt, "out");
    bool ta = arg_bool(bt, "trans_a"), tb = arg_bool(bt, "trans_b");
    double alpha = arg_double(bt, "alpha", 1.0);
    const Shape &sa = shape(ba), &sb = shape(bb), &so = shape(bo);
    int64_t M = so[so.size() - 2], N = so.back(), K = ta ? sa[sa.size() - 2] : sa.back();
    Shape batch_o(so.begin(), so.end() - 2), batch_a(sa.begin(), sa.end() - 2), batch_b(sb.begin(), sb.end() - 2);
    int64_t batches = numel(batch_o);
    std::vector<double> v(size_t(numel(so))), a(v.size());
    for (int64_t z = 0; z < batches; ++z) {
      int64_t za = broadcast_source(batch_o, batch_a, z) * M * K, zb = broadcast_source(batch_o, batch_b, z) * K * N;
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
          double s = 0, sabs = 0;
          for (int64_t k = 0; k < K; ++k) {
            size_t ia = size_t(za + (ta ? k * M + m : m * K + k)), ib = size_t(zb + (tb ? n * K + k : k * N + n));
            s += val(ba)[ia] * val(bb)[ib];
            sabs += r_.abs[size_t(ba)][ia] * r_.abs[size_t(bb)][ib];
          }
          v[size_t(z * M * N + m * N + n)] = alpha * s;
          a[size_t(z * M * N + m * N + n)] = std::abs(alpha) * sabs;
        }
    }
    out(bo, std::move(v), std::move(a));
  }

  void softmax(const BoundTask& bt) {
    int x = buf(bt, "x"), o = buf(bt, "out");
    const Shape& s = shape(x);
    int64_t n = s.back(), rows = numel(s) / n, rows_per_matrix = s.size() >= 2 ? s[s.size() - 2] : 1;
    double scale = arg_double(bt, "scale", 1.0);
    bool causal = arg_bool(bt, "causal");
    std::vector<double> v(size_t(numel(s))), a(v.size());
    for (int64_t r = 0; r < rows; ++r) {
      int64_t valid = causal ? std::min(n, r % rows_per_matrix + 1) : n;
      double m = -INFINITY, sum = 0;
      for (int64_t j = 0; j < valid; ++j) m = std::max(m, scale * val(x)[size_t(r * n + j)]);
      for (int64_t j = 0; j < valid; ++j) sum += std::exp(scale * val(x)[size_t(r * n + j)] - m);
      // First-order propagation: an error e_j in each input moves p_i by at most
      // p_i * |scale| * 2 max_j e_j, and each e_j is bounded by rtol * abs_j.
      double max_abs_in = 0;
      for (int64_t j = 0; j < valid; ++j) max_abs_in = std::max(max_abs_in, r_.abs[size_t(x)][size_t(r * n + j)]);
      for (int64_t j = 0; j < n; ++j) {
        size_t i = size_t(r * n + j);
        v[i] = j < valid ? std::exp(scale * val(x)[i] - m) / sum : 0.0;
        a[i] = v[i] * (1.0 + 2.0 * std::abs(scale) * max_abs_in);
      }
    }
    out(o, std::move(v), std::move(a));
  }

  void embedding(const BoundTask& bt) {
    int table = buf(bt, "table"), ids = buf(bt, "ids"), o = buf(bt, "out");
    int64_t dim = shape(table).back(), rows = shape(table)[0], n = numel(shape(o));
    std::vector<double> v(static_cast<size_t>(n)), a(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      int64_t row = int64_t(val(ids)[size_t(i / dim)]);
      if (row < 0 || row >= rows) throw std::runtime_error(fmt::format("reference: embedding id {} out of range", row));
      v[size_t(i)] = val(table)[size_t(row * dim + i % dim)];
      a[size_t(i)] = r_.abs[size_t(table)][size_t(row * dim + i % dim)];
    }
    out(o, std::move(v), std::move(a));
  }

  // out = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps). An error e in x
  // moves out[j] by |w_j| rstd (e_j + |x_j| rstd max_k e_k) at first order.
  // loss = mean over rows of log(sum(exp(x))) - x[label]; its gradient
  // (softmax(x) - onehot(label)) * scale. An error e in x moves a row's loss
  // by at most 2e, and softmax_j by softmax_j * 2e.
  void cross_entropy(const BoundTask& bt, bool forward) {
    int x = buf(bt, "logits"), l = buf(bt, "labels");
    const int64_t classes = shape(x).back(), rows = numel(shape(x)) / classes;
    const double scale = arg_double(bt, "scale", 1.0);
    std::vector<double> grad(size_t(rows * classes)), grad_abs(grad.size());
    double loss = 0, loss_abs = 0;
    for (int64_t r = 0; r < rows; ++r) {
      double row_max = -INFINITY, max_err = 0;
      for (int64_t j = 0; j < classes; ++j) {
        row_max = std::max(row_max, val(x)[size_t(r * classes + j)]);
        max_err = std::max(max_err, r_.abs[size_t(x)][size_t(r * classes + j)]);
      }
      double sum = 0;
      for (int64_t j = 0; j < classes; ++j) sum += std::exp(val(x)[size_t(r * classes + j)] - row_max);
      const double lse = row_max + std::log(sum);
      const int64_t label = int64_t(val(l)[size_t(r)]);
      if (label < 0 || label >= classes)
        throw std::runtime_error(fmt::format("reference: label {} of row {} is not a class of {}", label, r, classes));
      const double picked = val(x)[size_t(r * classes + label)];
      loss += (lse - picked) / double(rows);
      loss_abs += (std::abs(lse) + std::abs(picked) + 2 * max_err) / double(rows);
      for (int64_t j = 0; j < classes; ++j) {
        const size_t i = size_t(r * classes + j);
        const double p = std::exp(val(x)[i] - lse), onehot = j == label ? 1.0 : 0.0;
        grad[i] = (p - onehot) * scale;
        grad_abs[i] = (p * (1 + 2 * max_err) + onehot) * std::abs(scale);
      }
    }
    if (forward) out(buf(bt, "loss"), {loss}, {loss_abs});
    else out(buf(bt, "dlogits"), std::move(grad), std::move(grad_abs));
  }

  // 1 / micro_batches, times clipping's min(1, max_norm / (norm + 1e-6)) of
  // the mean gradient where max_norm > 0 (templates/optimizers.cuh).
  // Under loss scaling, 1 / loss_scale too, and -1 (a skipped step) where the
  // kernels' f32 sum of the scaled gradients' squares overflows: beyond f32's
  // range here.
  void gradient_scale(const BoundTask& bt) {
    const BoundTensor* scale_slot = bt.find_tensor("loss_scale");
    const double loss_scale = scale_slot != nullptr ? val(scale_slot->buffer)[0] : 0.0;
    const double max_norm = arg_double(bt, "max_norm", 0),
                 mean = 1.0 / (double(arg_int(bt, "micro_batches", 1)) * (loss_scale > 0 ? loss_scale : 1.0));
    auto factor = [=](double sq_norm) {
      if (loss_scale > 0 && !(sq_norm <= double(std::numeric_limits<float>::max()))) return -1.0;
      return max_norm > 0 ? mean * std::min(1.0, max_norm / (std::sqrt(sq_norm) * mean + 1e-6)) : mean;
    };
    const BoundTensor* sq = bt.find_tensor("sq_norm");
    if (sq == nullptr) return out(buf(bt, "out"), {factor(0)}, {factor(0)});
    unary(bt, factor, "sq_norm");
  }

  // GradScaler's update (templates/optimizers.cuh): exact, a few scalars.
  void loss_scale_update(const BoundTask& bt) {
    const int scale = buf(bt, "scale"), good = buf(bt, "good_steps"), steps = buf(bt, "steps");
    double s = val(scale)[0], g = val(good)[0], n = val(steps)[0];
    if (val(buf(bt, "factor"))[0] < 0) {
      s *= arg_double(bt, "backoff_factor", 0.5);
      g = 0;
    } else {
      n += 1;
      g += 1;
      if (g >= double(arg_int(bt, "growth_interval", 2000))) {
        s *= arg_double(bt, "growth_factor", 2.0);
        g = 0;
      }
    }
    out(scale, {s}, {std::abs(s)});
    out(good, {g}, {g});
    out(steps, {n}, {n});
  }

  // A gradient summed over micro-batches in place: micro-batch 0 overwrites.
  void accumulate(const BoundTask& bt) {
    const int acc = buf(bt, "acc"), g = buf(bt, "grad");
    if (arg_int(bt, "micro_batch", 0) == 0) return out(acc, val(g), r_.abs[size_t(g)]);
    std::vector<double> v = val(acc), a = r_.abs[size_t(acc)];
    for (size_t i = 0; i < v.size(); ++i) {
      v[i] += val(g)[i];
      a[i] += r_.abs[size_t(g)][i];
    }
    out(acc, std::move(v), std::move(a));
  }

  // An optimizer's gradient scale (gradient_scale's factor) and its error scale: 1
  // where the task leaves it out.
  std::pair<double, double> grad_scale(const BoundTask& bt) {
    const BoundTensor* s = bt.find_tensor("grad_scale");
    if (s == nullptr) return {1.0, 1.0};
    return {val(s->buffer)[0], r_.abs[size_t(s->buffer)][0]};
  }

  // A task that leaves what it updates in place as it was (an optimizer on a
  // skipped step).
  void keep(const BoundTask& bt) {
    for (const auto& b : bt.tensors)
      if (b.sig->writes) out(b.buffer, val(b.buffer), r_.abs[size_t(b.buffer)]);
  }

  // torch.optim.SGD: g = grad * grad_scale + weight_decay * param;
  // buf = momentum * buf + g; param -= lr * (momentum ? buf : g). Updated in place.
  void sgd(const BoundTask& bt) {
    int p = buf(bt, "param"), g = buf(bt, "grad");
    const BoundTensor* buf_slot = bt.find_tensor("momentum_buf");
    const double lr = arg_double(bt, "lr", 0), momentum = arg_double(bt, "momentum", 0),
                 wd = arg_double(bt, "weight_decay", 0);
    std::vector<double> pv = val(p), pa = r_.abs[size_t(p)], bv, ba;
    if (buf_slot != nullptr) bv = val(buf_slot->buffer), ba = r_.abs[size_t(buf_slot->buffer)];
    const auto [scale, scale_abs] = grad_scale(bt);
    if (scale < 0) return keep(bt);  // a skipped step
    for (size_t i = 0; i < pv.size(); ++i) {
      double step = val(g)[i] * scale + wd * pv[i],
             step_abs = r_.abs[size_t(g)][i] * scale_abs + std::abs(wd) * pa[i];
      if (momentum != 0 && buf_slot != nullptr) {
        bv[i] = momentum * bv[i] + step;
        ba[i] = std::abs(momentum) * ba[i] + step_abs;
        step = bv[i];
        step_abs = ba[i];
      }
      pv[i] -= lr * step;
      pa[i] += std::abs(lr) * step_abs + std::abs(pv[i]);
    }
    out(p, std::move(pv), std::move(pa));
    if (buf_slot != nullptr && momentum != 0) out(buf_slot->buffer, std::move(bv), std::move(ba));
  }

  // torch.optim.Adam (L2 decay added to the gradient) and AdamW (decoupled
  // decay). Error scales: each moment's terms by absolute value; the step's
  // direction m_hat / (sqrt(v_hat) + eps) moves, to first order, by its own
  // size times the relative scales of m and v.
  void adam(const BoundTask& bt, bool decoupled) {
    int p = buf(bt, "param"), g = buf(bt, "grad"), m = buf(bt, "m"), v = buf(bt, "v");
    const double lr = arg_double(bt, "lr", 0), b1 = arg_double(bt, "beta1", 0.9), b2 = arg_double(bt, "beta2", 0.999),
                 eps = arg_double(bt, "eps", 1e-8), wd = arg_double(bt, "weight_decay", 0);
    const BoundTensor* counted = bt.find_tensor("step_count");
    const double step = counted != nullptr && val(counted->buffer)[0] > 0 ? val(counted->buffer)[0]
                                                                         : arg_double(bt, "step", 1);
    std::vector<double> pv = val(p), pa = r_.abs[size_t(p)], mv = val(m), ma = r_.abs[size_t(m)], vv = val(v),
                        va = r_.abs[size_t(v)];
    const auto [scale, scale_abs] = grad_scale(bt);
    if (scale < 0) return keep(bt);  // a skipped step
    for (size_t i = 0; i < pv.size(); ++i) {
      const double grad = val(g)[i] * scale + (decoupled ? 0.0 : wd * pv[i]);
      const double grad_abs = r_.abs[size_t(g)][i] * scale_abs + (decoupled ? 0.0 : std::abs(wd) * pa[i]);
      mv[i] = b1 * mv[i] + (1 - b1) * grad;
      ma[i] = b1 * ma[i] + (1 - b1) * grad_abs;
      vv[i] = b2 * vv[i] + (1 - b2) * grad * grad;
      va[i] = b2 * va[i] + (1 - b2) * grad_abs * grad_abs;
      const double m_hat = mv[i] / (1 - std::pow(b1, step)), v_hat = vv[i] / (1 - std::pow(b2, step));
      const double direction = m_hat / (std::sqrt(v_hat) + eps);
      const double direction_abs = std::abs(direction) * (1 + ma[i] / std::max(std::abs(mv[i]), 1e-30) +
                                                          va[i] / std::max(vv[i], 1e-30));
      const double base = decoupled ? pv[i] * (1 - lr * wd) : pv[i];
      pa[i] = pa[i] * (decoupled ? std::abs(1 - lr * wd) : 1.0) + std::abs(lr) * direction_abs;
      pv[i] = base - lr * direction;
      pa[i] += std::abs(pv[i]);
    }
    out(p, std::move(pv), std::move(pa));
    out(m, std::move(mv), std::move(ma));
    out(v, std::move(vv), std::move(va));
  }

  // out = (x - mean) * rstd * weight + bias. Error scales by first order: an
  // error e in x moves x - mean by up to 2e and rstd by rstd^3 * 2 * mean|x - mean| * e.
  void layernorm(const BoundTask& bt) {
    int x = buf(bt, "x"), w = buf(bt, "weight"), b = buf(bt, "bias"), o = buf(bt, "out");
    const BoundTensor* mean_slot = bt.find_tensor("mean");
    const BoundTensor* rstd_slot = bt.find_tensor("rstd");
    const double eps = arg_double(bt, "eps", 1e-5);
    const Shape& s = shape(x);
    const int64_t n = s.back(), rows = numel(s) / n;
    std::vector<double> v(static_cast<size_t>(numel(s))), a(v.size()), m(static_cast<size_t>(rows)), ma(m.size()),
        r(m.size()), ra(m.size());
    for (int64_t row = 0; row < rows; ++row) {
      double sum = 0, abs_sum = 0, max_err = 0;
      for (int64_t j = 0; j < n; ++j) {
        const size_t i = size_t(row * n + j);
        sum += val(x)[i];
        abs_sum += std::abs(val(x)[i]);
        max_err = std::max(max_err, r_.abs[size_t(x)][i]);
      }
      const double mean = sum / double(n);
      double var = 0, mad = 0;
      for (int64_t j = 0; j < n; ++j) {
        const double d = val(x)[size_t(row * n + j)] - mean;
        var += d * d;
        mad += std::abs(d);
      }
      var /= double(n);
      mad /= double(n);
      const double rstd = 1 / std::sqrt(var + eps), drstd = rstd * rstd * rstd * 2 * mad * max_err;
      m[size_t(row)] = mean;
      ma[size_t(row)] = abs_sum / double(n) + max_err;
      r[size_t(row)] = rstd;
      ra[size_t(row)] = rstd + drstd;
      for (int64_t j = 0; j < n; ++j) {
        const size_t i = size_t(row * n + j);
        const double d = val(x)[i] - mean, wv = val(w)[size_t(j)];
        v[i] = d * rstd * wv + val(b)[size_t(j)];
        a[i] = std::abs(wv) * (rstd * (r_.abs[size_t(x)][i] + max_err) + std::abs(d) * drstd) +
               std::abs(d) * rstd * r_.abs[size_t(w)][size_t(j)] + r_.abs[size_t(b)][size_t(j)] + std::abs(v[i]);
      }
    }
    out(o, std::move(v), std::move(a));
    if (mean_slot != nullptr) out(mean_slot->buffer, std::move(m), std::move(ma));
    if (rstd_slot != nullptr) out(rstd_slot->buffer, std::move(r), std::move(ra));
  }

  void rmsnorm(const BoundTask& bt) {
    int x = buf(bt, "x"), w = buf(bt, "weight"), o = buf(bt, "out");
    const BoundTensor* rstd_slot = bt.find_tensor("rstd");
    double eps = arg_double(bt, "eps", 1e-6);
    const Shape& s = shape(x);
    int64_t n = s.back(), rows = numel(s) / n;
    std::vector<double> v(static_cast<size_t>(numel(s))), a(v.size()), r(static_cast<size_t>(rows)), ra(r.size());
    for (int64_t row = 0; row < rows; ++row) {
      double sum_sq = 0, max_err = 0;
      for (int64_t j = 0; j < n; ++j) {
        double xv = val(x)[size_t(row * n + j)];
        sum_sq += xv * xv;
        max_err = std::max(max_err, r_.abs[size_t(x)][size_t(row * n + j)]);
      }
      double rstd = 1 / std::sqrt(sum_sq / double(n) + eps);
      r[size_t(row)] = rstd;
      ra[size_t(row)] = rstd + rstd * rstd * max_err;
      for (int64_t j = 0; j < n; ++j) {
        size_t i = size_t(row * n + j);
        double xv = val(x)[i], wv = val(w)[size_t(j)];
        v[i] = xv * rstd * wv;
        a[i] = std::abs(wv) * rstd * (r_.abs[size_t(x)][i] + std::abs(xv) * rstd * max_err) +
               std::abs(xv) * rstd * r_.abs[size_t(w)][size_t(j)] + std::abs(v[i]);
      }
    }
    out(o, std::move(v), std::move(a));
    if (rstd_slot != nullptr) out(rstd_slot->buffer, std::move(r), std::move(ra));
  }

  // sum and mean scale as sums of absolute values; max by the largest input
  // scale; log_softmax moves by at most twice the largest input error.
  void row_op(const BoundTask& bt, const std::string& op) {
    int x = buf(bt, "x"), o = buf(bt, "out");
    const Shape& s = shape(x);
    int64_t n = s.back(), rows = numel(s) / n;
    const bool per_element = op == "log_softmax";
    std::vector<double> v(static_cast<size_t>(per_element ? numel(s) : rows)), a(v.size());
    for (int64_t r = 0; r < rows; ++r) {
      double sum = 0, sum_abs = 0, mx = -INFINITY, max_abs = 0;
      for (int64_t j = 0; j < n; ++j) {
        double xv = val(x)[size_t(r * n + j)], xa = r_.abs[size_t(x)][size_t(r * n + j)];
        sum += xv;
        sum_abs += xa;
        mx = std::max(mx, xv);
        max_abs = std::max(max_abs, xa);
      }
      if (op == "sum" || op == "mean") {
        double k = op == "mean" ? 1.0 / double(n) : 1.0;
        v[size_t(r)] = sum * k;
        a[size_t(r)] = sum_abs * k;
      } else if (op == "max") {
        v[size_t(r)] = mx;
        a[size_t(r)] = max_abs;
      } else {
        double log_sum = 0;
        for (int64_t j = 0; j < n; ++j) log_sum += std::exp(val(x)[size_t(r * n + j)] - mx);
        log_sum = std::log(log_sum);
        for (int64_t j = 0; j < n; ++j) {
          size_t i = size_t(r * n + j);
          v[i] = val(x)[i] - mx - log_sum;
          a[i] = r_.abs[size_t(x)][i] + 2 * max_abs + std::abs(v[i]);
        }
      }
    }
    out(o, std::move(v), std::move(a));
  }

  void sum_leading(const BoundTask& bt) {
    int x = buf(bt, "x"), o = buf(bt, "out");
    int64_t n = shape(x).back(), rows = numel(shape(x)) / n;
    std::vector<double> v(static_cast<size_t>(n), 0.0), a(v.size(), 0.0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < n; ++j) {
        v[size_t(j)] += val(x)[size_t(r * n + j)];
        a[size_t(j)] += r_.abs[size_t(x)][size_t(r * n + j)];
      }
    out(o, std::move(v), std::move(a));
  }

  // dx[r, j] = dout[r] (sum) or dout[r] / n (mean).
  void row_gradient(const BoundTask& bt, bool mean) {
    const int d = buf(bt, "dout"), x = buf(bt, "dx");
    const int64_t n = shape(x).back(), total = numel(shape(x));
    const double k = mean ? 1.0 / double(n) : 1.0;
    std::vector<double> v(static_cast<size_t>(total)), a(v.size());
    for (int64_t i = 0; i < total; ++i) {
      v[size_t(i)] = val(d)[size_t(i / n)] * k;
      a[size_t(i)] = r_.abs[size_t(d)][size_t(i / n)] * k;
    }
    out(x, std::move(v), std::move(a));
  }

  // The row's gradient split evenly between the elements equal to its max.
  void max_backward(const BoundTask& bt) {
    const int x = buf(bt, "x"), m = buf(bt, "out"), d = buf(bt, "dout"), dx = buf(bt, "dx");
    const int64_t n = shape(x).back(), rows = numel(shape(x)) / n;
    std::vector<double> v(static_cast<size_t>(rows * n), 0.0), a(v.size(), 0.0);
    for (int64_t r = 0; r < rows; ++r) {
      const double mx = val(m)[size_t(r)];
      int64_t ties = 0;
      for (int64_t j = 0; j < n; ++j) ties += val(x)[size_t(r * n + j)] == mx ? 1 : 0;
      for (int64_t j = 0; j < n; ++j)
        if (val(x)[size_t(r * n + j)] == mx) {
          v[size_t(r * n + j)] = val(d)[size_t(r)] / double(ties);
          a[size_t(r * n + j)] = r_.abs[size_t(d)][size_t(r)] / double(ties);
        }
    }
    out(dx, std::move(v), std::move(a));
  }

  void sum_leading_backward(const BoundTask& bt) {
    const int d = buf(bt, "dout"), x = buf(bt, "dx");
    const int64_t n = shape(d).back(), total = numel(shape(x));
    std::vector<double> v(static_cast<size_t>(total)), a(v.size());
    for (int64_t i = 0; i < total; ++i) {
      v[size_t(i)] = val(d)[size_t(i % n)];
      a[size_t(i)] = r_.abs[size_t(d)][size_t(i % n)];
    }
    out(x, std::move(v), std::move(a));
  }

  // dout where the operand `wrt` is the larger, half of it on a tie, else 0.
  void maximum_backward(const BoundTask& bt) {
    const int ia = buf(bt, "a"), ib = buf(bt, "b"), d = buf(bt, "dout"), x = buf(bt, "dx");
    const bool wrt_a = arg_string(bt, "wrt") != "b";
    const int64_t total = numel(shape(x));
    std::vector<double> v(static_cast<size_t>(total)), a(v.size());
    for (int64_t i = 0; i < total; ++i) {
      const double av = val(ia)[size_t(broadcast_source(shape(x), shape(ia), i))];
      const double bv = val(ib)[size_t(broadcast_source(shape(x), shape(ib), i))];
      const double mine = wrt_a ? av : bv, other = wrt_a ? bv : av;
      const double share = mine > other ? 1.0 : mine == other ? 0.5 : 0.0;
      v[size_t(i)] = val(d)[size_t(i)] * share;
      a[size_t(i)] = r_.abs[size_t(d)][size_t(i)] * share;
    }
    out(x, std::move(v), std::move(a));
  }

  // softmax: dx = scale * out * (dout - sum(dout * out)); log_softmax:
  // dx = dout - exp(out) * sum(dout). Error scales: the same computation on
  // the inputs' scales, exp's first-order term included.
  void softmax_backward(const BoundTask& bt, bool log) {
    int o = buf(bt, "out"), d = buf(bt, "dout"), x = buf(bt, "dx");
    const double scale = log ? 1.0 : arg_double(bt, "scale", 1.0);
    const int64_t n = shape(o).back(), rows = numel(shape(o)) / n;
    const auto &ov = val(o), &dv = val(d), &oa = r_.abs[size_t(o)], &da = r_.abs[size_t(d)];
    std::vector<double> v(ov.size()), a(ov.size());
    for (int64_t r = 0; r < rows; ++r) {
      double dot = 0, dot_abs = 0;
      for (int64_t j = 0; j < n; ++j) {
        const size_t i = size_t(r * n + j);
        dot += log ? dv[i] : dv[i] * ov[i];
        dot_abs += log ? da[i] : da[i] * oa[i];
      }
      for (int64_t j = 0; j < n; ++j) {
        const size_t i = size_t(r * n + j);
        if (log) {
          v[i] = dv[i] - std::exp(ov[i]) * dot;
          a[i] = da[i] + std::exp(ov[i]) * (1 + oa[i]) * dot_abs;
        } else {
          v[i] = scale * ov[i] * (dv[i] - dot);
          a[i] = std::abs(scale) * oa[i] * (da[i] + dot_abs);
        }
      }
    }
    out(x, std::move(v), std::move(a));
  }

  // rmsnorm: dx = rstd * (w * dout - x * rstd^2 * mean(w * dout * x)),
  // dweight = sum over rows of dout * x * rstd. layernorm, with
  // xhat = (x - mean) * rstd and g = dout * w:
  // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), dweight = sum of
  // dout * xhat, dbias = sum of dout. Error scales: the same computation on
  // the inputs' scales, rstd's up to three appearances counted thrice.
  void norm_backward(const BoundTask& bt, bool layer) {
    int x = buf(bt, "x"), w = buf(bt, "weight"), d = buf(bt, "dout"), rs = buf(bt, "rstd");
    int mu = layer ? buf(bt, "mean") : -1;
    const int64_t n = shape(x).back(), rows = numel(shape(x)) / n;
    const auto &xv = val(x), &wv = val(w), &dv = val(d), &rv = val(rs);
    const auto &xa = r_.abs[size_t(x)], &wa = r_.abs[size_t(w)], &da = r_.abs[size_t(d)], &ra = r_.abs[size_t(rs)];
    std::vector<double> dx(xv.size()), dxa(xv.size()), dw(size_t(n), 0.0), dwa(dw.size(), 0.0), db(dw.size(), 0.0),
        dba(dw.size(), 0.0);
    for (int64_t r = 0; r < rows; ++r) {
      const double rstd = rv[size_t(r)], rstd_abs = ra[size_t(r)];
      const double mean = layer ? val(mu)[size_t(r)] : 0.0, mean_abs = layer ? r_.abs[size_t(mu)][size_t(r)] : 0.0;
      auto xhat = [&](int64_t j) { return (xv[size_t(r * n + j)] - mean) * (layer ? rstd : 1.0); };
      auto xhat_abs = [&](int64_t j) { return (xa[size_t(r * n + j)] + mean_abs) * (layer ? rstd_abs : 1.0); };
      double sum_g = 0, sum_g_abs = 0, sum_gx = 0, sum_gx_abs = 0;
      for (int64_t j = 0; j < n; ++j) {
        const size_t i = size_t(r * n + j);
        sum_g += dv[i] * wv[size_t(j)];
        sum_g_abs += da[i] * wa[size_t(j)];
        sum_gx += dv[i] * wv[size_t(j)] * xhat(j);
        sum_gx_abs += da[i] * wa[size_t(j)] * xhat_abs(j);
      }
      for (int64_t j = 0; j < n; ++j) {
        const size_t i = size_t(r * n + j);
        const double g = dv[i] * wv[size_t(j)], g_abs = da[i] * wa[size_t(j)];
        if (layer) {
          dx[i] = rstd * (g - sum_g / double(n) - xhat(j) * sum_gx / double(n));
          dxa[i] = 3 * rstd_abs * (g_abs + sum_g_abs / double(n) + xhat_abs(j) * sum_gx_abs / double(n));
          dw[size_t(j)] += dv[i] * xhat(j);
          dwa[size_t(j)] += da[i] * xhat_abs(j);
          db[size_t(j)] += dv[i];
          dba[size_t(j)] += da[i];
        } else {
          const double c = rstd * rstd * sum_gx / double(n), c_abs = rstd_abs * rstd_abs * sum_gx_abs / double(n);
          dx[i] = rstd * (g - xv[i] * c);
          dxa[i] = 3 * rstd_abs * (g_abs + xa[i] * c_abs);
          dw[size_t(j)] += dv[i] * xv[i] * rstd;
          dwa[size_t(j)] += da[i] * xa[i] * rstd_abs;
        }
      }
    }
    out(buf(bt, "dx"), std::move(dx), std::move(dxa));
    out(buf(bt, "dweight"), std::move(dw), std::move(dwa));
    if (layer) out(buf(bt, "dbias"), std::move(db), std::move(dba));
  }

  // dtable[v, :] = the sum of the dout rows whose id is v.
  void embedding_backward(const BoundTask& bt) {
    int ids = buf(bt, "ids"), d = buf(bt, "dout"), t = buf(bt, "dtable");
    const int64_t rows = shape(t).front(), dim = shape(t).back(), count = numel(shape(ids));
    std::vector<double> v(size_t(rows * dim), 0.0), a(v.size(), 0.0);
    for (int64_t s = 0; s < count; ++s) {
      const int64_t row = int64_t(val(ids)[size_t(s)]);
      if (row < 0 || row >= rows)
        throw std::runtime_error(fmt::format("reference: embedding id {} out of range", row));
      for (int64_t j = 0; j < dim; ++j) {
        v[size_t(row * dim + j)] += val(d)[size_t(s * dim + j)];
        a[size_t(row * dim + j)] += r_.abs[size_t(d)][size_t(s * dim + j)];
      }
    }
    out(t, std::move(v), std::move(a));
  }

  // loss = mean((pred - target)^2); its scale, the same on the inputs' scales.
  void mse(const BoundTask& bt) {
    int p = buf(bt, "pred"), t = buf(bt, "target");
    const auto &pv = val(p), &tv = val(t), &pa = r_.abs[size_t(p)], &ta = r_.abs[size_t(t)];
    double loss = 0, loss_abs = 0;
    for (size_t i = 0; i < pv.size(); ++i) {
      loss += (pv[i] - tv[i]) * (pv[i] - tv[i]);
      loss_abs += (pa[i] + ta[i]) * (pa[i] + ta[i]);
    }
    const double n = double(std::max<size_t>(pv.size(), 1));
    out(buf(bt, "loss"), {loss / n}, {loss_abs / n});
  }

  void heads(const BoundTask& bt, bool split) {
    int x = buf(bt, "x"), o = buf(bt, "out");
    const Shape& s = split ? shape(o) : shape(x);  // [..., H, T, D]
    int64_t H = s[s.size() - 3], T = s[s.size() - 2], D = s.back(), n = numel(shape(o));
    std::vector<double> v(static_cast<size_t>(n)), a(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      int64_t d = i % D, src;
      if (split) {
        int64_t t = (i / D) % T, h = (i / (D * T)) % H, rest = i / (D * T * H);
        src = ((rest * T + t) * H + h) * D + d;
      } else {
        int64_t h = (i / D) % H, t = (i / (D * H)) % T, rest = i / (D * H * T);
        src = ((rest * H + h) * T + t) * D + d;
      }
      v[size_t(i)] = val(x)[size_t(src)];
      a[size_t(i)] = r_.abs[size_t(x)][size_t(src)];
    }
    out(o, std::move(v), std::move(a));
  }

  static float unit_float(int64_t seed, int64_t i, int stream) { return counter_unit_float(seed, i, stream); }

  void init(const BoundTask& bt) {
    int o = buf(bt, "out");
    const std::string& op = bt.op->name;
    const bool f32 = p_.buffers[size_t(o)].dtype == DType::f32;
    int64_t seed = 0;
    if (const ArgValue* a = arg(bt, "seed"); a != nullptr && std::holds_alternative<int64_t>(*a)) seed = std::get<int64_t>(*a);
    int64_t n = numel(shape(o));
    std::vector<double> v(static_cast<size_t>(n)), a(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      double x = 0;
      if (op == "fill") {
        x = f32 ? double(float(arg_double(bt, "value", 0))) : arg_double(bt, "value", 0);
      } else if (op == "dropout_mask") {  // the kernel's own comparison and scale, in f32
        const float p = float(arg_double(bt, "p", 0));
        const int64_t draw = dropout_draw_seed(seed, arg_int(bt, "step", 1), arg_int(bt, "micro_batch", 0));
        x = unit_float(draw, i, 0) < p ? 0.0 : double(1.0f / (1.0f - p));
      } else if (op == "uniform") {
        double low = arg_double(bt, "low", 0), high = arg_double(bt, "high", 1);
        x = f32 ? double(std::fma(float(high) - float(low), unit_float(seed, i, 0), float(low)))
                : std::fma(high - low, double(unit_float(seed, i, 0)), low);
      } else {
        double u1 = 1.0 - unit_float(seed, i, 0), u2 = unit_float(seed, i, 1);
        x = arg_double(bt, "mean", 0) + arg_double(bt, "std", 1) * std::sqrt(-2 * std::log(u1)) * std::cos(2 * M_PI * u2);
      }
      v[size_t(i)] = x;
      a[size_t(i)] = std::abs(x) + (op == "normal" ? std::abs(arg_double(bt, "std", 1)) : 0.0);
    }
    out(o, std::move(v), std::move(a));
  }

  void transpose(const BoundTask& bt) {
    int x = buf(bt, "x"), o = buf(bt, "out");
    const Shape& s = shape(x);
    int64_t M = s[s.size() - 2], N = s.back(), batches = numel(s) / (M * N);
    std::vector<double> v(size_t(numel(s))), a(v.size());
    for (int64_t z = 0; z < batches; ++z)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
          v[size_t(z * M * N + n * M + m)] = val(x)[size_t(z * M * N + m * N + n)];
          a[size_t(z * M * N + n * M + m)] = r_.abs[size_t(x)][size_t(z * M * N + m * N + n)];
        }
    out(o, std::move(v), std::move(a));
  }

  int64_t arg_int(const BoundTask& bt, const char* name, int64_t fallback) const {
    return int64_t(arg_double(bt, name, double(fallback)));
  }

  // Direct convolution, the definition (torch.nn.functional.conv2d); the
  // error scale is the same sum over absolute values. nhwc: conv2d_nhwc's
  // layouts (x and out channels-last, weight [O, KH, KW, CG]), no bias.
  void conv2d(const BoundTask& bt, bool nhwc) {
    const int x = buf(bt, "x"), w = buf(bt, "weight"), o = buf(bt, "out");
    const BoundTensor* bias = bt.find_tensor("bias");
    const Shape &sx = shape(x), &sw = shape(w), &so = shape(o);
    const int64_t B = sx[0], C = nhwc ? sx[3] : sx[1], H = nhwc ? sx[1] : sx[2], W = nhwc ? sx[2] : sx[3], O = sw[0],
                  KH = nhwc ? sw[1] : sw[2], KW = nhwc ? sw[2] : sw[3], OH = nhwc ? so[1] : so[2],
                  OW = nhwc ? so[2] : so[3];
    const int64_t groups = arg_int(bt, "groups", 1), OG = O / groups, CG = C / groups;
    const int64_t sh = arg_int(bt, "stride_h", 1), sw_ = arg_int(bt, "stride_w", 1), ph = arg_int(bt, "padding_h", 0),
                  pw = arg_int(bt, "padding_w", 0), dh = arg_int(bt, "dilation_h", 1), dw = arg_int(bt, "dilation_w", 1);
    // Where (image, channel, row, column) of x and out, (output channel, input channel, row, column) of the weight lie.
    auto image_at = [&](int64_t b, int64_t c, int64_t h, int64_t ww, int64_t channels, int64_t rows, int64_t cols) {
      return size_t(nhwc ? ((b * rows + h) * cols + ww) * channels + c : ((b * channels + c) * rows + h) * cols + ww);
    };
    auto weight_at = [&](int64_t oc, int64_t c, int64_t i, int64_t j) {
      return size_t(nhwc ? ((oc * KH + i) * KW + j) * CG + c : ((oc * CG + c) * KH + i) * KW + j);
    };
    std::vector<double> v(size_t(numel(so))), a(v.size());
    for (int64_t b = 0; b < B; ++b)
      for (int64_t oc = 0; oc < O; ++oc)
        for (int64_t oh = 0; oh < OH; ++oh)
          for (int64_t ow = 0; ow < OW; ++ow) {
            double sum = 0, sabs = 0;
            if (bias != nullptr) {
              sum = val(bias->buffer)[size_t(oc)];
              sabs = r_.abs[size_t(bias->buffer)][size_t(oc)];
            }
            const int64_t g = oc / OG;
            for (int64_t c = 0; c < CG; ++c)
              for (int64_t i = 0; i < KH; ++i)
                for (int64_t j = 0; j < KW; ++j) {
                  const int64_t h = oh * sh - ph + i * dh, ww = ow * sw_ - pw + j * dw;
                  if (h < 0 || h >= H || ww < 0 || ww >= W) continue;
                  const size_t ix = image_at(b, g * CG + c, h, ww, C, H, W), iw = weight_at(oc, c, i, j);
                  sum += val(x)[ix] * val(w)[iw];
                  sabs += r_.abs[size_t(x)][ix] * r_.abs[size_t(w)][iw];
                }
            const size_t io = image_at(b, oc, oh, ow, O, OH, OW);
            v[io] = sum;
            a[io] = sabs;
          }
    out(o, std::move(v), std::move(a));
  }

  // conv2d's gradients by the definition: every (output, tap) pair that the
  // forward sums adds its product to dx, dweight and dbias; each error scale
  // is the same sum over absolute values. nhwc: conv2d_nhwc's layouts (its
  // gradients are two ops, dx and dweight, each computed where bound).
  void conv2d_backward(const BoundTask& bt, bool nhwc) {
    const int x = buf(bt, "x"), w = buf(bt, "weight"), d = buf(bt, "dout");
    const BoundTensor *dx = bt.find_tensor("dx"), *dw = bt.find_tensor("dweight"), *db = bt.find_tensor("dbias");
    const Shape &sx = shape(x), &sw = shape(w), &sd = shape(d);
    const int64_t B = sx[0], C = nhwc ? sx[3] : sx[1], H = nhwc ? sx[1] : sx[2], W = nhwc ? sx[2] : sx[3], O = sw[0],
                  KH = nhwc ? sw[1] : sw[2], KW = nhwc ? sw[2] : sw[3], OH = nhwc ? sd[1] : sd[2],
                  OW = nhwc ? sd[2] : sd[3];
    const int64_t groups = arg_int(bt, "groups", 1), OG = O / groups, CG = C / groups;
    const int64_t sh = arg_int(bt, "stride_h", 1), sw_ = arg_int(bt, "stride_w", 1), ph = arg_int(bt, "padding_h", 0),
                  pw = arg_int(bt, "padding_w", 0), dh = arg_int(bt, "dilation_h", 1), dw_ = arg_int(bt, "dilation_w", 1);
    const auto &xv = val(x), &wv = val(w), &dv = val(d), &xa = r_.abs[size_t(x)], &wa = r_.abs[size_t(w)],
               &da = r_.abs[size_t(d)];
    std::vector<double> gx(size_t(numel(sx)), 0.0), gxa(gx.size(), 0.0), gw(size_t(numel(sw)), 0.0), gwa(gw.size(), 0.0),
        gb(size_t(O), 0.0), gba(gb.size(), 0.0);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t oc = 0; oc < O; ++oc)
        for (int64_t oh = 0; oh < OH; ++oh)
          for (int64_t ow = 0; ow < OW; ++ow) {
            const size_t io = size_t(nhwc ? ((b * OH + oh) * OW + ow) * O + oc : ((b * O + oc) * OH + oh) * OW + ow);
            gb[size_t(oc)] += dv[io];
            gba[size_t(oc)] += da[io];
            const int64_t g = oc / OG;
            for (int64_t c = 0; c < CG; ++c)
              for (int64_t i = 0; i < KH; ++i)
                for (int64_t j = 0; j < KW; ++j) {
                  const int64_t h = oh * sh - ph + i * dh, ww = ow * sw_ - pw + j * dw_;
                  if (h < 0 || h >= H || ww < 0 || ww >= W) continue;
                  const size_t ix = size_t(nhwc ? ((b * H + h) * W + ww) * C + g * CG + c
                                                : ((b * C + g * CG + c) * H + h) * W + ww);
                  const size_t iw = size_t(nhwc ? ((oc * KH + i) * KW + j) * CG + c : ((oc * CG + c) * KH + i) * KW + j);
                  gx[ix] += dv[io] * wv[iw];
                  gxa[ix] += da[io] * wa[iw];
                  gw[iw] += dv[io] * xv[ix];
                  gwa[iw] += da[io] * xa[ix];
                }
          }
    if (dx != nullptr) out(dx->buffer, std::move(gx), std::move(gxa));
    if (dw != nullptr) out(dw->buffer, std::move(gw), std::move(gwa));
    if (db != nullptr) out(db->buffer, std::move(gb), std::move(gba));
  }

  // The pooling gradients: each window's dout to what the forward read
  // (pool2d's order: max's first largest), over its divisor for avg.
  void pool2d_backward(const BoundTask& bt, bool max, bool nhwc = false) {
    const int d = buf(bt, "dout"), o = buf(bt, "dx");
    const int x = max ? buf(bt, "x") : -1;
    const Shape &sx = shape(o);
    const Planes px = planes_of(sx, nhwc), po = planes_of(shape(d), nhwc);
    const int64_t H = px.H, W = px.W, OH = po.H, OW = po.W, planes = po.count;
    const int64_t KH = arg_int(bt, "kernel_h", 1), KW = arg_int(bt, "kernel_w", 1), sh = arg_int(bt, "stride_h", 1),
                  sw = arg_int(bt, "stride_w", 1), ph = arg_int(bt, "padding_h", 0), pw = arg_int(bt, "padding_w", 0),
                  dh = max ? arg_int(bt, "dilation_h", 1) : 1, dw = max ? arg_int(bt, "dilation_w", 1) : 1;
    const bool include_pad = !max && arg_bool(bt, "count_include_pad");
    std::vector<double> v(size_t(numel(sx)), 0.0), a(v.size(), 0.0);
    for (int64_t q = 0; q < planes; ++q)
      for (int64_t oh = 0; oh < OH; ++oh)
        for (int64_t ow = 0; ow < OW; ++ow) {
          const size_t io = po.at(q, oh, ow);
          std::vector<size_t> read;
          double best = -INFINITY;
          size_t choice = SIZE_MAX;
          for (int64_t i = 0; i < KH; ++i)
            for (int64_t j = 0; j < KW; ++j) {
              const int64_t h = oh * sh - ph + i * dh, w = ow * sw - pw + j * dw;
              if (h < 0 || h >= H || w < 0 || w >= W) continue;
              const size_t ix = px.at(q, h, w);
              read.push_back(ix);
              if (max && (val(x)[ix] > best || choice == SIZE_MAX)) {
                best = val(x)[ix];
                choice = ix;
              }
            }
          if (max) {
            if (choice != SIZE_MAX) {
              v[choice] += val(d)[io];
              a[choice] += r_.abs[size_t(d)][io];
            }
            continue;
          }
          double count = double(read.size());
          if (include_pad) {
            const int64_t h0 = oh * sh - ph, w0 = ow * sw - pw;
            count = double((std::min(h0 + KH, H + ph) - h0) * (std::min(w0 + KW, W + pw) - w0));
          }
          for (size_t ix : read) {
            v[ix] += val(d)[io] / count;
            a[ix] += r_.abs[size_t(d)][io] / count;
          }
        }
    out(o, std::move(v), std::move(a));
  }

  void adaptive_avg_pool2d_backward(const BoundTask& bt, bool nhwc = false) {
    const int d = buf(bt, "dout"), o = buf(bt, "dx");
    const Shape& sx = shape(o);
    const Planes px = planes_of(sx, nhwc), po = planes_of(shape(d), nhwc);
    const int64_t H = px.H, W = px.W, OH = po.H, OW = po.W, planes = po.count;
    std::vector<double> v(size_t(numel(sx)), 0.0), a(v.size(), 0.0);
    for (int64_t q = 0; q < planes; ++q)
      for (int64_t oh = 0; oh < OH; ++oh)
        for (int64_t ow = 0; ow < OW; ++ow) {
          const int64_t h0 = oh * H / OH, h1 = ((oh + 1) * H + OH - 1) / OH;
          const int64_t w0 = ow * W / OW, w1 = ((ow + 1) * W + OW - 1) / OW;
          const double count = double((h1 - h0) * (w1 - w0));
          const size_t io = po.at(q, oh, ow);
          for (int64_t h = h0; h < h1; ++h)
            for (int64_t w = w0; w < w1; ++w) {
              v[px.at(q, h, w)] += val(d)[io] / count;
              a[px.at(q, h, w)] += r_.abs[size_t(d)][io] / count;
            }
        }
    out(o, std::move(v), std::move(a));
  }

  // BatchNorm in training mode: layernorm's computation over each channel's
  // B x H x W elements (its error scales alike), and the running statistics
  // moved toward the batch's. NCHW, or NHWC (batchnorm2d_nhwc).
  struct Channels {
    int64_t C, count, positions;  // positions: an NCHW image's H x W
    bool nhwc;
    // Element i of channel c's count.
    size_t at(int64_t c, int64_t i) const {
      return size_t(nhwc ? i * C + c : (i / positions * C + c) * positions + i % positions);
    }
  };
  static Channels channels_of(const Shape& s, bool nhwc) {
    if (nhwc) return Channels{s[3], s[0] * s[1] * s[2], 0, true};
    return Channels{s[1], s[0] * s[2] * s[3], s[2] * s[3], false};
  }
  void batchnorm2d(const BoundTask& bt, bool nhwc) {
    const int x = buf(bt, "x");
    const BoundTensor *w = bt.find_tensor("weight"), *b = bt.find_tensor("bias"), *rm = bt.find_tensor("running_mean"),
                      *rv = bt.find_tensor("running_var");
    const Channels ch = channels_of(shape(x), nhwc);
    const int64_t C = ch.C, count = ch.count;
    const double eps = arg_double(bt, "eps", 1e-5), momentum = arg_double(bt, "momentum", 0.1);
    const auto &xv = val(x), &xa = r_.abs[size_t(x)];
    std::vector<double> v(xv.size()), a(xv.size()), m(static_cast<size_t>(C)), ma(m.size()), r(m.size()), ra(m.size());
    std::vector<double> rmv, rma, rvv, rva;
    if (rm != nullptr) rmv = val(rm->buffer), rma = r_.abs[size_t(rm->buffer)];
    if (rv != nullptr) rvv = val(rv->buffer), rva = r_.abs[size_t(rv->buffer)];
    auto at = [&](int64_t c, int64_t i) { return ch.at(c, i); };
    for (int64_t c = 0; c < C; ++c) {
      double sum = 0, abs_sum = 0, max_err = 0;
      for (int64_t i = 0; i < count; ++i) {
        sum += xv[at(c, i)];
        abs_sum += std::abs(xv[at(c, i)]);
        max_err = std::max(max_err, xa[at(c, i)]);
      }
      const double mean = sum / double(count);
      double var = 0, mad = 0;
      for (int64_t i = 0; i < count; ++i) {
        const double d = xv[at(c, i)] - mean;
        var += d * d;
        mad += std::abs(d);
      }
      var /= double(count);
      mad /= double(count);
      const double rstd = 1 / std::sqrt(var + eps), drstd = rstd * rstd * rstd * 2 * mad * max_err;
      const double wv = w ? val(w->buffer)[size_t(c)] : 1.0, wa = w ? r_.abs[size_t(w->buffer)][size_t(c)] : 1.0;
      const double bv = b ? val(b->buffer)[size_t(c)] : 0.0, ba = b ? r_.abs[size_t(b->buffer)][size_t(c)] : 0.0;
      m[size_t(c)] = mean;
      ma[size_t(c)] = abs_sum / double(count) + max_err;
      r[size_t(c)] = rstd;
      ra[size_t(c)] = rstd + drstd;
      for (int64_t i = 0; i < count; ++i) {
        const size_t e = at(c, i);
        const double d = xv[e] - mean;
        v[e] = d * rstd * wv + bv;
        a[e] = wa * (rstd * (xa[e] + max_err) + std::abs(d) * drstd) + std::abs(d) * rstd * wa + ba + std::abs(v[e]);
      }
      if (rm != nullptr) {
        rmv[size_t(c)] = (1 - momentum) * rmv[size_t(c)] + momentum * mean;
        rma[size_t(c)] = (1 - momentum) * rma[size_t(c)] + momentum * ma[size_t(c)] + std::abs(rmv[size_t(c)]);
      }
      if (rv != nullptr) {
        const double unbiased = var * double(count) / double(count - 1);
        rvv[size_t(c)] = (1 - momentum) * rvv[size_t(c)] + momentum * unbiased;
        rva[size_t(c)] = (1 - momentum) * rva[size_t(c)] + momentum * (unbiased + 4 * mad * max_err * double(count) / double(count - 1)) +
                         std::abs(rvv[size_t(c)]);
      }
    }
    out(buf(bt, "out"), std::move(v), std::move(a));
    out(buf(bt, "mean"), std::move(m), std::move(ma));
    out(buf(bt, "rstd"), std::move(r), std::move(ra));
    if (rm != nullptr) out(rm->buffer, std::move(rmv), std::move(rma));
    if (rv != nullptr) out(rv->buffer, std::move(rvv), std::move(rva));
  }

  // batchnorm2d's gradients from the saved statistics: layernorm_backward's
  // formulas over each channel's elements.
  void batchnorm2d_backward(const BoundTask& bt, bool nhwc) {
    const int x = buf(bt, "x"), d = buf(bt, "dout"), mu = buf(bt, "mean"), rs = buf(bt, "rstd");
    const BoundTensor *w = bt.find_tensor("weight"), *dx = bt.find_tensor("dx"), *dw = bt.find_tensor("dweight"),
                      *db = bt.find_tensor("dbias");
    const Channels ch = channels_of(shape(x), nhwc);
    const int64_t C = ch.C, count = ch.count;
    const auto &xv = val(x), &xa = r_.abs[size_t(x)], &dv = val(d), &da = r_.abs[size_t(d)];
    std::vector<double> gx(xv.size()), gxa(xv.size()), gw(static_cast<size_t>(C)), gwa(gw.size()), gb(gw.size()), gba(gw.size());
    auto at = [&](int64_t c, int64_t i) { return ch.at(c, i); };
    for (int64_t c = 0; c < C; ++c) {
      const double mean = val(mu)[size_t(c)], mean_abs = r_.abs[size_t(mu)][size_t(c)];
      const double rstd = val(rs)[size_t(c)], rstd_abs = r_.abs[size_t(rs)][size_t(c)];
      const double wv = w ? val(w->buffer)[size_t(c)] : 1.0, wa = w ? r_.abs[size_t(w->buffer)][size_t(c)] : 1.0;
      double sum_dy = 0, sum_dy_abs = 0, sum_dy_xhat = 0, sum_dy_xhat_abs = 0;
      for (int64_t i = 0; i < count; ++i) {
        const size_t e = at(c, i);
        sum_dy += dv[e];
        sum_dy_abs += da[e];
        sum_dy_xhat += dv[e] * (xv[e] - mean) * rstd;
        sum_dy_xhat_abs += da[e] * (xa[e] + mean_abs) * rstd_abs;
      }
      gw[size_t(c)] = sum_dy_xhat;
      gwa[size_t(c)] = sum_dy_xhat_abs;
      gb[size_t(c)] = sum_dy;
      gba[size_t(c)] = sum_dy_abs;
      for (int64_t i = 0; i < count; ++i) {
        const size_t e = at(c, i);
        const double xhat = (xv[e] - mean) * rstd, xhat_abs = (xa[e] + mean_abs) * rstd_abs;
        gx[e] = wv * rstd * (dv[e] - (sum_dy + xhat * sum_dy_xhat) / double(count));
        gxa[e] = 3 * wa * rstd_abs * (da[e] + (sum_dy_abs + xhat_abs * sum_dy_xhat_abs) / double(count));
      }
    }
    if (dx != nullptr) out(dx->buffer, std::move(gx), std::move(gxa));
    if (dw != nullptr) out(dw->buffer, std::move(gw), std::move(gwa));
    if (db != nullptr) out(db->buffer, std::move(gb), std::move(gba));
  }

  // Where element (h, w) of plane q (an (image, channel) pair) lies: NCHW's
  // planes [..., H, W], or an NHWC tensor's [B, H, W, C] (the _nhwc ops).
  struct Planes {
    int64_t H, W, count, C;  // C: 0 for NCHW
    size_t at(int64_t q, int64_t h, int64_t w) const {
      return size_t(C == 0 ? (q * H + h) * W + w : ((q / C * H + h) * W + w) * C + q % C);
    }
  };
  static Planes planes_of(const Shape& s, bool nhwc) {
    if (nhwc) return Planes{s[1], s[2], s[0] * s[3], s[3]};
    return Planes{s[s.size() - 2], s.back(), numel(s) / (s[s.size() - 2] * s.back()), 0};
  }

  void pool2d(const BoundTask& bt, bool max, bool nhwc = false) {
    const int x = buf(bt, "x"), o = buf(bt, "out");
    const Planes px = planes_of(shape(x), nhwc), po = planes_of(shape(o), nhwc);
    const int64_t H = px.H, W = px.W, OH = po.H, OW = po.W, planes = po.count;
    const Shape& so = shape(o);
    const int64_t KH = arg_int(bt, "kernel_h", 1), KW = arg_int(bt, "kernel_w", 1), sh = arg_int(bt, "stride_h", 1),
                  sw = arg_int(bt, "stride_w", 1), ph = arg_int(bt, "padding_h", 0), pw = arg_int(bt, "padding_w", 0),
                  dh = max ? arg_int(bt, "dilation_h", 1) : 1, dw = max ? arg_int(bt, "dilation_w", 1) : 1;
    const bool include_pad = !max && arg_bool(bt, "count_include_pad");
    std::vector<double> v(size_t(numel(so))), a(v.size());
    for (int64_t q = 0; q < planes; ++q)
      for (int64_t oh = 0; oh < OH; ++oh)
        for (int64_t ow = 0; ow < OW; ++ow) {
          double best = -INFINITY, best_abs = 0, sum = 0, sum_abs = 0;
          int64_t count = 0;
          for (int64_t i = 0; i < KH; ++i)
            for (int64_t j = 0; j < KW; ++j) {
              const int64_t h = oh * sh - ph + i * dh, w = ow * sw - pw + j * dw;
              if (h < 0 || h >= H || w < 0 || w >= W) continue;
              const size_t ix = px.at(q, h, w);
              if (val(x)[ix] > best) {
                best = val(x)[ix];
                best_abs = r_.abs[size_t(x)][ix];
              }
              sum += val(x)[ix];
              sum_abs += r_.abs[size_t(x)][ix];
              ++count;
            }
          if (include_pad) {
            const int64_t h0 = oh * sh - ph, w0 = ow * sw - pw;
            count = (std::min(h0 + KH, H + ph) - h0) * (std::min(w0 + KW, W + pw) - w0);
          }
          const size_t io = po.at(q, oh, ow);
          v[io] = max ? best : sum / double(count);
          a[io] = max ? best_abs : sum_abs / double(count);
        }
    out(o, std::move(v), std::move(a));
  }

  void adaptive_avg_pool2d(const BoundTask& bt, bool nhwc = false) {
    const int x = buf(bt, "x"), o = buf(bt, "out");
    const Planes px = planes_of(shape(x), nhwc), po = planes_of(shape(o), nhwc);
    const int64_t H = px.H, W = px.W, OH = po.H, OW = po.W, planes = po.count;
    const Shape& so = shape(o);
    std::vector<double> v(size_t(numel(so))), a(v.size());
    for (int64_t q = 0; q < planes; ++q)
      for (int64_t oh = 0; oh < OH; ++oh)
        for (int64_t ow = 0; ow < OW; ++ow) {
          // floor(oh * H / OH) to ceil((oh + 1) * H / OH), as PyTorch.
          const int64_t h0 = oh * H / OH, h1 = ((oh + 1) * H + OH - 1) / OH;
          const int64_t w0 = ow * W / OW, w1 = ((ow + 1) * W + OW - 1) / OW;
          double sum = 0, sum_abs = 0;
          for (int64_t h = h0; h < h1; ++h)
            for (int64_t w = w0; w < w1; ++w) {
              sum += val(x)[px.at(q, h, w)];
              sum_abs += r_.abs[size_t(x)][px.at(q, h, w)];
            }
          const double count = double((h1 - h0) * (w1 - w0));
          v[po.at(q, oh, ow)] = sum / count;
          a[po.at(q, oh, ow)] = sum_abs / count;
        }
    out(o, std::move(v), std::move(a));
  }

  void permute(const BoundTask& bt) {
    const int x = buf(bt, "x"), o = buf(bt, "out");
    const Shape& sx = shape(x);
    const ArgValue* dims_arg = arg(bt, "dims");
    const auto* dims = dims_arg ? std::get_if<std::vector<int64_t>>(dims_arg) : nullptr;
    if (dims == nullptr || dims->size() != sx.size())
      throw std::runtime_error(fmt::format("reference: task '{}' has no permutation", bt.task->id));
    std::vector<int64_t> strides(sx.size(), 1);
    for (size_t j = sx.size(); j-- > 1;) strides[j - 1] = strides[j] * sx[j];
    const int64_t n = numel(sx);
    std::vector<double> v(static_cast<size_t>(n)), a(v.size());
    for (int64_t i = 0; i < n; ++i) {
      // i is an output index: its coordinates along out's axes, out axis j being x's axis dims[j].
      int64_t rest = i, source = 0;
      for (size_t j = sx.size(); j-- > 0;) {
        const int64_t extent = sx[size_t((*dims)[j])];
        source += rest % extent * strides[size_t((*dims)[j])];
        rest /= extent;
      }
      v[size_t(i)] = val(x)[size_t(source)];
      a[size_t(i)] = r_.abs[size_t(x)][size_t(source)];
    }
    out(o, std::move(v), std::move(a));
  }

  // slice (x -> out) and slice_backward (dout -> dx): out's element along the
  // axis a is x's start + a * step; the gradient puts it back, zeros elsewhere.
  void slice(const BoundTask& bt, bool backward) {
    const int part = buf(bt, backward ? "dout" : "x"), whole_out = buf(bt, backward ? "dx" : "out");
    const Shape& whole = shape(backward ? whole_out : part);
    const Shape& sliced = shape(backward ? part : whole_out);
    const int64_t rank = int64_t(whole.size());
    int64_t axis = arg_int(bt, "axis", 0);
    if (axis < 0) axis += rank;
    const int64_t size = whole[size_t(axis)], length = sliced[size_t(axis)], step = arg_int(bt, "step", 1);
    int64_t start = arg_int(bt, "start", 0);
    if (start < 0) start += size;
    int64_t inner = 1;
    for (int64_t j = axis + 1; j < rank; ++j) inner *= whole[size_t(j)];
    const int64_t n = numel(sliced);
    std::vector<double> v(size_t(numel(backward ? whole : sliced)), 0.0), a(v.size(), 0.0);
    for (int64_t i = 0; i < n; ++i) {  // i: an element of the slice
      const int64_t outer = i / (length * inner), k = i / inner % length, r = i % inner;
      const size_t source = size_t((outer * size + start + k * step) * inner + r);
      const size_t from = backward ? size_t(i) : source, to = backward ? source : size_t(i);
      v[to] = val(part)[from];
      a[to] = r_.abs[size_t(part)][from];
    }
    out(whole_out, std::move(v), std::move(a));
  }

  // A user's elementwise or broadcast op through its template's reference
  // function: per element, its inputs (broadcast) then its arguments; error
  // scales by first-order propagation, as unary ops (central differences in
  // each input).
  void user_element(const BoundTask& bt, ElementReference f) {
    std::vector<int> inputs;
    int o = -1;
    for (const auto& sig : bt.op->tensors) {
      const BoundTensor* bound = bt.find_tensor(sig.name);
      if (sig.role == SlotRole::output) o = bound->buffer;
      else if (!sig.written()) inputs.push_back(bound != nullptr ? bound->buffer : -1);
    }
    std::vector<double> values(inputs.size());
    for (const auto& a : bt.op->args) {
      double v = arg_double(bt, a.name.c_str(), 0);
      if (a.type == ArgType::string_) {  // the device function takes a string argument's index among its choices
        const std::string chosen = arg_string(bt, a.name.c_str());
        v = double(std::find(a.choices.begin(), a.choices.end(), chosen) - a.choices.begin());
      }
      values.push_back(v);
    }
    const int64_t n = numel(shape(o));
    std::vector<double> v(static_cast<size_t>(n)), scale(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      std::vector<double> abs_in(inputs.size(), 0);
      for (size_t j = 0; j < inputs.size(); ++j) {
        if (inputs[j] < 0) {
          values[j] = 0;  // an optional input the task leaves out
          continue;
        }
        const size_t at = size_t(broadcast_source(shape(o), shape(inputs[j]), i));
        values[j] = val(inputs[j])[at];
        abs_in[j] = r_.abs[size_t(inputs[j])][at];
      }
      v[size_t(i)] = f(values.data());
      double a = std::abs(v[size_t(i)]);
      for (size_t j = 0; j < inputs.size(); ++j) {
        const double x = values[j];
        a += std::abs(derivative([&](double y) { values[j] = y; return f(values.data()); }, x)) * abs_in[j];
        values[j] = x;
      }
      scale[size_t(i)] = a;
    }
    out(o, std::move(v), std::move(scale));
  }

  // An op whose template says `reference: none`: its outputs as the device
  // left them (unchecked; the runner says so), for the tasks after it.
  void device_values(const BoundTask& bt) {
    for (const auto& bound : bt.tensors) {
      if (bound.sig == nullptr || !bound.sig->written()) continue;
      const std::vector<double>* device = user_.device != nullptr ? &(*user_.device)[size_t(bound.buffer)] : nullptr;
      if (device == nullptr || (device->empty() && numel(shape(bound.buffer)) > 0))
        throw std::runtime_error(fmt::format(
            "op '{}' (task '{}') has no float64 reference (`reference: none`) and its output '{}' is not in memory "
            "(kept inside a fused kernel), so nothing after it can be checked; run with --no-fuse",
            bt.op->name, bt.task->id, bound.name));
      std::vector<double> a(device->size());
      for (size_t i = 0; i < a.size(); ++i) a[i] = std::abs((*device)[i]);
      out(bound.buffer, *device, std::move(a));
    }
  }

  const Program& p_;
  ReferenceBuffers& r_;
  const RunTimeArgs& args_;
  const UserOpReferences& user_;
  const std::vector<double> carried_error_;  // (a copy: the default argument is a temporary)
};

}  // namespace

ReferenceBuffers evaluate_task(const Program& program, int task, const std::vector<std::vector<double>>& buffers,
                               const RunTimeArgs& args, const UserOpReferences& user) {
  ReferenceBuffers r;
  r.value = buffers;
  r.abs.resize(buffers.size());
  for (size_t b = 0; b < buffers.size(); ++b)
    for (double x : buffers[b]) r.abs[b].push_back(std::abs(x));
  Evaluator(program, r, args, user).run(task);
  return r;
}

ReferenceBuffers evaluate_reference(const Program& program, const Schedule& schedule,
                                    const std::vector<std::vector<double>>& inputs, const RunTimeArgs& args,
                                    const UserOpReferences& user, const std::vector<double>& carried_error) {
  ReferenceBuffers r;
  r.value = inputs;
  r.value.resize(program.buffers.size());
  r.abs.resize(program.buffers.size());
  for (size_t b = 0; b < r.value.size(); ++b)
    for (double x : r.value[b]) r.abs[b].push_back(std::abs(x));
  Evaluator eval(program, r, args, user, carried_error);
  for (int t : schedule.order) eval.run(t);
  return r;
}

}  // namespace cudagen
