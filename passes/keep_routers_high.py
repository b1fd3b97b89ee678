"""keep_routers_high: MoE routers and shared-expert gates stay in high precision.

Requires: ``assign_precision`` (it runs right after it, before the user precision passes, which may
change what it decided).
Guarantees: with ``Recipe.high_precision_routers`` (the default), a GEMM site whose output selects
experts (it reaches a ``topk`` within a few operations, through a softmax, a sigmoid, a cast or a bias
add, without passing another GEMM site) is a router, and a one-output linear whose output goes through a
sigmoid is a shared expert's gate: both are set to "high" with that reason. Their outputs are logits
that pick the experts and weigh their outputs: rounding them to FP4 moves tokens between experts, for
GEMMs that are a small share of the FLOPs (N = number of experts, or 1).
"""

from __future__ import annotations

import operator

import torch.fx as fx

from fp4compile.contracts import broken, contract
from fp4compile.recipe import HIGH
from fp4compile.sites import CompileContext
from fp4compile.vocabulary import ROUTER, SHARED_GATE, regions
_DEPTH = 8  # operations between a router's GEMM and its top-k


def _is(node: fx.Node, name: str) -> bool:
    if node.op == "call_method":
        return node.target == name
    return node.op == "call_function" and getattr(node.target, "__name__", "") == name


def _reaches(node: fx.Node, name: str, depth: int) -> bool:
    """Whether a value computed from ``node`` reaches a ``name`` call within ``depth`` operations,
    passing no other GEMM site."""
    frontier, seen = [node], {node}
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for user in n.users:
                if user in seen or "fp4_site" in user.meta:
                    continue
                if _is(user, name):
                    return True
                seen.add(user)
                nxt.append(user)
        frontier = nxt
    return False


def _ensures_routers_high(gm: fx.GraphModule, ctx: CompileContext) -> None:
    for site in ctx.sites:
        if site.reason in (ROUTER, SHARED_GATE) and site.precision != HIGH:
            broken(f"site {site.name!r} is a {site.reason} in {site.precision}")


@contract(after=("assign_precision",), stages=("dynamo",), ensures=_ensures_routers_high)
def keep_routers_high(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    if not ctx.recipe.high_precision_routers:
        return gm
    graphs = [gm.graph, *(body.graph for _, body in regions(gm))]
    kept = 0
    for graph in graphs:
        for node in graph.nodes:
            index = node.meta.get("fp4_site")
            if index is None or node.op not in ("call_function", "call_method") or node.target is operator.getitem:
                continue
            site = ctx.sites[index]
            if not site.is_low_precision or site.experts is not None:
                continue
            if _reaches(node, "topk", _DEPTH):
                site.set_precision(HIGH, ROUTER)
            elif site.out_features == 1 and _reaches(node, "sigmoid", 2):
                site.set_precision(HIGH, SHARED_GATE)
            else:
                continue
            kept += 1
    ctx.note(f"graph {ctx.graph_id}: kept {kept} routers and gates in high precision")
    return gm


keep_routers_high.pass_name = "keep_routers_high"
