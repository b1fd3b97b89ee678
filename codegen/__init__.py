"""Kernel selection for FP4 GEMMs: CUTLASS block-scaled kernels on Blackwell, emulation elsewhere.

Like an executor registry, every GEMM shape is offered to the kernel providers in order; each one
says whether it can take the call and why not. The choice and its reason are stored in the report.

| kernel name | where | what |
|---|---|---|
| ``cutlass:<config>[+emulation]`` | sm_100 GPUs with CUDA torch | generated CUTLASS SM100 block-scaled NVFP4 GEMM, built on first use or ahead of time (``codegen.cutlass_runtime``); ``+emulation``: the recipe allows the emulated GEMM where the kernel fails |
| ``emulation`` | everywhere | block-decode both operands (exact), matmul with fp32 accumulation, alpha; on CUDA a BF16 GEMM on the decoded operands (Triton-decoded for NVFP4) with alpha in cuBLASLt's epilogue (``cublaslt_gemm``) or an fp32 output and an epilogue kernel |
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from fp4compile import ops, runtime

log = logging.getLogger("fp4compile")

_notices: set[str] = set()


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    name: str
    reason: str


def _triton_provider(name: str):
    """The provider ``triton_kernels.<name>`` for CUDA tensors: the fused Triton quantizers (bit-exact
    with formats) take NVFP4 and MXFP4 quantize calls and the weight-gradient RHT + quantize.

    Triton is imported on the first CUDA call only, so importing fp4compile stays light.
    """

    def provider(x, *args):
        if not x.is_cuda:
            return None
        from . import triton_kernels

        return getattr(triton_kernels, name)(x, *args)

    return provider


def _notice(message: str) -> None:
    if message not in _notices:
        _notices.add(message)
        log.warning("fp4compile: %s", message)


class CutlassRequired(RuntimeError):
    """An FP4 GEMM on a Blackwell GPU has no CUTLASS kernel and the recipe does not allow emulation."""


def _cutlass_choice(m, n, k, fmt, out_dtype, device, allow_emulation):
    """(KernelChoice or None, reason it was not taken). Pure: selects from the device's architecture and
    the GEMM's N, K and M (or M's size hint), builds nothing (``cutlass_runtime`` builds on first use)."""
    if fmt != "nvfp4":
        return None, f"CUTLASS kernels are generated for NVFP4 only, not {fmt}"
    if device.type != "cuda":
        return None, f"device {device} is not a CUDA GPU"
    try:
        from . import cutlass_gemm, cutlass_runtime
    except ImportError as exc:
        return None, f"CUTLASS code generation unavailable: {exc}"
    ok, why = cutlass_gemm.device_supports_cutlass(device)
    if not ok:
        return None, why
    config, why = cutlass_gemm.select_config(m, n, k, out_dtype)
    if config is None:
        return None, why
    return KernelChoice(cutlass_runtime.kernel_name(config, allow_emulation), why), ""


def is_blackwell(device) -> bool:
    """Whether ``device`` runs CUTLASS NVFP4 GEMMs (where an FP4 GEMM off them needs ``allow_emulation``)."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    try:
        from .cutlass_toolkit import is_cutlass_device
    except ImportError:
        return False
    return is_cutlass_device(device)


def choose_kernel(m, n, k, fmt: str, out_dtype: torch.dtype, device, allow_emulation: bool = True) -> KernelChoice:
    """The kernel for C[m, n] = A[m, k] @ B[n, k]^T in ``fmt`` on ``device``; M and K may be symbolic.

    On a Blackwell GPU a GEMM that gets no CUTLASS kernel raises ``CutlassRequired`` with the reason
    unless ``allow_emulation``."""
    device = torch.device(device)
    choice, why_not = _cutlass_choice(m, n, k, fmt, out_dtype, device, allow_emulation)
    if choice is not None:
        return choice
    return emulation(why_not, fmt, device, allow_emulation)


def emulation(why_not: str, fmt: str, device, allow_emulation: bool = True) -> KernelChoice:
    """The emulated kernel, for the reason ``why_not`` no other takes the GEMM; raises ``CutlassRequired``
    on a Blackwell GPU unless ``allow_emulation``."""
    device = torch.device(device)
    if device.type == "cuda":
        if is_blackwell(device) and not allow_emulation:
            raise CutlassRequired(
                f"{why_not}; on a Blackwell GPU FP4 GEMMs run on CUTLASS kernels only: "
                "Recipe(allow_emulation=True) (or Backend(allow_emulation=True)) runs such GEMMs in emulation"
            )
        _notice(f"FP4 GEMMs run in emulation on {torch.cuda.get_device_name(device)}: {why_not}")
        if fmt == "nvfp4":
            from . import cublaslt_gemm

            why_not = f"{why_not}; emulated GEMM: {cublaslt_gemm.describe()}"
    return KernelChoice("emulation", why_not)


def run_scaled_mm(kernel: str, a, a_scales, a_amax, b, b_scales, b_amax, fmt: str, out_dtype):
    if kernel.startswith("cutlass:"):
        from . import cutlass_runtime

        out = cutlass_runtime.scaled_mm(kernel, a, a_scales, a_amax, b, b_scales, b_amax, out_dtype)
        if out is not None:
            return out
        # The configuration failed on this device and the recipe allows emulation: the emulated GEMM.
    if a.is_cuda and a.dim() == 2 and b.dim() == 2:
        # Block-decoded operands are exact in BF16 (every E2M1 x E4M3 and E2M1 x E8M0 product is): a
        # BF16 GEMM with fp32 output accumulates the same products at tensor-core speed, alpha after.
        if fmt == "mxfp4":
            a_bd = ops.block_decode(a, a_scales, a_amax, fmt).to(torch.bfloat16)
            b_bd = ops.block_decode(b, b_scales, b_amax, fmt).to(torch.bfloat16)
            return torch.mm(a_bd, b_bd.t(), out_dtype=torch.float32).to(out_dtype)
        from . import triton_kernels

        if triton_kernels.available()[0]:
            a_bd, b_bd = (triton_kernels.block_decode(x, s, swizzled=s.dim() == 1) for x, s in ((a, a_scales), (b, b_scales)))
            return triton_kernels.emulated_scaled_mm(a_bd, a_amax, b_bd, b_amax, out_dtype)
    return ops.scaled_mm_reference(a, a_scales, a_amax, b, b_scales, b_amax, fmt, out_dtype)


runtime.register_quantize_provider(_triton_provider("quantize_provider"))
runtime.register_rht_quantize_provider(_triton_provider("rht_quantize_provider"))
runtime.register_fake_quantize_provider(_triton_provider("fake_quantize_provider"))
runtime.register_fake_rht_quantize_provider(_triton_provider("fake_rht_quantize_provider"))
runtime.register_fake_dual_quantize_provider(_triton_provider("fake_dual_quantize_provider"))
