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
