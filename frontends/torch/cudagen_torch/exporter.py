"""torch.fx GraphModule -> cudagen TaskGraph (JSON) and weights (.npy).

The module is captured as an fx graph: by torch.export where PyTorch has it
(2.x: ATen operators, `aten.linear.default`, its parameters as get_attr
nodes named by the module's own names), else by torch.fx's symbolic tracer
(1.13: modules, functions and tensor methods; a Tracer that records each
node's source line). The graph is then run once on the example inputs by an
fx Interpreter that keeps every node's value: shapes, dtypes and the integers
a model computes from shapes (x.size(0)) come from there, not from guessing.
Then each node maps to registry ops (MODULES, FUNCTIONS, METHODS and ATEN
below; docs/torch-frontend.md has the table):

- a node whose value does not depend on the inputs (a parameter, a buffer,
  a mask made from one) is a constant: it becomes a persistent tensor, its
  value an .npy file, only when a mapped op reads it as a tensor;
- every other node must map, or the export fails naming the node, its
  target, the model's source line and, where there is one, what to write
  instead with supported operators.

Nothing is written until the whole graph has mapped; files are written to a
temporary name and renamed into place.
"""

import json
import contextlib
import math
import operator
import os
import tempfile
import traceback
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from .simplify import simplify

FORMAT = "cudagen.taskgraph/1"

DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64", torch.int32: "i32",
          torch.int64: "i64"}


def to_numpy(tensor):
    """A tensor as the array its .npy file holds. numpy has no bfloat16: a
    bf16 tensor is saved as its bit patterns, uint16, which is how cudagen
    reads and writes bf16 .npy files (`from_numpy` is the inverse)."""
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


def from_numpy(array, dtype=None):
    """The tensor of an array read from a .npy file; `dtype=torch.bfloat16`
    reinterprets uint16 bit patterns."""
    if dtype == torch.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


class ExportError(Exception):
    """An input the frontend cannot export; the message names the fx node,
    its target and the model's source line, and suggests what is supported."""


@dataclass
class ExportResult:
    graph_path: str
    tracer: str  # how the model was captured: "torch.export" or "torch.fx.symbolic_trace"
    tasks: int
    weights: list  # names of the .npy files written for parameters and buffers
    inputs: list  # graph input tensor names, in the forward()'s order
    outputs: list  # graph output tensor names
    rewrites: list = field(default_factory=list)  # the rules of simplify.py that applied, in order


_MASK64 = (1 << 64) - 1


def _hash64(x):
    """cudagen's counter hash (templates/init.cuh, cg_hash64: splitmix64's
    finalizer) of a Python int or a uint64 array, modulo 2^64."""
    if isinstance(x, int):
        x = (x + 0x9E3779B97F4A7C15) & _MASK64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
        return x ^ (x >> 31)
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def dropout_mask(shape, p, seed, step=1, micro_batch=0):
    """The mask cudagen's `dropout_mask` task draws (templates/init.cuh), as
    a float32 array of `shape`: 0 with probability p, else 1 / (1 - p), the
    same bits on every device. A train-mode dropout exports as its input
    times this mask; its `seed` is the dropout's place among the model's
    dropouts (0, 1, ...), `step` counts training steps from 1 and
    `micro_batch` micro-batches from 0, so PyTorch can reproduce a cudagen
    training run's masks exactly (the export's own recorded run uses step 1)."""
    draw = _hash64(_hash64(_hash64(int(seed) & _MASK64) ^ (int(step) & _MASK64)) ^ (int(micro_batch) & _MASK64))
    counters = np.arange(int(np.prod(shape, dtype=np.int64)), dtype=np.uint64) * np.uint64(2)
    bits = _hash64(np.uint64(_hash64(draw)) ^ counters)
    u = (bits >> np.uint64(40)).astype(np.float32) * np.float32(2.0 ** -24)
    p = np.float32(p)
    kept = np.float32(1.0) / (np.float32(1.0) - p)
    return np.where(u < p, np.float32(0.0), kept).astype(np.float32).reshape(shape)


def _drawn_dropout(gm, node, value):
    """p of a dropout that draws a mask (training mode, p > 0): nn.Dropout
    itself, F.dropout, aten.dropout; None for any other node. value(arg)
    is an argument's Python value."""
    if node.op == "call_module":
        m = gm.get_submodule(node.target)
        return float(m.p) if type(m) is nn.Dropout and m.training and m.p > 0 else None
    if node.op != "call_function":
        return None
    if node.target is F.dropout:
        p, training = _arg(node, 1, "p", 0.5), _arg(node, 2, "training", True)
    elif node.target in (torch.dropout, torch.ops.aten.dropout.default):
        p, training = _arg(node, 1, "p", 0.5), _arg(node, 2, "train", True)
    else:
        return None
    p, training = float(value(p)), bool(value(training))
    return p if training and p > 0 else None


@dataclass
class Value:
    """A tensor of the graph being written: owned by a task's slot (ref), or
    not yet (an input or a constant, which the first task that reads it owns)."""
    shape: tuple
    dtype: str
    ref: str = None  # "task.slot"
    owner: dict = field(default=None, repr=False)  # the owning slot's JSON object
    pending: dict = None  # for an unowned value: "storage", "name" and the array to save
    name: str = None


def _frames(stack_trace):
    """(file line, code) per frame of a recorded stack trace, as written."""
    lines = (stack_trace or "").splitlines()
    frames = []
    for i, line in enumerate(lines):
        if line.strip().startswith("File "):
            code = lines[i + 1].strip() if i + 1 < len(lines) and not lines[i + 1].strip().startswith("File ") else ""
            frames.append((line.strip(), code))
    return frames


def _is_model_frame(frame):
    return os.sep + "torch" + os.sep not in frame[0] and os.sep + "cudagen_torch" + os.sep not in frame[0]


def _source_line(node):
    """The model's source line of an fx node, from its recorded stack trace:
    'File "model.py", line 7, in forward: return ...'. torch 1.13's fx
    writes the innermost frame first (it starts in the tracer), torch 2.x
    the outermost (it ends in the tracer or in torch.nn's modules): the
    innermost frame outside torch and this package either way."""
    frames = _frames(getattr(node, "stack_trace", None))
    model = [f for f in frames if _is_model_frame(f)]
    if not model:
        return "(no stack trace recorded)"
    innermost_first = not _is_model_frame(frames[0]) and _is_model_frame(frames[-1])
    line, code = model[0] if innermost_first else model[-1]
    return line + (f": {code}" if code else "")


def _module_of(node):
    """', in module classifier.2 (Dropout)': the innermost module a torch.export node was
    decomposed from (its recorded stack keeps only modules' forward frames, so the source
    line may be the model's call of a helper), or nothing."""
    stack = node.meta.get("nn_module_stack") if hasattr(node, "meta") else None
    if not stack:
        return ""
    path, kind = list(stack.values())[-1]
    if not path:
        return ""
    return f", in module {path} ({getattr(kind, '__name__', str(kind).rpartition('.')[2])})"


def _target_name(node):
    t = node.target
    if node.op == "call_module":
        return node.target
    if _is_aten(t):
        return str(t)  # aten.linear.default
    if isinstance(t, str):
        return f"Tensor.{t}" if node.op == "call_method" else t
    module = getattr(t, "__module__", None) or ""
    name = getattr(t, "__name__", repr(t))
    if module in ("_operator", "operator"):
        return f"operator.{name}"
    if module.startswith("torch.nn.functional"):
        return f"F.{name}"
    if module.startswith("torch") or module == "":
        return f"torch.{name}"
    return f"{module}.{name}"


def _is_aten(target):
    """An ATen operator overload, as torch.export's graphs call them."""
    return type(target).__name__ == "OpOverload"


# What a tensor's attribute gives without computing anything: static values
# here, since cudagen's shapes are those of the example inputs.
_STATIC_TENSOR_ATTRIBUTES = ("shape", "dtype", "device", "ndim", "is_cuda", "layout", "requires_grad")


class _Proxy(torch.fx.Proxy):
    """A Proxy that knows the value it stands for (the tracer's shadow): a
    tensor's static attributes (`x.shape`, `x.dtype`, `x.device`) are those
    values, and a tuple value unpacks into its items (`q, k, v =
    x.split(n, dim=2)`, `a, b = self.sub(x)`), whatever the Python version's
    bytecode (torch.fx reads the caller's UNPACK_SEQUENCE, which Python
    3.11's instruction caches moved)."""

    def __getattr__(self, name):
        value = self.tracer.shadow.get(self.node)
        if isinstance(value, torch.Tensor) and name in _STATIC_TENSOR_ATTRIBUTES:
            return getattr(value, name)
        return super().__getattr__(name)

    def __iter__(self):
        value = self.tracer.shadow.get(self.node)
        if isinstance(value, (tuple, list)):
            return iter([self[i] for i in range(len(value))])
        return super().__iter__()

    def __setitem__(self, key, value):
        """`mask[a:b, c:d] = v` (Swin's shifted-window mask): the assignment as a node that
        returns the updated copy, and this Proxy stands for that node from here on, so that
        later reads of the Python variable read the update. A copy cannot update what
        shares the tensor's storage: into a view, or into a tensor with views, is refused."""
        def is_view(n):
            return (n.op == "call_function" and n.target is operator.getitem) or (
                n.op == "call_method" and n.target in _VIEW_METHODS)
        if is_view(self.node) or any(is_view(u) for u in self.node.users):
            raise ExportError(f"fx node '{self.node.name}': an index assignment into a view, or into a tensor "
                              "that has views, has no mapping on the torch.fx path (the views would not see it); "
                              "assign into the tensor itself before taking views of it")
        self.node = self.tracer.create_proxy("call_function", _assigned, (self, key, value), {}).node


def _assigned(x, key, value):
    """x with x[key] = value, as a new tensor (the torch.fx path's index assignment)."""
    y = x.clone()
    y[key] = value
    return y


def _attribute(obj, name):
    """obj.name as the module holds it: its parameter, buffer or submodule
    itself, not the Proxy torch.fx's patched Module.__getattr__ would make
    of it while tracing (reading a parameter that way recursed)."""
    if isinstance(obj, torch.nn.Module):
        for table in ("_parameters", "_buffers", "_modules"):
            held = obj.__dict__.get(table, {})
            if name in held:
                return held[name]
    return getattr(obj, name)


class _Tracer(torch.fx.Tracer):
    """torch.fx's tracer with shapes specialised to the example inputs, as
    cudagen's shapes are static: every node is also run on real values as it
    is traced, and a node whose value is not a tensor (x.size(), x.shape[1],
    arithmetic on them) is that value, not a Proxy. So `B, T, C = x.size()`
    and a buffer sliced by T (`self.mask[:, :, :T, :T]`) trace; a branch on a
    tensor's value still fails, as it must. Source lines are recorded."""

    def __init__(self, example_inputs):
        super().__init__()
        self.record_stack_traces = True
        self.example_inputs = list(example_inputs)
        self.placeholders = 0
        self.shadow = {}  # fx node -> its value on the example inputs

    def proxy(self, node):
        return _Proxy(node, self)


    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, *rest, **more):
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, *rest, **more)
        if kind == "output":
            return proxy
        real = lambda a: self.shadow[a.node] if isinstance(a, torch.fx.Proxy) else a  # noqa: E731
        concrete_args = torch.fx.node.map_aggregate(args, real)
        concrete_kwargs = torch.fx.node.map_aggregate(kwargs, real)
        with torch.no_grad():
            if kind == "placeholder":
                value = self.example_inputs[self.placeholders] if self.placeholders < len(self.example_inputs) else None
                self.placeholders += 1
            elif kind == "get_attr":
                value = self.root
                for part in target.split("."):
                    value = _attribute(value, part)
            elif kind == "call_function":
                value = target(*concrete_args, **concrete_kwargs)
            elif kind == "call_method":
                value = getattr(concrete_args[0], target)(*concrete_args[1:], **concrete_kwargs)
            else:  # call_module: run the leaf as eager PyTorch would, outside the tracer's patches
                value = _untraced_call(self.root.get_submodule(target), concrete_args, concrete_kwargs)
        self.shadow[proxy.node] = value
        if kind != "placeholder" and not _holds_tensor(value):
            return value  # a shape, an int computed from one: a constant from here on
        return proxy


class _Recorder(torch.fx.Interpreter):
    """Runs the GraphModule once and keeps every node's value. A dropout
    that draws a mask multiplies by cudagen's first-step mask instead of
    PyTorch's random one, so the recorded outputs are the export's; its
    seed is its place among them (dropout_seeds: node -> (seed, p))."""

    def __init__(self, gm):
        super().__init__(gm)
        self.values = {}
        self.dropout_seeds = {}

    def run_node(self, n):
        # An update in place changes the tensor an earlier node recorded: its value is kept
        # as it was (a constant folded from it, x.new_zeros(...) before .add_(x), must be the
        # zeros), while the run goes on with the updated tensor.
        if n.args and isinstance(n.args[0], torch.fx.Node) and n.args[0].op != "get_attr" and _updates_first_argument(n):
            before = self.values.get(n.args[0])
            if isinstance(before, torch.Tensor):
                self.values[n.args[0]] = before.clone()
        p = _drawn_dropout(self.module, n, lambda a: self.values[a] if isinstance(a, torch.fx.Node) else a)
        if p is not None:
            seed = len(self.dropout_seeds)
            self.dropout_seeds[n] = (seed, p)
            x = self.values[n.args[0]] if n.args else self.values[n.kwargs["input"]]
            result = x * torch.from_numpy(dropout_mask(tuple(x.shape), p, seed)).to(device=x.device, dtype=x.dtype)
        else:
            result = super().run_node(n)
        self.values[n] = result
        return result


def _untraced_call(module, args, kwargs):
    """Calls a module with torch.nn.Module's own __call__ and __getattr__,
    which torch.fx replaces while it traces (its parameters would be
    Proxies, and the call a traced node)."""
    import torch.fx._symbolic_trace as symbolic_trace
    call = getattr(symbolic_trace, "_orig_module_call", None)
    getattr_ = getattr(symbolic_trace, "_orig_module_getattr", None)
    if call is None or getattr_ is None:
        raise ExportError(f"this PyTorch ({torch.__version__}) lacks torch.fx's saved Module.__call__; "
                          "cudagen_torch supports 1.13 and 2.x")
    saved = torch.nn.Module.__call__, torch.nn.Module.__getattr__
    torch.nn.Module.__call__, torch.nn.Module.__getattr__ = call, getattr_
    try:
        return module(*args, **kwargs)
    finally:
        torch.nn.Module.__call__, torch.nn.Module.__getattr__ = saved


def _holds_tensor(v):
    if isinstance(v, torch.Tensor):
        return True
    return isinstance(v, (tuple, list)) and any(_holds_tensor(x) for x in v)


def _ints(v, n=2):
    if isinstance(v, int):
        return (v,) * n
    return tuple(int(x) for x in v)


