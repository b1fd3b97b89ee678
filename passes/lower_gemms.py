"""lower_gemms: each quantize-dequantize GEMM becomes its final form, chosen once from its target.

Requires: ``insert_quantize`` and ``fuse_rht_quantize`` (the weight-gradient operands' quantizers are
``fp4.rht_quantize`` already).
Guarantees: every ``fp4.gemm(dequantize(quantize(a)), dequantize(quantize(b)))`` becomes one of three
forms, chosen by the executor table (``fp4compile.executors.choose_gemm``) for its shape, format and
device; the choice and its reason are stored in the site's ``RoleInfo`` (``kernel``, ``kernel_reason``):

- **CUTLASS, packed** (Blackwell): ``fp4.scaled_mm(a_codes, a_scales, a_amax, b_codes, b_scales,
  b_amax, fmt, dtype, "cutlass:...")``, alpha in the kernel's epilogue. The kernel reads its scales in
  the 128x4 tiled layout (``fp4compile.scale_layout``): each operand's producer (``fp4.quantize``,
  ``fp4.rht_quantize``, ``fp4.quantize_sharded``, dgrad's ``fp4.transpose_quantized``) whose scales only
  CUTLASS GEMMs read is asked to write that layout (``layout="swizzled"``); the weight quantized once
  for fprop and dgrad arrives tiled already (chosen on the joint graph, ``plan_sharing``). Where something else also reads the row-major scales, or the producer
  cannot write the layout, an ``fp4.swizzle_scales`` node rearranges them for the GEMM: logged with the
  reason, which the site's ``kernel_reason`` records.
- **Emulated, decoded** (NVFP4, 2-D, on CUDA): ``fp4.emulated_mm(a_bd, a_amax, b_bd, b_amax, fmt,
  dtype)`` on block-decoded BF16 operands (exact), so the decode, the GEMM and its epilogue are graph
  nodes that ``lower_kernels`` puts into the code Inductor compiles. Each operand is decoded by
  ``fp4.decode_blocks`` right before the GEMM (the packed form is what is kept, e.g. saved for the
  backward); dgrad's W^T, the ``fp4.transpose_quantized`` of the kept weight, is W decoded as stored and
  read transposed (an ``aten.permute`` view), so the packed transpose does not run (cuBLAS may then
  pick another kernel and summation order than for a transposed copy). With
  ``Recipe(decoded_operands=True)`` (what the backend makes of the default ``None`` when it compiles
  with CUDA graphs), an operand that comes straight from an ``fp4.quantize`` / ``fp4.rht_quantize``
  node read by that GEMM alone is written decoded by its quantizer instead: an ``fp4.fake_quantize`` /
  ``fp4.fake_rht_quantize`` node with the same arguments (seed, check label, metadata, with
  ``decoded=True``), the same codes and scales written as value(code) * block scale in BF16, so no
  decode pass runs. The multiply by alpha stays inside ``fp4.emulated_mm`` (applied by the GEMM's
  epilogue or its epilogue kernel): as graph nodes fused by Inductor into the consumer the bits changed.
  (``lower_kernels`` may compute alpha itself from the amaxes in the graph: products only.)
- **FP4-operand GEMM** (``FP4COMPILE_EMULATED_GEMM=packed``, NVFP4, 2-D, on CUDA): ``fp4.packed_mm(a_codes,
  a_scales, a_amax, b_codes, b_scales, b_amax, fmt, dtype)``, one Triton kernel that reads the packed
  operands, decodes them in registers inside its K loop and applies alpha in its epilogue: no decode
  kernels, no decoded copies, no epilogue kernel (``lower_kernels`` puts it into Inductor's code).
  dgrad's W^T is W as stored (``b_kn=True``), so the packed transpose does not run. Decoded operands
  (``Recipe.decoded_operands``) do not apply: the quantizers write packed operands.
- **Emulated, packed** (elsewhere: the CPU, MXFP4, batched activation GEMMs):
  ``fp4.scaled_mm(..., "emulation")``, which decodes, multiplies and applies alpha in one op. A
  ``scaled_mm`` implementation a user registered (``executors.register``) keeps its ``fp4.scaled_mm``
  node with its kernel string, on CUDA too.

The choice builds nothing and depends on the device's architecture, N, K and M only; a symbolic M
(dynamic shapes) is taken at its size hint. Dequantize nodes and packed transposes left without users
are removed. Remaining ``fp4.gemm`` nodes are high-precision GEMMs. On a Blackwell GPU, an FP4 GEMM
that gets no CUTLASS kernel is an error naming the site, role, shape and reason
(``executors.CutlassRequired``) unless ``Recipe.allow_emulation``.
"""

