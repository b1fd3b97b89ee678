"""The layouts large-scale training code uses: torchtitan's (checkpoint wrapper, per-block compile,
``fully_shard``, pipeline stages), Hugging Face's gradient checkpointing with per-layer compile, and a
checkpointed block that runs twice. Each gives the recipe's plan, or one ``PlanWarning`` naming the part
and the remedy.

A Llama-style model with ``layers`` in an ``nn.ModuleDict`` keyed by layer number and an ``output``
head, as torchtitan writes it.
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import fp4compile
import gloo
from fp4compile import Backend, PlanWarning

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

D, HEADS, VOCAB = 32, 2, 64


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(D, D, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, HEADS, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, D))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(D, 2 * D, bias=False), nn.Linear(D, 2 * D, bias=False)
        self.w2 = nn.Linear(2 * D, D, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(D), nn.RMSNorm(D)
        self.attention, self.feed_forward = Attention(), FeedForward()

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """torchtitan's layout; a pipeline stage keeps the layer keys and sets the parts it lacks to None."""

    def __init__(self, n_layers: int):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleDict({str(i): TransformerBlock() for i in range(n_layers)})
        self.norm = nn.RMSNorm(D)
        self.output = nn.Linear(D, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def recipe_plan(n_layers: int, layers) -> dict:
    """{site: (block, precision)} the recipe gives the blocks ``layers`` of an ``n_layers`` model."""
    first, last = fp4compile.Recipe().high_precision_block_counts(n_layers)
    names = [f"attention.{w}" for w in ("wq", "wk", "wv", "wo")] + [f"feed_forward.{w}" for w in ("w1", "w3", "w2")]
    return {f"layers.{i}.{n}": (i, "high" if i < first or i >= n_layers - last else "nvfp4") for i in layers for n in names}


def plan_of(backend) -> dict:
    return {s.name: (s.block, s.precision) for s in backend.report.sites if s.name.startswith("layers.")}


def tokens(batch=2, seq=16, seed=1):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# Pipeline stages: the blocks of a stage are placed among the whole model's
# ---------------------------------------------------------------------------------------------


def stage(model: Transformer, layers: range) -> Transformer:
    """torchtitan's pipeline split: a copy of the whole model keeping ``layers`` (and their keys), the
    embedding only in the first stage, norm and output only in the last."""
    part = copy.deepcopy(model)
    for key in list(part.layers.keys()):
        if int(key) not in layers:
            del part.layers[key]
    n = len(model.layers)
    if layers.start != 0:
        part.tok_embeddings = None
    if layers.stop != n:
        part.norm = part.output = None
    return part


def run_stage(part: Transformer, backend: Backend, per_block: bool, x):
    if per_block:
        for block in part.layers.values():
            block.compile(backend=backend)
        out = part(x)
    else:
        out = torch.compile(part, backend=backend)(x)
    out.float().square().mean().backward()
    return out


@pytest.mark.parametrize("per_block", [True, False], ids=["per_block", "whole_stage"])
def test_pipeline_stages_plan_the_whole_models_first_and_last_blocks(per_block):
    torch.manual_seed(0)
    model = Transformer(8)
    x = torch.randn(2, 16, D)
    plans = {}
    for layers in (range(0, 4), range(4, 8)):
        part = stage(model, layers)
        backend = Backend(inner="eager", model=part, total_blocks=8)
        with warnings.catch_warnings():
            warnings.simplefilter("error", PlanWarning)
            run_stage(part, backend, per_block, tokens() if layers.start == 0 else x)
        plans.update(plan_of(backend))
        assert backend.report.warnings == []
    assert plans == recipe_plan(8, range(8))


def test_a_stage_whose_keys_do_not_start_at_0_warns_without_the_total():
    torch.manual_seed(0)
    part = stage(Transformer(8), range(2, 5))  # a middle stage: its last key is not the model's last
    backend = Backend(inner="eager", model=part)
    with pytest.warns(PlanWarning, match=r"layers\.2 \.\.\. layers\.4.*Backend\(total_blocks=") as record:
        run_stage(part, backend, True, torch.randn(2, 16, D))
    assert sum(issubclass(w.category, PlanWarning) for w in record) == 1
    # Placed by their keys in a model of 5 blocks (the largest key + 1), as the warning says.
    assert plan_of(backend) == recipe_plan(5, range(2, 5))
    assert "total_blocks" in backend.report.precision_table()


def test_a_total_smaller_than_the_keys_is_an_error():
    part = stage(Transformer(8), range(4, 8))
    backend = Backend(inner="eager", model=part, total_blocks=6)
    with pytest.raises(Exception, match=r"total_blocks=6.*layers\.7 is block 7"):
        run_stage(part, backend, False, torch.randn(2, 16, D))
    with pytest.raises(ValueError, match="total_blocks"):
        Backend(total_blocks=0)


# ---------------------------------------------------------------------------------------------
# A checkpointed block that runs twice in one forward (weights shared across depth)
# ---------------------------------------------------------------------------------------------


class Looped(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(TransformerBlock() for _ in range(4))

    def forward(self, x):
        for i in (0, 1, 2, 1, 2, 3):
            x = self.layers[i](x)
        return x


@pytest.mark.parametrize("layout", ["checkpoint_wrapper_per_block", "checkpoint_wrapper_whole"])
def test_a_checkpointed_block_that_runs_twice_trains_and_records_its_ranges(layout):
    torch.manual_seed(0)
    model = Looped()
    backend = Backend(inner="eager", model=model)  # amax histories on (the default)
    for i, block in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(block)
        if layout == "checkpoint_wrapper_per_block":
            model.layers[i].compile(backend=backend)
    call = model if layout == "checkpoint_wrapper_per_block" else torch.compile(model, backend=backend)
    x = torch.randn(2, 16, D)
    for _ in range(2):
        call(x).square().mean().backward()
    assert {s.name.split("#")[0] for s in backend.report.sites if s.precision == "nvfp4"} == {
        f"layers.{i}.{n}" for i in (1, 2) for n in ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                                                   "feed_forward.w1", "feed_forward.w3", "feed_forward.w2")}
    ranges = backend.ranges.amax()
    assert set(ranges) >= {"layers.1.attention.wq", "layers.2.feed_forward.w2"}
    assert all(torch.isfinite(v) for v in ranges.values())
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# Hugging Face: gradient checkpointing and per-layer compile
# ---------------------------------------------------------------------------------------------


def _llama():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=4, num_attention_heads=HEADS,
        num_key_value_heads=HEADS, max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config).train()
    model.gradient_checkpointing_enable()
    return model


