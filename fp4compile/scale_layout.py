"""Where the E4M3 block scales of a packed NVFP4 operand sit: row-major, or tiled as Blackwell GEMMs read them.

| layout | scales tensor | who reads it |
|---|---|---|
| ``"row_major"`` (default) | ``[..., rows, K/16]``, one byte per block | the emulation, ``fp4.transpose_quantized``, everything else |
| ``"swizzled"`` | 1-D, ``round_up(rows, 128) * round_up(K/16, 4)`` bytes, zero padded | CUTLASS block-scaled GEMMs (``codegen.cutlass_runtime``) |

The swizzled layout is ``formats.swizzle_scales`` of the row-major one (docs/numerics.md, "Scale layout for
Blackwell GEMMs"). The quantize ops write it when asked (``layout="swizzled"``: the Triton kernels store
each scale at its tiled offset, the reference swizzles its row-major result), so a GEMM on Blackwell reads
its operands as they were written. Ops that read scales take either layout, telling them apart by
dimension: a 2-D operand's scales are 2-D when row-major and 1-D when swizzled.

``fp4.swizzle_scales`` is the separate step, for an operand whose producer cannot write the tiled layout
(the lowering inserts it, logged, only there).
"""

from __future__ import annotations

import torch

from . import formats

ROW_MAJOR = "row_major"
SWIZZLED = "swizzled"
LAYOUTS = (ROW_MAJOR, SWIZZLED)

__all__ = ["ROW_MAJOR", "SWIZZLED", "LAYOUTS", "check", "swizzled_numel", "is_swizzled", "arrange", "row_major",
           "fake_scales", "swizzle_scales"]


def check(layout: str, fmt: str, x: torch.Tensor, what: str) -> None:
    """Raise ValueError naming ``what`` unless ``layout`` is a layout the op can write for ``x`` in ``fmt``."""
    if layout not in LAYOUTS:
        raise ValueError(f"fp4compile: {what} of a {tuple(x.shape)} tensor: layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == SWIZZLED and (fmt != "nvfp4" or x.dim() != 2):
        raise ValueError(
            f"fp4compile: {what} of a {tuple(x.shape)} {fmt} tensor: the swizzled scale layout is for 2-D NVFP4 "
            "operands (what the CUTLASS GEMMs read)"
        )


def swizzled_numel(rows: int, cols: int) -> int:
    """Bytes of the tiled layout of a [rows, cols] scale matrix (rows padded to 128, cols to 4)."""
    return -(-rows // 128) * 128 * (-(-cols // 4) * 4)


def is_swizzled(data: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether ``scales`` of the 2-D packed codes ``data`` are in the tiled layout (1-D), not row-major."""
    return data.dim() == 2 and scales.dim() == 1


def arrange(scales: torch.Tensor, layout: str) -> torch.Tensor:
    """Row-major [rows, cols] scales in ``layout``."""
    return formats.swizzle_scales(scales) if layout == SWIZZLED else scales


def row_major(data: torch.Tensor, scales: torch.Tensor, block_cols: int = 16) -> torch.Tensor:
    """The [rows, K/block_cols] row-major scales of the packed codes ``data`` [rows, K/2], from either layout."""
    if not is_swizzled(data, scales):
        return scales
    rows, cols = data.shape[0], data.shape[1] * 2 // block_cols
    if scales.numel() != swizzled_numel(rows, cols):
        raise ValueError(
            f"fp4compile: 1-D scales of {tuple(data.shape)} packed codes must be the tiled layout of [{rows}, {cols}] "
            f"scales ({swizzled_numel(rows, cols)} bytes), got {scales.numel()}"
        )
    return formats.unswizzle_scales(scales, rows, cols)


def fake_scales(x: torch.Tensor, rows: int, cols: int, layout: str, shape=None) -> torch.Tensor:
    """An empty uint8 scales tensor like ``x``'s for a [rows, cols] scale matrix in ``layout`` (row-major:
    ``shape``, default [rows, cols])."""
    if layout == SWIZZLED:
        return x.new_empty((swizzled_numel(rows, cols),), dtype=torch.uint8)
    return x.new_empty(tuple(shape) if shape is not None else (rows, cols), dtype=torch.uint8)


@torch.library.custom_op("fp4::swizzle_scales", mutates_args=())
def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """``formats.swizzle_scales`` as a graph node: [rows, cols] row-major scales -> the 1-D tiled layout."""
    return formats.swizzle_scales(scales)


@swizzle_scales.register_fake
def _(scales):
    return scales.new_empty((swizzled_numel(scales.shape[0], scales.shape[1]),))
