"""fuse_amax: NVFP4 quantizers take their global amax from the operand's producer or a shared pass.

Requires: ``lower_gemms`` (it runs on the final quantize nodes).
Guarantees: on CUDA graphs (elsewhere the pass changes nothing), NVFP4 quantize nodes
(``fp4.quantize`` / ``fp4.fake_quantize`` with 1x16 blocks, ``fp4.rht_quantize`` /
``fp4.fake_rht_quantize``) get their ``amax`` argument from an earlier node, so their kernel makes one
pass over the operand instead of two (an amax pass, then the quantizing pass):

- a tensor quantized both along K (dgrad's dY) and, transposed with the RHT, along tokens (wgrad's
  dY^T) gets both amaxes from one ``fp4.wgrad_amax`` node, one read of the tensor for the two; where
  both quantizations are written decoded for the emulation (``lower_gemms``), they become one
  ``fp4.fake_dual_quantize`` node, one more read for the two, and where both are written packed with
  row-major scales (the packed emulation, the FP4-operand GEMM) one ``fp4.dual_quantize`` node; the
  GEMMs take the amaxes from ``fp4.wgrad_amax`` (the dual node's metadata: ``fp4_quantize`` for dY,
  ``fp4_quantize_rht`` for dY^T);
- any other 1x16 operand whose producer Inductor compiles into a kernel of its own making (a layer
  norm, an activation function, a residual sum: anything but a graph input, a GEMM, attention or an
  ``fp4`` op) gets its amax in the graph: a reduction whose first stage Inductor computes in the
  producer's kernel, so x is not read again for it. (A row max, then a max over the rows, also fuses,
  but measured slower: three kernels instead of two.) A float32 x takes ``amax(abs(x))``. A bf16 or
  fp16 x takes the maximum of its bit patterns with the sign bit cleared, read back as a float: inside
  the fused kernel Inductor holds a bf16 or fp16 result in float32, unrounded, so ``amax(abs(x))``
  there could differ from the amax of the stored tensor (under autocast, with the bf16 cast of a
  LayerNorm output, the step's bits changed on the H200); a bitcast needs the stored bits, so Inductor
  rounds the value to x's dtype first, and for non-negative floats of one format the order of the bit
  patterns is the order of the values (a NaN's patterns lie above infinity's, so a NaN still wins).
  Not where the graph runs eagerly (``Backend(inner="eager")``): there each op of the reduction is a
  kernel of its own.

The amax is exact (a maximum, no rounding), so codes, scales and amax keep their bits. Quantizers with
an amax already (X and RHT(X^T) of a linear whose forward shares X's amaxes: ``plan_sharing``),
sharded-amax operands (``fp4.quantize_sharded``), MXFP4 (no global scale) and 16x16
weights (read from a graph input) keep their own amax pass. ``fp4_quantize`` metadata records where
each amax comes from (``amax``: ``producer``, ``wgrad_amax``, ``wgrad_amax in the forward``, ``given``
or ``own pass``).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fp4compile import vocabulary
from fp4compile.contracts import broken, contract
from fp4compile.sites import CompileContext, bound_arguments, call_unpacked, example_tensor, set_arguments
from fp4compile.vocabulary import (
    DUAL_QUANTIZE, FAKE_DUAL_QUANTIZE, FAKE_QUANTIZE, FAKE_RHT_QUANTIZE, QUANTIZE, RHT_QUANTIZE, WGRAD_AMAX,
)

aten = torch.ops.aten
ROWS = (QUANTIZE, FAKE_QUANTIZE)
TRANSFORMED = (RHT_QUANTIZE, FAKE_RHT_QUANTIZE)
# Ops that only relabel memory: the producer is behind them.
VIEWS = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.t.default,
    aten.permute.default, aten.alias.default, aten.expand.default, aten.squeeze.dim, aten.unsqueeze.default,
}
# Multi-output ops Inductor computes in a kernel of its own (their results come through getitem).
FUSIBLE_MULTI = {
    aten.native_layer_norm.default, aten.native_layer_norm_backward.default, aten.var_mean.correction,
    aten.native_group_norm.default, aten.native_batch_norm.default,
}
# Single-output ops Inductor hands to a library (cuBLAS, cuDNN, flash attention) or to a kernel of their
# own: no fusion there. Matched against the words of the op's name (split at "_"), not substrings:
# "convert_element_type", the cast Inductor fuses into its producer, is not a convolution.
EXTERN_WORDS = frozenset({
    "mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "conv", "conv1d", "conv2d", "conv3d", "convolution",
    "attention", "scaled", "cudnn", "cufft", "fft", "sort", "argsort", "topk", "scatter", "put",
})


def applies(node: fx.Node) -> bool:
    """Whether the quantize ``node`` runs where a separate amax pass costs a read."""
    val = example_tensor(bound_arguments(node)["x"])
    return val is not None and vocabulary.separate_amax_costs_a_read(val)


def _behind_views(node: fx.Node) -> fx.Node:
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in VIEWS:
        node = node.args[0]
    return node


LOW_PRECISION = {torch.bfloat16: torch.int16, torch.float16: torch.int16}  # -> the integer type of its bits


def producer_is_fusible(x: fx.Node) -> bool:
    """Whether Inductor computes ``x`` (through views) in a kernel of its own that can take a reduction
    giving exactly the amax of ``x`` as stored: a float32, bf16 or fp16 ``x`` whose producer is an ATen
    or prims op Inductor generates code for (not a graph input, a library call or an opaque kernel)."""
    val = example_tensor(x)
    if val is None or (val.dtype != torch.float32 and val.dtype not in LOW_PRECISION):
        return False
    node = _behind_views(x)
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False  # a graph input or a constant: a separate read either way
    if node.target is operator.getitem:
        return node.args[0].op == "call_function" and node.args[0].target in FUSIBLE_MULTI
    namespace = getattr(node.target, "namespace", "")
    if namespace not in ("aten", "prims"):
        return False  # fp4 ops and other custom ops are opaque kernels
    name = node.target.name() if hasattr(node.target, "name") else str(node.target)
    words = set(name.split("::")[-1].split(".")[0].split("_"))
    return not words & EXTERN_WORDS


def _is_2d_transpose_of(node: fx.Node, base: fx.Node) -> bool:
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    if node.target is aten.t.default or (node.target is aten.permute.default and list(node.args[1]) == [1, 0]):
        return node.args[0] is base
    return False


def _fmt_block(node: fx.Node) -> tuple:
    args = bound_arguments(node)
    return args["fmt"], args["block"]


def _has_amax(node: fx.Node) -> bool:
    return bound_arguments(node)["amax"] is not None


def _give_amax(node: fx.Node, amax: fx.Node, source: str) -> None:
    set_arguments(node, amax=amax)
    if "fp4_quantize" in node.meta:
        node.meta["fp4_quantize"] = dict(node.meta["fp4_quantize"], amax=source)


def _x(quantizer: fx.Node) -> fx.Node:
    """The tensor a quantizer node quantizes."""
    return bound_arguments(quantizer)["x"]


def _call(graph: fx.Graph, target, *args) -> fx.Node:
    """``target(*args)`` as a node at the graph's insertion point, its fake value computed from its
    arguments'."""
    node = graph.call_function(target, args)
    node.meta["val"] = target(*fx.map_arg(args, lambda n: n.meta["val"]))
    return node


