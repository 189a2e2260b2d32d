#!/usr/bin/python3
"""Buffer profiles of real networks, traced with PyTorch, for the planner benchmark.

Writes one CSV per network in MiniMalloc's format (id,lower,upper,size): every
tensor an aten-level graph computes is a buffer, live from the op that writes
it to the last op that reads it (graph outputs to the end). Views (view,
transpose, expand, ...) share their base's buffer and extend its lifetime.
Parameters and inputs are left out: they live in the arena's persistent region.

Needs Debian's python3-torch and python3-torchvision (run with /usr/bin/python3).
    bench/trace_profiles.py OUT_DIR
"""
import math
import operator
import os
import sys

import torch
import torch.nn as nn
import torchvision
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata

VIEW_OPS = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "slice", "select", "squeeze",
            "unsqueeze", "as_strided", "detach", "alias", "reshape", "unbind", "split", "split_with_sizes",
            "chunk", "view_as", "expand_as", "_reshape_alias"}


def op_name(node):
    target = node.target
    name = getattr(target, "__name__", str(target))
    return name.split(".")[0]


def tensor_bytes(meta):
    return math.prod(meta.shape) * torch.empty((), dtype=meta.dtype).element_size()


def profile(graph_module, example_inputs):
    """The buffers of an fx graph of aten ops: (name, first step, last step + 1, bytes)."""
    ShapeProp(graph_module).propagate(*example_inputs)
    nodes = list(graph_module.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    owner = {}     # node (or (node, k) for tuple parts) -> buffer id
    buffers = {}   # id -> [first, last, bytes]
    for i, node in enumerate(nodes):
        if node.op != "call_function":
            continue
        meta = node.meta.get("tensor_meta")
        if node.target is operator.getitem:
            base = node.args[0]
            owner[node] = owner.get((base, node.args[1]), owner.get(base))
            continue
        if op_name(node) in VIEW_OPS:
            base = node.args[0]
            owner[node] = owner.get(base)
            if meta is not None and not isinstance(meta, TensorMetadata):
                for k in range(len(meta)):
                    owner[(node, k)] = owner.get(base)
            continue
        # TensorMetadata is itself a NamedTuple: test for it before treating meta as a list of parts.
        metas = [meta] if isinstance(meta, TensorMetadata) or meta is None else list(meta)
        for k, m in enumerate(metas):
            if not isinstance(m, TensorMetadata):
                continue
            bid = f"{node.name}.{k}" if len(metas) > 1 else node.name
            buffers[bid] = [i, i, tensor_bytes(m)]
            owner[(node, k) if len(metas) > 1 else node] = bid
    end = len(nodes)
    for node in nodes:
        for user in node.users:
            for key in [node] + [(node, k) for k in range(8)]:
                bid = owner.get(key)
                if bid is not None:
                    buffers[bid][1] = max(buffers[bid][1], end if user.op == "output" else index[user])
    return [(bid, b[0], b[1] + 1, b[2]) for bid, b in buffers.items() if b[2] > 0]


def trace(fn, *inputs):
    graph_module = make_fx(fn)(*inputs)
    return profile(graph_module, inputs)


def vision(name, batch):
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)().eval()
    params = dict(model.named_parameters())
    buffers_ = dict(model.named_buffers())

    def forward(x, *weights):
        state = dict(zip(list(params) + list(buffers_), weights))
        return torch.func.functional_call(model, state, (x,)) if hasattr(torch, "func") else \
            torch.nn.utils.stateless.functional_call(model, state, (x,))

    with torch.no_grad():
        return trace(forward, torch.randn(batch, 3, 224, 224), *params.values(), *buffers_.values())


def bert_base(batch=1, seq=128):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(768, 12, 3072, dropout=0.0, activation="gelu", batch_first=True)
    model = nn.TransformerEncoder(layer, 12, enable_nested_tensor=False).train()  # train(): no fused fast path
    params = dict(model.named_parameters())

    def forward(x, *weights):
        return torch.nn.utils.stateless.functional_call(model, dict(zip(params, weights)), (x,))

    with torch.no_grad():
        return trace(forward, torch.randn(batch, seq, 768), *params.values())


class Gpt2Block(nn.Module):
    def __init__(self, d=768, heads=12):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        attn = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        x = x + self.proj((attn @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class Gpt2(nn.Module):
    def __init__(self, vocab=50257, ctx=1024, d=768, layers=12):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Gpt2Block(d) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, ids, targets):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def gpt2_small_train_step(batch=1, seq=128):
    torch.manual_seed(0)
    model = Gpt2()
    params = dict(model.named_parameters())

    def step(ids, targets, *weights):
        weights = [w.requires_grad_() for w in weights]
        loss = torch.nn.utils.stateless.functional_call(model, dict(zip(params, weights)), (ids, targets))
        return (loss, *torch.autograd.grad(loss, weights))

    ids = torch.randint(0, 50257, (batch, seq))
    return trace(step, ids, ids, *[p.detach() for p in params.values()])


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "profiles"
    os.makedirs(out, exist_ok=True)
    networks = [
        ("mobilenet_v2_b1", lambda: vision("mobilenet_v2", 1)),
        ("mobilenet_v2_b32", lambda: vision("mobilenet_v2", 32)),
        ("resnet50_b1", lambda: vision("resnet50", 1)),
        ("resnet50_b32", lambda: vision("resnet50", 32)),
        ("bert_base_encoder_b1_s128", bert_base),
        ("gpt2_small_train_b1_s128", gpt2_small_train_step),
    ]
    for name, make in networks:
        rows = make()
        path = os.path.join(out, name + ".csv")
        with open(path + ".tmp", "w") as f:
            f.write("id,lower,upper,size\n")
            for row in rows:
                f.write("%s,%d,%d,%d\n" % row)
        os.replace(path + ".tmp", path)
        print("%-28s %6d buffers -> %s" % (name, len(rows), path), flush=True)


if __name__ == "__main__":
    main()
