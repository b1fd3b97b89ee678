"""The kernel launches and bytes of an FP4 training step, modelled from the compiled graphs.

``Report.traffic()`` reads the final forward and backward graph of every compiled graph, costs each fp4
op node by what its CUDA implementation launches, and sums the costs per GEMM site and role (fprop,
dgrad, wgrad). Nothing runs: the costs come from the nodes' fake values (shapes, dtypes) and constant
arguments, so a CPU test can hold the counts of a change that adds or removes kernels.

A cost has four numbers: the non-GEMM kernel launches, the GEMM launches, and the bytes the non-GEMM
launches read and write (a GEMM's own reads and writes are not counted; the emulated GEMM's decode and
epilogue kernels are non-GEMM kernels). The zero-fill of an amax accumulator (the int32 buffer an amax
kernel's programs take their atomic maximum in) is a launch of its own: one per amax pass and per MXFP4
quantizer, counted with the launches. Bytes are those of the tensors the kernels stream (inputs,
codes, scales, decoded operands, an fp32 accumulator); 0-dim scalars (amaxes, alphas, seeds) are left
out, as are the few bytes those fills write and the copies of a given amax, which Inductor puts in small
kernels of its own.

The cost of a node is looked up in ``COSTS`` by (op, implementation): the implementation is the executor
table's choice recorded when the graph was compiled for a CUDA device (``CompileContext.kernels``;
``fp4.scaled_mm``: the kernel string's name, ``emulation`` or ``cutlass``); for a graph compiled
elsewhere, the CUDA one is assumed: ``triton`` for every kernel op, and ``fp4.scaled_mm``'s emulation as
CUDA runs a packed call (``fp4.decode_blocks`` of both operands, then ``fp4.emulated_mm`` by
``EMULATED_GEMM``). A graph compiled for the CPU keeps the CPU's forms (packed emulated GEMMs, each
quantizer's own amax pass, no decoded operands): its counts are those of its nodes on CUDA, not those of
the graph a CUDA compilation makes. A node whose (op, implementation) has no entry (the reference, which
runs PyTorch ops, a sharded quantizer's all-reduce) is listed as not modelled.

To add an implementation, add its entry: a function of the node's arguments by name (fake tensors for
tensors) and its output's fake value, returning a ``Cost``; e.g. a ``scaled_mm`` implementation
registered as "mine" that reads packed codes and scales itself, one launch and no other kernel::

    COSTS["scaled_mm", "mine"] = gemm_only
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Callable, Optional

import torch
import torch.fx as fx

from fp4compile.sites import ROLES, CompileContext, bound_arguments
from fp4compile.tables import columns

__all__ = ["Cost", "TrafficRow", "NodeTraffic", "COSTS", "EMULATED_GEMM", "GRAPH", "gemm_only", "node_traffic",
           "rows", "table"]

GRAPH = "(graph)"  # the row of nodes no single site's GEMM owns (``fp4.sr_base``)
# The implementation of ``fp4.emulated_mm`` assumed where a packed emulated GEMM runs on CUDA: torch.mm with
# an fp32 output, then the epilogue kernel (what the graphs hold; ``cublaslt`` puts alpha in the GEMM).
EMULATED_GEMM = "triton"
STAGES = ("forward", "backward")


@dataclasses.dataclass(frozen=True)
class Cost:
    """Non-GEMM kernel launches, GEMM launches, and the bytes the non-GEMM launches read and write."""

    launches: int = 0
    gemm_launches: int = 0
    bytes_read: int = 0
    bytes_written: int = 0

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


@dataclasses.dataclass(frozen=True)
class TrafficRow:
    """One row of ``Report.traffic()``: a site's role (``site`` "(graph)", ``role`` "": the graphs' own
    nodes), per training step."""

    site: str
    role: str
    launches: int
    gemm_launches: int
    bytes_read: int
    bytes_written: int


@dataclasses.dataclass(frozen=True)
class NodeTraffic:
    """One fp4 node's cost (``cost`` None: its implementation is not modelled)."""

    graph_id: int
    stage: str
    node: str
    op: str
    implementation: str
    site: str
    role: str
    cost: Optional[Cost]


