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
A CUTLASS GEMM reads its scales in the 128x4 tiled layout (``fp4compile.scale_layout``), so nothing is
rearranged per call: each operand's producer (``fp4.quantize``, ``fp4.quantize_sharded``, or dgrad's
``fp4.transpose_quantized``)
whose scales only CUTLASS GEMMs read is asked to write that layout (``layout="swizzled"``, its metadata
updated); the weight quantized once for fprop and dgrad arrives tiled already (its layout is chosen
when the forward and backward are traced, ``ops._shared_weight_layout``). Where something else also
reads row-major scales, or the producer cannot write the layout, an
``fp4.swizzle_scales`` node rearranges them for the GEMM: logged with the reason, which the site's
``RoleInfo.kernel_reason`` records.
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx

from fp4compile import executors, scale_layout
from fp4compile.sites import CompileContext, example_values

from .insert_quantize import DEQUANTIZE, QUANTIZE, QUANTIZE_SHARDED, TRANSPOSE_QUANTIZED
from .plan_gemm_roles import gemm_nodes

SCALED_MM = torch.ops.fp4.scaled_mm.default
SWIZZLE_SCALES = torch.ops.fp4.swizzle_scales.default
SWIZZLING = (QUANTIZE, TRANSPOSE_QUANTIZED, QUANTIZE_SHARDED)  # producers that write the tiled layout when asked
_SCALES_ARGS = (1, 4)  # where fp4.scaled_mm takes A's and B's scales

log = logging.getLogger("fp4compile")


def _is_cutlass(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is SCALED_MM and executors.is_cutlass_kernel(node.args[8])


def _read_as_cutlass_scales(scales: fx.Node) -> bool:
    """Whether every reader of ``scales`` is a CUTLASS GEMM taking it as an operand's scales."""
    return all(_is_cutlass(u) and all(u.args[i] is not scales or i in _SCALES_ARGS for i in range(len(u.args)))
               for u in scales.users)


def _tiled_scales(gm: fx.GraphModule, mm: fx.Node, index: int) -> str:
    """Make the scales argument ``index`` of the CUTLASS GEMM ``mm`` arrive in the tiled layout; return
    why a separate ``fp4.swizzle_scales`` node does it, or "" where the producer writes the layout."""
    scales = mm.args[index]
    value = scales.meta.get("val")
    if isinstance(value, torch.Tensor) and value.dim() == 1:
        return ""  # tiled already
    producer = scales.args[0] if scales.op == "call_function" and scales.target is operator.getitem else None
    if producer is not None and producer.target in SWIZZLING and _read_as_cutlass_scales(scales):
        producer.update_kwarg("layout", scale_layout.SWIZZLED)
        producer.meta["val"] = producer.target(*example_values(producer.args), **producer.kwargs)
        for item in producer.users:
            item.meta["val"] = producer.meta["val"][item.args[1]]
        return ""
    why = (f"{producer.target.name() if producer is not None else scales.name} cannot write the tiled layout"
           if producer is None or producer.target not in SWIZZLING
           else "its scales are also read row-major elsewhere (e.g. kept for the backward)")
    with gm.graph.inserting_before(mm):
        tiled = gm.graph.call_function(SWIZZLE_SCALES, (scales,))
    tiled.meta["val"] = SWIZZLE_SCALES(value)
    mm.update_arg(index, tiled)
    return why


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
    separate = 0
    for mm in [n for n in gm.graph.nodes if _is_cutlass(n)]:
        for index, operand in zip(_SCALES_ARGS, "AB"):
            why = _tiled_scales(gm, mm, index)
            if why:
                separate += 1
                info = mm.meta.get("fp4_role")
                note = f"operand {operand}'s scales are swizzled by a separate node: {why}"
                log.info("fp4compile: graph %s, %s: %s", ctx.graph_id, mm.name, note)
                if info is not None:
                    info.kernel_reason = f"{info.kernel_reason}; {note}"
    if separate:
        ctx.note(f"graph {ctx.graph_id}: {separate} CUTLASS GEMM operands get their scales swizzled by a separate node")
    ctx.note(f"graph {ctx.graph_id}: lowered {lowered} GEMMs to fp4.scaled_mm")
    return gm
