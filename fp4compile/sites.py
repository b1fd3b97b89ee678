"""GEMM sites and the compile context the passes share."""

from __future__ import annotations

import dataclasses
import math
import operator
import logging
import re
from typing import Optional

import torch

from .recipe import HIGH, Recipe

log = logging.getLogger("fp4compile")

ROLES = ("fprop", "dgrad", "wgrad")


def copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A structural copy of ``graph`` (node metadata copied shallowly)."""
    copy = torch.fx.Graph()
    copy.output(copy.graph_copy(graph, {}))
    return copy


def example_tensor(node) -> Optional[torch.Tensor]:
    """The example tensor a graph node carries: dynamo's ``meta["example_value"]``, else the
    ``meta["val"]`` of aot_autograd's graphs; None for anything else."""
    if not isinstance(node, torch.fx.Node):
        return None
    value = node.meta.get("example_value")
    if value is None:
        value = node.meta.get("val")
    return value if isinstance(value, torch.Tensor) else None


def example_values(args) -> tuple:
    """``args`` with each graph node replaced by its example value (``meta["val"]``): the arguments
    with which an op's fake implementation gives a new node's metadata."""
    return tuple(a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args)


def bound_arguments(node: torch.fx.Node) -> dict:
    """An op node's arguments by name, in its schema's order, defaults filled in."""
    schema = node.target._schema
    values = dict(zip((a.name for a in schema.arguments), node.args))
    values.update(node.kwargs)
    for a in schema.arguments:
        if a.name not in values and a.has_default_value():
            values[a.name] = a.default_value
    return values


def set_arguments(node: torch.fx.Node, **changes) -> None:
    """Give the op node ``node`` the arguments ``changes``, by name; the others stay as they are (an
    argument the node holds by position keeps its place, as does one right after its positional ones;
    any other is given by keyword)."""
    names = [a.name for a in node.target._schema.arguments]
    args, kwargs = list(node.args), dict(node.kwargs)
    for name, value in changes.items():
        if name not in names:
            raise TypeError(f"{node.target} has no argument {name!r}; its arguments are {', '.join(names)}")
        i = names.index(name)
        if i < len(args):
            args[i] = value
        elif i == len(args) and name not in kwargs:
            args.append(value)
        else:
            kwargs[name] = value
    node.args, node.kwargs = tuple(args), kwargs


def call_unpacked(graph: torch.fx.Graph, target, args, outputs: int, kwargs: Optional[dict] = None) -> tuple:
    """(node, [getitem nodes 0 .. outputs-1]) for a multi-output op inserted at the graph's insert point,
    each with its ``meta["val"]`` from the op's fake implementation (the inputs' values are FakeTensors);
    ``kwargs``: constant keyword arguments."""
    kwargs = dict(kwargs or {})
    node = graph.call_function(target, tuple(args), kwargs)
    items = [graph.call_function(operator.getitem, (node, j)) for j in range(outputs)]
    node.meta["val"] = target(*example_values(args), **kwargs)
    for j, item in enumerate(items):
        item.meta["val"] = node.meta["val"][j]
    return node, items


def clone_dynamo_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of a graph module dynamo captured, sharing its parameters, that aot_autograd still reads as
    dynamo's: the module's ``meta`` and parameter sources and each placeholder's source travel with it.
    From them aot_autograd tells which inputs are parameters, which CUDA graphs then keep in place;
    without them every parameter is an input that each replay copies into the graph's own memory."""
    clone = torch.fx.GraphModule(gm, copy_graph(gm.graph))
    clone.meta.update(gm.meta)
    # The graphs of regions (a checkpointed function) are copied too: the passes rewrite them in place.
    for node in clone.graph.find_nodes(op="get_attr"):
        value = getattr(clone, node.target, None)
        if isinstance(value, torch.fx.GraphModule):
            setattr(clone, node.target, clone_dynamo_module(value))
    if hasattr(gm, "_param_name_to_source"):
        clone._param_name_to_source = gm._param_name_to_source
    for old, new in zip(gm.graph.find_nodes(op="placeholder"), clone.graph.find_nodes(op="placeholder")):
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    return clone


@dataclasses.dataclass
class RoleInfo:
    """One of a site's three GEMMs. ``shape`` is (M, N, K) of C[M, N] = A[M, K] @ B[N, K]^T."""

    role: str
    precision: str = HIGH
    reason: str = ""
    shape: Optional[tuple] = None
    kernel: Optional[str] = None
    kernel_reason: str = ""
    rht: bool = False
    rounding: tuple = ()  # (operand A rounding, operand B rounding)
    blocks: tuple = ()  # (operand A block, operand B block)

    @property
    def flops(self) -> Optional[int]:
        """2*M*N*K; None while a dim is symbolic (dynamic shapes record it as text)."""
        return self.flops_at({})

    def flops_at(self, hints: dict) -> Optional[int]:
        """2*M*N*K with each symbolic dim read at ``hints`` ({symbol: value}, ``size_at``); None where a
        dim's symbols have no hint there."""
        if not self.shape:
            return 0
        dims = [size_at(d, hints) for d in self.shape]
        if None in dims:
            return None
        m, n, k = dims
        return 2 * m * n * k