# -- sizes from fake values ---------------------------------------------------------------------------

def _int(d) -> int:
    """A size, a symbolic one at its hint (the value it had where the graph was compiled)."""
    if isinstance(d, int):
        return d
    hint = getattr(getattr(d, "node", None), "hint", None)
    if hint is None:
        raise ValueError(f"fp4compile.traffic: the size {d} has no hint")
    return int(hint)


def numel(t: torch.Tensor) -> int:
    return math.prod(_int(d) for d in t.shape)


def nbytes(t: torch.Tensor) -> int:
    return numel(t) * t.element_size()


def _written(out) -> int:
    """The bytes of an op's tensor results, 0-dim ones (amaxes) left out."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return sum(nbytes(t) for t in outs if isinstance(t, torch.Tensor) and t.dim() > 0)


# -- the cost of each (op, implementation) ------------------------------------------------------------

def gemm_only(args: dict, out) -> Cost:
    """One GEMM launch that reads the operands as they are (packed FP4 codes and scales): no other kernel."""
    return Cost(gemm_launches=1)


_FILL = 1  # the launch that zero-fills an amax accumulator (its bytes left out)


def _quantizer(args: dict, out) -> Cost:
    """``quantize``, ``rht_quantize`` and their decoding forms (``fake_``) by the Triton kernels: NVFP4
    without a given amax zero-fills its amax accumulator and runs an amax pass (``fp4.rht_quantize``'s: of
    the transformed operand) before the quantizing pass, two reads of x; with one (the operand's own, as
    the graphs give it: the quantizing pass takes it as it is), the quantizing pass alone. MXFP4: the fill
    of the accumulator of the amax it reports, then one pass. Writes codes and scales, or the decoded
    BF16 operand."""
    if args["fmt"] == "mxfp4":
        return Cost(_FILL + 1, 0, nbytes(args["x"]), _written(out))
    if args.get("amax") is not None:
        return Cost(1, 0, nbytes(args["x"]), _written(out))
    return Cost(_FILL + 2, 0, 2 * nbytes(args["x"]), _written(out))


def _dual_quantizer(args: dict, out) -> Cost:
    """``fake_dual_quantize`` / ``dual_quantize``: one launch reads x and writes both decoded operands, or both
    operands' codes and scales (amaxes given)."""
    return Cost(1, 0, nbytes(args["x"]), _written(out))


def _dual_in_turn(args: dict, out) -> Cost:
    """``fake_dual_quantize`` / ``dual_quantize`` where the one-launch kernel declines: the two quantizers
    in turn, each one pass over x (amaxes given)."""
    return Cost(2, 0, 2 * nbytes(args["x"]), _written(out))


def _amax_pass(args: dict, out) -> Cost:
    """``wgrad_amax``: one fill of the accumulators of both amaxes, then one launch reads x (its results
    are two scalars)."""
    return Cost(_FILL + 1, 0, nbytes(args["x"]), 0)


def _packed_pass(args: dict, out) -> Cost:
    """``transpose_quantized``, ``decode_blocks``: one launch reads codes and scales, writes its results."""
    return Cost(1, 0, nbytes(args["data"]) + nbytes(args["scales"]), _written(out))


def _mm_then_epilogue(args: dict, out) -> Cost:
    """``emulated_mm`` by ``triton``: the GEMM writes an fp32 accumulator, the epilogue kernel reads it and
    writes the output (alpha computed inside)."""
    return Cost(1, 1, 4 * numel(out), nbytes(out))


def _alpha_then_gemm(args: dict, out) -> Cost:
    """``emulated_mm`` by ``cublaslt``: a one-element alpha kernel, then the GEMM with alpha in its epilogue."""
    return Cost(1, 1, 0, 0)


