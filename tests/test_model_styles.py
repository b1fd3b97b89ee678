"""The precision plan is a property of the model, not of how its code is written or compiled.

One small transformer, written and compiled in the ways training code does: module calls, ``F.linear``
in the block and in a sub-module, ``x @ W.t()``, activation checkpointing (both modes, selective),
blocks compiled one by one (with and without ``Backend(model=)``), ``model.compile()`` and a graph break
in every block. Each gives the same plan (site names, blocks, precisions, reasons) and the same forward
values and gradients, bit for bit.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts, CheckpointPolicy

import fp4compile
from fp4compile import Backend, PlanWarning

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

D, HEADS, VOCAB, LAYERS = 32, 2, 64, 4


class Attention(nn.Module):
    def __init__(self, style):
        super().__init__()
        self.style = style
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(D, D, bias=False) for _ in range(4))

    def project(self, layer, x):
        if self.style == "functional_in_submodule":
            return F.linear(x, layer.weight)
        if self.style == "matmul":
            return x @ layer.weight.t()
        return layer(x)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (self.project(w, x).view(b, t, HEADS, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.project(self.wo, y.transpose(1, 2).reshape(b, t, D))


class Block(nn.Module):
    def __init__(self, style):
        super().__init__()
        self.style = style
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attention = Attention(style)
        self.fc = nn.Linear(D, 4 * D, bias=False)
        self.proj = nn.Linear(4 * D, D, bias=False)

    def mlp(self, x):
        if self.style == "functional":
            return F.linear(F.gelu(F.linear(x, self.fc.weight)), self.proj.weight)
        if self.style == "graph_break":
            h = F.gelu(self.fc(x))
            torch._dynamo.graph_break()
            return self.proj(h)
        return self.proj(F.gelu(self.fc(x)))

    def body(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))

    def forward(self, x):
        if self.style in ("checkpoint", "checkpoint_reentrant"):
            return checkpoint(self.body, x, use_reentrant=self.style == "checkpoint_reentrant")
        if self.style == "selective_checkpoint":
            policy = lambda ctx, op, *a, **k: (  # noqa: E731
                CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE
            )
            return checkpoint(self.body, x, use_reentrant=False,
                              context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
        return self.body(x)


class Model(nn.Module):
    """A torchtitan-like layout: ``layers`` keyed by layer number, an output layer named ``output``."""

    def __init__(self, style="modules"):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleDict({str(i): Block(style) for i in range(LAYERS)})
        self.norm = nn.LayerNorm(D)
        self.output = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx):
        x = self.tok_embeddings(idx)
        for layer in self.layers.values():
            x = layer(x)
        return self.output(self.norm(x))


class Wrapper(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, idx):
        return self.model(idx)


def compiled(style):
    """(model, what to call, backend) for ``style``."""
    torch.manual_seed(0)
    model = Model("checkpoint" if style == "checkpoint_per_block" else style)
    backend = Backend(inner="eager", model=model if style == "per_block" else None)
    if style in ("per_block", "per_block_no_root"):
        for name, block in model.layers.items():
            model.layers[name] = torch.compile(block, backend=backend)
        return model, model, backend
    if style in ("checkpoint_wrapper_per_block", "checkpoint_per_block"):
        # torchtitan's order: the activation-checkpoint wrapper on each block, then each block compiled
        # in place; or blocks that checkpoint their own body, compiled one by one.
        backend = Backend(inner="eager", model=model)
        for name, block in model.layers.items():
            if style == "checkpoint_wrapper_per_block":
                model.layers[name] = block = checkpoint_wrapper(block)
            block.compile(backend=backend)
        return model, model, backend
    if style == "model_compile":
        model.compile(backend=backend)
        return model, model, backend
    if style == "inside_a_wrapper":  # a training wrapper module around the compiled model
        return model, Wrapper(torch.compile(model, backend=backend)), backend
    return model, torch.compile(model, backend=backend), backend


def run(style):
    """(plan {site: (block, precision, reason)}, logits, gradients by parameter name, backend)."""
    fp4compile.manual_seed(0)
    torch._dynamo.reset()
    model, call, backend = compiled(style)
    idx = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    logits = call(idx)
    F.cross_entropy(logits.flatten(0, 1), idx.flatten()).backward()
    grads = {n.replace("._orig_mod", "").replace("._checkpoint_wrapped_module", ""): p.grad
             for n, p in model.named_parameters()}
    plan = {s.name: (s.block, s.precision, s.reason) for s in backend.report.sites}
    return plan, logits.detach(), grads, backend


@functools.cache
def reference():
    return run("modules")


def test_the_plan_of_the_reference_style():
    plan, *_ , backend = reference()
    layer_sites = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "fc", "proj")
    assert set(plan) == {f"layers.{i}.{s}" for i in range(LAYERS) for s in layer_sites} | {"output"}
    assert plan["output"] == (None, "high", "outside the repeated blocks")
    assert plan["layers.0.fc"] == (0, "high", "first 1 of 4 blocks")
    assert plan["layers.1.attention.wq"] == (1, "nvfp4", "recipe default")
    assert plan["layers.3.proj"] == (3, "high", "last 1 of 4 blocks")
    assert backend.report.warnings == []


STYLES = [
    "functional", "functional_in_submodule", "matmul", "checkpoint", "checkpoint_reentrant",
    "selective_checkpoint", "per_block", "per_block_no_root", "model_compile", "graph_break", "inside_a_wrapper",
    "checkpoint_wrapper_per_block", "checkpoint_per_block",
]
PER_BLOCK = ("per_block", "per_block_no_root", "graph_break", "checkpoint_wrapper_per_block", "checkpoint_per_block")


@pytest.mark.parametrize("style", STYLES)
def test_every_style_gives_the_same_plan_values_and_gradients(style):
    plan, logits, grads, backend = run(style)
    ref_plan, ref_logits, ref_grads, _ = reference()
    if style in PER_BLOCK:
        # The output layer runs outside the compiled blocks, in eager PyTorch.
        ref_plan = {k: v for k, v in ref_plan.items() if k != "output"}
    assert plan == ref_plan
    assert backend.report.warnings == []
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        # Where the embedding runs outside the compiled graphs, eager PyTorch sums its gradient in
        # another order; every other gradient is the same to the bit.
        exact = name.startswith("layers.") or style not in PER_BLOCK
        tol = 0 if exact else 1e-6
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=tol, atol=tol, msg=name)


def test_a_block_compiled_alone_with_no_model_around_it_warns_once():
    torch.manual_seed(0)
    blocks = [Block("modules") for _ in range(3)]
    backend = Backend(inner="eager")
    x = torch.randn(2, 16, D)
    with pytest.warns(PlanWarning, match="found no repeated blocks in Block.*Backend\\(model=") as record:
        for block in blocks:
            x = torch.compile(block, backend=backend)(x)
    assert sum(issubclass(w.category, PlanWarning) for w in record) == 1
    assert {s.precision for s in backend.report.sites} == {"high"}
    assert len(backend.report.warnings) == 1 and "Backend(model=" in backend.report.warnings[0]
    assert "warning: found no repeated blocks" in backend.report.precision_table()


class HeadWithChildren(Model):
    """An output head with a norm and a projection, and a tied embedding head beside it."""

    def __init__(self):
        super().__init__()
        self.output = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, VOCAB, bias=False))

    def forward(self, idx):
        x = self.tok_embeddings(idx)
        for layer in self.layers.values():
            x = layer(x)
        return self.output(x) + x @ self.tok_embeddings.weight.T


def test_heads_are_never_blocks():
    backend = Backend(inner="eager")
    with torch.no_grad():
        torch.compile(HeadWithChildren(), backend=backend)(torch.randint(0, VOCAB, (2, 16)))
    (ctx,) = backend.report.contexts
    assert ctx.block_names == [f"layers.{i}" for i in range(LAYERS)]
    plan = {s.name: (s.block, s.precision, s.reason) for s in ctx.sites}
    assert plan["output.1"] == (None, "high", "outside the repeated blocks")
    assert plan["tok_embeddings"][:2] == (None, "high")
    assert plan["layers.2.fc"][1] == "nvfp4"


class SharedWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(D, D, bias=False) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(layer(x))  # each weight in two GEMMs
        return x


def test_a_weight_in_several_gemms_gives_sites_of_unique_names():
    backend = Backend(inner="eager")
    with torch.no_grad():
        torch.compile(SharedWeight(), backend=backend)(torch.randn(16, D))
    names = [s.name for s in backend.report.sites]
    assert names[:4] == ["layers.0", "layers.0#2", "layers.1", "layers.1#2"]
    assert len(set(names)) == len(names)


class Fused(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D, bias=False)

    def forward(self, x):
        return torch.ops.fp4test.fused_linear(x, self.fc.weight)


@torch.library.custom_op("fp4test::fused_linear", mutates_args=())
def _fused_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.gelu(x @ w.t())


@_fused_linear.register_fake
def _(x, w):
    return x.new_empty(*x.shape[:-1], w.shape[0])


def test_a_custom_op_with_a_weight_is_named_in_a_warning():
    model = nn.Sequential(*[Fused() for _ in range(3)])
    backend = Backend(inner="eager")
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        torch.compile(model, backend=backend)(torch.randn(4, D))
    lines = [str(w.message) for w in caught if issubclass(w.category, PlanWarning)]
    assert len(lines) == 1
    assert "custom op fp4test::fused_linear" in lines[0] and "0, 1, 2" in lines[0]
    assert backend.report.warnings == [lines[0].removeprefix("fp4compile: ")]


class MHABlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(D, HEADS, batch_first=True)
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        x = x + self.attn(x, x, x, need_weights=False)[0]
        return x + self.fc(x)


def test_multihead_attention_projections_are_listed_and_counted():
    model = nn.Sequential(*[MHABlock() for _ in range(4)])
    backend = Backend(inner="eager")
    with pytest.warns(PlanWarning, match=r"nn.MultiheadAttention .*in 0.attn, 1.attn, 2.attn, 3.attn"):
        torch.compile(model, backend=backend)(torch.randn(2, 16, D)).sum().backward()
    (ctx,) = backend.report.contexts
    projections = [o for o in ctx.other_gemms if o.op.startswith("multi_head_attention_forward")]
    assert len(projections) == 8
    tokens = 2 * 16
    assert {o.flops for o in projections} == {3 * 2 * D * D * 3 * tokens, 3 * 2 * D * D * tokens}
    shares = backend.report.flop_shares()
    fc_flops = sum(info.flops for s in ctx.sites for info in s.roles.values())
    high = sum(o.flops for o in projections) + sum(
        info.flops for s in ctx.sites for info in s.roles.values() if info.precision == "high")
    assert shares["high"] == pytest.approx(high / (fc_flops + sum(o.flops for o in projections)))


@pytest.mark.gpu
@pytest.mark.parametrize("style", ["checkpoint", "per_block", "graph_break"])
def test_styles_on_the_gpu_with_inductor(style):
    """On a GPU with Inductor (bf16 autocast): the same plan as module calls, and the same forward and
    gradients within the differences of Inductor fusing other graphs (FP4 GEMM operands are the same)."""

    def gpu_run(style):
        fp4compile.manual_seed(0)
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Model(style).cuda()
        backend = Backend(model=model if style == "per_block" else None)
        if style == "per_block":
            for name, block in model.layers.items():
                model.layers[name] = torch.compile(block, backend=backend)
            call = model
        else:
            call = torch.compile(model, backend=backend)
        idx = torch.randint(0, VOCAB, (4, 64), generator=torch.Generator().manual_seed(1)).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = call(idx)
        F.cross_entropy(logits.float().flatten(0, 1), idx.flatten()).backward()
        grads = {n.replace("._orig_mod", ""): p.grad.float() for n, p in model.named_parameters()}
        plan = {s.name: (s.block, s.precision, s.reason) for s in backend.report.sites if s.name != "output"}
        return plan, logits.float().detach(), grads

    plan, logits, grads = gpu_run(style)
    ref_plan, ref_logits, ref_grads = gpu_run("modules")
    assert plan == ref_plan and any(p == "nvfp4" for _, p, _ in plan.values())
    torch.testing.assert_close(logits, ref_logits, rtol=2e-2, atol=2e-2)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=5e-2, atol=5e-3, msg=name)


@pytest.mark.slow
def test_checkpointing_under_inductor_recomputes_the_fp4_forward_to_the_same_bits():
    """The default inner compiler: Inductor's partitioner recomputes the checkpointed blocks in the
    backward, FP4 GEMMs included, and the numbers stay those of the model without checkpointing."""

    def inductor_run(style):
        fp4compile.manual_seed(0)
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Model(style)
        backend = Backend()
        idx = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
        logits = torch.compile(model, backend=backend)(idx)
        F.cross_entropy(logits.flatten(0, 1), idx.flatten()).backward()
        plan = {s.name: (s.block, s.precision, s.reason) for s in backend.report.sites}
        backward = backend.report.graph("backward", backend.report.pass_names("backward")[-1])
        return plan, logits.detach(), {n: p.grad for n, p in model.named_parameters()}, backward

    # Compiled afresh, not served from the compile caches that earlier tests filled.
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        plan, logits, grads, backward = inductor_run("checkpoint")
        ref_plan, ref_logits, ref_grads, ref_backward = inductor_run("modules")
    assert plan == ref_plan
    n_fp4 = sum(p == "nvfp4" for _, p, _ in plan.values())
    # dgrad and wgrad of every FP4 site; with checkpointing, recomputed fprops besides.
    assert ref_backward.count("fp4.scaled_mm.default(") == 2 * n_fp4
    assert backward.count("fp4.scaled_mm.default(") > 2 * n_fp4
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=0, msg=name)
