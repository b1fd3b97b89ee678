"""The recipe holds in the layouts and the state handling that large-scale training uses.

A backend reused for a second run, dynamic shapes in the report, export into a folder that holds an
earlier export, serving a model compiled block by block, models built on the meta device and the
backend's state through ``torch.distributed.checkpoint``. Each ends with the recipe's plan, the
numbers of the uncompiled (or the normally built) model where the plan says so, and no crash. Tiny
models, the eager inner compiler, on the CPU.
"""

from __future__ import annotations

import pytest
import torch

import fp4compile
from fp4compile import Backend
from models import MLPStack, grads

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

D = 16


def _all_fp4(**kw) -> dict:
    """Backend settings with every GEMM in FP4 (no first/last blocks, nor the layers outside them, kept
    in high precision), the eager inner compiler."""
    return {"high_precision_first_blocks": 0, "high_precision_last_blocks": 0,
            "high_precision_outside_blocks": False, "inner": "eager", **kw}


def _x(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _stack(n_blocks=1) -> MLPStack:
    torch.manual_seed(0)
    return MLPStack(n_blocks, d=D)


def _step(compiled, seed=100):
    compiled(_x(2, 16, D, seed=seed)).square().mean().backward()


# ---------------------------------------------------------------------------------------------
# Seeding with a reused backend
# ---------------------------------------------------------------------------------------------


def _run(backend, torch_seed, compile_options=None):
    """The weight gradients of one training step of a fresh model after ``torch.manual_seed``, compiled
    with ``backend`` (an instance, or "nvfp4" with ``compile_options``) as a new run in this process."""
    torch._dynamo.reset()
    model = _stack()
    torch.manual_seed(torch_seed)
    _step(torch.compile(model, backend=backend, options=compile_options))
    return grads(model)["layers.0.fc.weight"]


@pytest.mark.parametrize("how", ["instance", "string"])
def test_torch_manual_seed_governs_every_run_of_a_reused_backend(how):
    fp4compile.manual_seed(None)  # SR follows torch's generator (the default)
    settings = _all_fp4(rht=False)
    fresh = _run(Backend(**settings), 0)
    backend, options = (Backend(**settings), None) if how == "instance" else ("nvfp4", settings)
    first, other, again = _run(backend, 0, options), _run(backend, 1, options), _run(backend, 0, options)
    assert torch.equal(first, fresh)
    assert torch.equal(again, fresh)  # the same torch seed: the same bits in every run
    assert not torch.equal(other, fresh)  # another torch seed: other bits


def test_fp4compile_manual_seed_restarts_a_reused_backend_as_a_fresh_one():
    fresh = _run(Backend(**_all_fp4(rht=False)), 0)  # the fixture's fp4compile.manual_seed(0)
    backend = Backend(**_all_fp4(rht=False))
    _run(backend, 0)
    fp4compile.manual_seed(0)
    assert torch.equal(_run(backend, 0), fresh)


# ---------------------------------------------------------------------------------------------
# Dynamic shapes in the report
# ---------------------------------------------------------------------------------------------


def test_dynamic_shapes_count_gemm_flops_at_their_size_hints():
    reports = {}
    for dynamic in (False, True):
        torch._dynamo.reset()
        backend = Backend(inner="eager")
        _step(torch.compile(_stack(4), backend=backend, dynamic=dynamic))
        reports[dynamic] = backend.report
    static, dynamic = reports[False], reports[True]
    assert any(isinstance(d, str) for s in dynamic.sites for d in s.shapes["fprop"])  # symbolic tokens
    assert set(dynamic.flop_shares()) == {"nvfp4", "high"}
    assert dynamic.flop_shares() == pytest.approx(static.flop_shares())
    assert 0.4 < dynamic.flop_shares()["nvfp4"] < 0.6  # the middle two of four blocks
    assert dynamic.summary().startswith(static.summary())
    assert dynamic.summary().endswith("FLOPs at size hints " + ", ".join(f"{k}={v}" for k, v in dynamic.size_hints().items()))
    assert dynamic.size_hints() and set(dynamic.size_hints().values()) <= {2, 16} and static.size_hints() == {}


# ---------------------------------------------------------------------------------------------
# Export into a folder that holds an earlier export; serving a model compiled block by block
# ---------------------------------------------------------------------------------------------


def _trained(steps=1, per_block=None):
    """A 4-block stack and its backend after ``steps`` training steps; ``per_block``: "wrap"
    (``model.layers[i] = torch.compile(block)``) or "in_place" (``block.compile()``), else compiled whole."""
    model = _stack(4)
    backend = Backend(inner="eager", model=model if per_block else None)
    if per_block == "wrap":
        for i, block in enumerate(model.layers):
            model.layers[i] = torch.compile(block, backend=backend)
        compiled = model
    elif per_block == "in_place":
        for block in model.layers:
            block.compile(backend=backend)
        compiled = model
    else:
        compiled = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        _step(compiled, seed=100 + step)
        opt.step()
    return model, backend, compiled


def _read_export(folder):
    """{name: tensor} as a loader reads the folder: the shards the index names, else model.safetensors."""
    import json

    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    out = {}
    for f in files:
        out.update(load_file(str(folder / f)))
    return out


def _export_in_memory(model, backend, folder):
    fp4compile.export(model, folder, backend=backend, scheme="NVFP4A16")
    return _read_export(folder)


def test_export_replaces_an_earlier_export_whole(tmp_path):
    model, backend, _ = _trained(steps=1)
    out = tmp_path / "ckpt"
    fp4compile.export(model, out, backend=backend, scheme="NVFP4A16")  # one model.safetensors
    first = sorted(p.name for p in out.iterdir())
    assert "model.safetensors" in first
    with torch.no_grad():
        model.layers[1].fc.weight.mul_(0.5)  # trained on: other weights
    fp4compile.export(model, out, backend=backend, scheme="NVFP4A16", max_shard_size=4096)  # shards now
    files = sorted(p.name for p in out.iterdir())
    assert "model.safetensors" not in files and "model.safetensors.index.json" in files
    assert not [p for p in tmp_path.iterdir() if p.name != "ckpt"]  # nothing left beside it
    expected = _export_in_memory(model, backend, tmp_path / "fresh")
    got = _read_export(out)
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_export_refuses_a_folder_with_other_files_unless_told_to_overwrite(tmp_path):
    model, backend, _ = _trained(steps=1)
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"not ours")
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"model\.safetensors, notes\.txt.*overwrite=True"):
        fp4compile.export(model, out, backend=backend, scheme="NVFP4A16", max_shard_size=4096)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "notes.txt"]  # untouched
    fp4compile.export(model, out, backend=backend, scheme="NVFP4A16", max_shard_size=4096, overwrite=True)
    assert not (out / "notes.txt").exists() and not (out / "model.safetensors").exists()
    assert _read_export(out).keys() == _export_in_memory(model, backend, tmp_path / "fresh").keys()


