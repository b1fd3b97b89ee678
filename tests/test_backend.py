"""End-to-end behaviour of the nvfp4 backend on small models (CPU)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import fp4compile
from fp4compile import Backend
from models import MLPStack, TinyGPT, grads, lm_loss
from recipe_reference import reference_recipe
from tiers import first_fast

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _gpt(**kw):
    torch.manual_seed(0)
    return TinyGPT(**kw)


def _train_step(model, backend, idx):
    compiled = torch.compile(model, backend=backend)
    logits = compiled(idx)
    loss = lm_loss(logits, idx)
    loss.backward()
    return logits, loss


def test_backend_string_is_registered():
    from torch._dynamo.backends.registry import list_backends

    assert "nvfp4" in list_backends(exclude_tags=())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_matches_eager_reference_recipe_bit_for_bit(fmt):
    """Forward and all gradients equal an eager quantize->dequantize->matmul implementation (SR off)."""
    d = 64 if fmt == "mxfp4" else 32
    model = _gpt(n_layer=4, d=d)
    ref_model = copy.deepcopy(model)
    idx = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    backend = Backend(inner="eager", fmt=fmt, stochastic_rounding=False)
    logits, _ = _train_step(model, backend, idx)
    fp4_sites = [s.name for s in backend.report.sites if s.precision == fmt]
    assert fp4_sites == [f"blocks.{b}.{m}" for b in (1, 2) for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.out")]
    with reference_recipe(ref_model, fp4_sites, fmt=fmt):
        ref_logits = ref_model(idx)
        lm_loss(ref_logits, idx).backward()
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
    got, want = grads(model), grads(ref_model)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


def test_parameters_are_static_inputs_of_the_compiled_graphs(monkeypatch):
    """Inductor is told which forward inputs are parameters, as for a model compiled with plain Inductor:
    CUDA graphs keep those in place instead of copying every parameter into the graph on each replay."""
    import torch._functorch.config as functorch_config
    import torch._inductor.compile_fx as compile_fx

    seen = {}
    inner = compile_fx.compile_fx_inner

    def spy(graph, inputs, **kwargs):
        seen["backward" if kwargs.get("is_backward") else "forward"] = (len(inputs), kwargs.get("static_input_idxs"))
        return inner(graph, inputs, **kwargs)

    monkeypatch.setattr(compile_fx, "compile_fx_inner", spy)
    model = _gpt(n_layer=4, d=32)
    idx = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    backend = Backend()
    with functorch_config.patch(enable_autograd_cache=False):
        _train_step(model, backend, idx)
    n_inputs, static = seen["forward"]
    n_params = len(list(model.parameters()))
    n_histories = len(backend.ranges)  # each FP4 layer's activation-range history (a buffer, fp4compile.ranges)
    assert n_histories > 0
    assert n_inputs == n_params + n_histories + 1  # the parameters, the histories and the token ids
    assert len(static) == n_params + n_histories, static
    assert "backward" in seen


def test_inductor_plans_sharing_on_the_joint_graph_and_says_when_it_cannot():
    """Under Inductor the joint graph's pass plans one quantization of each FP4 weight (kept packed for
    dgrad); with Inductor's joint-graph passes off it cannot, says so once, and each GEMM quantizes W
    itself: the same bits."""
    from torch._inductor import config as inductor_config

    idx = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(2))
    results = {}
    for joint in (True, False):
        torch._dynamo.reset()
        fp4compile.manual_seed(3)
        model = _gpt(n_layer=4, d=32)
        backend = Backend()
        with inductor_config.patch(use_joint_graph_passes=joint), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            logits, _ = _train_step(model, backend, idx)
        said = [str(w.message) for w in caught if "joint-graph pass did not run" in str(w.message)]
        assert len(said) == (0 if joint else 1), said
        stages = {g.stage for g in backend.report.graphs}
        assert ("joint" in stages) == joint
        backward = backend.report.fx_graph("backward")
        transposes = [n for n in backward.nodes if n.target is torch.ops.fp4.transpose_quantized.default]
        assert len(transposes) == (8 if joint else 0)  # the FP4 blocks' 8 linears: dgrad reads the kept W
        results[joint] = (logits.detach(), [p.grad for p in model.parameters()])
    assert torch.equal(results[True][0], results[False][0])
    # Inductor's own joint-graph passes (off in the second run) change how the high-precision backward
    # is fused, so the gradients agree to float32 rounding, not bit for bit.
    for a, b in zip(results[True][1], results[False][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_inductor_matches_eager_inner():
    """Inductor fuses the surrounding ops differently: results agree to fp32 accumulation-order noise."""
    idx = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(2))
    results = {}
    for inner in ("eager", "inductor"):
        torch._dynamo.reset()
        model = _gpt(n_layer=4)
        logits, loss = _train_step(model, Backend(inner=inner, stochastic_rounding=False), idx)
        results[inner] = (logits.detach(), loss.item(), model.blocks[1].mlp.fc.weight.grad.clone())
    (le, losse, ge), (li, lossi, gi) = results["eager"], results["inductor"]
    assert abs(losse - lossi) < 1e-3
    assert (li - le).norm() / le.norm() < 1e-2
    assert (gi - ge).norm() / ge.norm() < 5e-2


def test_inductors_cache_key_covers_fp4compiles_code_and_the_users_passes(monkeypatch):
    """The post-grad pass the backend gives Inductor keys its FX graph cache on fp4compile's code version
    and on each user pass's uuid; a user pass without one makes the cache bypass the graph (None)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    from fp4compile import backend as backend_module

    class UserPass(CustomGraphPass):
        def __init__(self, key):
            self.key = key

        def __call__(self, graph):
            return None

        def uuid(self):
            return self.key

    key = lambda passes: backend_module._version_pass(passes).uuid()  # noqa: E731
    base = key(None)
    assert base and key([]) == base and key(UserPass("a")) not in (None, base)
    assert key(UserPass("a")) == key([UserPass("a")]) != key([UserPass("a"), UserPass("b")])
    assert key([UserPass("a"), lambda graph: None]) is None
    monkeypatch.setattr(backend_module, "_code_version", lambda: b"another version")
    assert key(None) != base and key(UserPass("a")) != key(None)


