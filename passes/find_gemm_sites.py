"""find_gemm_sites: locate every GEMM with a parameter operand in the dynamo graph.

Requires: a torch-level FX graph from dynamo (parameters as placeholders or get_attr nodes,
``nn_module_stack`` metadata on call nodes).
Guarantees: ``ctx.sites`` lists one ``GemmSite`` per GEMM that ``fp4.linear`` can compute, in graph order:

- ``linear``: ``F.linear(x, W, b)`` (``nn.Linear``);
- ``matmul``: ``x @ B`` / ``torch.matmul`` / ``torch.mm`` whose 2-D right operand ``B`` [in, out] reads a
  parameter, directly or through a transpose or a cast (``x @ W``, ``x @ W.T``, ``x @ W.to(dtype)``);
- ``addmm``: ``torch.addmm(b, x, W)`` with a 2-D ``x``, such a ``W`` [in, out] and a bias ``b`` [out], at
  ``beta = alpha = 1`` (Hugging Face's ``Conv1D``, used by GPT-2, is ``addmm(bias, x, weight)``).

Each site's node has ``node.meta["fp4_site"]`` = the site index. A site is named by its weight's qualified
name in the root model without ``.weight`` (``layers.3.attention.wq``), whichever of these forms reaches
it (``ctx.parameter_names``, from the backend; without a root model, from dynamo's sources). A tied weight
is named after the module whose call computes the GEMM where it is that module's own. Names are unique:
a weight used by several GEMMs of a graph names the second ``<name>#2`` and so on, so every site has
stochastic-rounding streams of its own. Block membership is left to ``find_blocks``.

Regions are seen through: GEMMs inside an activation-checkpointed function (``torch.utils.checkpoint``
in either mode, Hugging Face's gradient checkpointing, selective checkpointing; dynamo's
``tag_activation_checkpoint``) or a ``wrap`` region are sites like any other, with ``site.region`` the
region's node and their parameters followed through the region's inputs. Other calls that receive a
parameter or hold GEMMs inside a graph of their own (other higher-order ops, custom ops) are listed in
``ctx.opaque``: what they compute runs as written.

With ``Recipe(include_activation_matmuls=True)`` (experimental) a product of two activations
``A @ B`` (``operator.matmul``/``torch.matmul``/``torch.mm``/``torch.bmm`` calls) with A [..., M, K] and
B [..., K, N] of the same rank (2-D to 4-D) and the same leading dims is a site too:
- ``activation_matmul``: named ``<module>.matmul_<i>``, the module's i-th such product in graph order
  (attention scores ``q @ k.mT`` are ``attn.matmul_0``, ``probs @ v`` ``attn.matmul_1``),
  computed by ``fp4.matmul`` like a linear whose weight is B.

``nn.MultiheadAttention`` reaches dynamo's graph as one ``F.multi_head_attention_forward`` call: its input
and output projections are listed in ``ctx.other_gemms`` with their FLOPs (high precision, counted in
the report's FLOP shares) and the call in ``ctx.opaque``.

Mixture-of-experts projections whose weight is one 3-D parameter [E, N, K] are grouped sites
(``grouped_mm``, ``batched_mm``: see ``grouped_sites``), with ``site.experts`` = E.

Otherwise, products without a parameter operand (attention scores and values, SDPA, SSM scans written with
``einsum``/``bmm``) and other batched parameters (``baddbmm``, a grouped GEMM with a bias) are not sites:
they run in high precision, as the model wrote them. They are listed in
``ctx.other_gemms`` (``OtherGemm``: op, module path, operand shapes, why not a site) for reports.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Optional

import torch
import torch.fx as fx

from fp4compile.contracts import broken, contract
from fp4compile.model_structure import site_name
from fp4compile.sites import CompileContext, GemmSite, RoleInfo, example_tensor
from fp4compile.vocabulary import (
    LINEAR_TARGETS, MATMUL_TARGETS, SEEN_THROUGH, graph_root, module_stack, parameter_name,
)

from . import grouped_sites

ADDMM_TARGETS = (torch.addmm,)
# Products that are not sites are recorded in ctx.other_gemms (function targets and tensor methods).
PRODUCT_FUNCTIONS = {
    operator.matmul: "matmul",
    torch.matmul: "matmul",
    torch.mm: "mm",
    torch.bmm: "bmm",
    torch.addmm: "addmm",
    torch.baddbmm: "baddbmm",
    torch.einsum: "einsum",
    torch.nn.functional.scaled_dot_product_attention: "scaled_dot_product_attention",
    torch._C._nn.scaled_dot_product_attention: "scaled_dot_product_attention",
}
PRODUCT_METHODS = ("matmul", "mm", "bmm", "addmm", "baddbmm", "__matmul__")
# Reads of a parameter that keep its values: a matmul operand made by these still is the parameter.
_PARAMETER_VIEW_METHODS = (
    "t", "transpose", "permute", "to", "type", "type_as", "contiguous", "float", "half", "bfloat16",
)
_PARAMETER_VIEW_FUNCTIONS = (torch.t, torch.transpose, torch.permute)
_PARAMETER_VIEW_ATTRIBUTES = ("T", "mT")


@dataclasses.dataclass
class OtherGemm:
    """A matrix product of the graph that is not a GEMM site: it runs in high precision."""

    node_name: str
    op: str
    module: str  # path of the module that computes it ("" at the top level)
    shapes: tuple  # operand shapes
    reason: str
    # FLOPs of a product with a weight (forward, and backward where it has gradients), which the report
    # counts as high precision; None for products of activations, which it does not count.
    flops: Optional[int] = None

    @property
    def activation_matmul(self) -> bool:
        """A 2-D or 3-D ``matmul``/``mm``/``bmm`` of two activations (no parameter operand).

        These are the products an FP4 path for activation GEMMs would take (attention written with
        ``bmm``); 4-D attention products, ``einsum`` and SDPA are not.
        """
        return (
            self.reason == "no parameter operand"
            and self.op in ("matmul", "__matmul__", "mm", "bmm")
            and len(self.shapes) == 2
            and len(self.shapes[0]) == len(self.shapes[1]) in (2, 3)
        )



def _is_parameter_view(node: fx.Node) -> bool:
    """A read of its first argument that keeps a parameter's values (a transpose, a cast)."""
    return bool(node.args) and (
        (node.op == "call_method" and node.target in _PARAMETER_VIEW_METHODS)
        or (node.op == "call_function" and node.target in _PARAMETER_VIEW_FUNCTIONS)
        or (node.op == "call_function" and node.target is getattr and node.args[1] in _PARAMETER_VIEW_ATTRIBUTES)
    )


