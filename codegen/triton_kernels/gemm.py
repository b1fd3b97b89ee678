"""The FP4-operand GEMM: C = alpha * (A @ B^T) read from packed NVFP4 operands.

Each program computes a [BLOCK_M, BLOCK_N] tile of C. Along K it loads the packed E2M1 codes (two per
byte) and the E4M3 block scales of an A tile and a B tile, decodes them in registers to value(code) *
block scale (exact in bfloat16: at most 6 significant bits), and accumulates their product in fp32 with
the tensor cores (``tl.dot``); the epilogue multiplies by alpha (``_gemm_alpha``, from the two global
amaxes, computed in the kernel) and casts to C's dtype with ``_round_to``. That is the arithmetic of the
decoded emulation (``decode_blocks`` twice, a BF16 GEMM with fp32 output, alpha and the cast), in one
launch and without the decoded copies: the products are the same, only the GEMM's summation order is the
kernel's own.

B may arrive as stored for dgrad (``B_KN``): W [K, N] of a 16x16-tile quantized weight read as B^T, so
the packed transpose does not run (a 16x16 tile's scale is the same for W and W^T).
"""

from __future__ import annotations

from .numerics import tl, triton


if triton is not None:
    from .decode import _gemm_alpha
    from .numerics import _e2m1_value, _e4m3_value, _interpreting, _jit, _round_to, _scale_offset

    _COMPILED = tl.constexpr(not _interpreting())

    @_jit()
    def _decoded_tile(packed, sf, ROWS: tl.constexpr, COLS: tl.constexpr):
        """bf16 [ROWS, COLS] (exact) of codes packed along the columns ([ROWS, COLS/2] bytes, the low nibble first)
        times their scales ([ROWS, COLS/16], one per 16 columns)."""
        codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (ROWS, COLS // 16, 16))
        values = _e2m1_value(codes) * _e4m3_value(sf)[:, :, None]
        values = tl.reshape(values, (ROWS, COLS))
        if _COMPILED:
            return values.to(tl.bfloat16)
        else:  # Triton's interpreter multiplies bf16 tiles wrongly; the fp32 values are the same numbers
            return values

    @_jit()
    def _k_step(acc, k0, a_ptr, a_scales_ptr, b_ptr, b_scales_ptr, rm, rn, m_ok, n_ok, pid_n, N, K,
                A_SWIZZLE: tl.constexpr, B_SWIZZLE: tl.constexpr, B_KN: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """acc + the product of the A and B tiles at K offset k0, decoded."""
        pk = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        sk = k0 // 16 + tl.arange(0, BLOCK_K // 16)
        a_packed = tl.load(a_ptr + rm.to(tl.int64)[:, None] * (K // 2) + pk[None, :],
                           mask=m_ok[:, None] & (pk < K // 2)[None, :], other=0)
        a_sf = tl.load(a_scales_ptr + _scale_offset(rm[:, None], sk[None, :], K // 16, A_SWIZZLE),
                       mask=m_ok[:, None] & (sk < K // 16)[None, :], other=0)
        a = _decoded_tile(a_packed, a_sf, BLOCK_M, BLOCK_K)
        if B_KN:
            rk = k0 + tl.arange(0, BLOCK_K)
            pn = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            sn = pid_n * (BLOCK_N // 16) + tl.arange(0, BLOCK_N // 16)
            k_ok = rk < K
            b_packed = tl.load(b_ptr + rk.to(tl.int64)[:, None] * (N // 2) + pn[None, :],
                               mask=k_ok[:, None] & (pn < N // 2)[None, :], other=0)
            b_sf = tl.load(b_scales_ptr + _scale_offset(rk[:, None], sn[None, :], N // 16, B_SWIZZLE),
                           mask=k_ok[:, None] & (sn < N // 16)[None, :], other=0)
            bt = _decoded_tile(b_packed, b_sf, BLOCK_K, BLOCK_N)
        else:
            b_packed = tl.load(b_ptr + rn.to(tl.int64)[:, None] * (K // 2) + pk[None, :],
                               mask=n_ok[:, None] & (pk < K // 2)[None, :], other=0)
            b_sf = tl.load(b_scales_ptr + _scale_offset(rn[:, None], sk[None, :], K // 16, B_SWIZZLE),
                           mask=n_ok[:, None] & (sk < K // 16)[None, :], other=0)
            bt = tl.trans(_decoded_tile(b_packed, b_sf, BLOCK_N, BLOCK_K))
        if _COMPILED:
            return tl.dot(a, bt, acc, out_dtype=tl.float32)
        else:
            return tl.dot(a, bt, acc, input_precision="ieee", out_dtype=tl.float32)

    @_jit()
    def _packed_mm_kernel(
        a_ptr, a_scales_ptr, a_amax_ptr, b_ptr, b_scales_ptr, b_amax_ptr, c_ptr, M, N, K,
        A_SWIZZLE: tl.constexpr, B_SWIZZLE: tl.constexpr, B_KN: tl.constexpr, FOUR_SIX: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        """C [M, N] = cast(alpha * sum_k A[m, k] B[n, k]); A codes [M, K/2], scales [M, K/16]; B codes
        [N, K/2], scales [N, K/16], or with B_KN the codes [K, N/2] and scales [K, N/16] of B^T."""
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        in_group = GROUP_M * tiles_n
        first_m = (pid // in_group) * GROUP_M
        group_m = min(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % in_group) % group_m
        pid_n = (pid % in_group) // group_m
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if _COMPILED:
            for k0 in range(0, K, BLOCK_K):
                acc = _k_step(acc, k0, a_ptr, a_scales_ptr, b_ptr, b_scales_ptr, rm, rn, m_ok, n_ok, pid_n, N, K,
                              A_SWIZZLE, B_SWIZZLE, B_KN, BLOCK_M, BLOCK_N, BLOCK_K)
        else:  # Triton's interpreter takes no loop over a runtime bound: the same steps as a while loop
            k0 = 0
            while k0 < K:
                acc = _k_step(acc, k0, a_ptr, a_scales_ptr, b_ptr, b_scales_ptr, rm, rn, m_ok, n_ok, pid_n, N, K,
                              A_SWIZZLE, B_SWIZZLE, B_KN, BLOCK_M, BLOCK_N, BLOCK_K)
                k0 += BLOCK_K
        alpha = _gemm_alpha(a_amax_ptr, b_amax_ptr, FOUR_SIX)
        out = _round_to(acc * alpha, c_ptr.dtype.element_ty)
        tl.store(c_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], out.to(c_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])
