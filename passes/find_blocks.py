"""find_blocks: group GEMM sites into the model's blocks and order the blocks by data flow.

Requires: ``find_gemm_sites`` (sites named by their weight's path in the model).
Guarantees: ``site.block`` / ``site.block_name`` set for every site inside a block (None outside: the
output layer, projections before the first block), ``ctx.n_blocks`` and ``ctx.block_names`` in execution
order. ``site.block`` is the block's position in the whole model and ``ctx.n_blocks`` the whole model's
count: for a model holding part of the blocks under their layer keys (a pipeline stage), the keys' numbers
among ``ctx.total_blocks`` (``model_positions``, with a warning in ``ctx.warnings`` where the total is
guessed).

Blocks are the model's repeated units, found from the module hierarchy (of the whole root model where the
backend knows it, so that a graph holding part of the model numbers its blocks among all of them) and
the data flow between GEMM sites:

- descend from the root through modules with a single child that holds GEMM weights;
- at the first module with several such children: if they are the members of a list (integer names, as
  in an ``nn.ModuleList``, an ``nn.Sequential`` or a ``ModuleDict`` keyed by layer number), they are the
  blocks, whatever their classes (hybrid stacks of Mamba, attention and MLP blocks);
- otherwise (named children, such as ``encoder`` and ``decoder``, a trunk beside a head, or blocks kept
  as separate attributes) a child that leads, through single-child modules, to a list whose members run
  one after another contributes those members (``encoder.layers.0`` ...); of the other children, those
  repeated in their class (``block_a``, ``block_b`` of one class) are blocks, and a child of a class of
  its own (an output head with a norm and a projection, a projection before the blocks) is not.
  A GEMM weight that is a direct child here (``lm_head``, ``output``) is never a block. A list whose
  members run side by side (MoE experts, per-head projections) is part of a block, not a stack of blocks.

A model without any nesting (a lone linear, a flat ``nn.Sequential`` of linears) has one block per GEMM
site; a single module reached through single children (one block compiled on its own) has none. The blocks are numbered in data-flow order (networkx topological order of the block dependency graph,
ties by graph position) when the graph holds GEMMs of every block, so blocks called in another order than
they are defined are numbered as they run; otherwise in the order of their paths. Block A runs before
block B when a GEMM of B reads a value computed from a GEMM of A.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Callable, Optional

import networkx as nx
import torch.fx as fx

from fp4compile.contracts import broken, contract
from fp4compile.sites import CompileContext

# Whether GEMMs under these module paths run one after another (a stack) or side by side.
RunsInSequence = Callable[[list[str]], bool]


def _natural_key(path: str):
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in path.split(".")]


def _path(site) -> str:
    """The module path a site stands at: its name without the ``#k`` of a weight's k-th GEMM."""
    return site.name.split("#", 1)[0]


def _children(paths: set[str], parent: str) -> list[str]:
    depth = 0 if not parent else parent.count(".") + 1
    prefix = parent + "." if parent else ""
    kids = {p.split(".")[depth] for p in paths if p.startswith(prefix) and p != parent}
    return sorted((prefix + k for k in kids), key=_natural_key)


def _containers(paths: set[str], site_names: set[str], parent: str) -> list[str]:
    """Children of ``parent`` that hold GEMM sites below them (not GEMM sites themselves)."""
    return [k for k in _children(paths, parent) if any(s.startswith(k + ".") for s in site_names)]


def _is_list(kids: list[str]) -> bool:
    return len(kids) >= 2 and all(k.rsplit(".", 1)[-1].isdigit() for k in kids)


def _stack_members(paths, site_names, path, runs_in_sequence: RunsInSequence) -> Optional[list[str]]:
    """The members of the list that ``path`` leads to through single-container modules, if they run
    one after another; else None (``path`` is a block itself)."""
    while True:
        kids = _containers(paths, site_names, path)
        if len(kids) == 1:
            path = kids[0]
            continue
        return kids if _is_list(kids) and runs_in_sequence(kids) else None


