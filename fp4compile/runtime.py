"""Run-time state shared by the compiled graphs: the stochastic-rounding stream and kernel dispatch.

The SR stream is counter based: a quantize node carries a constant seed (mixed from the recipe seed,
the GEMM site, its role and operand) and combines it at run time with the SR state (base seed, step).
The step advances on every call of a compiled graph with gradients enabled (before its forward runs,
so that call's backward draws with the same step), so every training step draws fresh bits while two
runs started from the same state produce the same bits. ``get_rng_state``/``set_rng_state`` let a
checkpoint resume the stream exactly.

The runtime also knows the backend step of the running graph (``Backend.step``), so that the
non-finite error of ``Recipe(check_finite=True)`` can say when it happened.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

import torch

_MASK64 = (1 << 64) - 1
_lock = threading.Lock()
_state = {"seed": 0, "step": 0}
_backend_step = {"step": 0}


def _mix64(x: int) -> int:
    """splitmix64 finaliser: a bijective 64-bit mixer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def node_seed(recipe_seed: int, site_key: int, role: str, operand: int) -> int:
    """The constant a quantize node carries for its SR stream (stable across processes)."""
    role_code = {"fprop": 1, "dgrad": 2, "wgrad": 3}[role]
    return _mix64(((recipe_seed * 1_000_003 + site_key) * 16 + role_code * 2 + operand) & _MASK64) & ((1 << 63) - 1)


def manual_seed(seed: int) -> None:
    """Reset the SR stream: base seed ``seed``, step 0."""
    with _lock:
        _state["seed"] = int(seed)
        _state["step"] = 0


def get_rng_state() -> dict:
    """The SR stream's state, for checkpoints."""
    with _lock:
        return dict(_state)


def set_rng_state(state: dict) -> None:
    with _lock:
        _state["seed"] = int(state["seed"])
        _state["step"] = int(state["step"])


def advance() -> None:
    """Called on every call of a compiled graph with gradients enabled, before its forward runs."""
    with _lock:
        _state["step"] += 1


def set_backend_step(step: int) -> None:
    """The ``Backend.step`` count of the graph about to run (named by the non-finite error)."""
    _backend_step["step"] = int(step)


def sr_seed(node_constant: int) -> int:
    with _lock:
        base = _mix64(_state["seed"] ^ _mix64(_state["step"]))
    return _mix64(base ^ node_constant) & ((1 << 63) - 1)


# Fast quantize kernels by device type: each takes (x, fmt, block) and returns a callable
# (x, rounding, seed) -> (data, scales, amax), or None where it cannot take the call.
_quantize_providers: list[Callable] = []


def register_quantize_provider(provider: Callable) -> None:
    _quantize_providers.append(provider)


def _first_kernel(providers: list[Callable], *args) -> Optional[Callable]:
    """The kernel of the first provider that takes the call, or None."""
    for provider in providers:
        kernel = provider(*args)
        if kernel is not None:
            return kernel
    return None


def quantize_kernel(x: torch.Tensor, fmt: str, block: str) -> Optional[Callable]:
    return _first_kernel(_quantize_providers, x, fmt, block)


# Fused RHT + quantize kernels (the weight-gradient operands): each takes (x, size, fmt, block) and
# returns a callable (x, rounding, seed) -> (data, scales, amax) equal to quantizing ``formats.rht(x,
# size)``, or None where it cannot take the call.
_rht_quantize_providers: list[Callable] = []


def register_rht_quantize_provider(provider: Callable) -> None:
    _rht_quantize_providers.append(provider)


def rht_quantize_kernel(x: torch.Tensor, size: int, fmt: str, block: str) -> Optional[Callable]:
    return _first_kernel(_rht_quantize_providers, x, size, fmt, block)


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
