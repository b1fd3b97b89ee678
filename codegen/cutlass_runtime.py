"""Running the CUTLASS NVFP4 GEMM that a graph names: first use, self-test, failure policy, operands.

The lowering pass names a configuration without building it (``cutlass_gemm.select_config``), as the
kernel string ``cutlass:<config name>``, or ``cutlass:<config name>+emulation`` when the recipe allows
emulation (``Recipe.allow_emulation``). What a compile produces therefore never depends on whether a
build finished. When ``fp4.scaled_mm`` first runs a configuration on a device (``kernel_for``):

1. ``cutlass_gemm.load`` finds its build in the kernel cache (built ahead of time by ``fp4compile
   kernels build`` or ``warm_up``) or builds it now, showing the compiler's progress on stderr; the
   toolkit is checked before any compile (``cutlass_toolkit.check_toolkit``).
2. ``self_test`` runs a small GEMM with it and compares the result with the emulated GEMM of the same
   operands, within the bound of a different fp32 accumulation order and the output rounding.

If either step fails, the configuration is marked failed on that device for the rest of the process
and every GEMM that names it raises ``CutlassKernelError`` with the reason, or, where the recipe
allows emulation, runs the emulated GEMM after one ``fp4compile.PlanWarning`` naming the
configuration and the reason.

Operands (``prepare_operands``): packed codes [rows, K/2] (uint8 or float4_e2m1fn_x2) and E4M3 scales
in the 128x4 tiled layout (1-D), as the quantizers write them for a CUTLASS GEMM (``layout="swizzled"``,
requested by the lowering: ``fp4compile.scale_layout``); nothing is rearranged per call, and row-major
(2-D) scales are refused. A K that is a multiple of 16 but not of 32 (wgrad's token count) is
zero-padded to the next multiple of 32: zero codes add nothing to any product, and the tiled layout
already holds the extra scale column.
"""

from __future__ import annotations

import functools
import logging
import threading
import warnings
from typing import Callable, Optional

import torch

from . import cutlass_gemm
from .cutlass_gemm import GemmConfig, KernelBuildError

log = logging.getLogger("fp4compile")

__all__ = [
    "CutlassKernelError",
    "SelfTestError",
    "kernel_name",
    "parse_kernel",
    "check_operands",
    "prepare_operands",
    "self_test",
    "kernel_for",
    "scaled_mm",
    "warm_up",
    "reset",
]

PREFIX = "cutlass:"
EMULATION_SUFFIX = "+emulation"
_DATA_DTYPES = (torch.uint8, torch.float4_e2m1fn_x2)
_SCALE_DTYPES = (torch.uint8, torch.float8_e4m3fn)


class CutlassKernelError(RuntimeError):
    """A GEMM on a Blackwell GPU cannot run on its CUTLASS kernel and the recipe does not allow emulation."""


class SelfTestError(RuntimeError):
    """A configuration's first-use self-test raised or disagreed with the emulated GEMM."""


def kernel_name(config: GemmConfig, allow_emulation: bool) -> str:
    """The kernel string ``fp4.scaled_mm`` carries for ``config``."""
    return PREFIX + config.name + (EMULATION_SUFFIX if allow_emulation else "")


@functools.lru_cache(maxsize=None)
def parse_kernel(kernel: str) -> tuple[GemmConfig, bool]:
    """(configuration, whether emulation is allowed) of a ``kernel_name`` string."""
    if not kernel.startswith(PREFIX):
        raise ValueError(f"{kernel!r} does not name a CUTLASS kernel ({PREFIX}<config>)")
    name = kernel[len(PREFIX):]
    allow = name.endswith(EMULATION_SUFFIX)
    if allow:
        name = name[: -len(EMULATION_SUFFIX)]
    return GemmConfig.from_name(name), allow


# ----------------------------------------------------------------------------------------------
# Operands
# ----------------------------------------------------------------------------------------------


