"""fuse_rht_quantize: quantize(rht(x)) becomes one fp4.rht_quantize(x) for the weight-gradient operands.

Requires: ``insert_rht`` and ``insert_quantize`` (runs before ``lower_gemms``, which then asks the fused
quantizer for the tiled scale layout where a CUTLASS GEMM reads it).
Guarantees: every ``fp4.quantize`` whose input is an ``fp4.rht`` node used by nothing else is replaced
by ``fp4.rht_quantize(x, size, fmt, block, rounding, seed, check)`` with the same seed and check label,
so the bits are those of the CPU reference of the two ops (every argument carried over by name: a declared
rewrite, ``fp4compile.rewrites``); the ``fp4.rht`` node is removed. The quantize metadata stays on the new
node, with ``rht`` set to the transform size. Operands quantized with a sharded amax
(``fp4.quantize_sharded``) keep their separate RHT. Both formats are fused. On CUDA the fused op is
one Triton kernel pair for NVFP4 (amax after the transform, then transform and quantize) and one
Triton kernel for MXFP4 1x32 (no global scale), each reading the untransposed operand, summing the
RHT in the reference's order and never writing the transformed tensor; elsewhere it computes the two
steps in turn.
"""

from __future__ import annotations

import torch.fx as fx

from fp4compile.contracts import broken, contract
from fp4compile import rewrites
from fp4compile.rewrites import Rewrite
from fp4compile.sites import CompileContext, bound_arguments
from fp4compile.vocabulary import QUANTIZE, RHT, RHT_QUANTIZE


def _ensures_fused(gm: fx.GraphModule, ctx: CompileContext) -> None:
    for node in gm.graph.find_nodes(op="call_function", target=QUANTIZE):
        x = bound_arguments(node)["x"]
        if isinstance(x, fx.Node) and x.target is RHT and len(x.users) == 1:
            broken(f"{node.name} still quantizes {x.name}, an fp4.rht read by nothing else")


# quantize(rht(x, size), ...) -> rht_quantize(x, size, ...): the quantizer's arguments, the transform's input.
RHT_THEN_QUANTIZE = Rewrite(
    name="rht_quantize", outer=QUANTIZE, through="x", inner=RHT, replacement=RHT_QUANTIZE,
    arguments=lambda quantize, rht: {**quantize, "x": rht["x"], "size": rht["size"]},
    meta=lambda meta, rht: {**meta, "fp4_quantize": dict(meta["fp4_quantize"], rht=rht["size"])}
    if "fp4_quantize" in meta else meta,
)


@contract(after=("insert_rht", "insert_quantize"), stages=("forward", "backward"), ensures=_ensures_fused)
def fuse_rht_quantize(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    fused = rewrites.apply(gm, RHT_THEN_QUANTIZE)
    ctx.note(f"graph {ctx.graph_id}: fused {fused} RHT + quantize pairs")
    return gm