def _hf_per_layer(model, skip_side_effects: bool):
    backend = Backend(inner="eager", model=model)
    for layer in model.model.layers:
        layer.compile(backend=backend)
    idx = tokens()
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=skip_side_effects), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model(input_ids=idx, labels=idx, use_cache=False).loss.backward()
    return backend, [str(w.message) for w in caught if issubclass(w.category, PlanWarning)]


def test_hugging_face_checkpointed_layers_compiled_one_by_one_are_named_when_they_run_eagerly():
    backend, lines = _hf_per_layer(_llama(), skip_side_effects=False)
    # Llama's layers set a context variable inside the checkpointed region: dynamo runs them eagerly.
    assert len(lines) == 1
    assert "model.layers.1.self_attn.q_proj" in lines[0] and "in no compiled graph" in lines[0]
    assert "skip_fwd_side_effects_in_bwd_under_checkpoint = True" in lines[0]
    assert backend.report.warnings == [lines[0].removeprefix("fp4compile: ")]


@pytest.mark.slow  # a Hugging Face model compiled layer by layer (several seconds on 2 cores)
def test_hugging_face_checkpointed_layers_compiled_one_by_one_follow_the_recipe_with_the_remedy():
    backend, lines = _hf_per_layer(_llama(), skip_side_effects=True)
    assert lines == []
    plan = {s.name: (s.block, s.precision) for s in backend.report.sites}
    assert {name for name, (_, p) in plan.items() if p == "nvfp4"} == {
        name for name, (b, _) in plan.items() if b in (1, 2)}
    assert {b for b, _ in plan.values()} == {0, 1, 2, 3}


# ---------------------------------------------------------------------------------------------
# torchtitan's order with the default inner compiler
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow  # Inductor compiles every block instance
def test_checkpoint_wrapper_then_per_block_compile_with_inductor():
    def run(wrapped):
        torch._dynamo.reset()
        fp4compile.manual_seed(0)
        torch.manual_seed(0)
        model = Transformer(4)
        backend = Backend(model=model)
        for key, block in model.layers.items():
            if wrapped:
                model.layers[key] = block = checkpoint_wrapper(block)
            block.compile(backend=backend)
        logits = model(tokens())
        F.cross_entropy(logits.flatten(0, 1), tokens().flatten()).backward()
        grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in model.named_parameters()}
        return plan_of(backend), logits.detach(), grads, backend

    plan, logits, grads, backend = run(True)
    ref_plan, ref_logits, ref_grads, _ = run(False)
    assert plan == ref_plan == recipe_plan(4, range(4))
    assert backend.report.warnings == []
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=0, msg=name)


