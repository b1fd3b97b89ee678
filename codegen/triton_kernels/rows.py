"""Kernels along rows: the global amax, and NVFP4 quantization in 1x16 blocks or 16x16 tiles (codes and
scales, or the block-decoded values)."""

from __future__ import annotations

from .numerics import tl, triton


if triton is not None:
    from .numerics import (
        _FLT_MAX, _INV_GLOBAL_46, _ONE_SIXTH, _abs_bits, _block_scale, _e2m1, _e2m1_rne, _e2m1_rne_code_bits, _e4m3,
        _encode_scale, _encode_scale_rule, _fixup_amax, _jit, _max_nan, _mul_rn, _sr_draws, _sr_key, _sr_row_bits, _sr_word,
        _store_scales, _stream_key, _tile_ids,
    )

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
    # Four Over Six: each block's scale, to 6 or to 4 (formats.nvfp4_encode, scale_rule="4/6")
    # ------------------------------------------------------------------------------------------

    @_jit()
    def _pair_sum16(v):
        """Sum over the last dim (16) of a 4-D tensor, adjacent pairs level by level: the order of
        ``formats._pair_tree_sum``, one fp32 rounding per addition (no products: nothing to contract)."""
        a, b = tl.split(tl.reshape(v, (v.shape[0], v.shape[1], v.shape[2], 8, 2)))
        v = a + b
        a, b = tl.split(tl.reshape(v, (v.shape[0], v.shape[1], v.shape[2], 4, 2)))
        v = a + b
        a, b = tl.split(tl.reshape(v, (v.shape[0], v.shape[1], v.shape[2], 2, 2)))
        v = a + b
        a, b = tl.split(v)
        return a + b

    @_jit()
    def _four_six_error(x4, enc, sf, amax, TILE_ROWS: tl.constexpr):
        """Squared error per block, [A, NB], of the [A, TILE_ROWS, NB, 16] values x4 quantized with the
        encode factor ``enc`` (round to nearest even) and dequantized with the scale ``sf`` ([A, NB] each):
        x^ = value * ((sf * amax) * fp32(1/1536)); summed over each row's 16 elements, then over a tile's
        rows, as ``formats.four_over_six_errors``."""
        _, value = _e2m1_rne(x4 * enc[:, None, :, None])
        dscale = (sf * amax) * _INV_GLOBAL_46
        d = _mul_rn(value, tl.broadcast_to(dscale[:, None, :, None], value.shape)) - x4
        err = _pair_sum16(_mul_rn(d, d))  # [A, TILE_ROWS, NB]
        if TILE_ROWS > 1:
            rows = tl.permute(err, (0, 2, 1))  # [A, NB, 16]
            err = tl.reshape(_pair_sum16(tl.reshape(rows, (rows.shape[0], rows.shape[1], 1, TILE_ROWS))),
                             (rows.shape[0], rows.shape[1]))
        else:
            err = tl.reshape(err, (err.shape[0], err.shape[2]))
        return err

    @_jit()
    def _four_six_scale(x4, bamax, amax, s_enc, s_dec, sf_code, sf, enc, TILE_ROWS: tl.constexpr):
        """(scale code, scale value, encode factor) per block: the candidate scaled to 6 (given: sf_code,
        sf, enc from ``_block_scale``) or the one scaled to 4 (the unrounded scale times 1.5, rounded to
        E4M3), whichever has the strictly smaller squared error (``_four_six_error``); ties and NaN keep 6."""
        sf32 = bamax * (s_enc * _ONE_SIXTH)
        sf32 = tl.where(sf32 > 448.0, 448.0, sf32)
        sf32 = sf32 * 1.5
        code4, sf4 = _e4m3(tl.where(sf32 > 448.0, 448.0, sf32))
        enc4 = tl.math.div_rn(1.0, sf4 * s_dec)
        enc4 = tl.where(enc4 > _FLT_MAX, _FLT_MAX, enc4)
        use4 = _four_six_error(x4, enc4, sf4, amax, TILE_ROWS) < _four_six_error(x4, enc, sf, amax, TILE_ROWS)
        return tl.where(use4, code4, sf_code), tl.where(use4, sf4, sf), tl.where(use4, enc4, enc)

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
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, E4M3: tl.constexpr, FOUR_SIX: tl.constexpr = False,
    ):
        """Quantize a [BLOCK_M, BLOCK_K] tile; returns the bits of its abs max. FOUR_SIX: the block scale
        rule "4/6" (``_four_six_scale``), with 1x16 blocks too (as 16x16 tiles of one row)."""
        if TILE_ROWS == 1 and not FOUR_SIX:
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
        s_enc, s_dec = _encode_scale_rule(amax, FOUR_SIX)
        sf_code, sf, enc = _block_scale(bamax, s_enc, s_dec, E4M3)
        if FOUR_SIX:
            sf_code, sf, enc = _four_six_scale(x4, bamax, amax, s_enc, s_dec, sf_code, sf, enc, TILE_ROWS)
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
        ITERS: tl.constexpr = 1, E4M3: tl.constexpr = False, FOUR_SIX: tl.constexpr = False,
    ):
        """Quantizes ITERS consecutive tiles along K. With 1x16 blocks and ITERS > 1, the next tile's loads
        are issued before the tile loaded is quantized, so they are in flight during its arithmetic.
        FOUR_SIX: the block scale rule "4/6" (every tile through ``_quantize_rows_tile``)."""
        pid_m, k_group = _tile_ids(K_FIRST)
        seed_lo, seed_hi = _stream_key(seed_ptr, seed_lo, seed_hi, MIX)
        # PASS 0: amax_ptr holds the own amax. 1: a given amax; track the own one. 2: fix-up.
        if PASS == 2:
            own, nonfinite = _fixup_amax(amax_ptr, own_ptr, out_amax_ptr, (pid_m == 0) & (k_group == 0))
            if nonfinite:
                for i in range(ITERS):
                    _quantize_rows_tile(
                        x_ptr, data_ptr, scales_ptr, bd_ptr, own, M, K, stride_xm, seed_lo, seed_hi, pid_m,
                        k_group * ITERS + i, TILE_ROWS, SR, SWIZZLE, FAKE, BLOCK_M, BLOCK_K, E4M3, FOUR_SIX,
                    )
        else:
            amax = tl.load(amax_ptr)
            bits = tl.zeros((), tl.int32)
            if TILE_ROWS == 1 and ITERS > 1 and not FOUR_SIX:
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
                        k_group * ITERS + i, TILE_ROWS, SR, SWIZZLE, FAKE, BLOCK_M, BLOCK_K, E4M3, FOUR_SIX,
                    ))
            if PASS == 1:
                tl.atomic_max(own_ptr, bits)
