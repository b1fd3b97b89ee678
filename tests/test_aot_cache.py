"""AOTAutograd's on-disk cache for graphs with FP4 linears (fp4compile.aot_cache).

Each test compiles a small GPT with Inductor's FX graph cache and AOTAutograd's cache on, in a cache
directory of its own, resetting dynamo between compiles as a new process would start."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fp4compile
from fp4compile import Backend, Recipe, aot_cache, config, distributed
from fp4compile.passes import pipeline
from fp4compile.sites import CompileContext, GemmSite
from models import TinyGPT, grads, lm_loss

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

IDX = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def caches(monkeypatch, tmp_path):
    """Both on-disk caches on, in a directory of the test's own (through the config modules' own patch:
    monkeypatch's undo would delete their entries for later tests)."""
    from torch._inductor import config as inductor_config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    with inductor_config.patch(fx_graph_cache=True), torch._functorch.config.patch(enable_autograd_cache=True), \
            config.patch(aot_cache=True, print_ir_after=""):
        yield tmp_path


def start(backend: Backend):
    """One training step of a fresh model compiled by ``backend``, as a new process would run it:
    (logits, gradients, AOTAutograd's cache counters)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    fp4compile.manual_seed(0)
    torch.manual_seed(0)
    model = TinyGPT(n_layer=3)
    logits = torch.compile(model, backend=backend)(IDX)
    lm_loss(logits, IDX).backward()
    return logits.detach(), grads(model), dict(counters["aot_autograd"])


def backward_code(backend: Backend) -> str:
    (code,) = [g.code for g in backend.report.graphs if g.stage == "backward" and g.pass_name == "fuse_amax"]
    return code


def test_a_second_start_is_served_from_the_cache_with_the_same_bits_and_report(caches):
    cold = Backend()
    logits0, grads0, counts0 = start(cold)
    assert counts0.get("autograd_cache_saved") == 1 and not counts0.get("autograd_cache_hit")
    assert not cold.report.contexts[0].from_cache

    warm = Backend()
    logits1, grads1, counts1 = start(warm)
    assert counts1.get("autograd_cache_hit") == 1
    ctx = warm.report.contexts[0]
    assert ctx.from_cache and ctx.graphs and all(g.stage == "dynamo" for g in ctx.graphs)  # no aot pass ran

    # The cached graphs compute the same bits (SR included: same seed) ... but for the token embedding's
    # gradient, which Inductor's CPU code accumulates with atomic adds across threads (its last bits
    # differ between any two runs of one compiled graph).
    assert torch.equal(logits0, logits1)
    torch.testing.assert_close(grads1.pop("tok_emb.weight"), grads0.pop("tok_emb.weight"), rtol=1e-6, atol=1e-9)
    assert grads0.keys() == grads1.keys()
    assert [k for k in grads0 if not torch.equal(grads0[k], grads1[k])] == []
    # ... and the report, read (here under no_grad, which the rebuild must not take for the compile's
    # mode), rebuilds the passes' graphs and the GEMMs' roles as the cold start made them.
    with torch.no_grad():
        rebuilt = [(g.stage, g.pass_name, g.code) for g in warm.report.graphs]
    assert rebuilt == [(g.stage, g.pass_name, g.code) for g in cold.report.graphs]
    assert [(s.name, s.precision, s.roles) for s in warm.report.sites] == [
        (s.name, s.precision, s.roles) for s in cold.report.sites
    ]
    assert "fp4.rht_quantize" in backward_code(warm)
    assert warm.report.summary() == cold.report.summary()


@pytest.fixture
def one_rank():
    """torch.distributed on one process (gloo), for sharded-amax declarations."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        distributed.clear()
        dist.destroy_process_group()


def test_another_recipe_or_sharding_is_never_served_the_graphs_of_the_first(caches, one_rank):
    """The dynamo graph is the same in all three starts (on the CPU no X amax is shared, so RHT and
    sharding show only in the forward and backward graphs); the cache's key holds the recipe and the
    sharded-amax declarations, so a start with RHT off, or with dY's amax reduced across ranks, compiles
    its own graphs, and the same declaration again is served."""
    start(Backend())
    no_rht = Backend(rht=False)
    _, _, counts = start(no_rht)
    assert counts.get("autograd_cache_miss") == 1 and not counts.get("autograd_cache_hit")
    assert "fp4.rht_quantize" not in backward_code(no_rht) and "fp4.quantize" in backward_code(no_rht)

    distributed.shard_amax("*", tensors=("dY",))
    sharded = Backend()
    _, _, counts = start(sharded)
    assert counts.get("autograd_cache_miss") == 1 and not counts.get("autograd_cache_hit")
    assert "fp4.quantize_sharded" in backward_code(sharded)
    again = Backend()
    _, _, counts = start(again)
    assert counts.get("autograd_cache_hit") == 1 and "fp4.quantize_sharded" in backward_code(again)


