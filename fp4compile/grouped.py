"""Mixture-of-experts GEMMs in NVFP4: grouped quantization, the grouped emulated GEMM and its autograd.

A grouped site is one expert projection whose weight is a single 3-D parameter W [E, N, K] (expert e
computes Y_e = X_e W_e^T on the tokens routed to it). The tokens arrive sorted by expert, described by
cumulative offsets ``offs`` [E] (expert e owns rows ``offs[e-1]:offs[e]``, rows past ``offs[-1]`` belong
to no expert and give zero rows), as ``torch._grouped_mm`` takes them.

Quantization is per expert: every expert has its own global amax (one expert's range never sets another
expert's scale) and its own block scales, exactly what quantizing each expert's tensor on its own gives
(``formats.quantize``), computed for all experts at once:

- ``quantize_weight``: W [E, N, K] in 16x16 tiles, RNE, one amax per expert (fprop and dgrad);
- ``quantize_rows``: X or dY [S, K] in 1x16 blocks along K, one amax per expert's row group;
- ``quantize_columns``: RHT(dY^T) or RHT(X^T) [R, P] in 1x16 blocks along the tokens, each expert's
  token group zero-padded to a multiple of 16 (so no block and no 16-token RHT chunk mixes experts).

Stochastic rounding gives each expert a stream of its own: expert e of a quantized operand draws
``formats.sr_random_bits(numel_e, seed_e)`` over its slab in row-major order, ``seed_e`` from the node
constant ``expert_seeds`` makes for (site, role, operand, e). An expert that receives no tokens has
amax 0 and contributes nothing; its weight gradient is zero.

``fp4.grouped_gemm(a, b, offs, role, ...)`` is the emulated grouped GEMM of one role (fprop: Y = X W^T,
dgrad: dX = dY W, wgrad: dW = dY^T X per expert, with the RHT and SR of the recipe): quantize, decode,
multiply per expert in fp32, alpha per expert, cast; ``GroupedLinear`` (``linear``) is the autograd
function whose forward and backward are those three ops. Each call names its kernel: ``grouped
emulation`` (CPU, Hopper and other GPUs, shapes the kernel does not take), or on Blackwell a generated
CUTLASS grouped block-scaled GEMM ``cutlass_grouped:<config>`` (``codegen.cutlass_grouped``), one
launch for all experts of the role on the same quantized operands, which falls back to this emulation
only where the recipe allows it (see docs/models.md and docs/kernels.md).
"""

from __future__ import annotations

import zlib
from typing import Optional, Sequence

import torch

from . import formats, runtime
from .ops import autocast_dtype

BLOCK = 16  # NVFP4 block (and tile) size; also the RHT size and each expert's token padding for wgrad


def counts_from_offsets(offs: torch.Tensor) -> list[int]:
    """Tokens per expert from cumulative offsets [E] (a host read)."""
    if offs.dim() != 1:
        raise ValueError(f"fp4compile: grouped GEMM offsets must be 1-D [experts], got shape {tuple(offs.shape)}")
    ends = [int(v) for v in offs.tolist()]
    counts = [b - a for a, b in zip([0, *ends[:-1]], ends)]
    if any(c < 0 for c in counts):
        raise ValueError(f"fp4compile: grouped GEMM offsets must be non-decreasing, got {ends}")
    return counts


def expert_seeds(recipe_seed: Optional[int], site: str, role: str, operand: int, experts: int) -> list[int]:
    """The SR node constants of one operand of a grouped site's ``role`` GEMM, one per expert."""
    return [
        runtime.node_seed(recipe_seed, zlib.crc32(f"{site}:expert{e}".encode()), role, operand)
        for e in range(experts)
    ]


def _bits(slabs: Sequence[tuple[int, int]], seeds: Optional[Sequence[int]], device, dim: int):
    """SR bits of the experts' slabs (rows, cols), each from its own seed, joined along ``dim``; None for RNE."""
    if seeds is None:
        return None
    parts = [formats.sr_random_bits(r * c, int(s), device=device).reshape(r, c) for (r, c), s in zip(slabs, seeds)]
    return torch.cat(parts, dim=dim)


