"""The compiled model on a CUDA GPU (Triton quantizers, fused RHT + quantize, emulated GEMM) against the
same compiled model on the CPU (reference quantizers). Skipped without a GPU.

One linear layer, so both devices quantize identical operands: the codes and scales are the same bits,
and the outputs and gradients differ only by the GEMMs' fp32 summation order. The MXFP4 case runs
without the RHT (its transform is ``formats.rht`` on both devices, covered by the CPU tests).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from fp4compile import Backend, runtime  # noqa: E402
from models import NormMLP  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


class Proj(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(256, 256)])

    def forward(self, x):
        return self.blocks[0](x)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_gpu_compiled_linear_matches_cpu(inner, fmt, fresh_dynamo):
    torch.manual_seed(0)
    model = Proj()
    x = torch.randn(4, 512, 256)
    g = torch.randn(4, 512, 256)
    results = {}
    for device in ("cpu", "cuda"):
        torch._dynamo.reset()
        runtime.manual_seed(5)
        m = Proj().to(device)
        m.load_state_dict(model.state_dict())
        xd = x.detach().to(device).requires_grad_()  # a leaf on each device
        backend = Backend(inner=inner, fmt=fmt, high_precision_first_blocks=0, high_precision_last_blocks=0,
                          rht=fmt == "nvfp4")
        y = torch.compile(m, backend=backend)(xd)
        (y * g.to(device)).sum().backward()
        results[device] = (y.detach().cpu(), xd.grad.cpu(), m.blocks[0].weight.grad.cpu())
        site = next(s for s in backend.report.sites if s.name == "blocks.0")
        assert site.precision == fmt
    for cpu, gpu in zip(results["cpu"], results["cuda"]):
        # A flipped FP4 code would move a value by a whole grid step (>= 1/12 of its block's largest);
        # fp32 summation order moves it by ~1e-6 relative.
        torch.testing.assert_close(gpu, cpu, rtol=1e-4, atol=1e-4 * cpu.abs().max().item())


def test_gpu_cuda_graph_replays_draw_fresh_sr_bits(fresh_dynamo):
    """mode="reduce-overhead" records the training step in CUDA graphs: every replay must draw that
    step's SR bits (not the recorded step's), i.e. give the bits of the default mode step by step.
    The input is the same on every step, so the gradients differ between steps only through SR."""
    torch.manual_seed(0)
    model = Proj()
    x = torch.randn(4, 512, 256, device="cuda")
    g = torch.randn(4, 512, 256, device="cuda")
    runs = {}
    for mode in ("default", "reduce-overhead"):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        runtime.manual_seed(7)
        m = Proj().cuda()
        m.load_state_dict(model.state_dict())
        compiled = torch.compile(
            m, backend=Backend(mode=mode, high_precision_first_blocks=0, high_precision_last_blocks=0)
        )
        steps = []
        for _ in range(4):  # step 1 warms up, step 2 records, steps 3-4 replay
            xd = x.clone().requires_grad_()
            y = compiled(xd)
            (y * g).sum().backward()
            steps.append((y.detach().clone(), xd.grad.clone(), m.blocks[0].weight.grad.clone()))
            m.zero_grad(set_to_none=True)
        runs[mode] = steps
        if mode == "reduce-overhead":
            assert not torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    for step, (plain, graphed) in enumerate(zip(runs["default"], runs["reduce-overhead"])):
        for name, a, b in zip(("y", "dx", "dW"), plain, graphed):
            assert torch.equal(a, b), f"step {step}: {name} differs with CUDA graphs"
    for name, i in (("dx", 1), ("dW", 2)):
        assert not torch.equal(runs["reduce-overhead"][2][i], runs["reduce-overhead"][3][i]), f"{name}: SR bits repeat"
    assert torch.equal(runs["reduce-overhead"][2][0], runs["reduce-overhead"][3][0])  # fprop rounds to nearest


def test_gpu_sr_on_the_reference_path_refuses_cuda_graph_recording(monkeypatch):
    """A quantize call no GPU kernel takes (a 1-D tensor) would freeze its SR seed into a CUDA graph: it
    raises instead of silently repeating the recorded bits."""
    import fp4compile  # noqa: F401

    x = torch.randn(64, device="cuda")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=r"fp4.quantize of a \(64,\) torch.float32 tensor with stochastic"):
        torch.ops.fp4.quantize(x, "nvfp4", "1x16", "sr", 3, "")
    torch.ops.fp4.quantize(x, "nvfp4", "1x16", "rne", 3, "")  # no seed, nothing to freeze


def test_gpu_decoded_operands_give_the_bits_of_packed_ones(fresh_dynamo):
    """With Recipe(decoded_operands=True) the emulated GEMMs on CUDA read operands decoded by their
    quantizers (``lower_gemms``); by default they decode packed codes first. Same bits."""
    torch.manual_seed(0)
    model = Proj()
    x = torch.randn(4, 512, 256, device="cuda")
    g = torch.randn(4, 512, 256, device="cuda")
    results = {}
    for decoded in (True, False):
        torch._dynamo.reset()
        runtime.manual_seed(11)
        m = Proj().cuda()
        m.load_state_dict(model.state_dict())
        backend = Backend(inner="eager", high_precision_first_blocks=0, high_precision_last_blocks=0,
                          decoded_operands=decoded)
        xd = x.clone().requires_grad_()
        y = torch.compile(m, backend=backend)(xd)
        (y * g).sum().backward()
        results[decoded] = (y.detach(), xd.grad, m.blocks[0].weight.grad)
        final = [gr.code for gr in backend.report.graphs if gr.pass_name == "lower_gemms"]
        # Either way the GEMMs are fp4.emulated_mm; packed operands are decoded by fp4.decode_blocks.
        assert len(final) == 2 and all("fp4.emulated_mm" in code and "fp4.scaled_mm" not in code for code in final)
        # Decoded: X's quantizer writes it decoded (fp4.fake_quantize); packed: no quantizer does.
        assert ("fp4.fake_quantize" in final[0]) == decoded and ("fp4.decode_blocks" in final[0])
    for a, b in zip(results[True], results[False]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("decoded,autocast,rht", [(False, True, True), (True, True, True), (True, False, True), (True, False, False), (False, True, False), (True, True, False)])
def test_gpu_fuse_amax_keeps_the_bits(fresh_dynamo, monkeypatch, decoded, autocast, rht):
    """On CUDA each linear's forward computes X's two amaxes in one wgrad_amax read (fprop's, and wgrad's
    after the RHT, which the backward keeps), and ``fuse_amax`` gives dY one wgrad_amax read for both of
    its quantizations; without the RHT, X takes its amax from the producer (under autocast X is a bf16
    cast of the producer's output: the amax of its stored bits, where Inductor's fused kernel holds the
    value unrounded). The step keeps the bits it has with every quantizer's own amax pass."""
    from fp4compile import vocabulary
    from fp4compile.passes import fuse_amax as amax_module

    torch.manual_seed(0)
    model = NormMLP()
    x = torch.randn(4, 256, 256, device="cuda")
    g = torch.randn(4, 256, 256, device="cuda")
    applies, costs = amax_module.applies, vocabulary.separate_amax_costs_a_read
    results = {}
    for on in (True, False):
        torch._dynamo.reset()
        monkeypatch.setattr(amax_module, "applies", applies if on else (lambda node: False))
        monkeypatch.setattr(vocabulary, "separate_amax_costs_a_read", costs if on else (lambda val: False))
        runtime.manual_seed(11)
        m = NormMLP().cuda()
        m.load_state_dict(model.state_dict())
        backend = Backend(high_precision_first_blocks=0, high_precision_last_blocks=0, decoded_operands=decoded, rht=rht)
        xd = x.clone().requires_grad_()
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            y = torch.compile(m, backend=backend)(xd)
        (y.float() * g).sum().backward()
        results[on] = [y.detach(), xd.grad] + [p.grad for p in m.parameters()]
        final = [gr.code for gr in backend.report.graphs if gr.pass_name == "fuse_amax"]
        assert len(final) == 2
        assert ("fp4.wgrad_amax" in final[0]) == (on and rht)  # X's two amaxes in the forward
        assert ("fp4.wgrad_amax" in final[1]) == (on and rht)  # dY's
        assert ("aten.amax" in final[0]) == (on and not rht)
        assert ("aten.bitwise_and" in final[0]) == (on and autocast and not rht)
    for a, b in zip(results[True], results[False]):
        assert torch.equal(a, b)