def _bf16_gemm(args: dict, out) -> Cost:
    """``emulated_mm`` by ``cuda-bf16`` (MXFP4): the GEMM to fp32, then a cast where the output is not fp32."""
    if out.dtype == torch.float32:
        return Cost(0, 1, 0, 0)
    return Cost(1, 1, 4 * numel(out), nbytes(out))


def _decoded(codes: torch.Tensor) -> torch.Tensor:
    """The fake BF16 operand ``decode_blocks`` makes of packed codes [..., K/2]."""
    return codes.new_empty((*codes.shape[:-1], codes.shape[-1] * 2), dtype=torch.bfloat16)


def _emulation(args: dict, out) -> Optional[Cost]:
    """``scaled_mm`` by ``emulation`` on CUDA (NVFP4, 2-D): ``decode_blocks`` of each operand, then
    ``emulated_mm`` by ``EMULATED_GEMM``. MXFP4 and batched operands decode with PyTorch ops: not modelled."""
    a, b = args["a"], args["b"]
    if args["fmt"] != "nvfp4" or a.dim() != 2 or b.dim() != 2:
        return None
    decodes = [_packed_pass({"data": c, "scales": s}, _decoded(c)) for c, s in ((a, args["a_scales"]), (b, args["b_scales"]))]
    return decodes[0] + decodes[1] + COSTS["emulated_mm", EMULATED_GEMM]({}, out)


def _sr_base(args: dict, out) -> Cost:
    """``sr_base``: one launch mixes the step's base with the graph's keys (int64 [2 * keys] read and written)."""
    return Cost(1, 0, 8 + nbytes(out), nbytes(out))


def _producer_amax(args: dict, out) -> Cost:
    """An amax ``fuse_amax`` has Inductor reduce in the kernel that produces the operand: the first stage
    there (no launch, no read of its own), the second a launch of its own over the partial maxima."""
    return Cost(1, 0, 0, 0)


def _record_amax(args: dict, out) -> Cost:
    """``record_amax``: the shifted history is concatenated, then copied back (two launches over it)."""
    h = nbytes(args["history"])
    return Cost(2, 0, 2 * h, 2 * h)


# (op, implementation) -> cost(arguments by name, output's fake value) -> Cost, or None where the arguments
# take a path that is not modelled. "eager": the op's only implementation.
COSTS: dict[tuple[str, str], Callable[[dict, object], Optional[Cost]]] = {
    ("quantize", "triton"): _quantizer,
    ("rht_quantize", "triton"): _quantizer,
    ("fake_quantize", "triton"): _quantizer,
    ("fake_rht_quantize", "triton"): _quantizer,
    ("fake_dual_quantize", "triton"): _dual_quantizer,
    ("dual_quantize", "triton"): _dual_quantizer,
    ("fake_dual_quantize", "unfused"): _dual_in_turn,
    ("dual_quantize", "unfused"): _dual_in_turn,
    ("wgrad_amax", "triton"): _amax_pass,
    ("transpose_quantized", "triton"): _packed_pass,
    ("decode_blocks", "triton"): _packed_pass,
    ("emulated_mm", "triton"): _mm_then_epilogue,
    ("emulated_mm", "cublaslt"): _alpha_then_gemm,
    ("emulated_mm", "cuda-bf16"): _bf16_gemm,
    ("scaled_mm", "emulation"): _emulation,
    ("scaled_mm", "cutlass"): gemm_only,
    ("scaled_mm", "triton"): gemm_only,
    ("packed_mm", "triton"): gemm_only,
    ("sr_base", "eager"): _sr_base,
    ("record_amax", "eager"): _record_amax,
    ("producer_amax", "inductor"): _producer_amax,
}

_KERNEL_OPS = frozenset(op for op, impl in COSTS if impl == "triton")  # the ops with executor-table entries


# -- which node, which site and role --------------------------------------------------------------

