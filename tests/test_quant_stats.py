"""Quantization statistics (issue #50 part 1) and the places a block scale rule other than "6" must
reach: grouped expert GEMMs (kept high, with the reason) and the W4A4 served model's activations.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import fp4compile
from fp4compile import Backend, formats
from fp4compile.diagnostics import PlanWarning
from models import TinyGPT, lm_loss

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

E, D = 4, 32


class _Experts(nn.Module):
    """Expert weights [E, D, D], each token's gathered by its expert id: ``bmm(W[ids], x[..., None])``."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(E, D, D) * 0.1)

    def forward(self, x, ids):
        return torch.bmm(self.w[ids], x[:, :, None]).squeeze(-1)


class _MoEBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.experts = _Experts()

    def forward(self, x, ids):
        return x + self.experts(torch.relu(self.fc(x)), ids)


class _MoENet(nn.Module):
    def __init__(self, n: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(_MoEBlock() for _ in range(n))

    def forward(self, x, ids):
        for b in self.blocks:
            x = b(x, ids)
        return x


def _train_step(model, backend, *inputs):
    out = torch.compile(model, backend=backend)(*inputs)
    (lm_loss(out, inputs[0]) if out.dim() == 3 else out.square().mean()).backward()
    return out


# ----------------------------------------------------------------------------------------------
# (a) A block scale rule other than "6" where it was silently the "6" rule
# ----------------------------------------------------------------------------------------------


def test_grouped_expert_gemms_stay_high_under_four_over_six_and_say_why():
    torch.manual_seed(0)
    model = _MoENet()
    x, ids = torch.randn(32, D), torch.arange(32) % E
    backend = Backend(inner="eager", block_scale_rule="4/6")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train_step(model, backend, x, ids)
    sites = {s.name: s for s in backend.report.sites}
    for i in (1, 2):  # the middle blocks: their linears follow the recipe, their experts cannot
        assert sites[f"blocks.{i}.fc"].precision == "nvfp4"
        experts = sites[f"blocks.{i}.experts.w"]
        assert experts.precision == "high" and "block_scale_rule='4/6'" in experts.reason, experts.reason
    plan = [w for w in caught if issubclass(w.category, PlanWarning) and "grouped expert GEMMs" in str(w.message)]
    assert len(plan) == 1, [str(w.message) for w in caught]
    assert any("blocks.1.experts.w" in f for c in backend.report.contexts for f in c.fallbacks)
    # The default rule keeps them in NVFP4.
    torch._dynamo.reset()
    backend6 = Backend(inner="eager")
    _train_step(model, backend6, x, ids)
    assert {s.name: s.precision for s in backend6.report.sites}["blocks.1.experts.w"] == "nvfp4"


def test_w4a4_served_activations_follow_the_block_scale_rule():
    torch.manual_seed(0)
    model = TinyGPT()
    idx = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    backend = Backend(inner="eager", block_scale_rule="4/6", stochastic_rounding=False)
    _train_step(model, backend, idx)
    model.eval()
    site = "blocks.1.mlp.out"
    module = model.get_submodule(site)
    seen = []
    raw = module.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with fp4compile.served(model, backend, "NVFP4") as m:
        after = module.register_forward_pre_hook(lambda m_, a: seen.append(a[0]))
        m(idx)
        after.remove()
    raw.remove()
    x, quantized = seen
    amax = backend.ranges.amax()[site]
    want = formats.dequantize(formats.quantize(x, "nvfp4", "1x16", amax=amax, scale_rule="4/6"), x.dtype)
    assert torch.equal(quantized, want)
    six = formats.dequantize(formats.quantize(x, "nvfp4", "1x16", amax=amax), x.dtype)
    assert not torch.equal(quantized, six)


# ----------------------------------------------------------------------------------------------
# (b) Statistics recorded in the graphs against formats.quantization_stats
# ----------------------------------------------------------------------------------------------

from fp4compile import quant_stats  # noqa: E402
from recipe_reference import emulated_mm  # noqa: E402
from tiers import first_fast  # noqa: E402


class _StatsLinear(torch.autograd.Function):
    """The eager reference recipe (RNE, RHT, 16x16 weights) that also computes
    ``formats.quantization_stats`` of each operand it quantizes, into ``out[(site, role, operand)]``."""

    @staticmethod
    def forward(ctx, x, w, b, site, rule, out):
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2, w)
        ctx.cfg = (site, rule, out, x.shape)
        y = emulated_mm(_quantized(x2, "1x16", ctx.cfg, "fprop", "X"), _quantized(w, "16x16", ctx.cfg, "fprop", "W")) + b
        return y.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, w = ctx.saved_tensors
        cfg = ctx.cfg
        dy2 = dy.reshape(-1, dy.shape[-1])
        # dgrad's W^T: fprop's W quantized once (the same codes), which the backend records once, as W.
        wt = formats.quantize(w.t().contiguous(), "nvfp4", "16x16", scale_rule=cfg[1])
        dx = emulated_mm(_quantized(dy2, "1x16", cfg, "dgrad", "dY"), wt)
        a, b = formats.rht(dy2.t().contiguous()), formats.rht(x2.t().contiguous())
        dw = emulated_mm(_quantized(a, "1x16", cfg, "wgrad", "dY^T"), _quantized(b, "1x16", cfg, "wgrad", "X^T"))
        return dx.reshape(cfg[3]), dw, dy2.sum(0), None, None, None


