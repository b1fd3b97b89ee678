"""The words the passes, the report and the backend share about graphs.

One module of the core holds them, so that no pass imports another and nothing of the core imports a
pass: the handles of the ``fp4`` ops as graph targets, the torch-level targets of GEMM sites, the
regions a graph holds (checkpointed functions), module paths from dynamo's sources, the reasons the
plan gives, and queries over GEMM nodes.
"""

from __future__ import annotations

import operator
import re
import zlib
from typing import Optional

import torch
import torch.fx as fx

from fp4compile import distributed, ops, quant_stats, ranges, runtime, scale_layout  # noqa: F401  (register the fp4 ops named here)
from fp4compile.model_structure import without_wrappers

# -- the fp4 ops as graph targets ------------------------------------------------------------------
GEMM = torch.ops.fp4.gemm.default
QUANTIZE = torch.ops.fp4.quantize.default
QUANTIZE_SHARDED = torch.ops.fp4.quantize_sharded.default
DEQUANTIZE = torch.ops.fp4.dequantize.default
TRANSPOSE_QUANTIZED = torch.ops.fp4.transpose_quantized.default
RHT = torch.ops.fp4.rht.default
RHT_QUANTIZE = torch.ops.fp4.rht_quantize.default
SCALED_MM = torch.ops.fp4.scaled_mm.default
SWIZZLE_SCALES = torch.ops.fp4.swizzle_scales.default
EMULATED_MM = torch.ops.fp4.emulated_mm.default
CUBLASLT_MM = torch.ops.fp4.cublaslt_mm.default
PACKED_MM = torch.ops.fp4.packed_mm.default
DECODE_BLOCKS = torch.ops.fp4.decode_blocks.default
FAKE_QUANTIZE = torch.ops.fp4.fake_quantize.default
FAKE_RHT_QUANTIZE = torch.ops.fp4.fake_rht_quantize.default
FAKE_DUAL_QUANTIZE = torch.ops.fp4.fake_dual_quantize.default
DUAL_QUANTIZE = torch.ops.fp4.dual_quantize.default
WGRAD_AMAX = torch.ops.fp4.wgrad_amax.default
RECORD_AMAX = torch.ops.fp4.record_amax.default
RECORD_STATS = torch.ops.fp4.record_stats.default
SR_BASE = torch.ops.fp4.sr_base.default

# -- torch-level GEMM targets (dynamo graphs) ------------------------------------------------------
LINEAR_TARGETS = (torch._C._nn.linear, torch.nn.functional.linear)
MATMUL_TARGETS = (operator.matmul, torch.matmul, torch.mm)
# What a dynamo graph computes a linear, matmul or addmm site with before ``mark_fp4_linear``.
TORCH_GEMM_TARGETS = (*LINEAR_TARGETS, *MATMUL_TARGETS, torch.addmm)

# Higher-order ops whose graph runs as part of the model's forward, its inputs bound to the op's operands
# after the graph: GEMMs inside are sites like any other (aot_autograd inlines them, keeping the
# checkpoint's recomputation tags).
SEEN_THROUGH = tuple(
    op for op in (getattr(torch.ops.higher_order, name, None) for name in ("tag_activation_checkpoint", "wrap"))
    if op is not None
)

# -- the reasons of the plan -----------------------------------------------------------------------
OUTSIDE_BLOCKS = "outside the repeated blocks"
SWITCHED = "switched to high precision"  # the reason the backend's switch gives every site
ROUTER = "router (its output selects the experts: top-k)"
SHARED_GATE = "shared-expert gate (one output through a sigmoid)"

# A checkpointed fprop GEMM's activation amax history, named by its graph input: ``plan_sharing`` sets
# it on the GEMM node, ``insert_quantize`` finds the forward graph's input by that name.
HISTORY_INPUT = "fp4_amax_history_input"


def gemm_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The role-tagged ``fp4.gemm`` nodes of an aot_autograd graph, in graph order."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is GEMM]


def output_item(gm: fx.GraphModule, node: fx.Node, index: int) -> fx.Node:
    """The ``getitem`` node of output ``index`` of the multi-output ``node`` (a quantizer), made right after
    it, with its ``val``, where nothing reads that output yet."""
    for item in node.users:
        if item.op == "call_function" and item.target is operator.getitem and item.args[1] == index:
            return item
    with gm.graph.inserting_after(node):
        item = gm.graph.call_function(operator.getitem, (node, index))
    item.meta["val"] = node.meta["val"][index]
    return item