def check_operands(kernel: str, name: str, data, scales, amax, k: int) -> None:
    """Raise ValueError naming ``kernel`` and operand ``name`` unless ``data`` [rows, K/2] holds packed E2M1
    codes (uint8 or float4_e2m1fn_x2, contiguous), ``scales`` the E4M3 scales in the 128x4 tiled layout
    (1-D, uint8 or float8_e4m3fn, ``expected_scales_numel(rows, K)`` bytes) and ``amax`` a float32 scalar."""
    where = f"{kernel}: operand {name}"
    if data.dtype not in _DATA_DTYPES:
        raise ValueError(f"{where}: codes must be uint8 or float4_e2m1fn_x2, got {data.dtype}")
    if data.dim() != 2 or data.shape[1] * 2 != k or not data.is_contiguous():
        raise ValueError(
            f"{where}: codes must be a contiguous [rows, K/2] = [*, {k // 2}] tensor, got shape "
            f"{tuple(data.shape)} strides {data.stride()}"
        )
    if scales.dtype not in _SCALE_DTYPES:
        raise ValueError(f"{where}: scales must be float8_e4m3fn or uint8, got {scales.dtype}")
    expected = cutlass_gemm.expected_scales_numel(data.shape[0], k)
    if scales.dim() != 1 or scales.numel() != expected or not scales.is_contiguous():
        raise ValueError(
            f"{where}: scales must be in the 128x4 tiled layout (formats.swizzle_scales): 1-D, contiguous, "
            f"{expected} bytes for [{data.shape[0]}, {k // 16}] scales; got shape {tuple(scales.shape)} "
            "(a 2-D tensor is the quantizers' row-major layout, not the tiled one)"
        )
    if amax.dtype != torch.float32 or amax.numel() != 1:
        raise ValueError(f"{where}: amax must be a float32 scalar, got {amax.dtype} of shape {tuple(amax.shape)}")
    for what, t in (("scales", scales), ("amax", amax)):
        if t.device != data.device:
            raise ValueError(f"{where}: {what} are on {t.device}, the codes on {data.device}")


