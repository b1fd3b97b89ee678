"""Grouped GEMM sites: mixture-of-experts projections whose weight is one 3-D parameter [E, N, K].

Used by ``find_gemm_sites`` (``match``: which nodes are expert GEMMs, in which form) and by
``mark_fp4_linear`` (``mark``: the node rewritten to ``fp4compile.grouped``'s NVFP4 grouped GEMM). The
forms, as Hugging Face's ``experts_implementation`` writes them and other codebases do:

- ``grouped_mm``: ``torch._grouped_mm(x, B, offs=offs)`` / ``F.grouped_mm`` / transformers' fallback op
  ``transformers::grouped_mm_fallback(x, B, offs)``, tokens sorted by expert, B [E, K, N] a 3-D
  parameter read directly or through a transpose or cast (``W.transpose(-2, -1)`` of W [E, N, K]);
- ``batched_mm``: ``torch.bmm(W[ids], x[..., None])`` (W [E, N, K]) or ``torch.bmm(x[:, None], W[ids])``
  (W [E, K, N]): each token's expert weight gathered by the routed expert ids.

Hugging Face's ``"eager"`` form loops in Python over the experts that received tokens, which breaks the
graph where the routing becomes data (``nonzero``); under the backend it is traced in the ``grouped_mm``
form (``fp4compile.hf_experts``) and its sites say so (``GemmSite.form``).

A grouped site is named by its weight (``layers.3.mlp.experts.gate_up_proj``), has ``experts`` = E,
``in_features`` K, ``out_features`` N and ``input_shape`` [S, K] with S the routed token count (tokens
times top-k), which the FLOPs of its three GEMMs count (2 S N K each).
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from fp4compile import grouped
from fp4compile.sites import RoleInfo, example_tensor

GROUPED_MM_FUNCTIONS = tuple(f for f in (getattr(torch, "_grouped_mm", None), getattr(torch.nn.functional, "grouped_mm", None)) if f)
# Where the expert implementation of a Hugging Face experts module says it was written another way.
FORM_NOTES = {"eager": "eager loop (traced in grouped_mm form)"}


def _is_grouped_mm(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target in GROUPED_MM_FUNCTIONS:
        return True
    name = getattr(node.target, "__name__", "")
    return isinstance(node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) and name.split(".")[0] == "grouped_mm_fallback"


def _shape(node) -> tuple:
    value = example_tensor(node)
    return tuple(value.shape) if value is not None else ()


def _gathered(node, scan) -> Optional[tuple]:
    """(3-D parameter node, its name, ids node) where ``node`` is ``W[ids]`` for a 1-D integer ids."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem):
        return None
    w, ids = node.args
    ids_val = example_tensor(ids)
    if ids_val is None or ids_val.dim() != 1 or ids_val.is_floating_point() or len(_shape(w)) != 3:
        return None
    name = scan.reads_parameter(w)
    return (w, name, ids) if name is not None else None


def match(node: fx.Node, scan) -> Optional[dict]:
    """The grouped site ``node`` computes, as a dict (form, x, parameter name, E, N, K, input shape), or None."""
    if _is_grouped_mm(node):
        args = list(node.args) + [None] * 3
        x, b = args[0], args[1]
        offs = node.kwargs.get("offs", args[2])
        extra = {k: v for k, v in node.kwargs.items() if k != "offs"}
        if any(v is not None for v in extra.values()) or not isinstance(offs, fx.Node):
            return None  # a bias or an output dtype: runs as written
        name = scan.reads_parameter(b)
        bshape, xshape = _shape(b), _shape(x)
        if name is None or len(bshape) != 3 or len(xshape) != 2:
            return None
        e, k, n = bshape
        return dict(form="grouped_mm", x=x, name=name, experts=e, n=n, k=k, input_shape=xshape)
    if node.op == "call_function" and node.target is torch.bmm and len(node.args) == 2 and not node.kwargs:
        first, second = node.args
        for weight_first, gathered, x in ((True, first, second), (False, second, first)):
            hit = _gathered(gathered, scan)
            xshape = _shape(x)
            if hit is None or len(xshape) != 3 or xshape[2 if weight_first else 1] != 1:
                continue
            w, name, _ = hit
            e, rows, cols = _shape(w)
            n, k = (rows, cols) if weight_first else (cols, rows)
            return dict(form="batched_mm", x=x, name=name, experts=e, n=n, k=k,
                        input_shape=(xshape[0], k), weight_first=weight_first)
    return None


