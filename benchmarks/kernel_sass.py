"""Machine code of the NVFP4 Triton kernels for sm_90 (Hopper) or another --arch, built without a device.

Compiles each kernel at its default launch configuration (``triton_kernels.CONFIGS``) for compute
capability 9.0 (``--arch``: another one, e.g. 80 for the A100) with ``triton.compile`` (no device needed), disassembles it with the ``cuobjdump`` that
Triton's package carries, and prints the instruction count, registers, elements per thread and
instructions per element. Integer arguments are marked divisible by 16, as Triton specializes them at
launch for the benchmark's 8192x8192 input, so the loads are vectorized as they are there.

    python benchmarks/kernel_sass.py                  # all kernels
    python benchmarks/kernel_sass.py --kernels rows_rne rht_sr --dump-dir sass/
    python benchmarks/kernel_sass.py --arch 80 --extra  # the A100: block scales to E4M3 without fp8 hardware
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import torch


def _load_kernels():
    # The module picks Triton's interpreter when no CUDA device is present; compiling needs the real
    # JIT functions, so report a device while importing it.
    available = torch.cuda.is_available
    torch.cuda.is_available = lambda: True
    try:
        from fp4compile.codegen import triton_kernels as tk
    finally:
        torch.cuda.is_available = available
    return tk


QUANT_ARGS = {
    "x_ptr": "*bf16", "amax_ptr": "*fp32", "own_ptr": "*i32", "out_amax_ptr": "*fp32", "data_ptr": "*u8",
    "scales_ptr": "*u8", "bd_ptr": "*bf16", "M": "i32", "K": "i32", "stride_xm": "i32",
    "seed_ptr": "*i64", "seed_lo": "i32", "seed_hi": "i32",
}


def kernel_specs(tk, arch: int = 90, extra: bool = False):
    """name -> (jit function, signature, constexprs, config key) for compute capability ``arch`` (the
    hardware E4M3 conversion from sm_89 on, as ``triton_kernels.launch._hw_e4m3`` chooses at launch). ``extra``:
    also the 16x16 weight quantizer with swizzled scales, the own-amax fix-up pass and a device seed (the
    other specialization that converts block scales)."""
    e4m3 = int(arch >= 89)
    rows = dict(QUANT_ARGS, TILE_ROWS="constexpr", SR="constexpr", SWIZZLE="constexpr", FAKE="constexpr",
                PASS="constexpr", MIX="constexpr", BLOCK_M="constexpr", BLOCK_K="constexpr", K_FIRST="constexpr",
                ITERS="constexpr", E4M3="constexpr")
    rht = dict(QUANT_ARGS, SR="constexpr", SWIZZLE="constexpr", FAKE="constexpr", PASS="constexpr",
               MIX="constexpr", BLOCK_M="constexpr", BLOCK_K="constexpr", K_FIRST="constexpr", E4M3="constexpr")
    amax = {"x_ptr": "*bf16", "acc_ptr": "*i32", "amax_x_ptr": "*i32", "amax_y_ptr": "*i32", "M": "i32",
            "K": "i32", "stride_xm": "i32", "BLOCK_M": "constexpr", "BLOCK_K": "constexpr", "ITERS": "constexpr",
            "K_FIRST": "constexpr"}
    k_first = lambda key: int(bool(tk.CONFIGS[key].get("K_FIRST")))  # noqa: E731
    specs = {}
    for sr, name in ((0, "rne"), (1, "sr")):
        cfg = tk.CONFIGS["quantize_rows"]
        specs[f"rows_{name}"] = (tk.rows._quantize_rows_kernel, rows, dict(
            TILE_ROWS=1, SR=sr, SWIZZLE=0, FAKE=0, PASS=0, MIX=0, BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"],
            K_FIRST=k_first("quantize_rows"), ITERS=cfg.get("ITERS", 1), E4M3=e4m3), "quantize_rows")
        cfg = tk.CONFIGS["rht_quantize"]
        specs[f"rht_{name}"] = (tk.rht._rht_quantize_kernel, rht, dict(
            SR=sr, SWIZZLE=0, FAKE=0, PASS=0, MIX=0, BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"],
            K_FIRST=k_first("rht_quantize"), E4M3=e4m3), "rht_quantize")
    for name, key, kernel, args in (("rows_rne_fake", "fake_rows", tk.rows._quantize_rows_kernel, rows),
                                    ("rht_rne_fake", "rht_quantize", tk.rht._rht_quantize_kernel, rht)):
        cfg = tk.CONFIGS[key]
        consts = dict(SR=0, SWIZZLE=0, FAKE=1, PASS=0, MIX=0, BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"],
                      K_FIRST=k_first(key), E4M3=e4m3)
        if "TILE_ROWS" in args:
            consts.update(TILE_ROWS=1, ITERS=cfg.get("ITERS", 1))
        specs[name] = (kernel, args, consts, key)
    dual = {"x_ptr": "*bf16", "amax_ptr": "*fp32", "amax_t_ptr": "*fp32", "data_ptr": "*u8", "scales_ptr": "*u8",
            "bd_ptr": "*bf16", "data_t_ptr": "*u8", "scales_t_ptr": "*u8", "bd_t_ptr": "*bf16", "M": "i32", "K": "i32",
            "stride_xm": "i32", "seed_ptr": "*i64", "seed_lo": "i32", "seed_hi": "i32",
            "seed_t_ptr": "*i64", "seed_t_lo": "i32", "seed_t_hi": "i32", "SR": "constexpr", "MIX": "constexpr",
            "SR_T": "constexpr", "MIX_T": "constexpr", "BLOCK_M": "constexpr", "BLOCK_K": "constexpr",
            "K_FIRST": "constexpr", "E4M3": "constexpr", "FAKE": "constexpr"}
    cfg = tk.CONFIGS["dual_quantize"]
    specs["dual_sr_fake"] = (tk.rht._dual_quantize_kernel, dual, dict(
        SR=1, MIX=0, SR_T=1, MIX_T=0, BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"], K_FIRST=k_first("dual_quantize"),
        E4M3=e4m3, FAKE=1),
        "dual_quantize")
    if extra:
        cfg = tk.CONFIGS["quantize_tiles"]
        specs["tiles16_sr"] = (tk.rows._quantize_rows_kernel, rows, dict(
            TILE_ROWS=16, SR=1, SWIZZLE=1, FAKE=0, PASS=2, MIX=1, BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"],
            K_FIRST=k_first("quantize_tiles"), ITERS=1, E4M3=e4m3), "quantize_tiles")
    cfg = tk.CONFIGS["rht_amax"]
    specs["wgrad_amax"] = (tk.rht._rht_amax_kernel, amax, dict(
        BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"], ITERS=cfg["ITERS"], K_FIRST=k_first("rht_amax")), "rht_amax")
    return specs


def cuobjdump() -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(path):
        raise FileNotFoundError(f"cuobjdump is not in Triton's package ({path})")
    return path


def measure(tk, name, spec, dump_dir=None, arch: int = 90) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, signature, constexprs, key = spec
    cfg = tk.CONFIGS[key]
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, (arg, kind) in enumerate(signature.items())
        if kind != "constexpr" and not arg.startswith("seed_")
    }
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(
        source, target=GPUTarget("cuda", arch, 32), options={"num_warps": cfg["num_warps"]}
    )
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, f"{name}.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([cuobjdump(), "-sass", cubin], check=True, capture_output=True, text=True).stdout
        usage = subprocess.run([cuobjdump(), "-res-usage", cubin], check=True, capture_output=True, text=True).stdout
    if dump_dir:
        os.makedirs(dump_dir, exist_ok=True)
        with open(os.path.join(dump_dir, f"{name}.sass"), "w") as f:
            f.write(sass)
    instructions = len(re.findall(r"^\s+/\*[0-9a-f]{4}\*/", sass, flags=re.M))
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    per_thread = constexprs["BLOCK_M"] * constexprs["BLOCK_K"] // (cfg["num_warps"] * 32)
    return dict(kernel=name, instructions=instructions, registers=registers, elements_per_thread=per_thread,
                per_element=instructions / per_thread)


def main(argv=None) -> int:
    tk = _load_kernels()
    names = list(kernel_specs(tk, extra=True))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernels", nargs="+", choices=sorted(names), help="default: all (tiles16_sr with --extra)")
    parser.add_argument("--dump-dir", help="also write each kernel's disassembly here")
    parser.add_argument("--extra", action="store_true", help="also the 16x16 weight quantizer (tiles16_sr)")
    parser.add_argument("--arch", type=int, default=90,
                        help="compute capability to compile for, as 10*major+minor (default 90: Hopper; 80: A100)")
    args = parser.parse_args(argv)
    specs = kernel_specs(tk, args.arch, args.extra or "tiles16_sr" in (args.kernels or ()))
    args.kernels = args.kernels or list(specs)
    print(f"{'kernel':12s} {'instructions':>12s} {'registers':>9s} {'elems/thread':>12s} {'per element':>11s}")
    for name in args.kernels:
        r = measure(tk, name, specs[name], args.dump_dir, args.arch)
        print(f"{name:12s} {r['instructions']:12d} {r['registers']:9d} {r['elements_per_thread']:12d} "
              f"{r['per_element']:11.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
