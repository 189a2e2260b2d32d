"""The PyTorch frontend, end to end: each model exported with cudagen_torch,
compiled and run by `cudagen run --emulate` (weights from the exported .npy
files, inputs from example/), and its outputs compared with PyTorch's own on
the same fresh random inputs (f32: max |error| <= 1e-4 * max |PyTorch's output|);
the seed is printed on failure. Then the error cases, with their messages.

Run with Debian's PyTorch: /usr/bin/python3 tests/torch_frontend/test_frontend.py CUDAGEN [TEST...]
"""

import contextlib
import copy
import importlib.util
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "frontends", "torch"))
sys.path.insert(0, HERE)

import cudagen_torch  # noqa: E402
import models  # noqa: E402

CUDAGEN = None  # set from argv
# How `cudagen run` executes the models: in the host emulation (CI), or with
# CUDAGEN_TEST_RUN_MODE=--gpu on a GPU (bench/gpu_check.sh: the device machine
# has no host toolchain for the emulation build).
RUN_MODE = os.environ.get("CUDAGEN_TEST_RUN_MODE", "--emulate")
# The path export() takes by default: torch.export on PyTorch 2.x, torch.fx on 1.13.
TRACER = "torch.export" if cudagen_torch.exporter._has_torch_export() else "torch.fx.symbolic_trace"
# Both capture paths where this PyTorch has both (the tests of model code run on each).
TRACERS = ["fx"] + (["export"] if TRACER == "torch.export" else [])


def read(path):
    with open(path) as f:
        return f.read()


def _tensors(graph_path):
    """Every tensor slot of a graph file's tasks."""
    return [t for task in json.loads(read(graph_path))["tasks"] for t in task["tensors"].values() if isinstance(t, dict)]


# cuobjdump (ctest passes the build's; empty where the SASS part is not configured).
CUOBJDUMP = os.environ.get("CUDAGEN_CUOBJDUMP", "")
NVCC = os.environ.get("CUDAGEN_NVCC", "/usr/local/cuda/bin/nvcc")


def sass_opcodes(cu, arch, work):
    """{__global__ function: the set of its SASS opcodes} of a .cu built for `arch`."""
    cubin = os.path.join(work, f"sass_{arch}.cubin")
    subprocess.run([NVCC, "-cubin", f"-arch={arch}", "-O3", cu, "-o", cubin], check=True, capture_output=True)
    listing = subprocess.run([CUOBJDUMP, "-sass", cubin], check=True, capture_output=True, text=True).stdout
    functions, current = {}, None
    for line in listing.splitlines():
        if "Function :" in line:
            mangled = line.split("Function :")[1].strip()
            length = re.match(r"_Z(\d+)", mangled)  # _Z<length><name>...: the kernel's name
            name = mangled[length.end():length.end() + int(length.group(1))] if length else mangled
            current = functions.setdefault(name, set())
        elif current is not None and re.match(r"\s+/\*[0-9a-f]{4}\*/", line):
            opcode = re.sub(r"^@!?U?P\w+\s+", "", line.split("*/", 1)[1].strip()).split(" ")[0].split(".")[0]
            current.add(opcode.rstrip(";"))
    return functions


class cudagen_dropout_masks:
    """While active, F.dropout (and so nn.Dropout) in training mode
    multiplies by cudagen's mask (cudagen_torch.dropout_mask) instead of
    drawing PyTorch's: the k-th dropout of a forward pass takes seed k, as
    the export numbers them, at the step and micro-batch `position` says
    (the caller sets them, and "drawn" back to 0, before each forward pass)."""

    def __init__(self):
        self.position = {"step": 1, "micro_batch": 0, "drawn": 0}

    def __enter__(self):
        self.saved = F.dropout

        def dropout(input, p=0.5, training=True, inplace=False):
            if not training or p == 0:
                return input
            seed, self.position["drawn"] = self.position["drawn"], self.position["drawn"] + 1
            mask = cudagen_torch.dropout_mask(tuple(input.shape), p, seed, self.position["step"],
                                              self.position["micro_batch"])
            return input * torch.from_numpy(mask).to(input.dtype)

        torch.nn.functional.dropout = dropout
        return self.position

    def __exit__(self, *exc):
        torch.nn.functional.dropout = self.saved


def fresh_seed():
    """A new seed per test, printed on failure; CUDAGEN_TEST_SEED pins it (to rerun a failure)."""
    pinned = os.environ.get("CUDAGEN_TEST_SEED")
    return int(pinned) if pinned else random.SystemRandom().randrange(1 << 31)


class Exported(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="cudagen_torch_test_")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def run_cudagen(self, *args):
        started = time.time()
        r = subprocess.run([CUDAGEN, *args], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, f"cudagen {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}")
        return r.stdout, time.time() - started

    def check_model(self, model, inputs, seed, tolerance=1e-4, **kwargs):
        """Exports, runs in emulation, compares every output with PyTorch's
        (max |error| <= tolerance * max |PyTorch's output|)."""
        model_dir = os.path.join(self.dir, "model")
        result = cudagen_torch.export(model, inputs, model_dir, **kwargs)
        self.assertEqual(result.tracer, {"fx": "torch.fx.symbolic_trace", "export": "torch.export"}.get(
            kwargs.get("tracer"), TRACER))
        outputs = os.path.join(self.dir, "outputs")
        # --expected: cudagen's own comparison with PyTorch's outputs (within twice the float64 reference's bound).
        stdout, seconds = self.run_cudagen("run", result.graph_path, RUN_MODE, "--inputs",
                                           os.path.join(model_dir, "example"), "--outputs", outputs,
                                           "--expected", os.path.join(model_dir, "expected"))
        self.assertIn("against the expected outputs in", stdout)
        for name in result.outputs:
            got, want = (np.load(os.path.join(folder, name + ".npy")) for folder in (outputs, os.path.join(model_dir, "expected")))
            self.assertEqual((got.shape, got.dtype), (want.shape, want.dtype), name)
            if got.dtype == np.uint16:  # bf16 bit patterns
                got, want = (cudagen_torch.from_numpy(a, torch.bfloat16).double().numpy() for a in (got, want))
            self.assertFalse(np.isnan(got).any(), f"{name}: NaN (seed {seed})")
            error = float(np.abs(got.astype(np.float64) - want).max())
            scale = float(np.abs(want).max())
            self.assertLessEqual(error, tolerance * scale,
                                 f"{name}: max |error| {error:.3g} against max |output| {scale:.3g} (seed {seed})")
        return result, stdout, seconds