def _producer_amax(gm: fx.GraphModule, q: fx.Node) -> fx.Node:
    """x's amax as a float32 0-dim node, inserted before ``q``, as a reduction Inductor splits and whose
    first stage it computes in x's producer kernel: ``amax(abs(x))`` for float32; for bf16 and fp16 the
    largest bit pattern with the sign bit cleared, bitcast back and widened (exact, and computed from x
    rounded to its dtype: see the module's docstring). The reduction node is marked
    ``fp4_producer_amax`` (``fp4compile.traffic`` costs its second stage)."""
    x = bound_arguments(q)["x"]
    val = x.meta["val"]
    g = gm.graph
    dims = list(range(val.dim()))
    wide = val.dtype == torch.float32
    with g.inserting_before(q):
        if wide:
            magnitude = _call(g, aten.abs.default, x)
        else:
            magnitude = _call(g, aten.bitwise_and.Scalar, _call(g, aten.view.dtype, x, LOW_PRECISION[val.dtype]), 0x7FFF)
        largest = _call(g, aten.amax.default, magnitude, dims)
        largest.meta["fp4_producer_amax"] = True
        if wide:
            return largest
        return _call(g, torch.ops.prims.convert_element_type.default, _call(g, aten.view.dtype, largest, val.dtype),
                     torch.float32)


def _row_major(node: fx.Node) -> bool:
    return bound_arguments(node)["layout"] == "row_major"


def _one_launch_takes(rows: fx.Node, transformed: fx.Node, base: fx.Node) -> bool:
    """Whether the dual kernel takes the pair (``check_fake_dual_quantize`` less the device): the block
    scale rule "6", the 16-point RHT, a 2-D [tokens, K] gradient with tokens a multiple of 16. Elsewhere
    the two quantizers stay apart, each a kernel of its own in Inductor's code."""
    val = base.meta.get("val")
    return (bound_arguments(rows)["scale_rule"] == "6" and bound_arguments(transformed)["size"] == 16
            and isinstance(val, torch.Tensor) and val.dim() == 2 and isinstance(val.shape[0], int)
            and val.shape[0] % 16 == 0)


