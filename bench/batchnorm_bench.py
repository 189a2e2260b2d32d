#!/usr/bin/env python3
"""BatchNorm in training mode on ResNet-50's activations, bf16, channels-last:
cudagen's batchnorm2d_nhwc (the batch's statistics, the running statistics
updated, the output) and batchnorm2d_nhwc_backward (dx, dweight, dbias)
beside PyTorch's batch_norm forward and backward (cuDNN) on the same shapes.
Memory-bound: each line also gives the bytes the two passes must move at
least (the forward reads x and writes out; the backward reads x and dout and
writes dx), so a time reads as a bandwidth.

    python3 bench/batchnorm_bench.py --graphs DIR [--batch 32]
writes DIR/<layer>.json for each shape: one graph of the forward and
backward tasks, random inputs, for bench_megakernel to time.

    python3 bench/batchnorm_bench.py --torch [--batch 32] [--runs 20]
prints, for each shape, PyTorch's time for the same forward and backward
(torch.nn.functional.batch_norm with training=True on a channels_last
tensor, then autograd), "batchnorm_<layer>  torch  0.123 ms  MiB 12.3", the
mean of back-to-back runs after warm-up, timed with CUDA events (as
bench_megakernel times cudagen's kernels). bench/gpu_check.sh runs both at
batch 32.
"""
import argparse
import json
import os
import sys

# name: height and width, channels (the outputs of ResNet-50 v1.5's convolutions at 224 x 224)
LAYERS = {
    "stem_112x112x64": (112, 64),
    "layer1_56x56x64": (56, 64),
    "layer1_56x56x256": (56, 256),
    "layer2_28x28x512": (28, 512),
    "layer3_14x14x1024": (14, 1024),
    "layer4_7x7x2048": (7, 2048),
}


def minimum_bytes(batch, layer):
    size, c = LAYERS[layer]
    return 2 * batch * size * size * c * 5  # bf16: x and out, then x, dout and dx


def graph(batch, layer):
    size, c = LAYERS[layer]
    x = [batch, size, size, c]
    tensor = lambda dtype, shape, storage="external": {"dtype": dtype, "shape": shape, "storage": storage}
    forward = {"x": tensor("bf16", x), "weight": tensor("bf16", [c], "persistent"),
               "bias": tensor("bf16", [c], "persistent"), "running_mean": tensor("f32", [c], "persistent"),
               "running_var": tensor("f32", [c], "persistent"), "out": tensor("bf16", x),
               "mean": tensor("f32", [c]), "rstd": tensor("f32", [c])}
    backward = {"x": {"from": "bn.x"}, "weight": {"from": "bn.weight"}, "mean": {"from": "bn.mean"},
                "rstd": {"from": "bn.rstd"},
                "dout": tensor("bf16", x), "dx": tensor("bf16", x), "dweight": tensor("bf16", [c]),
                "dbias": tensor("bf16", [c])}
    tasks = [{"id": "bn", "op": "batchnorm2d_nhwc", "phase": "forward", "args": {"momentum": 0.1},
              "tensors": forward},
             {"id": "bn_backward", "op": "batchnorm2d_nhwc_backward", "phase": "forward", "tensors": backward}]
    return {"format": "cudagen.taskgraph/1", "name": f"batchnorm_{layer}", "tasks": tasks}


def time_torch(batch, layer, runs):
    import torch
    torch.backends.cudnn.benchmark = True
    size, c = LAYERS[layer]
    cl = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(batch, c, size, size, **cl).to(memory_format=torch.channels_last).requires_grad_()
    weight = torch.ones(c, **cl, requires_grad=True)
    bias = torch.zeros(c, **cl, requires_grad=True)
    running_mean = torch.zeros(c, device="cuda")
    running_var = torch.ones(c, device="cuda")
    dout = torch.randn(batch, c, size, size, **cl).to(memory_format=torch.channels_last)

    def step():
        out = torch.nn.functional.batch_norm(x, running_mean, running_var, weight, bias, training=True, momentum=0.1)
        torch.autograd.grad(out, (x, weight, bias), dout)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(runs):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / runs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--graphs", metavar="DIR", help="write one graph a shape here")
    ap.add_argument("--torch", action="store_true", help="time PyTorch's batch_norm forward and backward (needs a GPU)")
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    if not args.graphs and not args.torch:
        ap.error("give --graphs DIR, --torch, or both")
    if args.graphs:
        os.makedirs(args.graphs, exist_ok=True)
        for layer in LAYERS:
            path = os.path.join(args.graphs, layer + ".json")
            with open(path + ".tmp", "w") as f:
                json.dump(graph(args.batch, layer), f, indent=1)
            os.replace(path + ".tmp", path)
        print(f"wrote {len(LAYERS)} graphs to {args.graphs}", file=sys.stderr)
    if args.torch:
        for layer in LAYERS:
            ms = time_torch(args.batch, layer, args.runs)
            mib = minimum_bytes(args.batch, layer) / 2**20
            print(f"batchnorm_{layer:<20} torch  {ms:.4f} ms  MiB {mib:.1f}  {mib / 1024 / (ms / 1e3):.0f} GiB/s",
                  flush=True)


if __name__ == "__main__":
    main()
