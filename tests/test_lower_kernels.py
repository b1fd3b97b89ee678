"""``lower_kernels``: the fp4 ops that Triton kernels take become those kernels in the graph Inductor
compiles, and the report says how every quantizer runs."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import fp4compile
from fp4compile import Backend, runtime

pytest.importorskip("triton")


class Stack(torch.nn.Module):
    def __init__(self, d=64, n=3):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(d, d) for _ in range(n)])

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
        return x


# A graph of every kernel op on fake CUDA tensors, lowered as for Inductor on a simulated sm_90 device (the
# kernels are traced, not compiled: no GPU needed). Prints the call targets before and after and the
# report's choices.
_SIMULATE_SM90 = textwrap.dedent("""
    import os, collections, json
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["FP4COMPILE_EMULATED_GEMM"] = "torch"  # the traceable GEMM, whether or not cuBLASLt is installed
    import torch
    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_capability = lambda *a: (9, 0)
    torch.cuda.get_device_name = lambda *a: "simulated sm_90"
    torch.cuda.current_device = lambda: 0
    import types, triton
    from triton.backends.compiler import GPUTarget
    triton.runtime.driver.set_active(types.SimpleNamespace(get_current_target=lambda: GPUTarget("cuda", 90, 32)))
    from torch._higher_order_ops.triton_kernel_wrap import get_mutated_tensors, kernel_side_table
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.lowering import lowerings
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    import fp4compile
    from fp4compile.passes.lower_kernels import lower_kernels
    from fp4compile.sites import CompileContext
