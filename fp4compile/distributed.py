"""Distributed training: which FP4 amaxes are reduced across ranks, and how to declare sharded tensors.

NVFP4 scales every quantized tensor by its global amax (NUMERICS). Under data parallelism each rank
quantizes what it holds, and that is the right amax in most cases:

* DDP: parameters are replicas, so the weight amax is the same on every rank; activations and
  gradients belong to the rank's micro-batch and are quantized with its own amax (as Transformer
  Engine does). Nothing is reduced.
* FSDP2 (``fully_shard``): parameters are all-gathered before each forward and backward, so the GEMMs
  (and their quantization) see the full weight and its amax is local. Activations and gradients are
  per micro-batch, as with DDP. Nothing is reduced.
* Tensor (or sequence) parallelism: a GEMM operand is a shard of a larger tensor, and the local amax
  is the shard's. Declare it here; its quantization then uses the amax all-reduced (MAX) over the
  group, so every shard gets exactly the codes and scales of the full tensor's quantization.

Declarations map fnmatch patterns of GEMM-site names (module paths, as ``backend.report`` shows them)
to a process group and the model tensors of that GEMM that are sharded: "X" (the input activation,
fprop X and wgrad X^T), "W" (the weight, fprop W and dgrad W^T) and "dY" (the output gradient, dgrad dY
and wgrad dY^T). They are read when a graph is compiled, so declare before the first call; the backward,
compiled at the first backward, uses the declarations its forward was compiled with.

    dist_fp4.column_parallel("blocks.*.mlp.fc", tp_group)   # W split by rows, output (dY) sharded
    dist_fp4.row_parallel("blocks.*.mlp.out", tp_group)     # W split by columns, input (X) sharded
    dist_fp4.shard_amax("*", dp_group, tensors=("X", "dY")) # data parallel with global-batch amaxes

The last line makes data-parallel training quantize exactly as one process running the global batch
would (when each rank's token count is a multiple of 16), at the cost of one scalar all-reduce per
quantized activation and gradient.

MXFP4 has no global amax (its E8M0 block scales are local to a block), so nothing is reduced for it.
Stochastic rounding draws its bits per element of the local tensor: with SR on, a shard's rounding
is not the slice of the full tensor's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from . import formats, ops, reference, scale_layout

TENSORS = ("X", "W", "dY")


@dataclasses.dataclass(frozen=True)
class ShardedAmax:
    """GEMM sites matching ``pattern`` have ``tensors`` sharded over the group named ``group``."""

    pattern: str
    tensors: frozenset
    group: str


_rules: list[ShardedAmax] = []
_groups: dict[str, "dist.ProcessGroup"] = {}


def group_name(group: Optional["dist.ProcessGroup"] = None) -> str:
    """The name ``fp4.quantize_sharded`` knows ``group`` (default: the world group) by."""
    group = group if group is not None else dist.group.WORLD
    if group is None:
        raise RuntimeError("fp4compile.distributed: torch.distributed is not initialized")
    name = group.group_name
    _groups[name] = group
    return name


def shard_amax(
    pattern: str, group: Optional["dist.ProcessGroup"] = None, tensors: Sequence[str] = ("W",)
) -> ShardedAmax:
    """Declare that GEMM sites matching ``pattern`` hold ``tensors`` sharded across ``group``
    (default: the world group); their quantization all-reduces the amax over it."""
    tensors = frozenset(tensors)
    unknown = sorted(tensors - set(TENSORS))
    if unknown:
        raise ValueError(f"fp4compile.distributed: unknown tensors {unknown}; expected some of {TENSORS}")
    rule = ShardedAmax(pattern, tensors, group_name(group))
    _rules.append(rule)
    return rule


def column_parallel(pattern: str, group: Optional["dist.ProcessGroup"] = None) -> ShardedAmax:
    """A column-parallel linear: W split along its output features, so W and dY are sharded."""
    return shard_amax(pattern, group, ("W", "dY"))


def row_parallel(pattern: str, group: Optional["dist.ProcessGroup"] = None) -> ShardedAmax:
    """A row-parallel linear: W split along its input features, so W and X are sharded."""
    return shard_amax(pattern, group, ("X", "W"))


def remove(rule: ShardedAmax) -> None:
    _rules.remove(rule)


def clear() -> None:
    """Forget every declaration."""
    _rules.clear()


@contextlib.contextmanager
def sharded_amax(
    pattern: str, group: Optional["dist.ProcessGroup"] = None, tensors: Sequence[str] = ("W",)
) -> Iterator[ShardedAmax]:
    """``shard_amax`` for the graphs compiled inside the ``with`` block (their backward included, even
    when it runs after the block)."""
    rule = shard_amax(pattern, group, tensors)
    try:
        yield rule
    finally:
        remove(rule)


def snapshot() -> tuple:
    """The declarations in effect now. A compilation takes them once, when it starts (the graph's first
    call), and its backward, compiled at the first backward, uses the same ones."""
    return tuple(_rules)


def cache_state(rules: Sequence[ShardedAmax]) -> list:
    """``rules`` as text a compile cache keys on: (pattern, tensors, group) per rule, in order."""
    return [[rule.pattern, sorted(rule.tensors), rule.group] for rule in rules]


def group_key(site_name: str, tensor: str, rules: Optional[Sequence[ShardedAmax]] = None) -> Optional[str]:
    """The group over which the amax of ``tensor`` of the GEMM site ``site_name`` is reduced, or None;
    by ``rules`` (a compilation's ``snapshot()``), else the declarations in effect now."""
    for rule in (_rules if rules is None else rules):
        if tensor in rule.tensors and fnmatch.fnmatchcase(site_name, rule.pattern):
            return rule.group
    return None


def all_reduce_amax(x: torch.Tensor, group: str) -> torch.Tensor:
    """max |x| over every rank of ``group`` (fp32, 0-dim). A NaN on any rank makes it NaN everywhere,
    as the amax of the full tensor would be (a MAX reduction alone may drop NaN)."""
    local = x.detach().float().abs().amax()
    both = torch.stack((torch.where(torch.isnan(local), 0.0, local), torch.isnan(local).float()))
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=_groups[group])
    return torch.where(both[1] > 0, torch.nan, both[0])


@torch.library.custom_op("fp4::quantize_sharded", mutates_args=())
def quantize_sharded(
    x: torch.Tensor, fmt: str, block: str, rounding: str, seed: int, check: str, group: str,
    layout: str = "row_major", scale_rule: str = "6",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fp4.quantize`` of one shard of a tensor sharded over ``group``: the global amax is all-reduced
    (MAX) over the group first, so the codes and scales are those of the full tensor's quantization.
    ``layout``: the scales' layout, as ``fp4.quantize`` takes it (the 128x4 tiled one for a CUTLASS GEMM)."""
    amax = all_reduce_amax(x, group)
    stream = reference.host_stream(x, rounding, seed, "fp4.quantize_sharded")
    q = formats.quantize(x, fmt, block, rounding, seed=stream, amax=amax, scale_rule=scale_rule)
    ops._check_finite(check, q.amax, x)
    scales = q.scales.view(torch.uint8)
    return q.data.view(torch.uint8), scale_layout.arrange(scales, layout), q.amax


@quantize_sharded.register_fake
def _(x, fmt, block, rounding, seed, check, group, layout="row_major", scale_rule="6"):
    return torch.ops.fp4.quantize.default(x, fmt, block, rounding, seed, check, layout=layout)
