"""Run-time state shared by the compiled graphs: the stochastic-rounding stream.

A quantize node carries a constant seed (mixed from the recipe seed, the GEMM site, its role and
operand) and combines it at run time with the step's base. Every call of a compiled graph with
gradients enabled sets a new base before its forward runs (so that call's backward draws with it):

* by default the base is drawn from torch's default generator of the graph's device, as dropout
  draws its bits: ``torch.manual_seed`` governs stochastic rounding, the same torch seed gives the
  same bits and a resumed run continues identically when torch's RNG state is restored with it;
* after ``manual_seed(seed)``, or for a graph whose ``Recipe.seed`` is set, the base is counted
  instead, ``mix64(seed ^ mix64(step))`` (fp4compile's own stream, blind to torch's seed), and
  ``manual_seed(None)`` returns to torch's generator.

``get_rng_state``/``set_rng_state`` save and restore the stream (seed, step and current base).

On a GPU the state also lives on the device: one int64 per device holding the step's base
``mix64(seed ^ mix64(step))``, rewritten in place whenever the state changes. The GPU quantizers read
it and mix in their node's constant themselves (``device_seed``), so a captured CUDA graph (Inductor's
``mode="reduce-overhead"``) replays with each step's fresh bits instead of the bits it was recorded with.

The runtime also knows the backend step of the running graph (``Backend.step``), so that the
non-finite error of ``Recipe(check_finite=True)`` can say when it happened.
"""

from __future__ import annotations

import threading
from typing import NamedTuple, Optional

import torch

_MASK64 = (1 << 64) - 1


_lock = threading.Lock()
_state = {"seed": None, "step": 0}  # seed None: the base comes from torch's generator
_backend_step = {"step": 0}
_resets = {"count": 0}  # how often the state was set (manual_seed, set_rng_state): see ``resets``
_device_bases: dict = {}  # torch.device -> int64 [1] tensor holding the signed bits of _base()


def _mix64(x: int) -> int:
    """splitmix64 finaliser: a bijective 64-bit mixer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def node_seed(recipe_seed: Optional[int], site_key: int, role: str, operand: int) -> int:
    """The constant a quantize node carries for its SR stream (stable across processes); a recipe
    without a seed (None) mixes like seed 0."""
    recipe_seed = recipe_seed or 0
    role_code = {"fprop": 1, "dgrad": 2, "wgrad": 3}[role]
    return _mix64(((recipe_seed * 1_000_003 + site_key) * 16 + role_code * 2 + operand) & _MASK64) & ((1 << 63) - 1)


def _counted_base() -> int:
    """fp4compile's own stream's base at the current step (call with the lock held)."""
    return _mix64((_state["seed"] or 0) ^ _mix64(_state["step"]))


_state["base"] = _counted_base()


def _base() -> int:
    """The step's base of every node's stream (call with the lock held)."""
    return _state["base"]


def _draw_from_torch(device: torch.device) -> int:
    """A base from torch's default generator of ``device``, consuming it as a random op would."""
    if device.type == "cuda":
        # Philox: the generator's seed and offset; moving the offset on is what a kernel drawing from it
        # does, and needs no read back from the GPU.
        generator = torch.cuda.default_generators[_device_key(device).index]
        offset = generator.get_offset()
        generator.set_offset(offset + 4)
        return _mix64(generator.initial_seed() ^ _mix64(offset))
    return _mix64(int(torch.empty((), dtype=torch.int64).random_()))


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= (1 << 63) else value


def _check_not_recording(what: str) -> None:
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"fp4compile: {what} while a CUDA graph is being recorded. The SR stream's step is host state "
            "that advances between replays: record with torch.compile(..., mode='reduce-overhead') (the "
            "backend advances the step outside its graphs), not by capturing the whole training step."
        )


def _check_state_change() -> None:
    """(lock held) The SR state may change: not while a CUDA graph records, once devices hold its base."""
    if _device_bases:
        _check_not_recording("the stochastic-rounding step would change")


def _update_device_bases() -> None:
    """Rewrite the device copies of the base (call with the lock held): one small fill per device."""
    if _device_bases:
        base = _signed64(_base())
        for tensor in _device_bases.values():
            tensor.fill_(base)


def manual_seed(seed: Optional[int]) -> None:
    """Reset the SR stream to step 0 and make it fp4compile's own, counted from ``seed`` whatever
    torch's seed; ``None`` returns to drawing each step's base from torch's generator (the default)."""
    with _lock:
        _check_state_change()
        _state["seed"] = None if seed is None else int(seed)
        _state["step"] = 0
        _state["base"] = _counted_base()
        _resets["count"] += 1
        _update_device_bases()


