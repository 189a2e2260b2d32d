"""python3 -m cudagen_torch export package.module:factory --input 1x3x64x64 -o model/"""

import argparse
import importlib
import sys

import torch

from .exporter import TRACERS, ExportError, export, supported_targets

DTYPES = {"f32": torch.float32, "f16": torch.float16, "f64": torch.float64, "i32": torch.int32, "i64": torch.int64}


def _input(spec):
    """'1x3x64x64' or '1x3x64x64:f32' or '2x16:i64:1000' (integers below 1000)."""
    parts = spec.split(":")
    try:
        shape = tuple(int(d) for d in parts[0].split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--input {spec}: write the shape as 1x3x64x64") from None
    dtype = DTYPES.get(parts[1] if len(parts) > 1 else "f32")
    if dtype is None:
        raise argparse.ArgumentTypeError(f"--input {spec}: the dtype is one of {', '.join(DTYPES)}")
    high = int(parts[2]) if len(parts) > 2 else 100
    return shape, dtype, high


def _factory(text):
    if ":" not in text:
        raise argparse.ArgumentTypeError(f"{text}: write package.module:factory (a function returning the model)")
    module_name, attr = text.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise argparse.ArgumentTypeError(f"{text}: cannot import {module_name}: {e}") from None
    factory = module
    for part in attr.split("."):
        if not hasattr(factory, part):
            raise argparse.ArgumentTypeError(f"{text}: {module_name} has no {attr}")
        factory = getattr(factory, part)
    return factory


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python3 -m cudagen_torch",
                                     description="Export a PyTorch model to a cudagen task graph and its weights.")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="capture a model (torch.export or torch.fx) and write graph.json plus one "
                        ".npy per weight",
                        description="Calls FACTORY() for the model (in eval mode), traces it on random inputs of "
                        "the given shapes, and writes OUT/graph.json, OUT/<parameter name>.npy, and the example "
                        "inputs and PyTorch's outputs under OUT/example and OUT/expected. Then: "
                        "cudagen run OUT/graph.json --emulate --inputs OUT/example --outputs DIR")
    ex.add_argument("factory", type=_factory, help="package.module:function returning the torch.nn.Module")
    ex.add_argument("--input", type=_input, action="append", required=True, metavar="SHAPE[:DTYPE[:HIGH]]",
                    help="one per forward() argument: 1x3x64x64, or 2x16:i64:1000 for integer ids below 1000")
    ex.add_argument("-o", "--output", required=True, metavar="OUT", help="the folder to write")
    ex.add_argument("--name", help="the graph's name (default: the model's class)")
    ex.add_argument("--seed", type=int, default=0, help="seed of the example inputs (default 0)")
    ex.add_argument("--loss", choices=["cross_entropy", "mse"], help="add a loss: the graph then trains")
    ex.add_argument("--optimizer", choices=["sgd", "adam", "adamw"], help="with --loss: derive an update phase")
    ex.add_argument("--lr", type=float, default=0.01, help="the optimizer's learning rate (default 0.01)")
    ex.add_argument("--precision", choices=["bf16", "f16"],
                    help="with --loss: train as torch.autocast(dtype=torch.bfloat16 or float16) does, f32 master "
                    "weights and products in 16 bits; f16 with dynamic loss scaling, as GradScaler does (needs "
                    "--optimizer) (default: f32 throughout)")
    ex.add_argument("--clip-grad-norm", type=float, metavar="MAX",
                    help="with --optimizer: clip the gradients to this global L2 norm before each update, as "
                    "torch.nn.utils.clip_grad_norm_ does (default: no clipping)")
    ex.add_argument("--accumulate-gradients", action="store_true",
                    help="with --optimizer: let each training step run over several micro-batches and update with "
                    "the mean of their gradients (cudagen run --micro-batches K)")
    ex.add_argument("--train-mode", action="store_true",
                    help="export the model in training mode: BatchNorm normalises by each batch's statistics and "
                    "updates its running ones (default: eval mode)")
    ex.add_argument("--tracer", choices=TRACERS, default="auto",
                    help="how to capture the model: torch.export (PyTorch 2.x), torch.fx's symbolic tracer, or auto "
                    "(default): torch.export where this PyTorch has it")
    sub.add_parser("targets", help="list the modules, functions and tensor methods that map to cudagen ops")
    args = parser.parse_args(argv)

    if args.command == "targets":
        print("\n".join(supported_targets()))
        return 0
    generator = torch.Generator().manual_seed(args.seed)
    inputs = []
    for shape, dtype, high in args.input:
        if dtype.is_floating_point:
            inputs.append(torch.randn(shape, generator=generator).to(dtype))
        else:
            inputs.append(torch.randint(0, high, shape, generator=generator, dtype=dtype))
    model = args.factory()
    if not isinstance(model, torch.nn.Module):
        print(f"error: the factory returned {type(model).__name__}, not a torch.nn.Module", file=sys.stderr)
        return 2
    try:
        result = export(model, tuple(inputs), args.output, name=args.name, loss=args.loss, optimizer=args.optimizer,
                        optimizer_args={"lr": args.lr} if args.optimizer else None, tracer=args.tracer,
                        train_mode=args.train_mode, precision=args.precision, clip_grad_norm=args.clip_grad_norm,
                        accumulate_gradients=args.accumulate_gradients)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"exported {result.graph_path} ({result.tasks} tasks, {len(result.weights)} weight files; "
          f"traced with {result.tracer})")
    print(f"inputs: {', '.join(result.inputs)}; outputs: {', '.join(result.outputs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
