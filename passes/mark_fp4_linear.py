"""mark_fp4_linear: replace each low-precision GEMM site by ``fp4.linear(x, w, b, site)``.

Requires: ``assign_precision`` (and any user precision passes).
Guarantees: every site with precision != "high" whose feature dims fit the format's blocks is computed
by ``fp4compile.ops.linear``, whose autograd emits three ``fp4.gemm`` nodes tagged fprop/dgrad/wgrad
once aot_autograd traces the graph; a matmul ``x @ W`` becomes ``fp4.linear(x, W.t(), None)`` and an
``addmm(b, x, W)`` (GPT-2's Conv1D) ``fp4.linear(x, W.t(), b)``.
Sites inside a region (an activation-checkpointed function) are rewritten in the region's graph, so the
checkpoint recomputes the FP4 forward (round-to-nearest: the same bits as the first time).
Sites whose in/out features are not multiples of the block size, or whose operands are float64, stay
as they are, set to "high" with the reason recorded. High-precision sites are not touched: they compute
exactly what the model wrote. A site set to a format other than the recipe's is refused with a
ValueError naming it (quantizers and kernels follow the recipe's format).
A grouped site (MoE experts, ``site.experts``) becomes ``fp4compile.grouped``'s NVFP4 grouped GEMM
(``grouped_sites.mark``), which plans its three roles itself; under MXFP4, or a block scale rule other
than "6" (``Recipe(block_scale_rule="4/6")``, which its per-expert quantizers and the grouped kernel do
not implement), it stays high, with the reason (and, for the rule, one ``PlanWarning``).
An ``activation_matmul`` site ``A @ B`` (two activations, ``Recipe(include_activation_matmuls=True)``)
becomes ``fp4.matmul(A, B, site)`` (in_features = K, out_features = N must fit the blocks).
What the three GEMMs share across the forward and the backward (one quantization of W, one read of X
for both of its amaxes) is planned later, on the joint graph (``plan_sharing``).
Where the backend records activation ranges (``ctx.ranges``: a graph compiled with gradients enabled,
``Recipe.amax_history`` > 0), an NVFP4 linear also gets its site's amax history (``fp4compile.ranges``)
as ``amax_history``: a buffer of the graph module (``fp4_amax_history_<site index>``) that aot_autograd
lifts to a graph input, passed on into a region's graph as an extra operand of the region's call.
Where the backend collects quantization statistics (``ctx.quant_stats``: ``Backend.collect_stats``), an
NVFP4 linear gets its site's statistics buffer (``fp4compile.quant_stats``) as ``stats`` the same way
(``fp4_stats_<site index>``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from fp4compile import ops
from fp4compile.contracts import broken, contract
from fp4compile.recipe import HIGH
from fp4compile.sites import CompileContext, example_tensor
from fp4compile.vocabulary import TORCH_GEMM_TARGETS, regions

from . import grouped_sites

# Why a grouped site stays high under a block scale rule other than "6": its per-expert quantizers
# (``fp4compile.grouped``) and the grouped CUTLASS kernel's epilogue implement the "6" rule only.
GROUPED_SCALE_RULE = ("block_scale_rule={rule!r}: grouped expert GEMMs have the \"6\" block scale rule only "
                      "(their per-expert quantizers and the grouped kernel's alpha)")


class _Histories:
    """The node holding a site's amax history in a graph of ``gm`` (its own, or a region's); with
    ``prefix="fp4_stats"``, its quantization statistics buffer (``ctx.quant_stats``) instead."""

    def __init__(self, gm: fx.GraphModule, ctx: CompileContext, prefix: str = "fp4_amax_history"):
        self.gm, self.ctx, self.prefix = gm, ctx, prefix
        self.owner = ctx.ranges if prefix == "fp4_amax_history" else ctx.quant_stats
        self.calls = {id(body): call for call, body in regions(gm)}  # region graph module -> its call
        self.modules = {id(body.graph): body for _, body in regions(gm)}
        self.nodes: dict[tuple, fx.Node] = {}

    def __call__(self, module: fx.GraphModule, site, index: int, x: fx.Node) -> Optional[fx.Node]:
        ctx = self.ctx
        val = example_tensor(x)
        if self.owner is None or site.precision != "nvfp4" or site.kind == "activation_matmul" or val is None:
            return None
        return self._node(module, index, val.device)

    def _node(self, module: fx.GraphModule, index: int, device) -> fx.Node:
        key = (id(module), index)
        if key in self.nodes:
            return self.nodes[key]
        graph = module.graph
        last = list(graph.find_nodes(op="placeholder"))[-1:]
        if module is self.gm:
            name = f"{self.prefix}_{index}"
            site = self.ctx.sites[index]
            if self.owner is self.ctx.ranges:
                module.register_buffer(name, self.owner.history(site.name, device, self.ctx.recipe.amax_history))
            else:
                module.register_buffer(name, self.owner.buffer(site.name, device))
            if hasattr(module, "_param_name_to_source"):  # aot_autograd asks each lifted buffer's source
                from torch._dynamo.source import ConstantSource

                module._param_name_to_source = {**module._param_name_to_source, name: ConstantSource(name)}
            with graph.inserting_after(last[0]) if last else graph.inserting_before(next(iter(graph.nodes))):
                node = graph.get_attr(name)
        else:
            call = self.calls[id(module)]
            outer = self._node(self.modules[id(call.graph)] if id(call.graph) in self.modules else self.gm, index, device)
            with graph.inserting_after(last[0]) if last else graph.inserting_before(next(iter(graph.nodes))):
                node = graph.placeholder(f"{self.prefix}_{index}")
            call.args = (*call.args, outer)
        self.nodes[key] = node
        return node


def _ensures_marked(gm: fx.GraphModule, ctx: CompileContext) -> None:
    for graph in (gm, *(body for _, body in regions(gm))):
        for node in graph.graph.nodes:
            index = node.meta.get("fp4_site")
            if index is not None and ctx.sites[index].is_low_precision and node.target in TORCH_GEMM_TARGETS:
                broken(f"site {ctx.sites[index].name!r} runs in {ctx.sites[index].precision} but its node "
                       f"{node.name} still calls {node.target}")


@contract(after=("check_plan",), stages=("dynamo",), ensures=_ensures_marked)
def mark_fp4_linear(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    marked = 0
    histories, stats = _Histories(gm, ctx), _Histories(gm, ctx, "fp4_stats")
    for _, region in regions(gm):  # checkpointed functions: rewritten in place, recomputed as marked
        marked += _mark(region, ctx, histories, stats)
    marked += _mark(gm, ctx, histories, stats)
    ctx.note(f"graph {ctx.graph_id}: marked {marked} linears as fp4.linear")
    return gm


def _mark(gm: fx.GraphModule, ctx: CompileContext, histories: _Histories, stats: _Histories) -> int:
    bs = ctx.recipe.block_size
    marked = 0
    for node in list(gm.graph.nodes):
        index = node.meta.get("fp4_site")
        if index is None or node.op != "call_function":
            continue
        site = ctx.sites[index]
        if not site.is_low_precision:
            continue
        if site.precision != ctx.recipe.fmt:
            # Quantizers, scales and kernels are built for the recipe's format and its block size.
            raise ValueError(
                f"fp4compile: GEMM site {site.name!r} was set to {site.precision!r}, but the recipe's fmt is "
                f"{ctx.recipe.fmt!r}; a site runs in the recipe's format or in high precision ('high')"
            )
        bad = [f"{name}={dim}" for name, dim in (("in_features", site.in_features), ("out_features", site.out_features)) if dim % bs]
        operands = [example_tensor(a) for a in node.args if isinstance(a, fx.Node)]
        reason = None
        if any(t is not None and t.dtype == torch.float64 for t in operands):
            # A float64 model asked for float64 arithmetic; FP4 quantizers take fp32, bf16 and fp16.
            reason = "float64 operands: FP4 GEMMs take float32, bfloat16 or float16"
        elif bad:
            reason = f"{', '.join(bad)} not a multiple of the {site.precision} block size {bs}"
        elif site.experts is not None and site.precision != "nvfp4":
            reason = f"grouped expert GEMMs run in NVFP4 only, not {site.precision}"
        elif site.experts is not None and ctx.recipe.block_scale_rule != "6":
            reason = GROUPED_SCALE_RULE.format(rule=ctx.recipe.block_scale_rule)
            ctx.warnings.append(("grouped scale rule",
                                 f"{reason}, so the grouped expert GEMMs run in high precision (the first: {site.name})"))
        if reason is not None:
            ctx.fallback(site, "all GEMMs", reason)
            site.set_precision(HIGH, reason)
            continue
        with gm.graph.inserting_before(node):
            if site.experts is not None:
                new = grouped_sites.mark(gm, node, site, ctx.recipe)
            elif site.kind == "activation_matmul":
                new = gm.graph.call_function(ops.matmul, (node.args[0], node.args[1], index))
            else:
                if site.kind == "linear":
                    x, weight = node.args[0], node.args[1]
                    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
                else:  # matmul x @ B, or addmm(b, x, B): B is [in, out]
                    bias, x, param = node.args[:3] if site.kind == "addmm" else (None, *node.args[:2])
                    weight = gm.graph.call_function(torch.t, (param,))
                args = (x, weight, bias, index)
                history, buffer = histories(gm, site, index, x), stats(gm, site, index, x)
                new = gm.graph.call_function(ops.linear, args + ((history,) if history is not None else ()),
                                             {"stats": buffer} if buffer is not None else {})
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        marked += 1
    if marked:
        gm.graph.lint()
        gm.recompile()
    return marked
