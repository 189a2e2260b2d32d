#!/usr/bin/python3
"""Trains a graph under a 16-bit precision policy ("training": {"precision": "bf16"}
or "f16", generator/autocast.h) for a few steps in cudagen's host emulation, and
PyTorch's same model under torch.autocast from the same state, step by step: each
step's loss agrees within the dtype's bound (docs/architecture.md section 9: 1e-2
bf16, 5e-3 f16), and so do the f32 master weights and the optimizer state after
it, up to what a 16-bit gradient's rounding makes of an update (the slack below).

    tests/train_autocast_with_torch.py CUDAGEN {decoder,mlp} [--precision bf16|f16] [--steps 5] [--seed N]

f16 trains with dynamic loss scaling, against PyTorch's own torch.amp.GradScaler
(PyTorch 2.4 or later: 1.13 has no GradScaler and no f16 autocast on the CPU).
Its first scale, 2^40, overflows every f16 gradient: that step is skipped by both
and the scale backs off by 2^-28; the next steps are taken, the scale doubling
after every two. The scale, its good-step count and the optimizer's step count
cudagen keeps on the device must equal GradScaler's after every step.

decoder: bench/decoder_graph.py's pre-norm block (--train --dtype bf16: the graph
in f32, the policy bf16) against bench/decoder_torch.py's Block, AdamW.
mlp: two linear layers with biases, silu and cross-entropy, SGD with momentum
(a smooth activation: relu's mask flips where bf16 rounds a value across zero,
which no bound on rounding covers).
PyTorch runs on the CPU in f32 inside torch.autocast("cpu", dtype), which puts the
products in 16 bits as CUDA's autocast does (checked: the script fails if a product
comes out f32). bf16 runs on Debian's python3-torch (/usr/bin/python3) or PyTorch
2.x; f16 on the pinned PyTorch 2.x that scripts/dev.sh installs into
.cache/torch2-venv.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "bench"))
from torch_reference import Graph, optimizer_state, run_torch  # noqa: E402

RTOL = {"bf16": 1e-2, "f16": 5e-3}  # docs/architecture.md section 9
TORCH_DTYPE = {"bf16": torch.bfloat16, "f16": torch.float16}
# f16's loss scaling: the first scale overflows, the back-off lands well inside f16's range
# (the largest scaled gradient of either model is then under 1e3), growth every two steps.
LOSS_SCALE = {"initial": 2.0**40, "growth_factor": 2.0, "backoff_factor": 2.0**-28, "growth_interval": 2}


def checked_product(x):
    """A product under autocast: 16-bit, or the reference is not the policy's."""
    if x.dtype not in TORCH_DTYPE.values():
        raise SystemExit(f"torch.autocast left a product in {x.dtype}: the reference would not be 16-bit")
    return x


