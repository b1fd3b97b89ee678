"""plan_gemm_roles: decide how each role-tagged GEMM of the forward/backward graph is computed.

Requires: an aot_autograd forward or backward graph holding ``fp4.gemm(a, b, role, site, dtype)`` nodes
(from ``mark_fp4_linear``) with ``val`` metadata.
Guarantees: for each such node ``site.roles[role]`` is a ``RoleInfo`` with the (M, N, K) shape and either
a low precision with operand blocks and rounding (fprop: X 1x16 RNE, W 16x16 RNE; dgrad: dY 1x16 SR, W
as fprop; wgrad: dY^T 1x16 SR, X^T 1x16 RNE, RHT on both) or "high" with the reason: the recipe
quantizes the forward only, or the reduction dim of fprop/dgrad (a feature dim) is dynamic or not a
multiple of the block size. ``node.meta["fp4_role"]`` holds the same RoleInfo. In a backward graph,
the dgrad/wgrad roles an FP4 site does not compute (frozen weight, input without gradient) are
removed from ``site.roles``.

Activation matmul sites (``fp4.matmul``, batched operands [..., M, K]): both operands of every role use
the activation block (1x16, no 16x16 tiles: B is not a weight); dC is stochastically rounded in dgrad
and wgrad like other gradients, and wgrad gets the RHT as for linears. The recorded shape folds the
leading dims into M, so that ``flops`` counts every batch.

Token padding: the reduction dim of wgrad is the token count, which a batch or sequence length sets
(and which is symbolic under ``torch.compile(dynamic=True)``). When it is not known to be a multiple
of the block size, both wgrad operands are zero-padded along it to the next multiple, at run time
(``aten.constant_pad_nd`` with the pad computed from the symbolic size, so no shape guard and no
recompile). Zero tokens add nothing to dW = dY^T X, to any block amax or to the global amax; the RHT
mixes them into their 16-token chunk, but it is applied to both operands and cancels. So every token
count gets an FP4 wgrad, with the same bits whether the graph was compiled for a static or a dynamic
token count.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fp4compile.contracts import broken, contract
from fp4compile.sites import ROLES, CompileContext, RoleInfo, bound_arguments, set_arguments
from fp4compile.vocabulary import gemm_nodes

PAD = torch.ops.aten.constant_pad_nd.default
SYM_SIZE = torch.ops.aten.sym_size.int


def _static(d):
    return isinstance(d, int) or (hasattr(d, "node") and d.node.is_constant())


def _shape_text(dims) -> tuple:
    """(M, N, K) for the report: ints, or the symbolic expression as text (no shape guard)."""
    return tuple(int(d) if _static(d) else str(d) for d in dims)


def _is_multiple(d, bs: int) -> bool:
    if _static(d):
        return int(d) % bs == 0
    return statically_known_true(d % bs == 0)


def _pad_tokens(gm: fx.GraphModule, node: fx.Node, bs: int):
    """Zero-pad both operands of the wgrad ``node`` along the token (last) dim to a multiple of ``bs``;
    returns the padded token count (int or SymInt)."""
    gemm = bound_arguments(node)
    a = gemm["a"]
    k = a.meta["val"].shape[-1]
    with gm.graph.inserting_before(node):
        if _static(k):
            pad = (-int(k)) % bs
        else:
            size = gm.graph.call_function(SYM_SIZE, (a, a.meta["val"].dim() - 1))
            size.meta["val"] = k
            neg = gm.graph.call_function(operator.neg, (size,))
            neg.meta["val"] = -k
            pad = gm.graph.call_function(operator.mod, (neg, bs))
            pad.meta["val"] = (-k) % bs
        padded_k = k + (pad.meta["val"] if isinstance(pad, fx.Node) else pad)
        padded = {}
        for name in ("a", "b"):
            val = gemm[name].meta["val"]
            padded[name] = gm.graph.call_function(PAD, (gemm[name], [0, pad], 0.0))
            padded[name].meta["val"] = val.new_empty((*val.shape[:-1], padded_k))
    set_arguments(node, **padded)
    return padded_k


def _is_backward(gm: fx.GraphModule) -> bool:
    return any(n.op == "placeholder" and n.name.startswith("tangents") for n in gm.graph.nodes)


def _ensures_roles(gm: fx.GraphModule, ctx: CompileContext) -> None:
    for node in gemm_nodes(gm):
        info = node.meta.get("fp4_role")
        if not isinstance(info, RoleInfo) or info.role not in ROLES:
            broken(f"{node.name} has no planned role (meta['fp4_role'] = {info!r})")
        if ctx.sites[bound_arguments(node)["site"]].roles.get(info.role) is not info:
            broken(f"{node.name}: the site's {info.role} is not the plan on its node")


@contract(after=("mark_fp4_linear",), stages=("forward", "backward"), ensures=_ensures_roles)
def plan_gemm_roles(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    recipe = ctx.recipe
    bs = recipe.block_size
    planned = padded = 0
    seen = set()
    for node in gemm_nodes(gm):
        gemm = bound_arguments(node)
        a, b, role, index = gemm["a"], gemm["b"], gemm["role"], gemm["site"]
        site = ctx.sites[index]
        seen.add((index, role))
        aval = a.meta["val"]
        (m, k), n = aval.shape[-2:], b.meta["val"].shape[-2]
        for d in aval.shape[:-2]:
            m = m * d
        info = RoleInfo(role=role, shape=_shape_text((m, n, k)))
        activation = site.kind == "activation_matmul"
        sr = "sr" if recipe.stochastic_rounding else "rne"
        if not site.is_low_precision:
            info.reason = site.reason
        elif role != "fprop" and not recipe.quantize_backward:
            info.reason = "recipe quantizes the forward GEMMs only"
        elif role != "wgrad" and not _static(k):
            info.reason = f"reduction dim K={k} is dynamic"
            ctx.fallback(site, role, info.reason)
        elif role != "wgrad" and int(k) % bs:
            info.reason = f"reduction dim K={int(k)} is not a multiple of the block size {bs}"
            ctx.fallback(site, role, info.reason)
        else:
            info.precision = site.precision
            info.reason = site.reason
            act = recipe.activation_block
            weight = act if activation else recipe.weight_block
            if role == "fprop":
                info.blocks, info.rounding = (act, weight), ("rne", "rne")
            elif role == "dgrad":
                info.blocks, info.rounding = (act, weight), (sr, "rne")
            else:
                # linear: (dY^T, X^T); activation matmul: (A^T, dC^T), the gradient second.
                info.blocks, info.rounding = (act, act), (("rne", sr) if activation else (sr, "rne"))
                info.rht = recipe.rht
                if not _is_multiple(k, bs):
                    padded_k = _pad_tokens(gm, node, bs)
                    info.shape = _shape_text((m, n, padded_k))
                    info.reason = f"{site.reason}; {k} tokens zero-padded to a multiple of {bs}"
                    padded += 1
        site.roles[role] = info
        node.meta["fp4_role"] = info
        planned += 1
    if _is_backward(gm):
        # Only FP4-marked sites have fp4.gemm nodes; high-precision ones keep the roles they expect, and
        # grouped sites the roles ``grouped_sites`` planned (``fp4.grouped_gemm`` computes them).
        for index, site in enumerate(ctx.sites):
            for role in ("dgrad", "wgrad"):
                if site.is_low_precision and site.experts is None and (index, role) not in seen:
                    site.roles.pop(role, None)
    ctx.note(f"graph {ctx.graph_id}: planned {planned} role-tagged GEMMs, padded the tokens of {padded} wgrad GEMMs")
    return gm
