"""Hugging Face transformers models compiled with the backend: precision plan and a few training steps.

Small configs with random weights, on the CPU, nothing downloaded. Hidden sizes are multiples of 32 so
that every projection qualifies for FP4 (NVFP4 blocks of 16, MXFP4 blocks of 32).
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never reach for the Hub

import pytest
import torch

import fp4compile
from fp4compile import Backend
from fp4compile.passes.keep_routers_high import ROUTER

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_dynamo")]

transformers = pytest.importorskip("transformers")

VOCAB = 128


def train(model, steps=3, lr=3e-3):
    """Compile with the backend and take ``steps`` AdamW steps on one batch; -> (backend, losses)."""
    backend = Backend(inner="eager")
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    idx = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(steps):
        loss = compiled(input_ids=idx, labels=idx, use_cache=False).loss
        opt.zero_grad()
        loss.backward()
        for name, p in model.named_parameters():
            assert p.grad is None or torch.isfinite(p.grad).all(), name
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0], losses
    return backend, losses


def check_recipe_plan(backend, layers: str, n: int):
    """One block per layer, in order; lm_head, the first/last blocks and MoE routers high, the rest NVFP4."""
    (ctx,) = [c for c in backend.report.contexts if c.sites]  # the graph that holds the GEMMs
    assert ctx.n_blocks == n
    assert ctx.block_names == [f"{layers}.{i}" for i in range(n)]
    first, last = max(1, round(n * 2 / 62)), max(1, round(n * 8 / 62))
    high_blocks = set(range(first)) | set(range(n - last, n))
    for s in ctx.sites:
        if s.name == "lm_head":
            assert s.block is None and s.precision == "high" and "high_precision_modules" in s.reason
        elif s.block in high_blocks:
            assert s.precision == "high" and ("first" in s.reason or "last" in s.reason), s
        elif s.reason == ROUTER:
            assert s.precision == "high" and s.module_type.endswith("Router"), s
        else:
            assert s.block is not None and s.precision == "nvfp4", s
            assert s.roles["fprop"].precision == s.roles["dgrad"].precision == s.roles["wgrad"].precision == "nvfp4"
    # Embedding lookups are not GEMMs; only the (possibly tied) lm_head reads the embedding matrix.
    assert not any("embed" in s.name or s.name.endswith(("wte", "wpe")) for s in ctx.sites)
    return {s.name: s for s in ctx.sites}


def test_gpt2_conv1d_projections_are_fp4_sites():
    """GPT-2's Conv1D computes addmm(bias, x, W) with W [in, out]: a linear layer in another form."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=4, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config)
    backend, _ = train(model)
    sites = check_recipe_plan(backend, "transformer.h", 4)
    c_attn = sites["transformer.h.1.attn.c_attn"]
    assert (c_attn.kind, c_attn.in_features, c_attn.out_features) == ("addmm", 64, 192)
    assert sorted(n for n, s in sites.items() if s.block == 1) == [
        f"transformer.h.1.{m}" for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    assert model.transformer.wte.weight.grad is not None  # tied lm_head and embedding


def test_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    backend, _ = train(transformers.LlamaForCausalLM(config))
    sites = check_recipe_plan(backend, "model.layers", 4)
    assert {n.rsplit(".", 1)[-1] for n, s in sites.items() if s.block == 2} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


NEMOTRON_H_LAYERS = ["linear_attention", "mlp", "full_attention", "moe", "linear_attention", "mlp"]


def test_nemotron_h_hybrid_mamba_attention_moe():
    """Mamba-2, attention, MLP and MoE blocks in one stack (the PyTorch path of the Mamba-2 mixer)."""
    torch.manual_seed(0)
    config = transformers.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=64, layers_block_type=NEMOTRON_H_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
        mamba_num_heads=32, mamba_head_dim=4, n_groups=2, ssm_state_size=16, chunk_size=16,
        n_routed_experts=16, num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=64,
        max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    backend, _ = train(transformers.NemotronHForCausalLM(config))
    sites = check_recipe_plan(backend, "model.layers", len(NEMOTRON_H_LAYERS))
    # Mamba-2 mixer: in/out projections are FP4 sites (in_proj: 2*128 + 2*2*16 + 32 = 352 outputs).
    in_proj = sites["model.layers.4.mixer.in_proj"]
    assert (in_proj.precision, in_proj.out_features) == ("nvfp4", 352)
    assert sites["model.layers.4.mixer.out_proj"].precision == "nvfp4"
    assert sites["model.layers.2.mixer.q_proj"].precision == "nvfp4"
    router = sites["model.layers.3.mixer.gate"]
    assert (router.precision, router.reason) == ("high", ROUTER)
    # Stacked experts (3-D weights) are grouped NVFP4 sites; the shared expert's projections are linears.
    experts = sites["model.layers.3.mixer.experts.up_proj"]
    assert (experts.precision, experts.experts) == ("nvfp4", 16)
    assert sites["model.layers.3.mixer.shared_experts.up_proj"].precision == "nvfp4"
    # The chunked scan (einsum) and attention (SDPA) are not sites.
    (ctx,) = [c for c in backend.report.contexts if c.sites]
    ops = {(o.op, o.module.rsplit(".", 1)[-1]) for o in ctx.other_gemms}
    assert {("einsum", "mixer"), ("scaled_dot_product_attention", "mixer")} <= ops


def test_bamba_mamba_and_attention_layers_with_feed_forward():
    """Every Bamba layer holds a mixer (Mamba-2 or attention) and a feed-forward: one block each."""
    torch.manual_seed(0)
    config = transformers.BambaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, attn_layer_indices=[2],
        num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=32, mamba_d_head=4, mamba_n_groups=1,
        mamba_d_state=16, mamba_chunk_size=16, max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
        pad_token_id=0,
    )
    backend, _ = train(transformers.BambaForCausalLM(config))
    sites = check_recipe_plan(backend, "model.layers", 4)
    assert {n.split(".", 3)[-1] for n, s in sites.items() if s.block in (1, 2)} == {
        "mamba.in_proj", "mamba.out_proj", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
        "self_attn.o_proj", "feed_forward.gate_proj", "feed_forward.up_proj", "feed_forward.down_proj"}