def _through_views(node):
    """The node a chain of parameter views (transposes, casts) starts from."""
    while isinstance(node, fx.Node) and _is_parameter_view(node):
        node = node.args[0]
    return node


def _reads_parameter(node, gm: fx.GraphModule, root: Optional[str], names=None) -> Optional[str]:
    """The parameter ``node`` is, through transposes and casts (``W``, ``W.t()``, ``W.T``, ``W.to(bf16)``);
    ``names(node)`` gives a node's parameter name where the caller knows it (regions, root model)."""
    while isinstance(node, fx.Node):
        name = names(node) if names is not None else parameter_name(node, gm, root)
        if name is not None or not _is_parameter_view(node):
            return name
        node = node.args[0]
    return None


def _shape(node) -> tuple:
    value = example_tensor(node)
    if value is None:
        return ()
    return tuple(d if isinstance(d, int) else str(d) for d in value.shape)


def _site_operands(node: fx.Node, scan: "_Scan"):
    """(kind, x, weight operand, has bias, parameter path) when ``fp4.linear`` can compute ``node``."""
    if node.op != "call_function":
        return None
    args, kwargs = node.args, node.kwargs
    if node.target in LINEAR_TARGETS:
        x, weight = args[0], args[1]
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        if len(_shape(weight)) != 2:
            return None
        pname = scan.parameter(weight) if isinstance(weight, fx.Node) else None
        return "linear", x, weight, bias is not None, pname
    if node.target in MATMUL_TARGETS and len(args) == 2 and not kwargs:
        x, weight = args
        pname = scan.reads_parameter(weight)
        if pname is None or len(_shape(weight)) != 2 or len(_shape(x)) < 1:
            return None
        return "matmul", x, weight, False, pname
    if node.target in ADDMM_TARGETS and len(args) == 3 and all(kwargs.get(k, 1) == 1 for k in ("beta", "alpha")):
        bias, x, weight = args
        pname = scan.reads_parameter(weight)
        wshape = _shape(weight)
        if set(kwargs) - {"beta", "alpha"} or pname is None or len(wshape) != 2:
            return None
        if len(_shape(x)) != 2 or _shape(bias) != wshape[1:]:
            return None
        return "addmm", x, weight, True, pname
    return None


