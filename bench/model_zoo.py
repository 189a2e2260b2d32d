#!/usr/bin/env python3
"""The PyTorch frontend's coverage: a pinned list of real models exported with
cudagen_torch, compiled, run in cudagen's host emulation and compared with
PyTorch's own outputs on the same inputs; one table row per model.

    bench/model_zoo.py CUDAGEN [--ci] [--only NAME,...] [--jobs N] [--json FILE] [--timeout S]
    bench/model_zoo.py --combine ROWS.json... [--markdown FILE]

The list: every classification model family of torchvision, each by its
smallest variant at a small input, and transformers' GPT-2, BERT, LLaMA and T5
encoder from small configs (random weights, no downloads; BatchNorm statistics
randomised so that folding them is tested on more than the identity). It runs
on the interpreter's PyTorch: Debian's 1.13 (/usr/bin/python3: the torch.fx
path) or the pinned 2.x that scripts/dev.sh installs (.cache/torch2-venv/bin/python:
the torch.export path). A model passes when cudagen's run succeeds (its own
float64 check included) and every output is within 1e-4 of the model's own in
eager PyTorch, relative to the output's largest magnitude. A model this PyTorch or its packages lack
is listed as "n/a" with the reason; a failure with the first line of its error,
which names the op or the check that stops it. Nothing is skipped silently.

--ci runs one model per family (CI does, on both PyTorch versions): the
family's listed model where it is cheap, else a small configuration of the
family's own torchvision classes (alexnet_ci, vit_ci, ...: fewer blocks,
narrower layers, the same module code); the exit status is 1 when an
available model fails. --json keeps a
run's rows; --combine puts the rows of runs on several PyTorch versions side by
side, one line a model, as docs/torch-frontend.md carries it (--markdown FILE).
"""
import argparse
import json
import os
import select
import signal
import subprocess
import threading
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "frontends", "torch"))

TOLERANCE = 1e-4  # max |cudagen - PyTorch| <= TOLERANCE * max |PyTorch| (f32 outputs)


def _randomised(model):
    """Random BatchNorm statistics (folding them must be right, not merely the
    identity), and no all-zero head (ViT's starts so: no output to compare)."""
    import torch
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and not m.weight.any():
            torch.nn.init.normal_(m.weight, std=0.1)
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)
    return model.eval()


def _torchvision(name, size, **kwargs):
    def build():
        import torch
        try:
            import torchvision
        except ImportError:
            raise Unavailable("torchvision is not installed")
        builder = getattr(torchvision.models, name, None)
        if builder is None:
            raise Unavailable(f"torchvision {torchvision.__version__} has no {name}")
        torch.manual_seed(0)
        return _randomised(builder(**kwargs)), (torch.randn(1, 3, size, size),)
    return build


def _small(size, make):
    """A family's own torchvision classes in a small configuration (fewer
    blocks, narrower layers): the same module code as the listed variant, at
    a fraction of its emulated cost. make(torchvision.models) builds it."""
    def build():
        import torch
        try:
            import torchvision
        except ImportError:
            raise Unavailable("torchvision is not installed")
        torch.manual_seed(0)
        try:
            model = make(torchvision.models)
        except AttributeError as e:  # a class this torchvision lacks
            raise Unavailable(f"torchvision {torchvision.__version__}: {e}")
        return _randomised(model), (torch.randn(1, 3, size, size),)
    return build


def _narrow_classifier(model, widths, inputs=None):
    """The model with the Linear layers of its `classifier` narrowed to
    `widths` (AlexNet's and VGG's 4096-wide ones hold almost all the work of
    a small input); the first reads `inputs` features (default: as it did)."""
    import torch
    linears = [i for i, m in enumerate(model.classifier) if isinstance(m, torch.nn.Linear)]
    inputs = inputs or model.classifier[linears[0]].in_features
    for i, width in zip(linears, widths):
        model.classifier[i] = torch.nn.Linear(inputs, width)
        inputs = width
    return model


def _efficientnet(models, v2):
    e = models.efficientnet
    if v2:
        setting = [e.FusedMBConvConfig(1, 3, 1, 16, 16, 1), e.FusedMBConvConfig(4, 3, 2, 16, 24, 1),
                   e.MBConvConfig(4, 3, 2, 24, 32, 1)]
    else:
        setting = [e.MBConvConfig(1, 3, 1, 16, 16, 1), e.MBConvConfig(6, 5, 2, 16, 24, 1)]
    return models.EfficientNet(setting, dropout=0.2, last_channel=64 if v2 else None, num_classes=10)