def _prepare(data: torch.Tensor, scales: torch.Tensor, padded_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    if data.dtype not in _DATA_DTYPES or scales.dtype not in _SCALE_DTYPES:
        raise ValueError(
            f"CUTLASS NVFP4 operands are codes (uint8 or float4_e2m1fn_x2) and scales (float8_e4m3fn or "
            f"uint8), got {data.dtype} and {scales.dtype}"
        )
    k = data.shape[-1] * 2
    if scales.dim() != 1:
        raise ValueError(
            f"CUTLASS NVFP4 scales must be in the 128x4 tiled layout (1-D: quantize with layout='swizzled', or "
            f"formats.swizzle_scales), got a {tuple(scales.shape)} tensor (the row-major layout) for "
            f"[{data.shape[0]}, {k // 16}] scales"
        )
    if padded_k != k:
        # The tiled layout holds round_up(K/16, 4) scale columns, which covers the padded K: its extra
        # column is already there (zero); only the codes grow.
        raw = torch.nn.functional.pad(data.contiguous().view(torch.uint8), (0, (padded_k - k) // 2))
        data = raw.view(data.dtype) if data.dtype != torch.uint8 else raw
    return data.contiguous(), scales.contiguous()


def prepare_operands(a, a_scales, b, b_scales) -> tuple:
    """(a, a_scales, b, b_scales) as the kernel reads them: K padded with zero codes to a multiple of
    ``cutlass_gemm.ALIGN_K``. Raises ValueError when K is not a multiple of 16 or the scales are not in
    the tiled layout."""
    k = a.shape[-1] * 2
    if b.shape[-1] * 2 != k:
        raise ValueError(f"operands disagree on K: A has {k}, B has {b.shape[-1] * 2}")
    if k % cutlass_gemm.BLOCK_K:
        raise ValueError(f"K={k} is not a multiple of the NVFP4 block ({cutlass_gemm.BLOCK_K})")
    padded_k = -(-k // cutlass_gemm.ALIGN_K) * cutlass_gemm.ALIGN_K
    return (*_prepare(a, a_scales, padded_k), *_prepare(b, b_scales, padded_k))


# ----------------------------------------------------------------------------------------------
# First use: load (or build), self-test, remember the outcome
# ----------------------------------------------------------------------------------------------


def _self_test_shape(config: GemmConfig) -> tuple[int, int, int]:
    """M over one cluster of tiles with a partial tile, N two clusters wide, K two MMA k-tiles and a
    partial one."""
    m = config.tile_m * config.cluster_m + 40
    n = config.tile_n * config.cluster_n * 2
    k = 2 * config.tile_k + 96
    return m, n, k


def self_test(config: GemmConfig, kernel: Callable, device) -> None:
    """Run ``kernel`` on a small GEMM on ``device`` and compare with the emulated GEMM; raise
    ``SelfTestError`` with the reason when it raises, returns the wrong shape or dtype, or differs by
    more than a different fp32 accumulation order (2 K ulp of the sum of |products|) plus the output's
    rounding (one ulp) can explain."""
    from fp4compile import formats, reference

    m, n, k = _self_test_shape(config)
    gen = torch.Generator().manual_seed(0)
    qa = formats.quantize(torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4)
    qb = formats.quantize(torch.randn(n, k, generator=gen), block="16x16")
    what = f"self-test of {config.name} ({m}x{n}x{k}) on {device}"
    # Bytes cross devices (a copy of the FP4/FP8 storage dtypes needs kernels not every build has).
    tiled = (formats.swizzle_scales(qa.scales), formats.swizzle_scales(qb.scales))  # as the quantizers write them
    operands = [t.view(torch.uint8).to(device) if t.element_size() == 1 else t.to(device)
                for t in (qa.data, tiled[0], qa.amax, qb.data, tiled[1], qb.amax)]
    try:
        a, sa, b, sb = prepare_operands(operands[0], operands[1], operands[3], operands[4])
        out = kernel(a, sa, operands[2], b, sb, operands[5], None)
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
    except Exception as exc:  # a launch, initialize or TMA/cluster setup failure of the kernel
        raise SelfTestError(f"{what} raised {type(exc).__name__}: {exc}") from exc
    if tuple(out.shape) != (m, n) or out.dtype != config.torch_out_dtype:
        raise SelfTestError(
            f"{what} returned {out.dtype} of shape {tuple(out.shape)}, expected {config.torch_out_dtype} {(m, n)}"
        )
    args = (qa.data, qa.scales, qa.amax, qb.data, qb.scales, qb.amax, "nvfp4")
    ref = reference.scaled_mm_reference(*args, torch.float32).double()
    alpha = formats.gemm_alpha(qa.amax, qb.amax).double()
    magnitude = (reference.block_decode(qa.data, qa.scales, qa.amax, "nvfp4").double().abs()
                 @ reference.block_decode(qb.data, qb.scales, qb.amax, "nvfp4").double().abs().T) * alpha
    output_ulp = torch.finfo(config.torch_out_dtype).eps
    bound = 2 * k * 2.0**-24 * magnitude + output_ulp * ref.abs() + torch.finfo(torch.float32).tiny
    got = out.double().cpu()
    error = (got - ref).abs()
    bad = ~(error <= bound)  # NaN counts as bad
    if bad.any():
        row, col = (int(i) for i in bad.nonzero()[0])
        raise SelfTestError(
            f"{what} disagrees with the emulated GEMM at {int(bad.sum())} of {m * n} outputs, e.g. "
            f"[{row}, {col}]: {float(got[row, col])!r} vs {float(ref[row, col])!r} (bound {float(bound[row, col]):.3g})"
        )


_lock = threading.Lock()
_kernels: dict = {}  # (config, device) -> callable
_failed: dict = {}  # (config, device) -> reason
_warned: set = set()


def reset() -> None:
    """Forget every configuration's first-use outcome in this process (the next use loads and tests again)."""
    with _lock:
        _kernels.clear()
        _failed.clear()
        _warned.clear()


def _first_use(config: GemmConfig, device: torch.device) -> None:
    try:
        kernel = cutlass_gemm.load(config, device=device, progress=True)
        self_test(config, kernel, device)
    except (KernelBuildError, SelfTestError) as exc:
        _failed[config, device] = str(exc)
        log.error("fp4compile: CUTLASS kernel %s cannot run on %s: %s", config.name, device, exc)
    else:
        _kernels[config, device] = kernel


def kernel_for(config: GemmConfig, device, allow_emulation: bool) -> Optional[Callable]:
    """The loaded, self-tested kernel of ``config`` on ``device``; None when it failed and emulation is
    allowed (warned once per configuration and device); raises ``CutlassKernelError`` when it failed
    and emulation is not allowed."""
    device = torch.device(device)
    key = (config, device)
    kernel = _kernels.get(key)  # the common case, once the first use succeeded: no lock
    if kernel is not None:
        return kernel
    with _lock:
        if key not in _kernels and key not in _failed:
            _first_use(config, device)
        if key in _kernels:
            return _kernels[key]
        reason = _failed[key]
        if not allow_emulation:
            raise CutlassKernelError(
                f"the FP4 GEMMs that selected the CUTLASS kernel {config.name} cannot run on {device}: {reason}. "
                "On a Blackwell GPU FP4 GEMMs run on CUTLASS kernels only; Recipe(allow_emulation=True) "
                "(or Backend(allow_emulation=True)) runs them in emulation instead, with the same operands, slower."
            )
        if key not in _warned:
            _warned.add(key)
            from fp4compile.diagnostics import PlanWarning

            warnings.warn(
                f"fp4compile: the FP4 GEMMs that selected the CUTLASS kernel {config.name} run in emulation on "
                f"{device} (Recipe.allow_emulation): {reason}",
                PlanWarning,
                stacklevel=2,
            )
        return None


def scaled_mm(kernel: str, a, a_scales, a_amax, b, b_scales, b_amax, out_dtype) -> Optional[torch.Tensor]:
    """``fp4.scaled_mm`` on the CUTLASS kernel named by ``kernel``; None when the configuration failed on
    this device and emulation is allowed (the caller runs the emulated GEMM)."""
    config, allow_emulation = parse_kernel(kernel)
    if out_dtype != config.torch_out_dtype:
        raise ValueError(f"{kernel}: the kernel writes {config.torch_out_dtype}, the graph expects {out_dtype}")
    m, n = a.shape[0], b.shape[0]
    if m == 0 or n == 0 or a.shape[-1] == 0:
        return torch.zeros((m, n), dtype=out_dtype, device=a.device)  # nothing to multiply (no tokens)
    run = kernel_for(config, a.device, allow_emulation)
    if run is None:
        return None
    a, a_scales, b, b_scales = prepare_operands(a, a_scales, b, b_scales)
    k = a.shape[-1] * 2
    check_operands(kernel, "A", a, a_scales, a_amax, k)
    check_operands(kernel, "B", b, b_scales, b_amax, k)
    return run(a, a_scales, a_amax, b, b_scales, b_amax, None)


def warm_up(configs, device=None) -> dict:
    """Load (building where no build exists) and self-test ``configs`` on ``device`` (default: the
    current CUDA device) now, before training: {config name: None if it runs, else the reason}."""
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    outcome = {}
    for config in configs:
        with _lock:
            if (config, device) not in _kernels and (config, device) not in _failed:
                _first_use(config, device)
        outcome[config.name] = _failed.get((config, device))
    return outcome
