"""Launching the kernels: their launch parameters (``CONFIGS``), the grid of a tiled launch, input
checks, SR seed arguments, output buffers, and the launch itself."""

from __future__ import annotations

import functools
from typing import Optional, Union

import torch
from torch.library import wrap_triton

from fp4compile import runtime

from .numerics import _IMPORT_ERROR, triton


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
    "packed_mm": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
}


def _require_triton() -> None:
    if triton is None:
        raise RuntimeError(f"fp4compile's Triton kernels need triton: {_IMPORT_ERROR}")


def _launch_options(cfg: dict) -> dict:
    return {"num_warps": cfg["num_warps"]}


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
    """Launch ``kernel`` over ``grid``. Through ``torch.library.wrap_triton``: run eagerly it launches at
    once; traced (the fp4 ops' decomposition for Inductor) it becomes a node of the graph, which Inductor
    compiles, caches and launches from its generated code. (``wrap_triton`` hands the interpreter's
    kernels back as they are: they launch, and are not traceable.)"""
    wrap_triton(kernel)[grid](*args, **kwargs)


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


def _amax_arg(amax: torch.Tensor, device) -> torch.Tensor:
    """A given amax as the kernels read it: one float32 on ``device``."""
    return amax.detach().to(device=device, dtype=torch.float32).reshape(1).contiguous()


def _output_buffers(rows, cols, swizzle, fake, device):
    """(data, scales, block-decoded) buffers of a quantize launch; a fake launch writes only the last."""
    if fake:
        bd = torch.empty((rows, cols), dtype=torch.bfloat16, device=device)
        return bd, bd, bd
    data = torch.empty((rows, cols // 2), dtype=torch.uint8, device=device)
    return data, _scales_buffer(rows, cols // 16, swizzle, device), data
