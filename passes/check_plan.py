"""check_plan: say where the precision plan cannot be what the recipe asks, once, with the reason.

Requires: ``assign_precision`` and the user precision passes (it runs after them).
Guarantees: ``ctx.warnings`` holds one (key, line) per problem of this graph's plan; the backend warns
once per key (``fp4compile.PlanWarning``) and the report lists the lines. The problems:

- calls the passes cannot see into (``ctx.opaque``: higher-order ops other than checkpointed regions,
  custom ops) that receive a weight or hold GEMMs: what they compute runs as written;
- no repeated blocks in a model whose GEMMs are all kept in high precision for being outside the
  blocks (a block compiled on its own, with no model to place it in);
- a model whose every block is one of the recipe's first or last high-precision blocks;
- GEMM sites in the middle blocks, none of which runs in a low-precision format (routers and
  shared-expert gates, high by policy, aside).
"""

from __future__ import annotations

import torch.fx as fx

from fp4compile.contracts import broken, contract
from fp4compile.sites import CompileContext
from fp4compile.vocabulary import OUTSIDE_BLOCKS, ROUTER, SHARED_GATE, SWITCHED


def _ensures_warnings(gm: fx.GraphModule, ctx: CompileContext) -> None:
    keys = [w[0] for w in ctx.warnings]
    if not all(isinstance(w, tuple) and len(w) == 2 and all(isinstance(t, str) for t in w) for w in ctx.warnings):
        broken("ctx.warnings holds something other than (key, line) pairs of text")
    if len(set(keys)) != len(keys):
        broken(f"a problem is warned about twice: {sorted(k for k in keys if keys.count(k) > 1)[:3]}")


@contract(after=("assign_precision",), stages=("dynamo",), ensures=_ensures_warnings)
def check_plan(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    warnings = ctx.warnings  # with what earlier passes found (find_blocks)
    opaque: dict[str, list[str]] = {}
    for _, what, module in ctx.opaque:
        opaque.setdefault(what, []).append(module or "the top level")
    for what, modules in opaque.items():
        where = ", ".join(dict.fromkeys(modules))
        warnings.append((f"opaque {what}", (
            f"cannot see inside {what} (in {where}): any GEMM it computes runs as written, in high precision"
        )))
    sites = ctx.sites
    if not sites:
        return gm
    root = ctx.model.root_class if ctx.model is not None else "the compiled module"
    if ctx.n_blocks == 0 and all(s.reason == OUTSIDE_BLOCKS for s in sites):
        warnings.append((f"no blocks {root}", (
            f"found no repeated blocks in {root}: its GEMMs stay in high precision as '{OUTSIDE_BLOCKS}'. "
            "If it is one block of a larger model compiled block by block, pass the model as "
            "fp4compile.Backend(model=...); Recipe(high_precision_outside_blocks=False) runs GEMMs outside "
            "blocks in FP4"
        )))
        return gm
    first, last = ctx.recipe.high_precision_block_counts(ctx.n_blocks)
    if ctx.n_blocks and first + last >= ctx.n_blocks:
        warnings.append(("all blocks high", (
            f"all {ctx.n_blocks} blocks of {root} are among the recipe's first {first} and last {last} "
            f"high-precision blocks: no GEMM runs in {ctx.recipe.fmt} (set Recipe.high_precision_first_blocks "
            "and high_precision_last_blocks to change this)"
        )))
        return gm
    # Routers and shared-expert gates are high by the recipe's policy (a graph may hold nothing else).
    middle = [s for s in sites if s.block is not None and first <= s.block < ctx.n_blocks - last
              and s.reason not in (ROUTER, SHARED_GATE)]
    switched = all(s.reason == SWITCHED for s in middle)
    if middle and not any(s.is_low_precision for s in sites) and not switched:
        reasons = ", ".join(dict.fromkeys(s.reason for s in middle))
        warnings.append((f"no fp4 graph {ctx.graph_id}", (
            f"graph {ctx.graph_id}: none of its {len(sites)} GEMM sites runs in {ctx.recipe.fmt}, "
            f"{len(middle)} of them in middle blocks ({reasons})"
        )))
    return gm