def one_step(model):
    """One forward and backward through the backend: ({site: (block, precision, reason)}, loss, grads)."""
    fp4compile.manual_seed(0)
    torch._dynamo.reset()
    backend = Backend(inner="eager")
    idx = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    loss = torch.compile(model, backend=backend)(input_ids=idx, labels=idx, use_cache=False).loss
    loss.backward()
    plan = {s.name: (s.block, s.precision, s.reason) for s in backend.report.sites}
    return plan, loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=4, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    ))


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    ))


def bert_mlm():
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    ))


@pytest.mark.parametrize("make, layers", [(gpt2, "transformer.h"), (llama, "model.layers"), (bert_mlm, "bert.encoder.layer")])
def test_gradient_checkpointing_keeps_the_plan_and_the_numbers(make, layers):
    torch.manual_seed(0)
    model = make().train()
    plan, loss, grads = one_step(model)
    model.zero_grad(set_to_none=True)
    model.gradient_checkpointing_enable()
    # Llama's layers set a context variable that dynamo would replay in the recomputation; without this
    # setting it runs them in eager PyTorch, and the backend warns that their weights are in no graph.
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        ck_plan, ck_loss, ck_grads = one_step(model)
    assert ck_plan == plan
    blocks = {b for b, precision, _ in plan.values() if b is not None}
    assert blocks == {0, 1, 2, 3}
    assert {name for name, (b, p, _) in plan.items() if p == "nvfp4"} == {
        name for name, (b, _, _) in plan.items() if b in (1, 2)}
    assert all(name.startswith(layers) for name, (b, _, _) in plan.items() if b is not None)
    torch.testing.assert_close(ck_loss, loss, rtol=0, atol=0)
    for name in grads:
        torch.testing.assert_close(ck_grads[name], grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_bert_mlm_head_is_outside_the_blocks():
    torch.manual_seed(0)
    plan, _, _ = one_step(bert_mlm())
    heads = {n: v for n, v in plan.items() if n.startswith("cls.")}
    assert heads and all(v == (None, "high", "outside the repeated blocks") for v in heads.values())


def test_layers_that_dynamo_runs_eagerly_are_named_in_a_warning():
    torch.manual_seed(0)
    model = llama().train()
    model.gradient_checkpointing_enable()
    backend = Backend(inner="eager")
    compiled = torch.compile(model, backend=backend)
    idx = torch.randint(0, VOCAB, (2, 32))
    with pytest.warns(fp4compile.PlanWarning, match="GEMM weights of LlamaForCausalLM's blocks are in no compiled graph"):
        for _ in range(2):
            compiled(input_ids=idx, labels=idx, use_cache=False).loss.backward()
    assert any("skip_fwd_side_effects_in_bwd_under_checkpoint" in w for w in backend.report.warnings)
