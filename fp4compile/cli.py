"""The ``fp4compile`` command.

    fp4compile inspect MODULE:FACTORY --input-shape 2x32 [--input-dtype long] [--show table|graphs|diff|mlir|dot|pipeline]
                       [--stage dynamo|forward|backward] [--image out.png] [--recipe-option key=value ...]
    fp4compile export MODULE:FACTORY CHECKPOINT OUT --input-shape 2x32 [--input-dtype long] [--scheme NVFP4A16|NVFP4]
                      [--recipe-option key=value ...] [--trust-checkpoint]
    fp4compile pipeline
    fp4compile kernels build|list ...      (where the kernel tooling is installed)

``inspect`` builds the model by calling ``FACTORY()`` from ``MODULE`` (an importable module such as
``mypkg.models`` or a ``.py`` file path), makes random inputs of the given shapes, runs
``fp4compile.explain`` (one forward and one backward through the nvfp4 backend) and prints what the
compiler did. ``export`` builds the model the same way, loads CHECKPOINT's weights into it (a state dict,
or a dict holding one under "model"), compiles one forward and backward with the recipe to find its
precision plan, and writes the NVFP4 checkpoint OUT (``fp4compile.export``, docs/export.md): W4A16 by
default; W4A4 (``--scheme NVFP4``) with the activation ranges recorded in training, which CHECKPOINT
holds where it keeps the backend's state under "backend" (``Backend.state_dict()``). CHECKPOINT is
loaded with ``torch.load(weights_only=True)``, which unpickles tensors and plain data only; a file that
holds anything else is refused unless ``--trust-checkpoint`` (with a warning) loads it in full.
Errors in ``MODULE:FACTORY`` or the options exit with status 2.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import os
import pickle
import re
import sys
from pathlib import Path
from typing import Optional, Sequence

import fp4compile
from fp4compile.recipe import Recipe

# torch is imported by the commands that run, not for ``--help`` or a usage error.

__all__ = ["main", "load_factory"]

DTYPES = {
    "long": "int64", "int64": "int64", "int": "int32", "int32": "int32",
    "float": "float32", "float32": "float32", "half": "float16", "float16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}
SHOW = ("table", "graphs", "diff", "mlir", "dot", "pipeline")


class UsageError(Exception):
    """A mistake in the command line: reported in one line, exit status 2."""


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UsageError as exc:
        print(f"fp4compile {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fp4compile", description="Train PyTorch models with NVFP4 through torch.compile.")
    commands = parser.add_subparsers(dest="command")
    commands.required = True

    inspect = commands.add_parser(
        "inspect", help="compile a model's forward and backward and show what the compiler did",
        description="Compile FACTORY() from MODULE with the nvfp4 backend (one forward and one backward on "
        "random inputs) and print the precision table, the graphs after each pass, their diffs, MLIR or DOT.",
    )
    inspect.add_argument("model", metavar="MODULE:FACTORY",
                         help="e.g. mypkg.models:build or path/to/file.py:TinyGPT; FACTORY() must return an nn.Module")
    inspect.add_argument("--input-shape", action="append", required=True, type=_shape, metavar="DxDx...",
                         help="shape of one model input, e.g. 2x32; repeat for several inputs")
    inspect.add_argument("--input-dtype", action="append", choices=sorted(DTYPES), metavar="DTYPE",
                         help="long (random token ids), float, bfloat16, ...: one for all inputs or one per input "
                         "(default float)")
    inspect.add_argument("--input-high", type=int, metavar="N",
                         help="integer inputs are drawn from [0, N) (default: the smallest nn.Embedding's size)")
    inspect.add_argument("--show", choices=SHOW, default="table", help="what to print (default: table)")
    inspect.add_argument("--stage", choices=("dynamo", "joint", "forward", "backward"),
                         help="graph stage for graphs/diff (default: all), mlir (default: forward), dot and "
                         "--image (default: backward)")
    inspect.add_argument("--full", action="store_true",
                         help="dot and --image: every node, not only the quantize/RHT/GEMM/attention ones")
    inspect.add_argument("--image", type=Path, metavar="PATH", help="also draw the data-flow graph (PNG/SVG/PDF)")
    inspect.add_argument("--recipe-option", action="append", default=[], type=_option, metavar="KEY=VALUE",
                         help="a Recipe field, e.g. rht=false, fmt=mxfp4, high_precision_last_blocks=2; repeatable")
    inspect.add_argument("--inner", choices=("eager", "inductor"), default="eager", help="inner compiler (default: eager)")
    inspect.add_argument("--device", default="cpu", help="device for the model and inputs (default: cpu)")
    inspect.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default: 0)")
    inspect.set_defaults(func=_inspect)

    export = commands.add_parser(
        "export", help="write a trained model's checkpoint as an NVFP4 compressed-tensors folder",
        description="Load CHECKPOINT into FACTORY() from MODULE, find its precision plan with the recipe (one "
        "forward and backward on random inputs of the given shapes) and write the NVFP4 weights, as the "
        "training forward quantizes them, in the compressed-tensors format (W4A16: weights only; W4A4 takes "
        "the activation ranges recorded in training from the backend state CHECKPOINT holds under 'backend').",
    )
    export.add_argument("model", metavar="MODULE:FACTORY", help="the model's factory, as for inspect")
    export.add_argument("checkpoint", type=Path, metavar="CHECKPOINT",
                        help="torch.save'd state dict, or a dict with the state dict under 'model'")
    export.add_argument("out", type=Path, metavar="OUT", help="folder to write")
    export.add_argument("--input-shape", action="append", required=True, type=_shape, metavar="DxDx...",
                        help="shape of one model input for the planning pass, e.g. 2x32; repeatable")
    export.add_argument("--input-dtype", action="append", choices=sorted(DTYPES), metavar="DTYPE",
                        help="as for inspect (default float)")
    export.add_argument("--input-high", type=int, metavar="N", help="as for inspect")
    export.add_argument("--recipe-option", action="append", default=[], type=_option, metavar="KEY=VALUE",
                        help="the Recipe fields the model was trained with, e.g. high_precision_last_blocks=2")
    export.add_argument("--trust-checkpoint", action="store_true",
                        help="unpickle CHECKPOINT in full, whatever it holds: it can then run any code it carries, "
                        "so only for a file you made or trust; without it, CHECKPOINT is loaded with "
                        "torch.load(weights_only=True) (tensors, numbers, strings and containers of them, as "
                        "examples/train_gpt.py saves) and anything else is refused")
    export.add_argument("--scheme", choices=("NVFP4A16", "NVFP4"), default="NVFP4A16",
                        help="NVFP4A16 (default): FP4 weights; NVFP4: FP4 weights and activations (W4A4), with the "
                        "activation ranges the checkpoint's backend state recorded in training")
    export.set_defaults(func=_export, device="cpu", seed=0)

    pipeline = commands.add_parser("pipeline", help="print the compiler's pass pipeline")
    pipeline.set_defaults(func=_pipeline)

    try:
        from fp4compile import cli_kernels

        cli_kernels.add_subparser(commands)
    except ImportError:  # the kernel build tooling is optional
        pass
    return parser


def _shape(text: str) -> tuple:
    try:
        dims = tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        dims = ()
    if not dims or any(d <= 0 for d in dims):
        raise argparse.ArgumentTypeError(f"a shape is positive sizes joined by 'x', e.g. 2x32; got {text!r}")
    return dims


def _option(text: str) -> tuple:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), _value(value.strip())


def _value(text: str):
    """true/false/none, a Python literal, a comma list of strings, or the string itself."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return tuple(t.strip() for t in text.split(",")) if "," in text else text