def test_an_export_that_fails_leaves_the_earlier_one_as_it_was(tmp_path):
    model, backend, _ = _trained(steps=1)
    out = tmp_path / "ckpt"
    fp4compile.export(model, out, backend=backend, scheme="NVFP4A16")
    before, files = _read_export(out), sorted(p.name for p in out.iterdir())
    model.head.bias = torch.nn.Parameter(torch.empty(D, device="meta"))  # no values to write
    with pytest.raises(Exception):
        fp4compile.export(model, out, backend=backend, scheme="NVFP4A16", max_shard_size=4096)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert sorted(p.name for p in out.iterdir()) == files  # no part of the failed export in it
    after = _read_export(out)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.parametrize("per_block", ["wrap", "in_place"])
def test_served_runs_the_plain_modules_of_a_model_compiled_block_by_block(per_block, tmp_path):
    model, backend, compiled = _trained(steps=1, per_block=per_block)
    x = _x(2, 16, D, seed=7)
    with torch.no_grad():
        training_forward = compiled(x)
    assert len({s.name for s in backend.report.sites if s.precision == "nvfp4"}) == 4  # the middle two blocks
    # The same weights in a model that was never compiled, served by the same plan.
    plain = _stack(4)
    plain.load_state_dict({k.replace("._orig_mod", ""): v for k, v in model.state_dict().items()})
    with fp4compile.served(plain, backend) as m:
        expected = m(x)
    with fp4compile.served(model, backend) as m:
        got = m(x)
    assert torch.equal(got, expected)
    assert not torch.equal(got, training_forward)
    if per_block == "wrap":
        assert isinstance(model.layers[1], torch._dynamo.eval_frame.OptimizedModule)  # as it was
    with torch.no_grad():
        assert torch.equal(model(x), training_forward)  # compiled again after the block
    exported = _export_in_memory(model, backend, tmp_path / "ckpt")
    assert exported.keys() == _export_in_memory(plain, backend, tmp_path / "plain").keys()