class Residual(nn.Module):
    """A block of one linear layer, the least for Inductor to compile."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D, bias=False)

    def forward(self, x):
        return x + self.fc(x)


class Stack(nn.Module):
    def __init__(self, n_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(Residual() for _ in range(n_layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_checkpointed_blocks_compiled_one_by_one_under_inductor_get_their_own_graphs_from_the_caches():
    """The checkpoint-wrapped blocks compiled from one frame have the same dynamo graph, their FP4
    linears inside the checkpoint's region. AOTAutograd's cache keys its entries on that graph (it
    bypasses itself only for such calls at the top level), so it would serve both FP4 blocks one
    block's compilation, with that block's SR seeds, and a run with another recipe the graphs compiled
    under the first: the backend keeps it off for graphs that quantize. Whatever earlier runs left in
    the caches, a run computes what it computes without AOTAutograd's cache, bit for bit, each FP4
    block through its own passes."""
    import torch._functorch.config as functorch_config

    def run(recipe, aot_cache=True):
        torch._dynamo.reset()
        fp4compile.manual_seed(0)
        torch.manual_seed(0)
        model = Stack(4)
        backend = Backend(model=model, recipe=recipe)
        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block)
            model.layers[i].compile(backend=backend)
        with functorch_config.patch(enable_autograd_cache=aot_cache and functorch_config.enable_autograd_cache):
            model(torch.randn(16, D)).square().mean().backward()
        fp4_graphs = {c.graph_id for c in backend.report.contexts if any(s.is_low_precision for s in c.sites)}
        passed = {c.graph_id for c in backend.report.contexts for g in c.graphs if g.stage == "backward"}
        return [p.grad for p in model.parameters()], fp4_graphs, passed

    # The second run finds the first's graphs in the caches, if no earlier one left them there.
    for recipe in (fp4compile.Recipe(), fp4compile.Recipe(stochastic_rounding=False)):
        grads, fp4_graphs, passed = run(recipe)
        for got, want in zip(grads, run(recipe, aot_cache=False)[0]):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert len(fp4_graphs) == 2 and fp4_graphs <= passed


# ---------------------------------------------------------------------------------------------
# torchtitan's parallelize order on two processes: checkpoint wrapper, per-block compile, fully_shard
# ---------------------------------------------------------------------------------------------

WORLD, LAYERS, STEPS = 2, 6, 3


def _titan_run(rank: int, world: int) -> dict:
    """torchtitan's apply_ac, apply_compile, apply_fsdp on ``world`` ranks (every rank the same batch,
    so that the averaged gradients are the one-process gradients to the bit); a few AdamW steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch._dynamo.reset()
    fp4compile.manual_seed(0)
    torch.manual_seed(0)
    model = Transformer(LAYERS)
    backend = Backend(inner="eager", model=model)
    for key, block in model.layers.items():
        model.layers[key] = checkpoint_wrapper(block)
    for block in model.layers.values():
        block.compile(backend=backend)
    if world > 1:
        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], {}
    for step in range(STEPS):
        idx = tokens(seed=10 + step)
        loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
        loss.backward()
        if step == 0:
            for name, p in model.named_parameters():
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                grads[name.replace("._checkpoint_wrapped_module", "")] = g.detach().clone()
        opt.step()
        opt.zero_grad()
        backend.step()
        losses.append(loss.detach())
    return {"plan": plan_of(backend), "warnings": list(backend.report.warnings), "losses": torch.stack(losses),
            "grads": grads}


def _titan_worker(rank: int, port: int, out_dir: str) -> None:
    gloo.init(rank, WORLD, port)
    try:
        torch.save(_titan_run(rank, WORLD), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # starts two processes
def test_torchtitan_parallelize_order_on_two_processes_equals_one_process(tmp_path):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    mp.spawn(_titan_worker, args=(gloo.free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    one = _titan_run(0, 1)
    assert one["plan"] == recipe_plan(LAYERS, range(LAYERS)) and one["warnings"] == []
    for got in ranks:
        assert got["plan"] == one["plan"] and got["warnings"] == []
        torch.testing.assert_close(got["losses"], one["losses"], rtol=0, atol=0)
        assert got["grads"].keys() == one["grads"].keys()
        for name, g in one["grads"].items():
            torch.testing.assert_close(got["grads"][name], g, rtol=0, atol=0, msg=name)
