"""What the compiler decided, per GEMM site and per graph: ``backend.report`` (or ``fp4compile.explain``).

A ``Report`` answers, for the latest compilation of every graph dynamo captured:

- ``sites`` / ``precision_table()``: each GEMM site's precision, the rule that chose it, its three GEMMs
  (fprop, dgrad, wgrad) with shapes, RHT and rounding, and the kernel that runs them;
- ``graphs`` / ``graph(stage, pass_name)`` / ``diff(stage, pass_name)``: the graph after every pass;
- ``fx_graph(stage)`` / ``to_mlir(stage)``: the final rewritten forward/backward graph, as FX or as MLIR
  (torch dialect, through torch-mlir's FX importer);
- ``dataflow(stage)`` / ``to_dot(stage)`` / ``save_image(path, stage)``: the data flow of a final graph
  with quantize, RHT, FP4-GEMM and high-precision-GEMM nodes coloured;
- ``traffic()`` / ``traffic_table()``: per FP4 site and role, the kernel launches and bytes of a step on
  CUDA, modelled from the final graphs (``fp4compile.traffic``).

Stages are "dynamo" (the torch-level graph), "joint" (aot_autograd's joint forward-backward graph,
before its partition: what the forward and the backward share is planned there), "forward" and
"backward" (aot_autograd's ATen graphs).
"""

from __future__ import annotations

import dataclasses
import difflib
import operator
from typing import Optional

import networkx as nx
import torch
import torch.fx as fx

from fp4compile import ops, traffic
from fp4compile.tables import columns
from fp4compile.vocabulary import LINEAR_TARGETS, MATMUL_TARGETS, module_path
from fp4compile.recipe import HIGH, Recipe
from fp4compile.sites import ROLES, CompileContext, GemmSite, StageGraph, copy_graph, symbols

STAGES = ("dynamo", "joint", "forward", "backward")


@dataclasses.dataclass
class SiteView:
    """A GEMM site as the report shows it (one row of the precision table)."""

    name: str
    block: Optional[int]
    kind: str
    precision: str
    reason: str
    shapes: dict  # role -> (M, N, K)
    roles: dict  # role -> RoleInfo
    graph_id: int
    experts: Optional[int] = None  # a grouped site (MoE experts with one 3-D weight): E
    form: str = ""  # a grouped site's form as the model wrote it (grouped_mm, batched_mm, eager loop)

    @property
    def kernel(self) -> Optional[str]:
        kernels = sorted({r.kernel for r in self.roles.values() if r.kernel})
        return ", ".join(kernels) if kernels else None

    @property
    def kernel_reason(self) -> str:
        reasons = sorted({r.kernel_reason for r in self.roles.values() if r.kernel_reason})
        return "; ".join(reasons)


def _view(site: GemmSite) -> SiteView:
    return SiteView(
        site.name, site.block, site.kind, site.precision, site.reason,
        {role: info.shape for role, info in site.roles.items()}, dict(site.roles), site.graph_id,
        site.experts, site.form,
    )


def _role_cell(info) -> str:
    if info is None:
        return "-"
    tag = info.precision if info.precision != HIGH else "high"
    return tag + ("+rht" if info.rht else "") + ("+sr" if "sr" in info.rounding else "")


