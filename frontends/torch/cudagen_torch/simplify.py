"""Rewrites of the exported task list, so that cudagen's fusion rules see
the patterns they know in a model written the PyTorch way.

GPT-2's attention, as PyTorch users write it, is a fused qkv projection
split in three, `.view(B, T, H, D).transpose(1, 2)` per head, `q @
k.transpose(-2, -1) * scale`, and `.transpose(1, 2).contiguous().view(B, T, C)`
after: mapped op for op, copies (split, permute, transpose) and an extra
elementwise pass that no fusion rule takes, and the attention rule, which
wants `alpha * q k^T`, does not see its pattern. Each rewrite below computes
the same values (up to the rounding of one multiplication):

- `transpose_into_matmul`: a matmul operand that is a transpose of the last
  two axes reads the transpose's input with `trans_a`/`trans_b` toggled;
- `scale_into_matmul`: a multiplication by a number (affine, no shift) of a
  matmul's result, its only reader, is the matmul's `alpha`;
- `heads`: `reshape [..., T, H*D] -> [..., T, H, D]` then a permute swapping
  T and H is `split_heads`; the permute back then a reshape to `[..., T, H*D]`
  is `merge_heads`;
- `split_linear` (inference exports only: training keeps each parameter
  whole, under its module's name): a linear layer whose output is only split
  along its last axis (c_attn into q, k, v) becomes one linear layer per part,
  each with its rows of the weight and of the bias (`attn.c_attn.weight.rows0-48`);
- `grouped_query`: attention `softmax(q k^T) v` whose keys and values are
  heads repeated G times each (LLaMA's `repeat_kv`, `x[:, :, None].expand(B,
  Hkv, G, T, D).reshape(B, H, T, D)`, or `repeat_interleave(G, dim=1)`:
  exported as copies) reads the heads themselves: q seen as `[..., Hkv, G,
  T, D]` over k and v seen as `[..., Hkv, 1, T, D]`, grouped-query attention,
  which the attention kernels take without the copies (the output seen back
  as `[..., H, T, D]`);
- `channels_last` (inference exports only: `conv2d_nhwc` has no gradient
  yet): a 16-bit `conv2d` whose input channels a group are whole 16-byte
  chunks (8), or of one group and fewer (a network's first layer, its
  channels then zero-padded to 8, its weight's too), or a depthwise one of
  whole chunks of channels, becomes a permute to NHWC, `conv2d_nhwc` (its weight's
  array permuted to `[O, KH, KW, C]`, `<name>.nhwc`), its bias as an `add`
  (which fuses into the convolution's epilogue) and a permute back to NCHW:
  the convolution runs on tensor cores (docs/gemm.md);
- `sink_permute`: an elementwise op reading a permute's output, which it
  alone reads, runs before the permute instead (`relu(p(y))` is
  `p(relu(y))`), where each of its other operands is that permute's output
  too or already permuted back by a permute of its own (a residual `add`),
  so that permutes meet;
- `dedupe_permutes`: two permutes of one tensor by the same dims are one;
- `pool_channels_last`: max, average and adaptive average pooling of a permute back to
  NCHW pool channels-last (`max_pool2d_nhwc`, `avg_pool2d_nhwc`, `adaptive_avg_pool2d_nhwc`)
  before the permute instead;
- `cancel_permutes`: a permute of a permute that together leave every axis in
  place is the first one's input: between two channels-last convolutions (and
  the elementwise ops and pools between them) no permute is left;
- `permute_as_reshape`: a permute that moves only axes of size 1 (the pooled
  `[B, 1, 1, C]` of a classifier's head) is a reshape, a view: a ResNet keeps
  one permute, of its input;
- `remove_dead`: a task none of whose outputs is read (what the rewrites
  above leave behind).

Tasks are the exporter's JSON objects: a slot is either `{"from": "task.slot"}`
or owns its tensor (dtype, shape; an input also its storage).
"""

import numpy as np