def _fp4_op(node: fx.Node) -> Optional[str]:
    """The op name of an fp4 op node ("quantize"), None for anything else and for ``fp4.gemm`` (a
    high-precision GEMM, or one not lowered)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    if target.namespace != "fp4" or target.overloadpacket.__name__ == "gemm":
        return None
    return target.overloadpacket.__name__


def _attributed(node: fx.Node, role_owner: dict) -> Optional[tuple[str, str]]:
    """(site, role) from the metadata the passes put on the node: a quantizer's ``fp4_quantize``, a
    GEMM's ``fp4_role``."""
    quantized = node.meta.get("fp4_quantize")
    if quantized and quantized.get("site"):
        return quantized["site"], quantized.get("role") or ""
    info = node.meta.get("fp4_role")
    if info is not None and id(info) in role_owner:
        return role_owner[id(info)], info.role
    return None


def _passes_through(node: fx.Node) -> bool:
    """getitem and views: the nodes between an unlabelled fp4 node and the labelled one it serves."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    return isinstance(node.target, torch._ops.OpOverload) and node.target.overloadpacket.__name__ in (
        "permute", "t", "view", "_unsafe_view", "reshape", "transpose", "alias", "slice", "convert_element_type")


def _owner(node: fx.Node, role_owner: dict, order: dict) -> Optional[tuple[str, str]]:
    """The (site, role) a node serves: its own labels; else those of the first labelled node that reads
    its result (through getitems and views: a decode's GEMM, an amax pass's quantizers); else those of
    the labelled node it reads (a recorded amax's quantizer); None where none tells (the graph's own)."""
    own = _attributed(node, role_owner)
    if own is not None:
        return own
    todo, seen, readers = list(node.users), set(), []
    while todo:
        user = todo.pop()
        if user in seen:
            continue
        seen.add(user)
        if _attributed(user, role_owner) is not None:
            readers.append(user)
        elif _passes_through(user):
            todo.extend(user.users)
    if readers:
        return _attributed(min(readers, key=order.__getitem__), role_owner)
    for arg in node.all_input_nodes:
        while _passes_through(arg) and arg.all_input_nodes:
            arg = arg.all_input_nodes[0]
        found = _attributed(arg, role_owner)
        if found is not None:
            return found
    return None


def _implementation(op: str, node: fx.Node, args: dict, chosen: dict) -> str:
    """The implementation that runs the node on CUDA: ``scaled_mm``'s kernel string; a kernel op's
    recorded choice where the graph was compiled for CUDA, else ``triton``; "eager" for the others."""
    if op == "scaled_mm":
        return str(args["kernel"]).split(":", 1)[0]
    if op not in _KERNEL_OPS:
        return "eager"
    first = next((v for v in args.values() if isinstance(v, torch.Tensor)), None)
    if first is not None and first.device.type == "cuda" and node.name in chosen:
        return chosen[node.name].removeprefix("in-graph ")
    return "triton"


def _value(arg):
    return arg.meta.get("val") if isinstance(arg, fx.Node) else arg


def _graph(ctx: CompileContext, stage: str) -> Optional[fx.Graph]:
    """The graph whose fp4 op nodes run: its snapshot before ``lower_kernels`` (which may put their
    kernels into it), without the nodes nothing reads, as the final graph is; else the final graph.
    Nodes the lowering adds (``fp4.sr_base``) come from the final graph."""
    snapshots = [g for g in ctx.graphs if g.stage == stage]
    lowered = [i for i, g in enumerate(snapshots) if g.pass_name == "lower_kernels"]
    if not lowered or lowered[-1] == 0:
        return ctx.final_graphs.get(stage)
    graph = snapshots[lowered[-1] - 1].graph()
    graph.eliminate_dead_code()
    return graph


def node_traffic(ctx: CompileContext) -> list[NodeTraffic]:
    """The cost of every fp4 op node of the final forward and backward graphs of one compiled graph, and
    of the amax reductions ``fuse_amax`` put in the operands' producers."""
    role_owner = {id(info): site.name for site in ctx.sites for info in site.roles.values()}
    out = []
    for stage in STAGES:
        graph = _graph(ctx, stage)
        if graph is None:
            continue
        chosen = {name: impl for s, name, _op, impl, _why in ctx.kernels if s == stage}
        nodes = list(graph.nodes)
        if graph is not ctx.final_graphs.get(stage):  # nodes the lowering added
            nodes += [n for n in ctx.final_graphs.get(stage, fx.Graph()).nodes if _fp4_op(n) == "sr_base"]
        order = {n: i for i, n in enumerate(nodes)}
        for node in nodes:
            op = _fp4_op(node)
            if op is None and node.meta.get("fp4_producer_amax"):  # marked by fuse_amax
                owner = _owner(node, role_owner, order) or (GRAPH, "")
                cost = COSTS["producer_amax", "inductor"]({}, node.meta.get("val"))
                out.append(NodeTraffic(ctx.graph_id, stage, node.name, "aten.amax", "inductor", *owner, cost))
                continue
            if op is None:
                continue
            args = {k: _value(v) for k, v in bound_arguments(node).items()}
            implementation = _implementation(op, node, args, chosen)
            entry = COSTS.get((op, implementation))
            cost = entry(args, node.meta.get("val")) if entry is not None else None
            owner = _owner(node, role_owner, order) or (GRAPH, "")
            out.append(NodeTraffic(ctx.graph_id, stage, node.name, f"fp4.{op}", implementation, *owner, cost))
    return out


