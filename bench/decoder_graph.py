#!/usr/bin/env python3
"""Writes a stack of pre-norm decoder blocks as a cudagen task graph, for benchmarks.

The block is examples/transformer_block.json's (RMSNorm, q/k/v projections, causal
attention by heads, output projection, residual; RMSNorm, up projection, tanh GELU, down
projection, residual) at any size; bench/decoder_torch.py builds the same module in
PyTorch. Weights are initialised by the graph's init phase. GPT-2 small's sizes by default:

    python3 bench/decoder_graph.py --layers 12 --tokens 64 -o /tmp/decoder12.json

With --train, a training step instead: the stack's output regressed on a target (mse), the
backward and AdamW update phases derived by cudagen. A 16-bit --dtype then trains as
torch.autocast does: the graph is written in f32 (weights, inputs, norms) and its "training"
section asks for "precision": the dtype the products compute in (generator/autocast.h).
"""
import argparse
import json
import os
import tempfile


def block(tasks, i, x_from, shape, dim, heads, mlp, dtype, seed, train=False):
    p = f"l{i}_"
    batch, tokens = shape[0], shape[1]
    hd = dim // heads

    def init(name, out_shape, op, **args):
        tasks.append({"id": p + name, "op": op, "phase": "init", "tensors": {"out": {"dtype": dtype, "shape": out_shape}},
                      "args": args})

    def task(name, op, tensors, **args):
        t = {"id": p + name, "op": op, "tensors": tensors}
        if args:
            t["args"] = args
        tasks.append(t)

    def own(s):
        return {"dtype": dtype, "shape": s}

    def ref(name, slot="out"):
        return {"from": f"{p}{name}.{slot}"}

    bound = dim ** -0.5
    init("ln1_w", [dim], "fill", value=1.0)
    for n, name in enumerate(["wq", "wk", "wv", "wo"]):
        init(name, [dim, dim], "uniform", low=-bound, high=bound, seed=seed + n)
    init("ln2_w", [dim], "fill", value=1.0)
    init("w_up", [dim, mlp], "uniform", low=-bound, high=bound, seed=seed + 4)
    init("w_down", [mlp, dim], "uniform", low=-mlp ** -0.5, high=mlp ** -0.5, seed=seed + 5)
    row = [batch, tokens, dim]
    task("ln1", "rmsnorm", norm_slots(x_from, ref("ln1_w"), row, dtype, train), eps=1e-6)
    for n in ["q", "k", "v"]:
        task(n, "matmul", {"a": ref("ln1"), "b": ref("w" + n), "out": own(row)})
        task(n + "_heads", "split_heads", {"x": ref(n), "out": own([batch, heads, tokens, hd])}, heads=heads)
    task("scores", "matmul", {"a": ref("q_heads"), "b": ref("k_heads"), "out": own([batch, heads, tokens, tokens])},
         trans_b=True)
    task("probs", "softmax", {"x": ref("scores"), "out": own([batch, heads, tokens, tokens])}, scale=hd ** -0.5,
         causal=True)
    task("context", "matmul", {"a": ref("probs"), "b": ref("v_heads"), "out": own([batch, heads, tokens, hd])})
    task("merged", "merge_heads", {"x": ref("context"), "out": own(row)}, heads=heads)
    task("attn_out", "matmul", {"a": ref("merged"), "b": ref("wo"), "out": own(row)})
    residual = x_from if "from" in x_from else ref("ln1", "x")  # the first block owns the input
    task("res1", "add", {"a": residual, "b": ref("attn_out"), "out": own(row)})
    task("ln2", "rmsnorm", norm_slots(ref("res1"), ref("ln2_w"), row, dtype, train), eps=1e-6)
    task("up", "matmul", {"a": ref("ln2"), "b": ref("w_up"), "out": own([batch, tokens, mlp])})
    task("act", "gelu", {"x": ref("up"), "out": own([batch, tokens, mlp])}, approximate="tanh")
    task("down", "matmul", {"a": ref("act"), "b": ref("w_down"), "out": own(row)})
    task("res2", "add", {"a": ref("res1"), "b": ref("down"), "out": own(row)})
    return {"from": f"{p}res2.out"}


def norm_slots(x, weight, row, dtype, train):
    """An rmsnorm's tensors; training saves each row's rstd for the backward pass."""
    tensors = {"x": x, "weight": weight, "out": {"dtype": dtype, "shape": row}}
    if train:
        tensors["rstd"] = {"dtype": "f32", "shape": row[:-1]}
    return tensors


def add_model_arguments(ap):
    """The decoder stack's sizes (bench/decoder_torch.py takes the same)."""
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--mlp", type=int, default=3072)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(ap)
    ap.add_argument("--dtype", default="f32", choices=["f32", "f16", "bf16"])
    ap.add_argument("--train", action="store_true", help="a training step: mse against a target, AdamW")
    ap.add_argument("--clip-grad-norm", type=float, help="with --train: clip the gradients to this global norm")
    ap.add_argument("--accumulate-gradients", action="store_true",
                    help="with --train: sum the gradients over micro-batches (cudagen run --micro-batches K)")
    ap.add_argument("-o", "--output", required=True)
    a = ap.parse_args()
    if (a.clip_grad_norm is not None or a.accumulate_gradients) and not a.train:
        ap.error("--clip-grad-norm and --accumulate-gradients shape a training step: give --train too")
    if a.dim % a.heads:
        ap.error(f"--dim {a.dim} is not a multiple of --heads {a.heads}")
    # Training in 16 bits keeps f32 master weights: the graph is f32 and the policy converts.
    precision = a.dtype if a.train and a.dtype != "f32" else None
    if precision:
        a.dtype = "f32"
    tasks = []
    x = {"dtype": a.dtype, "shape": [a.batch, a.tokens, a.dim], "storage": "external"}
    for i in range(a.layers):
        x = block(tasks, i, x, [a.batch, a.tokens], a.dim, a.heads, a.mlp, a.dtype, 10 * i + 1, a.train)
    graph = {"format": "cudagen.taskgraph/1", "name": f"decoder{a.layers}", "tasks": tasks}
    if a.train:
        graph["name"] = f"train_decoder{a.layers}"
        tasks.append({"id": "loss", "op": "mse", "tensors": {
            "pred": x, "target": {"dtype": a.dtype, "shape": [a.batch, a.tokens, a.dim], "storage": "external"},
            "loss": {"dtype": "f32", "shape": [], "storage": "external"}}})
        graph["training"] = {"loss": "loss.loss", "optimizer": "adamw", "args": {"lr": 0.001}}
        if precision:
            graph["training"]["precision"] = precision
        if a.clip_grad_norm is not None:
            graph["training"]["clip_grad_norm"] = a.clip_grad_norm
        if a.accumulate_gradients:
            graph["training"]["accumulate_gradients"] = True
    else:
        tasks[-1]["tensors"]["out"]["storage"] = "external"  # the last residual is the output
    folder = os.path.dirname(os.path.abspath(a.output))
    with tempfile.NamedTemporaryFile("w", dir=folder, delete=False, suffix=".tmp") as f:
        json.dump(graph, f, indent=1)
    os.replace(f.name, a.output)


if __name__ == "__main__":
    main()