def get_rng_state() -> dict:
    """The SR stream's state, for checkpoints."""
    with _lock:
        return dict(_state)


def set_rng_state(state: dict) -> None:
    with _lock:
        _check_state_change()
        _state["seed"] = None if state["seed"] is None else int(state["seed"])
        _state["step"] = int(state["step"])
        _state["base"] = int(state["base"]) if "base" in state else _counted_base()
        _resets["count"] += 1
        _update_device_bases()


def resets() -> int:
    """How many times ``manual_seed`` or ``set_rng_state`` set the stream: a backend whose pass over its
    graphs began before that starts the next pass with a new base."""
    with _lock:
        return _resets["count"]


def advance(device: Optional[torch.device] = None, counted: bool = False) -> None:
    """Called once per pass over a backend's compiled graphs with gradients enabled, before the first
    runs: the next base, from torch's generator of ``device`` unless the stream is counted
    (``manual_seed`` with a seed, or ``counted`` for a graph whose recipe has a seed)."""
    with _lock:
        _check_state_change()
        _state["step"] += 1
        if _state["seed"] is None and not counted:
            _state["base"] = _draw_from_torch(torch.device("cpu") if device is None else device)
        else:
            _state["base"] = _counted_base()
        _update_device_bases()


def set_backend_step(step: int) -> None:
    """The ``Backend.step`` count of the graph about to run (named by the non-finite error)."""
    _backend_step["step"] = int(step)


def sr_seed(node_constant: int) -> int:
    """The seed a quantize node with ``node_constant`` draws its SR bits from at the current step."""
    with _lock:
        base = _base()
    return _mix64(base ^ node_constant) & ((1 << 63) - 1)


class DeviceSeed(NamedTuple):
    """``sr_seed(node)`` computed where it is used: ``mix64(base ^ node)`` with the low 63 bits kept,
    ``base`` the int64 [1] tensor ``device_base`` returns (read when the kernel runs, not when it is
    launched or recorded)."""

    node: int
    base: torch.Tensor


def _device_key(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def device_base(device) -> torch.Tensor:
    """The int64 [1] tensor on ``device`` that holds the current step's base (kept up to date in place).

    Created on first use; the backend creates it when it compiles a graph for the device, before any
    CUDA graph is recorded (an allocation made while one is recorded would belong to the graph).
    """
    key = _device_key(device)
    with _lock:
        tensor = _device_bases.get(key)
        if tensor is None:
            _check_not_recording(f"the SR base for {key} would be allocated (call runtime.device_base first)")
            # A normal tensor even under inference_mode: it is updated in place on every training step.
            with torch.inference_mode(False):
                tensor = torch.full((1,), _signed64(_base()), dtype=torch.int64, device=key)
            _device_bases[key] = tensor
    return tensor


_device_keys: dict = {}  # (device, keys) -> int64 [len(keys), 2] tensor, the keys in column 0


def device_keys(device, keys: tuple) -> torch.Tensor:
    """An int64 [len(keys), 2] tensor on ``device`` holding ``keys`` (SR node constants, signed 64-bit)
    in its first column and zeros in the second, so that each row starts 16 bytes after the last. Made
    once per (device, keys): the lowering makes a graph's keys when it compiles, before any CUDA graph
    is recorded."""
    key = (_device_key(device), tuple(int(k) for k in keys))
    with _lock:
        tensor = _device_keys.get(key)
        if tensor is None:
            _check_not_recording(f"the SR node constants for {key[0]} would be allocated")
            with torch.inference_mode(False):
                tensor = torch.tensor([[k, 0] for k in key[1]], dtype=torch.int64).to(key[0])
            _device_keys[key] = tensor
    return tensor


def device_seed(node_constant: int, device) -> DeviceSeed:
    """The stream of a quantize node for kernels that read the base on ``device``."""
    return DeviceSeed(int(node_constant), device_base(device))


def raise_non_finite(label: str, x: torch.Tensor) -> None:
    """The error ``Recipe(check_finite=True)`` raises: names layer, GEMM role, operand and step.

    ``step`` is the backend's step count (``Backend.step``, the optimizer steps the training loop
    reports); the SR stream step (compiled training calls so far) is given too, for runs that do not
    call ``Backend.step``.
    """
    n_nan = int(torch.isnan(x).sum())
    n_inf = int(torch.isinf(x).sum())
    with _lock:
        sr_step = _state["step"]
    raise FloatingPointError(
        f"fp4compile: non-finite values in {label} (shape {tuple(x.shape)}, {n_nan} NaN, {n_inf} Inf) "
        f"at step {_backend_step['step']} (SR stream step {sr_step})"
    )
