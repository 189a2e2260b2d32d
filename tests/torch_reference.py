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

DTYPES = {"f32": np.float32, "f64": np.float64, "i32": np.int32, "i64": np.int64}


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
        """Every owning slot: name -> (dtype, shape, storage, written)."""
        out = {}
        for t in self.tasks:
            for slot, spec in t.get("tensors", {}).items():
                if "from" not in spec:
                    sig = self.role(t["id"], slot)
                    written = sig["role"] in ("output", "scratch") or sig.get("writes", False)
                    out[f"{t['id']}.{slot}"] = (spec["dtype"], spec["shape"], spec.get("storage"), written)
        return out

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


def run_torch(g, values, phases=None):
    """Evaluates every task (of `phases`, when given) in float64; `values`
    maps buffer names to tensors."""
    def get(t, slot):
        return values["%s.%s" % g.owner(t["id"], slot)]

    def put(t, slot, v):
        values[f"{t['id']}.{slot}"] = v

    for t in g.order():
        if phases is not None and t.get("phase", "forward") not in phases:
            continue
        op = t["op"]
        # A run-time argument ({"value": v, "runtime": true}) runs with its initial value.
        args = {k: (a["value"] if isinstance(a, dict) and "value" in a else a) for k, a in t.get("args", {}).items()}
        shape = lambda slot: t["tensors"][slot]["shape"]
        if op in ("relu", "sigmoid", "silu", "tanh", "exp", "log", "neg"):
            f = {"relu": torch.relu, "sigmoid": torch.sigmoid, "silu": torch.nn.functional.silu,
                 "tanh": torch.tanh, "exp": torch.exp, "log": torch.log, "neg": torch.neg}[op]
            put(t, "out", f(get(t, "x")))
        elif op == "gelu":
            put(t, "out", torch.nn.functional.gelu(get(t, "x"), approximate={"tanh": "tanh", "erf": "none"}[args.get("approximate", "tanh")]))
        elif op == "affine":
            put(t, "out", args.get("scale", 1.0) * get(t, "x") + args.get("shift", 0.0))
        elif op in ("add", "sub", "mul", "div", "maximum"):
            f = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "maximum": torch.maximum}[op]
            put(t, "out", f(get(t, "a"), get(t, "b")))
        elif op.endswith("_backward") and op[:-9] in ("relu", "sigmoid", "silu", "tanh"):
            # PyTorch's own autograd of the forward op gives the reference gradient.
            f = {"relu": torch.relu, "sigmoid": torch.sigmoid, "silu": torch.nn.functional.silu,
                 "tanh": torch.tanh}[op[:-9]]
            x = get(t, "x").clone().requires_grad_()
            (dx,) = torch.autograd.grad(f(x), x, grad_outputs=get(t, "dout"))
            put(t, "dx", dx.detach())
        elif op == "matmul":
            a, b = get(t, "a"), get(t, "b")
            if args.get("trans_a"):
                a = a.transpose(-1, -2)
            if args.get("trans_b"):
                b = b.transpose(-1, -2)
            put(t, "out", args.get("alpha", 1.0) * torch.matmul(a, b))
        elif op == "softmax":
            x = args.get("scale", 1.0) * get(t, "x")
            if args.get("causal"):
                rows, cols = x.shape[-2], x.shape[-1]
                mask = torch.ones(rows, cols, dtype=torch.bool).tril()
                x = x.masked_fill(~mask, float("-inf"))
            put(t, "out", torch.softmax(x, dim=-1))
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


def compare(title, rows):
    """Prints one line per (name, got, want, rtol, atol): it agrees when
    max |got - want| <= rtol * max |want| + atol and got is finite. Returns
    whether every row agrees."""
    print("%-24s %9s %12s %12s  %s" % (title, "elements", "max |diff|", "max |ref|", "result"))
    all_ok = True
    for name, got, want, rtol, atol in rows:
        got = np.asarray(got, dtype=np.float64)
        diff, scale = float(np.max(np.abs(got - want))), float(np.max(np.abs(want)))
        ok = bool(np.all(np.isfinite(got))) and diff <= rtol * scale + atol
        all_ok &= ok
        print("%-24s %9d %12.3g %12.3g  %s" % (name, got.size, diff, scale, "ok" if ok else "FAIL"))
    return all_ok


def random_inputs(g, rng):
    """Values for every buffer no task writes: uniform in [-1, 1), integers as
    indices of what they index (an embedding table's rows, a loss's classes)."""
    out = {}
    for name, (dtype, shape, storage, written) in g.buffers().items():
        if written:
            continue
        if dtype in ("i32", "i64"):
            limit = 8
            for t in g.tasks:
                if t["op"] == "embedding" and "%s.%s" % g.owner(t["id"], "ids") == name:
                    limit = g.buffers()["%s.%s" % g.owner(t["id"], "table")][1][0]
                if t["op"] == "cross_entropy" and "%s.%s" % g.owner(t["id"], "labels") == name:
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
        rows = [(name, np.load(os.path.join(outputs, name + ".npy")), values[name].numpy(),
                 1e-4 if dtype == "f32" else 1e-10, 1e-6)
                for name, (dtype, shape, storage, written) in g.buffers().items() if written and storage == "external"]
        failed = not compare("output (vs PyTorch)", rows)
        if failed:
            raise SystemExit(f"outputs differ from PyTorch (seed {opts.seed})")


if __name__ == "__main__":
    main()
