"""FSDP2 with FP4 weights on the wire: all-gather each FP4 layer's quantized weight, not its BF16 copy.

    fp4compile.enable_fp4_all_gather(model, backend=backend)   # before fully_shard
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    model = torch.compile(model, backend=backend)

Under ``fully_shard`` every rank all-gathers each layer's full weight in the parameter dtype before the
forward (and again before the backward when ``reshard_after_forward``), and the compiled graph then
quantizes it (NVFP4, 16x16 tiles, round to nearest even; one quantization for fprop and dgrad). The GEMMs
read only the codes (4 bits per element) and the E4M3 tile scales (one byte per 16 elements): for a BF16
weight the gather carries 3.6x the bytes they need, for an fp32 one 7.1x.

``enable_fp4_all_gather`` turns the weights of the layers the backend's plan puts in NVFP4 (the recipe's
policy applied to the model's structure, before any compile) into ``FP4ShardedWeight`` parameters: the
master weight, as it was, wrapped in a tensor subclass that FSDP2 shards like any tensor (every op on it
runs on the master weight) and whose FSDP2 all-gather extension (``fsdp_pre_all_gather`` /
``fsdp_post_all_gather``) does this:

* before the all-gather, each rank casts its shard to the gather dtype (``MixedPrecisionPolicy.param_dtype``,
  what the compiled graph would have quantized), all-reduces its amax (one scalar MAX over the shard
  group, NaN kept, as ``fp4compile.distributed`` does for tensor parallelism) and quantizes the shard
  with that global amax in 16x16 tiles. A shard whose rows start and end on multiples of 16 holds whole
  tiles, so its codes and scales are exactly the rows of the full weight's quantization (NUMERICS: a
  tile's scale depends on the tile and the global amax only);
* the all-gather carries the codes and the scales (uint8), and the unsharded parameter is an
  ``FP4GatheredWeight``: a tensor of the weight's shape and dtype that holds the codes, the scales and
  the amax;
* the compiled graph reads them directly. aot_autograd traces the FP4 linear (``fp4.linear``) with the
  gathered weight as a tensor subclass; the subclass answers the fprop GEMM ``fp4.gemm(X, W)`` and the
  dgrad GEMM ``fp4.gemm(dY, W^T)`` by handing the gathered codes, scales and amax to the GEMM as its
  already-quantized weight (``b_codes, b_scales, b_amax``, the route ``plan_sharing`` uses for the
  weight it quantizes once), so ``insert_quantize`` dequantizes them for fprop and transposes them in
  packed form for dgrad instead of quantizing W. The weight gradient is the dense gradient of the
  unsharded weight, reduce-scattered by FSDP2 into the master weight's gradient as usual.

The forward and backward are therefore bit for bit those of the same run without FP4 gathering (the
weight's 16x16 quantization does not depend on where it is computed). The optimizer, the gradients and
the sharded master weights are untouched, and so are checkpoints: ``state_dict`` and DCP see the master
weight (an ``FP4ShardedWeight`` pickles as the plain tensor it wraps), never codes.

Why this route: fp4compile inserts its quantize nodes after aot_autograd has flattened tensor
subclasses into their inner tensors, so no pass ever sees the gathered weight as one value. The
subclass is seen where aot_autograd traces the model (the FP4 linear's ``fp4.gemm`` calls): answering
the GEMM there keeps every pass as it is, and the codes reach the graph as inputs through the existing
already-quantized-weight arguments.

A layer gathers in high precision (the weight in the gather dtype, as without this module), with the
reason given once as a ``PlanWarning`` and in the report, where:

* the plan keeps it high (first/last blocks, ``high_precision_modules``, outside the blocks), it is no
  ``nn.Linear`` weight, its features are not multiples of 16, it is tied to another parameter, or its
  weight is declared sharded for tensor parallelism (``fp4compile.distributed``): decided at enable time;
* the recipe does not quantize the weight in NVFP4 16x16 tiles for both fprop and dgrad (MXFP4,
  ``weight_2d=False``, ``quantize_backward=False``): then no layer gathers in FP4;
* its shard does not hold whole 16-row tiles: FSDP2 shards dim 0 with ``torch.chunk``, so a weight of
  N rows gathers in FP4 over W ranks only where N is a multiple of 16 * W (an uneven shard is padded,
  and FSDP2's extension needs gather inputs of the padded weight's shape), and only where the shard dim
  is 0 on a 1-D shard mesh: decided at the first all-gather;
* the backend runs in high precision (``Backend.switch_to_high_precision`` or
  ``Recipe.switch_to_high_precision_at``): from the first all-gather after the switch, every weight
  gathers in high precision again (each such parameter's FSDP2 gather buffers are made anew once).

A graph that reads an FP4-gathered weight other than through an NVFP4 GEMM (the plan changed by a user
pass, a router kept high) is an error naming the layer, never a computation on the dequantized weight.
``reshard_after_forward`` set to an int (resharding to a smaller mesh) is refused by FSDP2 for
all-gather extensions (``NotImplementedError`` in torch's ``FSDPParam.all_gather_inputs``).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Optional, Union

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from . import distributed

__all__ = ["FP4GatheredWeight", "FP4ShardedWeight", "GatherStats", "enable_fp4_all_gather"]

FP4 = "nvfp4"
HIGH = "high"
TILE = 16


# ---------------------------------------------------------------------------------------------
# What is gathered, and how many bytes
# ---------------------------------------------------------------------------------------------


class GatherStats:
    """The weights ``enable_fp4_all_gather`` looks after and what their all-gathers carry.

    ``modes[name]``: "nvfp4" or "high" as the latest all-gather of that weight went; ``reasons[name]``: why
    a weight gathers in high precision; ``per_gather[name]``: bytes the weight's latest all-gather put in
    each rank's gathered buffers (all ranks' shards: what the collective carries to each rank). A step is
    the all-gathers between two forwards: ``step_bytes()`` gives the last complete step's bytes by mode
    (the current one's before any step completed). The amax all-reduce (8 bytes per FP4 weight and
    all-gather) is counted apart, in ``amax_bytes``."""

    def __init__(self):
        self.planned: list[str] = []  # the weights enable_fp4_all_gather made FP4ShardedWeight
        self.modes: dict[str, str] = {}
        self.reasons: dict[str, str] = {}
        self.per_gather: dict[str, int] = {}
        self.gathers = {FP4: 0, HIGH: 0}
        self.total_bytes = {FP4: 0, HIGH: 0}
        self.amax_bytes = 0
        self._current = {FP4: 0, HIGH: 0}
        self._last: Optional[dict] = None
        self._forward_seen: set[str] = set()

    def record(self, name: str, mode: str, nbytes: int, in_backward: bool) -> None:
        if not in_backward:
            if name in self._forward_seen:  # this weight's next forward: a step is complete
                self._last, self._current = self._current, {FP4: 0, HIGH: 0}
                self._forward_seen = set()
            self._forward_seen.add(name)
        self.modes[name] = mode
        self.per_gather[name] = nbytes
        self.gathers[mode] += 1
        self.total_bytes[mode] += nbytes
        self._current[mode] += nbytes
        if mode == FP4:
            self.amax_bytes += 8

    def step_bytes(self) -> dict:
        """{"nvfp4": bytes, "high": bytes} all-gathered per step (the last complete one)."""
        return dict(self._last if self._last is not None else self._current)

    def lines(self) -> list[str]:
        fp4 = sorted(n for n, m in self.modes.items() if m == FP4)
        high = sorted(n for n, m in self.modes.items() if m == HIGH)
        step = self.step_bytes()
        out = [f"FSDP all-gather: {len(fp4)} weights in FP4 (codes + scales), {len(high)} in high precision; "
               f"per step {step[FP4]} bytes FP4, {step[HIGH]} bytes high precision"]
        out += [f"all-gather FP4: {n} ({self.per_gather[n]} bytes per gather)" for n in fp4]
        out += [f"all-gather high: {n} ({self.per_gather[n]} bytes per gather): {self.reasons.get(n, '')}"
                for n in high]
        as_before: dict[str, list[str]] = {}
        for name, reason in self.reasons.items():
            if name not in self.modes:
                as_before.setdefault(reason, []).append(name)
        out += [f"all-gather as before (not counted): {len(names)} weights ({', '.join(names[:4])}"
                f"{', ...' if len(names) > 4 else ''}): {reason}" for reason, names in as_before.items()]
        return out


# ---------------------------------------------------------------------------------------------
# One weight's settings, shared by every piece of it FSDP2 makes
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _WeightSpec:
    name: str  # the GEMM site's name (the weight's path without ".weight")
    backend: object
    root: weakref.ref  # the model given to enable_fp4_all_gather
    stats: GatherStats
    scale_rule: str = "6"
    check: str = ""
    reason: Optional[str] = None  # why this weight gathers in high precision (found at the first gather)
    mode: Optional[str] = None  # how the latest all-gather went

    def warn(self, reason: str) -> None:
        self.stats.reasons[self.name] = reason
        self.backend._warn(f"{self.name}: gathers its weight in high precision under FSDP2: {reason}",
                           key=f"fp4 all-gather {self.name}: {reason}")


def _rule_kwargs(rule: str) -> dict:
    return {"scale_rule": rule} if rule != "6" else {}


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


# ---------------------------------------------------------------------------------------------
# The sharded master weight
# ---------------------------------------------------------------------------------------------

_aten = torch.ops.aten
# Ops whose result is (a piece or a copy of) the weight itself: their tensor results stay FP4ShardedWeight,
# so that FSDP2's shards of it (chunk, narrow, view, padding, a move) keep the all-gather extension.
_KEEP_TYPE = {
    _aten.split.Tensor, _aten.split_with_sizes.default, _aten.chunk.default, _aten.narrow.default,
    _aten.slice.Tensor, _aten.view.default, _aten._unsafe_view.default, _aten.reshape.default,
    _aten.as_strided.default, _aten.detach.default, _aten.alias.default, _aten.clone.default,
    _aten.new_zeros.default, _aten.new_empty.default, _aten.new_empty_strided.default, _aten._to_copy.default,
    _aten.empty_like.default, _aten.zeros_like.default,
}


class FP4ShardedWeight(torch.Tensor):
    """A master weight (or FSDP2's shard of it) that all-gathers as NVFP4 codes and 16x16 tile scales.

    Every op runs on the wrapped tensor (``_data``): FSDP2's sharding, ``copy_``, the optimizer's updates,
    ``state_dict`` and checkpoint loading see the master weight as it is. Pickled (``torch.save``, DCP) it
    is the plain tensor."""

    _data: torch.Tensor
    _spec: _WeightSpec

    @staticmethod
    def __new__(cls, data: torch.Tensor, spec: _WeightSpec, requires_grad: bool = False):
        t = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(), dtype=data.dtype,
            device=data.device, layout=data.layout, requires_grad=requires_grad,
        )
        t._data = data
        t._spec = spec
        return t

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"FP4ShardedWeight({self._spec.name}, {self._data!r})"

    def __tensor_flatten__(self):
        return ["_data"], self._spec

    @staticmethod
    def __tensor_unflatten__(inner_tensors, spec, outer_size, outer_stride):
        return FP4ShardedWeight(inner_tensors["_data"], spec)

    def __reduce_ex__(self, protocol):
        # A checkpoint holds the master weight as a plain tensor (and loads without fp4compile).
        return self._data.detach().__reduce_ex__(protocol)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        spec = None
        inners: dict[int, FP4ShardedWeight] = {}

        def unwrap(t):
            nonlocal spec
            spec = spec or t._spec
            inners[id(t._data)] = t
            return t._data

        args, kwargs = pytree.tree_map_only(FP4ShardedWeight, unwrap, (args, kwargs))
        out = func(*args, **kwargs)
        if func in _KEEP_TYPE:
            return pytree.tree_map_only(torch.Tensor, lambda t: FP4ShardedWeight(t, spec), out)
        # In-place ops (copy_, the optimizer's updates) return their argument: the wrapper, not its data.
        return pytree.tree_map_only(torch.Tensor, lambda t: inners.get(id(t), t), out)

    # -- FSDP2's all-gather extension ---------------------------------------------------------

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        spec = self._spec
        param_dtype = mp_policy.param_dtype if mp_policy is not None and mp_policy.param_dtype is not None else self.dtype
        local = self._data
        world = mesh.size()
        mode = _gather_mode(spec, mesh, tuple(outer_size), tuple(local.shape))
        if _in_backward() and spec.mode is not None:
            mode = spec.mode  # the backward's gather serves the graph its forward ran
        _reset_if_switched(self, spec, mode)
        spec.mode = mode
        x = local.to(param_dtype)
        if mode == HIGH:
            rows = -(-outer_size[0] // world)  # FSDP2's padded shard: ceil(N / W) rows
            if x.shape[0] != rows:
                x = torch.cat((x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))))
            spec.stats.record(spec.name, HIGH, x.numel() * x.element_size() * world, _in_backward())
            return (x,), (HIGH,)
        amax = _global_amax(x, mesh)
        codes, scales, amax = torch.ops.fp4.quantize(x, FP4, "16x16", "rne", 0, spec.check, amax,
                                                     **_rule_kwargs(spec.scale_rule))
        # One gather input, each row its codes then its scales: FSDP2 gathers one input per parameter
        # where the world has one rank.
        packed = torch.cat((codes, scales), dim=1)
        spec.stats.record(spec.name, FP4, packed.numel() * world, _in_backward())
        _attach_report(spec)
        return (packed,), (FP4, amax, codes.shape[1])

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        mode = metadata[0]
        if mode == HIGH:
            (data,) = all_gather_outputs
            if out is not None:
                if isinstance(out, FP4GatheredWeight):
                    raise RuntimeError(f"fp4compile: {self._spec.name}: the FSDP2 parameter still holds an FP4 "
                                       "gathered weight where a high-precision gather arrived")
                return None  # the all-gather wrote into the unsharded parameter's storage
            return data, (data,)
        (packed,) = all_gather_outputs
        _, amax, half = metadata
        codes, scales = packed[:, :half], packed[:, half:]
        # The GEMMs read contiguous codes and scales: copied out of the gather buffer, which is then freed
        # (FSDP2 allocates it again before its next all-gather).
        if out is not None:
            if not isinstance(out, FP4GatheredWeight):
                raise RuntimeError(f"fp4compile: {self._spec.name}: the FSDP2 parameter holds no FP4 gathered "
                                   "weight where an FP4 gather arrived")
            with torch.autograd._unsafe_preserve_version_counter((out._codes, out._scales, out._amax)):
                out._codes.copy_(codes)
                out._scales.copy_(scales)
                out._amax.copy_(amax)
            _free(packed)
            return None
        codes, scales = codes.contiguous(), scales.contiguous()
        _free(packed)
        shape = (codes.shape[0], codes.shape[1] * 2)
        gathered = FP4GatheredWeight(codes, scales, amax.clone(), shape, param_dtype,
                                     (self._spec.name, self._spec.scale_rule, False))
        return gathered, (codes, scales)


def _global_amax(x: torch.Tensor, mesh) -> torch.Tensor:
    """max |weight| over every shard: one scalar all-reduce (MAX, NaN kept) over the shard mesh's group."""
    return distributed.all_reduce_amax(x, distributed.group_name(mesh.get_group()))


def _free(t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    if storage.size():
        storage.resize_(0)


def _gather_mode(spec: _WeightSpec, mesh, outer_size: tuple, local_shape: tuple) -> str:
    """"nvfp4" where this weight's shards hold whole 16x16 tiles and the backend plans FP4; else "high",
    with the reason given once."""
    if spec.backend.high_precision:
        return HIGH
    if spec.reason is None:
        world = mesh.size()
        n = outer_size[0]
        if mesh.ndim != 1:
            spec.reason = f"its shard mesh has {mesh.ndim} dimensions (FP4 gathering takes a 1-D shard mesh)"
        elif len(outer_size) != 2 or tuple(local_shape[1:]) != tuple(outer_size[1:]):
            spec.reason = (f"FSDP2 shards it along another dim than 0 ({tuple(outer_size)} -> {tuple(local_shape)}): "
                           "its shards would not hold whole 16x16 tiles")
        elif n % (TILE * world):
            spec.reason = (f"its {n} rows do not split into {world} shards of whole 16-row tiles (FSDP2 shards "
                           f"dim 0 with torch.chunk: {-(-n // world)} rows per rank; FP4 gathering needs rows "
                           f"that are a multiple of 16 x {world} = {TILE * world})")
        else:
            spec.reason = ""
        if spec.reason:
            spec.warn(spec.reason)
    return HIGH if spec.reason else FP4


def _attach_report(spec: _WeightSpec) -> None:
    spec.backend.report.all_gather = spec.stats


def _reset_if_switched(shard: FP4ShardedWeight, spec: _WeightSpec, mode: str) -> None:
    """When a weight's gather changes between FP4 and high precision (the backend switched), FSDP2's
    buffers and unsharded parameter for it (made at its first all-gather, reused since) are made anew."""
    if spec.mode is None or spec.mode == mode:
        return
    if mode == HIGH and spec.backend.high_precision:
        spec.stats.reasons[spec.name] = "the backend switched to high precision"
    param = _fsdp_param_of(spec, shard)
    if param is None:
        raise RuntimeError(f"fp4compile: {spec.name}: its gather changes to {mode}, but its FSDP2 parameter is not "
                           "found under the model given to enable_fp4_all_gather")
    for attr in ("all_gather_outputs", "_unsharded_inner_tensors"):
        if not hasattr(param, attr):
            raise RuntimeError(f"fp4compile: {spec.name}: this torch's FSDP2 has no FSDPParam.{attr}; "
                               "the switch between FP4 and high-precision gathering cannot be made")
    param.all_gather_outputs = []
    param._unsharded_inner_tensors = []
    if hasattr(param, "_unsharded_param"):
        del param._unsharded_param


def _fsdp_param_of(spec: _WeightSpec, shard: FP4ShardedWeight):
    from torch.distributed.fsdp import FSDPModule

    root = spec.root()
    for module in root.modules() if root is not None else ():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        for param in (group.fsdp_params if group is not None else ()):
            if param._sharded_local_tensor is shard:
                return param
    return None


# ---------------------------------------------------------------------------------------------
# The gathered weight
# ---------------------------------------------------------------------------------------------


class FP4GatheredWeight(torch.Tensor):
    """FSDP2's unsharded parameter of an FP4-gathered weight: shape and dtype of the weight, holding its
    NVFP4 16x16 quantization (``_codes`` uint8 [N, K/2], ``_scales`` uint8 [N, K/16], ``_amax`` fp32).

    Traced in a compiled graph, it answers the FP4 linear's fprop and dgrad GEMMs (``fp4.gemm`` with W or
    W^T) with its codes, scales and amax as the GEMM's already-quantized weight. Any other op that would
    compute with it in a traced or eager graph is an error naming the layer; dynamo's shape propagation
    (fake tensors, no graph being traced) reads it dequantized."""

    @staticmethod
    def __new__(cls, codes, scales, amax, shape, dtype, meta, requires_grad: bool = False):
        name, rule, transposed = meta
        t = torch.Tensor._make_wrapper_subclass(
            cls, tuple(shape), dtype=dtype, device=codes.device, requires_grad=requires_grad,
        )
        t._codes, t._scales, t._amax = codes, scales, amax
        t._meta = meta
        return t

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"FP4GatheredWeight({self._meta[0]}, shape={tuple(self.shape)}, dtype={self.dtype})"

    def __tensor_flatten__(self):
        return ["_codes", "_scales", "_amax"], (self._meta, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        meta, dtype = ctx
        return FP4GatheredWeight(inner_tensors["_codes"], inner_tensors["_scales"], inner_tensors["_amax"],
                                 outer_size, dtype, meta)

    def _like(self, transposed: bool) -> "FP4GatheredWeight":
        name, rule, _ = self._meta
        shape = tuple(reversed(self.shape)) if transposed != self._meta[2] else tuple(self.shape)
        return FP4GatheredWeight(self._codes, self._scales, self._amax, shape, self.dtype, (name, rule, transposed))

    def dequantized(self) -> torch.Tensor:
        """The weight its codes stand for (W, or W^T for a transposed view), in its dtype."""
        name, rule, transposed = self._meta
        w = torch.ops.fp4.dequantize(self._codes, self._scales, self._amax, FP4, "16x16", self.dtype,
                                     **_rule_kwargs(rule))
        return w.t() if transposed else w

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.fp4.gemm.default:
            return _gemm(*args, **kwargs)
        first = next(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, FP4GatheredWeight))
        name = first._meta[0]
        if func in (_aten.detach.default, _aten.alias.default):
            return first._like(first._meta[2])
        if func in (_aten.as_strided.default, _aten.view.default, _aten._unsafe_view.default):
            if tuple(args[1]) == tuple(first.shape):
                return first._like(first._meta[2])
        if func is _aten.t.default or (func is _aten.transpose.int and sorted(d % 2 for d in args[1:3]) == [0, 1]) or (
                func is _aten.permute.default and [d % 2 for d in args[1]] == [1, 0]):
            return first._like(not first._meta[2])
        if _tracing() or not _fake(first):
            raise RuntimeError(
                f"fp4compile: the weight of {name} was all-gathered in FP4 (enable_fp4_all_gather) and is read by "
                f"{func}, not by an NVFP4 GEMM of the nvfp4 backend: only a model compiled with that backend, whose "
                "plan runs this layer in NVFP4, can read it (a layer planned otherwise, by a user pass or the router "
                "rule, must be left out of enable_fp4_all_gather: exclude=...)"
            )
        # Dynamo's propagation of shapes through the model's code (fake tensors, no graph being traced).
        args, kwargs = pytree.tree_map_only(FP4GatheredWeight, lambda t: t.dequantized(), (args, kwargs))
        return func(*args, **kwargs)


def _fake(t: FP4GatheredWeight) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t._codes)


def _tracing() -> bool:
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return get_proxy_mode() is not None


_GEMM_ARGS = ("a", "b", "role", "site", "dtype", "b_codes", "b_scales", "b_amax", "x_amax", "x_history")


def _gemm(*args, **kwargs):
    """``fp4.gemm`` with an FP4-gathered weight: fprop reads W, dgrad W^T; both get the gathered codes,
    scales and amax as the GEMM's already-quantized weight (``b_codes, b_scales, b_amax``)."""
    bound = dict(zip(_GEMM_ARGS, args), **kwargs)
    w = bound["b"]
    if isinstance(bound["a"], FP4GatheredWeight) or not isinstance(w, FP4GatheredWeight):
        name = (w if isinstance(w, FP4GatheredWeight) else bound["a"])._meta[0]
        raise RuntimeError(f"fp4compile: the FP4-gathered weight of {name} is the activation operand of a "
                           f"{bound['role']} GEMM; it can only be the weight of an FP4 linear")
    name, rule, transposed = w._meta
    if (bound["role"], transposed) not in (("fprop", False), ("dgrad", True)):
        raise RuntimeError(f"fp4compile: the FP4-gathered weight of {name} is read {'transposed ' if transposed else ''}"
                           f"by a {bound['role']} GEMM; FP4 gathering takes nn.Linear weights (fprop reads W, dgrad W^T)")
    bound.update(b=w.dequantized(), b_codes=w._codes, b_scales=w._scales, b_amax=w._amax)
    return torch.ops.fp4.gemm.default(**bound)


# ---------------------------------------------------------------------------------------------
# The entry point
# ---------------------------------------------------------------------------------------------


def _plan(model: nn.Module, backend, exclude) -> tuple[dict[str, tuple], Optional[str]]:
    """({site name: (module, reason)} for every nn.Linear weight of ``model``: reason None where the
    backend's plan runs the layer in NVFP4 (the recipe's policy on the model's structure, as
    ``assign_precision`` applies it), else why it gathers in high precision; why no layer does, or None)."""
    import fnmatch

    from .backend import _blocks
    from .model_structure import ModelStructure, site_name, without_wrappers
    from .passes.find_blocks import model_positions

    recipe = backend.recipe
    structure = ModelStructure(model)
    blocks = _blocks(structure)
    placed = model_positions(blocks, backend.total_blocks)
    first, last = recipe.high_precision_block_counts(placed.n_blocks)
    recipe_reason = None
    if recipe.fmt != FP4:
        recipe_reason = f"the recipe's format is {recipe.fmt} (FP4 gathering is for NVFP4)"
    elif recipe.weight_block != "16x16":
        recipe_reason = "the recipe quantizes weights in 1x16 blocks (weight_2d=False), not 16x16 tiles"
    elif not recipe.quantize_backward:
        recipe_reason = "the recipe keeps dgrad in high precision (quantize_backward=False)"
    plan = {}
    for path, module in model.named_modules():
        if not isinstance(module, nn.Linear) or not isinstance(module.weight, torch.Tensor):
            continue
        name = site_name(without_wrappers(f"{path}.weight"))
        weight = module.weight
        block = next((b for b in blocks if name == b or name.startswith(b + ".")), None)
        pattern = recipe.matches_high_precision_module(name)
        excluded = next((p for p in exclude if fnmatch.fnmatchcase(name, p)), None)
        if recipe_reason is not None:
            reason = recipe_reason
        elif excluded is not None:
            reason = f"exclude matches {excluded!r}"
        elif pattern is not None:
            reason = f"the plan keeps it high: high_precision_modules matches {pattern!r}"
        elif block is not None and placed.positions[block] < first:
            reason = f"the plan keeps it high: first {first} of {placed.n_blocks} blocks"
        elif block is not None and placed.positions[block] >= placed.n_blocks - last:
            reason = f"the plan keeps it high: last {last} of {placed.n_blocks} blocks"
        elif block is None and recipe.high_precision_outside_blocks:
            reason = "the plan keeps it high: outside the repeated blocks"
        elif weight.dim() != 2 or weight.shape[0] % TILE or weight.shape[1] % TILE:
            reason = f"its features {tuple(weight.shape)} are not multiples of 16 (the layer runs in high precision)"
        elif weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            reason = f"its weight is {weight.dtype} (the layer runs in high precision)"
        elif len(structure.names.get(id(weight), ())) > 1:
            reason = f"its weight is tied to {', '.join(structure.names[id(weight)][1:])}"
        elif distributed.group_key(name, "W") is not None:
            reason = "its weight is declared sharded for tensor parallelism (fp4compile.distributed)"
        else:
            reason = None
        plan[name] = (module, reason)
    return plan, recipe_reason


def enable_fp4_all_gather(model: nn.Module, backend: Union[object, str, None] = None, exclude=()) -> GatherStats:
    """Make FSDP2 all-gather the weights of ``model``'s NVFP4 layers as FP4 codes and scales.

    Call it before ``fully_shard``, with the backend the model will be compiled with (a ``Backend``; None
    or "nvfp4": the shared backend of ``torch.compile(backend="nvfp4")``). The weights of the ``nn.Linear``
    layers the backend's plan runs in NVFP4 become ``FP4ShardedWeight`` parameters (new parameter objects:
    make the optimizer afterwards, as after ``fully_shard``); every other weight gathers as before.
    ``exclude``: fnmatch patterns of layer names to leave as they are (a layer that a user precision pass
    moves to high precision). Returns the ``GatherStats`` that ``backend.report`` shows (which weights
    gather in FP4, why the others do not, the bytes gathered per step)."""
    from .backend import Backend, get_backend

    if backend is None or backend == "nvfp4":
        backend = get_backend()
    if not isinstance(backend, Backend):
        raise TypeError(f"enable_fp4_all_gather(backend=...) takes a fp4compile.Backend or 'nvfp4', got {backend!r}")
    exclude = (exclude,) if isinstance(exclude, str) else tuple(exclude)
    stats = GatherStats()
    backend.report.all_gather = stats
    root = weakref.ref(model)
    rule = getattr(backend.recipe, "block_scale_rule", "6")
    plan, recipe_reason = _plan(model, backend, exclude)
    if recipe_reason is not None:
        backend._warn(f"no weight gathers in FP4 under FSDP2: {recipe_reason}", key="fp4 all-gather recipe")
    for name, (module, reason) in plan.items():
        weight = module.weight
        if isinstance(weight, FP4ShardedWeight):
            continue
        if reason is not None:
            if reason != recipe_reason and not reason.startswith(("the plan keeps it high", "exclude matches")):
                backend._warn(f"{name}: gathers its weight in high precision under FSDP2: {reason}",
                              key=f"fp4 all-gather {name}: {reason}")
            stats.reasons[name] = reason
            continue
        check = f"layer {name!r} fprop operand W" if backend.recipe.check_finite else ""
        spec = _WeightSpec(name, backend, root, stats, rule, check)
        module.weight = nn.Parameter(FP4ShardedWeight(weight.detach(), spec), requires_grad=weight.requires_grad)
        stats.planned.append(name)
    return stats
