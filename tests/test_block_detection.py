"""Model analysis on custom models: which products are GEMM sites, and how sites group into blocks.

Blocks need not live in one ModuleList, nor be of one class, nor run in the order they are defined.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fp4compile
from fp4compile import Backend, Recipe
from fp4compile.passes.find_blocks import block_paths
from fp4compile.vocabulary import module_path, source_root
from models import MLP, Attention


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def analyse(model, *inputs, **recipe_fields):
    """Compile (forward only) and return the context: sites, blocks, other products."""
    torch.manual_seed(0)
    backend = Backend(inner="eager", **recipe_fields)
    with torch.no_grad():
        torch.compile(model, backend=backend)(*inputs)
    (ctx,) = backend.report.contexts
    return ctx


def plan(ctx):
    """{site name: (block, precision)}"""
    return {s.name: (s.block, s.precision) for s in ctx.sites}


# ------------------------------------------------------------------------------------ GEMM sites


class ParameterProducts(nn.Module):
    """The ways models multiply by a weight without nn.Linear."""

    def __init__(self, d=32):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d**0.5)  # [out, in]
        self.u = nn.Parameter(torch.randn(d, d) / d**0.5)  # [in, out]
        self.b = nn.Parameter(torch.zeros(d))
        self.experts = nn.Parameter(torch.randn(4, d, d) / d**0.5)

    def forward(self, x):
        y = x @ self.w.T  # a tied lm_head written by hand
        y = torch.matmul(y, self.u.to(torch.float32))
        y = torch.addmm(self.b, y.reshape(-1, y.shape[-1]), self.u).view_as(y)  # Hugging Face Conv1D
        y = torch.addmm(self.b, y.reshape(-1, y.shape[-1]), self.u, beta=0.5).view_as(y)
        return torch.bmm(y.expand(4, -1, -1), self.experts)  # batched weights: not a linear layer


def test_parameter_products_are_sites_in_linear_form():
    ctx = analyse(ParameterProducts(), torch.randn(16, 32))
    sites = [(s.name, s.kind, s.has_bias, s.in_features, s.out_features) for s in ctx.sites]
    assert sites == [
        ("w", "matmul", False, 32, 32),
        ("u", "matmul", False, 32, 32),
        ("u#2", "addmm", True, 32, 32),  # the second GEMM of weight u
    ]
    others = {(o.op, o.reason) for o in ctx.other_gemms}
    assert others == {
        ("addmm", "parameter operand in a form fp4.linear does not take"),  # beta != 1
        ("bmm", "parameter operand in a form fp4.linear does not take"),  # 3-D weight
    }


class ManualAttention(Attention):
    """The same projections as ``models.Attention``, with the products written out in every form."""

    def __init__(self, d=32, n_head=2):
        super().__init__(d, n_head)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.n_head, -1).transpose(1, 2) for z in self.qkv(x).split(d, dim=-1))
        scores = torch.matmul(q, k.transpose(-1, -2)) / (d // self.n_head) ** 0.5
        y = scores.softmax(-1) @ v
        y = y + F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y + torch.einsum("bhts,bhsd->bhtd", scores, v)
        flat = y.reshape(b * self.n_head, t, -1)
        y = y + torch.bmm(flat, flat.transpose(1, 2)).bmm(flat).view_as(y)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


def test_attention_products_are_not_sites_and_stay_high_precision():
    model = nn.Sequential(*[ManualAttention() for _ in range(4)])
    ctx = analyse(model, torch.randn(2, 16, 32))
    assert [s.name for s in ctx.sites] == [f"{i}.{m}" for i in range(4) for m in ("qkv", "proj")]
    assert {s.kind for s in ctx.sites} == {"linear"}
    ops = sorted(o.op for o in ctx.other_gemms if o.module == "1")
    assert ops == ["bmm", "bmm", "einsum", "matmul", "matmul", "scaled_dot_product_attention"]
    assert {o.reason for o in ctx.other_gemms} == {"no parameter operand"}
    # The 3-D bmm products would be the candidates of an FP4 path for activation products.
    assert sorted(o.op for o in ctx.other_gemms if o.module == "1" and o.activation_matmul) == ["bmm", "bmm"]
    # Only the linears of the middle blocks are rewritten; the products run as the model wrote them.
    graph = next(g.code for g in ctx.graphs if g.pass_name == "mark_fp4_linear")
    assert graph.count("fp4_linear(") == 4
    assert all(f"{o.node_name}: " in graph for o in ctx.other_gemms)


def test_module_paths_of_wrapped_models():
    """Hugging Face models are reached as L['args'][0] (their forward is wrapped by a decorator)."""
    assert source_root("L['args'][0].model.layers.0") == "L['args'][0]"
    assert module_path("L['args'][0].model.layers.0", root="L['args'][0]") == "model.layers.0"
    assert module_path("L['args'][0]._modules['model']._parameters['w']", root="L['args'][0]") == "model.w"
    # Without one root (a function over a list of models), the list index stays in the path.
    assert module_path("L['models'][1]._modules['fc']._parameters['weight']") == "1.fc.weight"


# ---------------------------------------------------------------------------------------- blocks


class Reordered(nn.Module):
    """Blocks as separate attributes, called in another order than they are defined."""

    def __init__(self, d=32):
        super().__init__()
        self.block_a = MLP(d)
        self.block_b = MLP(d)
        self.block_c = MLP(d)
        self.lm_head = nn.Linear(d, 64, bias=False)

    def forward(self, x):
        x = x + self.block_c(x)
        x = x + self.block_a(x)
        x = x + self.block_b(x)
        return self.lm_head(x)


def test_separate_attribute_blocks_are_numbered_as_they_run():
    ctx = analyse(Reordered(), torch.randn(2, 16, 32))
    assert ctx.block_names == ["block_c", "block_a", "block_b"]
    assert plan(ctx)["block_c.fc"] == (0, "high")
    assert plan(ctx)["block_a.out"] == (1, "nvfp4")
    assert plan(ctx)["block_b.fc"] == (2, "high")
    assert plan(ctx)["lm_head"] == (None, "high")


class ReversedStack(nn.Module):
    def __init__(self, n=4, d=32):
        super().__init__()
        self.layers = nn.ModuleList([MLP(d) for _ in range(n)])

    def forward(self, x):
        for layer in reversed(self.layers):
            x = x + layer(x)
        return x


def test_list_called_in_reverse_is_numbered_by_data_flow():
    ctx = analyse(ReversedStack(), torch.randn(2, 16, 32))
    assert ctx.block_names == ["layers.3", "layers.2", "layers.1", "layers.0"]
    assert plan(ctx)["layers.3.fc"] == (0, "high") and plan(ctx)["layers.0.fc"] == (3, "high")
    assert plan(ctx)["layers.2.fc"] == (1, "nvfp4")


class DecoderLayer(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.self_attn = Attention(d, 2)
        self.cross_q = nn.Linear(d, d)
        self.cross_kv = nn.Linear(d, 2 * d)
        self.mlp = MLP(d)

    def forward(self, x, memory):
        x = x + self.self_attn(x)
        k, v = self.cross_kv(memory).chunk(2, dim=-1)
        x = x + F.scaled_dot_product_attention(self.cross_q(x), k, v)
        return x + self.mlp(x)


class EncoderDecoder(nn.Module):
    def __init__(self, d=32, n_enc=3, n_dec=3):
        super().__init__()
        self.decoder = nn.ModuleDict({"layers": nn.ModuleList([DecoderLayer(d) for _ in range(n_dec)])})
        self.encoder = nn.ModuleDict({"layers": nn.ModuleList([MLP(d) for _ in range(n_enc)])})
        self.lm_head = nn.Linear(d, 64, bias=False)

    def forward(self, src, tgt):
        for layer in self.encoder["layers"]:
            src = src + layer(src)
        for layer in self.decoder["layers"]:
            tgt = layer(tgt, src)
        return self.lm_head(tgt)


def test_encoder_and_decoder_stacks_are_one_sequence_of_blocks():
    ctx = analyse(EncoderDecoder(), torch.randn(2, 16, 32), torch.randn(2, 16, 32))
    assert ctx.block_names == [f"encoder.layers.{i}" for i in range(3)] + [f"decoder.layers.{i}" for i in range(3)]
    first, last = Recipe().high_precision_block_counts(6)
    assert (first, last) == (1, 1)
    assert plan(ctx)["encoder.layers.0.fc"] == (0, "high")
    assert plan(ctx)["decoder.layers.0.cross_kv"] == (3, "nvfp4")
    assert plan(ctx)["decoder.layers.2.mlp.out"] == (5, "high")


class SSMBlock(nn.Module):
    """A Mamba-like block: gated in/out projections around a depthwise convolution."""

    def __init__(self, d=32):
        super().__init__()
        self.in_proj = nn.Linear(d, 4 * d, bias=False)
        self.conv = nn.Conv1d(2 * d, 2 * d, 4, groups=2 * d, padding=3)
        self.out_proj = nn.Linear(2 * d, d, bias=False)

    def forward(self, x):
        u, z = self.in_proj(x).chunk(2, dim=-1)
        u = self.conv(u.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)
        return x + self.out_proj(F.silu(u) * F.silu(z))


class AttentionBlock(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.attn = Attention(d, 2)

    def forward(self, x):
        return x + self.attn(x)


class MoEBlock(nn.Module):
    """Experts in a ModuleList run side by side: they are parts of one block, not blocks."""

    def __init__(self, d=32, n_experts=4):
        super().__init__()
        self.router = nn.Linear(d, n_experts, bias=False)
        self.experts = nn.ModuleList([MLP(d) for _ in range(n_experts)])

    def forward(self, x):
        weights = self.router(x).softmax(-1)
        return x + sum(weights[..., i : i + 1] * e(x) for i, e in enumerate(self.experts))


class Hybrid(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        kinds = [SSMBlock, SSMBlock, AttentionBlock, SSMBlock, MoEBlock, SSMBlock]
        self.layers = nn.ModuleList([kind(d) for kind in kinds])
        self.lm_head = nn.Linear(d, 64, bias=False)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


def test_hybrid_list_of_different_block_classes():
    ctx = analyse(Hybrid(), torch.randn(2, 16, 32))
    assert ctx.block_names == [f"layers.{i}" for i in range(6)]
    p = plan(ctx)
    assert p["layers.0.in_proj"] == (0, "high") and p["layers.5.out_proj"] == (5, "high")
    assert p["layers.1.in_proj"] == (1, "nvfp4") and p["layers.2.attn.qkv"] == (2, "nvfp4")
    assert p["layers.4.experts.3.out"] == (4, "nvfp4")


class TwoNamedStacks(nn.Module):
    """A hybrid stack under a named attribute, beside a block whose MoE experts hang off one child."""

    def __init__(self, d=32):
        super().__init__()
        self.trunk = nn.ModuleDict({"layers": nn.ModuleList([SSMBlock(d), AttentionBlock(d), SSMBlock(d)])})
        self.moe = nn.ModuleDict({"inner": MoEBlock(d)})
        self.lm_head = nn.Linear(d, 64, bias=False)

    def forward(self, x):
        for layer in self.trunk["layers"]:
            x = layer(x)
        return self.lm_head(self.moe["inner"](x))


def test_named_hybrid_stack_expands_but_experts_do_not():
    ctx = analyse(TwoNamedStacks(), torch.randn(2, 16, 32))
    assert ctx.block_names == ["trunk.layers.0", "trunk.layers.1", "trunk.layers.2"]
    # A layer of a class of its own after the stack is not one of the repeated blocks: it stays high.
    assert {plan(ctx)[f"moe.inner.experts.{i}.fc"] for i in range(4)} == {(None, "high")}


class Macaron(nn.Module):
    """A block whose GEMMs are two sub-layers of one class: feed-forward before and after a
    depthwise convolution (a Conformer block without its attention)."""

    def __init__(self, d=32):
        super().__init__()
        self.ffn_in = MLP(d)
        self.conv = nn.Conv1d(d, d, 3, padding=1, groups=d)
        self.ffn_out = MLP(d)

    def forward(self, x):
        x = x + 0.5 * self.ffn_in(x)
        x = x + self.conv(x.transpose(1, 2)).transpose(1, 2)
        return x + 0.5 * self.ffn_out(x)


class MacaronPair(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.first = Macaron(d)
        self.second = Macaron(d)

    def forward(self, x):
        return self.second(self.first(x))


def test_block_with_sub_layers_of_one_class_is_one_block():
    ctx = analyse(MacaronPair(), torch.randn(2, 16, 32))
    assert ctx.block_names == ["first", "second"]


def test_flat_model_has_one_block_per_site():
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
    ctx = analyse(model, torch.randn(2, 16, 32))
    assert ctx.block_names == ["0", "2", "4"]


def test_block_paths_without_a_graph():
    names = ["embed.proj", "layers.0.mixer.in_proj", "layers.1.mixer.q_proj", "layers.10.mixer.in_proj", "lm_head"]
    # A projection before the stack and the output layer are not blocks.
    assert block_paths(names) == ["layers.0", "layers.1", "layers.10"]
    experts = [f"block.moe.experts.{i}.fc" for i in range(4)] + ["head.fc", "head.out"]
    assert block_paths(experts, runs_in_sequence=lambda paths: False) == []
    # Named children are blocks where their class repeats.
    named = ["a.fc", "b.fc", "head.fc"]
    assert block_paths(named, classes={"a": "Block", "b": "Block", "head": "Head"}) == ["a", "b"]
    assert block_paths(named) == []


# ------------------------------------------------------------------------- the hybrid example


@pytest.mark.slow
def test_hybrid_mamba_example_with_activation_checkpointing_keeps_its_plan():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import hybrid_mamba

    threads = torch.get_num_threads()
    plans, losses = [], []
    try:
        for flags in ([], ["--checkpoint"]):
            torch._dynamo.reset()
            out = hybrid_mamba.main(["--steps", "1", "--batch-size", "2", "--seq-len", "64", "--threads", "1", *flags])
            plans.append({s.name: (s.block, s.precision, s.reason) for s in out["backend"].report.sites})
            losses.append(out["losses"])
    finally:
        torch.set_num_threads(threads)
    assert plans[0] == plans[1] and sum(p == "nvfp4" for _, p, _ in plans[0].values()) == 12
    assert losses[0] == losses[1]


@pytest.mark.slow
def test_hybrid_mamba_example_trains_with_fp4_projections(capsys):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import hybrid_mamba

    threads = torch.get_num_threads()
    try:
        out = hybrid_mamba.main(["--steps", "2", "--batch-size", "2", "--seq-len", "64", "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.isfinite(torch.tensor(out["losses"])))
    (ctx,) = [c for c in out["backend"].report.contexts if c.sites]
    layout = hybrid_mamba.HybridConfig.layout
    assert ctx.block_names == [f"layers.{i}" for i in range(len(layout))]
    p = plan(ctx)
    for i, kind in enumerate(layout):
        names = {"M": ("in_proj", "out_proj"), "A": ("qkv", "proj"), "F": ("fc", "proj")}[kind]
        want = "high" if i in (0, len(layout) - 1) else "nvfp4"
        assert [p[f"layers.{i}.mixer.{n}"] for n in names] == [(i, want)] * 2
    # The scan (einsum), the convolution, the norms and attention (SDPA) are not GEMM sites.
    assert {(o.op, o.reason) for o in ctx.other_gemms} == {
        ("einsum", "no parameter operand"), ("scaled_dot_product_attention", "no parameter operand")}
    printed = capsys.readouterr().out
    assert "layers.4.mixer.in_proj" in printed and "Mamba-2        einsum" in printed
