"""insert_quantize: quantize and dequantize both operands of every low-precision GEMM.

Requires: ``plan_gemm_roles`` (and ``insert_rht`` if the recipe has the RHT).
Guarantees: each low-precision ``fp4.gemm`` reads ``fp4.dequantize(fp4.quantize(operand))`` for both
operands, with the blocks and rounding of its plan (the graph stays runnable: this is the
quantize-dequantize form the lowering pattern-matches). SR quantize nodes carry a seed constant unique
to (recipe seed, site name, role, operand). With ``Recipe(check_finite=True)`` each quantize names its
layer, GEMM role and operand for the non-finite error. An operand declared sharded across a process
group (``fp4compile.distributed``) is quantized by ``fp4.quantize_sharded``, with the global amax
all-reduced (MAX) over that group, so each rank's shard gets the codes and scales of the full tensor.
A weight quantized once for fprop and dgrad (``fp4.gemm`` given ``b_codes, b_scales, b_amax`` by
``plan_sharing``: the ``fp4.quantize`` of W in the forward, what the forward kept of it in the backward) is dequantized from
those nodes instead of quantized again, where the plan is NVFP4 16x16 tiles, dgrad's through an
``fp4.transpose_quantized`` inserted here, in the backward graph; the extra arguments are dropped from
the GEMM either way. The shared quantization's source node (the quantize, or the transpose) gets the
``fp4_quantize`` metadata, with ``shared="fprop+dgrad"``. A GEMM given ``x_amax`` (``plan_sharing``)
hands it to the quantizer of X in fprop and of RHT(X^T) in wgrad (NVFP4 1x16, RHT planned, amax not
sharded) as their ``amax`` argument, recorded in their metadata (``amax``); it is dropped otherwise.
A fprop GEMM given ``x_history`` (``linear(..., amax_history=...)``) leaves it on the quantize node of X
(metadata ``fp4_amax_history``) for ``record_ranges``, which records that quantizer's amax into it.
A GEMM given ``stats`` (``linear(..., stats=...)``, ``Backend.collect_stats``) leaves it, with the
operand's slot (``quant_stats.slot``), on each quantize node it inserts (metadata ``fp4_stats``), and on
the shared weight's quantize for fprop, for ``record_stats``.
With ``Recipe(block_scale_rule="4/6")`` every NVFP4 quantize and dequantize node takes
``scale_rule="4/6"`` (a keyword argument, which the later passes keep), and its metadata records it.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from fp4compile import distributed
from fp4compile.contracts import broken, contract
from fp4compile.quant_stats import slot as stats_slot
from fp4compile.sites import CompileContext, bound_arguments, call_unpacked
from fp4compile.vocabulary import (
    DEQUANTIZE, HISTORY_INPUT, OPERAND_TENSORS, QUANTIZE, QUANTIZE_SHARDED, TRANSPOSE_QUANTIZED, gemm_nodes,
    operand_seed_and_label, scale_rule_kwargs,
)


def _dequantize(gm: fx.GraphModule, node: fx.Node, parts: list, fmt: str, block: str, rule: dict) -> fx.Node:
    """fp4.dequantize of the (codes, scales, amax) nodes ``parts`` (with ``val`` metadata), before ``node``;
    ``rule``: the block scale rule's keyword arguments (``scale_rule_kwargs``)."""
    with gm.graph.inserting_before(node):
        dq = gm.graph.call_function(DEQUANTIZE, (*parts, fmt, block, torch.float32), dict(rule))
    dq.meta["val"] = DEQUANTIZE(*(p.meta["val"] for p in parts), fmt, block, torch.float32, **rule)
    return dq


def _transposed(gm: fx.GraphModule, node: fx.Node, shared: list) -> tuple[fx.Node, list]:
    """(the ``fp4.transpose_quantized`` node, [codes, scales, amax] of W^T) for dgrad's shared weight
    ``shared`` (W's codes, scales, amax as the forward made them), inserted before ``node``."""
    with gm.graph.inserting_before(node):
        t, parts = call_unpacked(gm.graph, TRANSPOSE_QUANTIZED, (shared[0], shared[1]), 2)
    return t, [*parts, shared[2]]


def _given_x_amax(info, i: int, x_amax, group) -> Optional[fx.Node]:
    """The amax the GEMM's ``x_amax`` argument gives operand ``i``'s quantizer, where it is that
    quantizer's own: X in fprop (operand a), RHT(X^T) in wgrad (operand b, with the RHT in the plan),
    NVFP4 1x16 blocks, amax not sharded."""
    if x_amax is None or group is not None or info.precision != "nvfp4" or info.blocks[i] != "1x16":
        return None
    if (info.role, i) == ("fprop", 0) or ((info.role, i) == ("wgrad", 1) and info.rht):
        return x_amax
    return None


