"""lower_kernels: fp4 ops that a Triton kernel takes become those kernels, in the graph Inductor compiles.

Requires: the final forward or backward graph (after ``fuse_amax``), nodes with fake values
(``meta["val"]``).
Guarantees: where the graph goes to Inductor (``ctx.inner == "inductor"``), every kernel op
(``fp4.quantize``, ``fp4.rht_quantize``, ``fp4.fake_quantize``, ``fp4.fake_rht_quantize``,
``fp4.fake_dual_quantize``, ``fp4.dual_quantize``, ``fp4.wgrad_amax``, ``fp4.transpose_quantized``, ``fp4.decode_blocks``,
``fp4.emulated_mm``, ``fp4.packed_mm``) whose call the Triton kernels take is replaced by the op's implementation traced
functionally: its buffer allocations, aten ops (the emulated GEMM's ``torch.mm``) and its Triton
kernels as ``triton_kernel_wrapper_functional`` nodes. Inductor compiles those kernels with its own (asynchronously, into its on-disk caches), launches
them from its generated code and records them in CUDA graphs like its own. Quantizers with stochastic
rounding read the step's base, mixed with their node constants, from one ``fp4.sr_base`` node per
device at the top of the graph.

Which implementation takes a node is the executor table's choice for its fake values
(``executors.choose``); only one that can be traced into the graph (``Implementation.in_graph``: the
Triton kernels; not the emulated GEMM's cuBLASLt path, which calls cuBLASLt through nvmath-python) is.
An op stays one node, run by its implementation when the graph runs, where: the
table chose another implementation (the tensor is not on a CUDA device, Triton's kernels cannot run or
do not take the shape; the reason says which declined and why); the inner compiler is not Inductor;
in-graph kernels are off; the op checks its output for non-finite values (``check`` label: a read back
to the host); a size is symbolic. ``ctx.kernels`` records each node's implementation ("in-graph
triton" where its kernels are in Inductor's code) and the reason; the report shows them
(``Report.traffic`` costs the fp4 op nodes of the graph's snapshot before this pass).

Inductor works out which buffers a Triton kernel in its graph writes by compiling the kernel to TTIR and
walking it, at every launch site and several times per site (functionalization, its graph lowering, its
IR node): tens to hundreds of milliseconds each, which for a model's hundreds of fp4 kernel launches made
most of the first step's compile. The answer depends only on the kernel and its arguments' types and
constants, so for fp4compile's own kernels it is worked out once per (kernel, argument types and
constants) and reused (``reuse_kernel_analysis``; ``config.kernel_analysis_cache`` off: every site is
analysed, as Inductor does for other kernels, which stay untouched). Likewise, nodes of one op with
equal constants and tensor metadata (the same quantizer in every layer; an RNE node's unused seed
counts as 0) are traced once per graph and inlined from that trace, so they also share Inductor's
kernel-table entries.

Under Inductor (on any device), each ``fp4.record_amax`` (an activation's amax written into its site's
history) becomes the ATen ops of its implementation, a shift and a copy into the history, which Inductor
fuses into a kernel of its own instead of calling the op from its code at every step. Likewise each
``fp4.emulated_mm`` that cuBLASLt runs (its implementation calls cuBLASLt, so it cannot be traced) becomes
its alpha as ATen ops (``formats.gemm_alpha``'s three float32 products, in a kernel of Inductor's making,
instead of the op's launch of alpha's kernel) and ``fp4.cublaslt_mm``, the GEMM alone: a dispatcher call
from Inductor's code straight to its kernel, where the op went through its custom-op wrapping, chose its
implementation and launched alpha's kernel from Python at every step. Where it declines (an amax that is
not one float32 value on the operands' device, operand or output types cuBLASLt does not take) the op
stays, and the report's reason says why.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import operator
from typing import Optional

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from fp4compile import config, executors, formats, runtime
from fp4compile.contracts import broken, contract
from fp4compile.sites import CompileContext, bound_arguments
from fp4compile.vocabulary import CUBLASLT_MM, RECORD_AMAX, SR_BASE

KERNEL_OPS = {
    torch.ops.fp4.quantize.default: "fp4.quantize",
    torch.ops.fp4.rht_quantize.default: "fp4.rht_quantize",
    torch.ops.fp4.fake_quantize.default: "fp4.fake_quantize",
    torch.ops.fp4.fake_rht_quantize.default: "fp4.fake_rht_quantize",
    torch.ops.fp4.fake_dual_quantize.default: "fp4.fake_dual_quantize",
    torch.ops.fp4.dual_quantize.default: "fp4.dual_quantize",
    torch.ops.fp4.wgrad_amax.default: "fp4.wgrad_amax",
    torch.ops.fp4.transpose_quantized.default: "fp4.transpose_quantized",
    torch.ops.fp4.decode_blocks.default: "fp4.decode_blocks",
    torch.ops.fp4.emulated_mm.default: "fp4.emulated_mm",
    torch.ops.fp4.packed_mm.default: "fp4.packed_mm",
}
_CHECK_ARGS = ("check", "check_t")
_STREAM_ARGS = (("rounding", "seed"), ("rounding_t", "seed_t"))  # each rounding argument and its seed
_ROUNDING_ARGS = tuple(rounding for rounding, _ in _STREAM_ARGS)


def _analysis_key(kernel, kwargs: dict, tma_descriptor_metadata) -> Optional[tuple]:
    """What Inductor's analysis of a kernel launch depends on, for one of fp4compile's kernels: the
    kernel, its source, its launch configuration's arguments, each argument's kind (a tensor's dtype: tensors become two-element tensors of
    their dtype for the analysis; a symbolic size becomes one value; constants as given). None where the
    launch is not one of ours or has an argument this cannot key (it is then analysed as usual)."""
    import sympy

    jit = getattr(kernel, "fn", None) if not hasattr(kernel, "src") else kernel  # an Autotuner wraps its JITFunction
    module = str(getattr(jit, "module", ""))
    if tma_descriptor_metadata or jit is None or not (module == "fp4compile" or module.startswith("fp4compile.")):
        return None
    items = []
    for name, value in sorted(kwargs.items()):
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool, sympy.Expr)):
            items.append((name, "symbolic"))
        elif isinstance(value, (bool, int, float, str, type(None), torch.dtype)):
            items.append((name, type(value).__name__, value))
        else:
            dtype = getattr(value, "dtype", None)
            if dtype is None and hasattr(value, "get_dtype"):  # Inductor's TensorBox
                dtype = value.get_dtype()
            if not isinstance(dtype, torch.dtype):
                return None
            items.append((name, "tensor", dtype))
    # A launch traced with launch options comes as a one-config Autotuner made for it: what the analysis
    # reads of it is its first config's arguments (added to the launch's).
    configs = getattr(kernel, "configs", None) or ()
    extra = tuple(sorted(configs[0].kwargs.items())) if configs else ()
    return _hashable((jit, jit.src, extra, tuple(items)))


def reuse_kernel_analysis() -> None:
    """Make Inductor's analysis of which arguments a Triton kernel reads and writes run once per
    ``_analysis_key`` for fp4compile's kernels (idempotent; each caller gets its own copy of the answer).
    The analysis is ``identify_accessed_tensors`` (PyTorch 2.12 on) or ``identify_mutated_tensors``
    (2.11) in ``torch._higher_order_ops.triton_kernel_wrap``; every caller looks it up there when it
    runs."""
    from torch._higher_order_ops import triton_kernel_wrap as wrap

    name = "identify_accessed_tensors" if hasattr(wrap, "identify_accessed_tensors") else "identify_mutated_tensors"
    analyse = getattr(wrap, name)
    if getattr(analyse, "_fp4compile_reuse", False):
        return
    answers: dict = {}

    @functools.wraps(analyse)
    def reused(kernel, kwargs, tma_descriptor_metadata, *args, **kw):
        key = None
        if config.kernel_analysis_cache and not args and not kw:
            key = _analysis_key(kernel, kwargs, tma_descriptor_metadata)
        if key is None:
            return analyse(kernel, kwargs, tma_descriptor_metadata, *args, **kw)
        if key not in answers:
            answers[key] = analyse(kernel, kwargs, tma_descriptor_metadata)
        return copy.deepcopy(answers[key])

    reused._fp4compile_reuse = True
    reused.answers = answers
    setattr(wrap, name, reused)


def _value(arg):
    return arg.meta.get("val") if isinstance(arg, fx.Node) else arg


def _symbolic(values: list) -> str:
    """A symbolic size among the op's arguments, as the reason it stays an op call ("" if none)."""
    for value in values:
        if isinstance(value, torch.Tensor) and not all(isinstance(d, int) for d in (*value.shape, *value.stride(), value.storage_offset())):
            return f"a symbolic size ({tuple(value.shape)})"
        if isinstance(value, torch.SymInt):
            return "a symbolic argument"
    return ""


