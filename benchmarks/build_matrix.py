"""Build every CUTLASS NVFP4 GEMM configuration with this machine's toolkit and record the outcome.

    python benchmarks/build_matrix.py [--grouped] [--arch sm_100a ...] [--out FILE] [--budget-min 20] [--only NAME ...]

For each target arch and each configuration of ``cutlass_gemm.supported_configs()`` (every tile,
cluster, schedule and output dtype the templates take), or with ``--grouped`` of the MoE grouped
kernels' ``cutlass_grouped.supported_configs()``, it checks the toolkit
(``cutlass_toolkit.toolkit_problem``), builds the kernel into the kernel cache and records: ok or the
error, the compile seconds, the mainloop's pipeline stages and ptxas's registers and spill bytes
(``cutlass_gemm.build_stats``). Progress goes to stdout, one line per configuration.

Resumable: results are written to ``--out`` (default ``benchmarks/results/build_matrix_cuda<release>.json``,
``build_matrix_grouped_cuda<release>.json`` with ``--grouped``)
after every configuration, and a configuration already recorded for the same toolkit, CUTLASS and
template is skipped (the kernel cache also makes a rebuild free). ``--budget-min`` stops starting new
builds after that many minutes; run again to continue.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path

from fp4compile.codegen import build_cache, cutlass_gemm, cutlass_grouped, cutlass_toolkit


def _identity(module) -> dict:
    nvcc = build_cache.find_nvcc()
    if nvcc is None:
        raise SystemExit("nvcc not found (set CUDA_HOME or FP4COMPILE_NVCC, or put nvcc on PATH)")
    version = build_cache.nvcc_version(nvcc)
    template = cutlass_gemm._template_text(module.KERNEL_TEMPLATE)
    return {
        "nvcc": version,
        "release": ".".join(map(str, build_cache.nvcc_release(version))),
        "cutlass": cutlass_toolkit.cutlass_version(),
        "kernel_template_sha256": hashlib.sha256(template.encode()).hexdigest()[:16],
        "nvcc_flags": list(cutlass_gemm.NVCC_FLAGS),
    }


def _save(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grouped", action="store_true", help="the grouped (MoE) kernels' configurations")
    parser.add_argument("--arch", action="append", choices=cutlass_toolkit.SUPPORTED_ARCHS,
                        help="target architecture (repeatable; default sm_100a)")
    parser.add_argument("--out", type=Path, help="results file (JSON)")
    parser.add_argument("--budget-min", type=float, default=None, help="start no build after this many minutes")
    parser.add_argument("--only", nargs="*", default=None, metavar="NAME", help="only these configuration names, in this order")
    args = parser.parse_args(argv)
    arches = args.arch or ["sm_100a"]
    module = cutlass_grouped if args.grouped else cutlass_gemm
    identity = _identity(module)
    kind = "_grouped" if args.grouped else ""
    out = args.out or Path(__file__).parent / "results" / f"build_matrix{kind}_cuda{identity['release']}.json"
    data = json.loads(out.read_text()) if out.exists() else {}
    if data.get("identity") != identity:
        data = {"identity": identity, "results": {}}  # another toolkit or template: start over
    data["machine"] = f"{platform.node()} ({os.cpu_count()} CPUs, {platform.platform()})"
    configs = module.supported_configs()
    if args.only is not None:
        by_name = {c.name: c for c in configs}
        unknown = [name for name in args.only if name not in by_name]
        if unknown:
            raise SystemExit(f"unknown configurations {unknown}; see {module.__name__}.supported_configs()")
        configs = [by_name[name] for name in args.only]
    elif args.grouped:
        configs.sort(key=lambda c: ((c.schedule, c.tile_n) not in cutlass_grouped._CANDIDATE_TILES, c.out_dtype != "bf16"))
    else:
        # The selector's candidates first (they are what compiled models use), then the rest.
        candidates = {(s, n) for s, n in cutlass_gemm._CANDIDATE_TILES}
        configs.sort(key=lambda c: (c.cluster_m != cutlass_gemm.GemmConfig(c.schedule).cluster_m or c.cluster_n != 1,
                                    (c.schedule, c.tile_n) not in candidates, c.out_dtype != "bf16"))
    todo = [(arch, c) for arch in arches for c in configs]
    start = time.monotonic()
    print(f"{len(todo)} configurations, {identity['nvcc']}, CUTLASS {identity['cutlass']}", flush=True)
    for index, (arch, config) in enumerate(todo, 1):
        key = f"{arch}/{config.name}"
        head = f"[{index}/{len(todo)}] {key}"
        if key in data["results"]:
            print(f"{head}: recorded earlier ({data['results'][key]['status']})", flush=True)
            continue
        if args.budget_min is not None and time.monotonic() - start > args.budget_min * 60:
            print(f"{head}: not started (budget of {args.budget_min:g} min spent; run again to continue)", flush=True)
            continue
        release = build_cache.nvcc_release(identity["nvcc"])
        problem = cutlass_toolkit.toolkit_problem(release, arch, None)
        if problem is not None:
            data["results"][key] = {"status": "refused", "error": problem}
            print(f"{head}: refused: {problem}", flush=True)
            _save(out, data)
            continue
        t0 = time.monotonic()
        try:
            result = module.build(config, arch=arch, progress=False)
        except cutlass_gemm.KernelBuildError as exc:
            record = {"status": "failed", "seconds": round(time.monotonic() - t0, 1), "error": str(exc)[-2000:]}
        else:
            seconds = json.loads((result.entry_dir / build_cache.MANIFEST).read_text()).get("build_seconds")
            record = {"status": "ok", "seconds": seconds, **cutlass_gemm.build_stats(result)}
        data["results"][key] = record
        _save(out, data)
        detail = ", ".join(f"{k} {v}" for k, v in record.items() if k not in ("status", "error"))
        print(f"{head}: {record['status']} ({detail}){': ' + record['error'][:300] if 'error' in record else ''}",
              flush=True)
    counts = {}
    for record in data["results"].values():
        counts[record["status"]] = counts.get(record["status"], 0) + 1
    print(f"recorded {len(data['results'])} of {len(todo)}: {counts}; results in {out}", flush=True)
    return 1 if counts.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
