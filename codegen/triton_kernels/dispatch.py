"""The Triton entries of the executor table (``fp4compile.executors``): for each op a check, which says
whether these kernels take a call and why not, and the call itself, both with the op's arguments.

Checks read only what a fake tensor also has (device, dtype, shape) and the op's constant arguments, so
the compiler asks them on a graph's fake values (``lower_kernels``) and gets the answer the run gets.
Calls hand the kernels the node's SR stream as a ``runtime.DeviceSeed`` on CUDA (the kernel mixes the
node's constant with the step's base when it runs) and an amax computed by an earlier node as
``amax=..., amax_is_own=True`` (the quantizing pass alone); that amax, which the kernel returns as it
is, is copied, since an op's output may not alias its input.
"""

from __future__ import annotations

from typing import Optional

import torch

from fp4compile import runtime
from fp4compile.scale_layout import SWIZZLED, is_swizzled

from .api import (
    available, block_decode, cublaslt_scaled_mm, emulated_scaled_mm, fake_quantize_16x16, fake_quantize_1x16, fake_quantize_dual,
    fake_quantize_wgrad_operand, packed_scaled_mm, quantize_16x16, quantize_dual, quantize_1x16, quantize_mxfp4, quantize_wgrad_operand,
    quantize_wgrad_operand_mxfp4, transpose_tiles, wgrad_amax as _wgrad_amax,
)
from .launch import _INPUT_DTYPES

_QUANTIZERS = {("nvfp4", "1x16"): quantize_1x16, ("nvfp4", "16x16"): quantize_16x16, ("mxfp4", "1x32"): quantize_mxfp4}
_FAKE_QUANTIZERS = {("nvfp4", "1x16"): fake_quantize_1x16, ("nvfp4", "16x16"): fake_quantize_16x16}
_RHT_BLOCKS = (("nvfp4", "1x16"), ("mxfp4", "1x32"))


def kernel_stream(x: torch.Tensor, rounding: str, node: int, seed_base: Optional[torch.Tensor] = None):
    """The SR stream a kernel takes for the node constant ``node``: on CUDA a ``runtime.DeviceSeed``
    (``seed_base``: the step's base as a tensor the graph holds, ``fp4.sr_base``; without it the runtime's
    own copy on the device), elsewhere (the interpreter) the seed itself."""
    if rounding != "sr":
        return 0
    if seed_base is not None and x.is_cuda:
        return runtime.DeviceSeed(int(node), seed_base)
    return runtime.device_seed(node, x.device) if x.is_cuda else runtime.sr_seed(node)


def _given(amax: Optional[torch.Tensor]) -> dict:
    return {} if amax is None else {"amax": amax, "amax_is_own": True}


def _own_amax(outputs: tuple, amax: Optional[torch.Tensor]) -> tuple:
    return outputs if amax is None else (*outputs[:-1], outputs[-1].clone())


def check_kernels() -> tuple[bool, str]:
    """Whether the Triton kernels can run here (a CUDA device, or Triton's interpreter), and why
    not: every op's check asks it, as does the executor table's ``scaled_mm`` check of the FP4-operand
    GEMM."""
    ok, why = available()
    return (True, why) if ok else (False, f"the Triton kernels cannot run here ({why})")


def _operand(x: torch.Tensor, multiple: int) -> tuple[bool, str]:
    """Whether the kernels read ``x`` (rows of ``multiple``-element blocks) on this device."""
    if not x.is_cuda:
        return False, f"its input is on {x.device.type}, not CUDA"
    ok, why = check_kernels()
    if not ok:
        return False, why
    if x.dtype not in _INPUT_DTYPES:
        return False, f"a {x.dtype} input (the kernels read float32, bfloat16 and float16)"
    if x.dim() < 2 or x.numel() == 0:
        return False, f"an input of shape {tuple(x.shape)} (the kernels take non-empty rows)"
    if x.shape[-1] % multiple:
        return False, f"rows of {x.shape[-1]} elements, not a multiple of {multiple}"
    return True, ""


def _swizzle(layout: str) -> dict:
    """The kernels' option for a scale layout: ``swizzle`` stores each scale at its 128x4-tiled offset."""
    return {"swizzle": True} if layout == SWIZZLED else {}


def _rule(scale_rule) -> dict:
    """The kernels' option for a block scale rule ("4/6": Four Over Six)."""
    return {"scale_rule": scale_rule} if scale_rule == "4/6" else {}