from __future__ import annotations

import logging
import operator
from typing import Optional

import torch
import torch.fx as fx

from fp4compile import executors, scale_layout
from fp4compile.contracts import broken, contract
from fp4compile.sites import CompileContext, bound_arguments, call_unpacked, example_values, set_arguments
from fp4compile.vocabulary import (
    DECODE_BLOCKS, DEQUANTIZE, EMULATED_MM, FAKE_QUANTIZE, FAKE_RHT_QUANTIZE, PACKED_MM, QUANTIZE, QUANTIZE_SHARDED,
    RHT_QUANTIZE, SCALED_MM, SWIZZLE_SCALES, TRANSPOSE_QUANTIZED, gemm_nodes,
)
TRANSPOSE = torch.ops.aten.permute.default  # [1, 0]: what aot_autograd graphs hold (Inductor lowers no aten.t)
# Producers that write the tiled scale layout when asked.
SWIZZLING = (QUANTIZE, RHT_QUANTIZE, TRANSPOSE_QUANTIZED, QUANTIZE_SHARDED)
_SCALES_ARGS = ("a_scales", "b_scales")  # fp4.scaled_mm's arguments for A's and B's scales
_DECODED_BY = {QUANTIZE: FAKE_QUANTIZE, RHT_QUANTIZE: FAKE_RHT_QUANTIZE}

log = logging.getLogger("fp4compile")


def decodes_on(device: torch.device) -> bool:
    """Whether an emulated NVFP4 GEMM on ``device`` takes the decoded form: a CUDA device, where the
    decode, the GEMM and the epilogue become kernels in Inductor's code."""
    return device.type == "cuda"


def _form(kernel: str, fmt: str, batched: bool, device: torch.device) -> str:
    """The GEMM's final form: "cutlass", "triton" (the FP4-operand GEMM, ``fp4.packed_mm``), "decoded"
    (the built-in emulation, where it decodes) or "packed" (the emulation elsewhere, and any other
    implementation of ``scaled_mm`` a user registered, which then runs as the op's call)."""
    if executors.is_cutlass_kernel(kernel):
        return "cutlass"
    if kernel == "triton":
        return "triton"
    if kernel == "emulation" and fmt == "nvfp4" and not batched and decodes_on(device):
        return "decoded"
    return "packed"


# -- CUTLASS: scales in the tiled layout ---------------------------------------------------------

def _is_cutlass(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target is SCALED_MM
            and executors.is_cutlass_kernel(bound_arguments(node)["kernel"]))


def _read_as_cutlass_scales(scales: fx.Node) -> bool:
    """Whether every reader of ``scales`` is a CUTLASS GEMM taking it as an operand's scales."""
    return all(_is_cutlass(u) and all(v is not scales or k in _SCALES_ARGS for k, v in bound_arguments(u).items())
               for u in scales.users)


def _tiled_scales(gm: fx.GraphModule, mm: fx.Node, name: str) -> str:
    """Make the scales argument ``name`` of the CUTLASS GEMM ``mm`` arrive in the tiled layout; return
    why a separate ``fp4.swizzle_scales`` node does it, or "" where the producer writes the layout."""
    scales = bound_arguments(mm)[name]
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
    set_arguments(mm, **{name: tiled})
    return why


# -- The FP4-operand GEMM -------------------------------------------------------------------------

def _packed_operands(a_parts: dict, b_parts: dict) -> tuple[tuple, dict]:
    """``fp4.packed_mm``'s operands: A's and B's codes, scales and amax; dgrad's W^T (a
    ``fp4.transpose_quantized`` of W) as W is stored, read transposed by the kernel (``b_kn``)."""
    b_data, b_scales, extra = b_parts["data"], b_parts["scales"], {}
    t = _unpacked((b_data, b_scales))
    if t is not None and t.target is TRANSPOSE_QUANTIZED:
        stored = bound_arguments(t)
        b_data, b_scales, extra = stored["data"], stored["scales"], {"b_kn": True}
    return (a_parts["data"], a_parts["scales"], a_parts["amax"], b_data, b_scales, b_parts["amax"]), extra


# -- Emulated, decoded -----------------------------------------------------------------------------