@pytest.mark.slow  # two Inductor compiles of a 4-block GPT
def test_users_post_grad_passes_still_run_under_inductor():
    """Inductor's post_grad_custom_pre_pass setting, as a user sets it (a list; one pass without a uuid),
    still runs on the forward and backward graphs the backend compiles, and leaves the results alone."""
    from torch._inductor import config as inductor_config

    calls = {"first": 0, "second": 0}

    def first(graph):
        calls["first"] += 1

    def second(graph):
        calls["second"] += 1

    idx = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(2))
    results = []
    for passes in (None, [first, second]):
        torch._dynamo.reset()
        model = _gpt(n_layer=4)
        with inductor_config.patch(post_grad_custom_pre_pass=passes):
            logits, loss = _train_step(model, Backend(inner="inductor", stochastic_rounding=False), idx)
        results.append((logits.detach(), model.blocks[1].mlp.fc.weight.grad.clone()))
    assert calls["first"] >= 2 and calls["first"] == calls["second"]  # forward and backward, each pass
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.slow
def test_sr_gradients_are_unbiased_over_seeds():
    """With SR on, the mean weight gradient over many SR streams approaches the RNE-free exact one."""
    model = _gpt(n_layer=4)
    idx = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(3))
    backend = Backend(inner="eager", rht=False, weight_2d=False)
    compiled = torch.compile(model, backend=backend)
    weight = model.blocks[1].mlp.fc.weight
    grads = []
    for seed in range(16):
        fp4compile.manual_seed(seed)
        model.zero_grad()
        lm_loss(compiled(idx), idx).backward()
        grads.append(weight.grad.clone())
    grads = torch.stack(grads)
    # Reference: the same model with SR off (RNE on dY); SR noise averages out, so the SR mean is
    # closer to the high-precision gradient than single SR draws are.
    ref = copy.deepcopy(model)
    ref.zero_grad()
    lm_loss(ref(idx), idx).backward()
    exact = ref.blocks[1].mlp.fc.weight.grad
    single = (grads - exact).norm(dim=(1, 2)).mean()
    mean = (grads.mean(0) - exact).norm()
    assert mean < 0.8 * single
    assert not torch.equal(grads[0], grads[1]), "different SR streams must draw different bits"


