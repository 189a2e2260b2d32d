#!/usr/bin/python3
"""Trains examples/train_mlp.json in cudagen's host emulation and the same
model in PyTorch, and compares: the loss must fall below a threshold within
the steps, and the weights after the last step must match PyTorch's.

    tests/train_mlp_torch.py CUDAGEN GRAPH [--steps 20] [--loss-below 0.5] [--rtol 1e-5]

The data set is synthetic and learnable: 256 points uniform in [-1, 1]^8,
each labelled by the largest of four fixed linear scores (a "teacher"), all
from a fixed seed. Both runs start from the weights the graph's init tasks
make (the counter-based generator of templates/init.cuh, reproduced here)
and use full-batch Adam with the graph's hyper-parameters. PyTorch runs in
float32, as the generated kernels do; the weights agree when
max |w - w_torch| <= rtol * max |w_torch| for every weight.

Needs Debian's python3-torch (run with /usr/bin/python3). Exit 0 on success.
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
from torch_reference import compare, unit_float  # noqa: E402  (shared with the other reference)


def task(graph, task_id):
    return next(t for t in graph["tasks"] if t["id"] == task_id)


def initial_weight(graph, task_id):
    """What the init task `task_id` (fill or uniform, f32) writes."""
    t = task(graph, task_id)
    shape, args = t["tensors"]["out"]["shape"], t.get("args", {})
    n = int(np.prod(shape))
    if t["op"] == "fill":
        values = np.full(n, args.get("value", 0.0), dtype=np.float32)
    else:
        low, high = np.float32(args.get("low", 0.0)), np.float32(args.get("high", 1.0))
        # fma(high - low, u, low) in f32, as the template computes it.
        values = ((high - low).astype(np.float64) * unit_float(args.get("seed", 0), n, 0) + low).astype(np.float32)
    return torch.from_numpy(values.reshape(shape))


def make_data(rows, features, classes, seed=2026):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, size=(rows, features)).astype(np.float32)
    teacher = rng.normal(size=(features, classes))
    labels = np.argmax(x.astype(np.float64) @ teacher, axis=1).astype(np.int32)
    return x, labels


def arg_value(a):
    return a["value"] if isinstance(a, dict) else a


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cudagen")
    parser.add_argument("graph")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--loss-below", type=float, default=0.5)
    parser.add_argument("--rtol", type=float, default=1e-5)
    opts = parser.parse_args()
    graph = json.load(open(opts.graph))
    training = graph["training"]
    if training["optimizer"] != "adam":
        raise SystemExit("this check trains with adam; the graph's optimizer is " + training["optimizer"])
    hyper = {k: arg_value(v) for k, v in training.get("args", {}).items()}
    x_shape = task(graph, "fc1")["tensors"]["a"]["shape"]
    classes = task(graph, "w2")["tensors"]["out"]["shape"][1]
    x, labels = make_data(x_shape[0], x_shape[1], classes)

    with tempfile.TemporaryDirectory() as work:
        inputs, outputs = os.path.join(work, "in"), os.path.join(work, "out")
        os.makedirs(inputs)
        np.save(os.path.join(inputs, "fc1.a.npy"), x)
        np.save(os.path.join(inputs, "loss.labels.npy"), labels)
        run = subprocess.run([opts.cudagen, "run", opts.graph, "--emulate", "--steps", str(opts.steps), "--check-each-task", "--inputs", inputs,
                              "--outputs", outputs, "--work-dir", os.path.join(work, "build")],
                             capture_output=True, text=True)
        print(run.stdout, end="")
        if run.returncode != 0:
            print(run.stderr, end="")
            raise SystemExit("cudagen run failed")
        losses = np.load(os.path.join(outputs, "loss.loss.per_step.npy"))
        ours = {w: np.load(os.path.join(outputs, w + ".out.npy")) for w in ("w1", "b1", "w2", "b2")}

    # The same model, data, initial weights and optimizer in PyTorch.
    params = {w: initial_weight(graph, w).clone().requires_grad_(True) for w in ("w1", "b1", "w2", "b2")}
    optimizer = torch.optim.Adam(params.values(), lr=hyper["lr"], betas=(hyper.get("beta1", 0.9), hyper.get("beta2", 0.999)),
                                 eps=hyper.get("eps", 1e-8), weight_decay=hyper.get("weight_decay", 0.0))
    xt, yt = torch.from_numpy(x), torch.from_numpy(labels.astype(np.int64))
    torch_losses = []
    for _ in range(opts.steps):
        optimizer.zero_grad()
        hidden = torch.relu(xt @ params["w1"] + params["b1"])
        loss = torch.nn.functional.cross_entropy(hidden @ params["w2"] + params["b2"], yt)
        loss.backward()
        optimizer.step()
        torch_losses.append(loss.item())

    failed = False
    print("%-6s %12s %12s" % ("step", "loss", "torch loss"))
    for i in range(opts.steps):
        print("%-6d %12.6f %12.6f" % (i + 1, losses[i], torch_losses[i]))
    below = [i + 1 for i, v in enumerate(losses) if v < opts.loss_below]
    if below:
        print(f"the loss fell below {opts.loss_below} at step {below[0]} of {opts.steps}")
    else:
        print(f"FAIL: the loss did not fall below {opts.loss_below} within {opts.steps} steps")
        failed = True
    rows = [(w, got, params[w].detach().numpy(), opts.rtol, 0.0) for w, got in ours.items()]
    failed |= not compare("weight (vs PyTorch)", rows)
    if failed:
        raise SystemExit("training differs from PyTorch or did not learn")
    print(f"weights after {opts.steps} steps match PyTorch (rtol {opts.rtol})")


if __name__ == "__main__":
    main()