def _swin(models, v2):
    s = models.swin_transformer
    extra = dict(block=s.SwinTransformerBlockV2, downsample_layer=s.PatchMergingV2) if v2 else {}
    return models.SwinTransformer([4, 4], 16, [2, 1], [2, 2], [4, 4], num_classes=10, **extra)


def _transformers(name):
    def build():
        import torch
        try:
            import transformers
        except ImportError:
            raise Unavailable("transformers is not installed (scripts/dev.sh installs it with PyTorch 2.x)")
        torch.manual_seed(0)
        small = dict(vocab_size=100)
        if name == "gpt2":
            model = transformers.GPT2Model(transformers.GPT2Config(n_positions=16, n_embd=32, n_layer=2, n_head=2, **small))
        elif name == "bert":
            model = transformers.BertModel(transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                                   intermediate_size=64, max_position_embeddings=16, **small))
        elif name == "llama":
            model = transformers.LlamaModel(transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                                     num_key_value_heads=2, intermediate_size=64,
                                                                     max_position_embeddings=16, **small))
        else:
            model = transformers.T5EncoderModel(transformers.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                                                      **small))
        decoder_only = name in ("gpt2", "llama")

        class LastHiddenState(torch.nn.Module):
            """The model called as a user calls it, on token ids only; its last hidden state."""

            def __init__(self, model):
                super().__init__()
                self.model = model

            def forward(self, ids):
                extra = {"use_cache": False} if decoder_only else {}
                return self.model(input_ids=ids, return_dict=False, **extra)[0]

        return LastHiddenState(model).eval(), (torch.randint(0, 100, (1, 8)),)
    return build


class Unavailable(Exception):
    """This PyTorch (or its packages) lacks the model."""