ACTIVATION_MATMUL_TARGETS = (operator.matmul, torch.matmul, torch.mm, torch.bmm)


def _activation_matmul(node: fx.Node, scan: "_Scan"):
    """(A, B) when ``node`` is an explicit product of two activations ``fp4.matmul`` can compute."""
    if node.op != "call_function" or node.target not in ACTIVATION_MATMUL_TARGETS:
        return None
    if len(node.args) != 2 or node.kwargs or not all(isinstance(a, fx.Node) for a in node.args):
        return None
    a, b = node.args
    if scan.reads_parameter(a) or scan.reads_parameter(b):
        return None
    sa, sb = _shape(a), _shape(b)
    if not 2 <= len(sa) <= 4 or len(sa) != len(sb) or sa[:-2] != sb[:-2] or sa[-1] != sb[-2]:
        return None
    if not (isinstance(sa[-1], int) and isinstance(sb[-1], int)):
        return None  # a dynamic K or N: stays in high precision as written
    return a, b


def _other_gemm(node: fx.Node, scan: "_Scan", stack) -> Optional[OtherGemm]:
    """``node`` as an ``OtherGemm`` if it is a matrix product (that is not a site), else None."""
    if node.op == "call_function" and node.target in PRODUCT_FUNCTIONS:
        op = PRODUCT_FUNCTIONS[node.target]
    elif node.op == "call_function" and "grouped_mm" in str(getattr(node.target, "__name__", "")):
        op = "grouped_mm"  # MoE experts: torch._grouped_mm, or a library's fallback op
    elif node.op == "call_method" and node.target in PRODUCT_METHODS:
        op = node.target
    else:
        return None
    operands = [a for a in node.args if isinstance(a, fx.Node)]
    if not any(scan.reads_parameter(a) for a in operands):
        reason = "no parameter operand"
    elif node.op == "call_method":
        reason = "tensor method call"
    else:
        reason = "parameter operand in a form fp4.linear does not take"
    module = stack[-1][0] if stack else ""
    return OtherGemm(node.name, op, module, tuple(_shape(a) for a in operands), reason)


def _expected_roles(site: GemmSite, weight) -> None:
    """Roles and (M, N, K) shapes as the model computes them; the aot passes refine FP4 sites."""
    t, n, k = site.tokens, site.out_features, site.in_features
    site.roles["fprop"] = RoleInfo("fprop", shape=(t, n, k))
    if torch.is_grad_enabled():
        site.roles["dgrad"] = RoleInfo("dgrad", shape=(t, k, n))
        wval = weight.meta.get("example_value") if isinstance(weight, fx.Node) else None
        if wval is None or wval.requires_grad:
            site.roles["wgrad"] = RoleInfo("wgrad", shape=(n, k, t))