def block_paths(
    site_names: list[str],
    runs_in_sequence: Optional[RunsInSequence] = None,
    classes: Optional[dict[str, str]] = None,
) -> list[str]:
    """Module paths of the blocks, in natural path order, for GEMM sites with these names.

    ``runs_in_sequence(paths)`` tells whether the sites under those module paths run one after another;
    without it every list is taken to be a stack. ``classes`` maps module paths to class names: named
    children repeated in their class are blocks; without it (or for a path it lacks) every named child
    is of a class of its own.
    """
    runs_in_sequence = runs_in_sequence or (lambda kids: True)
    classes = classes or {}
    names = set(site_names)
    paths = set()
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            paths.add(".".join(parts[:i]))
    node = ""
    while True:
        kids = _containers(paths, names, node)
        if not kids:
            # No module below holds GEMMs: a list of linears (a flat ``nn.Sequential``), or at the root any
            # linears, are one block each; a single module reached through single children is no stack.
            sites = [k for k in _children(paths, node) if k in names]
            if node == "" or all(k.rsplit(".", 1)[-1].isdigit() for k in sites):
                return sorted(sites, key=_natural_key)  # a list of linears, or linears at the root
            return [node] if node.rsplit(".", 1)[-1].isdigit() else []  # the one member of a list
        if len(kids) == 1:
            node = kids[0]
            continue
        if _is_list(kids):
            return kids
        out, single = [], []
        for kid in kids:
            members = _stack_members(paths, names, kid, runs_in_sequence)
            if members:
                out.extend(members)
            else:
                single.append(kid)
        counts = Counter(classes.get(kid, kid) for kid in single)
        out.extend(kid for kid in single if counts[classes.get(kid, kid)] > 1)
        return sorted(out, key=_natural_key)


@dataclasses.dataclass
class Placement:
    """Where blocks stand in the whole model: ``positions[block]`` and the whole model's ``n_blocks``;
    ``warning`` where the whole model's size had to be guessed."""

    positions: dict[str, int]
    n_blocks: int
    warning: Optional[str] = None


def model_positions(blocks: list[str], total_blocks: Optional[int] = None) -> Placement:
    """The positions of ``blocks`` (in execution order) among the whole model's blocks.

    A model that holds part of the blocks (a pipeline stage keeps the layer keys of the whole model:
    ``layers.4`` ... ``layers.7`` of 8) places its blocks by their keys, where they are the numbered
    members of one list; ``total_blocks`` (``Backend(total_blocks=...)``) states how many blocks the
    whole model has. Keys that do not start at 0 with no total stated place the blocks by their keys
    in a model of (largest key + 1) blocks, with a warning saying so. Otherwise the blocks are the
    whole model's, numbered in execution order.
    """
    in_order = {b: i for i, b in enumerate(blocks)}
    parents = {b.rpartition(".")[0] for b in blocks}
    keys = [b.rpartition(".")[2] for b in blocks]
    if total_blocks is not None and total_blocks < 1:
        raise ValueError(f"Backend(total_blocks={total_blocks}): the whole model's number of blocks must be positive")
    if not blocks or len(parents) != 1 or not all(k.isdigit() for k in keys):
        if total_blocks is not None and total_blocks != len(blocks):
            return Placement(in_order, len(blocks), (
                f"Backend(total_blocks={total_blocks}) cannot place the {len(blocks)} blocks found "
                f"({', '.join(blocks[:3])}{', ...' if len(blocks) > 3 else ''}): they are not the members of one "
                "list keyed by layer number, so they are numbered as the whole model's blocks"
            ))
        return Placement(in_order, len(blocks))
    numbers = {b: int(k) for b, k in zip(blocks, keys)}
    if total_blocks is not None:
        if max(numbers.values()) >= total_blocks:
            raise ValueError(
                f"Backend(total_blocks={total_blocks}) is smaller than the model's block keys: "
                f"{max(numbers, key=numbers.get)} is block {max(numbers.values())}"
            )
        return Placement(numbers, total_blocks)
    if sorted(numbers.values()) == list(range(len(blocks))):
        return Placement(in_order, len(blocks))
    guessed = max(numbers.values()) + 1
    parent = parents.pop()
    return Placement(numbers, guessed, (
        f"the blocks of this model are {parent}.{min(numbers.values())} ... {parent}.{max(numbers.values())}, "
        f"part of a larger model (a pipeline stage): they are planned as blocks of a model of {guessed} "
        "blocks, so the recipe's last blocks may be in another stage; state the whole model's number of "
        "blocks with fp4compile.Backend(total_blocks=...)"
    ))


