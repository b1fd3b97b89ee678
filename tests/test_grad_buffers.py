"""Unused output gradients handed to the backward as a buffer the forward graph returned
(``fp4compile.grad_buffers``): which outputs get one, that the backward reads that buffer, and that
gradients are the same bits with and without it."""

from __future__ import annotations

import pytest
import torch

from fp4compile import Backend, grad_buffers, runtime
from models import GPTWithLoss, TinyGPT, grads

VOCAB = 512  # logits of [4, 128, 512] fp32: 1 MiB, the smallest output that gets a buffer


def _capture(model, *args):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(model, backend=backend)(*args)
    assert len(graphs) == 1
    return graphs[0]


def _idx(vocab=VOCAB):
    return torch.randint(0, vocab, (4, 128), generator=torch.Generator().manual_seed(1))


def test_plan_picks_the_output_the_graphs_loss_reads(fresh_dynamo):
    torch.manual_seed(0)
    gm = _capture(GPTWithLoss(), _idx())
    plan = grad_buffers.plan(gm)
    assert plan is not None and plan.n_outputs == 2 and plan.outputs == (0,)
    outputs_before = len(gm.graph.output_node().args[0])
    grad_buffers.add_buffers(gm, plan)
    out = gm.graph.output_node().args[0]
    assert len(out) == outputs_before + 1 and out[-1].target is torch.empty_like and out[-1].args[0] is out[0]


class TwoActivations(torch.nn.Module):
    """A graph of a split model: activations out, one of them also read inside, no loss."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(512, 512), torch.nn.Linear(512, 512)

    def forward(self, x):
        h = self.a(x)
        return h, self.b(h)


def test_plan_skips_outputs_a_loss_outside_reads_and_small_ones(fresh_dynamo):
    torch.manual_seed(0)
    assert grad_buffers.plan(_capture(TinyGPT(n_layer=1, d=32, vocab=VOCAB, seq=128), _idx())) is None
    torch._dynamo.reset()
    assert grad_buffers.plan(_capture(TwoActivations(), torch.randn(512, 512))) is None
    torch._dynamo.reset()
    small = GPTWithLoss(vocab=256)  # 512 KiB of logits: autograd's own zeros cost next to nothing
    assert grad_buffers.plan(_capture(small, _idx(256))) is None
    torch._dynamo.reset()
    with torch.no_grad():  # nothing needs a gradient
        assert grad_buffers.plan(_capture(GPTWithLoss(), _idx())) is None


def _compiled(model_class, state, buffers: bool, **recipe_fields):
    """(model with ``state``, its Backend, the compiled model): fresh dynamo cache, SR stream seed 3."""
    torch._dynamo.reset()
    runtime.manual_seed(3)
    model = model_class()
    model.load_state_dict(state)
    backend = Backend(inner="eager", unused_grad_buffers=buffers, **recipe_fields)
    return model, backend, torch.compile(model, backend=backend)


def _train(buffers: bool, use_logits: bool, model_state):
    model, backend, compiled = _compiled(
        GPTWithLoss, model_state, buffers, high_precision_first_blocks=0, high_precision_last_blocks=0
    )
    compiled(_idx())
    table = backend.report.precision_table()
    assert ("an unused gradient of" in table) == buffers, table
    runtime.manual_seed(3)
    seen = []
    for _ in range(2):
        logits, loss = compiled(_idx())
        node = logits.grad_fn
        assert (type(node).__name__ == "_UnusedGradToBufferBackward") == buffers
        if buffers:
            # The compiled graph's own backward node, and what it receives for the logits.
            graph_node = node.next_functions[0][0]
            graph_node.register_prehook(lambda g, out=seen: out.append(g[0]))
            buffer = node.buffers[0]
        (loss + logits.square().mean() if use_logits else loss).backward()
        if buffers:
            received = seen[-1]
            assert (received.data_ptr() == buffer.data_ptr()) == (not use_logits)
            if not use_logits:
                assert not received.any()
    return logits.detach(), loss.detach(), grads(model)


@pytest.mark.slow
@pytest.mark.parametrize("use_logits", [False, True], ids=["logits-unused", "logits-used"])
def test_training_gives_the_same_bits_with_buffers(use_logits, fresh_dynamo):
    torch.manual_seed(0)
    state = GPTWithLoss().state_dict()
    with_buffers = _train(True, use_logits, state)
    without = _train(False, use_logits, state)
    for a, b in zip(with_buffers[:2], without[:2]):
        assert torch.equal(a, b)
    assert with_buffers[2].keys() == without[2].keys()
    for name in without[2]:
        assert torch.equal(with_buffers[2][name], without[2][name]), name


def test_buffers_are_off_without_cuda_graphs_and_under_no_grad(fresh_dynamo):
    torch.manual_seed(0)
    logits, loss = torch.compile(GPTWithLoss(), backend=Backend(inner="eager"))(_idx())
    assert type(logits.grad_fn).__name__ == "CompiledFunctionBackward"  # automatic: only under CUDA graphs
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(GPTWithLoss(), backend=Backend(inner="eager", unused_grad_buffers=True))(_idx())
    assert len(out) == 2 and out[0].grad_fn is None


def test_option_through_the_named_backend(fresh_dynamo):
    import fp4compile

    assert fp4compile.get_backend({"unused_grad_buffers": False}).unused_grad_buffers is False
    assert fp4compile.get_backend({}, "reduce-overhead").unused_grad_buffers is None


def _in_place_then_backward(buffers: bool, state):
    model, _, compiled = _compiled(GPTWithLoss, state, buffers)
    logits, loss = compiled(_idx())
    logits.mul_(2)
    try:
        (loss + logits.square().mean()).backward()
    except RuntimeError as err:
        return str(err)
    return grads(model)


def test_in_place_change_of_an_output_behaves_as_without_buffers(fresh_dynamo):
    """The outputs share the version counter of the graph's own, so an in-place change is seen (or
    caught, where the backward saved that output) exactly as without the buffers."""
    torch.manual_seed(0)
    state = GPTWithLoss().state_dict()
    with_buffers, without = _in_place_then_backward(True, state), _in_place_then_backward(False, state)
    assert type(with_buffers) is type(without)
    if isinstance(without, str):
        assert with_buffers == without
    else:
        assert with_buffers.keys() == without.keys()
        assert all(torch.equal(with_buffers[k], without[k]) for k in without)


class ReturnsItsWeight(torch.nn.Module):
    """Returns a parameter (an input of the graph) next to a loss computed from it."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(512, 512))

    def forward(self, x):
        y = x @ self.w
        return self.w, y, (y.square().mean() + self.w.square().mean())


def _weight_grad(buffers: bool, state, x):
    model, _, compiled = _compiled(ReturnsItsWeight, state, buffers)
    w, y, loss = compiled(x)
    assert w is model.w  # dynamo returns it from outside the graph; the node leaves it alone too
    assert (type(y.grad_fn).__name__ == "_UnusedGradToBufferBackward") == buffers
    loss.backward()
    return model.w.grad


def test_inputs_returned_as_they_are_stay_themselves(fresh_dynamo):
    torch.manual_seed(0)
    model = ReturnsItsWeight()
    x = torch.randn(512, 512)
    plan = grad_buffers.plan(_capture(model, x))
    assert plan is not None and plan.names == ("y",)
    state = model.state_dict()
    assert torch.equal(_weight_grad(True, state, x), _weight_grad(False, state, x))
