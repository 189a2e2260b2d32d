#!/usr/bin/env python3
"""Writes one attention (scores = q k^T, softmax with scale 1/sqrt(D), causal or
not, context = probs v) over [B, H, T, D] heads as a cudagen task graph, for
benchmarks: bench/gpu_check.sh times it beside PyTorch's scaled_dot_product_attention
(bench/attention_torch.py) on the same shapes. With --train, its gradients too (a
backward phase, as cudagen's derive pass writes them, from a given dout): dq, dk
and dv, the flash backward kernel's work."""
import argparse
import json
import math

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--heads", type=int, default=12)
parser.add_argument("--tokens", type=int, default=512)
parser.add_argument("--head", type=int, default=64, help="values per head (D)")
parser.add_argument("--queries", type=int, help="query rows a head (default: --tokens; 1 decodes over a cache of --tokens)")
parser.add_argument("--causal", action="store_true")
parser.add_argument("--dtype", choices=["f16", "bf16", "f32"], default="bf16")
parser.add_argument("--train", action="store_true", help="also the gradients of q, k and v (a backward phase)")
parser.add_argument("-o", "--output", required=True)
args = parser.parse_args()

queries = args.queries or args.tokens
shape = [args.batch, args.heads, args.tokens, args.head]
q_shape = [args.batch, args.heads, queries, args.head]
square = [args.batch, args.heads, queries, args.tokens]
dt = args.dtype
graph = {
    "format": "cudagen.taskgraph/1",
    "name": f"attention_b{args.batch}_h{args.heads}_q{queries}_t{args.tokens}_d{args.head}{'_causal' if args.causal else ''}",
    "tasks": [
        {"id": "scores", "op": "matmul", "phase": "forward", "args": {"trans_b": True},
         "tensors": {"a": {"dtype": dt, "shape": q_shape, "storage": "external", "name": "q"},
                     "b": {"dtype": dt, "shape": shape, "storage": "external", "name": "k"},
                     "out": {"dtype": dt, "shape": square}}},
        {"id": "probs", "op": "softmax", "phase": "forward", "args": {"scale": 1 / math.sqrt(args.head), "causal": args.causal},
         "tensors": {"x": {"from": "scores.out"}, "out": {"dtype": dt, "shape": square}}},
        {"id": "context", "op": "matmul", "phase": "forward",
         "tensors": {"a": {"from": "probs.out"},
                     "b": {"dtype": dt, "shape": shape, "storage": "external", "name": "v"},
                     "out": {"dtype": dt, "shape": q_shape, "storage": "external", "name": "out"}}},
    ],
}
if args.train:
    graph["name"] += "_train"
    ext = lambda s, name: {"dtype": dt, "shape": s, "storage": "external", "name": name}
    graph["tasks"] += [
        {"id": "dp", "op": "matmul", "phase": "backward", "args": {"trans_b": True},
         "tensors": {"a": ext(q_shape, "dout"), "b": {"from": "context.b"}, "out": {"dtype": dt, "shape": square}}},
        {"id": "dv", "op": "matmul", "phase": "backward", "args": {"trans_a": True},
         "tensors": {"a": {"from": "probs.out"}, "b": {"from": "dp.a"}, "out": ext(shape, "dv")}},
        {"id": "ds", "op": "softmax_backward", "phase": "backward", "args": {"scale": 1 / math.sqrt(args.head)},
         "tensors": {"out": {"from": "probs.out"}, "dout": {"from": "dp.out"}, "dx": {"dtype": dt, "shape": square}}},
        {"id": "dq", "op": "matmul", "phase": "backward",
         "tensors": {"a": {"from": "ds.dx"}, "b": {"from": "scores.b"}, "out": ext(q_shape, "dq")}},
        {"id": "dk", "op": "matmul", "phase": "backward", "args": {"trans_a": True},
         "tensors": {"a": {"from": "ds.dx"}, "b": {"from": "scores.a"}, "out": ext(shape, "dk")}},
    ]
with open(args.output, "w") as f:
    json.dump(graph, f, indent=1)