def check_quantize(x, fmt, block, rounding=None, seed=None, amax=None, seed_base=None, layout=None,
                   scale_rule="6") -> tuple[bool, str]:
    if (fmt, block) not in _QUANTIZERS:
        return False, f"no Triton quantizer for {fmt} with {block} blocks"
    ok, why = _operand(x, 32 if fmt == "mxfp4" else 16)
    if ok and block == "16x16" and x.shape[-2] % 16:
        return False, f"{x.shape[-2]} rows, not a multiple of 16 (16x16 tiles)"
    return ok, why


def quantize(x, fmt, block, rounding, seed, amax=None, seed_base=None, layout="row_major", scale_rule="6") -> tuple:
    kernel = _QUANTIZERS[fmt, block]
    stream = kernel_stream(x, rounding, seed, seed_base)
    return _own_amax(kernel(x, rounding, stream, **_given(amax), **_swizzle(layout), **_rule(scale_rule)), amax)


def check_rht_quantize(x, size, fmt, block, rounding=None, seed=None, amax=None, seed_base=None,
                       layout=None, scale_rule="6") -> tuple[bool, str]:
    """The fused transpose + 16-point RHT + quantize of a [K, tokens] operand (the view the wgrad reads)."""
    if scale_rule != "6":
        return False, f"no fused RHT quantizer for the block scale rule {scale_rule!r} (the RHT, then the quantizer)"
    if (fmt, block) not in _RHT_BLOCKS:
        return False, f"no fused RHT quantizer for {fmt} with {block} blocks"
    if size != 16:
        return False, f"a {size}-point RHT (the fused kernels do 16)"
    if x.dim() != 2:
        return False, f"a {x.dim()}-D operand (the fused kernels take [K, tokens])"
    return _operand(x, 32 if fmt == "mxfp4" else 16)


def rht_quantize(x, size, fmt, block, rounding, seed, amax=None, seed_base=None, layout="row_major",
                 scale_rule="6") -> tuple:
    stream = kernel_stream(x, rounding, seed, seed_base)
    if fmt == "mxfp4":
        return quantize_wgrad_operand_mxfp4(x.t(), rounding, stream)
    return _own_amax(quantize_wgrad_operand(x.t(), rounding, stream, **_given(amax), **_swizzle(layout)), amax)


def check_fake_quantize(x, fmt, block, rounding=None, seed=None, amax=None, seed_base=None,
                        scale_rule="6") -> tuple[bool, str]:
    if (fmt, block) not in _FAKE_QUANTIZERS:
        return False, f"no decoding Triton quantizer for {fmt} with {block} blocks"
    return check_quantize(x, fmt, block)


def fake_quantize(x, fmt, block, rounding, seed, amax=None, seed_base=None, scale_rule="6") -> tuple:
    kernel = _FAKE_QUANTIZERS[fmt, block]
    stream = kernel_stream(x, rounding, seed, seed_base)
    return _own_amax(kernel(x, rounding, stream, **_given(amax), **_rule(scale_rule)), amax)


def check_fake_rht_quantize(x, size, fmt, block, rounding=None, seed=None, amax=None, seed_base=None,
                            scale_rule="6"):
    if fmt != "nvfp4":
        return False, f"no decoding RHT quantizer for {fmt}"
    return check_rht_quantize(x, size, fmt, block, scale_rule=scale_rule)


def fake_rht_quantize(x, size, fmt, block, rounding, seed, amax=None, seed_base=None, scale_rule="6") -> tuple:
    stream = kernel_stream(x, rounding, seed, seed_base)
    return _own_amax(fake_quantize_wgrad_operand(x.t(), rounding, stream, **_given(amax)), amax)


def check_fake_dual_quantize(x, size, fmt, *rest) -> tuple[bool, str]:
    """Both decoded operands of a [tokens, K] gradient in one launch (tokens a multiple of 16)."""
    if len(rest) > 8 and rest[8] != "6":
        return False, f"the one-launch kernel has no block scale rule {rest[8]!r} (the two quantizers in turn)"
    if fmt != "nvfp4" or size != 16:
        return False, f"the one-launch kernel does NVFP4 with the 16-point RHT, not {fmt} with {size}"
    if x.dim() != 2:
        return False, f"a {x.dim()}-D gradient (the kernel takes [tokens, K])"
    ok, why = check_quantize(x, fmt, "1x16")
    if ok and x.shape[0] % 16:
        return False, f"{x.shape[0]} tokens, not a multiple of 16"
    return ok, why


def fake_dual_quantize(x, size, fmt, rounding, seed, amax, rounding_t, seed_t, amax_t, seed_base=None,
                       seed_base_t=None, scale_rule="6") -> tuple:
    return fake_quantize_dual(
        x, rounding, kernel_stream(x, rounding, seed, seed_base), amax,
        rounding_t, kernel_stream(x, rounding_t, seed_t, seed_base_t), amax_t,
    )