class Report:
    """Sites, precisions, kernels and per-pass graphs of a backend's compilations."""

    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        self.contexts: list[CompileContext] = []
        # What the compiler could not do as the recipe asks, one line per problem (``fp4compile.PlanWarning``).
        self.warnings: list[str] = []
        # FSDP2 all-gathers of FP4 weights, where ``fp4compile.enable_fp4_all_gather`` was called with this
        # backend: which weights gather in FP4 and the bytes per step (``fp4compile.fsdp.GatherStats``).
        self.all_gather = None
        # The quantization statistics the backend collects (``Backend.collect_stats``): ``stats()``.
        self.quant_stats = None

    def add_context(self, ctx: CompileContext) -> None:
        self.contexts.append(ctx)

    def __getstate__(self) -> dict:
        # Compilations hold graphs, fake tensors and caches that can be neither pickled nor copied: a
        # copy or an unpickled report keeps the recipe and no compilations (keep ``summary()`` or
        # ``precision_table()`` as text to save what they showed).
        return {"recipe": self.recipe, "contexts": [], "quant_stats": None}

    @property
    def latest(self) -> list[CompileContext]:
        """The latest compilation of each graph (recompiles replace earlier ones)."""
        by_graph = {}
        for ctx in self.contexts:
            by_graph[ctx.graph_id] = ctx
        return [by_graph[k] for k in sorted(by_graph)]

    @property
    def sites(self) -> list[SiteView]:
        return [_view(s) for ctx in self.latest for s in ctx.sites]

    @property
    def graphs(self) -> list[StageGraph]:
        """The graph after every pass (``pass_name`` "input": before the first), in compile order."""
        return [g for ctx in self.latest for g in ctx.graphs]

    @property
    def graph_ids(self) -> list[int]:
        return [ctx.graph_id for ctx in self.latest]

    @property
    def fallbacks(self) -> list[str]:
        return [f for ctx in self.latest for f in ctx.fallbacks]

    @property
    def n_blocks(self) -> int:
        return max((ctx.n_blocks for ctx in self.latest), default=0)

    # -- the precision plan --------------------------------------------------------------------

    def counts(self) -> dict:
        """Number of GEMMs (site x role that ran) per precision."""
        out: dict = {}
        for site in self.sites:
            for info in site.roles.values():
                out[info.precision] = out.get(info.precision, 0) + 1
        return out

    def flop_shares(self) -> dict:
        """Share of GEMM FLOPs per precision over every role-tagged GEMM with a known shape, and the products
        with a weight that are not sites (high precision). A symbolic size (a graph compiled with dynamic
        shapes) is counted at its size hint, the value it had in the inputs the graph was compiled for
        (``size_hints``)."""
        totals: dict = {}
        for ctx in self.latest:
            hints = ctx.size_hints()
            for site in ctx.sites:
                for info in site.roles.values():
                    flops = info.flops_at(hints)
                    if flops is not None:
                        totals[info.precision] = totals.get(info.precision, 0) + flops
        for ctx in self.latest:  # products with a weight that are not sites (nn.MultiheadAttention's)
            for other in ctx.other_gemms:
                if other.flops:
                    totals[HIGH] = totals.get(HIGH, 0) + other.flops
        total = sum(totals.values()) or 1
        return {k: v / total for k, v in totals.items()}

    def size_hints(self) -> dict[str, int]:
        """{symbol: size hint} of the symbolic GEMM sizes that ``flop_shares`` counts at their hints (empty
        where every GEMM shape is static)."""
        out: dict = {}
        for ctx in self.latest:
            hints = ctx.size_hints()
            for site in ctx.sites:
                for info in site.roles.values():
                    out.update({name: hints[name] for d in info.shape or () for name in symbols(d) if name in hints})
        return dict(sorted(out.items()))

    def kernels(self) -> dict:
        """(kernel, reason) -> number of FP4 GEMMs it runs."""
        out: dict = {}
        for site in self.sites:
            for info in site.roles.values():
                if info.kernel:
                    key = (info.kernel, info.kernel_reason)
                    out[key] = out.get(key, 0) + 1
        return out

    def quantizer_kernels(self) -> dict:
        """(op, implementation, reason) -> number of nodes: how each quantize, amax, transpose and decode
        node of the compiled graphs runs, as ``lower_kernels`` records it: the executor table's
        implementation ("in-graph triton": its kernels are in Inductor's code; otherwise the op runs as one
        call by that implementation) and the reason (why it stays a call, and which implementations were
        asked before it and declined, with theirs)."""
        out: dict = {}
        for ctx in self.latest:
            for _stage, _node, op, implementation, reason in ctx.kernels:
                key = (op, implementation, reason)
                out[key] = out.get(key, 0) + 1
        return out

    def traffic(self) -> list:
        """Per FP4 site and GEMM role, the kernel launches and bytes of one training step as modelled from the
        final forward and backward graphs (``fp4compile.traffic``): a list of ``TrafficRow`` (``site``,
        ``role``, ``launches`` and ``bytes_read`` / ``bytes_written`` of the non-GEMM kernels,
        ``gemm_launches``), then a "(graph)" row for the nodes no site owns. Each graph's forward and
        backward count once."""
        return traffic.rows(self.latest)

    def traffic_table(self) -> str:
        """``traffic()`` as a text table with a total row, then the nodes whose implementation is not modelled."""
        return traffic.table(self.latest)

    def precision_table(self) -> str:
        """One row per GEMM site, then fallbacks, kernels and the FP4 / high-precision totals (last line)."""
        rows = [("site", "block", "M x N x K (fprop)", *ROLES, "kernel", "reason")]
        for s in self.sites:
            shape = s.shapes.get("fprop")
            shape_text = " x ".join(str(d) for d in shape) if shape else "-"
            block = "-" if s.block is None else str(s.block)
            cells = [_role_cell(s.roles.get(role)) for role in ROLES]
            name = s.name if s.experts is None else f"{s.name} [{s.experts} experts, {s.form}]"
            rows.append((name, block, shape_text, *cells, s.kernel or "-", s.reason))
        lines = columns(rows)
        lines += [f"fallback: {f}" for f in self.fallbacks]
        lines += [f"warning: {w}" for w in self.warnings]
        lines += [f"kernel {name} ({n} GEMMs): {reason}" for (name, reason), n in sorted(self.kernels().items())]
        lines += [
            f"{op} ({n} nodes): {implementation}" + (f": {reason}" if reason else "")
            for (op, implementation, reason), n in sorted(self.quantizer_kernels().items())
        ]
        others = [o for ctx in self.latest for o in ctx.other_gemms]
        if others:
            lines.append(f"{len(others)} other matrix products (attention, scans, batched weights) run in high precision")
        lines += [
            f"graph {ctx.graph_id}: an unused gradient of {', '.join(ctx.grad_buffers)} reaches the backward "
            "in a buffer of the forward graph (no copy under CUDA graphs)"
            for ctx in self.latest if ctx.grad_buffers
        ]
        if getattr(self, "all_gather", None) is not None:
            lines += self.all_gather.lines()
        lines.append(self.summary())
        return "\n".join(lines)

    def summary(self) -> str:
        """The totals line: "N GEMM sites in B blocks; nvfp4: G GEMMs, x% of GEMM FLOPs; high precision: ...",
        and with dynamic shapes the size hints the FLOPs were counted at ("FLOPs at size hints s0=4")."""
        counts, shares = self.counts(), self.flop_shares()
        order = sorted(counts, key=lambda k: (k == HIGH, k))
        parts = [
            f"{'high precision' if k == HIGH else k}: {counts[k]} GEMMs, {100 * shares.get(k, 0):.1f}% of GEMM FLOPs"
            for k in order
        ]
        hints = self.size_hints()
        if parts and hints:
            parts.append("FLOPs at size hints " + ", ".join(f"{name}={value}" for name, value in hints.items()))
        head = f"{len(self.sites)} GEMM sites in {self.n_blocks} blocks"
        return "; ".join([head, *parts]) if parts else f"{head}; no GEMM has run yet"

    def __str__(self) -> str:
        return self.precision_table()

    # -- quantization statistics ---------------------------------------------------------------

    def stats(self, reduce: Optional[str] = "mean") -> list[dict]:
        """The quantization statistics of ``Backend.collect_stats`` (``fp4compile.quant_stats``): a list of
        dicts, one per FP4 site, GEMM role and operand with values recorded (``site``, ``layer``, ``role``,
        ``operand``, ``steps``, ``zero_fraction``, ``scale_saturated``, ``scale_underflow``,
        ``relative_error``, ``amax``), averaged over the recorded steps (``amax``: their maximum); with
        ``reduce="last"`` the latest step's; with ``reduce=None`` one row per recorded step (``step``).
        Empty where nothing was collected. Reading copies the buffers to the host (a sync)."""
        return self.quant_stats.rows(reduce) if self.quant_stats is not None else []

    def stats_table(self, reduce: Optional[str] = "mean") -> str:
        """``stats(reduce)`` as a text table, the largest relative error first."""
        from fp4compile import quant_stats

        return quant_stats.table(self.stats(reduce) if reduce is not None else self.stats("mean"))

    # -- graphs after each pass ----------------------------------------------------------------

    def _selected(self, stage: str, graph_id: Optional[int]) -> list[CompileContext]:
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
        contexts = [c for c in self.latest if graph_id is None or c.graph_id == graph_id]
        if graph_id is not None and not contexts:
            raise ValueError(f"no graph {graph_id}; the report has graphs {self.graph_ids}")
        contexts = [c for c in contexts if stage in c.final_graphs]
        if not contexts:
            hint = " (backward graphs exist once a compiled graph ran with gradients)" if stage == "backward" else ""
            raise ValueError(f"no {stage} graph was compiled{hint}")
        return contexts

    def pass_names(self, stage: str) -> list[str]:
        """The passes recorded for ``stage`` ("input" first: the graph before any pass)."""
        contexts = self._selected(stage, None)
        return [g.pass_name for g in contexts[0].graphs if g.stage == stage]

    def _snapshot(self, ctx: CompileContext, stage: str, pass_name: str) -> tuple[Optional[StageGraph], StageGraph]:
        """(the graph before ``pass_name``, the graph after it) in one compiled graph."""
        snapshots = [g for g in ctx.graphs if g.stage == stage]
        for before, after in zip([None, *snapshots], snapshots):
            if after.pass_name == pass_name:
                return before, after
        names = [g.pass_name for g in snapshots]
        raise ValueError(f"no pass {pass_name!r} in the {stage} pipeline of graph {ctx.graph_id}; passes: {names}")

    def graph(self, stage: str, pass_name: str, graph_id: Optional[int] = None) -> str:
        """The code of the ``stage`` graph after ``pass_name`` ("input": before the first pass).

        With several graphs (graph breaks) and no ``graph_id``, all of them, each under a header line.
        """
        contexts = self._selected(stage, graph_id)
        codes = [(c.graph_id, self._snapshot(c, stage, pass_name)[1].code) for c in contexts]
        if len(codes) == 1:
            return codes[0][1]
        return "\n".join(f"# graph {gid}\n{code}" for gid, code in codes)

    def diff(self, stage: str, pass_name: str, graph_id: Optional[int] = None, context: int = 3) -> str:
        """A unified diff of what ``pass_name`` changed in the ``stage`` graph ("" if nothing).

        Comment and blank lines (source locations) are left out: the diff shows nodes only.
        """
        out = []
        for ctx in self._selected(stage, graph_id):
            before, after = self._snapshot(ctx, stage, pass_name)
            if before is None:
                raise ValueError(f"{pass_name!r} is the {stage} graph before the first pass: nothing to diff")
            out.extend(difflib.unified_diff(
                _code_lines(before.code), _code_lines(after.code),
                fromfile=f"graph {ctx.graph_id} {stage} before {pass_name}",
                tofile=f"graph {ctx.graph_id} {stage} after {pass_name}", n=context,
            ))
        return "".join(out)

    # -- final graphs: FX, MLIR, data flow -----------------------------------------------------

    def fx_graph(self, stage: str = "forward", graph_id: Optional[int] = None) -> fx.Graph:
        """A copy of the final ``stage`` graph (after the last pass, as the inner compiler received it)."""
        contexts = self._selected(stage, graph_id)
        if len(contexts) > 1:
            raise ValueError(f"the report has several {stage} graphs {[c.graph_id for c in contexts]}: pass graph_id")
        return copy_graph(contexts[0].final_graphs[stage])

    def to_mlir(self, stage: str = "forward", graph_id: Optional[int] = None) -> str:
        """The final ``stage`` graph(s) as MLIR in torch-mlir's ``torch`` dialect, one ``func.func`` per
        graph named ``graph<id>_<stage>``.

        The fp4 custom ops have no torch-mlir definition, so they import as generic ops:
        ``torch.operator "torch.fp4.quantize"(...)``, ``"torch.fp4.rht"``, ``"torch.fp4.scaled_mm"``.
        This is the raw import; torch-mlir's lowerings (torch backend contract, linalg-on-tensors, TOSA,
        StableHLO) reject any ``torch.operator`` they cannot legalize, so they do not apply to these
        graphs. Parse the text back with a context that has the torch dialect registered.
        """
        if stage == "dynamo":
            raise ValueError("the dynamo graph calls torch functions, not ATen ops: MLIR import needs 'forward' or 'backward'")
        try:
            from torch_mlir import ir
            from torch_mlir.dialects import torch as torch_dialect
            from torch_mlir.extras.fx_importer import FxImporter
        except ImportError as exc:
            raise ImportError("Report.to_mlir needs torch-mlir: pip install 'fp4compile[mlir]'") from exc
        context = ir.Context()
        torch_dialect.register_dialect(context)
        importer = FxImporter(context=context)
        for ctx in self._selected(stage, graph_id):
            # The importer rewrites some nodes in place: give it a copy.
            importer.import_stateless_graph(copy_graph(ctx.final_graphs[stage]), func_name=f"graph{ctx.graph_id}_{stage}")
        return str(importer.module)

    def dataflow(self, stage: str = "backward", graph_id: Optional[int] = None, compact: bool = False):
        """The final ``stage`` graph(s) as a ``networkx.DiGraph`` of FX nodes (getitems folded into
        their producer). Node attributes: ``kind`` (see ``NODE_KINDS``), ``label``, ``color``,
        ``target``, ``site``, ``role``, ``graph_id``.

        ``compact=True`` keeps only quantize, RHT, GEMM and attention nodes, with an edge wherever data
        flows from one to another through the nodes left out.
        """
        contexts = self._selected(stage, graph_id)
        out = nx.DiGraph()
        for ctx in contexts:
            prefix = f"g{ctx.graph_id}." if len(contexts) > 1 else ""
            graph = _dataflow(ctx, stage, prefix)
            out.update(_compact(graph) if compact else graph)
        out.graph["name"] = stage if len(contexts) > 1 else f"graph{contexts[0].graph_id}_{stage}"
        return out

    def to_dot(self, stage: str = "backward", graph_id: Optional[int] = None, compact: bool = False) -> str:
        """The data flow of the final ``stage`` graph(s) as Graphviz DOT text, nodes filled by kind."""
        return _dot(self.dataflow(stage, graph_id, compact))

    def save_image(self, path, stage: str = "backward", graph_id: Optional[int] = None, compact: bool = True,
                   title: Optional[str] = None) -> None:
        """Draw the data flow of the final ``stage`` graph(s) to ``path`` (PNG, SVG or PDF by suffix)
        with matplotlib (no Graphviz needed): a layered layout, data flowing top to bottom. By default
        ``compact``: only quantize, RHT, GEMM and attention nodes, edges implied by longer paths left out."""
        graph = self.dataflow(stage, graph_id, compact)
        _draw(graph, path, title or f"{stage} graph{'' if compact else ' (all nodes)'}")


