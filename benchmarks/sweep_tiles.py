"""Tile sweep of the training step's quantizers at the step's own shapes (GPU).

``bench_kernels.py`` times every kernel on one 8192x8192 tensor; the benchmark GPT's step quantizes
[16384, K] tensors with K of 1024, 3072 and 4096, where the best tile and program order can differ.
For each kernel the step launches and each shape, this script times the default configuration
(``triton_kernels.CONFIGS``) and each alternative below, after checking that the alternative gives the
default's bits (codes, decoded values and amaxes: a tile only changes which program computes what), and
the default under register caps (``maxnreg``).
Times are medians of ``triton.testing.do_bench_cudagraph``: each call is recorded in a CUDA graph and
replayed, because at these shapes a kernel takes 10-40 us and the Python launch about as long, so that
timing each launch from Python (``--timer launch``, ``triton.testing.do_bench``) measures the host as
much as the kernel.

    python benchmarks/sweep_tiles.py --out sweep.json [--timer graph|launch]
"""

from __future__ import annotations

import argparse
import copy
import json

import torch

SHAPES = [(16384, 1024), (16384, 3072), (16384, 4096), (8192, 8192)]


def _bits(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out.contiguous().reshape(-1).view(torch.uint8)]
    return [b for t in out for b in _bits(t)]


def _same(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(_bits(a), _bits(b)))


def capped(tk, key, *caps):
    """The default configuration of ``key`` under each register cap (``maxnreg``): more programs resident
    per SM, at the risk of spills."""
    return [dict(tk.CONFIGS[key], maxnreg=cap) for cap in caps]


def sweeps(tk):
    """(label, CONFIGS key, function of x, alternatives)."""
    amaxes = {}

    def given(kind, x):
        key = (kind, x.data_ptr())
        if key not in amaxes:
            amaxes[key] = tk.global_amax(x) if kind == "x" else tk.wgrad_amax(x)
        return amaxes[key]

    return [
        ("wgrad_amax", "rht_amax", tk.wgrad_amax, [
            dict(BLOCK_M=bm, BLOCK_K=bk, ITERS=it, num_warps=w, K_FIRST=kf) for kf in (False, True)
            for bm, bk, it, w in ((128, 64, 4, 4), (64, 128, 4, 4), (64, 128, 1, 4), (64, 64, 2, 4), (32, 128, 4, 2))
        ] + [
            dict(BLOCK_M=bm, BLOCK_K=bk, ITERS=it, num_warps=w, K_FIRST=True)
            for bm, bk, it, w in ((32, 256, 4, 4), (32, 128, 8, 2), (16, 256, 8, 2), (32, 128, 2, 2), (32, 64, 4, 2))
        ] + capped(tk, "rht_amax", 96, 80)),
        ("global_amax", "amax", tk.global_amax, [
            dict(BLOCK=b, ITERS=i, num_warps=w) for b, i, w in ((4096, 4, 8), (2048, 8, 4), (8192, 4, 8))
        ]),
        ("fake_dual sr (given amaxes)", "dual_quantize",
         lambda x: tk.fake_quantize_dual(x, "sr", 11, given("t", x)[0], "sr", 12, given("t", x)[1]), [
            dict(BLOCK_M=64, BLOCK_K=64, num_warps=4, K_FIRST=False), dict(BLOCK_M=32, BLOCK_K=128, num_warps=4),
            dict(BLOCK_M=32, BLOCK_K=128, num_warps=4, K_FIRST=True), dict(BLOCK_M=128, BLOCK_K=64, num_warps=4),
         ] + capped(tk, "dual_quantize", 64, 56)),
        ("fake_rht rne (given amax)", "rht_quantize",
         lambda x: tk.fake_quantize_wgrad_operand(x, "rne", None, amax=given("t", x)[1], amax_is_own=True), [
            dict(BLOCK_M=64, BLOCK_K=64, num_warps=4, K_FIRST=True), dict(BLOCK_M=64, BLOCK_K=128, num_warps=4, K_FIRST=True),
            dict(BLOCK_M=128, BLOCK_K=64, num_warps=4, K_FIRST=True), dict(BLOCK_M=128, BLOCK_K=64, num_warps=4),
         ] + capped(tk, "rht_quantize", 48)),
        ("fake_rows rne (given amax)", "fake_rows",
         lambda x: tk.fake_quantize_1x16(x, "rne", None, amax=given("x", x), amax_is_own=True), [
            dict(BLOCK_M=32, BLOCK_K=256, num_warps=8), dict(BLOCK_M=32, BLOCK_K=256, num_warps=8, K_FIRST=True),
            dict(BLOCK_M=16, BLOCK_K=256, num_warps=8), dict(BLOCK_M=32, BLOCK_K=128, num_warps=8, K_FIRST=True),
         ] + [
            dict(BLOCK_M=bm, BLOCK_K=bk, num_warps=w, K_FIRST=True, ITERS=it)
            for bm, bk, w, it in ((16, 256, 8, 2), (16, 256, 8, 4), (16, 128, 4, 4), (32, 256, 8, 2), (8, 256, 4, 4))
         ] + capped(tk, "fake_rows", 32)),
        ("quantize_1x16 rne (own amax)", "quantize_rows",
         lambda x: tk.quantize_1x16(x, "rne", None, amax=given("x", x), amax_is_own=True), [
            dict(BLOCK_M=32, BLOCK_K=256, num_warps=8),
         ] + [
            dict(BLOCK_M=bm, BLOCK_K=bk, num_warps=w, K_FIRST=True, ITERS=it)
            for bm, bk, w, it in ((32, 256, 8, 4), (16, 256, 4, 8), (8, 256, 2, 4), (8, 256, 2, 8), (16, 128, 2, 4),
                                  (16, 256, 4, 2), (16, 256, 2, 4), (32, 256, 4, 4))
         ] + capped(tk, "quantize_rows", 96, 80, 64)),
        ("quantize_1x16 sr (own amax)", "quantize_rows",
         lambda x: tk.quantize_1x16(x, "sr", 5, amax=given("x", x), amax_is_own=True), [
            dict(BLOCK_M=32, BLOCK_K=256, num_warps=8),
            dict(BLOCK_M=16, BLOCK_K=256, num_warps=4, K_FIRST=True, ITERS=8),
         ]),
        ("rht sr packed (own amax)", "rht_quantize",
         lambda x: tk.quantize_wgrad_operand(x, "sr", 5, amax=given("t", x)[1], amax_is_own=True), [
            dict(BLOCK_M=32, BLOCK_K=128, num_warps=4), dict(BLOCK_M=128, BLOCK_K=64, num_warps=4, K_FIRST=True),
         ] + capped(tk, "rht_quantize", 80, 72)),
    ]


