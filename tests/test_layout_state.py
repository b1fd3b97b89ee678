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