def _quantized(t, block, cfg, role, operand):
    site, rule, out, _ = cfg
    q = formats.quantize(t, "nvfp4", block, scale_rule=rule)
    out[(site, role, operand)] = formats.quantization_stats(t, q)
    return q


def _tiny(seed=0):
    torch.manual_seed(seed)
    return TinyGPT()


IDX = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(*first_fast("rule", ["6", "4/6"]))
def test_recorded_statistics_equal_the_reference_bit_for_bit(rule):
    """Every FP4 operand's statistics, recorded in the compiled graphs, equal ``formats.quantization_stats``
    of the eager reference recipe's quantization of the same tensor: the same float64 numbers."""
    import copy

    model = _tiny()
    ref = copy.deepcopy(model)
    backend = Backend(inner="eager", stochastic_rounding=False, block_scale_rule=rule)
    backend.collect_stats(1)
    _train_step(model, backend, IDX)
    fp4 = [s.name for s in backend.report.sites if s.precision == "nvfp4"]
    assert len(fp4) == 8
    want: dict = {}
    modules = dict(ref.named_modules())
    for name in fp4:
        m = modules[name]
        m.forward = (lambda m, name: lambda x: _StatsLinear.apply(x, m.weight, m.bias, name, rule, want))(m, name)
    lm_loss(ref(IDX), IDX).backward()
    rows = backend.report.stats("last")
    got = {(r["site"], r["role"], r["operand"]): {k: r[k] for k in quant_stats.STATS} for r in rows}
    assert set(got) == set(want) and len(got) == 8 * 5  # dgrad's W^T is W's quantization: recorded as W
    for key in want:
        assert got[key] == want[key], key
    assert all(r["steps"] == 1 for r in rows)


def test_statistics_change_no_bits_and_cost_nothing_once_off():
    """Recording for 2 of 4 SR training steps leaves losses and weights equal to a run that never records;
    the graphs that run after the window hold no statistics node (each graph compiled again once)."""
    runs = []
    for collect in (False, True):
        torch._dynamo.reset()
        fp4compile.manual_seed(0)
        model = _tiny()
        backend = Backend(inner="eager")
        if collect:
            backend.collect_stats(2)
        compiled = torch.compile(model, backend=backend)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(4):
            loss = lm_loss(compiled(IDX), IDX)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
            backend.step()
        runs.append((losses, [p.detach().clone() for p in model.parameters()], backend))
    (l0, p0, off), (l1, p1, on) = runs
    assert all(torch.equal(a, b) for a, b in zip(l0, l1)) and all(torch.equal(a, b) for a, b in zip(p0, p1))
    assert off.report.stats() == [] and not off.collecting_stats
    per_step = on.report.stats(None)
    assert {r["step"] for r in per_step} == {0, 1} and len(per_step) == 2 * 8 * 5
    assert len(on.report.contexts) == 2 and len(off.report.contexts) == 1  # compiled twice: recording, then not
    for ctx in on.report.latest:
        for stage, graph in ctx.final_graphs.items():
            assert not graph.find_nodes(op="call_function", target=torch.ops.fp4.record_stats.default), stage
            assert not [n for n in graph.nodes if n.op == "placeholder" and "fp4_stats" in n.name], stage
    recorded = on.report.contexts[0].final_graphs
    assert len(recorded["forward"].find_nodes(op="call_function", target=torch.ops.fp4.record_stats.default)) == 8 * 2
    assert len(recorded["backward"].find_nodes(op="call_function", target=torch.ops.fp4.record_stats.default)) == 8 * 3


def test_report_rows_reduce_and_table():
    model = _tiny()
    backend = Backend(inner="eager")
    with pytest.raises(ValueError, match="steps"):
        backend.collect_stats(0)
    assert "no quantization statistics" in backend.report.stats_table()
    backend.collect_stats(3)
    compiled = torch.compile(model, backend=backend)
    for _ in range(2):  # two of the three steps: two entries per window
        lm_loss(compiled(IDX), IDX).backward()
    every = backend.report.stats(None)
    mean, last = backend.report.stats(), backend.report.stats("last")
    key = lambda r: (r["site"], r["role"], r["operand"])  # noqa: E731
    assert [key(r) for r in mean] == [key(r) for r in last]
    for m, l in zip(mean, last):
        steps = [r for r in every if key(r) == key(m)]
        assert m["steps"] == l["steps"] == len(steps) == 2
        assert l["relative_error"] == steps[-1]["relative_error"]
        assert m["relative_error"] == (steps[0]["relative_error"] + steps[1]["relative_error"]) / 2
        assert m["amax"] == max(r["amax"] for r in steps)
        assert m["layer"] == m["site"] and set(m) >= {"zero_fraction", "scale_saturated", "scale_underflow"}
    table = backend.report.stats_table()
    assert table.splitlines()[0].split()[:4] == ["site", "role", "operand", "rel."] and len(table.splitlines()) == 2 + 40
    with pytest.raises(ValueError, match="reduce"):
        backend.report.stats("median")