class _Exporter:
    def __init__(self, gm, values, name, training, module_names=None, dropout_seeds=None, root=None):
        self.gm = gm
        self.root = root  # the user's module (torch.export's graph keeps only its tensors)
        self.dropout_seeds = dropout_seeds or {}  # train-mode dropout node -> (its mask's seed, p)
        # The user's module's own name of each parameter and buffer, by storage: a tied
        # weight (GPT-2's embedding and output projection) under the first name
        # named_parameters() gives it, whichever attribute the capture read it through.
        self.module_names = module_names or {}
        self.training = training  # norms then also write the statistics their backward reads
        self.values = values  # node -> recorded value
        self.name = name
        self.tasks = []
        self.ids = set()
        self.env = {}  # node -> Value, tuple of Values, or a Python constant
        self.arrays = {}  # tensor name -> numpy array to save
        self.constants = {}  # (storage address, shape, strides, dtype) -> Value: a weight read twice is one tensor
        self.kept = []  # the tensors behind those keys, alive so that no address is reused
        self.depends = set()  # nodes whose value depends on the graph inputs
        self.inputs, self.outputs = [], []
        self.folded_bn = {}  # BatchNorm node -> the conv node it folds into

    # ---- errors --------------------------------------------------------
    def fail(self, node, message, hint=None):
        near = _nearest_targets(_target_name(node))
        text = f"fx node '{node.name}' (target {_target_name(node)}, at {_source_line(node)}{_module_of(node)}): {message}"
        hint = hint or _equivalent_hint(_target_name(node))
        if hint:
            text += f"\n  {hint}"
        if near:
            text += f"\n  supported instead: {', '.join(near)}"
        raise ExportError(text)

    # ---- graph building ------------------------------------------------
    def task_id(self, base):
        base = "".join(c if c.isalnum() or c == "_" else "_" for c in base) or "t"
        if base[0].isdigit():
            base = "t_" + base
        tid, n = base, 2
        while tid in self.ids:
            tid, n = f"{base}_{n}", n + 1
        self.ids.add(tid)
        return tid

    def add(self, node, base, op, inputs, outputs, args=None):
        """One task: `inputs` slot -> Value, `outputs` slot -> (dtype, shape).
        Returns the output Values by slot."""
        tid = self.task_id(base)
        tensors = {}
        for slot, v in inputs.items():
            if not isinstance(v, Value):
                self.fail(node, f"slot '{slot}' of op '{op}' needs a tensor, got {type(v).__name__} {v!r}")
            if v.ref is not None:
                tensors[slot] = {"from": v.ref}
                continue
            obj = {"dtype": v.dtype, "shape": list(v.shape), "storage": v.pending["storage"]}
            if v.name:
                obj["name"] = v.name
            if v.pending.get("array") is not None:
                obj["data"] = v.name + ".npy"
                self.arrays[v.name] = v.pending["array"]
            tensors[slot] = obj
            v.ref, v.owner, v.pending = f"{tid}.{slot}", obj, None
        result = {}
        for slot, (dtype, shape) in outputs.items():
            obj = {"dtype": dtype, "shape": list(shape)}
            tensors[slot] = obj
            result[slot] = Value(tuple(shape), dtype, f"{tid}.{slot}", obj)
        task = {"id": tid, "op": op, "phase": "forward", "tensors": tensors}
        if args:
            task["args"] = args
        self.tasks.append(task)
        return result

    def state(self, node, tensor, name):
        """A buffer a task updates in place (a BatchNorm's running
        statistics): persistent, saved under `name`, never trained (cudagen
        trains only what no task writes)."""
        v = self.constant(node, tensor, name)
        v.pending["storage"] = "persistent"
        return v

    def constant(self, node, tensor, name):
        """A tensor the inputs do not change (a weight, a buffer, a mask): a
        persistent tensor whose value is saved under `name`. When training,
        only a trainable parameter is persistent (cudagen trains every
        persistent tensor the loss reaches); any other constant (a padding
        block, a mask, a folded value) is an input that reads its file, so
        that it stays as it is."""
        if not isinstance(tensor, torch.Tensor):
            self.fail(node, f"expected a tensor, got {type(tensor).__name__}")
        key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), str(tensor.dtype)) if tensor.numel() else name
        if key in self.constants:
            return self.constants[key]
        dtype = self.dtype_of(node, tensor)
        array = to_numpy(tensor)
        if array.ndim == 0:
            array = array.reshape(())
        name = self.unique_name(self.module_names.get(key, name))
        trained = not self.training or (isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad)
        v = Value(tuple(tensor.shape), dtype, pending={"storage": "persistent" if trained else "external", "array": array},
                  name=name)
        self.constants[key] = v
        self.kept.append(tensor)
        return v

    def unique_name(self, name):
        name = "".join(c if c.isalnum() or c in "_.-" else "_" for c in name).lstrip(".-") or "tensor"
        taken = {v.name for v in self.constants.values()} | set(self.inputs) | set(self.arrays)
        unique, n = name, 2
        while unique in taken:
            unique, n = f"{name}_{n}", n + 1
        return unique

    def dtype_of(self, node, tensor):
        d = DTYPES.get(tensor.dtype)
        if d is None:
            self.fail(node, f"dtype {tensor.dtype} is not in the registry",
                      "cudagen tensors are float32, float16, bfloat16, float64, int32 or int64; cast the model (model.float())")
        return d

    def tensor(self, node, arg):
        """The Value of an fx argument that must be a tensor (or a Value a
        handler already made, as a reduction's rows before keepdim reshapes them)."""
        if isinstance(arg, Value):
            return arg
        if isinstance(arg, torch.fx.Node):
            v = self.env.get(arg)
            if isinstance(v, Value):
                return v
            if arg not in self.depends and isinstance(self.values.get(arg), torch.Tensor):
                v = self.constant(arg, self.values[arg], arg.target if arg.op == "get_attr" else arg.name)
                self.env[arg] = v
                return v
            self.fail(node, f"argument {arg.name} is not a tensor the graph computes")
        if isinstance(arg, torch.Tensor):
            return self.constant(node, arg, f"{node.name}.constant")
        self.fail(node, f"expected a tensor argument, got {type(arg).__name__} {arg!r}")

    def const(self, arg):
        """A Python value of an fx argument (ints a model computes from shapes)."""
        if isinstance(arg, torch.fx.Node):
            return self.values[arg]
        if isinstance(arg, (list, tuple)):
            return type(arg)(self.const(a) for a in arg)
        return arg

    def result_meta(self, node):
        v = self.values[node]
        if isinstance(v, (tuple, list)):  # outputs and saved statistics: the first is the one mapped
            v = v[0]
        if v.dtype == torch.bool:  # a view of a comparison's mask: 1/0 in its operands' dtype (_compare)
            source = next((self.env[a] for a in node.args if isinstance(a, torch.fx.Node)
                           and isinstance(self.env.get(a), Value)), None)
            if source is not None:
                if _op_name(_target_name(node)) not in _MASK_VIEWS:
                    self.fail(node, "a comparison's mask is 1/0 in its operands' dtype here, and this op would not "
                              "read it as PyTorch reads a bool tensor", "convert it first: mask.float()")
                return source.dtype, tuple(v.shape)
        return self.dtype_of(node, v), tuple(v.shape)

    # ---- the walk ------------------------------------------------------
    def run(self):
        graph = self.gm.graph
        # What the inputs reach is computed by tasks; the rest is constant, folded here. When
        # training, so is what a trainable parameter reaches (self.table[:T]): folded, its
        # gradient would go nowhere and the parameter would not be trained or saved.
        # A leaf module with trainable parameters (the fx path's nn.Embedding of constant
        # positions, GPT-2's wpe) is one too, though no get_attr node reads them.
        trainable = {n for n in graph.nodes if self.training and (
            (n.op == "get_attr" and isinstance(self.values.get(n), torch.nn.Parameter) and self.values[n].requires_grad)
            or (n.op == "call_module" and any(p.requires_grad for p in self.gm.get_submodule(n.target).parameters())))}
        for node in graph.nodes:
            sources = node.all_input_nodes
            if _values_ignore_inputs(node):  # x.new_zeros(...): x's shape only (a fill value still counts)
                sources = [a for a in sources if a is not node.args[0]]
            # (A drawn dropout's mask changes each step: computed even on a constant input.)
            if (node.op == "placeholder" or (node.op == "call_module" and node in trainable)
                    or node in self.dropout_seeds or any(a in self.depends or a in trainable for a in sources)):
                self.depends.add(node)
        for node in graph.nodes:
            if node.meta.get("cudagen_view_update_of") and node in self.depends:
                self.fail(node, f"an in-place update of a view of '{node.meta['cudagen_view_update_of']}', which a "
                          "trained parameter reaches and which is read afterwards: cudagen's graphs are functional",
                          "write the update out of place, or export for inference (no loss=)")
        self.find_batchnorm_folds()
        for node in graph.nodes:
            if node.op == "placeholder":
                value = self.values[node]
                if not isinstance(value, torch.Tensor):
                    self.fail(node, "a graph input must be a tensor")
                self.inputs.append(node.name)
                self.env[node] = Value(tuple(value.shape), self.dtype_of(node, value),
                                       pending={"storage": "external"}, name=node.name)
            elif node.op == "output":
                self.mark_outputs(node)
            elif node not in self.depends or not _holds_tensor(self.values[node]):
                # A constant (shapes are static, so x.size(0) is one too): kept as a
                # Python value, made a tensor only where read as one.
                self.env[node] = self.values[node]
            elif node.op == "call_module":
                self.env[node] = self.call_module(node)
            else:
                self.env[node] = self.call(node)

    def mark_outputs(self, node):
        results = node.args[0]
        flat = list(results) if isinstance(results, (tuple, list)) else [results]
        for i, r in enumerate(flat):
            v = self.env.get(r) if isinstance(r, torch.fx.Node) else None
            if not isinstance(v, Value):
                self.fail(node, f"output {i} is not a tensor the graph computes")
            if v.owner is None or v.ref is None or "from" in v.owner:
                self.fail(node, f"output {i} is a graph input or a constant, which cudagen does not copy out")
            name = "output" if len(flat) == 1 else f"output.{i}"
            if v.owner.get("storage") == "external":
                continue  # the same tensor returned twice
            v.owner["storage"] = "external"
            v.owner["name"] = name
            self.outputs.append(name)

    def find_batchnorm_folds(self):
        """BatchNorms in eval mode that fold into the convolution before them,
        its only reader: nn.BatchNorm2d after nn.Conv2d (torch.fx), or
        aten.batch_norm after aten.conv2d with constant weights (torch.export).
        None when training: a folded weight is no parameter, so the
        convolution's and the norm's own parameters would not train."""
        if self.training:
            return
        for node in self.gm.graph.nodes:
            source = node.args[0] if node.args else None
            if not isinstance(source, torch.fx.Node) or len(source.users) != 1:
                continue
            if node.op == "call_module" and source.op == "call_module":
                bn, conv = self.gm.get_submodule(node.target), self.gm.get_submodule(source.target)
                if (isinstance(bn, nn.BatchNorm2d) and isinstance(conv, nn.Conv2d) and not bn.training
                        and bn.running_mean is not None):
                    self.folded_bn[node] = source
            elif node.op == "call_function" and node.target in _BATCH_NORM and source.target in _CONV2D:
                args = _batch_norm_args(node)
                statistics = [args[n] for n in ("weight", "bias", "running_mean", "running_var")]
                conv_weights = [_arg(source, 1, "weight"), _arg(source, 2, "bias")]
                if (not self.const(args["training"]) and args["running_mean"] is not None
                        and not any(a in self.depends for a in statistics + conv_weights)):
                    self.folded_bn[node] = source

    def batchnorm_affine(self, node):
        """The per-channel scale and shift of an aten.batch_norm node in eval
        mode: y = x * scale + shift."""
        args = _batch_norm_args(node)
        if self.const(args["training"]):
            self.fail(node, "batch_norm in training mode has no mapping", "call model.eval() before exporting")
        gamma, beta, mean, var = (self.const(args[n]) for n in ("weight", "bias", "running_mean", "running_var"))
        if mean is None or var is None:
            self.fail(node, "batch_norm without running statistics has no mapping",
                      "construct BatchNorm with track_running_stats=True")
        return _batchnorm_affine(gamma, beta, mean, var, float(self.const(args["eps"])))

    # ---- modules -------------------------------------------------------
    def call_module(self, node):
        m = self.gm.get_submodule(node.target)
        kind = type(m)
        handler = MODULES.get(kind)
        if handler is None:
            for base, h in MODULES.items():
                if isinstance(m, base):
                    handler = h
                    break
        if handler is None:
            self.fail(node, f"module type {kind.__module__}.{kind.__name__} has no mapping")
        return handler(self, node, m)

    def call(self, node):
        target = node.target
        if node.op == "call_method":
            # An in-place method maps as its pure form: _functionalize_in_place rewired its readers.
            handler = METHODS.get(target) or (METHODS.get(target[:-1]) if target.endswith("_") else None)
        else:
            handler = FUNCTIONS.get(target) or FUNCTIONS.get(_pure_aten(target))
        if handler is None:
            self.fail(node, "no mapping to a cudagen op")
        return handler(self, node)

    # ---- helpers the mappings share -----------------------------------
    def unary(self, node, op, x, args=None):
        dtype, shape = self.result_meta(node)
        return self.add(node, node.name, op, {"x": self.tensor(node, x)}, {"out": (dtype, shape)}, args)["out"]

    def binary(self, node, op, a, b):
        dtype, shape = self.result_meta(node)
        return self.add(node, node.name, op, {"a": self.tensor(node, a), "b": self.tensor(node, b)},
                        {"out": (dtype, shape)})["out"]

    def dropout(self, node, x):
        """A train-mode dropout: x times a `dropout_mask` drawn from the
        node's seed, a new one each step and micro-batch (run-time arguments
        `step` and `micro_batch`, which the runtime advances). The product's
        gradient reads the same mask: the backward drops what the forward did."""
        inplace = self.gm.get_submodule(node.target).inplace if node.op == "call_module" else \
            self.const(_arg(node, 3, "inplace", False))
        if inplace:  # later readers of x would see it dropped: cudagen's graphs are functional
            self.fail(node, "dropout with inplace=True in training mode has no mapping", "pass inplace=False")
        x = self.tensor(node, x)
        seed, p = self.dropout_seeds[node]
        runtime = {"step": {"value": 1, "runtime": True}, "micro_batch": {"value": 0, "runtime": True}}
        mask = self.add(node, node.name + "_mask", "dropout_mask", {}, {"out": (x.dtype, x.shape)},
                        {"p": p, "seed": seed, **runtime})["out"]
        return self.add(node, node.name, "mul", {"a": x, "b": mask}, {"out": (x.dtype, x.shape)})["out"]

    def reshape_to(self, node, x, shape, base=None):
        return _as_shape(self, node, base or node.name, self.tensor(node, x), shape)

    def norm_outputs(self, node, statistics):
        """A norm's outputs: `out`, and when training the per-row statistics
        (f32) its backward reads."""
        dtype, shape = self.result_meta(node)
        outputs = {"out": (dtype, shape)}
        if self.training:
            outputs.update({s: ("f32", shape[:-1]) for s in statistics})
        return outputs

    def last_axis(self, node, dim, rank, what):
        d = self.const(dim)
        if d is None or d not in (-1, rank - 1):
            self.fail(node, f"{what} over axis {d} of a rank-{rank} tensor; cudagen's op works on the last axis",
                      "permute the axis last first, or reduce over dim=-1")

    def linear(self, node, x, weight, bias, base):
        xv = self.tensor(node, x)
        dtype, shape = self.result_meta(node)
        out = self.add(node, base, "matmul", {"a": xv, "b": weight}, {"out": (dtype, shape)}, {"trans_b": True})["out"]
        if bias is not None:
            out = self.add(node, base + "_bias", "add", {"a": out, "b": bias}, {"out": (dtype, shape)})["out"]
        return out

    def conv(self, node, x, weight, bias, stride, padding, dilation, groups, base):
        dtype, shape = self.result_meta(node)
        if len(shape) != 4:
            self.fail(node, f"conv2d of a rank-{len(shape)} tensor; cudagen's conv2d is NCHW with a batch axis")
        if isinstance(padding, str):
            if padding == "valid":
                padding = 0
            else:
                self.fail(node, f"padding='{padding}' has no mapping", "give the padding as integers")
        sh, sw = _ints(stride)
        ph, pw = _ints(padding)
        dh, dw = _ints(dilation)
        inputs = {"x": self.tensor(node, x), "weight": weight}
        if bias is not None:
            inputs["bias"] = bias
        args = {"stride_h": sh, "stride_w": sw, "padding_h": ph, "padding_w": pw, "dilation_h": dh,
                "dilation_w": dw, "groups": int(groups)}
        return self.add(node, base, "conv2d", inputs, {"out": (dtype, shape)}, args)["out"]

    def attention(self, node, q, k, v, causal, scale, enable_gqa=False, bias=None):
        """softmax(scale q k^T) v, causal or not; with `bias` (a Value: SDPA's
        additive attn_mask that the inputs change), softmax(scale q k^T +
        bias) v, which no attention kernel takes yet: a matmul whose epilogue
        adds the bias, the softmax, a matmul. With `enable_gqa` (SDPA's),
        k and v have fewer heads than q, each shared by a group of G query
        heads in a row: q is seen as [..., Hkv, G, T, D] over k and v seen as
        [..., Hkv, 1, T, D], grouped-query attention, and the output back as
        [..., H, T, D]."""
        qv, kv, vv = (self.tensor(node, t) for t in (q, k, v))
        d = qv.shape[-1]
        scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        dtype, shape = self.result_meta(node)
        heads, kv_heads = qv.shape[-3] if len(qv.shape) >= 3 else 1, kv.shape[-3] if len(kv.shape) >= 3 else 1
        grouped = enable_gqa and heads != kv_heads
        if grouped:
            if heads % kv_heads or vv.shape[-3] != kv_heads:
                self.fail(node, f"scaled_dot_product_attention with enable_gqa over {heads} query heads, {kv_heads} "
                          f"key heads and {vv.shape[-3]} value heads", "give k and v one number of heads that divides q's")
            lead, groups = qv.shape[:-3] + (kv_heads,), heads // kv_heads
            qv = _as_shape(self, node, node.name + "_q_grouped", qv, lead + (groups,) + qv.shape[-2:])
            kv = _as_shape(self, node, node.name + "_k_heads", kv, lead + (1,) + kv.shape[-2:])
            vv = _as_shape(self, node, node.name + "_v_heads", vv, lead + (1,) + vv.shape[-2:])
        scores_shape = qv.shape[:-1] + (kv.shape[-2],)
        scores = self.add(node, node.name + "_scores", "matmul", {"a": qv, "b": kv},
                          {"out": (qv.dtype, scores_shape)}, {"trans_b": True, "alpha": scale})["out"]
        if bias is not None:
            if grouped:
                self.fail(node, "scaled_dot_product_attention with enable_gqa and an attn_mask the inputs change has "
                          "no mapping", "repeat k and v's heads (repeat_interleave) and drop enable_gqa")
            scores = self.add(node, node.name + "_masked", "add", {"a": scores, "b": bias},
                              {"out": (qv.dtype, scores_shape)})["out"]
        probs = self.add(node, node.name + "_probs", "softmax", {"x": scores}, {"out": (qv.dtype, scores_shape)},
                         {"causal": True} if causal else None)["out"]
        if not grouped:
            return self.add(node, node.name, "matmul", {"a": probs, "b": vv}, {"out": (dtype, shape)})["out"]
        context = self.add(node, node.name + "_grouped", "matmul", {"a": probs, "b": vv},
                           {"out": (dtype, qv.shape[:-1] + (vv.shape[-1],))})["out"]
        return _as_shape(self, node, node.name, context, shape)


