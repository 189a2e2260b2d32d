#!/usr/bin/env python3
"""PyTorch's time for bench/decoder_graph.py's decoder stack: eager, and
torch.compile(mode="reduce-overhead") (CUDA Graphs), forward only, on the GPU.

    python3 bench/decoder_torch.py --layers 1 --tokens 64
prints one line per mode: "torch eager  layers=1 tokens=64  0.381 ms/step", the mean of a
batch of back-to-back steps after warm-up, timed with CUDA events (as bench_megakernel does).

With --train, decoder_graph.py --train's step instead: forward, mse against a target,
backward and AdamW (lr 1e-3), the model in f32; --dtype bf16 then runs the forward and
backward under torch.autocast(dtype=torch.bfloat16), as the graph's precision policy does,
eager and torch.compile (default mode: the optimizer step stays eager).
"""
import argparse
import contextlib
import sys

import torch
import torch.nn.functional as F

from decoder_graph import add_model_arguments  # the same sizes as the cudagen graph


class Block(torch.nn.Module):
    def __init__(self, dim, heads, mlp):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.Parameter(torch.ones(dim))
        self.wq, self.wk, self.wv, self.wo = (torch.nn.Parameter(torch.empty(dim, dim).uniform_(-dim ** -0.5, dim ** -0.5))
                                              for _ in range(4))
        self.ln2 = torch.nn.Parameter(torch.ones(dim))
        self.w_up = torch.nn.Parameter(torch.empty(dim, mlp).uniform_(-dim ** -0.5, dim ** -0.5))
        self.w_down = torch.nn.Parameter(torch.empty(mlp, dim).uniform_(-mlp ** -0.5, mlp ** -0.5))

    @staticmethod
    def rmsnorm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def forward(self, x):
        b, t, c = x.shape
        h = self.rmsnorm(x, self.ln1)
        q, k, v = ((h @ w).view(b, t, self.heads, c // self.heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        scores = (q @ k.transpose(-1, -2)) * (c // self.heads) ** -0.5
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        x = x + ((probs @ v).transpose(1, 2).reshape(b, t, c) @ self.wo)
        h = self.rmsnorm(x, self.ln2)
        return x + F.gelu(h @ self.w_up, approximate="tanh") @ self.w_down


def time_ms(fn, x, runs):
    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(runs):
        fn(x)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / runs


def train_step(model, optimizer, x, target, dtype):
    """One training step as decoder_graph.py --train writes it; 16-bit under autocast."""
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext():
        loss = F.mse_loss(model(x), target)
    loss.backward()
    optimizer.step()
    return loss


def time_training(a, dtype):
    model = torch.nn.Sequential(*[Block(a.dim, a.heads, a.mlp) for _ in range(a.layers)]).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    x = torch.randn(a.batch, a.tokens, a.dim, device="cuda")
    target = torch.randn_like(x)
    eager = time_ms(lambda inputs: train_step(model, optimizer, *inputs, dtype), (x, target), a.runs)
    compiled_model = torch.compile(model)
    compiled = time_ms(lambda inputs: train_step(compiled_model, optimizer, *inputs, dtype), (x, target), a.runs)
    return eager, compiled


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(ap)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--dtype", choices=["f32", "f16", "bf16"], default="f32",
                    help="weights and activations, as decoder_graph.py's --dtype (with --train: autocast's dtype)")
    ap.add_argument("--train", action="store_true", help="time a training step (decoder_graph.py --train)")
    a = ap.parse_args()
    dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[a.dtype]
    if not torch.cuda.is_available():
        sys.exit("decoder_torch.py: no CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False  # f32 as cudagen computes it (docs/architecture.md §9)
    if a.train:
        eager, compiled = time_training(a, dtype)
        for mode, ms in (("torch eager train", eager), ("torch.compile train", compiled)):
            print(f"{mode:<30} layers={a.layers} batch={a.batch} tokens={a.tokens} {a.dtype}  {ms:.4f} ms/step")
        return
    model = torch.nn.Sequential(*[Block(a.dim, a.heads, a.mlp) for _ in range(a.layers)]).cuda().eval().to(dtype)
    x = torch.randn(a.batch, a.tokens, a.dim, device="cuda", dtype=dtype)
    with torch.no_grad():
        eager = time_ms(model, x, a.runs)
        compiled = torch.compile(model, mode="reduce-overhead")
        graphs = time_ms(compiled, x, a.runs)
    for mode, ms in (("torch eager", eager), ("torch.compile reduce-overhead", graphs)):
        print(f"{mode:<30} layers={a.layers} batch={a.batch} tokens={a.tokens} {a.dtype}  {ms:.4f} ms/step")


if __name__ == "__main__":
    main()