def _add_activation_site(node: fx.Node, ctx: CompileContext, stack, a: fx.Node, b: fx.Node, region=None) -> None:
    sa, sb = _shape(a), _shape(b)
    module, module_type = stack[-1] if stack else ("", "")
    prefix = f"{module}." if module else ""
    i = sum(s.kind == "activation_matmul" and s.name == f"{prefix}{s.name.rsplit('.', 1)[-1]}" for s in ctx.sites)
    site = GemmSite(
        index=len(ctx.sites),
        name=f"{prefix}matmul_{i}",
        kind="activation_matmul",
        module_type=module_type or "matmul",
        in_features=sa[-1],
        out_features=sb[-1],
        input_shape=sa,
        has_bias=False,
        node_name=node.name,
        graph_id=ctx.graph_id,
        region=region,
    )
    t, n, k = site.tokens, site.out_features, site.in_features
    site.roles["fprop"] = RoleInfo("fprop", shape=(t, n, k))
    if torch.is_grad_enabled():
        aval, bval = a.meta.get("example_value"), b.meta.get("example_value")
        if aval is None or aval.requires_grad:
            site.roles["dgrad"] = RoleInfo("dgrad", shape=(t, k, n))
        if bval is None or bval.requires_grad:
            # dB = A^T dC per leading index: (K, N) reduced over M; the leading dims fold into K.
            lead = sa[:-2]
            if all(isinstance(d, int) for d in lead):
                rows = k * math.prod(lead)
            else:
                rows = "*".join(map(str, (*lead, k)))
            site.roles["wgrad"] = RoleInfo("wgrad", shape=(rows, n, sa[-2]))
    node.meta["fp4_site"] = site.index
    ctx.sites.append(site)


# Operator namespaces whose ops are PyTorch's own (or this backend's): anything else is a custom op.
_OWN_NAMESPACES = ("aten", "prims", "fp4", "_c10d_functional", "c10d_functional", "_dtensor", "profiler")
_GEMM_TARGETS = set(LINEAR_TARGETS) | set(PRODUCT_FUNCTIONS)


class _Scan:
    """One graph being scanned: the top level, or a region's graph whose placeholders stand for the
    operands of the call in the graph around it (``outer``: that graph's scan and the call node)."""

    def __init__(self, gm: fx.GraphModule, ctx: CompileContext, root: Optional[str], outer=None):
        self.gm, self.ctx, self.root = gm, ctx, root
        self.bound: dict[str, tuple["_Scan", fx.Node]] = {}
        self.region: Optional[str] = None
        if outer is not None:
            scan, call = outer
            self.region = scan.region or call.name
            placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
            for placeholder, operand in zip(placeholders, call.args[1:]):
                if isinstance(operand, fx.Node):
                    self.bound[placeholder.name] = (scan, operand)

    def parameter(self, node: fx.Node) -> Optional[str]:
        """The qualified name of the parameter ``node`` is (followed into the graph around a region)."""
        if node.op == "placeholder" and node.name in self.bound:
            scan, operand = self.bound[node.name]
            return scan.reads_parameter(operand)
        if node.op == "placeholder" and self.region is None and node.name in self.ctx.parameter_names:
            return self.ctx.parameter_names[node.name][0]
        if self.region is not None:
            return None
        return parameter_name(node, self.gm, self.root)

    def parameter_names(self, node: fx.Node) -> tuple:
        """Every qualified name of the parameter ``node`` reads (a tied weight has several)."""
        if isinstance(node, fx.Node) and node.op == "placeholder" and node.name in self.bound:
            scan, operand = self.bound[node.name]
            return scan.parameter_names(_through_views(operand))
        if isinstance(node, fx.Node) and node.op == "placeholder" and node.name in self.ctx.parameter_names:
            return tuple(self.ctx.parameter_names[node.name])
        name = self.reads_parameter(node) if isinstance(node, fx.Node) else None
        return (name,) if name is not None else ()

    def reads_parameter(self, node) -> Optional[str]:
        return _reads_parameter(node, self.gm, self.root, self.parameter)