# ---------------------------------------------------------------------------------------------
# Data-flow graphs: classification, compaction, DOT and pictures
# ---------------------------------------------------------------------------------------------

# kind -> (fill colour, legend text)
NODE_KINDS = {
    "fp4_gemm": ("#d62828", "FP4 GEMM (fp4.scaled_mm)"),
    "high_gemm": ("#4a7fb5", "high-precision GEMM"),
    "quantize": ("#f4a261", "fp4.quantize"),
    "dequantize": ("#e9c46a", "fp4.dequantize"),
    "rht": ("#8e5ec9", "fp4.rht (random Hadamard)"),
    "rht_quantize": ("#c77dba", "fp4.rht_quantize (RHT fused into quantize)"),
    "attention": ("#a7c957", "attention"),
    "input": ("#e0e0e0", "graph input"),
    "output": ("#e0e0e0", "graph output"),
    "other": ("#f7f7f7", "other op"),
}
DARK_KINDS = ("fp4_gemm", "high_gemm", "rht")  # drawn with white text
KEY_KINDS = ("fp4_gemm", "high_gemm", "quantize", "dequantize", "rht", "rht_quantize", "attention")

STAGE_ROLES = {"dynamo": (), "joint": ("fprop", "dgrad", "wgrad"), "forward": ("fprop",), "backward": ("dgrad", "wgrad")}
_ATEN_GEMMS = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addbmm", "_scaled_mm")


