"""Pass contracts run (``fp4compile.contracts``): the pipeline checks each pass's order, what it requires
and what it guarantees, and that every node it adds to an aot_autograd graph carries ``meta["val"]``.
The suite runs with the checks on (tests/conftest.py); these tests show that a pass breaking its
contract is caught, and that the checks cost nothing when off."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
import torch.nn as nn

from fp4compile import Backend, config
from fp4compile.contracts import ContractError, contract_of
from fp4compile.passes import lower_gemms as lower_gemms_module
from fp4compile.passes import pipeline

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(4)])

    def forward(self, x):
        return self.layers(x)


@contextlib.contextmanager
def contract_broken(match: str):
    """The block raises ContractError (as it is, or wrapped by dynamo's BackendCompilerFailed) matching ``match``."""
    with pytest.raises(Exception) as info:
        yield
    err = getattr(info.value, "inner_exception", info.value)
    assert isinstance(err, ContractError), repr(info.value)
    assert re.search(match, str(err)), str(err)


def train_step(backend):
    torch.manual_seed(0)
    model = Stack()
    torch.compile(model, backend=backend)(torch.randn(2, 16, 32)).square().mean().backward()
    return backend


def test_every_pass_of_the_pipeline_states_a_contract():
    for p in pipeline.DYNAMO_PASSES + pipeline.JOINT_PASSES + pipeline.AOT_PASSES:
        c = contract_of(p)
        assert c is not None and c.stages, pipeline.pass_name(p)
        assert c.ensures is not None, pipeline.pass_name(p)
        for name in c.after:  # every pass it follows runs before it in the pipeline
            order = pipeline.pass_names()
            assert order.index(name) < order.index(pipeline.pass_name(p)), (name, pipeline.pass_name(p))


def test_the_suite_runs_with_the_checks_on():
    assert config.check_contracts


def test_a_pass_adding_a_node_without_a_fake_value_is_caught():
    def add_one(gm, ctx):
        out = next(n for n in gm.graph.nodes if n.op == "output")
        with gm.graph.inserting_before(out):
            gm.graph.call_function(torch.ops.aten.zeros.default, ([1],))
        return gm

    backend = Backend(inner="eager")
    original = list(pipeline.AOT_PASSES)
    pipeline.AOT_PASSES.insert(1, add_one)
    try:
        with contract_broken(r"pass 'add_one' added 1 nodes without a fake value.*aten.zeros"):
            train_step(backend)
    finally:
        pipeline.AOT_PASSES[:] = original


def test_a_pass_run_out_of_order_is_caught():
    insert_quantize = pipeline.AOT_PASSES[pipeline.pass_order.AOT.index("insert_quantize")]
    original = list(pipeline.AOT_PASSES)
    pipeline.AOT_PASSES[:] = [insert_quantize] + [p for p in original if p is not insert_quantize]
    try:
        with contract_broken("pass 'insert_quantize' must run after plan_gemm_roles"):
            train_step(Backend(inner="eager"))
    finally:
        pipeline.AOT_PASSES[:] = original


@pytest.fixture
def lowering_that_does_nothing():
    """``lower_gemms`` replaced by a pass under its name and contract that leaves every GEMM as it found
    it, reading dequantized operands."""

    def lower_gemms(gm, ctx):
        return gm

    lower_gemms.contract = contract_of(lower_gemms_module.lower_gemms)
    original = list(pipeline.AOT_PASSES)
    pipeline.AOT_PASSES[original.index(lower_gemms_module.lower_gemms)] = lower_gemms
    yield
    pipeline.AOT_PASSES[:] = original


def test_a_pass_that_breaks_its_guarantee_is_caught(lowering_that_does_nothing):
    with contract_broken(r"pass 'lower_gemms' ensures: .* still reads dequantized operands"):
        train_step(Backend(inner="eager"))


def test_the_checks_are_off_unless_asked_for(lowering_that_does_nothing):
    with config.patch(check_contracts=False):
        backend = train_step(Backend(inner="eager"))  # the broken pass runs unchecked
    assert any(s.precision == "nvfp4" for s in backend.report.sites)
    assert "fp4.scaled_mm" not in backend.report.graph("forward", "lower_gemms")