# ---------------------------------------------------------------------------------------------
# Meta device
# ---------------------------------------------------------------------------------------------


def test_a_model_built_on_meta_compiles_and_then_trains_as_one_built_on_the_cpu():
    reference = _stack(4)
    with torch.device("meta"):
        model = MLPStack(4, d=D)
    backend = Backend(inner="eager")
    compiled = torch.compile(model, backend=backend)
    out = compiled(_x(2, 16, D).to("meta"))  # a shape-only run, as before to_empty
    out.square().mean().backward()
    assert out.shape == (2, 16, D) and out.device.type == "meta"
    model.to_empty(device="cpu")
    model.load_state_dict(reference.state_dict())
    model.zero_grad(set_to_none=True)
    logits = compiled(_x(2, 16, D))
    logits.square().mean().backward()

    torch._dynamo.reset()
    fp4compile.manual_seed(0)
    expected_backend = Backend(inner="eager")
    expected = torch.compile(reference, backend=expected_backend)(_x(2, 16, D))
    expected.square().mean().backward()
    plan = {(s.name, s.precision, s.reason) for s in backend.report.sites}
    assert plan == {(s.name, s.precision, s.reason) for s in expected_backend.report.sites}
    assert backend.report.warnings == []
    assert torch.equal(logits, expected)
    for name, g in grads(reference).items():
        assert torch.equal(grads(model)[name], g), name  # the meta pass drew no SR bits
    assert set(backend.ranges.amax()) == {"layers.1.fc", "layers.1.out", "layers.2.fc", "layers.2.out"}


# ---------------------------------------------------------------------------------------------
# The backend's state through torch.distributed.checkpoint
# ---------------------------------------------------------------------------------------------


def _train(model, backend, steps, start=0):
    """``steps`` SGD steps (no optimizer state) from step ``start``; the losses."""
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(start, start + steps):
        opt.zero_grad()
        loss = compiled(_x(2, 16, D, seed=100 + step)).square().mean()
        loss.backward()
        opt.step()
        backend.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("stateful", [True, False], ids=["backend", "state_dict"])
def test_distributed_checkpoint_loads_the_backend_state_into_a_fresh_backend(stateful, tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    uninterrupted = _train(_stack(4), Backend(inner="eager"), 3)

    torch._dynamo.reset()
    fp4compile.manual_seed(0)
    model, backend = _stack(4), Backend(inner="eager")
    assert _train(model, backend, 2) == uninterrupted[:2]
    with pytest.warns(UserWarning, match="single process"):  # one process, no process group
        dcp.save({"model": model.state_dict(), "backend": backend}, checkpoint_id=tmp_path / "step2")

    # A new run: other weights, another SR state, a backend that has compiled nothing.
    torch._dynamo.reset()
    fp4compile.manual_seed(999)
    torch.manual_seed(999)
    resumed, fresh = MLPStack(4, d=D), Backend(inner="eager")
    state = {"model": resumed.state_dict(), "backend": fresh if stateful else fresh.state_dict()}
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(state, checkpoint_id=tmp_path / "step2")
    if not stateful:
        fresh.load_state_dict(state["backend"])
    resumed.load_state_dict(state["model"])
    recorded = backend.ranges.amax()
    assert len(recorded) == 4 and fresh.ranges.amax().keys() == recorded.keys()
    assert all(torch.equal(fresh.ranges.amax()[k], v) for k, v in recorded.items())
    assert fresh.step(0) == 2
    assert _train(resumed, fresh, 1, start=2) == uninterrupted[2:]
