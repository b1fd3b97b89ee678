"""Mixture-of-experts models: expert GEMMs as grouped NVFP4 sites in every experts implementation.

Hugging Face's Mixtral, Qwen3-MoE and OLMoE (tiny configs, random weights, CPU) with each
``experts_implementation``; experts kept as a ``ModuleList`` of MLPs; steps where experts get no tokens.
"""

from __future__ import annotations

import copy
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never reach for the Hub

import pytest
import torch

import fp4compile
from fp4compile import Backend
from fp4compile.passes.keep_routers_high import ROUTER, SHARED_GATE

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_dynamo")]  # whole Hugging Face MoE models

transformers = pytest.importorskip("transformers")

VOCAB, EXPERTS, LAYERS = 128, 16, 4
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)
CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(intermediate_size=32, num_local_experts=EXPERTS, **COMMON),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=32, head_dim=16,
                                                     num_experts=EXPERTS, **COMMON),
    "olmoe": lambda: transformers.OlmoeConfig(intermediate_size=32, num_experts=EXPERTS, **COMMON),
}
FORMS = {"eager": "eager loop (traced in grouped_mm form)", "grouped_mm": "grouped_mm", "batched_mm": "batched_mm"}


def hf_model(name: str, implementation: str):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name]())
    model.set_experts_implementation(implementation)
    return model.train()


