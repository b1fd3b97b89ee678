"""Pass contracts that run: what a pass requires of the graph it is given and what it guarantees.

Every pass of the pipeline states its contract with ``@contract(...)``: the passes that must have run
before it (``after``), the stages it runs on, and two checks, ``requires(gm, ctx)`` before it runs and
``ensures(gm, ctx)`` after, each raising ``ContractError`` (through ``broken``) where the graph or the
context is not what the pass's docstring says. ``pipeline.run_passes`` runs them where
``fp4compile.config.check_contracts`` is on (``FP4COMPILE_CHECK_CONTRACTS=1``; the test suite turns it
on), together with one check for every pass: each node a pass adds to an aot_autograd graph carries its
fake value in ``meta["val"]``, as Inductor's passes guarantee for theirs. Off (the default), nothing is
checked and nothing costs.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch.fx as fx

__all__ = ["Contract", "ContractError", "broken", "contract", "contract_of"]

Check = Callable[[fx.GraphModule, object], None]


class ContractError(AssertionError):
    """A pass was given a graph it does not accept, or left one that breaks its guarantees."""


def broken(message: str) -> None:
    """Raise ``ContractError(message)``: what a ``requires`` or ``ensures`` check calls on a violation."""
    raise ContractError(message)


@dataclasses.dataclass(frozen=True)
class Contract:
    after: tuple[str, ...] = ()  # passes that must have run before, on this graph or the one it came from
    stages: tuple[str, ...] = ()  # the stages the pass runs on ("dynamo", "joint", "forward", "backward")
    requires: Optional[Check] = None
    ensures: Optional[Check] = None


def contract(*, after=(), stages=(), requires: Optional[Check] = None, ensures: Optional[Check] = None):
    """Decorator: give the pass ``fn(gm, ctx) -> gm`` its contract (``contract_of`` reads it)."""

    def wrap(fn):
        fn.contract = Contract(tuple(after), tuple(stages), requires, ensures)
        return fn

    return wrap


def contract_of(p) -> Optional[Contract]:
    return getattr(p, "contract", None)


def check_before(p, name: str, gm: fx.GraphModule, ctx, stage: str, ran: list[str]) -> None:
    """The order and ``requires`` of pass ``p`` (named ``name``) about to run on ``gm`` in ``stage``;
    ``ran``: the passes that ran on this compilation so far, in order."""
    c = contract_of(p)
    if c is None:
        return
    if c.stages and stage not in c.stages:
        raise ContractError(f"pass {name!r} runs on the {', '.join(c.stages)} stage, not on the {stage} graph")
    missing = [a for a in c.after if a not in ran]
    if missing:
        raise ContractError(f"pass {name!r} must run after {', '.join(missing)}, which did not run on this graph "
                            f"(ran: {', '.join(ran) or 'nothing'})")
    if c.requires is not None:
        _checked(name, "requires", c.requires, gm, ctx)


def check_after(p, name: str, gm: fx.GraphModule, ctx, stage: str, before: set) -> None:
    """The guarantees of pass ``p`` that just ran on ``gm`` (``before``: the graph's nodes before it)."""
    if stage != "dynamo":
        added = [n for n in gm.graph.nodes if n not in before and n.op == "call_function" and "val" not in n.meta]
        if added:
            raise ContractError(
                f"pass {name!r} added {len(added)} nodes without a fake value in meta['val'] "
                f"({', '.join(f'{n.name} = {n.target}' for n in added[:3])})"
            )
    c = contract_of(p)
    if c is not None and c.ensures is not None:
        _checked(name, "ensures", c.ensures, gm, ctx)


def _checked(name: str, which: str, check: Check, gm, ctx) -> None:
    try:
        check(gm, ctx)
    except ContractError as err:
        raise ContractError(f"pass {name!r} {which}: {err}") from None