# ---- module mappings ---------------------------------------------------------

def _m_linear(ex, node, m):
    w = ex.constant(node, m.weight, f"{node.target}.weight")
    b = ex.constant(node, m.bias, f"{node.target}.bias") if m.bias is not None else None
    return ex.linear(node, node.args[0], w, b, node.name)


def _m_conv2d(ex, node, m):
    if m.padding_mode != "zeros":
        ex.fail(node, f"padding_mode='{m.padding_mode}' has no mapping", "cudagen's conv2d pads with zeros")
    weight, bias = m.weight, m.bias  # parameters: trained when training
    w_name, b_name = f"{node.target}.weight", f"{node.target}.bias"
    bn_node = next((b for b, c in ex.folded_bn.items() if c is node), None)
    if bn_node is not None:
        bn = ex.gm.get_submodule(bn_node.target)
        scale, shift = _batchnorm_affine(bn.weight if bn.affine else None, bn.bias if bn.affine else None,
                                         bn.running_mean, bn.running_var, bn.eps)
        weight, bias = _fold_into_conv(weight.detach(), None if bias is None else bias.detach(), scale, shift)
        w_name, b_name = f"{node.target}.weight.folded", f"{node.target}.bias.folded"
    w = ex.constant(node, weight, w_name)
    b = ex.constant(node, bias, b_name) if bias is not None else None
    return ex.conv(node, node.args[0], w, b, m.stride, m.padding, m.dilation, m.groups, node.name)


def _batchnorm_affine(gamma, beta, mean, var, eps):
    """BatchNorm in eval mode as y = x * scale + shift, per channel:
    scale = gamma / sqrt(var + eps), shift = beta - mean * scale."""
    mean, var = mean.detach(), var.detach()
    scale = (gamma.detach() if gamma is not None else torch.ones_like(var)) / torch.sqrt(var + eps)
    shift = (beta.detach() if beta is not None else torch.zeros_like(mean)) - mean * scale
    return scale, shift


def _fold_into_conv(weight, bias, scale, shift):
    """A convolution followed by y * scale + shift (per output channel) as one
    convolution: w' = w * scale, b' = b * scale + shift."""
    bias = bias if bias is not None else torch.zeros_like(scale)
    return weight * scale.reshape(-1, 1, 1, 1), bias * scale + shift


def _scale_shift(ex, node, x, scale, shift, name, suffix=""):
    """x * scale + shift per channel of an NCHW tensor (a BatchNorm that no
    convolution absorbs); its tasks' ids end in `suffix`."""
    scale_v = ex.constant(node, scale.reshape(-1, 1, 1), f"{name}.scale.folded")
    shift_v = ex.constant(node, shift.reshape(-1, 1, 1), f"{name}.shift.folded")
    dtype, shape = ex.result_meta(node)
    scaled = ex.add(node, node.name + suffix + "_scale", "mul", {"a": ex.tensor(node, x), "b": scale_v},
                    {"out": (dtype, shape)})["out"]
    return ex.add(node, node.name + suffix, "add", {"a": scaled, "b": shift_v}, {"out": (dtype, shape)})["out"]


def _frozen_batchnorm(ex, node, x, gamma, beta, mean, var, eps, name):
    """BatchNorm in eval mode in a training export: its running statistics
    are constants, its weight and bias parameters that train, as PyTorch trains
    an eval-mode BatchNorm: y = (x * inv_std + shift) * weight + bias, per
    channel, inv_std = 1 / sqrt(var + eps) and shift = -mean * inv_std.
    `gamma` and `beta` are Values (or None: no affine)."""
    normalized = _scale_shift(ex, node, x, *_batchnorm_affine(None, None, mean, var, eps), name, suffix="_normalized")
    dtype, shape = ex.result_meta(node)
    out = normalized
    for slot, param, op in (("weight", gamma, "mul"), ("bias", beta, "add")):
        if param is None:
            continue
        per_channel = ex.add(node, f"{node.name}_{slot}", "reshape", {"x": param}, {"out": (dtype, (shape[1], 1, 1))})["out"]
        out = ex.add(node, node.name if slot == "bias" or beta is None else f"{node.name}_{op}", op,
                     {"a": out, "b": per_channel}, {"out": (dtype, shape)})["out"]
    return out


def _batchnorm_batch_statistics(ex, node, x, weight, bias, running_mean, running_var, momentum, eps, name):
    """BatchNorm2d in training mode: `batchnorm2d`, each channel normalised by
    the batch's statistics, the running statistics (persistent, saved under
    their names `name`.running_mean and .running_var) updated in place by
    `momentum`, as PyTorch's train mode. weight, bias and the statistics are
    tensors or None."""
    tracked = running_mean is not None
    if tracked and momentum is None:
        ex.fail(node, "BatchNorm2d with momentum=None (a cumulative average) has no mapping", "give it a momentum")
    dtype, shape = ex.result_meta(node)
    if len(shape) != 4:
        ex.fail(node, f"BatchNorm2d of a rank-{len(shape)} tensor; cudagen's batchnorm2d is NCHW")
    inputs = {"x": ex.tensor(node, x)}
    if tracked:  # (num_batches_tracked is not counted: with a momentum nothing reads it)
        inputs["running_mean"] = ex.state(node, running_mean, f"{name}.running_mean")
        inputs["running_var"] = ex.state(node, running_var, f"{name}.running_var")
    if weight is not None:
        inputs["weight"] = ex.constant(node, weight, f"{name}.weight")
        inputs["bias"] = ex.constant(node, bias if bias is not None else torch.zeros_like(weight), f"{name}.bias")
    outputs = {"out": (dtype, shape), "mean": ("f32", (shape[1],)), "rstd": ("f32", (shape[1],))}
    return ex.add(node, node.name, "batchnorm2d", inputs, outputs,
                  {"eps": float(eps), "momentum": float(momentum or 0.0)})["out"]


def _m_batchnorm2d(ex, node, m):
    if node in ex.folded_bn:
        return ex.env[ex.folded_bn[node]]  # already in the convolution's weights
    if m.training or m.running_mean is None:  # without running statistics PyTorch uses the batch's in eval mode too
        tracked = m.track_running_stats and m.running_mean is not None
        return _batchnorm_batch_statistics(
            ex, node, node.args[0], m.weight if m.affine else None, m.bias if m.affine else None,
            m.running_mean if tracked else None, m.running_var if tracked else None,
            m.momentum if tracked else 0.0, m.eps, node.target)
    if ex.training and m.affine:
        return _frozen_batchnorm(ex, node, node.args[0], ex.constant(node, m.weight, f"{node.target}.weight"),
                                 ex.constant(node, m.bias, f"{node.target}.bias"), m.running_mean, m.running_var, m.eps,
                                 node.target)
    scale, shift = _batchnorm_affine(m.weight if m.affine else None, m.bias if m.affine else None,
                                     m.running_mean, m.running_var, m.eps)
    return _scale_shift(ex, node, node.args[0], scale, shift, node.target)


def _m_layernorm(ex, node, m):
    if len(m.normalized_shape) != 1:
        ex.fail(node, f"LayerNorm over {tuple(m.normalized_shape)}; cudagen's layernorm normalises the last axis")
    n = m.normalized_shape[0]
    w = ex.constant(node, m.weight if m.elementwise_affine else torch.ones(n), f"{node.target}.weight")
    b_tensor = m.bias if (m.elementwise_affine and getattr(m, "bias", None) is not None) else torch.zeros(n)
    b = ex.constant(node, b_tensor, f"{node.target}.bias")
    return ex.add(node, node.name, "layernorm", {"x": ex.tensor(node, node.args[0]), "weight": w, "bias": b},
                  ex.norm_outputs(node, ("mean", "rstd")), {"eps": float(m.eps)})["out"]


def _m_rmsnorm(ex, node, m):
    shape_n = tuple(m.normalized_shape)
    if len(shape_n) != 1:
        ex.fail(node, f"RMSNorm over {shape_n}; cudagen's rmsnorm normalises the last axis")
    w = ex.constant(node, m.weight if m.weight is not None else torch.ones(shape_n[0]), f"{node.target}.weight")
    eps = m.eps if m.eps is not None else torch.finfo(torch.float32).eps
    return ex.add(node, node.name, "rmsnorm", {"x": ex.tensor(node, node.args[0]), "weight": w},
                  ex.norm_outputs(node, ("rstd",)), {"eps": float(eps)})["out"]


def _m_embedding(ex, node, m):
    table = ex.constant(node, m.weight, f"{node.target}.weight")
    dtype, shape = ex.result_meta(node)
    return ex.add(node, node.name, "embedding", {"table": table, "ids": ex.tensor(node, node.args[0])},
                  {"out": (dtype, shape)})["out"]


def _m_activation(op, args=None):
    return lambda ex, node, m: ex.unary(node, op, node.args[0], args(m) if callable(args) else args)


def _m_identity(ex, node, m):
    x = _arg(node, 0, "input")
    if node in ex.dropout_seeds:
        return ex.dropout(node, x)
    if isinstance(m, nn.modules.dropout._DropoutNd) and m.training and m.p > 0:
        ex.fail(node, f"{type(m).__name__} in training mode has no mapping (nn.Dropout has: a mask per element)",
                "export in eval mode (train_mode=False), or use nn.Dropout")
    return ex.tensor(node, x)


def _m_flatten(ex, node, m):
    return ex.reshape_to(node, node.args[0], ex.result_meta(node)[1])


def _pool_args(node, kernel, stride, padding, dilation=None):
    kh, kw = _ints(kernel)
    sh, sw = _ints(stride if stride not in (None, []) else kernel)
    ph, pw = _ints(padding)
    args = {"kernel_h": kh, "kernel_w": kw, "stride_h": sh, "stride_w": sw, "padding_h": ph, "padding_w": pw}
    if dilation is not None:
        dh, dw = _ints(dilation)
        args.update({"dilation_h": dh, "dilation_w": dw})
    return args


def _max_pool(ex, node, x, kernel, stride, padding, dilation, ceil_mode, return_indices=False):
    if return_indices:
        ex.fail(node, "max_pool2d with return_indices has no mapping")
    args = _pool_args(node, kernel, stride, padding, dilation)
    if ceil_mode:
        # The op rounds the output size up; PyTorch also drops a last window that would start in
        # the right padding, which the op's size rule does not: refused where the two differ.
        args["ceil_mode"] = True
        in_h, in_w = ex.tensor(node, x).shape[-2:]
        _, shape = ex.result_meta(node)
        for axis, size in (("h", in_h), ("w", in_w)):
            k, s, p, d = args[f"kernel_{axis}"], args[f"stride_{axis}"], args[f"padding_{axis}"], args[f"dilation_{axis}"]
            rounded_up = (size + 2 * p - d * (k - 1) - 1 + s - 1) // s + 1
            if rounded_up != shape[-2 if axis == "h" else -1]:
                ex.fail(node, f"max_pool2d with ceil_mode drops a last window that starts in the padding here "
                        f"({rounded_up - 1} windows along {'H' if axis == 'h' else 'W'}, not {rounded_up}); "
                        "only sizes where it does not map", "pad the input instead, or use ceil_mode=False")
    return ex.unary(node, "max_pool2d", x, args)


def _avg_pool(ex, node, x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override):
    if ceil_mode or divisor_override:
        ex.fail(node, "avg_pool2d with ceil_mode or divisor_override has no mapping")
    args = _pool_args(node, kernel, stride, padding)
    args["count_include_pad"] = bool(count_include_pad)
    return ex.unary(node, "avg_pool2d", x, args)


def _m_softmax(op):
    def handler(ex, node, m):
        x = ex.tensor(node, node.args[0])
        ex.last_axis(node, m.dim, len(x.shape), op)
        return ex.unary(node, op, node.args[0])
    return handler


def _m_gelu(ex, node, m):
    return ex.unary(node, "gelu", node.args[0], {"approximate": "tanh" if m.approximate == "tanh" else "erf"})


def _m_multihead_attention(ex, node, m):
    """nn.MultiheadAttention in eval mode (torchvision's ViT), on the torch.fx path where
    it is one call: its in-projection (one matmul each for q, k and v, from the packed
    in_proj_weight), heads split, softmax(q k^T / sqrt(d)) v, heads merged, out_proj.
    Returns (output, None): the averaged attention weights (need_weights=True) have no
    mapping, and nothing may read them. Masks, bias_k/bias_v, add_zero_attn, separate
    q/k/v weights, and a training export (the packed weight's thirds would not train
    under its name) are refused."""
    def arg(i, name, default=None):
        return _arg(node, i, name, default)
    query, key, value = arg(0, "query"), arg(1, "key"), arg(2, "value")
    unsupported = [what for what, present in (
        ("key_padding_mask", arg(3, "key_padding_mask") is not None), ("attn_mask", arg(5, "attn_mask") is not None),
        ("is_causal", bool(ex.const(arg(7, "is_causal", False)))), ("bias_k/bias_v", m.bias_k is not None),
        ("add_zero_attn", m.add_zero_attn), ("separate q/k/v projection weights", not m._qkv_same_embed_dim),
        ("a training export", ex.training)) if present]
    if m.training and m.dropout > 0:
        unsupported.append(f"dropout {m.dropout:g} in training mode")
    if any(len(ex.values[t].shape) != 3 for t in (query, key, value) if isinstance(t, torch.fx.Node)):
        unsupported.append("unbatched (rank-2) inputs")
    if unsupported:
        ex.fail(node, f"nn.MultiheadAttention with {', '.join(unsupported)} has no mapping",
                "F.scaled_dot_product_attention on your own projections maps (with is_causal for a causal mask)")
    if any(u.op == "call_function" and u.target is operator.getitem and ex.const(u.args[1]) == 1 for u in node.users):
        ex.fail(node, "nn.MultiheadAttention's attention weights (need_weights=True) have no mapping",
                "call it with need_weights=False, or read only its first result")
    e, heads = m.embed_dim, m.num_heads
    d = e // heads
    q, k, v = (ex.tensor(node, t) for t in (query, key, value))
    if not m.batch_first:  # [T, B, E] -> [B, T, E]
        q, k, v = (ex.add(node, f"{node.name}_{n}_batch_first", "permute", {"x": t},
                          {"out": (t.dtype, (t.shape[1], t.shape[0], t.shape[2]))}, {"dims": [1, 0, 2]})["out"]
                   for n, t in (("q", q), ("k", k), ("v", v)))
    weight, bias = m.in_proj_weight.detach(), m.in_proj_bias

    def heads_of(x, part, name):
        w = ex.constant(node, weight[part * e:(part + 1) * e], f"{node.target}.in_proj_weight.{name}")
        projected = ex.add(node, f"{node.name}_{name}", "matmul", {"a": x, "b": w},
                           {"out": (x.dtype, x.shape)}, {"trans_b": True})["out"]
        if bias is not None:
            b = ex.constant(node, bias.detach()[part * e:(part + 1) * e], f"{node.target}.in_proj_bias.{name}")
            projected = ex.add(node, f"{node.name}_{name}_bias", "add", {"a": projected, "b": b},
                               {"out": (x.dtype, x.shape)})["out"]
        split = _as_shape(ex, node, f"{node.name}_{name}_split", projected, x.shape[:2] + (heads, d))
        return ex.add(node, f"{node.name}_{name}_heads", "permute", {"x": split},
                      {"out": (x.dtype, (x.shape[0], heads, x.shape[1], d))}, {"dims": [0, 2, 1, 3]})["out"]

    qh, kh, vh = heads_of(q, 0, "q"), heads_of(k, 1, "k"), heads_of(v, 2, "v")
    scores_shape = qh.shape[:-1] + (kh.shape[-2],)
    scores = ex.add(node, f"{node.name}_scores", "matmul", {"a": qh, "b": kh}, {"out": (qh.dtype, scores_shape)},
                    {"trans_b": True, "alpha": 1.0 / math.sqrt(d)})["out"]
    probs = ex.add(node, f"{node.name}_probs", "softmax", {"x": scores}, {"out": (qh.dtype, scores_shape)})["out"]
    context = ex.add(node, f"{node.name}_context", "matmul", {"a": probs, "b": vh}, {"out": (qh.dtype, qh.shape)})["out"]
    batch, tokens = qh.shape[0], qh.shape[2]
    merged = ex.add(node, f"{node.name}_merged", "permute", {"x": context},
                    {"out": (qh.dtype, (batch, tokens, heads, d))}, {"dims": [0, 2, 1, 3]})["out"]
    merged = _as_shape(ex, node, f"{node.name}_merged_rows", merged, (batch, tokens, e))
    out_w = ex.constant(node, m.out_proj.weight, f"{node.target}.out_proj.weight")
    out = ex.add(node, f"{node.name}_out", "matmul", {"a": merged, "b": out_w}, {"out": (qh.dtype, merged.shape)},
                 {"trans_b": True})["out"]
    if m.out_proj.bias is not None:
        out_b = ex.constant(node, m.out_proj.bias, f"{node.target}.out_proj.bias")
        out = ex.add(node, f"{node.name}_out_bias", "add", {"a": out, "b": out_b}, {"out": (qh.dtype, out.shape)})["out"]
    if not m.batch_first:
        out = ex.add(node, f"{node.name}_seq_first", "permute", {"x": out},
                     {"out": (out.dtype, (tokens, batch, e))}, {"dims": [1, 0, 2]})["out"]
    return (out, None)


