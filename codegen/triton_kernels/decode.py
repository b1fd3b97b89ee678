"""Kernels that decode quantized tensors, transpose 16x16-tile quantized weights, and apply the emulated
GEMM's alpha."""

from __future__ import annotations

from .numerics import tl, triton


if triton is not None:
    from .numerics import _INV_GLOBAL, _INV_GLOBAL_46, _e2m1_value, _e4m3_value, _jit, _round_to, _scale_offset, _store_scales

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
        sf = _e4m3_value(tl.load(scales_ptr + _scale_offset(r, c, K // 16, SWIZZLE), mask=row_ok[:, None] & (c < K // 16),
                                 other=0))
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
                                BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                                IN_SWIZZLE: tl.constexpr = False, SWIZZLE: tl.constexpr = False):
        """Codes [K, N/2] and scales [K, N/16] of W^T from those of a 16x16-tile quantized W [N, K]: each
        [BLOCK_M, BLOCK_K] tile of codes unpacked, transposed and packed again; the tile scales (the
        first row of each 16-row tile) transposed and repeated on the 16 rows of the output tile. W's
        scales are read from (IN_SWIZZLE), W^T's written to (SWIZZLE), the 128x4 tiled layout."""
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
        sf = tl.load(scales_ptr + _scale_offset((tiles * 16)[None, :], (cols // 16)[:, None], K // 16, IN_SWIZZLE),
                     mask=tile_ok, other=0)
        _store_scales(out_scales_ptr, sf, cols[:, None], tiles[None, :], N // 16, tile_ok, SWIZZLE)

    @_jit()
    def _gemm_alpha(amax_a_ptr, amax_b_ptr, FOUR_SIX: tl.constexpr):
        """(amax_a * fp32(1/2688)) * (amax_b * fp32(1/2688)): ``formats.gemm_alpha`` (two products, no
        sum: nothing to contract); fp32(1/1536) with FOUR_SIX (the block scale rule "4/6")."""
        if FOUR_SIX:
            return (tl.load(amax_a_ptr) * _INV_GLOBAL_46) * (tl.load(amax_b_ptr) * _INV_GLOBAL_46)
        else:
            return (tl.load(amax_a_ptr) * _INV_GLOBAL) * (tl.load(amax_b_ptr) * _INV_GLOBAL)

    @_jit()
    def _alpha_kernel(amax_a_ptr, amax_b_ptr, alpha_ptr, N, BLOCK: tl.constexpr, FOUR_SIX: tl.constexpr = False):
        """alpha_ptr[0:N] = ``_gemm_alpha``."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        alpha = _gemm_alpha(amax_a_ptr, amax_b_ptr, FOUR_SIX)
        tl.store(alpha_ptr + offs, tl.full((BLOCK,), 0.0, tl.float32) + alpha, mask=offs < N)

    @_jit()
    def _epilogue_kernel(acc_ptr, amax_a_ptr, amax_b_ptr, out_ptr, N, BLOCK: tl.constexpr, FOUR_SIX: tl.constexpr = False):
        """out = acc * alpha, cast to out's dtype; alpha (``_gemm_alpha``) computed here, so the GEMM
        needs no launch of its own for it."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        alpha = _gemm_alpha(amax_a_ptr, amax_b_ptr, FOUR_SIX)
        acc = tl.load(acc_ptr + offs, mask=mask, other=0.0)
        out = _round_to(acc * alpha, out_ptr.dtype.element_ty)
        tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)
