"""Fewer and smaller garbage-collector passes while the backend compiles.

Compiling a graph (aot_autograd's trace and partition, fp4compile's passes, Inductor) creates and drops
hundreds of thousands of Python objects. With Python's default thresholds (700, 10, 10) that starts a
young-generation collection every 700 net allocations, and every hundredth of them is a full
collection, which scans every object the process holds (the model, its parameters' Python objects,
everything imported). On a 12-layer GPT the collector took about 3 s of the first call on the CPU,
most of it in full collections.

While the backend compiles (``Backend`` enters ``compile_gc.relaxed()`` around each graph's
compilation, forward and backward):

- the first threshold is raised, by default to 50,000: the same objects are collected, in about a
  twentieth as many passes;
- the objects that existed when the compilation started are frozen (``gc.freeze()``), so a full
  collection scans only what the compilation made. They are unfrozen when it ends; garbage among them
  is collected by the next collections after that.

On exit the thresholds the process had are restored. ``FP4COMPILE_COMPILE_GC_THRESHOLD=N`` (read when a
compilation starts) sets the first threshold; ``0`` leaves the collector alone (no threshold change, no
freeze). Nothing changes where the collector is disabled or already has a first threshold at least as
high; nothing is frozen where the process has frozen objects of its own (``gc.get_freeze_count()``),
which an unfreeze would release. Compilations that nest (the forward's inner compile inside the
backend's) or run on two threads at once share one relaxation: the outermost restores.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading

log = logging.getLogger("fp4compile")

ENV = "FP4COMPILE_COMPILE_GC_THRESHOLD"
DEFAULT_THRESHOLD = 50_000

_lock = threading.Lock()
_state = {"depth": 0, "saved": None, "set": None, "froze": False}


def threshold() -> int:
    """The first GC threshold while compiling (``FP4COMPILE_COMPILE_GC_THRESHOLD``; 0: no change)."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return DEFAULT_THRESHOLD
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{ENV} must be a whole number of allocations (0 leaves the collector alone), got {value!r}")
    if n < 0:
        raise ValueError(f"{ENV} must be 0 or more, got {n}")
    return n


def _enter() -> None:
    with _lock:
        _state["depth"] += 1
        if _state["depth"] > 1:
            return
        wanted = threshold()
        current = gc.get_threshold()
        if not wanted or not gc.isenabled() or current[0] == 0 or current[0] >= wanted:
            return
        new = (wanted,) + tuple(current[1:])
        gc.set_threshold(*new)
        _state["saved"], _state["set"] = current, new
        if gc.get_freeze_count() == 0:
            gc.freeze()
            _state["froze"] = True
        log.debug("fp4compile: GC threshold %s while compiling (was %s), older objects frozen: %s",
                  new, current, _state["froze"])


def _exit() -> None:
    with _lock:
        _state["depth"] -= 1
        if _state["depth"] > 0 or _state["saved"] is None:
            return
        saved, was_set, froze = _state["saved"], _state["set"], _state["froze"]
        _state["saved"] = _state["set"] = None
        _state["froze"] = False
        if froze:
            gc.unfreeze()
        if gc.get_threshold() == was_set:  # left as set: restore; changed by someone else: theirs stands
            gc.set_threshold(*saved)


@contextlib.contextmanager
def relaxed():
    """Raise the collector's first threshold for the duration (see the module docstring)."""
    _enter()
    try:
        yield
    finally:
        _exit()