def main() -> None:
    import triton

    from fp4compile.codegen import triton_kernels as tk

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="sweep_tiles.json")
    p.add_argument("--timer", choices=("graph", "launch"), default="graph")
    p.add_argument("--only", nargs="+", metavar="TEXT", help="sweep only the kernels whose label contains one of these")
    args = p.parse_args()
    if args.timer == "graph":
        timer = lambda fn: triton.testing.do_bench_cudagraph(fn, return_mode="median")  # noqa: E731
    else:
        timer = lambda fn: triton.testing.do_bench(fn, return_mode="median")  # noqa: E731
    default = copy.deepcopy(tk.CONFIGS)
    torch.manual_seed(0)
    results = []
    for label, key, fn, alternatives in sweeps(tk):
        if args.only and not any(text in label for text in args.only):
            continue
        for shape in SHAPES:
            x = (torch.randn(shape, device="cuda") * 2).to(torch.bfloat16)
            tk.CONFIGS[key] = dict(default[key])
            ref = fn(x)
            row = dict(kernel=label, shape=list(shape), default=default[key],
                       default_ms=timer(lambda: fn(x)), variants=[])
            for cfg in alternatives:
                tk.CONFIGS[key] = dict(cfg)
                try:
                    exact = _same(ref, fn(x))
                    row["variants"].append(dict(cfg=cfg, exact=exact, ms=timer(lambda: fn(x))))
                except Exception as exc:  # a configuration that does not compile or launch is reported
                    row["variants"].append(dict(cfg=cfg, error=f"{type(exc).__name__}: {str(exc)[:200]}"))
            tk.CONFIGS[key] = dict(default[key])
            best = min((v for v in row["variants"] if v.get("exact")), key=lambda v: v["ms"], default=None)
            print(f"{label:28s} {str(shape):14s} default {row['default_ms'] * 1e3:7.1f} us   best other "
                  + (f"{best['ms'] * 1e3:7.1f} us {best['cfg']}" if best else "-"), flush=True)
            results.append(row)
    with open(args.out, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), triton=triton.__version__, timer=args.timer, results=results),
                  f, indent=1)


if __name__ == "__main__":
    main()
