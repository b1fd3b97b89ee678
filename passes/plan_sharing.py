"""plan_sharing: what an FP4 linear's forward and backward GEMMs share, planned on the joint graph.

Requires: the joint forward-backward graph aot_autograd traces from the marked graph, before it is
partitioned: each FP4 linear's three role-tagged ``fp4.gemm`` nodes (fprop ``X @ W^T``, dgrad
``dY @ W``, wgrad ``dY^T @ X``) in one graph, nodes with fake values (``meta["val"]``).
Guarantees:
- **One quantization of W** where ``Recipe(share_weight=True)`` (the default), NVFP4 16x16 weight tiles,
  FP4 backward GEMMs, the site runs in NVFP4, W's amax is not sharded across ranks
  (``fp4compile.distributed``) and the graph holds both the site's fprop and its dgrad: one
  ``fp4.quantize(W, "nvfp4", "16x16", "rne", seed, check, layout=...)`` before fprop (the seed constant
  and check label ``insert_quantize`` gives fprop's W), whose codes, scales and amax fprop and dgrad
  take as ``b_codes, b_scales, b_amax``. Its scales are in the 128x4 tiled layout where fprop gets a
  CUTLASS kernel (which reads only that one), else row-major.
- **One read of X for both of its amaxes** where X is a CUDA tensor (elsewhere the quantizer finds its
  amax within its own pass), the recipe has the RHT and FP4 backward GEMMs, X's amax is not sharded,
  its token count is static and a multiple of the RHT size, and the graph holds the site's fprop and
  wgrad: one ``fp4.wgrad_amax(X, rht_size)`` before fprop, max |X| given to fprop and max |RHT(X^T)|
  to wgrad as their ``x_amax``.
- **No history in the backward**: a fprop GEMM in an activation-checkpointed region gives up its
  activation amax history argument, named instead by its graph input in ``meta["fp4_amax_history_input"]``,
  so that the recomputation in the backward does not need it (only the forward records into it).

The partitioner then decides where these nodes run as it does for any other: the forward computes
them, and the backward reads what the forward kept (the packed weight, a one-element amax), or, in an
activation-checkpointed region (the new nodes join the fprop GEMM's region, with the policy
``PREFER_RECOMPUTE`` whatever a selective policy said for the GEMM), computes them again where the
partitioner prefers. ``insert_quantize`` turns the given tensors into the GEMMs' operands. The plan is made here,
once per graph, rather than by the op while the model is traced, so that the FP4 linear op carries
only the model's tensors and its site.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Optional

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from fp4compile import distributed, executors, scale_layout, vocabulary
from fp4compile.contracts import broken, contract
from fp4compile.sites import CompileContext, bound_arguments, call_unpacked, example_tensor, set_arguments
from fp4compile.vocabulary import HISTORY_INPUT, QUANTIZE, WGRAD_AMAX, gemm_nodes, operand_seed_and_label, scale_rule_kwargs
# What a node inserted for a GEMM takes from it: its checkpointed region (for the partitioner) and source.
_TAGS = ("ac_graph_id", "stack_trace", "nn_module_stack")


def _behind_transpose(node) -> Optional[fx.Node]:
    """The tensor ``node`` transposes (dgrad's ``W^T``: a ``t`` or ``permute``/``transpose`` of W)."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node.target in (torch.ops.aten.t.default, torch.ops.aten.permute.default, torch.ops.aten.transpose.int):
        return node.args[0]
    return None


def _layout(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, scale_rule: str = "6") -> str:
    """The scale layout of the shared weight: tiled where fprop gets a CUTLASS kernel, else row-major.
    A symbolic token count is read at its hint, as ``lower_gemms`` reads it."""
    if weight.dim() != 2 or not all(isinstance(d, int) for d in weight.shape):
        return scale_layout.ROW_MAJOR
    (n, k), m = weight.shape, x.shape[0]
    choice = executors.choose_gemm(m, n, k, "nvfp4", dtype, x.device, scale_rule=scale_rule)
    return scale_layout.SWIZZLED if executors.is_cutlass_kernel(choice.name) else scale_layout.ROW_MAJOR


def _insert(graph: fx.Graph, before: fx.Node, target, args: tuple, outputs: int, tags: dict,
            kwargs: Optional[dict] = None) -> list:
    """getitem nodes of ``target(*args, **kwargs)`` inserted before ``before`` (``call_unpacked``), with ``tags``."""
    with graph.inserting_before(before):
        node, items = call_unpacked(graph, target, args, outputs, kwargs)
    for n in (node, *items):
        n.meta.update(tags)
    return items


def _shares_weight(ctx: CompileContext, site) -> bool:
    recipe = ctx.recipe
    return (recipe.share_weight and recipe.quantize_backward and site.precision == "nvfp4"
            and recipe.weight_block == "16x16" and distributed.group_key(site.name, "W", ctx.sharded_amax) is None)


def _amax_size(ctx: CompileContext, site, x: fx.Node) -> Optional[int]:
    """The RHT size for one ``fp4.wgrad_amax`` of X, where it replaces a read of X; else None."""
    recipe = ctx.recipe
    if not (recipe.quantize_backward and recipe.rht and site.precision == "nvfp4"):
        return None
    if distributed.group_key(site.name, "X", ctx.sharded_amax) is not None:
        return None
    val = example_tensor(x)
    if val is None or val.dim() != 2 or not vocabulary.separate_amax_costs_a_read(val):
        return None
    if not isinstance(val.shape[0], int):
        return None  # symbolic: possibly padded
    return recipe.rht_size if val.shape[0] % recipe.rht_size == 0 else None


def _requires_joint(gm: fx.GraphModule, ctx: CompileContext) -> None:
    if not any(n.op == "placeholder" and n.name.startswith("tangents") for n in gm.graph.nodes):
        broken("the graph has no tangents: it is not aot_autograd's joint forward-backward graph")


def _ensures_shared(gm: fx.GraphModule, ctx: CompileContext) -> None:
    for node in gemm_nodes(gm):
        args = bound_arguments(node)
        given = [args.get(k) is not None for k in ("b_codes", "b_scales", "b_amax")]
        if any(given) and not all(given):
            broken(f"{node.name} is given part of a quantized weight (b_codes, b_scales, b_amax: {given})")
        if "recompute" in node.meta and args.get("x_history") is not None:
            broken(f"{node.name} is recomputed in a checkpointed region but still takes an amax history")


@contract(after=("mark_fp4_linear",), stages=("joint",), requires=_requires_joint, ensures=_ensures_shared)
def plan_sharing(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    by_site: dict = defaultdict(dict)
    for node in gemm_nodes(gm):
        args = bound_arguments(node)
        site = ctx.sites[args["site"]]
        if site.kind != "activation_matmul" and site.experts is None:  # the FP4 linears (fp4.linear)
            by_site[args["site"]].setdefault(args["role"], node)
    shared = amaxes = 0
    for index, roles in by_site.items():
        site, fprop = ctx.sites[index], roles.get("fprop")
        if fprop is None:
            continue
        args = bound_arguments(fprop)
        x, weight, tags = args["a"], args["b"], {k: fprop.meta[k] for k in _TAGS if k in fprop.meta}
        if "recompute" in fprop.meta:  # in a checkpointed region: recomputed where the partitioner prefers
            tags["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
        history = args.get("x_history")
        if "recompute" in fprop.meta and history is not None and history.op == "placeholder":
            # A recomputed GEMM would need the history in the backward: the partitioner would keep it
            # for the backward, and autograd would refuse a backward after the history is written again
            # (a block called twice, the next micro-batch). Only the forward records into it.
            set_arguments(fprop, x_history=None)
            fprop.meta[HISTORY_INPUT] = history.name
        dgrad, wgrad = roles.get("dgrad"), roles.get("wgrad")
        given = args.get("b_codes") is not None  # an FP4-gathered weight's codes (fp4compile.fsdp)
        if dgrad is not None and not given and _shares_weight(ctx, site) and _behind_transpose(bound_arguments(dgrad)["b"]) is weight:
            seed, label, _ = operand_seed_and_label(ctx.recipe, site, "fprop", 1)
            layout = _layout(example_tensor(x), example_tensor(weight), args["dtype"], ctx.recipe.block_scale_rule)
            rule = scale_rule_kwargs(ctx.recipe, "nvfp4")
            parts = _insert(gm.graph, fprop, QUANTIZE, (weight, "nvfp4", "16x16", "rne", seed, label, None, None, layout), 3, tags,
                            rule)
            parts[0].args[0].meta["fp4_quantize"] = {"site": site.name, "role": "fprop", "operand": "W", "block": "16x16",
                                                     "rounding": "rne", "amax_group": None, "shared": "fprop+dgrad", **rule}
            set_arguments(fprop, b_codes=parts[0], b_scales=parts[1], b_amax=parts[2])
            set_arguments(dgrad, b_codes=parts[0], b_scales=parts[1], b_amax=parts[2])
            shared += 1
        size = _amax_size(ctx, site, x) if wgrad is not None else None
        if size is not None and _behind_transpose(bound_arguments(wgrad)["b"]) is x:
            x_amax, x_rht_amax = _insert(gm.graph, fprop, WGRAD_AMAX, (x, size), 2, tags)
            set_arguments(fprop, x_amax=x_amax)
            set_arguments(wgrad, x_amax=x_rht_amax)
            amaxes += 1
    if shared or amaxes:
        ctx.note(f"graph {ctx.graph_id}: {shared} weights quantized once for fprop and dgrad, "
                 f"{amaxes} activations read once for both amaxes")
    return gm
