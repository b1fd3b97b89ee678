"""FSDP2 all-gathering FP4 weights (``fp4compile.enable_fp4_all_gather``).

Fast tests: the sharded weight's pre/post all-gather round trip against ``fp4.quantize`` of the full
weight, the ops FSDP2 and the optimizer run on the sharded weight, the plan of which weights gather in FP4,
and the error where something other than an FP4 GEMM reads a gathered weight. Slow tests: one spawn of
2 gloo processes (and one of 1) runs every scenario with and without FP4 gathering; the bits must match.
"""

from __future__ import annotations

import io
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from fp4compile import Backend, fsdp
from fp4compile.fsdp import FP4GatheredWeight, FP4ShardedWeight, enable_fp4_all_gather
import gloo
from models import MLPStack

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

D = 32
BATCH, TOKENS = 4, 16
STEPS = 3


def _backend(**changes) -> Backend:
    fields = dict(inner="eager", high_precision_first_blocks=1, high_precision_last_blocks=1)
    return Backend(**{**fields, **changes})


# ---------------------------------------------------------------------------------------------
# Fast: one process
# ---------------------------------------------------------------------------------------------


class _Mesh:
    """What fsdp_pre_all_gather reads of the shard mesh."""

    ndim = 1

    def __init__(self, world: int):
        self.world = world

    def size(self, dim: int = 0) -> int:
        return self.world


class _Policy:
    def __init__(self, param_dtype=None):
        self.param_dtype = param_dtype


def _sharded(w: torch.Tensor, name: str = "layers.1.fc", rule: str = "6") -> FP4ShardedWeight:
    spec = fsdp._WeightSpec(name, _backend(), lambda: None, fsdp.GatherStats(), rule)
    return FP4ShardedWeight(w, spec)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_pre_and_post_all_gather_give_the_full_weights_quantization(monkeypatch, world, param_dtype):
    """Each shard quantized with the global amax, gathered, is bit for bit fp4.quantize(W, "nvfp4",
    "16x16", "rne") of the whole weight (cast to the gather dtype, as the graph would have read it)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(128, 64, generator=g) * torch.logspace(-2, 1, 128)[:, None]  # shards' amaxes differ
    full = w.to(param_dtype or w.dtype)
    monkeypatch.setattr(fsdp, "_global_amax", lambda x, mesh: full.float().abs().amax())
    packed, metadata = [], None
    for shard in _sharded(w).chunk(world):
        assert isinstance(shard, FP4ShardedWeight)
        (part,), metadata = shard.fsdp_pre_all_gather(_Mesh(world), w.shape, w.stride(), None, _Policy(param_dtype))
        assert part.dtype == torch.uint8 and part.shape == (128 // world, 64 // 2 + 64 // 16)
        packed.append(part)
    gathered, inner = _sharded(w).fsdp_post_all_gather((torch.cat(packed),), metadata, param_dtype or w.dtype)
    assert isinstance(gathered, FP4GatheredWeight)
    assert gathered.shape == w.shape and gathered.dtype == (param_dtype or w.dtype)
    codes, scales, amax = torch.ops.fp4.quantize(full, "nvfp4", "16x16", "rne", 0, "")
    assert torch.equal(gathered._codes, codes) and torch.equal(gathered._scales, scales)
    assert torch.equal(gathered._amax, amax)
    assert all(t.is_contiguous() for t in inner)
    # FSDP2's later all-gathers write into the same unsharded parameter (``out=``).
    monkeypatch.setattr(fsdp, "_global_amax", lambda x, mesh: (2 * full).float().abs().amax())
    (part,), metadata2 = _sharded(w * 2).fsdp_pre_all_gather(_Mesh(1), w.shape, w.stride(), None, _Policy(param_dtype))
    _sharded(w).fsdp_post_all_gather((part,), metadata2, param_dtype or w.dtype, out=gathered)
    codes2, scales2, amax2 = torch.ops.fp4.quantize(2 * full, "nvfp4", "16x16", "rne", 0, "")
    assert torch.equal(gathered._codes, codes2) and torch.equal(gathered._scales, scales2)
    assert torch.equal(gathered._amax, amax2)


def test_shards_that_split_a_tile_gather_in_high_precision(monkeypatch):
    """A 48-row weight over 2 ranks: 24 rows each, half a tile; it gathers in the gather dtype, padded to
    FSDP2's shard size, with the reason given once."""
    w = torch.randn(48, 32)
    backend = _backend()
    spec = fsdp._WeightSpec("layers.1.out", backend, lambda: None, fsdp.GatherStats())
    shard = FP4ShardedWeight(w, spec).chunk(2)[1]
    with pytest.warns(UserWarning, match="layers.1.out: gathers its weight in high precision.*multiple of 16 x 2"):
        (part,), metadata = shard.fsdp_pre_all_gather(_Mesh(2), w.shape, w.stride(), None, _Policy(torch.bfloat16))
    assert metadata == ("high",) and part.dtype == torch.bfloat16 and torch.equal(part, w[24:].bfloat16())
    assert spec.stats.modes == {"layers.1.out": "high"}
    assert "multiple of 16 x 2 = 32" in "\n".join(spec.stats.lines())
    assert any("layers.1.out" in line for line in backend.report.warnings)


