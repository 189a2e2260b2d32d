#!/usr/bin/python3
"""Runs a task graph in cudagen's host emulation and in PyTorch (float64, an
independent implementation of every op), on the same random inputs, and
compares the graph outputs: max |y - ref| <= 1e-4 * max |ref| for f32.

    tests/torch_reference.py CUDAGEN GRAPH [--seed N]

Needs Debian's python3-torch (run with /usr/bin/python3). Exit 0 when every
output agrees; the seed is printed on failure.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

DTYPES = {"f32": np.float32, "f64": np.float64, "f16": np.float16, "i32": np.int32, "i64": np.int64}
# max |y - ref| <= RTOL * max |ref| + 1e-6, by the output's dtype (the storage rounding of 16-bit dominates).
RTOL = {"f32": 1e-4, "f64": 1e-10, "f16": 5e-3}


def splitmix64(x):
    """templates/init.cuh's hash, on numpy uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def unit_float(seed, n, stream):
    i = np.arange(n, dtype=np.uint64)
    bits = splitmix64(splitmix64(np.uint64(seed & (2**64 - 1))) ^ (np.uint64(2) * i + np.uint64(stream)))
    return (bits >> np.uint64(40)).astype(np.float64) * 2.0**-24


class Graph:
    def __init__(self, graph, registry):
        self.tasks = graph["tasks"]
        self.by_id = {t["id"]: t for t in self.tasks}
        self.ops = {op["name"]: op for op in registry["ops"]}

    def owner(self, task_id, slot):
        """The (task, slot) that owns the storage behind a slot."""
        spec = self.by_id[task_id]["tensors"][slot]
        while "from" in spec:
            task_id, slot = spec["from"].split(".")
            spec = self.by_id[task_id]["tensors"][slot]
        return task_id, slot

    def role(self, task_id, slot):
        op = self.ops[self.by_id[task_id]["op"]]
        return next(s for s in op["tensors"] if s["name"] == slot)

    def buffers(self):
        """Every owning slot: name -> (dtype, shape, storage, written, produced);
        a produced buffer is an op's output, a written one may also be a
        buffer an optimizer updates in place (an input too)."""
        out = {}
        for t in self.tasks:
            for slot, spec in t.get("tensors", {}).items():
                if "from" not in spec:
                    sig = self.role(t["id"], slot)
                    produced = sig["role"] in ("output", "scratch")
                    out[f"{t['id']}.{slot}"] = [spec["dtype"], spec["shape"], spec.get("storage"), produced, produced]
        for t in self.tasks:  # in-place updates through a slot of another task's buffer
            for slot in t.get("tensors", {}):
                if self.role(t["id"], slot).get("writes", False):
                    out["%s.%s" % self.owner(t["id"], slot)][3] = True
        return {name: tuple(v) for name, v in out.items()}

    def order(self):
        phases = ["init", "forward", "backward", "update"]
        deps = {t["id"]: set() for t in self.tasks}
        for t in self.tasks:
            for spec in t.get("tensors", {}).values():
                if "from" in spec:
                    deps[t["id"]].add(spec["from"].split(".")[0])
        done, order = set(), []
        for phase in phases:
            pending = [t for t in self.tasks if t.get("phase", "forward") == phase]
            while pending:
                ready = [t for t in pending if deps[t["id"]] <= done | {t["id"]}]
                if not ready:
                    raise SystemExit("cycle in the graph")
                for t in ready:
                    order.append(t)
                    done.add(t["id"])
                pending = [t for t in pending if t["id"] not in done]
        return order


F32_MAX = float(np.finfo(np.float32).max)


