"""The ``fp4`` operator namespace: the nodes the passes insert into FX graphs.

Each op has a reference implementation (``fp4compile.reference``, any device), a fake implementation
for tracing, and, where the codegen module has one, a faster kernel; the ops that have several run
through the executor table (``fp4compile.executors``), which picks an implementation per call and says
why. Tensors cross op boundaries in plain dtypes (packed E2M1 codes and E4M3/E8M0 scales as ``uint8``)
so that every inner compiler can hold them in buffers; ``formats.QTensor`` is rebuilt inside the
implementations.

| op | meaning |
|---|---|
| ``fp4.gemm(a, b, role, site)`` | role-tagged C = a @ b.T (last two dims) in the compute dtype (before lowering) |
| ``fp4.quantize(x, fmt, block, rounding, seed, check, amax=None)`` | packed codes, block scales, global amax (given: computed earlier) |
| ``fp4.dequantize(data, scales, amax, fmt, block, dtype)`` | the exact decode of NUMERICS |
| ``fp4.rht(x, size)`` | blockwise random Hadamard transform along the last dim |
| ``fp4.wgrad_amax(x, size)`` | (max abs of x, max abs of rht(x.T)) from one read: the amaxes the quantize ops take |
| ``fp4.scaled_mm(a, sa, amax_a, b, sb, amax_b, fmt, out_dtype, kernel)`` | FP4 GEMM, fp32 accumulate |
| ``fp4.fake_quantize(x, fmt, block, rounding, seed)`` / ``fp4.fake_rht_quantize(x, size, ...)`` | block-decoded operand (bf16) and amax |
| ``fp4.fake_dual_quantize(x, size, fmt, rounding, seed, check, rounding_t, seed_t, check_t, amax, amax_t)`` | the two decoded operands of a gradient (1x16, and RHT(x.T)) in one launch |
| ``fp4.dual_quantize(x, size, fmt, rounding, seed, check, rounding_t, seed_t, check_t, amax, amax_t)`` | the same two quantizations of a gradient, packed (codes and scales of each), in one launch |
| ``fp4.emulated_mm(a_bd, amax_a, b_bd, amax_b, fmt, out_dtype)`` | emulated FP4 GEMM on block-decoded operands |
| ``fp4.cublaslt_mm(a, b, alpha, out_dtype)`` | ``fp4.emulated_mm`` of block-decoded a, b as the lowered graphs call cuBLASLt: alpha computed in the graph, one GEMM with alpha in its epilogue (not through the executor table) |
| ``fp4.packed_mm(a, sa, amax_a, b, sb, amax_b, fmt, out_dtype, scale_rule, b_kn)`` | emulated NVFP4 GEMM reading packed operands, decoded in registers (one Triton kernel on CUDA) |
| ``fp4.record_amax(history, amax)`` | shifts an activation amax history and writes ``amax`` last, in place (``fp4compile.ranges``) |
| ``fp4.record_stats(stats, slot, x, codes, scales, amax, block, scale_rule)`` | shifts a quantization statistics window and writes the statistics of x's quantization last, in place (``fp4compile.quant_stats``) |
| ``fp4.sr_base(device, keys)`` | the step's stochastic-rounding base on the device mixed with each SR node constant of a graph (int64 [2 * len(keys)]), computed when the graph runs |

The ops with Triton kernels (the quantizers, ``wgrad_amax``, ``transpose_quantized``, ``decode_blocks``, the emulated GEMMs)
are ``torch.library.triton_op``s: the ``lower_kernels`` pass replaces each call that a kernel takes by
the kernels themselves, which Inductor then compiles, caches and launches like its own. Called eagerly
(or where no kernel takes the call) the same function runs: the kernels on CUDA, else the reference.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Optional

import torch
from torch._subclasses.functional_tensor import FunctionalTensorMode

from . import executors, formats, reference, runtime, scale_layout
# The reference GEMM and decode, where the ops' callers have always found them.
from .reference import block_decode, qtensor as _qtensor, scaled_mm_reference  # noqa: F401


def _custom_op(name: str):
    """``torch.library.custom_op(name)`` for a function without mutated arguments: an op that stays one
    node in every graph (its implementation runs when the compiled graph runs)."""

    def register(fn):
        return torch.library.custom_op(name, mutates_args=())(fn)

    return register


_lowering = threading.local()


@contextlib.contextmanager
def tracing_kernels():
    """While active in this thread, a functional trace (``make_fx`` under ``FunctionalTensorMode``) of a
    kernel op records the op's implementation instead of the op: its Triton kernels as
    ``triton_kernel_wrapper_functional`` nodes, which Inductor compiles, caches and launches in its
    generated code. The ``lower_kernels`` pass traces with it; elsewhere (AOTAutograd's trace of the
    model) kernel ops stay single nodes, so that the passes see them."""
    previous = getattr(_lowering, "active", False)
    _lowering.active = True
    try:
        yield
    finally:
        _lowering.active = previous


def _kernel_op(name: str):
    """``torch.library.triton_op(name)``: an op whose CUDA implementation is Triton kernels launched
    through ``wrap_triton`` (``codegen.triton_kernels``), decomposed into them only by a trace under
    ``tracing_kernels`` (not by every functional trace, as ``triton_op`` does by default). The same
    function runs eagerly on every device: the reference implementation where no kernel takes the call."""

    def register(fn):
        op = torch.library.triton_op(name, fn, mutates_args=())

        def functional(mode, op_overload, types, args, kwargs):
            if not getattr(_lowering, "active", False):
                return mode.__torch_dispatch__(op_overload, types, args, kwargs)
            with mode:
                return fn(*args, **kwargs)

        op.register_torch_dispatch(FunctionalTensorMode, functional)
        return op

    return register


# ---------------------------------------------------------------------------------------------
# fp4.gemm: the role-tagged GEMM the marking pass produces (high precision until lowered)
# ---------------------------------------------------------------------------------------------


@_custom_op("fp4::gemm")
def gemm(
    a: torch.Tensor, b: torch.Tensor, role: str, site: int, dtype: torch.dtype,
    b_codes: Optional[torch.Tensor] = None, b_scales: Optional[torch.Tensor] = None,
    b_amax: Optional[torch.Tensor] = None, x_amax: Optional[torch.Tensor] = None,
    x_history: Optional[torch.Tensor] = None, stats: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """C = a @ b.T in ``dtype`` (the model's compute dtype) with a [M, K], b [N, K], or batched
    a [..., M, K], b [..., N, K] with the same leading dims (activation matmuls).

    Operands arrive as the model holds them (e.g. fp32 master weights under BF16 autocast), so that
    quantization reads the full-precision tensor. ``b_codes, b_scales, b_amax``, where given, are b's
    NVFP4 16x16-tile quantization made once for fprop and dgrad (``passes/plan_sharing``):
    ``insert_quantize`` uses it instead of quantizing b again (for dgrad, whose b is W^T, they are W's
    codes and scales as the forward made them, and ``insert_quantize`` transposes them). ``x_amax``,
    where given, is the global amax of the activation operand as its NVFP4 quantizer sees it: max |X|
    for fprop's a, max |RHT(X^T)| for wgrad's b (``passes/plan_sharing``); ``insert_quantize``
    hands it to that quantizer. ``x_history``, where given (fprop), is the site's activation amax
    history (``fp4compile.ranges``): the forward graph records the amax of a's quantizer into it.
    ``stats``, where given, is the site's quantization statistics buffer (``fp4compile.quant_stats``):
    the graphs record the statistics of both operands' quantizations into it.
    Before the passes lower it, the op computes the high-precision product and ignores all of these.
    """
    return a.to(dtype) @ b.to(dtype).transpose(-2, -1)


@gemm.register_fake
def _(a, b, role, site, dtype, b_codes=None, b_scales=None, b_amax=None, x_amax=None, x_history=None, stats=None):
    return a.new_empty((*a.shape[:-1], b.shape[-2]), dtype=dtype)


# ---------------------------------------------------------------------------------------------
# fp4.quantize / fp4.dequantize
# ---------------------------------------------------------------------------------------------


@_custom_op("fp4::sr_base")
def sr_base(device: torch.device, keys: list[int]) -> torch.Tensor:
    """The current step's stochastic-rounding base on ``device`` mixed with each of ``keys`` (the SR node
    constants of a graph): int64 [2 * len(keys)] with ``base ^ keys[i]`` at 2i, what the quantize kernel
    of node i reads as its ``seed_base`` (a one-element view, 16-byte aligned). Computed when the graph
    runs, from the tensor the runtime rewrites at every step (``runtime.device_base``): recorded in a
    CUDA graph, each replay mixes that step's base. One op for a graph's nodes: one small kernel, the
    same for every node, instead of one per node constant."""
    return (runtime.device_base(device) ^ runtime.device_keys(device, tuple(keys))).view(-1)


@sr_base.register_fake
def _(device, keys):
    return torch.empty(2 * len(keys), dtype=torch.int64, device=device)


def _check_amax(amax: Optional[torch.Tensor], fmt: str, x: torch.Tensor, what: str) -> None:
    """An operand's own amax computed by an earlier node: NVFP4 only, one value."""
    if amax is None:
        return
    if fmt != "nvfp4":
        raise ValueError(f"fp4compile: {what} of a {tuple(x.shape)} tensor: only NVFP4 has a global amax to give, not {fmt}")
    if amax.numel() != 1:
        raise ValueError(f"fp4compile: {what} of a {tuple(x.shape)} tensor: amax must hold one value, got shape {tuple(amax.shape)}")