# (name, family, builder, ci): the smallest variant of each family. ci: True
# where CI runs the model itself, or (name, builder) of the small
# configuration CI runs for its family instead, or None where another model
# stands for the family.
MODELS = [
    ("alexnet", "AlexNet", _torchvision("alexnet", 64),
     ("alexnet_ci", _small(64, lambda m: _narrow_classifier(m.AlexNet(num_classes=10), [64, 64, 10])))),
    ("vgg11_bn", "VGG", _torchvision("vgg11_bn", 32),
     ("vgg_bn_ci", _small(32, lambda m: _narrow_classifier(
         m.VGG(m.vgg.make_layers([16, "M", 32, "M", 32, 32, "M", 64, 64, "M", 64, 64, "M"], batch_norm=True)),
         [64, 64, 10], inputs=64 * 7 * 7)))),
    ("resnet18", "ResNet", _torchvision("resnet18", 32), True),
    ("resnext50_32x4d", "ResNeXt", _torchvision("resnext50_32x4d", 32),
     ("resnext_ci", _small(32, lambda m: m.ResNet(m.resnet.Bottleneck, [1, 1, 1, 1], groups=32, width_per_group=4,
                                                  num_classes=10)))),
    ("wide_resnet50_2", "Wide ResNet", _torchvision("wide_resnet50_2", 32),
     ("wide_resnet_ci", _small(32, lambda m: m.ResNet(m.resnet.Bottleneck, [1, 1, 1, 1], width_per_group=128,
                                                      num_classes=10)))),
    ("squeezenet1_0", "SqueezeNet", _torchvision("squeezenet1_0", 64), True),
    ("densenet121", "DenseNet", _torchvision("densenet121", 32),
     ("densenet_ci", _small(32, lambda m: m.DenseNet(growth_rate=8, block_config=(2, 2, 2, 2), num_init_features=16,
                                                     bn_size=2, num_classes=10)))),
    ("googlenet", "GoogLeNet", _torchvision("googlenet", 64, init_weights=True),
     ("googlenet_ci", _torchvision("googlenet", 32, init_weights=True, aux_logits=False, num_classes=10))),
    ("inception_v3", "Inception", _torchvision("inception_v3", 75, init_weights=True),
     ("inception_ci", _torchvision("inception_v3", 75, init_weights=True, aux_logits=False, num_classes=10))),
    ("shufflenet_v2_x0_5", "ShuffleNet", _torchvision("shufflenet_v2_x0_5", 32), True),
    ("mobilenet_v2", "MobileNet", _torchvision("mobilenet_v2", 32), None),
    ("mobilenet_v3_small", "MobileNet", _torchvision("mobilenet_v3_small", 32), True),
    ("mnasnet0_5", "MNASNet", _torchvision("mnasnet0_5", 32), True),
    ("efficientnet_b0", "EfficientNet", _torchvision("efficientnet_b0", 32),
     ("efficientnet_ci", _small(32, lambda m: _efficientnet(m, v2=False)))),
    ("efficientnet_v2_s", "EfficientNetV2", _torchvision("efficientnet_v2_s", 32),
     ("efficientnet_v2_ci", _small(32, lambda m: _efficientnet(m, v2=True)))),
    ("regnet_x_400mf", "RegNet", _torchvision("regnet_x_400mf", 32), None),
    ("regnet_y_400mf", "RegNet", _torchvision("regnet_y_400mf", 32), True),
    ("convnext_tiny", "ConvNeXt", _torchvision("convnext_tiny", 32),
     ("convnext_ci", _small(32, lambda m: m.ConvNeXt([m.convnext.CNBlockConfig(16, 32, 1),
                                                      m.convnext.CNBlockConfig(32, None, 1)], num_classes=10)))),
    ("vit_b_16", "ViT", _torchvision("vit_b_16", 32, image_size=32),
     ("vit_ci", _small(32, lambda m: m.VisionTransformer(32, 8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
                                                         num_classes=10)))),
    ("swin_t", "Swin", _torchvision("swin_t", 32), ("swin_ci", _small(32, lambda m: _swin(m, v2=False)))),
    ("swin_v2_t", "Swin V2", _torchvision("swin_v2_t", 32), ("swin_v2_ci", _small(32, lambda m: _swin(m, v2=True)))),
    ("maxvit_t", "MaxViT", _torchvision("maxvit_t", 224),
     ("maxvit_ci", _small(64, lambda m: m.MaxVit((64, 64), stem_channels=16, partition_size=4, block_channels=[16, 32],
                                                 block_layers=[1, 1], head_dim=8, stochastic_depth_prob=0.0,
                                                 num_classes=10)))),
    ("gpt2", "GPT-2 (transformers)", _transformers("gpt2"), True),
    ("bert", "BERT (transformers)", _transformers("bert"), True),
    ("llama", "LLaMA (transformers)", _transformers("llama"), True),
    ("t5_encoder", "T5 encoder (transformers)", _transformers("t5"), True),
]
# Every runnable entry, CI's small configurations too: name -> (family, builder).
RUNNABLE = dict([(m[0], (m[1], m[2])) for m in MODELS] +
                [(m[3][0], (m[1], m[3][1])) for m in MODELS if isinstance(m[3], tuple)])


def ci_names():
    """One model per family: the listed one where CI runs it, else its family's small configuration."""
    return [m[0] if m[3] is True else m[3][0] for m in MODELS if m[3] is True or isinstance(m[3], tuple)]