def size_at(dim, hints: dict) -> Optional[int]:
    """A size as the report records it, an int or a symbolic expression as text ("16*s0"), with the
    symbols read at ``hints`` ({symbol name: value}); None where one has no value there."""
    if isinstance(dim, int):
        return dim
    names = set(symbols(dim))
    if not names or not names <= hints.keys():
        return None
    import sympy

    try:
        value = sympy.sympify(str(dim), locals={name: sympy.Integer(hints[name]) for name in names})
    except (sympy.SympifyError, SyntaxError, TypeError):
        return None
    return int(value) if getattr(value, "is_Integer", False) else None


def symbols(dim) -> list[str]:
    """The symbols a size recorded as text reads ("16*s0" -> ["s0"]); none for an int."""
    return [] if isinstance(dim, int) else re.findall(r"\b[a-z]+\d+\b", str(dim))


@dataclasses.dataclass
class GemmSite:
    """A GEMM of the model with a parameter operand: a linear layer, or a matmul with a parameter.

    ``name`` is the module path (for a matmul, the owning module's path and the parameter name),
    ``block`` the index of the block it belongs to (None outside blocks), ``precision`` the format its
    GEMMs run in ("nvfp4", "mxfp4" or "high"), ``reason`` the rule that decided it.
    """

    index: int
    name: str
    kind: str  # "linear", "matmul", "addmm", "activation_matmul", or "grouped_mm"/"batched_mm" (grouped)
    module_type: str
    in_features: int
    out_features: int
    input_shape: tuple
    has_bias: bool
    node_name: str
    graph_id: int = 0
    # The node of the graph's top level that computes it: a checkpointed region's node for a site inside
    # that region (``node_name`` is then a node of the region's graph), None for a site at the top level.
    region: Optional[str] = None
    # A grouped site (MoE experts with one 3-D weight [E, N, K]): the number of experts E, and the form the
    # model computes it in ("grouped_mm", "batched_mm", Hugging Face's eager loop); None and "" otherwise.
    experts: Optional[int] = None
    form: str = ""
    block: Optional[int] = None
    block_name: Optional[str] = None
    precision: str = HIGH
    reason: str = ""
    roles: dict = dataclasses.field(default_factory=dict)

    def set_precision(self, precision: str, reason: str) -> None:
        """Set the site's precision; passes call this and say why (shown in reports)."""
        if precision not in ("nvfp4", "mxfp4", HIGH):
            raise ValueError(f"{self.name}: precision must be 'nvfp4', 'mxfp4' or 'high', got {precision!r}")
        self.precision = precision
        self.reason = reason

    @property
    def graph_node(self) -> str:
        """The node of the graph's top level that computes this site (itself, or its region)."""
        return self.region or self.node_name

    @property
    def is_low_precision(self) -> bool:
        return self.precision != HIGH

    @property
    def tokens(self):
        """Rows the GEMM reads; text such as "s0*s1" when a dim is symbolic (int() would add a shape guard)."""
        dims = self.input_shape[:-1]
        if all(isinstance(d, int) for d in dims):
            return math.prod(dims)
        return "*".join(str(d) for d in dims)