def test_the_backward_uses_the_declarations_its_forward_was_compiled_with(one_rank):
    """The backward compiles at the first backward: a declaration made for the forward's compile (the
    ``with`` block) holds for it, and one made after the forward's compile does not."""
    torch.manual_seed(0)
    model = TinyGPT(n_layer=3)
    backend = Backend()
    compiled = torch.compile(model, backend=backend)
    with distributed.sharded_amax("*", tensors=("dY",)):
        logits = compiled(IDX)
    lm_loss(logits, IDX).backward()
    assert "fp4.quantize_sharded" in backward_code(backend)

    torch._dynamo.reset()
    backend = Backend()
    logits = torch.compile(TinyGPT(n_layer=3), backend=backend)(IDX)
    with distributed.sharded_amax("*", tensors=("dY",)):
        lm_loss(logits, IDX).backward()
    assert "fp4.quantize_sharded" not in backward_code(backend)


def _aot_fallback(gm, ctx):
    """An aot-level pass logging a fallback, as ``plan_gemm_roles`` does for a dynamic K."""
    site = next(s for s in ctx.sites if s.is_low_precision)
    stage = "backward" if any(n.name.startswith("tangents") for n in gm.graph.nodes if n.op == "placeholder") else "forward"
    ctx.fallback(site, "wgrad", f"test reason in the {stage} graph")
    return gm


def test_what_the_passes_logged_is_logged_again_on_a_hit(caches, monkeypatch, caplog):
    monkeypatch.setattr(pipeline, "AOT_PASSES", [*pipeline.AOT_PASSES, _aot_fallback])
    with caplog.at_level("WARNING", logger="fp4compile"):
        start(Backend())
    cold_messages = [r.getMessage() for r in caplog.records if "test reason" in r.getMessage()]
    assert len(cold_messages) == 2  # forward and backward

    caplog.clear()
    warm = Backend()
    with caplog.at_level("WARNING", logger="fp4compile"):
        _, _, counts = start(warm)
    assert counts.get("autograd_cache_hit") == 1
    assert [r.getMessage() for r in caplog.records if "test reason" in r.getMessage()] == cold_messages
    caplog.clear()
    with caplog.at_level("WARNING", logger="fp4compile"):
        fallbacks = warm.report.fallbacks  # the rebuild: recorded in the report, not logged a third time
    assert sum("test reason" in f for f in fallbacks) == 2 and "test reason" not in caplog.text


def test_a_hit_without_its_record_runs_the_passes_again_at_once(caches, caplog):
    start(Backend())
    records = list((caches / "fp4compile_aot").glob("*.json"))
    assert len(records) == 1
    records[0].unlink()
    warm = Backend()
    with caplog.at_level("INFO", logger="fp4compile"):
        _, _, counts = start(warm)
    assert counts.get("autograd_cache_hit") == 1
    assert "no record of what its passes logged" in caplog.text
    ctx = warm.report.contexts[0]
    assert ctx._rebuild is None and {g.stage for g in ctx.graphs} == {"dynamo", "forward", "backward"}


@pytest.mark.parametrize("switch", ["config", "print_ir_after"])
def test_graphs_stay_out_of_the_cache_when_switched_off_or_printed(caches, switch, capsys):
    def backend():
        return Backend() if switch == "config" else Backend(print_ir_after="fuse_amax")

    with config.patch(aot_cache=switch != "config"):
        start(backend())
        warm = backend()
        _, _, counts = start(warm)
    assert not counts.get("autograd_cache_hit") and counts.get("autograd_cache_bypass") == 1
    assert not warm.report.contexts[0].from_cache
    if switch == "print_ir_after":
        assert capsys.readouterr().out.count("after fuse_amax") == 4  # forward and backward, both starts


def _context(**recipe) -> CompileContext:
    ctx = CompileContext(Recipe(**recipe), 0)
    ctx.sites = [GemmSite(0, "blocks.1.mlp.fc", "linear", "Linear", 32, 128, (2, 32, 32), True, "fc", precision="nvfp4")]
    ctx.n_blocks, ctx.block_names = 3, ["blocks.0", "blocks.1", "blocks.2"]
    return ctx


