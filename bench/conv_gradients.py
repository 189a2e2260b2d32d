#!/usr/bin/env python3
"""The gradients of ResNet-50's convolutions, bf16, channels-last: cudagen's
conv2d_nhwc_backward_data and conv2d_nhwc_backward_weight (docs/gemm.md, "The
gradients") beside PyTorch's convolution backward (cuDNN) on the same layers.

    python3 bench/conv_gradients.py --graphs DIR [--batch 32]
writes DIR/<layer>.json for each layer: one graph of the two gradient tasks
(dx and dweight), random inputs, for bench_megakernel to time.

    python3 bench/conv_gradients.py --torch [--batch 32] [--runs 20]
prints, for each layer, PyTorch's time for the same two gradients
(torch.ops.aten.convolution_backward, channels_last, cudnn.benchmark on),
"conv_grad_<layer>  torch  0.123 ms  GFLOP 1.23", the mean of back-to-back
runs after warm-up, timed with CUDA events (as bench_megakernel times
cudagen's kernels). bench/gpu_check.sh runs both at batch 32.
"""
import argparse
import json
import os
import sys

# name: input height and width, input channels, output channels, kernel, stride (ResNet-50 v1.5 at 224 x 224)
LAYERS = {
    "layer1_3x3": (56, 64, 64, 3, 1),
    "layer1_1x1_up": (56, 64, 256, 1, 1),
    "layer2_3x3_stride2": (56, 128, 128, 3, 2),
    "layer2_1x1_downsample": (56, 256, 512, 1, 2),
    "layer2_3x3": (28, 128, 128, 3, 1),
    "layer3_3x3": (14, 256, 256, 3, 1),
    "layer4_3x3": (7, 512, 512, 3, 1),
}


def out_size(size, kernel, stride):
    return (size + 2 * (kernel // 2) - kernel) // stride + 1


def flops(batch, layer):
    size, c, o, k, s = LAYERS[layer]
    return 2 * 2 * batch * out_size(size, k, s) ** 2 * o * c * k * k  # two gradients, each the forward's


def graph(batch, layer):
    size, c, o, k, s = LAYERS[layer]
    oh = out_size(size, k, s)
    tensor = lambda shape, storage="external": {"dtype": "bf16", "shape": shape, "storage": storage}
    x, w, d = [batch, size, size, c], [o, k, k, c], [batch, oh, oh, o]
    args = {"stride_h": s, "stride_w": s, "padding_h": k // 2, "padding_w": k // 2}
    tasks = [{"id": "dx", "op": "conv2d_nhwc_backward_data", "phase": "forward", "args": args,
              "tensors": {"x": tensor(x), "weight": tensor(w), "dout": tensor(d), "dx": tensor(x)}},
             {"id": "dweight", "op": "conv2d_nhwc_backward_weight", "phase": "forward", "args": args,
              "tensors": {"x": tensor(x), "weight": tensor(w), "dout": tensor(d), "dweight": tensor(w)}}]
    return {"format": "cudagen.taskgraph/1", "name": f"conv_grad_{layer}", "tasks": tasks}


def time_torch(batch, layer, runs):
    import torch
    torch.backends.cudnn.benchmark = True
    size, c, o, k, s = LAYERS[layer]
    oh = out_size(size, k, s)
    cl = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(batch, c, size, size, **cl).to(memory_format=torch.channels_last)
    w = torch.randn(o, c, k, k, **cl).to(memory_format=torch.channels_last) / (c * k * k) ** 0.5
    d = torch.randn(batch, o, oh, oh, **cl).to(memory_format=torch.channels_last)

    def step():
        return torch.ops.aten.convolution_backward(d, x, w, None, [s, s], [k // 2, k // 2], [1, 1], False, [0, 0], 1,
                                                   [True, True, False])
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
    ap.add_argument("--graphs", metavar="DIR", help="write one graph a layer here")
    ap.add_argument("--torch", action="store_true", help="time PyTorch's convolution backward (needs a GPU)")
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
            print(f"conv_grad_{layer:<22} torch  {ms:.4f} ms  GFLOP {flops(args.batch, layer) / 1e9:.2f}", flush=True)


if __name__ == "__main__":
    main()