""")

_SIMULATED = _SIMULATE_SM90 + textwrap.dedent("""
    def f(x, w, dy):
        xa, _ = torch.ops.fp4.wgrad_amax(x, 16)
        xb, xamax = torch.ops.fp4.fake_quantize(x, "nvfp4", "1x16", "rne", 11, "", xa)
        wd, ws, wa = torch.ops.fp4.quantize(w, "nvfp4", "16x16", "rne", 12, "")
        wb = torch.ops.fp4.decode_blocks(wd, ws)
        wtd, wts = torch.ops.fp4.transpose_quantized(wd, ws)
        dy_amaxes = torch.ops.fp4.wgrad_amax(dy, 16)
        g, gt = torch.ops.fp4.fake_dual_quantize(dy, 16, "nvfp4", "sr", 13, "", "sr", 14, "", *dy_amaxes)
        g2, gt2 = torch.ops.fp4.fake_dual_quantize(dy, 16, "nvfp4", "sr", 19, "", "sr", -20, "", *dy_amaxes)
        r, ramax = torch.ops.fp4.fake_rht_quantize(x.t(), 16, "nvfp4", "1x16", "sr", 15, "")
        c = torch.ops.fp4.fake_quantize(x, "nvfp4", "1x16", "rne", 16, "layer fprop a")[0]
        s1 = torch.ops.fp4.fake_quantize(dy, "nvfp4", "1x16", "sr", -(2**62) - 17, "", xa)[0]
        s2 = torch.ops.fp4.fake_quantize(dy, "nvfp4", "1x16", "sr", 18, "", xa)[0]
        y = torch.ops.fp4.emulated_mm(xb, xamax, wb, wa, "nvfp4", torch.bfloat16)
        return xb, wb, wtd, wts, g, gt, r, xamax, wa, ramax, c, s1, s2, g2, gt2, y

    with FakeTensorMode():
        x = torch.empty(64, 128, device="cuda", dtype=torch.bfloat16)
        w = torch.empty(32, 128, device="cuda", dtype=torch.float32)
        dy = torch.empty(64, 32, device="cuda", dtype=torch.bfloat16)
        gm = make_fx(f)(x, w, dy)
    before = collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    old_nodes = set(gm.graph.nodes)
    ctx = CompileContext(fp4compile.Recipe(), 0)
    ctx.inner = "inductor"
    ctx.cuda_graphs = os.environ.get("SIMULATED_CUDA_GRAPHS") == "1"
    gm = lower_kernels(gm, ctx)
    after = collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    new_nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n not in old_nodes]
    # Ops the lowering added that Inductor has no lowering for (it expects them decomposed).
    unlowered = [str(n.target) for n in new_nodes if n.target in select_decomp_table() and n.target not in lowerings]
    # What Inductor's analysis of each kernel says it writes: the op nodes behind those arguments.
    writes, scalars, tables = [], [], []
    for n in new_nodes:
        if str(n.target) != "triton_kernel_wrapper_functional":
            continue
        kw = n.kwargs["kwargs"]
        kernel = kernel_side_table.get_kernel(n.kwargs["kernel_idx"])
        values = {k: (v.meta["val"] if isinstance(v, torch.fx.Node) else v) for k, v in kw.items()}
        names = get_mutated_tensors(n.kwargs["kernel_idx"], n.kwargs["constant_args_idx"], values,
                                    n.kwargs.get("tma_descriptor_metadata", {}))
        writes.append(sorted(str(kw[k].target) for k in names))
        tables.append([n.kwargs["kernel_idx"], n.kwargs["constant_args_idx"]])
        scalars.append([getattr(kernel.fn, "__name__", "?"), sorted(
            (k, v) for k, v in {**kw, **kernel_side_table.get_constant_args(n.kwargs["constant_args_idx"])}.items()
            if not isinstance(v, torch.fx.Node))])
    # The analysis Inductor runs at every launch, as lower_kernels leaves it (answers reused per kernel and
    # argument types and constants), against a fresh analysis of each launch.
    import torch._higher_order_ops.triton_kernel_wrap as wrap
    analyse = getattr(wrap, "identify_accessed_tensors", None) or wrap.identify_mutated_tensors
    def names(answer):
        rw = getattr(answer, "read_writes", None)
        return sorted(d.name for d in rw.writes) + ["|"] + sorted(d.name for d in rw.reads) if rw else sorted(answer)
    launches = [(kernel_side_table.get_kernel(n.kwargs["kernel_idx"]),
                 {**{k: (v.meta["val"] if isinstance(v, torch.fx.Node) else v) for k, v in n.kwargs["kwargs"].items()},
                  **kernel_side_table.get_constant_args(n.kwargs["constant_args_idx"])})
                for n in new_nodes if str(n.target) == "triton_kernel_wrapper_functional"]
    reused = [names(analyse(k, kw, {})) for k, kw in launches]
    fresh = [names(analyse.__wrapped__(k, kw, {})) for k, kw in launches]
    print(json.dumps({"before": before, "after": after, "choices": ctx.kernels, "unlowered": unlowered,
                      "writes": writes, "scalars": scalars, "reused_equal_fresh": reused == fresh,
                      "launches": len(launches), "analyses": len(analyse.answers), "tables": tables}))
