"""insert_rht: random Hadamard transform on both operands of each FP4 weight-gradient GEMM.

Requires: ``plan_gemm_roles``.
Guarantees: every wgrad ``fp4.gemm`` whose plan has ``rht`` reads ``fp4.rht(dY^T, 16)`` and
``fp4.rht(X^T, 16)``: 16-element chunks along the token (reduction) dim, so the transforms cancel in
dW = dY^T X. No other GEMM gets an RHT.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fp4compile.contracts import broken, contract
from fp4compile.sites import CompileContext, bound_arguments, set_arguments
from fp4compile.vocabulary import RHT, gemm_nodes


def _ensures_rht(gm: fx.GraphModule, ctx: CompileContext) -> None:
    for node in gemm_nodes(gm):
        info = node.meta["fp4_role"]
        args = bound_arguments(node)
        transformed = [isinstance(args[k], fx.Node) and args[k].target is RHT for k in ("a", "b")]
        wanted = info.role == "wgrad" and info.rht and info.precision != "high"
        if transformed != [wanted, wanted]:
            broken(f"{node.name} ({info.role}, rht={info.rht}): operands transformed {transformed}")


@contract(after=("plan_gemm_roles",), stages=("forward", "backward"), ensures=_ensures_rht)
def insert_rht(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    inserted = 0
    for node in gemm_nodes(gm):
        info = node.meta.get("fp4_role")
        if info is None or not info.rht:
            continue
        args = bound_arguments(node)
        a, b = args["a"], args["b"]
        with gm.graph.inserting_before(node):
            ra = gm.graph.call_function(RHT, (a, ctx.recipe.rht_size))
            rb = gm.graph.call_function(RHT, (b, ctx.recipe.rht_size))
        for new, old in ((ra, a), (rb, b)):
            new.meta["val"] = torch.empty_like(old.meta["val"])
        set_arguments(node, a=ra, b=rb)
        inserted += 2
    ctx.note(f"graph {ctx.graph_id}: inserted {inserted} RHT nodes")
    return gm