class Comparisons(torch.nn.Module):
    """eq and ne as masks (h == relu(h) is h >= 0, exactly), and x * x of a
    graph input: one tensor through both slots of a task."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        h = self.fc1(x * x)
        positive = (h == torch.relu(h)).float()
        nonzero = torch.relu(h).ne(0).float()
        return self.fc2(h * positive + nonzero * 0.5 - (h != 0.25).float())


class Models(Exported):
    def test_dropout_in_a_train_mode_inference_export_draws_the_first_steps_mask(self):
        """train_mode=True without a loss: dropout draws step 1's mask (a run-time
        argument left at its first value), which the export's expected outputs
        used too; the mask is computed in the loop that applies it, never in the
        next matmul's operand loads (whose kernel does not read the mask task's
        run-time arguments)."""
        seed = fresh_seed()
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Dropout(0.4),
                                    torch.nn.Linear(16, 4))
        for tracer in TRACERS:
            result, _, _ = self.check_model(model, (torch.randn(5, 12),), seed, tracer=tracer, train_mode=True)
            ops = [t["op"] for t in json.loads(read(result.graph_path))["tasks"]]
            self.assertEqual(ops.count("dropout_mask"), 1, ops)

    def test_comparisons_map_to_masks(self):
        seed = fresh_seed()
        torch.manual_seed(seed)
        for tracer in TRACERS:
            self.check_model(Comparisons(), (torch.randn(6, 8),), seed, tracer=tracer)
            ops = [t["op"] for t in json.loads(read(os.path.join(self.dir, "model", "graph.json")))["tasks"]]
            self.assertEqual((ops.count("eq"), ops.count("ne")), (1, 2), ops)

    def test_mlp(self):
        seed = fresh_seed()
        torch.manual_seed(seed)
        result, _, _ = self.check_model(models.mlp(), (torch.randn(9, 20),), seed)
        self.assertEqual(sorted(result.weights), ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"])
        # Parameters keep the module's names, and the .npy files hold their values.
        w = np.load(os.path.join(self.dir, "model", "fc1.weight.npy"))
        np.testing.assert_array_equal(w, models.mlp().fc1.weight.detach().numpy())

    def test_plain_code_traces_on_both_paths(self):
        """Parameters read in forward, x.shape, x.dim(), x.size(0), a tuple
        result unpacked, mean and sum with keepdim=True: on torch.fx (1.13's
        path, which failed on each) and, where PyTorch has it, torch.export."""
        seed = fresh_seed()
        torch.manual_seed(seed)
        for tracer in TRACERS:
            result, _, _ = self.check_model(models.plain_code(), (torch.randn(4, 16),), seed, tracer=tracer)
            self.assertIn("weight", result.weights)
            self.assertIn("scale", result.weights)

    def test_hand_written_norms_map_pow_rsqrt_and_sqrt(self):
        """x.pow(2), torch.rsqrt, torch.sqrt and x ** 3 (LLaMA-style RMSNorm
        code) export on both paths and match PyTorch."""
        seed = fresh_seed()
        torch.manual_seed(seed)
        for tracer in TRACERS:
            result, _, _ = self.check_model(models.hand_written_norm(), (torch.randn(4, 16),), seed, tracer=tracer)
            graph = read(result.graph_path)
            for op in ('"op": "pow"', '"op": "rsqrt"', '"op": "sqrt"'):
                self.assertIn(op, graph)

    def test_addmm_and_hardsigmoid_map(self):
        """torch.addmm (transformers' Conv1D), with alpha, and nn.Hardsigmoid /
        F.hardsigmoid (MobileNetV3) on both paths, matching PyTorch."""
        seed = fresh_seed()
        torch.manual_seed(seed)
        for tracer in TRACERS:
            result, _, _ = self.check_model(models.transformers_style(), (torch.randn(2, 3, 16),), seed, tracer=tracer)
            graph = read(result.graph_path)
            self.assertIn('"op": "hardsigmoid"', graph)
            self.assertIn('"alpha": 0.5', graph)

    def test_global_pools_and_stochastic_depth_map(self):
        """x.mean([2, 3]) and sums over several trailing axes (keepdim too),
        StochasticDepth in eval mode and MaxPool2d with ceil_mode, on both
        paths, matching PyTorch."""
        seed = fresh_seed()
        torch.manual_seed(seed)
        for tracer in TRACERS:
            result, _, _ = self.check_model(models.global_pool(), (torch.randn(2, 4, 6, 6),), seed, tracer=tracer)
            self.assertEqual(len(result.outputs), 3)

    def test_batchnorm_without_running_statistics_uses_the_batchs(self):
        """BatchNorm2d(track_running_stats=False) normalises by the batch's
        statistics in eval mode too (PyTorch's rule): batchnorm2d, not a fold,
        matching PyTorch."""
        seed = fresh_seed()
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 6, 3), torch.nn.BatchNorm2d(6, track_running_stats=False))
        result, _, _ = self.check_model(model, (torch.randn(2, 3, 7, 7),), seed, tracer="fx")
        ops = [t["op"] for t in json.loads(read(result.graph_path))["tasks"]]
        self.assertIn("batchnorm2d", ops)

    def test_conversions_and_like_constants_map(self):
        """x.to(dtype), type_as, .half(), zeros_like, new_ones, unflatten, fill_
        and zero_ on both paths: casts where the dtype changes, constants, a reshape. The
        f64 output, computed in f32, is checked at f32's tolerance (f64's
        failed it)."""
        seed = fresh_seed()
        torch.manual_seed(seed)
        for tracer in TRACERS:
            # bf16 out: PyTorch and cudagen may round a sum to neighbouring bf16 steps.
            result, _, _ = self.check_model(models.conversions(), (torch.randn(2, 12),), seed, tolerance=2.0 ** -7,
                                            tracer=tracer)
            graph = read(result.graph_path)
            for dtype in ("f16", "bf16", "f64"):
                self.assertIn(f'"dtype": "{dtype}"', graph)

    def test_slicing_and_select_map(self):
        """x[:, 1:4], x[:, -1], x[..., ::2], x[:, None, 0, 2:5], narrow and a
        table cut to the sequence, on both paths, matching PyTorch."""
        seed = fresh_seed()
        torch.manual_seed(seed)
        for tracer in TRACERS:
            result, _, _ = self.check_model(models.slicing(), (torch.randn(2, 5, 6),), seed, tracer=tracer)
            self.assertIn('"op": "slice"', read(result.graph_path))

    def test_roll_repeat_interleave_and_pad_map(self):
        """torch.roll (several axes, a negative shift, none: flattened),
        repeat_interleave and F.pad (a value, two axes, a crop) as slices and
        concatenations, on both paths, matching PyTorch (Training trains
        through them)."""
        seed = fresh_seed()
        torch.manual_seed(seed)
        for tracer in TRACERS:
            result, _, _ = self.check_model(models.shuffles(), (torch.randn(2, 4, 5, 6),), seed, tracer=tracer)
            graph = read(result.graph_path)
            self.assertIn('"op": "concat"', graph)
            self.assertIn('"op": "slice"', graph)

    def test_in_place_updates_are_kept(self):
        """y.add_(1), F.relu(z, inplace=True), nn.ReLU(inplace=True), w.mul_(0.5):
        the export and its expected outputs agree with eager PyTorch."""
        seed = fresh_seed()
        torch.manual_seed(seed)
        x = torch.randn(4, 8)
        result, _, _ = self.check_model(models.in_place(), (x,), seed)
        expected = np.load(os.path.join(self.dir, "model", "expected", result.outputs[0] + ".npy"))
        eager = models.in_place()(x.clone()).detach().numpy()
        np.testing.assert_allclose(expected, eager, rtol=0, atol=0)

    def test_mlp_in_bfloat16(self):
        """bf16 weights, inputs and outputs, as .npy files of their bit
        patterns; PyTorch's bf16 result and cudagen's, each rounded from f32
        sums in another order, agree within a few bf16 steps (2^-8)."""
        seed = fresh_seed()
        torch.manual_seed(seed)
        result, _, _ = self.check_model(models.mlp().to(torch.bfloat16), (torch.randn(9, 20).to(torch.bfloat16),), seed,
                                        tolerance=3 * 2.0 ** -8)
        self.assertIn('"dtype": "bf16"', read(result.graph_path))
        w = np.load(os.path.join(self.dir, "model", "fc1.weight.npy"))
        self.assertEqual(w.dtype, np.uint16)
        self.assertTrue(torch.equal(cudagen_torch.from_numpy(w, torch.bfloat16),
                                    models.mlp().to(torch.bfloat16).fc1.weight.detach()))

    def test_decoder_block_with_attention_written_out(self):
        seed = fresh_seed()
        torch.manual_seed(seed)
        result, _, _ = self.check_model(models.block(), (torch.randn(2, 16, 48),), seed)
        graph = read(result.graph_path)
        self.assertIn('"causal": true', graph)  # the mask and masked_fill folded into the softmax
        self.assertIn('"op": "layernorm"', graph)
        # simplify.py: q, k and v projections of their own, heads split and merged by the head
        # ops, k^T and the scale in the scores matmul; then the fusion rules see the pattern of
        # examples/transformer_block.json: the same 3 launches, the layernorm, the projections
        # (bias and head split after each) and attention in one kernel, the MLP in another.
        self.assertEqual(result.rewrites, ["transpose_into_matmul", "scale_into_matmul", "heads", "split_linear",
                                           "remove_dead"])
        ops = [t["op"] for t in json.loads(graph)["tasks"]]
        self.assertEqual((ops.count("split_heads"), ops.count("merge_heads")), (3, 1))
        for copy in ("split", "permute", "transpose", "affine", "reshape"):
            self.assertNotIn(copy, ops)
        self.assertIn("attn.c_attn.weight.rows48-96", result.weights)
        described, _ = self.run_cudagen("describe", result.graph_path)
        self.assertIn("kernels: 3 kernels in 3 launches", described)
        self.assertIn("[norm_prologue, attention_projection, attention]", described)
        self.assertIn("[norm_prologue, matmul_chain]", described)

    @unittest.skipUnless(hasattr(torch.nn.functional, "scaled_dot_product_attention"),
                         f"torch {torch.__version__} has no F.scaled_dot_product_attention (2.0 and later do)")
    def test_decoder_block_with_sdpa(self):
        seed = fresh_seed()
        torch.manual_seed(seed)
        model = models.Block(use_sdpa=True)
        self.check_model(model.eval(), (torch.randn(2, 16, 48),), seed)

    @unittest.skipUnless(TRACER == "torch.export", f"torch {torch.__version__} has no torch.export, and its "
                         "torch.fx path keeps the mask's construction as calls of its own")
    def test_sdpa_masks_map(self):
        """transformers passes SDPA a mask it builds from the sequence length: a constant one
        that keeps exactly the causal keys is causal attention, one that keeps every key is
        none. A float mask the input decides (a padding mask, a bias) is added to the scores
        before the softmax, in the attention kernel (each row kernel adds it to its scores); a
        boolean one is refused, saying what to write instead."""
        for kind, causal in (("additive", True), ("boolean", True), ("keep_all", False), ("from_input", False),
                             ("padding", False)):
            with self.subTest(kind=kind):
                seed = fresh_seed()
                torch.manual_seed(seed)
                result, _, _ = self.check_model(models.MaskedAttention(kind).eval(), (torch.randn(2, 8, 16),), seed)
                tasks = json.loads(read(result.graph_path))["tasks"]
                softmax = next(t for t in tasks if t["op"] == "softmax")
                self.assertEqual(bool(softmax.get("args", {}).get("causal")), causal)
                # The input's mask is added to the scores: the softmax reads the sum.
                self.assertEqual(softmax["tensors"]["x"]["from"].split(".")[0].endswith("_masked"),
                                 kind in ("from_input", "padding"), softmax)
                cu = os.path.join(self.dir, f"{kind}.cu")
                self.run_cudagen("compile", result.graph_path, "-o", cu)
                source = read(cu)
                self.assertIn("cg_attention_row(", source)  # scores, mask, softmax and values: one kernel
                self.assertEqual("[&](int j, float x) { return x + " in source, kind in ("from_input", "padding"))
        with self.assertRaises(cudagen_torch.ExportError) as caught:
            cudagen_torch.export(models.MaskedAttention("boolean_from_input").eval(), (torch.randn(2, 8, 16),),
                                 tempfile.mkdtemp())
        self.assertIn("a boolean attn_mask the inputs change has no mapping", str(caught.exception))
        self.assertIn("pass an additive float mask", str(caught.exception))

    def test_multihead_attention_module(self):
        """nn.MultiheadAttention (ViT's self-attention), batch first and sequence first:
        on the fx path one call, mapped to its projections and the attention ops."""
        for batch_first in (True, False):
            with self.subTest(batch_first=batch_first):
                seed = fresh_seed()
                torch.manual_seed(seed)
                x = torch.randn(2, 6, 16) if batch_first else torch.randn(6, 2, 16)
                result, _, _ = self.check_model(models.MultiheadSelfAttention(batch_first).eval(), (x,), seed)
                self.assertIn('"op": "softmax"', read(result.graph_path))
        if TRACER == "torch.fx.symbolic_trace":  # (torch.export decomposes the module into ATen ops)
            class ReadsTheWeights(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.attention = torch.nn.MultiheadAttention(16, 4, batch_first=True)

                def forward(self, x):
                    return self.attention(x, x, x)[1]

            with self.assertRaises(cudagen_torch.ExportError) as caught:
                cudagen_torch.export(ReadsTheWeights().eval(), (torch.randn(2, 6, 16),), tempfile.mkdtemp())
            self.assertIn("attention weights (need_weights=True) have no mapping", str(caught.exception))

    def test_einsum_products_and_vector_norms(self):
        """einsum equations that are batched matrix products map to matmul (trans_a and
        trans_b where an operand's letters run the other way); on torch.export, F.normalize's
        ATen ops (linalg_vector_norm, clamp_min, expand_as) map too. Another equation is
        refused, saying what to write."""
        for normalize in (False, True) if TRACER == "torch.export" else (False,):
            with self.subTest(normalize=normalize):
                seed = fresh_seed()
                torch.manual_seed(seed)
                inputs = (torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4))
                result, _, _ = self.check_model(models.EinsumAndNorms(normalize), inputs, seed)
                matmuls = [t for t in json.loads(read(result.graph_path))["tasks"] if t["op"] == "matmul"]
                self.assertEqual(sorted(tuple(sorted(k for k in t.get("args", {}) if k.startswith("trans")))
                                        for t in matmuls), [(), ("trans_a",), ("trans_b",)])

        class Trace(torch.nn.Module):
            def forward(self, x):
                return torch.einsum("ii->i", x)

        with self.assertRaises(cudagen_torch.ExportError) as caught:
            cudagen_torch.export(Trace(), (torch.randn(3, 3),), tempfile.mkdtemp())
        self.assertIn("write it with matmul (@), transpose and reshape", str(caught.exception))

    def test_constant_constructions_in_model_code(self):
        """Index assignment into a constant (a mask), an in-place update through a view of a
        parameter's clone, F.dropout(p=0) and F.normalize, on both paths; the constants come
        out as the model's run built them."""
        seed = fresh_seed()
        torch.manual_seed(seed)
        for tracer in TRACERS:
            with self.subTest(tracer=tracer):
                self.check_model(models.ConstantConstructions().eval(), (torch.randn(4, 6),), seed, tracer=tracer)

    def test_grouped_query_attention(self):
        """LLaMA's repeat_kv (expand, or repeat_interleave) before attention,
        rotary embeddings on q and k: the attention reads the heads of keys
        and values themselves, q seen as [B, Hkv, G, T, D] over k and v as
        [B, Hkv, 1, T, D]: no copy of a head is left in the graph (the
        concats left are rotate_half's, a head wide), and the attention is one
        kernel (Training trains it)."""
        for repeat in ("expand", "repeat_interleave"):
            with self.subTest(repeat=repeat):
                seed = fresh_seed()
                torch.manual_seed(seed)
                model = models.GroupedQueryAttention(repeat=repeat).eval()
                result, _, _ = self.check_model(model, (torch.randn(2, 12, 64),), seed)
                tasks = json.loads(read(result.graph_path))["tasks"]
                concats = [t for t in tasks if t["op"] == "concat"]
                self.assertEqual([t["tensors"]["out"]["shape"][-1] for t in concats], [8, 8],
                                 "only rotate_half's concats of q and k: a repeated head is copied")
                softmax = next(t for t in tasks if t["op"] == "softmax")
                self.assertEqual(softmax["tensors"]["out"]["shape"], [2, 2, 4, 12, 12])
                self.assertTrue(softmax["args"].get("causal"))
                described, _ = self.run_cudagen("describe", result.graph_path)
                self.assertIn("[attention]", described)

    @unittest.skipUnless("enable_gqa" in (getattr(torch.nn.functional.scaled_dot_product_attention, "__doc__", "") or "")
                         if hasattr(torch.nn.functional, "scaled_dot_product_attention") else False,
                         f"torch {torch.__version__} has no scaled_dot_product_attention(enable_gqa=True) (2.5 and later do)")
    def test_grouped_query_attention_with_sdpa(self):
        seed = fresh_seed()
        torch.manual_seed(seed)
        result, _, _ = self.check_model(models.GroupedQueryAttention(repeat="sdpa").eval(), (torch.randn(2, 12, 64),), seed)
        softmax = next(t for t in json.loads(read(result.graph_path))["tasks"] if t["op"] == "softmax")
        self.assertEqual(softmax["tensors"]["out"]["shape"], [2, 2, 4, 12, 12])

    def test_cat_and_split_along_any_axis(self):
        seed = fresh_seed()
        torch.manual_seed(seed)
        result, _, _ = self.check_model(models.CatSplit().eval(), (torch.randn(2, 6, 4, 8),), seed)
        graph = read(result.graph_path)
        self.assertIn('"op": "concat"', graph)
        self.assertIn('"op": "split"', graph)

    def test_the_other_mappings(self):
        seed = fresh_seed()
        torch.manual_seed(seed)
        inputs = (torch.randint(0, 50, (2, 6)), torch.randn(2, 4, 8, 8))
        result, _, _ = self.check_model(models.zoo(), inputs, seed)
        ops = {t["op"] for t in json.loads(read(result.graph_path))["tasks"]}
        for op in ("embedding", "silu", "sigmoid", "tanh", "hardswish", "avg_pool2d", "log_softmax", "mean", "sum",
                   "permute", "conv2d", "rmsnorm" if hasattr(torch.nn, "RMSNorm") else "layernorm"):
            self.assertIn(op, ops)
        self.assertEqual(len(result.outputs), 2)

    def test_rewrites_only_where_they_hold(self):
        """simplify.py leaves alone what it cannot rewrite exactly: a scale with
        a shift, a split whose part is an output, a transpose of a graph input."""
        class Partial(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.proj = torch.nn.Linear(8, 12)

            def forward(self, x, y):  # [3, 8], [5, 8]
                parts = self.proj(x).split([4, 8], dim=-1)  # indexed: see models.CatSplit
                a, b = parts[0], parts[1]
                scores = (x @ y.transpose(0, 1)) * 2.0 + 1.0  # y^T: a graph input's transpose
                return a, b.relu(), scores

        seed = fresh_seed()
        torch.manual_seed(seed)
        result, _, _ = self.check_model(Partial().eval(), (torch.randn(3, 8), torch.randn(5, 8)), seed)
        ops = [t["op"] for t in json.loads(read(result.graph_path))["tasks"]]
        self.assertIn("split", ops)  # part a is an output: the layer stays whole
        self.assertIn("affine", ops)  # * 2 + 1 is no alpha
        self.assertIn("transpose", ops)
        self.assertEqual(sorted(result.weights), ["proj.bias", "proj.weight"])

    @unittest.skipUnless(importlib.util.find_spec("torchvision"), "torchvision is not installed (CI has Debian's)")
    def test_resnet18(self):
        seed = fresh_seed()
        torch.manual_seed(seed)
        result, stdout, seconds = self.check_model(models.resnet18(), (torch.randn(1, 3, 64, 64),), seed)
        graph = read(result.graph_path)
        self.assertNotIn("batchnorm", graph.lower().replace("folded", ""))  # every BatchNorm folded into its conv
        print(f"\nresnet18 1x3x64x64: export + compile + emulated run {seconds:.1f} s", file=sys.stderr)

    @unittest.skipUnless(importlib.util.find_spec("torchvision"), "torchvision is not installed (CI has Debian's)")
    def test_mobilenet_v2(self):
        seed = fresh_seed()
        torch.manual_seed(seed)
        result, stdout, seconds = self.check_model(models.mobilenet_v2(), (torch.randn(1, 3, 64, 64),), seed)
        self.assertIn('"op": "relu6"', read(result.graph_path))
        print(f"\nmobilenet_v2 1x3x64x64: compile + emulated run {seconds:.1f} s", file=sys.stderr)

    @unittest.skipUnless(TRACER == "torch.export", f"torch {torch.__version__} has no torch.export: "
                         "export() takes the torch.fx path, which every other test here checks")
    def test_decoder_block_through_both_paths(self):
        """torch.fx on PyTorch 2.x too, and the two graphs alike: the same ops."""
        seed = fresh_seed()
        torch.manual_seed(seed)
        ops = {}
        for tracer in ("fx", "export"):
            result, _, _ = self.check_model(models.block(), (torch.randn(2, 16, 48),), seed, tracer=tracer)
            ops[tracer] = sorted(t["op"] for t in json.loads(read(result.graph_path))["tasks"])
        self.assertEqual(ops["fx"], ops["export"])

    def test_cli_export(self):
        out = os.path.join(self.dir, "cli")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(HERE, "..", "..", "frontends", "torch"), HERE]))
        r = subprocess.run([sys.executable, "-m", "cudagen_torch", "export", "models:mlp", "--input", "4x20", "-o", out],
                           capture_output=True, text=True, env=env)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn(f"traced with {TRACER}", r.stdout)
        self.run_cudagen("run", os.path.join(out, "graph.json"), RUN_MODE)  # weights from the .npy files


class ChannelsLast(Exported):
    """16-bit models whose convolutions and pools run channels-last (issue #40):
    a ctest of their own, the suite's longest emulated runs beside Training."""

    @unittest.skipUnless(importlib.util.find_spec("torchvision"), "torchvision is not installed (CI has Debian's)")
    def test_resnet18_in_bfloat16_runs_channels_last(self):
        """A 16-bit export's convolutions run channels-last (conv2d_nhwc, the
        implicit GEMM on tensor cores), the stem's 3 channels padded to 8, and
        its pools too: one permute is left, of the input. The result is within
        2% of the float64 model's largest output (PyTorch's own bf16 result on
        the CPU is about 4% off)."""
        seed = fresh_seed()
        torch.manual_seed(seed)
        model, x = models.resnet18().to(torch.bfloat16), torch.randn(2, 3, 32, 32).to(torch.bfloat16)
        model_dir, outputs = os.path.join(self.dir, "model"), os.path.join(self.dir, "outputs")
        result = cudagen_torch.export(model, (x,), model_dir)
        ops = [t["op"] for t in json.loads(read(result.graph_path))["tasks"]]
        self.assertEqual((ops.count("conv2d"), ops.count("conv2d_nhwc"), ops.count("permute")), (0, 20, 1), ops)
        self.assertEqual((ops.count("max_pool2d_nhwc"), ops.count("adaptive_avg_pool2d_nhwc")), (1, 1), ops)
        self.run_cudagen("run", result.graph_path, RUN_MODE, "--inputs", os.path.join(model_dir, "example"),
                         "--outputs", outputs)
        got = cudagen_torch.from_numpy(np.load(os.path.join(outputs, result.outputs[0] + ".npy")), torch.bfloat16)
        want = model.double()(x.double()).detach()
        error, scale = float((got.double() - want).abs().max()), float(want.abs().max())
        self.assertLessEqual(error, 0.02 * scale, f"max |error| {error:.3g} against max |output| {scale:.3g} (seed {seed})")

    def test_grouped_convolutions_in_bfloat16_run_channels_last(self):
        """Grouped convolutions of 8 or more channels a group run conv2d_nhwc
        (a product a group), and so does a depthwise one of whole 16-byte
        chunks of channels (its own memory-bound form), the average pooling
        between them avg_pool2d_nhwc: no conv2d is left, nor a permute but at
        the model's edges."""
        seed = fresh_seed()
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Conv2d(16, 32, 3, padding=1, groups=2), torch.nn.ReLU(),
                                    torch.nn.AvgPool2d(3, stride=2, padding=1),
                                    torch.nn.Conv2d(32, 32, 3, padding=1, groups=32), torch.nn.ReLU(),
                                    torch.nn.Conv2d(32, 16, 1, groups=4)).to(torch.bfloat16).eval()
        x = torch.randn(2, 16, 6, 7).to(torch.bfloat16)  # (PyTorch 1.13 has no f16 convolution on the CPU)
        model_dir, outputs = os.path.join(self.dir, "model"), os.path.join(self.dir, "outputs")
        result = cudagen_torch.export(model, (x,), model_dir)
        tasks = json.loads(read(result.graph_path))["tasks"]
        groups = sorted(t.get("args", {}).get("groups", 1) for t in tasks if t["op"] == "conv2d_nhwc")
        self.assertEqual(groups, [2, 4, 32], [t["op"] for t in tasks])
        self.assertEqual([t["op"] for t in tasks].count("conv2d"), 0)
        self.assertEqual([t["op"] for t in tasks].count("avg_pool2d_nhwc"), 1, [t["op"] for t in tasks])
        self.assertEqual([t["op"] for t in tasks].count("permute"), 2, [t["op"] for t in tasks])
        self.run_cudagen("run", result.graph_path, RUN_MODE, "--inputs", os.path.join(model_dir, "example"),
                         "--outputs", outputs)
        got = cudagen_torch.from_numpy(np.load(os.path.join(outputs, result.outputs[0] + ".npy")), torch.bfloat16).double()
        want = model.double()(x.double()).detach()
        error, scale = float((got - want).abs().max()), float(want.abs().max())
        self.assertLessEqual(error, 0.02 * scale, f"max |error| {error:.3g} against max |output| {scale:.3g} (seed {seed})")

    @unittest.skipUnless(importlib.util.find_spec("torchvision"), "torchvision is not installed (CI has Debian's)")
    def test_mobilenet_v2_in_bfloat16_runs_channels_last(self):
        """MobileNetV2 in bf16: its depthwise convolutions run channels-last
        too (conv2d_nhwc's depthwise form), so every convolution does and one
        permute is left, of the input; the result is within 2% of the float64
        model's largest output."""
        seed = fresh_seed()
        torch.manual_seed(seed)
        model, x = models.mobilenet_v2().to(torch.bfloat16), torch.randn(1, 3, 32, 32).to(torch.bfloat16)
        model_dir, outputs = os.path.join(self.dir, "model"), os.path.join(self.dir, "outputs")
        result = cudagen_torch.export(model, (x,), model_dir)
        tasks = json.loads(read(result.graph_path))["tasks"]
        ops = [t["op"] for t in tasks]
        depthwise = [t for t in tasks if t["op"] == "conv2d_nhwc" and t.get("args", {}).get("groups", 1) > 1]
        self.assertEqual((ops.count("conv2d"), ops.count("conv2d_nhwc"), ops.count("permute")), (0, 52, 1), ops)
        self.assertEqual(len(depthwise), 17, ops)
        self.run_cudagen("run", result.graph_path, RUN_MODE, "--inputs", os.path.join(model_dir, "example"),
                         "--outputs", outputs)
        got = cudagen_torch.from_numpy(np.load(os.path.join(outputs, result.outputs[0] + ".npy")), torch.bfloat16)
        want = model.double()(x.double()).detach()
        error, scale = float((got.double() - want).abs().max()), float(want.abs().max())
        self.assertLessEqual(error, 0.02 * scale, f"max |error| {error:.3g} against max |output| {scale:.3g} (seed {seed})")

    @unittest.skipUnless(importlib.util.find_spec("torchvision"), "torchvision is not installed (CI has Debian's)")
    @unittest.skipUnless(CUOBJDUMP, "no cuobjdump: configure with the SASS part (scripts/dev.sh installs "
                         "nvidia-cuda-cuobjdump)")
    def test_resnet18_in_bfloat16_computes_on_tensor_cores(self):
        """Issue #40's measure: ResNet-18 (bf16, 2 x 3 x 64 x 64) runs at least
        95% of its FLOPs in kernels whose own SASS (sm_80 and sm_90) has HMMA,
        LDSM and LDGSTS and no local memory."""
        model_dir = os.path.join(self.dir, "model")
        result = cudagen_torch.export(models.resnet18().to(torch.bfloat16),
                                      (torch.randn(2, 3, 64, 64).to(torch.bfloat16),), model_dir)
        cu, manifest = os.path.join(self.dir, "r18.cu"), os.path.join(self.dir, "r18.manifest.json")
        self.run_cudagen("compile", result.graph_path, "-o", cu, "--manifest", manifest)
        launches = json.loads(read(manifest))["kernels"]
        flops = {k["name"]: k["flops"] or 0 for k in launches}  # (none for a copy)
        total = sum(flops.values())
        for arch in ("sm_80", "sm_90"):
            sass = sass_opcodes(cu, arch, self.dir)
            on_tensor_cores = sum(flops[k["name"]] for k in launches
                                  if {"HMMA", "LDSM", "LDGSTS"} <= sass[k["name"]] and not {"LDL", "STL"} & sass[k["name"]])
            self.assertGreaterEqual(on_tensor_cores, 0.95 * total, f"{arch}: {on_tensor_cores} of {total} FLOPs")
            print(f"\nresnet18 bf16 2x3x64x64 on {arch}: {on_tensor_cores / total:.1%} of {total / 1e9:.2f} GFLOP in "
                  "HMMA + LDSM + LDGSTS kernels without local memory", file=sys.stderr)


