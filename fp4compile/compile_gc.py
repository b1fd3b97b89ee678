"""Fewer and smaller garbage-collector passes while the backend compiles.

Compiling a graph (aot_autograd's trace and partition, fp4compile's passes, Inductor) creates and drops
hundreds of thousands of Python objects. With Python's default thresholds (700, 10, 10) that starts a
young-generation collection every 700 net allocations, and up to every hundredth of them is a full
collection, which scans every object the process holds (the model, its parameters' Python objects,
everything imported). On a 12-layer GPT the collector took about 3 s of the first call on the CPU,
most of it in full collections.

While the backend compiles (``Backend`` enters ``compile_gc.relaxed()`` around each graph's
compilation, forward and backward):

- the first threshold is raised, by default to 50,000: about a twentieth as many passes, each over
  more new objects;
- the objects that existed when the compilation started are frozen (``gc.freeze()``), after a
  young-generation collection so that young garbage is not frozen with them: a full collection scans
  only what the compilation made. They are unfrozen when it ends, into the oldest generation: garbage
  among them is collected by the next full collection.

On exit the thresholds the process had are restored. ``fp4compile.config.compile_gc_threshold``
(``FP4COMPILE_COMPILE_GC_THRESHOLD=N``) sets the first threshold; ``0`` leaves the collector alone (no threshold change, no
freeze). Nothing changes where the collector is disabled or already has a first threshold at least as
high. Nothing is frozen where the process has frozen objects of its own (``gc.get_freeze_count()``),
which an unfreeze would release; and where something else freezes objects during the compilation, the
end of it does not unfreeze (it logs a warning: the objects frozen for the compilation stay frozen
too). Compilations that nest (the forward's inner compile inside the backend's) or run on two threads
at once share one relaxation: the outermost restores. A process forked during a compilation starts
with the collector as it was before it.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading

from fp4compile import config

log = logging.getLogger("fp4compile")


_lock = threading.Lock()
_state = {"depth": 0, "saved": None, "set": None, "frozen": None}


def _restore() -> None:
    """Undo the relaxation (the lock held, the state's depth already 0)."""
    saved, was_set, frozen = _state["saved"], _state["set"], _state["frozen"]
    _state["saved"] = _state["set"] = _state["frozen"] = None
    if frozen is not None:
        # ``frozen`` was made after the compilation's freeze: frozen now, it was frozen by someone else.
        if not any(o is frozen for o in gc.get_objects()):
            log.warning("fp4compile: objects were frozen (gc.freeze) during a compilation; leaving every frozen "
                        "object frozen, those frozen for the compilation included")
        else:
            gc.unfreeze()
    if saved is not None and gc.get_threshold() == was_set:  # changed by someone else: theirs stands
        gc.set_threshold(*saved)


def _enter() -> None:
    wanted = config.compile_gc_threshold
    with _lock:
        _state["depth"] += 1
        if _state["depth"] > 1:
            return
        try:
            current = gc.get_threshold()
            if not wanted or not gc.isenabled() or current[0] == 0 or current[0] >= wanted:
                return
            new = (wanted,) + tuple(current[1:])
            gc.set_threshold(*new)
            _state["saved"], _state["set"] = current, new
            if gc.get_freeze_count() == 0:
                gc.collect(1)
                gc.freeze()
                _state["frozen"] = []  # a sentinel: a tracked object made after the freeze
            log.debug("fp4compile: GC threshold %s while compiling (was %s), older objects frozen: %s",
                      new, current, _state["frozen"] is not None)
        except BaseException:
            _state["depth"] -= 1
            _restore()
            raise


def _exit() -> None:
    with _lock:
        _state["depth"] -= 1
        if _state["depth"] == 0:
            _restore()


def _after_fork_in_child() -> None:
    """A child forked while a compilation runs (on another thread) does not run it: undo it there."""
    global _lock
    _lock = threading.Lock()
    if _state["depth"]:
        _state["depth"] = 0
        _restore()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def relaxed():
    """Raise the collector's first threshold and freeze older objects for the duration (see the module
    docstring)."""
    _enter()
    try:
        yield
    finally:
        _exit()