MODULES = {
    nn.Linear: _m_linear,
    nn.Conv2d: _m_conv2d,
    nn.BatchNorm2d: _m_batchnorm2d,
    nn.LayerNorm: _m_layernorm,
    nn.Embedding: _m_embedding,
    nn.ReLU: _m_activation("relu"),
    nn.ReLU6: _m_activation("relu6"),
    nn.GELU: _m_gelu,
    nn.SiLU: _m_activation("silu"),
    nn.Sigmoid: _m_activation("sigmoid"),
    nn.Tanh: _m_activation("tanh"),
    nn.Hardswish: _m_activation("hardswish"), nn.Hardsigmoid: _m_activation("hardsigmoid"),
    nn.Dropout: _m_identity,
    nn.MultiheadAttention: _m_multihead_attention,
    nn.Identity: _m_identity,
    nn.Flatten: _m_flatten,
    nn.MaxPool2d: lambda ex, node, m: _max_pool(ex, node, node.args[0], m.kernel_size, m.stride, m.padding,
                                                m.dilation, m.ceil_mode, m.return_indices),
    nn.AvgPool2d: lambda ex, node, m: _avg_pool(ex, node, node.args[0], m.kernel_size, m.stride, m.padding,
                                                m.ceil_mode, m.count_include_pad, m.divisor_override),
    nn.AdaptiveAvgPool2d: lambda ex, node, m: ex.unary(node, "adaptive_avg_pool2d", node.args[0]),
    nn.Softmax: _m_softmax("softmax"),
    nn.LogSoftmax: _m_softmax("log_softmax"),
}
if hasattr(nn, "RMSNorm"):
    MODULES[nn.RMSNorm] = _m_rmsnorm


# ---- function and method mappings ----------------------------------------------

def _arg(node, i, name, default=None):
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _is_tensor_arg(ex, a):
    return isinstance(a, torch.fx.Node) and isinstance(ex.values.get(a), torch.Tensor)


def _arith(kind):
    def handler(ex, node):
        a, b = _arg(node, 0, "input"), _arg(node, 1, "other")
        if node.kwargs.get("alpha", 1) != 1:
            ex.fail(node, "add/sub with alpha has no mapping")
        ta, tb = _is_tensor_arg(ex, a), _is_tensor_arg(ex, b)
        if ta and tb:
            return ex.binary(node, kind, a, b)
        if not (ta or tb):
            ex.fail(node, "neither operand is a tensor")
        x, c = (a, ex.const(b)) if ta else (b, ex.const(a))
        if not isinstance(c, (int, float)):
            ex.fail(node, f"operand {c!r} is neither a tensor nor a number")
        c = float(c)
        # A number operand: affine(x) = scale * x + shift.
        if kind == "add":
            scale, shift = 1.0, c
        elif kind == "sub":
            scale, shift = (1.0, -c) if ta else (-1.0, c)
        elif kind == "mul":
            scale, shift = c, 0.0
        else:
            if not ta:
                ex.fail(node, "a number divided by a tensor has no mapping")
            scale, shift = 1.0 / c, 0.0
        return ex.unary(node, "affine", x, {"scale": scale, "shift": shift})
    return handler


_TORCH_DTYPES = {name: dtype for dtype, name in DTYPES.items()}
# Ops that move a comparison's mask without reading its values as numbers: they keep it a mask.
_MASK_VIEWS = {"view", "reshape", "_unsafe_view", "expand", "expand_as", "permute", "transpose", "t", "unsqueeze",
               "squeeze", "flatten", "contiguous", "clone", "alias", "getitem", "slice", "select", "narrow", "repeat",
               "cat", "concat", "mul"}  # (a product of two masks is their logical and, as in PyTorch)


def _compare(kind):
    """a == b and a != b (eq, ne; a tensor and a tensor or a number): a mask of
    1 and 0 in the operands' floating dtype, which a product, .float() or a
    view (_MASK_VIEWS) reads as PyTorch reads its bool tensor; any other op on
    the bool is refused (.float() first). No gradient flows through it
    (`gradient: none`). torch.where and masked_fill of such a mask have no
    mapping."""
    def handler(ex, node):
        a, b = _arg(node, 0, "input"), _arg(node, 1, "other")
        ta, tb = _is_tensor_arg(ex, a), _is_tensor_arg(ex, b)
        if not (ta or tb):
            ex.fail(node, "neither operand is a tensor")
        x = ex.tensor(node, a if ta else b)
        if x.dtype not in ("f32", "f16", "bf16", "f64"):
            ex.fail(node, f"{kind} of {x.dtype} tensors has no mapping: comparisons map for floating operands",
                    "compare floating values (x.float() == y.float())")
        if ta and tb:
            y = ex.tensor(node, b)
            if y.dtype != x.dtype:
                ex.fail(node, f"{kind} of a {x.dtype} and a {y.dtype} tensor has no mapping", "cast one to the other's dtype")
        else:
            number = ex.const(b if ta else a)
            if not isinstance(number, (int, float)):
                ex.fail(node, f"operand {number!r} is neither a tensor nor a number")
            y = ex.constant(node, torch.tensor(float(number), dtype=_TORCH_DTYPES[x.dtype]), f"{node.name}.other")
        shape = tuple(ex.values[node].shape)
        return ex.add(node, node.name, kind, {"a": x, "b": y}, {"out": (x.dtype, shape)})["out"]
    return handler


def _f_unary(op, args=None):
    return lambda ex, node: ex.unary(node, op, node.args[0], args)


def _f_pow(ex, node):
    """x ** p, x.pow(p), torch.pow(x, p): a tensor to a number's power (a hand-written RMSNorm's x.pow(2))."""
    base, exponent = node.args[0], ex.const(_arg(node, 1, "exponent"))
    if not isinstance(base, torch.fx.Node) or isinstance(exponent, torch.Tensor) or not isinstance(exponent, (int, float)):
        ex.fail(node, "pow maps for a tensor raised to a number (x ** 2, x.pow(0.5)); here the base or the exponent "
                "is not", "write a tensor exponent as torch.exp(y * torch.log(x))")
    return ex.unary(node, "pow", base, {"exponent": float(exponent)})


def _f_softmax(op):
    def handler(ex, node):
        x = ex.tensor(node, node.args[0])
        ex.last_axis(node, _arg(node, 1, "dim"), len(x.shape), op)
        # A causal mask filled with -inf just before folds into the softmax.
        source = node.args[0]
        if isinstance(source, torch.fx.Node) and hasattr(source, "_cudagen_causal_scores"):
            return ex.unary(node, op, source._cudagen_causal_scores, {"causal": True})
        return ex.unary(node, op, node.args[0])
    return handler


def _f_masked_fill(ex, node):
    """x.masked_fill(mask, -inf) with a constant causal mask, read only by a
    softmax: the softmax's causal flag. Anything else has no mapping."""
    x, mask, value = node.args[0], node.args[1], ex.const(node.args[2])
    if mask in ex.depends or not (isinstance(value, float) and value == -math.inf):
        ex.fail(node, "masked_fill has no mapping except a constant causal mask filled with -inf before softmax")
    shape = ex.values[x].shape
    n, m = shape[-2], shape[-1]
    causal = torch.ones(n, m, dtype=torch.bool).triu(1).expand(shape)
    users_ok = all(u.op in ("call_function", "call_method") and u.target in _SOFTMAX for u in node.users)
    if not users_ok or not torch.equal(ex.values[mask].to(torch.bool).expand(shape), causal):
        ex.fail(node, "masked_fill has no mapping except a constant causal mask filled with -inf before softmax",
                "mask[i, j] must be true exactly where j > i (a lower-triangular 'keep' mask compared with 0)")
    node._cudagen_causal_scores = x
    return ex.tensor(node, x)  # the softmax reads the unmasked scores itself


def _f_where(ex, node):
    """torch.where(mask, scores, lowest) with a constant mask that keeps exactly the causal
    keys (GPT-2's eager attention: its tril buffer sliced to T, the dtype's lowest value or
    -inf elsewhere), read only by a softmax: the softmax's causal flag; with a mask that keeps
    everything, the scores themselves. Anything else has no mapping."""
    if len(node.args) != 3:
        ex.fail(node, "torch.where(condition) (the indices where it holds) has no mapping")
    cond, x, other = node.args[0], node.args[1], node.args[2]
    if not isinstance(x, torch.fx.Node):
        ex.fail(node, "torch.where has no mapping except a constant causal mask over scores before a softmax")
    shape = tuple(ex.values[x].shape)
    kind = _constant_mask_kind(ex, node, cond, shape)
    fill = ex.values[other] if isinstance(other, torch.fx.Node) else other
    if isinstance(other, torch.fx.Node) and other in ex.depends:
        fill = None
    fill = float(fill) if isinstance(fill, (int, float)) or (isinstance(fill, torch.Tensor) and fill.numel() == 1) else None
    if kind == "none":
        return ex.tensor(node, x)
    users_ok = all(u.op in ("call_function", "call_method") and u.target in _SOFTMAX for u in node.users)
    if kind != "causal" or fill is None or fill > _MASKED_BELOW or not users_ok:
        ex.fail(node, "torch.where has no mapping except a constant causal mask over scores before a softmax",
                "mask[i, j] must be true exactly where j <= i and the other value -inf or the dtype's lowest; "
                "for a general select write mask * x + (1 - mask) * y")
    node._cudagen_causal_scores = x
    return ex.tensor(node, x)


def _f_matmul(ex, node):
    return ex.binary(node, "matmul", node.args[0], node.args[1])


def _f_addmm(ex, node):
    """beta * input + alpha * (mat1 @ mat2): transformers' Conv1D (GPT-2's projections) writes its
    linear layer as torch.addmm(bias, x, weight). A matmul (alpha its scale), then the add."""
    bias, mat1, mat2 = node.args[0], node.args[1], node.args[2]
    beta, alpha = float(ex.const(_arg(node, 3, "beta", 1))), float(ex.const(_arg(node, 4, "alpha", 1)))
    if beta != 1.0:
        ex.fail(node, f"addmm with beta={beta:g} has no mapping; beta=1 (the default) does",
                "scale the input before: torch.addmm(beta * input, mat1, mat2)")
    dtype, shape = ex.result_meta(node)
    product = ex.add(node, node.name + "_product", "matmul", {"a": ex.tensor(node, mat1), "b": ex.tensor(node, mat2)},
                     {"out": (dtype, shape)}, {"alpha": alpha} if alpha != 1.0 else None)["out"]
    return ex.add(node, node.name, "add", {"a": product, "b": ex.tensor(node, bias)}, {"out": (dtype, shape)})["out"]


def _f_linear(ex, node):
    x, w, b = node.args[0], _arg(node, 1, "weight"), _arg(node, 2, "bias")
    return ex.linear(node, x, ex.tensor(node, w), ex.tensor(node, b) if b is not None else None, node.name)


def _f_conv2d(ex, node):
    x, w = node.args[0], _arg(node, 1, "weight")
    b = _arg(node, 2, "bias")
    bn_node = next((n for n, c in ex.folded_bn.items() if c is node), None)
    if bn_node is not None:  # torch.export: the aten.batch_norm after it folds into its weights
        weight, bias = _fold_into_conv(ex.const(w), ex.const(b), *ex.batchnorm_affine(bn_node))
        # Named as the fx path names them: conv1.weight.folded, conv1.bias.folded.
        owner = w.target.rpartition(".")[0] if isinstance(w, torch.fx.Node) and w.op == "get_attr" else node.name
        w_v, b_v = ex.constant(node, weight, f"{owner}.weight.folded"), ex.constant(node, bias, f"{owner}.bias.folded")
    else:
        w_v, b_v = ex.tensor(node, w), ex.tensor(node, b) if b is not None else None
    return ex.conv(node, x, w_v, b_v, ex.const(_arg(node, 3, "stride", 1)), ex.const(_arg(node, 4, "padding", 0)),
                   ex.const(_arg(node, 5, "dilation", 1)), ex.const(_arg(node, 6, "groups", 1)), node.name)


def _f_reshape(ex, node):
    return ex.reshape_to(node, node.args[0], ex.result_meta(node)[1])


def _f_identity(ex, node):
    return ex.tensor(node, node.args[0])


def _f_dropout(ex, node):
    """F.dropout and aten.dropout: a mask in training mode (ex.dropout), else
    (or at p = 0, Swin's F.dropout(attn, p=0.0)) the identity."""
    x = _arg(node, 0, "input")
    return ex.dropout(node, x) if node in ex.dropout_seeds else ex.tensor(node, x)


def _f_stochastic_depth(ex, node):
    """torchvision.ops.stochastic_depth(input, p, mode, training) (EfficientNet's and ConvNeXt's
    residual branches, traced as a leaf on the fx path): the input itself in eval mode or at p 0."""
    p, training = float(ex.const(_arg(node, 1, "p", 0.0))), ex.const(_arg(node, 3, "training", True))
    if training and p > 0:
        ex.fail(node, "stochastic_depth with training=True has no mapping", "call eval() on the model before exporting")
    return ex.tensor(node, node.args[0])


def _permute(ex, node, dims):
    x = ex.tensor(node, node.args[0])
    rank = len(x.shape)
    dims = [d % rank for d in dims]
    if dims == list(range(rank)):
        return x
    dtype, shape = ex.result_meta(node)
    if dims == list(range(rank - 2)) + [rank - 1, rank - 2]:
        return ex.add(node, node.name, "transpose", {"x": x}, {"out": (dtype, shape)})["out"]
    return ex.add(node, node.name, "permute", {"x": x}, {"out": (dtype, shape)}, {"dims": dims})["out"]


def _f_transpose(ex, node):
    """x.transpose(dim0, dim1), and swapaxes/swapdims (axis0, axis1)."""
    rank = len(ex.values[node.args[0]].shape)
    first = _arg(node, 1, "dim0", node.kwargs.get("axis0"))
    second = _arg(node, 2, "dim1", node.kwargs.get("axis1"))
    a, b = ex.const(first) % rank, ex.const(second) % rank
    dims = list(range(rank))
    dims[a], dims[b] = dims[b], dims[a]
    return _permute(ex, node, dims)


def _f_permute(ex, node):
    dims = ex.const(node.args[1:]) if len(node.args) > 2 else ex.const(_arg(node, 1, "dims"))
    return _permute(ex, node, list(dims))


def _f_t(ex, node):
    return _permute(ex, node, [1, 0]) if len(ex.values[node.args[0]].shape) == 2 else ex.tensor(node, node.args[0])


def _axis(ex, node, dim, rank, what):
    d = ex.const(dim)
    if not isinstance(d, int) or not -rank <= d < rank:
        ex.fail(node, f"{what} over axis {d} of a rank-{rank} tensor", f"give {what} a constant dim in [-{rank}, {rank})")
    return d % rank


def _rows(shape, axis):
    """The product of the dims before `axis` and of those after it."""
    return math.prod(shape[:axis]), math.prod(shape[axis + 1:])


def _as_shape(ex, node, name, v, shape):
    """`v` seen with another shape (a view where the planner can alias it)."""
    shape = tuple(shape)
    if shape == v.shape:
        return v
    return ex.add(node, name, "reshape", {"x": v}, {"out": (v.dtype, shape)})["out"]


def _join(ex, node, values, axis, name):
    """`values` (equal but along `axis`) joined along it: the ops join along
    the last axis, so each part is seen as [before, size * after] (row-major,
    a part's slab for one leading index is contiguous), joined, and seen back
    with the joined shape."""
    rank = len(values[0].shape)
    shape = list(values[0].shape)
    shape[axis] = sum(v.shape[axis] for v in values)
    before, after = _rows(values[0].shape, axis)
    last = axis == rank - 1
    if not last:
        seen = {}  # one view of a value joined several times (copies: repeat, expand)
        values = [seen[id(v)] if id(v) in seen else seen.setdefault(id(v), _as_shape(
            ex, node, f"{name}_in{i}", v, (before, v.shape[axis] * after))) for i, v in enumerate(values)]
    acc = values[0]
    for i, v in enumerate(values[1:], 1):
        joined = acc.shape[:-1] + (acc.shape[-1] + v.shape[-1],)
        acc = ex.add(node, name if last and i == len(values) - 1 else f"{name}_{i}", "concat", {"a": acc, "b": v},
                     {"out": (acc.dtype, joined)})["out"]
    return _as_shape(ex, node, name, acc, shape)