class _Graph:
    def __init__(self, tasks, outputs, arrays):
        self.tasks = tasks
        self.outputs = set(outputs)  # names of the graph's output tensors
        self.arrays = arrays  # tensor name -> the array its .npy holds

    # ---- reading the list --------------------------------------------
    def by_id(self, tid):
        return next(t for t in self.tasks if t["id"] == tid)

    def readers(self, ref):
        """(task, slot) of every slot that reads `ref` ("task.slot")."""
        return [(t, s) for t in self.tasks for s, v in t["tensors"].items() if v.get("from") == ref]

    def is_output(self, slot):
        return "from" not in slot and ("storage" not in slot or slot.get("name") in self.outputs)

    def producer(self, slot):
        """The task and slot name a `from` slot reads, or (None, None)."""
        if "from" not in slot:
            return None, None
        tid, _, name = slot["from"].rpartition(".")
        return self.by_id(tid), name

    def only_reader(self, task, slot, op=None):
        """The one task reading task.slot (of op `op`), else None; never for
        a graph output."""
        if task["tensors"][slot].get("name") in self.outputs:
            return None
        readers = self.readers(f"{task['id']}.{slot}")
        if len(readers) != 1 or (op is not None and readers[0][0]["op"] != op):
            return None
        return readers[0][0]

    def repoint(self, old_ref, new_ref):
        for t, s in self.readers(old_ref):
            t["tensors"][s] = {"from": new_ref}

    # ---- rewrites ------------------------------------------------------
    def transpose_into_matmul(self):
        changed = False
        for t in self.tasks:
            if t["op"] != "matmul":
                continue
            for slot, flag in (("a", "trans_a"), ("b", "trans_b")):
                source, _ = self.producer(t["tensors"][slot])
                if source is None or source["op"] != "transpose" or "from" not in source["tensors"]["x"]:
                    continue
                t["tensors"][slot] = {"from": source["tensors"]["x"]["from"]}
                args = t.setdefault("args", {})
                args[flag] = not args.get(flag, False)
                changed = True
        return changed

    def scale_into_matmul(self):
        changed = False
        for t in self.tasks:
            if t["op"] != "matmul":
                continue
            scale = self.only_reader(t, "out", "affine")
            if scale is None or scale["args"].get("shift", 0.0) != 0.0 or scale["tensors"]["out"].get("storage"):
                continue
            args = t.setdefault("args", {})
            args["alpha"] = float(args.get("alpha", 1.0)) * float(scale["args"]["scale"])
            self.repoint(f"{scale['id']}.out", f"{t['id']}.out")
            self.tasks.remove(scale)
            changed = True
        return changed

    def heads(self):
        changed = False
        for t in self.tasks:
            if t["op"] != "permute" or "from" not in t["tensors"]["x"]:
                continue
            rank = len(t["tensors"]["out"]["shape"])
            swap = list(range(rank - 3)) + [rank - 2, rank - 3, rank - 1]
            if rank < 3 or t["args"].get("dims") != swap:
                continue
            source, _ = self.producer(t["tensors"]["x"])
            if source is not None and source["op"] == "reshape" and "from" in source["tensors"]["x"]:
                # [..., T, H*D] -> [..., T, H, D] -> [..., H, T, D]: split_heads.
                view = source["tensors"]["out"]["shape"]
                if self.shape_of(source["tensors"]["x"]) == view[:-2] + [view[-2] * view[-1]]:
                    t["op"] = "split_heads"
                    t["tensors"]["x"] = {"from": source["tensors"]["x"]["from"]}
                    t["args"] = {"heads": view[-2]}
                    changed = True
                    continue
            # [..., H, T, D] -> [..., T, H, D] -> [..., T, H*D]: merge_heads.
            reshape = self.only_reader(t, "out", "reshape")
            shape = t["tensors"]["out"]["shape"]
            if reshape is not None and reshape["tensors"]["out"]["shape"] == shape[:-2] + [shape[-2] * shape[-1]]:
                t["op"] = "merge_heads"
                t["tensors"]["out"] = dict(reshape["tensors"]["out"])
                t["args"] = {"heads": self.shape_of(t["tensors"]["x"])[-3]}
                self.repoint(f"{reshape['id']}.out", f"{t['id']}.out")
                self.tasks.remove(reshape)
                changed = True
        return changed

    def repeated_heads(self, slot):
        """(ref, G) where `slot` reads a tensor [..., H, T, D] whose heads are
        those of `ref` repeated G times each, in a row (head h is ref's head
        h // G); None otherwise. As the exporter writes such a repeat
        (repeat_interleave, expand: _join of copies): reshapes around a
        left-deep chain of concats of one value seen as [rows, T * D]."""
        shape = self.shape_of(slot)
        task, name = self.producer(slot)
        while task is not None and task["op"] == "reshape":
            task, name = self.producer(task["tensors"]["x"])
        if task is None or task["op"] != "concat" or len(shape) < 3:
            return None
        copies = []
        while True:
            copies.append(task["tensors"]["b"].get("from"))
            inner, name = self.producer(task["tensors"]["a"])
            if inner is None or inner["op"] != "concat" or name != "out":
                copies.append(task["tensors"]["a"].get("from"))
                break
            task = inner
        ref, groups = copies[0], len(copies)
        if ref is None or any(c is None or self.root(c) != self.root(ref) for c in copies):
            return None
        source = self.shape_of({"from": ref})
        if len(source) != 2:
            return None
        rows, cols = source
        if cols != shape[-2] * shape[-1] or shape[-3] % groups or rows * groups != int(np.prod(shape[:-2])):
            return None
        return ref, groups

    def grouped_query(self):
        for s in self.tasks:
            args = s.get("args", {})
            if s["op"] != "matmul" or not args.get("trans_b") or args.get("trans_a"):
                continue
            keys = self.repeated_heads(s["tensors"]["b"])
            probs = self.only_reader(s, "out", "softmax")
            if keys is None or probs is None:
                continue
            context = self.only_reader(probs, "out", "matmul")
            if (context is None or context["tensors"]["a"].get("from") != f"{probs['id']}.out"
                    or context.get("args", {}).get("trans_a") or context.get("args", {}).get("trans_b")):
                continue
            values = self.repeated_heads(context["tensors"]["b"])
            q_shape, k_shape = self.shape_of(s["tensors"]["a"]), self.shape_of(s["tensors"]["b"])
            v_shape = self.shape_of(context["tensors"]["b"])
            if values is None or values[1] != keys[1] or not q_shape[:-2] == k_shape[:-2] == v_shape[:-2]:
                continue
            self.group_heads(s, probs, context, keys, values)
            return True
        return False

    def group_heads(self, scores, probs, context, keys, values):
        """Rewrites the attention (scores, probs, context) over repeated heads
        into grouped-query attention over the heads themselves."""
        groups = keys[1]
        q_shape = self.shape_of(scores["tensors"]["a"])
        lead, heads = q_shape[:-3], q_shape[-3]

        def grouped(shape, g):  # [..., H, T, X] -> [..., H / G, g, T, X]
            return lead + [heads // groups, g] + shape[-2:]

        def view(ref_or_slot, shape, base):
            slot = ref_or_slot if isinstance(ref_or_slot, dict) else {"from": ref_or_slot}
            t = {"id": self.fresh_id(base), "op": "reshape", "phase": scores["phase"],
                 "tensors": {"x": slot, "out": {"dtype": self.dtype_of(slot), "shape": shape}}}
            self.tasks.insert(self.tasks.index(scores), t)
            return {"from": f"{t['id']}.out"}

        k_shape, v_shape = self.shape_of(scores["tensors"]["b"]), self.shape_of(context["tensors"]["b"])
        scores["tensors"]["a"] = view(scores["tensors"]["a"], grouped(q_shape, groups), f"{scores['id']}_q_grouped")
        scores["tensors"]["b"] = view(keys[0], grouped(k_shape, 1), f"{scores['id']}_k_heads")
        context["tensors"]["b"] = view(values[0], grouped(v_shape, 1), f"{context['id']}_v_heads")
        for t, slot in ((scores, "out"), (probs, "out")):
            t["tensors"][slot]["shape"] = grouped(t["tensors"][slot]["shape"], groups)
        # The context, grouped, then seen as before by its readers (or as the graph's output).
        original = context["tensors"]["out"]
        readers = self.readers(f"{context['id']}.out")
        context["tensors"]["out"] = {"dtype": original["dtype"], "shape": grouped(original["shape"], groups)}
        back = {"id": self.fresh_id(f"{context['id']}_heads"), "op": "reshape", "phase": context["phase"],
                "tensors": {"x": {"from": f"{context['id']}.out"}, "out": original}}
        for t, slot in readers:
            t["tensors"][slot] = {"from": f"{back['id']}.out"}
        self.tasks.insert(self.tasks.index(context) + 1, back)

    def root(self, ref):
        """The ref a chain of reshapes (views) starts from: `ref` itself where
        no reshape writes it."""
        task, _ = self.producer({"from": ref})
        while task is not None and task["op"] == "reshape" and "from" in task["tensors"]["x"]:
            ref = task["tensors"]["x"]["from"]
            task, _ = self.producer({"from": ref})
        return ref

    def owning_slot(self, slot):
        """The slot that owns the tensor `slot` reads (itself where it owns one)."""
        while "from" in slot:
            task, name = self.producer(slot)
            slot = task["tensors"][name]
        return slot

    def dtype_of(self, slot):
        return self.owning_slot(slot)["dtype"]

    def shape_of(self, slot):
        return self.owning_slot(slot)["shape"]

    def split_linear(self):
        for t in self.tasks:
            if t["op"] == "split" and self.split_one_linear(t):
                return True
        return False

    def split_one_linear(self, split):
        """The linear layer before `split` (a matmul by a transposed weight,
        then perhaps a bias add), as one layer per part."""
        value_task, value_slot = self.producer(split["tensors"]["x"])
        if value_task is None or self.only_reader(value_task, value_slot) is not split:
            return False
        matmul, bias = value_task, None
        if value_task["op"] == "add":
            bias = value_task
            matmul, _ = self.producer(bias["tensors"]["a"])
            if matmul is None or matmul["op"] != "matmul" or self.only_reader(matmul, "out") is not bias:
                return False
            b = bias["tensors"]["b"]
            if "data" not in b or len(b["shape"]) != 1 or self.readers(f"{bias['id']}.b"):
                return False
        if matmul["op"] != "matmul" or not matmul.get("args", {}).get("trans_b") or matmul["args"].get("trans_a"):
            return False
        weight = matmul["tensors"]["b"]
        if "data" not in weight or len(weight["shape"]) != 2 or self.readers(f"{matmul['id']}.b"):
            return False
        if "from" not in matmul["tensors"]["a"]:
            return False  # the layer owns its input (a graph input): keep it whole
        splits = []
        parts = self.split_parts(split, 0, splits)
        if parts is None:
            return False

        at = self.tasks.index(matmul)
        new = []
        for i, (start, end, ref) in enumerate(parts):
            rows = f"rows{start}-{end}"
            w = self.slice_constant(weight, start, end, rows)
            mm = {"id": self.fresh_id(f"{matmul['id']}_{rows}"), "op": "matmul", "phase": matmul["phase"],
                  "tensors": {"a": dict(matmul["tensors"]["a"]), "b": w,
                              "out": {"dtype": matmul["tensors"]["out"]["dtype"],
                                      "shape": matmul["tensors"]["out"]["shape"][:-1] + [end - start]}},
                  "args": dict(matmul["args"])}
            new.append(mm)
            result = f"{mm['id']}.out"
            if bias is not None:
                add = {"id": self.fresh_id(f"{bias['id']}_{rows}"), "op": "add", "phase": bias["phase"],
                       "tensors": {"a": {"from": result}, "b": self.slice_constant(bias["tensors"]["b"], start, end, rows),
                                   "out": dict(mm["tensors"]["out"])}}
                new.append(add)
                result = f"{add['id']}.out"
            self.repoint(ref, result)
        dead = [matmul] + ([bias] if bias else []) + splits
        for name in {weight["name"], bias["tensors"]["b"]["name"] if bias else None} - {None}:
            self.arrays.pop(name, None)
        self.tasks[at:at] = new
        for t in dead:
            self.tasks.remove(t)
        return True

    def split_parts(self, split, start, splits):
        """[(start, end, ref)] of the leaves of the tree of splits along the
        last axis that `split` starts, each split task added to `splits`; None
        when a part is a graph output."""
        splits.append(split)
        parts = []
        for slot in ("a", "b"):
            value = split["tensors"][slot]
            if value.get("name") in self.outputs:
                return None
            size = value["shape"][-1]
            inner = self.only_reader(split, slot, "split")
            if inner is not None:
                more = self.split_parts(inner, start, splits)
                if more is None:
                    return None
                parts += more
            else:
                parts.append((start, start + size, f"{split['id']}.{slot}"))
            start += size
        return parts

    def slice_constant(self, slot, start, end, rows):
        name = f"{slot['name']}.{rows}"
        self.arrays[name] = np.ascontiguousarray(self.arrays[slot["name"]][start:end])
        return {"dtype": slot["dtype"], "shape": [end - start] + slot["shape"][1:], "storage": slot["storage"],
                "name": name, "data": name + ".npy"}

    def fresh_id(self, base):
        taken = {t["id"] for t in self.tasks}
        base = base.replace("-", "_")
        tid, n = base, 2
        while tid in taken:
            tid, n = f"{base}_{n}", n + 1
        return tid

    # ---- channels-last convolutions ----------------------------------
    _TO_NHWC, _TO_NCHW = [0, 2, 3, 1], [0, 3, 1, 2]
    # Ops whose result's element i depends on their operands' element i alone
    # (as the registry's elementwise ops, and the broadcast ones on operands
    # of one shape): layout-free.
    _ELEMENTWISE = {"relu": ["x"], "relu6": ["x"], "hardswish": ["x"], "hardsigmoid": ["x"], "silu": ["x"],
                    "sigmoid": ["x"], "gelu": ["x"], "tanh": ["x"], "neg": ["x"], "exp": ["x"], "affine": ["x"],
                    "cast": ["x"], "add": ["a", "b"], "sub": ["a", "b"], "mul": ["a", "b"], "div": ["a", "b"],
                    "maximum": ["a", "b"]}

    def channels_last(self):
        for t in self.tasks:
            if t["op"] == "conv2d" and self.one_conv_channels_last(t):
                return True
        return False

    def one_conv_channels_last(self, conv):
        x, w, out = conv["tensors"]["x"], conv["tensors"]["weight"], conv["tensors"]["out"]
        bias = conv["tensors"].get("bias")
        groups = conv.get("args", {}).get("groups", 1)
        if out["dtype"] not in ("f16", "bf16"):
            return False
        if any(s is not None and ("data" not in s or s["name"] not in self.arrays) for s in (w, bias)):
            return False  # weights computed by another task: keep NCHW
        if sum(v.get("name") == w["name"] for t in self.tasks for v in t["tensors"].values()) > 1:
            return False  # one weight array shared by several slots: keep NCHW
        B, C, H, W = self.shape_of(x)
        _, O, OH, OW = out["shape"]
        # 16-byte chunks of channels a group: a network's first layer (3
        # channels) is zero-padded to 8, the rest must have whole chunks, but
        # for depthwise convolutions, whose kernel takes whole chunks of
        # channels across the groups.
        channels = 8 if C < 8 and groups == 1 else C
        depthwise = groups == C == O and C % 8 == 0
        if (channels // groups) % 8 != 0 and not depthwise:
            return False
        cid, phase, dtype = conv["id"], conv["phase"], out["dtype"]
        to_nhwc = {"id": self.fresh_id(cid + "_to_nhwc"), "op": "permute", "phase": phase,
                   "tensors": {"x": dict(x), "out": {"dtype": dtype, "shape": [B, H, W, C]}},
                   "args": {"dims": self._TO_NHWC}}
        new_before = [to_nhwc]
        if channels != C:  # (slice_backward places its input among zeros: a pad)
            pad = {"id": self.fresh_id(cid + "_pad_channels"), "op": "slice_backward", "phase": phase,
                   "tensors": {"dout": {"from": f"{to_nhwc['id']}.out"},
                               "dx": {"dtype": dtype, "shape": [B, H, W, channels]}},
                   "args": {"axis": 3, "start": 0, "step": 1}}
            new_before.append(pad)
        result = f"{cid}.out"
        new_after = []
        if bias is not None:
            add = {"id": self.fresh_id(cid + "_bias"), "op": "add", "phase": phase,
                   "tensors": {"a": {"from": result}, "b": dict(bias), "out": {"dtype": dtype, "shape": [B, OH, OW, O]}}}
            new_after.append(add)
            result = f"{add['id']}.out"
        to_nchw = {"id": self.fresh_id(cid + "_to_nchw"), "op": "permute", "phase": phase,
                   "tensors": {"x": {"from": result}, "out": dict(out)}, "args": {"dims": self._TO_NCHW}}
        new_after.append(to_nchw)
        self.repoint(f"{cid}.out", f"{to_nchw['id']}.out")
        name = w["name"] + ".nhwc"
        weight = self.arrays.pop(w["name"]).transpose(0, 2, 3, 1)
        padded = np.zeros(weight.shape[:3] + (channels // groups,), weight.dtype)  # (0 is 0.0 in bf16's bits too)
        padded[..., :C] = weight
        self.arrays[name] = padded
        conv["op"] = "conv2d_nhwc"
        conv["tensors"] = {"x": {"from": f"{new_before[-1]['id']}.{'dx' if channels != C else 'out'}"},
                           "weight": dict(w, shape=list(padded.shape), name=name, data=name + ".npy"),
                           "out": {"dtype": dtype, "shape": [B, OH, OW, O]}}
        at = self.tasks.index(conv)
        self.tasks[at + 1:at + 1] = new_after
        self.tasks[at:at] = new_before
        return True

    def sink_permute(self):
        for t in self.tasks:
            slots = self._ELEMENTWISE.get(t["op"])
            if slots is None or t["tensors"]["out"].get("name") in self.outputs:
                continue
            permutes = [self.producer(t["tensors"][s])[0] for s in slots]
            moved = [p for p in permutes if p is not None and p["op"] == "permute" and "from" in p["tensors"]["x"] and
                     self.only_reader(p, "out") is t]
            if not moved:
                continue
            dims = moved[0]["args"]["dims"]
            shape = self.shape_of(moved[0]["tensors"]["x"])
            inverse = [dims.index(i) for i in range(len(dims))]
            # Each operand before the op: a moved permute's input, or (another
            # operand of its shape) where it is already permuted back by a
            # permute of its own (a residual's other branch, which feeds the
            # next convolution too); otherwise the op stays.
            sources = []
            for s, p in zip(slots, permutes):
                if p in moved and p["args"]["dims"] == dims and self.shape_of(p["tensors"]["x"]) == shape:
                    sources.append(dict(p["tensors"]["x"]))
                    continue
                back = self.permute_of(t["tensors"][s], inverse)
                if back is None or back["tensors"]["out"]["shape"] != shape:
                    break
                sources.append({"from": f"{back['id']}.out"})
            if len(sources) != len(slots):
                continue
            for s, source in zip(slots, sources):
                t["tensors"][s] = source
            for p in moved:
                if p in self.tasks and not self.readers(f"{p['id']}.out"):
                    self.tasks.remove(p)
            self.permute_after(t, dims, shape)
            return True
        return False

    def pool_channels_last(self):
        """A pool (max, average, adaptive average) of a permute back to NCHW,
        its only reader: the channels-last pool, then the permute."""
        for t in self.tasks:
            if t["op"] not in ("max_pool2d", "avg_pool2d", "adaptive_avg_pool2d") or len(t["tensors"]["out"]["shape"]) != 4:
                continue
            p, _ = self.producer(t["tensors"]["x"])
            if (p is None or p["op"] != "permute" or p["args"]["dims"] != self._TO_NCHW or
                    "from" not in p["tensors"]["x"] or self.only_reader(p, "out") is not t):
                continue
            B, C, OH, OW = t["tensors"]["out"]["shape"]
            t["op"] += "_nhwc"
            t["tensors"]["x"] = dict(p["tensors"]["x"])
            self.tasks.remove(p)
            self.permute_after(t, self._TO_NCHW, [B, OH, OW, C])
            return True
        return False

    def permute_as_reshape(self):
        """A permute that moves only axes of size 1 (a pooled [B, 1, 1, C] to
        [B, C, 1, 1]) leaves every element where it was: a reshape, which is
        a view."""
        for t in self.tasks:
            if t["op"] != "permute" or "from" not in t["tensors"]["x"]:
                continue
            shape = self.shape_of(t["tensors"]["x"])
            kept = [d for d in t["args"]["dims"] if shape[d] != 1]
            if kept == sorted(kept):
                t["op"] = "reshape"
                del t["args"]
                return True
        return False

    def permute_after(self, t, dims, shape):
        """t's result becomes `shape`, and a permute by `dims` after it gives
        its readers (and the graph, where it is an output) what t gave."""
        after = {"id": self.fresh_id(t["id"] + "_permuted"), "op": "permute", "phase": t["phase"],
                 "tensors": {"x": {"from": f"{t['id']}.out"}, "out": dict(t["tensors"]["out"])},
                 "args": {"dims": list(dims)}}
        self.repoint(f"{t['id']}.out", f"{after['id']}.out")
        t["tensors"]["out"] = {"dtype": t["tensors"]["out"]["dtype"], "shape": list(shape)}
        self.tasks.insert(self.tasks.index(t) + 1, after)

    def permute_of(self, slot, dims):
        """A task that permutes the tensor `slot` reads by `dims`, or None."""
        if "from" not in slot:
            return None
        return next((t for t in self.tasks if t["op"] == "permute" and t["tensors"]["x"].get("from") == slot["from"]
                     and t["args"]["dims"] == dims), None)

    def dedupe_permutes(self):
        """Two permutes of one tensor by the same dims: the second's readers read the first."""
        for t in self.tasks:
            if t["op"] != "permute" or t["tensors"]["out"].get("name") in self.outputs:
                continue
            first = self.permute_of(t["tensors"]["x"], t["args"]["dims"])
            if first is not None and first is not t:
                self.repoint(f"{t['id']}.out", f"{first['id']}.out")
                self.tasks.remove(t)
                return True
        return False

    def cancel_permutes(self):
        for t in self.tasks:
            if t["op"] != "permute" or t["tensors"]["out"].get("name") in self.outputs:
                continue
            first, _ = self.producer(t["tensors"]["x"])
            if first is None or first["op"] != "permute" or "from" not in first["tensors"]["x"]:
                continue
            if [first["args"]["dims"][d] for d in t["args"]["dims"]] != list(range(len(t["args"]["dims"]))):
                continue
            self.repoint(f"{t['id']}.out", first["tensors"]["x"]["from"])
            self.tasks.remove(t)
            return True
        return False

    def remove_dead(self):
        changed = False
        for t in list(self.tasks):
            slots = t["tensors"].values()
            owns_input = any("from" not in v and not self.is_output(v) for v in slots)
            read = any(self.is_output(v) and (v.get("storage") or self.readers(f"{t['id']}.{s}"))
                       for s, v in t["tensors"].items())
            if not owns_input and not read:
                self.tasks.remove(t)
                changed = True
        return changed


def simplify(tasks, outputs, arrays, training):
    """Rewrites `tasks` (and `arrays`, the constants' values) in place until
    no rule applies; returns the names of the rules that did."""
    g = _Graph(tasks, outputs, arrays)
    rules = [g.transpose_into_matmul, g.scale_into_matmul, g.heads, g.grouped_query]
    if not training:
        rules += [g.split_linear, g.channels_last, g.dedupe_permutes, g.sink_permute, g.pool_channels_last,
                  g.cancel_permutes, g.permute_as_reshape]
    rules.append(g.remove_dead)
    applied = []
    progress = True
    while progress:
        progress = False
        for rule in rules:
            while rule():
                progress = True
                if rule.__name__ not in applied:
                    applied.append(rule.__name__)
    return applied
