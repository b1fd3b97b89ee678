"""Where the first call of the benchmark step spends its time, phase by phase.

Each variant runs in its own process with fresh Inductor and Triton caches, as in ``bench_e2e.py``.
For the first training step it prints the forward call (Dynamo's trace, AOT autograd, fp4compile's
passes, the forward graph's compile and first run), the backward (the backward graph's compile and
first run) and the optimizer step, and TorchDynamo's compile metrics summed over the graphs
(``torch._dynamo.utils.compilation_time_metrics``), and the time fp4compile's passes took (``passes``:
summed over every graph and stage, the report's ``pass_seconds``; 0 for the BF16 arms).

``--prewarm`` also runs each nvfp4 variant with a Triton cache that holds fp4compile's kernels and
nothing else, compiled beforehand by the same model under ``Backend(inner="eager")`` (which compiles no
Inductor kernel): the difference to the cold run is what compiling fp4compile's kernels costs the
first call.

As in ``bench_e2e.py``, every variant gets fp4compile's generic compile settings (the BF16 one through
``fp4compile.Baseline``; ``--generic off``: none does). ``--env SETTING ...`` runs each nvfp4 variant once per setting, ``NAME=VALUE[,NAME=VALUE...]`` added to
its environment (``-``: nothing added), for an A/B of fp4compile's switches on one machine in one run
(e.g. ``FP4COMPILE_EMULATED_GEMM``: the GEMM of the emulation). ``--repeat N`` runs the whole sequence N times, interleaved, and prints each
row's median. Each row also gives the time the first step spent in garbage collection, the training
process's own CPU time for it (user + system; not its compile workers') and its peak resident memory. ``--warm`` starts
each variant a second time on the Inductor and Triton caches its cold start filled, as a restarted
training job would.

    python benchmarks/first_call.py --variants bf16 nvfp4-cg --d-model 1024 --prewarm --out first_call.json
    python benchmarks/first_call.py --variants bf16 nvfp4-cg --env FP4COMPILE_EMULATED_GEMM=cublaslt \
        FP4COMPILE_EMULATED_GEMM=torch --repeat 2
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
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


# A start's own figures, given as their median over the repeats.
MEDIAN_FIGURES = ("first_step_s", "forward_call_s", "backward_s", "gc_s", "process_cpu_s", "peak_rss_mib", "passes_s")


class GCTimer:
    """A ``gc.callbacks`` entry adding up the time spent in garbage collections (all threads')."""

    def __init__(self):
        self.seconds, self.passes, self._start = 0.0, 0, None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self.passes += 1
            self._start = None


def first_step(variant: str, d_model: int, n_layer: int, batch: int, device: str = "cuda", generic: bool = True) -> dict:
    """Phases of the first training step of ``variant`` in this process ("prewarm": nvfp4 compiled with
    ``inner="eager"``, which builds only fp4compile's kernels); ``generic``: as ``bench_e2e.compile_arm``."""
    return _first_step(variant, d_model, n_layer, batch, device, generic)


def _first_step(variant: str, d_model: int, n_layer: int, batch: int, device: str, generic: bool) -> dict:
    if variant == "prewarm":
        s = bench_e2e.training_setup("nvfp4", d_model, n_layer, batch, inner="eager", device=device, generic=generic)
    else:
        s = bench_e2e.training_setup(variant, d_model, n_layer, batch, device=device, generic=generic)
    compiled, opt, x, graphs = s["compiled"], s["opt"], s["x"], s["graphs"]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    collector = GCTimer()
    gc.callbacks.append(collector)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu0 = usage.ru_utime + usage.ru_stime
    t0 = time.perf_counter()
    if graphs:
        torch.compiler.cudagraph_mark_step_begin()
    with torch.autocast(device, dtype=torch.bfloat16):
        _, loss = compiled(x, x)
    sync()
    t1 = time.perf_counter()
    loss.backward()
    sync()
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync()
    t3 = time.perf_counter()
    gc.callbacks.remove(collector)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    metrics = torch._dynamo.utils.compilation_time_metrics
    report = getattr(s["backend"], "report", None)  # fp4compile.Backend's; the BF16 arms run none of its passes
    passes_s = sum(sum(ctx.pass_seconds.values()) for ctx in report.contexts) if report is not None else 0.0
    return {
        "variant": variant, "device": device, "d_model": d_model, "first_step_s": t3 - t0, "forward_call_s": t1 - t0,
        "backward_s": t2 - t1, "optimizer_s": t3 - t2, "gc_s": collector.seconds, "gc_passes": collector.passes,
        "process_cpu_s": usage.ru_utime + usage.ru_stime - cpu0, "peak_rss_mib": usage.ru_maxrss / 1024,
        "passes_s": passes_s,
        "compile_metrics_s": {k: round(sum(metrics.get(k, [])), 3) for k in METRICS},
        "generic": bench_e2e.generic_record(s["backend"]),
    }


def parse_setting(text: str) -> dict:
    """``NAME=VALUE[,NAME=VALUE...]`` (or ``-``, nothing) as a dict of environment variables."""
    if text == "-":
        return {}
    env = {}
    for item in text.split(","):
        name, eq, value = item.partition("=")
        if not eq or not name.strip():
            raise ValueError(f"--env: expected NAME=VALUE[,NAME=VALUE...] or -, got {text!r}")
        env[name.strip()] = value
    return env


def run(variant: str, args, triton_cache: str | None = None, setting: str | None = None,
        inductor_cache: str | None = None) -> dict:
    env = parse_setting(setting) if setting else None
    row = bench_e2e.cold_start(__file__, ["--variant", variant, "--d-model", str(args.d_model), "--n-layer",
                                          str(args.n_layer), "--batch", str(args.batch), "--device", args.device,
                                          "--generic", args.generic],
                               triton_cache, env, inductor_cache)
    row = dict(row, variant=variant) if "error" in row else row
    if setting:
        row["env"] = setting
    return row


def label(row: dict) -> str:
    """The row's name in the table: the variant, and the environment setting where one was given."""
    return row["variant"] + (f" [{row['env']}]" if row.get("env") else "")


def sequence(args) -> list:
    """Every row of one pass over the variants (cold starts, in order)."""
    rows = []
    for variant in args.variants:
        nvfp4 = variant.startswith("nvfp4")
        for setting in (args.env or [None]) if nvfp4 else [None]:
            caches = (tempfile.mkdtemp(), tempfile.mkdtemp()) if args.warm else (None, None)
            rows.append(run(variant, args, caches[0], setting, caches[1]))
            print(f"done {label(rows[-1])}", file=sys.stderr, flush=True)
            if args.warm:
                row = run(variant, args, caches[0], setting, caches[1])
                row["variant"] = f"{variant}, warm caches"
                rows.append(row)
                print(f"done {label(row)}", file=sys.stderr, flush=True)
            if args.prewarm and nvfp4:
                cache = tempfile.mkdtemp()
                warm = run("prewarm", args, cache, setting)
                kernels = sum(1 for _ in Path(cache).rglob("*.cubin"))
                row = run(variant, args, cache, setting)
                row.update(variant=f"{variant}, fp4compile kernels cached", prewarm_s=warm.get("first_step_s"),
                           cached_kernels=kernels)
                rows.append(row)
                print(f"done {label(row)} with {kernels} kernels cached", file=sys.stderr, flush=True)
    return rows


def medians(rows: list) -> list:
    """One row per label, in first-seen order: its figures the median over the repeats (errors dropped)."""
    groups: dict = {}
    for r in rows:
        groups.setdefault(label(r), []).append(r)
    out = []
    for name, group in groups.items():
        ok = [r for r in group if "error" not in r]
        if not ok:
            out.append({"label": name, "error": group[-1]["error"]})
            continue
        row = {"label": name, "starts": len(ok), "all_first_step_s": [round(r["first_step_s"], 2) for r in ok]}
        for key in MEDIAN_FIGURES:  # rows from before a figure was recorded lack it: NaN
            row[key] = statistics.median(r.get(key, float("nan")) for r in ok)
        row["compile_metrics_s"] = {k: statistics.median(r["compile_metrics_s"][k] for r in ok) for k in METRICS}
        out.append(row)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--variant")
    p.add_argument("--variants", nargs="+", choices=bench_e2e.VARIANTS, default=["bf16", "nvfp4-cg"])
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: the compile on a machine without a GPU (no -cg variants, no --prewarm)")
    p.add_argument("--prewarm", action="store_true", help="also run nvfp4 variants with fp4compile's kernels cached")
    p.add_argument("--env", nargs="+", metavar="SETTING",
                   help="run each nvfp4 variant once per NAME=VALUE[,NAME=VALUE...] setting (- for none)")
    p.add_argument("--warm", action="store_true",
                   help="also start each variant again on the Inductor and Triton caches its cold start filled")
    p.add_argument("--repeat", type=int, default=1, help="run the whole sequence N times (medians printed)")
    p.add_argument("--generic", choices=("on", "off"), default="on",
                   help="as bench_e2e.py: on, every variant gets fp4compile's generic compile settings; off, none does")
    p.add_argument("--out", default="first_call.json")
    args = p.parse_args()
    if args.variant:
        print(json.dumps(first_step(args.variant, args.d_model, args.n_layer, args.batch, args.device,
                                    args.generic == "on")))
        return
    if args.repeat < 1:
        p.error("--repeat must be 1 or more")
    if args.device == "cpu" and (args.prewarm or any(v.endswith("-cg") for v in args.variants)):
        p.error("--device cpu: CUDA-graph (-cg) variants and --prewarm (Triton kernels) need a GPU")
    for setting in args.env or []:
        try:
            names = parse_setting(setting)
        except ValueError as e:
            p.error(str(e))
        if {"TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"} & set(names):
            p.error("--env: the cache directories are the benchmark's own (fresh per start, or --warm)")
    if args.env and not any(v.startswith("nvfp4") for v in args.variants):
        p.error("--env applies to nvfp4 variants; none is selected")
    rows = []
    for _ in range(args.repeat):
        rows += sequence(args)
    table = medians(rows)
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {os.cpu_count()} cores"
    result = {"device": device, "torch": torch.__version__, "d_model": args.d_model, "n_layer": args.n_layer,
              "batch": args.batch, "repeat": args.repeat, "generic": args.generic, "rows": rows, "medians": table}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{result['device']}, torch {result['torch']}, d_model {args.d_model}"
          + (f", median of {args.repeat} starts" if args.repeat > 1 else "")
          + f", generic compile settings {args.generic} for every variant")
    print(f"{'variant':52} {'first s':>8} {'forward':>8} {'backward':>8} {'fw compile':>10} {'bw compile':>10} "
          f"{'lowering':>9} {'partition':>9} {'passes':>7} {'gc':>6} {'cpu s':>7} {'rss MiB':>8}")
    for r in table:
        if "error" in r:
            print(f"{r['label']:52} error")
            continue
        m = r["compile_metrics_s"]
        print(f"{r['label']:52} {r['first_step_s']:8.1f} {r['forward_call_s']:8.1f} {r['backward_s']:8.1f} "
              f"{m['compile_fx.<locals>.fw_compiler_base']:10.2f} {m['compile_fx.<locals>.bw_compiler']:10.2f} "
              f"{m['GraphLowering.run']:9.2f} {m['min_cut_rematerialization_partition']:9.2f} {r['passes_s']:7.2f} "
              f"{r['gc_s']:6.2f} "
              f"{r['process_cpu_s']:7.1f} {r['peak_rss_mib']:8.0f}")


if __name__ == "__main__":
    main()
