"""plan_gemm_roles: decide how each role-tagged GEMM of the forward/backward graph is computed.

Requires: an aot_autograd forward or backward graph holding ``fp4.gemm(a, b, role, site, dtype)`` nodes
(from ``mark_fp4_linear``) with ``val`` metadata.
Guarantees: for each such node ``site.roles[role]`` is a ``RoleInfo`` with the (M, N, K) shape and either
a low precision with operand blocks and rounding (fprop: X 1x16 RNE, W 16x16 RNE; dgrad: dY 1x16 SR, W
as fprop; wgrad: dY^T 1x16 SR, X^T 1x16 RNE, RHT on both) or "high" with the reason: the recipe
quantizes the forward only, the reduction dim is not a multiple of the block size, or it is dynamic.
``node.meta["fp4_role"]`` holds the same RoleInfo.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fp4compile.recipe import HIGH
from fp4compile.sites import CompileContext, RoleInfo

GEMM = torch.ops.fp4.gemm.default


def gemm_nodes(gm: fx.GraphModule):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is GEMM]


def _static(d):
    return isinstance(d, int) or (hasattr(d, "node") and d.node.is_constant())


def plan_gemm_roles(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    recipe = ctx.recipe
    bs = recipe.block_size
    planned = 0
    for node in gemm_nodes(gm):
        a, b, role, index = node.args[:4]
        site = ctx.sites[index]
        (m, k), (n, _) = a.meta["val"].shape, b.meta["val"].shape
        info = RoleInfo(role=role, shape=tuple(int(d) if _static(d) else str(d) for d in (m, n, k)))
        sr = "sr" if recipe.stochastic_rounding else "rne"
        if not site.is_low_precision:
            info.reason = site.reason
        elif role != "fprop" and not recipe.quantize_backward:
            info.reason = "recipe quantizes the forward GEMMs only"
        elif not _static(k):
            info.reason = f"reduction dim K={k} is dynamic"
            ctx.fallback(site, role, info.reason)
        elif int(k) % bs:
            info.reason = f"reduction dim K={int(k)} is not a multiple of the block size {bs}"
            ctx.fallback(site, role, info.reason)
        else:
            info.precision = site.precision
            info.reason = site.reason
            act, weight = recipe.activation_block, recipe.weight_block
            if role == "fprop":
                info.blocks, info.rounding = (act, weight), ("rne", "rne")
            elif role == "dgrad":
                info.blocks, info.rounding = (act, weight), (sr, "rne")
            else:
                info.blocks, info.rounding = (act, act), (sr, "rne")
                info.rht = recipe.rht
        site.roles[role] = info
        node.meta["fp4_role"] = info
        planned += 1
    ctx.note(f"graph {ctx.graph_id}: planned {planned} role-tagged GEMMs")
    return gm
