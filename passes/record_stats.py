"""record_stats: the graphs record the quantization statistics of each FP4 operand into its site's buffer.

Requires: ``insert_quantize`` (and runs right after it, on the quantize nodes as it made them: each
quantizer's input is the tensor it quantizes, after the RHT where the recipe applies it, and its
outputs are packed codes, row-major scales and the amax).
Guarantees: every quantize node that ``insert_quantize`` gave a statistics buffer (metadata
``fp4_stats``: the buffer's graph node and the operand's slot, where the backend collects statistics:
``Backend.collect_stats``) is followed by ``fp4.record_stats(buffer, slot, x, codes, scales, amax, block,
scale_rule)``, reading the quantizer's own input and outputs: no operand is quantized again. The op
declares its mutation of the buffer, so dead-code elimination keeps it and a CUDA graph records it
with the step. The forward recomputed in a backward graph (a checkpointed block) records nothing: one
record per training forward. The metadata is removed either way. With the operands read by the op, the
later passes keep such an operand's ``fp4.rht`` and quantizer apart and write no decoded-only operand
(the same bits, more traffic: statistics cost only while they are collected).
"""

from __future__ import annotations

import torch.fx as fx

from fp4compile.contracts import broken, contract
from fp4compile.sites import CompileContext, bound_arguments
from fp4compile.vocabulary import RECORD_STATS, output_item


def _last(q: fx.Node, items: list) -> fx.Node:
    """The last of ``items`` (readers of ``q``, so after it) in graph order: a walk from ``q``."""
    left, node = set(items), q
    while left:
        node = node.next
        left.discard(node)
    return node


def _ensures_recorded(gm: fx.GraphModule, ctx: CompileContext) -> None:
    if any("fp4_stats" in n.meta for n in gm.graph.nodes):
        broken("a quantize node still carries its statistics buffer in meta['fp4_stats']")
    if ctx.stage != "forward":
        for node in gm.graph.find_nodes(op="call_function", target=RECORD_STATS):
            if bound_arguments(node)["slot"] in (0, 1):
                broken(f"the {ctx.stage} graph records fprop statistics ({node.name}): one record per training forward")


@contract(after=("insert_quantize",), stages=("forward", "backward"), ensures=_ensures_recorded)
def record_stats(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    recorded = 0
    for q in list(gm.graph.nodes):
        entry = q.meta.pop("fp4_stats", None)
        if entry is None:
            continue
        buffer, slot = entry
        if slot in (0, 1) and ctx.stage != "forward":  # fprop's quantizers, recomputed in the backward
            continue
        parts = [output_item(gm, q, i) for i in range(3)]
        block, quantizer = q.meta["fp4_quantize"]["block"], bound_arguments(q)
        with gm.graph.inserting_after(_last(q, parts)):
            node = gm.graph.call_function(
                RECORD_STATS, (buffer, slot, quantizer["x"], *parts, block, quantizer["scale_rule"]))
        node.meta["val"] = None
        recorded += 1
    if recorded:
        ctx.note(f"graph {ctx.graph_id}: {recorded} quantizations' statistics recorded")
    return gm
