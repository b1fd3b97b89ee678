"""End-to-end training-step benchmark: BF16 torch.compile vs backend="nvfp4" vs naive fake-quant.

Each variant runs in its own process with a fresh Inductor cache and a fresh Triton cache, so the
first-call time is a real compile, fp4compile's Triton kernels included (without a fresh Triton cache
they would load from the cache of an earlier run on the machine, and the figure would depend on the
machine's history). Measures: first step (compile + run), median step time, peak GPU memory in steady state.
Before timing, checks that the GPU quantize matches the CPU reference bit for bit. A ``-cg`` variant
compiles with ``mode="reduce-overhead"`` (the steps are recorded in CUDA graphs and replayed); a ``-dec``
variant sets ``Recipe(decoded_operands=True)``, a ``-packed`` one ``decoded_operands=False`` (without
either, the recipe's default: decoded with CUDA graphs, packed without). Ratios are given against
``bf16``, plain ``torch.compile``.

A cold start's first call varies between processes, BF16's by several seconds: ``--cold-starts N``
starts each variant N times (the further starts run only the first step) and reports the median first
step, with every start's figure beside it.

    python benchmarks/bench_e2e.py --out results.json            # d=1024 and d=2048, all variants
    python benchmarks/bench_e2e.py --d-model 1024 --variants bf16 nvfp4-cg --cold-starts 3
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

VARIANTS = ("bf16", "nvfp4", "naive", "bf16-cg", "nvfp4-cg", "nvfp4-dec", "nvfp4-dec-cg", "nvfp4-packed-cg")


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
    from fp4compile import formats  # importing the package registers the fp4 ops

    x = torch.randn(512, 1024, device="cuda") * 3
    got = torch.ops.fp4.quantize(x, "nvfp4", "1x16", "rne", 0, "")
    want = formats.quantize(x.cpu(), "nvfp4", "1x16")
    ok = torch.equal(got[0].cpu(), want.data.view(torch.uint8)) and torch.equal(got[1].cpu(), want.scales.view(torch.uint8))
    if not ok:
        raise SystemExit("GPU quantize differs from the CPU reference")
    return "bit-exact"


def training_setup(variant: str, d_model: int, n_layer: int, batch: int, inner: str = "inductor",
                   device: str = "cuda") -> dict:
    """The pieces of the benchmark's training step: compiled model, optimizer, input, whether the step
    runs under CUDA graphs, the nvfp4 Backend (or None) and the model's config. ``inner``: what compiles
    the nvfp4 variants' rewritten graphs (``Backend(inner=...)``); ``device``: "cuda" or "cpu" (the
    first-call benchmark's CPU runs; no ``-cg`` variant there)."""
    import fp4compile

    torch.manual_seed(0)
    graphs = variant.endswith("-cg")
    variant = variant.removesuffix("-cg")
    decoded = {"-dec": True, "-packed": False}.get(variant[variant.rfind("-"):]) if "-" in variant else None
    variant = variant.removesuffix("-dec").removesuffix("-packed")
    mode = "reduce-overhead" if graphs else None
    if graphs and device != "cuda":
        raise ValueError(f"variant {variant}-cg records CUDA graphs; it needs device='cuda', got {device!r}")
    model, cfg = build(d_model, n_layer, variant, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    backend = fp4compile.Backend(mode=mode, decoded_operands=decoded, inner=inner) if variant == "nvfp4" else None
    compiled = torch.compile(model, backend=backend or "inductor", mode=None if backend else mode)
    x = torch.randint(0, cfg.vocab, (batch, cfg.seq_len), device=device)
    return dict(compiled=compiled, opt=opt, x=x, graphs=graphs, backend=backend, cfg=cfg)


def training_step(variant: str, d_model: int, n_layer: int, batch: int):
    """(step function running one AdamW training step of the benchmark GPT, the nvfp4 Backend or None, cfg)."""
    s = training_setup(variant, d_model, n_layer, batch)
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


def run_variant(variant: str, d_model: int, n_layer: int, steps: int, batch: int, first_only: bool = False) -> dict:
    step, backend, cfg = training_step(variant, d_model, n_layer, batch)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    loss = step()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    if first_only:
        return {"variant": variant, "d_model": d_model, "first_step_s": first}
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
    }
    if backend is not None:
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
    p.add_argument("--first-step-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.d_model[0], args.n_layer, args.steps, args.batch,
                                     args.first_step_only)))
        return
    if args.cold_starts < 1:
        p.error("--cold-starts must be 1 or more")
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": datetime.date.today().isoformat()}
    try:
        import triton

        results["triton"] = triton.__version__
    except ImportError:
        pass
    results["check"] = check_bit_exact()

    def start(variant: str, d: int, first_only: bool = False) -> dict:
        row = cold_start(__file__, ["--variant", variant, "--d-model", str(d), "--n-layer", str(args.n_layer),
                                    "--steps", str(args.steps), "--batch", str(args.batch)]
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
    # Reserved memory is the comparable figure: a CUDA-graph variant's activations live in the graphs' private
    # pool, which the caching allocator's peak-allocated count leaves out.
    print(f"{'d':>5} {'variant':9} {'step ms':>8} {'x bf16':>7} {'reserved GiB':>12} {'x bf16':>7} "
          f"{'allocated GiB':>13} {'1st s':>6} {'x bf16':>7}")
    for d in args.d_model:
        base = next((r for r in rows if r["d_model"] == d and r["variant"] == "bf16" and "error" not in r), None)
        for r in rows:
            if r["d_model"] != d:
                continue
            if "error" in r:
                print(f"{d:>5} {r['variant']:9} error")
                continue
            ratio = lambda k: r[k] / base[k] if base else float("nan")
            print(f"{d:>5} {r['variant']:9} {r['step_ms_median']:8.1f} {ratio('step_ms_median'):7.2f} "
                  f"{r['peak_reserved_gib']:12.2f} {ratio('peak_reserved_gib'):7.2f} {r['peak_mem_gib']:13.2f} "
                  f"{r['first_step_s']:6.1f} {ratio('first_step_s'):7.2f}")
    for r in rows:
        if "first_step_runs_s" in r:
            runs = ", ".join(f"{t:.1f}" for t in r["first_step_runs_s"])
            print(f"first steps of {r['variant']} d={r['d_model']} over {len(r['first_step_runs_s'])} cold starts: {runs} s")


if __name__ == "__main__":
    main()