@_kernel_op("fp4::quantize")
def quantize(
    x: torch.Tensor, fmt: str, block: str, rounding: str, seed: int, check: str,
    amax: Optional[torch.Tensor] = None, seed_base: Optional[torch.Tensor] = None, layout: str = "row_major",
    scale_rule: str = "6",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (packed codes uint8 [M, K/2], block scales uint8 [M, K/block], amax fp32 0-dim).

    ``amax`` (NVFP4): x's own max |x|, computed by an earlier node (the ``fuse_amax`` pass has the
    operand's producer or ``fp4.wgrad_amax`` compute it); the kernel then makes no amax pass of its own.
    It must be exactly that value: the quantizer trusts it.

    With ``rounding == "sr"`` the random stream is ``runtime.sr_seed(seed)``: the graph's constant mixed
    with the SR state, which advances on every compiled call made with gradients enabled. A non-empty ``check`` names the
    operand ("layer role operand"): non-finite input then raises ``FloatingPointError``. ``seed_base``
    (CUDA): an int64 [1] tensor the kernel mixes ``seed`` with instead of the step's base (the
    ``lower_kernels`` pass gives the step's base already mixed with the node's constant, a slice of
    ``fp4.sr_base``, and seed 0; without it the kernel reads the runtime's copy of the base).

    ``layout="swizzled"`` (2-D NVFP4 x): the scales in the 1-D 128x4 tiled layout CUTLASS GEMMs read
    (``fp4compile.scale_layout``), the bytes of ``formats.swizzle_scales`` of the row-major ones.

    ``scale_rule`` (NVFP4): the block scale rule, "6" (the recipe's) or "4/6" (Four Over Six: each block
    scaled to 6 or to 4, whichever dequantizes closer; amax maps to 6 * 256, ``formats.nvfp4_encode``).
    Whatever reads the result (``dequantize``, the GEMMs' alpha) must be given the same rule.
    """
    _check_amax(amax, fmt, x, "fp4.quantize")
    scale_layout.check(layout, fmt, x, "fp4.quantize")
    formats._check_scale_rule(scale_rule, fmt)
    data, scales, amax = executors.run("quantize", x, fmt, block, rounding, seed, amax, seed_base, layout, scale_rule)
    _check_finite(check, amax, x)
    return data, scales, amax


def _check_finite(check: str, amax: torch.Tensor, x: torch.Tensor, rht_size: int = 0) -> None:
    """With a ``check`` label, raise the non-finite error when the quantized operand's amax is not
    finite; it counts in ``formats.rht(x, rht_size)`` for the weight-gradient operands (a finite x can
    overflow in the RHT)."""
    if check and not bool(torch.isfinite(amax)):
        runtime.raise_non_finite(check, formats.rht(x, rht_size) if rht_size else x)


@quantize.register_fake
def _quantize_fake(x, fmt, block, rounding, seed, check, amax=None, seed_base=None, layout="row_major", scale_rule="6"):
    cols = formats._BLOCK_SHAPES[block][1]
    shape = x.shape[:-1]
    rows = x.shape[0] if x.dim() == 2 else 0
    return (
        x.new_empty((*shape, x.shape[-1] // 2), dtype=torch.uint8),
        scale_layout.fake_scales(x, rows, x.shape[-1] // cols, layout, (*shape, x.shape[-1] // cols)),
        x.new_empty((), dtype=torch.float32),
    )


@_kernel_op("fp4::rht_quantize")
def rht_quantize(
    x: torch.Tensor, size: int, fmt: str, block: str, rounding: str, seed: int, check: str,
    amax: Optional[torch.Tensor] = None, seed_base: Optional[torch.Tensor] = None, layout: str = "row_major",
    scale_rule: str = "6",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fp4.quantize(fp4.rht(x, size), ...)`` in one op: what the weight-gradient operands need.

    The bits of the CPU reference ``formats.quantize(formats.rht(x, size), ...)``, with the SR stream of
    the two ops. Where a fused kernel takes the call (on CUDA: for NVFP4 a Triton kernel pair, for MXFP4
    1x32 one Triton kernel, that reads x, transforms it summing in the reference's order, and quantizes)
    the RHT output is never written out. Elsewhere the op runs ``formats.rht`` and then the quantizer.
    A given ``amax`` (NVFP4) is that of ``formats.rht(x, size)`` (``fp4.wgrad_amax``'s second result);
    ``seed_base``, ``layout`` and ``scale_rule`` as ``fp4.quantize``.
    """
    _check_amax(amax, fmt, x, "fp4.rht_quantize")
    scale_layout.check(layout, fmt, x, "fp4.rht_quantize")
    formats._check_scale_rule(scale_rule, fmt)
    data, scales, amax = executors.run("rht_quantize", x, size, fmt, block, rounding, seed, amax, seed_base, layout,
                                       scale_rule)
    _check_finite(check, amax, x, size)
    return data, scales, amax


@rht_quantize.register_fake
def _(x, size, fmt, block, rounding, seed, check, amax=None, seed_base=None, layout="row_major", scale_rule="6"):
    return _quantize_fake(x, fmt, block, rounding, seed, check, layout=layout)


@_kernel_op("fp4::wgrad_amax")
def wgrad_amax(x: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(max |x|, max |formats.rht(x.T, size)|) as fp32 0-dim tensors, for x [tokens, K]: the two global
    amaxes a tensor quantized both for a forward/dgrad GEMM (1x16 along K) and for the weight-gradient
    GEMM (RHT along tokens) needs, from one read of x on CUDA (a Triton kernel; ``size`` 16, tokens a
    multiple of 16). NaN where the tensor (or its transform) holds a NaN, as ``torch.amax``."""
    if x.dim() != 2:
        raise ValueError(f"fp4.wgrad_amax takes a [tokens, K] tensor, got shape {tuple(x.shape)}")
    return executors.run("wgrad_amax", x, size)


@wgrad_amax.register_fake
def _(x, size):
    return x.new_empty((), dtype=torch.float32), x.new_empty((), dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# fp4.fake_quantize / fp4.fake_rht_quantize: the decoded operands of the emulated GEMM
# ---------------------------------------------------------------------------------------------


@_kernel_op("fp4::fake_quantize")
def fake_quantize(
    x: torch.Tensor, fmt: str, block: str, rounding: str, seed: int, check: str,
    amax: Optional[torch.Tensor] = None, seed_base: Optional[torch.Tensor] = None, scale_rule: str = "6",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block-decoded ``fp4.quantize(x, ...)`` in bfloat16 with x's shape, amax): the same codes and
    scales, handed to the emulated GEMM already decoded (``fp4.emulated_mm``). Where a kernel takes the
    call (on CUDA, NVFP4: one Triton pass after the amax pass) the packed codes are never written and
    no separate decode pass runs. Seeds, the ``check`` label and a given ``amax`` as ``fp4.quantize``."""
    _check_amax(amax, fmt, x, "fp4.fake_quantize")
    formats._check_scale_rule(scale_rule, fmt)
    decoded, amax = executors.run("fake_quantize", x, fmt, block, rounding, seed, amax, seed_base, scale_rule)
    _check_finite(check, amax, x)
    return decoded, amax


@fake_quantize.register_fake
def _(x, fmt, block, rounding, seed, check, amax=None, seed_base=None, scale_rule="6"):
    return x.new_empty(x.shape, dtype=torch.bfloat16), x.new_empty((), dtype=torch.float32)


@_kernel_op("fp4::fake_rht_quantize")
def fake_rht_quantize(
    x: torch.Tensor, size: int, fmt: str, block: str, rounding: str, seed: int, check: str,
    amax: Optional[torch.Tensor] = None, seed_base: Optional[torch.Tensor] = None, scale_rule: str = "6",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block-decoded ``fp4.rht_quantize(x, size, ...)`` in bfloat16, amax): the weight-gradient operand
    as ``fp4.emulated_mm`` reads it. On CUDA (NVFP4) the fused transpose + RHT + quantize kernel writes
    the decoded values directly. A given ``amax`` as ``fp4.rht_quantize``."""
    _check_amax(amax, fmt, x, "fp4.fake_rht_quantize")
    formats._check_scale_rule(scale_rule, fmt)
    decoded, amax = executors.run("fake_rht_quantize", x, size, fmt, block, rounding, seed, amax, seed_base, scale_rule)
    _check_finite(check, amax, x, size)
    return decoded, amax


@fake_rht_quantize.register_fake
def _(x, size, fmt, block, rounding, seed, check, amax=None, seed_base=None, scale_rule="6"):
    return x.new_empty(x.shape, dtype=torch.bfloat16), x.new_empty((), dtype=torch.float32)


@_kernel_op("fp4::fake_dual_quantize")
def fake_dual_quantize(
    x: torch.Tensor, size: int, fmt: str, rounding: str, seed: int, check: str,
    rounding_t: str, seed_t: int, check_t: str, amax: torch.Tensor, amax_t: torch.Tensor,
    seed_base: Optional[torch.Tensor] = None, seed_base_t: Optional[torch.Tensor] = None, scale_rule: str = "6",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``fp4.fake_quantize(x, fmt, "1x16", rounding, seed, check, amax)[0]``,
    ``fp4.fake_rht_quantize(x.t(), size, fmt, "1x16", rounding_t, seed_t, check_t, amax_t)[0]``): a
    [tokens, K] gradient dY block-decoded for dgrad and, with the RHT, for wgrad, with both amaxes its
    own (``fp4.wgrad_amax``). On CUDA one Triton launch quantizes each tile of x both ways (its second
    read mostly from L2); elsewhere the two ops run in turn. The bits are those of the two ops.
    ``seed_base_t``: the base the second stream mixes ``seed_t`` with (default ``seed_base``)."""
    seed_base_t = seed_base if seed_base_t is None else seed_base_t
    _check_amax(amax, fmt, x, "fp4.fake_dual_quantize")
    _check_amax(amax_t, fmt, x, "fp4.fake_dual_quantize")
    formats._check_scale_rule(scale_rule, fmt)
    rows, transformed = executors.run(
        "fake_dual_quantize", x, size, fmt, rounding, seed, amax, rounding_t, seed_t, amax_t, seed_base, seed_base_t,
        scale_rule,
    )
    _check_finite(check, amax, x)
    _check_finite(check_t, amax_t, x.t(), size)
    return rows, transformed


@fake_dual_quantize.register_fake
def _(x, size, fmt, rounding, seed, check, rounding_t, seed_t, check_t, amax, amax_t, seed_base=None,
      seed_base_t=None, scale_rule="6"):
    return x.new_empty(x.shape, dtype=torch.bfloat16), x.new_empty((x.shape[1], x.shape[0]), dtype=torch.bfloat16)


@_kernel_op("fp4::dual_quantize")
def dual_quantize(
    x: torch.Tensor, size: int, fmt: str, rounding: str, seed: int, check: str,
    rounding_t: str, seed_t: int, check_t: str, amax: torch.Tensor, amax_t: torch.Tensor,
    seed_base: Optional[torch.Tensor] = None, seed_base_t: Optional[torch.Tensor] = None, scale_rule: str = "6",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fp4.fake_dual_quantize`` with packed outputs: (codes, scales) of ``fp4.quantize(x, fmt, "1x16",
    rounding, seed, check, amax)`` and (codes, scales) of ``fp4.rht_quantize(x.t(), size, fmt, "1x16",
    rounding_t, seed_t, check_t, amax_t)``, both amaxes x's own (``fp4.wgrad_amax``): a [tokens, K] gradient
    quantized for dgrad and, with the RHT, for wgrad. On CUDA one Triton launch quantizes each tile of x
    both ways; elsewhere the two ops run in turn. The bits are those of the two ops."""
    seed_base_t = seed_base if seed_base_t is None else seed_base_t
    _check_amax(amax, fmt, x, "fp4.dual_quantize")
    _check_amax(amax_t, fmt, x, "fp4.dual_quantize")
    formats._check_scale_rule(scale_rule, fmt)
    out = executors.run(
        "dual_quantize", x, size, fmt, rounding, seed, amax, rounding_t, seed_t, amax_t, seed_base, seed_base_t,
        scale_rule,
    )
    _check_finite(check, amax, x)
    _check_finite(check_t, amax_t, x.t(), size)
    return tuple(out)


@dual_quantize.register_fake
def _(x, size, fmt, rounding, seed, check, rounding_t, seed_t, check_t, amax, amax_t, seed_base=None,
      seed_base_t=None, scale_rule="6"):
    tokens, k = x.shape
    u8 = torch.uint8
    return (x.new_empty((tokens, k // 2), dtype=u8), x.new_empty((tokens, k // 16), dtype=u8),
            x.new_empty((k, tokens // 2), dtype=u8), x.new_empty((k, tokens // 16), dtype=u8))


@_kernel_op("fp4::transpose_quantized")
def transpose_quantized(
    data: torch.Tensor, scales: torch.Tensor, layout: str = "row_major"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of W^T from those of W [N, K] quantized with NVFP4 16x16 tiles: codes [K, N/2] and
    scales [K, N/16] (the tile scales, repeated on each row, as ``formats`` stores them), or with ``layout``
    "swizzled" their tiled layout; W's scales in either layout (``scale_layout``). Bit for bit what
    quantizing W^T gives (docs/numerics.md: one quantized weight for fprop and dgrad), without reading W."""
    n, k = (data.shape[0], data.shape[1] * 2) if data.dim() == 2 else (0, 0)
    tiled = scale_layout.is_swizzled(data, scales)
    if data.dim() != 2 or n % 16 or k % 16 or (scales.numel() != scale_layout.swizzled_numel(n, k // 16) if tiled
                                                else tuple(scales.shape) != (n, k // 16)):
        raise ValueError(
            f"fp4.transpose_quantized takes a 16x16-tile quantized [N, K] weight (N, K multiples of 16): "
            f"got codes {tuple(data.shape)} and scales {tuple(scales.shape)}"
        )
    scale_layout.check(layout, "nvfp4", data, "fp4.transpose_quantized")
    return executors.run("transpose_quantized", data, scales, layout)


@transpose_quantized.register_fake
def _(data, scales, layout="row_major"):
    n, k = data.shape[0], data.shape[1] * 2
    return data.new_empty((k, n // 2)), scale_layout.fake_scales(scales, k, n // 16, layout)


@_kernel_op("fp4::decode_blocks")
def decode_blocks(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """value(code) * block scale in bfloat16 (exact) of NVFP4 codes [M, K/2] with E4M3 scales [M, K/16]:
    the operand an emulated GEMM (``fp4.emulated_mm``) reads, for operands quantized elsewhere (a weight
    quantized once for fprop and dgrad), scales in either layout. On CUDA one Triton pass."""
    return executors.run("decode_blocks", data, scales)


@decode_blocks.register_fake
def _(data, scales):
    return data.new_empty((*data.shape[:-1], data.shape[-1] * 2), dtype=torch.bfloat16)


@_custom_op("fp4::dequantize")
def dequantize(
    data: torch.Tensor, scales: torch.Tensor, amax: torch.Tensor, fmt: str, block: str, dtype: torch.dtype,
    scale_rule: str = "6",
) -> torch.Tensor:
    shape = (*data.shape[:-1], data.shape[-1] * 2)
    return formats.dequantize(_qtensor(data, scales, amax, fmt, block, shape, scale_rule=scale_rule), dtype)


@dequantize.register_fake
def _(data, scales, amax, fmt, block, dtype, scale_rule="6"):
    return data.new_empty((*data.shape[:-1], data.shape[-1] * 2), dtype=dtype)


# ---------------------------------------------------------------------------------------------
# fp4.rht
# ---------------------------------------------------------------------------------------------


@_custom_op("fp4::rht")
def rht(x: torch.Tensor, size: int) -> torch.Tensor:
    """Blockwise random Hadamard transform along the last dim, default sign vector."""
    # The output keeps the input's layout (as the fake does), whatever strides the compiler picks.
    return torch.empty_like(x).copy_(formats.rht(x, size))


@rht.register_fake
def _(x, size):
    return torch.empty_like(x)


# ---------------------------------------------------------------------------------------------
# fp4.scaled_mm
# ---------------------------------------------------------------------------------------------


@_custom_op("fp4::scaled_mm")
def scaled_mm(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    a_amax: torch.Tensor,
    b: torch.Tensor,
    b_scales: torch.Tensor,
    b_amax: torch.Tensor,
    fmt: str,
    out_dtype: torch.dtype,
    kernel: str,
    scale_rule: str = "6",
) -> torch.Tensor:
    """C = A @ B.T for packed FP4 operands A [M, K/2], B [N, K/2] (or batched [..., M, K/2], [..., N, K/2]);
    ``kernel`` names the implementation chosen at compile time (``executors.choose_gemm``); ``scale_rule``:
    the operands' NVFP4 block scale rule, which sets alpha's constant (``formats.gemm_alpha``)."""
    return executors.run_scaled_mm(kernel, a, a_scales, a_amax, b, b_scales, b_amax, fmt, out_dtype, scale_rule)


@scaled_mm.register_fake
def _(a, a_scales, a_amax, b, b_scales, b_amax, fmt, out_dtype, kernel, scale_rule="6"):
    return a.new_empty((*a.shape[:-1], b.shape[-2]), dtype=out_dtype)


@_kernel_op("fp4::emulated_mm")
def emulated_mm(
    a: torch.Tensor, a_amax: torch.Tensor, b: torch.Tensor, b_amax: torch.Tensor, fmt: str, out_dtype: torch.dtype,
    scale_rule: str = "6",
) -> torch.Tensor:
    """C = A @ B.T for block-decoded operands A [M, K], B [N, K] (bfloat16, from ``fp4.fake_quantize``):
    fp32 accumulation, then alpha = ``formats.gemm_alpha(a_amax, b_amax)`` (NVFP4) once, cast to
    ``out_dtype``; the arithmetic of ``fp4.scaled_mm``'s emulation on the same operands. On CUDA: one
    cuBLASLt GEMM with alpha in its epilogue where ``codegen.cublaslt_gemm`` runs, else ``torch.mm``
    with an fp32 output and the Triton epilogue kernel (``triton_kernels.emulated_scaled_mm``), which the
    ``lower_kernels`` pass puts into the graph Inductor compiles. ``scale_rule`` as ``fp4.scaled_mm``."""
    return executors.run("emulated_mm", a, a_amax, b, b_amax, fmt, out_dtype, scale_rule)


@emulated_mm.register_fake
def _(a, a_amax, b, b_amax, fmt, out_dtype, scale_rule="6"):
    return a.new_empty((*a.shape[:-1], b.shape[-2]), dtype=out_dtype)


# fp4.cublaslt_mm: where cuBLASLt runs an emulated GEMM of a graph Inductor compiles, ``lower_kernels``
# computes alpha in the graph and leaves this op, the GEMM alone. Defined on a library fragment, its
# implementations registered straight on their dispatch keys (not through the executor table: the
# lowering chose cuBLASLt already): Inductor's code calls it at every step, through the dispatcher
# straight to its kernel, without a custom op's Python wrapping.
_library = torch.library.Library("fp4", "FRAGMENT")
_library.define("cublaslt_mm(Tensor a, Tensor b, Tensor alpha, ScalarType out_dtype) -> Tensor")


def _cublaslt_mm(a: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """One cuBLASLt GEMM reading alpha in its epilogue (``codegen.cublaslt_gemm.mm_alpha``); a problem
    cuBLASLt has no algorithm for runs ``reference.alpha_product``, logged once (an error where
    ``FP4COMPILE_EMULATED_GEMM=cublaslt``)."""
    from fp4compile.codegen import cublaslt_gemm  # the ops import no codegen when they load

    try:
        return cublaslt_gemm.mm_alpha(a, b, alpha, out_dtype)
    except cublaslt_gemm.Unsupported as err:
        if cublaslt_gemm.required():
            raise
        cublaslt_gemm.log_fallback(err)
    return reference.alpha_product(a, b, alpha, out_dtype)


_library.impl("cublaslt_mm", _cublaslt_mm, "CUDA")
_library.impl("cublaslt_mm", reference.alpha_product, "CompositeExplicitAutograd")


@torch.library.register_fake("fp4::cublaslt_mm")
def _(a, b, alpha, out_dtype):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


@_kernel_op("fp4::packed_mm")
def packed_mm(
    a: torch.Tensor, a_scales: torch.Tensor, a_amax: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
    b_amax: torch.Tensor, fmt: str, out_dtype: torch.dtype, scale_rule: str = "6", b_kn: bool = False,
) -> torch.Tensor:
    """C = A @ B.T for packed NVFP4 operands A [M, K/2], B [N, K/2] (codes, E4M3 scales, global amax), or
    with ``b_kn`` B given as W [K, N/2] of a 16x16-tile quantized W (B = W^T: dgrad's weight as stored):
    ``fp4.scaled_mm``'s arithmetic (decode, fp32 accumulation, alpha, cast). On CUDA one Triton kernel
    decodes the operands in registers inside its K loop (``triton_kernels.packed_scaled_mm``), which the
    ``lower_kernels`` pass puts into the graph Inductor compiles; elsewhere the reference."""
    return executors.run("packed_mm", a, a_scales, a_amax, b, b_scales, b_amax, fmt, out_dtype, scale_rule, b_kn)


@packed_mm.register_fake
def _(a, a_scales, a_amax, b, b_scales, b_amax, fmt, out_dtype, scale_rule="6", b_kn=False):
    return a.new_empty((a.shape[0], b.shape[1] * 2 if b_kn else b.shape[0]), dtype=out_dtype)


# ---------------------------------------------------------------------------------------------
# fp4.linear: what the marking pass puts in the dynamo graph
# ---------------------------------------------------------------------------------------------


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype autocast computes in on ``device_type``; None where autocast is off there, or where the
    device has no autocast (a model built on the meta device is traced with meta tensors)."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return autocast_dtype(x.device.type) or x.dtype


def _autocast_input(x: torch.Tensor) -> torch.Tensor:
    """An activation entering an FP4 GEMM under autocast, cast to the autocast dtype as autocast casts
    ``F.linear``'s inputs (floating point, not float64): it is quantized from, and saved for the
    backward in, the precision the BF16 model would use (LayerNorm outputs arrive in float32 under
    autocast). Weights are quantized from the parameters as stored."""
    dtype = autocast_dtype(x.device.type)
    if dtype is not None and x.is_floating_point() and x.dtype not in (torch.float64, dtype):
        return x.to(dtype)
    return x


class _LinearFunction(torch.autograd.Function):
    """y = x W^T + b whose forward and backward are three role-tagged ``fp4.gemm`` calls.

    aot_autograd traces through this function, so the forward graph holds the fprop GEMM and the
    backward graph the dgrad and wgrad GEMMs, each tagged with its role and GEMM site for the passes.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, site: int, dtype: torch.dtype, amax_history, stats):
        x2 = x.reshape(-1, x.shape[-1])
        recorded = {"stats": stats} if stats is not None else {}
        y = torch.ops.fp4.gemm(x2, weight, "fprop", site, dtype, x_history=amax_history, **recorded)
        ctx.save_for_backward(x2, weight, stats)
        if bias is not None:
            y = y + bias.to(dtype)
        ctx.site, ctx.dtype = site, dtype
        ctx.x_shape = x.shape
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        ctx.has_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        # Not y.reshape: a view made inside a custom Function is an output autograd forbids modifying in
        # place (``nn.ReLU(inplace=True)``, ``y += x`` on the linear's output). ``_unsafe_view`` (what
        # ``torch.matmul`` returns) is the same zero-copy reshape of the contiguous GEMM output without
        # autograd's view tracking; y itself is neither saved nor used again.
        return torch.ops.aten._unsafe_view(y, (*x.shape[:-1], weight.shape[0]))

    @staticmethod
    def backward(ctx, dy):
        x2, w, stats = ctx.saved_tensors
        recorded = {"stats": stats} if stats is not None else {}
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = torch.ops.fp4.gemm(dy2, w.t(), "dgrad", ctx.site, ctx.dtype, **recorded)
            dx = dx.reshape(ctx.x_shape).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dw = torch.ops.fp4.gemm(dy2.t(), x2.t(), "wgrad", ctx.site, ctx.dtype, **recorded)
            dw = dw.to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0).to(ctx.bias_dtype)
        return dx, dw, db, None, None, None, None


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], site: int,
    amax_history: Optional[torch.Tensor] = None, stats: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``F.linear`` whose three GEMMs carry role and site tags (see ``_LinearFunction``). What the GEMMs
    share across the forward and the backward (one quantization of W, one read of X for its two amaxes)
    is planned on the joint graph (``passes/plan_sharing``). ``amax_history``: the site's activation amax
    history (``fp4compile.ranges``), which the forward graph records fprop's amax of X into. ``stats``:
    the site's quantization statistics buffer (``fp4compile.quant_stats``), which the three GEMMs'
    quantizers record into.
    """
    x = _autocast_input(x)
    return _LinearFunction.apply(x, weight, bias, site, _compute_dtype(x), amax_history, stats)


linear.__name__ = "fp4_linear"


class _MatmulFunction(torch.autograd.Function):
    """C = A @ B for two activations A [..., M, K], B [..., K, N] (same leading dims), computed like a
    linear whose weight is B: fprop C = fp4.gemm(A, B^T), dgrad dA = fp4.gemm(dC, B), wgrad
    dB = fp4.gemm(A^T, dC^T) (reduction over M)."""

    @staticmethod
    def forward(ctx, a, b, site: int, dtype: torch.dtype):
        c = torch.ops.fp4.gemm(a, b.transpose(-2, -1), "fprop", site, dtype)
        ctx.save_for_backward(a, b)
        ctx.site, ctx.dtype = site, dtype
        ctx.a_dtype, ctx.b_dtype = a.dtype, b.dtype
        return c

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        da = db = None
        if ctx.needs_input_grad[0]:
            da = torch.ops.fp4.gemm(dc, b, "dgrad", ctx.site, ctx.dtype).to(ctx.a_dtype)
        if ctx.needs_input_grad[1]:
            db = torch.ops.fp4.gemm(
                a.transpose(-2, -1), dc.transpose(-2, -1), "wgrad", ctx.site, ctx.dtype
            ).to(ctx.b_dtype)
        return da, db, None, None


def matmul(a: torch.Tensor, b: torch.Tensor, site: int) -> torch.Tensor:
    """``a @ b`` of two activations whose three GEMMs carry role and site tags (see ``_MatmulFunction``)."""
    a, b = _autocast_input(a), _autocast_input(b)
    return _MatmulFunction.apply(a, b, site, _compute_dtype(a))


matmul.__name__ = "fp4_matmul"