def _code_lines(code: str) -> list[str]:
    return [line for line in code.splitlines(keepends=True) if line.strip() and not line.lstrip().startswith("#")]


def _op_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    return getattr(target, "__name__", str(target))


_KIND_BY_TARGET = {
    torch.ops.fp4.quantize.default: "quantize",
    torch.ops.fp4.dequantize.default: "dequantize",
    torch.ops.fp4.rht.default: "rht",
    torch.ops.fp4.rht_quantize.default: "rht_quantize",
    torch.ops.fp4.scaled_mm.default: "fp4_gemm",
    torch.ops.fp4.fake_quantize.default: "quantize",
    torch.ops.fp4.fake_rht_quantize.default: "rht_quantize",
    torch.ops.fp4.fake_dual_quantize.default: "rht_quantize",  # a gradient for dgrad and, with the RHT, wgrad
    torch.ops.fp4.dual_quantize.default: "rht_quantize",  # the same, packed
    torch.ops.fp4.emulated_mm.default: "fp4_gemm",
    torch.ops.fp4.cublaslt_mm.default: "fp4_gemm",  # an emulated GEMM cuBLASLt runs, its alpha in the graph
    torch.ops.fp4.packed_mm.default: "fp4_gemm",
    torch.ops.fp4.transpose_quantized.default: "quantize",  # the forward's quantized weight, for dgrad
    torch.ops.fp4.decode_blocks.default: "dequantize",
    ops.linear: "fp4_gemm",  # the dynamo graph's marked linears
    **{t: "high_gemm" for t in (*LINEAR_TARGETS, *MATMUL_TARGETS)},  # the dynamo graph's other GEMMs
}


