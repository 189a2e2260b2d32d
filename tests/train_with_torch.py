#!/usr/bin/python3
"""Trains a graph with a "training" section for a few steps in cudagen's host
emulation and checks each step against PyTorch (float64 autograd of the
forward ops, torch.optim) started from the state cudagen reached before it:
the weights and the optimizer state after every step agree,
|x - x_torch| <= rtol * max |x_torch| + 1e-7 + slack, where slack is what
Adam's division by sqrt(v) + eps makes of an f32 gradient's rounding (see
adam_slack); zero for SGD.

    tests/train_with_torch.py CUDAGEN GRAPH [--steps 3] [--rtol 1e-4] [--seed N]
                              [--clip-grad-norm MAX] [--micro-batches K]
                              [--loss-scale INITIAL [--backoff-factor F] [--growth-interval N]]

The backward tasks cudagen derives are checked here against PyTorch's own
autograd, and its optimizer tasks (their state and step count included)
against torch.optim (sgd with momentum, adam, adamw). --clip-grad-norm trains
the graph with "clip_grad_norm" set, against torch.nn.utils.clip_grad_norm_,
and fails unless some step's norm is above it (so the clipping is tested,
not only the norm). --micro-batches trains it with "accumulate_gradients"
set, each step over K micro-batches of their own inputs, against PyTorch
summing the gradients of each micro-batch's loss divided by K. --loss-scale
trains it with dynamic loss scaling ("loss_scale"), against
torch.cuda.amp.GradScaler's algorithm written out here (Debian's PyTorch 1.13
has no GradScaler off CUDA): the loss multiplied by the scale, a step skipped
and the scale backed off where the scaled gradients overflow, the gradients
unscaled otherwise, the scale grown after growth_interval good steps. The
overflow test is cudagen's, the f32 sum of the scaled gradients' squares (an
inf, a NaN, or beyond f32's range), so that PyTorch in float64 sees the same
overflow; each run must skip a step and take one. Needs Debian's
python3-torch (run with /usr/bin/python3).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_reference import Graph, compare, optimizer_state, random_inputs, run_torch  # noqa: E402


def optimizer_for(training, params):
    args = {k: (v["value"] if isinstance(v, dict) else v) for k, v in training.get("args", {}).items()}
    name = training["optimizer"]
    if name == "sgd":
        return torch.optim.SGD(params, lr=args["lr"], momentum=args.get("momentum", 0.0),
                               weight_decay=args.get("weight_decay", 0.0))
    betas = (args.get("beta1", 0.9), args.get("beta2", 0.999))
    cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
    return cls(params, lr=args["lr"], betas=betas, eps=args.get("eps", 1e-8),
               weight_decay=args.get("weight_decay", 0.0 if name == "adam" else 0.01))


def adam_slack(optimizer, lr, gradient_rtol=1e-5):
    """After an Adam(W) step: per parameter, how far the step may move each
    element because cudagen's gradients are f32. A gradient is within
    gradient_rtol (docs/architecture.md section 9's f32 bound) of its tensor's largest
    magnitude; Adam divides it by sqrt(v_hat) + eps, so an element whose
    gradient is near eps (1e-8) turns a rounding of 1e-10 into a step of
    1e-4: lr * delta_g / (sqrt(v_hat) + eps), never more than 2 lr (the step
    is at most about lr either way). For every other element the slack is far
    below a wrong gradient's effect (about lr)."""
    slack = {}
    for group in optimizer.param_groups:
        beta2, eps = group["betas"][1], group["eps"]
        for p in group["params"]:
            state = optimizer.state[p]
            step = int(state["step"])
            v_hat = state["exp_avg_sq"] / (1 - beta2 ** step)
            delta_g = gradient_rtol * float(p.grad.abs().max())
            slack[p] = (lr * np.minimum(2.0, delta_g / (v_hat.sqrt() + eps).detach().numpy()))
    return slack


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cudagen")
    parser.add_argument("graph")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rtol", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=int.from_bytes(os.urandom(4), "little"))
    parser.add_argument("--clip-grad-norm", type=float, help="train with this \"clip_grad_norm\"")
    parser.add_argument("--micro-batches", type=int, default=1,
                        help="train with \"accumulate_gradients\", K micro-batches a step")
    parser.add_argument("--loss-scale", type=float, help="train with \"loss_scale\" starting at this scale")
    parser.add_argument("--backoff-factor", type=float, default=0.5)
    parser.add_argument("--growth-interval", type=int, default=2000)
    opts = parser.parse_args()
    graph = json.load(open(opts.graph))
    training = graph.get("training")
    if not training or not training.get("optimizer"):
        raise SystemExit(f"{opts.graph} has no \"training\" section with an optimizer")
    if opts.clip_grad_norm is not None:
        training["clip_grad_norm"] = opts.clip_grad_norm
    if opts.micro_batches > 1:
        training["accumulate_gradients"] = True
    scaling = None
    if opts.loss_scale is not None:
        scaling = {"initial": opts.loss_scale, "growth_factor": 2.0, "backoff_factor": opts.backoff_factor,
                   "growth_interval": opts.growth_interval}
        training["loss_scale"] = scaling
    changed = opts.clip_grad_norm is not None or opts.micro_batches > 1 or scaling is not None
    registry = json.loads(subprocess.run([opts.cudagen, "ops", "--json"], check=True, capture_output=True, text=True).stdout)
    g = Graph(graph, registry)
    rng = np.random.default_rng(opts.seed)
    # Each micro-batch's inputs: its own graph inputs; weights' "data" and the like shared.
    micro_batches = [random_inputs(g, rng) for _ in range(opts.micro_batches)]
    external = {name for name, (_, _, storage, _, _) in g.buffers().items() if storage in (None, "external")}
    inputs = micro_batches[0]
    # The weights: what init tasks write.
    weights = sorted({"%s.%s" % (t["id"], slot) for t in graph["tasks"] if t.get("phase") == "init" for slot in t["tensors"]})

    # cudagen after 1, 2, ..., steps steps: its weights and optimizer state after each (the run of
    # all the steps also checks every task of every step against the float64 reference).
    runs = [None]
    with tempfile.TemporaryDirectory() as work:
        graph_path = opts.graph
        if changed:  # the graph as changed
            if '"data"' in json.dumps(graph):
                raise SystemExit("--clip-grad-norm and --micro-batches take a graph without \"data\" files")
            graph_path = os.path.join(work, "graph.json")
            with open(graph_path, "w") as f:
                json.dump(graph, f)
        in_dir = os.path.join(work, "in")
        os.makedirs(in_dir)
        for name, array in inputs.items():  # stacked [K, ...] where each micro-batch has its own
            if opts.micro_batches > 1 and name in external:
                array = np.stack([m[name] for m in micro_batches])
            np.save(os.path.join(in_dir, name + ".npy"), array)
        for steps in range(1, opts.steps + 1):
            out_dir = os.path.join(work, "out%d" % steps)
            check = ["--check-each-task"] if steps == opts.steps else []
            run = subprocess.run([opts.cudagen, "run", graph_path, "--emulate", "--steps", str(steps), "--micro-batches",
                                  str(opts.micro_batches), *check, "--inputs", in_dir,
                                  "--outputs", out_dir, "--seed", str(opts.seed), "--work-dir", os.path.join(work, "build")],
                                 capture_output=True, text=True)
            if steps == opts.steps or run.returncode != 0:
                print(run.stdout, end="")
            if run.returncode != 0:
                print(run.stderr, end="")
                raise SystemExit(f"cudagen run failed (seed {opts.seed})")
            runs.append({name[:-len(".npy")]: np.load(os.path.join(out_dir, name)) for name in os.listdir(out_dir)})

    # PyTorch, one step at a time from the state cudagen reached before it: each step's derived
    # gradients and update are checked on their own. Compared only after several steps, Adam's
    # first step (lr * g / (|g| + eps), about lr * sign(g)) turns an f32 gradient's rounding into a
    # step of up to 2 lr wherever a gradient is near zero, and the next steps carry that change
    # into every weight: a chaotic difference, not a wrong derivative.
    values = {name: torch.from_numpy(a.astype(np.float64) if a.dtype.kind == "f" else a) for name, a in inputs.items()}
    values = run_torch(g, values, phases={"init"})
    loss_task, loss_slot = training["loss"].split(".")
    failed = False
    clipped_steps = 0
    skipped_steps = 0
    print("%-6s %14s %14s" % ("step", "loss", "torch loss"))
    for step in range(1, opts.steps + 1):
        # The kernels store f32 weights: the first step starts from the same rounded values.
        before = runs[step - 1]
        params = {name: (values[name].float().double() if before is None else torch.from_numpy(before[name].astype(np.float64)))
                  .requires_grad_(True) for name in weights}
        optimizer = optimizer_for(training, list(params.values()))
        # Loss scaling's state before the step: the scale, the good steps since the last
        # overflow, the optimizer steps taken (Adam's count).
        scale, good_steps, steps_taken = 1.0, 0, step - 1
        if scaling is not None:
            scale, good_steps, steps_taken = scaling["initial"], 0, 0
            if before is not None:
                scale, good_steps, steps_taken = (float(before[n]) for n in ("loss_scale.out", "loss_scale_good_steps.out",
                                                                             "optimizer_steps.out"))
        if before is not None:
            for name, p in params.items():
                state = optimizer_state(training["optimizer"], before, name, np.float64)
                if training["optimizer"] != "sgd":
                    state["step"] = torch.tensor(float(steps_taken))
                optimizer.state[p] = state
        optimizer.zero_grad()
        losses = []
        for micro_batch in micro_batches:  # each loss divided by their count: the gradients sum to the mean
            own = {name: torch.from_numpy(micro_batch[name].astype(np.float64) if micro_batch[name].dtype.kind == "f"
                                          else micro_batch[name]) for name in external & set(micro_batch)}
            state = run_torch(g, dict(values, **own, **params), phases={"forward"})
            loss = state["%s.%s" % g.owner(loss_task, loss_slot)]
            (loss * scale / len(micro_batches)).backward()
            losses.append(loss.item())
        skipped = False
        if scaling is not None:  # GradScaler: unscale, or skip and back off
            grads = [p.grad for p in params.values()]
            sum_of_squares = sum(float((grad * grad).sum()) for grad in grads)
            skipped = not sum_of_squares <= float(np.finfo(np.float32).max)
            if skipped:
                scale, good_steps = scale * scaling["backoff_factor"], 0
            else:
                for grad in grads:
                    grad.mul_(1.0 / scale)
                steps_taken, good_steps = steps_taken + 1, good_steps + 1
                if good_steps >= scaling["growth_interval"]:
                    scale, good_steps = scale * scaling["growth_factor"], 0
            skipped_steps += skipped
            print("       loss scale now %g%s" % (scale, " (overflow: step skipped)" if skipped else ""))
        if "clip_grad_norm" in training and not skipped:
            norm = float(torch.nn.utils.clip_grad_norm_(list(params.values()), training["clip_grad_norm"]))
            clipped_steps += norm > training["clip_grad_norm"]
            print("       gradient norm %.6g (clip_grad_norm %g)" % (norm, training["clip_grad_norm"]))
        if not skipped:
            optimizer.step()
        slack = {p: 0.0 for p in params.values()}
        if training["optimizer"] in ("adam", "adamw") and not skipped and optimizer.state:
            slack = adam_slack(optimizer, optimizer.param_groups[0]["lr"])
        after = runs[step]
        print("%-6d %14.8f %14.8f" % (step, after[training["loss"] + ".per_step"][step - 1], np.mean(losses)))
        rows = []
        for name, p in params.items():
            rows.append((name, after[name], p.detach().numpy(), opts.rtol, 1e-7 + slack[p]))
            for key, want in optimizer.state[p].items() if not skipped else ():
                if key != "step":
                    ours = optimizer_state(training["optimizer"], after, name, np.float64)[key]
                    rows.append(("  " + key, ours.numpy(), want.detach().numpy(), opts.rtol, 1e-12))
        if skipped and before is not None:  # the state as it was
            for name in params:
                for key, ours in optimizer_state(training["optimizer"], after, name, np.float64).items():
                    rows.append(("  " + key, ours.numpy(), optimizer_state(training["optimizer"], before, name,
                                                                          np.float64)[key].numpy(), 0.0, 0.0))
        if scaling is not None:
            for name, want in (("loss_scale.out", scale), ("loss_scale_good_steps.out", good_steps),
                               ("optimizer_steps.out", steps_taken)):
                rows.append((name, after[name], np.float64(want), 0.0, 0.0))
        failed |= not compare("step %d (vs PyTorch)" % step, rows)
    if "clip_grad_norm" in training and clipped_steps == 0:
        raise SystemExit(f"no step's gradient norm exceeded clip_grad_norm {training['clip_grad_norm']}: lower it, "
                         "or the test checks no clipping")
    if scaling is not None and not 0 < skipped_steps < opts.steps:
        raise SystemExit(f"{skipped_steps} of {opts.steps} steps overflowed: choose --loss-scale so that some step is "
                         "skipped and some is taken, or the test checks one path only")
    if failed:
        raise SystemExit(f"a training step differs from PyTorch's (seed {opts.seed})")
    print(f"every one of {opts.steps} steps matches PyTorch's from the same state (rtol {opts.rtol}, seed {opts.seed})")


if __name__ == "__main__":
    main()