def _unpacked(items) -> Optional[fx.Node]:
    """The node whose outputs 0, 1, ... are ``items`` (getitem nodes, in that order), else None."""
    if not all(isinstance(t, fx.Node) and t.target is operator.getitem for t in items):
        return None
    source = items[0].args[0]
    if [t.args for t in items] != [(source, j) for j in range(len(items))]:
        return None
    return source if isinstance(source, fx.Node) else None


def _decoded_operand(gm: fx.GraphModule, before: fx.Node, codes: fx.Node, scales: fx.Node) -> fx.Node:
    """``fp4.decode_blocks`` of an operand, inserted before ``before``; dgrad's W^T (a
    ``fp4.transpose_quantized`` of W) is W decoded as stored and read transposed."""
    t = _unpacked((codes, scales))
    transposed = t is not None and t.target is TRANSPOSE_QUANTIZED
    with gm.graph.inserting_before(before):
        if transposed:
            stored = bound_arguments(t)
            codes, scales = stored["data"], stored["scales"]
        bd = gm.graph.call_function(DECODE_BLOCKS, (codes, scales))
        bd.meta["val"] = DECODE_BLOCKS(*example_values(bd.args))
        if transposed:
            bd = gm.graph.call_function(TRANSPOSE, (bd, [1, 0]))
            bd.meta["val"] = TRANSPOSE(*example_values(bd.args))
    return bd


def _quantizer_decodes(gm: fx.GraphModule, mm: fx.Node, index: int) -> bool:
    """Where operand ``index`` (0 or 1) of the decoded GEMM ``mm`` is ``decode_blocks`` of an
    ``fp4.quantize`` / ``fp4.rht_quantize`` that nothing else reads, have that quantizer write the
    decoded operand itself (its ``fake_`` form, same arguments and metadata). Returns whether it did."""
    operand, operand_amax = ("a", "a_amax") if index == 0 else ("b", "b_amax")
    gemm = bound_arguments(mm)
    bd, amax = gemm[operand], gemm[operand_amax]
    if bd.target is not DECODE_BLOCKS or len(bd.users) != 1:
        return False
    decoded_from = bound_arguments(bd)
    q = _unpacked((decoded_from["data"], decoded_from["scales"], amax))
    if q is None or q.target not in _DECODED_BY:
        return False
    if any(item.target is not operator.getitem or any(u not in (bd, mm) for u in item.users) for item in q.users):
        return False
    with gm.graph.inserting_before(q):
        # The quantizer's arguments by name (the scales' layout does not apply to decoded values; the block
        # scale rule is a keyword, as insert_quantize gives it).
        quantizer, target = bound_arguments(q), _DECODED_BY[q.target]
        names = [a.name for a in target._schema.arguments if a.name != "scale_rule"]
        rule = {"scale_rule": quantizer["scale_rule"]} if quantizer["scale_rule"] != "6" else {}
        fq, (decoded, fq_amax) = call_unpacked(gm.graph, target, tuple(quantizer[n] for n in names), 2, rule)
    fq.meta.update({k: v for k, v in q.meta.items() if k not in ("val", "eager_input_vals")})
    if "fp4_quantize" in q.meta:
        fq.meta["fp4_quantize"] = dict(q.meta["fp4_quantize"], decoded=True)
    set_arguments(mm, **{operand: decoded, operand_amax: fq_amax})
    gm.graph.erase_node(bd)
    _erase_with_items(gm, q)
    return True


def _erase_with_items(gm: fx.GraphModule, node: fx.Node) -> None:
    """Erase a multi-output node and the getitem nodes that unpack it (none of them read any more)."""
    for item in list(node.users):
        gm.graph.erase_node(item)
    gm.graph.erase_node(node)


def _ensures_lowered(gm: fx.GraphModule, ctx: CompileContext) -> None:
    for node in gemm_nodes(gm):
        gemm = bound_arguments(node)
        if any(isinstance(gemm[k], fx.Node) and gemm[k].target is DEQUANTIZE for k in ("a", "b")):
            broken(f"{node.name} ({node.meta['fp4_role'].role}) still reads dequantized operands")