def _kind(node: fx.Node) -> str:
    if node.op == "placeholder":
        return "input"
    if node.op == "output":
        return "output"
    if node.op != "call_function":
        return "other"
    if node.target in _KIND_BY_TARGET:
        return _KIND_BY_TARGET[node.target]
    if node.target is torch.ops.fp4.gemm.default:  # role-tagged, before lowering or kept high
        info = node.meta.get("fp4_role")
        return "fp4_gemm" if info is not None and info.precision != HIGH else "high_gemm"
    name = _op_name(node.target)
    if isinstance(node.target, torch._ops.OpOverload) and name in _ATEN_GEMMS:
        return "high_gemm"
    if "scaled_dot_product" in name or "attention" in name:
        return "attention"
    return "other"


def _module_site(node: fx.Node, site_names: set) -> Optional[str]:
    """The GEMM site a node was traced from (forward: nn_module_stack, backward: its forward's)."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    for qualified, _cls in reversed(list(stack.values())):
        path = module_path(qualified)
        if path in site_names:
            return path
    return None


def _role_by_shape(node: fx.Node, site: GemmSite, roles: tuple) -> Optional[str]:
    """The role (one of ``roles``) of a high-precision GEMM of ``site`` whose output [M, N] (or its
    transpose) matches exactly one role's shape. Where several match (a square output: dgrad's [M, K] and
    wgrad's [N, K] when M == N), the weight gradient is the one whose result is a graph output as it is
    (through views and transposes only) and the others are not; None when that does not tell either."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 2:
        return None
    out = tuple(val.shape)
    matches = [r for r, info in site.roles.items() if r in roles and info.shape and tuple(info.shape[:2]) in (out, out[::-1])]
    if len(matches) > 1 and "wgrad" in matches:
        matches = ["wgrad"] if _is_output_as_is(node) else [r for r in matches if r != "wgrad"]
    return matches[0] if len(matches) == 1 else None