def regions(gm: fx.GraphModule):
    """(call node, region graph module) for every seen-through region of ``gm``, nested ones included."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in SEEN_THROUGH and isinstance(node.args[0], fx.Node):
            body = getattr(gm, node.args[0].target, None)
            if isinstance(body, fx.GraphModule):
                yield node, body
                yield from regions(body)


# -- module paths from dynamo's sources ------------------------------------------------------------
_LOCAL_ROOT = re.compile(r"^[LG]\['[^']*'\](?:\[[^\]]*\])*")
# ``._modules['x']``, ``._parameters['w']``, and the same through ``.__dict__`` (how dynamo reaches the
# module inside a wrapper whose ``__getattr__`` it does not trace, such as the checkpoint wrapper).
_MODULES = re.compile(
    r"(?:\.__dict__\['_modules'\]|\._modules)\['([^']*)'\]|(?:\.__dict__\['_parameters'\]|\._parameters)\['([^']*)'\]"
    r"|\[(\d+)\]|\['([^']*)'\]"
)


def source_root(qualified: str) -> str:
    """The frame-local object a dynamo source starts from: ``L['args'][0]`` of ``L['args'][0].model``."""
    match = _LOCAL_ROOT.match(qualified)
    return match.group(0) if match else ""


def module_path(qualified: str, root: Optional[str] = None) -> str:
    """Dynamo's ``L['self'].blocks.0.attn`` or ``L['self']._modules['blocks']...`` -> ``blocks.0.attn``.

    ``root`` is the compiled model's source (``graph_root``); without it only the frame local
    (``L['self']``) is dropped, so that objects reached through ``L['models'][0]`` and ``L['models'][1]``
    keep distinct paths (``0.fc``, ``1.fc``).
    """
    if root and qualified.startswith(root):
        path = qualified[len(root):]
    else:
        path = re.sub(r"^[LG]\['[^']*'\]", "", qualified)
    path = _MODULES.sub(lambda m: "." + next(g for g in m.groups() if g is not None), path)
    return without_wrappers(path.strip("."))


def source_name(grapharg) -> str:
    name = grapharg.source.name
    return name() if callable(name) else name


def graph_root(gm: fx.GraphModule) -> Optional[str]:
    """The source of the one model the graph reads modules and parameters from, or None.

    A model whose forward is wrapped by a decorator (Hugging Face models) is reached as
    ``L['args'][0]``, a module compiled directly as ``L['self']``. Modules the model's code reaches
    through its module's globals (a function wrapped as a parameter-free module, such as Hugging Face's
    hub-kernel layers) are not the model: where the frame's locals give one root, that is it.
    """
    roots = set()
    for node in gm.graph.nodes:
        for qualified, _ in (node.meta.get("nn_module_stack") or {}).values():
            roots.add(source_root(qualified))
        grapharg = node.meta.get("grapharg") if node.op == "placeholder" else None
        if grapharg is not None and "._parameters[" in source_name(grapharg):
            roots.add(source_root(source_name(grapharg)))
    local = {r for r in roots if r.startswith("L[")}
    roots = local or roots
    return roots.pop() if len(roots) == 1 else None


def module_stack(node: fx.Node, root: Optional[str] = None) -> list[tuple[str, str]]:
    """[(module path, class name)] from the root's child down to the module that made ``node``; with a
    root, only the model's own modules (not helper modules reached through globals, see ``graph_root``)."""
    out = []
    for qualified, cls in (node.meta.get("nn_module_stack") or {}).values():
        if root and not qualified.startswith(root):
            continue
        name = cls if isinstance(cls, str) else getattr(cls, "__qualname__", str(cls))
        out.append((module_path(qualified, root), name.rsplit(".", 1)[-1]))
    return [(p, c) for p, c in out if p]


def parameter_name(node: fx.Node, gm: fx.GraphModule, root: Optional[str] = None):
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
        source = source_name(grapharg)
        if isinstance(grapharg.example, torch.nn.Parameter) or "_parameters[" in source:
            return module_path(source, root)
        return None
    # Without dynamo's GraphArg (it is not always attached): the fake value remembers it was a
    # Parameter, the owning module comes from the module stack, the name from the placeholder.
    if not isinstance(node.meta.get("example_value"), torch.nn.Parameter):
        return None
    name = str(node.target).rsplit("_parameters_", 1)[-1].rstrip("_")
    stack = module_stack(node, root)
    return f"{stack[-1][0]}.{name}" if stack else name


# -- what a quantizer of an operand is called and seeded with --------------------------------------
OPERAND_NAMES = {"fprop": ("X", "W"), "dgrad": ("dY", "W^T"), "wgrad": ("dY^T", "X^T")}
# The model tensor each operand is made of (what ``fp4compile.distributed`` declares sharded).
OPERAND_TENSORS = {"fprop": ("X", "W"), "dgrad": ("dY", "W"), "wgrad": ("dY", "X")}
# Activation matmul sites C = A @ B (``fp4.matmul``): fp4.gemm(A, B^T), fp4.gemm(dC, B), fp4.gemm(A^T, dC^T).
ACTIVATION_OPERAND_NAMES = {"fprop": ("A", "B^T"), "dgrad": ("dC", "B"), "wgrad": ("A^T", "dC^T")}


def operand_seed_and_label(recipe, site, role: str, i: int) -> tuple[int, str, str]:
    """(SR seed constant, check label, operand name) of operand ``i`` of ``site``'s ``role`` GEMM."""
    activation = site.kind == "activation_matmul"
    operand_name = (ACTIVATION_OPERAND_NAMES if activation else OPERAND_NAMES)[role][i]
    seed = runtime.node_seed(recipe.seed, zlib.crc32(site.name.encode()), role, i)
    label = f"layer {site.name!r} {role} operand {operand_name}" if recipe.check_finite else ""
    return seed, label, operand_name


def scale_rule_kwargs(recipe, fmt: str) -> dict:
    """The keyword arguments that give an NVFP4 op node the recipe's block scale rule (none for "6", the
    ops' default, so graphs of the default recipe are unchanged)."""
    rule = getattr(recipe, "block_scale_rule", "6")
    return {"scale_rule": rule} if fmt == "nvfp4" and rule != "6" else {}


def separate_amax_costs_a_read(val: torch.Tensor) -> bool:
    """Whether quantizing ``val`` where it lives runs an amax pass that reads it again: a CUDA tensor
    (the Triton kernels). Elsewhere the quantizer computes its amax as part of the reference."""
    return val.device.type == "cuda"
