#!/usr/bin/python3
"""Trains a graph with a "training" section for a few steps in cudagen's host
emulation and in PyTorch (float64 autograd of the forward ops, torch.optim),
from the same random inputs and initial weights, and compares the weights
after the last step: |w - w_torch| <= rtol * max |w_torch| + 1e-7 + slack,
where slack is what Adam's division by sqrt(v) + eps makes of an f32
gradient's rounding (see adam_slack); zero for SGD.

    tests/train_with_torch.py CUDAGEN GRAPH [--steps 3] [--rtol 1e-4] [--seed N]

The backward tasks cudagen derives are checked here against PyTorch's own
autograd, and its optimizer tasks against torch.optim (sgd with momentum,
adam, adamw). Needs Debian's python3-torch (run with /usr/bin/python3).
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
from torch_reference import Graph, compare, random_inputs, run_torch  # noqa: E402


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
    opts = parser.parse_args()
    graph = json.load(open(opts.graph))
    training = graph.get("training")
    if not training or not training.get("optimizer"):
        raise SystemExit(f"{opts.graph} has no \"training\" section with an optimizer")
    registry = json.loads(subprocess.run([opts.cudagen, "ops", "--json"], check=True, capture_output=True, text=True).stdout)
    g = Graph(graph, registry)
    rng = np.random.default_rng(opts.seed)
    inputs = random_inputs(g, rng)

    with tempfile.TemporaryDirectory() as work:
        in_dir, out_dir = os.path.join(work, "in"), os.path.join(work, "out")
        os.makedirs(in_dir)
        for name, array in inputs.items():
            np.save(os.path.join(in_dir, name + ".npy"), array)
        run = subprocess.run([opts.cudagen, "run", opts.graph, "--emulate", "--steps", str(opts.steps), "--check-each-task", "--inputs", in_dir,
                              "--outputs", out_dir, "--seed", str(opts.seed), "--work-dir", os.path.join(work, "build")],
                             capture_output=True, text=True)
        print(run.stdout, end="")
        if run.returncode != 0:
            print(run.stderr, end="")
            raise SystemExit(f"cudagen run failed (seed {opts.seed})")
        # The weights: what init tasks write.
        weights = {"%s.%s" % (t["id"], slot) for t in graph["tasks"] if t.get("phase") == "init" for slot in t["tensors"]}
        ours = {name: np.load(os.path.join(out_dir, name + ".npy")) for name in sorted(weights)}
        losses = np.load(os.path.join(out_dir, training["loss"] + ".per_step.npy"))

    values = {name: torch.from_numpy(a.astype(np.float64) if a.dtype.kind == "f" else a) for name, a in inputs.items()}
    values = run_torch(g, values, phases={"init"})
    # The kernels store f32 weights: start PyTorch from the same rounded values.
    params = {name: values[name].float().double().requires_grad_(True) for name in sorted(weights)}
    optimizer = optimizer_for(training, list(params.values()))
    loss_task, loss_slot = training["loss"].split(".")
    torch_losses = []
    slack = {name: 0.0 for name in params}
    for _ in range(opts.steps):
        optimizer.zero_grad()
        state = dict(values, **params)
        state = run_torch(g, state, phases={"forward"})
        loss = state["%s.%s" % g.owner(loss_task, loss_slot)]
        loss.backward()
        optimizer.step()
        torch_losses.append(loss.item())
        if training["optimizer"] in ("adam", "adamw"):
            step_slack = adam_slack(optimizer, optimizer.param_groups[0]["lr"])
            for name, p in params.items():
                slack[name] = slack[name] + step_slack[p]

    print("%-6s %14s %14s" % ("step", "loss", "torch loss"))
    for i in range(opts.steps):
        print("%-6d %14.8f %14.8f" % (i + 1, losses[i], torch_losses[i]))
    rows = [(name, got, params[name].detach().numpy(), opts.rtol, 1e-7 + slack[name]) for name, got in ours.items()]
    failed = not compare("weight (vs PyTorch)", rows)
    if failed:
        raise SystemExit(f"weights after {opts.steps} steps differ from PyTorch (seed {opts.seed})")
    print(f"weights after {opts.steps} steps match PyTorch's (rtol {opts.rtol}, seed {opts.seed})")


if __name__ == "__main__":
    main()
