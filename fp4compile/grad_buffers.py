"""Unused output gradients without a copy into the recorded backward graph.

A language model that returns its logits together with a loss computed from them in the same graph
(``logits, loss = model(x, y)``, then ``loss.backward()``) leaves the logits' gradient unused. Autograd
then hands the compiled backward a freshly allocated tensor of zeros for it, and when Inductor records
the backward in a CUDA graph it copies that tensor into the graph's own input buffer on every replay:
for a [16384, 50304] bf16 logits tensor, a 1.6 GB fill and a 1.6 GB copy per step.

Under CUDA graphs the backend therefore gives such an output a buffer of its own: the forward graph
also returns an uninitialized tensor of the output's shape, dtype and strides (an allocation in the
graphs' memory pool, no kernel), and a small autograd node in front of the graph's outputs zeroes that
buffer and passes it on as the gradient when the output's gradient is unused. A tensor that a recorded
graph produced is an input the next recorded graph reads in place, so the copy goes away; the fill
stays (it is the gradient). When the gradient is used the buffer is not touched.

Which outputs get a buffer (``plan``): those that need a gradient, hold at least ``MIN_BYTES``, and that
a loss output of the same graph (a scalar that needs a gradient) is computed from. Other outputs most
likely feed a loss computed outside, or the next graph where the model is split into several (graph
breaks, DDP's buckets), and their gradient is always used; they get none, so as not to hold memory
for nothing.

The outputs leave the graph as aliases made by that node, so ``grad_fn`` names it and in-place changes
to an output behave as before (they share the version counter). Outputs that are views, or that share
storage with another output, are returned as the graph made them (the node is skipped for that call);
inputs the graph returns as they are (a parameter) pass through untouched.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.fx as fx

log = logging.getLogger("fp4compile")

MIN_BYTES = 1 << 20  # smaller outputs: autograd's own zeros cost next to nothing


@dataclass(frozen=True)
class BufferPlan:
    """The graph's original output count and, in order, the outputs that got a buffer."""

    n_outputs: int
    outputs: tuple[int, ...]
    names: tuple[str, ...]


def _output_nodes(gm: fx.GraphModule) -> Optional[list]:
    out = gm.graph.output_node()
    args = out.args[0] if out.args else None
    if not isinstance(args, (tuple, list)):
        return None
    return list(args)


def _needs_grad(node) -> bool:
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return isinstance(value, torch.Tensor) and value.requires_grad


def _ancestors(node: fx.Node) -> set:
    """The nodes ``node`` is computed from (itself included)."""
    seen, stack = {node}, [node]
    while stack:
        for parent in stack.pop().all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


def plan(gm: fx.GraphModule) -> Optional[BufferPlan]:
    """The outputs of ``gm`` (a dynamo graph, grad enabled) that get a gradient buffer; None if none do:
    large floating-point outputs that need a gradient and that a loss output of the same graph (a
    scalar that needs a gradient) is computed from."""
    outs = _output_nodes(gm)
    if outs is None:
        return None
    losses = [o for o in outs if _needs_grad(o) and o.meta["example_value"].numel() == 1]
    if not losses:
        return None
    upstream = set().union(*(_ancestors(loss) for loss in losses))
    chosen = []
    for i, node in enumerate(outs):
        if not _needs_grad(node) or node.op == "placeholder":  # an input returned as is: no graph output
            continue
        value = node.meta["example_value"]
        if not value.is_floating_point() or value.numel() * value.element_size() < MIN_BYTES:
            continue
        if node in upstream:
            chosen.append(i)
    if not chosen:
        return None
    return BufferPlan(len(outs), tuple(chosen), tuple(outs[i].name for i in chosen))


def records_cuda_graphs(inductor_config: dict) -> bool:
    """Whether Inductor records a compilation under the config patches ``inductor_config`` in CUDA
    graphs (their ``triton.cudagraphs``, else Inductor's global setting)."""
    graphs = inductor_config.get("triton.cudagraphs")
    if graphs is None:
        from torch._inductor import config as inductor_global

        graphs = inductor_global.triton.cudagraphs
    return bool(graphs)


def prepare(gm: fx.GraphModule, wanted: Optional[bool], records_graphs: bool) -> Optional[BufferPlan]:
    """Give ``gm`` (a dynamo graph) its buffers where they apply and return their plan, or None.
    ``wanted``: True or False, or None for "where the graph is recorded in CUDA graphs"
    (``records_graphs``). Nothing applies where gradients are disabled."""
    if wanted is None:
        wanted = records_graphs
    if not wanted or not torch.is_grad_enabled():
        return None
    buffer_plan = plan(gm)
    if buffer_plan is not None:
        add_buffers(gm, buffer_plan)
    return buffer_plan


def add_buffers(gm: fx.GraphModule, buffer_plan: BufferPlan) -> fx.GraphModule:
    """Append to ``gm``'s outputs one uninitialized buffer like each planned output (in place)."""
    outs = _output_nodes(gm)
    output_node = gm.graph.output_node()
    with gm.graph.inserting_before(output_node):
        buffers = [gm.graph.call_function(torch.empty_like, (outs[i],)) for i in buffer_plan.outputs]
    output_node.args = (type(output_node.args[0])(outs + buffers),)
    gm.recompile()
    return gm


class _UnusedGradToBuffer(torch.autograd.Function):
    """Passes the graph's differentiable outputs through; an unused gradient becomes the zeroed buffer."""

    @staticmethod
    def forward(ctx, buffers, *outputs):
        ctx.set_materialize_grads(False)
        ctx.buffers = buffers
        return tuple(t.detach() for t in outputs)

    @staticmethod
    def backward(ctx, *grads):
        out = [None]
        for grad, buffer in zip(grads, ctx.buffers):
            if grad is None and buffer is not None:
                grad = buffer.zero_()
            out.append(grad)
        return tuple(out)


def _attach(outs: list, buffer_plan: BufferPlan, buffers) -> list:
    by_output = dict(zip(buffer_plan.outputs, buffers))
    # The graph's own differentiable outputs; leaves (inputs returned as they are) pass through untouched.
    grads = [j for j, t in enumerate(outs) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    storages = {outs[j].untyped_storage().data_ptr() for j in grads}
    if len(storages) != len(grads) or any(outs[j]._is_view() for j in grads):
        return outs
    if not any(j in by_output for j in grads):
        return outs
    passed = _UnusedGradToBuffer.apply([by_output.get(j) for j in grads], *[outs[j] for j in grads])
    for j, t in zip(grads, passed):
        outs[j] = t
    return outs


def wrap(compiled: Callable, buffer_plan: BufferPlan) -> Callable:
    """``compiled`` (which returns the planned buffers after the graph's outputs) as the graph's callable."""
    n = buffer_plan.n_outputs

    def run(*args):
        result = compiled(*args)
        outs, buffers = list(result[:n]), result[n:]
        if torch.is_grad_enabled():
            outs = _attach(outs, buffer_plan, buffers)
        return type(result)(outs) if isinstance(result, tuple) else outs

    run.buffer_plan = buffer_plan
    return run
