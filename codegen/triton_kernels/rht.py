"""Kernels of the weight-gradient operand: quantize(RHT(x^T)) with 16-token RHT chunks as 16-token blocks,
the amax of x and of RHT(x^T) in one read, and both decoded operands of a gradient in one launch."""

from __future__ import annotations

from .numerics import tl, triton


if triton is not None:
    from .numerics import (
        _CONTRACTION_SAFE, _RHT_NEG, _abs_bits, _block_scale, _e2m1, _encode_scale, _fixup_amax, _jit, _max_nan, _round_to, _sr_draws,
        _sr_key, _sr_word, _store_scales, _stream_key, _tile_ids,
    )
    from .rows import _quantize_blocks_tile

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
        """z_i = x_i * (s_i / 4) for fp32 x_i: the sign vector and the 1/4 (a power of two: exact unless
        the product is subnormal).

        Compiled for the GPU, the product is a ``mul.rn`` that no compiler may contract with the
        butterfly's first addition into an FMA (which would skip its rounding where it is not exact), so
        the bits do not depend on the compiler's contraction setting (Inductor compiles the kernels
        with contraction on). The interpreter never contracts."""
        if _CONTRACTION_SAFE:
            if (_RHT_NEG >> i) & 1:
                return tl.inline_asm_elementwise(
                    "mul.rn.f32 $0, $1, 0fBE800000;", "=r,r", [xi], dtype=tl.float32, is_pure=True, pack=1
                )
            else:
                return tl.inline_asm_elementwise(
                    "mul.rn.f32 $0, $1, 0f3E800000;", "=r,r", [xi], dtype=tl.float32, is_pure=True, pack=1
                )
        else:
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
    def _rht_indices(pid_m, pid_k, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        """(chunk indices, column indices) of the [BLOCK_M tokens, BLOCK_K] tile at (pid_m, pid_k).

        Computed apart from the loads: a pointer an output is stored through must not come out of a call
        that also takes the input's pointer, or Inductor's analysis of the kernel counts the input as
        written (and copies it before every launch)."""
        return pid_m * (BLOCK_M // 16) + tl.arange(0, BLOCK_M // 16), pid_k * BLOCK_K + tl.arange(0, BLOCK_K)

    @_jit()
    def _rht_loads(x_ptr, M, K, stride_xm, chunks, cols, F32: tl.constexpr):
        """The 16 tokens of every 16-token chunk of a tile (``_rht_indices``), as fp32 (F32) or in x's
        dtype: x_0 .. x_15, [BLOCK_M/16, BLOCK_K]."""
        return (
            _rht_load(x_ptr, M, K, stride_xm, chunks, cols, 0, F32), _rht_load(x_ptr, M, K, stride_xm, chunks, cols, 1, F32),
            _rht_load(x_ptr, M, K, stride_xm, chunks, cols, 2, F32), _rht_load(x_ptr, M, K, stride_xm, chunks, cols, 3, F32),
            _rht_load(x_ptr, M, K, stride_xm, chunks, cols, 4, F32), _rht_load(x_ptr, M, K, stride_xm, chunks, cols, 5, F32),
            _rht_load(x_ptr, M, K, stride_xm, chunks, cols, 6, F32), _rht_load(x_ptr, M, K, stride_xm, chunks, cols, 7, F32),
            _rht_load(x_ptr, M, K, stride_xm, chunks, cols, 8, F32), _rht_load(x_ptr, M, K, stride_xm, chunks, cols, 9, F32),
            _rht_load(x_ptr, M, K, stride_xm, chunks, cols, 10, F32), _rht_load(x_ptr, M, K, stride_xm, chunks, cols, 11, F32),
            _rht_load(x_ptr, M, K, stride_xm, chunks, cols, 12, F32), _rht_load(x_ptr, M, K, stride_xm, chunks, cols, 13, F32),
            _rht_load(x_ptr, M, K, stride_xm, chunks, cols, 14, F32), _rht_load(x_ptr, M, K, stride_xm, chunks, cols, 15, F32),
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
    def _rht_tile(x_ptr, M, K, stride_xm, chunks, cols):
        """RHT along tokens of a tile (``_rht_indices``): y_0 .. y_15, where
        y_j[c, k] = RHT(x^T)[k, 16 c + j], [BLOCK_M/16, BLOCK_K] fp32 holding values rounded to x's dtype,
        as ``formats.rht`` returns it.
        """
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _rht_loads(
            x_ptr, M, K, stride_xm, chunks, cols, True
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
        x_ptr, acc_ptr, amax_x_ptr, amax_y_ptr, M, K, stride_xm,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ITERS: tl.constexpr, K_FIRST: tl.constexpr = False,
    ):
        """Atomic max of |x| and |RHT(x^T)| bits; each program takes ITERS tiles along K, loading the next
        tile before it transforms the one loaded (its loads are in flight during the arithmetic), and
        keeps elementwise maxima until the end (one reduction across the program, not one per tile).

        The maxima are float maxima that propagate NaN, whose bits (an NaN's above Inf's) the atomics
        compare as integers. The RHT values are rounded to x's dtype once, at the end: rounding to
        nearest is monotone and symmetric, so the largest rounded |y| is the rounded largest |y| (NaN
        stays NaN).

        acc_ptr: int32 [3], zero-filled: the two maxima and the count of programs done. The last program
        to finish copies the maxima to amax_x_ptr and amax_y_ptr, so that the two results are tensors of
        their own (an op's outputs may not share memory) with one fill for the launch, not one each."""
        pid_m, k_group = _tile_ids(K_FIRST)
        x_acc = tl.zeros((BLOCK_M // 16, BLOCK_K), tl.float32)
        y_acc = tl.zeros((BLOCK_M // 16, BLOCK_K), tl.float32)
        chunks, cols = _rht_indices(pid_m, k_group * ITERS, BLOCK_M, BLOCK_K)
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _rht_loads(
            x_ptr, M, K, stride_xm, chunks, cols, False
        )
        for i in range(ITERS):
            c0, c1, c2, c3, c4, c5, c6, c7 = x0, x1, x2, x3, x4, x5, x6, x7
            c8, c9, c10, c11, c12, c13, c14, c15 = x8, x9, x10, x11, x12, x13, x14, x15
            # The next tile (none after the last: no column is below a bound of 0).
            k_next = tl.where(i + 1 < ITERS, K, 0)
            chunks, cols = _rht_indices(pid_m, k_group * ITERS + i + 1, BLOCK_M, BLOCK_K)
            x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _rht_loads(
                x_ptr, M, k_next, stride_xm, chunks, cols, False
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
        tl.atomic_max(acc_ptr, x_max.to(tl.int32, bitcast=True))
        tl.atomic_max(acc_ptr + 1, _round_to(y_max, x_ptr.dtype.element_ty).to(tl.int32, bitcast=True))
        # The count's atomic (acquire-release) orders this program's maxima before it, so the last program
        # to count sees every program's; its volatile loads read the totals past the L1 cache.
        done = tl.atomic_add(acc_ptr + 2, 1)
        if done == tl.num_programs(0) * tl.num_programs(1) - 1:
            tl.store(amax_x_ptr, tl.load(acc_ptr, volatile=True))
            tl.store(amax_y_ptr, tl.load(acc_ptr + 1, volatile=True))

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
        chunks, cols = _rht_indices(pid_m, pid_k, BLOCK_M, BLOCK_K)
        y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15 = _rht_tile(
            x_ptr, M, K, stride_xm, chunks, cols
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
        x_ptr, amax_ptr, amax_t_ptr, data_ptr, scales_ptr, bd_ptr, data_t_ptr, scales_t_ptr, bd_t_ptr, M, K,
        stride_xm, seed_ptr, seed_lo, seed_hi, seed_t_ptr, seed_t_lo, seed_t_hi,
        SR: tl.constexpr, MIX: tl.constexpr, SR_T: tl.constexpr, MIX_T: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, K_FIRST: tl.constexpr = False, E4M3: tl.constexpr = False,
        FAKE: tl.constexpr = True,
    ):
        """Both NVFP4 quantizations of a [M tokens, K] tensor, with their own amaxes given
        (``fp4.wgrad_amax``): 1x16 blocks along K (codes data_ptr [M, K/2], scales scales_ptr [M, K/16], or
        with FAKE block-decoded into bd_ptr [M, K]), and RHT(x^T) with 16-token blocks (data_t_ptr [K, M/2],
        scales_t_ptr [K, M/16], or bd_t_ptr [K, M]). Each program quantizes its tile both ways, so the
        second read of the tile comes mostly from L2."""
        pid_m, pid_k = _tile_ids(K_FIRST)
        seed_t_lo, seed_t_hi = _stream_key(seed_t_ptr, seed_t_lo, seed_t_hi, MIX_T)
        _rht_quantize_tile(
            x_ptr, data_t_ptr, scales_t_ptr, bd_t_ptr, tl.load(amax_t_ptr), M, K, stride_xm, seed_t_lo, seed_t_hi,
            pid_m, pid_k, SR_T, False, FAKE, BLOCK_M, BLOCK_K, E4M3,
        )
        seed_lo, seed_hi = _stream_key(seed_ptr, seed_lo, seed_hi, MIX)
        _quantize_blocks_tile(
            x_ptr, data_ptr, scales_ptr, bd_ptr, tl.load(amax_ptr), M, K, stride_xm, seed_lo, seed_hi, pid_m, pid_k,
            SR, False, FAKE, BLOCK_M, BLOCK_K, E4M3,
        )