def _f_cat(ex, node):
    """cat along any axis (_join)."""
    values = [ex.tensor(node, p) for p in list(_arg(node, 0, "tensors"))]
    axis = _axis(ex, node, _arg(node, 1, "dim", 0), len(values[0].shape), "cat")
    return _as_shape(ex, node, node.name, _join(ex, node, values, axis, node.name), ex.result_meta(node)[1])


def _f_roll(ex, node):
    """torch.roll(x, shifts, dims): along each axis the last `shift` elements
    come first, two slices joined; with no dims, the flattened tensor rolled
    and seen back with its shape."""
    x = ex.tensor(node, node.args[0])
    shifts, dims = ex.const(_arg(node, 1, "shifts")), ex.const(_arg(node, 2, "dims", None))
    shifts = list(shifts) if isinstance(shifts, (list, tuple)) else [shifts]
    dims = [] if dims is None else list(dims) if isinstance(dims, (list, tuple)) else [dims]
    v = x
    if not dims:
        if len(shifts) != 1:
            ex.fail(node, f"roll with {len(shifts)} shifts and no dims", "give a dim for each shift")
        v, dims = _as_shape(ex, node, f"{node.name}_flat", x, (math.prod(x.shape),)), [0]
    if len(shifts) != len(dims):
        ex.fail(node, f"roll with {len(shifts)} shifts for {len(dims)} dims", "give one shift per dim")
    for k, (shift, dim) in enumerate(zip(shifts, dims)):
        axis = _axis(ex, node, dim, len(v.shape), "roll")
        size = v.shape[axis]
        s = int(shift) % size
        if s == 0:
            continue
        tail = _slice_axis(ex, node, v, axis, size - s, s, 1, f"{node.name}_{k}_tail")
        head = _slice_axis(ex, node, v, axis, 0, size - s, 1, f"{node.name}_{k}_head")
        v = _join(ex, node, [tail, head], axis, f"{node.name}_{k}")
    return _as_shape(ex, node, node.name, v, ex.result_meta(node)[1])


def _f_repeat_interleave(ex, node):
    """x.repeat_interleave(r, dim): each element r times along dim. x seen as
    [before * size, after], r copies joined along the last axis (element (i,
    j * after + a) is x's (i, a)), seen back as [before, size * r, after]."""
    x = ex.tensor(node, node.args[0])
    repeats, dim = ex.const(_arg(node, 1, "repeats")), ex.const(_arg(node, 2, "dim", None))
    if not isinstance(repeats, int) or repeats < 1:
        ex.fail(node, f"repeat_interleave with repeats {repeats!r}", "give one positive int (per-element counts have no mapping)")
    v = x
    if dim is None:
        v, dim = _as_shape(ex, node, f"{node.name}_flat", x, (math.prod(x.shape),)), 0
    axis = _axis(ex, node, dim, len(v.shape), "repeat_interleave")
    before, after = _rows(v.shape, axis)
    rows = _as_shape(ex, node, f"{node.name}_rows", v, (before * v.shape[axis], after))
    if repeats > 1:
        rows = _join(ex, node, [rows] * repeats, 1, f"{node.name}_copies")
    return _as_shape(ex, node, node.name, rows, ex.result_meta(node)[1])


def _f_expand(ex, node):
    """x.expand(*sizes) (expand_as): each axis of size 1 that grows, copied
    along it (_join of copies); leading axes it adds, as 1s first. A copy,
    where PyTorch makes a view: a broadcasting add or mul needs none, and
    attention over heads repeated this way (LLaMA's repeat_kv) is rewritten
    into grouped-query attention (simplify.py), which reads no copy."""
    v = ex.tensor(node, node.args[0])
    shape = ex.result_meta(node)[1]
    v = _as_shape(ex, node, f"{node.name}_rank", v, (1,) * (len(shape) - len(v.shape)) + tuple(v.shape))
    for axis, size in enumerate(shape):
        if v.shape[axis] != size:
            v = _join(ex, node, [v] * size, axis, f"{node.name}_{axis}")
    return _as_shape(ex, node, node.name, v, shape)


def _f_repeat(ex, node):
    """x.repeat(*sizes): the whole tensor tiled, axis by axis (_join of
    copies); leading axes it adds, as 1s first."""
    v = ex.tensor(node, node.args[0])
    sizes = ex.const(list(node.args[1:]))  # x.repeat(2, 1, 3), or x.repeat((2, 1, 3)) and ATen's repeat(x, [2, 1, 3])
    if len(sizes) == 1 and isinstance(sizes[0], (list, tuple)):
        sizes = sizes[0]
    sizes = [int(r) for r in sizes]
    if len(sizes) < len(v.shape) or any(r < 1 for r in sizes):
        ex.fail(node, f"repeat{tuple(sizes)} of a rank-{len(v.shape)} tensor",
                "give one count per axis, each at least 1 (an empty tensor has no mapping)")
    v = _as_shape(ex, node, f"{node.name}_rank", v, (1,) * (len(sizes) - len(v.shape)) + tuple(v.shape))
    for axis, r in enumerate(sizes):
        if r > 1:
            v = _join(ex, node, [v] * r, axis, f"{node.name}_{axis}")
    return _as_shape(ex, node, node.name, v, ex.result_meta(node)[1])


def _f_pad(ex, node):  # F.pad(x, pad, mode="constant", value=None)
    mode = ex.const(_arg(node, 2, "mode", "constant"))
    if mode != "constant":
        ex.fail(node, f"F.pad in mode '{mode}' has no mapping (constant only)", "pad with a constant value")
    return _pad(ex, node, list(ex.const(_arg(node, 1, "pad"))), ex.const(_arg(node, 3, "value", None)))


def _a_constant_pad(ex, node):  # aten.constant_pad_nd(x, pad, value=0)
    return _pad(ex, node, list(ex.const(_arg(node, 1, "pad"))), ex.const(_arg(node, 2, "value", 0)))


def _pad(ex, node, pad, value):
    """x padded with (left, right, top, bottom, ...) in constant mode: per
    axis from the last, blocks of the value joined before and after (a
    negative pad, which crops, as a slice)."""
    x = ex.tensor(node, node.args[0])
    if len(pad) % 2 or len(pad) // 2 > len(x.shape):
        ex.fail(node, f"F.pad with {len(pad)} sizes for a rank-{len(x.shape)} tensor")
    v = x
    for k in range(len(pad) // 2):
        axis = len(x.shape) - 1 - k
        left, right = int(pad[2 * k]), int(pad[2 * k + 1])
        if left < 0 or right < 0:  # cropping
            start, length = max(-left, 0), v.shape[axis] - max(-left, 0) - max(-right, 0)
            v = _slice_axis(ex, node, v, axis, start, length, 1, f"{node.name}_{k}_crop")
            left, right = max(left, 0), max(right, 0)
        parts = []
        for side, size in (("before", left), ("after", right)):
            if size:
                shape = list(v.shape)
                shape[axis] = size
                block = torch.full(shape, 0.0 if value is None else float(value), dtype=ex.values[node].dtype)
                parts.append((side, ex.constant(node, block, f"{node.name}.{k}.{side}")))
        if parts:
            pieces = [p for side, p in parts if side == "before"] + [v] + [p for side, p in parts if side == "after"]
            v = _join(ex, node, pieces, axis, f"{node.name}_{k}")
    return _as_shape(ex, node, node.name, v, ex.result_meta(node)[1])


def _f_split(ex, node):
    """split and chunk alike, along any axis (seen as [before, size * after],
    as for cat); the parts' sizes come from the recorded result."""
    x = ex.tensor(node, node.args[0])
    results = ex.values[node]
    rank = len(x.shape)
    axis = _axis(ex, node, _arg(node, 2, "dim", 0), rank, "split")
    before, after = _rows(x.shape, axis)
    lead = x.shape[:-1] if axis == rank - 1 else (before,)
    rest = _as_shape(ex, node, f"{node.name}_in", x, lead + (x.shape[axis] * after,))
    sizes = [r.shape[axis] * after for r in results]
    outs = []
    for i, size in enumerate(sizes[:-1]):
        remaining = rest.shape[-1] - size
        pieces = ex.add(node, f"{node.name}_{i}", "split", {"x": rest},
                        {"a": (x.dtype, lead + (size,)), "b": (x.dtype, lead + (remaining,))})
        outs.append(pieces["a"])
        rest = pieces["b"]
    outs.append(rest)
    return tuple(_as_shape(ex, node, f"{node.name}_part{i}", v, r.shape) for i, (v, r) in enumerate(zip(outs, results)))


def _slice_axis(ex, node, v, axis, start, length, step, name):
    """v sliced along one axis: `length` elements from `start` (negative: from the end) by `step` (op slice)."""
    start = start + v.shape[axis] if start < 0 else start
    if start == 0 and step == 1 and length == v.shape[axis]:
        return v
    shape = tuple(v.shape[:axis]) + (length,) + tuple(v.shape[axis + 1:])
    return ex.add(node, name, "slice", {"x": v}, {"out": (v.dtype, shape)},
                  {"axis": axis, "start": start, "step": step})["out"]


def _f_getitem(ex, node):
    container, index = ex.env.get(node.args[0]), ex.const(node.args[1])
    if isinstance(container, tuple) and isinstance(index, int):
        return container[index]
    x = ex.tensor(node, node.args[0])
    # Basic indexing: slices, integers (a slice of one, the axis dropped), ... and None (new
    # axes): a slice per axis it narrows, then the result seen with PyTorch's shape.
    index = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, torch.Tensor) or isinstance(i, (list, bool)) for i in index):
        ex.fail(node, "indexing with a tensor, a list or a bool has no mapping (only slices, integers, ... and None)",
                "use reshape, split or a slice per axis")
    if index.count(Ellipsis) > 1:
        ex.fail(node, "an index with two '...' is not one PyTorch accepts")
    named = sum(1 for i in index if i is not None and i is not Ellipsis)
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (len(x.shape) - named) + index[at + 1:]
    v, axis, part = x, 0, 0
    for i in index:
        if i is None:
            continue
        size = x.shape[axis]
        if isinstance(i, int):
            v = _slice_axis(ex, node, v, axis, i, 1, 1, f"{node.name}_{part}")
        else:
            start, stop, step = i.indices(size)
            length = len(range(start, stop, step))
            if length == 0:
                ex.fail(node, f"the slice {i} of axis {axis} ({size}) is empty; cudagen tensors are not")
            v = _slice_axis(ex, node, v, axis, start, length, step, f"{node.name}_{part}")
        axis, part = axis + 1, part + 1
    return ex.reshape_to(node, v, ex.result_meta(node)[1])


def _f_narrow(ex, node):  # x.narrow(dim, start, length)
    x = ex.tensor(node, node.args[0])
    axis = int(ex.const(_arg(node, 1, "dim"))) % len(x.shape)
    return _slice_axis(ex, node, x, axis, int(ex.const(_arg(node, 2, "start"))), int(ex.const(_arg(node, 3, "length"))),
                       1, node.name)


def _a_slice(ex, node):  # aten.slice.Tensor(x, dim=0, start=None, end=None, step=1)
    x = ex.tensor(node, node.args[0])
    axis = int(ex.const(_arg(node, 1, "dim", 0))) % len(x.shape)
    start, stop, step = slice(ex.const(_arg(node, 2, "start")), ex.const(_arg(node, 3, "end")),
                              ex.const(_arg(node, 4, "step", 1))).indices(x.shape[axis])
    return _slice_axis(ex, node, x, axis, start, len(range(start, stop, step)), step, node.name)


def _a_select(ex, node):  # aten.select.int(x, dim, index): a slice of one, the axis dropped
    x = ex.tensor(node, node.args[0])
    axis = int(ex.const(_arg(node, 1, "dim"))) % len(x.shape)
    v = _slice_axis(ex, node, x, axis, int(ex.const(_arg(node, 2, "index"))), 1, 1, node.name + "_slice")
    return ex.reshape_to(node, v, ex.result_meta(node)[1])


def _f_reduce(op):
    def handler(ex, node):
        x = ex.tensor(node, node.args[0])
        dim = ex.const(_arg(node, 1, "dim"))
        if isinstance(dim, (list, tuple)) and len(dim) == 1:
            dim = dim[0]
        if dim is None:
            ex.fail(node, f"{op} over every axis has no mapping", "reshape to one row and reduce over dim=-1")
        rank = len(x.shape)
        if isinstance(dim, (list, tuple)):
            # Trailing axes (x.mean([2, 3]): a global pool) are one axis of their product, in row-major order.
            axes = sorted(d % rank for d in dim)
            if axes != list(range(rank - len(axes), rank)):
                ex.fail(node, f"{op} over axes {list(dim)} of a rank-{rank} tensor; only the trailing axes map",
                        "permute the axes to the end first")
            x = ex.reshape_to(node, x, tuple(x.shape[:rank - len(axes)]) + (math.prod(x.shape[rank - len(axes):]),),
                              node.name + "_flat")
            dim = -1
        ex.last_axis(node, dim, len(x.shape), op)
        dtype, shape = ex.result_meta(node)
        reduced = x.shape[:-1]
        out = ex.add(node, node.name if reduced == shape else node.name + "_rows", op, {"x": x},
                     {"out": (dtype, reduced)})["out"]
        return out if reduced == shape else ex.reshape_to(node, out, shape)
    return handler


def _f_layer_norm(ex, node):
    x = ex.tensor(node, node.args[0])
    normalized = ex.const(_arg(node, 1, "normalized_shape"))
    if len(normalized) != 1:
        ex.fail(node, f"layer_norm over {tuple(normalized)}; cudagen's layernorm normalises the last axis")
    w, b = _arg(node, 2, "weight"), _arg(node, 3, "bias")
    n = normalized[0]
    wv = ex.tensor(node, w) if w is not None else ex.constant(node, torch.ones(n), f"{node.name}.weight")
    bv = ex.tensor(node, b) if b is not None else ex.constant(node, torch.zeros(n), f"{node.name}.bias")
    return ex.add(node, node.name, "layernorm", {"x": x, "weight": wv, "bias": bv},
                  ex.norm_outputs(node, ("mean", "rstd")), {"eps": float(ex.const(_arg(node, 4, "eps", 1e-5)))})["out"]


def _f_embedding(ex, node):
    ids, table = node.args[0], _arg(node, 1, "weight")
    dtype, shape = ex.result_meta(node)
    return ex.add(node, node.name, "embedding", {"table": ex.tensor(node, table), "ids": ex.tensor(node, ids)},
                  {"out": (dtype, shape)})["out"]


# An additive attention mask's "masked" entries: at or below float16's lowest value (what
# transformers fills with is its dtype's lowest), exp() of a score plus one is 0 in f32 for every
# score under 65000, so the key is left out exactly as a causal mask leaves it out.
_MASKED_BELOW = -65504.0


def _constant_mask_kind(ex, node, mask, scores_shape):
    """What a constant attention mask (one no input reaches: transformers builds its
    causal mask from the sequence length) does: "none" (keeps every key), "causal" (keeps
    key j for query i exactly where j <= i, SDPA's is_causal), or None (anything else)."""
    if mask is None:
        return "none"
    if isinstance(mask, torch.fx.Node) and mask in ex.depends:
        return None
    value = ex.values[mask] if isinstance(mask, torch.fx.Node) else mask
    if not isinstance(value, torch.Tensor):
        return None
    try:
        value = value.expand(scores_shape)
    except RuntimeError:
        return None
    if value.dtype == torch.bool:
        keep = value
    else:
        keep = value == 0
        if not bool(((value == 0) | (value <= _MASKED_BELOW)).all()):
            return None  # a bias that is neither 0 nor "masked": it changes the scores
    if bool(keep.all()):
        return "none"
    n, m = scores_shape[-2], scores_shape[-1]
    causal = torch.ones(n, m, dtype=torch.bool).tril().expand(scores_shape)
    return "causal" if torch.equal(keep, causal) else None