@pytest.mark.parametrize(*first_fast("block,rounding,rule", [
    ("1x16", "rne", "6"), ("16x16", "rne", "4/6"), ("1x16", "sr", "4/6"), ("16x16", "rne", "6"), ("1x16", "sr", "6")]))
def test_record_stats_of_the_triton_quantizers_equals_the_reference(block, rounding, rule):
    """fp4.record_stats on what the Triton quantizers write (Triton's interpreter on the CPU, or CUDA)
    equals formats.quantization_stats of the reference quantization, shifted into its slot: bit for bit
    on the CPU; on CUDA the relative error's float64 norms are summed in another order (1e-13)."""
    import os

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    from fp4compile.codegen import triton_kernels as tk

    if not tk.available()[0]:
        pytest.skip(tk.available()[1])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(3)
    x = torch.randn(48, 64, generator=g) * torch.logspace(-3, 1, 64)  # blocks of very different ranges
    x[16:32, :16] = 1e-30  # a 16x16 tile (sixteen 1x16 blocks) whose scale underflows
    q = formats.quantize(x, "nvfp4", block, rounding, seed=11, scale_rule=rule)
    quantize = tk.quantize_1x16 if block == "1x16" else tk.quantize_16x16
    data, scales, amax = quantize(x.to(device), rounding, 11, scale_rule=rule)
    buffer = torch.full((6, 2, 5), float("nan"), dtype=torch.float64, device=device)
    for _ in range(2):  # written twice: the window shifts
        torch.ops.fp4.record_stats(buffer, 4, x.to(device), data, scales, amax, block, rule)
    want = torch.tensor(list(formats.quantization_stats(x, q).values()), dtype=torch.float64)
    got = buffer[4].cpu()
    if device == "cpu":
        assert torch.equal(got, torch.stack((want, want)))
    else:  # the fractions and amax to the bit; the error's float64 norms sum in the GPU's order
        error = formats.STATS.index("relative_error")
        exact = [i for i in range(len(want)) if i != error]
        assert torch.equal(got[:, exact], torch.stack((want, want))[:, exact])
        torch.testing.assert_close(got[:, error], want[error].expand(2), rtol=1e-13, atol=0)
    assert torch.isnan(buffer[[0, 1, 2, 3, 5]]).all()
    assert want[2] > 0  # the underflowing block counted


@pytest.mark.slow
def test_statistics_under_inductor_equal_the_eager_backend():
    got = []
    for inner in ("eager", "inductor"):
        torch._dynamo.reset()
        fp4compile.manual_seed(0)
        backend = Backend(inner=inner)
        backend.collect_stats(1)
        _train_step(_tiny(), backend, IDX)
        got.append(backend.report.stats())
    # The operands themselves differ in their last bits: Inductor fuses and rounds the high-precision ops
    # that produce them (the norms, the activations, their gradients) otherwise than eager PyTorch, which
    # moves the error and the amax by about 1e-7 and can flip a block or two of a small tensor (a scale at
    # the edge of saturating or underflowing). The statistics of one quantization are exact either way
    # (test_recorded_statistics_equal_the_reference_bit_for_bit).
    assert len(got[0]) == len(got[1]) == 40
    for eager, inductor in zip(*got):
        assert {k: v for k, v in eager.items() if isinstance(v, str)} == {
            k: v for k, v in inductor.items() if isinstance(v, str)}
        for key in ("relative_error", "amax"):
            assert inductor[key] == pytest.approx(eager[key], rel=1e-5), (eager["site"], eager["role"], key)
        for key in ("zero_fraction", "scale_saturated", "scale_underflow"):
            assert inductor[key] == pytest.approx(eager[key], abs=1e-2), (eager["site"], eager["role"], key)


def test_plot_writes_a_png_of_the_error_per_layer_and_role(tmp_path):
    pytest.importorskip("matplotlib")
    from fp4compile import plot

    backend = Backend(inner="eager")
    backend.collect_stats(1)
    _train_step(_tiny(), backend, IDX)
    path = plot.quant_error(backend.report.stats(), tmp_path / "err.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [plot._layer_key(n) for n in ("blocks.2.mlp.fc", "blocks.10.mlp.fc")] == sorted(
        plot._layer_key(n) for n in ("blocks.10.mlp.fc", "blocks.2.mlp.fc"))
    with pytest.raises(ValueError, match="collect_stats"):
        plot.quant_error([], tmp_path / "none.png")


def test_reduce_rows_of_per_step_rows_is_the_reports_mean():
    backend = Backend(inner="eager")
    backend.collect_stats(2)
    compiled = torch.compile(_tiny(), backend=backend)
    for _ in range(2):
        lm_loss(compiled(IDX), IDX).backward()
    assert quant_stats.reduce_rows(backend.report.stats(None)) == backend.report.stats()