# ---------------------------------------------------------------------------------------------
# Loading MODULE:FACTORY
# ---------------------------------------------------------------------------------------------


def load_factory(spec: str):
    """Call FACTORY() from MODULE in ``"MODULE:FACTORY"`` and return the ``nn.Module`` it builds.

    MODULE is a module name (``pkg.models``) or a path to a ``.py`` file; FACTORY may be dotted
    (``Model.small``). Every mistake raises ``UsageError`` saying what is wrong.
    """
    module_name, sep, factory_name = spec.rpartition(":")
    if not sep or not module_name or not factory_name:
        raise UsageError(f"expected MODULE:FACTORY (e.g. mypkg.models:build or model.py:build), got {spec!r}")
    module = _import(module_name)
    factory = module
    for part in factory_name.split("."):
        if not hasattr(factory, part):
            defined = sorted(
                n for n, v in vars(module).items()
                if not n.startswith("_") and callable(v) and getattr(v, "__module__", None) == module.__name__
            )
            hint = f"; callables defined there: {', '.join(defined[:12])}" if defined else ""
            raise UsageError(f"{module_name!r} has no attribute {factory_name!r}{hint}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise UsageError(f"{spec!r} is not callable (it is a {type(factory).__name__})")
    try:
        model = factory()
    except Exception as exc:
        raise UsageError(f"calling {spec}() failed: {type(exc).__name__}: {exc}") from exc
    import torch

    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"{spec}() returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def _import(name: str):
    is_file = name.endswith(".py") or "/" in name or "\\" in name
    try:
        return _import_file(Path(name)) if is_file else _import_module(name)
    except UsageError:
        raise
    except ModuleNotFoundError as exc:
        if not is_file and exc.name is not None and (name == exc.name or name.startswith(exc.name + ".")):
            raise UsageError(f"module {name!r} not found (searched the current directory and sys.path; "
                             "a file path must end in .py)") from exc
        raise UsageError(f"importing {name!r} failed: {exc}") from exc
    except Exception as exc:
        raise UsageError(f"importing {name!r} failed: {type(exc).__name__}: {exc}") from exc


def _import_module(name: str):
    # As ``python -m`` would: modules in the current directory are importable.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return importlib.import_module(name)


def _import_file(path: Path):
    if not path.is_file():
        raise UsageError(f"file {str(path)!r} not found")
    # The file's folder goes first on sys.path so that the file can import its neighbours.
    sys.path.insert(0, str(path.resolve().parent))
    spec = importlib.util.spec_from_file_location(f"_fp4compile_inspect_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------------


def _inputs(args, model) -> list:
    import torch

    shapes = args.input_shape
    dtypes = args.input_dtype or ["float"]
    if len(dtypes) == 1:
        dtypes = dtypes * len(shapes)
    if len(dtypes) != len(shapes):
        raise UsageError(f"{len(shapes)} --input-shape but {len(dtypes)} --input-dtype: give one dtype or one per input")
    high = args.input_high
    if high is None:
        sizes = [m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding)]
        high = min(sizes) if sizes else 2
    generator = torch.Generator().manual_seed(args.seed)
    out = []
    for shape, name in zip(shapes, dtypes):
        dtype = getattr(torch, DTYPES[name])
        if dtype.is_floating_point:
            x = torch.randn(shape, generator=generator).to(dtype)
        else:
            x = torch.randint(0, high, shape, generator=generator, dtype=dtype)
        out.append(x.to(args.device))
    return out


def _recipe(options: list) -> Recipe:
    try:
        return Recipe.from_options(dict(options))
    except (TypeError, ValueError) as exc:
        raise UsageError(f"--recipe-option: {exc}") from exc


def _inspect(args) -> int:
    import torch

    recipe = _recipe(args.recipe_option)
    if args.image is not None and importlib.util.find_spec("matplotlib") is None:  # checked before compiling
        raise UsageError("--image needs matplotlib: pip install matplotlib (or the [plot] extra)")
    model = load_factory(args.model).to(args.device)
    inputs = _inputs(args, model)
    try:
        report = fp4compile.explain(model, *inputs, recipe=recipe, inner=args.inner)
    except Exception as exc:
        # One line, not dynamo's traceback: usually inputs that do not fit the model, which the
        # innermost error (the op that refused them) says best.
        cause = exc
        while cause.__cause__ is not None:
            cause = cause.__cause__
        message = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        hint = ""
        if any(m for m in model.modules() if isinstance(m, torch.nn.Embedding)) and any(x.is_floating_point() for x in inputs):
            hint = "; the model has embeddings, whose inputs are token ids: pass --input-dtype long"
        raise UsageError(f"running the model on the inputs failed: {message}{hint}") from exc
    try:
        _show(report, args)
        if args.image is not None:
            report.save_image(args.image, stage=args.stage or "backward", compact=not args.full)
            print(f"wrote {args.image}", file=sys.stderr)
    except ValueError as exc:  # a stage this model has no graph for, MLIR of the dynamo stage, ...
        raise UsageError(str(exc)) from exc
    return 0


def _show(report, args) -> None:
    compiled = {g.stage for g in report.graphs}
    stages = [args.stage] if args.stage else [s for s in ("dynamo", "joint", "forward", "backward") if s in compiled]
    if args.show == "table":
        print(report.precision_table())
    elif args.show == "graphs":
        for stage in stages:
            for name in report.pass_names(stage):
                print(f"# ---- fp4compile: {stage} {'input' if name == 'input' else 'after ' + name} ----")
                print(report.graph(stage, name))
    elif args.show == "diff":
        for stage in stages:
            for name in report.pass_names(stage)[1:]:
                print(report.diff(stage, name) or f"# {stage}: {name} changed nothing\n", end="")
    elif args.show == "mlir":
        print(report.to_mlir(args.stage or "forward"))
    elif args.show == "dot":
        print(report.to_dot(args.stage or "backward", compact=not args.full), end="")
    else:
        fp4compile.print_pipeline()


def _export(args) -> int:
    import torch

    recipe = _recipe(args.recipe_option)
    if not args.checkpoint.is_file():
        raise UsageError(f"checkpoint {str(args.checkpoint)!r} not found")
    model = load_factory(args.model)
    checkpoint = _load_checkpoint(args.checkpoint, trust=args.trust_checkpoint)
    state = checkpoint.get("model", checkpoint) if isinstance(checkpoint, dict) else checkpoint
    if not isinstance(state, dict):
        raise UsageError(f"{args.checkpoint} holds a {type(state).__name__}, not a state dict")
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise UsageError(f"{args.checkpoint} does not fit {args.model}(): {str(exc).splitlines()[0]}") from exc
    inputs = _inputs(args, model)
    backend = fp4compile.Backend(recipe=recipe, inner="eager")
    try:
        torch.compile(model, backend=backend)(*inputs)  # the forward decides the plan
    except Exception as exc:
        raise UsageError(f"running the model on the inputs failed: {exc}") from exc
    # The ranges of training, not of the random inputs the planning forward just recorded.
    saved = checkpoint.get("backend") if isinstance(checkpoint, dict) and "model" in checkpoint else None
    backend.ranges.load_state_dict(saved.get("activation_ranges") if isinstance(saved, dict) else None)
    try:
        out = fp4compile.export(model, args.out, backend=backend, scheme=args.scheme)
    except (ValueError, NotImplementedError) as exc:
        hint = ""
        if args.scheme == "NVFP4" and not backend.ranges.amax():
            hint = (f" ({args.checkpoint} holds no activation ranges: save Backend.state_dict() under 'backend' "
                    "beside 'model', as examples/train_gpt.py does, or export with --scheme NVFP4A16)")
        raise UsageError(str(exc) + hint) from exc
    n = len([s for s in backend.report.sites if s.precision != "high"])
    print(f"wrote {out}: {n} FP4 GEMM sites ({args.scheme})")
    return 0


def _load_checkpoint(path: Path, trust: bool = False):
    """CHECKPOINT's contents. Loaded with ``weights_only=True``: what ``torch.save`` wrote of tensors,
    numbers, strings, dtypes and dicts, lists and tuples of them (a state dict, an optimizer's, the
    backend's ``state_dict()``, the records ``examples/train_gpt.py`` keeps) and nothing that unpickling
    would call; anything else is refused, naming what, unless ``trust`` (``--trust-checkpoint``), which
    unpickles the file in full after a warning."""
    import torch

    if trust:
        print(f"fp4compile export: warning: --trust-checkpoint: unpickling {path} in full; a checkpoint can run "
              "any code it carries while it loads, so use this only on a file you made or trust", file=sys.stderr)
        return torch.load(path, map_location="cpu", weights_only=False)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        named = re.search(r"GLOBAL ([\w.]+)", str(exc))
        raise UsageError(
            f"{path} holds more than tensors and plain data{' (it names ' + named.group(1) + ')' if named else ''}, "
            "which is not loaded: unpickling it could run code; pass --trust-checkpoint to load it anyway if you "
            "made it or trust where it came from") from exc


def _pipeline(args) -> int:
    fp4compile.print_pipeline()
    return 0


if __name__ == "__main__":
    sys.exit(main())
