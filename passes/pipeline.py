"""The pass pipeline of the nvfp4 backend, declared in one place.

Dynamo-level passes run on the torch-level FX graph dynamo captures; user precision passes run right
after ``assign_precision``; the joint pass runs on the joint forward-backward graph aot_autograd traces
from the marked graph, before its partitioner splits it; aot-level passes run on the forward and on the
backward graph (they see the three role-tagged GEMMs of every FP4 linear).

    find_gemm_sites -> find_blocks -> assign_precision -> keep_routers_high -> [user passes] -> check_plan
    -> mark_fp4_linear
    ──aot_autograd──▶ plan_sharing (joint graph) ──partition──▶
                      plan_gemm_roles -> insert_rht -> insert_quantize -> fuse_rht_quantize
                      -> lower_gemms -> fuse_amax -> record_ranges -> lower_kernels

Every pass is ``fn(gm, ctx) -> gm`` in its own module, with a docstring saying what it requires and
guarantees. ``print_pipeline()`` prints this list (``pipeline_text()`` returns it); ``fp4compile.config.print_ir_after`` (``FP4COMPILE_PRINT_IR_AFTER``:
"all" or a comma list of pass names) prints the graph after those passes while compiling.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch.fx as fx

from fp4compile import config, contracts, pass_order
from fp4compile.sites import CompileContext

from .assign_precision import assign_precision
from .check_plan import check_plan
from .find_blocks import find_blocks
from .find_gemm_sites import find_gemm_sites
from .fuse_amax import fuse_amax
from .fuse_rht_quantize import fuse_rht_quantize
from .insert_quantize import insert_quantize
from .insert_rht import insert_rht
from .keep_routers_high import keep_routers_high
from .lower_gemms import lower_gemms
from .lower_kernels import lower_kernels
from .mark_fp4_linear import mark_fp4_linear
from .plan_gemm_roles import plan_gemm_roles
from .plan_sharing import plan_sharing
from .record_ranges import record_ranges
from .record_stats import record_stats

Pass = Callable[[fx.GraphModule, CompileContext], fx.GraphModule]

_BY_NAME = {p.__name__: p for p in (
    find_gemm_sites, find_blocks, assign_precision, keep_routers_high, check_plan, mark_fp4_linear, plan_sharing,
    plan_gemm_roles, insert_rht, insert_quantize, record_stats, fuse_rht_quantize, lower_gemms, fuse_amax,
    record_ranges, lower_kernels,
)}
# The order is declared once, by name, in ``fp4compile.pass_order``.
DYNAMO_PASSES: list[Pass] = [_BY_NAME[n] for n in pass_order.DYNAMO]
# User precision passes are inserted at this index of DYNAMO_PASSES (after keep_routers_high).
USER_PASS_INDEX = pass_order.DYNAMO.index(pass_order.USER_PASSES_AFTER) + 1
JOINT_PASSES: list[Pass] = [_BY_NAME[n] for n in pass_order.JOINT]
AOT_PASSES: list[Pass] = [_BY_NAME[n] for n in pass_order.AOT]


def pass_name(p: Pass) -> str:
    return getattr(p, "pass_name", None) or getattr(p, "__name__", type(p).__name__)


def pass_names(user_passes: Sequence[Pass] = ()) -> list[str]:
    """Every pass's name in pipeline order (``pipeline_text``'s), ``user_passes`` in their place."""
    return pass_order.names([pass_name(p) for p in user_passes])


def check_pass_selection(selection, user_passes: Sequence[Pass] = ()) -> None:
    """Raise a ValueError unless every name in ``selection`` (a comma list or a sequence of names, as
    ``print_ir_after`` takes) is "all", a pass of the pipeline, one of ``user_passes`` or a pass made with
    ``precision_pass``; the error lists the names there are."""
    pass_order.check_selection(selection, [pass_name(p) for p in user_passes])


def precision_pass(fn: Pass = None, *, name: str = None):
    """Decorator marking a user precision pass ``fn(gm, ctx) -> gm`` (optionally naming it).

    A precision pass reads ``ctx.sites`` (module path, block index, shapes, kind) and calls
    ``site.set_precision("high" | "nvfp4" | "mxfp4", reason)``. Pass it as ``Backend(passes=[fn])``.
    """

    def wrap(f):
        f.pass_name = name or f.__name__
        pass_order.precision_pass_names.add(f.pass_name)
        return f

    return wrap(fn) if fn is not None else wrap


def dynamo_pipeline(user_passes: Sequence[Pass] = ()) -> list[Pass]:
    return DYNAMO_PASSES[:USER_PASS_INDEX] + list(user_passes) + DYNAMO_PASSES[USER_PASS_INDEX:]


def _summary(p: Pass) -> str:
    """First line of the pass's docstring, or of its module's (built-in passes document the module)."""
    import sys

    doc = p.__doc__ or getattr(sys.modules.get(p.__module__), "__doc__", None) or "user pass"
    first = doc.strip().splitlines()[0]
    return first.split(": ", 1)[1] if first.startswith(pass_name(p) + ":") else first


def print_pipeline(user_passes: Sequence[Pass] = (), file=None) -> None:
    """Print the pipeline (``pipeline_text``) to ``file`` (standard output by default)."""
    print(pipeline_text(user_passes), file=file)


def pipeline_text(user_passes: Sequence[Pass] = ()) -> str:
    """The pipeline as text: stage, pass name and the first line of its docstring."""
    lines = ["dynamo graph:"]
    for p in dynamo_pipeline(user_passes):
        lines.append(f"  {pass_name(p):20s} {_summary(p)}")
    lines.append("aot_autograd joint graph, before the partition:")
    for p in JOINT_PASSES:
        lines.append(f"  {pass_name(p):20s} {_summary(p)}")
    lines.append("aot_autograd forward and backward graphs:")
    for p in AOT_PASSES:
        lines.append(f"  {pass_name(p):20s} {_summary(p)}")
    return "\n".join(lines)


def _print_after(selection, name: str) -> bool:
    selection = selection if selection is not None else config.print_ir_after
    if not selection:
        return False
    names = {s.strip() for s in (selection.split(",") if isinstance(selection, str) else selection)}
    return "all" in names or name in names


def _ran(ctx: CompileContext) -> list[str]:
    """The passes that ran on this compilation so far: its dynamo graph's, then the joint graph's and the
    current stage's (the forward's and backward's run on separate graphs)."""
    return [g.pass_name for g in ctx.graphs if g.pass_name != "input"
            and g.stage in ("dynamo", "joint", ctx.stage)]