def _f_sdpa(ex, node):
    q, k, v = node.args[0], node.args[1], node.args[2]
    if float(ex.const(_arg(node, 4, "dropout_p", 0.0))) != 0.0:
        ex.fail(node, "scaled_dot_product_attention with dropout has no mapping",
                "export in eval mode (model.eval()), where dropout_p is 0")
    causal = bool(ex.const(_arg(node, 5, "is_causal", False)))
    mask = _arg(node, 3, "attn_mask")
    kind = _constant_mask_kind(ex, node, mask, tuple(ex.values[q].shape[:-1]) + (ex.values[k].shape[-2],))
    bias = None
    if kind is None:  # a mask the inputs change (a padding mask), or another constant one: added to the scores
        value, queries = ex.values[mask] if isinstance(mask, torch.fx.Node) else mask, ex.tensor(node, q)
        if value.dtype == torch.bool:
            if isinstance(mask, torch.fx.Node) and mask in ex.depends:
                ex.fail(node, "scaled_dot_product_attention with a boolean attn_mask the inputs change has no mapping",
                        "pass an additive float mask: 0 where a key is kept, a large negative value where not "
                        "((1.0 - keep.float()) * torch.finfo(q.dtype).min)")
            # A constant one (a sliding window): the additive mask of the same keys.
            lowest = torch.finfo(_TORCH_DTYPES[queries.dtype]).min
            additive = torch.zeros(value.shape, dtype=_TORCH_DTYPES[queries.dtype]).masked_fill(~value.cpu(), lowest)
            bias = ex.constant(node, additive, f"{node.name}.mask")
        else:
            bias = ex.tensor(node, mask)
        if bias.dtype != queries.dtype:
            ex.fail(node, f"scaled_dot_product_attention with a {bias.dtype} attn_mask on {queries.dtype} scores has "
                    "no mapping", "cast the mask to the queries' dtype")
    return ex.attention(node, q, k, v, causal or kind == "causal", ex.const(_arg(node, 6, "scale")),
                        bool(ex.const(_arg(node, 7, "enable_gqa", False))), bias)


def _f_max_pool(ex, node):
    return _max_pool(ex, node, node.args[0], ex.const(_arg(node, 1, "kernel_size")),
                     ex.const(_arg(node, 2, "stride")), ex.const(_arg(node, 3, "padding", 0)),
                     ex.const(_arg(node, 4, "dilation", 1)), ex.const(_arg(node, 5, "ceil_mode", False)),
                     ex.const(_arg(node, 6, "return_indices", False)))


def _f_avg_pool(ex, node):
    return _avg_pool(ex, node, node.args[0], ex.const(_arg(node, 1, "kernel_size")),
                     ex.const(_arg(node, 2, "stride")), ex.const(_arg(node, 3, "padding", 0)),
                     ex.const(_arg(node, 4, "ceil_mode", False)), ex.const(_arg(node, 5, "count_include_pad", True)),
                     ex.const(_arg(node, 6, "divisor_override")))


def _f_gelu(ex, node):
    approximate = node.kwargs.get("approximate", "none")
    return ex.unary(node, "gelu", node.args[0], {"approximate": "tanh" if approximate == "tanh" else "erf"})


def _f_float(ex, node):
    """.float(), and every conversion whose result's dtype PyTorch's run gave: x.to(torch.float16),
    x.to(y), x.type_as(y), .half(), .bfloat16(), .double(). A cast where the dtype changes; a
    device or memory-format argument changes nothing here."""
    v = ex.tensor(node, node.args[0])
    dtype, shape = ex.result_meta(node)
    if v.dtype != dtype:
        return ex.add(node, node.name, "cast", {"x": v}, {"out": (dtype, shape)})["out"]
    return v


def _f_new_empty(ex, node):
    """x.new_empty(shape), torch.empty_like(x): values unspecified (the traced ones are whatever
    the memory held, NaN included), so zeros, which every later write or fill overrides."""
    return ex.constant(node, torch.zeros_like(ex.values[node]), f"{node.name}.constant")


def _f_like_constant(ex, node):
    """torch.zeros_like(x), x.new_zeros(n), torch.full_like(x, v), ...: a tensor whose values do
    not depend on x's (only its shape and dtype, which are static): a constant."""
    return ex.constant(node, ex.values[node], f"{node.name}.constant")


def _row_norm(ex, node, x, dtype):
    """The 2-norm of each row of x (over its last axis), in `dtype`: pow 2, sum, sqrt."""
    rows = x.shape[:-1]
    squares = ex.add(node, node.name + "_squares", "pow", {"x": x}, {"out": (x.dtype, x.shape)}, {"exponent": 2.0})["out"]
    sums = ex.add(node, node.name + "_sum", "sum", {"x": squares}, {"out": (dtype, rows)})["out"]
    return ex.add(node, node.name + "_rows", "sqrt", {"x": sums}, {"out": (dtype, rows)})["out"]


def _f_vector_norm(ex, node):
    """torch.linalg.vector_norm(x, 2, dim=-1) (F.normalize's, Swin V2's cosine attention):
    the square root of the sum of squares over the last axis, keepdim or not."""
    x = ex.tensor(node, node.args[0])
    order, dim = ex.const(_arg(node, 1, "ord", 2)), ex.const(_arg(node, 2, "dim"))
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    if float(order) != 2.0 or dim is None or isinstance(dim, (list, tuple)):
        ex.fail(node, f"vector_norm of order {order} over {dim} has no mapping; the 2-norm over one axis maps",
                "compute it as torch.sqrt((x * x).sum(-1)) over the last axis")
    ex.last_axis(node, dim, len(x.shape), "vector_norm")
    dtype, shape = ex.result_meta(node)
    return ex.reshape_to(node, _row_norm(ex, node, x, dtype), shape)


def _values_ignore_inputs(node):
    """Whether an fx node's values do not depend on its inputs' values (zeros_like,
    x.new_zeros, full_like, ...: only on static shapes and dtypes), so that what is built
    from it, such as Swin's shifted-window mask filled in place, is a constant."""
    if node.op == "call_method":
        return METHODS.get(node.target) is _f_like_constant
    if node.op == "call_function":
        return FUNCTIONS.get(node.target) is _f_like_constant
    return False


def _f_fill(ex, node):
    """x.fill_(v), x.zero_(): a constant of x's shape (readers after the update read it, as
    for every in-place method), where v is a number or a tensor the inputs do not reach. Made
    afresh from v: the recorded result is x itself, which a later in-place update changes."""
    value = _arg(node, 1, "value", 0)
    if isinstance(value, torch.fx.Node) and value in ex.depends:
        ex.fail(node, "fill_ with a value computed from the inputs has no mapping",
                "multiply torch.ones_like(x) by the value")
    value = ex.const(value)
    filled = torch.full_like(ex.values[node], float(value.item() if isinstance(value, torch.Tensor) else value))
    return ex.constant(node, filled, f"{node.name}.constant")


FUNCTIONS = {
    operator.add: _arith("add"), torch.add: _arith("add"), operator.iadd: _arith("add"),
    operator.sub: _arith("sub"), torch.sub: _arith("sub"),
    operator.mul: _arith("mul"), torch.mul: _arith("mul"), operator.imul: _arith("mul"),
    operator.truediv: _arith("div"), torch.div: _arith("div"),
    operator.neg: _f_unary("neg"), torch.neg: _f_unary("neg"),
    operator.eq: _compare("eq"), torch.eq: _compare("eq"), operator.ne: _compare("ne"), torch.ne: _compare("ne"),
    operator.matmul: _f_matmul, torch.matmul: _f_matmul, torch.bmm: _f_matmul,
    operator.getitem: _f_getitem, torch.narrow: _f_narrow, torch.unflatten: _f_reshape,
    torch.zeros_like: _f_like_constant, torch.ones_like: _f_like_constant, torch.full_like: _f_like_constant,
    torch.empty_like: _f_new_empty,
    torch.relu: _f_unary("relu"), F.relu: _f_unary("relu"), F.relu6: _f_unary("relu6"),
    F.gelu: _f_gelu, F.silu: _f_unary("silu"), torch.sigmoid: _f_unary("sigmoid"), F.sigmoid: _f_unary("sigmoid"),
    torch.tanh: _f_unary("tanh"), F.tanh: _f_unary("tanh"), F.hardswish: _f_unary("hardswish"),
    F.hardsigmoid: _f_unary("hardsigmoid"),
    torch.exp: _f_unary("exp"), torch.log: _f_unary("log"),
    torch.sqrt: _f_unary("sqrt"), torch.rsqrt: _f_unary("rsqrt"), torch.pow: _f_pow, operator.pow: _f_pow,
    F.softmax: _f_softmax("softmax"), torch.softmax: _f_softmax("softmax"),
    F.log_softmax: _f_softmax("log_softmax"), torch.log_softmax: _f_softmax("log_softmax"),
    F.linear: _f_linear, torch.addmm: _f_addmm, F.conv2d: _f_conv2d, F.layer_norm: _f_layer_norm, F.embedding: _f_embedding,
    torch.flatten: _f_reshape, torch.reshape: _f_reshape,
    torch.transpose: _f_transpose, torch.swapaxes: _f_transpose, torch.swapdims: _f_transpose,
    torch.permute: _f_permute, torch.t: _f_t,
    torch.cat: _f_cat, torch.concat: _f_cat, torch.split: _f_split, torch.roll: _f_roll,
    torch.repeat_interleave: _f_repeat_interleave, F.pad: _f_pad,
    torch.chunk: _f_split,
    torch.mean: _f_reduce("mean"), torch.sum: _f_reduce("sum"),
    F.dropout: _f_dropout, torch.dropout: _f_dropout, F.max_pool2d: _f_max_pool, F.avg_pool2d: _f_avg_pool,
    F.adaptive_avg_pool2d: lambda ex, node: ex.unary(node, "adaptive_avg_pool2d", node.args[0]),
}
if hasattr(F, "scaled_dot_product_attention"):
    FUNCTIONS[F.scaled_dot_product_attention] = _f_sdpa
try:  # torchvision wraps it for torch.fx: a call of its own in the traced graph
    import torchvision.ops

    FUNCTIONS[torchvision.ops.stochastic_depth] = _f_stochastic_depth
except ImportError:
    pass

METHODS = {
    "eq": _compare("eq"), "ne": _compare("ne"),
    "add": _arith("add"), "sub": _arith("sub"), "mul": _arith("mul"), "div": _arith("div"),
    "add_": _arith("add"), "mul_": _arith("mul"),
    "neg": _f_unary("neg"), "relu": _f_unary("relu"), "sigmoid": _f_unary("sigmoid"), "tanh": _f_unary("tanh"),
    "exp": _f_unary("exp"), "log": _f_unary("log"),
    "sqrt": _f_unary("sqrt"), "rsqrt": _f_unary("rsqrt"), "pow": _f_pow,
    "matmul": _f_matmul, "bmm": _f_matmul,
    "softmax": _f_softmax("softmax"), "log_softmax": _f_softmax("log_softmax"),
    "view": _f_reshape, "reshape": _f_reshape, "flatten": _f_reshape, "view_as": _f_reshape,
    "reshape_as": _f_reshape, "squeeze": _f_reshape, "unsqueeze": _f_reshape,
    "transpose": _f_transpose, "swapaxes": _f_transpose, "swapdims": _f_transpose, "permute": _f_permute, "t": _f_t,
    "contiguous": _f_identity, "float": _f_float, "to": _f_float, "type_as": _f_float, "type": _f_float, "half": _f_float,
    "bfloat16": _f_float, "double": _f_float, "unflatten": _f_reshape,
    "new_zeros": _f_like_constant, "new_ones": _f_like_constant, "new_full": _f_like_constant,
    "new_empty": _f_like_constant, "fill_": _f_fill, "zero_": _f_fill,
    "split": _f_split, "chunk": _f_split, "narrow": _f_narrow,
    "roll": _f_roll, "repeat_interleave": _f_repeat_interleave, "expand": _f_expand, "expand_as": _f_expand,
    "repeat": _f_repeat,
    "mean": _f_reduce("mean"), "sum": _f_reduce("sum"),
    "masked_fill": _f_masked_fill,
}
FUNCTIONS[torch.Tensor.masked_fill] = _f_masked_fill
FUNCTIONS[torch.where] = _f_where


# ---- ATen operators (torch.export) -----------------------------------------------
# torch.export's graphs (PyTorch 2.x, the training IR) call ATen overloads
# that keep the functional API's positional arguments, so most reuse the
# handlers above; those that differ have their own.

def _a_batch_norm(ex, node):
    if node in ex.folded_bn:
        return ex.env[ex.folded_bn[node]]  # already in the convolution's weights
    args = _batch_norm_args(node)
    if ex.const(args["training"]):  # torch.export of a train-mode module: batch statistics, running ones moved
        def tensor(key):
            return ex.const(args[key]) if args[key] is not None else None
        statistics = args["running_mean"]
        name = statistics.target.rsplit(".", 1)[0] if isinstance(statistics, torch.fx.Node) and \
            statistics.op == "get_attr" else node.name
        momentum = ex.const(args["momentum"])
        # momentum=None (a cumulative average) reaches the graph as this call's factor, a number:
        # the module says what it is.
        try:
            owner = ex.root.get_submodule(name) if ex.root is not None else None
        except AttributeError:
            owner = None
        if isinstance(owner, nn.modules.batchnorm._BatchNorm) and owner.momentum is None:
            momentum = None
        return _batchnorm_batch_statistics(ex, node, node.args[0], tensor("weight"), tensor("bias"),
                                           tensor("running_mean"), tensor("running_var"), momentum,
                                           ex.const(args["eps"]), name)
    if ex.training and args["weight"] is not None and not ex.const(args["training"]):
        mean, var = ex.const(args["running_mean"]), ex.const(args["running_var"])
        if mean is not None and var is not None:
            return _frozen_batchnorm(ex, node, node.args[0], ex.tensor(node, args["weight"]),
                                     ex.tensor(node, args["bias"]) if args["bias"] is not None else None, mean, var,
                                     float(ex.const(args["eps"])), node.name)
    return _scale_shift(ex, node, node.args[0], *ex.batchnorm_affine(node), node.name)


def _a_batch_norm_no_training(ex, node):
    """aten._native_batch_norm_legit_no_training (torch.export on PyTorch 2.5): eval-mode
    batch_norm as a tuple (out, saved mean, saved inverse std) whose readers take out."""
    return (_a_batch_norm(ex, node), None, None)


def _a_embedding(ex, node):  # aten.embedding(weight, indices): the table first
    dtype, shape = ex.result_meta(node)
    return ex.add(node, node.name, "embedding", {"table": ex.tensor(node, node.args[0]),
                                                 "ids": ex.tensor(node, node.args[1])}, {"out": (dtype, shape)})["out"]


def _a_hardtanh(ex, node):  # F.relu6 is hardtanh(x, 0, 6) in ATen
    low, high = float(ex.const(_arg(node, 1, "min_val", -1.0))), float(ex.const(_arg(node, 2, "max_val", 1.0)))
    if (low, high) != (0.0, 6.0):
        ex.fail(node, f"hardtanh({low}, {high}) has no mapping; only relu6 (hardtanh(0, 6)) does")
    return ex.unary(node, "relu6", node.args[0])


def _f_einsum(ex, node):
    """torch.einsum of two operands that is a batched matrix product (MaxViT's attention:
    "bghid,bghjd->bghij"): the same leading letters in both operands and the result, one
    letter contracted, each operand's other letter kept, in either order (trans_a, trans_b).
    Any other equation has no mapping."""
    equation, operands = ex.const(node.args[0]), node.args[1]
    if not isinstance(operands, (list, tuple)):
        operands = node.args[1:]
    hint = "write it with matmul (@), transpose and reshape"
    spec = "".join(equation.split())
    if "->" not in spec or "." in spec or len(operands) != 2:
        ex.fail(node, f"einsum('{equation}') has no mapping: only two operands and an explicit '->' result", hint)
    inputs, result = spec.split("->")
    left, right = inputs.split(",") if inputs.count(",") == 1 else ("", "")
    batch = result[:-2]
    i, j = result[-2:] if len(result) >= 2 else ("", "")
    contracted = set(left) & set(right) - set(result)
    if (len(contracted) != 1 or not left or len(left) != len(right) or len(left) != len(result)
            or not left.startswith(batch) or not right.startswith(batch) or len(set(result)) != len(result)):
        ex.fail(node, f"einsum('{equation}') is not a batched matrix product", hint)
    k = contracted.pop()
    a_tail, b_tail = left[len(batch):], right[len(batch):]
    if sorted(a_tail) != sorted(i + k) or sorted(b_tail) != sorted(k + j):
        ex.fail(node, f"einsum('{equation}') is not a batched matrix product", hint)
    args = {}
    if a_tail == k + i:
        args["trans_a"] = True
    if b_tail == j + k:
        args["trans_b"] = True
    dtype, shape = ex.result_meta(node)
    return ex.add(node, node.name, "matmul", {"a": ex.tensor(node, operands[0]), "b": ex.tensor(node, operands[1])},
                  {"out": (dtype, shape)}, args or None)["out"]


FUNCTIONS[torch.einsum] = _f_einsum


