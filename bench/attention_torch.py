#!/usr/bin/env python3
"""Times PyTorch's scaled_dot_product_attention on the flash backend over
[B, H, T, D] heads (the shapes of bench/attention_graph.py), forward: median of
CUDA-event-timed runs after a warm-up, on random inputs; with --train, the
forward and the backward pass (dq, dk, dv from a given dout). bench/gpu_check.sh
prints it beside cudagen's flash kernels on the same shapes."""
import argparse
import statistics

import torch
import torch.nn.functional as F

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--heads", type=int, default=12)
parser.add_argument("--tokens", type=int, nargs="+", default=[512])
parser.add_argument("--head", type=int, default=64)
parser.add_argument("--dtype", choices=["f16", "bf16", "f32"], default="bf16",
                    help="f32: TF32 allowed (torch.backends.cuda.matmul.allow_tf32), on SDPA's efficient backend "
                    "(its flash backend takes 16-bit types only)")
parser.add_argument("--runs", type=int, default=20)
parser.add_argument("--decode", type=int, nargs="*", default=[],
                    help="also one query row a head over a cache of this many keys (not causal)")
parser.add_argument("--train", action="store_true", help="time the forward and the backward pass")
parser.add_argument("--no-tf32", action="store_true",
                    help="f32 with torch.backends.cuda.matmul.allow_tf32 off, beside cudagen's f32 without --allow-tf32")
parser.add_argument("--kv-heads", type=int, help="heads of keys and values (grouped-query attention: SDPA's "
                    "enable_gqa, PyTorch 2.5 and later; default: --heads)")
args = parser.parse_args()

dtype = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[args.dtype]
f32 = dtype == torch.float32
torch.backends.cuda.matmul.allow_tf32 = f32 and not args.no_tf32
try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = lambda: sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION if f32 else SDPBackend.FLASH_ATTENTION])
except ImportError:  # PyTorch before 2.3
    backend = lambda: torch.backends.cuda.sdp_kernel(enable_flash=not f32, enable_math=False, enable_mem_efficient=f32)

cases = [(tokens, tokens, causal) for tokens in args.tokens for causal in (False, True)]
cases += [(1, tokens, False) for tokens in args.decode]
kv_heads = args.kv_heads or args.heads
gqa = {"enable_gqa": True} if kv_heads != args.heads else {}
for queries, tokens, causal in cases:
    shape = (args.batch, kv_heads, tokens, args.head)
    k, v = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(2))
    q = torch.randn((args.batch, args.heads, queries, args.head), device="cuda", dtype=dtype)
    if args.train:
        for x in (q, k, v):
            x.requires_grad_(True)
        dout = torch.randn(q.shape, device="cuda", dtype=dtype)

    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa)
        if args.train:
            torch.autograd.grad(out, (q, k, v), dout)

    with backend():
        for _ in range(3):
            step()
        times = []
        for _ in range(args.runs):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
    ms = statistics.median(times)
    # The FLOPs cudagen's emitter counts: both products and the softmax, the masked half included.
    flops = args.batch * args.heads * queries * tokens * (4 * args.head + 5)
    if args.train:  # and the backward pass's four products in cudagen's graph (dp, dv, dq, dk)
        flops += args.batch * args.heads * queries * tokens * 8 * args.head
    print(f"torch sdpa ({('efficient, f32' + (', TF32 off' if args.no_tf32 else '')) if f32 else 'flash'}{', fwd+bwd' if args.train else ''})  b{args.batch} h{args.heads}"
          f"{f' kv{kv_heads}' if gqa else ''} q{queries} t{tokens} d{args.head}{' causal' if causal else ''}"
          f"  {ms:.4f} ms  {flops / ms / 1e9:.1f} TFLOP/s (cudagen's count)")