def _holds_gemms(gm: fx.GraphModule) -> bool:
    return any(n.op == "call_function" and n.target in _GEMM_TARGETS for n in gm.graph.nodes) or any(
        _holds_gemms(m) for m in gm.children() if isinstance(m, fx.GraphModule)
    )


def _opaque(node: fx.Node, scan: _Scan) -> Optional[str]:
    """What ``node`` is when the passes cannot see into it and it may compute a GEMM with a weight: a
    higher-order op (other than the regions seen through) or a custom op that receives a parameter or
    holds GEMMs in a graph of its own; None otherwise."""
    if node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, torch._ops.HigherOrderOperator):
        if target in SEEN_THROUGH:
            return None
        what = f"higher-order op {target.name()}"
    elif isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        namespace = target.namespace if isinstance(target, torch._ops.OpOverload) else target._qualified_op_name.split("::")[0]
        if namespace in _OWN_NAMESPACES:
            return None
        what = f"custom op {namespace}::{target.__name__.split('.')[0]}"
    else:
        return None
    operands = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)]
    graphs = [getattr(scan.gm, a.target, None) for a in operands if a.op == "get_attr"]
    if any(scan.reads_parameter(a) for a in operands if a.op != "get_attr") or any(
        isinstance(g, fx.GraphModule) and _holds_gemms(g) for g in graphs
    ):
        return what
    return None


def _multihead_attention(node: fx.Node, scan: _Scan, stack) -> list[OtherGemm]:
    """The input and output projections of a fused ``F.multi_head_attention_forward`` call
    (``nn.MultiheadAttention``), which dynamo keeps as one call: products with a weight, in high precision."""
    args = dict(zip(_MHA_PARAMETERS, node.args), **node.kwargs)
    query, key = _shape(args["query"]), _shape(args["key"])
    if len(query) < 2 or len(key) < 2 or not all(isinstance(d, int) for d in (*query, *key)):
        return []
    e = query[-1]
    t, s = math.prod(query[:-1]), math.prod(key[:-1])
    backward = 3 if torch.is_grad_enabled() else 1  # fprop, dgrad and wgrad
    module = stack[-1][0] if stack else ""
    reason = "inside nn.MultiheadAttention's fused function, which the passes do not see into"
    return [
        OtherGemm(node.name, "multi_head_attention_forward.in_proj", module, ((t, e), (3 * e, e)), reason,
                  backward * 2 * e * e * (t + 2 * s)),
        OtherGemm(node.name, "multi_head_attention_forward.out_proj", module, ((t, e), (e, e)), reason,
                  backward * 2 * t * e * e),
    ]


_MHA_PARAMETERS = (
    "query", "key", "value", "embed_dim_to_check", "num_heads", "in_proj_weight", "in_proj_bias", "bias_k",
    "bias_v", "add_zero_attn", "dropout_p", "out_proj_weight", "out_proj_bias",
)


def _add_grouped_site(node: fx.Node, ctx: CompileContext, stack, hit: dict, region=None) -> None:
    """A grouped (MoE experts) site from ``grouped_sites.match``'s ``hit``."""
    module, module_type = stack[-1] if stack else ("", "Experts")
    site = GemmSite(
        index=len(ctx.sites),
        name=_unique(ctx, site_name(hit["name"])),
        kind=hit["form"],
        module_type=module_type,
        in_features=int(hit["k"]),
        out_features=int(hit["n"]),
        input_shape=tuple(d if isinstance(d, int) else str(d) for d in hit["input_shape"]),
        has_bias=False,
        node_name=node.name,
        graph_id=ctx.graph_id,
        region=region,
        experts=int(hit["experts"]),
        form=grouped_sites.form_seen(ctx.model, module, hit["form"]),
    )
    _expected_roles(site, None)
    node.meta["fp4_site"] = site.index
    ctx.sites.append(site)


