#!/usr/bin/env python3
"""Writes one attention (scores = q k^T, softmax with scale 1/sqrt(D), causal or
not, context = probs v) over [B, H, T, D] heads as a cudagen task graph, for
benchmarks: bench/gpu_check.sh times it beside PyTorch's scaled_dot_product_attention
(bench/attention_torch.py) on the same shapes. With --train, its gradients too (a
backward phase, as cudagen's derive pass writes them, from a given dout): dq, dk
and dv, the flash backward kernel's work. With --kv-heads, grouped-query attention:
q as [B, Hkv, G, T, D] over k and v as [B, Hkv, 1, T, D] (H = G Hkv), and trained,
dk and dv per query head summed over each group after the kernel, as the derive
pass writes them."""
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
parser.add_argument("--kv-heads", type=int, help="heads of keys and values, each shared by heads / kv-heads query heads "
                    "(grouped-query attention; default: --heads)")
parser.add_argument("-o", "--output", required=True)
args = parser.parse_args()

queries = args.queries or args.tokens
kv_heads = args.kv_heads or args.heads
if args.heads % kv_heads:
    parser.error(f"--kv-heads {kv_heads} does not divide --heads {args.heads}")
groups = args.heads // kv_heads
# Heads as leading axes: [B, H] or, grouped, [B, Hkv, G] for q and [B, Hkv, 1] for k and v.
lead_q = [args.batch, args.heads] if groups == 1 else [args.batch, kv_heads, groups]
lead_kv = [args.batch, args.heads] if groups == 1 else [args.batch, kv_heads, 1]
shape = lead_kv + [args.tokens, args.head]
q_shape = lead_q + [queries, args.head]
square = lead_q + [queries, args.tokens]
dt = args.dtype
graph = {
    "format": "cudagen.taskgraph/1",
    "name": f"attention_b{args.batch}_h{args.heads}{f'_kv{kv_heads}' if groups > 1 else ''}_q{queries}_t{args.tokens}"
            f"_d{args.head}{'_causal' if args.causal else ''}",
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
    per_query_head = lead_q + [args.tokens, args.head]  # dk and dv before a group's sum

    def summed(name):
        """Grouped: the gradient per query head, [B, Hkv, G, T, D], summed over
        G as the derive pass does (G to the front, rows, sum_leading, back)."""
        if groups == 1:
            return [], ext(shape, name)
        front = [groups, args.batch, kv_heads, args.tokens, args.head]
        cols = args.batch * kv_heads * args.tokens * args.head
        return [
            {"id": f"{name}_front", "op": "permute", "phase": "backward", "args": {"dims": [2, 0, 1, 3, 4]},
             "tensors": {"x": {"from": f"{name}.out"}, "out": {"dtype": dt, "shape": front}}},
            {"id": f"{name}_rows", "op": "reshape", "phase": "backward",
             "tensors": {"x": {"from": f"{name}_front.out"}, "out": {"dtype": dt, "shape": [groups, cols]}}},
            {"id": f"{name}_sum", "op": "sum_leading", "phase": "backward",
             "tensors": {"x": {"from": f"{name}_rows.out"}, "out": {"dtype": dt, "shape": [cols]}}},
            {"id": f"{name}_shape", "op": "reshape", "phase": "backward",
             "tensors": {"x": {"from": f"{name}_sum.out"}, "out": ext(shape, name)}},
        ], {"dtype": dt, "shape": per_query_head}

    dv_sum, dv_out = summed("dv")
    dk_sum, dk_out = summed("dk")
    graph["tasks"] += [
        {"id": "dp", "op": "matmul", "phase": "backward", "args": {"trans_b": True},
         "tensors": {"a": ext(q_shape, "dout"), "b": {"from": "context.b"}, "out": {"dtype": dt, "shape": square}}},
        {"id": "dv", "op": "matmul", "phase": "backward", "args": {"trans_a": True},
         "tensors": {"a": {"from": "probs.out"}, "b": {"from": "dp.a"}, "out": dv_out}},
        {"id": "ds", "op": "softmax_backward", "phase": "backward", "args": {"scale": 1 / math.sqrt(args.head)},
         "tensors": {"out": {"from": "probs.out"}, "dout": {"from": "dp.out"}, "dx": {"dtype": dt, "shape": square}}},
        {"id": "dq", "op": "matmul", "phase": "backward",
         "tensors": {"a": {"from": "ds.dx"}, "b": {"from": "scores.b"}, "out": ext(q_shape, "dq")}},
        {"id": "dk", "op": "matmul", "phase": "backward", "args": {"trans_a": True},
         "tensors": {"a": {"from": "ds.dx"}, "b": {"from": "scores.a"}, "out": dk_out}},
    ] + dv_sum + dk_sum
with open(args.output, "w") as f:
    json.dump(graph, f, indent=1)