""")


# Two weights quantized with equal settings: their decodes share one trace, and the GEMMs read them (the
# emulated wgrad's two decoded operands), once as two operands and once as the same operand twice. And two
# bf16 views of one buffer quantized with equal settings, one whose rows start off a 32-bit word. Prints,
# for each torch.mm the lowering made, which graph inputs each of its two operands is computed from, and
# what each 1x16 kernel's input is behind its views (the graph input, or the copy the launch made).
_SHARED_TRACES = _SIMULATE_SM90 + textwrap.dedent("""
    def f(w1, w2, x):
        d1, s1, a1 = torch.ops.fp4.quantize(w1, "nvfp4", "16x16", "rne", 1, "")
        d2, s2, a2 = torch.ops.fp4.quantize(w2, "nvfp4", "16x16", "rne", 2, "")
        b1, b2 = torch.ops.fp4.decode_blocks(d1, s1), torch.ops.fp4.decode_blocks(d2, s2)
        even = torch.ops.fp4.fake_quantize(x.narrow(0, 2, 64 * 128).view(64, 128), "nvfp4", "1x16", "rne", 3, "")[0]
        odd = torch.ops.fp4.fake_quantize(x.narrow(0, 1, 64 * 128).view(64, 128), "nvfp4", "1x16", "rne", 4, "")[0]
        return (torch.ops.fp4.emulated_mm(b1, a1, b2, a2, "nvfp4", torch.float32),
                torch.ops.fp4.emulated_mm(b1, a1, b1, a1, "nvfp4", torch.float32), even, odd)

    with FakeTensorMode():
        w1, w2 = (torch.empty(64, 128, device="cuda", dtype=torch.float32) for _ in range(2))
        x = torch.empty(64 * 128 + 2, device="cuda", dtype=torch.bfloat16)
        gm = make_fx(f)(w1, w2, x)
    ctx = CompileContext(fp4compile.Recipe(), 0)
    ctx.inner = "inductor"
    gm = lower_kernels(gm, ctx)
    inputs = {}
    for n in gm.graph.nodes:
        inputs[n] = {n.name} if n.op == "placeholder" else set().union(*(inputs[a] for a in n.all_input_nodes))
    order = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    mms = [[sorted(order.index(p) for p in inputs[a]) for a in n.args[:2]]
           for n in gm.graph.nodes if n.op == "call_function" and str(n.target) == "aten.mm.dtype"]
    def behind_views(n):
        while n.op == "call_function" and torch.Tag.view_copy not in getattr(n.target, "tags", ()) and (
                getattr(n.target, "is_view", False) or str(n.target) in ("aten.view.default", "aten.slice.Tensor")):
            n = n.args[0]
        return n.op if n.op == "placeholder" else str(n.target)
    rows = [behind_views(n.kwargs["kwargs"]["x_ptr"]) for n in gm.graph.nodes
            if str(n.target) == "triton_kernel_wrapper_functional" and "x_ptr" in n.kwargs["kwargs"]
            and n.kwargs["kwargs"]["x_ptr"].meta["val"].dtype == torch.bfloat16]
    print(json.dumps({"mms": mms, "in_graph": sum(c[3] == "in-graph triton" for c in ctx.kernels), "rows": rows}))
