"""The reference implementations of the fp4 ops, on the plain-dtype tensors the ops pass around.

Tensors cross op boundaries as packed E2M1 codes and E4M3/E8M0 scales in ``uint8``; these functions
rebuild ``formats.QTensor`` and apply the numerics of ``fp4compile.formats`` (docs/numerics.md). They run on
every device and are the last entry of each op in the executor table (``fp4compile.executors``): every
faster implementation is held to their bits. The module imports only ``formats``, ``runtime`` and ``scale_layout``, so
``fp4compile.codegen`` (the CUTLASS self-test, the emulated GEMM) can use it without importing the ops.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import formats, runtime, scale_layout


def qtensor(data, scales, amax, fmt: str, block: str, shape, dtype=torch.float32, scale_rule: str = "6") -> formats.QTensor:
    """The ``formats.QTensor`` of packed codes and scale bytes (any byte dtype)."""
    scale_dtype = torch.float8_e4m3fn if fmt == "nvfp4" else torch.float8_e8m0fnu
    return formats.QTensor(
        data.view(torch.float4_e2m1fn_x2),
        scales.view(scale_dtype),
        amax if fmt == "nvfp4" else None,
        fmt,
        block,
        torch.Size(shape),
        dtype,
        scale_rule,
    )


def host_stream(x: torch.Tensor, rounding: str, node: int, what: str) -> int:
    """The SR seed of a quantize node's constant ``node`` as a host integer (``runtime.sr_seed``)."""
    if rounding != "sr":
        return 0
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"fp4compile: {what} of a {tuple(x.shape)} {x.dtype} tensor with stochastic rounding while a CUDA "
            "graph is recorded (mode='reduce-overhead'): no GPU kernel takes this call, and the reference "
            "implementation's seed would be frozen into the graph, repeating the same random bits on every "
            "replay. Compile without CUDA graphs, or make the Triton kernels available (triton installed)."
        )
    return runtime.sr_seed(node)


def quantize(x: torch.Tensor, fmt: str, block: str, rounding: str, seed: int,
             amax: Optional[torch.Tensor] = None, seed_base=None, layout: str = scale_layout.ROW_MAJOR,
             scale_rule: str = "6", what: str = "fp4.quantize") -> tuple:
    """(packed codes uint8, scale bytes uint8 in ``layout``, amax) of ``formats.quantize`` with the node's
    SR stream; ``amax``: x's own amax computed by an earlier node. ``seed_base`` is unused (the host
    reads the base). ``scale_rule``: NVFP4's block scale rule ("6" or "4/6", ``formats.quantize``)."""
    q = formats.quantize(x, fmt, block, rounding, seed=host_stream(x, rounding, seed, what), amax=amax,
                         scale_rule=scale_rule)
    amax = q.amax if q.amax is not None else x.float().abs().amax()
    return q.data.view(torch.uint8), scale_layout.arrange(q.scales.view(torch.uint8), layout), amax


def wgrad_amax(x: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(max |x|, max |formats.rht(x.T, size)|) as fp32 0-dim tensors."""
    return x.float().abs().amax(), formats.rht(x.t(), size).float().abs().amax()


def transpose_quantized(data: torch.Tensor, scales: torch.Tensor,
                        layout: str = scale_layout.ROW_MAJOR) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales (in ``layout``) of W^T from those of a 16x16-tile quantized W [N, K], its scales in
    either layout (``QTensor.transpose``)."""
    n, k = data.shape[0], data.shape[1] * 2
    t = qtensor(data, scale_layout.row_major(data, scales), None, "nvfp4", "16x16", (n, k)).transpose()
    return t.data.view(torch.uint8), scale_layout.arrange(t.scales.view(torch.uint8), layout)


def block_decode(data, scales, amax, fmt: str) -> torch.Tensor:
    """value(code) * block scale (fp32) of a packed GEMM operand [..., M, K/2] with 1-D blocks (scales in
    either layout)."""
    block = "1x16" if fmt == "nvfp4" else "1x32"
    scales = scale_layout.row_major(data, scales, 16 if fmt == "nvfp4" else 32)
    return formats.block_decode(qtensor(data, scales, amax, fmt, block, (*data.shape[:-1], data.shape[-1] * 2)))


def decode_blocks(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``block_decode`` of NVFP4 codes and E4M3 scales in bfloat16 (exact)."""
    return block_decode(data, scales, None, "nvfp4").to(torch.bfloat16)


def packed_product(a, a_scales, a_amax, b, b_scales, b_amax, fmt: str, out_dtype: torch.dtype,
                   scale_rule: str = "6", b_kn: bool = False) -> torch.Tensor:
    """``fp4.packed_mm``: ``scaled_mm_reference``, B given as its rows [N, K/2] or, with ``b_kn``, as the
    16x16-tile quantized W [K, N/2] whose transpose it is."""
    if b_kn:
        b, b_scales = transpose_quantized(b, b_scales)
    return scaled_mm_reference(a, a_scales, a_amax, b, b_scales, b_amax, fmt, out_dtype, scale_rule)


def alpha_product(a_bd, b_bd, alpha: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """A_bd @ B_bd.T of block-decoded operands in fp32, times ``alpha`` where given, cast."""
    acc = a_bd.float() @ b_bd.float().transpose(-2, -1)
    if alpha is not None:
        acc = acc * alpha
    return acc.to(out_dtype)


def decoded_product(a_bd, a_amax, b_bd, b_amax, fmt: str, out_dtype: torch.dtype, scale_rule: str = "6") -> torch.Tensor:
    """A_bd @ B_bd.T of block-decoded operands in fp32, times alpha (NVFP4, ``formats.gemm_alpha`` of the
    operands' block scale rule), cast."""
    alpha = formats.gemm_alpha(a_amax, b_amax, scale_rule) if fmt == "nvfp4" else None
    return alpha_product(a_bd, b_bd, alpha, out_dtype)


def scaled_mm_reference(a, a_scales, a_amax, b, b_scales, b_amax, fmt: str, out_dtype: torch.dtype,
                        scale_rule: str = "6"):
    """Emulated block-scaled FP4 GEMM: (block-decoded A) @ (block-decoded B).T with fp32 accumulation,
    then alpha = ``formats.gemm_alpha(amax_A, amax_B)`` (NVFP4) applied once, as a Blackwell epilogue does.
    Batched operands [..., M, K/2] and [..., N, K/2] (activation matmuls) multiply per leading index."""
    return decoded_product(
        block_decode(a, a_scales, a_amax, fmt), a_amax, block_decode(b, b_scales, b_amax, fmt), b_amax, fmt, out_dtype,
        scale_rule,
    )
