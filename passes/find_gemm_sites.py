"""find_gemm_sites: locate every GEMM with a parameter operand in the dynamo graph.

Requires: a torch-level FX graph from dynamo (parameters as placeholders or get_attr nodes,
``nn_module_stack`` metadata on call nodes).
Guarantees: ``ctx.sites`` lists one ``GemmSite`` per linear call (``F.linear``) and per matmul with a 2-D
parameter operand, in graph order; each such node has ``node.meta["fp4_site"]`` = the site index and a
normalised module path. Block membership is left to ``find_blocks``.
"""

from __future__ import annotations

import operator
import re

import torch
import torch.fx as fx

from fp4compile.sites import CompileContext, GemmSite, RoleInfo

LINEAR_TARGETS = (torch._C._nn.linear, torch.nn.functional.linear)
MATMUL_TARGETS = (operator.matmul, torch.matmul, torch.mm)

_ROOT = re.compile(r"^L\['[^']*'\]\.?")
_MODULES = re.compile(r"\._modules\['([^']*)'\]|\._parameters\['([^']*)'\]|\[(\d+)\]|\['([^']*)'\]")


def module_path(qualified: str) -> str:
    """Dynamo's ``L['self'].blocks[0].attn`` or ``L['self']._modules['blocks']...`` -> ``blocks.0.attn``."""
    path = _ROOT.sub("", qualified)
    path = _MODULES.sub(lambda m: "." + next(g for g in m.groups() if g is not None), path)
    return path.strip(".")


def _stack(node: fx.Node) -> list[tuple[str, str]]:
    """[(module path, class name)] from the root's child down to the module that made ``node``."""
    out = []
    for qualified, cls in (node.meta.get("nn_module_stack") or {}).values():
        name = cls if isinstance(cls, str) else getattr(cls, "__qualname__", str(cls))
        out.append((module_path(qualified), name.rsplit(".", 1)[-1]))
    return [(p, c) for p, c in out if p]


def parameter_name(node: fx.Node, gm: fx.GraphModule):
    """The parameter's dotted path if ``node`` is a parameter of the model, else None."""
    if node.op == "get_attr":
        try:
            value = gm.get_parameter(node.target)
        except AttributeError:
            return None
        return node.target if isinstance(value, torch.nn.Parameter) else None
    if node.op != "placeholder":
        return None
    grapharg = node.meta.get("grapharg")
    if grapharg is not None:
        source = grapharg.source.name if not callable(grapharg.source.name) else grapharg.source.name()
        if isinstance(grapharg.example, torch.nn.Parameter) or "_parameters[" in source:
            return module_path(source)
        return None
    # Without dynamo's GraphArg (it is not always attached): the fake value remembers it was a
    # Parameter, the owning module comes from the module stack, the name from the placeholder.
    if not isinstance(node.meta.get("example_value"), torch.nn.Parameter):
        return None
    name = str(node.target).rsplit("_parameters_", 1)[-1].rstrip("_")
    stack = _stack(node)
    return f"{stack[-1][0]}.{name}" if stack else name


def _shape(node) -> tuple:
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    if value is None and isinstance(node, fx.Node):
        value = node.meta.get("val")
    return tuple(value.shape) if isinstance(value, torch.Tensor) else ()


def _expected_roles(site: GemmSite, weight) -> None:
    """Roles and (M, N, K) shapes as the model computes them; the aot passes refine FP4 sites."""
    t, n, k = site.tokens, site.out_features, site.in_features
    site.roles["fprop"] = RoleInfo("fprop", shape=(t, n, k))
    if torch.is_grad_enabled():
        site.roles["dgrad"] = RoleInfo("dgrad", shape=(t, k, n))
        wval = weight.meta.get("example_value") if isinstance(weight, fx.Node) else None
        if wval is None or wval.requires_grad:
            site.roles["wgrad"] = RoleInfo("wgrad", shape=(n, k, t))


def find_gemm_sites(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    ctx.module_types = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        stack = _stack(node)
        for path, cls in stack:
            ctx.module_types.setdefault(path, cls)
        if node.target in LINEAR_TARGETS:
            x, weight = node.args[0], node.args[1]
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            wshape = _shape(weight)
            if len(wshape) != 2:
                continue
            name = stack[-1][0] if stack else (parameter_name(weight, gm) or node.name).rsplit(".", 1)[0]
            kind, out_f, in_f, has_bias = "linear", wshape[0], wshape[1], bias is not None
            module_type = stack[-1][1] if stack else "Linear"
        elif node.target in MATMUL_TARGETS and len(node.args) == 2:
            x, weight = node.args
            pname = parameter_name(weight, gm) if isinstance(weight, fx.Node) else None
            wshape = _shape(weight)
            if pname is None or len(wshape) != 2 or len(_shape(x)) < 1:
                continue
            name, kind, module_type = pname, "matmul", "Parameter"
            in_f, out_f, has_bias = wshape[0], wshape[1], False
        else:
            continue
        site = GemmSite(
            index=len(ctx.sites),
            name=name,
            kind=kind,
            module_type=module_type,
            in_features=int(in_f),
            out_features=int(out_f),
            input_shape=_shape(x),
            has_bias=has_bias,
            node_name=node.name,
            graph_id=ctx.graph_id,
        )
        site.module_stack = stack
        _expected_roles(site, weight)
        node.meta["fp4_site"] = site.index
        ctx.sites.append(site)
    ctx.note(f"graph {ctx.graph_id}: found {len(ctx.sites)} GEMM sites")
    return gm
