"""record_ranges: the forward graph records each FP4 layer's activation amax into its history.

Requires: ``insert_quantize`` (and runs last, on the final quantize nodes: ``lower_gemms``
and ``fuse_amax`` keep the metadata of the nodes they replace).
Guarantees: in the forward graph, every quantize node of a fprop X operand that ``insert_quantize``
gave an amax history (metadata ``fp4_amax_history``, the history's graph input) is followed by
``fp4.record_amax(history, amax)``, ``amax`` being that quantizer's own amax output (max |X| as the
quantizer computed it: no new read of X). The op declares its mutation of the history, so
aot_autograd's and Inductor's dead-code elimination keep it, and a CUDA graph records it with the
step. The backward graph (a checkpointed forward recomputed there) records nothing: one record per
training forward. The metadata is removed either way.
"""

from __future__ import annotations

import torch.fx as fx

from fp4compile.contracts import broken, contract
from fp4compile.sites import CompileContext
from fp4compile.vocabulary import RECORD_AMAX, output_item


def _amax_output(gm: fx.GraphModule, q: fx.Node) -> fx.Node:
    """The getitem node of ``q``'s amax, its last output (made where nothing reads it yet)."""
    return output_item(gm, q, len(q.meta["val"]) - 1)


def _ensures_recorded(gm: fx.GraphModule, ctx: CompileContext) -> None:
    if any("fp4_amax_history" in n.meta for n in gm.graph.nodes):
        broken("a quantize node still carries its amax history in meta['fp4_amax_history']")
    if ctx.stage != "forward" and gm.graph.find_nodes(op="call_function", target=RECORD_AMAX):
        broken(f"the {ctx.stage} graph records activation amaxes: one record per training forward")


@contract(after=("insert_quantize",), stages=("forward", "backward"), ensures=_ensures_recorded)
def record_ranges(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    recorded = 0
    for q in list(gm.graph.nodes):
        history = q.meta.pop("fp4_amax_history", None)
        if history is None or ctx.stage != "forward":
            continue
        amax = _amax_output(gm, q)
        with gm.graph.inserting_after(amax):
            node = gm.graph.call_function(RECORD_AMAX, (history, amax))
        node.meta["val"] = None
        recorded += 1
    if recorded:
        ctx.note(f"graph {ctx.graph_id}: {recorded} activation amaxes recorded into their histories")
    return gm