def test_the_sharded_weight_is_the_master_weight_for_every_op():
    """FSDP2's sharding ops keep the type (and the all-gather extension); values, in-place updates,
    the optimizer and pickling see the plain master weight."""
    w = torch.randn(64, 32)
    p = nn.Parameter(_sharded(w.clone()))
    assert isinstance(p, FP4ShardedWeight) and isinstance(p, nn.Parameter)
    for piece in (*p.chunk(2), p.narrow(0, 0, 16), p.view(-1), p.detach(), p.new_zeros((8, 32))):
        assert isinstance(piece, FP4ShardedWeight) and hasattr(piece, "fsdp_pre_all_gather")
    assert torch.equal(p.chunk(2)[1]._data, w[32:])
    total = p * 2 + 1
    assert type(total) is torch.Tensor and torch.equal(total, w * 2 + 1)
    plain = nn.Parameter(w.clone())
    for q in (p, plain):
        q.grad = torch.ones_like(w)
        opt = torch.optim.AdamW([q], lr=0.1)
        opt.step()
    assert torch.equal(p._data, plain.detach())
    buffer = io.BytesIO()
    torch.save({"w": p.detach()}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["w"]
    assert type(loaded) is torch.Tensor and torch.equal(loaded, plain.detach())


def test_enable_wraps_the_weights_the_plan_puts_in_nvfp4():
    torch.manual_seed(0)
    model = MLPStack(4, d=D)
    model.layers[2].out = nn.Linear(4 * D, D + 8)  # features not multiples of 16
    backend = _backend()
    stats = enable_fp4_all_gather(model, backend=backend)
    assert stats.planned == ["layers.1.fc", "layers.1.out", "layers.2.fc"]
    for name in stats.planned:
        assert isinstance(model.get_submodule(name).weight, FP4ShardedWeight)
    assert type(model.layers[0].fc.weight) is nn.Parameter and type(model.head.weight) is nn.Parameter
    assert stats.reasons["layers.0.fc"] == "the plan keeps it high: first 1 of 4 blocks"
    assert stats.reasons["layers.3.out"] == "the plan keeps it high: last 1 of 4 blocks"
    assert stats.reasons["head"] == "the plan keeps it high: outside the repeated blocks"
    assert "not multiples of 16" in stats.reasons["layers.2.out"]
    assert any("layers.2.out" in w for w in backend.report.warnings)
    # MXFP4 has no 16x16 weight tiles: nothing gathers in FP4.
    model = MLPStack(4, d=D)
    assert enable_fp4_all_gather(model, backend=_backend(fmt="mxfp4")).planned == []


def test_a_gathered_weight_is_read_only_by_fp4_gemms():
    w = torch.randn(32, 32)
    codes, scales, amax = torch.ops.fp4.quantize(w, "nvfp4", "16x16", "rne", 0, "")
    gathered = FP4GatheredWeight(codes, scales, amax, w.shape, w.dtype, ("layers.1.fc", "6", False))
    with pytest.raises(RuntimeError, match="weight of layers.1.fc was all-gathered in FP4.*not by an NVFP4 GEMM"):
        torch.nn.functional.linear(torch.randn(4, 32), gathered)
    # The GEMM route: fprop reads W, with the gathered codes handed over as the quantized weight.
    x = torch.randn(16, 32)
    y = torch.ops.fp4.gemm(x, gathered, "fprop", 0, torch.float32)
    want = x @ torch.ops.fp4.dequantize(codes, scales, amax, "nvfp4", "16x16", torch.float32).t()
    assert torch.equal(y, want)
    with pytest.raises(RuntimeError, match="read transposed by a fprop GEMM"):
        torch.ops.fp4.gemm(x, gathered.t(), "fprop", 0, torch.float32)


# ---------------------------------------------------------------------------------------------
# Slow: 2 gloo processes (and 1) with fully_shard, compiled, AdamW
# ---------------------------------------------------------------------------------------------

LAYOUTS = {  # name: (compile style, reshard_after_forward)
    "whole": ("whole", True),
    "whole_keep_unsharded": ("whole", False),
    "per_block": ("block", True),
    "checkpointed": ("ac", True),
}


def _batch(step: int, rank: int, world: int, d: int) -> torch.Tensor:
    x = torch.randn(BATCH, TOKENS, d, generator=torch.Generator().manual_seed(10 + step))
    per = BATCH // world
    return x[rank * per:(rank + 1) * per]


def _sharded_model(fp4: bool, style: str, reshard: bool, d: int = D, backend=None):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MLPStack(4, d=d)
    backend = backend or _backend(model=model if style == "block" else None)
    if fp4:
        enable_fp4_all_gather(model, backend=backend)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for i, layer in enumerate(model.layers):
        if style == "ac":
            layer = model.layers[i] = checkpoint_wrapper(layer)
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        if style == "block":
            layer.compile(backend=backend)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    run = model if style == "block" else torch.compile(model, backend=backend)
    return model, run, backend


class _CountGathers:
    """Bytes FSDP2's all-gathers put in each rank's output buffers (what the collectives carry)."""

    def __init__(self):
        self.bytes = 0
        self.original = dist.all_gather_single

    def __enter__(self):
        def counted(output_tensor, input_tensor, *args, **kwargs):
            self.bytes += output_tensor.numel() * output_tensor.element_size()
            return self.original(output_tensor, input_tensor, *args, **kwargs)

        dist.all_gather_single = counted
        return self

    def __exit__(self, *exc):
        dist.all_gather_single = self.original


def _train(rank, fp4, style="whole", reshard=True, d=D, switch_at=None, steps=STEPS, count=False):
    model, run, backend = _sharded_model(fp4, style, reshard, d)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    world = dist.get_world_size()
    out = {"losses": [], "grads": [], "step_bytes": []}
    for step in range(steps):
        if switch_at is not None and step == switch_at:
            backend.switch_to_high_precision()
        with _CountGathers() as counter:
            loss = run(_batch(step, rank, world, d)).square().mean()
            loss.backward()
        out["step_bytes"].append(counter.bytes)
        out["losses"].append(loss.detach().clone())
        out["grads"].append({n: p.grad.full_tensor().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    out["weights"] = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    stats = backend.report.all_gather
    out["report"] = backend.report.precision_table()
    out["warnings"] = list(backend.report.warnings)
    if stats is not None:
        out["modes"], out["per_gather"] = dict(stats.modes), dict(stats.per_gather)
        out["stats_step"], out["reasons"] = stats.step_bytes(), dict(stats.reasons)
    out["sites"] = {s.name: s.precision for s in backend.report.sites}
    out["model"] = (model, opt, run)
    return out


def _checkpoint(rank: int, ckpt_dir: str) -> dict:
    """DCP save of the FP4-gathering model after its steps; loads into a plain sharded model and into an
    FP4-gathering one; both continue like the original."""
    import torch.distributed.checkpoint as dcp

    got = _train(rank, True)
    model, opt, run = got["model"]
    state = model.state_dict()
    local_types = sorted({type(v._local_tensor).__name__ for v in state.values()})
    dcp.save(state, checkpoint_id=ckpt_dir)
    buffer = io.BytesIO()
    torch.save({k: v._local_tensor for k, v in state.items()}, buffer)
    buffer.seek(0)
    pickled_types = sorted({type(v).__name__ for v in torch.load(buffer, weights_only=True).values()})
    out = {"local_types": local_types, "pickled_types": pickled_types, "saved": got["weights"]}
    x = _batch(STEPS, rank, dist.get_world_size(), D)
    out["continued"] = run(x).detach().clone()
    for fp4 in (False, True):
        fresh, fresh_run, _ = _sharded_model(fp4, "whole", True)
        fresh_state = fresh.state_dict()
        dcp.load(fresh_state, checkpoint_id=ckpt_dir)
        fresh.load_state_dict(fresh_state)
        out[f"loaded_{fp4}"] = {n: p.full_tensor().clone() for n, p in fresh.named_parameters()}
        out[f"continued_{fp4}"] = fresh_run(x).detach().clone()
    return out


def _strip(result: dict) -> dict:
    result.pop("model", None)
    return result


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    gloo.init(rank, world, port)
    try:
        results = {}
        layouts = LAYOUTS if world > 1 else {"whole": LAYOUTS["whole"]}
        for name, (style, reshard) in layouts.items():
            results[name] = [_strip(_train(rank, fp4, style, reshard)) for fp4 in (False, True)]
        if world > 1:
            results["unaligned"] = [_strip(_train(rank, fp4, d=16)) for fp4 in (False, True)]
            results["switch"] = [_strip(_train(rank, fp4, switch_at=2, steps=4)) for fp4 in (False, True)]
            results["checkpoint"] = _checkpoint(rank, os.path.join(out_dir, "ckpt"))
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _spawn(world: int, out_dir) -> list:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    mp.spawn(_worker, args=(world, gloo.free_port(), str(out_dir)), nprocs=world, join=True)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _spawn(2, tmp_path_factory.mktemp("fsdp_fp4_2"))


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return _spawn(1, tmp_path_factory.mktemp("fsdp_fp4_1"))


def _assert_same_bits(plain: dict, fp4: dict) -> None:
    assert len(plain["losses"]) == len(fp4["losses"])
    for a, b in zip(plain["losses"], fp4["losses"]):
        assert torch.equal(a, b)
    for ga, gb in zip(plain["grads"], fp4["grads"]):
        assert ga.keys() == gb.keys()
        for name in ga:
            assert torch.equal(ga[name], gb[name]), name
    for name in plain["weights"]:
        assert torch.equal(plain["weights"][name], fp4["weights"][name]), name


FP4_WEIGHTS = ["layers.1.fc", "layers.1.out", "layers.2.fc", "layers.2.out"]


@pytest.mark.slow  # starts two processes
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp4_gathering_keeps_the_bits(two_ranks, layout):
    """Losses, gradients and weights after 3 AdamW steps equal those of the same run without FP4
    gathering, bit for bit, on each rank: whole-model and per-block compile, activation checkpointing,
    reshard_after_forward True and False."""
    for rank in two_ranks:
        plain, fp4 = rank[layout]
        _assert_same_bits(plain, fp4)
        assert fp4["modes"] == {name: "nvfp4" for name in FP4_WEIGHTS}
        assert {n for n, p in fp4["sites"].items() if p == "nvfp4"} == set(FP4_WEIGHTS)
        assert fp4["sites"] == plain["sites"]


@pytest.mark.slow
def test_fp4_gathering_keeps_the_bits_on_one_rank(one_rank):
    plain, fp4 = one_rank[0]["whole"]
    _assert_same_bits(plain, fp4)
    assert fp4["modes"] == {name: "nvfp4" for name in FP4_WEIGHTS}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["whole", "whole_keep_unsharded"])
def test_bytes_gathered_per_step(two_ranks, layout):
    """What the all-gathers carry per step: each FP4 weight's codes and scales (0.5625 bytes per element)
    instead of its fp32 values (4 bytes), once per forward and, resharded after it, once per backward; the
    report counts the same."""
    gathers = 2 if LAYOUTS[layout][1] else 1
    elements = 4 * D * D
    fp4_bytes = elements // 2 + elements // 16
    saved = len(FP4_WEIGHTS) * (elements * 4 - fp4_bytes)
    for rank in two_ranks:
        plain, fp4 = rank[layout]
        for step in range(1, STEPS):  # the first step's backward is the same; later steps too
            assert plain["step_bytes"][step] - fp4["step_bytes"][step] == saved * gathers
        assert fp4["per_gather"] == {name: fp4_bytes for name in FP4_WEIGHTS}
        assert fp4["stats_step"] == {"nvfp4": len(FP4_WEIGHTS) * fp4_bytes * gathers, "high": 0}
        assert f"per step {len(FP4_WEIGHTS) * fp4_bytes * gathers} bytes FP4, 0 bytes high precision" in fp4["report"]
        assert "all-gather FP4: layers.1.fc (2304 bytes per gather)" in fp4["report"]


@pytest.mark.slow
def test_unaligned_shard_gathers_in_high_precision(two_ranks):
    """d = 16: the out layers' 16 rows split into 8-row shards, half a tile: they gather in high precision
    with the reason (warning and report); the fc layers (64 rows) gather in FP4; the bits hold."""
    for rank in two_ranks:
        plain, fp4 = rank["unaligned"]
        _assert_same_bits(plain, fp4)
        assert fp4["modes"] == {"layers.1.fc": "nvfp4", "layers.2.fc": "nvfp4", "layers.1.out": "high",
                                "layers.2.out": "high"}
        reason = fp4["reasons"]["layers.1.out"]
        assert "16 rows do not split into 2 shards of whole 16-row tiles" in reason
        assert any(w.startswith("layers.1.out: gathers its weight in high precision") for w in fp4["warnings"])
        assert f"all-gather high: layers.1.out (4096 bytes per gather): {reason}" in fp4["report"]


@pytest.mark.slow
def test_switch_to_high_precision_gathers_in_high_precision(two_ranks):
    """After Backend.switch_to_high_precision (before step 2 of 4) every weight gathers in high precision
    again; the run equals the same run without FP4 gathering, bit for bit."""
    for rank in two_ranks:
        plain, fp4 = rank["switch"]
        _assert_same_bits(plain, fp4)
        assert fp4["modes"] == {name: "high" for name in FP4_WEIGHTS}
        assert fp4["reasons"]["layers.1.fc"] == "the backend switched to high precision"
        assert all(p == "high" for p in fp4["sites"].values())
        assert fp4["step_bytes"][:2] != plain["step_bytes"][:2]
        assert fp4["step_bytes"][2:] == plain["step_bytes"][2:]


@pytest.mark.slow
def test_checkpoints_hold_the_master_weights(two_ranks):
    """The sharded state dict holds the master weights; pickled, they are plain tensors; a DCP checkpoint
    loads into a sharded model with or without FP4 gathering, and both continue like the original."""
    for rank in two_ranks:
        got = rank["checkpoint"]
        assert got["local_types"] == ["FP4ShardedWeight", "Tensor"]
        assert got["pickled_types"] == ["Tensor"]
        for fp4 in (False, True):
            loaded = got[f"loaded_{fp4}"]
            assert loaded.keys() == got["saved"].keys()
            for name in loaded:
                assert torch.equal(loaded[name], got["saved"][name]), name
            assert torch.equal(got[f"continued_{fp4}"], got["continued"])
