"""Running the CUTLASS grouped NVFP4 GEMM of a grouped site: choice, packing, first use, self-test, fallback.

Choice (``choose``, what ``passes/grouped_sites`` calls for each role of a grouped site at compile time,
building nothing): on an sm_100-class GPU with CUDA torch, a configuration from
``cutlass_grouped.select_grouped_config`` named ``cutlass_grouped:<config>`` (``+emulation`` when the
recipe allows emulation); anywhere else, or for a shape the kernel does not take, ``grouped emulation``
with the reason, which on a Blackwell GPU is an error (``executors.CutlassRequired``) unless
``Recipe.allow_emulation``. A fallback is logged once per reason.

Packing (``pack_rows`` for fprop and dgrad, ``pack_token_slabs`` for wgrad): the quantized operands of
all experts become the kernel's byte buffers and a table with one row per non-empty expert
(``cutlass_grouped.GROUP_COLUMNS``: expert, M, N, K and byte offsets of A, B, their scales and D). Each
group's scales are swizzled on their own (``swizzle_groups``: the 128x4 tiled layout of that group's
rows, rows rounded up to 128), since the collective reads every group's scales from its own pointer.

First use (``kernel_for``), as for the dense kernels (``cutlass_runtime``): load or build the
configuration, run ``self_test`` (three experts, one with no tokens, against the emulated products
within the bound of a different fp32 accumulation order and the output rounding); a failure is
remembered per device and makes every grouped GEMM naming the configuration raise
``CutlassKernelError``, or run in emulation after one ``PlanWarning`` where the recipe allows it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
import warnings
from typing import Callable, NamedTuple, Optional, Sequence

import torch

from . import cutlass_grouped, cutlass_runtime
from .cutlass_gemm import ALIGN_K, KernelBuildError
from .cutlass_grouped import GroupedGemmConfig
from .cutlass_runtime import CutlassKernelError, SelfTestError

log = logging.getLogger("fp4compile")

PREFIX = "cutlass_grouped:"
EMULATION = "grouped emulation"
EMULATION_SUFFIX = "+emulation"
_logged: set = set()


def kernel_name(config: GroupedGemmConfig, allow_emulation: bool) -> str:
    return PREFIX + config.name + (EMULATION_SUFFIX if allow_emulation else "")


@functools.lru_cache(maxsize=None)
def parse_kernel(kernel: str) -> tuple[GroupedGemmConfig, bool]:
    """(configuration, whether emulation is allowed) of a ``kernel_name`` string."""
    match = re.fullmatch(re.escape(PREFIX) + r"(\w+?)(" + re.escape(EMULATION_SUFFIX) + ")?", kernel)
    if match is None:
        raise ValueError(f"{kernel!r} does not name a CUTLASS grouped kernel ({PREFIX}<config>[{EMULATION_SUFFIX}])")
    return GroupedGemmConfig.from_name(match.group(1)), match.group(2) is not None


class GroupedChoice(NamedTuple):
    """The kernel string a grouped GEMM role carries, and why it was chosen."""

    name: str
    reason: str


def choose(role: str, out_features: int, in_features: int, tokens, experts: int, out_dtype: torch.dtype,
           device, allow_emulation: bool = True) -> GroupedChoice:
    """The kernel for one role of a grouped site on ``device``. Pure."""
    from fp4compile.executors import CutlassRequired, is_blackwell

    device = torch.device(device)
    config, why = None, f"device {device} is not a CUDA GPU"
    if device.type == "cuda":
        ok, why = cutlass_grouped.cutlass_gemm.device_supports_cutlass(device)
        if ok:
            config, why = cutlass_grouped.select_grouped_config(role, out_features, in_features, tokens, experts, out_dtype)
    if config is not None:
        return GroupedChoice(kernel_name(config, allow_emulation), why)
    if is_blackwell(device):
        if not allow_emulation:
            raise CutlassRequired(
                f"{why}; on a Blackwell GPU FP4 GEMMs run on CUTLASS kernels only: "
                "Recipe(allow_emulation=True) (or Backend(allow_emulation=True)) runs such GEMMs in emulation"
            )
        if why not in _logged:
            _logged.add(why)
            log.warning("fp4compile: grouped expert GEMMs run in emulation on this Blackwell GPU: %s", why)
    return GroupedChoice(EMULATION, f"per-expert emulated NVFP4 GEMMs: {why}")


# ----------------------------------------------------------------------------------------------
# Packing
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Packed:
    """What the grouped kernel reads and writes: byte buffers, the group table (CPU int64), the output."""

    a: torch.Tensor
    a_scales: torch.Tensor
    b: torch.Tensor
    b_scales: torch.Tensor
    table: torch.Tensor
    out: torch.Tensor

    def args(self, a_amax: torch.Tensor, b_amax: torch.Tensor) -> tuple:
        return (self.a, self.a_scales, a_amax, self.b, self.b_scales, b_amax, self.table, self.out)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def swizzle_groups(scales: torch.Tensor, rows: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
    """Scales [R, C] whose first ``sum(rows)`` rows are consecutive groups -> (one byte buffer holding
    each group's rows in the 128x4 tiled layout of its own, each round_up(rows_g, 128) * round_up(C, 4)
    bytes, the byte offset of each group). Rows past the groups are not read."""
    from fp4compile import formats

    cols = scales.shape[1]
    sizes = [_round_up(r, 128) * _round_up(cols, 4) for r in rows]
    offsets = [sum(sizes[:g]) for g in range(len(rows))]
    total = sum(rows)
    out = torch.zeros(sum(sizes), dtype=torch.uint8, device=scales.device)
    if total and cols:
        device = scales.device
        group = torch.repeat_interleave(torch.arange(len(rows), device=device), torch.tensor(rows, device=device))
        starts = torch.tensor([sum(rows[:g]) for g in range(len(rows))], device=device)
        local = torch.arange(total, device=device) - starts[group]
        where = torch.tensor(offsets, device=device)[group][:, None] + formats.swizzled_offset(
            local[:, None], torch.arange(cols, device=device)[None, :], cols)
        out[where.reshape(-1)] = scales[:total].contiguous().view(torch.uint8).reshape(-1)
    return out, offsets


def pack_rows(a_codes, a_scales, counts: Sequence[int], b_codes, b_scales, out_dtype: torch.dtype) -> Packed:
    """fprop / dgrad: A = the rows of each expert in a_codes [S, K/2] (scales [S, K/16]), B_e = b_codes[e]
    [N, K/2] (scales [E, N, K/16]), D = out [S, N] row-major (rows past the experts' zero)."""
    experts, n, k = b_codes.shape[0], b_codes.shape[1], b_codes.shape[2] * 2
    if a_codes.shape[1] * 2 != k or len(counts) != experts or k % ALIGN_K:
        raise ValueError(f"grouped operands: A {tuple(a_codes.shape)} and B {tuple(b_codes.shape)} codes for "
                         f"{len(counts)} experts; K must agree and be a multiple of {ALIGN_K}")
    total = sum(counts)
    sfa, sfa_at = swizzle_groups(a_scales, counts)
    sfb, sfb_at = swizzle_groups(b_scales.reshape(experts * n, -1), [n] * experts)
    out = torch.empty(a_codes.shape[0], n, dtype=out_dtype, device=a_codes.device)
    out[total:] = 0
    size = out.element_size()
    rows, start = [], 0
    for e, m in enumerate(counts):
        if m:
            rows.append((e, m, n, k, start * k // 2, e * n * k // 2, sfa_at[e], sfb_at[e], start * n * size))
        start += m
    return Packed(_bytes(a_codes), sfa, _bytes(b_codes), sfb, _table(rows), out)


def pack_token_slabs(a_codes, a_scales, b_codes, b_scales, widths: Sequence[int], out_dtype: torch.dtype) -> Packed:
    """wgrad: a_codes [N, P/2] and b_codes [K, P/2] hold each expert's token slab (``widths``, multiples
    of 16, in order) side by side; group e is A_e [N, w_e] . B_e [K, w_e]^T into out[e] of [E, N, K].
    Each slab is copied into a contiguous block with its K padded with zero codes to a multiple of 32
    (the tiled scale layout already holds the extra scale column)."""
    n, k = a_codes.shape[0], b_codes.shape[0]
    out = torch.zeros(len(widths), n, k, dtype=out_dtype, device=a_codes.device)
    blocks = {"a": [], "sa": [], "b": [], "sb": []}
    at = {key: 0 for key in blocks}
    rows, start = [], 0
    for e, w in enumerate(widths):
        if w and n and k:
            kp = _round_up(w, ALIGN_K)
            offsets = []
            for key, codes, scales in (("a", a_codes, a_scales), ("b", b_codes, b_scales)):
                slab = torch.nn.functional.pad(_bytes(codes).view(codes.shape[0], -1)[:, start // 2:(start + w) // 2],
                                               (0, (kp - w) // 2))
                swizzled, _ = swizzle_groups(scales[:, start // 16:(start + w) // 16], [codes.shape[0]])
                for part, data in ((key, slab.reshape(-1)), ("s" + key, swizzled)):
                    blocks[part].append(data)
                    offsets.append(at[part])
                    at[part] += data.numel()
            rows.append((e, n, k, kp, offsets[0], offsets[2], offsets[1], offsets[3], e * n * k * out.element_size()))
        start += w
    joined = {key: torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8, device=a_codes.device)
              for key, parts in blocks.items()}
    return Packed(joined["a"], joined["sa"], joined["b"], joined["sb"], _table(rows), out)


def _table(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, len(cutlass_grouped.GROUP_COLUMNS))


# ----------------------------------------------------------------------------------------------
# First use: load (or build), self-test, remember the outcome
# ----------------------------------------------------------------------------------------------


def _self_test_counts(config: GroupedGemmConfig) -> list[int]:
    """Three experts: one over a full cluster of tiles and a partial tile, one with no tokens, one small."""
    return [config.tile_m * config.cluster_m + 40, 0, 72]


def self_test(config: GroupedGemmConfig, kernel: Callable, device) -> None:
    """Run ``kernel`` on a small fprop-shaped grouped GEMM on ``device`` and compare every expert's rows
    with the emulated products; raise ``SelfTestError`` when it raises or differs by more than a
    different fp32 accumulation order (2 K ulp of the sum of |products|) plus one output ulp."""
    from fp4compile import formats, grouped

    counts = _self_test_counts(config)
    n, k = config.tile_n * 2, 2 * 256 + 96
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts) + 8, k, generator=gen) * torch.rand(sum(counts) + 8, 1, generator=gen) * 4
    w = torch.randn(len(counts), n, k, generator=gen)
    ca, sa, amax_a = grouped.quantize_rows(x, counts)
    cw, sw, amax_w = grouped.quantize_weight(w)
    what = f"self-test of {config.name} ({len(counts)} experts of {counts} rows, N={n}, K={k}) on {device}"
    packed = pack_rows(ca, sa, counts, cw, sw, config.torch_out_dtype)
    # The table stays on the CPU (the binding reads it there); everything else goes to the device.
    moved = [t if t is packed.table else t.to(device) for t in packed.args(amax_a, amax_w)]
    try:
        kernel(*moved)
        if moved[-1].is_cuda:
            torch.cuda.synchronize(moved[-1].device)
    except Exception as exc:  # a launch, initialize or TMA setup failure of the kernel
        raise SelfTestError(f"{what} raised {type(exc).__name__}: {exc}") from exc
    got = moved[-1].double().cpu()
    a_bd, w_bd = grouped._decode(ca, sa).double(), grouped._decode(cw, sw).double()
    for e, start, end in grouped._spans(counts):
        alpha = float(formats.gemm_alpha(amax_a[e], amax_w[e]))
        ref = (a_bd[start:end] @ w_bd[e].T) * alpha
        bound = 2 * k * 2.0**-24 * (a_bd[start:end].abs() @ w_bd[e].abs().T) * alpha \
            + torch.finfo(config.torch_out_dtype).eps * ref.abs() + torch.finfo(torch.float32).tiny
        bad = ~((got[start:end] - ref).abs() <= bound)
        if bad.any():
            row, col = (int(i) for i in bad.nonzero()[0])
            raise SelfTestError(f"{what} disagrees with the emulated GEMM of expert {e} at {int(bad.sum())} outputs, "
                                f"e.g. [{start + row}, {col}]: {float(got[start + row, col])!r} vs {float(ref[row, col])!r}")
    if got[sum(counts):].abs().sum() != 0:
        raise SelfTestError(f"{what} wrote rows that belong to no expert")


# First-use outcomes live with the dense kernels' (``cutlass_runtime``: one lock, one reset), keyed by
# (configuration, device); a grouped configuration is a type of its own, so the keys never meet.
_lock, _kernels, _failed, _warned = (cutlass_runtime._lock, cutlass_runtime._kernels, cutlass_runtime._failed,
                                     cutlass_runtime._warned)


def reset() -> None:
    """Forget every configuration's first-use outcome (dense and grouped) and the logged fallbacks."""
    cutlass_runtime.reset()
    _logged.clear()


def kernel_for(kernel: str, device) -> Optional[Callable]:
    """The loaded, self-tested kernel ``kernel`` names on ``device``; None when it failed there and the
    name allows emulation (warned once); raises ``CutlassKernelError`` when it failed otherwise."""
    config, allow_emulation = parse_kernel(kernel)
    device = torch.device(device)
    key = (config, device)
    if key in _kernels:
        return _kernels[key]
    with _lock:
        if key not in _kernels and key not in _failed:
            try:
                run = cutlass_grouped.load(config, device=device, progress=True)
                self_test(config, run, device)
            except (KernelBuildError, SelfTestError) as exc:
                _failed[key] = str(exc)
                log.error("fp4compile: CUTLASS grouped kernel %s cannot run on %s: %s", config.name, device, exc)
            else:
                _kernels[key] = run
        reason = _failed.get(key)
    if reason is None:
        return _kernels[key]
    if not allow_emulation:
        raise CutlassKernelError(f"the grouped expert GEMMs that selected the CUTLASS kernel {config.name} cannot run "
                                 f"on {device}: {reason}. On a Blackwell GPU FP4 GEMMs run on CUTLASS kernels only; "
                                 "Recipe(allow_emulation=True) (or Backend(allow_emulation=True)) runs them in "
                                 "emulation instead, with the same operands, slower.")
    if key not in _warned:
        _warned.add(key)
        from fp4compile.diagnostics import PlanWarning

        warnings.warn(f"fp4compile: the grouped expert GEMMs that selected the CUTLASS kernel {config.name} run in "
                      f"emulation on {device} (Recipe.allow_emulation): {reason}", PlanWarning, stacklevel=2)
    return None


def run(kernel: str, run_kernel: Callable, packed: Packed, a_amax: torch.Tensor, b_amax: torch.Tensor) -> torch.Tensor:
    """Launch ``run_kernel`` (from ``kernel_for``) on ``packed``; returns the output."""
    config, _ = parse_kernel(kernel)
    if packed.out.dtype != config.torch_out_dtype:
        raise ValueError(f"{kernel}: the kernel writes {config.torch_out_dtype}, the graph expects {packed.out.dtype}")
    if packed.table.shape[0]:
        run_kernel(*packed.args(a_amax.float().contiguous(), b_amax.float().contiguous()))
    return packed.out
