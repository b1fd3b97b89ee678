"""End-to-end training-step benchmark: BF16 torch.compile vs backend="nvfp4" vs naive fake-quant.

Each variant runs in its own process with a fresh Inductor cache and a fresh Triton cache, so the
first-call time is a real compile, fp4compile's Triton kernels included (without a fresh Triton cache
they would load from the cache of an earlier run on the machine, and the figure would depend on the
machine's history). Measures: first step (compile + run), median step time, peak GPU memory in steady state.
Before timing, checks that the GPU quantize matches the CPU reference bit for bit. A ``-cg`` variant
compiles with ``mode="reduce-overhead"`` (the steps are recorded in CUDA graphs and replayed); a ``-dec``
variant sets ``Recipe(decoded_operands=True)``, a ``-packed`` one ``decoded_operands=False`` (without
either, the recipe's default: decoded with CUDA graphs, packed without); a ``-fp4mm`` variant runs the
emulated GEMMs on the FP4-operand Triton GEMM (``FP4COMPILE_EMULATED_GEMM=packed``: packed operands,
decoded in the GEMM's registers).

Generic settings. One thing the nvfp4 backend does while compiling is not FP4-specific: buffers for
unused output gradients under CUDA graphs (``fp4compile.grad_buffers``). With ``--generic on`` (the
default) the BF16 and naive arms get it too: they compile with ``fp4compile.Baseline``, Inductor with
that setting. With ``--generic off`` no arm gets it: BF16 and naive are plain ``torch.compile`` and nvfp4
runs with ``unused_grad_buffers=False``. Each row records what its graphs got
(``generic``), and the printout lists it per arm. Ratios are against the BF16 arm with the same CUDA-graph
setting (``bf16-cg`` for ``-cg`` variants, else ``bf16``); where that arm is not in the run, against the
other, marked ``*``.

A cold start's first call varies between processes, BF16's by several seconds: ``--cold-starts N``
starts each variant N times (the further starts run only the first step) and reports the median first
step, with every start's figure beside it.

    python benchmarks/bench_e2e.py --out results.json            # d=1024 and d=2048, all variants
    python benchmarks/bench_e2e.py --d-model 1024 --variants bf16-cg nvfp4-cg --cold-starts 3
    python benchmarks/bench_e2e.py --d-model 1024 --variants bf16 nvfp4 --generic off
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

VARIANTS = ("bf16", "nvfp4", "naive", "bf16-cg", "nvfp4-cg", "nvfp4-dec", "nvfp4-dec-cg", "nvfp4-packed-cg",
            "nvfp4-fp4mm", "nvfp4-fp4mm-cg")


def naive_fake_quant(x: torch.Tensor) -> torch.Tensor:
    """Forward-only NVFP4 1x16 fake quantization in plain PyTorch (the anchor of the goals)."""
    shape = x.shape
    xf = x.float().reshape(-1, 16)
    amax = xf.abs().amax().clamp(min=1e-30)
    s_enc = 2688.0 / amax
    bamax = xf.abs().amax(-1, keepdim=True)
    sf = (bamax * s_enc / 6.0).clamp(max=448).to(torch.float8_e4m3fn).float()
    enc = 1.0 / (sf / s_enc).clamp(min=1e-30)
    v = (xf * enc).clamp(-6, 6)
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], device=x.device)
    idx = (v.abs().unsqueeze(-1) - grid).abs().argmin(-1)
    q = grid[idx] * v.sign()
    return (q * sf / s_enc).reshape(shape).to(x.dtype)


class NaiveFQLinear(nn.Linear):
    def forward(self, x):
        return F.linear(naive_fake_quant(x), naive_fake_quant(self.weight), self.bias)


def build(d_model: int, n_layer: int, variant: str, device: str = "cuda"):
    from gpt import GPT, GPTConfig

    cfg = GPTConfig(n_layer=n_layer, n_head=d_model // 64, d_model=d_model, seq_len=1024, vocab=50304)
    model = GPT(cfg).to(device)
    if variant == "naive":
        for name, mod in list(model.named_modules()):
            for child_name, child in list(mod.named_children()):
                if type(child) is nn.Linear and child_name != "lm_head":
                    new = NaiveFQLinear(child.in_features, child.out_features, bias=child.bias is not None).to(device)
                    new.load_state_dict(child.state_dict())
                    setattr(mod, child_name, new)
    return model, cfg


def check_bit_exact() -> str:
    from fp4compile import formats, ops  # noqa: F401  (the ops module registers the fp4 ops)

    x = torch.randn(512, 1024, device="cuda") * 3
    got = torch.ops.fp4.quantize(x, "nvfp4", "1x16", "rne", 0, "")
    want = formats.quantize(x.cpu(), "nvfp4", "1x16")
    ok = torch.equal(got[0].cpu(), want.data.view(torch.uint8)) and torch.equal(got[1].cpu(), want.scales.view(torch.uint8))
    if not ok:
        raise SystemExit("GPU quantize differs from the CPU reference")
    return "bit-exact"


def compile_arm(model: nn.Module, arm: str, mode: Optional[str] = None, decoded: Optional[bool] = None,
                inner: str = "inductor", generic: bool = True):
    """(compiled model, its backend) for one arm of the comparison. ``arm`` "nvfp4": ``fp4compile.Backend``
    (``decoded``: ``decoded_operands``; ``inner``: what compiles its rewritten graphs); any other arm
    compiles in high precision with Inductor. ``generic``: every arm gets fp4compile's generic settings
    (the high-precision arms through ``fp4compile.Baseline``); False: none does (the high-precision arms
    are plain ``torch.compile``, backend None)."""
    import fp4compile

    if arm == "nvfp4":
        backend = fp4compile.Backend(mode=mode, decoded_operands=decoded, inner=inner,
                                     unused_grad_buffers=None if generic else False)
        return torch.compile(model, backend=backend), backend
    if generic:
        backend = fp4compile.Baseline(mode=mode)
        return torch.compile(model, backend=backend), backend
    return torch.compile(model, mode=mode), None


def generic_record(backend) -> dict:
    """What the graphs an arm compiled got of the generic settings (``fp4compile.baseline.generic_settings``;
    plain ``torch.compile``, backend None: none of them)."""
    from fp4compile import baseline

    if backend is None:
        return {"unused_grad_buffers": []}
    return baseline.generic_settings(backend)


def training_setup(variant: str, d_model: int, n_layer: int, batch: int, inner: str = "inductor",
                   device: str = "cuda", generic: bool = True) -> dict:
    """The pieces of the benchmark's training step: compiled model, optimizer, input, whether the step
    runs under CUDA graphs, the arm's backend (``compile_arm``) and the model's config. ``inner``: what
    compiles the nvfp4 variants' rewritten graphs (``Backend(inner=...)``); ``device``: "cuda" or "cpu"
    (the first-call benchmark's CPU runs; no ``-cg`` variant there); ``generic``: as ``compile_arm``."""
    torch.manual_seed(0)
    graphs = variant.endswith("-cg")
    variant = variant.removesuffix("-cg")
    decoded = {"-dec": True, "-packed": False}.get(variant[variant.rfind("-"):]) if "-" in variant else None
    if variant.endswith("-fp4mm"):
        from fp4compile import config

        config.emulated_gemm = "packed"  # each variant runs in a process of its own
    variant = variant.removesuffix("-dec").removesuffix("-packed").removesuffix("-fp4mm")
    mode = "reduce-overhead" if graphs else None
    if graphs and device != "cuda":
        raise ValueError(f"variant {variant}-cg records CUDA graphs; it needs device='cuda', got {device!r}")
    model, cfg = build(d_model, n_layer, variant, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    compiled, backend = compile_arm(model, variant, mode, decoded, inner, generic)
    x = torch.randint(0, cfg.vocab, (batch, cfg.seq_len), device=device)
    return dict(compiled=compiled, opt=opt, x=x, graphs=graphs, backend=backend, cfg=cfg)


def training_step(variant: str, d_model: int, n_layer: int, batch: int, generic: bool = True):
    """(step function running one AdamW training step of the benchmark GPT, the arm's backend or None,
    cfg)."""
    s = training_setup(variant, d_model, n_layer, batch, generic=generic)
    compiled, opt, x, graphs = s["compiled"], s["opt"], s["x"], s["graphs"]

    def step():
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = compiled(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, s["backend"], s["cfg"]


def run_variant(variant: str, d_model: int, n_layer: int, steps: int, batch: int, first_only: bool = False,
                generic: bool = True) -> dict:
    return _run_variant(variant, d_model, n_layer, steps, batch, first_only, generic)


def _run_variant(variant: str, d_model: int, n_layer: int, steps: int, batch: int, first_only: bool,
                 generic: bool) -> dict:
    import fp4compile

    step, backend, cfg = training_step(variant, d_model, n_layer, batch, generic)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    loss = step()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    if first_only:
        return {"variant": variant, "d_model": d_model, "first_step_s": first, "generic": generic_record(backend)}
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    out = {
        "variant": variant, "d_model": d_model, "n_layer": n_layer, "batch": batch, "seq": cfg.seq_len,
        "first_step_s": first, "step_ms_median": times[len(times) // 2],
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        # CUDA graphs keep their temporaries in a private pool: reserved, no longer counted as allocated.
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30, "loss": float(loss),
        "generic": generic_record(backend),
    }
    if isinstance(backend, fp4compile.Backend):
        out["plan"] = backend.report.precision_table().splitlines()[-1]
        out["cudagraph_skips"] = int(torch._dynamo.utils.counters["inductor"]["cudagraph_skips"])
        from fp4compile.codegen import cublaslt_gemm

        out["emulated_gemm"] = cublaslt_gemm.describe()
    return out


def cold_start(script: str, argv: list, triton_cache: Optional[str] = None, env: Optional[dict] = None,
               inductor_cache: Optional[str] = None) -> dict:
    """Run ``script`` with ``argv`` in a new process with a fresh Inductor cache and a fresh Triton cache
    (or the given ones), ``env`` added to this process's environment: the JSON of its last output line,
    or {"error": the end of its stderr}."""
    env = {**os.environ, **(env or {}), "TORCHINDUCTOR_CACHE_DIR": inductor_cache or tempfile.mkdtemp(),
           "TRITON_CACHE_DIR": triton_cache or tempfile.mkdtemp()}
    proc = subprocess.run([sys.executable, script, *argv], env=env, capture_output=True, text=True)
    if proc.returncode:
        print(proc.stderr[-3000:], file=sys.stderr)
        return {"error": proc.stderr[-500:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--variant", choices=VARIANTS)
    p.add_argument("--d-model", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--out", default="bench_e2e.json")
    p.add_argument("--cold-starts", type=int, default=1, help="starts per variant for the first-call figure (median)")
    p.add_argument("--generic", choices=("on", "off"), default="on",
                   help="on: every arm gets fp4compile's generic compile settings (unused-gradient buffers under "
                        "CUDA graphs); off: none does")
    p.add_argument("--first-step-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.d_model[0], args.n_layer, args.steps, args.batch,
                                     args.first_step_only, args.generic == "on")))
        return
    if args.cold_starts < 1:
        p.error("--cold-starts must be 1 or more")
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": datetime.date.today().isoformat(),
               "generic": args.generic}
    try:
        import triton

        results["triton"] = triton.__version__
    except ImportError:
        pass
    results["check"] = check_bit_exact()

    def start(variant: str, d: int, first_only: bool = False) -> dict:
        row = cold_start(__file__, ["--variant", variant, "--d-model", str(d), "--n-layer", str(args.n_layer),
                                    "--steps", str(args.steps), "--batch", str(args.batch), "--generic", args.generic]
                         + (["--first-step-only"] if first_only else []))
        return dict(row, variant=variant, d_model=d) if "error" in row else row

    rows = []
    for d in args.d_model:
        for variant in args.variants:
            row = start(variant, d)
            if "error" not in row and args.cold_starts > 1:
                firsts = [row["first_step_s"]]
                for _ in range(args.cold_starts - 1):
                    again = start(variant, d, first_only=True)
                    if "error" in again:
                        row["error"] = again["error"]
                        break
                    firsts.append(again["first_step_s"])
                row["first_step_runs_s"] = firsts
                row["first_step_s"] = sorted(firsts)[len(firsts) // 2]  # the median (the upper one of an even count)
            rows.append(row)
            print(f"done {variant} d={d}: {row}", file=sys.stderr, flush=True)
            Path(args.out).write_text(json.dumps(dict(results, rows=rows), indent=1))
    results["rows"] = rows
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"{results['gpu']}, torch {results['torch']}, quantize check: {results['check']}")
    print_table(rows, args.generic == "on")


def baseline_row(rows: list, row: dict) -> tuple[Optional[dict], bool]:
    """(the BF16 row ``row`` is compared with, whether it matches its CUDA-graph setting): ``bf16-cg``
    for a ``-cg`` variant, else ``bf16``, at the same width; the other BF16 row where that one is missing
    or failed (None where neither ran)."""
    same = "bf16-cg" if row["variant"].endswith("-cg") else "bf16"
    other = "bf16" if same == "bf16-cg" else "bf16-cg"
    for name in (same, other):
        base = next((r for r in rows if r["d_model"] == row["d_model"] and r["variant"] == name and "error" not in r), None)
        if base is not None:
            return base, name == same
    return None, False


def describe_generic(record: dict) -> str:
    """A row's generic settings (``generic_record``) in words."""
    names = record["unused_grad_buffers"]
    return f"unused-gradient buffers for {', '.join(names)}" if names else "no unused-gradient buffers"


def print_table(rows: list, generic: bool) -> None:
    """The rows with their ratios to the BF16 arm (``baseline_row``) and each arm's generic settings."""
    # Reserved memory is the comparable figure: a CUDA-graph variant's activations live in the graphs' private
    # pool, which the caching allocator's peak-allocated count leaves out.
    print(f"{'d':>5} {'variant':16} {'step ms':>8} {'x bf16':>8} {'reserved GiB':>12} {'x bf16':>8} "
          f"{'allocated GiB':>13} {'1st s':>6} {'x bf16':>8}")
    marked = False
    for r in rows:
        if "error" in r:
            print(f"{r['d_model']:>5} {r['variant']:16} error")
            continue
        base, same = baseline_row(rows, r)
        mark = "" if same or base is None else "*"
        marked = marked or bool(mark)
        ratio = lambda k: f"{r[k] / base[k]:.2f}{mark}" if base else "nan"
        print(f"{r['d_model']:>5} {r['variant']:16} {r['step_ms_median']:8.1f} {ratio('step_ms_median'):>8} "
              f"{r['peak_reserved_gib']:12.2f} {ratio('peak_reserved_gib'):>8} {r['peak_mem_gib']:13.2f} "
              f"{r['first_step_s']:6.1f} {ratio('first_step_s'):>8}")
    if marked:
        print("* against the BF16 arm with the other CUDA-graph setting (the matching one is not in this run)")
    print("generic settings " + ("on: every arm gets them" if generic else "off: no arm gets them") + "; per arm:")
    for r in rows:
        if "generic" in r:
            print(f"  {r['variant']} d={r['d_model']}: {describe_generic(r['generic'])}")
    for r in rows:
        if "first_step_runs_s" in r:
            runs = ", ".join(f"{t:.1f}" for t in r["first_step_runs_s"])
            print(f"first steps of {r['variant']} d={r['d_model']} over {len(r['first_step_runs_s'])} cold starts: {runs} s")


if __name__ == "__main__":
    main()
