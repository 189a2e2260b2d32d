#!/usr/bin/env python3
"""ResNet-50 in bf16, forward: exported for cudagen (channels-last, its
convolutions on the implicit GEMM: docs/gemm.md), and PyTorch's own time on
the GPU: eager (cuDNN) in NCHW and in channels_last memory format, and
torch.compile.

    python3 bench/resnet_torch.py --batch 32 --export DIR [--no-compile]
writes DIR/graph.json (cudagen_torch.export; no example files) and prints one
line per PyTorch mode: "torch eager (NCHW)  batch=32  12.345 ms/step", the mean
of a batch of back-to-back steps after warm-up, timed with CUDA events (as
bench_megakernel times cudagen's kernels). bench/gpu_check.sh runs it at batch
1 and 32. The network is torchvision's resnet50 (v1.5: the stride on the 3x3
convolution), written out here so that the device machine needs no
torchvision; BatchNorm statistics are random, so that folding them matters.
"""
import argparse
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "frontends", "torch"))


class Bottleneck(nn.Module):
    def __init__(self, channels, width, stride):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(channels, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, 4 * width, 1, bias=False), nn.BatchNorm2d(4 * width)
        self.relu = nn.ReLU()
        self.downsample = None
        if stride != 1 or channels != 4 * width:
            self.downsample = nn.Sequential(nn.Conv2d(channels, 4 * width, 1, stride, bias=False), nn.BatchNorm2d(4 * width))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        return self.relu(self.bn3(self.conv3(y)) + identity)


class ResNet50(nn.Module):
    def __init__(self, classes=1000):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64)
        self.relu, self.maxpool = nn.ReLU(), nn.MaxPool2d(3, 2, 1)
        layers, channels = [], 64
        for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for i in range(blocks):
                layers.append(Bottleneck(channels, width, stride if i == 0 else 1))
                channels = 4 * width
        self.layers = nn.Sequential(*layers)
        self.avgpool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(2048, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(self.avgpool(self.layers(x)), 1))


def resnet50():
    torch.manual_seed(0)
    model = ResNet50()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
    return model.eval()


def time_ms(fn, x, runs):
    with torch.no_grad():
        for _ in range(5):  # (reduce-overhead records its graph on the third call)
            fn(x)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(runs):
            fn(x)
        end.record()
        end.synchronize()
    return start.elapsed_time(end) / runs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--size", type=int, default=224, help="image height and width")
    ap.add_argument("--export", metavar="DIR", help="write the cudagen graph here first")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile (its compile takes a minute)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # cuDNN's best algorithm for each shape, as anyone timing convolutions sets it (the H200 run of
    # 2026-11-27 ran without it: eager took 9.0 ms at batch 32).
    torch.backends.cudnn.benchmark = True
    model = resnet50().to(device=device, dtype=torch.bfloat16)
    x = torch.randn(args.batch, 3, args.size, args.size, device=device, dtype=torch.bfloat16)
    if args.export:
        import cudagen_torch
        result = cudagen_torch.export(model, (x,), args.export, name=f"resnet50_b{args.batch}", write_example=False)
        print(f"exported {result.graph_path} ({', '.join(result.rewrites)})", file=sys.stderr)
    if device != "cuda":
        sys.exit("no GPU: PyTorch's times need one")
    def report(name, fn, inputs):
        print(f"{name:<28} batch={args.batch}  {time_ms(fn, inputs, args.runs):.3f} ms/step", flush=True)

    report("torch eager (NCHW)", model, x)
    model = model.to(memory_format=torch.channels_last)  # (in place)
    report("torch eager (channels_last)", model, x.to(memory_format=torch.channels_last))
    if not args.no_compile:
        report("torch.compile", torch.compile(model), x.to(memory_format=torch.channels_last))
        # CUDA graphs too: at batch 1 the launches, not the GPU, set eager's and torch.compile's time.
        report("torch.compile reduce-overhead", torch.compile(model, mode="reduce-overhead"),
               x.to(memory_format=torch.channels_last))


if __name__ == "__main__":
    main()
