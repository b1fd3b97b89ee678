"""The garbage collector's first threshold is raised while the backend compiles, and restored after."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

from fp4compile import Backend, compile_gc
from fp4compile.passes import pipeline
from models import TinyGPT, lm_loss


@pytest.fixture(autouse=True)
def gc_settings(monkeypatch):
    """Each test starts from Python's default thresholds with the collector on, and leaves them so."""
    monkeypatch.delenv(compile_gc.ENV, raising=False)
    saved, enabled = gc.get_threshold(), gc.isenabled()
    assert gc.get_freeze_count() == 0
    gc.set_threshold(700, 10, 10)
    gc.enable()
    yield
    gc.unfreeze()
    gc.set_threshold(*saved)
    (gc.enable if enabled else gc.disable)()


def test_raises_the_first_threshold_and_restores_all_three():
    gc.set_threshold(700, 11, 12)
    with compile_gc.relaxed():
        assert gc.get_threshold() == (compile_gc.DEFAULT_THRESHOLD, 11, 12)
    assert gc.get_threshold() == (700, 11, 12)


class _Cycle:
    def __init__(self):
        self.me = self


def test_older_objects_are_frozen_during_the_compile_and_collected_after():
    """A cycle made before the compile and dropped during it survives the compile's collections (it is
    frozen) and is collected by the first collection after."""
    cycle = _Cycle()
    gone = weakref.ref(cycle)
    with compile_gc.relaxed():
        assert gc.get_freeze_count() > 0
        del cycle
        gc.collect()
        assert gone() is not None
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert gone() is None


def test_objects_frozen_by_the_process_stay_frozen():
    cycle = _Cycle()
    gone = weakref.ref(cycle)
    gc.freeze()
    frozen = gc.get_freeze_count()
    with compile_gc.relaxed():
        assert gc.get_threshold()[0] == compile_gc.DEFAULT_THRESHOLD  # the threshold is still raised
        assert gc.get_freeze_count() == frozen
    assert gc.get_freeze_count() == frozen  # not unfrozen by the compile's exit
    del cycle
    gc.collect()
    assert gone() is not None


def test_nested_and_concurrent_compiles_share_one_relaxation():
    with compile_gc.relaxed():
        with compile_gc.relaxed():
            assert gc.get_threshold()[0] == compile_gc.DEFAULT_THRESHOLD
        assert gc.get_threshold()[0] == compile_gc.DEFAULT_THRESHOLD  # the inner exit restores nothing
        seen = []
        other = threading.Thread(target=lambda: seen.append(_inside()))
        other.start()
        other.join()
        assert seen == [compile_gc.DEFAULT_THRESHOLD] and gc.get_threshold()[0] == compile_gc.DEFAULT_THRESHOLD
    assert gc.get_threshold() == (700, 10, 10)


def _inside() -> int:
    with compile_gc.relaxed():
        return gc.get_threshold()[0]


def test_restores_after_an_exception():
    with pytest.raises(RuntimeError, match="boom"):
        with compile_gc.relaxed():
            raise RuntimeError("boom")
    assert gc.get_threshold() == (700, 10, 10)
    with compile_gc.relaxed():  # and the depth count is back to zero: the next compile relaxes again
        assert gc.get_threshold()[0] == compile_gc.DEFAULT_THRESHOLD


@pytest.mark.parametrize("setup", ["disabled", "higher", "zero", "env-off"])
def test_leaves_the_collector_alone(monkeypatch, setup):
    if setup == "disabled":
        gc.disable()
    elif setup == "higher":
        gc.set_threshold(200_000, 10, 10)
    elif setup == "zero":  # a first threshold of 0 means no automatic collection: not ours to start
        gc.set_threshold(0, 10, 10)
    else:
        monkeypatch.setenv(compile_gc.ENV, "0")
    before = gc.get_threshold()
    with compile_gc.relaxed():
        assert gc.get_threshold() == before and gc.get_freeze_count() == 0
    assert gc.get_threshold() == before
    assert gc.isenabled() == (setup != "disabled")


def test_environment_sets_the_threshold_and_rejects_bad_values(monkeypatch):
    monkeypatch.setenv(compile_gc.ENV, "20000")
    with compile_gc.relaxed():
        assert gc.get_threshold()[0] == 20_000
    for bad, message in (("lots", "whole number"), ("-5", "0 or more")):
        monkeypatch.setenv(compile_gc.ENV, bad)
        with pytest.raises(ValueError, match=f"{compile_gc.ENV}.*{message}"):
            compile_gc.threshold()


def test_a_threshold_changed_during_the_compile_is_kept():
    with compile_gc.relaxed():
        gc.set_threshold(1234, 10, 10)  # e.g. the user's code, from a pass or another thread
    assert gc.get_threshold() == (1234, 10, 10)


@pytest.mark.usefixtures("fresh_dynamo")
def test_forward_and_backward_compile_under_the_raised_threshold(monkeypatch):
    """The threshold each aot-level pass run sees (forward at the first call, backward at the first
    backward, both outside any other relaxation) and the one the training step leaves behind."""
    seen = []

    def watch(gm, ctx):
        seen.append(gc.get_threshold()[0])
        assert gc.get_freeze_count() > 0
        return gm

    monkeypatch.setattr(pipeline, "AOT_PASSES", pipeline.AOT_PASSES + [watch])
    torch.manual_seed(0)
    model = TinyGPT()
    idx = torch.randint(0, 64, (2, 32))
    compiled = torch.compile(model, backend=Backend())
    loss = lm_loss(compiled(idx), idx)
    assert seen == [compile_gc.DEFAULT_THRESHOLD]
    assert gc.get_threshold() == (700, 10, 10) and gc.get_freeze_count() == 0
    loss.backward()
    assert seen == [compile_gc.DEFAULT_THRESHOLD] * 2
    assert gc.get_threshold() == (700, 10, 10) and gc.get_freeze_count() == 0
