"""The emulated NVFP4 GEMM at the shapes of a GPT training step, against the BF16 GEMM it stands in for.

    python benchmarks/bench_gemm.py [--d-model 1024] [--tokens 16384] [--out DIR]

For each GEMM of one transformer block (fprop, dgrad and wgrad of qkv, proj, fc and out), times with
``triton.testing.do_bench`` (median, after warm-up):

- ``bf16``: ``torch.mm`` with a bfloat16 output: what the BF16 model runs;
- ``torch + epilogue``: ``torch.mm`` writing fp32, then the Triton kernel applying alpha
  (``FP4COMPILE_EMULATED_GEMM=torch``);
- ``cuBLASLt alpha``: one cuBLASLt GEMM reading alpha in its epilogue and writing bfloat16
  (``codegen/cublaslt_gemm.py``), alpha's one-launch kernel included;
- ``cublaslt_mm op``: the form an Inductor graph runs, alpha computed beforehand (in the graph) and the
  ``fp4.cublaslt_mm`` op called through the dispatcher: the GEMM call alone;
- ``decode + cuBLASLt``: the packed operands decoded by ``decode_blocks`` (two launches), then the above:
  what an emulated GEMM on packed operands costs;
- ``packed triton``: the FP4-operand GEMM (``triton_kernels.packed_scaled_mm``), which reads the packed
  codes and scales and decodes in registers (dgrad reads W as stored); with ``--sweep`` also each of
  its tile configurations.

Before timing, the emulated paths are checked to give the same bits on operands whose sums are exact
(so the summation order cannot matter). Prints a table and writes bench_gemm.json to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch


def shapes(d: int, tokens: int):
    """(name, M, N, K) of C[M, N] = A[M, K] . B[N, K]^T for the four linears of a GPT block."""
    linears = {"qkv": (3 * d, d), "proj": (d, d), "fc": (4 * d, d), "out": (d, 4 * d)}
    for name, (out_f, in_f) in linears.items():
        yield f"{name} fprop", tokens, out_f, in_f
        yield f"{name} dgrad", tokens, in_f, out_f
        yield f"{name} wgrad", out_f, in_f, tokens


SWEEP = [  # tile configurations of the packed GEMM tried with --sweep (over CONFIGS["packed_mm"])
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
    dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=2),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3),
]


def _label(cfg: dict) -> str:
    return "{BLOCK_M}x{BLOCK_N}x{BLOCK_K} w{num_warps} s{num_stages}".format(**cfg)


def _exact_packed(rows: int, cols: int, g: torch.Generator):
    """Random E2M1 codes [rows, cols/2] with every block scale 1.0 (E4M3 0x38): products of two such
    values are multiples of 1/4 up to 36, so a K-term sum is exact in fp32 in any order."""
    codes = torch.randint(0, 256, (rows, cols // 2), device="cuda", generator=g, dtype=torch.int32).to(torch.uint8)
    return codes, torch.full((rows, cols // 16), 0x38, dtype=torch.uint8, device="cuda")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--out", default=".")
    parser.add_argument("--sweep", action="store_true", help="time each packed-GEMM tile configuration too")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_gemm needs a CUDA GPU", file=sys.stderr)
        return 2
    from triton.testing import do_bench

    from fp4compile import config, formats, ops  # noqa: F401  (ops: registers fp4.cublaslt_mm)
    from fp4compile.codegen import cublaslt_gemm as cl
    from fp4compile.codegen import triton_kernels as tk

    ok, why = cl.available()
    print(f"cuBLASLt: {why}", flush=True)
    if not ok:
        return 2

    def emulated(mode, a, amax_a, b, amax_b):
        gemm = tk.cublaslt_scaled_mm if mode == "cublaslt" else tk.emulated_scaled_mm
        with config.patch(emulated_gemm=mode):
            return gemm(a, amax_a, b, amax_b)

    amax_a, amax_b = torch.tensor(3.0e-3, device="cuda"), torch.tensor(7.77e2, device="cuda")
    alpha = formats.gemm_alpha(amax_a, amax_b)  # what the graph computes before fp4.cublaslt_mm

    def lowered(a, b):
        return torch.ops.fp4.cublaslt_mm(a, b, alpha, torch.bfloat16)
    base = dict(tk.CONFIGS["packed_mm"])
    sweep = [base] + ([dict(base, **c) for c in SWEEP] if args.sweep else [])

    def packed(cfg, qa, qb, b_kn):
        tk.CONFIGS["packed_mm"].update(cfg)
        try:
            return tk.packed_scaled_mm(*qa, *qb, b_kn=b_kn)
        finally:
            tk.CONFIGS["packed_mm"].update(base)

    rows = []
    for name, m, n, k in shapes(args.d_model, args.tokens):
        g = torch.Generator(device="cuda").manual_seed(m + n + k)
        exact_a = torch.randint(-6, 7, (m, k), device="cuda", generator=g).bfloat16()
        exact_b = torch.randint(-6, 7, (n, k), device="cuda", generator=g).bfloat16()
        same = torch.equal(emulated("cublaslt", exact_a, amax_a, exact_b, amax_b), emulated("torch", exact_a, amax_a, exact_b, amax_b))
        with config.patch(emulated_gemm="cublaslt"):  # a problem cuBLASLt refuses is an error, not the fallback
            same = same and torch.equal(lowered(exact_a, exact_b), emulated("torch", exact_a, amax_a, exact_b, amax_b))
        # Packed operands whose products sum exactly (codes of halves to 6, block scales 1): every order
        # gives the bits of the decode + torch.mm + epilogue path.
        dgrad = name.endswith("dgrad")
        qa = _exact_packed(m, k, g) + (amax_a,)
        qb = _exact_packed(k, n, g) + (amax_b,) if dgrad else _exact_packed(n, k, g) + (amax_b,)
        b_rows = tk.block_decode(qb[0], qb[1])
        b_dec = b_rows.t() if dgrad else b_rows
        want = emulated("torch", tk.block_decode(qa[0], qa[1]), amax_a, b_dec.contiguous(), amax_b)
        same_packed = all(torch.equal(packed(cfg, qa, qb, dgrad), want) for cfg in sweep)
        a = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        b = torch.randn(n, k, device="cuda", generator=g).bfloat16()
        qa = tk.quantize_1x16(torch.randn(m, k, device="cuda", generator=g).bfloat16(), "rne", 0)
        w = torch.randn(k, n, device="cuda", generator=g) if dgrad else torch.randn(n, k, device="cuda", generator=g)
        qb = tk.quantize_16x16(w.bfloat16(), "rne", 0)

        def decode_then_cublaslt():
            b_bd = tk.block_decode(qb[0], qb[1])
            return emulated("cublaslt", tk.block_decode(qa[0], qa[1]), qa[2], b_bd.t() if dgrad else b_bd, qb[2])

        times = {
            "bf16": do_bench(lambda: torch.mm(a, b.t()), warmup=25, rep=100, return_mode="median"),
            "torch + epilogue": do_bench(lambda: emulated("torch", a, amax_a, b, amax_b), warmup=25, rep=100, return_mode="median"),
            "cuBLASLt alpha": do_bench(lambda: emulated("cublaslt", a, amax_a, b, amax_b), warmup=25, rep=100, return_mode="median"),
            # The call alone, as Inductor's code makes it (cuBLASLt took these shapes in the bit check).
            "cublaslt_mm op": do_bench(lambda: lowered(a, b), warmup=25, rep=100, return_mode="median"),
            "decode + cuBLASLt": do_bench(decode_then_cublaslt, warmup=25, rep=100, return_mode="median"),
        }
        for i, cfg in enumerate(sweep):
            key = "packed triton" if i == 0 else "packed " + _label(cfg)
            times[key] = do_bench(lambda: packed(cfg, qa, qb, dgrad), warmup=25, rep=100, return_mode="median")
        row = dict(gemm=name, M=m, N=n, K=k, same_bits=same and same_packed, ms=times,
                   tflops={key: 2 * m * n * k / t / 1e9 for key, t in times.items()})
        rows.append(row)
        print(f"{name:12s} {m:6d}x{n:6d}x{k:6d} same bits {same and same_packed}  "
              + "  ".join(f"{key} {t * 1e3:7.1f} us" for key, t in times.items()), flush=True)
    total = {key: sum(r["ms"][key] for r in rows) for key in rows[0]["ms"]}
    print("per block: " + ", ".join(f"{key} {t:.3f} ms" for key, t in total.items()))
    result = dict(
        date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
        cublaslt=why, d_model=args.d_model, tokens=args.tokens, rows=rows, per_block_ms=total,
    )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_gemm.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0 if all(r["same_bits"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