class _NodeRef:
    """A graph node named in a snapshot's arguments (kept apart from string arguments)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


class StageGraph:
    """A snapshot of a graph after a pass: ``stage`` is "dynamo", "forward" or "backward"; ``code`` is the
    graph's readable code (``GraphModule.print_readable``).

    The snapshot keeps each node's op, name, target, arguments (graph nodes by name), type and a shallow
    copy of its metadata, and builds the graph and renders ``code`` when it is first read: generating the
    code at every pass of every graph was about a second of each compile, and copying the graph itself
    (``copy_graph``) a second again on a 12-layer GPT, for text that only the reports and
    ``FP4COMPILE_PRINT_IR_AFTER`` read. The graph built from the record is the one ``copy_graph`` makes.
    """

    def __init__(self, graph_id: int, stage: str, pass_name: str, gm: torch.fx.GraphModule):
        self.graph_id = graph_id
        self.stage = stage
        self.pass_name = pass_name
        ref = lambda n: _NodeRef(n.name)  # noqa: E731
        self._nodes = []
        # The attributes and submodules the graph's nodes name, as they are now (not the module itself: a
        # later pass or the inner compiler may change it).
        self._attrs = {}
        for n in gm.graph.nodes:
            args, kwargs = torch.fx.node.map_arg(n.args, ref), torch.fx.node.map_arg(n.kwargs, ref)
            self._nodes.append((n.op, n.name, n.target, args, kwargs, n.type, dict(n.meta)))
            if n.op in ("get_attr", "call_module"):
                self._attrs[n.target] = operator.attrgetter(n.target)(gm)
        self._class_name = type(gm).__name__
        self._code: Optional[str] = None

    def graph(self) -> torch.fx.Graph:
        """The recorded graph, built anew at each call as ``copy_graph`` copies one (the output node
        without metadata; node metadata copied shallowly when the pass ran)."""
        graph = torch.fx.Graph()
        nodes: dict = {}
        node_of = lambda a: nodes[a.name] if isinstance(a, _NodeRef) else a  # noqa: E731
        for op, name, target, args, kwargs, type_expr, meta in self._nodes:
            args = torch.fx.node.map_aggregate(args, node_of)
            if op == "output":
                graph.output(args[0])
                break
            node = graph.create_node(op, target, args, torch.fx.node.map_aggregate(kwargs, node_of), name, type_expr)
            node.meta = meta
            nodes[name] = node
        return graph

    @property
    def code(self) -> str:
        if self._code is None:
            module = torch.fx.GraphModule(self._attrs, self.graph(), class_name=self._class_name)
            self._code = module.print_readable(print_output=False)
        return self._code

    def __repr__(self) -> str:
        return f"StageGraph(graph_id={self.graph_id}, stage={self.stage!r}, pass_name={self.pass_name!r})"


class CompileContext:
    """What the passes of one compiled graph share: the recipe, the GEMM sites and the log of changes."""

    def __init__(self, recipe: Recipe, graph_id: int, model=None, parameter_names: Optional[dict] = None):
        self.recipe = recipe
        self.graph_id = graph_id
        # The root model's names and structure (``model_structure.ModelStructure``), where the backend knows
        # the model; ``parameter_names`` maps the graph's parameter placeholders to their names in it.
        self.model = model
        self.parameter_names: dict[str, str] = dict(parameter_names or {})
        # What the compiler could not plan as the recipe asks: (key, line), one per problem (``check_plan``).
        self.warnings: list[tuple[str, str]] = []
        # Calls the passes cannot see into (``find_gemm_sites``): (node name, what, module path).
        self.opaque: list[tuple] = []
        self.sites: list[GemmSite] = []
        self.n_blocks = 0  # the whole model's blocks (``find_blocks``), also where the graph holds some
        self.block_names: list[str] = []
        self.total_blocks: Optional[int] = None  # the whole model's number of blocks, where stated
        self.graphs: list[StageGraph] = []
        self.final_graphs: dict[str, torch.fx.Graph] = {}  # stage -> graph after the latest pass
        self.fallbacks: list[str] = []
        # The backend's quantization statistics (``fp4compile.quant_stats``) where this graph records them
        # (``Backend.collect_stats``); else None.
        self.quant_stats = None
        self.other_gemms: list = []  # matrix products that are not GEMM sites (find_gemm_sites)
        # The sharded-amax declarations as the compilation started (``distributed.snapshot``): the backward
        # passes, which run at the first backward, see the ones the forward saw.
        from fp4compile import distributed

        self.sharded_amax = distributed.snapshot()
        self.grad_buffers: list[str] = []  # outputs given a buffer for an unused gradient (grad_buffers)
        self.pass_seconds: dict[tuple[str, str], float] = {}  # (stage, pass) -> time spent (run_passes)
        self.inner: Optional[str] = None  # the compiler the graphs go to: "inductor" or "eager"
        self.cuda_graphs = False  # whether Inductor records the graphs in CUDA graphs
        # (stage, node, op, implementation, why not the in-graph kernels) of every kernel op (lower_kernels)
        self.kernels: list[tuple[str, str, str, str, str]] = []
        # The backend's activation ranges (``fp4compile.ranges``) where this graph records them: compiled
        # with gradients enabled and ``Recipe.amax_history`` > 0; else None.
        self.ranges = None
        # The shape environment of a graph with symbolic sizes (dynamic shapes): ``size_hints``.
        self.shape_env = None

    def size_hints(self) -> dict[str, int]:
        """{symbol: size hint} of the graph's symbolic sizes: the value each had in the inputs the graph
        was compiled for."""
        if self.shape_env is None:
            return {}
        env = self.shape_env
        values = getattr(env, "backed_var_to_val", None)
        values = env.var_to_val if values is None else values  # older torch
        return {str(symbol): int(value) for symbol, value in values.items()}

    @property
    def stage(self) -> str:
        """The stage whose graph the passes are rewriting: "dynamo", "joint", "forward" or "backward"."""
        return self.graphs[-1].stage if self.graphs else "dynamo"

    def note(self, message: str) -> None:
        log.info("fp4compile: %s", message)

    def fallback(self, site: GemmSite, role: str, reason: str) -> None:
        """A GEMM kept in high precision for a reason other than the policy: logged and reported."""
        message = f"{site.name} {role}: kept in high precision: {reason}"
        self.fallbacks.append(message)
        log.warning("fp4compile: %s", message)

    def record(self, stage: str, pass_name: str, gm: torch.fx.GraphModule) -> None:
        """Keep the graph's code after a pass (for reports and diffs)."""
        self.graphs.append(StageGraph(self.graph_id, stage, pass_name, gm))

    def keep_final(self, stage: str, gm: torch.fx.GraphModule) -> None:
        """Keep a copy of the graph our passes produced: the inner compiler (Inductor's post-grad
        passes) may rewrite ``gm`` in place afterwards."""
        self.final_graphs[stage] = copy_graph(gm.graph)