def _graph_input(gm: fx.GraphModule, name: str) -> Optional[fx.Node]:
    return next((n for n in gm.graph.nodes if n.op == "placeholder" and n.name == name), None)


def _ensures_quantized(gm: fx.GraphModule, ctx: CompileContext) -> None:
    for node in gemm_nodes(gm):
        info = node.meta["fp4_role"]
        args = bound_arguments(node)
        dequantized = [isinstance(args[k], fx.Node) and args[k].target is DEQUANTIZE for k in ("a", "b")]
        if dequantized != [info.precision != "high"] * 2:
            broken(f"{node.name} ({info.role}, {info.precision}): operands dequantized {dequantized}")


@contract(after=("plan_gemm_roles",), stages=("forward", "backward"), ensures=_ensures_quantized)
def insert_quantize(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    inserted = 0
    recipe = ctx.recipe
    for node in gemm_nodes(gm):
        info = node.meta.get("fp4_role")
        if info is None:
            continue
        gemm = bound_arguments(node)
        site = ctx.sites[gemm["site"]]
        shared = [gemm[k] for k in ("b_codes", "b_scales", "b_amax") if gemm[k] is not None]
        planned = (info.precision, *info.blocks[1:2], *info.rounding[1:2])
        if shared and planned != ("nvfp4", "16x16", "rne"):
            # Only an FP4-gathered weight (fp4compile.fsdp) can bring its codes to a GEMM not planned for them.
            raise RuntimeError(
                f"fp4compile: the {info.role} GEMM of {site.name!r} is given its weight already quantized (NVFP4 "
                f"16x16, an FSDP2 all-gather of FP4 codes: fp4compile.enable_fp4_all_gather) but its plan is "
                f"{' '.join(planned)} for it: leave this layer out of "
                "enable_fp4_all_gather (exclude=...)"
            )
        if info.precision == "high":
            continue
        x_amax = gemm["x_amax"]
        x_history = gemm["x_history"] if info.role == "fprop" else None
        if x_history is None and info.role == "fprop" and HISTORY_INPUT in node.meta:
            x_history = _graph_input(gm, node.meta[HISTORY_INPUT])  # in the forward; not in a recomputation
        stats = gemm.get("stats") if info.precision == "nvfp4" else None
        operands = [gemm["a"], gemm["b"]]
        activation = site.kind == "activation_matmul"
        rule = scale_rule_kwargs(recipe, info.precision)
        for i in (0, 1):
            operand = operands[i]
            block, rounding = info.blocks[i], info.rounding[i]
            seed, label, operand_name = operand_seed_and_label(recipe, site, info.role, i)
            args = (operand, info.precision, block, rounding, seed, label)
            tensor = OPERAND_TENSORS[info.role][i]
            group = distributed.group_key(site.name, tensor, ctx.sharded_amax) if info.precision == "nvfp4" and not activation else None
            meta = {"site": site.name, "role": info.role, "operand": operand_name, "block": block, "rounding": rounding,
                    "amax_group": group, **rule}
            given = _given_x_amax(info, i, x_amax, group)
            if given is not None:
                args = (*args, given)
                meta["amax"] = "wgrad_amax" if info.role == "fprop" else "wgrad_amax in the forward"
            if i == 1 and len(shared) == 3 and (info.precision, block, rounding) == ("nvfp4", "16x16", "rne"):
                if info.role == "dgrad":
                    source, parts = _transposed(gm, node, shared)
                else:
                    source, parts = (shared[0].args[0] if shared[0].target is operator.getitem else shared[0]), shared
                operands[i] = _dequantize(gm, node, parts, info.precision, block, rule)
                source.meta["fp4_quantize"] = dict(meta, amax_group=None, shared="fprop+dgrad")
                if stats is not None and info.role == "fprop":
                    source.meta["fp4_stats"] = (stats, stats_slot("fprop", 1))
                inserted += 1
                continue
            with gm.graph.inserting_before(node):
                if group is None:
                    q, parts = call_unpacked(gm.graph, QUANTIZE, args, 3, rule)
                else:
                    q, parts = call_unpacked(gm.graph, QUANTIZE_SHARDED, (*args, group), 3, rule)
            q.meta["fp4_quantize"] = meta
            if stats is not None:
                q.meta["fp4_stats"] = (stats, stats_slot(info.role, i))
            if i == 0 and x_history is not None and info.precision == "nvfp4":
                q.meta["fp4_amax_history"] = x_history
            operands[i] = _dequantize(gm, node, parts, info.precision, block, rule)
            inserted += 1
        # The GEMM reads its operands dequantized; what it was given besides them is used up here.
        node.args, node.kwargs = (*operands, gemm["role"], gemm["site"], gemm["dtype"]), {}
    ctx.note(f"graph {ctx.graph_id}: inserted {inserted} quantize nodes")
    return gm