def check_dual_quantize(x, size, fmt, *rest) -> tuple[bool, str]:
    """Both packed operands of a [tokens, K] gradient in one launch (tokens a multiple of 16)."""
    return check_fake_dual_quantize(x, size, fmt, *rest)


def dual_quantize(x, size, fmt, rounding, seed, amax, rounding_t, seed_t, amax_t, seed_base=None,
                  seed_base_t=None, scale_rule="6") -> tuple:
    return quantize_dual(
        x, rounding, kernel_stream(x, rounding, seed, seed_base), amax,
        rounding_t, kernel_stream(x, rounding_t, seed_t, seed_base_t), amax_t,
    )


def check_wgrad_amax(x, size) -> tuple[bool, str]:
    if size != 16:
        return False, f"a {size}-point RHT (the kernel does 16)"
    ok, why = _operand(x, 1)
    if ok and x.shape[0] % 16:
        return False, f"{x.shape[0]} tokens, not a multiple of 16"
    return ok, why


def wgrad_amax(x, size) -> tuple[torch.Tensor, torch.Tensor]:
    return _wgrad_amax(x)


def _packed(data: torch.Tensor) -> tuple[bool, str]:
    if not data.is_cuda:
        return False, f"its input is on {data.device.type}, not CUDA"
    ok, why = check_kernels()
    return (True, "") if ok else (False, why)


def check_transpose_quantized(data, scales, layout=None) -> tuple[bool, str]:
    return _packed(data)


def transpose_quantized(data, scales, layout="row_major") -> tuple[torch.Tensor, torch.Tensor]:
    return transpose_tiles(data, scales, swizzled=is_swizzled(data, scales), swizzle=layout == SWIZZLED)


def check_decode_blocks(data, scales) -> tuple[bool, str]:
    return _packed(data)


def decode_blocks(data, scales) -> torch.Tensor:
    return block_decode(data, scales, swizzled=is_swizzled(data, scales))


def check_emulated_mm(a, a_amax, b, b_amax, fmt, out_dtype, scale_rule="6") -> tuple[bool, str]:
    """The BF16 GEMM of decoded NVFP4 operands with an fp32 output, then the epilogue kernel (alpha)."""
    if fmt != "nvfp4":
        return False, f"alpha is NVFP4's: {fmt} operands need no epilogue"
    if a.dim() != 2 or b.dim() != 2:
        return False, f"batched operands ({a.dim()}-D and {b.dim()}-D; the GEMM takes 2-D)"
    return _packed(a)


def emulated_mm(a, a_amax, b, b_amax, fmt, out_dtype, scale_rule="6") -> torch.Tensor:
    return emulated_scaled_mm(a, a_amax, b, b_amax, out_dtype, scale_rule)


def check_cublaslt_mm(a, a_amax, b, b_amax, fmt, out_dtype, scale_rule="6") -> tuple[bool, str]:
    """One cuBLASLt GEMM with alpha in its epilogue (``codegen.cublaslt_gemm``, ``config.emulated_gemm``)."""
    from .. import cublaslt_gemm

    ok, why = check_emulated_mm(a, a_amax, b, b_amax, fmt, out_dtype)
    if not ok:
        return ok, why
    problem = cublaslt_gemm.dtype_problem(a.dtype, b.dtype, out_dtype)
    if problem and not cublaslt_gemm.required():  # required: the call raises it
        return False, problem
    if not cublaslt_gemm.enabled():
        ok, why = cublaslt_gemm.available()
        return False, "cuBLASLt GEMMs are off (FP4COMPILE_EMULATED_GEMM=torch)" if ok else f"cuBLASLt GEMMs cannot run here: {why}"
    return True, ""


def cublaslt_mm(a, a_amax, b, b_amax, fmt, out_dtype, scale_rule="6") -> torch.Tensor:
    return cublaslt_scaled_mm(a, a_amax, b, b_amax, out_dtype, scale_rule)


def check_packed_mm(a, a_scales, a_amax, b, b_scales, b_amax, fmt, out_dtype, scale_rule="6", b_kn=False) -> tuple[bool, str]:
    """The FP4-operand GEMM: 2-D packed NVFP4 operands."""
    if fmt != "nvfp4":
        return False, f"it decodes NVFP4 operands, not {fmt}"
    if a.dim() != 2 or b.dim() != 2:
        return False, f"batched operands ({a.dim()}-D and {b.dim()}-D; the GEMM takes 2-D)"
    return _packed(a)


def packed_mm(a, a_scales, a_amax, b, b_scales, b_amax, fmt, out_dtype, scale_rule="6", b_kn=False) -> torch.Tensor:
    return packed_scaled_mm(a, a_scales, a_amax, b, b_scales, b_amax, out_dtype, scale_rule, b_kn)