def run_torch(g, values, phases=None):
    """Evaluates every task (of `phases`, when given) in float64; `values`
    maps buffer names to tensors."""
    def get(t, slot):
        return values["%s.%s" % g.owner(t["id"], slot)]

    def put(t, slot, v):
        values["%s.%s" % g.owner(t["id"], slot)] = v

    def grad(f, wrt, dout):
        """PyTorch's autograd of f at `wrt` (a list of tensors), for output gradient dout."""
        leaves = [w.detach().clone().requires_grad_() for w in wrt]
        return [d.detach() for d in torch.autograd.grad(f(*leaves), leaves, grad_outputs=dout)]

    def producer(t, slot):
        """The task that wrote the buffer behind a slot, and its argument values."""
        owner = g.by_id[g.owner(t["id"], slot)[0]]
        return owner, {k: (a["value"] if isinstance(a, dict) and "value" in a else a)
                       for k, a in owner.get("args", {}).items()}

    def softmax(x, scale, causal):
        x = scale * x
        if causal:
            mask = torch.ones(x.shape[-2], x.shape[-1], dtype=torch.bool).tril()
            x = x.masked_fill(~mask, float("-inf"))
        return torch.softmax(x, dim=-1)

    for t in g.order():
        if phases is not None and t.get("phase", "forward") not in phases:
            continue
        op = t["op"]
        # A run-time argument ({"value": v, "runtime": true}) runs with its initial value.
        args = {k: (a["value"] if isinstance(a, dict) and "value" in a else a) for k, a in t.get("args", {}).items()}
        shape = lambda slot: t["tensors"][slot]["shape"]
        if op in ("relu", "sigmoid", "silu", "tanh", "exp", "log", "neg", "sqrt", "rsqrt"):
            f = {"relu": torch.relu, "sigmoid": torch.sigmoid, "silu": torch.nn.functional.silu,
                 "tanh": torch.tanh, "exp": torch.exp, "log": torch.log, "neg": torch.neg,
                 "sqrt": torch.sqrt, "rsqrt": torch.rsqrt}[op]
            put(t, "out", f(get(t, "x")))
        elif op == "pow":
            put(t, "out", torch.pow(get(t, "x"), args.get("exponent", 2.0)))
        elif op == "gelu":
            put(t, "out", torch.nn.functional.gelu(get(t, "x"), approximate={"tanh": "tanh", "erf": "none"}[args.get("approximate", "tanh")]))
        elif op == "gradient_scale":
            loss_scale = float(get(t, "loss_scale")) if "loss_scale" in t["tensors"] else 0.0
            mean = 1.0 / (args.get("micro_batches", 1) * (loss_scale if loss_scale > 0 else 1.0))
            factor = torch.tensor(mean, dtype=torch.float64)
            sq_norm = get(t, "sq_norm") if "sq_norm" in t["tensors"] else torch.tensor(0.0, dtype=torch.float64)
            if args.get("max_norm", 0.0) > 0:
                # As the kernel's fminf(1, c): a NaN c (a NaN norm, from NaN gradients that poison the
                # weights anyway) reads 1, where torch.clamp would keep the NaN.
                c = float(args["max_norm"] / (torch.sqrt(sq_norm) * mean + 1e-6))
                factor = torch.tensor(mean * (c if c < 1.0 else 1.0), dtype=torch.float64)
            if loss_scale > 0 and not float(sq_norm) <= F32_MAX:  # overflowed: skip the step
                factor = torch.tensor(-1.0, dtype=torch.float64)
            put(t, "out", factor)
        elif op == "loss_scale_update":
            scale, good, steps = (float(get(t, s)) for s in ("scale", "good_steps", "steps"))
            if float(get(t, "factor")) < 0:
                scale, good = scale * args.get("backoff_factor", 0.5), 0.0
            else:
                steps, good = steps + 1, good + 1
                if good >= args.get("growth_interval", 2000):
                    scale, good = scale * args.get("growth_factor", 2.0), 0.0
            for slot, value in (("scale", scale), ("good_steps", good), ("steps", steps)):
                put(t, slot, torch.tensor(value, dtype=torch.float64))
        elif op == "accumulate":
            grad = get(t, "grad")
            put(t, "acc", grad.clone() if args.get("micro_batch", 0) == 0 else get(t, "acc") + grad)
        elif op == "affine":
            put(t, "out", args.get("scale", 1.0) * get(t, "x") + args.get("shift", 0.0))
        elif op in ("eq", "ne"):  # a 1/0 mask in the operands' dtype
            put(t, "out", (torch.eq if op == "eq" else torch.ne)(get(t, "a"), get(t, "b")).double())
        elif op == "dropout_mask":  # templates/init.cuh's draw: the seed hashed with step and micro-batch
            n, m = math.prod(shape("out")), 2**64 - 1
            draw = splitmix64(splitmix64(splitmix64(np.uint64(args.get("seed", 0) & m)) ^ np.uint64(args.get("step", 1) & m))
                              ^ np.uint64(args.get("micro_batch", 0) & m))
            p = np.float32(args["p"])
            u = unit_float(int(draw), n, 0).astype(np.float32)  # (24 bits: exact in f32)
            v = np.where(u < p, 0.0, np.float64(np.float32(1.0) / (np.float32(1.0) - p)))
            put(t, "out", torch.from_numpy(v.reshape(shape("out"))))
        elif op in ("add", "sub", "mul", "div", "maximum"):
            f = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "maximum": torch.maximum}[op]
            put(t, "out", f(get(t, "a"), get(t, "b")))
        elif op.endswith("_backward") and op[:-9] in ("relu", "sigmoid", "silu", "tanh", "log", "gelu", "sqrt", "rsqrt",
                                                      "pow"):
            # PyTorch's own autograd of the forward op gives the reference gradient.
            approximate = {"tanh": "tanh", "erf": "none"}[args.get("approximate", "tanh")]
            f = {"relu": torch.relu, "sigmoid": torch.sigmoid, "silu": torch.nn.functional.silu,
                 "tanh": torch.tanh, "log": torch.log, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt,
                 "pow": lambda x: torch.pow(x, args.get("exponent", 2.0)),
                 "gelu": lambda x: torch.nn.functional.gelu(x, approximate=approximate)}[op[:-9]]
            put(t, "dx", grad(f, [get(t, "x")], get(t, "dout"))[0])
        elif op == "exp_backward":
            put(t, "dx", get(t, "dout") * get(t, "out"))  # exp' = exp, which is out
        elif op in ("neg_backward", "affine_backward", "cast_backward"):
            scale = {"neg_backward": -1.0, "cast_backward": 1.0}.get(op, args.get("scale", 1.0))
            put(t, "dx", scale * get(t, "dout"))
        elif op in ("sum_backward", "mean_backward"):
            f = (lambda x: x.sum(-1)) if op == "sum_backward" else (lambda x: x.mean(-1))
            put(t, "dx", grad(f, [torch.zeros(shape("dx"), dtype=torch.float64)], get(t, "dout"))[0])
        elif op == "max_backward":  # torch.amax splits the gradient evenly between ties
            put(t, "dx", grad(lambda x: torch.amax(x, dim=-1), [get(t, "x")], get(t, "dout"))[0])
        elif op == "sum_leading_backward":
            f = lambda x: x.reshape(-1, x.shape[-1]).sum(0)
            put(t, "dx", grad(f, [torch.zeros(shape("dx"), dtype=torch.float64)], get(t, "dout"))[0])
        elif op == "maximum_backward":
            # The operand expanded to the output's shape: its gradient before summing over broadcast axes.
            a, b = get(t, "a"), get(t, "b")
            out_shape = shape("dx")
            if args.get("wrt", "a") == "a":
                d = grad(lambda a: torch.maximum(a, b), [a.expand(out_shape)], get(t, "dout"))[0]
            else:
                d = grad(lambda b: torch.maximum(a, b), [b.expand(out_shape)], get(t, "dout"))[0]
            put(t, "dx", d)
        elif op in ("softmax_backward", "log_softmax_backward"):
            # The gradient of the task that produced `out`, recomputed from its input.
            forward, fargs = producer(t, "out")
            x = get(forward, "x")
            if op == "softmax_backward":
                f = lambda x: softmax(x, fargs.get("scale", 1.0), fargs.get("causal", False))
            else:
                f = lambda x: torch.log_softmax(x, dim=-1)
            put(t, "dx", grad(f, [x], get(t, "dout"))[0])
        elif op in ("rmsnorm_backward", "layernorm_backward"):
            forward, fargs = producer(t, "rstd")
            x, w = get(forward, "x"), get(forward, "weight")
            if op == "rmsnorm_backward":
                eps = fargs.get("eps", 1e-6)
                dx, dw = grad(lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w, [x, w],
                              get(t, "dout"))
            else:
                eps, bias = fargs.get("eps", 1e-5), get(forward, "bias")
                dx, dw, db = grad(lambda x, w, b: torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, eps),
                                  [x, w, bias], get(t, "dout"))
                put(t, "dbias", db)
            put(t, "dx", dx)
            put(t, "dweight", dw)
        elif op == "cross_entropy_backward":
            logits, labels = get(t, "logits"), get(t, "labels").reshape(-1).long()
            f = lambda z: args.get("scale", 1.0) * torch.nn.functional.cross_entropy(
                z.reshape(-1, z.shape[-1]), labels, reduction="sum")
            put(t, "dlogits", grad(f, [logits], torch.tensor(1.0, dtype=torch.float64))[0])
        elif op == "embedding_backward":
            ids = get(t, "ids").long()
            put(t, "dtable", grad(lambda table: table[ids], [torch.zeros(shape("dtable"), dtype=torch.float64)],
                                  get(t, "dout"))[0])
        elif op == "mse_backward":
            target = get(t, "target")
            f = lambda p: args.get("scale", 1.0) * ((p - target) ** 2).sum()
            put(t, "dpred", grad(f, [get(t, "pred")], torch.tensor(1.0, dtype=torch.float64))[0])
        elif op in ("sgd", "adam", "adamw") and "grad_scale" in t["tensors"] and float(get(t, "grad_scale")) < 0:
            pass  # loss scaling found an overflow: the step is skipped, everything stays
        elif op in ("sgd", "adam", "adamw"):
            # One step of torch.optim, its state set to the task's buffers.
            param = get(t, "param").clone().requires_grad_()
            param.grad = get(t, "grad").clone()
            if "grad_scale" in t["tensors"]:  # gradient_scale's: clipping's factor, as clip_grad_norm_ applies it
                param.grad.mul_(get(t, "grad_scale"))
            wd = args.get("weight_decay", 0.0)
            if op == "sgd":
                momentum = args.get("momentum", 0.0)
                opt = torch.optim.SGD([param], lr=args["lr"], momentum=momentum, weight_decay=wd)
                if momentum:
                    opt.state[param]["momentum_buffer"] = get(t, "momentum_buf").clone()
            else:
                cls = torch.optim.Adam if op == "adam" else torch.optim.AdamW
                opt = cls([param], lr=args["lr"], betas=(args.get("beta1", 0.9), args.get("beta2", 0.999)),
                          eps=args.get("eps", 1e-8), weight_decay=wd)
                step = float(get(t, "step_count")) if "step_count" in t["tensors"] else 0.0
                step = step if step > 0 else float(args["step"])  # the device's count of steps taken, where kept
                opt.state[param].update(step=torch.tensor(step - 1), exp_avg=get(t, "m").clone(),
                                        exp_avg_sq=get(t, "v").clone())
            opt.step()
            put(t, "param", param.detach())
            state = opt.state[param]
            if op == "sgd" and "momentum_buf" in t["tensors"]:
                put(t, "momentum_buf", state["momentum_buffer"])
            if op != "sgd":
                put(t, "m", state["exp_avg"])
                put(t, "v", state["exp_avg_sq"])
        elif op in ("cast", "reshape"):
            put(t, "out", get(t, "x").reshape(shape("out")))
        elif op == "concat":
            put(t, "out", torch.cat([get(t, "a"), get(t, "b")], dim=-1))
        elif op == "split":
            x, width = get(t, "x"), shape("a")[-1]
            put(t, "a", x[..., :width])
            put(t, "b", x[..., width:])
        elif op == "layernorm":
            x, eps = get(t, "x"), args.get("eps", 1e-5)
            put(t, "out", torch.nn.functional.layer_norm(x, (x.shape[-1],), get(t, "weight"), get(t, "bias"), eps))
            if "mean" in t["tensors"]:
                put(t, "mean", x.mean(-1))
            if "rstd" in t["tensors"]:
                put(t, "rstd", torch.rsqrt(x.var(-1, unbiased=False) + eps))
        elif op == "matmul":
            a, b = get(t, "a"), get(t, "b")
            if args.get("trans_a"):
                a = a.transpose(-1, -2)
            if args.get("trans_b"):
                b = b.transpose(-1, -2)
            put(t, "out", args.get("alpha", 1.0) * torch.matmul(a, b))
        elif op == "softmax":
            put(t, "out", softmax(get(t, "x"), args.get("scale", 1.0), args.get("causal", False)))
        elif op in ("sum", "mean"):
            put(t, "out", getattr(torch, op)(get(t, "x"), dim=-1))
        elif op == "max":
            put(t, "out", get(t, "x").max(dim=-1).values)
        elif op == "sum_leading":
            x = get(t, "x")
            put(t, "out", x.reshape(-1, x.shape[-1]).sum(0))
        elif op == "log_softmax":
            put(t, "out", torch.log_softmax(get(t, "x"), dim=-1))
        elif op == "rmsnorm":
            x = get(t, "x")
            rstd = torch.rsqrt(x.pow(2).mean(-1) + args.get("eps", 1e-6))
            put(t, "out", x * rstd.unsqueeze(-1) * get(t, "weight"))
            if "rstd" in t["tensors"]:
                put(t, "rstd", rstd)
        elif op == "split_heads":
            x, h = get(t, "x"), args["heads"]
            put(t, "out", x.reshape(*x.shape[:-1], h, x.shape[-1] // h).transpose(-3, -2))
        elif op == "merge_heads":
            x = get(t, "x")
            y = x.transpose(-3, -2)
            put(t, "out", y.reshape(*y.shape[:-2], y.shape[-2] * y.shape[-1]))
        elif op == "embedding":
            put(t, "out", get(t, "table")[get(t, "ids").long()])
        elif op == "transpose":
            put(t, "out", get(t, "x").transpose(-1, -2))
        elif op == "permute":
            put(t, "out", get(t, "x").permute(*args["dims"]))
        elif op in ("relu6", "hardswish", "hardsigmoid"):
            put(t, "out", getattr(torch.nn.functional, op)(get(t, "x")))
        elif op in ("relu6_backward", "hardswish_backward", "hardsigmoid_backward"):
            put(t, "dx", grad(getattr(torch.nn.functional, op[:-9]), [get(t, "x")], get(t, "dout"))[0])
        elif op == "conv2d":
            bias = get(t, "bias") if "bias" in t["tensors"] else None
            put(t, "out", torch.nn.functional.conv2d(
                get(t, "x"), get(t, "weight"), bias, stride=(args.get("stride_h", 1), args.get("stride_w", 1)),
                padding=(args.get("padding_h", 0), args.get("padding_w", 0)),
                dilation=(args.get("dilation_h", 1), args.get("dilation_w", 1)), groups=args.get("groups", 1)))
        elif op == "conv2d_nhwc":  # channels-last: NCHW's convolution, permuted in and out
            put(t, "out", torch.nn.functional.conv2d(
                get(t, "x").permute(0, 3, 1, 2), get(t, "weight").permute(0, 3, 1, 2),
                stride=(args.get("stride_h", 1), args.get("stride_w", 1)),
                padding=(args.get("padding_h", 0), args.get("padding_w", 0)),
                dilation=(args.get("dilation_h", 1), args.get("dilation_w", 1)),
                groups=args.get("groups", 1)).permute(0, 2, 3, 1))
        elif op == "max_pool2d_nhwc":
            put(t, "out", torch.nn.functional.max_pool2d(
                get(t, "x").permute(0, 3, 1, 2), (args["kernel_h"], args["kernel_w"]),
                stride=(args["stride_h"], args["stride_w"]), padding=(args.get("padding_h", 0), args.get("padding_w", 0)),
                dilation=(args.get("dilation_h", 1), args.get("dilation_w", 1)),
                ceil_mode=args.get("ceil_mode", False)).permute(0, 2, 3, 1))
        elif op == "avg_pool2d_nhwc":
            put(t, "out", torch.nn.functional.avg_pool2d(
                get(t, "x").permute(0, 3, 1, 2), (args["kernel_h"], args["kernel_w"]),
                stride=(args["stride_h"], args["stride_w"]), padding=(args.get("padding_h", 0), args.get("padding_w", 0)),
                count_include_pad=args.get("count_include_pad", True)).permute(0, 2, 3, 1))
        elif op == "adaptive_avg_pool2d_nhwc":
            put(t, "out", torch.nn.functional.adaptive_avg_pool2d(
                get(t, "x").permute(0, 3, 1, 2), tuple(shape("out")[1:3])).permute(0, 2, 3, 1))
        elif op == "conv2d_backward":
            def conv(x, w):
                return torch.nn.functional.conv2d(
                    x, w, stride=(args.get("stride_h", 1), args.get("stride_w", 1)),
                    padding=(args.get("padding_h", 0), args.get("padding_w", 0)),
                    dilation=(args.get("dilation_h", 1), args.get("dilation_w", 1)), groups=args.get("groups", 1))
            dx, dweight = grad(conv, [get(t, "x"), get(t, "weight")], get(t, "dout"))
            for slot, value in (("dx", dx), ("dweight", dweight), ("dbias", get(t, "dout").sum((0, 2, 3)))):
                if slot in t["tensors"]:
                    put(t, slot, value)
        elif op in ("conv2d_nhwc_backward_data", "conv2d_nhwc_backward_weight"):  # NCHW's gradients, permuted
            def conv(x, w):
                return torch.nn.functional.conv2d(
                    x.permute(0, 3, 1, 2), w.permute(0, 3, 1, 2),
                    stride=(args.get("stride_h", 1), args.get("stride_w", 1)),
                    padding=(args.get("padding_h", 0), args.get("padding_w", 0)),
                    dilation=(args.get("dilation_h", 1), args.get("dilation_w", 1)),
                    groups=args.get("groups", 1)).permute(0, 2, 3, 1)
            dx, dweight = grad(conv, [get(t, "x"), get(t, "weight")], get(t, "dout"))
            put(t, "dx" if op.endswith("_data") else "dweight", dx if op.endswith("_data") else dweight)
        elif op in ("max_pool2d_nhwc_backward", "avg_pool2d_nhwc_backward",
                    "adaptive_avg_pool2d_nhwc_backward"):  # NCHW's, permuted
            def nchw(x):
                if op.startswith("max"):
                    return torch.nn.functional.max_pool2d(
                        x, (args["kernel_h"], args["kernel_w"]), (args["stride_h"], args["stride_w"]),
                        (args.get("padding_h", 0), args.get("padding_w", 0)),
                        (args.get("dilation_h", 1), args.get("dilation_w", 1)), ceil_mode=args.get("ceil_mode", False))
                if op.startswith("avg"):
                    return torch.nn.functional.avg_pool2d(
                        x, (args["kernel_h"], args["kernel_w"]), (args["stride_h"], args["stride_w"]),
                        (args.get("padding_h", 0), args.get("padding_w", 0)),
                        count_include_pad=args.get("count_include_pad", True))
                return torch.nn.functional.adaptive_avg_pool2d(x, tuple(shape("dout")[1:3]))
            x = get(t, "x") if op.startswith("max") else torch.zeros(shape("dx"), dtype=torch.float64)
            put(t, "dx", grad(lambda x: nchw(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1), [x], get(t, "dout"))[0])
        elif op in ("max_pool2d_backward", "avg_pool2d_backward", "adaptive_avg_pool2d_backward"):
            pool = {"max_pool2d_backward": lambda x: torch.nn.functional.max_pool2d(
                        x, (args["kernel_h"], args["kernel_w"]), (args["stride_h"], args["stride_w"]),
                        (args.get("padding_h", 0), args.get("padding_w", 0)),
                        (args.get("dilation_h", 1), args.get("dilation_w", 1)), ceil_mode=args.get("ceil_mode", False)),
                    "avg_pool2d_backward": lambda x: torch.nn.functional.avg_pool2d(
                        x, (args["kernel_h"], args["kernel_w"]), (args["stride_h"], args["stride_w"]),
                        (args.get("padding_h", 0), args.get("padding_w", 0)),
                        count_include_pad=args.get("count_include_pad", True)),
                    "adaptive_avg_pool2d_backward": lambda x: torch.nn.functional.adaptive_avg_pool2d(
                        x, tuple(shape("dout")[-2:]))}[op]
            # Only max pooling's gradient depends on x; the others' on its shape.
            x = get(t, "x") if op == "max_pool2d_backward" else torch.zeros(shape("dx"), dtype=torch.float64)
            put(t, "dx", grad(pool, [x], get(t, "dout"))[0])
        elif op in ("batchnorm2d", "batchnorm2d_nhwc"):
            # The channels-last form: channels on the last axis, the statistics over the others.
            axes, c = ((0, 1, 2), (1, 1, 1, -1)) if op == "batchnorm2d_nhwc" else ((0, 2, 3), (1, -1, 1, 1))
            x = get(t, "x")
            mean, var = x.mean(axes), x.var(axes, unbiased=False)
            eps, momentum = args.get("eps", 1e-5), args.get("momentum", 0.1)
            weight = get(t, "weight") if "weight" in t["tensors"] else torch.ones_like(mean)
            bias = get(t, "bias") if "bias" in t["tensors"] else torch.zeros_like(mean)
            put(t, "out", (x - mean.reshape(c)) / torch.sqrt(var.reshape(c) + eps) * weight.reshape(c) + bias.reshape(c))
            put(t, "mean", mean)
            put(t, "rstd", 1 / torch.sqrt(var + eps))
            if "running_mean" in t["tensors"]:
                put(t, "running_mean", (1 - momentum) * get(t, "running_mean") + momentum * mean)
            if "running_var" in t["tensors"]:
                put(t, "running_var", (1 - momentum) * get(t, "running_var") + momentum * x.var(axes, unbiased=True))
        elif op in ("batchnorm2d_backward", "batchnorm2d_nhwc_backward"):
            axes, c = ((0, 1, 2), (1, 1, 1, -1)) if op == "batchnorm2d_nhwc_backward" else ((0, 2, 3), (1, -1, 1, 1))
            mean, rstd = get(t, "mean").reshape(c), get(t, "rstd").reshape(c)
            weight = get(t, "weight") if "weight" in t["tensors"] else torch.ones(mean.numel(), dtype=torch.float64)
            x = get(t, "x")
            dweight, dbias = grad(lambda w, b: (x - mean) * rstd * w.reshape(c) + b.reshape(c),
                                  [weight, torch.zeros_like(weight)], get(t, "dout"))
            # dx with the saved statistics taken as x's own (the op's contract):
            # the textbook projection, which autograd of the affine above lacks.
            xhat = (get(t, "x") - mean) * rstd
            n = get(t, "x").numel() / mean.numel()
            dxhat = get(t, "dout") * weight.reshape(c)
            dx = rstd / n * (n * dxhat - dxhat.sum(axes, keepdim=True) - xhat * (dxhat * xhat).sum(axes, keepdim=True))
            for slot, value in (("dx", dx), ("dweight", dweight), ("dbias", dbias)):
                if slot in t["tensors"]:
                    put(t, slot, value)
        elif op in ("slice", "slice_backward"):
            x_shape = shape("x") if op == "slice" else shape("dx")
            axis = args["axis"] % len(x_shape)
            start = args.get("start", 0) % x_shape[axis]
            length = (shape("out") if op == "slice" else shape("dout"))[axis]
            index = [slice(None)] * len(x_shape)
            index[axis] = slice(start, start + (length - 1) * args.get("step", 1) + 1, args.get("step", 1))
            if op == "slice":
                put(t, "out", get(t, "x")[tuple(index)])
            else:
                dx = torch.zeros(x_shape, dtype=torch.float64)
                dx[tuple(index)] = get(t, "dout")
                put(t, "dx", dx)
        elif op == "max_pool2d":
            put(t, "out", torch.nn.functional.max_pool2d(
                get(t, "x"), (args["kernel_h"], args["kernel_w"]), (args["stride_h"], args["stride_w"]),
                (args.get("padding_h", 0), args.get("padding_w", 0)), (args.get("dilation_h", 1), args.get("dilation_w", 1)),
                ceil_mode=args.get("ceil_mode", False)))
        elif op == "avg_pool2d":
            put(t, "out", torch.nn.functional.avg_pool2d(
                get(t, "x"), (args["kernel_h"], args["kernel_w"]), (args["stride_h"], args["stride_w"]),
                (args.get("padding_h", 0), args.get("padding_w", 0)), count_include_pad=args.get("count_include_pad", True)))
        elif op == "adaptive_avg_pool2d":
            put(t, "out", torch.nn.functional.adaptive_avg_pool2d(get(t, "x"), tuple(shape("out")[-2:])))
        elif op == "cross_entropy":
            logits = get(t, "logits")
            put(t, "loss", torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                             get(t, "labels").reshape(-1).long()))
        elif op == "mse":
            put(t, "loss", torch.nn.functional.mse_loss(get(t, "pred"), get(t, "target")))
        elif op in ("fill", "uniform", "normal"):
            n = math.prod(shape("out"))
            f32 = t["tensors"]["out"]["dtype"] == "f32"
            if op == "fill":
                v = np.full(n, args.get("value", 0.0))
            elif op == "uniform":
                low, high = args.get("low", 0.0), args.get("high", 1.0)
                u = unit_float(args.get("seed", 0), n, 0)
                v = (np.float32(high) - np.float32(low)) * u + np.float32(low) if f32 else (high - low) * u + low
            else:
                u1, u2 = 1.0 - unit_float(args.get("seed", 0), n, 0), unit_float(args.get("seed", 0), n, 1)
                v = args.get("mean", 0.0) + args.get("std", 1.0) * np.sqrt(-2 * np.log(u1)) * np.cos(2 * np.pi * u2)
            put(t, "out", torch.from_numpy(np.asarray(v, dtype=np.float64).reshape(shape("out"))))
        else:
            raise SystemExit(f"torch_reference.py has no mapping for op '{op}' (task {t['id']})")
    return values


def optimizer_state(optimizer, run, weight, dtype):
    """The optimizer's state for weight ("task.slot") in one cudagen run's
    outputs, as torch.optim keeps it, in `dtype`: the derive pass names it
    <task>[_<slot>]_<m|v|momentum>_init.out (generator/derive.cpp, add_update).
    SGD without momentum has none."""
    task, slot = weight.split(".")
    name = task if slot == "out" else task + "_" + slot
    state = lambda kind: torch.from_numpy(run[f"{name}_{kind}_init.out"].astype(dtype))
    if optimizer == "sgd":
        return {"momentum_buffer": state("momentum")} if f"{name}_momentum_init.out" in run else {}
    return {"exp_avg": state("m"), "exp_avg_sq": state("v")}


def compare(title, rows):
    """Prints one line per (name, got, want, rtol, atol): it agrees when
    |got - want| <= rtol * max |want| + atol for every element (atol a number
    or an array of want's shape) and got is finite. Returns whether every row
    agrees."""
    print("%-30s %9s %12s %12s  %s" % (title, "elements", "max |diff|", "max |ref|", "result"))
    all_ok = True
    for name, got, want, rtol, atol in rows:
        got = np.asarray(got, dtype=np.float64)
        diff, scale = float(np.max(np.abs(got - want))), float(np.max(np.abs(want)))
        ok = bool(np.all(np.isfinite(got))) and bool(np.all(np.abs(got - want) <= rtol * scale + np.asarray(atol)))
        all_ok &= ok
        print("%-30s %9d %12.3g %12.3g  %s" % (name, got.size, diff, scale, "ok" if ok else "FAIL"))
    return all_ok


def random_inputs(g, rng):
    """Values for every buffer no task writes: uniform in [-1, 1), integers as
    indices of what they index (an embedding table's rows, a loss's classes)."""
    out = {}
    for name, (dtype, shape, storage, written, produced) in g.buffers().items():
        if produced:
            continue
        if dtype in ("i32", "i64"):
            limit = 8
            for t in g.tasks:
                if t["op"] == "embedding" and "%s.%s" % g.owner(t["id"], "ids") == name:
                    limit = g.buffers()["%s.%s" % g.owner(t["id"], "table")][1][0]
                if t["op"] == "embedding_backward" and "%s.%s" % g.owner(t["id"], "ids") == name:
                    limit = g.buffers()["%s.%s" % g.owner(t["id"], "dtable")][1][0]
                if t["op"] in ("cross_entropy", "cross_entropy_backward") and \
                        "%s.%s" % g.owner(t["id"], "labels") == name:
                    limit = g.buffers()["%s.%s" % g.owner(t["id"], "logits")][1][-1]
            out[name] = rng.integers(0, limit, size=shape).astype(DTYPES[dtype])
        else:
            out[name] = rng.uniform(-1, 1, size=shape).astype(DTYPES[dtype])
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cudagen")
    parser.add_argument("graph")
    parser.add_argument("--seed", type=int, default=int.from_bytes(os.urandom(4), "little"))
    opts = parser.parse_args()
    graph = json.load(open(opts.graph))
    registry = json.loads(subprocess.run([opts.cudagen, "ops", "--json"], check=True, capture_output=True, text=True).stdout)
    g = Graph(graph, registry)
    rng = np.random.default_rng(opts.seed)
    with tempfile.TemporaryDirectory() as work:
        inputs, outputs = os.path.join(work, "in"), os.path.join(work, "out")
        os.makedirs(inputs)
        values = {}
        for name, array in random_inputs(g, rng).items():
            np.save(os.path.join(inputs, name + ".npy"), array)
            values[name] = torch.from_numpy(array.astype(np.float64) if array.dtype.kind == "f" else array)
        run = subprocess.run([opts.cudagen, "run", opts.graph, "--emulate", "--inputs", inputs, "--outputs", outputs,
                              "--seed", str(opts.seed), "--work-dir", os.path.join(work, "build")],
                             capture_output=True, text=True)
        if run.returncode != 0:
            print(run.stdout, run.stderr)
            raise SystemExit(f"cudagen run failed (seed {opts.seed})")
        values = run_torch(g, values)
        rows = [(name, np.load(os.path.join(outputs, name + ".npy")), values[name].numpy(), RTOL[dtype], 1e-6)
                for name, (dtype, shape, storage, written, produced) in g.buffers().items()
                if written and storage == "external"]
        failed = not compare("output (vs PyTorch)", rows)
        if failed:
            raise SystemExit(f"outputs differ from PyTorch (seed {opts.seed})")


if __name__ == "__main__":
    main()