def _choose(op: str, values: list):
    """The executor table's choice for the op's fake values. Symbolic sizes are read at their hints, adding
    no guard: the call is chosen again when it runs."""
    shape_env = next((v.fake_mode.shape_env for v in values if isinstance(v, FakeTensor)), None)
    with shape_env.suppress_guards() if shape_env is not None else contextlib.nullcontext():
        return executors.choose(op, *values)


def _in_graph_refusal(ctx: CompileContext) -> str:
    """Why ``config.in_graph_kernels`` keeps this graph's kernel ops as op calls ("" where it does not)."""
    setting = config.in_graph_kernels
    if setting == "auto":
        return ("the graph is recorded in CUDA graphs, where an op call costs a replay no host time "
                "(fp4compile.config.in_graph_kernels='auto')") if ctx.cuda_graphs else ""
    return "" if setting else "in-graph kernels are off (fp4compile.config.in_graph_kernels)"


def _why_not(args: dict, values: list, inductor: bool, refusal: str) -> str:
    """Why an op whose chosen implementation could go into the graph stays a node ("" where it goes)."""
    from fp4compile.codegen import triton_kernels

    if not inductor:
        return "the graph is not compiled by Inductor"
    if refusal:
        return refusal
    if triton_kernels.numerics._interpreting():
        return "the Triton kernels cannot be compiled here (Triton's interpreter)"
    if any(args.get(name) for name in _CHECK_ARGS):
        return "it checks its output for non-finite values (a read back to the host)"
    return _symbolic(values)