def run_one(name, cudagen, work):
    """Exports, runs and compares one model, in this process; returns its row."""
    import numpy as np
    import torch
    import cudagen_torch
    family, builder = RUNNABLE[name]
    row = {"model": name, "family": family, "torch": torch.__version__.split("+")[0]}
    start = time.time()
    try:
        model, inputs = builder()
    except Unavailable as e:
        return dict(row, status="n/a", note=str(e), seconds=0.0)
    # The model's own output, eager PyTorch: the reference, independent of how the exporter
    # captured the model (its expected/ files come from running the captured graph).
    with torch.no_grad():
        eager = model(*inputs)
    eager = [t.detach().double().numpy() for t in (eager if isinstance(eager, (tuple, list)) else [eager])]
    try:
        result = cudagen_torch.export(model, inputs, os.path.join(work, "model"))
    except Exception as e:  # the exporter's errors name the node, its target and the model's source line
        first = (str(e).splitlines() or [""])[0]
        return dict(row, path="?", status="FAIL", note=f"export: {type(e).__name__}: {first}", seconds=time.time() - start)
    row["path"] = {"torch.export": "export", "torch.fx.symbolic_trace": "fx"}.get(result.tracer, result.tracer)
    outputs = os.path.join(work, "outputs")
    run = subprocess.run([cudagen, "run", result.graph_path, "--emulate", "--inputs", os.path.join(work, "model", "example"),
                          "--outputs", outputs, "--work-dir", os.path.join(work, "build")],
                         capture_output=True, text=True)
    row["seconds"] = time.time() - start
    if run.returncode != 0:
        lines = [l for l in (run.stderr + run.stdout).splitlines() if "error" in l.lower() or "FAIL" in l]
        return dict(row, status="FAIL", note="cudagen run: " + (lines[0].strip() if lines else f"exit {run.returncode}"))
    if len(eager) != len(result.outputs):
        return dict(row, status="FAIL", note=f"{len(result.outputs)} outputs exported, the model returns {len(eager)}")
    worst = 0.0
    for out, want in zip(result.outputs, eager):
        got = np.load(os.path.join(outputs, out + ".npy")).astype(np.float64)
        if got.shape != want.shape or not np.isfinite(got).all():
            return dict(row, status="FAIL", note=f"output {out}: shape {got.shape} against {want.shape}, or not finite")
        if not np.abs(want).max() > 0:
            return dict(row, status="FAIL", note=f"PyTorch's output {out} is all zero: the comparison would prove nothing")
        worst = max(worst, float(np.abs(got - want).max()) / max(float(np.abs(want).max()), 1e-30))
    row["error"] = worst
    if worst > TOLERANCE:
        return dict(row, status="FAIL", note=f"max |error| {worst:.2g} of max |output|, over {TOLERANCE:g}")
    return dict(row, status="pass", note="")


class Worker:
    """A child process that runs models one after another (run_one; `--serve`),
    so that PyTorch is imported once a worker, not once a model (6 s of CPU on
    2.6). A crash, a hang (past the timeout) or a failure ends the child, and
    the next model starts a fresh one: what went wrong stays there. The child's
    stdout carries only its rows; everything else it prints goes to stderr, a
    file whose last line reports a crash."""

    def __init__(self, cudagen):
        self.cudagen, self.child, self.stderr = cudagen, None, None

    def stop(self):
        if self.child is not None:
            try:
                os.killpg(self.child.pid, signal.SIGKILL)  # the cudagen run it started too
            except ProcessLookupError:
                pass
            self.child.wait()
            self.child = None

    def run(self, name, timeout):
        if self.child is None:
            self.stderr = tempfile.TemporaryFile(mode="w+")
            self.child = subprocess.Popen([sys.executable, os.path.abspath(__file__), self.cudagen, "--serve"],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
                                          start_new_session=True)
        fail = lambda note, seconds: {"model": name, "family": RUNNABLE[name][0], "status": "FAIL", "note": note,
                                      "seconds": seconds}
        with tempfile.TemporaryDirectory(prefix=f"zoo_{name}_") as work:
            try:
                self.child.stdin.write(json.dumps([name, work]) + "\n")
                self.child.stdin.flush()
            except BrokenPipeError:
                pass  # it died: the read below sees the end of its output
            ready, _, _ = select.select([self.child.stdout], [], [], timeout)
            line = self.child.stdout.readline() if ready else None
            if line is None:
                self.stop()
                return fail(f"over the {timeout} s timeout", float(timeout))
            if not line.startswith("{"):
                self.stop()
                self.stderr.seek(0)
                tail = (self.stderr.read().strip().splitlines() or ["no output"])[-1]
                return fail(f"crashed: {tail}", 0.0)
            row = json.loads(line)
            if row["status"] == "FAIL":
                self.stop()
            return row


def serve(cudagen):
    """--serve: run_one for each [name, work] line of stdin, a JSON row a line
    on stdout (the only thing written there: print goes to stderr)."""
    rows = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin:
        name, work = json.loads(line)
        rows.write(json.dumps(run_one(name, cudagen, work)) + "\n")
        rows.flush()


def table(rows):
    head = ["model", "family", "PyTorch", "path", "status", "max error", "seconds", "what stops it"]
    cells = [[r["model"], r["family"], r.get("torch", ""), r.get("path", ""), r["status"],
              f"{r['error']:.1e}" if "error" in r else "", f"{r.get('seconds', 0):.0f}", r.get("note", "")] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) if i < len(head) - 1 else 0 for i, h in enumerate(head)]
    fmt = lambda row: "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
    return "\n".join([fmt(head)] + [fmt(c) for c in cells])


