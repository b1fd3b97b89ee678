"""Device functions shared by the kernels: E2M1 and E4M3 rounding and encoding, stochastic rounding's
counter-based bits, the SR seed stream, block scales, and the tile order of a launch.

Also how kernels are made here: ``_jit`` compiles them for the GPU, or hands them to Triton's
interpreter where there is none (``_interpreting``).
"""

from __future__ import annotations

import os
import struct

import torch

from fp4compile import formats


try:
    import triton
    import triton.language as tl
except ImportError as exc:  # the package works without triton; available() says why these kernels don't
    triton = None
    tl = None
    _IMPORT_ERROR = str(exc)
else:
    _IMPORT_ERROR = ""


def _f32(value: float) -> float:
    """``value`` rounded to float32 (round to nearest even), as a Python float."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def _interpreting() -> bool:
    return triton is not None and (os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available())


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
    _INV_GLOBAL_46 = tl.constexpr(_f32(1.0 / formats.FOUR_OVER_SIX_GLOBAL))
    _TWO_M126 = tl.constexpr(2.0**-126)
    _NEG_MAGIC_M126 = tl.constexpr(-6291456.0 * 2.0**-126)  # -(3 * 2**21) * 2**-126, exact in fp32
    # Bit i set where the RHT sign vector has -1 at i.
    # Compiled for a GPU (not interpreted): products that feed an addition are written as explicit
    # round-to-nearest multiplies where an FMA would change the bits.
    _CONTRACTION_SAFE = tl.constexpr(not _interpreting())
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
    def _encode_scale_rule(amax, FOUR_SIX: tl.constexpr):
        """``_encode_scale`` of a block scale rule: with FOUR_SIX ("4/6") amax maps to 1536 = 6 * 256."""
        if FOUR_SIX:
            s_enc = tl.math.div_rn(1536.0, amax)  # = formats.FOUR_OVER_SIX_GLOBAL
            s_enc = tl.where(s_enc > _FLT_MAX, _FLT_MAX, s_enc)
            s_enc = tl.where((amax == 0.0) | (s_enc == 0.0), 1.0, s_enc)
            return s_enc, tl.math.div_rn(1.0, s_enc)
        else:
            return _encode_scale(amax)

    @_jit()
    def _mul_rn(a, b):
        """a * b rounded to nearest even (same shapes), never contracted with an addition into an FMA when
        compiled for the GPU (``_CONTRACTION_SAFE``); the interpreter never contracts."""
        if _CONTRACTION_SAFE:
            return tl.inline_asm_elementwise(
                "mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1
            )
        else:
            return a * b

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
        k0 = tl.cast(seed_lo, tl.uint32, bitcast=True)
        k1 = tl.cast(seed_hi, tl.uint32, bitcast=True)
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
        lo = tl.cast(seed_lo, tl.uint32, bitcast=True)  # an int where the kernel is traced with constant ints
        hi = tl.cast(seed_hi, tl.uint32, bitcast=True)
        if MIX:
            node = (hi.to(tl.uint64) << 32) | lo.to(tl.uint64)
            stream = _mix64(tl.load(seed_ptr).to(tl.uint64, bitcast=True) ^ node)
            lo = (stream & 0xFFFFFFFF).to(tl.uint32)
            hi = ((stream >> 32) & 0x7FFFFFFF).to(tl.uint32)
        return lo, hi

    @_jit()
    def _scale_offset(r, c, n_cols, SWIZZLE: tl.constexpr):
        """Offset of scale (row r, column c) of a [rows, n_cols] scale matrix: row-major, or with SWIZZLE
        in the 128x4 tiled layout (formats.swizzled_offset)."""
        if SWIZZLE:
            offset = ((((r // 128) * ((n_cols + 3) // 4) + c // 4) * 32 + r % 32) * 16).to(tl.int64)
            offset += ((r % 128) // 32) * 4 + c % 4
        else:
            offset = r.to(tl.int64) * n_cols + c
        return offset

    @_jit()
    def _store_scales(scales_ptr, sf, r, c, n_cols, mask, SWIZZLE: tl.constexpr):
        """Store scale codes sf at (row r, column c) (broadcastable with sf) of a [rows, n_cols] scale
        matrix in its layout (``_scale_offset``)."""
        tl.store(scales_ptr + _scale_offset(r, c, n_cols, SWIZZLE), sf, mask=mask)

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