def form_seen(model, module: str, form: str) -> str:
    """The form to report: ``form`` as the graph holds it, or what the model's experts module says it
    was written as (Hugging Face's ``config._experts_implementation``)."""
    root = model.root() if model is not None else None
    try:
        experts = root.get_submodule(module) if root is not None else None
    except AttributeError:
        experts = None
    written = getattr(getattr(experts, "config", None), "_experts_implementation", None)
    return FORM_NOTES.get(written, form)


def plan_roles(site, recipe, weight_grad: bool, device=None, out_dtype=None) -> tuple:
    """The site's three GEMMs as ``fp4.grouped_gemm`` computes them (the aot passes do not rewrite it),
    each with its kernel (``cutlass_grouped_runtime.choose`` for ``device`` and ``out_dtype``; the
    grouped emulation where either is unknown); returns the kernel names of (fprop, dgrad, wgrad).
    On a Blackwell GPU a role without a kernel is an error naming the site unless the recipe allows
    emulation."""
    t, n, k = site.tokens, site.out_features, site.in_features
    sr = ("sr" if recipe.stochastic_rounding else "rne")
    reason = f"{site.reason}; grouped over {site.experts} experts, per-expert scales"
    site.roles = {
        "fprop": RoleInfo("fprop", site.precision, reason, (t, n, k), blocks=("1x16", "16x16"), rounding=("rne", "rne")),
    }
    if torch.is_grad_enabled():
        site.roles["dgrad"] = RoleInfo("dgrad", site.precision, reason, (t, k, n), blocks=("1x16", "16x16"), rounding=(sr, "rne"))
        if weight_grad:
            site.roles["wgrad"] = RoleInfo("wgrad", site.precision, reason + "; each expert's tokens padded to 16",
                                           (n, k, t), rht=recipe.rht, blocks=("1x16", "1x16"), rounding=(sr, "rne"))
    from fp4compile.codegen import cutlass_grouped_runtime as cgr
    from fp4compile.executors import CutlassRequired

    for role, info in site.roles.items():
        if device is None or out_dtype is None:
            choice = cgr.GroupedChoice(cgr.EMULATION, "per-expert emulated NVFP4 GEMMs: the site's device is unknown")
        else:
            try:
                choice = cgr.choose(role, n, k, site.input_shape[0], site.experts, out_dtype, device, recipe.allow_emulation)
            except CutlassRequired as exc:
                shape = "x".join(str(d) for d in info.shape)
                raise CutlassRequired(
                    f"{site.name} {role} GEMM (grouped over {site.experts} experts, M x N x K = {shape}): {exc}"
                ) from None
        info.kernel, info.kernel_reason = choice.name, choice.reason
    return tuple(site.roles[r].kernel if r in site.roles else cgr.EMULATION for r in ("fprop", "dgrad", "wgrad"))


def mark(gm: fx.GraphModule, node: fx.Node, site, recipe) -> fx.Node:
    """Insert the NVFP4 grouped GEMM that replaces ``node`` (before it); returns the new node."""
    if site.kind == "grouped_mm":
        args = list(node.args) + [None] * 3
        weight = args[1]
    else:
        first, second = node.args
        weight_first = first.op == "call_function" and first.target is operator.getitem and len(_shape(first.args[0])) == 3
        weight = first if weight_first else second
    out = example_tensor(node)
    kernels = plan_roles(site, recipe, _requires_grad(weight), *((out.device, out.dtype) if out is not None else ()))
    plan = grouped.site_plan(recipe, site.name, site.experts, kernels)
    if site.kind == "grouped_mm":
        offs = node.kwargs.get("offs", args[2])
        return gm.graph.call_function(grouped.grouped_mm, (args[0], weight, offs, plan))
    w, ids = weight.args
    operands = (w, second) if weight_first else (first, w)
    return gm.graph.call_function(grouped.gathered_bmm, (*operands, ids, weight_first, plan))


def _requires_grad(weight: fx.Node) -> bool:
    value = example_tensor(weight)
    return value is None or value.requires_grad