def run_passes(gm: fx.GraphModule, ctx: CompileContext, passes: Sequence[Pass], stage: str, print_ir_after=None):
    """Run ``passes`` on ``gm`` in order. After each: the graph is linted and snapshotted for the report
    (``ctx.graphs``), its time added to ``ctx.pass_seconds``; after the last: on aot_autograd's graphs
    (functional) the nodes nothing uses are removed, and the module's code is generated once.
    Passes edit ``gm.graph`` and leave recompiling to this function. With ``config.check_contracts``,
    each pass's contract (``fp4compile.contracts``) is checked before and after it runs."""
    ctx.record(stage, "input", gm)
    checking = config.check_contracts
    for p in passes:
        name = pass_name(p)
        if checking:
            contracts.check_before(p, name, gm, ctx, stage, _ran(ctx))
            before = set(gm.graph.nodes)
        start = time.perf_counter()
        out = p(gm, ctx)
        if out is not None and not isinstance(out, fx.GraphModule):
            raise TypeError(
                f"fp4compile: pass {name!r} returned {type(out).__name__} {out!r:.60}; a pass returns the "
                "GraphModule it was given (or another GraphModule), or None"
            )
        if out is not None:
            gm = out
        gm.graph.lint()
        ctx.pass_seconds[(stage, name)] = ctx.pass_seconds.get((stage, name), 0.0) + time.perf_counter() - start
        if checking:
            contracts.check_after(p, name, gm, ctx, stage, before)
        ctx.record(stage, name, gm)
        if _print_after(print_ir_after, name):
            print(f"# ---- fp4compile: graph {ctx.graph_id} {stage} after {name} ----")
            print(ctx.graphs[-1].code)
    if stage != "dynamo":  # dynamo's graphs may hold in-place operations that DCE cannot see through
        gm.graph.eliminate_dead_code()
    gm.recompile()
    ctx.keep_final(stage, gm)
    return gm
