"""insert_rht: random Hadamard transform on both operands of each FP4 weight-gradient GEMM.

Requires: ``plan_gemm_roles``.
Guarantees: every wgrad ``fp4.gemm`` whose plan has ``rht`` reads ``fp4.rht(dY^T, 16)`` and
``fp4.rht(X^T, 16)``: 16-element chunks along the token (reduction) dim, so the transforms cancel in
dW = dY^T X. No other GEMM gets an RHT.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fp4compile.sites import CompileContext

from .plan_gemm_roles import gemm_nodes

RHT = torch.ops.fp4.rht.default


def insert_rht(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    inserted = 0
    for node in gemm_nodes(gm):
        info = node.meta.get("fp4_role")
        if info is None or not info.rht:
            continue
        a, b = node.args[:2]
        with gm.graph.inserting_before(node):
            ra = gm.graph.call_function(RHT, (a, ctx.recipe.rht_size))
            rb = gm.graph.call_function(RHT, (b, ctx.recipe.rht_size))
        for new, old in ((ra, a), (rb, b)):
            new.meta["val"] = torch.empty_like(old.meta["val"])
        node.args = (ra, rb, *node.args[2:])
        inserted += 2
    ctx.note(f"graph {ctx.graph_id}: inserted {inserted} RHT nodes")
    return gm