def _check(x: torch.Tensor, dims: int, what: str) -> None:
    if x.dim() != dims or x.shape[-1] % BLOCK:
        raise ValueError(
            f"fp4compile: {what} must be {dims}-D with a last dim that is a multiple of {BLOCK}, got shape {tuple(x.shape)}"
        )
    if x.dtype not in formats._INPUT_DTYPES:
        raise TypeError(f"fp4compile: {what} of shape {tuple(x.shape)} is {x.dtype}; FP4 quantizes float32, bfloat16, float16")


def _segment_amax(values: torch.Tensor, groups: torch.Tensor, experts: int) -> torch.Tensor:
    """max over each group of ``values`` (0 for an empty group; NaN propagates)."""
    out = torch.zeros(experts, dtype=torch.float32, device=values.device)
    return out.scatter_reduce(0, groups, values, "amax", include_self=True) if values.numel() else out


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [E, N, K] -> (codes uint8 [E, N, K/2], E4M3 tile scales [E, N, K/16], amax [E]): 16x16 tiles,
    RNE, each expert as ``formats.quantize(W[e], "nvfp4", "16x16")``."""
    _check(w, 3, "a grouped weight [experts, out, in]")
    if w.shape[1] % BLOCK:
        raise ValueError(f"fp4compile: grouped weight of shape {tuple(w.shape)}: out features not a multiple of {BLOCK}")
    xf = w.float()
    bamax = formats._block_amax(xf, "16x16")
    amax = bamax.amax(dim=(-2, -1)) if bamax.numel() else xf.new_zeros(w.shape[0])
    codes, scales = formats.nvfp4_encode(xf, bamax, amax[:, None, None], BLOCK, "rne")
    return codes.view(torch.uint8), scales, amax


def quantize_rows(x: torch.Tensor, counts: Sequence[int], seeds: Optional[Sequence[int]] = None):
    """Rows of x [S, K] grouped by expert (``counts``, in order; rows past their sum are quantized with
    amax 0 and are never read) -> (codes [S, K/2], scales [S, K/16], amax [E]): 1x16 blocks, each
    expert's rows as ``formats.quantize(x_e, "nvfp4", "1x16", ...)``; SR with ``seeds`` (one per expert)."""
    _check(x, 2, "grouped activations [tokens, features]")
    experts, total = len(counts), sum(counts)
    groups = torch.repeat_interleave(torch.arange(experts, device=x.device), torch.tensor(counts, device=x.device))
    xf = x.float()
    bamax = formats._block_amax(xf, "1x16")
    amax = _segment_amax(bamax[:total].amax(dim=-1), groups, experts)
    row_amax = torch.cat([amax[groups], amax.new_zeros(x.shape[0] - total)])
    k = x.shape[1]
    bits = _bits([(c, k) for c in counts] + [(x.shape[0] - total, k)], seeds and [*seeds, 0], x.device, 0)
    codes, scales = formats.nvfp4_encode(xf, bamax, row_amax[:, None], BLOCK, "sr" if seeds else "rne", bits)
    return codes.view(torch.uint8), scales, amax


