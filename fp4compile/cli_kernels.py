"""``fp4compile kernels``: build CUTLASS NVFP4 GEMMs ahead of time and inspect the kernel cache.

    fp4compile kernels build --arch sm_100a --shape 4096x4096x4096 [--out-dtype bf16|fp32] [--out DIR]
    fp4compile kernels list

``build`` selects the configuration for the shape exactly as the compiler would, builds it into the
cache (no GPU needed: nvcc and the CUTLASS headers suffice) and prints the paths of the kernel source,
PTX, cubin, host object and, where torch has CUDA, the loadable module. ``--out`` also copies them to
DIR. ``list`` shows every cache entry and whether its files still match its manifest.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

__all__ = ["add_subparser", "main_kernels"]


def _shape(text: str) -> tuple[int, int, int]:
    match = re.fullmatch(r"\s*(\d+)\s*[xX,]\s*(\d+)\s*[xX,]\s*(\d+)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"shape must be MxNxK (e.g. 4096x4096x4096), got {text!r}")
    return tuple(int(g) for g in match.groups())


def add_subparser(subparsers) -> argparse.ArgumentParser:
    """Register ``kernels`` (with ``build`` and ``list``) on an argparse subparsers object."""
    from fp4compile.codegen.cutlass_gemm import SUPPORTED_ARCHS

    parser = subparsers.add_parser("kernels", help="build and inspect CUTLASS NVFP4 GEMM kernels")
    actions = parser.add_subparsers(dest="kernels_command", metavar="{build,list}")
    actions.required = True

    build = actions.add_parser("build", help="build the kernel a GEMM shape selects (ahead of time)")
    build.add_argument("--arch", default="sm_100a", choices=SUPPORTED_ARCHS, help="target architecture")
    build.add_argument(
        "--shape", required=True, type=_shape, metavar="MxNxK", help="GEMM shape: out[M,N] = A[M,K].B[N,K]^T"
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


def _build(args: argparse.Namespace) -> int:
    from fp4compile.codegen.cutlass_gemm import KernelBuildError, build, select_config

    m, n, k = args.shape
    config, reason = select_config(m, n, k, args.out_dtype)
    if config is None:
        print(f"no CUTLASS kernel for {m}x{n}x{k}: {reason}", file=sys.stderr)
        return 2
    print(f"selected {reason}")
    try:
        result = build(config, arch=args.arch, progress=not args.quiet)
    except KernelBuildError as exc:
        print(f"build failed: {exc}", file=sys.stderr)
        return 1
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
    return 0


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