def test_sr_is_reproducible_from_the_same_state():
    idx = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(4))
    runs = []
    for _ in range(2):
        torch._dynamo.reset()
        fp4compile.manual_seed(7)
        model = _gpt(n_layer=4)
        compiled = torch.compile(model, backend=Backend(inner="eager"))
        losses = []
        for _step in range(2):
            model.zero_grad()
            loss = lm_loss(compiled(idx), idx)
            loss.backward()
            losses.append(loss.item())
        runs.append((losses, grads(model)))
    assert runs[0][0] == runs[1][0]
    for name in runs[0][1]:
        assert torch.equal(runs[0][1][name], runs[1][1][name]), name


@pytest.mark.parametrize(*first_fast("n_blocks, first, last", [(1, 1, 1), (4, 1, 1), (12, 1, 2), (62, 2, 8)]))
def test_precision_plan_follows_the_recipe_proportions(n_blocks, first, last):
    torch.manual_seed(0)
    model = MLPStack(n_blocks)
    backend = Backend(inner="eager")
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(2, 16, 16))
    sites = backend.report.sites
    assert backend.report.n_blocks == n_blocks
    high_blocks = sorted({s.block for s in sites if s.block is not None and s.precision == "high"})
    expected = sorted(set(range(first)) | set(range(n_blocks - last, n_blocks)))
    assert high_blocks == expected
    assert all(s.precision == "nvfp4" for s in sites if s.block is not None and s.block not in expected)
    head = next(s for s in sites if s.name == "head")
    assert (head.block, head.precision, head.reason) == (None, "high", "outside the repeated blocks")
    for s in sites:
        if s.precision == "high" and s is not head:
            assert "first" in s.reason or "last" in s.reason


def test_gpt_plan_keeps_lm_head_and_ends_high():
    model = _gpt(n_layer=12, tied=True)
    backend = Backend(inner="eager")
    idx = torch.randint(0, 64, (2, 32))
    _train_step(model, backend, idx)
    by_name = {s.name: s for s in backend.report.sites}
    assert by_name["lm_head"].precision == "high" and "lm_head" in by_name["lm_head"].reason
    assert {s.block for s in backend.report.sites if s.precision == "high" and s.block is not None} == {0, 10, 11}
    # Tied weight: the embedding received gradients from both uses.
    assert model.tok_emb.weight.grad is not None and torch.isfinite(model.tok_emb.weight.grad).all()


def test_tied_lm_head_in_fp4_trains():
    model = _gpt(n_layer=4, tied=True)
    backend = Backend(inner="eager", high_precision_modules=(), high_precision_outside_blocks=False)
    _, loss = _train_step(model, backend, torch.randint(0, 64, (2, 32)))
    lm_head = next(s for s in backend.report.sites if s.name == "lm_head")
    assert lm_head.precision == "nvfp4"
    assert torch.isfinite(loss) and torch.isfinite(model.tok_emb.weight.grad).all()


