"""Recipe(include_activation_matmuls=True): explicit products of two activations as FP4 GEMM sites."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fp4compile
from fp4compile import Backend, formats

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

LINEARS_HIGH = ("*.qkv", "*.proj", "*.fc", "*.out", "emb", "head")


def _reference_matmul(a, b):
    """A @ B with both operands quantized in 1x16 blocks along K (RNE), block-decoded, multiplied in
    fp32 and scaled by alpha, as the emulated FP4 GEMM computes it."""
    qa = formats.quantize(a, "nvfp4", "1x16", "rne")
    qb = formats.quantize(b.transpose(-2, -1).contiguous(), "nvfp4", "1x16", "rne")
    acc = formats.block_decode(qa) @ formats.block_decode(qb).transpose(-2, -1)
    return acc * formats.gemm_alpha(qa.amax, qb.amax)


class Attention(nn.Module):
    def __init__(self, d: int, head_dim: int):
        super().__init__()
        self.n_head, self.head_dim = d // head_dim, head_dim
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.reference = False  # eager reference: the two products through _reference_matmul

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, self.head_dim).transpose(1, 2) for z in (q, k, v))
        mm = _reference_matmul if self.reference else torch.matmul
        scores = mm(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = mm(probs, v)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, head_dim: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, head_dim)
        self.fc, self.out = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyAttentionModel(nn.Module):
    def __init__(self, vocab=64, d=32, head_dim=16, n_layer=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, head_dim) for _ in range(n_layer))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _model(**kw):
    torch.manual_seed(0)
    return TinyAttentionModel(**kw)


def _idx():
    return torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))


def _other_gemms(backend):
    return [o for ctx in backend.report.latest for o in ctx.other_gemms]


def _activation_sites(backend):
    return [s for s in backend.report.sites if s.kind == "activation_matmul"]


@pytest.mark.parametrize("head_dim", [16, 32])
def test_attention_products_are_fp4_sites_in_all_roles(head_dim):
    model = _model(d=64, head_dim=head_dim)
    backend = Backend(inner="eager", include_activation_matmuls=True)
    logits = torch.compile(model, backend=backend)(_idx())
    loss = F.cross_entropy(logits.flatten(0, 1), _idx().flatten())
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert model.blocks[1].attn.qkv.weight.grad is not None

    sites = _activation_sites(backend)
    assert len(sites) == 2 * 4  # scores and values of each block
    assert {s.block for s in sites} == {0, 1, 2, 3}
    for s in sites:
        assert s.name.startswith(f"blocks.{s.block}.attn.")
        if s.block in (1, 2):
            assert s.precision == "nvfp4", s
            assert set(s.roles) == {"fprop", "dgrad", "wgrad"}
            for role, info in s.roles.items():
                assert info.precision == "nvfp4", (s.name, role, info.reason)
                assert info.blocks == ("1x16", "1x16")
                assert info.kernel == "emulation"
            assert s.roles["fprop"].rounding == ("rne", "rne")
            assert s.roles["dgrad"].rounding == ("sr", "rne")
            assert s.roles["wgrad"].rounding == ("rne", "sr") and s.roles["wgrad"].rht
        else:
            assert s.precision == "high"
    scores, values = sorted((s for s in sites if s.block == 1), key=lambda s: (len(s.name), s.name))
    assert (scores.name, values.name) == ("blocks.1.attn.matmul_0", "blocks.1.attn.matmul_1")
    n_head = 64 // head_dim
    # (M, N, K) with the batch and head dims folded into M.
    assert scores.roles["fprop"].shape == (2 * n_head * 32, 32, head_dim)
    assert values.roles["fprop"].shape == (2 * n_head * 32, head_dim, 32)
    assert scores.roles["wgrad"].shape == (2 * n_head * head_dim, 32, 32)
    assert not any(o.reason == "no parameter operand" and o.module.startswith("blocks.1.")
                   for o in _other_gemms(backend) if o.op == "matmul")


def test_forward_matches_eager_reference_bit_for_bit():
    model = _model()
    ref_model = copy.deepcopy(model)
    backend = Backend(
        inner="eager", include_activation_matmuls=True, stochastic_rounding=False,
        high_precision_modules=LINEARS_HIGH,
    )
    with torch.no_grad():
        logits = torch.compile(model, backend=backend)(_idx())
    assert [s.name for s in backend.report.sites if s.precision == "nvfp4"] == [
        s.name for s in _activation_sites(backend) if s.block in (1, 2)
    ]
    assert len([s for s in backend.report.sites if s.precision == "nvfp4"]) == 4
    for b in (1, 2):
        ref_model.blocks[b].attn.reference = True
    with torch.no_grad():
        want = ref_model(_idx())
        plain = model(_idx())
    torch.testing.assert_close(logits, want, rtol=0, atol=0)
    assert not torch.equal(logits, plain)  # the products were quantized


def test_training_step_matches_reference_forward_and_is_finite():
    model = _model()
    ref_model = copy.deepcopy(model)
    backend = Backend(inner="eager", include_activation_matmuls=True, stochastic_rounding=False,
                      high_precision_modules=LINEARS_HIGH)
    logits = torch.compile(model, backend=backend)(_idx())
    loss = F.cross_entropy(logits.flatten(0, 1), _idx().flatten())
    loss.backward()
    for b in (1, 2):
        ref_model.blocks[b].attn.reference = True
    torch.testing.assert_close(logits, ref_model(_idx()), rtol=0, atol=0)
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())


def test_option_off_leaves_activation_products_alone():
    model = _model()
    backend = Backend(inner="eager")
    logits = torch.compile(model, backend=backend)(_idx())
    F.cross_entropy(logits.flatten(0, 1), _idx().flatten()).backward()
    assert not _activation_sites(backend)
    assert {s.kind for s in backend.report.sites} == {"linear"}
    products = [o for o in _other_gemms(backend) if o.module.endswith(".attn")]
    assert len(products) == 2 * 4 and {o.reason for o in products} == {"no parameter operand"}


class _ProductBlock(nn.Module):
    """[.., 24, 16] @ [.., 16, 32]: M = 24 is not a multiple of the block size."""

    def __init__(self, op):
        super().__init__()
        self.a, self.b, self.op = nn.Linear(16, 16), nn.Linear(16, 32), op

    def forward(self, x):
        return self.op(self.a(x), self.b(x)[..., :16, :])[..., :16]


@pytest.mark.parametrize("op, shape", [(torch.mm, (24, 16)), (torch.bmm, (2, 24, 16))])
def test_wgrad_reduction_dim_is_zero_padded(op, shape):
    torch.manual_seed(0)
    model = nn.Sequential(_ProductBlock(op), _ProductBlock(op))
    backend = Backend(
        inner="eager", include_activation_matmuls=True,
        high_precision_first_blocks=0, high_precision_last_blocks=0,
    )
    torch.compile(model, backend=backend)(torch.randn(*shape)).square().sum().backward()
    sites = _activation_sites(backend)
    assert [s.name for s in sites] == ["0.matmul_0", "1.matmul_0"]
    for s in sites:
        assert {r: i.precision for r, i in s.roles.items()} == {"fprop": "nvfp4", "dgrad": "nvfp4", "wgrad": "nvfp4"}
        assert "24 tokens zero-padded" in s.roles["wgrad"].reason
    assert not backend.report.fallbacks
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
