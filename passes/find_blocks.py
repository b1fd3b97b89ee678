"""find_blocks: group GEMM sites into the model's blocks and order the blocks by data flow.

Requires: ``find_gemm_sites`` (sites named by module path).
Guarantees: ``site.block`` / ``site.block_name`` set for every site inside a block (None outside, e.g.
lm_head), ``ctx.n_blocks`` and ``ctx.block_names`` in execution order.

Blocks come from the module hierarchy and the data flow between GEMM sites:

- descend from the root through modules with a single child that holds GEMM sites;
- at the first module with several such children: if they are the members of a list (integer names, as
  in an ``nn.ModuleList`` or ``nn.Sequential``), they are the blocks, whatever their classes (hybrid
  stacks of Mamba, attention and MLP blocks);
- otherwise (named children, such as ``encoder`` and ``decoder``, or blocks kept as separate attributes)
  each child is a block, unless it leads, through single-child modules, to a list whose members run one
  after another; then those members are blocks (``encoder.layers.0`` ...). A list whose members run side
  by side (MoE experts, per-head projections) is part of a block, not a stack of blocks.

A model without any nesting (a flat ``nn.Sequential`` of linears) has one block per GEMM site.
The blocks are numbered in data-flow order (networkx topological order of the block dependency graph,
ties by graph position), not by name, so blocks called in another order than they are defined are
numbered as they run. Block A runs before block B when a GEMM of B reads a value computed from a GEMM
of A. Blocks that a graph break puts in another graph are numbered within their own graph.
"""

from __future__ import annotations

from typing import Callable, Optional

import networkx as nx
import torch.fx as fx

from fp4compile.sites import CompileContext

# Whether GEMMs under these module paths run one after another (a stack) or side by side.
RunsInSequence = Callable[[list[str]], bool]


def _natural_key(path: str):
    return [int(t) if t.isdigit() else t for t in path.split(".")]


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


def block_paths(site_names: list[str], runs_in_sequence: Optional[RunsInSequence] = None) -> list[str]:
    """Module paths of the blocks, in natural path order, for GEMM sites with these names.

    ``runs_in_sequence(paths)`` tells whether the sites under those module paths run one after another;
    without it every list is taken to be a stack.
    """
    runs_in_sequence = runs_in_sequence or (lambda kids: True)
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
            return sorted(names, key=_natural_key) if node == "" else [node]
        if len(kids) == 1:
            node = kids[0]
            continue
        if _is_list(kids):
            return kids
        out = []
        for kid in kids:
            out.extend(_stack_members(paths, names, kid, runs_in_sequence) or [kid])
        return out


class SiteDataFlow:
    """Which GEMM sites of a graph read values computed by which others.

    One pass over the graph in its (topological) order gives every node the set of sites upstream of
    it, kept as an integer bitset over the site indices.
    """

    def __init__(self, gm: fx.GraphModule, sites):
        bit = {s.node_name: 1 << i for i, s in enumerate(sites)}
        upstream: dict[str, int] = {}
        for node in gm.graph.nodes:
            mask = 0
            for source in node.all_input_nodes:
                mask |= upstream[source.name] | bit.get(source.name, 0)
            upstream[node.name] = mask
        self.position = {n.name: i for i, n in enumerate(gm.graph.nodes)}
        self.sites = list(sites)
        self._bit = bit
        self._upstream = upstream

    def members(self, path: str) -> list:
        return [s for s in self.sites if s.name == path or s.name.startswith(path + ".")]

    def graph(self, paths: list[str]) -> nx.DiGraph:
        """Dependency graph of module paths: an edge A -> B when a GEMM under B reads one under A."""
        masks, upstream = {}, {}
        for path in paths:
            members = self.members(path)
            masks[path] = sum(self._bit[s.node_name] for s in members)
            upstream[path] = 0
            for s in members:
                upstream[path] |= self._upstream[s.node_name]
        graph = nx.DiGraph()
        graph.add_nodes_from(p for p in paths if masks[p])
        graph.add_edges_from(
            (a, b) for a in graph for b in graph if a != b and upstream[b] & masks[a]
        )
        return graph

    def first_position(self, path: str) -> int:
        return min(self.position[s.node_name] for s in self.members(path))

    def order(self, paths: list[str], graph: Optional[nx.DiGraph] = None) -> list[str]:
        """``paths`` (those holding sites of this graph) in data-flow order, ties by graph position
        (``graph``: their ``self.graph(paths)`` when the caller has it already)."""
        graph = self.graph(paths) if graph is None else graph
        if nx.is_directed_acyclic_graph(graph):
            return list(nx.lexicographical_topological_sort(graph, key=self.first_position))
        return sorted(graph, key=self.first_position)

    def runs_in_sequence(self, paths: list[str]) -> bool:
        """True when the paths' GEMMs form a chain: each (in data-flow order) reads the one before."""
        graph = self.graph(paths)
        if len(graph) < 2 or not nx.is_directed_acyclic_graph(graph):
            return False
        ordered = self.order(paths, graph)
        return all(graph.has_edge(a, b) for a, b in zip(ordered, ordered[1:]))


def find_blocks(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    if not ctx.sites:
        return gm
    model_names = ctx.model_site_names
    if model_names:
        # Blocks known from the whole model (graph breaks): keep the model's numbering.
        ordered = block_paths(model_names)
    else:
        flow = SiteDataFlow(gm, ctx.sites)
        ordered = flow.order(block_paths([s.name for s in ctx.sites], flow.runs_in_sequence))

    def owner(name):
        for b in ordered:
            if name == b or name.startswith(b + "."):
                return b
        return None

    index = {b: i for i, b in enumerate(ordered)}
    for site in ctx.sites:
        b = owner(site.name)
        site.block, site.block_name = (index[b], b) if b is not None else (None, None)
    ctx.n_blocks = len(ordered)
    ctx.block_names = ordered
    ctx.note(f"graph {ctx.graph_id}: {ctx.n_blocks} blocks ({', '.join(ordered[:3])}{', ...' if len(ordered) > 3 else ''})")
    return gm