def _f_normalize(ex, node):
    """F.normalize(x, p=2, dim=-1, eps): x over max(its 2-norm over the last axis, eps), as
    Swin V2's cosine attention calls it on the torch.fx path (torch.export shows its ATen ops)."""
    x = ex.tensor(node, node.args[0])
    order, dim, eps = (ex.const(_arg(node, i, name, default)) for i, name, default in
                       ((1, "p", 2.0), (2, "dim", 1), (3, "eps", 1e-12)))
    ex.last_axis(node, dim, len(x.shape), "normalize")
    if float(order) != 2.0:
        ex.fail(node, f"F.normalize with p={order} has no mapping; p=2 does")
    rows = x.shape[:-1]
    norm = _row_norm(ex, node, x, x.dtype)
    floor = ex.constant(node, torch.tensor(float(eps), dtype=ex.values[node].dtype), f"{node.name}.eps")
    norm = ex.add(node, node.name + "_floor", "maximum", {"a": norm, "b": floor}, {"out": (x.dtype, rows)})["out"]
    norm = _as_shape(ex, node, node.name + "_keepdim", norm, rows + (1,))
    return ex.add(node, node.name, "div", {"a": x, "b": norm}, {"out": (x.dtype, x.shape)})["out"]


FUNCTIONS[F.normalize] = _f_normalize


def _f_clamp_min(ex, node):
    """ATen's clamp_min(x, v) and clamp(x, v) (F.normalize's floor under a norm, on the
    torch.export path): `maximum` with v, a constant tensor; a bound that is a tensor the
    inputs change, or an upper bound, has no mapping."""
    low, high = _arg(node, 1, "min"), _arg(node, 2, "max")
    if high is not None or low is None or (isinstance(low, torch.fx.Node) and low in ex.depends):
        ex.fail(node, "clamp maps only with a constant lower bound (clamp_min)", "use torch.maximum(x, y) for a tensor bound")
    x = ex.tensor(node, node.args[0])
    bound = ex.values[low] if isinstance(low, torch.fx.Node) else torch.tensor(float(low))
    floor = ex.constant(node, bound.to(ex.values[node].dtype).reshape(()), f"{node.name}.min")
    dtype, shape = ex.result_meta(node)
    return ex.add(node, node.name, "maximum", {"a": x, "b": floor}, {"out": (dtype, shape)})["out"]


def _a_gelu(ex, node):
    approximate = ex.const(_arg(node, 1, "approximate", "none"))
    return ex.unary(node, "gelu", node.args[0], {"approximate": "tanh" if approximate == "tanh" else "erf"})


def _a_rms_norm(ex, node):  # aten.rms_norm(input, normalized_shape, weight, eps)
    x = ex.tensor(node, node.args[0])
    normalized = ex.const(_arg(node, 1, "normalized_shape"))
    if len(normalized) != 1:
        ex.fail(node, f"rms_norm over {tuple(normalized)}; cudagen's rmsnorm normalises the last axis")
    w = _arg(node, 2, "weight")
    wv = ex.tensor(node, w) if w is not None else ex.constant(node, torch.ones(normalized[0]), f"{node.name}.weight")
    eps = ex.const(_arg(node, 3, "eps"))
    eps = torch.finfo(torch.float32).eps if eps is None else eps
    return ex.add(node, node.name, "rmsnorm", {"x": x, "weight": wv}, ex.norm_outputs(node, ("rstd",)),
                  {"eps": float(eps)})["out"]


_BATCH_NORM_ARGS = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps")
_BATCH_NORM_NO_TRAINING_ARGS = ("input", "weight", "bias", "running_mean", "running_var", "momentum", "eps")


def _batch_norm_args(node):
    """A batch_norm node's arguments by name, whichever aten form it is (the no-training form
    has no `training` and its eps one place earlier)."""
    no_training = str(node.target).split(".")[-2].endswith("_no_training")
    names = _BATCH_NORM_NO_TRAINING_ARGS if no_training else _BATCH_NORM_ARGS
    args = {n: _arg(node, i, n) for i, n in enumerate(names)}
    args["training"] = False if no_training else args["training"]
    args["eps"] = 1e-5 if args["eps"] is None else args["eps"]
    return args


def _aten_handlers():
    """ATen overload -> handler, for the overloads this PyTorch has."""
    names = {
        "linear.default": _f_linear, "conv2d.default": _f_conv2d, "batch_norm.default": _a_batch_norm,
        "_native_batch_norm_legit_no_training.default": _a_batch_norm_no_training,
        "layer_norm.default": _f_layer_norm, "rms_norm.default": _a_rms_norm, "embedding.default": _a_embedding,
        "add.Tensor": _arith("add"), "add_.Tensor": _arith("add"), "add.Scalar": _arith("add"),
        "sub.Tensor": _arith("sub"), "sub.Scalar": _arith("sub"),
        "mul.Tensor": _arith("mul"), "mul_.Tensor": _arith("mul"), "mul.Scalar": _arith("mul"),
        "div.Tensor": _arith("div"), "div.Scalar": _arith("div"),
        "eq.Tensor": _compare("eq"), "eq.Scalar": _compare("eq"), "ne.Tensor": _compare("ne"),
        "ne.Scalar": _compare("ne"),
        "neg.default": _f_unary("neg"), "exp.default": _f_unary("exp"), "log.default": _f_unary("log"),
        "sqrt.default": _f_unary("sqrt"), "rsqrt.default": _f_unary("rsqrt"), "pow.Tensor_Scalar": _f_pow,
        "relu.default": _f_unary("relu"), "relu_.default": _f_unary("relu"),
        "hardtanh.default": _a_hardtanh, "hardtanh_.default": _a_hardtanh,
        "gelu.default": _a_gelu, "silu.default": _f_unary("silu"), "silu_.default": _f_unary("silu"),
        "sigmoid.default": _f_unary("sigmoid"), "tanh.default": _f_unary("tanh"),
        "hardswish.default": _f_unary("hardswish"), "hardswish_.default": _f_unary("hardswish"),
        "hardsigmoid.default": _f_unary("hardsigmoid"), "hardsigmoid_.default": _f_unary("hardsigmoid"),
        "dropout.default": _f_dropout,
        "matmul.default": _f_matmul, "bmm.default": _f_matmul, "mm.default": _f_matmul, "addmm.default": _f_addmm,
        "softmax.int": _f_softmax("softmax"), "_softmax.default": _f_softmax("softmax"),
        "log_softmax.int": _f_softmax("log_softmax"), "_log_softmax.default": _f_softmax("log_softmax"),
        "masked_fill.Scalar": _f_masked_fill, "where.self": _f_where,
        "view.default": _f_reshape, "reshape.default": _f_reshape, "_unsafe_view.default": _f_reshape,
        "flatten.using_ints": _f_reshape, "squeeze.dim": _f_reshape, "squeeze.default": _f_reshape,
        "unsqueeze.default": _f_reshape,
        "transpose.int": _f_transpose, "permute.default": _f_permute, "t.default": _f_t,
        "contiguous.default": _f_identity, "clone.default": _f_identity, "alias.default": _f_identity,
        "to.dtype": _f_float, "to.dtype_layout": _f_float, "_to_copy.default": _f_float, "type_as.default": _f_float,
        "zeros_like.default": _f_like_constant, "ones_like.default": _f_like_constant,
        "full_like.default": _f_like_constant, "new_zeros.default": _f_like_constant,
        "new_ones.default": _f_like_constant,
        "new_empty.default": _f_new_empty, "new_full.default": _f_like_constant, "unflatten.int": _f_reshape,
        "empty_like.default": _f_new_empty, "fill.Scalar": _f_fill, "fill_.Scalar": _f_fill, "zero.default": _f_fill, "zero_.default": _f_fill,
        "slice.Tensor": _a_slice, "select.int": _a_select, "narrow.default": _f_narrow,
        "cat.default": _f_cat, "split.Tensor": _f_split, "split_with_sizes.default": _f_split,
        "chunk.default": _f_split, "roll.default": _f_roll, "constant_pad_nd.default": _a_constant_pad,
        "pad.default": _f_pad,  # torch.export on PyTorch 2.11 keeps F.pad as aten.pad
        "repeat_interleave.self_int": _f_repeat_interleave, "expand.default": _f_expand, "repeat.default": _f_repeat,
        "mean.dim": _f_reduce("mean"), "sum.dim_IntList": _f_reduce("sum"),
        "scaled_dot_product_attention.default": _f_sdpa, "linalg_vector_norm.default": _f_vector_norm,
        "einsum.default": _f_einsum, "clamp_min.default": _f_clamp_min, "swapaxes.default": _f_transpose,
        "swapdims.default": _f_transpose, "clamp.default": _f_clamp_min, "expand_as.default": _f_expand,
        "max_pool2d.default": _f_max_pool, "avg_pool2d.default": _f_avg_pool,
        "adaptive_avg_pool2d.default": lambda ex, node: ex.unary(node, "adaptive_avg_pool2d", node.args[0]),
    }
    table = {}
    for name, handler in names.items():
        packet, _, overload = name.partition(".")
        try:
            op = getattr(getattr(torch.ops.aten, packet), overload)
        except (AttributeError, RuntimeError):
            continue  # not in this PyTorch
        table[op] = handler
    return table


ATEN = _aten_handlers()


def _pure_aten(target):
    """The out-of-place ATen overload of an in-place one (aten.dropout_.default ->
    aten.dropout.default), or None: torch.export's graph reads the update's result where
    the model reads the updated tensor afterwards, so the pure op maps it."""
    name = str(target)
    if not name.startswith("aten.") or name.count(".") != 2:
        return None
    _, packet, overload = name.split(".")
    if not packet.endswith("_") or packet.endswith("__"):
        return None
    try:
        return getattr(getattr(torch.ops.aten, packet[:-1]), overload)
    except (AttributeError, RuntimeError):
        return None
FUNCTIONS.update(ATEN)
_BATCH_NORM = {op for op, h in ATEN.items() if h in (_a_batch_norm, _a_batch_norm_no_training)}
_CONV2D = {F.conv2d} | {op for op, h in ATEN.items() if h is _f_conv2d}
_SOFTMAX = {F.softmax, torch.softmax, "softmax"} | {op for op in ATEN if str(op).split(".")[1] in ("softmax", "_softmax")}


def supported_targets():
    """Every module type, function, tensor method and ATen operator the
    frontend maps, as fx names them in messages."""
    names = {f"torch.nn.{m.__name__}" for m in MODULES}
    for f in FUNCTIONS:
        if _is_aten(f):
            names.add(str(f))
            continue
        module = getattr(f, "__module__", "") or ""
        name = getattr(f, "__name__", repr(f))
        names.add(f"operator.{name}" if module in ("_operator", "operator")
                  else f"F.{name}" if module.startswith("torch.nn.functional") else f"torch.{name}")
    names |= {f"Tensor.{m}" for m in METHODS}
    return sorted(names)


# Unsupported operators and what a model can write instead with supported
# ones: real equivalents, not names that merely look alike (string distance
# suggested F.dropout for pow). By operator name, in either vocabulary.
_EQUIVALENTS = {
    "square": ("x * x, or x ** 2", ["mul", "pow"]),
    "baddbmm": ("torch.bmm then +", ["bmm", "add"]),
    "scaled_dot_product_attention": ("softmax(q @ k^T * scale) @ v written out", ["matmul", "softmax", "masked_fill"]),
    "max": ("F.max_pool2d for pooling; a row max feeds only softmax here", ["max_pool2d", "softmax"]),
    "var": ("nn.LayerNorm / F.layer_norm", ["layer_norm", "LayerNorm"]),
    "std": ("nn.LayerNorm / F.layer_norm", ["layer_norm", "LayerNorm"]),
}


def _op_name(target_name):
    """An operator's bare name from _target_name's: aten.sum.dim_IntList -> sum,
    torch.nn.Linear -> Linear, F.relu -> relu, Tensor.expand -> expand."""
    return target_name.split(".")[1] if target_name.startswith("aten.") else target_name.rsplit(".", 1)[-1]


def _nearest_targets(target, n=4):
    """Supported targets a model could use instead of `target`, in its own
    vocabulary (ATen names for an ATen operator): those of the table of real
    equivalents above, or `target`'s pure or in-place sibling (relu_ and
    relu); none otherwise."""
    aten = target.startswith("aten.")
    by_name = {}
    for t in supported_targets():
        if t.startswith("aten.") == aten:
            by_name.setdefault(_op_name(t), []).append(t)
    name = _op_name(target)
    names = _EQUIVALENTS.get(name.rstrip("_"), (None, []))[1]
    if not names:
        names = [n for n in (name.rstrip("_"), name.rstrip("_") + "_") if n != name]
    return [t for n in names for t in by_name.get(n, [])][:n]


def _equivalent_hint(target):
    """How to write `target` with supported operators, or None."""
    name = target.split(".")[1] if target.startswith("aten.") else target.rsplit(".", 1)[-1]
    return _EQUIVALENTS.get(name.rstrip("_"), (None, []))[0]


# ---- the entry point -------------------------------------------------------------

# Functions torchvision wraps for torch.fx (a call of their own in the traced graph) that are
# model code to trace through: with static shapes their Python runs once, on the example.
_TRACE_THROUGH = {"shifted_window_attention", "_get_relative_position_bias", "_patch_merging_pad"}


@contextlib.contextmanager
def _tracing_through_wrapped():
    import torch.fx._symbolic_trace as symbolic_trace
    patched = getattr(symbolic_trace, "_wrapped_fns_to_patch", None)
    if isinstance(patched, list):  # 1.13: [(globals, name)]
        saved = list(patched)
        patched[:] = [(frame, name) for frame, name in saved if name not in _TRACE_THROUGH]
        restore = lambda: patched.__setitem__(slice(None), saved)  # noqa: E731
    elif isinstance(patched, dict):  # 2.x: {(id(globals), name): globals}
        saved = dict(patched)
        for key in [k for k in saved if isinstance(k, tuple) and k[-1] in _TRACE_THROUGH]:
            del patched[key]
        restore = lambda: (patched.clear(), patched.update(saved))  # noqa: E731
    else:
        restore = lambda: None  # noqa: E731
    try:
        yield
    finally:
        restore()


def _trace(module, example_inputs):
    tracer = _Tracer(example_inputs)
    try:
        with _tracing_through_wrapped():
            graph = tracer.trace(module)
    except Exception as e:  # noqa: BLE001: tracing failures come as many types
        frames = [f for f in traceback.extract_tb(e.__traceback__) if "torch" + os.sep not in f.filename
                  and os.path.basename(os.path.dirname(f.filename)) != "cudagen_torch"]
        where = f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})" if frames else "unknown place"
        raise ExportError(
            f"torch.fx could not trace the model at {where}: {type(e).__name__}: {e}\n"
            "  a data-dependent shape or control flow on tensor values cannot be captured; "
            "make it depend on constants, or wrap it in a leaf module") from None
    gm = torch.fx.GraphModule(tracer.root, graph, module.__class__.__name__)
    _functionalize_in_place(gm)
    _eliminate_dead_code(gm.graph)  # the shape queries that became constants
    gm.recompile()
    return gm


# Tensor methods and modules that return a view of their input: an in-place
# update through one also changes the tensor it views.
_VIEW_METHODS = {"view", "view_as", "reshape", "reshape_as", "transpose", "permute", "t", "squeeze", "unsqueeze",
                 "flatten", "expand", "expand_as", "narrow", "select", "split", "chunk", "unbind", "__getitem__"}


def _in_place(node):
    """Whether fx node `node` updates its first argument in place: a tensor
    method such as `add_` or `relu_`, a function given inplace=True (F.relu),
    or a module built with inplace=True (nn.ReLU(inplace=True))."""
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.endswith("__")
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        return node.kwargs.get("inplace", False) is True or (name.endswith("_") and not name.endswith("__"))
    if node.op == "call_module":
        return getattr(node.graph.owning_module.get_submodule(node.target), "inplace", False) is True
    return False


def _updates_first_argument(node):
    """_in_place, and an in-place ATen overload on the torch.export path (aten.add_.Tensor)."""
    if _in_place(node):
        return True
    name = str(node.target) if node.op == "call_function" else ""
    return name.startswith("aten.") and name.count(".") == 2 and name.split(".")[1].endswith("_") \
        and not name.split(".")[1].endswith("__")


def _functionalize_in_place(gm):
    """fx records `y.add_(1)` as a node whose result nobody reads while later
    code reads `y`: dead-code elimination then dropped the update, and both
    the export and its expected outputs silently lacked it. Here every reader
    of the updated tensor after the update reads the update's result instead,
    so the graph is functional and the mapping's pure ops are right. An
    update through a view of a tensor still read afterwards cannot be written
    that way, and is refused."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        if not _in_place(node) or not node.args or not isinstance(node.args[0], torch.fx.Node):
            continue
        target = node.args[0]
        base = target.args[0] if (target.op == "call_method" and target.target in _VIEW_METHODS) or (
            target.op == "call_function" and getattr(target.target, "__name__", "") == "getitem") else None
        read_after = isinstance(base, torch.fx.Node) and any(order[u] > order[node] for u in base.users if u is not target)
        # (A reader before it whose result nothing reads is a shape query, a constant already.)
        read_before = read_after and any(order[u] < order[node] and u.users for u in base.users if u is not target)
        if read_after and not read_before and not _reaches_from_input(base):
            node.meta["cudagen_view_update_of"] = base.name
        elif read_after:
            raise ExportError(
                f"fx node '{node.name}' (target {_target_name(node)}, at {_source_line(node)}): an in-place update "
                f"of '{target.name}', a view of '{base.name}', which is read afterwards: cudagen's graphs are "
                "functional; write the update out of place (y = y + 1, not y.add_(1))")
        for user in list(target.users):
            if user is not node and order[user] > order[node]:
                user.replace_input_with(target, node)


def _eliminate_dead_code(graph):
    """torch.fx's dead-code elimination, except that an update in place of a constant
    through a view (marked by _functionalize_in_place) stays: nothing reads its result,
    but the recorded run must perform it for the constant's readers."""
    for node in reversed(list(graph.nodes)):
        if node.op in ("placeholder", "output") or node.users or node.meta.get("cudagen_view_update_of"):
            continue
        if node.op in ("call_function", "call_method", "call_module", "get_attr") and not node.is_impure():
            graph.erase_node(node)