def _record(args: dict, op: str, inductor: bool, refusal: str) -> tuple[str, str, Optional[executors.Implementation]]:
    """(implementation, reason, the table's entry or None) of a kernel op node: the executor table's
    choice for its fake values, "in-graph <name>" where the lowering puts that implementation's kernels
    into the graph (reason "")."""
    values = [_value(args[name]) for name in executors.arguments(op)]
    if not isinstance(values[0], torch.Tensor):
        return "chosen when it runs", "no fake value for its input", None
    choice = _choose(op, values)
    why = _why_not(args, values, inductor, refusal) if choice.implementation.in_graph else ""
    if choice.implementation.in_graph and not why:
        return f"in-graph {choice.name}", choice.reason, choice.implementation
    return choice.name, "; ".join(r for r in (why, choice.reason) if r), choice.implementation


def _tensor_names(args: dict) -> list:
    """The names of the op's tensor arguments, in ``args`` order: the inputs of its trace."""
    return [k for k, v in args.items() if isinstance(_value(v), torch.Tensor)]


def _hashable(key: tuple) -> Optional[tuple]:
    """``key``, or None where it holds something unhashable (an unhashable constant)."""
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _like(v: torch.Tensor) -> torch.Tensor:
    """A new tensor with ``v``'s shape, strides, storage offset, dtype and device (the launch code reads
    the offset: a bf16 view whose rows start off a 32-bit word is copied before the 1x16 kernel)."""
    extent = 1 + sum((d - 1) * s for d, s in zip(v.shape, v.stride())) if v.numel() else 0
    base = torch.empty(v.storage_offset() + extent, dtype=v.dtype, device=v.device)
    return base.as_strided(v.shape, v.stride(), v.storage_offset())