def test_gpu_unused_logits_gradient_reaches_the_recorded_backward_without_a_copy(fresh_dynamo):
    """Under CUDA graphs the logits returned beside the loss get a gradient buffer from the forward
    graph (``fp4compile.grad_buffers``): the recorded backward reads it in place, one input fewer to
    copy on every replay, and every step's outputs and gradients are the bits of the run without it."""
    from models import GPTWithLoss, grads

    torch.manual_seed(0)
    state = GPTWithLoss().state_dict()
    idx = torch.randint(0, 512, (4, 128), device="cuda")
    runs, copied = {}, {}
    for buffers in (True, False):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        runtime.manual_seed(7)
        m = GPTWithLoss().cuda()
        m.load_state_dict(state)
        backend = Backend(mode="reduce-overhead", unused_grad_buffers=None if buffers else False,
                          high_precision_first_blocks=0, high_precision_last_blocks=0)
        compiled = torch.compile(m, backend=backend)
        steps = []
        for _ in range(4):  # step 1 warms up, step 2 records, steps 3-4 replay
            torch.compiler.cudagraph_mark_step_begin()
            logits, loss = compiled(idx)
            assert (type(logits.grad_fn).__name__ == "_UnusedGradToBufferBackward") == buffers
            loss.backward()
            steps.append((logits.detach().clone(), loss.detach().clone(), grads(m)))
            m.zero_grad(set_to_none=True)
        counters = torch._dynamo.utils.counters["inductor"]
        assert not counters["cudagraph_skips"]
        copied[buffers] = counters["cudagraph_recorded_non_static_inputs"]
        runs[buffers] = steps
    assert copied[True] == copied[False] - 1, copied  # the logits' gradient is no longer copied in
    for step, (a, b) in enumerate(zip(runs[True], runs[False])):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), f"step {step}: outputs differ"
        assert a[2].keys() == b[2].keys()
        for name in b[2]:
            if name.endswith("_emb.weight"):
                # CUDA's embedding backward accumulates with atomics: its last bits vary from run to run
                # (two runs without the buffers differ there as well).
                torch.testing.assert_close(a[2][name], b[2][name], rtol=1e-5, atol=1e-9)
            else:
                assert torch.equal(a[2][name], b[2][name]), f"step {step}: {name}"