def test_biasless_and_odd_shapes_fall_back_with_reason(caplog):
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(32, 32, bias=False), nn.Linear(32, 24)) for _ in range(5)])

        def forward(self, x):
            for b in self.blocks:
                x = b[0](x) + b[1](x).sum(-1, keepdim=True)
            return x

    torch.manual_seed(0)
    model = Odd()
    backend = Backend(inner="eager")
    with caplog.at_level("WARNING", logger="fp4compile"):
        y = torch.compile(model, backend=backend)(torch.randn(3, 16, 32))
        y.sum().backward()
    sites = {s.name: s for s in backend.report.sites}
    assert sites["blocks.2.0"].precision == "nvfp4"
    odd = sites["blocks.2.1"]
    assert odd.precision == "high" and "out_features=24 not a multiple" in odd.reason
    assert any("blocks.2.1" in f and "out_features=24" in f for f in backend.report.fallbacks)
    assert "blocks.2.1" in caplog.text


def test_token_count_not_multiple_of_16_pads_wgrad_tokens():
    model = _gpt(n_layer=4)
    backend = Backend(inner="eager")
    _train_step(model, backend, torch.randint(0, 64, (1, 9)))  # 9 tokens
    site = next(s for s in backend.report.sites if s.name == "blocks.1.mlp.fc")
    assert site.roles["fprop"].precision == "nvfp4"
    assert site.roles["dgrad"].precision == "nvfp4"
    wgrad = site.roles["wgrad"]
    assert wgrad.precision == "nvfp4" and wgrad.shape[2] == 16
    assert "9 tokens zero-padded to a multiple of 16" in wgrad.reason


def test_eval_no_grad_runs_fprop_only():
    model = _gpt(n_layer=4).eval()
    backend = Backend(inner="eager")
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(torch.randint(0, 64, (2, 32)))
    assert out.shape == (2, 32, 64)
    for s in backend.report.sites:
        assert set(s.roles) == {"fprop"}
    assert not any(g.stage == "backward" for g in backend.report.graphs)


def test_custom_precision_pass_keeps_attention_projection_high():
    @fp4compile.precision_pass
    def keep_attn_proj_high(gm, ctx):
        for site in ctx.sites:
            if site.name.endswith("attn.proj"):
                site.set_precision("high", "user: attention output projections in BF16")
        return gm

    model = _gpt(n_layer=4)
    backend = Backend(inner="eager", passes=[keep_attn_proj_high])
    _train_step(model, backend, torch.randint(0, 64, (2, 32)))
    sites = {s.name: s for s in backend.report.sites}
    assert sites["blocks.1.attn.proj"].precision == "high"
    assert sites["blocks.1.attn.proj"].reason == "user: attention output projections in BF16"
    assert sites["blocks.1.attn.qkv"].precision == "nvfp4"
    dynamo_passes = [g.pass_name for g in backend.report.graphs if g.stage == "dynamo"]
    # user passes run after the built-in policy passes (assign_precision, keep_routers_high)
    assert dynamo_passes.index("keep_attn_proj_high") == dynamo_passes.index("keep_routers_high") + 1


def _graph_after(backend, stage, pass_name):
    return next(g.code for g in backend.report.graphs if g.stage == stage and g.pass_name == pass_name)


@pytest.mark.parametrize(
    "flags, checks",
    [
        ({"rht": False}, {"rht_nodes": 0}),
        ({"stochastic_rounding": False}, {"sr_nodes": 0}),
        ({"weight_2d": False}, {"tiles_16x16": 0}),
        ({"quantize_backward": False}, {"backward_scaled_mm": 0}),
    ],
)
def test_each_recipe_flag_off(flags, checks):
    model = _gpt(n_layer=4)
    backend = Backend(inner="eager", **flags)
    _, loss = _train_step(model, backend, torch.randint(0, 64, (2, 32)))
    assert torch.isfinite(loss)
    fw = _graph_after(backend, "forward", "lower_gemms")
    bw = _graph_after(backend, "backward", "lower_gemms")
    counts = {
        "rht_nodes": bw.count("fp4.rht_quantize.default("),
        "sr_nodes": bw.count("'sr'"),
        "tiles_16x16": (fw + bw).count("'16x16'"),
        "backward_scaled_mm": bw.count("fp4.scaled_mm.default("),
    }
    for key, want in checks.items():
        assert counts[key] == want, (key, counts)
    assert fw.count("fp4.scaled_mm.default(") == 8  # 2 FP4 blocks x 4 linears