def _make_dual(gm: fx.GraphModule, rows: fx.Node, transformed: fx.Node, base: fx.Node, amaxes: list, first: fx.Node):
    """Replace a gradient's two quantizations (``rows``: 1x16, ``transformed``: RHT of its transpose),
    whose amaxes are ``amaxes`` (from ``fp4.wgrad_amax``), by one ``fp4.fake_dual_quantize`` of ``base``
    (both decoded) or ``fp4.dual_quantize`` (both packed, scales row-major); readers of their amax outputs
    read ``amaxes`` instead."""
    q, t = bound_arguments(rows), bound_arguments(transformed)
    args = (base, t["size"], q["fmt"], q["rounding"], q["seed"], q["check"], t["rounding"], t["seed"], t["check"], *amaxes)
    rule = {"scale_rule": q["scale_rule"]} if q["scale_rule"] != "6" else {}
    packed = rows.target is QUANTIZE  # codes and scales of each, else the decoded operand of each
    with gm.graph.inserting_before(first):
        dual, outputs = call_unpacked(gm.graph, DUAL_QUANTIZE if packed else FAKE_DUAL_QUANTIZE, args,
                                      4 if packed else 2, rule)
    dual.meta["fp4_quantize"] = dict(rows.meta.get("fp4_quantize", {}), dual=True)
    dual.meta["fp4_quantize_rht"] = dict(transformed.meta.get("fp4_quantize", {}), dual=True)
    per_operand = (outputs[:2], outputs[2:]) if packed else ((outputs[0],), (outputs[1],))
    for old, written, amax in ((rows, per_operand[0], amaxes[0]), (transformed, per_operand[1], amaxes[1])):
        for item in list(old.users):
            if item.target is not operator.getitem:
                raise AssertionError(f"fuse_amax: {old.name} is read other than through getitem")
            index = item.args[1]
            item.replace_all_uses_with(written[index] if index < len(written) else amax)
            gm.graph.erase_node(item)
        gm.graph.erase_node(old)


def _ensures_amaxes_read(gm: fx.GraphModule, ctx: CompileContext) -> None:
    for node in gm.graph.find_nodes(op="call_function", target=WGRAD_AMAX):
        if not node.users:
            broken(f"{node.name} computes amaxes nothing reads")


@contract(after=("lower_gemms",), stages=("forward", "backward"), ensures=_ensures_amaxes_read)
def fuse_amax(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    nvfp4 = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ROWS + TRANSFORMED and _fmt_block(n)[0] == "nvfp4"]
    quantizers = [n for n in nvfp4 if _fmt_block(n)[1] == "1x16" and not _has_amax(n) and applies(n)]
    rows = [n for n in quantizers if n.target in ROWS]
    shared = fused = dual = 0
    taken = set()
    for r in (n for n in quantizers if n.target in TRANSFORMED):
        x, size = bound_arguments(r)["x"], bound_arguments(r)["size"]
        partner = next(
            (q for q in rows if q not in taken and isinstance(_x(q), fx.Node) and _is_2d_transpose_of(x, _x(q))),
            None,
        )
        if partner is None:
            continue
        base = _x(partner)
        first = min(r, partner, key=order.__getitem__)
        with gm.graph.inserting_before(first):
            _, amaxes = call_unpacked(gm.graph, WGRAD_AMAX, (base, size), 2)
        _give_amax(partner, amaxes[0], "wgrad_amax")
        _give_amax(r, amaxes[1], "wgrad_amax")
        taken.add(partner)
        shared += 1
        both_decoded = partner.target is FAKE_QUANTIZE and r.target is FAKE_RHT_QUANTIZE
        both_packed = (partner.target is QUANTIZE and r.target is RHT_QUANTIZE and _row_major(partner)
                       and _row_major(r))
        if (both_decoded or both_packed) and _one_launch_takes(partner, r, base):
            _make_dual(gm, partner, r, base, amaxes, first)
            dual += 1
    # Run eagerly (``inner="eager"``), each op of the reduction would be a kernel of its own writing a
    # full tensor: more traffic than the quantizer's own amax pass. Only a compiler fuses it.
    fuses = getattr(ctx, "inner", None) != "eager"
    # Quantizers of one tensor (q, k and v of one norm, each through a view of its own) share one
    # reduction: the views in VIEWS reshape, transpose or broadcast, so every one holds the values of the
    # tensor behind it, and has its amax.
    made: dict = {}  # the tensor behind the views -> its amax node
    for q in rows:  # in graph order: the first quantizer gets the node, before it, for the later ones
        if q in taken:
            continue
        if fuses and producer_is_fusible(_x(q)):
            base = _behind_views(_x(q))
            if base not in made:
                made[base] = _producer_amax(gm, q)
            _give_amax(q, made[base], "producer")
            fused += 1
    for n in nvfp4:
        if "fp4_quantize" in n.meta and "amax" not in n.meta["fp4_quantize"]:
            n.meta["fp4_quantize"] = dict(n.meta["fp4_quantize"], amax="given" if _has_amax(n) else "own pass")
    ctx.note(
        f"graph {ctx.graph_id}: {shared} tensors share one amax read between their two quantizations, "
        f"{fused} quantizers take the amax from their operand's producer, {dual} gradients are quantized for "
        "dgrad and wgrad in one launch"
    )
    return gm