def _trace(target, args: dict) -> fx.GraphModule:
    """The op's implementation traced functionally on the nodes' fake values: a graph whose inputs are
    the op's tensor arguments (in ``args`` order)."""
    from torch._guards import detect_fake_mode
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.functional_tensor import dispatch_functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    from fp4compile import ops

    names = _tensor_names(args)
    constants = {k: v for k, v in args.items() if k not in names}

    def call(*tensors):
        return target(**constants, **dict(zip(names, tensors)))

    fake_mode = detect_fake_mode([_value(args[k]) for k in names])
    with ops.tracing_kernels(), (fake_mode if fake_mode is not None else contextlib.nullcontext()):
        # Each node its own input tensor (one per node passed several times): the trace binds an input
        # object once, so two nodes holding one value object would trace as one input.
        inputs: dict = {}
        for k in names:
            if id(args[k]) not in inputs:
                inputs[id(args[k])] = _like(_value(args[k]))
        # With Inductor's decompositions, as AOTAutograd traces for it: Inductor lowers only what they leave
        # (e.g. ``aten.zeros`` for a kernel's output buffer becomes ``aten.full``).
        traced = make_fx(dispatch_functionalize(call), decomposition_table=select_decomp_table(),
                         tracing_mode="real")(*(inputs[id(args[k])] for k in names))
    return traced


def _trace_key(target, args: dict) -> Optional[tuple]:
    """What ``_trace`` of ``target`` on ``args`` depends on: the constants, and each tensor's shape,
    strides, dtype, device and the parity of its storage offset (the trace runs on fake values; of where
    an input starts, the launch code reads only whether a bf16 row starts on a 32-bit word, so the SR
    streams' slices of one ``fp4.sr_base`` share a trace). None where a constant is unhashable."""
    parts = []
    first = {}  # a node passed as several arguments traces as one input: the pattern is part of the key
    for name, arg in args.items():
        value = _value(arg)
        if isinstance(value, torch.Tensor):
            same = first.setdefault(id(arg), name)
            parts.append((name, tuple(value.shape), value.stride(), value.storage_offset() % 2, value.dtype,
                          value.device, same))
        else:
            parts.append((name, type(arg).__name__, arg))
    return _hashable((target, tuple(parts)))


def _inline(gm: fx.GraphModule, node: fx.Node, traced: fx.GraphModule, inputs: list) -> None:
    """Put ``traced``'s nodes before ``node`` (its inputs bound to ``inputs``) and let its outputs take
    the place of ``node``'s. Each copy gets its own fake values, computed from this site's inputs (a
    trace inlined at several sites would otherwise hand them all one value object, which later traces
    and Inductor's aliasing analysis would read as one tensor)."""
    from torch._guards import detect_fake_mode

    fake_mode = detect_fake_mode([_value(a) for a in inputs])
    env = {}
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    for p, arg in zip(placeholders, inputs):
        env[p] = arg
    outputs = None
    with gm.graph.inserting_before(node):
        for n in traced.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                outputs = fx.map_arg(n.args[0], lambda a: env[a])
                continue
            copy_ = env[n] = gm.graph.node_copy(n, lambda a: env[a])
            if fake_mode is not None and copy_.op == "call_function" and "val" in n.meta:
                call_args, call_kwargs = fx.map_arg((copy_.args, copy_.kwargs), lambda a: a.meta["val"])
                with fake_mode:
                    copy_.meta["val"] = copy_.target(*call_args, **call_kwargs)
    if isinstance(outputs, (tuple, list)):
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(outputs[user.args[1]])
                gm.graph.erase_node(user)
        if node.users:
            raise RuntimeError(f"lower_kernels: {node.name} is used other than by indexing its outputs")
    else:
        node.replace_all_uses_with(outputs)
    gm.graph.erase_node(node)