def test_the_key_covers_recipe_sites_passes_settings_and_sharded_amax(monkeypatch):
    inputs = [torch.zeros(2, 32)]
    base = aot_cache.digest(_context(), inputs)
    assert aot_cache.digest(_context(), inputs) == base  # stable
    assert aot_cache.digest(_context(rht=False), inputs) != base
    high = _context()
    high.sites[0] = dataclasses.replace(high.sites[0], precision="high")
    assert aot_cache.digest(high, inputs) != base
    assert aot_cache.digest(_context(), inputs, grad_buffers=["logits"]) != base
    assert aot_cache.digest(_context(), [torch.zeros(2, 32, dtype=torch.bfloat16, device="meta")]) != base
    changed = dict(check_finite=True, emulated_gemm="torch")
    assert set(changed) == set(config.SETTINGS) - set(aot_cache.RUNTIME_ONLY_SETTINGS)  # every other setting
    for name, value in changed.items():
        with config.patch(**{name: value}):
            assert aot_cache.digest(_context(), inputs) != base, name
    monkeypatch.setattr(pipeline, "AOT_PASSES", [*pipeline.AOT_PASSES, _aot_fallback])  # another pipeline
    assert aot_cache.digest(_context(), inputs) != base
    monkeypatch.undo()
    distributed._rules.append(distributed.ShardedAmax("blocks.*", frozenset({"W"}), "0"))
    try:
        sharded = _context()  # the declarations as the compilation starts
    finally:
        distributed.clear()
    assert aot_cache.digest(sharded, inputs) != base
    assert aot_cache.digest(_context(), inputs) == base
    runtime_only = dict(aot_cache=False, cache_dir="elsewhere", nvcc="nvcc", compile_gc_threshold=1, precompile="off",
                        precompile_threads=1, print_ir_after="all")
    assert set(runtime_only) == set(aot_cache.RUNTIME_ONLY_SETTINGS)
    with config.patch(**runtime_only):  # how things compile, not what: left out
        assert aot_cache.digest(_context(), inputs) == base


def test_config_patches_mark_fp4compile_functions_and_keep_others():
    from torch._inductor import config as inductor_config

    with inductor_config.patch(unsafe_marked_cacheable_functions={"mylib.fn": "v1"}):
        patches = aot_cache.config_patches("k", {"triton.cudagraphs": True})
    assert patches["triton.cudagraphs"] is True
    assert patches["unsafe_marked_cacheable_functions"] == {
        "mylib.fn": "v1", "fp4compile.ops.fp4_linear": "k", "fp4compile.ops.fp4_matmul": "k",
    }
    assert {f"{f.__module__}.{f.__name__}" for f in (fp4compile.ops.linear, fp4compile.ops.matmul)} == set(
        aot_cache.FUNCTIONS
    )


@config.patch(aot_cache=True, print_ir_after="")
def test_enabled_by_default_and_off_by_switch():
    assert aot_cache.enabled() == (True, "")
    assert aot_cache.enabled(print_ir_after="dynamo_only_name")[0]  # no aot-level pass printed
    assert not aot_cache.enabled(print_ir_after="all")[0]
    with config.patch(print_ir_after="lower_scaled_mm"):
        assert not aot_cache.enabled()[0]
    with config.patch(aot_cache=False):
        assert aot_cache.enabled() == (False, "fp4compile.config.aot_cache is off (FP4COMPILE_AOT_CACHE=0)")


@pytest.mark.gpu
def test_a_warm_start_under_cuda_graphs_replays_the_same_bits(caches):
    """On a GPU, with the step recorded in CUDA graphs (decoded operands, unused-gradient buffers, SR
    from the device's stream): the warm start is served from the cache and its steps give the cold
    start's losses and gradients."""
    from torch._dynamo.utils import counters

    from models import GPTWithLoss

    torch.manual_seed(0)
    state = GPTWithLoss().state_dict()
    idx = torch.randint(0, 512, (4, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(0))

    def run():
        torch._dynamo.reset()
        counters.clear()
        fp4compile.manual_seed(7)
        model = GPTWithLoss().cuda()
        model.load_state_dict(state)
        compiled = torch.compile(model, backend=Backend(mode="reduce-overhead", high_precision_first_blocks=0,
                                                        high_precision_last_blocks=0))
        steps = []
        for _ in range(3):
            torch.compiler.cudagraph_mark_step_begin()
            _, loss = compiled(idx)
            loss.backward()
            steps.append((loss.detach().clone(), grads(model)))
            model.zero_grad(set_to_none=True)
        return steps, dict(counters["aot_autograd"])

    cold, _ = run()
    warm, counts = run()
    assert counts.get("autograd_cache_hit") == 1
    for (loss0, g0), (loss1, g1) in zip(cold, warm):
        assert torch.equal(loss0, loss1)
        # CUDA's embedding backward accumulates with atomics: its last bits differ between any two runs.
        torch.testing.assert_close(g1.pop("gpt.tok_emb.weight"), g0.pop("gpt.tok_emb.weight"), rtol=1e-5, atol=1e-7)
        assert g0.keys() == g1.keys() and all(torch.equal(g0[k], g1[k]) for k in g0)
