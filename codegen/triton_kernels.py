"""Triton kernels that emulate NVFP4 and MXFP4 on GPUs without FP4 tensor cores (Hopper and older).

Every kernel produces exactly the bits of ``fp4compile.formats`` (the CPU reference): the same packed
E2M1 codes, E4M3 (or E8M0) block scales and global amax, including stochastic rounding (the
counter-based bits of ``formats.sr_random_bits`` are regenerated from (seed, flat index), one hash per
pair of elements) and the NaN/Inf/zero cases of the global scale. What they add is speed: one pass
over the tensor per kernel.

| function | what it returns | equals |
|---|---|---|
| ``global_amax(x)`` | max abs of x (fp32, NaN-propagating) | ``x.float().abs().amax()`` |
| ``wgrad_amax(x)`` | (amax of x, amax of RHT(x^T)), one read | ``(.., rht(x.t()).float().abs().amax())`` |
| ``quantize_1x16(x, rounding, seed, amax, swizzle)`` | (codes uint8 [M, K/2], scales uint8, amax) | ``quantize(x, "nvfp4", "1x16", ..)`` |
| ``quantize_16x16(w, ...)`` | same, 16x16 tiles (scales repeated per row) | ``quantize(w, "nvfp4", "16x16", ..)`` |
| ``quantize_wgrad_operand(x, rounding, seed, ..)`` | quantized RHT(x^T): [K, tokens/2] .. | ``quantize(rht(x.t()), ..)`` |
| ``quantize_mxfp4(x, rounding, seed)`` | (codes [M, K/2], E8M0 scale bytes [M, K/32], max abs of x) | ``quantize(x, "mxfp4", "1x32", ..)`` |
| ``quantize_wgrad_operand_mxfp4(x, ..)`` | the same for RHT(x^T): [K, tokens/2] .. | ``quantize(rht(x.t()), "mxfp4", ..)`` |
| ``fake_quantize_*`` | (value(code) * block scale in bf16, amax) | ``block_decode(quantize(..))`` |
| ``fake_quantize_dual(x, ..)`` | both decoded operands of a gradient: 1x16 and RHT(x^T), one launch | the two ``fake_quantize_*`` |
| ``dequantize`` / ``block_decode`` | decoded tensor from codes and scales | ``formats.dequantize`` / ``block_decode`` |
| ``transpose_tiles(data, scales)`` | codes and scales of W^T from a 16x16-tile quantized W | ``QTensor.transpose()`` |
| ``emulated_scaled_mm(a_bd, amax_a, b_bd, amax_b)`` | (A_bd @ B_bd^T, fp32 accumulate) * alpha | ``ops.scaled_mm_reference`` |

The fake-quant outputs are exact in bf16 (an E2M1 value times an E4M3 scale has at most 6 significant
bits), so an emulated FP4 GEMM is a plain bf16 GEMM with fp32 accumulation followed by the per-tensor
decode factors: the same arithmetic a Blackwell block-scaled GEMM does, up to the summation order.

MXFP4 has no global scale: its kernels quantize in one pass and take the amax they report on the side
(an atomic max over the bits of |x|, NaN above Inf). For NVFP4 a global amax needs a pass of its own
before the quantizing pass (the block scales depend on it). With ``amax=`` given, the quantizing pass
runs at once and tracks the tensor's own amax on the side, because a non-finite own amax wins over the
given one (as in ``formats.quantize``); a fix-up pass, which exits at once when the own amax is
finite, then redoes the tensor in that rare case.

Arithmetic notes: divisions use ``div_rn`` (Triton's ``/`` is approximate on NVIDIA GPUs), every
kernel is compiled without mul+add contraction, E4M3 and E2M1 rounding are done on the fp32 bits (and
one exact-by-construction fp32 addition), and the RHT runs the butterfly ``formats.rht`` defines
(``z_i = x_i * s_i / 4``, then additions and subtractions at strides 8, 4, 2, 1). Where an
element's scaled value is NaN its code is +0 (code 0): NaN has no E2M1 encoding, and the sign the CPU
reference gives such an element depends on its vector unit. docs/emulation.md has the details.

SR seeds: an int seed is passed to the kernel as it is; a ``runtime.DeviceSeed`` (what ``fp4.quantize``
passes on CUDA) makes the kernel compute ``runtime.sr_seed(node)`` itself from the step's base, read from
device memory when the kernel runs. Launching the kernel thus needs nothing that changes from step to
step, so Inductor can record a training step in a CUDA graph and every replay draws that step's bits.

Without a CUDA device the kernels run in Triton's interpreter on CPU tensors (slow; for tests).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
import struct
import threading
from typing import Optional, Union

import torch

from fp4compile import formats, runtime

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # the package works without triton; available() says why these kernels don't
    triton = None
    tl = None
    _IMPORT_ERROR = str(exc)
else:
    _IMPORT_ERROR = ""

__all__ = [
    "available",
    "global_amax",
    "wgrad_amax",
    "quantize_1x16",
    "quantize_16x16",
    "quantize_wgrad_operand",
    "quantize_mxfp4",
    "quantize_wgrad_operand_mxfp4",
    "fake_quantize_1x16",
    "fake_quantize_16x16",
    "fake_quantize_wgrad_operand",
    "fake_quantize_dual",
    "dequantize",
    "block_decode",
    "transpose_tiles",
    "emulated_scaled_mm",
    "gemm_alpha",
    "quantize_provider",
    "rht_quantize_provider",
    "fake_quantize_provider",
    "fake_rht_quantize_provider",
    "fake_dual_quantize_provider",
    "CONFIGS",
]

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# An SR seed: the seed itself, None (drawn at random, as formats.quantize does), or a runtime.DeviceSeed
# (a quantize node's constant, mixed on the device with the step's base the runtime keeps there).
Seed = Optional[Union[int, runtime.DeviceSeed]]

# Launch parameters per kernel, chosen on an H200 (benchmarks/bench_kernels.py sweeps alternatives at
# 8192x8192, benchmarks/sweep_tiles.py at the training step's shapes). K_FIRST: consecutive programs take
# the tiles of a row band (``_tile_ids``). ITERS: tiles per program along K; the 1x16 quantizers and
# wgrad_amax load the next tile while working on the one loaded. The decoded 1x16 quantizer has its own
# entry (fake_rows).
CONFIGS = {
    "amax": dict(BLOCK=4096, ITERS=8, num_warps=8),
    "quantize_rows": dict(BLOCK_M=16, BLOCK_K=256, num_warps=4, ITERS=4, K_FIRST=True),
    "fake_rows": dict(BLOCK_M=16, BLOCK_K=256, num_warps=8, K_FIRST=True),
    "quantize_tiles": dict(BLOCK_M=32, BLOCK_K=256, num_warps=8),
    "rht_amax": dict(BLOCK_M=32, BLOCK_K=128, ITERS=4, num_warps=2, K_FIRST=True),
    "rht_quantize": dict(BLOCK_M=64, BLOCK_K=64, num_warps=4),
    "dual_quantize": dict(BLOCK_M=64, BLOCK_K=64, num_warps=4, K_FIRST=True),
    "decode": dict(BLOCK_M=32, BLOCK_K=256, num_warps=8),
    "transpose_tiles": dict(BLOCK_M=64, BLOCK_K=64, num_warps=4),
    "quantize_mx": dict(BLOCK_M=32, BLOCK_K=256, num_warps=8),
    "rht_quantize_mx": dict(BLOCK_M=64, BLOCK_K=64, num_warps=4),
    "epilogue": dict(BLOCK=4096, num_warps=8),
}


def _f32(value: float) -> float:
    """``value`` rounded to float32 (round to nearest even), as a Python float."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def _interpreting() -> bool:
    return triton is not None and (os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available())


@functools.lru_cache(maxsize=None)
def available() -> tuple[bool, str]:
    """(whether the kernels can run here, why or why not); fixed for the process, so asked once."""
    if triton is None:
        return False, f"triton is not installed ({_IMPORT_ERROR})"
    if not torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET") == "1":
            return True, f"no CUDA device: Triton {triton.__version__} interpreter on the CPU (slow, for tests)"
        return False, "no CUDA device (TRITON_INTERPRET=1 runs the kernels in Triton's interpreter on the CPU)"
    major, minor = torch.cuda.get_device_capability()
    name = torch.cuda.get_device_name()
    if major < 8:
        return False, f"{name} (sm_{major}{minor}) lacks bfloat16 support; the kernels need sm_80 or newer"
    return True, f"Triton {triton.__version__} on {name} (sm_{major}{minor})"


