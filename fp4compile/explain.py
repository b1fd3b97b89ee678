"""``fp4compile.explain``: compile a model's forward and backward once and report what the compiler did.

    report = fp4compile.explain(model, idx)
    print(report.precision_table())
    print(report.diff("backward", "insert_rht"))
    report.save_image("backward.png", stage="backward")

The user's model is left as it was: explain runs on a deep copy (or, for a model that cannot be copied,
on the model itself with its gradients and buffers put back afterwards), and restores the
stochastic-rounding stream and torch's random state.
"""

from __future__ import annotations

import contextlib
import copy
import types
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from fp4compile import runtime
from fp4compile.backend import Backend
from fp4compile.recipe import Recipe
from fp4compile.report import Report

__all__ = ["explain"]


def explain(
    model: nn.Module,
    *example_inputs,
    recipe: Optional[Recipe] = None,
    inner: str = "eager",
    loss_fn: Optional[Callable] = None,
    passes: Sequence = (),
) -> Report:
    """Compile ``model`` with the nvfp4 backend, run one forward and one backward on ``example_inputs``
    and return the backend's ``Report``.

    recipe: the ``Recipe`` (default: the published NVFP4 recipe); passes: user precision passes, as
    ``Backend(passes=...)``; inner: the inner compiler ("eager", the default, compiles fastest;
    "inductor" makes the same precision plan around differently decomposed ATen ops).
    loss_fn: ``loss_fn(output) -> scalar`` for the backward; default: the sum of every floating-point
    output that requires grad. Without such an output only the forward graph is compiled.
    The graphs are compiled for the shapes of ``example_inputs`` (static), whatever earlier calls
    explained.
    """
    model = getattr(model, "_orig_mod", model)  # an already compiled model: explain the model itself
    backend = Backend(recipe=recipe, passes=passes, inner=inner)
    inputs = pytree.tree_map_only(torch.Tensor, _fresh_input, example_inputs)
    with _isolated(model) as target, torch.enable_grad():
        # Shapes as given: dynamo keeps its automatic dynamic shapes per function name and place, which
        # every explain call shares, so an earlier call with other shapes would make these symbolic.
        output = torch.compile(_fresh_call(), backend=backend, dynamic=False)(target, *inputs)
        loss = loss_fn(output) if loss_fn is not None else _default_loss(output)
        if loss is not None and loss.requires_grad:
            loss.backward()
    return backend.report


def _fresh_input(x: torch.Tensor) -> torch.Tensor:
    """The input as a new leaf, so the backward does not touch the caller's tensor or its .grad."""
    return x.detach().clone().requires_grad_(x.requires_grad)


def _default_loss(output) -> Optional[torch.Tensor]:
    tensors = [
        t for t in pytree.tree_leaves(output)
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()
    ]
    return sum(t.float().sum() for t in tensors) if tensors else None


def _call(model, *inputs):
    return model(*inputs)


def _fresh_call():
    """``_call`` with a code object of its own: dynamo keeps compiled code (and counts recompiles) per
    code object, so explain's compilation lands in this throwaway one and is freed with it, instead of
    adding entries to the model's own ``forward`` cache."""
    return types.FunctionType(_call.__code__.replace(), _call.__globals__, "explain_call")


@contextlib.contextmanager
def _isolated(model: nn.Module):
    """Yield the module to run: a deep copy of ``model``, or ``model`` itself when it cannot be copied,
    with its gradients and buffers restored afterwards. The SR stream and torch's RNG are restored too."""
    try:
        target = copy.deepcopy(model)
    except Exception:  # modules holding locks, handles, ...: run in place and put the state back
        target = None
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    sr_state = runtime.get_rng_state()
    try:
        with torch.random.fork_rng(devices=devices):
            if target is not None:
                target.zero_grad(set_to_none=True)
                yield target
            else:
                with _state_restored(model):
                    yield model
    finally:
        runtime.set_rng_state(sr_state)


@contextlib.contextmanager
def _state_restored(model: nn.Module):
    params = list(model.parameters())
    grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, g in zip(params, grads):
            p.grad = g
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
