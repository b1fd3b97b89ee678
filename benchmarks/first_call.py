"""Where the first call of the benchmark step spends its time, phase by phase.

Each variant runs in its own process with fresh Inductor and Triton caches, as in ``bench_e2e.py``.
For the first training step it prints the forward call (Dynamo's trace, AOT autograd, fp4compile's
passes, the forward graph's compile and first run), the backward (the backward graph's compile and
first run) and the optimizer step, and TorchDynamo's compile metrics summed over the graphs
(``torch._dynamo.utils.compilation_time_metrics``).

``--prewarm`` also runs each nvfp4 variant with a Triton cache that holds fp4compile's kernels and
nothing else, compiled beforehand by the same model under ``Backend(inner="eager")`` (which compiles no
Inductor kernel): the difference to the cold run is what compiling fp4compile's kernels costs the
first call.

    python benchmarks/first_call.py --variants bf16 nvfp4-cg --d-model 1024 --prewarm --out first_call.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_e2e  # noqa: E402

# TorchDynamo's timers reported (seconds, summed over the compiled graphs).
METRICS = (
    "_compile.compile_inner",
    "create_aot_dispatcher_function",
    "aot_trace_joint_graph",
    "min_cut_rematerialization_partition",
    "compile_fx.<locals>.fw_compiler_base",
    "compile_fx.<locals>.bw_compiler",
    "GraphLowering.run",
    "GraphLowering.compile_to_module",
    "async_compile.wait",
)


def first_step(variant: str, d_model: int, n_layer: int, batch: int) -> dict:
    """Phases of the first training step of ``variant`` in this process ("prewarm": nvfp4 compiled with
    ``inner="eager"``, which builds only fp4compile's kernels)."""
    if variant == "prewarm":
        s = bench_e2e.training_setup("nvfp4", d_model, n_layer, batch, inner="eager")
    else:
        s = bench_e2e.training_setup(variant, d_model, n_layer, batch)
    compiled, opt, x, graphs = s["compiled"], s["opt"], s["x"], s["graphs"]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if graphs:
        torch.compiler.cudagraph_mark_step_begin()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss = compiled(x, x)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    loss.backward()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    metrics = torch._dynamo.utils.compilation_time_metrics
    return {
        "variant": variant, "d_model": d_model, "first_step_s": t3 - t0, "forward_call_s": t1 - t0,
        "backward_s": t2 - t1, "optimizer_s": t3 - t2,
        "compile_metrics_s": {k: round(sum(metrics.get(k, [])), 3) for k in METRICS},
    }


def run(variant: str, args, triton_cache: str | None = None) -> dict:
    row = bench_e2e.cold_start(__file__, ["--variant", variant, "--d-model", str(args.d_model),
                                          "--n-layer", str(args.n_layer), "--batch", str(args.batch)], triton_cache)
    return dict(row, variant=variant) if "error" in row else row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--variant")
    p.add_argument("--variants", nargs="+", choices=bench_e2e.VARIANTS, default=["bf16", "nvfp4-cg"])
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prewarm", action="store_true", help="also run nvfp4 variants with fp4compile's kernels cached")
    p.add_argument("--out", default="first_call.json")
    args = p.parse_args()
    if args.variant:
        print(json.dumps(first_step(args.variant, args.d_model, args.n_layer, args.batch)))
        return
    rows = []
    for variant in args.variants:
        rows.append(run(variant, args))
        print(f"done {variant}", file=sys.stderr, flush=True)
        if args.prewarm and variant.startswith("nvfp4"):
            cache = tempfile.mkdtemp()
            warm = run("prewarm", args, cache)
            kernels = sum(1 for _ in Path(cache).rglob("*.cubin"))
            row = run(variant, args, cache)
            row.update(variant=f"{variant}, fp4compile kernels cached", prewarm_s=warm.get("first_step_s"),
                       cached_kernels=kernels)
            rows.append(row)
            print(f"done {variant} with {kernels} kernels cached", file=sys.stderr, flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{result['gpu']}, torch {result['torch']}, d_model {args.d_model}")
    print(f"{'variant':42} {'first s':>8} {'forward':>8} {'backward':>8} {'fw compile':>10} {'bw compile':>10} "
          f"{'lowering':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:42} error")
            continue
        m = r["compile_metrics_s"]
        print(f"{r['variant']:42} {r['first_step_s']:8.1f} {r['forward_call_s']:8.1f} {r['backward_s']:8.1f} "
              f"{m['compile_fx.<locals>.fw_compiler_base']:10.2f} {m['compile_fx.<locals>.bw_compiler']:10.2f} "
              f"{m['GraphLowering.run']:9.2f}")


if __name__ == "__main__":
    main()
