"""The host API: quantize, decode and GEMM functions over the kernels (``dispatch`` offers them to the
executor table)."""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from fp4compile.scale_layout import is_swizzled

from .launch import (
    CONFIGS, Seed, _INPUT_DTYPES, _amax_arg, _as_rows, _hw_e4m3, _launch, _launch_options, _output_buffers,
    _require_triton, _scales_buffer, _scales_bytes, _seed_args, _tiles,
)
from .numerics import _IMPORT_ERROR, triton

if triton is not None:  # the kernels exist only where triton does
    from .rows import _amax_kernel, _quantize_rows_kernel
    from .rht import _dual_quantize_kernel, _rht_amax_kernel, _rht_quantize_kernel
    from .mx import _quantize_mx_kernel, _rht_quantize_mx_kernel
    from .decode import _alpha_kernel, _decode_kernel, _epilogue_kernel, _transpose_tiles_kernel
    from .gemm import _packed_mm_kernel


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
    """(int32 [1], int32 [1]): the bits of max |x| and of max |RHT(x^T)|, from one launch and one fill (the
    kernel's accumulators and count in one zeroed buffer; the results, unfilled, are written by its last
    program)."""
    cfg = CONFIGS["rht_amax"]
    m, k = x2.shape
    acc = torch.zeros(3, dtype=torch.int32, device=x2.device)
    out_x = torch.empty(1, dtype=torch.int32, device=x2.device)
    out_y = torch.empty(1, dtype=torch.int32, device=x2.device)
    grid, order = _tiles(cfg, triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(k, cfg["BLOCK_K"] * cfg["ITERS"]))
    _launch(
        _rht_amax_kernel, grid,
        x2, acc, out_x, out_y, m, k, x2.stride(0), BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"], ITERS=cfg["ITERS"],
        **order, **_launch_options(cfg),
    )
    return out_x, out_y


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


