"""fuse_rht_quantize: quantize(rht(x)) becomes one fp4.rht_quantize(x) for the weight-gradient operands.

Requires: ``insert_rht`` and ``insert_quantize`` (runs before ``lower_gemms``, which then asks the fused
quantizer for the tiled scale layout where a CUTLASS GEMM reads it).
Guarantees: every ``fp4.quantize`` whose input is an ``fp4.rht`` node used by nothing else is replaced
by ``fp4.rht_quantize(x, size, fmt, block, rounding, seed, check)`` with the same seed and check label,
so the bits are those of the CPU reference of the two ops (its keyword arguments carried over); the ``fp4.rht``
node is removed. The quantize metadata stays on
the new node, with ``rht`` set to the transform size. Operands quantized with a sharded amax
(``fp4.quantize_sharded``) keep their separate RHT. Both formats are fused. On CUDA the fused op is
one Triton kernel pair for NVFP4 (amax after the transform, then transform and quantize) and one
Triton kernel for MXFP4 1x32 (no global scale), each reading the untransposed operand, summing the
RHT in the reference's order and never writing the transformed tensor; elsewhere it computes the two
steps in turn.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fp4compile.sites import CompileContext

from .insert_quantize import QUANTIZE
from .insert_rht import RHT

RHT_QUANTIZE = torch.ops.fp4.rht_quantize.default


def fuse_rht_quantize(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    fused = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not QUANTIZE:
            continue
        rht = node.args[0]
        if not (isinstance(rht, fx.Node) and rht.target is RHT and len(rht.users) == 1):
            continue
        x, size = rht.args
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(RHT_QUANTIZE, (x, size, *node.args[1:]), dict(node.kwargs))
        new.meta.update(node.meta)
        if "fp4_quantize" in node.meta:
            new.meta["fp4_quantize"] = dict(node.meta["fp4_quantize"], rht=size)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        gm.graph.erase_node(rht)
        fused += 1
    ctx.note(f"graph {ctx.graph_id}: fused {fused} RHT + quantize pairs")
    return gm
