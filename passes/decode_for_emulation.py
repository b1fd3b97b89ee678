"""decode_for_emulation: emulated NVFP4 GEMMs on CUDA become decode + BF16 GEMM nodes in the graph.

Requires: ``lower_scaled_mm`` and ``fuse_rht_quantize``.
Guarantees: every 2-D ``fp4.scaled_mm`` on a CUDA device with the ``emulation`` kernel and NVFP4 becomes
``fp4.emulated_mm(a_bd, a_amax, b_bd, b_amax, fmt, dtype)`` on block-decoded BF16 operands (exact), so
the decode, the GEMM and its epilogue are separate graph nodes that ``lower_kernels`` puts into the code
Inductor compiles, rather than one opaque op call. The operands, their decode and alpha (once, in the
epilogue) are those of the ``scaled_mm`` it replaces, and so is the BF16 GEMM with its fp32 output
(dgrad reads W^T as a view of the decoded weight, whose layout may lead cuBLAS to another kernel and
summation order).
Each operand is decoded by ``fp4.decode_blocks`` right before the GEMM (the packed form is what is kept,
e.g. saved for the backward), except with ``Recipe(decoded_operands=True)`` (what the backend makes of
the default ``None`` when it compiles with CUDA graphs): an operand that comes straight from a
``fp4.quantize`` / ``fp4.rht_quantize`` node used by that GEMM alone is written decoded by its
quantizer instead, a ``fp4.fake_quantize`` / ``fp4.fake_rht_quantize`` node with the same arguments
(seed, check label, metadata): the same codes and scales, written as value(code) * block scale in BF16,
so no decode pass runs before the GEMM.
alpha stays inside ``fp4.emulated_mm`` (applied by the GEMM's epilogue, see ``codegen.cublaslt_gemm``, or
by its epilogue kernel): as graph nodes fused by Inductor into the consumer (a multiply and the bias add
can become one FMA) the bits changed.
dgrad's W^T, the ``fp4.transpose_quantized`` of the kept weight, is W decoded as stored and read
transposed (an ``aten.permute`` view), so the packed transpose no longer runs.
CUTLASS GEMMs (Blackwell), MXFP4, batched GEMMs and CPU graphs keep ``scaled_mm``.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fp4compile.sites import CompileContext, call_unpacked, example_values

from .fuse_rht_quantize import RHT_QUANTIZE
from .insert_quantize import QUANTIZE
from .lower_scaled_mm import SCALED_MM

FAKE_QUANTIZE = torch.ops.fp4.fake_quantize.default
FAKE_RHT_QUANTIZE = torch.ops.fp4.fake_rht_quantize.default
EMULATED_MM = torch.ops.fp4.emulated_mm.default
DECODE_BLOCKS = torch.ops.fp4.decode_blocks.default
TRANSPOSE_QUANTIZED = torch.ops.fp4.transpose_quantized.default
TRANSPOSE = torch.ops.aten.permute.default  # [1, 0]: what aot_autograd graphs hold (Inductor lowers no aten.t)


def applies(mm: fx.Node) -> bool:
    """Whether the emulated GEMM ``mm`` runs where the decoded form pays: a CUDA device."""
    val = mm.meta.get("val")
    return isinstance(val, torch.Tensor) and val.device.type == "cuda"


def _unpacked(items) -> "fx.Node | None":
    """The node whose outputs 0, 1, ... are ``items`` (getitem nodes, in that order), else None."""
    if not all(isinstance(t, fx.Node) and t.target is operator.getitem for t in items):
        return None
    source = items[0].args[0]
    if [t.args for t in items] != [(source, j) for j in range(len(items))]:
        return None
    return source if isinstance(source, fx.Node) else None


def _quantize_of(mm: fx.Node, triple) -> "fx.Node | None":
    """The quantize node whose (codes, scales, amax) are ``triple``, if ``mm`` is its only consumer."""
    q = _unpacked(triple)
    if q is None or q.target not in (QUANTIZE, RHT_QUANTIZE):
        return None
    for item in q.users:
        if item.target is not operator.getitem or any(u is not mm for u in item.users):
            return None
    return q


def _transposed_from(codes: fx.Node, scales: fx.Node) -> "tuple[fx.Node, fx.Node] | None":
    """(codes, scales) of W where ``codes, scales`` are ``fp4.transpose_quantized(W's codes, scales)``."""
    t = _unpacked((codes, scales))
    if t is None or t.target is not TRANSPOSE_QUANTIZED:
        return None
    return t.args[0], t.args[1]


def _erase_with_items(gm: fx.GraphModule, node: fx.Node) -> None:
    """Erase a multi-output node and the getitem nodes that unpack it (none of them read any more)."""
    for item in list(node.users):
        gm.graph.erase_node(item)
    gm.graph.erase_node(node)


def decode_for_emulation(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    decoded = bool(ctx.recipe.decoded_operands)
    replaced = by_quantizer = 0
    for mm in list(gm.graph.nodes):
        if mm.op != "call_function" or mm.target is not SCALED_MM:
            continue
        a, sa, amax_a, b, sb, amax_b, fmt, dtype, kernel = mm.args
        if kernel != "emulation" or fmt != "nvfp4" or not applies(mm):
            continue
        if a.meta["val"].dim() != 2 or b.meta["val"].dim() != 2:
            continue
        sources = [_quantize_of(mm, (a, sa, amax_a)), _quantize_of(mm, (b, sb, amax_b))] if decoded else [None, None]
        operands = []
        for q, (codes, scales, amax) in zip(sources, ((a, sa, amax_a), (b, sb, amax_b))):
            if q is None:
                transposed = _transposed_from(codes, scales)
                with gm.graph.inserting_before(mm):
                    bd = gm.graph.call_function(DECODE_BLOCKS, transposed or (codes, scales))
                    bd.meta["val"] = DECODE_BLOCKS(*example_values(bd.args))
                    if transposed:
                        # W decoded as stored, read transposed by the GEMM (a view: cuBLASLt takes either
                        # layout), instead of transposing the packed tiles first.
                        bd = gm.graph.call_function(TRANSPOSE, (bd, [1, 0]))
                        bd.meta["val"] = TRANSPOSE(*example_values(bd.args))
                operands.append((bd, amax))
                continue
            target = FAKE_RHT_QUANTIZE if q.target is RHT_QUANTIZE else FAKE_QUANTIZE
            with gm.graph.inserting_before(q):
                fq, parts = call_unpacked(gm.graph, target, q.args, 2)
            fq.meta.update({k: v for k, v in q.meta.items() if k not in ("val", "eager_input_vals")})
            if "fp4_quantize" in q.meta:
                fq.meta["fp4_quantize"] = dict(q.meta["fp4_quantize"], decoded=True)
            operands.append(parts)
        with gm.graph.inserting_before(mm):
            new = gm.graph.call_function(EMULATED_MM, (*operands[0], *operands[1], fmt, dtype))
        new.meta.update({k: v for k, v in mm.meta.items() if k != "eager_input_vals"})
        mm.replace_all_uses_with(new)
        gm.graph.erase_node(mm)
        for q in (q for q in sources if q is not None):
            _erase_with_items(gm, q)
        replaced += 1
        by_quantizer += sum(q is not None for q in sources)
    for t in [n for n in gm.graph.nodes if n.target is TRANSPOSE_QUANTIZED]:
        if all(not item.users for item in t.users):  # a packed transpose no GEMM reads any more
            _erase_with_items(gm, t)
    ctx.note(f"graph {ctx.graph_id}: {replaced} emulated GEMMs read decoded operands "
             f"({by_quantizer} written decoded by their quantizer, the rest by fp4.decode_blocks)")
    return gm