_VIEW_OPS = {"t", "view", "_unsafe_view", "reshape", "permute", "transpose", "alias", "contiguous", "clone"}


def _is_output_as_is(node: fx.Node) -> bool:
    """Whether ``node``'s result is one of the graph's outputs, itself or through views and transposes."""
    todo, seen = [node], {node}
    while todo:
        for user in todo.pop().users:
            if user.op == "output":
                return True
            if user.op == "call_function" and _op_name(user.target) in _VIEW_OPS and user not in seen:
                seen.add(user)
                todo.append(user)
    return False


def _label(kind: str, node: fx.Node, attrs: dict) -> str:
    site, role, operand = attrs.get("site"), attrs.get("role"), attrs.get("operand")
    if kind in ("quantize", "rht_quantize"):
        q = node.meta.get("fp4_quantize", {})
        what = "RHT + quantize" if kind == "rht_quantize" else "quantize"
        if node.target in (torch.ops.fp4.fake_dual_quantize.default, torch.ops.fp4.dual_quantize.default):
            what = "quantize + RHT + quantize"
        if node.target is torch.ops.fp4.transpose_quantized.default:
            what = "transposed"
        return f"{what} {operand or ''}\n{q.get('block', '')} {q.get('rounding', '').upper()}".strip()
    if kind == "rht":
        return f"RHT {operand}" if operand else "RHT"
    if kind == "fp4_gemm":
        return f"FP4 {role or 'GEMM'}\n{site or ''}".strip()
    if kind == "high_gemm":
        name = _op_name(node.target)
        return f"{name} ({role + ', ' if role else ''}high)\n{site or ''}".strip()
    if kind == "attention":
        return "attention backward" if "backward" in _op_name(node.target) else "attention"
    if kind == "output":
        return "output"
    return node.name if kind == "input" else _op_name(node.target)