def steps(model, batches, backend=None, lr=3e-3):
    """AdamW steps on ``batches`` (compiled with ``backend`` where given) -> the losses."""
    run = torch.compile(model, backend=backend) if backend is not None else model
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for idx in batches:
        loss = run(input_ids=idx, labels=idx, use_cache=False).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def batch(tokens: int, seed: int = 0):
    return torch.randint(0, VOCAB, (2, tokens // 2), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_moe_expert_gemms_run_in_nvfp4(name, implementation):
    model = hf_model(name, implementation)
    reference = copy.deepcopy(model)
    backend = Backend(inner="eager")
    losses = steps(model, [batch(32), batch(32)], backend)
    eager_losses = steps(reference, [batch(32), batch(32)])
    # The loss after the first step, from the same weights and batch, within a few percent of eager.
    assert abs(losses[1] - eager_losses[1]) <= 0.03 * eager_losses[1], (losses, eager_losses)

    sites = {s.name: s for s in backend.report.sites}
    for layer in range(LAYERS):
        middle = layer in (1, 2)  # the recipe keeps the first and last of 4 blocks high
        for proj, (n, k) in (("gate_up_proj", (64, 64)), ("down_proj", (64, 32))):
            s = sites[f"model.layers.{layer}.mlp.experts.{proj}"]
            assert (s.experts, s.kind, s.form, s.block) == (EXPERTS, implementation.replace("eager", "grouped_mm"),
                                                           FORMS[implementation], layer)
            # Each token goes to 2 experts: the GEMMs run on 2 x 32 routed tokens.
            assert s.shapes["fprop"] == (64, n, k) and s.roles["fprop"].flops == 2 * 64 * n * k
            if middle:
                assert s.precision == "nvfp4"
                assert [s.roles[r].precision for r in ("fprop", "dgrad", "wgrad")] == ["nvfp4"] * 3
                assert s.roles["wgrad"].rht and s.roles["dgrad"].rounding == ("sr", "rne")
            else:
                assert s.precision == "high"
        router = sites[f"model.layers.{layer}.mlp.gate"]
        assert router.precision == "high" and (router.reason == ROUTER or not middle), router
    assert not backend.report.warnings
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
def test_experts_without_tokens_get_no_update_and_the_rest_train(implementation):
    """Two tokens: in every layer, at most 4 of the 16 experts get one (top-2) and the rest nothing."""
    model = hf_model("qwen3_moe", implementation)
    backend = Backend(inner="eager")
    compiled = torch.compile(model, backend=backend)
    idx = torch.tensor([[5, 9]])
    loss = compiled(input_ids=idx, labels=idx, use_cache=False).loss
    loss.backward()
    assert torch.isfinite(loss)
    experts = model.model.layers[1].mlp.experts
    used = experts.gate_up_proj.grad.flatten(1).abs().amax(dim=1) > 0
    assert 2 <= int(used.sum()) <= 4
    assert torch.equal(experts.down_proj.grad[~used], torch.zeros_like(experts.down_proj.grad[~used]))
    assert torch.isfinite(experts.down_proj.grad).all() and experts.down_proj.grad[used].abs().sum() > 0
    assert {s.precision for s in backend.report.sites if s.name.startswith("model.layers.1.mlp.experts")} == {"nvfp4"}


class ExpertMLP(torch.nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w1, self.w2 = torch.nn.Linear(d, h, bias=False), torch.nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.w2(torch.nn.functional.silu(self.w1(x)))


class Router(torch.nn.Module):
    def __init__(self, d, experts):
        super().__init__()
        self.experts = experts
        self.proj = torch.nn.Linear(d, 16, bias=False)  # 16 logits: a size FP4 could take

    def forward(self, x):
        return torch.topk(self.proj(x)[:, : self.experts].softmax(-1), 1, dim=-1)


class ListMoE(torch.nn.Module):
    """Experts as a ModuleList, each called on the tokens routed to it (possibly none): the loop over
    data-dependent token sets breaks the graph, and each expert and the router compile on their own."""

    def __init__(self, d=32, h=64, experts=4):
        super().__init__()
        self.router = Router(d, experts)
        self.experts = torch.nn.ModuleList(ExpertMLP(d, h) for _ in range(experts))

    def forward(self, x):
        weight, chosen = self.router(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = (chosen[:, 0] == e).nonzero().squeeze(-1)
            out = out.index_add(0, rows, expert(x[rows]) * weight[rows])
        return out


class ListModel(torch.nn.Module):
    def __init__(self, d=32, layers=4):
        super().__init__()
        self.layers = torch.nn.ModuleList(ListMoE(d) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_module_list_experts_are_linear_sites_even_with_no_tokens():
    torch.manual_seed(0)
    model = ListModel()
    backend = Backend(inner="eager")
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(8, 32).abs()
    for layer in model.layers:  # expert 3 of every layer never wins: it is called on no tokens
        with torch.no_grad():
            layer.router.proj.weight[3] = -100.0
    compiled(x).square().mean().backward()
    sites = {s.name: s for s in backend.report.sites}
    assert sites["layers.1.experts.0.w1"].precision == "nvfp4" and sites["layers.2.experts.2.w2"].precision == "nvfp4"
    assert sites["layers.1.router.proj"].precision == "high" and sites["layers.1.router.proj"].reason == ROUTER
    assert sites["layers.1.experts.3.w1"].shapes["fprop"][0] == 0  # no tokens: an empty FP4 GEMM
    assert torch.equal(model.layers[1].experts[3].w1.weight.grad, torch.zeros(64, 32))
    assert torch.isfinite(model.layers[1].experts[0].w1.weight.grad).all()


def test_routers_can_run_in_fp4_when_asked():
    model = hf_model("mixtral", "grouped_mm")
    backend = Backend(inner="eager", high_precision_routers=False)
    steps(model, [batch(32)], backend)
    router = next(s for s in backend.report.sites if s.name == "model.layers.1.mlp.gate")
    assert router.precision == "nvfp4"


def test_mxfp4_keeps_grouped_sites_high_and_says_why():
    model = hf_model("mixtral", "grouped_mm")
    backend = Backend(inner="eager", fmt="mxfp4")
    steps(model, [batch(32)], backend)
    s = next(s for s in backend.report.sites if s.name == "model.layers.1.mlp.experts.down_proj")
    assert s.precision == "high" and "NVFP4 only" in s.reason
    assert any("experts.down_proj" in f for f in backend.report.fallbacks)
    assert fp4compile  # the package import registers the backend


def test_shared_expert_is_linear_sites_and_its_gate_stays_high():
    """Qwen2-MoE: routed experts (grouped), a shared expert (linears) and its one-output sigmoid gate."""
    torch.manual_seed(0)
    config = transformers.Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                         num_experts=EXPERTS, **COMMON)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.set_experts_implementation("grouped_mm")
    backend = Backend(inner="eager")
    steps(model, [batch(32)], backend)
    sites = {s.name: s for s in backend.report.sites}
    assert (sites["model.layers.1.mlp.shared_expert_gate"].precision, sites["model.layers.1.mlp.shared_expert_gate"].reason) \
        == ("high", SHARED_GATE)
    assert sites["model.layers.1.mlp.shared_expert.up_proj"].precision == "nvfp4"
    assert sites["model.layers.1.mlp.experts.down_proj"].precision == "nvfp4"
    assert sites["model.layers.1.mlp.gate"].reason == ROUTER