def combined_table(runs):
    """One Markdown line a model, a column pair (status, max error) a PyTorch version, and
    what stops it where it fails."""
    version = lambda rows: next((r["torch"] for r in rows if r.get("torch")), "?")
    path = lambda rows: next((r["path"] for r in rows if r.get("path") not in (None, "?")), "?")
    versions = [f"{version(rows)} ({path(rows)})" for rows in runs]
    head = ["model", "family"] + [f"PyTorch {v}" for v in versions] + ["what stops it"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by_model = [{r["model"]: r for r in rows} for rows in runs]
    for name, family, _, _ in MODELS:
        cells, notes = [name, family], []
        for rows in by_model:
            r = rows.get(name)
            if r is None:
                cells.append("not run")
                continue
            cells.append(f"{r['status']} ({r['error']:.0e})" if "error" in r and r["status"] == "pass" else r["status"])
            if r.get("note") and r["note"] not in notes:
                notes.append(r["note"])
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells + ["; ".join(notes)]) + " |")
    for rows in runs:
        available = [r for r in rows if r["status"] != "n/a"]
        passed = sum(r["status"] == "pass" for r in available)
        lines.append(f"\nPyTorch {version(rows)}: {passed} of {len(available)} pass"
                     + (f", {len(rows) - len(available)} not available" if len(rows) > len(available) else "") + ".")
    return "\n".join(lines) + "\n"


def main():
    if "--combine" in sys.argv:
        ap = argparse.ArgumentParser(description="the rows of several runs (--json) side by side")
        ap.add_argument("--combine", nargs="+", required=True, metavar="ROWS.json")
        ap.add_argument("--markdown", metavar="FILE", help="write the table here (default: print it)")
        a = ap.parse_args()
        runs = []
        for path in a.combine:
            with open(path) as f:
                runs.append(json.load(f))
        text = combined_table(runs)
        if not a.markdown:
            print(text, end="")
            return
        with open(a.markdown + ".tmp", "w") as f:
            f.write(text)
        os.replace(a.markdown + ".tmp", a.markdown)
        return

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("cudagen", help="the cudagen binary (build/generator/cudagen)")
    ap.add_argument("--ci", action="store_true", help="one model per family, as CI runs (a small configuration where the listed one is costly)")
    ap.add_argument("--only", help="comma-separated model names (default: the whole list)")
    ap.add_argument("--jobs", type=int, default=2, help="models run at once (each compiles with the host compiler)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds a model may take")
    ap.add_argument("--json", metavar="FILE", help="also write the rows (for --combine)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    cudagen = os.path.abspath(a.cudagen)
    if a.serve:
        serve(cudagen)
        return
    names = ci_names() if a.ci else [m[0] for m in MODELS]
    if a.only:
        wanted = a.only.split(",")
        unknown = sorted(set(wanted) - set(RUNNABLE))
        if unknown:
            ap.error(f"no model {', '.join(unknown)} in the list; it has {', '.join(RUNNABLE)}")
        names = [n for n in wanted if n in names or not a.ci]
    print(f"{len(names)} models, {a.jobs} at a time, on {sys.executable}", flush=True)
    rows = {}
    local, workers = threading.local(), []  # a worker process per thread of the pool

    def run(name):
        if not hasattr(local, "worker"):
            local.worker = Worker(cudagen)
            workers.append(local.worker)
        return local.worker.run(name, a.timeout)

    try:
        with ThreadPoolExecutor(max_workers=a.jobs) as pool:
            for r in pool.map(run, names):
                rows[r["model"]] = r
                print(f"  {r['model']:<20} {r['status']:<5} {r.get('seconds', 0):6.0f} s  {r.get('note', '')}", flush=True)
    finally:
        for worker in workers:
            worker.stop()
    ordered = [rows[n] for n in names]
    print(table(ordered))
    passed = sum(r["status"] == "pass" for r in ordered)
    available = sum(r["status"] != "n/a" for r in ordered)
    print(f"{passed} of {available} available models pass ({len(ordered) - available} not in this PyTorch's packages)")
    if a.json:
        with open(a.json + ".tmp", "w") as f:
            json.dump(ordered, f, indent=1)
        os.replace(a.json + ".tmp", a.json)
    if passed < available:
        sys.exit(1)


if __name__ == "__main__":
    main()