class SiteDataFlow:
    """Which GEMM sites of a graph read values computed by which others.

    One pass over the graph in its (topological) order gives every node the set of sites upstream of
    it, kept as an integer bitset over the site indices.
    """

    def __init__(self, gm: fx.GraphModule, sites):
        # A site inside a region (a checkpointed function) counts as the region's node of this graph.
        bit: dict[str, int] = {}
        for i, s in enumerate(sites):
            bit[s.graph_node] = bit.get(s.graph_node, 0) | 1 << i
        upstream: dict[str, int] = {}
        for node in gm.graph.nodes:
            mask = 0
            for source in node.all_input_nodes:
                mask |= upstream[source.name] | bit.get(source.name, 0)
            upstream[node.name] = mask
        self.position = {n.name: i for i, n in enumerate(gm.graph.nodes)}
        self.sites = list(sites)
        self._index = {id(s): i for i, s in enumerate(self.sites)}
        self._upstream = upstream

    def members(self, path: str) -> list:
        return [s for s in self.sites if _path(s) == path or _path(s).startswith(path + ".")]

    def graph(self, paths: list[str]) -> nx.DiGraph:
        """Dependency graph of module paths: an edge A -> B when a GEMM under B reads one under A."""
        masks, upstream = {}, {}
        for path in paths:
            members = self.members(path)
            masks[path] = 0
            upstream[path] = 0
            for s in members:
                masks[path] |= 1 << self._index[id(s)]
                upstream[path] |= self._upstream[s.graph_node]
        graph = nx.DiGraph()
        graph.add_nodes_from(p for p in paths if masks[p])
        graph.add_edges_from(
            (a, b) for a in graph for b in graph if a != b and upstream[b] & masks[a]
        )
        return graph

    def first_position(self, path: str) -> int:
        members = self.members(path)
        return min(self.position[s.graph_node] for s in members) if members else len(self.position)

    def order(self, paths: list[str], graph: Optional[nx.DiGraph] = None) -> list[str]:
        """``paths`` (those holding sites of this graph) in data-flow order, ties by graph position
        (``graph``: their ``self.graph(paths)`` when the caller has it already)."""
        graph = self.graph(paths) if graph is None else graph
        if nx.is_directed_acyclic_graph(graph):
            return list(nx.lexicographical_topological_sort(graph, key=self.first_position))
        return sorted(graph, key=self.first_position)

    def runs_in_sequence(self, paths: list[str]) -> bool:
        """True when the paths' GEMMs form a chain: each (in data-flow order) reads the one before. Where
        the graph holds GEMMs of fewer than two of them (a block compiled on its own), it cannot tell,
        and a list is taken to be a stack."""
        graph = self.graph(paths)
        if len(graph) < 2:
            return True
        if not nx.is_directed_acyclic_graph(graph):
            return False
        ordered = self.order(paths, graph)
        return all(graph.has_edge(a, b) for a, b in zip(ordered, ordered[1:]))


def _ensures_blocks(gm: fx.GraphModule, ctx: CompileContext) -> None:
    if len(set(ctx.block_names)) != len(ctx.block_names) or len(ctx.block_names) > ctx.n_blocks:
        broken(f"{len(ctx.block_names)} block names for {ctx.n_blocks} blocks: {ctx.block_names[:4]}")
    where: dict = {}
    for site in ctx.sites:
        if site.block is None:
            continue
        if not 0 <= site.block < ctx.n_blocks:
            broken(f"site {site.name!r} is in block {site.block}, outside 0 .. {ctx.n_blocks - 1}")
        if where.setdefault(site.block_name, site.block) != site.block:
            broken(f"block {site.block_name!r} has two positions, {where[site.block_name]} and {site.block}")


@contract(after=("find_gemm_sites",), stages=("dynamo",), ensures=_ensures_blocks)
def find_blocks(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    if not ctx.sites:
        return gm
    flow = SiteDataFlow(gm, ctx.sites)
    model = ctx.model
    if model is not None:
        # The whole model's GEMM weights: a graph with part of the model numbers its blocks among all.
        names = list(dict.fromkeys([*model.gemm_weights, *map(_path, ctx.sites)]))
        classes = model.classes
    else:
        names, classes = list(dict.fromkeys(map(_path, ctx.sites))), _graph_classes(gm)
    paths = block_paths(names, flow.runs_in_sequence, classes)
    in_graph = [p for p in paths if flow.members(p)]
    # Data-flow order where this graph runs every block; the order of their paths otherwise.
    ordered = flow.order(paths) if len(in_graph) == len(paths) else paths

    def owner(name):
        for b in ordered:
            if name == b or name.startswith(b + "."):
                return b
        return None

    placed = model_positions(ordered, ctx.total_blocks)
    if placed.warning:
        ctx.warnings.append(("block positions", placed.warning))
    ordered = sorted(ordered, key=placed.positions.__getitem__)
    for site in ctx.sites:
        b = owner(_path(site))
        site.block, site.block_name = (placed.positions[b], b) if b is not None else (None, None)
    ctx.n_blocks = placed.n_blocks
    ctx.block_names = ordered
    ctx.note(f"graph {ctx.graph_id}: {ctx.n_blocks} blocks ({', '.join(ordered[:3])}{', ...' if len(ordered) > 3 else ''})")
    return gm


def _graph_classes(gm: fx.GraphModule) -> dict[str, str]:
    """Module path -> class name from the graph's module stacks (where the backend has no root model)."""
    from fp4compile.vocabulary import graph_root, module_path

    root = graph_root(gm)
    classes = {}
    for node in gm.graph.nodes:
        for qualified, cls in (node.meta.get("nn_module_stack") or {}).values():
            name = cls if isinstance(cls, str) else getattr(cls, "__qualname__", str(cls))
            classes.setdefault(module_path(qualified, root), name.rsplit(".", 1)[-1])
    return classes