def rows(contexts: list[CompileContext]) -> list[TrafficRow]:
    """Per site and role (sites in the graphs' order, then "(graph)"), the summed cost of its nodes."""
    return _rows(contexts, [node_traffic(ctx) for ctx in contexts])


def _rows(contexts: list[CompileContext], costed: list[list[NodeTraffic]]) -> list[TrafficRow]:
    """``rows`` from each context's ``node_traffic``."""
    sums: dict[tuple[str, str], Cost] = {}
    for ctx, items in zip(contexts, costed):
        for site in ctx.sites:
            for role in ROLES:
                key = (site.name, role)
                if role in site.roles and site.roles[role].precision != "high":
                    sums.setdefault(key, Cost())
        for item in items:
            if item.cost is not None:
                key = (item.site, item.role)
                sums[key] = sums.get(key, Cost()) + item.cost
    order = {(s.name, r): i for i, (s, r) in enumerate((s, r) for ctx in contexts for s in ctx.sites for r in ROLES)}
    keys = sorted(sums, key=lambda k: (k[0] == GRAPH, order.get(k, len(order)), k))
    return [TrafficRow(*key, *dataclasses.astuple(sums[key])) for key in keys]


def table(contexts: list[CompileContext]) -> str:
    """``rows`` as text, with a total row, then a line per op and implementation not modelled."""
    costed = [node_traffic(ctx) for ctx in contexts]
    found = _rows(contexts, costed)
    total = sum((Cost(r.launches, r.gemm_launches, r.bytes_read, r.bytes_written) for r in found), Cost())
    head = ("site", "role", "launches", "GEMM launches", "bytes read", "bytes written")
    body = [(r.site, r.role or "-", r.launches, r.gemm_launches, r.bytes_read, r.bytes_written) for r in found]
    lines = columns([head, *body, ("total", "", *dataclasses.astuple(total))], right=lambda _, cell: isinstance(cell, int),
                    total=True)
    unmodelled: dict = {}
    for items in costed:
        for item in items:
            if item.cost is None:
                unmodelled[(item.op, item.implementation)] = unmodelled.get((item.op, item.implementation), 0) + 1
    lines += [f"not modelled: {op} by {impl} ({n} nodes)" for (op, impl), n in sorted(unmodelled.items())]
    return "\n".join(lines)