def _dataflow(ctx: CompileContext, stage: str, prefix: str):
    graph = ctx.final_graphs[stage]
    stage_roles = STAGE_ROLES[stage]
    sites = {s.name: s for s in ctx.sites}
    site_names = set(sites)
    role_owner = {id(info): site.name for site in ctx.sites for info in site.roles.values()}
    source = {}  # getitem node -> the node whose output it unpacks
    out = nx.DiGraph()
    for node in graph.nodes:
        if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            source[node] = source.get(node.args[0], node.args[0])
            continue
        kind = _kind(node)
        attrs = {"kind": kind, "target": str(node.target), "graph_id": ctx.graph_id, "site": None, "role": None,
                 "operand": None}
        info = node.meta.get("fp4_role")
        if info is not None:
            attrs["role"], attrs["site"] = info.role, role_owner.get(id(info))
        elif kind in ("quantize", "rht_quantize"):
            q = node.meta.get("fp4_quantize", {})
            attrs.update(site=q.get("site"), role=q.get("role"), operand=q.get("operand"))
        elif kind in ("high_gemm", "fp4_gemm"):
            index = node.meta.get("fp4_site")
            attrs["site"] = ctx.sites[index].name if index is not None else _module_site(node, site_names)
            if attrs["site"] is not None:
                attrs["role"] = _role_by_shape(node, sites[attrs["site"]], stage_roles)
        out.add_node(prefix + node.name, **attrs)
        for inp in node.all_input_nodes:
            out.add_edge(prefix + source.get(inp, inp).name, prefix + node.name)
    # An RHT belongs to the operand of the quantize it feeds.
    for name, attrs in out.nodes(data=True):
        if attrs["kind"] == "rht":
            for succ in out.successors(name):
                if out.nodes[succ]["kind"] == "quantize":
                    for key in ("site", "role", "operand"):
                        attrs[key] = out.nodes[succ][key]
    nodes = {prefix + n.name: n for n in graph.nodes}
    for name, attrs in out.nodes(data=True):
        attrs["label"] = _label(attrs["kind"], nodes[name], attrs)
        attrs["color"] = NODE_KINDS[attrs["kind"]][0]
    return out


def _compact(graph):
    """Only the KEY_KINDS nodes, joined wherever a path runs between them through other nodes."""
    out = nx.DiGraph()
    reaching: dict = {}  # node -> key nodes whose data reaches it through non-key nodes only
    for name in graph.nodes:  # FX order: topological
        sources = set().union(*(reaching[p] for p in graph.predecessors(name)))
        if graph.nodes[name]["kind"] in KEY_KINDS:
            out.add_node(name, **graph.nodes[name])
            out.add_edges_from((s, name) for s in sources)
            reaching[name] = {name}
        else:
            reaching[name] = sources
    return out