""")


def test_equal_nodes_sharing_a_trace_keep_their_own_inputs():
    """Nodes traced once and inlined at each site feed later kernel ops as distinct tensors: a GEMM of
    two operands decoded by one shared trace reads both, not one of them twice."""
    import json

    out = subprocess.run([sys.executable, "-c", _SHARED_TRACES], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["in_graph"] == 8  # four quantizers, two decodes, two GEMMs
    assert result["mms"] == [[[0], [1]], [[0], [0]]]
    # The view whose rows start off a 32-bit word is copied before its kernel, the other read in place.
    # (Each quantizer launches its amax kernel and its quantize kernel on the view.)
    assert result["rows"] == ["placeholder"] * 2 + ["aten.clone.default"] * 2, result["rows"]


def test_kernel_ops_become_triton_kernels_in_the_graph_for_inductor_on_cuda():
    out = subprocess.run([sys.executable, "-c", _SIMULATED], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    result = json.loads(out.stdout.strip().splitlines()[-1])
    before, after = result["before"], result["after"]
    assert before["fp4.fake_quantize.default"] == 4 and before["fp4.wgrad_amax.default"] == 2
    # Every kernel op is gone but the one that checks its output (a read back to the host).
    assert after.get("fp4.fake_quantize.default") == 1
    for op in ("quantize", "rht_quantize", "fake_rht_quantize", "fake_dual_quantize", "wgrad_amax",
               "transpose_quantized", "decode_blocks", "emulated_mm"):
        assert f"fp4.{op}.default" not in after, op
    # The kernels: wgrad_amax x2 (one each), fake_quantize x3 (one pass each: amax given), quantize 16x16
    # (amax + quantize), decode, transpose, dual x2 (one each), fake_rht_quantize (amax + quantize), and
    # the emulated GEMM's epilogue (alpha computed in it) after its torch.mm (an fp32 output).
    assert after["triton_kernel_wrapper_functional"] == 2 + 3 + 2 + 1 + 1 + 2 + 2 + 1
    assert after["aten.mm.dtype"] == 1
    # One op mixes the step's base with every SR stream's constant (7 streams: the dual quantizers have
    # two); each kernel reads its own element through a view, no kernel per stream.
    assert after["fp4.sr_base.default"] == 1 and after["aten.slice.Tensor"] == 7
    assert "aten.bitwise_xor.Scalar" not in after
    choices = {(c[2], c[3], c[4]) for c in result["choices"]}
    assert ("fp4.fake_quantize", "triton", "it checks its output for non-finite values (a read back to the host)") in choices
    assert sum(c[3] == "in-graph triton" for c in result["choices"]) == 12
    # Inductor can lower everything the kernels' traces hold (their buffers come as ``aten.full``/``empty``).
    assert result["unlowered"] == []
    # Inductor's analysis of each kernel finds it writing only the buffers made for it, never an input: a
    # kernel Inductor thinks writes its input gets a copy of that input before every launch.
    assert len(result["writes"]) == 14
    for written in result["writes"]:
        assert written and all(t.startswith(("aten.empty", "aten.full")) for t in written), written
    # Two SR quantizers of one tensor with different seeds launch kernels with equal scalar arguments (the
    # streams come as device data), so Inductor compiles that kernel once for both.
    rows = [s for s in result["scalars"] if s[0] == "_quantize_rows_kernel"]
    assert len(rows) == 4 and rows[-1] == rows[-2]
    # They share one trace: the same kernel and constants entries of Inductor's kernel table.
    row_tables = [t for s, t in zip(result["scalars"], result["tables"]) if s[0] == "_quantize_rows_kernel"]
    assert row_tables[-1] == row_tables[-2] and row_tables[0] != row_tables[-1]
    # Likewise both streams of the dual quantizer (each its own device base).
    dual = [s for s in result["scalars"] if s[0] == "_dual_quantize_kernel"]
    assert len(dual) == 2 and dual[0] == dual[1]
    # Inductor's analysis of what each kernel reads and writes ran once per kernel and argument types and
    # constants (the equal launches above share it) and gives each launch what a fresh analysis gives.
    assert result["reused_equal_fresh"]
    assert result["launches"] == 14 and result["analyses"] == 11


def test_sr_base_mixes_the_step_base_with_each_node_constant():
    saved = runtime.get_rng_state()
    runtime.manual_seed(3)
    keys = [5, -7, 2**62 + 1]
    out = torch.ops.fp4.sr_base(torch.device("cpu"), keys)
    base = int(runtime.device_base("cpu"))
    assert out.dtype == torch.int64 and out.shape == (6,)
    assert out[0::2].tolist() == [base ^ k for k in keys]
    runtime.advance()  # a new step: the same op gives the new base's mix
    new_base = int(runtime.device_base("cpu"))
    assert new_base != base
    assert torch.ops.fp4.sr_base(torch.device("cpu"), keys)[0::2].tolist() == [new_base ^ k for k in keys]
    runtime.set_rng_state(saved)


@pytest.mark.slow
def test_in_graph_kernels_can_be_turned_off():
    import json
    import os

    env = {**os.environ, "FP4COMPILE_IN_GRAPH_KERNELS": "0"}
    out = subprocess.run([sys.executable, "-c", _SIMULATED], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["after"] == result["before"]  # every kernel op stays one op call
    assert result["writes"] == []
    assert {c[3] for c in result["choices"]} == {"triton"}  # op calls that launch the kernels
    assert sum("in-graph kernels are off" in c[4] for c in result["choices"]) == 13


@pytest.mark.slow
def test_in_graph_kernels_auto_makes_op_calls_only_under_cuda_graphs():
    import json
    import os

    results = {}
    for graphs in ("0", "1"):
        env = {**os.environ, "FP4COMPILE_IN_GRAPH_KERNELS": "auto", "SIMULATED_CUDA_GRAPHS": graphs}
        out = subprocess.run([sys.executable, "-c", _SIMULATED], capture_output=True, text=True, timeout=600, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        results[graphs] = json.loads(out.stdout.strip().splitlines()[-1])
    # Recorded in CUDA graphs: every kernel op stays one op call, and the report says why.
    recorded = results["1"]
    assert recorded["after"] == recorded["before"] and recorded["writes"] == []
    assert sum("recorded in CUDA graphs" in c[4] for c in recorded["choices"]) == 13
    # Not recorded: the kernels go into the graph, as with in-graph kernels on.
    assert sum(c[3] == "in-graph triton" for c in results["0"]["choices"]) == 12
    assert "fp4.quantize.default" not in results["0"]["after"]


def test_the_report_says_how_each_quantizer_runs_on_the_cpu(fresh_dynamo):
    torch.manual_seed(0)
    backend = Backend()
    model = torch.compile(Stack(), backend=backend)
    model(torch.randn(32, 64)).sum().backward()
    choices = backend.report.quantizer_kernels()
    # The executor table's choice: the reference (after the RHT, for the wgrad operands), Triton declining.
    assert {(op, impl) for op, impl, _ in choices} == {
        ("fp4.quantize", "reference"), ("fp4.rht_quantize", "unfused"), ("fp4.transpose_quantized", "reference")
    }
    assert {reason for _, _, reason in choices} == {"triton declined: its input is on cpu, not CUDA"}
    table = backend.report.precision_table()
    assert "fp4.quantize" in table and "nodes): reference: triton declined: its input is on cpu, not CUDA" in table


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode,gemm", [(None, "torch"), ("reduce-overhead", "torch"), (None, "cublaslt"),
                                       ("reduce-overhead", "cublaslt")])
def test_gpu_in_graph_kernels_give_the_bits_of_the_ops(fresh_dynamo, monkeypatch, mode, gemm):
    """Inductor with the kernels in its code against Inductor calling the fp4 ops (in-graph kernels off):
    the same logits and gradients, bit for bit, over three steps (fresh SR bits each). Both compile the
    same graph around the quantizers, so only how the quantizers run differs. ``gemm``: the emulated
    GEMM, ``torch`` (traced into the graph) or ``cublaslt`` (alpha computed in the graph and
    ``fp4.cublaslt_mm``, against ``fp4.emulated_mm`` computing alpha itself)."""
    from fp4compile import config
    from fp4compile.codegen import cublaslt_gemm

    if gemm == "cublaslt" and not cublaslt_gemm.available()[0]:
        pytest.skip(cublaslt_gemm.available()[1])
    results = {}
    monkeypatch.setattr(config, "emulated_gemm", gemm)
    for in_graph in (False, True):
        monkeypatch.setattr(config, "in_graph_kernels", in_graph)
        torch._dynamo.reset()
        torch.manual_seed(0)
        runtime.manual_seed(7)
        model = Stack(256).cuda()
        backend = Backend(inner="inductor", mode=mode)
        compiled = torch.compile(model, backend=backend)
        outs = []
        for step in range(3):
            x = torch.randn(512, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
            y = compiled(x)
            y.square().sum().backward()
            outs.append((y.detach().clone(), [p.grad.clone() for p in model.parameters()]))
            model.zero_grad(set_to_none=True)
        results[in_graph] = outs
        every = backend.report.quantizer_kernels()
        choices = [c for c in every if c[0] != "fp4.emulated_mm"]  # the kernels' ops, less the GEMM's
        gemms = {impl for op, impl, _ in every if op == "fp4.emulated_mm"}
        assert gemms == ({"cublaslt"} if gemm == "cublaslt" else {"in-graph triton" if in_graph else "triton"}), gemms
        final = [g for ctx in backend.report.latest for stage, g in ctx.final_graphs.items() if stage in ("forward", "backward")]
        targets = {str(n.target) for g in final for n in g.nodes if n.op == "call_function"}
        if in_graph:
            assert choices and all(impl == "in-graph triton" for _, impl, _ in choices), choices
            assert "triton_kernel_wrapper_functional" in targets
            assert not any(t.startswith("fp4.") and "quantize" in t for t in targets), targets
            assert ("fp4.cublaslt_mm.default" in targets) == (gemm == "cublaslt")
            assert "fp4.emulated_mm.default" not in targets
        else:
            assert choices and all(impl == "triton" for _, impl, _ in choices), choices
            assert "triton_kernel_wrapper_functional" not in targets
    for step, ((y_e, g_e), (y_i, g_i)) in enumerate(zip(results[False], results[True])):
        for name, a, b in [("logits", y_e, y_i), *((f"grad {i}", a, b) for i, (a, b) in enumerate(zip(g_e, g_i)))]:
            assert torch.equal(a, b), f"step {step} {name}: {(a != b).sum().item()} of {a.numel()} differ"


# Emulated GEMMs on a simulated sm_90 device where cuBLASLt runs them (the bindings' presence simulated):
# two NVFP4 ones (block scale rules "6" and "4/6", bf16 and fp32 outputs) and an MXFP4 one. Prints the
# call targets after the lowering, the constants alpha is computed with, and the report's choices.
_CUBLASLT = _SIMULATE_SM90.replace('"FP4COMPILE_EMULATED_GEMM"] = "torch"', '"FP4COMPILE_EMULATED_GEMM"] = "auto"') + textwrap.dedent("""
    from fp4compile.codegen import cublaslt_gemm
    cublaslt_gemm.available = lambda: (True, "cuBLASLt (simulated)")

    def f(a, b, a_amax, b_amax):
        return (torch.ops.fp4.emulated_mm(a, a_amax, b, b_amax, "nvfp4", torch.bfloat16),
                torch.ops.fp4.emulated_mm(a, b_amax, b, a_amax, "nvfp4", torch.float32, "4/6"),
                torch.ops.fp4.emulated_mm(a, a_amax, b, b_amax, "mxfp4", torch.bfloat16))

    with FakeTensorMode():
        a = torch.empty(64, 128, device="cuda", dtype=torch.bfloat16)
        b = torch.empty(32, 128, device="cuda", dtype=torch.bfloat16)
        amax = torch.empty((), device="cuda", dtype=torch.float32)
        gm = make_fx(f)(a, b, amax, amax.clone())
    ctx = CompileContext(fp4compile.Recipe(), 0)
    ctx.inner = "inductor"
    gm = lower_kernels(gm, ctx)
    after = collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    constants = sorted({n.args[1] for n in gm.graph.nodes if str(n.target) == "aten.mul.Tensor"
                        and isinstance(n.args[1], float)})
    gemms = [[str(a) if isinstance(a, torch.fx.Node) else str(a) for a in n.args]
             for n in gm.graph.nodes if str(n.target) == "fp4.cublaslt_mm.default"]
    print(json.dumps({"after": after, "constants": constants, "gemms": gemms,
                      "choices": [c[2:] for c in ctx.kernels]}))
