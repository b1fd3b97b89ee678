"""assign_precision: give every GEMM site a precision from the recipe's policy.

Requires: ``find_gemm_sites`` and ``find_blocks``.
Guarantees: every site has ``precision`` ("nvfp4"/"mxfp4" or "high") and a ``reason`` naming the rule:
``high_precision_modules`` patterns, the first/last blocks of the recipe, a place outside the model's
repeated blocks (``Recipe.high_precision_outside_blocks``), or the default format.
User precision passes run after this one and may change any site (see ``Backend(passes=...)``).
"""

from __future__ import annotations

import torch.fx as fx

from fp4compile.contracts import broken, contract
from fp4compile.recipe import HIGH
from fp4compile.sites import CompileContext
from fp4compile.vocabulary import OUTSIDE_BLOCKS


def _ensures_precisions(gm: fx.GraphModule, ctx: CompileContext) -> None:
    for site in ctx.sites:
        if site.precision not in (HIGH, ctx.recipe.fmt) or not site.reason:
            broken(f"site {site.name!r} has precision {site.precision!r} for the reason {site.reason!r}")


@contract(after=("find_blocks",), stages=("dynamo",), ensures=_ensures_precisions)
def assign_precision(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    recipe = ctx.recipe
    first, last = recipe.high_precision_block_counts(ctx.n_blocks)
    for site in ctx.sites:
        pattern = recipe.matches_high_precision_module(site.name)
        if pattern is not None:
            site.set_precision(HIGH, f"high_precision_modules matches {pattern!r}")
        elif site.block is not None and site.block < first:
            site.set_precision(HIGH, f"first {first} of {ctx.n_blocks} blocks")
        elif site.block is not None and site.block >= ctx.n_blocks - last:
            site.set_precision(HIGH, f"last {last} of {ctx.n_blocks} blocks")
        elif site.block is None and recipe.high_precision_outside_blocks:
            site.set_precision(HIGH, OUTSIDE_BLOCKS)
        else:
            site.set_precision(recipe.fmt, "recipe default")
    n_low = sum(s.is_low_precision for s in ctx.sites)
    ctx.note(f"graph {ctx.graph_id}: {n_low} of {len(ctx.sites)} GEMM sites in {recipe.fmt}")
    return gm