def decoder_model(work, args):
    dim, heads, mlp, batch, tokens = 32, 2, 64, 2, 8
    path = os.path.join(work, "decoder.json")
    subprocess.run([sys.executable, os.path.join(HERE, "..", "bench", "decoder_graph.py"), "--train", "--dtype", args.precision,
                    "--dim", str(dim), "--heads", str(heads), "--mlp", str(mlp), "--batch", str(batch),
                    "--tokens", str(tokens), "-o", path], check=True)
    with open(path) as f:
        graph = json.load(f)
    names = {"ln1": "l0_ln1_w.out", "wq": "l0_wq.out", "wk": "l0_wk.out", "wv": "l0_wv.out", "wo": "l0_wo.out",
             "ln2": "l0_ln2_w.out", "w_up": "l0_w_up.out", "w_down": "l0_w_down.out"}

    def rmsnorm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def loss(p, inputs, record, exact=False):
        checked = (lambda x: x) if exact else checked_product
        x, target = inputs["l0_ln1.x"], inputs["loss.target"]
        b, t, c = x.shape

        def product(h, key):
            return record(key, h, checked(h @ p[key]))

        def norm(x, key):
            n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
            return record(key, n, n * p[key], scale=True)

        h = norm(x, "ln1")
        q, k, v = (product(h, w).view(b, t, heads, c // heads).transpose(1, 2) for w in ("wq", "wk", "wv"))
        scores = checked(q @ k.transpose(-1, -2)) * (c // heads) ** -0.5
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        x = x + product(checked(probs @ v).transpose(1, 2).reshape(b, t, c), "wo")
        h = norm(x, "ln2")
        x = x + product(F.gelu(product(h, "w_up"), approximate="tanh"), "w_down")
        return F.mse_loss(x, target)

    return graph, names, loss


def mlp_model(work, args):
    rows, features, hidden, classes = 16, 24, 32, 10

    def init(name, shape, seed):
        bound = shape[0] ** -0.5
        return {"id": name, "op": "uniform", "phase": "init", "tensors": {"out": {"dtype": "f32", "shape": shape}},
                "args": {"low": -bound, "high": bound, "seed": seed}}

    def zeros(name, shape):
        return {"id": name, "op": "fill", "phase": "init", "tensors": {"out": {"dtype": "f32", "shape": shape}},
                "args": {"value": 0.0}}

    def task(name, op, **tensors):
        return {"id": name, "op": op, "tensors": tensors}

    own = lambda shape, **kw: dict({"dtype": "f32", "shape": shape}, **kw)
    ref = lambda s: {"from": s}
    graph = {"format": "cudagen.taskgraph/1", "name": "autocast_mlp", "tasks": [
        init("w1", [features, hidden], 1), zeros("b1", [hidden]), init("w2", [hidden, classes], 2), zeros("b2", [classes]),
        task("fc1", "matmul", a=own([rows, features], storage="external"), b=ref("w1.out"), out=own([rows, hidden])),
        task("bias1", "add", a=ref("fc1.out"), b=ref("b1.out"), out=own([rows, hidden])),
        task("act", "silu", x=ref("bias1.out"), out=own([rows, hidden])),
        task("fc2", "matmul", a=ref("act.out"), b=ref("w2.out"), out=own([rows, classes])),
        task("bias2", "add", a=ref("fc2.out"), b=ref("b2.out"), out=own([rows, classes])),
        task("loss", "cross_entropy", logits=ref("bias2.out"), labels={"dtype": "i32", "shape": [rows], "storage": "external"},
             loss=own([], storage="external"))],
        "training": {"loss": "loss.loss", "optimizer": "sgd", "args": {"lr": 0.5, "momentum": 0.9},
                     "precision": args.precision}}
    names = {n: n + ".out" for n in ("w1", "b1", "w2", "b2")}

    def loss(p, inputs, record, exact=False):
        checked = (lambda x: x) if exact else checked_product
        y = record("w1", inputs["fc1.a"], checked(inputs["fc1.a"] @ p["w1"]))
        h = F.silu(record("b1", None, y + p["b1"]))
        logits = record("b2", None, record("w2", h, checked(h @ p["w2"])) + p["b2"])
        return F.cross_entropy(logits, inputs["loss.labels"].long())

    return graph, names, loss


class Contractions:
    """Each weight's gradient as the contraction it is, recorded in the forward:
    a product's weight sums operand * output gradient over the rows, a norm's
    scale the normalised value * output gradient, a bias the output gradient.
    After backward, the same sums of absolute values: DESIGN's ref_abs
    (docs/architecture.md section 9), so that a gradient summed with
    cancellation is held to the dtype's bound of its terms, not of its total.
    Under loss scaling the output gradients are scaled: loss_scale divides them."""

    def __init__(self):
        self.terms = {}

    def __call__(self, key, operand, output, scale=False):
        output.retain_grad()
        self.terms[key] = (operand, output, scale)
        return output

    def abs_gradient(self, key, loss_scale=1.0):
        operand, output, scale = self.terms[key]
        d = output.grad.double().abs() / loss_scale
        if operand is None:  # a bias: summed over every leading axis
            return d.reshape(-1, d.shape[-1]).sum(0)
        a = operand.detach().double().abs()
        if scale:  # a norm's scale: elementwise, summed over the rows
            return (a * d).reshape(-1, d.shape[-1]).sum(0)
        return a.reshape(-1, a.shape[-1]).T @ d.reshape(-1, d.shape[-1])


def grad_scaler(before, scaling):
    """torch.amp.GradScaler in the state cudagen's loss scaling was in before a
    step: its scale and the good steps since its last overflow (the run-time
    scalars loss_scale.out and loss_scale_good_steps.out)."""
    if not hasattr(torch, "amp") or not hasattr(torch.amp, "GradScaler"):
        raise SystemExit(f"PyTorch {torch.__version__} has no torch.amp.GradScaler for the CPU: f16 needs 2.4 or "
                         "later (scripts/dev.sh installs it into .cache/torch2-venv)")
    scaler = torch.amp.GradScaler("cpu", init_scale=scaling["initial"], growth_factor=scaling["growth_factor"],
                                  backoff_factor=scaling["backoff_factor"], growth_interval=scaling["growth_interval"])
    if before is not None:
        state = scaler.state_dict()
        state.update(scale=float(before["loss_scale.out"]), _growth_tracker=int(before["loss_scale_good_steps.out"]))
        scaler.load_state_dict(state)
    return scaler


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cudagen")
    ap.add_argument("model", choices=["decoder", "mlp"])
    ap.add_argument("--precision", choices=["bf16", "f16"], default="bf16")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=int.from_bytes(os.urandom(4), "little"))
    opts = ap.parse_args()
    rng = np.random.default_rng(opts.seed)
    rtol, dtype = RTOL[opts.precision], TORCH_DTYPE[opts.precision]
    registry = json.loads(subprocess.run([opts.cudagen, "ops", "--json"], check=True, capture_output=True, text=True).stdout)
    with tempfile.TemporaryDirectory() as work:
        graph, names, loss_fn = (decoder_model if opts.model == "decoder" else mlp_model)(work, opts)
        training = graph["training"]
        scaling = None
        if opts.precision == "f16":
            scaling = training["loss_scale"] = dict(LOSS_SCALE)
            grad_scaler(None, scaling)  # refuses a PyTorch without one before cudagen runs
        path = os.path.join(work, "graph.json")
        with open(path, "w") as f:
            json.dump(graph, f)
        g = Graph(graph, registry)
        # The policy as cudagen applied it: every product of the graph computes in the 16-bit dtype.
        described = subprocess.run([opts.cudagen, "describe", path], check=True, capture_output=True, text=True).stdout
        dtypes = dict(re.findall(r"^\s+(\S+)\s+(f32|f16|bf16|f64|i32|i64)\s+\[", described, re.M))
        for t in graph["tasks"]:
            if t["op"] == "matmul" and dtypes.get(t["id"] + ".out") != opts.precision:
                raise SystemExit(f"cudagen computes {t['id']} in {dtypes.get(t['id'] + '.out')}, not {opts.precision}:\n"
                                 f"{described}")
        inputs = {}  # every external slot but the loss: the caller's inputs
        for t in graph["tasks"]:
            for slot, spec in t["tensors"].items():
                if spec.get("storage") != "external" or f"{t['id']}.{slot}" == training["loss"]:
                    continue
                integer = spec["dtype"] == "i32"  # class labels: the MLP has 10 classes
                inputs[f"{t['id']}.{slot}"] = (rng.integers(0, 10, size=spec["shape"]).astype(np.int32) if integer
                                               else rng.uniform(-1, 1, size=spec["shape"]).astype(np.float32))
        in_dir = os.path.join(work, "in")
        os.makedirs(in_dir)
        for name, array in inputs.items():
            np.save(os.path.join(in_dir, name + ".npy"), array)
        runs = [None]
        for steps in range(1, opts.steps + 1):
            out_dir = os.path.join(work, f"out{steps}")
            run = subprocess.run([opts.cudagen, "run", path, "--emulate", "--steps", str(steps), "--inputs", in_dir,
                                  "--outputs", out_dir, "--seed", str(opts.seed), "--work-dir", os.path.join(work, "build")],
                                 capture_output=True, text=True)
            if run.returncode != 0:
                print(run.stdout + run.stderr, end="")
                raise SystemExit(f"cudagen run failed (seed {opts.seed})")
            runs.append({n[:-len(".npy")]: np.load(os.path.join(out_dir, n)) for n in os.listdir(out_dir)})
        initial = run_torch(g, {}, phases={"init"})

    torch_inputs = {n: torch.from_numpy(a) for n, a in inputs.items()}
    args = {k: (v["value"] if isinstance(v, dict) else v) for k, v in training["args"].items()}
    failed, skipped_steps = False, 0
    print("%-6s %14s %14s" % ("step", "loss", "torch loss"))
    for step in range(1, opts.steps + 1):
        before, after = runs[step - 1], runs[step]
        params = {key: torch.tensor(before[name] if before is not None else initial[name].float().numpy(),
                                    dtype=torch.float32, requires_grad=True) for key, name in names.items()}
        if training["optimizer"] == "sgd":
            optimizer = torch.optim.SGD(list(params.values()), lr=args["lr"], momentum=args.get("momentum", 0.0))
        else:
            optimizer = torch.optim.AdamW(list(params.values()), lr=args["lr"], weight_decay=args.get("weight_decay", 0.0))
        # The optimizer's steps taken so far: skipped steps are not counted (cudagen keeps the count on the device).
        steps_taken = step - 1 if scaling is None or before is None else int(before["optimizer_steps.out"])
        if before is not None:
            for key, p in params.items():
                optimizer.state[p] = optimizer_state(training["optimizer"], before, names[key], np.float32)
                if training["optimizer"] != "sgd":
                    optimizer.state[p]["step"] = torch.tensor(float(steps_taken))
        scaler = grad_scaler(before, scaling) if scaling is not None else None
        scale = scaler.get_scale() if scaler is not None else 1.0
        record = Contractions()
        with torch.autocast("cpu", dtype=dtype):
            loss = loss_fn(params, torch_inputs, record)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        skipped = False
        if scaler is not None:
            scaler.unscale_(optimizer)  # the gradients unscaled in place, or inf/NaN found
            skipped = not all(bool(torch.isfinite(p.grad).all()) for p in params.values())
        # PyTorch's own 16-bit error: the same gradients in float64, without autocast, as a
        # fraction of each element's sum of absolute terms; the tensor's largest (at least
        # the dtype's bound) is the rate each of the two 16-bit implementations may err at, so
        # theirs are within twice it of each other.
        delta_g = {}
        if not skipped:
            exact = {key: p.detach().double().requires_grad_(True) for key, p in params.items()}
            loss_fn(exact, {n: (t.double() if t.is_floating_point() else t) for n, t in torch_inputs.items()},
                    lambda key, operand, output, scale=False: output, exact=True).backward()
            for key, p in params.items():
                abs_g = record.abs_gradient(key, scale).numpy()
                rate = max(rtol, float(np.max(np.abs(p.grad.double().numpy() - exact[key].grad.numpy()) / (abs_g + 1e-30))))
                delta_g[p] = 2 * rate * abs_g + 1e-7
        if scaler is not None:
            scaler.step(optimizer)  # skips the step on the inf/NaN unscale_ found
            scaler.update()
            skipped_steps += skipped
            steps_taken += not skipped
            print("       loss scale now %g%s" % (scaler.get_scale(), " (overflow: step skipped)" if skipped else ""))
        else:
            optimizer.step()
        ours_loss = float(after[training["loss"] + ".per_step"][step - 1])
        print("%-6d %14.8f %14.8f" % (step, ours_loss, loss.item()))
        if abs(ours_loss - loss.item()) > rtol * abs(loss.item()) + 1e-6:
            print(f"  loss differs by more than {opts.precision}'s bound ({rtol} relative)")
            failed = True
        # What a gradient's difference makes of the step: SGD moves by lr times it;
        # Adam divides it by sqrt(v_hat) + eps, and never moves by more than about 2 lr.
        # A skipped step leaves every weight as it was: no slack.
        if skipped:
            slack = {p: 0.0 for p in params.values()}
        elif training["optimizer"] == "sgd":
            slack = {p: args["lr"] * delta_g[p] for p in params.values()}
        else:
            slack = {}
            for p in params.values():
                state = optimizer.state[p]
                v_hat = state["exp_avg_sq"].double().numpy() / (1 - 0.999 ** int(state["step"]))
                slack[p] = args["lr"] * np.minimum(2.0, delta_g[p] / (np.sqrt(v_hat) + 1e-8))
        for key, p in params.items():
            ours, want = after[names[key]].astype(np.float64), p.detach().double().numpy()
            bound = (0.0 if skipped else 1e-5 * np.abs(want).max() + 1e-7) + slack[p]
            worst = float(np.max(np.abs(ours - want) - bound))
            if worst > 0:
                print(f"  {names[key]}: differs from PyTorch's by {worst:.3g} beyond the bound "
                      f"(max |difference| {np.abs(ours - want).max():.3g}, bound {np.max(bound):.3g}, max |w| {np.abs(want).max():.3g})")
                failed = True
        if scaler is not None:  # GradScaler's state and the optimizer's count, exactly
            for name, want in (("loss_scale.out", scaler.get_scale()),
                               ("loss_scale_good_steps.out", scaler.state_dict()["_growth_tracker"]),
                               ("optimizer_steps.out", steps_taken)):
                if float(after[name]) != float(want):
                    print(f"  {name}: cudagen's {float(after[name]):g}, GradScaler's {float(want):g}")
                    failed = True
    if scaling is not None and not 0 < skipped_steps < opts.steps:
        raise SystemExit(f"{skipped_steps} of {opts.steps} steps overflowed: the test means to check a skipped step "
                         "and taken ones")
    if failed:
        raise SystemExit(f"a {opts.precision} training step differs from PyTorch's under torch.autocast (seed {opts.seed})")
    print(f"every one of {opts.steps} {opts.precision} steps matches PyTorch's under torch.autocast from the same state "
          f"(PyTorch {torch.__version__}, seed {opts.seed})")


if __name__ == "__main__":
    main()