def _dot_quote(text: str) -> str:
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _dot(graph) -> str:
    lines = [
        f"digraph {_dot_quote(graph.graph.get('name', 'fp4compile'))} {{",
        "  rankdir=TB;",
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
        '  edge [color="#777777", arrowsize=0.6];',
    ]
    for name, attrs in graph.nodes(data=True):
        lines.append(
            f"  {_dot_quote(name)} [label={_dot_quote(attrs['label'])}, fillcolor={_dot_quote(attrs['color'])}, "
            f"fontcolor={_dot_quote('white' if attrs['kind'] in DARK_KINDS else 'black')}, "
            f"class={_dot_quote(attrs['kind'])}, tooltip={_dot_quote(attrs['target'])}];"
        )
    lines += [f"  {_dot_quote(u)} -> {_dot_quote(v)};" for u, v in graph.edges]
    lines.append("}")
    return "\n".join(lines) + "\n"


def _layers(graph) -> list[list]:
    """Rows for a layered drawing: longest path from the inputs, then every node moved down to just above
    its first consumer (weights and saved activations sit next to the GEMM that reads them); each row
    ordered by the mean position of its predecessors (fewer crossings)."""
    order = list(nx.topological_sort(graph))
    index = {n: i for i, n in enumerate(order)}
    row = {}
    for n in order:
        row[n] = max((row[p] + 1 for p in graph.predecessors(n)), default=0)
    for n in reversed(order):
        below = [row[s] for s in graph.successors(n)]
        if below:
            row[n] = min(below) - 1
    layers = [[] for _ in range(max(row.values(), default=-1) + 1)]
    for n in order:
        layers[row[n]].append(n)
    position = {}
    for i, layer in enumerate(layers):
        def key(n):
            preds = [position[p] for p in graph.predecessors(n)]
            return (sum(preds) / len(preds) if preds else 0.0, index[n])

        layer.sort(key=key)
        for j, n in enumerate(layer):
            position[n] = j - (len(layer) - 1) / 2
    return [layer for layer in layers if layer]


def _draw(graph, path, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    # Draw only the edges no longer path implies: a residual stream otherwise wires every GEMM to
    # every later one and hides the structure. (dataflow() and to_dot() keep every edge.)
    reduced = nx.transitive_reduction(graph)
    reduced.add_nodes_from(graph.nodes(data=True))
    layers = _layers(reduced)
    width = max((len(layer) for layer in layers), default=1)
    height = max(3.0, 0.62 * len(layers) + 0.4)
    fig = Figure(figsize=(max(7.0, 1.9 * width + 1.0), height + 1.0))
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0.01, 0.01, 0.98, height / (height + 1.0)))
    ax.set_axis_off()
    ax.set_xlim(-width / 2 - 0.1, width / 2 + 0.1)
    ax.set_ylim(-len(layers) + 0.5, 0.5)
    artists = {}
    for row, layer in enumerate(layers):
        for i, name in enumerate(layer):
            attrs = reduced.nodes[name]
            dark = attrs["kind"] in DARK_KINDS
            artists[name] = ax.text(
                i - (len(layer) - 1) / 2, -row, attrs["label"], ha="center", va="center", fontsize=8, zorder=3,
                color="white" if dark else "black", fontweight="bold" if attrs["kind"] == "fp4_gemm" else "normal",
                bbox=dict(boxstyle="round,pad=0.35", fc=attrs["color"], ec="#555555", lw=0.6),
            )
    for u, v in reduced.edges:
        ax.annotate(
            "", xy=(0.5, 1.0), xycoords=artists[v], xytext=(0.5, 0.0), textcoords=artists[u], zorder=1,
            arrowprops=dict(arrowstyle="-|>", color="#888888", lw=0.7, shrinkA=1, shrinkB=1, mutation_scale=8),
        )
    kinds = [k for k in NODE_KINDS if any(a["kind"] == k for _, a in reduced.nodes(data=True))]
    fig.legend(handles=[Patch(fc=NODE_KINDS[k][0], ec="#555555", label=NODE_KINDS[k][1]) for k in kinds],
               loc="upper center", bbox_to_anchor=(0.5, 1 - 0.45 / (height + 1.0)), ncol=min(len(kinds), 4),
               fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=11, y=1 - 0.1 / (height + 1.0), va="top")
    fig.savefig(path, dpi=110)