class Training(Exported):
    STEPS = 2

    def check_training(self, seed, model, inputs, loss, optimizer, optimizer_args, steps=None, train_mode=False,
                       update_rtol=1e-3, clip_grad_norm=None, micro_batches=1, dropout_masks=False):
        """Exports forward + loss, lets cudagen derive backward and update, runs
        STEPS steps in emulation (each checked against the float64 reference
        by `cudagen run`), and compares the losses and the updated weights
        with PyTorch's own training of the same model from the same weights
        and inputs (torch.optim, autograd; clip_grad_norm_ before each step
        where clip_grad_norm is given, which must then clip some step).
        With micro_batches, each step runs over that many micro-batches (the
        example, then copies of it shifted), against PyTorch summing the
        gradients of each micro-batch's loss divided by their count.
        With dropout_masks, PyTorch's dropouts draw cudagen's mask of each
        step and micro-batch (cudagen_dropout_masks)."""
        steps = steps or self.STEPS
        model_dir = os.path.join(self.dir, "model")
        result = cudagen_torch.export(model, inputs, model_dir, loss=loss, optimizer=optimizer,
                                      optimizer_args=optimizer_args, train_mode=train_mode, clip_grad_norm=clip_grad_norm,
                                      accumulate_gradients=micro_batches > 1)
        self.assertEqual(result.tracer, TRACER)  # torch.export on 2.x, train mode too
        self.assertIn("labels" if loss == "cross_entropy" else "target", result.inputs)
        example_dir = os.path.join(model_dir, "example")
        example = {n: np.load(os.path.join(example_dir, n + ".npy")) for n in result.inputs}
        # Micro-batch m: the example's values moved by m (floats scaled, classes rotated).
        feeds = [{n: (a * (1.0 - 0.4 * m)).astype(a.dtype) if a.dtype.kind == "f"
                  else (a + m) % (int(a.max()) + 1) for n, a in example.items()} for m in range(micro_batches)]
        inputs_dir = example_dir
        if micro_batches > 1:
            inputs_dir = os.path.join(self.dir, "micro_batches")
            os.makedirs(inputs_dir, exist_ok=True)
            for n in result.inputs:
                np.save(os.path.join(inputs_dir, n + ".npy"), np.stack([feed[n] for feed in feeds]))
        outputs = os.path.join(self.dir, "outputs")
        stdout, _ = self.run_cudagen("run", result.graph_path, RUN_MODE, "--steps", str(steps), "--inputs", inputs_dir,
                                     "--outputs", outputs, "--micro-batches", str(micro_batches))
        self.assertIn("loss", stdout)

        # PyTorch trains its own copy: eval mode (dropout the identity) unless
        # the test asks for train mode (BatchNorm's batch statistics, dropout's
        # masks), the exported inputs, the same optimizer.
        model.train(train_mode)
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        args = {"sgd": dict(lr=optimizer_args["lr"], momentum=optimizer_args.get("momentum", 0.0)),
                "adamw": dict(lr=optimizer_args["lr"], betas=(optimizer_args.get("beta1", 0.9),
                                                             optimizer_args.get("beta2", 0.999)),
                              eps=optimizer_args.get("eps", 1e-8), weight_decay=optimizer_args.get("weight_decay", 0.0))}
        # The same training in float64, from the same weights: how far each f32 run is from
        # exact arithmetic, where the two f32 runs disagree (below; trained when first needed).
        exact_model, exact_trained = copy.deepcopy(model).double(), []

        def exact():
            if not exact_trained:
                train(exact_model, torch.float64)
                exact_trained.append(True)
            return exact_model

        def train(net, dtype):
            torch_optimizer = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[optimizer](net.parameters(),
                                                                                             **args[optimizer])
            losses, norms = [], []
            with cudagen_dropout_masks() if dropout_masks else contextlib.nullcontext({}) as position:
                for step in range(steps):
                    torch_optimizer.zero_grad()
                    step_losses = []
                    for micro_batch, feed in enumerate(feeds):
                        position.update(step=step + 1, micro_batch=micro_batch, drawn=0)
                        feed = {n: torch.from_numpy(a).to(dtype) if a.dtype.kind == "f" else torch.from_numpy(a)
                                for n, a in feed.items()}
                        logits = net(feed[result.inputs[0]])
                        if loss == "cross_entropy":
                            value = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                    feed["labels"].reshape(-1).long())
                        else:
                            value = F.mse_loss(logits, feed["target"])
                        (value / micro_batches).backward()
                        step_losses.append(float(value))
                    if clip_grad_norm is not None:
                        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), clip_grad_norm)))
                    torch_optimizer.step()
                    losses.append(float(np.mean(step_losses)))
            return losses, norms

        losses, norms = train(model, torch.float32)

        if clip_grad_norm is not None:
            self.assertGreater(max(norms), clip_grad_norm, f"no step was clipped: the norms were {norms} (seed {seed})")
        got_losses = np.load(os.path.join(outputs, "loss.per_step.npy")).reshape(-1)
        np.testing.assert_allclose(got_losses, losses, rtol=1e-5, err_msg=f"loss per step, cudagen vs PyTorch (seed {seed})")
        for name, start in initial.items():
            got = np.load(os.path.join(outputs, name + ".npy")).astype(np.float64)
            want = model.state_dict()[name].detach().double().numpy()
            self.assertEqual(got.shape, want.shape, name)
            # The update itself (not the weight, which would hide it): within
            # update_rtol of its largest element, as f32 sums in another order allow.
            moved, want_moved = got - start.double().numpy(), want - start.double().numpy()
            scale = float(np.abs(want_moved).max())
            self.assertGreater(scale, 0.0, f"{name}: PyTorch did not change it (seed {seed})")
            error = float(np.abs(moved - want_moved).max())
            # An update read off f32 weights is known to one ulp of the weight: a BatchNorm's
            # weight near 1 moved by 1e-4 cannot agree to better than 1.2e-7.
            ulp = float(np.spacing(np.float32(np.abs(want).max())))
            if error <= update_rtol * scale + ulp:
                continue
            # Further apart than that: where steps amplify f32's rounding (BatchNorm over few values,
            # ResNet-18's conv1 after three steps on PyTorch 2.x), PyTorch's own f32 run strays from
            # exact arithmetic too. cudagen's update must then be as close to the float64 run's as
            # PyTorch's is (within twice its distance).
            exact_moved = exact().state_dict()[name].detach().numpy() - start.double().numpy()
            torch_error = float(np.abs(want_moved - exact_moved).max())
            cudagen_error = float(np.abs(moved - exact_moved).max())
            self.assertLessEqual(cudagen_error, max(update_rtol * scale, 2 * torch_error) + ulp,
                                 f"{name}: update differs from PyTorch's by {error:.3g} (largest {scale:.3g}), from "
                                 f"float64's by {cudagen_error:.3g}, PyTorch's from float64's by {torch_error:.3g} "
                                 f"(seed {seed})")
        # The running statistics a train-mode BatchNorm moved, step by step: within 1e-4 of
        # the buffer's largest element, as the updates are. (Element by element, a channel's
        # mean near 0 is a sum of 2 x 32 x 32 f32 values that cancel, which an atol cannot
        # bound: on an H200 an element missed rtol 1e-4 with atol 1e-6, bench/RESULTS.md.)
        # Where further apart, as close to the float64 run's as PyTorch's are (as the updates).
        for name, buffer in model.named_buffers() if train_mode else ():
            if name.endswith(("running_mean", "running_var")):
                got = np.load(os.path.join(outputs, name + ".npy")).astype(np.float64)
                want = buffer.double().numpy()
                scale = float(np.abs(want).max())
                worst = int(np.abs(got - want).argmax())
                if abs(got.flat[worst] - want.flat[worst]) <= 1e-4 * scale:
                    continue
                exact_value = dict(exact().named_buffers())[name].numpy()
                torch_error = float(np.abs(want - exact_value).max())
                cudagen_error = float(np.abs(got - exact_value).max())
                self.assertLessEqual(cudagen_error, max(1e-4 * scale, 2 * torch_error),
                                     f"{name} after {steps} steps: element {worst} is {got.flat[worst]:.7g}, PyTorch's "
                                     f"{want.flat[worst]:.7g} (largest {scale:.3g}); from float64's by "
                                     f"{cudagen_error:.3g}, PyTorch's by {torch_error:.3g} (seed {seed})")
        return stdout

    def test_slices_train(self):
        """The slice's gradient (slice_backward, derived by cudagen) trains a
        table cut to the sequence and a last-token head as PyTorch does."""
        seed = fresh_seed()
        torch.manual_seed(seed)
        self.check_training(seed, models.sliced_head(), (torch.randn(4, 5, 6),), "mse", "sgd", {"lr": 0.1})

    def test_grouped_query_attention_trains(self):
        """LLaMA's repeated heads rewritten into grouped-query attention: the
        gradients of the heads of keys and values (summed over each group by
        cudagen's derive pass) train the projections as PyTorch does, on the
        fused attention kernels."""
        seed = fresh_seed()
        torch.manual_seed(seed)
        self.check_training(seed, models.GroupedQueryAttention(), (torch.randn(2, 12, 64),), "mse", "sgd", {"lr": 0.1})
        described, _ = self.run_cudagen("describe", os.path.join(self.dir, "model", "graph.json"))
        self.assertIn("[attention]", described)
        self.assertIn("[attention_backward]", described)

    def test_roll_repeat_interleave_and_pad_train(self):
        """Their gradients (split and slice_backward, derived by cudagen) train
        the layer before them as PyTorch does."""
        seed = fresh_seed()
        torch.manual_seed(seed)
        self.check_training(seed, models.shuffled_head(), (torch.randn(4, 6),), "mse", "sgd", {"lr": 0.1})

    def test_an_export_inside_autocast_trains_in_bf16_as_pytorch_does(self):
        """Exported inside torch.autocast(dtype=torch.bfloat16): the graph stays
        f32 and asks for "precision": "bf16" (issue #41), cudagen computes its
        products in bf16, and two SGD steps give PyTorch's losses under the same
        autocast within bf16's bound (docs/architecture.md section 9)."""
        seed = fresh_seed()
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.SiLU(), torch.nn.Linear(32, 10))
        model_dir = os.path.join(self.dir, "model")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            result = cudagen_torch.export(model, (torch.randn(16, 24),), model_dir, loss="cross_entropy",
                                          optimizer="sgd", optimizer_args={"lr": 0.1})
        with open(result.graph_path) as f:
            graph = json.load(f)
        self.assertEqual(graph["training"]["precision"], "bf16")
        self.assertEqual({t["tensors"]["out"]["dtype"] for t in graph["tasks"] if t["op"] == "matmul"}, {"f32"})
        described, _ = self.run_cudagen("describe", result.graph_path)
        self.assertRegex(described, r"_to_bf16\.out\s+bf16")
        outputs = os.path.join(self.dir, "outputs")
        self.run_cudagen("run", result.graph_path, RUN_MODE, "--steps", "2", "--inputs",
                         os.path.join(model_dir, "example"), "--outputs", outputs)
        example = {n: torch.from_numpy(np.load(os.path.join(model_dir, "example", n + ".npy"))) for n in result.inputs}
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(2):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(example[result.inputs[0]])
                self.assertEqual(logits.dtype, torch.bfloat16)
                value = F.cross_entropy(logits.float(), example["labels"].long())
            value.backward()
            optimizer.step()
            losses.append(float(value))
        got = np.load(os.path.join(outputs, "loss.per_step.npy")).reshape(-1)
        np.testing.assert_allclose(got, losses, rtol=1e-2, err_msg=f"loss per step, cudagen vs PyTorch (seed {seed})")
        with self.assertRaisesRegex(cudagen_torch.ExportError, "scales the loss for the optimizer"):
            cudagen_torch.export(model, (torch.randn(16, 24),), model_dir, loss="mse", precision=torch.float16)

    def test_a_float16_export_scales_its_loss_and_trains(self):
        """precision=torch.float16 with an optimizer: "precision": "f16", the
        loss scaled dynamically (GradScaler's arguments where given), and the
        export trains in emulation, each step checked against the float64
        reference (PyTorch 1.13 has no float16 autocast on the CPU to compare
        with)."""
        seed = fresh_seed()
        torch.manual_seed(seed)
        model_dir = os.path.join(self.dir, "model")
        result = cudagen_torch.export(models.mlp(), (torch.randn(16, 20),), model_dir, loss="cross_entropy",
                                      optimizer="adamw", optimizer_args={"lr": 0.01}, precision=torch.float16,
                                      loss_scale={"init_scale": 256.0, "growth_interval": 1})
        with open(result.graph_path) as f:
            training = json.load(f)["training"]
        self.assertEqual(training["precision"], "f16")
        self.assertEqual(training["loss_scale"], {"initial": 256.0, "growth_interval": 1})
        outputs = os.path.join(self.dir, "outputs")
        self.run_cudagen("run", result.graph_path, RUN_MODE, "--steps", "2", "--inputs",
                         os.path.join(model_dir, "example"), "--outputs", outputs)
        self.assertEqual(float(np.load(os.path.join(outputs, "loss_scale.out.npy"))), 1024.0)  # grown after each step
        with self.assertRaisesRegex(cudagen_torch.ExportError, "give 'dynamic', or a dict"):
            cudagen_torch.export(models.mlp(), (torch.randn(16, 20),), model_dir, loss="mse", optimizer="sgd",
                                 optimizer_args={"lr": 0.1}, loss_scale={"scale": 2.0})

    def test_clipped_gradients_train_as_pytorch_does(self):
        """export(clip_grad_norm=...): cudagen clips the gradients to that
        global norm before each AdamW update, as torch.nn.utils.clip_grad_norm_
        does (issue #41)."""
        seed = fresh_seed()
        torch.manual_seed(seed)
        self.check_training(seed, models.mlp(), (torch.randn(8, 20),), "cross_entropy", "adamw", {"lr": 0.01},
                            clip_grad_norm=0.05)
        with open(os.path.join(self.dir, "model", "graph.json")) as f:
            self.assertEqual(json.load(f)["training"]["clip_grad_norm"], 0.05)
        with self.assertRaisesRegex(cudagen_torch.ExportError, "clips what an optimizer reads"):
            cudagen_torch.export(models.mlp(), (torch.randn(8, 20),), os.path.join(self.dir, "other"), loss="mse",
                                 clip_grad_norm=1.0)

    def test_accumulated_gradients_train_as_pytorch_does(self):
        """export(accumulate_gradients=True): each step runs over three
        micro-batches and updates with the mean of their gradients, clipped,
        as dividing each loss by three, clip_grad_norm_ and one SGD step do
        (issue #41)."""
        seed = fresh_seed()
        torch.manual_seed(seed)
        self.check_training(seed, models.mlp(), (torch.randn(8, 20),), "cross_entropy", "sgd",
                            {"lr": 0.1, "momentum": 0.9}, clip_grad_norm=0.3, micro_batches=3)
        with open(os.path.join(self.dir, "model", "graph.json")) as f:
            self.assertTrue(json.load(f)["training"]["accumulate_gradients"])
        with self.assertRaisesRegex(cudagen_torch.ExportError, "sums what an optimizer reads"):
            cudagen_torch.export(models.mlp(), (torch.randn(8, 20),), os.path.join(self.dir, "other"), loss="mse",
                                 accumulate_gradients=True)

    def test_dropout_trains_as_pytorch_does_with_the_same_masks(self):
        """nn.Dropout and F.dropout in training mode: each a dropout_mask task
        times its input, a new mask each step and micro-batch. PyTorch, made
        to draw cudagen's masks, computes the same losses and updates over
        three steps of two micro-batches; the masks do change from step to
        step (else the losses would agree with a fixed mask too)."""
        class DropoutMLP(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1, self.fc2, self.fc3 = torch.nn.Linear(20, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 5)
                self.drop = torch.nn.Dropout(0.3)

            def forward(self, x):
                x = self.drop(torch.relu(self.fc1(x)))
                return self.fc3(F.dropout(torch.relu(self.fc2(x)), 0.25, self.training))

        seed = fresh_seed()
        torch.manual_seed(seed)
        self.check_training(seed, DropoutMLP(), (torch.randn(8, 20),), "cross_entropy", "sgd",
                            {"lr": 0.05, "momentum": 0.9}, steps=3, train_mode=True, micro_batches=2, dropout_masks=True)
        tasks = json.loads(read(os.path.join(self.dir, "model", "graph.json")))["tasks"]
        masks = [t for t in tasks if t["op"] == "dropout_mask"]
        self.assertEqual([(t["args"]["p"], t["args"]["seed"]) for t in masks], [(0.3, 0), (0.25, 1)])
        first, second = (cudagen_torch.dropout_mask((8, 32), 0.3, 0, step) for step in (1, 2))
        self.assertTrue(0.2 < float((first == 0).mean()) < 0.4, first)
        self.assertGreater(float((first != second).mean()), 0.2)

    def test_comparisons_train_with_no_gradient_through_their_masks(self):
        seed = fresh_seed()
        torch.manual_seed(seed)
        self.check_training(seed, Comparisons(), (torch.randn(6, 8),), "mse", "sgd", {"lr": 0.05})

    def test_mlp_trains_as_pytorch_does(self):
        seed = fresh_seed()
        torch.manual_seed(seed)
        self.check_training(seed, models.mlp(), (torch.randn(8, 20),), "cross_entropy", "sgd", {"lr": 0.05, "momentum": 0.9})

    def test_convolutional_network_trains_as_pytorch_does(self):
        """Convolutions (grouped, depthwise, strided), max, average and
        global pooling and a residual: their gradients, derived by cudagen,
        train every weight as PyTorch does."""
        seed = fresh_seed()
        torch.manual_seed(seed)
        self.check_training(seed, models.small_resnet(), (torch.randn(2, 3, 12, 12),), "cross_entropy", "sgd",
                            {"lr": 0.1, "momentum": 0.9})

    def test_batchnorm_in_train_mode_trains_as_pytorch_does(self):
        """BatchNorm in training mode: each step normalises by the batch's
        statistics and moves the running ones, as PyTorch's train mode does;
        losses, updates and running statistics match."""
        seed = fresh_seed()
        torch.manual_seed(seed)
        self.check_training(seed, models.small_resnet(batchnorm=True), (torch.randn(2, 3, 12, 12),),
                            "cross_entropy", "sgd", {"lr": 0.1, "momentum": 0.9}, steps=3, train_mode=True)
        ops = [t["op"] for t in json.loads(read(os.path.join(self.dir, "model", "graph.json")))["tasks"]]
        self.assertEqual(ops.count("batchnorm2d"), 2)

    def test_resnet18_trains_as_pytorch_does(self):
        """torchvision's ResNet-18 (random weights), BatchNorm in training mode
        (batch statistics; running statistics moved), 2 x 3 x 64 x 64: three
        SGD steps, each checked against the float64 reference, match PyTorch's
        losses, every parameter's update and every running statistic (about
        100 s in emulation on the 2-core CI machine). Not at 32 x 32: there the
        last stage's BatchNorms normalise two values a channel, whose gradient
        is zero in exact arithmetic, and both frameworks would train the
        earlier layers on rounding noise (issue #43). At 64 x 64 the last
        stage still normalises 8 values a channel, which amplifies f32's
        differences from step to step: on one seed the first step's updates
        agreed with PyTorch's to 1e-5 of their largest, the third's to 2e-3
        (the losses to 1e-5 throughout), hence 1e-2 for the updates here.
        On PyTorch 2.6 (torch.export) PyTorch's own f32 run strays further:
        on one seed conv1's update differed from cudagen's by 5% of its
        largest, and a running variance by 1.07e-4, while cudagen's stayed as
        close to the float64 run's as PyTorch's (check_training's fallback).
        Eval-mode BatchNorm in training:
        test_batchnorm_in_eval_mode_trains_as_pytorch_does."""
        seed = fresh_seed()
        torch.manual_seed(seed)
        self.check_training(seed, models.resnet18(), (torch.randn(2, 3, 64, 64),), "cross_entropy", "sgd",
                            {"lr": 0.002}, steps=3, train_mode=True, update_rtol=1e-2)

    @unittest.skipUnless(importlib.util.find_spec("transformers"), "transformers is not installed here: ctest's "
                         "torch_frontend.transformers.* run this in .cache/torch1-venv and .cache/torch2-venv")
    def test_transformers_gpt2_trains_as_pytorch_does(self):
        """transformers' GPT-2 (a small config of GPT2LMHeadModel, its output projection tied to
        the token embedding: one parameter, two uses) trains three AdamW steps on token
        cross-entropy, matching PyTorch's losses and every parameter's update."""
        seed = fresh_seed()
        torch.manual_seed(seed)
        self.check_training(seed, models.transformers_gpt2(), (torch.randint(0, 64, (2, 8)),), "cross_entropy", "adamw",
                            {"lr": 1e-3, "weight_decay": 0.01, "eps": 1e-3}, steps=3)

    def test_batchnorm_in_eval_mode_trains_as_pytorch_does(self):
        """An eval-mode BatchNorm in a training export is not folded into
        the convolution before it: the convolution's weight, and the norm's
        weight and bias, train under their PyTorch names; its statistics stay."""
        seed = fresh_seed()
        torch.manual_seed(seed)
        self.check_training(seed, models.small_resnet(batchnorm=True), (torch.randn(2, 3, 12, 12),), "cross_entropy",
                            "sgd", {"lr": 0.1})
        names = {t.get("name") for t in _tensors(os.path.join(self.dir, "model", "graph.json"))}
        for name in ("stem.weight", "stem_bn.weight", "stem_bn.bias", "bn1.weight", "bn1.bias"):
            self.assertIn(name, names)
        self.assertNotIn("stem.weight.folded", names)

    def test_decoder_block_trains_as_pytorch_does(self):
        seed = fresh_seed()
        torch.manual_seed(seed)
        # eps 1e-3: with Adam's first steps every update is about lr * sign(gradient), so a
        # gradient near round-off (1e-8) would flip its sign between any two orders of summation.
        self.check_training(seed, models.BlockClassifier().eval(), (torch.randn(1, 16, 48),), "cross_entropy", "adamw",
                            {"lr": 1e-3, "weight_decay": 0.01, "eps": 1e-3})


class Errors(unittest.TestCase):
    def export_error(self, model, inputs, **kwargs):
        out = tempfile.mkdtemp(prefix="cudagen_torch_err_")
        shutil.rmtree(out)
        with self.assertRaises(cudagen_torch.ExportError) as caught:
            cudagen_torch.export(model, inputs, out, **kwargs)
        self.assertFalse(os.path.exists(out), "nothing may be written on failure")
        return str(caught.exception)

    def test_an_op_without_a_mapping_names_node_target_line_and_equivalents(self):
        class Cumulative(torch.nn.Module):
            def forward(self, x):
                return torch.cumsum(x, dim=-1)

        message = self.export_error(Cumulative(), (torch.randn(3, 4),))
        self.assertIn("fx node 'cumsum'", message)
        self.assertIn("target torch.cumsum" if TRACER == "torch.fx.symbolic_trace" else "target aten.cumsum.default",
                      message)
        self.assertIn("test_frontend.py", message)  # the model's source line
        self.assertIn("return torch.cumsum(x, dim=-1)", message)
        # A running sum is no sum: nothing is offered where nothing is equivalent.
        self.assertNotIn("supported instead", message)
        if TRACER == "torch.export":  # its stack keeps modules' frames only: the module is named too
            wrapped = torch.nn.Sequential(torch.nn.Identity(), Cumulative())
            self.assertIn("in module 1 (Cumulative)", self.export_error(wrapped, (torch.randn(3, 4),)))

        class BatchedAddMatmul(torch.nn.Module):
            def forward(self, x):
                return torch.baddbmm(x, x, x)

        message = self.export_error(BatchedAddMatmul(), (torch.randn(2, 3, 3),))
        self.assertIn("torch.bmm then +", message)
        self.assertRegex(message, r"supported instead: .*bmm")
        self.assertNotIn("dropout", message)

    def test_an_in_place_update_through_a_view_is_refused(self):
        class ThroughView(torch.nn.Module):
            def forward(self, x):
                y = x * 2
                y.view(-1).add_(1)
                return y

        if TRACER != "torch.fx.symbolic_trace":
            self.skipTest("torch.export functionalizes views itself")
        message = self.export_error(ThroughView(), (torch.randn(3, 4),))
        self.assertIn("an in-place update", message)
        self.assertIn("write the update out of place", message)
        self.assertIn("y.view(-1).add_(1)", message)

    def test_an_index_assignment_into_a_view_is_refused(self):
        class IntoAView(torch.nn.Module):
            def forward(self, x):
                mask = x.new_zeros(4, 6)
                row = mask[0]
                row[1:3] = 1.0  # the mask shares it: a copy would leave the mask as it was
                return x + mask

        if TRACER != "torch.fx.symbolic_trace":
            self.skipTest("torch.export captures index assignment itself")
        message = self.export_error(IntoAView(), (torch.randn(4, 6),))
        self.assertIn("an index assignment into a view", message)
        self.assertIn("assign into the tensor itself", message)

    def test_data_dependent_control_flow(self):
        class Branchy(torch.nn.Module):
            def forward(self, x):
                if x.sum() > 0:
                    return x * 2
                return x

        message = self.export_error(Branchy(), (torch.randn(3),))
        self.assertIn("torch.fx could not trace the model at" if TRACER == "torch.fx.symbolic_trace"
                      else "torch.export could not capture the model at", message)
        self.assertIn("if x.sum() > 0:", message)
        self.assertIn("control flow", message)

    def test_a_tracer_this_pytorch_lacks(self):
        if TRACER == "torch.export":
            with self.assertRaises(cudagen_torch.ExportError) as caught:
                cudagen_torch.export(models.mlp(), (torch.randn(2, 20),), tempfile.mkdtemp(), tracer="jit")
            self.assertIn("tracer='jit': use one of auto, export, fx", str(caught.exception))
        else:
            message = self.export_error(models.mlp(), (torch.randn(2, 20),), tracer="export")
            self.assertIn("tracer='export' needs torch.export (PyTorch 2.2 or later)", message)
            self.assertIn("use tracer='fx'", message)

    def test_training_a_bfloat16_model(self):
        message = self.export_error(models.mlp().to(torch.bfloat16), (torch.randn(2, 20).to(torch.bfloat16),),
                                    loss="mse")
        self.assertIn("loss= needs a float32 model, this one's output is bf16", message)

    def test_a_channel_dropout_in_train_mode(self):
        dropout = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.Dropout2d(0.1))
        message = self.export_error(dropout, (torch.randn(2, 3, 4, 4),), train_mode=True)
        self.assertIn("Dropout2d", message)

    def test_a_dtype_the_registry_lacks(self):
        class Complexish(torch.nn.Module):
            def forward(self, x):
                return torch.relu(x)

        message = self.export_error(Complexish(), (torch.randn(3).to(torch.int8),))
        self.assertIn("dtype torch.int8 is not in the registry", message)
        self.assertIn("fx node 'x'", message)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    CUDAGEN = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