def test_default_recipe_node_counts():
    model = _gpt(n_layer=4)
    backend = Backend(inner="eager")
    _train_step(model, backend, torch.randint(0, 64, (2, 32)))
    fw = _graph_after(backend, "forward", "lower_gemms")
    bw = _graph_after(backend, "backward", "lower_gemms")
    assert fw.count("fp4.scaled_mm.default(") == 8 and bw.count("fp4.scaled_mm.default(") == 16
    assert fw.count("fp4.rht_quantize.default(") == 0 and bw.count("fp4.rht_quantize.default(") == 16
    assert fw.count("'sr'") == 0 and bw.count("'sr'") == 16  # dY in dgrad and wgrad of 8 linears
    assert "fp4.gemm.default(" not in fw and "fp4.gemm.default(" not in bw


def test_options_through_torch_compile():
    model = _gpt(n_layer=4)
    compiled = torch.compile(model, backend="nvfp4", options={"fmt": "mxfp4", "inner": "eager"})
    compiled(torch.randint(0, 64, (2, 32)))
    backend = fp4compile.get_backend({"fmt": "mxfp4", "inner": "eager"})
    assert backend.recipe.fmt == "mxfp4"
    assert any(s.precision == "mxfp4" for s in backend.report.sites)
    with pytest.raises(Exception, match="unknown nvfp4 backend options"):
        torch._dynamo.reset()
        torch.compile(_gpt(n_layer=1), backend="nvfp4", options={"fmtt": "x"})(torch.randint(0, 64, (1, 8)))