""")


def test_an_emulated_gemm_cublaslt_runs_computes_its_alpha_in_the_graph():
    """Where cuBLASLt runs an emulated NVFP4 GEMM of a graph Inductor compiles, alpha is three float32
    products in the graph (amax_A * fp32(1/G) times amax_B * fp32(1/G), G of the block scale rule) and the
    GEMM is ``fp4.cublaslt_mm`` reading it: no op at run time chooses an implementation or launches
    alpha's kernels. The MXFP4 GEMM (no alpha) is not cuBLASLt's and keeps its own form."""
    import json

    out = subprocess.run([sys.executable, "-c", _CUBLASLT], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    after = result["after"]
    assert after["fp4.cublaslt_mm.default"] == 2 and after["aten.mul.Tensor"] == 2 * 3
    assert after["fp4.emulated_mm.default"] == 1  # the MXFP4 one: a BF16 GEMM, no alpha
    f32 = lambda v: float(torch.tensor(v, dtype=torch.float32))  # noqa: E731
    assert result["constants"] == sorted([f32(1 / 2688), f32(1 / 1536)])
    assert [g[-1] for g in result["gemms"]] == ["torch.bfloat16", "torch.float32"]
    assert [c[1] for c in result["choices"]] == ["cublaslt", "cublaslt", "cuda-bf16"]


def test_alpha_in_the_graph_gives_the_bits_of_the_emulated_gemm(monkeypatch):
    """The lowered form (alpha as ATen ops, ``fp4.cublaslt_mm``) against ``fp4.emulated_mm`` on the CPU,
    with a cuBLASLt entry that takes CPU calls: bit for bit, run eagerly and compiled by Inductor (whose
    code computes alpha), for both block scale rules and output dtypes, on amaxes whose alpha rounds."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fp4compile import executors, reference
    from fp4compile.passes.lower_kernels import lower_kernels
    from fp4compile.sites import CompileContext

    monkeypatch.setattr(executors, "_TABLE", dict(executors._TABLE))  # restored whole after the test
    executors.unregister("emulated_mm", "cublaslt")
    executors.register("emulated_mm", "cublaslt", lambda *a: (True, ""), reference.decoded_product, before="triton")
    # Only fp4compile's own entry is rewritten: another of that name runs as called.
    gm = make_fx(lambda a, b, x, y: torch.ops.fp4.emulated_mm(a, x, b, y, "nvfp4", torch.bfloat16),
                 tracing_mode="fake")(*(torch.ones(16, 16, dtype=torch.bfloat16),) * 2, torch.tensor(1.0), torch.tensor(1.0))
    ctx = CompileContext(fp4compile.Recipe(), 0)
    ctx.inner = "inductor"
    targets = [n.target for n in lower_kernels(gm, ctx).graph.nodes]
    assert torch.ops.fp4.emulated_mm.default in targets and torch.ops.fp4.cublaslt_mm.default not in targets
    monkeypatch.setattr(executors, "CUBLASLT", executors._entries("emulated_mm")[0])

    def f(a, b, a_amax, b_amax):
        return (torch.ops.fp4.emulated_mm(a, a_amax, b, b_amax, "nvfp4", torch.bfloat16),
                torch.ops.fp4.emulated_mm(a, b_amax, b, a_amax, "nvfp4", torch.float32, "4/6"))

    torch.manual_seed(0)
    codes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    a = (codes[torch.randint(0, 8, (48, 64))] * torch.randn(48, 64).sign()).bfloat16()
    b = (codes[torch.randint(0, 8, (32, 64))] * torch.randn(32, 64).sign()).bfloat16()
    a_amax, b_amax = torch.tensor(3.1e-3), torch.tensor(7.77e4)
    expected = f(a, b, a_amax, b_amax)
    gm = make_fx(f, tracing_mode="fake")(a, b, a_amax, b_amax)
    ctx = CompileContext(fp4compile.Recipe(), 0)
    ctx.inner = "inductor"
    lowered = lower_kernels(gm, ctx)
    lowered.recompile()
    targets = [n.target for n in lowered.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.fp4.cublaslt_mm.default) == 2 and torch.ops.fp4.emulated_mm.default not in targets
    for got in (lowered(a, b, a_amax, b_amax), torch.compile(lowered, backend="inductor")(a, b, a_amax, b_amax)):
        for y, y_ref in zip(got, expected):
            assert y.dtype == y_ref.dtype and torch.equal(y, y_ref)
    # Operands cuBLASLt does not take (float16): the op stays, to raise or fall back as it does, and the
    # report says why.
    gm = make_fx(lambda a, b, x, y: torch.ops.fp4.emulated_mm(a, x, b, y, "nvfp4", torch.float16),
                 tracing_mode="fake")(a.half(), b.half(), a_amax, b_amax)
    ctx = CompileContext(fp4compile.Recipe(), 0)
    ctx.inner = "inductor"
    targets = [n.target for n in lower_kernels(gm, ctx).graph.nodes]
    assert torch.ops.fp4.emulated_mm.default in targets and torch.ops.fp4.cublaslt_mm.default not in targets
    assert ctx.kernels[-1][3] == "cublaslt" and "bfloat16 operands" in ctx.kernels[-1][4]
