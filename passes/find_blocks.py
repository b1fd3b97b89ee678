"""find_blocks: group GEMM sites into the model's blocks and order the blocks by data flow.

Requires: ``find_gemm_sites`` (sites with module stacks).
Guarantees: ``site.block`` / ``site.block_name`` set for every site inside a block (None outside, e.g.
lm_head), ``ctx.n_blocks`` and ``ctx.block_names`` in execution order.

Blocks come from the module hierarchy: descend from the root through modules with a single child that
holds GEMM sites; at the first module with several such children, those children are the blocks, and a
child that is itself a stack (it leads to several children of one class, like ``encoder.layers``) is
expanded into its members. Blocks need not live in one ModuleList, nor be of one class (hybrid stacks).
A model without any nesting (a flat ``nn.Sequential`` of linears) has one block per GEMM site.
The blocks are ordered by data flow (networkx topological order of the block dependency graph, ties by
graph position), not by name, so models that call their blocks in another order than they are defined
are numbered as they run.
"""

from __future__ import annotations

import networkx as nx
import torch.fx as fx

from fp4compile.sites import CompileContext


def _children(paths: set[str], parent: str) -> list[str]:
    depth = 0 if not parent else parent.count(".") + 1
    prefix = parent + "." if parent else ""
    kids = {p.split(".")[depth] for p in paths if p.startswith(prefix) and p != parent}
    return sorted((prefix + k for k in kids), key=_natural_key)


def _natural_key(path: str):
    return [int(t) if t.isdigit() else t for t in path.split(".")]


def _is_container(paths: set[str], site_names: set[str], path: str) -> bool:
    """A module that holds GEMM sites below it (not just a GEMM site itself)."""
    prefix = path + "."
    return any(s.startswith(prefix) for s in site_names)


def _stack_members(paths, site_names, types, path):
    """If ``path`` leads (through single-container modules) to >= 2 containers of one class, those."""
    while True:
        kids = [k for k in _children(paths, path) if _is_container(paths, site_names, k)]
        if len(kids) == 1:
            path = kids[0]
            continue
        if len(kids) >= 2 and len({types.get(k) for k in kids}) == 1 and types.get(kids[0]) is not None:
            return kids
        return None


def block_paths(site_names: list[str], types: dict[str, str]) -> list[str]:
    """Module paths of the blocks (unordered) for sites with these names."""
    names = set(site_names)
    paths = set()
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            paths.add(".".join(parts[:i]))
    node = ""
    while True:
        kids = [k for k in _children(paths, node) if _is_container(paths, names, k)]
        if not kids:
            return sorted(names, key=_natural_key) if node == "" else [node]
        if len(kids) == 1:
            node = kids[0]
            continue
        out = []
        for kid in kids:
            out.extend(_stack_members(paths, names, types, kid) or [kid])
        return out


def find_blocks(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    if not ctx.sites:
        return gm
    model_names = getattr(ctx, "model_site_names", None)
    blocks = block_paths(model_names or [s.name for s in ctx.sites], getattr(ctx, "module_types", {}))

    def owner(name):
        for b in blocks:
            if name == b or name.startswith(b + "."):
                return b
        return None

    # Data flow between blocks: block A -> block B when a GEMM of B consumes a value derived from A.
    position = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    graph = nx.DiGraph()
    graph.add_nodes_from(n.name for n in gm.graph.nodes)
    graph.add_edges_from((u.name, n.name) for n in gm.graph.nodes for u in n.all_input_nodes)
    present = {}
    for site in ctx.sites:
        b = owner(site.name)
        if b is not None:
            present.setdefault(b, []).append(site.node_name)
    order_graph = nx.DiGraph()
    order_graph.add_nodes_from(present)
    for b, members in present.items():
        ancestors = set().union(*(nx.ancestors(graph, m) for m in members))
        for other, other_members in present.items():
            if other != b and ancestors.intersection(other_members):
                order_graph.add_edge(other, b)
    first_seen = {b: min(position[m] for m in members) for b, members in present.items()}
    if nx.is_directed_acyclic_graph(order_graph):
        ordered = list(nx.lexicographical_topological_sort(order_graph, key=lambda b: first_seen[b]))
    else:
        ordered = sorted(present, key=first_seen.get)
    if model_names:
        # Blocks known from the whole model (graph breaks): keep the model's numbering.
        ordered = [b for b in blocks]
    index = {b: i for i, b in enumerate(ordered)}
    for site in ctx.sites:
        b = owner(site.name)
        site.block, site.block_name = (index.get(b), b) if b is not None else (None, None)
    ctx.n_blocks = len(ordered)
    ctx.block_names = ordered
    ctx.note(f"graph {ctx.graph_id}: {ctx.n_blocks} blocks ({', '.join(ordered[:3])}{', ...' if len(ordered) > 3 else ''})")
    return gm