def _quantize_rows(x, what, tile_rows, rounding, seed, amax, swizzle, fake, amax_is_own=False, scale_rule="6"):
    _require_triton()
    if scale_rule not in ("6", "4/6"):
        raise ValueError(f"{what}: scale_rule must be '6' or '4/6', got {scale_rule!r}")
    four_six = scale_rule == "4/6"
    x2 = _as_rows(x, what, tile_rows, pair_words=tile_rows == 1)
    m, k = x2.shape
    # Four Over Six quantizes 1x16 blocks as one-row tiles, through the tile kernel's path.
    cfg = CONFIGS["quantize_tiles" if tile_rows > 1 or four_six else "fake_rows" if fake else "quantize_rows"]
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
            BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"], ITERS=iters, E4M3=e4m3, FOUR_SIX=four_six, **order,
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
    swizzle: bool = False, amax_is_own: bool = False, scale_rule: str = "6",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 with 1x16 blocks along the last dim: (codes uint8 [..., K/2], scales uint8, amax fp32 0-dim).

    Bit for bit ``formats.quantize(x, "nvfp4", "1x16", rounding, amax=amax, seed=seed)``. Scales are
    the bits of float8_e4m3fn, [..., K/16] row-major, or with ``swizzle`` the flat 128x4-tiled layout
    of ``formats.swizzle_scales`` over the [rows, K/16] matrix (zero padded).

    A given ``amax`` is checked against the tensor's own (a second pass over a per-tile maximum; a
    non-finite own amax wins). ``amax_is_own=True`` says it *is* x's own abs max, computed elsewhere
    (by ``global_amax``, ``wgrad_amax`` or the operand's producer): then one quantizing pass reads x
    once and does nothing else. ``scale_rule="4/6"``: Four Over Six block scales (``formats.nvfp4_encode``).
    """
    return _quantize_rows(x, "quantize_1x16", 1, rounding, seed, amax, swizzle, False, amax_is_own, scale_rule)


def quantize_16x16(
    w: torch.Tensor, rounding: str = "rne", seed: Seed = None, amax: Optional[torch.Tensor] = None,
    swizzle: bool = False, amax_is_own: bool = False, scale_rule: str = "6",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 with 16x16 tiles over the last two dims (scales repeated on each row of a tile, as formats);
    ``amax``, ``amax_is_own`` and ``scale_rule`` as ``quantize_1x16``."""
    return _quantize_rows(w, "quantize_16x16", 16, rounding, seed, amax, swizzle, False, amax_is_own, scale_rule)


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
    amax_is_own: bool = False, scale_rule: str = "6",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(value(code) * block scale as bf16 with x's shape, amax): ``formats.block_decode`` of quantize_1x16."""
    return _quantize_rows(x, "fake_quantize_1x16", 1, rounding, seed, amax, False, True, amax_is_own, scale_rule)


def fake_quantize_16x16(
    w: torch.Tensor, rounding: str = "rne", seed: Seed = None, amax: Optional[torch.Tensor] = None,
    amax_is_own: bool = False, scale_rule: str = "6",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(value(code) * tile scale as bf16, amax) for 16x16 tiles."""
    return _quantize_rows(w, "fake_quantize_16x16", 16, rounding, seed, amax, False, True, amax_is_own, scale_rule)


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
    bd, bd_t = _dual(x, rounding, seed, amax, rounding_t, seed_t, amax_t, fake=True)
    return bd.reshape(x.shape), bd_t


def quantize_dual(
    x: torch.Tensor, rounding: str, seed: Seed, amax: torch.Tensor,
    rounding_t: str, seed_t: Seed, amax_t: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fake_quantize_dual`` writing packed operands: (codes [tokens, K/2], scales [tokens, K/16]) of
    ``quantize_1x16(x, rounding, seed, amax=amax, amax_is_own=True)`` and (codes [K, tokens/2], scales
    [K, tokens/16]) of ``quantize_wgrad_operand(x, rounding_t, seed_t, amax=amax_t, amax_is_own=True)``,
    bit for bit, from one launch. ``amax`` and ``amax_t`` must be x's own (``wgrad_amax(x)``)."""
    return _dual(x, rounding, seed, amax, rounding_t, seed_t, amax_t, fake=False)


def _dual(x, rounding, seed, amax, rounding_t, seed_t, amax_t, fake: bool) -> tuple:
    _require_triton()
    x2 = _as_rows(x, "quantize_dual", rows_multiple=16, pair_words=True)
    m, k = x2.shape
    cfg = CONFIGS["dual_quantize"]
    device = x2.device
    if fake:
        bd = torch.empty((m, k), dtype=torch.bfloat16, device=device)
        bd_t = torch.empty((k, m), dtype=torch.bfloat16, device=device)
        buffers = (bd, bd, bd, bd_t, bd_t, bd_t)
    else:
        data, scales = torch.empty((m, k // 2), dtype=torch.uint8, device=device), _scales_buffer(m, k // 16, False, device)
        data_t, scales_t = torch.empty((k, m // 2), dtype=torch.uint8, device=device), _scales_buffer(k, m // 16, False, device)
        buffers = (data, scales, data, data_t, scales_t, data_t)
    given = [_amax_arg(a, device) for a in (amax, amax_t)]
    seeds = _seed_args(rounding, seed, x2, buffers[0])
    seeds_t = _seed_args(rounding_t, seed_t, x2, buffers[0])
    grid, order = _tiles(cfg, triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(k, cfg["BLOCK_K"]))
    _launch(
        _dual_quantize_kernel, grid,
        x2, given[0], given[1], *buffers, m, k, x2.stride(0),
        seeds["seed_ptr"], seeds["seed_lo"], seeds["seed_hi"], seeds_t["seed_ptr"], seeds_t["seed_lo"], seeds_t["seed_hi"],
        SR=rounding == "sr", MIX=seeds["MIX"], SR_T=rounding_t == "sr", MIX_T=seeds_t["MIX"],
        BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"], E4M3=_hw_e4m3(device), FAKE=fake, **order, **_launch_options(cfg),
    )
    return (buffers[2], buffers[5]) if fake else (buffers[0], buffers[1], buffers[3], buffers[4])


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


def transpose_tiles(
    data: torch.Tensor, scales: torch.Tensor, swizzled: bool = False, swizzle: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [K, N/2], scales [K, N/16]) of W^T from the codes [N, K/2] and the E4M3 scale bytes [N, K/16]
    of a 16x16-tile quantized W [N, K] (N, K multiples of 16): ``formats.QTensor.transpose`` in one pass
    over the packed weight (a permutation of codes and scales: no arithmetic). ``swizzled``: W's scales
    are in the 128x4 tiled layout; ``swizzle``: W^T's are written in it (zero padded)."""
    _require_triton()
    n, k = data.shape[0], data.shape[1] * 2
    data = data.view(torch.uint8).contiguous()
    scales = scales.view(torch.uint8).contiguous()
    expected = _scales_bytes(n, k // 16, swizzled)
    if scales.numel() != expected:
        raise ValueError(f"transpose_tiles: scales hold {scales.numel()} bytes; [{n}, {k // 16}] (swizzled={swizzled}) needs {expected}")
    out_data = torch.empty((k, n // 2), dtype=torch.uint8, device=data.device)
    out_scales = _scales_buffer(k, n // 16, swizzle, data.device)
    cfg = CONFIGS["transpose_tiles"]
    grid = (triton.cdiv(n, cfg["BLOCK_M"]), triton.cdiv(k, cfg["BLOCK_K"]))
    _launch(
        _transpose_tiles_kernel, grid,
        data, scales, out_data, out_scales, n, k, BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"],
        IN_SWIZZLE=swizzled, SWIZZLE=swizzle, **_launch_options(cfg),
    )
    return out_data, out_scales


def gemm_alpha(amax_a: torch.Tensor, amax_b: torch.Tensor, count: int = 1, scale_rule: str = "6") -> torch.Tensor:
    """``formats.gemm_alpha(amax_a, amax_b, scale_rule)`` on the device, repeated ``count`` times (fp32 [count])."""
    _require_triton()
    amax_a = amax_a.detach().to(torch.float32).reshape(1)
    amax_b = amax_b.detach().to(amax_a.device, torch.float32).reshape(1)
    alpha = torch.empty(max(count, 1), dtype=torch.float32, device=amax_a.device)
    block = 1024
    grid = (triton.cdiv(alpha.numel(), block),)
    _launch(_alpha_kernel, grid, amax_a, amax_b, alpha, alpha.numel(), BLOCK=block, FOUR_SIX=scale_rule == "4/6",
            num_warps=4)
    return alpha


def emulated_scaled_mm(
    a_bd: torch.Tensor, amax_a: torch.Tensor, b_bd: torch.Tensor, amax_b: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16, scale_rule: str = "6",
) -> torch.Tensor:
    """C = A @ B^T for block-decoded operands A [M, K], B [N, K] (bf16, from fake_quantize_* or block_decode).

    fp32 accumulation (``torch.mm`` with an fp32 output), then ``cast(acc * alpha)`` with
    ``alpha = formats.gemm_alpha(amax_a, amax_b)``, both in ``_epilogue_kernel``: the arithmetic of
    ``reference.scaled_mm_reference``, up to the GEMM's summation order. Every step is a kernel launch or
    an aten op, so the ``lower_kernels`` pass can trace it into the graph Inductor compiles.
    ``cublaslt_scaled_mm`` does the same in one cuBLASLt GEMM with alpha in its epilogue.
    """
    _require_triton()
    if a_bd.dim() != 2 or b_bd.dim() != 2 or a_bd.shape[1] != b_bd.shape[1]:
        raise ValueError(f"emulated_scaled_mm needs A [M, K] and B [N, K], got {tuple(a_bd.shape)} and {tuple(b_bd.shape)}")
    return _mm_then_epilogue(a_bd, b_bd, amax_a, amax_b, out_dtype, scale_rule)


def _mm_then_epilogue(a_bd: torch.Tensor, b_bd: torch.Tensor, amax_a: torch.Tensor, amax_b: torch.Tensor,
                      out_dtype: torch.dtype, scale_rule: str = "6"):
    """``cast(alpha * (A @ B^T))``: the GEMM with an fp32 output, then ``_epilogue_kernel``, which
    computes alpha from the two amaxes."""
    amax_a = amax_a.detach().to(a_bd.device, torch.float32).reshape(1)
    amax_b = amax_b.detach().to(a_bd.device, torch.float32).reshape(1)
    if a_bd.is_cuda:
        acc = torch.mm(a_bd, b_bd.t(), out_dtype=torch.float32)
    else:
        acc = a_bd.float() @ b_bd.float().t()
    out = torch.empty(acc.shape, dtype=out_dtype, device=acc.device)
    cfg = CONFIGS["epilogue"]
    n = acc.numel()
    if n == 0:  # no tokens (or no outputs): nothing to launch
        return out
    _launch(_epilogue_kernel, (triton.cdiv(n, cfg["BLOCK"]),), acc, amax_a, amax_b, out, n, BLOCK=cfg["BLOCK"],
            FOUR_SIX=scale_rule == "4/6", **_launch_options(cfg))
    return out


def cublaslt_scaled_mm(
    a_bd: torch.Tensor, amax_a: torch.Tensor, b_bd: torch.Tensor, amax_b: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16, scale_rule: str = "6",
) -> torch.Tensor:
    """``emulated_scaled_mm`` as one cuBLASLt GEMM that reads alpha in its epilogue and writes ``out_dtype``
    (``codegen.cublaslt_gemm``); a problem cuBLASLt offers no algorithm for runs ``emulated_scaled_mm``,
    logged once, unless ``FP4COMPILE_EMULATED_GEMM=cublaslt`` makes that an error."""
    from .. import cublaslt_gemm

    try:
        problem = cublaslt_gemm.dtype_problem(a_bd.dtype, b_bd.dtype, out_dtype)
        if problem:
            raise cublaslt_gemm.Unsupported(problem)
        return cublaslt_gemm.mm_alpha(a_bd, b_bd, gemm_alpha(amax_a.to(a_bd.device), amax_b, scale_rule=scale_rule),
                                      out_dtype)
    except cublaslt_gemm.Unsupported as err:
        if cublaslt_gemm.required():
            raise
        cublaslt_gemm.log_fallback(err)
    return _mm_then_epilogue(a_bd, b_bd, amax_a, amax_b, out_dtype, scale_rule)


def packed_scaled_mm(
    a: torch.Tensor, a_scales: torch.Tensor, amax_a: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
    amax_b: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16, scale_rule: str = "6", b_kn: bool = False,
) -> torch.Tensor:
    """C [M, N] = cast(alpha * (A @ B^T)) from packed NVFP4 operands in one launch (``gemm._packed_mm_kernel``):
    A's codes [M, K/2] and E4M3 scale bytes [M, K/16]; B's codes [N, K/2] and scales [N, K/16], or with
    ``b_kn`` those of a 16x16-tile quantized W [K, N] (B = W^T: dgrad's weight as stored). Scales in
    either layout (row-major, or the 128x4 tiled one). The operands are decoded in registers (exact in
    bf16) and multiplied with fp32 accumulation: ``reference.scaled_mm_reference`` up to the summation
    order."""
    _require_triton()
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"packed_scaled_mm takes 2-D packed operands, got {tuple(a.shape)} and {tuple(b.shape)}")
    m, k = a.shape[0], a.shape[1] * 2
    n = b.shape[1] * 2 if b_kn else b.shape[0]
    if (b.shape[0] if b_kn else b.shape[1] * 2) != k:
        raise ValueError(f"packed_scaled_mm: A holds K={k} but B's codes are {tuple(b.shape)} (b_kn={b_kn})")
    if k % 16 or (b_kn and n % 16):
        raise ValueError(f"packed_scaled_mm needs K (and with b_kn N) a multiple of 16, got M={m}, N={n}, K={k}")
    a, b = a.view(torch.uint8).contiguous(), b.view(torch.uint8).contiguous()
    a_swizzled, b_swizzled = is_swizzled(a, a_scales), is_swizzled(b, b_scales)
    a_scales, b_scales = a_scales.view(torch.uint8).contiguous(), b_scales.view(torch.uint8).contiguous()
    b_rows, b_cols = (k, n // 16) if b_kn else (n, k // 16)
    for name, scales, rows, cols, swizzled in (("A", a_scales, m, k // 16, a_swizzled), ("B", b_scales, b_rows, b_cols, b_swizzled)):
        if scales.numel() != _scales_bytes(rows, cols, swizzled):
            raise ValueError(f"packed_scaled_mm: {name}'s scales hold {scales.numel()} bytes; [{rows}, {cols}] "
                             f"(swizzled={swizzled}) needs {_scales_bytes(rows, cols, swizzled)}")
    amax_a, amax_b = _amax_arg(amax_a, a.device), _amax_arg(amax_b, a.device)
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    cfg = CONFIGS["packed_mm"]
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _launch(
        _packed_mm_kernel, grid, a, a_scales, amax_a, b, b_scales, amax_b, out, m, n, k,
        A_SWIZZLE=a_swizzled, B_SWIZZLE=b_swizzled, B_KN=b_kn, FOUR_SIX=scale_rule == "4/6",
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