@contract(after=("fuse_rht_quantize",), stages=("forward", "backward"), ensures=_ensures_lowered)
def lower_gemms(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    forms = {"cutlass": 0, "triton": 0, "decoded": 0, "packed": 0}
    decoded_gemms = []
    for node in gemm_nodes(gm):
        info = node.meta.get("fp4_role")
        gemm = bound_arguments(node)
        a, b, index, dtype = gemm["a"], gemm["b"], gemm["site"], gemm["dtype"]
        if info is None or info.precision == "high":
            continue
        if not all(isinstance(x, fx.Node) and x.target is DEQUANTIZE for x in (a, b)):
            continue
        aval = a.meta["val"]
        (m, k), n = aval.shape[-2:], b.meta["val"].shape[-2]
        device = node.meta["val"].device
        batched = aval.dim() > 2
        # The operands' block scale rule (their dequantize nodes': insert_quantize) sets alpha's constant.
        a_parts, b_parts = bound_arguments(a), bound_arguments(b)
        rule = {"scale_rule": a_parts["scale_rule"]} if a_parts["scale_rule"] != "6" else {}
        if a_parts["scale_rule"] != b_parts["scale_rule"]:
            raise AssertionError(f"lower_gemms: {node.name}'s operands were quantized with different block scale rules")
        try:
            choice = executors.choose_gemm(m, n, k, info.precision, dtype, device, ctx.recipe.allow_emulation,
                                           batched=batched, scale_rule=rule.get("scale_rule", "6"))
        except executors.CutlassRequired as exc:
            site = ctx.sites[index]
            shape = "x".join(str(d) for d in info.shape)
            raise executors.CutlassRequired(
                f"{site.name} {info.role} GEMM (M x N x K = {shape}): {exc}", exc.declined
            ) from None
        info.kernel, info.kernel_reason = choice.name, choice.reason
        form = _form(choice.name, info.precision, batched, device)
        if form == "decoded":
            operands = (_decoded_operand(gm, node, a_parts["data"], a_parts["scales"]), a_parts["amax"],
                        _decoded_operand(gm, node, b_parts["data"], b_parts["scales"]), b_parts["amax"])
            target, args = EMULATED_MM, (*operands, info.precision, dtype)
        elif form == "triton":
            operands, extra = _packed_operands(a_parts, b_parts)
            target, args, rule = PACKED_MM, (*operands, info.precision, dtype), {**rule, **extra}
        else:
            packed = tuple(p[k] for p in (a_parts, b_parts) for k in ("data", "scales", "amax"))
            target, args = SCALED_MM, (*packed, info.precision, dtype, choice.name)
        with gm.graph.inserting_before(node):
            mm = gm.graph.call_function(target, args, rule)
        mm.meta.update({k: v for k, v in node.meta.items() if k != "eager_input_vals"})
        node.replace_all_uses_with(mm)
        gm.graph.erase_node(node)
        forms[form] += 1
        if form == "decoded":
            decoded_gemms.append(mm)
    for node in reversed(list(gm.graph.nodes)):
        if node.target is DEQUANTIZE and not node.users:
            gm.graph.erase_node(node)
    for t in [n for n in gm.graph.nodes if n.target is TRANSPOSE_QUANTIZED]:
        if all(not item.users for item in t.users):  # a packed transpose no GEMM reads any more
            _erase_with_items(gm, t)

    by_quantizer = 0
    if ctx.recipe.decoded_operands:
        by_quantizer = sum(_quantizer_decodes(gm, mm, i) for mm in decoded_gemms for i in (0, 1))
    separate = 0
    for mm in [n for n in gm.graph.nodes if _is_cutlass(n)]:
        for name, operand in zip(_SCALES_ARGS, "AB"):
            why = _tiled_scales(gm, mm, name)
            if why:
                separate += 1
                info = mm.meta.get("fp4_role")
                note = f"operand {operand}'s scales are swizzled by a separate node: {why}"
                log.info("fp4compile: graph %s, %s: %s", ctx.graph_id, mm.name, note)
                if info is not None:
                    info.kernel_reason = f"{info.kernel_reason}; {note}"
    if separate:
        ctx.note(f"graph {ctx.graph_id}: {separate} CUTLASS GEMM operands get their scales swizzled by a separate node")
    ctx.note(f"graph {ctx.graph_id}: lowered {sum(forms.values())} GEMMs: {forms['cutlass']} CUTLASS, "
             f"{forms['triton']} FP4-operand Triton GEMMs, "
             f"{forms['decoded']} emulated on decoded operands ({by_quantizer} operands written decoded by "
             f"their quantizer, the others by fp4.decode_blocks), {forms['packed']} on packed operands")
    return gm
