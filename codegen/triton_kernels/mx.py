"""MXFP4 kernels: 1x32 blocks with E8M0 (power-of-two) scales and no global scale, along rows and for
the weight-gradient operand RHT(x^T)."""

from __future__ import annotations

from .numerics import tl, triton


if triton is not None:
    from .numerics import _abs_bits, _e2m1, _jit, _sr_row_bits, _stream_key
    from .rht import _amax16, _rht_indices, _rht_store_codes, _rht_tile

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
        chunks, cols = _rht_indices(pid_m, pid_k, BLOCK_M, BLOCK_K)
        y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15 = _rht_tile(
            x_ptr, M, K, stride_xm, chunks, cols
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
