"""Peephole rewrites declared as data: ``outer(..., name=inner(...), ...)`` becomes one ``replacement``
node, where the inner node is read by the outer one alone.

A pass declares what it rewrites (``Rewrite``: the two ops, the argument that joins them, the
replacement's arguments by name from theirs, what its metadata adds) and ``apply`` does the matching,
the graph surgery and the copying of metadata, the same way for every rewrite. Arguments are read and
written by name (the ops' schemas), never by position. A matcher of our own rather than Inductor's
``pattern_matcher``: that one traces example functions through its private API and sees the graph
after Inductor's decompositions, while these rewrites run on fp4compile's own ops before Inductor
compiles the graph, and carry fp4compile's node metadata across.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch.fx as fx

from fp4compile.sites import bound_arguments

__all__ = ["Rewrite", "apply", "call_form"]


@dataclasses.dataclass(frozen=True)
class Rewrite:
    """``outer`` whose argument ``through`` is an ``inner`` node read by nothing else becomes
    ``replacement(**arguments(outer's arguments, inner's arguments))``; the new node takes the outer
    node's metadata, updated by ``meta(outer's metadata, inner's arguments)``."""

    name: str
    outer: object  # an op overload, e.g. torch.ops.fp4.quantize.default
    through: str
    inner: object
    replacement: object
    arguments: Callable[[dict, dict], dict]
    meta: Callable[[dict, dict], dict] = lambda meta, inner: meta


def call_form(target, values: dict) -> tuple:
    """``values`` (every argument of op ``target`` by name) as a call's positional arguments: in the
    schema's order, trailing ones equal to their defaults left out."""
    schema = target._schema.arguments
    missing = [a.name for a in schema if a.name not in values and not a.has_default_value()]
    unknown = set(values) - {a.name for a in schema}
    if missing or unknown:
        raise TypeError(f"{target}: arguments {missing} missing, {sorted(unknown)} unknown")
    ordered = [values[a.name] if a.name in values else a.default_value for a in schema]
    while ordered:
        a, last = schema[len(ordered) - 1], ordered[-1]
        if isinstance(last, fx.Node) or not a.has_default_value() or last != a.default_value:
            break
        ordered.pop()
    return tuple(ordered)


def apply(gm: fx.GraphModule, rewrite: Rewrite) -> int:
    """Rewrite every match of ``rewrite`` in ``gm``; returns how many."""
    done = 0
    for node in list(gm.graph.find_nodes(op="call_function", target=rewrite.outer)):
        outer = bound_arguments(node)
        inner = outer.get(rewrite.through)
        if not (isinstance(inner, fx.Node) and inner.op == "call_function" and inner.target is rewrite.inner
                and len(inner.users) == 1):
            continue
        inner_args = bound_arguments(inner)
        args = call_form(rewrite.replacement, rewrite.arguments(outer, inner_args))
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(rewrite.replacement, args)
        new.meta.update(rewrite.meta(dict(node.meta), inner_args))
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        gm.graph.erase_node(inner)
        done += 1
    return done
