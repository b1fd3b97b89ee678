"""``fp4compile kernels``: build CUTLASS NVFP4 GEMMs ahead of time and inspect the kernel cache.

    fp4compile kernels build [--arch sm_100a] [--shapes MxNxK[,MxNxK...]] [--model MODULE:FUNCTION]
                             [--out-dtype bf16|fp32] [--out DIR]
    fp4compile kernels list

``build`` selects the configuration of each GEMM shape exactly as the compiler does
(``cutlass_gemm.select_config``; ``?`` for a symbolic M or K, e.g. ``?x4096x4096``) and builds every
distinct one into the cache (no GPU needed: nvcc and the CUTLASS headers suffice), printing the paths of
the kernel source, PTX, cubin, host object and, where torch has CUDA, the loadable module. ``--model``
takes the shapes from a model: ``FUNCTION`` (in the importable ``MODULE``) returns ``(model, inputs)``;
the model is compiled with the nvfp4 backend on the CPU and run forward and backward once, and every
NVFP4 GEMM of its report is built for. ``--out`` also copies the files to DIR. ``list`` shows every
cache entry and whether its files still match its manifest.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

__all__ = ["add_subparser", "main_kernels"]


_DIM = r"\s*(\d+|\?)\s*"


def _shape(text: str) -> tuple:
    match = re.fullmatch(_DIM + "[xX]" + _DIM + "[xX]" + _DIM, text)
    if not match:
        raise argparse.ArgumentTypeError(f"shape must be MxNxK (e.g. 4096x4096x4096, ? for symbolic), got {text!r}")
    return tuple(None if g == "?" else int(g) for g in match.groups())


def _shapes(text: str) -> list:
    return [_shape(part) for part in text.split(",") if part.strip()]


class _Archs:
    """The architectures kernels are built for (``cutlass_toolkit.SUPPORTED_ARCHS``), as ``--arch``'s
    choices: read when an ``--arch`` is checked or listed, since the kernel tooling imports torch, which
    ``fp4compile --help`` does without."""

    def _values(self) -> tuple:
        from fp4compile.codegen.cutlass_toolkit import SUPPORTED_ARCHS

        return SUPPORTED_ARCHS

    def __contains__(self, arch) -> bool:
        return arch in self._values()

    def __iter__(self):
        return iter(self._values())


def add_subparser(subparsers) -> argparse.ArgumentParser:
    """Register ``kernels`` (with ``build`` and ``list``) on an argparse subparsers object."""
    parser = subparsers.add_parser("kernels", help="build and inspect CUTLASS NVFP4 GEMM kernels")
    actions = parser.add_subparsers(dest="kernels_command", metavar="{build,list}")
    actions.required = True

    build = actions.add_parser("build", help="build ahead of time the kernels of the given GEMM shapes, or of a model's FP4 GEMMs")
    build.add_argument("--arch", default="sm_100a", choices=_Archs(), metavar="ARCH",
                       help="target architecture: %(choices)s (default %(default)s)")
    build.add_argument(
        "--shape", "--shapes", dest="shapes", action="extend", type=_shapes, default=[], metavar="MxNxK[,...]",
        help="GEMM shapes out[M,N] = A[M,K].B[N,K]^T, comma-separated or repeated; ? marks a symbolic dim",
    )
    build.add_argument(
        "--model", metavar="MODULE:FUNCTION",
        help="build for every NVFP4 GEMM of the model FUNCTION() returns as (model, inputs)",
    )
    build.add_argument("--out-dtype", default="bf16", choices=("bf16", "fp32"), help="output dtype (default bf16)")
    build.add_argument("--out", type=Path, metavar="DIR", help="also copy the built files to DIR")
    build.add_argument("--quiet", action="store_true", help="no compile progress on stderr")

    actions.add_parser("list", help="list the kernel cache entries")
    parser.set_defaults(func=main_kernels)
    return parser


def main_kernels(args: argparse.Namespace) -> int:
    """Run ``kernels build`` or ``kernels list``; returns the process exit code."""
    if args.kernels_command == "build":
        return _build(args)
    return _list()


def _model_shapes(spec: str) -> list:
    """The NVFP4 GEMM shapes of the model ``MODULE:FUNCTION`` returns, from one compiled step on the CPU."""
    import importlib

    import torch

    import fp4compile
    from fp4compile.codegen.cutlass_gemm import report_shapes

    module_name, _, function = spec.partition(":")
    if not module_name or not function:
        raise ValueError(f"--model takes MODULE:FUNCTION, got {spec!r}")
    model, inputs = getattr(importlib.import_module(module_name), function)()
    inputs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    backend = fp4compile.Backend()
    out = torch.compile(model, backend=backend)(*inputs)
    if not isinstance(out, torch.Tensor):
        out = out.loss if getattr(out, "loss", None) is not None else out[0]
    if out.requires_grad:
        out.float().sum().backward()
    return report_shapes(backend.report)


def _build(args: argparse.Namespace) -> int:
    from fp4compile.codegen.cutlass_gemm import KernelBuildError, build, configs_for_shapes

    shapes = list(args.shapes)
    if args.model:
        try:
            shapes += _model_shapes(args.model)
        except (ImportError, AttributeError, ValueError, TypeError) as exc:
            print(f"--model {args.model}: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 2
    if not shapes:
        print("nothing to build: give --shapes or --model (or a model with NVFP4 GEMMs)", file=sys.stderr)
        return 2
    chosen, rejected = configs_for_shapes(shapes, args.out_dtype)
    text = lambda shape: "x".join("?" if d is None else str(d) for d in shape)  # noqa: E731
    for shape, reason in rejected:
        print(f"no CUTLASS kernel for {text(shape)}: {reason}", file=sys.stderr)
    if not chosen:
        return 2
    failed = 0
    for index, (config, selected_by) in enumerate(chosen.items(), 1):
        print(f"[{index}/{len(chosen)}] {config.name} for {', '.join(dict.fromkeys(text(s) for s in selected_by))}")
        try:
            result = build(config, arch=args.arch, progress=not args.quiet)
        except KernelBuildError as exc:
            print(f"build failed: {exc}", file=sys.stderr)
            failed += 1
            continue
        print(f"{'cached' if result.from_cache else 'built'}: {result.entry_dir}")
        paths = dict(result.paths)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            paths = {role: Path(shutil.copy2(p, args.out / f"{config.name}.{p.name}")) for role, p in paths.items()}
        for role in ("cu", "binding", "ptx", "cubin", "object", "module", "log"):
            if role in paths:
                print(f"  {role:8s} {paths[role]}")
        if "module" not in paths:
            print("  module   (not built: this torch has no CUDA; build on a machine with CUDA torch to get it)")
    return 1 if failed else 0


def _list() -> int:
    from fp4compile.codegen.cutlass_gemm import cache_dir, list_entries

    entries = list_entries()
    print(f"kernel cache: {cache_dir() / 'kernels'} ({len(entries)} entr{'y' if len(entries) == 1 else 'ies'})")
    for e in entries:
        material = e["material"]
        built_with = (material.get("arch"), material.get("nvcc", "").split(",")[-1].strip(), material.get("torch"))
        detail = ", ".join(str(v) for v in built_with if v)
        status = "ok" if e["ok"] else "CORRUPT (rebuilt on next use)"
        print(f"  {e['name']:40s} {e['key'][:12]}  {e['size'] / 1e6:7.2f} MB  {status}  {detail}")
        print(f"      {e['path']}  [{' '.join(e['files'])}]")
    return 0