class _StreamKeys:
    """The graph's ``fp4.sr_base`` node per device (at the top of the graph) and the node constants it
    mixes with the step's base, one slice of its output per SR stream."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.bases: dict = {}  # device -> (sr_base node, its keys, the fake mode of the graph)

    def slice(self, x: torch.Tensor, key: int) -> fx.Node:
        """A node holding ``base ^ key`` (int64 [1]) on the device of ``x`` (a fake value)."""
        graph = self.gm.graph
        if x.device not in self.bases:
            first = next(n for n in graph.nodes if n.op != "placeholder")
            with graph.inserting_before(first):
                self.bases[x.device] = (graph.call_function(SR_BASE, (x.device, [])), [], x.fake_mode)
        base, keys, _ = self.bases[x.device]
        keys.append(int(key))
        with graph.inserting_after(base):
            piece = graph.call_function(torch.ops.aten.slice.Tensor, (base, 0, 2 * len(keys) - 2, 2 * len(keys) - 1))
        with x.fake_mode:
            piece.meta["val"] = torch.empty(1, dtype=torch.int64, device=x.device)
        return piece

    def finish(self) -> None:
        """Give each ``fp4.sr_base`` node its keys (and, where CUDA runs, make their device copy now,
        before any CUDA graph is recorded)."""
        for device, (base, keys, fake_mode) in self.bases.items():
            base.args = (device, keys)
            with fake_mode:
                base.meta["val"] = torch.empty(2 * len(keys), dtype=torch.int64, device=device)
            if torch.cuda.is_initialized():
                runtime.device_keys(device, tuple(keys))


def _key_streams(node: fx.Node, args: dict, keys: _StreamKeys) -> None:
    """Hand the node's SR streams to its kernels as device data rather than as scalar arguments.

    A kernel mixes ``base ^ seed`` (``runtime.DeviceSeed``). Each SR seed goes into the graph's
    ``fp4.sr_base`` node, whose output holds ``base ^ seed`` for it: the node's ``seed_base`` (and
    ``seed_base_t`` for the second stream of ``fp4.fake_dual_quantize``) is that slice, and its seed
    becomes 0; an RNE side's seed is unused and becomes 0. The kernels then mix the same values (the
    bits do not change), and nodes of one shape launch kernels with equal scalar arguments, which
    Inductor compiles once instead of once per node (it keys the definitions of kernels launched with
    launch options on their scalar arguments); the mixing is one small kernel for the whole graph."""
    x = _value(next(iter(args.values())))
    for (rounding, seed), base_arg in zip(_STREAM_ARGS, ("seed_base", "seed_base_t")):
        if rounding not in args:
            continue
        if args[rounding] == "sr":
            args[base_arg] = keys.slice(x, int(args[seed]))
        args[seed] = 0


def _give_fake_values(nodes, fake_mode) -> None:
    """Each new node's fake value, computed from its arguments' in ``fake_mode`` (None: as they are)."""
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        for new in nodes:
            args, kwargs = fx.map_arg((new.args, new.kwargs), lambda a: a.meta["val"])
            new.meta["val"] = new.target(*args, **kwargs)


def _record_amax_in_graph(gm: fx.GraphModule, node: fx.Node) -> None:
    """Replace ``fp4.record_amax(history, amax)`` by the ATen ops of its implementation: the history
    shifted by one with the amax appended (``aten.cat``), copied back into the history (``aten.copy_``, a
    mutation of the graph's input that Inductor performs in its code). The op would otherwise be a call
    from Inductor's code through the dispatcher at every step."""
    history, amax = (bound_arguments(node)[k] for k in ("history", "amax"))
    h = history.meta["val"]
    graph = gm.graph
    with graph.inserting_before(node):
        older = graph.call_function(torch.ops.aten.slice.Tensor, (history, 0, 1, h.shape[0]))
        newest = graph.call_function(torch.ops.aten.reshape.default, (amax, [1]))
        if amax.meta["val"].dtype != h.dtype:
            newest = graph.call_function(torch.ops.aten._to_copy.default, (newest,), {"dtype": h.dtype})
        shifted = graph.call_function(torch.ops.aten.cat.default, ([older, newest],))
        copied = graph.call_function(torch.ops.aten.copy_.default, (history, shifted))
    _give_fake_values((older, newest, shifted, copied), h.fake_mode)
    for key in ("stack_trace", "fp4_quantize", "fp4_role"):
        if key in node.meta:
            copied.meta[key] = node.meta[key]
    graph.erase_node(node)


def _cublaslt_in_graph(gm: fx.GraphModule, node: fx.Node, args: dict) -> str:
    """Replace ``fp4.emulated_mm`` that cuBLASLt runs by alpha computed in the graph and ``fp4.cublaslt_mm``
    (the GEMM alone, alpha read in its epilogue). Alpha is ``formats.gemm_alpha``'s three float32
    products, amax_A * fp32(1/G) times amax_B * fp32(1/G), as ATen ops (multiplies only: nothing for a
    compiler to contract into an FMA), which Inductor compiles into a kernel of its own making. "" where
    done; else why not (nothing changed): an amax that is not one float32 value on the operands' device,
    or operand or output types cuBLASLt does not take (the op then raises or falls back as it does)."""
    from fp4compile.codegen import cublaslt_gemm

    a = args["a"].meta["val"]
    amaxes = [args[name] for name in ("a_amax", "b_amax")]
    values = [_value(x) for x in amaxes]
    if not all(isinstance(v, torch.Tensor) and v.dtype == torch.float32 and v.numel() == 1 and v.device == a.device
               for v in values):
        return "alpha computed in the op: an amax is not one float32 value on the operands' device"
    problem = cublaslt_gemm.dtype_problem(a.dtype, _value(args["b"]).dtype, args["out_dtype"])
    if problem:
        return f"the op's call: {problem}"
    inv = formats.decode_factor(args["scale_rule"])  # eager kernels and Inductor's code multiply by this float32
    graph = gm.graph
    aten = torch.ops.aten
    with graph.inserting_before(node):
        decode = [graph.call_function(aten.mul.Tensor, (x, inv)) for x in amaxes]
        product = graph.call_function(aten.mul.Tensor, tuple(decode))
        alpha = graph.call_function(aten.reshape.default, (product, []))
        gemm = graph.call_function(CUBLASLT_MM, (args["a"], args["b"], alpha, args["out_dtype"]))
    from torch._guards import detect_fake_mode

    _give_fake_values((*decode, product, alpha, gemm), detect_fake_mode([a, *values]))
    for key, value in node.meta.items():
        if key != "val" and (key == "stack_trace" or key.startswith("fp4")):
            gemm.meta[key] = value
    node.replace_all_uses_with(gemm)
    graph.erase_node(node)
    return ""


def _ensures_one_base_per_device(gm: fx.GraphModule, ctx: CompileContext) -> None:
    devices = [str(n.meta["val"].device) for n in gm.graph.find_nodes(op="call_function", target=SR_BASE)]
    if len(set(devices)) != len(devices):
        broken(f"several fp4.sr_base nodes for one device: {devices}")


@contract(after=("fuse_amax", "record_ranges"), stages=("forward", "backward"), ensures=_ensures_one_base_per_device)
def lower_kernels(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    inductor = getattr(ctx, "inner", None) == "inductor"
    refusal = _in_graph_refusal(ctx)
    if inductor:
        reuse_kernel_analysis()
    keys = _StreamKeys(gm)
    traces: dict = {}
    changed = False
    stage = ctx.stage
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is RECORD_AMAX and inductor and not refusal:
            _record_amax_in_graph(gm, node)
            changed = True
            continue
        if node.op != "call_function" or node.target not in KERNEL_OPS:
            continue
        args = bound_arguments(node)
        implementation, reason, entry = _record(args, KERNEL_OPS[node.target][len("fp4."):], inductor, refusal)
        # Only fp4compile's own cuBLASLt entry: an implementation registered in its place runs as called.
        declined = _cublaslt_in_graph(gm, node, args) if entry is executors.CUBLASLT and inductor and not refusal else None
        ctx.kernels.append((stage, node.name, KERNEL_OPS[node.target], implementation,
                            "; ".join(r for r in (declined, reason) if r)))
        if declined == "":  # rewritten
            changed = True
            continue
        if not implementation.startswith("in-graph "):
            continue
        if any(name in args for name in _ROUNDING_ARGS):
            _key_streams(node, args, keys)
        # Nodes of one op with equal constants and tensor metadata (a model's repeated layers) share a trace.
        key = _trace_key(node.target, args)
        traced = traces.get(key) if key is not None else None
        if traced is None:
            traced = _trace(node.target, args)
            if key is not None:
                traces[key] = traced
        _inline(gm, node, traced, [args[k] for k in _tensor_names(args)])
        changed = True
    keys.finish()
    if changed:
        gm.graph.eliminate_dead_code()  # the traced kernels' unused outputs
    return gm