def _unique(ctx: CompileContext, name: str) -> str:
    """``name``, or ``name#k`` for the k-th GEMM of the graph that uses this weight."""
    taken = {s.name for s in ctx.sites}
    if name not in taken:
        return name
    k = 2
    while f"{name}#{k}" in taken:
        k += 1
    return f"{name}#{k}"


def _scan(scan: _Scan) -> None:
    ctx, root, seen = scan.ctx, scan.root, set()
    for node in scan.gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        if node.op == "call_function" and node.target in SEEN_THROUGH and isinstance(node.args[0], fx.Node):
            body = getattr(scan.gm, node.args[0].target, None)
            if isinstance(body, fx.GraphModule) and id(body) not in seen:
                seen.add(id(body))
                _scan(_Scan(body, ctx, root, outer=(scan, node)))
                continue
        stack = module_stack(node, root)
        if node.target is torch.nn.functional.multi_head_attention_forward:
            ctx.other_gemms.extend(_multihead_attention(node, scan, stack))
            ctx.opaque.append((node.name, "nn.MultiheadAttention (F.multi_head_attention_forward)",
                               stack[-1][0] if stack else ""))
            continue
        hit = grouped_sites.match(node, scan)
        if hit is not None:
            _add_grouped_site(node, ctx, stack, hit, scan.region)
            continue
        match = _site_operands(node, scan)
        if match is None and ctx.recipe.include_activation_matmuls:
            operands = _activation_matmul(node, scan)
            if operands is not None:
                _add_activation_site(node, ctx, stack, *operands, region=scan.region)
                continue
        if match is None:
            other = _other_gemm(node, scan, stack)
            what = _opaque(node, scan) if other is None else None
            if other is not None:
                ctx.other_gemms.append(other)
            elif what is not None:
                ctx.opaque.append((node.name, what, stack[-1][0] if stack else ""))
            continue
        kind, x, weight, has_bias, pname = match
        wshape = _shape(weight)
        module, module_type = stack[-1] if stack else ("", "Linear")
        names = scan.parameter_names(_through_views(weight))
        if names:
            # A tied weight is named after the module whose call computes the GEMM, where it is its own.
            pname = next((n for n in names if n.rsplit(".", 1)[0] == module), names[0])
        if pname is None:
            name = module or node.name
        else:
            name = site_name(pname)
        if ctx.model is not None and name in ctx.model.classes:
            module_type = ctx.model.classes[name]
        elif name != module:
            module_type = "Parameter"
        out_f, in_f = wshape if kind == "linear" else wshape[::-1]
        site = GemmSite(
            index=len(ctx.sites),
            name=_unique(ctx, name),
            kind=kind,
            module_type=module_type,
            in_features=int(in_f),
            out_features=int(out_f),
            input_shape=_shape(x),
            has_bias=has_bias,
            node_name=node.name,
            graph_id=ctx.graph_id,
            region=scan.region,
        )
        _expected_roles(site, weight)
        node.meta["fp4_site"] = site.index
        ctx.sites.append(site)



def _ensures_sites(gm: fx.GraphModule, ctx: CompileContext) -> None:
    names = [s.name for s in ctx.sites]
    if len(set(names)) != len(names):
        broken(f"site names are not unique: {sorted(n for n in names if names.count(n) > 1)[:3]}")
    nodes = {n.name for n in gm.graph.nodes}
    for i, site in enumerate(ctx.sites):
        if site.index != i:
            broken(f"site {site.name!r} has index {site.index}, not its place {i} in ctx.sites")
        if site.graph_node not in nodes:
            broken(f"site {site.name!r}: its node {site.graph_node!r} is not in the graph")


@contract(stages=("dynamo",), ensures=_ensures_sites)
def find_gemm_sites(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    ctx.other_gemms = []
    ctx.opaque = []
    _scan(_Scan(gm, ctx, graph_root(gm)))
    ctx.note(
        f"graph {ctx.graph_id}: found {len(ctx.sites)} GEMM sites; "
        f"{len(ctx.other_gemms)} other matrix products stay in high precision"
    )
    return gm