def test_autocast_bf16_keeps_high_precision_gemms_in_bf16():
    model = _gpt(n_layer=4)
    backend = Backend(inner="eager")
    idx = torch.randint(0, 64, (2, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = torch.compile(model, backend=backend)(idx)
        loss = lm_loss(logits.float(), idx)
    loss.backward()
    assert logits.dtype == torch.bfloat16
    fw = _graph_after(backend, "forward", "lower_gemms")
    assert "torch.bfloat16, 'emulation')" in fw  # FP4 GEMMs write the autocast dtype
    assert model.blocks[1].mlp.fc.weight.grad.dtype == torch.float32


def _saved_activations(model, backend, idx):
    """dtype and shape of every tensor the compiled step saves for its backward that is not a parameter."""
    params = {p.data_ptr() for p in model.parameters()}
    saved = []

    def pack(t):
        if t.data_ptr() not in params:
            saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(torch.compile(model, backend=backend)(idx).float(), idx)
    loss.backward()
    return saved


def test_autocast_activations_enter_fp4_gemms_in_the_autocast_dtype():
    """Under autocast, LayerNorm outputs arrive in float32; an FP4 linear casts them to the autocast dtype
    first, as autocast does for F.linear: they are quantized from, and saved for the backward in, bf16.
    The step then saves no more than the BF16 model does (which also saves bf16 copies of its weights)."""
    idx = torch.randint(0, 64, (2, 32))
    fp4 = _saved_activations(_gpt(n_layer=2), Backend(inner="eager", high_precision_first_blocks=0, high_precision_last_blocks=0), idx)
    torch._dynamo.reset()
    bf16 = _saved_activations(_gpt(n_layer=2), "aot_eager", idx)
    tokens_by_d = {(64, 32), (32, 64)}  # the LayerNorm outputs feeding qkv and fc, either layout
    assert [d for d, shape in fp4 if shape in tokens_by_d and d == torch.float32] == []
    assert sum(shape in tokens_by_d and d == torch.bfloat16 for d, shape in fp4) >= 4  # qkv and fc inputs, 2 blocks

    def nbytes(saved):
        return sum(torch.Size(shape).numel() * torch.empty((), dtype=d).element_size() for d, shape in saved)

    assert nbytes(fp4) <= nbytes(bf16)


def test_switch_to_high_precision_recompiles_once():
    model = _gpt(n_layer=4)
    backend = Backend(inner="eager", switch_to_high_precision_at=2)
    compiled = torch.compile(model, backend=backend)
    idx = torch.randint(0, 64, (2, 32))
    for _ in range(4):
        model.zero_grad()
        lm_loss(compiled(idx), idx).backward()
        backend.step()
    n_contexts = len(backend.report.contexts)
    assert n_contexts == 2  # the FP4 compile and one high-precision recompile
    assert all(s.precision == "high" for s in backend.report.sites)
    assert backend.report.contexts[0].sites[4].precision == "nvfp4"


@pytest.mark.slow
def test_training_loss_decreases_and_tracks_fp32():
    idx_gen = torch.Generator().manual_seed(5)
    data = torch.randint(0, 16, (16, 32), generator=idx_gen)  # a small vocabulary: learnable quickly
    finals = {}
    for precision in ("fp32", "nvfp4"):
        torch._dynamo.reset()
        fp4compile.manual_seed(0)
        model = _gpt(n_layer=4, d=64)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        compiled = torch.compile(model, backend=Backend(inner="eager")) if precision == "nvfp4" else model
        losses = []
        for step in range(30):
            batch = data[(step * 4) % 16:(step * 4) % 16 + 4]
            loss = lm_loss(compiled(batch), batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        finals[precision] = sum(losses[-5:]) / 5
        assert finals[precision] < 0.8 * losses[0], (precision, losses[0], finals[precision])
    assert abs(finals["nvfp4"] - finals["fp32"]) / finals["fp32"] < 0.05, finals


def test_mode_reduce_overhead_configures_cuda_graphs(caplog):
    backend = Backend(mode="reduce-overhead")
    assert backend.inductor_config["triton.cudagraphs"] is True
    assert Backend().inductor_config == {} and Backend(mode="default").inductor_config == {}
    assert fp4compile.get_backend({"seed": 3}, "reduce-overhead").inductor_config["triton.cudagraphs"] is True
    with pytest.raises(ValueError, match="mode='reduce-overhead' is an Inductor mode; it needs inner='inductor'"):
        Backend(mode="reduce-overhead", inner="eager")
    # check_finite reads amax values back to the host: that graph compiles without CUDA graphs, and says so.
    checked = Backend(mode="reduce-overhead", check_finite=True)
    with caplog.at_level("WARNING", logger="fp4compile"):
        assert checked._inductor_config(7)["triton.cudagraphs"] is False
    assert "graph 7: Recipe(check_finite=True)" in caplog.text and "without CUDA graphs" in caplog.text
    assert checked.inductor_config["triton.cudagraphs"] is True  # the backend's own setting is kept



def test_decoded_operands_follow_cuda_graphs_unless_set():
    # Recipe(decoded_operands=None), the default: on where the graphs are recorded in CUDA graphs.
    graphed = Backend(mode="reduce-overhead")
    assert graphed.recipe.decoded_operands is None
    assert graphed._effective_recipe(graphed._inductor_config(0)).decoded_operands is True
    assert Backend()._effective_recipe(Backend()._inductor_config(0)).decoded_operands is False
    assert graphed.resolved_recipe().decoded_operands is True and Backend().resolved_recipe().decoded_operands is False
    assert Backend(decoded_operands=True).resolved_recipe().decoded_operands is True
    # A graph that compiles without CUDA graphs (check_finite) keeps packed operands.
    checked = Backend(mode="reduce-overhead", check_finite=True)
    assert checked._effective_recipe(checked._inductor_config(0)).decoded_operands is False
    # Inductor's global setting counts where the backend's mode does not set it.
    from torch._inductor import config as inductor_config

    with inductor_config.patch({"triton.cudagraphs": True}):
        assert Backend()._effective_recipe(Backend()._inductor_config(0)).decoded_operands is True
        assert Backend(inner="eager")._effective_recipe({}).decoded_operands is False
    # An explicit choice is kept either way.
    for mode in (None, "reduce-overhead"):
        for value in (True, False):
            backend = Backend(mode=mode, decoded_operands=value)
            assert backend._effective_recipe(backend._inductor_config(0)).decoded_operands is value


@pytest.mark.slow
def test_fuse_amax_of_bf16_operands_through_inductor_keeps_the_bits(monkeypatch):
    """Under autocast each X is a bf16 tensor (LayerNorm's output cast, GELU's output): ``fuse_amax``
    (forced here on the CPU) gives its quantizer the amax of its stored bits, a reduction Inductor fuses
    into the producer's kernel, and the step keeps the bits of each quantizer's own amax pass (no RHT:
    with it, X's amaxes come from one fp4.wgrad_amax read instead). The CPU's generated code rounds a
    fused bf16 value where Triton's does not, so the hazard the bitcast avoids shows only on a GPU
    (``test_gpu_fuse_amax_keeps_the_bits``); here the nodes compile and keep the bits."""
    from fp4compile import vocabulary
    from fp4compile.passes import fuse_amax as amax_module

    from models import NormMLP

    torch.manual_seed(0)
    state = NormMLP(64).state_dict()
    x = torch.randn(2, 32, 64) * 3
    results, sources = [], []
    for forced in (False, True):
        torch._dynamo.reset()
        if forced:
            monkeypatch.setattr(amax_module, "applies", lambda node: True)
            monkeypatch.setattr(vocabulary, "separate_amax_costs_a_read", lambda val: True)
        fp4compile.manual_seed(3)
        model = NormMLP(64)
        model.load_state_dict(state)
        backend = Backend(high_precision_first_blocks=0, high_precision_last_blocks=0, rht=False)
        xd = x.clone().requires_grad_()
        with torch.autocast("cpu", torch.bfloat16):
            y = torch.compile(model, backend=backend)(xd)
        y.float().square().sum().backward()
        results.append([y.detach(), xd.grad] + [p.grad for p in model.parameters()])
        forward = backend.report.graph("forward", "fuse_amax")
        sources.append((forward.count("aten.bitwise_and.Scalar("), forward.count("aten.amax.default(")))
    assert sources == [(0, 0), (2, 2)]  # forced: both X operands (bf16) take the bit-pattern amax
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_fuse_amax_through_inductor_keeps_the_bits(monkeypatch):
    """The amax nodes ``fuse_amax`` adds (applied on CUDA; forced here on the CPU) compile with Inductor and
    give the training step the bits it has with each quantizer's own amax pass."""
    from fp4compile.passes import fuse_amax as amax_module

    idx = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(4))
    results = []
    for forced in (False, True):
        torch._dynamo.reset()
        if forced:
            monkeypatch.setattr(amax_module, "applies", lambda node: True)
        fp4compile.manual_seed(11)
        model = _gpt(n_layer=4)
        backend = Backend()
        logits, loss = _train_step(model, backend, idx)
        sources = [s for gr in backend.report.graphs if gr.pass_name == "fuse_amax" for s in [gr.code.count("wgrad_amax.default(")]]
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        results.append((logits.detach(), grads, sum(sources)))
    (l0, g0, shared0), (l1, g1, shared1) = results
    assert shared0 == 0 and shared1 > 0
    assert torch.equal(l0, l1)
    # The embedding gradient is a scatter-add whose summation order follows Inductor's kernel choice,
    # which the new nodes may change: equal to fp32 rounding. Every other gradient keeps its bits.
    torch.testing.assert_close(g1.pop("tok_emb.weight"), g0.pop("tok_emb.weight"), rtol=1e-6, atol=1e-9)
    assert g0.keys() == g1.keys()
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name
