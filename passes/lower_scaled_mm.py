"""lower_scaled_mm: replace each quantize-dequantize GEMM by ``fp4.scaled_mm`` on the packed operands.

Requires: ``insert_quantize``.
Guarantees: every ``fp4.gemm(dequantize(quantize(a)), dequantize(quantize(b)))`` becomes
``fp4.scaled_mm(a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, fmt, dtype, kernel)`` with the
kernel chosen by the executor table (``fp4compile.executors.choose_gemm``) for its shape and device
(CUTLASS on Blackwell, emulation elsewhere), the choice and its reason stored in the site's ``RoleInfo``. The choice builds
nothing and depends on the device's architecture, N, K and M only; a symbolic M (dynamic shapes) is
taken at its size hint. Dequantize nodes left without users are removed. Remaining ``fp4.gemm`` nodes
are high-precision GEMMs. Batched GEMMs (activation matmuls with leading dims) run the emulated kernel.
On a Blackwell GPU, an FP4 GEMM that gets no CUTLASS kernel is an error naming the site, role, shape
and reason (``executors.CutlassRequired``) unless ``Recipe.allow_emulation``.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fp4compile import executors
from fp4compile.sites import CompileContext

from .insert_quantize import DEQUANTIZE
from .plan_gemm_roles import gemm_nodes

SCALED_MM = torch.ops.fp4.scaled_mm.default


def lower_scaled_mm(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    lowered = 0
    for node in gemm_nodes(gm):
        info = node.meta.get("fp4_role")
        a, b, role, index, dtype = node.args[:5]
        if info is None or info.precision == "high":
            continue
        if not all(isinstance(x, fx.Node) and x.target is DEQUANTIZE for x in (a, b)):
            continue
        aval = a.meta["val"]
        (m, k), n = aval.shape[-2:], b.meta["val"].shape[-2]
        device = node.meta["val"].device
        allow = ctx.recipe.allow_emulation
        try:
            choice = executors.choose_gemm(m, n, k, info.precision, dtype, device, allow, batched=aval.dim() > 2)
        except executors.CutlassRequired as exc:
            site = ctx.sites[node.args[3]]
            shape = "x".join(str(d) for d in info.shape)
            raise executors.CutlassRequired(
                f"{site.name} {info.role} GEMM (M x N x K = {shape}): {exc}", exc.declined
            ) from None
        info.kernel, info.kernel_reason = choice.name, choice.reason
        with gm.graph.inserting_before(node):
            mm = gm.graph.call_function(
                SCALED_MM, (*a.args[:3], *b.args[:3], info.precision, dtype, choice.name)
            )
        mm.meta.update({k: v for k, v in node.meta.items() if k != "eager_input_vals"})
        node.replace_all_uses_with(mm)
        gm.graph.erase_node(node)
        lowered += 1
    for node in reversed(list(gm.graph.nodes)):
        if node.target is DEQUANTIZE and not node.users:
            gm.graph.erase_node(node)
    ctx.note(f"graph {ctx.graph_id}: lowered {lowered} GEMMs to fp4.scaled_mm")
    return gm