if triton is not None:
    # Kernels are compiled for the GPU, or run by the interpreter when there is none, whatever the
    # environment said when triton was first imported.
    if _interpreting():
        from triton.runtime.interpreter import InterpretedFunction

        def _jit(**kwargs):
            return InterpretedFunction

    else:

        def _jit(**kwargs):
            return lambda fn: triton.jit(fn, **kwargs)

    _FLT_MAX = tl.constexpr(torch.finfo(torch.float32).max)
    _NVFP4_GLOBAL = tl.constexpr(formats.NVFP4_GLOBAL)
    _ONE_SIXTH = tl.constexpr(_f32(1.0 / 6.0))
    _INV_GLOBAL = tl.constexpr(_f32(1.0 / formats.NVFP4_GLOBAL))
    _TWO_M126 = tl.constexpr(2.0**-126)
    _NEG_MAGIC_M126 = tl.constexpr(-6291456.0 * 2.0**-126)  # -(3 * 2**21) * 2**-126, exact in fp32
    # Bit i set where the RHT sign vector has -1 at i.
    _RHT_NEG = tl.constexpr(sum(1 << i for i, s in enumerate(formats.DEFAULT_RHT_SIGNS) if s < 0))

    # ------------------------------------------------------------------------------------------
    # Scalar and element helpers
    # ------------------------------------------------------------------------------------------

    @_jit()
    def _abs_bits(x):
        """Bits of |x| as int32: their integer order is the float order, and NaN sorts above Inf."""
        return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF

    @_jit()
    def _max_nan(a, b):
        """Maximum that returns NaN where either operand is NaN (a reduction's combine function)."""
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @_jit()
    def _encode_scale(amax):
        """(S_enc, S_dec) from the global amax: min(2688/amax, FLT_MAX), 1 where amax or S_enc is 0.

        2688/amax is one IEEE-rounded division, as in the reference.
        """
        s_enc = tl.math.div_rn(2688.0, amax)  # = NVFP4_GLOBAL (6 * 448)
        s_enc = tl.where(s_enc > _FLT_MAX, _FLT_MAX, s_enc)  # a NaN stays NaN
        s_enc = tl.where((amax == 0.0) | (s_enc == 0.0), 1.0, s_enc)
        return s_enc, tl.math.div_rn(1.0, s_enc)

    @_jit()
    def _e4m3(f):
        """(E4M3 code as uint8, its value in fp32) of f in [0, 448] or NaN, rounded to nearest even.

        Matches ``torch.float8_e4m3fn`` conversion, subnormals included; NaN becomes code 0x7F.
        """
        nan = f != f
        safe = tl.where(nan, 0.0, f)
        bits = safe.to(tl.uint32, bitcast=True)
        # Normal range: round the fp32 mantissa to 3 bits, ties to even; the bits then read as E4M3.
        rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20
        # Subnormal range: multiples of 2**-9, rounded to nearest even by the 2**23 addition.
        steps = (safe * 512.0 + 8388608.0) - 8388608.0
        normal = safe >= 0.015625
        code = tl.where(normal, rounded - 960, steps.to(tl.uint32))
        code = tl.where(nan, 0x7F, code).to(tl.uint8)
        value = tl.where(normal, (rounded << 20).to(tl.float32, bitcast=True), steps * 0.001953125)
        return code, tl.where(nan, f, value)

    # Where the kernels are compiled for a GPU of sm_89 or later, block scales are converted to E4M3 by
    # the hardware (Triton's fp32 -> float8e4nv conversion, which Triton refuses for older GPUs such as
    # the A100); elsewhere, and in Triton's interpreter, they take the bit-level path (``_e4m3``). The
    # kernels take the choice as their E4M3 argument (``_hw_e4m3``).
    _HW_E4M3 = tl.constexpr(not _interpreting())

    @_jit()
    def _block_scale(bamax, s_enc, s_dec, HW: tl.constexpr):
        """(E4M3 scale code, its fp32 value, the fp32 encode factor) for block maxima >= 0 or NaN; ``HW``:
        the hardware conversion (bit for bit the same codes and values as the bit-level path)."""
        sf32 = bamax * (s_enc * _ONE_SIXTH)
        sf32 = tl.where(sf32 > 448.0, 448.0, sf32)
        if _HW_E4M3 and HW:
            # The hardware conversion (sm_89 and later: cvt.rn.satfinite.e4m3x2.f32, nearest even,
            # subnormals kept, NaN to 0x7F) and its exact inverse.
            fp8 = sf32.to(tl.float8e4nv)
            code = fp8.to(tl.uint8, bitcast=True)
            value = tl.where(sf32 != sf32, sf32, fp8.to(tl.float32))
        else:
            code, value = _e4m3(sf32)
        enc = tl.math.div_rn(1.0, value * s_dec)
        return code, value, tl.where(enc > _FLT_MAX, _FLT_MAX, enc)

    # Triton's interpreter does not round fp32 -> bf16 conversions to nearest even; there they are
    # done on the bits.
    _BF16_ON_BITS = tl.constexpr(_interpreting())

    @_jit()
    def _round_to(x, dtype: tl.constexpr):
        """fp32 x rounded to ``dtype`` (to nearest even) and back to fp32."""
        if dtype == tl.bfloat16 and _BF16_ON_BITS:
            bits = x.to(tl.uint32, bitcast=True)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
            return tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))
        else:
            return x.to(dtype).to(tl.float32)

    @_jit()
    def _e4m3_value(code):
        """fp32 value of E4M3 codes (uint8)."""
        c = code.to(tl.uint32)
        exponent = (c >> 3) & 0xF
        mantissa = c & 7
        subnormal = (mantissa.to(tl.float32) * 0.001953125).to(tl.uint32, bitcast=True)
        bits = tl.where(exponent == 0, subnormal, ((exponent + 120) << 23) | (mantissa << 20))
        bits = tl.where((c & 0x7F) == 0x7F, 0x7FC00000, bits)
        return (bits | ((c >> 7) << 31)).to(tl.float32, bitcast=True)

    @_jit()
    def _grid_position(v):
        """(m = min(|v|, 6), its fp32 bits, bits of its binade 2**floor(log2 m) clamped to >= 1, sign code).

        A NaN v gives meaningless results: callers zero the codes of blocks whose encode factor is NaN,
        which are exactly the blocks where v can be NaN.
        """
        m = tl.minimum(tl.abs(v), 6.0)
        bits = m.to(tl.uint32, bitcast=True)
        binade = tl.maximum(bits & 0x7F800000, 0x3F800000)
        sign = (v.to(tl.uint32, bitcast=True) >> 28) & 8
        return m, bits, binade, sign

    @_jit()
    def _e2m1_rne(v):
        """(4-bit code, signed E2M1 value) of v rounded to nearest, ties to even, saturating at 6.

        Adding 3 * 2**21 * binade rounds m to its binade's grid step (0.5, 1 or 2) in one fp32 addition;
        the number of steps, read off the sum's bits, plus the binade's offset, is the E2M1 index.
        """
        m, bits, binade, sign = _grid_position(v)
        magic = binade + (0x4AC00000 - 0x3F800000)
        total = m + magic.to(tl.float32, bitcast=True)
        idx = total.to(tl.uint32, bitcast=True) - magic + ((binade - 0x3F800000) >> 22)
        rounded = total - magic.to(tl.float32, bitcast=True)
        value = (rounded.to(tl.uint32, bitcast=True) | (sign << 28)).to(tl.float32, bitcast=True)
        return idx | sign, value

    @_jit()
    def _e2m1_rne_code_bits(v):
        """|v| rounded to nearest even on the E2M1 grid, saturating at 6, as the fp32 bits of r * 2**-126:
        the 3-bit magnitude code in bits 22-24 and nothing else set. For the codes of 0.5 ... 6 (1 ... 7)
        those bits are E2M1's own: 2**-126 moves E2M1's exponent bias of 1 to fp32's 127, and 0.5 * 2**-126
        is the fp32 subnormal 2**22 * 2**-149. Every step is exact, so the additions may be fused: m plus
        3 * 2**21 * binade rounds m to its binade's grid step (as in ``_e2m1_rne``), and subtracting that
        constant again after the 2**-126 scaling leaves r * 2**-126. All of it on the FMA pipe but the
        binade (two integer operations), where ``_e2m1_rne`` needs four more integer ones for the index.
        The kernels are built without flushing subnormals (plain fp32 arithmetic, no libdevice)."""
        m = tl.minimum(tl.abs(v), 6.0)
        binade = tl.maximum(m.to(tl.uint32, bitcast=True) & 0x7F800000, 0x3F800000).to(tl.float32, bitcast=True)
        total = tl.fma(binade, 6291456.0, m)
        return tl.fma(total, _TWO_M126, binade * _NEG_MAGIC_M126).to(tl.uint32, bitcast=True)

    # Outside Triton's interpreter (which has no directed-rounding additions) the kernels that write
    # decoded values take SR's ceiling below 1 as m + 1 rounded upward: one fp32 addition instead of a
    # float-to-int conversion (``_e2m1_sr``).
    _ADD_RU = tl.constexpr(not _interpreting())

    @_jit()
    def _e2m1_sr(v, r64, DECODED: tl.constexpr):
        """(4-bit code, signed E2M1 value) of v rounded stochastically, as ``formats._e2m1_index_sr``;
        ``r64``: the element's 16 random bits times 2**6 (``_sr_draws``).

        Integer arithmetic on a fixed-point m = min(|v|, 6) in which every grid step is 2**22: from 1 up,
        m's own fp32 bits (the mantissa's top bit is the grid bit, the 22 below it are frac * 2**22
        exactly); below 1, where the step is 0.5 as in [1, 2), the bits of m + 1 rounded upward (add.rp:
        ceil(m * 2**23) in the mantissa). Adding 2**22 - 1 - r64 carries into the grid bit exactly when
        rand * 2**6 < frac * 2**22, that is when u = rand * 2**-16 < frac; below 1 the upward rounding
        keeps that comparison exact (r64 is an integer). Clearing the 22 bits leaves the rounded value
        (less 1 below 1). Where only the code is wanted (not DECODED), and in the interpreter, the ceiling
        is computed as ceil(m * 2**23) instead (the same integer; a float-to-int conversion, but the index
        is then the sum's bits from 22 up, with no correction).
        """
        m, bits, _, sign = _grid_position(v)
        if _ADD_RU and DECODED:
            below = m < 1.0
            shift = tl.where(below, 1.0, 0.0)
            # m itself from 1 up (adding 0 is exact). Not libdevice's add_ru: Triton builds it flushing
            # subnormals to zero, and a subnormal m must still round up to 0.5 on a draw of 0.
            lifted = tl.inline_asm_elementwise(
                "add.rp.f32 $0, $1, $2;", "=f,f,f", [m, shift], dtype=tl.float32, is_pure=True, pack=1
            )
            total = (lifted.to(tl.uint32, bitcast=True) + (0x3FFFFF - r64)) & 0xFFC00000
            # 1.0 (bits 254 << 22) is index 2; below 1, value + 1 in [1, 2] is index + 2.
            idx = (total >> 22) - tl.where(below, 254, 252)
            magnitude = total.to(tl.float32, bitcast=True) - shift  # exact
            value_bits = magnitude.to(tl.uint32, bitcast=True)
        else:
            normal = m >= 1.0
            below = tl.math.ceil(m * 8388608.0).to(tl.uint32)  # at most 6 * 2**23: computed for every m, kept below 1
            total = tl.where(normal, bits - (0x3F000000 - 0x3FFFFF), below + 0x3FFFFF) - r64
            idx = total >> 22
            value_bits = tl.where(idx >= 2, (total & 0xFFC00000) + 0x3F000000, idx * 0x3F000000)
        return idx | sign, (value_bits | (sign << 28)).to(tl.float32, bitcast=True)

    @_jit()
    def _e2m1_value(code):
        """fp32 value of 4-bit E2M1 codes."""
        c = code.to(tl.uint32)
        idx = c & 7
        bits = tl.where(idx >= 2, (((idx >> 1) + 126) << 23) | ((idx & 1) << 22), tl.where(idx == 1, 0x3F000000, 0))
        return (bits | ((c >> 3) << 31)).to(tl.float32, bitcast=True)

    @_jit()
    def _hash32_open(x):
        """lowbias32 on uint32 (``formats._hash32``) less its last step, h -> h ^ (h >> 16)."""
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        return x * 0x846CA68B

    @_jit()
    def _sr_key(first, seed_lo, seed_hi):
        """The stream key of the pairs first + k (``_sr_word``): (first mod 2**32) xor k0 xor h((first >>
        32) xor k1), as ``formats.sr_random_bits`` keys pair first; the pairs first + k then hash
        key xor k. One full hash per ``first``, shared by its pairs."""
        k0 = seed_lo.to(tl.uint32, bitcast=True)
        k1 = seed_hi.to(tl.uint32, bitcast=True)
        h = _hash32_open((first >> 32).to(tl.uint32) ^ k1)
        return (first.to(tl.uint32) ^ k0) ^ (h ^ (h >> 16))

    @_jit()
    def _sr_word(key, k):
        """The 32-bit words of the pair indices first + k (elements 2 pair and 2 pair + 1) of the stream
        whose key for ``first`` is ``key`` (``_sr_key``), as ``formats.sr_random_bits``, before the last
        step of their hash (``_sr_draws`` takes it). Element 2 pair draws the word's low 16 bits, element
        2 pair + 1 the high 16 bits. Every kernel holds both elements of a pair and hashes once for both.

        ``first`` is a multiple of a power of two above every ``k`` (small non-negative ints), so
        first + k carries nothing: its low word is first's with k or-ed in and its high word is first's,
        and the key of first serves all its pairs."""
        return _hash32_open(key ^ k)

    @_jit()
    def _sr_draws(h):
        """(even, odd) element's 16 random bits times 2**6 (what ``_e2m1_sr`` takes) from their pair's word
        h before its last step: the word is w = h ^ (h >> 16), the even element draws (w & 0xFFFF) << 6 =
        ((h << 6) ^ (h >> 10)) & 0x3FFFC0 and the odd one (w >> 16) << 6 = (h >> 10) & 0x3FFFC0, so the
        last step's shift is shared and its exclusive or merges with the masking."""
        s = h >> 10
        return ((h << 6) ^ s) & 0x3FFFC0, s & 0x3FFFC0

    @_jit()
    def _sr_pair_bits(first, k, seed_lo, seed_hi):
        """The random draws (``_sr_draws``) of the elements of the [R, P] pair indices first + k (as
        ``_sr_word``): [R, 2 P], elements 2 pair and 2 pair + 1 side by side, one hash per pair."""
        even, odd = _sr_draws(_sr_word(_sr_key(first, seed_lo, seed_hi), k))
        return tl.reshape(tl.join(even, odd), (even.shape[0], 2 * even.shape[1]))

    @_jit()
    def _sr_row_bits(rows, pid_k, K, BLOCK_K: tl.constexpr, seed_lo, seed_hi):
        """The random draws (``_sr_draws``) of the [rows, BLOCK_K] tile at column block pid_k of a row-major
        [.., K] tensor (K even): pair index (row K + col) / 2."""
        pcols = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        return _sr_pair_bits(rows.to(tl.int64)[:, None] * (K // 2) + pcols[None, :], 0, seed_lo, seed_hi)

    @_jit()
    def _e2m1(v, rand, SR: tl.constexpr, DECODED: tl.constexpr = False):
        """(4-bit code, signed E2M1 value) of v: stochastic with SR (``rand``: the elements' random draws,
        see ``_sr_draws``), else round to nearest even; ``rand`` is read with SR only. DECODED: the value
        is used (else only the code)."""
        if SR:
            code, value = _e2m1_sr(v, rand, DECODED)
        else:
            code, value = _e2m1_rne(v)
        return code, value

    @_jit()
    def _mix64(x):
        """splitmix64's finaliser on uint64, as ``runtime._mix64`` (wrapping arithmetic)."""
        x = x + 0x9E3779B97F4A7C15
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB
        return x ^ (x >> 31)

    @_jit()
    def _stream_key(seed_ptr, seed_lo, seed_hi, MIX: tl.constexpr):
        """The SR seed's (low, high) 32 bits as uint32: the seed given in halves, or with MIX
        ``runtime.sr_seed`` of the node constant given in halves, mixed here with the step's base that
        the runtime keeps at seed_ptr (int64), so a recorded CUDA graph reads each step's base."""
        lo = seed_lo.to(tl.uint32, bitcast=True)
        hi = seed_hi.to(tl.uint32, bitcast=True)
        if MIX:
            node = (hi.to(tl.uint64) << 32) | lo.to(tl.uint64)
            stream = _mix64(tl.load(seed_ptr).to(tl.uint64, bitcast=True) ^ node)
            lo = (stream & 0xFFFFFFFF).to(tl.uint32)
            hi = ((stream >> 32) & 0x7FFFFFFF).to(tl.uint32)
        return lo, hi

    @_jit()
    def _store_scales(scales_ptr, sf, r, c, n_cols, mask, SWIZZLE: tl.constexpr):
        """Store scale codes sf at (row r, column c) (broadcastable with sf) of a row-major [rows, n_cols]
        matrix, or at their 128x4-tile offsets (formats.swizzled_offset)."""
        if SWIZZLE:
            offset = (((r // 128) * ((n_cols + 3) // 4) + c // 4) * 32 + r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
        else:
            offset = r.to(tl.int64) * n_cols + c
        tl.store(scales_ptr + offset, sf, mask=mask)

    @_jit()
    def _fixup_amax(amax_ptr, own_ptr, out_amax_ptr, first):
        """Fix-up pass after a given-amax pass: (the own amax, whether it is non-finite and so wins).

        The first program writes the amax the result was quantized with.
        """
        own_bits = tl.load(own_ptr)
        own = own_bits.to(tl.float32, bitcast=True)
        nonfinite = own_bits >= 0x7F800000
        tl.store(out_amax_ptr, tl.where(nonfinite, own, tl.load(amax_ptr)), mask=first)
        return own, nonfinite

    @_jit()
    def _tile_ids(K_FIRST: tl.constexpr):
        """(pid_m, pid_k) of this program's tile: consecutive programs step along M (down a column of
        tiles), or with K_FIRST along K (across a row of tiles, through memory in address order)."""
        if K_FIRST:
            return tl.program_id(1), tl.program_id(0)
        return tl.program_id(0), tl.program_id(1)

    # ------------------------------------------------------------------------------------------
    # Global amax
    # ------------------------------------------------------------------------------------------

    @_jit()
    def _amax_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        """Atomic max of |x| bits (int32) into out_ptr; each program reads ITERS * BLOCK elements."""
        start = tl.program_id(0).to(tl.int64) * (BLOCK * ITERS)
        acc = tl.zeros((BLOCK,), tl.int32)
        for i in range(ITERS):
            offs = start + i * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + offs, mask=offs < N, other=0.0).to(tl.float32)
            acc = tl.maximum(acc, _abs_bits(x))
        tl.atomic_max(out_ptr, tl.max(acc, axis=0))

    # ------------------------------------------------------------------------------------------
    # Quantize along rows: 1x16 blocks or 16x16 tiles
    # ------------------------------------------------------------------------------------------

    @_jit()
    def _load_half_blocks(x_ptr, rows, kb, half: tl.constexpr, stride_xm, ok):
        """The first (half 0) or second half of the 16-element blocks kb of rows ``rows`` ([G] each), as
        loaded: bf16 as [G, 4] 32-bit words, each holding a pair of elements (one 16-byte load per half
        block; ``_as_rows(..., pair_words=True)`` copies a bf16 view whose rows do not start on a word),
        other dtypes as [G, 8] elements."""
        if x_ptr.dtype.element_ty == tl.bfloat16:
            words = x_ptr.to(tl.pointer_type(tl.uint32))
            start = rows.to(tl.int64) * (stride_xm // 2) + kb * 8 + half * 4
            loaded = tl.load(words + start[:, None] + tl.arange(0, 4)[None, :], mask=ok[:, None], other=0)
        else:
            start = rows.to(tl.int64) * stride_xm + kb * 16 + half * 8
            loaded = tl.load(x_ptr + start[:, None] + tl.arange(0, 8)[None, :], mask=ok[:, None], other=0.0)
        return loaded

    @_jit()
    def _half_pairs(x_ptr, loaded):
        """The even and the odd elements (j < 4: 2 j and 2 j + 1) of half blocks as ``_load_half_blocks``
        loads them: two [G, 4] fp32 tensors. A bf16 word's even element is the word shifted up 16 bits,
        its odd one the word's high half: one integer operation per element."""
        if x_ptr.dtype.element_ty == tl.bfloat16:
            even = (loaded << 16).to(tl.float32, bitcast=True)
            odd = (loaded & 0xFFFF0000).to(tl.float32, bitcast=True)
        else:
            even, odd = tl.split(tl.reshape(loaded.to(tl.float32), (loaded.shape[0], 4, 2)))
        return even, odd

    @_jit()
    def _tile_blocks(M, K, pid_m, pid_k, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        """(rows, block columns) of the 1x16 blocks of the [BLOCK_M, BLOCK_K] tile at (pid_m, pid_k), one
        per block, and whether each lies inside the [M, K] tensor."""
        NB: tl.constexpr = BLOCK_K // 16
        g = tl.arange(0, BLOCK_M * NB)
        rows = pid_m * BLOCK_M + g // NB
        kb = pid_k * NB + g % NB
        return rows, kb, (rows < M) & (kb < K // 16)

    @_jit()
    def _half_block_codes(x_ptr, loaded, even, odd, enc, keep, start, seed_lo, seed_hi, sf, bd_ptr, mask,
                          SR: tl.constexpr, FAKE: tl.constexpr):
        """Codes of [G, 8] half blocks, given as loaded (``_load_half_blocks``) and as their even and odd
        elements ([G, 4] each, x; v = x * enc, code 0 where the block is not ``keep``) whose first
        elements have the flat indices ``start`` ([G] int64, multiples of 8): one uint32 per half block,
        element j in nibble j; with FAKE, stores value * sf at those indices instead."""
        if not SR and not FAKE:
            # Round to nearest, codes only: magnitudes from ``_e2m1_rne_code_bits``, signs from x (the sign
            # of v is x's: enc > 0 where the block is kept).
            c_even = _e2m1_rne_code_bits(even * enc[:, None])
            c_odd = _e2m1_rne_code_bits(odd * enc[:, None])
            pair = ((c_even + (c_odd << 4)) >> 22) | (_pair_signs(x_ptr, loaded, even, odd) & 0x88)
        else:
            if SR:
                # Pair index start / 2 + j: start / 2 is a multiple of 4.
                key = _sr_key((start >> 1)[:, None], seed_lo, seed_hi)
                r_even, r_odd = _sr_draws(_sr_word(key, tl.arange(0, 4)[None, :]))
            else:
                r_even, r_odd = 0, 0
            c_even, v_even = _e2m1(even * enc[:, None], r_even, SR, FAKE)
            c_odd, v_odd = _e2m1(odd * enc[:, None], r_odd, SR, FAKE)
            if FAKE:
                bd = tl.reshape(tl.join(v_even * sf[:, None], v_odd * sf[:, None]), (even.shape[0], 8))
                tl.store(bd_ptr + start[:, None] + tl.arange(0, 8)[None, :], bd.to(bd_ptr.dtype.element_ty),
                         mask=mask[:, None])
            pair = c_even | (c_odd << 4)
        # A byte per pair, element 2 j low; disjoint bytes, so the sum is an OR.
        word = tl.sum(pair << (tl.arange(0, 4) * 8)[None, :], axis=1)
        return tl.where(keep, word, 0)

    @_jit()
    def _pair_signs(x_ptr, loaded, even, odd):
        """Sign bits of the pairs of half blocks (``_load_half_blocks``, ``_half_pairs``): [G, 4] uint32
        with the even element's sign in bit 3 and the odd one's in bit 7 (other bits may be set: the caller
        masks with 0x88). A bf16 word holds them in bits 15 and 31; the high word of its product with
        2**20 + 2**8 has bit 15 in bit 3 and bit 31 in bit 7 (and in bit 19): one multiply, no shifts."""
        if x_ptr.dtype.element_ty == tl.bfloat16:
            return tl.umulhi(loaded & 0x80008000, 0x00100100)
        return ((even.to(tl.uint32, bitcast=True) >> 28) & 8) | ((odd.to(tl.uint32, bitcast=True) >> 24) & 0x80)

    @_jit()
    def _quantize_blocks_tile(
        x_ptr, data_ptr, scales_ptr, bd_ptr, amax, M, K, stride_xm, seed_lo, seed_hi, pid_m, pid_k,
        SR: tl.constexpr, SWIZZLE: tl.constexpr, FAKE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
        E4M3: tl.constexpr,
    ):
        """1x16 blocks of a [BLOCK_M, BLOCK_K] tile: loads it, then ``_quantize_loaded_blocks``."""
        rows, kb, ok = _tile_blocks(M, K, pid_m, pid_k, BLOCK_M, BLOCK_K)
        h0 = _load_half_blocks(x_ptr, rows, kb, 0, stride_xm, ok)
        h1 = _load_half_blocks(x_ptr, rows, kb, 1, stride_xm, ok)
        return _quantize_loaded_blocks(
            x_ptr, h0, h1, rows, kb, ok, data_ptr, scales_ptr, bd_ptr, amax, K, seed_lo, seed_hi, SR, SWIZZLE, FAKE,
            E4M3,
        )

    @_jit()
    def _quantize_loaded_blocks(
        x_ptr, h0, h1, rows, kb, ok, data_ptr, scales_ptr, bd_ptr, amax, K, seed_lo, seed_hi,
        SR: tl.constexpr, SWIZZLE: tl.constexpr, FAKE: tl.constexpr, E4M3: tl.constexpr,
    ):
        """1x16 blocks of a tile, given as loaded (h0, h1: the first and second halves of the blocks
        (rows, kb), ``ok`` where inside the tensor: ``_tile_blocks``, ``_load_half_blocks``) and held as
        the even and odd elements of each half (``_half_pairs``), so each thread holds whole blocks: the
        block maximum, scale and encode factor are computed once per block, no data moves between
        threads, and the two elements of a pair, which share one SR word and one byte of codes, sit side
        by side. Returns the bits of the tile's abs max."""
        e0, o0 = _half_pairs(x_ptr, h0)
        e1, o1 = _half_pairs(x_ptr, h1)
        # The block maximum of |x|; NaN wins (as in the integer order of the bits).
        bamax = tl.reduce(_max_nan(_max_nan(tl.abs(e0), tl.abs(o0)), _max_nan(tl.abs(e1), tl.abs(o1))), 1, _max_nan)
        s_enc, s_dec = _encode_scale(amax)
        sf_code, sf, enc = _block_scale(bamax, s_enc, s_dec, E4M3)
        # NaN has no E2M1 code: blocks whose encode factor is NaN (the only ones where v can be NaN) get 0.
        keep = enc == enc
        flat = rows.to(tl.int64) * K + kb * 16  # flat index of each block's first element
        w_lo = _half_block_codes(x_ptr, h0, e0, o0, enc, keep, flat, seed_lo, seed_hi, sf, bd_ptr, ok, SR, FAKE)
        w_hi = _half_block_codes(x_ptr, h1, e1, o1, enc, keep, flat + 8, seed_lo, seed_hi, sf, bd_ptr, ok, SR, FAKE)
        if not FAKE:
            # A block's 16 codes as one 8-byte store (little-endian: the first half block's word first), so a
            # warp's stores cover whole sectors in one instruction.
            blocks = data_ptr.to(tl.pointer_type(tl.uint64))
            tl.store(blocks + flat // 16, (w_hi.to(tl.uint64) << 32) | w_lo.to(tl.uint64), mask=ok)
            _store_scales(scales_ptr, sf_code, rows, kb, K // 16, ok, SWIZZLE)
        return tl.max(bamax.to(tl.int32, bitcast=True), axis=0)

    @_jit()
    def _quantize_rows_tile(
        x_ptr, data_ptr, scales_ptr, bd_ptr, amax, M, K, stride_xm, seed_lo, seed_hi, pid_m, pid_k,
        TILE_ROWS: tl.constexpr, SR: tl.constexpr, SWIZZLE: tl.constexpr, FAKE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, E4M3: tl.constexpr,
    ):
        """Quantize a [BLOCK_M, BLOCK_K] tile; returns the bits of its abs max."""
        if TILE_ROWS == 1:
            return _quantize_blocks_tile(
                x_ptr, data_ptr, scales_ptr, bd_ptr, amax, M, K, stride_xm, seed_lo, seed_hi, pid_m, pid_k,
                SR, SWIZZLE, FAKE, BLOCK_M, BLOCK_K, E4M3,
            )
        NB: tl.constexpr = BLOCK_K // 16
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        row_ok = rows < M
        mask = row_ok[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
        x4 = tl.reshape(x.to(tl.float32), (BLOCK_M // TILE_ROWS, TILE_ROWS, NB, 16))
        bamax = tl.max(tl.max(_abs_bits(x4), axis=3), axis=1).to(tl.float32, bitcast=True)
        s_enc, s_dec = _encode_scale(amax)
        sf_code, sf, enc = _block_scale(bamax, s_enc, s_dec, E4M3)
        v = x4 * enc[:, None, :, None]
        if SR:
            rand = tl.reshape(_sr_row_bits(rows, pid_k, K, BLOCK_K, seed_lo, seed_hi), (BLOCK_M // TILE_ROWS, TILE_ROWS, NB, 16))
        else:
            rand = 0
        code, value = _e2m1(v, rand, SR, FAKE)
        if FAKE:
            bd = tl.reshape(value * sf[:, None, :, None], (BLOCK_M, BLOCK_K))
            tl.store(bd_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], bd.to(bd_ptr.dtype.element_ty), mask=mask)
        else:
            # NaN has no E2M1 code: blocks whose encode factor is NaN (the only ones where v can be NaN) get 0.
            code = tl.where((enc == enc)[:, None, :, None], code, 0).to(tl.uint8)
            lo, hi = tl.split(tl.reshape(code, (BLOCK_M, BLOCK_K // 2, 2)))
            pcols = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
            pmask = row_ok[:, None] & (pcols < K // 2)[None, :]
            tl.store(data_ptr + rows.to(tl.int64)[:, None] * (K // 2) + pcols[None, :], lo | (hi << 4), mask=pmask)
            sf_rows = tl.reshape(
                tl.broadcast_to(sf_code[:, None, :], (BLOCK_M // TILE_ROWS, TILE_ROWS, NB)), (BLOCK_M, NB)
            )
            scols = pid_k * NB + tl.arange(0, NB)
            smask = row_ok[:, None] & (scols < K // 16)[None, :]
            _store_scales(scales_ptr, sf_rows, rows[:, None], scols[None, :], K // 16, smask, SWIZZLE)
        return tl.max(tl.max(bamax.to(tl.int32, bitcast=True), axis=1), axis=0)

    @_jit(do_not_specialize=("seed_lo", "seed_hi"))
    def _quantize_rows_kernel(
        x_ptr, amax_ptr, own_ptr, out_amax_ptr, data_ptr, scales_ptr, bd_ptr, M, K, stride_xm,
        seed_ptr, seed_lo, seed_hi,
        TILE_ROWS: tl.constexpr, SR: tl.constexpr, SWIZZLE: tl.constexpr, FAKE: tl.constexpr, PASS: tl.constexpr,
        MIX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, K_FIRST: tl.constexpr = False,
        ITERS: tl.constexpr = 1, E4M3: tl.constexpr = False,
    ):
        """Quantizes ITERS consecutive tiles along K. With 1x16 blocks and ITERS > 1, the next tile's loads
        are issued before the tile loaded is quantized, so they are in flight during its arithmetic."""
        pid_m, k_group = _tile_ids(K_FIRST)
        seed_lo, seed_hi = _stream_key(seed_ptr, seed_lo, seed_hi, MIX)
        # PASS 0: amax_ptr holds the own amax. 1: a given amax; track the own one. 2: fix-up.
        if PASS == 2:
            own, nonfinite = _fixup_amax(amax_ptr, own_ptr, out_amax_ptr, (pid_m == 0) & (k_group == 0))
            if nonfinite:
                for i in range(ITERS):
                    _quantize_rows_tile(
                        x_ptr, data_ptr, scales_ptr, bd_ptr, own, M, K, stride_xm, seed_lo, seed_hi, pid_m,
                        k_group * ITERS + i, TILE_ROWS, SR, SWIZZLE, FAKE, BLOCK_M, BLOCK_K, E4M3,
                    )
        else:
            amax = tl.load(amax_ptr)
            bits = tl.zeros((), tl.int32)
            if TILE_ROWS == 1 and ITERS > 1:
                rows, kb, ok = _tile_blocks(M, K, pid_m, k_group * ITERS, BLOCK_M, BLOCK_K)
                h0 = _load_half_blocks(x_ptr, rows, kb, 0, stride_xm, ok)
                h1 = _load_half_blocks(x_ptr, rows, kb, 1, stride_xm, ok)
                for i in range(ITERS):
                    c0, c1, c_rows, c_kb, c_ok = h0, h1, rows, kb, ok
                    # The next tile (none after the last: no block column is below a bound of 0).
                    rows, kb, ok = _tile_blocks(M, tl.where(i + 1 < ITERS, K, 0), pid_m, k_group * ITERS + i + 1,
                                                BLOCK_M, BLOCK_K)
                    h0 = _load_half_blocks(x_ptr, rows, kb, 0, stride_xm, ok)
                    h1 = _load_half_blocks(x_ptr, rows, kb, 1, stride_xm, ok)
                    bits = tl.maximum(bits, _quantize_loaded_blocks(
                        x_ptr, c0, c1, c_rows, c_kb, c_ok, data_ptr, scales_ptr, bd_ptr, amax, K, seed_lo, seed_hi,
                        SR, SWIZZLE, FAKE, E4M3,
                    ))
            else:
                for i in range(ITERS):
                    bits = tl.maximum(bits, _quantize_rows_tile(
                        x_ptr, data_ptr, scales_ptr, bd_ptr, amax, M, K, stride_xm, seed_lo, seed_hi, pid_m,
                        k_group * ITERS + i, TILE_ROWS, SR, SWIZZLE, FAKE, BLOCK_M, BLOCK_K, E4M3,
                    ))
            if PASS == 1:
                tl.atomic_max(own_ptr, bits)

    # ------------------------------------------------------------------------------------------
    # MXFP4: 1x32 blocks with E8M0 (power-of-two) scales, no global scale
    # ------------------------------------------------------------------------------------------

    @_jit()
    def _mx_scale(bits):
        """(E8M0 scale byte, fp32 factor 2**-exp) of blocks whose abs max has the bits ``bits`` (int32).

        As ``formats.quantize(.., "mxfp4")``: exp = floor(log2 bamax) - 2 from the exponent field, clamped
        to [-127, 127] (zero and subnormal maxima give -127). Non-finite blocks get scale byte 0xFF (NaN)
        and are encoded as the reference does: an Inf block with 2**-3, a NaN block with 2**-127.
        """
        exp = tl.maximum((bits >> 23) - 129, -127)
        exp = tl.where(bits > 0x7F800000, -127, tl.where(bits == 0x7F800000, -3, exp))
        scale_code = tl.where(bits >= 0x7F800000, 255, exp + 127).to(tl.uint8)
        # x / 2**exp, exactly: a multiplication by the (normal) power of two 2**-exp.
        return scale_code, ((127 - exp) << 23).to(tl.float32, bitcast=True)

    @_jit()
    def _mx_codes(v, rand, SR: tl.constexpr):
        """4-bit codes (uint8) of the scaled values v; ``rand`` (their random draws) is read with SR only."""
        code, _ = _e2m1(v, rand, SR)
        return tl.where(v == v, code, 0).to(tl.uint8)  # NaN: index 0, as the reference's comparisons give

    @_jit(do_not_specialize=("seed_lo", "seed_hi"))
    def _quantize_mx_kernel(
        x_ptr, data_ptr, scales_ptr, amax_ptr, M, K, stride_xm, seed_ptr, seed_lo, seed_hi,
        SR: tl.constexpr, MIX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """``formats.quantize(x, "mxfp4", "1x32")``: scale 2**(floor(log2 bamax) - 2) clamped to
        [2**-127, 2**127], code of x / scale (``_mx_scale``); atomic max of the |x| bits into amax_ptr."""
        NB: tl.constexpr = BLOCK_K // 32
        pid_m = tl.program_id(0)
        pid_k = tl.program_id(1)
        seed_lo, seed_hi = _stream_key(seed_ptr, seed_lo, seed_hi, MIX)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        row_ok = rows < M
        mask = row_ok[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
        x3 = tl.reshape(x.to(tl.float32), (BLOCK_M, NB, 32))
        bits = tl.max(_abs_bits(x3), axis=2)  # [BLOCK_M, NB]; NaN sorts above Inf
        scale_code, inv_scale = _mx_scale(bits)
        v = x3 * inv_scale[:, :, None]
        if SR:
            rand = tl.reshape(_sr_row_bits(rows, pid_k, K, BLOCK_K, seed_lo, seed_hi), (BLOCK_M, NB, 32))
        else:
            rand = 0
        code = _mx_codes(v, rand, SR)
        lo, hi = tl.split(tl.reshape(code, (BLOCK_M, BLOCK_K // 2, 2)))
        pcols = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        pmask = row_ok[:, None] & (pcols < K // 2)[None, :]
        tl.store(data_ptr + rows.to(tl.int64)[:, None] * (K // 2) + pcols[None, :], lo | (hi << 4), mask=pmask)
        scols = pid_k * NB + tl.arange(0, NB)
        smask = row_ok[:, None] & (scols < K // 32)[None, :]
        tl.store(scales_ptr + rows.to(tl.int64)[:, None] * (K // 32) + scols[None, :], scale_code, mask=smask)
        tl.atomic_max(amax_ptr, tl.max(tl.max(bits, axis=1), axis=0))

    # ------------------------------------------------------------------------------------------
    # Weight-gradient operand: quantize(RHT(x^T)) with 16-token RHT chunks = 16-token blocks
    # ------------------------------------------------------------------------------------------
    #
    # A tile of BLOCK_M tokens x BLOCK_K columns is held as 16 [BLOCK_M/16, BLOCK_K] tensors x_i, the
    # i-th token of every 16-token chunk (16 coalesced loads), so the butterfly, the block maxima over the
    # 16 outputs and the packing of the transposed codes are all elementwise: no data moves between
    # threads.

    @_jit()
    def _rht_load(x_ptr, M, K, stride_xm, chunks, cols, i: tl.constexpr, F32: tl.constexpr):
        """Token 16 c + i of every chunk c, [chunks, cols] as fp32 (F32) or in x's dtype."""
        tokens = chunks * 16 + i
        mask = (tokens < M)[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + tokens.to(tl.int64)[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
        return x.to(tl.float32) if F32 else x

    @_jit()
    def _rht_in(xi, i: tl.constexpr):
        """z_i = x_i * (s_i / 4): the sign vector and the 1/4 (exact: a power of two)."""
        return xi * (0.25 - 0.5 * ((_RHT_NEG >> i) & 1))

    @_jit()
    def _bfly(a, b):
        return a + b, a - b

    @_jit()
    def _amax16(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15):
        """Elementwise max of the |a_i| bits (int32; NaN sorts above Inf)."""
        m0 = tl.maximum(tl.maximum(_abs_bits(a0), _abs_bits(a1)), tl.maximum(_abs_bits(a2), _abs_bits(a3)))
        m1 = tl.maximum(tl.maximum(_abs_bits(a4), _abs_bits(a5)), tl.maximum(_abs_bits(a6), _abs_bits(a7)))
        m2 = tl.maximum(tl.maximum(_abs_bits(a8), _abs_bits(a9)), tl.maximum(_abs_bits(a10), _abs_bits(a11)))
        m3 = tl.maximum(tl.maximum(_abs_bits(a12), _abs_bits(a13)), tl.maximum(_abs_bits(a14), _abs_bits(a15)))
        return tl.maximum(tl.maximum(m0, m1), tl.maximum(m2, m3))

    @_jit()
    def _rht_loads(
        x_ptr, M, K, stride_xm, pid_m, pid_k, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, F32: tl.constexpr,
    ):
        """The 16 tokens of every 16-token chunk of the [BLOCK_M tokens, BLOCK_K] tile at (pid_m, pid_k),
        as fp32 (F32) or in x's dtype: (x_0 .. x_15, chunk indices, column indices), x_i [BLOCK_M/16,
        BLOCK_K]."""
        chunks = pid_m * (BLOCK_M // 16) + tl.arange(0, BLOCK_M // 16)
        cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        return (
            _rht_load(x_ptr, M, K, stride_xm, chunks, cols, 0, F32), _rht_load(x_ptr, M, K, stride_xm, chunks, cols, 1, F32),
            _rht_load(x_ptr, M, K, stride_xm, chunks, cols, 2, F32), _rht_load(x_ptr, M, K, stride_xm, chunks, cols, 3, F32),
            _rht_load(x_ptr, M, K, stride_xm, chunks, cols, 4, F32), _rht_load(x_ptr, M, K, stride_xm, chunks, cols, 5, F32),
            _rht_load(x_ptr, M, K, stride_xm, chunks, cols, 6, F32), _rht_load(x_ptr, M, K, stride_xm, chunks, cols, 7, F32),
            _rht_load(x_ptr, M, K, stride_xm, chunks, cols, 8, F32), _rht_load(x_ptr, M, K, stride_xm, chunks, cols, 9, F32),
            _rht_load(x_ptr, M, K, stride_xm, chunks, cols, 10, F32), _rht_load(x_ptr, M, K, stride_xm, chunks, cols, 11, F32),
            _rht_load(x_ptr, M, K, stride_xm, chunks, cols, 12, F32), _rht_load(x_ptr, M, K, stride_xm, chunks, cols, 13, F32),
            _rht_load(x_ptr, M, K, stride_xm, chunks, cols, 14, F32), _rht_load(x_ptr, M, K, stride_xm, chunks, cols, 15, F32),
            chunks, cols,
        )

    @_jit()
    def _rht_butterfly(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15):
        """RHT of the 16-element vectors (x_0 .. x_15) (elementwise over their shape), in fp32 before any
        rounding to the input's dtype: the butterfly of formats.rht, z_i = x_i * s_i / 4, then strides
        8, 4, 2, 1."""
        x0, x1, x2, x3 = _rht_in(x0, 0), _rht_in(x1, 1), _rht_in(x2, 2), _rht_in(x3, 3)
        x4, x5, x6, x7 = _rht_in(x4, 4), _rht_in(x5, 5), _rht_in(x6, 6), _rht_in(x7, 7)
        x8, x9, x10, x11 = _rht_in(x8, 8), _rht_in(x9, 9), _rht_in(x10, 10), _rht_in(x11, 11)
        x12, x13, x14, x15 = _rht_in(x12, 12), _rht_in(x13, 13), _rht_in(x14, 14), _rht_in(x15, 15)
        x0, x8 = _bfly(x0, x8)
        x1, x9 = _bfly(x1, x9)
        x2, x10 = _bfly(x2, x10)
        x3, x11 = _bfly(x3, x11)
        x4, x12 = _bfly(x4, x12)
        x5, x13 = _bfly(x5, x13)
        x6, x14 = _bfly(x6, x14)
        x7, x15 = _bfly(x7, x15)
        x0, x4 = _bfly(x0, x4)
        x1, x5 = _bfly(x1, x5)
        x2, x6 = _bfly(x2, x6)
        x3, x7 = _bfly(x3, x7)
        x8, x12 = _bfly(x8, x12)
        x9, x13 = _bfly(x9, x13)
        x10, x14 = _bfly(x10, x14)
        x11, x15 = _bfly(x11, x15)
        x0, x2 = _bfly(x0, x2)
        x1, x3 = _bfly(x1, x3)
        x4, x6 = _bfly(x4, x6)
        x5, x7 = _bfly(x5, x7)
        x8, x10 = _bfly(x8, x10)
        x9, x11 = _bfly(x9, x11)
        x12, x14 = _bfly(x12, x14)
        x13, x15 = _bfly(x13, x15)
        x0, x1 = _bfly(x0, x1)
        x2, x3 = _bfly(x2, x3)
        x4, x5 = _bfly(x4, x5)
        x6, x7 = _bfly(x6, x7)
        x8, x9 = _bfly(x8, x9)
        x10, x11 = _bfly(x10, x11)
        x12, x13 = _bfly(x12, x13)
        x14, x15 = _bfly(x14, x15)
        return x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15

    @_jit()
    def _rht_tile(
        x_ptr, M, K, stride_xm, pid_m, pid_k, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """RHT along tokens of the [BLOCK_M tokens, BLOCK_K] tile at (pid_m, pid_k).

        Returns (y_0 .. y_15, chunk indices, column indices), where
        y_j[c, k] = RHT(x^T)[k, 16 c + j], [BLOCK_M/16, BLOCK_K] fp32 holding values rounded to x's dtype,
        as ``formats.rht`` returns it.
        """
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, chunks, cols = _rht_loads(
            x_ptr, M, K, stride_xm, pid_m, pid_k, BLOCK_M, BLOCK_K, True
        )
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _rht_butterfly(
            x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15
        )
        dt: tl.constexpr = x_ptr.dtype.element_ty
        return (
            _round_to(x0, dt), _round_to(x1, dt), _round_to(x2, dt), _round_to(x3, dt),
            _round_to(x4, dt), _round_to(x5, dt), _round_to(x6, dt), _round_to(x7, dt),
            _round_to(x8, dt), _round_to(x9, dt), _round_to(x10, dt), _round_to(x11, dt),
            _round_to(x12, dt), _round_to(x13, dt), _round_to(x14, dt), _round_to(x15, dt),
            chunks, cols,
        )

    @_jit()
    def _absmax16(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15):
        """Elementwise max of the |a_i| (fp32), NaN where any is NaN: float maxima whose operands take the
        absolute value as a modifier, one instruction per operand."""
        m0 = _max_nan(_max_nan(tl.abs(a0), tl.abs(a1)), _max_nan(tl.abs(a2), tl.abs(a3)))
        m1 = _max_nan(_max_nan(tl.abs(a4), tl.abs(a5)), _max_nan(tl.abs(a6), tl.abs(a7)))
        m2 = _max_nan(_max_nan(tl.abs(a8), tl.abs(a9)), _max_nan(tl.abs(a10), tl.abs(a11)))
        m3 = _max_nan(_max_nan(tl.abs(a12), tl.abs(a13)), _max_nan(tl.abs(a14), tl.abs(a15)))
        return _max_nan(_max_nan(m0, m1), _max_nan(m2, m3))

    @_jit()
    def _rht_amax_kernel(
        x_ptr, amax_x_ptr, amax_y_ptr, M, K, stride_xm,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ITERS: tl.constexpr, K_FIRST: tl.constexpr = False,
    ):
        """Atomic max of |x| and |RHT(x^T)| bits; each program takes ITERS tiles along K, loading the next
        tile before it transforms the one loaded (its loads are in flight during the arithmetic), and
        keeps elementwise maxima until the end (one reduction across the program, not one per tile).

        The maxima are float maxima that propagate NaN, whose bits (an NaN's above Inf's) the atomics
        compare as integers. The RHT values are rounded to x's dtype once, at the end: rounding to
        nearest is monotone and symmetric, so the largest rounded |y| is the rounded largest |y| (NaN
        stays NaN)."""
        pid_m, k_group = _tile_ids(K_FIRST)
        x_acc = tl.zeros((BLOCK_M // 16, BLOCK_K), tl.float32)
        y_acc = tl.zeros((BLOCK_M // 16, BLOCK_K), tl.float32)
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, _, _ = _rht_loads(
            x_ptr, M, K, stride_xm, pid_m, k_group * ITERS, BLOCK_M, BLOCK_K, False
        )
        for i in range(ITERS):
            c0, c1, c2, c3, c4, c5, c6, c7 = x0, x1, x2, x3, x4, x5, x6, x7
            c8, c9, c10, c11, c12, c13, c14, c15 = x8, x9, x10, x11, x12, x13, x14, x15
            # The next tile (none after the last: no column is below a bound of 0).
            k_next = tl.where(i + 1 < ITERS, K, 0)
            x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, _, _ = _rht_loads(
                x_ptr, M, k_next, stride_xm, pid_m, k_group * ITERS + i + 1, BLOCK_M, BLOCK_K, False
            )
            c0, c1, c2, c3 = c0.to(tl.float32), c1.to(tl.float32), c2.to(tl.float32), c3.to(tl.float32)
            c4, c5, c6, c7 = c4.to(tl.float32), c5.to(tl.float32), c6.to(tl.float32), c7.to(tl.float32)
            c8, c9, c10, c11 = c8.to(tl.float32), c9.to(tl.float32), c10.to(tl.float32), c11.to(tl.float32)
            c12, c13, c14, c15 = c12.to(tl.float32), c13.to(tl.float32), c14.to(tl.float32), c15.to(tl.float32)
            x_acc = _max_nan(x_acc, _absmax16(c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15))
            c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15 = _rht_butterfly(
                c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15
            )
            y_acc = _max_nan(y_acc, _absmax16(c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15))
        x_max = tl.reduce(tl.reduce(x_acc, 1, _max_nan), 0, _max_nan)
        y_max = tl.reduce(tl.reduce(y_acc, 1, _max_nan), 0, _max_nan)
        tl.atomic_max(amax_x_ptr, x_max.to(tl.int32, bitcast=True))
        tl.atomic_max(amax_y_ptr, _round_to(y_max, x_ptr.dtype.element_ty).to(tl.int32, bitcast=True))

    @_jit()
    def _rht_code(y, factor, keep, rand, sf, SR: tl.constexpr, FAKE: tl.constexpr, MX: tl.constexpr):
        """4-bit code (uint32) of v = y * factor, 0 where not ``keep`` (with MX: where v is NaN, as the
        reference's comparisons give); with FAKE, its block-decoded value value(code) * sf instead.
        ``rand``: the elements' random draws (``_sr_draws``), read with SR only."""
        v = y * factor
        if MX:
            keep = v == v
        code, value = _e2m1(v, rand, SR, FAKE)
        if FAKE:
            out = value * sf
        else:
            out = tl.where(keep, code, 0)
        return out

    @_jit()
    def _join16(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15):
        """[..., 16] tensor t with t[..., j] = a_j (each join adds a last dim: the highest bit of j first)."""
        p0, p1, p2, p3 = tl.join(a0, a8), tl.join(a1, a9), tl.join(a2, a10), tl.join(a3, a11)
        p4, p5, p6, p7 = tl.join(a4, a12), tl.join(a5, a13), tl.join(a6, a14), tl.join(a7, a15)
        q0, q1, q2, q3 = tl.join(p0, p4), tl.join(p1, p5), tl.join(p2, p6), tl.join(p3, p7)
        t = tl.join(tl.join(q0, q2), tl.join(q1, q3))
        return tl.reshape(t, (a0.shape[0], a0.shape[1], 16))

    @_jit()
    def _pack8(c0, c1, c2, c3, c4, c5, c6, c7):
        """Eight 4-bit codes as one uint32, the first in the lowest nibble (little-endian bytes)."""
        lo = c0 | (c1 << 4) | (c2 << 8) | (c3 << 12)
        return lo | (c4 << 16) | (c5 << 20) | (c6 << 24) | (c7 << 28)

    @_jit()
    def _rht_store_codes(data_ptr, blocks_per_row, chunks, cols, mask, y0, y1, y2, y3, y4, y5, y6, y7, y8, y9,
                         y10, y11, y12, y13, y14, y15, factor, keep, seed_lo, seed_hi, sf, bd_ptr, M,
                         SR: tl.constexpr, FAKE: tl.constexpr, MX: tl.constexpr):
        """Codes of the 16 outputs of each chunk: one 8-byte store at row ``col`` of the [K, M/2] output
        (or, with FAKE, the 16 block-decoded values, contiguous, at row ``col`` of the [K, M] one)."""
        base = cols.to(tl.int64)[None, :] * M + (chunks.to(tl.int64) * 16)[:, None]  # flat index of (col, 16 c)
        if SR:
            # Elements 16 c + 2 j and 16 c + 2 j + 1 of a chunk share one word (base is a multiple of 16).
            key = _sr_key(base >> 1, seed_lo, seed_hi)  # pair base / 2, a multiple of 8
            w0, w1, w2, w3 = _sr_word(key, 0), _sr_word(key, 1), _sr_word(key, 2), _sr_word(key, 3)
            w4, w5, w6, w7 = _sr_word(key, 4), _sr_word(key, 5), _sr_word(key, 6), _sr_word(key, 7)
            r0, r1 = _sr_draws(w0)
            r2, r3 = _sr_draws(w1)
            r4, r5 = _sr_draws(w2)
            r6, r7 = _sr_draws(w3)
            r8, r9 = _sr_draws(w4)
            r10, r11 = _sr_draws(w5)
            r12, r13 = _sr_draws(w6)
            r14, r15 = _sr_draws(w7)
        else:
            r0, r1, r2, r3, r4, r5, r6, r7, r8, r9, r10, r11, r12, r13, r14, r15 = (0,) * 16
        c0 = _rht_code(y0, factor, keep, r0, sf, SR, FAKE, MX)
        c1 = _rht_code(y1, factor, keep, r1, sf, SR, FAKE, MX)
        c2 = _rht_code(y2, factor, keep, r2, sf, SR, FAKE, MX)
        c3 = _rht_code(y3, factor, keep, r3, sf, SR, FAKE, MX)
        c4 = _rht_code(y4, factor, keep, r4, sf, SR, FAKE, MX)
        c5 = _rht_code(y5, factor, keep, r5, sf, SR, FAKE, MX)
        c6 = _rht_code(y6, factor, keep, r6, sf, SR, FAKE, MX)
        c7 = _rht_code(y7, factor, keep, r7, sf, SR, FAKE, MX)
        c8 = _rht_code(y8, factor, keep, r8, sf, SR, FAKE, MX)
        c9 = _rht_code(y9, factor, keep, r9, sf, SR, FAKE, MX)
        c10 = _rht_code(y10, factor, keep, r10, sf, SR, FAKE, MX)
        c11 = _rht_code(y11, factor, keep, r11, sf, SR, FAKE, MX)
        c12 = _rht_code(y12, factor, keep, r12, sf, SR, FAKE, MX)
        c13 = _rht_code(y13, factor, keep, r13, sf, SR, FAKE, MX)
        c14 = _rht_code(y14, factor, keep, r14, sf, SR, FAKE, MX)
        c15 = _rht_code(y15, factor, keep, r15, sf, SR, FAKE, MX)
        if FAKE:
            bd = _join16(c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15)
            tl.store(bd_ptr + base[:, :, None] + tl.arange(0, 16)[None, None, :], bd.to(bd_ptr.dtype.element_ty),
                     mask=mask[:, :, None])
        else:
            # The chunk's 16 codes as one 8-byte store (little-endian: codes 0-7 in the first word).
            blocks = data_ptr.to(tl.pointer_type(tl.uint64))
            b = cols.to(tl.int64)[None, :] * blocks_per_row + chunks[:, None]
            first = _pack8(c0, c1, c2, c3, c4, c5, c6, c7).to(tl.uint64)
            tl.store(blocks + b, (_pack8(c8, c9, c10, c11, c12, c13, c14, c15).to(tl.uint64) << 32) | first, mask=mask)

    @_jit()
    def _rht_quantize_tile(
        x_ptr, data_ptr, scales_ptr, bd_ptr, amax, M, K, stride_xm, seed_lo, seed_hi, pid_m, pid_k,
        SR: tl.constexpr, SWIZZLE: tl.constexpr, FAKE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
        E4M3: tl.constexpr,
    ):
        """Quantize RHT(x^T) for one tile; outputs are [K, M]-shaped (transposed). Returns its abs-max bits."""
        y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15, chunks, cols = _rht_tile(
            x_ptr, M, K, stride_xm, pid_m, pid_k, BLOCK_M, BLOCK_K
        )
        bits = _amax16(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15)  # [chunk, column]
        s_enc, s_dec = _encode_scale(amax)
        # The hardware E4M3 conversion only for the decoded form: the packed one then needs 95 registers
        # instead of 72 on sm_90 (fewer programs per SM), and measured 5% slower with it.
        sf_code, sf, enc = _block_scale(bits.to(tl.float32, bitcast=True), s_enc, s_dec, FAKE and E4M3)
        mask = (chunks < M // 16)[:, None] & (cols < K)[None, :]
        # NaN has no E2M1 code: blocks whose encode factor is NaN (the only ones where v can be NaN) get 0.
        _rht_store_codes(
            data_ptr, M // 16, chunks, cols, mask, y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14,
            y15, enc, enc == enc, seed_lo, seed_hi, sf, bd_ptr, M, SR, FAKE, False,
        )
        if not FAKE:
            _store_scales(scales_ptr, sf_code, cols[None, :], chunks[:, None], M // 16, mask, SWIZZLE)
        return tl.max(tl.max(bits, axis=1), axis=0)

    @_jit(do_not_specialize=("seed_lo", "seed_hi"))
    def _rht_quantize_kernel(
        x_ptr, amax_ptr, own_ptr, out_amax_ptr, data_ptr, scales_ptr, bd_ptr, M, K, stride_xm,
        seed_ptr, seed_lo, seed_hi,
        SR: tl.constexpr, SWIZZLE: tl.constexpr, FAKE: tl.constexpr, PASS: tl.constexpr,
        MIX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, K_FIRST: tl.constexpr = False,
        E4M3: tl.constexpr = False,
    ):
        pid_m, pid_k = _tile_ids(K_FIRST)
        seed_lo, seed_hi = _stream_key(seed_ptr, seed_lo, seed_hi, MIX)
        if PASS == 2:
            own, nonfinite = _fixup_amax(amax_ptr, own_ptr, out_amax_ptr, (pid_m == 0) & (pid_k == 0))
            if nonfinite:
                _rht_quantize_tile(
                    x_ptr, data_ptr, scales_ptr, bd_ptr, own, M, K, stride_xm, seed_lo, seed_hi, pid_m, pid_k,
                    SR, SWIZZLE, FAKE, BLOCK_M, BLOCK_K, E4M3,
                )
        else:
            tile_amax_bits = _rht_quantize_tile(
                x_ptr, data_ptr, scales_ptr, bd_ptr, tl.load(amax_ptr), M, K, stride_xm, seed_lo, seed_hi, pid_m,
                pid_k, SR, SWIZZLE, FAKE, BLOCK_M, BLOCK_K, E4M3,
            )
            if PASS == 1:
                tl.atomic_max(own_ptr, tile_amax_bits)

    @_jit(do_not_specialize=("seed_lo", "seed_hi", "seed_t_lo", "seed_t_hi"))
    def _dual_quantize_kernel(
        x_ptr, amax_ptr, amax_t_ptr, bd_ptr, bd_t_ptr, M, K, stride_xm,
        seed_ptr, seed_lo, seed_hi, seed_t_ptr, seed_t_lo, seed_t_hi,
        SR: tl.constexpr, MIX: tl.constexpr, SR_T: tl.constexpr, MIX_T: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, K_FIRST: tl.constexpr = False, E4M3: tl.constexpr = False,
    ):
        """Both NVFP4 quantizations of a [M tokens, K] tensor, block-decoded, with their own amaxes given
        (``fp4.wgrad_amax``): 1x16 blocks along K into bd_ptr [M, K], and RHT(x^T) with 16-token blocks
        into bd_t_ptr [K, M]. Each program quantizes its tile both ways, so the second read of the tile
        comes mostly from L2."""
        pid_m, pid_k = _tile_ids(K_FIRST)
        seed_t_lo, seed_t_hi = _stream_key(seed_t_ptr, seed_t_lo, seed_t_hi, MIX_T)
        _rht_quantize_tile(
            x_ptr, bd_t_ptr, bd_t_ptr, bd_t_ptr, tl.load(amax_t_ptr), M, K, stride_xm, seed_t_lo, seed_t_hi,
            pid_m, pid_k, SR_T, False, True, BLOCK_M, BLOCK_K, E4M3,
        )
        seed_lo, seed_hi = _stream_key(seed_ptr, seed_lo, seed_hi, MIX)
        _quantize_blocks_tile(
            x_ptr, bd_ptr, bd_ptr, bd_ptr, tl.load(amax_ptr), M, K, stride_xm, seed_lo, seed_hi, pid_m, pid_k,
            SR, False, True, BLOCK_M, BLOCK_K, E4M3,
        )

    @_jit()
    def _pairs(t):
        """[2n, C] -> [n, 2, C]: chunks 2b and 2b + 1 side by side."""
        return tl.reshape(t, (t.shape[0] // 2, 2, t.shape[1]))

    @_jit(do_not_specialize=("seed_lo", "seed_hi"))
    def _rht_quantize_mx_kernel(
        x_ptr, data_ptr, scales_ptr, amax_ptr, M, K, stride_xm, seed_ptr, seed_lo, seed_hi,
        SR: tl.constexpr, MIX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """MXFP4 1x32 quantization of RHT(x^T) (two consecutive 16-token RHT chunks form a 32-token block);
        outputs are [K, M]-shaped. Atomic max of the |RHT(x^T)| bits into amax_ptr."""
        pid_m = tl.program_id(0)
        pid_k = tl.program_id(1)
        seed_lo, seed_hi = _stream_key(seed_ptr, seed_lo, seed_hi, MIX)
        y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15, chunks, cols = _rht_tile(
            x_ptr, M, K, stride_xm, pid_m, pid_k, BLOCK_M, BLOCK_K
        )
        chunk_bits = _amax16(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15)
        bits = tl.max(_pairs(chunk_bits), axis=1)  # [block, column]; NaN sorts above Inf
        scale_code, inv_scale = _mx_scale(bits)
        factor = tl.reshape(tl.broadcast_to(inv_scale[:, None, :], (BLOCK_M // 32, 2, BLOCK_K)), (BLOCK_M // 16, BLOCK_K))
        mask = (chunks < M // 16)[:, None] & (cols < K)[None, :]
        _rht_store_codes(
            data_ptr, M // 16, chunks, cols, mask, y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14,
            y15, factor, True, seed_lo, seed_hi, factor, data_ptr, M, SR, False, True,
        )
        blocks = pid_m * (BLOCK_M // 32) + tl.arange(0, BLOCK_M // 32)
        smask = (blocks < M // 32)[:, None] & (cols < K)[None, :]
        tl.store(scales_ptr + cols.to(tl.int64)[None, :] * (M // 32) + blocks[:, None], scale_code, mask=smask)
        tl.atomic_max(amax_ptr, tl.max(tl.max(bits, axis=1), axis=0))

    # ------------------------------------------------------------------------------------------
    # Decode, and the emulated GEMM's epilogue
    # ------------------------------------------------------------------------------------------

    @_jit()
    def _decode_kernel(
        data_ptr, scales_ptr, amax_ptr, out_ptr, M, K,
        SWIZZLE: tl.constexpr, APPLY_AMAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """value(code) * sf, times (sf * amax) * fp32(1/2688) instead of sf with APPLY_AMAX."""
        NB: tl.constexpr = BLOCK_K // 16
        pid_m = tl.program_id(0)
        pid_k = tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        pcols = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(
            data_ptr + rows.to(tl.int64)[:, None] * (K // 2) + pcols[None, :],
            mask=row_ok[:, None] & (pcols < K // 2)[None, :], other=0,
        )
        codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_M, NB, 16))
        scols = pid_k * NB + tl.arange(0, NB)
        r = rows[:, None]
        c = scols[None, :]
        if SWIZZLE:
            soffset = (((r // 128) * ((K // 16 + 3) // 4) + c // 4) * 32 + r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
        else:
            soffset = r.to(tl.int64) * (K // 16) + c
        sf = _e4m3_value(tl.load(scales_ptr + soffset, mask=row_ok[:, None] & (c < K // 16), other=0))
        if APPLY_AMAX:
            sf = (sf * tl.load(amax_ptr)) * _INV_GLOBAL
        out = _round_to(tl.reshape(_e2m1_value(codes) * sf[:, :, None], (BLOCK_M, BLOCK_K)), out_ptr.dtype.element_ty)
        cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        tl.store(
            out_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & (cols < K)[None, :],
        )

    @_jit()
    def _transpose_tiles_kernel(data_ptr, scales_ptr, out_data_ptr, out_scales_ptr, N, K,
                                BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        """Codes [K, N/2] and scales [K, N/16] of W^T from those of a 16x16-tile quantized W [N, K]: each
        [BLOCK_M, BLOCK_K] tile of codes unpacked, transposed and packed again; the tile scales (the
        first row of each 16-row tile) transposed and repeated on the 16 rows of the output tile."""
        pid_m = tl.program_id(0)
        pid_k = tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pcols = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(data_ptr + rows.to(tl.int64)[:, None] * (K // 2) + pcols[None, :],
                         mask=(rows < N)[:, None] & (pcols < K // 2)[None, :], other=0)
        codes = tl.trans(tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_M, BLOCK_K)))  # [BLOCK_K, BLOCK_M]
        even, odd = tl.split(tl.reshape(codes, (BLOCK_K, BLOCK_M // 2, 2)))
        cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)  # output rows
        prows = pid_m * (BLOCK_M // 2) + tl.arange(0, BLOCK_M // 2)
        tl.store(out_data_ptr + cols.to(tl.int64)[:, None] * (N // 2) + prows[None, :], even | (odd << 4),
                 mask=(cols < K)[:, None] & (prows < N // 2)[None, :])
        # Scales: out[k, t] = in[16 t, k // 16].
        tiles = pid_m * (BLOCK_M // 16) + tl.arange(0, BLOCK_M // 16)
        tile_ok = (tiles < N // 16)[None, :] & (cols < K)[:, None]
        sf = tl.load(scales_ptr + (tiles.to(tl.int64) * 16)[None, :] * (K // 16) + (cols // 16)[:, None], mask=tile_ok, other=0)
        tl.store(out_scales_ptr + cols.to(tl.int64)[:, None] * (N // 16) + tiles[None, :], sf, mask=tile_ok)

    @_jit()
    def _alpha_kernel(amax_a_ptr, amax_b_ptr, alpha_ptr, N, BLOCK: tl.constexpr):
        """alpha_ptr[0:N] = (amax_a * fp32(1/2688)) * (amax_b * fp32(1/2688)): ``formats.gemm_alpha``."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        alpha = (tl.load(amax_a_ptr) * _INV_GLOBAL) * (tl.load(amax_b_ptr) * _INV_GLOBAL)
        tl.store(alpha_ptr + offs, tl.full((BLOCK,), 0.0, tl.float32) + alpha, mask=offs < N)

    @_jit()
    def _epilogue_kernel(acc_ptr, alpha_ptr, out_ptr, N, BLOCK: tl.constexpr):
        """out = acc * alpha, cast to out's dtype."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        acc = tl.load(acc_ptr + offs, mask=mask, other=0.0)
        out = _round_to(acc * tl.load(alpha_ptr), out_ptr.dtype.element_ty)
        tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Python API
# ----------------------------------------------------------------------------------------------


def _require_triton() -> None:
    if triton is None:
        raise RuntimeError(f"fp4compile's Triton kernels need triton: {_IMPORT_ERROR}")


def _launch_options(cfg: dict) -> dict:
    options = {"num_warps": cfg["num_warps"], "enable_fp_fusion": False}
    if cfg.get("maxnreg"):  # a register cap (more programs resident per SM, spills if set too low)
        options["maxnreg"] = cfg["maxnreg"]
    return options


# Launches, and plans of them. ``codegen.precompile`` runs a graph's ops with launches planned instead
# of made, to compile their kernels while Inductor compiles the graph; the first launch after that
# waits for those compiles rather than compiling a kernel a second time.
_plans = threading.local()  # .sink: where this thread's launches go while it plans
_pending: list = []  # futures of background compiles that the next launch waits for
_pending_lock = threading.Lock()


@contextlib.contextmanager
def planning(sink):
    """In this thread, each launch calls ``sink(kernel, grid, args, kwargs)`` instead of running: the
    launchers do everything else as usual (on fake tensors, so nothing is allocated or read)."""
    previous = getattr(_plans, "sink", None)
    _plans.sink = sink
    try:
        yield
    finally:
        _plans.sink = previous


def planning_active() -> bool:
    return getattr(_plans, "sink", None) is not None


def launch_after(futures) -> None:
    """Make the next launch, in any thread, wait for these (background compiles) first."""
    with _pending_lock:
        _pending.extend(futures)


def _hw_e4m3(device: torch.device) -> bool:
    """Whether the kernels convert block scales to E4M3 in hardware on ``device``: a CUDA GPU of sm_89
    or later (Ada, Hopper, Blackwell). Older GPUs (sm_80/86: A100, A10, RTX 30) have no such conversion,
    and Triton refuses it there; they take the bit-level path, which gives the same bits."""
    if device.type != "cuda":
        return False
    return _capability(torch.cuda.current_device() if device.index is None else device.index) >= (8, 9)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _launch(kernel, grid, *args, **kwargs) -> None:
    sink = getattr(_plans, "sink", None)
    if sink is not None:
        sink(kernel, grid, args, kwargs)
        return
    if _pending:
        with _pending_lock:
            futures = list(_pending)
            _pending.clear()
        concurrent.futures.wait(futures)
    kernel[grid](*args, **kwargs)


_MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension


def _tiles(cfg: dict, m_tiles: int, k_tiles: int) -> tuple[tuple[int, int], dict]:
    """(grid, the K_FIRST argument) of a kernel over m_tiles x k_tiles tiles (``_tile_ids``): K-tiles
    first where the config asks for it and the M-tiles fit the grid's second dimension."""
    k_first = bool(cfg.get("K_FIRST")) and m_tiles <= _MAX_GRID_Y
    return ((k_tiles, m_tiles) if k_first else (m_tiles, k_tiles)), {"K_FIRST": k_first}


def _as_rows(
    x: torch.Tensor, what: str, rows_multiple: int = 1, cols_multiple: int = 16, pair_words: bool = False
) -> torch.Tensor:
    """x as a 2-D [rows, K] tensor with unit stride along K (a view where possible); with ``pair_words``
    (the 1x16 tile, ``_load_half_blocks``), bf16 rows that each start on a 32-bit word."""
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"{what} takes float32, bfloat16 or float16 tensors, got {x.dtype} of shape {tuple(x.shape)}")
    if x.dim() < 1 or x.shape[-1] % cols_multiple:
        raise ValueError(
            f"{what}: the last dim of shape {tuple(x.shape)} is not a multiple of {cols_multiple}; pad it first"
        )
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    # The 1x16 tile reads bf16 rows as 32-bit words: every row must start on one (an even offset into
    # its storage, whose start the allocators align, and an even row stride); a view that does not is
    # copied. (The offset, not the address: the ops also run on fake tensors while they are traced.)
    odd = x2.storage_offset() % 2 or (x2.shape[0] > 1 and x2.stride(0) % 2)
    if pair_words and x2.dtype == torch.bfloat16 and odd:
        x2 = x2.clone(memory_format=torch.contiguous_format)
    if x2.shape[0] % rows_multiple:
        raise ValueError(f"{what}: {x2.shape[0]} rows (shape {tuple(x.shape)}) is not a multiple of {rows_multiple}")
    if x2.numel() == 0:
        raise ValueError(f"{what}: empty tensor of shape {tuple(x.shape)}")
    return x2


def _seed_args(rounding: str, seed, x2: torch.Tensor, unused: torch.Tensor) -> dict:
    """The kernels' seed arguments: (seed_ptr, seed_lo, seed_hi) and MIX.

    ``seed`` is an int (the SR seed itself; its low and high 32 bits travel as signed int32 values),
    None (drawn as ``formats.quantize`` draws it), or a ``runtime.DeviceSeed``: then the halves are
    the node constant's and the kernel mixes them with the base tensor on the device. ``unused`` is any
    tensor on x2's device, passed as the pointer the kernel never reads without MIX.
    """
    if rounding not in ("rne", "sr"):
        raise ValueError(f"rounding must be 'rne' or 'sr', got {rounding!r}")
    mix = rounding == "sr" and isinstance(seed, runtime.DeviceSeed)
    if rounding == "rne":
        value = 0
    elif mix:
        if seed.base.device != x2.device or seed.base.dtype != torch.int64 or seed.base.numel() != 1:
            raise ValueError(
                f"DeviceSeed base must be one int64 on {x2.device}, got {seed.base.dtype} "
                f"{tuple(seed.base.shape)} on {seed.base.device}"
            )
        value = seed.node
    elif seed is None:  # as formats.quantize draws it
        value = int(torch.randint(0, 2**62, ()))
    else:
        value = int(seed)
    value &= 0xFFFFFFFFFFFFFFFF
    lo, hi = (h - (1 << 32) if h >= (1 << 31) else h for h in (value & 0xFFFFFFFF, value >> 32))
    return {"seed_ptr": seed.base if mix else unused, "seed_lo": lo, "seed_hi": hi, "MIX": mix}


def _scales_bytes(rows: int, cols: int, swizzle: bool) -> int:
    """Bytes of a [rows, cols] scale matrix, plain or in the zero-padded 128x4-tiled layout."""
    return (-(-rows // 128) * 128) * (-(-cols // 4) * 4) if swizzle else rows * cols


def _scales_buffer(rows: int, cols: int, swizzle: bool, device) -> torch.Tensor:
    if swizzle:
        return torch.zeros(_scales_bytes(rows, cols, True), dtype=torch.uint8, device=device)
    return torch.empty((rows, cols), dtype=torch.uint8, device=device)


_AMAX_PROGRAMS = 1024


def _amax_bits(x2: torch.Tensor) -> torch.Tensor:
    """int32 [1] holding the bits of max |x| (viewed as float32 it is the amax)."""
    cfg = CONFIGS["amax"]
    out = torch.zeros(1, dtype=torch.int32, device=x2.device)
    flat = x2 if x2.is_contiguous() else x2.contiguous()
    n = flat.numel()
    iters = cfg["ITERS"]
    # Fewer tiles per program where the tensor is small (a weight): at least _AMAX_PROGRAMS programs, so
    # every SM has several to overlap the loads of, instead of a fraction of the GPU each reading serially.
    while iters > 1 and triton.cdiv(n, cfg["BLOCK"] * iters) < _AMAX_PROGRAMS:
        iters //= 2
    grid = (triton.cdiv(n, cfg["BLOCK"] * iters),)
    _launch(_amax_kernel, grid, flat, out, n, BLOCK=cfg["BLOCK"], ITERS=iters, **_launch_options(cfg))
    return out


def _rht_amax_bits(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = CONFIGS["rht_amax"]
    m, k = x2.shape
    out_x = torch.zeros(1, dtype=torch.int32, device=x2.device)
    out_y = torch.zeros(1, dtype=torch.int32, device=x2.device)
    grid, order = _tiles(cfg, triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(k, cfg["BLOCK_K"] * cfg["ITERS"]))
    _launch(
        _rht_amax_kernel, grid,
        x2, out_x, out_y, m, k, x2.stride(0), BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"], ITERS=cfg["ITERS"],
        **order, **_launch_options(cfg),
    )
    return out_x, out_y


def _amax_arg(amax: torch.Tensor, device) -> torch.Tensor:
    """A given amax as the kernels read it: one float32 on ``device``."""
    return amax.detach().to(device=device, dtype=torch.float32).reshape(1).contiguous()


def _quantize_passes(launch, own_amax_bits, amax: Optional[torch.Tensor], device, amax_is_own: bool) -> torch.Tensor:
    """Run ``launch(amax_ptr, own_ptr, out_amax_ptr, PASS)`` as the amax mode needs; return the amax used.

    Without ``amax``: one pass with the tensor's own amax (``own_amax_bits()`` computes it first).
    With it and ``amax_is_own``: that one pass alone, with the amax computed elsewhere (returned as
    given, on the device as float32). Otherwise: a pass with the given amax that also tracks the own
    amax, then the fix-up pass.
    """
    if amax is None:
        if amax_is_own:
            raise ValueError("amax_is_own=True needs the amax (amax=...)")
        own = own_amax_bits().view(torch.float32)
        launch(own, own, own, 0)
        return own.reshape(())
    given = _amax_arg(amax, device)
    if amax_is_own:
        launch(given, given, given, 0)
        return given.reshape(())
    own = torch.zeros(1, dtype=torch.int32, device=device)
    result = torch.empty(1, dtype=torch.float32, device=device)
    launch(given, own, result, 1)
    launch(given, own, result, 2)
    return result.reshape(())


def _output_buffers(rows, cols, swizzle, fake, device):
    """(data, scales, block-decoded) buffers of a quantize launch; a fake launch writes only the last."""
    if fake:
        bd = torch.empty((rows, cols), dtype=torch.bfloat16, device=device)
        return bd, bd, bd
    data = torch.empty((rows, cols // 2), dtype=torch.uint8, device=device)
    return data, _scales_buffer(rows, cols // 16, swizzle, device), data


def _quantize_rows(x, what, tile_rows, rounding, seed, amax, swizzle, fake, amax_is_own=False):
    _require_triton()
    x2 = _as_rows(x, what, tile_rows, pair_words=tile_rows == 1)
    m, k = x2.shape
    cfg = CONFIGS["quantize_tiles" if tile_rows > 1 else "fake_rows" if fake else "quantize_rows"]
    data, scales, bd = _output_buffers(m, k, swizzle, fake, x2.device)
    seed_args = _seed_args(rounding, seed, x2, bd)
    iters = cfg.get("ITERS", 1)
    grid, order = _tiles(cfg, triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(k, cfg["BLOCK_K"] * iters))
    e4m3 = _hw_e4m3(x2.device)

    def launch(amax_ptr, own_ptr, out_amax_ptr, pass_):
        _launch(
            _quantize_rows_kernel, grid,
            x2, amax_ptr, own_ptr, out_amax_ptr, data, scales, bd, m, k, x2.stride(0), **seed_args,
            TILE_ROWS=tile_rows, SR=rounding == "sr", SWIZZLE=swizzle, FAKE=fake, PASS=pass_,
            BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"], ITERS=iters, E4M3=e4m3, **order,
            **_launch_options(cfg),
        )

    amax_used = _quantize_passes(launch, lambda: _amax_bits(x2), amax, x2.device, amax_is_own)
    lead = x.shape[:-1]
    if fake:
        return bd.reshape(x.shape), amax_used
    if not swizzle:
        scales = scales.reshape(*lead, k // 16)
    return data.reshape(*lead, k // 2), scales, amax_used


def _quantize_wgrad(x, rounding, seed, amax, swizzle, fake, amax_is_own=False):
    _require_triton()
    x2 = _as_rows(x, "quantize_wgrad_operand", rows_multiple=16, cols_multiple=1)
    m, k = x2.shape  # m tokens
    cfg = CONFIGS["rht_quantize"]
    data, scales, bd = _output_buffers(k, m, swizzle, fake, x2.device)
    seed_args = _seed_args(rounding, seed, x2, bd)
    grid, order = _tiles(cfg, triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(k, cfg["BLOCK_K"]))
    e4m3 = _hw_e4m3(x2.device)

    def launch(amax_ptr, own_ptr, out_amax_ptr, pass_):
        _launch(
            _rht_quantize_kernel, grid,
            x2, amax_ptr, own_ptr, out_amax_ptr, data, scales, bd, m, k, x2.stride(0), **seed_args,
            SR=rounding == "sr", SWIZZLE=swizzle, FAKE=fake, PASS=pass_,
            BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"], E4M3=e4m3, **order, **_launch_options(cfg),
        )

    amax_used = _quantize_passes(launch, lambda: _rht_amax_bits(x2)[1], amax, x2.device, amax_is_own)
    if fake:
        return bd, amax_used
    return data, scales, amax_used


def global_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a float32 0-dim tensor; NaN if x holds a NaN (as ``torch.amax``)."""
    _require_triton()
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"global_amax takes float32, bfloat16 or float16 tensors, got {x.dtype}")
    if x.numel() == 0:
        raise ValueError(f"global_amax: empty tensor of shape {tuple(x.shape)}")
    return _amax_bits(x.reshape(1, -1)).view(torch.float32).reshape(())


def wgrad_amax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax of x, amax of RHT(x^T)) from one read of x [tokens, K] (tokens a multiple of 16).

    The second is the amax ``quantize_wgrad_operand`` needs; the first serves the 1x16 quantization
    of the same tensor for fprop or dgrad, so one pass gives both.
    """
    _require_triton()
    x_bits, y_bits = _rht_amax_bits(_as_rows(x, "wgrad_amax", rows_multiple=16, cols_multiple=1))
    return x_bits.view(torch.float32).reshape(()), y_bits.view(torch.float32).reshape(())


def quantize_1x16(
    x: torch.Tensor, rounding: str = "rne", seed: Seed = None, amax: Optional[torch.Tensor] = None,
    swizzle: bool = False, amax_is_own: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 with 1x16 blocks along the last dim: (codes uint8 [..., K/2], scales uint8, amax fp32 0-dim).

    Bit for bit ``formats.quantize(x, "nvfp4", "1x16", rounding, amax=amax, seed=seed)``. Scales are
    the bits of float8_e4m3fn, [..., K/16] row-major, or with ``swizzle`` the flat 128x4-tiled layout
    of ``formats.swizzle_scales`` over the [rows, K/16] matrix (zero padded).

    A given ``amax`` is checked against the tensor's own (a second pass over a per-tile maximum; a
    non-finite own amax wins). ``amax_is_own=True`` says it *is* x's own abs max, computed elsewhere
    (by ``global_amax``, ``wgrad_amax`` or the operand's producer): then one quantizing pass reads x
    once and does nothing else.
    """
    return _quantize_rows(x, "quantize_1x16", 1, rounding, seed, amax, swizzle, False, amax_is_own)


def quantize_16x16(
    w: torch.Tensor, rounding: str = "rne", seed: Seed = None, amax: Optional[torch.Tensor] = None,
    swizzle: bool = False, amax_is_own: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 with 16x16 tiles over the last two dims (scales repeated on each row of a tile, as formats);
    ``amax`` and ``amax_is_own`` as ``quantize_1x16``."""
    return _quantize_rows(w, "quantize_16x16", 16, rounding, seed, amax, swizzle, False, amax_is_own)


def quantize_wgrad_operand(
    x: torch.Tensor, rounding: str = "rne", seed: Seed = None, amax: Optional[torch.Tensor] = None,
    swizzle: bool = False, amax_is_own: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantized RHT(x^T) for x [tokens, K] (leading dims flattened into tokens, a multiple of 16).

    Transpose, 16-point RHT along tokens, amax after the RHT and 1x16 quantization along tokens, fused:
    returns (codes [K, tokens/2], scales [K, tokens/16] or swizzled, amax), bit for bit
    ``formats.quantize(formats.rht(x2.t()), "nvfp4", "1x16", rounding, amax=amax, seed=seed)`` with
    x2 = x as [tokens, K]. The RHT output is rounded to x's dtype first, as ``formats.rht`` returns it.
    Use rounding="rne" for activations X and "sr" for output gradients dY. ``amax_is_own=True``: the given
    amax is that of RHT(x^T) (``wgrad_amax``'s second result), and one pass runs, as in ``quantize_1x16``.
    """
    return _quantize_wgrad(x, rounding, seed, amax, swizzle, False, amax_is_own)


def _quantize_mx(kernel, x2, rows, cols, cfg, grid, rounding, seed):
    """Launch an MXFP4 kernel writing codes [rows, cols/2], scales [rows, cols/32] and the amax bits."""
    data = torch.empty((rows, cols // 2), dtype=torch.uint8, device=x2.device)
    scales = torch.empty((rows, cols // 32), dtype=torch.uint8, device=x2.device)
    amax = torch.zeros(1, dtype=torch.int32, device=x2.device)
    _launch(
        kernel, grid,
        x2, data, scales, amax, x2.shape[0], x2.shape[1], x2.stride(0), **_seed_args(rounding, seed, x2, data),
        SR=rounding == "sr", BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"], **_launch_options(cfg),
    )
    return data, scales, amax.view(torch.float32).reshape(())


def quantize_mxfp4(
    x: torch.Tensor, rounding: str = "rne", seed: Seed = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MXFP4 with 1x32 blocks along the last dim: (codes uint8 [..., K/2], E8M0 scale bytes [..., K/32],
    amax = max |x| fp32 0-dim), in one pass. Bit for bit ``formats.quantize(x, "mxfp4", "1x32", rounding,
    seed=seed)``; the amax is what ``fp4.quantize`` reports for MXFP4 (the format itself has no global
    scale): ``x.float().abs().amax()``, NaN where x holds a NaN (the NaN's payload may differ)."""
    _require_triton()
    x2 = _as_rows(x, "quantize_mxfp4", cols_multiple=32)
    m, k = x2.shape
    cfg = CONFIGS["quantize_mx"]
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(k, cfg["BLOCK_K"]))
    data, scales, amax = _quantize_mx(_quantize_mx_kernel, x2, m, k, cfg, grid, rounding, seed)
    lead = x.shape[:-1]
    return data.reshape(*lead, k // 2), scales.reshape(*lead, k // 32), amax


def quantize_wgrad_operand_mxfp4(
    x: torch.Tensor, rounding: str = "rne", seed: Seed = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MXFP4 quantized RHT(x^T) for x [tokens, K] (leading dims flattened into tokens, a multiple of 32).

    Transpose, 16-point RHT along tokens and 1x32 quantization along tokens in one pass (two
    consecutive RHT chunks form a block): returns (codes uint8 [K, tokens/2], E8M0 scale bytes
    [K, tokens/32], amax fp32 0-dim), bit for bit ``formats.quantize(formats.rht(x2.t()), "mxfp4",
    "1x32", rounding, seed=seed)`` with x2 = x as [tokens, K]. The amax is max |RHT(x^T)|, what
    ``fp4.rht_quantize`` reports for MXFP4; NaN where the transformed operand holds a NaN (the NaN's
    payload may differ from the reference's), Inf where it overflowed to Inf.
    """
    _require_triton()
    x2 = _as_rows(x, "quantize_wgrad_operand_mxfp4", rows_multiple=32, cols_multiple=1)
    m, k = x2.shape  # m tokens
    cfg = CONFIGS["rht_quantize_mx"]
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(k, cfg["BLOCK_K"]))
    return _quantize_mx(_rht_quantize_mx_kernel, x2, k, m, cfg, grid, rounding, seed)


def fake_quantize_1x16(
    x: torch.Tensor, rounding: str = "rne", seed: Seed = None, amax: Optional[torch.Tensor] = None,
    amax_is_own: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(value(code) * block scale as bf16 with x's shape, amax): ``formats.block_decode`` of quantize_1x16."""
    return _quantize_rows(x, "fake_quantize_1x16", 1, rounding, seed, amax, False, True, amax_is_own)


def fake_quantize_16x16(
    w: torch.Tensor, rounding: str = "rne", seed: Seed = None, amax: Optional[torch.Tensor] = None,
    amax_is_own: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(value(code) * tile scale as bf16, amax) for 16x16 tiles."""
    return _quantize_rows(w, "fake_quantize_16x16", 16, rounding, seed, amax, False, True, amax_is_own)


def fake_quantize_wgrad_operand(
    x: torch.Tensor, rounding: str = "rne", seed: Seed = None, amax: Optional[torch.Tensor] = None,
    amax_is_own: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block-decoded quantized RHT(x^T) as bf16 [K, tokens], amax)."""
    return _quantize_wgrad(x, rounding, seed, amax, False, True, amax_is_own)


def fake_quantize_dual(
    x: torch.Tensor, rounding: str, seed: Seed, amax: torch.Tensor,
    rounding_t: str, seed_t: Seed, amax_t: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``fake_quantize_1x16(x, rounding, seed, amax=amax, amax_is_own=True)[0]``,
    ``fake_quantize_wgrad_operand(x, rounding_t, seed_t, amax=amax_t, amax_is_own=True)[0]``) from one
    launch that quantizes each tile of the [tokens, K] tensor x both ways (the second read of a tile
    mostly from L2): a gradient dY quantized for dgrad and, with the RHT, for wgrad. ``amax`` and
    ``amax_t`` must be x's own (``wgrad_amax(x)``)."""
    _require_triton()
    x2 = _as_rows(x, "fake_quantize_dual", rows_multiple=16, pair_words=True)
    m, k = x2.shape
    cfg = CONFIGS["dual_quantize"]
    bd = torch.empty((m, k), dtype=torch.bfloat16, device=x2.device)
    bd_t = torch.empty((k, m), dtype=torch.bfloat16, device=x2.device)
    given = [_amax_arg(a, x2.device) for a in (amax, amax_t)]
    seeds = _seed_args(rounding, seed, x2, bd)
    seeds_t = _seed_args(rounding_t, seed_t, x2, bd)
    grid, order = _tiles(cfg, triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(k, cfg["BLOCK_K"]))
    _launch(
        _dual_quantize_kernel, grid,
        x2, given[0], given[1], bd, bd_t, m, k, x2.stride(0),
        seeds["seed_ptr"], seeds["seed_lo"], seeds["seed_hi"], seeds_t["seed_ptr"], seeds_t["seed_lo"], seeds_t["seed_hi"],
        SR=rounding == "sr", MIX=seeds["MIX"], SR_T=rounding_t == "sr", MIX_T=seeds_t["MIX"],
        BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"], E4M3=_hw_e4m3(x2.device), **order, **_launch_options(cfg),
    )
    return bd.reshape(x.shape), bd_t


def _decode(data, scales, amax, dtype, swizzled, apply_amax):
    _require_triton()
    data = data.view(torch.uint8)
    data2 = data.reshape(-1, data.shape[-1]).contiguous()
    m, k = data2.shape[0], data2.shape[1] * 2
    if k % 16:
        raise ValueError(f"packed data of shape {tuple(data.shape)} does not hold whole 16-element blocks")
    scales = scales.view(torch.uint8).contiguous()
    expected = _scales_bytes(m, k // 16, swizzled)
    if scales.numel() != expected:
        raise ValueError(f"scales hold {scales.numel()} bytes; [{m}, {k // 16}] (swizzled={swizzled}) needs {expected}")
    out = torch.empty((m, k), dtype=dtype, device=data.device)
    # Without APPLY_AMAX the kernel never reads amax_ptr: pass the output, not a host tensor (a copy
    # from pageable host memory would wait for the whole stream on every call).
    amax_t = out if amax is None else amax.detach().to(data.device, torch.float32).reshape(1)
    cfg = CONFIGS["decode"]
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(k, cfg["BLOCK_K"]))
    _launch(
        _decode_kernel, grid,
        data2, scales, amax_t, out, m, k, SWIZZLE=swizzled, APPLY_AMAX=apply_amax,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"], **_launch_options(cfg),
    )
    return out.reshape(*data.shape[:-1], k)


def dequantize(
    data: torch.Tensor, scales: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype = torch.float32,
    swizzled: bool = False,
) -> torch.Tensor:
    """value(code) * ((sf * amax) * fp32(1/2688)), cast to ``dtype``: ``formats.dequantize`` for NVFP4.

    ``data`` [..., K/2] packed codes, ``scales`` [..., K/16] (or swizzled) E4M3 bits; 16x16-tile results
    decode the same way since their scales are stored per row.
    """
    return _decode(data, scales, amax, dtype, swizzled, apply_amax=True)


def block_decode(data: torch.Tensor, scales: torch.Tensor, swizzled: bool = False) -> torch.Tensor:
    """value(code) * sf in bf16 (exact): ``formats.block_decode``, the operand an emulated GEMM reads."""
    return _decode(data, scales, None, torch.bfloat16, swizzled, apply_amax=False)


def transpose_tiles(data: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [K, N/2], scales [K, N/16]) of W^T from the codes [N, K/2] and the E4M3 scale bytes [N, K/16]
    of a 16x16-tile quantized W [N, K] (N, K multiples of 16): ``formats.QTensor.transpose`` in one pass
    over the packed weight (a permutation of codes and scales: no arithmetic)."""
    _require_triton()
    n, k = data.shape[0], data.shape[1] * 2
    data = data.view(torch.uint8).contiguous()
    scales = scales.view(torch.uint8).contiguous()
    out_data = torch.empty((k, n // 2), dtype=torch.uint8, device=data.device)
    out_scales = torch.empty((k, n // 16), dtype=torch.uint8, device=data.device)
    cfg = CONFIGS["transpose_tiles"]
    grid = (triton.cdiv(n, cfg["BLOCK_M"]), triton.cdiv(k, cfg["BLOCK_K"]))
    _launch(
        _transpose_tiles_kernel, grid,
        data, scales, out_data, out_scales, n, k, BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"], **_launch_options(cfg),
    )
    return out_data, out_scales


def gemm_alpha(amax_a: torch.Tensor, amax_b: torch.Tensor, count: int = 1) -> torch.Tensor:
    """``formats.gemm_alpha(amax_a, amax_b)`` on the device, repeated ``count`` times (fp32 [count])."""
    _require_triton()
    amax_a = amax_a.detach().to(torch.float32).reshape(1)
    amax_b = amax_b.detach().to(amax_a.device, torch.float32).reshape(1)
    alpha = torch.empty(max(count, 1), dtype=torch.float32, device=amax_a.device)
    block = 1024
    grid = (triton.cdiv(alpha.numel(), block),)
    _launch(_alpha_kernel, grid, amax_a, amax_b, alpha, alpha.numel(), BLOCK=block, num_warps=4)
    return alpha


def emulated_scaled_mm(
    a_bd: torch.Tensor, amax_a: torch.Tensor, b_bd: torch.Tensor, amax_b: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """C = A @ B^T for block-decoded operands A [M, K], B [N, K] (bf16, from fake_quantize_* or block_decode).

    fp32 accumulation, then ``cast(acc * alpha)`` with ``alpha = formats.gemm_alpha(amax_a, amax_b)``: the
    arithmetic of ``ops.scaled_mm_reference``, up to the GEMM's summation order. On CUDA with
    ``codegen.cublaslt_gemm`` enabled, one cuBLASLt GEMM reads alpha in its epilogue and writes the
    bfloat16 output; otherwise ``torch.mm`` writes fp32 and ``_epilogue_kernel`` applies alpha.
    """
    _require_triton()
    if a_bd.dim() != 2 or b_bd.dim() != 2 or a_bd.shape[1] != b_bd.shape[1]:
        raise ValueError(f"emulated_scaled_mm needs A [M, K] and B [N, K], got {tuple(a_bd.shape)} and {tuple(b_bd.shape)}")
    alpha = gemm_alpha(amax_a.to(a_bd.device), amax_b)
    if a_bd.is_cuda:
        from . import cublaslt_gemm

        if cublaslt_gemm.enabled():
            if planning_active():  # a plan of the launches: cuBLASLt's GEMM has no Triton kernel
                return torch.empty((a_bd.shape[0], b_bd.shape[0]), dtype=out_dtype, device=a_bd.device)
            try:
                if out_dtype not in (torch.bfloat16, torch.float32) or not a_bd.dtype == b_bd.dtype == torch.bfloat16:
                    raise cublaslt_gemm.Unsupported(
                        f"the cuBLASLt path takes bfloat16 operands and a bfloat16 or float32 output, got "
                        f"{a_bd.dtype} x {b_bd.dtype} -> {out_dtype}"
                    )
                return cublaslt_gemm.mm_alpha(a_bd, b_bd, alpha, out_dtype)
            except cublaslt_gemm.Unsupported as err:
                if cublaslt_gemm.required():
                    raise
                cublaslt_gemm.log_fallback(err)
        acc = torch.mm(a_bd, b_bd.t(), out_dtype=torch.float32)
    else:
        acc = a_bd.float() @ b_bd.float().t()
    out = torch.empty(acc.shape, dtype=out_dtype, device=acc.device)
    cfg = CONFIGS["epilogue"]
    n = acc.numel()
    if n == 0:  # no tokens (or no outputs): nothing to launch
        return out
    _launch(_epilogue_kernel, (triton.cdiv(n, cfg["BLOCK"]),), acc, alpha, out, n, BLOCK=cfg["BLOCK"],
            **_launch_options(cfg))
    return out


def quantize_provider(x: torch.Tensor, fmt: str, block: str):
    """A quantize provider for ``runtime.register_quantize_provider``: these kernels for NVFP4 and MXFP4 on CUDA.

    Returns a callable (x, rounding, seed) -> (data, scales, amax), or None where it cannot take the call.
    """
    if (fmt, block) not in (("nvfp4", "1x16"), ("nvfp4", "16x16"), ("mxfp4", "1x32")):
        return None
    if not x.is_cuda or x.dtype not in _INPUT_DTYPES or not available()[0] or x.dim() < 2 or x.numel() == 0:
        return None
    if x.shape[-1] % (32 if fmt == "mxfp4" else 16) or (block == "16x16" and x.shape[-2] % 16):
        return None
    if fmt == "mxfp4":
        return quantize_mxfp4
    return quantize_1x16 if block == "1x16" else quantize_16x16


def fake_quantize_provider(x: torch.Tensor, fmt: str, block: str):
    """A provider for ``runtime.register_fake_quantize_provider``: ``fake_quantize_1x16`` / ``_16x16`` for
    NVFP4 on CUDA. Returns a callable (x, rounding, seed) -> (block-decoded bf16, amax), or None."""
    if fmt != "nvfp4" or block not in ("1x16", "16x16"):
        return None
    if quantize_provider(x, fmt, block) is None:
        return None
    return fake_quantize_1x16 if block == "1x16" else fake_quantize_16x16


def fake_rht_quantize_provider(x: torch.Tensor, size: int, fmt: str, block: str):
    """A provider for ``runtime.register_fake_rht_quantize_provider``: ``fake_quantize_wgrad_operand`` of
    the ``[K, tokens]`` operand of an NVFP4 wgrad on CUDA, or None where it cannot take the call."""
    if fmt != "nvfp4" or rht_quantize_provider(x, size, fmt, block) is None:
        return None
    return lambda x, rounding, seed, **given: fake_quantize_wgrad_operand(x.t(), rounding, seed, **given)


def fake_dual_quantize_provider(x: torch.Tensor, size: int, fmt: str):
    """A provider for ``runtime.register_fake_dual_quantize_provider``: ``fake_quantize_dual`` for a 2-D
    NVFP4 CUDA tensor [tokens, K] (both multiples of 16), or None where it cannot take the call."""
    if fmt != "nvfp4" or size != 16 or fake_quantize_provider(x, fmt, "1x16") is None:
        return None
    if x.dim() != 2 or x.shape[0] % 16:
        return None
    return fake_quantize_dual


def rht_quantize_provider(x: torch.Tensor, size: int, fmt: str, block: str):
    """A provider for ``runtime.register_rht_quantize_provider``: the fused transpose + 16-point RHT +
    quantize kernels for a 2-D CUDA operand [K, tokens] (the transposed view the wgrad GEMM reads),
    ``quantize_wgrad_operand`` for NVFP4 1x16 and ``quantize_wgrad_operand_mxfp4`` for MXFP4 1x32.

    Returns a callable (x, rounding, seed) -> (data, scales, amax), or None where it cannot take the call.
    """
    if (fmt, block) not in (("nvfp4", "1x16"), ("mxfp4", "1x32")) or size != 16:
        return None
    if not x.is_cuda or x.dtype not in _INPUT_DTYPES or not available()[0] or x.dim() != 2 or x.numel() == 0:
        return None
    if x.shape[-1] % (32 if fmt == "mxfp4" else 16):
        return None
    if fmt == "mxfp4":
        return lambda x, rounding, seed: quantize_wgrad_operand_mxfp4(x.t(), rounding, seed)
    return lambda x, rounding, seed, **given: quantize_wgrad_operand(x.t(), rounding, seed, **given)
