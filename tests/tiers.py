"""Test tiers for parametrized tests: the default run takes one case, ``-m slow`` the others."""

from __future__ import annotations

import pytest


def first_fast(argnames: str, values, ids=None) -> tuple:
    """Arguments for ``pytest.mark.parametrize(*first_fast(argnames, values))``: the first case runs in
    the default (fast) run, the others are marked slow (``.ci/run`` runs both tiers, so every case still
    runs there)."""
    several = "," in argnames
    values = list(values)
    ids = list(ids) if ids is not None else [None] * len(values)
    params = [pytest.param(*(v if several else (v,)), id=i, marks=() if n == 0 else pytest.mark.slow)
              for n, (v, i) in enumerate(zip(values, ids))]
    return argnames, params