def quantize_columns(x: torch.Tensor, widths: Sequence[int], seeds: Optional[Sequence[int]] = None):
    """x [R, P] whose columns are the experts' token groups, each ``widths[e]`` wide (a multiple of 16)
    -> (codes [R, P/2], scales [R, P/16], amax [E]): 1x16 blocks along the tokens, each expert's slab
    as ``formats.quantize(x[:, slab_e], "nvfp4", "1x16", ...)``; SR with ``seeds`` (one per expert)."""
    if any(w % BLOCK for w in widths) or x.dim() != 2 or sum(widths) != x.shape[1]:
        raise ValueError(f"fp4compile: expert token groups {list(widths)} do not tile a [rows, tokens] tensor "
                         f"of shape {tuple(x.shape)} in multiples of {BLOCK}")
    experts = len(widths)
    groups = torch.repeat_interleave(
        torch.arange(experts, device=x.device), torch.tensor([w // BLOCK for w in widths], device=x.device)
    )
    xf = x.float()
    bamax = formats._block_amax(xf, "1x16")
    amax = _segment_amax(bamax.amax(dim=0) if x.shape[0] else bamax.new_zeros(groups.shape), groups, experts)
    bits = _bits([(x.shape[0], w) for w in widths], seeds, x.device, 1)
    codes, scales = formats.nvfp4_encode(xf, bamax, amax[groups][None, :], BLOCK, "sr" if seeds else "rne", bits)
    return codes.view(torch.uint8), scales, amax


def _decode(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """value(code) * block scale in fp32 (exact): what the tensor core multiplies before alpha."""
    shape = (*codes.shape[:-1], codes.shape[-1] * 2)
    q = formats.QTensor(codes.view(torch.float4_e2m1fn_x2), scales, None, "nvfp4", "1x16", torch.Size(shape), torch.float32)
    return formats.block_decode(q)


def _stream(seeds: Sequence[int], sr: bool) -> Optional[list[int]]:
    """The step's SR seeds of the experts' node constants; None for round-to-nearest."""
    return [runtime.sr_seed(int(s)) for s in seeds] if sr else None


def _spans(counts: Sequence[int]):
    start = 0
    for e, c in enumerate(counts):
        yield e, start, start + c
        start += c


def _product(a_bd, b_bd, amax_a, amax_b) -> torch.Tensor:
    """a_bd @ b_bd^T in fp32, times alpha of the two per-expert amaxes (one 0-dim each)."""
    return (a_bd @ b_bd.transpose(0, 1)) * formats.gemm_alpha(amax_a, amax_b)


def _padded_tokens(t: torch.Tensor, counts: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
    """t [S, C] -> (t^T [C, P] with each expert's token group zero-padded to a multiple of 16, widths)."""
    widths = [-(-c // BLOCK) * BLOCK for c in counts]
    index = torch.cat([torch.arange(c, device=t.device) + start for (_, start, _), c in zip(_spans(widths), counts)]
                      or [torch.zeros(0, dtype=torch.long, device=t.device)])
    padded = t.new_zeros(sum(widths), t.shape[1]).index_copy(0, index, t[: sum(counts)])
    return padded.t(), widths


EMULATION = "grouped emulation"


def _wgrad_operands(dy, x, counts, rht: bool, sr: bool, seeds_a, seeds_b):
    """dW_e = dY_e^T X_e: both operands along each expert's tokens, padded to 16, RHT'd, quantized in
    1x16 blocks there -> (token group widths, dY^T's (codes, scales, amax), X^T's)."""
    dyt, widths = _padded_tokens(dy, counts)
    xt, _ = _padded_tokens(x, counts)
    if rht:
        dyt, xt = formats.rht(dyt, BLOCK), formats.rht(xt, BLOCK)
    return widths, quantize_columns(dyt, widths, _stream(seeds_a, sr)), quantize_columns(xt, widths, _stream(seeds_b, False))


def _on_cutlass(kernel: str, a, b, counts, role: str, rht: bool, sr: bool, seeds_a, seeds_b, dtype):
    """The role's GEMM on the CUTLASS grouped kernel ``kernel`` names, on the operands the emulation
    quantizes (dgrad's W^T from W's 16x16 tiles read transposed: the same codes and scales); None when
    the kernel failed on this device and the recipe allows emulation."""
    from fp4compile.codegen import cutlass_grouped_runtime as cgr

    launch = cgr.kernel_for(kernel, a.device)
    if launch is None:
        return None
    if role == "wgrad":
        widths, (ca, sa, amax_a), (cb, sb, amax_b) = _wgrad_operands(a, b, counts, rht, sr, seeds_a, seeds_b)
        packed = cgr.pack_token_slabs(ca, sa, cb, sb, widths, dtype)
    else:
        ca, sa, amax_a = quantize_rows(a, counts, _stream(seeds_a, sr and role == "dgrad"))
        cb, sb, amax_b = quantize_weight(b.transpose(1, 2).contiguous() if role == "dgrad" else b)
        packed = cgr.pack_rows(ca, sa, counts, cb, sb, dtype)
    return cgr.run(kernel, launch, packed, amax_a, amax_b)


def _grouped_gemm(a, b, offs, role: str, rht: bool, sr: bool, seeds_a: list[int], seeds_b: list[int], dtype,
                  kernel: str = EMULATION):
    counts = counts_from_offsets(offs)
    experts = len(counts)
    if role != "wgrad" and (b.dim() != 3 or b.shape[0] != experts):
        raise ValueError(f"fp4compile: grouped {role} GEMM: weight of shape {tuple(b.shape)} for {experts} experts' offsets")
    if kernel != EMULATION:
        out = _on_cutlass(kernel, a, b, counts, role, rht, sr, seeds_a, seeds_b, dtype)
        if out is not None:
            return out
    if role == "wgrad":
        widths, (ca, sa, amax_a), (cb, sb, amax_b) = _wgrad_operands(a, b, counts, rht, sr, seeds_a, seeds_b)
        a_bd, b_bd = _decode(ca, sa), _decode(cb, sb)
        out = torch.zeros(experts, a.shape[1], b.shape[1], dtype=torch.float32, device=a.device)
        for e, start, end in _spans(widths):
            if end > start:
                out[e] = _product(a_bd[:, start:end], b_bd[:, start:end], amax_a[e], amax_b[e])
        return out.to(dtype)
    ca, sa, amax_a = quantize_rows(a, counts, _stream(seeds_a, sr and role == "dgrad"))
    cw, sw, amax_w = quantize_weight(b)
    a_bd, w_bd = _decode(ca, sa), _decode(cw, sw)
    if role == "dgrad":
        w_bd = w_bd.transpose(1, 2)  # W^T [E, K, N]: the same tiles read the other way (NUMERICS)
    out = torch.zeros(a.shape[0], w_bd.shape[1], dtype=torch.float32, device=a.device)
    for e, start, end in _spans(counts):
        if end > start:
            out[start:end] = _product(a_bd[start:end], w_bd[e], amax_a[e], amax_w[e])
    return out.to(dtype)


@torch.library.custom_op("fp4::grouped_gemm", mutates_args=())
def grouped_gemm(
    a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, role: str, rht: bool, sr: bool,
    seeds_a: list[int], seeds_b: list[int], dtype: torch.dtype, kernel: str = EMULATION,
) -> torch.Tensor:
    """One role of a grouped site's GEMMs, emulated in NVFP4 with per-expert scales:

    - fprop: a = X [S, K], b = W [E, N, K] -> Y [S, N] (X 1x16 RNE, W 16x16 RNE);
    - dgrad: a = dY [S, N], b = W [E, N, K] -> dX [S, K] (dY 1x16, SR if ``sr``; W^T from W's tiles);
    - wgrad: a = dY [S, N], b = X [S, K] -> dW [E, N, K] (RHT along each expert's tokens if ``rht``,
      dY^T SR if ``sr``, X^T RNE).

    ``seeds_a``/``seeds_b``: the SR node constants of operands a and b, one per expert. ``kernel``:
    ``grouped emulation`` or a ``cutlass_grouped:<config>[+emulation]`` name (Blackwell)."""
    if role not in ("fprop", "dgrad", "wgrad"):
        raise ValueError(f"fp4compile: grouped GEMM role must be fprop, dgrad or wgrad, got {role!r}")
    return _grouped_gemm(a, b, offs, role, rht, sr, seeds_a, seeds_b, dtype, kernel)


@grouped_gemm.register_fake
def _(a, b, offs, role, rht, sr, seeds_a, seeds_b, dtype, kernel=EMULATION):
    if role == "wgrad":
        return a.new_empty((offs.shape[0], a.shape[1], b.shape[1]), dtype=dtype)
    return a.new_empty((a.shape[0], b.shape[1] if role == "fprop" else b.shape[2]), dtype=dtype)


class GroupedLinear(torch.autograd.Function):
    """Y = X_e W_e^T per expert whose fprop, dgrad and wgrad are ``fp4.grouped_gemm`` calls.

    ``plan`` = (rht, sr, seeds, kernels): seeds holds the SR node constants per expert of (fprop a,
    fprop b, dgrad a, dgrad b, wgrad a, wgrad b), kernels the kernel names of (fprop, dgrad, wgrad),
    as ``site_plan`` makes them."""

    @staticmethod
    def forward(ctx, x, w, offs, plan, dtype):
        rht, sr, seeds, kernels = plan
        ctx.save_for_backward(x, w, offs)
        ctx.plan, ctx.dtype = plan, dtype
        ctx.x_dtype, ctx.w_dtype = x.dtype, w.dtype
        return torch.ops.fp4.grouped_gemm(x, w, offs, "fprop", rht, sr, [*seeds[0]], [*seeds[1]], dtype, kernels[0])

    @staticmethod
    def backward(ctx, dy):
        x, w, offs = ctx.saved_tensors
        (rht, sr, seeds, kernels), dtype = ctx.plan, ctx.dtype
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = torch.ops.fp4.grouped_gemm(dy, w, offs, "dgrad", rht, sr, [*seeds[2]], [*seeds[3]], dtype, kernels[1])
            dx = dx.to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dw = torch.ops.fp4.grouped_gemm(dy, x, offs, "wgrad", rht, sr, [*seeds[4]], [*seeds[5]], dtype, kernels[2])
            dw = dw.to(ctx.w_dtype)
        return dx, dw, None, None, None


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return autocast_dtype(x.device.type) or x.dtype


def site_plan(recipe, site: str, experts: int, kernels: Sequence[str] = (EMULATION,) * 3) -> tuple:
    """``GroupedLinear``'s plan for a grouped site named ``site`` under ``recipe`` whose (fprop, dgrad,
    wgrad) GEMMs run on ``kernels``."""
    seeds = tuple(
        tuple(expert_seeds(recipe.seed, site, role, i, experts)) for role in ("fprop", "dgrad", "wgrad") for i in (0, 1)
    )
    return recipe.rht, recipe.stochastic_rounding, seeds, tuple(kernels)


def linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, plan: tuple) -> torch.Tensor:
    """Y [S, N] = X_e W_e^T for x [S, K] sorted by expert, w [E, N, K], cumulative ``offs`` [E], in the
    compute dtype (autocast's, else x's); ``plan`` from ``site_plan``."""
    dtype = _compute_dtype(x)
    if x.dtype != dtype:  # autocast's dtype
        x = x.to(dtype)
    return GroupedLinear.apply(x, w, offs, plan, dtype)


def grouped_mm(x: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, plan: tuple) -> torch.Tensor:
    """``torch._grouped_mm(x, b, offs=offs)`` with b [E, K, N] (the weight as the experts' inputs read
    it, ``W.transpose(-2, -1)`` for W [E, N, K]), in NVFP4."""
    return linear(x, b.transpose(-2, -1), offs, plan)


def gathered_bmm(first: torch.Tensor, second: torch.Tensor, ids: torch.Tensor, weight_first: bool, plan: tuple):
    """``torch.bmm`` of per-token gathered expert weights (Hugging Face's ``batched_mm`` form), in NVFP4:
    ``bmm(W[ids], x[..., None])`` with W [E, N, K] (``weight_first``) or ``bmm(x[:, None], W[ids])`` with
    W [E, K, N]; ``first``/``second`` are the bmm's operands with the gathered one replaced by W.
    The tokens are sorted by expert (stable), computed as one grouped GEMM and put back in order."""
    w, x3 = (first, second) if weight_first else (second, first)
    w = w if weight_first else w.transpose(-2, -1)
    x = x3.squeeze(-1) if weight_first else x3.squeeze(1)
    order = torch.argsort(ids, stable=True)
    counts = torch.zeros(w.shape[0], dtype=torch.int64, device=ids.device).index_add_(0, ids, torch.ones_like(ids))
    y = linear(x[order], w, counts.cumsum(0), plan)[torch.argsort(order)]
    return y.unsqueeze(-1) if weight_first else y.unsqueeze(1)