def _reaches_from_input(node):
    """Whether a graph input flows into fx node `node`. An update through a view of a tensor
    no input reaches (Swin V2's qkv_bias.clone() zeroed in its middle third) is a constant's
    construction, which the recorded run performs as written; the mapping folds it. (Its
    parameters then do not train: a training export refuses such a model where a trained
    parameter reaches the update, see _Exporter.run.)"""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            return True
        stack.extend(n.all_input_nodes)
    return False


def _export_keeps_training_ops():
    """Whether torch.export keeps training-mode batch_norm and dropout as aten.batch_norm and
    aten.dropout (PyTorch 2.6's training IR), which the mapping reads; earlier versions decompose
    them into ops it does not map."""
    major, minor = (int("".join(c for c in part if c.isdigit()) or 0) for part in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 6)


def _has_torch_export():
    export = getattr(torch, "export", None)
    return hasattr(export, "export") and hasattr(getattr(export, "ExportedProgram", None), "module")


def _export_program(module, example_inputs):
    """torch.export (PyTorch 2.x), non-strict where the version lets us choose
    (the model runs as Python, so a failure points at its own line): the
    unlifted GraphModule, whose parameters and buffers are get_attr nodes
    named as the module names them."""
    import inspect
    import logging
    options = {"strict": False} if "strict" in inspect.signature(torch.export.export).parameters else {}
    quiet = logging.getLogger("torch")  # its warnings about guards repeat what the error below says
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        program = torch.export.export(module, tuple(example_inputs), **options)
    except Exception as e:  # noqa: BLE001: export failures come as many types
        frames = [f for f in traceback.extract_tb(e.__traceback__) if "torch" + os.sep not in f.filename
                  and os.path.basename(os.path.dirname(f.filename)) != "cudagen_torch" and f.filename != "<string>"]
        where = f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})" if frames else "unknown place"
        first_line = (str(e).strip().splitlines() or [""])[0]
        raise ExportError(
            f"torch.export could not capture the model at {where}: {type(e).__name__}: {first_line}\n"
            "  a data-dependent shape or control flow on tensor values cannot be captured; make it depend on "
            "constants (tracer='fx' traces some models torch.export cannot)") from None
    finally:
        quiet.setLevel(level)
    return program.module()


TRACERS = ("auto", "export", "fx")


def _capture(module, example_inputs, tracer):
    """The model as an fx GraphModule, and the name of the path taken."""
    if tracer not in TRACERS:
        raise ExportError(f"tracer={tracer!r}: use one of {', '.join(TRACERS)}")
    if tracer == "auto":
        tracer = "export" if _has_torch_export() else "fx"
    if tracer == "fx":
        return _trace(module, example_inputs), "torch.fx.symbolic_trace"
    if not _has_torch_export():
        raise ExportError(f"tracer='export' needs torch.export (PyTorch 2.2 or later), this is {torch.__version__}; "
                          "use tracer='fx'")
    return _export_program(module, example_inputs), "torch.export"


def _enclosing_autocast_dtype():
    """The dtype of the torch.autocast (CUDA's, else the CPU's) the caller runs in, or None."""
    if hasattr(torch, "get_autocast_dtype"):  # PyTorch 2.4 and later: one function a device
        for device in ("cuda", "cpu"):
            if torch.is_autocast_enabled(device):
                return torch.get_autocast_dtype(device)
        return None
    if torch.is_autocast_enabled():
        return torch.get_autocast_gpu_dtype()
    if torch.is_autocast_cpu_enabled():
        return torch.get_autocast_cpu_dtype()
    return None


def _autocast_precision(precision, loss):
    """The training's precision policy: `precision` as given ("bf16",
    torch.bfloat16, "f16" or torch.float16), else the dtype of the
    torch.autocast the export runs in (CUDA's or the CPU's), else None (f32
    throughout)."""
    if precision is None:
        precision = _enclosing_autocast_dtype()
        if precision is None:
            return None
    names = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
    precision = names.get(precision, precision)
    if precision not in ("bf16", "f16", "f32"):
        raise ExportError(f"precision={precision!r} has no mapping; use 'bf16' (torch.bfloat16) or 'f16' "
                          "(torch.float16)")
    if loss is None:
        raise ExportError(f"precision={precision!r} (or a torch.autocast around the export) is a training policy: "
                          "pass loss= as well, or export outside torch.autocast")
    return None if precision == "f32" else precision


def _loss_scale(loss_scale, optimizer, precision):
    """The training section's "loss_scale": "dynamic", or GradScaler's
    arguments as a dict (init_scale, growth_factor, backoff_factor,
    growth_interval, as torch.cuda.amp.GradScaler names them); None for none
    (float16 then scales dynamically with GradScaler's defaults)."""
    if loss_scale is None and precision != "f16":
        return None
    if optimizer is None:
        raise ExportError("loss scaling (float16 autocast, or loss_scale=) scales the loss for the optimizer, which "
                          "unscales the gradients: pass optimizer= too")
    if loss_scale is None or loss_scale == "dynamic":
        return "dynamic" if loss_scale is not None else None
    names = {"init_scale": "initial", "growth_factor": "growth_factor", "backoff_factor": "backoff_factor",
             "growth_interval": "growth_interval"}
    if not isinstance(loss_scale, dict) or not set(loss_scale) <= set(names):
        raise ExportError(f"loss_scale={loss_scale!r}: give 'dynamic', or a dict of GradScaler's arguments "
                          f"({', '.join(names)})")
    return {names[k]: v for k, v in loss_scale.items()}


def export(module, example_inputs, path, name=None, loss=None, optimizer=None, optimizer_args=None,
           write_example=True, tracer="auto", train_mode=False, precision=None, clip_grad_norm=None,
           accumulate_gradients=False, loss_scale=None):
    """Captures `module` on `example_inputs` (a tuple of tensors) and writes
    `path`/graph.json with one .npy per parameter and buffer.

    tracer: "export" (torch.export, PyTorch 2.x), "fx" (torch.fx's symbolic
      tracer) or "auto": torch.export where this PyTorch has it, else torch.fx.
      ExportResult.tracer says which path was taken.
    loss: None, or "cross_entropy" (adds integer `labels`, one per row of
      the output) or "mse" (adds a `target` like the output): the graph then
      has a `training` section, and cudagen derives backward and update.
    optimizer: "sgd", "adam" or "adamw" (with loss), optimizer_args its
      hyper-parameters ({"lr": 0.01}).
    write_example: also write the example inputs to `path`/example/ and
      PyTorch's outputs on them to `path`/expected/ (<name>.npy).
    train_mode: capture the module in training mode (module.train()) (torch.fx
      before PyTorch 2.6, whose torch.export decomposes these ops), where
      BatchNorm normalises by each batch's statistics and updates its running
      ones (`batchnorm2d`) and dropout draws a mask each step
      (`dropout_mask`); by default in eval mode (module.eval()). The module
      is left in that mode; its running statistics are as they were (the
      capture's own forward pass does not move them).
    precision: with loss, "bf16" (or torch.bfloat16) or "f16" (torch.float16)
      trains as torch.autocast does: the graph stays f32 (the weights are f32
      master weights) and its `training` section asks cudagen for
      "precision": "bf16" (products in bf16, norms and losses in f32;
      docs/taskgraph-format.md); f16 with dynamic loss scaling, as
      torch.cuda.amp.GradScaler does, and so needs an optimizer. By default the
      dtype of a torch.autocast the export runs in, so exporting inside the
      training loop's `with torch.autocast(...)` keeps its policy. The model
      itself is captured in f32 either way.
    clip_grad_norm: with an optimizer, clip the gradients to this global L2
      norm before each update, as torch.nn.utils.clip_grad_norm_ does
      ("clip_grad_norm" in the training section).
    loss_scale: with an optimizer, scale the loss dynamically as
      torch.cuda.amp.GradScaler does: "dynamic" (its defaults), or a dict of
      its arguments ({"init_scale": 1024, "growth_interval": 100}); float16
      implies "dynamic".
    accumulate_gradients: with an optimizer, let each training step run over
      several micro-batches (their count chosen at run time) and update with
      the mean of their gradients, as dividing each micro-batch's loss by the
      count and stepping after the last does ("accumulate_gradients").
    Raises ExportError naming the node for anything it cannot map; nothing is
    written then."""
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    precision = _autocast_precision(precision, loss)
    if clip_grad_norm is not None:
        if optimizer is None:
            raise ExportError("clip_grad_norm clips what an optimizer reads: pass optimizer= too")
        if not (isinstance(clip_grad_norm, (int, float)) and 0 < clip_grad_norm <= 3e38):
            raise ExportError(f"clip_grad_norm={clip_grad_norm!r}: it is the largest global L2 norm of the gradients, "
                              "a positive number")
    scaling = _loss_scale(loss_scale, optimizer, precision)
    if accumulate_gradients and optimizer is None:
        raise ExportError("accumulate_gradients sums what an optimizer reads: pass optimizer= too")
    if train_mode and tracer in ("auto", "export") and _has_torch_export() and not _export_keeps_training_ops():
        if tracer == "export":
            raise ExportError(f"train_mode=True on torch.export needs PyTorch 2.6 or later, whose graph keeps "
                              f"batch_norm and dropout as calls; this is {torch.__version__}: pass tracer='fx'")
        tracer = "fx"
    module = module.train(train_mode)
    # A train-mode forward moves BatchNorm's running statistics, the module's and (torch.export's
    # copies) the captured graph's: both are put back as they were.
    buffers = [(b, b.detach().clone()) for _, b in module.named_buffers()]
    try:
        # Captured and recorded in f32: an enclosing autocast is the policy, not the model.
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            gm, traced_with = _capture(module, example_inputs, tracer)
            buffers += [(b, b.detach().clone()) for _, b in gm.named_buffers()]
            recorder = _Recorder(gm)
            with torch.no_grad():
                outputs = recorder.run(*example_inputs)
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    module_names = {}
    for n, t in list(module.named_parameters()) + list(module.named_buffers()):
        if t.numel():
            module_names.setdefault((t.data_ptr(), tuple(t.shape), tuple(t.stride()), str(t.dtype)), n)
    ex = _Exporter(gm, recorder.values, name or module.__class__.__name__, loss is not None, module_names,
                   recorder.dropout_seeds, module)
    ex.run()
    rewrites = simplify(ex.tasks, ex.outputs, ex.arrays, training=loss is not None)
    graph = {"format": FORMAT, "name": "".join(c if c.isalnum() or c == "_" else "_" for c in ex.name), "tasks": ex.tasks}
    extra_inputs = {}
    if loss is not None:
        graph["training"], extra_inputs = _training(ex, loss, optimizer, optimizer_args, outputs)
        if precision is not None:
            graph["training"]["precision"] = precision
        if clip_grad_norm is not None:
            graph["training"]["clip_grad_norm"] = float(clip_grad_norm)
        if accumulate_gradients:
            graph["training"]["accumulate_gradients"] = True
        if scaling is not None:
            graph["training"]["loss_scale"] = scaling
    flat_outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]

    # Everything mapped: now write, each file under a temporary name first.
    os.makedirs(path, exist_ok=True)
    files = {"graph.json": _canonical_json(graph)}
    for tensor_name, array in ex.arrays.items():
        files[tensor_name + ".npy"] = array
    if write_example:
        for node_name, tensor in zip(ex.inputs, example_inputs):
            files[os.path.join("example", node_name + ".npy")] = to_numpy(tensor)
        for tensor_name, array in extra_inputs.items():
            files[os.path.join("example", tensor_name + ".npy")] = array
        for out_name, tensor in zip(ex.outputs, flat_outputs):
            files[os.path.join("expected", out_name + ".npy")] = to_numpy(tensor)
    for relative, content in files.items():
        target = os.path.join(path, relative)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".cudagen-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                if isinstance(content, str):
                    f.write(content.encode())
                else:
                    # (reshaped: numpy 1.x's ascontiguousarray makes a 0-d array 1-d)
                    np.save(f, np.ascontiguousarray(content).reshape(np.shape(content)))
            os.replace(temporary, target)
        except BaseException:
            if os.path.exists(temporary):
                os.unlink(temporary)
            raise
    return ExportResult(os.path.join(path, "graph.json"), traced_with, len(ex.tasks),
                        sorted(ex.arrays), list(ex.inputs) + sorted(extra_inputs), list(ex.outputs), rewrites)


def _canonical_json(graph):
    """The graph in cudagen's canonical form (docs/taskgraph-format.md): two
    spaces, one slot per line, fields in their order, floats round-tripping."""
    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, float):
            text = repr(v)
            return text if any(c in text for c in ".en") else text + ".0"
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{json.dumps(k)}: {value(x)}" for k, x in v.items()) + "}"
        return json.dumps(v)

    order = ["from", "dtype", "shape", "storage", "name", "data"]
    tasks = []
    for t in graph["tasks"]:
        lines = [f'      "id": {json.dumps(t["id"])}', f'      "op": {json.dumps(t["op"])}',
                 f'      "phase": {json.dumps(t["phase"])}']
        slots = [f'        {json.dumps(k)}: {value({f: s[f] for f in order if f in s})}' for k, s in t["tensors"].items()]
        lines.append('      "tensors": {\n' + ",\n".join(slots) + "\n      }")
        if t.get("args"):
            args = [f"        {json.dumps(k)}: {value(v)}" for k, v in t["args"].items()]
            lines.append('      "args": {\n' + ",\n".join(args) + "\n      }")
        tasks.append("    {\n" + ",\n".join(lines) + "\n    }")
    head = f'{{\n  "format": {json.dumps(graph["format"])},\n  "name": {json.dumps(graph["name"])},\n'
    tail = ""
    if "training" in graph:
        tail = f',\n  "training": {value(graph["training"])}'
    return head + '  "tasks": [\n' + ",\n".join(tasks) + "\n  ]" + tail + "\n}\n"


def _training(ex, loss, optimizer, optimizer_args, outputs):
    """A loss task after the (single) output, and the graph's `training` section."""
    if len(ex.outputs) != 1:
        raise ExportError(f"loss= needs a model with one output, this one has {len(ex.outputs)}")
    out_task = next(t for t in ex.tasks for s in t["tensors"].values() if s.get("name") == ex.outputs[0])
    out_slot = next(k for k, s in out_task["tensors"].items() if s.get("name") == ex.outputs[0])
    ref, shape = f"{out_task['id']}.{out_slot}", tuple(out_task["tensors"][out_slot]["shape"])
    if out_task["tensors"][out_slot]["dtype"] != "f32":
        raise ExportError(f"loss= needs a float32 model, this one's output is {out_task['tensors'][out_slot]['dtype']}; "
                          "export model.float() to train")
    example = {}
    if loss == "cross_entropy":
        labels_shape = shape[:-1]
        tensors = {"logits": {"from": ref},
                   "labels": {"dtype": "i64", "shape": list(labels_shape), "storage": "external", "name": "labels"},
                   "loss": {"dtype": "f32", "shape": [], "storage": "external", "name": "loss"}}
        example["labels"] = torch.randint(0, shape[-1], labels_shape, generator=torch.Generator().manual_seed(0)).numpy()
    elif loss == "mse":
        tensors = {"pred": {"from": ref},
                   "target": {"dtype": "f32", "shape": list(shape), "storage": "external", "name": "target"},
                   "loss": {"dtype": "f32", "shape": [], "storage": "external", "name": "loss"}}
        example["target"] = torch.randn(shape, generator=torch.Generator().manual_seed(0)).numpy()
    else:
        raise ExportError(f"loss={loss!r} has no mapping; use 'cross_entropy' or 'mse'")
    tid = ex.task_id("loss")
    ex.tasks.append({"id": tid, "op": loss, "phase": "forward", "tensors": tensors})
    training = {"loss": f"{tid}.loss"}
    if optimizer is not None:
        if optimizer not in ("sgd", "adam", "adamw"):
            raise ExportError(f"optimizer={optimizer!r} has no mapping; use 'sgd', 'adam' or 'adamw'")
        training["optimizer"] = optimizer
        training["args"] = dict(optimizer_args or {})
    ex.outputs.append("loss")
    return training, example
