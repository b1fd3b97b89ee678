"""Triton kernels that emulate NVFP4 and MXFP4 on GPUs without FP4 tensor cores (Hopper and older).

Every kernel produces exactly the bits of ``fp4compile.formats`` (the CPU reference): the same packed
E2M1 codes, E4M3 (or E8M0) block scales and global amax, including stochastic rounding (the
counter-based bits of ``formats.sr_random_bits`` are regenerated from (seed, flat index), one hash per
pair of elements) and the NaN/Inf/zero cases of the global scale. What they add is speed: one pass
over the tensor per kernel.

| function | what it returns | equals |
|---|---|---|
| ``global_amax(x)`` | max abs of x (fp32, NaN-propagating) | ``x.float().abs().amax()`` |
| ``wgrad_amax(x)`` | (amax of x, amax of RHT(x^T)), one read | ``(.., rht(x.t()).float().abs().amax())`` |
| ``quantize_1x16(x, rounding, seed, amax, swizzle)`` | (codes uint8 [M, K/2], scales uint8, amax) | ``quantize(x, "nvfp4", "1x16", ..)`` |
| ``quantize_16x16(w, ...)`` | same, 16x16 tiles (scales repeated per row) | ``quantize(w, "nvfp4", "16x16", ..)`` |
| ``quantize_wgrad_operand(x, rounding, seed, ..)`` | quantized RHT(x^T): [K, tokens/2] .. | ``quantize(rht(x.t()), ..)`` |
| ``quantize_mxfp4(x, rounding, seed)`` | (codes [M, K/2], E8M0 scale bytes [M, K/32], max abs of x) | ``quantize(x, "mxfp4", "1x32", ..)`` |
| ``quantize_wgrad_operand_mxfp4(x, ..)`` | the same for RHT(x^T): [K, tokens/2] .. | ``quantize(rht(x.t()), "mxfp4", ..)`` |
| ``fake_quantize_*`` | (value(code) * block scale in bf16, amax) | ``block_decode(quantize(..))`` |
| ``fake_quantize_dual(x, ..)`` | both decoded operands of a gradient: 1x16 and RHT(x^T), one launch | the two ``fake_quantize_*`` |
| ``quantize_dual(x, ..)`` | the same, packed: codes and scales of both | ``quantize_1x16`` and ``quantize_wgrad_operand`` |
| ``dequantize`` / ``block_decode`` | decoded tensor from codes and scales | ``formats.dequantize`` / ``block_decode`` |
| ``transpose_tiles(data, scales)`` | codes and scales of W^T from a 16x16-tile quantized W | ``QTensor.transpose()`` |
| ``emulated_scaled_mm(a_bd, amax_a, b_bd, amax_b)`` | (A_bd @ B_bd^T, fp32 accumulate) * alpha: torch.mm, then an epilogue kernel | ``reference.scaled_mm_reference`` |
| ``cublaslt_scaled_mm(a_bd, amax_a, b_bd, amax_b)`` | the same in one cuBLASLt GEMM, alpha in its epilogue | ``reference.scaled_mm_reference`` |
| ``packed_scaled_mm(a, sa, amax_a, b, sb, amax_b)`` | the same from packed codes and scales, decoded in registers: one launch | ``reference.scaled_mm_reference`` |

The fake-quant outputs are exact in bf16 (an E2M1 value times an E4M3 scale has at most 6 significant
bits), so an emulated FP4 GEMM is a plain bf16 GEMM with fp32 accumulation followed by the per-tensor
decode factors: the same arithmetic a Blackwell block-scaled GEMM does, up to the summation order.

MXFP4 has no global scale: its kernels quantize in one pass and take the amax they report on the side
(an atomic max over the bits of |x|, NaN above Inf). For NVFP4 a global amax needs a pass of its own
before the quantizing pass (the block scales depend on it). With ``amax=`` given, the quantizing pass
runs at once and tracks the tensor's own amax on the side, because a non-finite own amax wins over the
given one (as in ``formats.quantize``); a fix-up pass, which exits at once when the own amax is
finite, then redoes the tensor in that rare case.

Arithmetic notes: divisions use ``div_rn`` (Triton's ``/`` is approximate on NVIDIA GPUs); the one
product that feeds an addition where an FMA would change the bits (the RHT's sign and 1/4) is an
explicit round-to-nearest multiply, so the bits do not depend on the compiler's contraction setting;
E4M3 and E2M1 rounding are done on the fp32 bits (and one exact-by-construction fp32 addition); the
RHT runs the butterfly ``formats.rht`` defines (``z_i = x_i * s_i / 4``, then additions and
subtractions at strides 8, 4, 2, 1). Where an element's scaled value is NaN its code is +0 (code 0):
NaN has no E2M1 encoding, and the sign the CPU
reference gives such an element depends on its vector unit. docs/emulation.md has the details.

SR seeds: an int seed is passed to the kernel as it is; a ``runtime.DeviceSeed`` (what ``fp4.quantize``
passes on CUDA) makes the kernel compute ``runtime.sr_seed(node)`` itself from the step's base, read from
device memory when the kernel runs. Launching the kernel thus needs nothing that changes from step to
step, so Inductor can record a training step in a CUDA graph and every replay draws that step's bits.

Without a CUDA device the kernels run in Triton's interpreter on CPU tensors (slow; for tests).

The package is laid out by job: ``numerics`` (the device functions every kernel shares), ``rows``,
``rht``, ``mx`` and ``decode`` (the kernels by family), ``launch`` (launch parameters, grids, input
checks, the launch), ``gemm`` (the FP4-operand GEMM), ``api`` (the functions above) and ``dispatch`` (each op's check and call for the
executor table, ``fp4compile.executors``).
"""

from __future__ import annotations

from . import api, decode, dispatch, gemm, launch, mx, numerics, rht, rows
from .api import (
    available, global_amax, wgrad_amax, quantize_1x16, quantize_16x16, quantize_wgrad_operand, quantize_mxfp4,
    quantize_wgrad_operand_mxfp4, fake_quantize_1x16, fake_quantize_16x16, fake_quantize_wgrad_operand,
    fake_quantize_dual, quantize_dual, dequantize, block_decode, transpose_tiles, emulated_scaled_mm, cublaslt_scaled_mm, gemm_alpha,
    packed_scaled_mm,
)
from .launch import CONFIGS

__all__ = [
    "available",
    "global_amax",
    "wgrad_amax",
    "quantize_1x16",
    "quantize_16x16",
    "quantize_wgrad_operand",
    "quantize_mxfp4",
    "quantize_wgrad_operand_mxfp4",
    "fake_quantize_1x16",
    "fake_quantize_16x16",
    "fake_quantize_wgrad_operand",
    "fake_quantize_dual",
    "dequantize",
    "block_decode",
    "transpose_tiles",
    "emulated_scaled_mm",
    "cublaslt_scaled_mm",
    "gemm_alpha",
    "packed_scaled_mm",
    "quantize_dual",
    "CONFIGS",
]
