"""The garbage collector's first threshold is raised while the backend compiles, and restored after."""

from __future__ import annotations

import gc
import logging
import os
import threading
import weakref

import pytest
import torch

from fp4compile import Backend, compile_gc, config
from fp4compile.passes import pipeline
from models import TinyGPT, lm_loss

DEFAULT_THRESHOLD = config.DEFAULTS["compile_gc_threshold"]


@pytest.fixture(autouse=True)
def gc_settings(monkeypatch):
    """Each test starts from Python's default thresholds with the collector on, and leaves them so."""
    saved, enabled = gc.get_threshold(), gc.isenabled()
    assert gc.get_freeze_count() == 0
    gc.set_threshold(700, 10, 10)
    gc.enable()
    with config.patch(compile_gc_threshold=DEFAULT_THRESHOLD):
        yield
    gc.unfreeze()
    gc.set_threshold(*saved)
    (gc.enable if enabled else gc.disable)()


def test_raises_the_first_threshold_and_restores_all_three():
    gc.set_threshold(700, 11, 12)
    with compile_gc.relaxed():
        assert gc.get_threshold() == (DEFAULT_THRESHOLD, 11, 12)
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


def test_young_garbage_is_collected_before_the_freeze():
    """Unreachable young objects are not frozen (and so not promoted to the oldest generation)."""
    cycle = _Cycle()
    gone = weakref.ref(cycle)
    del cycle
    with compile_gc.relaxed():
        assert gone() is None


def test_a_freeze_during_the_compile_is_not_undone(caplog):
    with caplog.at_level(logging.WARNING, logger="fp4compile"):
        with compile_gc.relaxed():
            theirs = _Cycle()  # made during the compile, frozen by the process's own freeze
            gc.freeze()
    assert gc.get_freeze_count() > 0 and not any(o is theirs for o in gc.get_objects())  # still frozen
    assert "frozen (gc.freeze) during a compilation" in caplog.text
    assert gc.get_threshold() == (700, 10, 10)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_process_forked_during_a_compile_starts_with_the_collector_as_before():
    with compile_gc.relaxed():
        pid = os.fork()
        if pid == 0:  # the child: no compilation runs here
            ok = gc.get_threshold() == (700, 10, 10) and gc.get_freeze_count() == 0 and compile_gc._state["depth"] == 0
            os._exit(0 if ok else 1)
        assert gc.get_threshold()[0] == DEFAULT_THRESHOLD  # the parent's compile goes on
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_objects_frozen_by_the_process_stay_frozen():
    cycle = _Cycle()
    gone = weakref.ref(cycle)
    gc.freeze()
    frozen = gc.get_freeze_count()
    with compile_gc.relaxed():
        assert gc.get_threshold()[0] == DEFAULT_THRESHOLD  # the threshold is still raised
        assert gc.get_freeze_count() == frozen
    assert gc.get_freeze_count() == frozen  # not unfrozen by the compile's exit
    del cycle
    gc.collect()
    assert gone() is not None


def test_nested_and_concurrent_compiles_share_one_relaxation():
    with compile_gc.relaxed():
        with compile_gc.relaxed():
            assert gc.get_threshold()[0] == DEFAULT_THRESHOLD
        assert gc.get_threshold()[0] == DEFAULT_THRESHOLD  # the inner exit restores nothing
    assert gc.get_threshold() == (700, 10, 10)

    # Two threads: A enters, B enters, A leaves (still relaxed for B), B leaves (restored).
    b_inside, a_left, b_done = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def b():
        with compile_gc.relaxed():
            b_inside.set()
            a_left.wait(10)
            seen["b after a left"] = gc.get_threshold()[0]
        b_done.set()

    with compile_gc.relaxed():
        other = threading.Thread(target=b)
        other.start()
        assert b_inside.wait(10)
    a_left.set()
    assert b_done.wait(10)
    other.join()
    assert seen == {"b after a left": DEFAULT_THRESHOLD}
    assert gc.get_threshold() == (700, 10, 10) and gc.get_freeze_count() == 0
    assert compile_gc._state["depth"] == 0


def test_restores_after_an_exception():
    with pytest.raises(RuntimeError, match="boom"):
        with compile_gc.relaxed():
            raise RuntimeError("boom")
    assert gc.get_threshold() == (700, 10, 10)
    with compile_gc.relaxed():  # and the depth count is back to zero: the next compile relaxes again
        assert gc.get_threshold()[0] == DEFAULT_THRESHOLD


@pytest.mark.parametrize("setup", ["disabled", "higher", "zero", "setting-off"])
def test_leaves_the_collector_alone(setup):
    if setup == "disabled":
        gc.disable()
    elif setup == "higher":
        gc.set_threshold(200_000, 10, 10)
    elif setup == "zero":  # a first threshold of 0 means no automatic collection: not ours to start
        gc.set_threshold(0, 10, 10)
    before = gc.get_threshold()
    with config.patch(compile_gc_threshold=0 if setup == "setting-off" else DEFAULT_THRESHOLD), compile_gc.relaxed():
        assert gc.get_threshold() == before and gc.get_freeze_count() == 0
    assert gc.get_threshold() == before
    assert gc.isenabled() == (setup != "disabled")


def test_the_setting_sets_the_threshold_and_rejects_bad_values():
    with config.patch(compile_gc_threshold=20_000), compile_gc.relaxed():
        assert gc.get_threshold()[0] == 20_000
    assert gc.get_threshold() == (700, 10, 10)
    variable = config.SETTINGS["compile_gc_threshold"].variable
    assert config.from_environment({variable: "20000"})["compile_gc_threshold"] == 20_000
    for bad, message in (("lots", "whole number"), ("-5", "between 0 and"), (str(2**40), "between 0 and")):
        with pytest.raises(ValueError, match=f"{variable}.*{message}"):
            config.from_environment({variable: bad})
        if bad != "lots":
            with pytest.raises(ValueError, match=f"compile_gc_threshold.*{message}"), config.patch(compile_gc_threshold=int(bad)):
                pass


def test_a_threshold_changed_during_the_compile_is_kept():
    with compile_gc.relaxed():
        gc.set_threshold(1234, 10, 10)  # e.g. the user's code, from a pass or another thread
    assert gc.get_threshold() == (1234, 10, 10)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("inner", ["inductor", "eager"])
def test_forward_and_backward_compile_under_the_raised_threshold(monkeypatch, inner):
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
    compiled = torch.compile(model, backend=Backend(inner=inner))
    loss = lm_loss(compiled(idx), idx)
    assert seen == [DEFAULT_THRESHOLD]
    assert gc.get_threshold() == (700, 10, 10) and gc.get_freeze_count() == 0
    loss.backward()
    assert seen == [DEFAULT_THRESHOLD] * 2
    assert gc.get_threshold() == (700, 10, 10) and gc.get_freeze_count() == 0
