"""Each pass on a tiny graph: node targets and metadata before and after."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch._functorch.aot_autograd import aot_module_simplified
from torch._functorch.partitioners import default_partition
from functorch.compile import make_boxed_func

from fp4compile import Recipe, ops, vocabulary
from fp4compile.passes import fuse_amax as amax_module
from fp4compile.passes import pipeline
from fp4compile.passes import lower_gemms as gemms_module
from fp4compile.passes.assign_precision import assign_precision
from fp4compile.passes.find_gemm_sites import find_gemm_sites
from fp4compile.passes.fuse_amax import fuse_amax
from fp4compile.passes.fuse_rht_quantize import fuse_rht_quantize
from fp4compile.passes.insert_quantize import insert_quantize
from fp4compile.passes.insert_rht import insert_rht
from fp4compile.passes.lower_gemms import lower_gemms
from fp4compile.passes.mark_fp4_linear import mark_fp4_linear
from fp4compile.passes.plan_gemm_roles import plan_gemm_roles
from fp4compile.passes.plan_sharing import plan_sharing
from fp4compile.sites import CompileContext, bound_arguments, clone_dynamo_module


def upto(passes, last):
    """The passes of a pipeline list up to and including ``last``, in the pipeline's order."""
    return passes[: passes.index(last) + 1]


MARKING = upto(pipeline.DYNAMO_PASSES, mark_fp4_linear)  # find_gemm_sites ... mark_fp4_linear

F4 = torch.ops.fp4


class Block(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.p = nn.Parameter(torch.randn(d, d) / d**0.5)

    def forward(self, x):
        return x + torch.relu(self.fc(x)) @ self.p


class Net(nn.Module):
    def __init__(self, n=4, d=32):
        super().__init__()
        self.blocks = nn.ModuleList([Block(d) for _ in range(n)])
        self.lm_head = nn.Linear(d, 8, bias=False)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.lm_head(x)


def capture(model, *inputs):
    graphs = []

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:  # dynamo drops some metadata (grapharg) once compiled: keep a copy
            node.meta = dict(node.meta)
        graphs.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend)(*inputs)
    torch._dynamo.reset()
    assert len(graphs) == 1
    return graphs[0]


def targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.fixture
def dynamo_graph():
    torch.manual_seed(0)
    model = Net()
    gm, example = capture(model, torch.randn(2, 16, 32))
    return model, gm, example


def test_find_gemm_sites_finds_linears_and_parameter_matmuls(dynamo_graph):
    _, gm, _ = dynamo_graph
    ctx = CompileContext(Recipe(), 0)
    find_gemm_sites(gm, ctx)
    assert [s.name for s in ctx.sites] == [n for b in range(4) for n in (f"blocks.{b}.fc", f"blocks.{b}.p")] + ["lm_head"]
    assert [s.kind for s in ctx.sites[:2]] == ["linear", "matmul"]
    fc, p = ctx.sites[:2]
    assert (fc.in_features, fc.out_features, fc.has_bias, fc.input_shape) == (32, 32, True, (2, 16, 32))
    assert (p.in_features, p.out_features, p.has_bias) == (32, 32, False)
    tagged = [n for n in gm.graph.nodes if "fp4_site" in n.meta]
    assert [n.meta["fp4_site"] for n in tagged] == list(range(9))
    assert fc.roles["fprop"].shape == (32, 32, 32)


def test_find_blocks_and_assign_precision(dynamo_graph):
    _, gm, _ = dynamo_graph
    ctx = CompileContext(Recipe(), 0)
    for p in upto(pipeline.DYNAMO_PASSES, assign_precision):
        p(gm, ctx)
    assert ctx.n_blocks == 4 and ctx.block_names == [f"blocks.{i}" for i in range(4)]
    plan = {s.name: (s.block, s.precision) for s in ctx.sites}
    assert plan["blocks.0.fc"] == (0, "high") and plan["blocks.3.p"] == (3, "high")
    assert plan["blocks.1.fc"] == (1, "nvfp4") and plan["blocks.2.p"] == (2, "nvfp4")
    assert plan["lm_head"] == (None, "high")


_GLOBAL_HELPER = nn.GELU()  # a parameter-free module the model's code reaches through its module's globals


class _UsesGlobalModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(32, 32) for _ in range(3)])

    def forward(self, x):
        for block in self.blocks:
            x = _GLOBAL_HELPER(block(x))
        return x


def test_modules_reached_through_globals_are_not_the_model():
    """A helper module from the model code's globals (as Hugging Face's hub-kernel layers) is neither a
    second root nor the module a GEMM belongs to: the sites keep the model's paths."""
    from fp4compile.passes.find_gemm_sites import graph_root

    gm, _ = capture(_UsesGlobalModule(), torch.randn(2, 16, 32))
    stacks = [q for n in gm.graph.nodes for q, _ in (n.meta.get("nn_module_stack") or {}).values()]
    assert any(q.startswith("G[") for q in stacks) and any(q.startswith("L[") for q in stacks)
    assert graph_root(gm) == "L['self']"
    ctx = CompileContext(Recipe(), 0)
    find_gemm_sites(gm, ctx)
    assert [s.name for s in ctx.sites] == ["blocks.0", "blocks.1", "blocks.2"]


def test_mark_fp4_linear_rewrites_only_low_precision_sites(dynamo_graph):
    _, gm, _ = dynamo_graph
    ctx = CompileContext(Recipe(), 0)
    for p in upto(pipeline.DYNAMO_PASSES, assign_precision):
        p(gm, ctx)
    linear_before = targets(gm).count(torch._C._nn.linear)
    mark_fp4_linear(gm, ctx)
    after = targets(gm)
    assert after.count(ops.linear) == 4  # fc and p of blocks 1 and 2
    assert after.count(torch._C._nn.linear) == linear_before - 2
    assert after.count(torch.t) == 2  # x @ p -> fp4.linear(x, p.t())
    marked = [n for n in gm.graph.nodes if n.target is ops.linear]
    assert sorted(n.args[3] for n in marked) == [2, 3, 4, 5]


def aot_graphs(gm, example, ctx, passes):
    """Trace forward and backward with aot_autograd and run ``passes`` on both; return the graphs."""
    return _run_with_grads(gm, example, ctx, passes)[0]


@pytest.fixture
def marked(dynamo_graph):
    _, gm, example = dynamo_graph
    ctx = CompileContext(Recipe(), 0)
    for p in MARKING:
        p(gm, ctx)
    return gm, example, ctx


@pytest.fixture
def marked_unshared(dynamo_graph):
    """``marked`` with every weight quantized by each of its GEMMs (Recipe(share_weight=False))."""
    _, gm, example = dynamo_graph
    ctx = CompileContext(Recipe(share_weight=False), 0)
    for p in MARKING:
        p(gm, ctx)
    return gm, example, ctx


def role_nodes(graph, target):
    return [n for n in graph.graph.nodes if n.target is target]


def test_marked_graph_traces_to_role_tagged_gemms(marked):
    gm, example, ctx = marked
    graphs = aot_graphs(gm, example, ctx, [plan_gemm_roles])
    fw = [n.args[2] for n in role_nodes(graphs["forward"], F4.gemm.default)]
    bw = [n.args[2] for n in role_nodes(graphs["backward"], F4.gemm.default)]
    assert fw == ["fprop"] * 4
    assert sorted(bw) == ["dgrad"] * 4 + ["wgrad"] * 4
    info = role_nodes(graphs["backward"], F4.gemm.default)[0].meta["fp4_role"]
    assert info.precision == "nvfp4"
    wgrad = ctx.sites[2].roles["wgrad"]
    assert wgrad.shape == (32, 32, 32) and wgrad.rht and wgrad.rounding == ("sr", "rne")
    assert ctx.sites[2].roles["fprop"].blocks == ("1x16", "16x16")


def test_insert_rht_only_on_wgrad_operands(marked):
    gm, example, ctx = marked
    graphs = aot_graphs(gm, example, ctx, [plan_gemm_roles, insert_rht])
    assert role_nodes(graphs["forward"], F4.rht.default) == []
    rhts = role_nodes(graphs["backward"], F4.rht.default)
    assert len(rhts) == 8
    for r in rhts:
        (user,) = r.users
        assert user.target is F4.gemm.default and user.args[2] == "wgrad"


def test_insert_quantize_blocks_and_rounding(marked):
    gm, example, ctx = marked
    graphs = aot_graphs(gm, example, ctx, [plan_gemm_roles, insert_rht, insert_quantize])
    seen = {}
    for stage, graph in graphs.items():
        for q in role_nodes(graph, F4.quantize.default):
            meta = q.meta["fp4_quantize"]
            seen.setdefault((meta["role"], meta["operand"]), set()).add((q.args[2], q.args[3]))
            deq = [u for u in q.users if u.target is operator.getitem]
            assert len(deq) == 3
        # dgrad reads the weight fprop quantized (Recipe(share_weight=True)), transposed in packed form.
        for t in role_nodes(graph, F4.transpose_quantized.default):
            meta = t.meta["fp4_quantize"]
            assert stage == "backward" and meta["shared"] == "fprop+dgrad"
            seen.setdefault((meta["role"], meta["operand"]), set()).add((meta["block"], meta["rounding"]))
    assert len(role_nodes(graphs["backward"], F4.transpose_quantized.default)) == 4
    assert seen == {
        ("fprop", "X"): {("1x16", "rne")},
        ("fprop", "W"): {("16x16", "rne")},
        ("dgrad", "dY"): {("1x16", "sr")},
        ("dgrad", "W^T"): {("16x16", "rne")},
        ("wgrad", "dY^T"): {("1x16", "sr")},
        ("wgrad", "X^T"): {("1x16", "rne")},
    }
    for graph in graphs.values():
        for g in role_nodes(graph, F4.gemm.default):
            assert all(a.target is F4.dequantize.default for a in g.args[:2])


def test_lower_gemms_replaces_every_quantized_gemm(marked):
    """On the CPU every FP4 GEMM takes the packed emulated form, fp4.scaled_mm on the quantizers' outputs."""
    gm, example, ctx = marked
    graphs = aot_graphs(gm, example, ctx, [plan_gemm_roles, insert_rht, insert_quantize, lower_gemms])
    assert len(role_nodes(graphs["forward"], F4.scaled_mm.default)) == 4
    assert len(role_nodes(graphs["backward"], F4.scaled_mm.default)) == 8
    for graph in graphs.values():
        assert role_nodes(graph, F4.gemm.default) == []
        assert role_nodes(graph, F4.dequantize.default) == []
        for mm in role_nodes(graph, F4.scaled_mm.default):
            assert mm.args[6] == "nvfp4" and mm.args[8] == "emulation"
            # Operands from quantize nodes; dgrad's W^T from the forward's W, transposed (kept packed).
            sources = [a.args[0].target for a in mm.args[:6] if a.op != "placeholder"]
            if mm.meta["fp4_role"].role == "dgrad":
                assert sources == [F4.quantize.default] * 3 + [F4.transpose_quantized.default] * 2
                assert mm.args[5].op == "placeholder"  # the amax of W, saved by the forward
            else:
                assert sources == [F4.quantize.default] * 6
    assert ctx.sites[2].roles["fprop"].kernel == "emulation"
    assert "not a CUDA GPU" in ctx.sites[2].roles["fprop"].kernel_reason


@pytest.mark.parametrize("fmt, block", [("nvfp4", "1x16"), ("mxfp4", "1x32")])
def test_fuse_rht_quantize_fuses_both_wgrad_operands(dynamo_graph, fmt, block):
    """Each wgrad operand's RHT moves into its quantize, for both formats (on CUDA the fused op is one
    Triton kernel per format), with the seed and metadata of the quantize it replaces."""
    _, gm, example = dynamo_graph
    ctx = CompileContext(Recipe(fmt=fmt), 0)
    for p in MARKING:
        p(gm, ctx)
    unfused = aot_graphs(gm, example, ctx, [plan_gemm_roles, insert_rht, insert_quantize, lower_gemms])
    seeds = {(n.meta["fp4_quantize"]["site"], n.meta["fp4_quantize"]["operand"]): n.args[4]
             for n in role_nodes(unfused["backward"], F4.quantize.default) if n.args[0].target is F4.rht.default}
    assert len(seeds) == 8
    passes = [plan_gemm_roles, insert_rht, insert_quantize, fuse_rht_quantize, lower_gemms]
    graphs = aot_graphs(gm, example, ctx, passes)
    assert role_nodes(graphs["forward"], F4.rht_quantize.default) == []
    backward = graphs["backward"]
    assert role_nodes(backward, F4.rht.default) == []
    fused = role_nodes(backward, F4.rht_quantize.default)
    assert len(fused) == 8
    for node in fused:
        meta = node.meta["fp4_quantize"]
        assert node.args[1:4] == (16, fmt, block) and meta["role"] == "wgrad" and meta["rht"] == 16
        assert node.args[5] == seeds[(meta["site"], meta["operand"])]
        assert {u.args[0] for u in node.users} == {node}
        for mm in {v for u in node.users for v in u.users}:
            assert mm.target is F4.scaled_mm.default and mm.args[6] == fmt
    # The quantize nodes of dgrad stay as they are: dY's, and W^T's unless fprop's W is shared (NVFP4).
    assert len(role_nodes(backward, F4.quantize.default)) == (4 if fmt == "nvfp4" else 8)


def test_quantize_dequantize_stage_is_numerically_close_to_lowered(marked):
    """Every stage is a runnable program: the QDQ form and the lowered form agree to rounding."""
    gm, example, ctx = marked
    results = {}
    for name, passes in {
        "qdq": [plan_gemm_roles, insert_rht, insert_quantize],
        "lowered": [plan_gemm_roles, insert_rht, insert_quantize, fuse_rht_quantize, lower_gemms],
    }.items():
        graphs = aot_graphs(gm, example, ctx, passes)
        results[name] = graphs["forward"](*[t.detach() for t in example])[0]
    torch.testing.assert_close(results["qdq"], results["lowered"], rtol=1e-5, atol=1e-5)


def _run_with_grads(gm, example, ctx, passes, joint=None):
    """(graphs, forward output, gradients of every input that requires grad) through ``passes``, after
    the joint graph's pass (``plan_sharing``) as the backend runs it; ``joint``, a list, gets that graph."""
    out = {}

    def partition(graph, joint_inputs, **kwargs):
        plan_sharing(graph, ctx)
        graph.graph.lint()
        graph.recompile()
        if joint is not None:
            joint.append(graph)
        return default_partition(graph, joint_inputs, **kwargs)

    def compiler(stage):
        def compile_graph(graph, inputs):
            for p in passes:
                graph = p(graph, ctx)
            graph.graph.lint()
            graph.recompile()  # as run_passes does: the graph that runs is the one the passes made
            out[stage] = graph
            return make_boxed_func(graph.forward)

        return compile_graph

    compiled = aot_module_simplified(gm, example, fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                                     partition_fn=partition)
    inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in example]
    y = compiled(*inputs)
    y = y[0] if isinstance(y, (tuple, list)) else y
    (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
    return out, y.detach(), [t.grad for t in inputs if t.requires_grad]


LOWERED = upto(pipeline.AOT_PASSES, lower_gemms)  # plan_gemm_roles ... lower_gemms, as the backend runs them


@pytest.mark.parametrize("decoded", [True, False])
def test_lower_gemms_keeps_emulated_gemms_packed_off_cuda(marked, monkeypatch, decoded):
    gm, example, ctx = marked
    ctx.recipe = ctx.recipe.replace(decoded_operands=decoded)
    monkeypatch.setattr(gemms_module, "decodes_on", lambda device: False)
    graphs = aot_graphs(gm, example, ctx, LOWERED)
    assert len(role_nodes(graphs["forward"], F4.scaled_mm.default)) == 4
    assert len(role_nodes(graphs["backward"], F4.scaled_mm.default)) == 8
    for graph in graphs.values():
        assert role_nodes(graph, F4.emulated_mm.default) == []


def test_lower_gemms_with_packed_operands_decodes_before_each_gemm(marked, monkeypatch):
    """Recipe(decoded_operands=False) on CUDA (forced here on the CPU): every emulated NVFP4 GEMM becomes
    fp4.emulated_mm on fp4.decode_blocks of the packed operands, which the quantizers still write (and
    the backward still keeps); dgrad reads W decoded as stored, transposed. The same bits."""
    gm, example, ctx = marked
    import fp4compile

    ctx.recipe = ctx.recipe.replace(decoded_operands=False)
    fp4compile.manual_seed(3)
    plain, y_ref, grads_ref = _run_with_grads(gm, example, ctx, LOWERED)
    monkeypatch.setattr(gemms_module, "decodes_on", lambda device: True)
    fp4compile.manual_seed(3)
    graphs, y, grads = _run_with_grads(gm, example, ctx, LOWERED)
    quantizers = (F4.quantize.default, F4.rht_quantize.default)
    for stage, graph in graphs.items():
        assert role_nodes(graph, F4.scaled_mm.default) == []
        assert role_nodes(graph, F4.transpose_quantized.default) == []
        assert [n for n in graph.graph.nodes if n.target in (F4.fake_quantize.default, F4.fake_rht_quantize.default)] == []
        # The quantizers are those of the packed graph.
        assert sum(n.target in quantizers for n in graph.graph.nodes) == sum(
            n.target in quantizers for n in plain[stage].graph.nodes)
        gemms = role_nodes(graph, F4.emulated_mm.default)
        assert len(gemms) == {"forward": 4, "backward": 8}[stage]
        assert len(role_nodes(graph, F4.decode_blocks.default)) == 2 * len(gemms)
        for mm in gemms:
            for operand in (mm.args[0], mm.args[2]):
                if operand.target is torch.ops.aten.permute.default:  # dgrad's W^T
                    assert mm.meta["fp4_role"].role == "dgrad" and operand.args[1] == [1, 0]
                    operand = operand.args[0]
                assert operand.target is F4.decode_blocks.default
    assert torch.equal(y, y_ref)
    assert len(grads) == len(grads_ref) > 0
    for g, g_ref in zip(grads, grads_ref):
        assert torch.equal(g, g_ref)


def test_lower_gemms_decoded_by_quantizers_gives_the_same_bits(marked_unshared, monkeypatch):
    """Where it applies (CUDA; forced here on the CPU), every emulated NVFP4 GEMM reads operands decoded by
    their quantizer: node counts, arguments and metadata carried over, and the same output and gradient bits."""
    gm, example, ctx = marked_unshared
    import fp4compile

    fp4compile.manual_seed(3)
    _, y_ref, grads_ref = _run_with_grads(gm, example, ctx, LOWERED)
    plain = aot_graphs(gm, example, ctx, LOWERED)
    quantize_args = {(n.meta["fp4_quantize"]["site"], n.meta["fp4_quantize"]["operand"], n.meta["fp4_quantize"]["role"]):
                     bound_arguments(n) for g in plain.values() for n in g.graph.nodes
                     if n.target in (F4.quantize.default, F4.rht_quantize.default)}
    monkeypatch.setattr(gemms_module, "decodes_on", lambda device: True)
    ctx.recipe = ctx.recipe.replace(decoded_operands=True)
    fp4compile.manual_seed(3)
    graphs, y, grads = _run_with_grads(gm, example, ctx, LOWERED)
    forward, backward = graphs["forward"], graphs["backward"]
    for graph in (forward, backward):
        for target in (F4.scaled_mm.default, F4.quantize.default, F4.rht_quantize.default, F4.dequantize.default):
            assert role_nodes(graph, target) == [], target
    assert len(role_nodes(forward, F4.emulated_mm.default)) == 4
    assert len(role_nodes(forward, F4.fake_quantize.default)) == 8
    assert len(role_nodes(backward, F4.emulated_mm.default)) == 8
    assert len(role_nodes(backward, F4.fake_quantize.default)) == 8  # dY and W^T of dgrad
    assert len(role_nodes(backward, F4.fake_rht_quantize.default)) == 8  # both wgrad operands
    decoded = [n for g in (forward, backward) for n in g.graph.nodes
               if n.target in (F4.fake_quantize.default, F4.fake_rht_quantize.default)]
    assert len(decoded) == len(quantize_args) == 24
    for node in decoded:
        meta = node.meta["fp4_quantize"]
        assert meta["decoded"] is True
        want = quantize_args[(meta["site"], meta["operand"], meta["role"])]
        got = bound_arguments(node)
        assert got.pop("x").name == want["x"].name  # the same operand, seed and label
        assert got == {k: v for k, v in want.items() if k not in ("x", "layout")}
    for mm in role_nodes(backward, F4.emulated_mm.default):
        assert mm.meta["fp4_role"].role in ("dgrad", "wgrad") and mm.args[4:] == ("nvfp4", torch.float32)
        for operand, amax in ((mm.args[0], mm.args[1]), (mm.args[2], mm.args[3])):
            assert operand.args == (operand.args[0], 0) and amax.args == (operand.args[0], 1)
    assert torch.equal(y, y_ref)
    assert len(grads) == len(grads_ref) > 0
    for g, g_ref in zip(grads, grads_ref):
        assert torch.equal(g, g_ref)


def test_lower_gemms_decodes_an_operand_read_elsewhere(marked_unshared, monkeypatch):
    """A quantized operand that something else also reads keeps its packed form; its GEMM reads it
    through fp4.decode_blocks, the other operand decoded by its quantizer."""
    gm, example, ctx = marked_unshared
    ctx.recipe = ctx.recipe.replace(decoded_operands=True)
    monkeypatch.setattr(gemms_module, "decodes_on", lambda device: True)

    def share_one_amax(graph, ctx):  # a second reader of one fprop operand's amax
        gemm = [n for n in role_nodes(graph, F4.gemm.default) if n.args[0].target is F4.dequantize.default][0]
        amax = gemm.args[0].args[2]
        with graph.graph.inserting_after(gemm):
            extra = graph.graph.call_function(torch.ops.aten.add.Tensor, (amax, 1.0))
        extra.meta["val"] = amax.meta["val"]
        return graph

    graphs = aot_graphs(gm, example, ctx, LOWERED[:-1] + [share_one_amax, lower_gemms])
    forward = graphs["forward"]
    assert role_nodes(forward, F4.scaled_mm.default) == []
    assert len(role_nodes(forward, F4.emulated_mm.default)) == 4
    (decode,) = role_nodes(forward, F4.decode_blocks.default)
    (kept,) = role_nodes(forward, F4.quantize.default)
    assert [a.args for a in decode.args] == [(kept, 0), (kept, 1)]
    assert len(role_nodes(forward, F4.fake_quantize.default)) == 7


def _amax_sources(graph):
    quantizers = (F4.quantize.default, F4.rht_quantize.default, F4.fake_quantize.default, F4.fake_rht_quantize.default)
    metas = [n.meta["fp4_quantize"] for n in graph.graph.nodes if n.target in quantizers]
    duals = role_nodes(graph, F4.fake_dual_quantize.default) + role_nodes(graph, F4.dual_quantize.default)
    for n in duals:  # a gradient's two quantizations in one node
        metas += [n.meta["fp4_quantize"], n.meta["fp4_quantize_rht"]]
    return sorted((m["operand"], m["amax"]) for m in metas)


def _fused_against_own_passes(gm, example, ctx, monkeypatch):
    """The graphs of a run with ``fuse_amax`` forced on (as on CUDA), after checking that its outputs and
    gradients are the bits of the run where each quantizer makes its own amax pass."""
    import fp4compile

    monkeypatch.setattr(gemms_module, "decodes_on", lambda device: True)  # as on CUDA: fp4.emulated_mm GEMMs
    fp4compile.manual_seed(5)
    _, y_ref, grads_ref = _run_with_grads(gm, example, ctx, LOWERED)
    monkeypatch.setattr(amax_module, "applies", lambda node: True)
    fp4compile.manual_seed(5)
    graphs, y, grads = _run_with_grads(gm, example, ctx, LOWERED + [fuse_amax])
    assert torch.equal(y, y_ref)
    assert len(grads) == len(grads_ref) > 0
    for g, g_ref in zip(grads, grads_ref):
        assert torch.equal(g, g_ref)
    return graphs


@pytest.mark.parametrize("decoded", [False, True])
def test_fuse_amax_gives_quantizers_their_amax_with_the_same_bits(marked, monkeypatch, decoded):
    """Where it applies (CUDA; forced here on the CPU): forward X operands take the amax from their producer,
    backward dY from one fp4.wgrad_amax shared with its wgrad twin; weights and X^T keep their own pass.
    Outputs and gradients keep their bits."""
    gm, example, ctx = marked
    ctx.recipe = ctx.recipe.replace(decoded_operands=decoded)
    graphs = _fused_against_own_passes(gm, example, ctx, monkeypatch)
    forward, backward = graphs["forward"], graphs["backward"]
    assert _amax_sources(forward) == [("W", "own pass")] * 4 + [("X", "producer")] * 4
    # W^T: the forward's quantization of W, transposed (Recipe(share_weight=True)), no quantizer here.
    assert _amax_sources(backward) == [("X^T", "own pass")] * 4 + [("dY", "wgrad_amax")] * 4 + [("dY^T", "wgrad_amax")] * 4
    assert len(role_nodes(forward, torch.ops.aten.amax.default)) == 4  # one per X operand, over all dims
    shared = role_nodes(backward, F4.wgrad_amax.default)
    assert len(shared) == 4
    for node in shared:
        readers = {u.target for item in node.users for u in item.users}
        # dY's two quantizations are one node (decoded or packed), and the GEMMs read the amaxes here.
        dual = F4.fake_dual_quantize.default if decoded else F4.dual_quantize.default
        assert readers == {dual, F4.emulated_mm.default}
        assert len(node.users) == 2
    assert len(role_nodes(backward, F4.fake_dual_quantize.default)) == (4 if decoded else 0)
    assert len(role_nodes(backward, F4.dual_quantize.default)) == (0 if decoded else 4)
    assert not role_nodes(backward, F4.quantize.default)  # every dY quantizer went into a dual node


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fuse_amax_gives_low_precision_operands_the_amax_of_their_stored_bits(monkeypatch, dtype):
    """A bf16 or fp16 X takes its amax from its producer too, as the largest bit pattern with the sign bit
    cleared (a bitcast: computed from the stored, rounded values), not as a float amax. Outputs and
    gradients keep the bits of each quantizer's own amax pass."""
    torch.manual_seed(0)
    model = Net().to(dtype)
    gm, example = capture(model, torch.randn(2, 16, 32, dtype=dtype))
    ctx = CompileContext(Recipe(), 0)
    for p in MARKING:
        p(gm, ctx)
    graphs = _fused_against_own_passes(gm, example, ctx, monkeypatch)
    forward = graphs["forward"]
    assert _amax_sources(forward) == [("W", "own pass")] * 4 + [("X", "producer")] * 4
    bitcasts = [n for n in role_nodes(forward, torch.ops.aten.view.dtype) if n.args[1] is torch.int16]
    assert len(bitcasts) == 4 and len(role_nodes(forward, torch.ops.aten.amax.default)) == 4
    assert role_nodes(forward, torch.ops.aten.abs.default) == []


class QKVBlock(nn.Module):
    """One normalised tensor read by three linears (q, k and v of attention)."""

    def __init__(self, d=32):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        h = self.norm(x)
        return x + self.q(h) * self.k(h) + self.v(h)


def test_fuse_amax_gives_the_quantizers_of_one_tensor_one_reduction(monkeypatch):
    """Three linears reading one LayerNorm output quantize it three times; the three quantizers take their
    amax from one reduction fused into the norm's kernel, not three."""
    torch.manual_seed(0)
    model = nn.Sequential(*[QKVBlock() for _ in range(4)])
    gm, example = capture(model, torch.randn(2, 16, 32))
    ctx = CompileContext(Recipe(), 0)
    for p in MARKING:
        p(gm, ctx)
    graphs = _fused_against_own_passes(gm, example, ctx, monkeypatch)
    forward = graphs["forward"]
    fp4_blocks = 2  # the first and last of the 4 blocks stay in high precision
    assert _amax_sources(forward).count(("X", "producer")) == 3 * fp4_blocks
    amaxes = role_nodes(forward, torch.ops.aten.amax.default)
    assert len(amaxes) == fp4_blocks
    assert all(len(a.users) == 3 for a in amaxes)


def test_fuse_amax_leaves_producers_alone_where_the_graph_runs_eagerly(marked, monkeypatch):
    """With ``inner="eager"`` nothing fuses the reduction into the producer (each op would be a kernel of
    its own): X keeps its quantizer's own amax pass, while dY still shares one fp4.wgrad_amax read."""
    gm, example, ctx = marked
    ctx.inner = "eager"
    graphs = _fused_against_own_passes(gm, example, ctx, monkeypatch)
    assert _amax_sources(graphs["forward"]) == [("W", "own pass")] * 4 + [("X", "own pass")] * 4
    assert role_nodes(graphs["forward"], torch.ops.aten.amax.default) == []
    assert len(role_nodes(graphs["backward"], F4.wgrad_amax.default)) == 4


def test_the_bit_pattern_amax_equals_the_float_amax():
    """The low-precision producer amax over the values where bit order could go wrong: signed zeros,
    subnormals, the largest finite values, infinities and NaN (which wins, as in torch.amax)."""
    for dtype in (torch.bfloat16, torch.float16):
        info = torch.finfo(dtype)
        special = torch.tensor([0.0, -0.0, info.tiny / 4, -info.tiny / 4, info.tiny, -info.max, info.max, 1.0, -3.5],
                               dtype=dtype)
        cases = [special, special[:2], torch.cat([special, torch.tensor([-float("inf")], dtype=dtype)]),
                 torch.cat([special, torch.tensor([float("nan")], dtype=dtype)]),
                 torch.cat([special, -torch.tensor([float("nan")], dtype=dtype)]), torch.randn(64, 48).to(dtype) * 100]
        for x in cases:
            g = fx.Graph()
            inp = g.placeholder("x")
            inp.meta["val"] = x
            q = g.call_function(F4.quantize.default, (inp, "nvfp4", "1x16", "rne", 0, ""))
            gm = fx.GraphModule(torch.nn.Module(), g)
            amax = amax_module._producer_amax(gm, q)
            g.erase_node(q)
            g.output(amax)
            gm.recompile()
            got = gm(x)
            want = x.float().abs().amax()
            assert got.dtype == torch.float32 and got.shape == ()
            assert torch.equal(got, want) or (got.isnan() and want.isnan()), (dtype, x)


@pytest.mark.parametrize("decoded", [False, True])
def test_fuse_amax_keeps_the_pair_apart_where_the_one_launch_kernel_declines(marked, monkeypatch, decoded):
    """Under the 4/6 block scale rule the dual kernel declines (it has no such rule): dY's two quantizers
    share the wgrad_amax read but stay two nodes, each a kernel of its own, with the same bits."""
    gm, example, ctx = marked
    ctx.recipe = ctx.recipe.replace(decoded_operands=decoded, block_scale_rule="4/6")
    graphs = _fused_against_own_passes(gm, example, ctx, monkeypatch)
    backward = graphs["backward"]
    assert len(role_nodes(backward, F4.wgrad_amax.default)) == 4
    assert not role_nodes(backward, F4.dual_quantize.default) + role_nodes(backward, F4.fake_dual_quantize.default)


@pytest.mark.parametrize("decoded", [False, True])
def test_forward_shares_x_amaxes_with_wgrad(dynamo_graph, monkeypatch, decoded):
    """Where X's amax costs a read (CUDA; forced here on the CPU), each FP4 linear's forward computes both
    amaxes of X in one fp4.wgrad_amax: fprop's X quantizer takes the first, and the backward keeps the
    second (a saved scalar) for RHT(X^T), which reads X once instead of twice. Same bits as without."""
    import fp4compile

    _, gm, example = dynamo_graph
    passes = LOWERED + [fuse_amax]  # as on CUDA
    monkeypatch.setattr(gemms_module, "decodes_on", lambda device: True)
    monkeypatch.setattr(amax_module, "applies", lambda node: True)
    results = {}
    for shared in (False, True):
        monkeypatch.setattr(vocabulary, "separate_amax_costs_a_read", lambda val: shared)
        marked = clone_dynamo_module(gm)
        ctx = CompileContext(Recipe(decoded_operands=decoded), 0)
        for p in MARKING:
            p(marked, ctx)
        fp4compile.manual_seed(5)
        joint = []
        results[shared] = _run_with_grads(marked, example, ctx, passes, joint)
        # The joint graph's plan: one wgrad_amax of X per linear, read by its fprop and wgrad GEMMs.
        amaxes = role_nodes(joint[0], F4.wgrad_amax.default)
        assert len(amaxes) == (4 if shared else 0)
        for node in amaxes:
            assert sorted(u.args[2] for item in node.users for u in item.users) == ["fprop", "wgrad"]
    (graphs, y, grads), (_, y_ref, grads_ref) = results[True], results[False]
    forward, backward = graphs["forward"], graphs["backward"]
    assert _amax_sources(forward) == [("W", "own pass")] * 4 + [("X", "wgrad_amax")] * 4
    assert _amax_sources(backward) == (
        [("X^T", "wgrad_amax in the forward")] * 4 + [("dY", "wgrad_amax")] * 4 + [("dY^T", "wgrad_amax")] * 4
    )
    assert len(role_nodes(forward, F4.wgrad_amax.default)) == 4
    assert len(role_nodes(backward, F4.wgrad_amax.default)) == 4  # dY's, shared by dgrad and wgrad
    transformed = F4.fake_rht_quantize.default if decoded else F4.rht_quantize.default
    x_t = [n for n in role_nodes(backward, transformed) if n.meta["fp4_quantize"]["operand"] == "X^T"]
    assert all(n.args[7].op == "placeholder" for n in x_t)  # the amax the forward saved
    assert torch.equal(y, y_ref)
    assert len(grads) == len(grads_ref) > 0
    for g, g_ref in zip(grads, grads_ref):
        assert torch.equal(g, g_ref)


def test_fuse_amax_needs_cuda(marked):
    gm, example, ctx = marked
    graphs = aot_graphs(gm, example, ctx, LOWERED + [fuse_amax])
    for graph in graphs.values():
        assert role_nodes(graph, F4.wgrad_amax.default) == []
        assert role_nodes(graph, torch.ops.aten.amax.default) == []
        assert {src for _, src in _amax_sources(graph)} == {"own pass"}


def test_fuse_amax_producer_rule():
    """Only floating-point tensors whose producers Inductor compiles into its own kernels take the amax
    nodes; graph inputs, GEMMs, attention and fp4 ops do not (they keep the quantizer's amax pass)."""
    g = fx.Graph()
    aten, prims = torch.ops.aten, torch.ops.prims

    def node(target, args, dtype=torch.float32, kwargs=None):
        n = g.call_function(target, args, kwargs or {})
        n.meta["val"] = torch.empty(2, 32, dtype=dtype)
        return n

    def view(n):
        t = node(aten.t.default, (n,), n.meta["val"].dtype)
        return node(aten.view.default, (t, [-1]), n.meta["val"].dtype)

    x, w = g.placeholder("x"), g.placeholder("w")
    x.meta["val"] = w.meta["val"] = torch.empty(2, 32)
    relu = node(aten.relu.default, (x,))
    mm = node(aten.mm.default, (x, w))
    ln = g.call_function(aten.native_layer_norm.default, (x, [32], None, None, 1e-5))
    ln_out = g.call_function(operator.getitem, (ln, 0))
    ln_out.meta["val"] = torch.empty(2, 32)
    sdpa = g.call_function(aten._scaled_dot_product_flash_attention.default, (x, x, x))
    attn = g.call_function(operator.getitem, (sdpa, 0))
    attn.meta["val"] = torch.empty(2, 32)
    q = g.call_function(F4.quantize.default, (x, "nvfp4", "1x16", "rne", 0, ""))
    codes = g.call_function(operator.getitem, (q, 0))
    # A cast is a pointwise op Inductor fuses, not a convolution for all that its name starts with "conv".
    # bf16 / fp16 results fuse too, a cast's or any other op's (a residual sum): their amax is taken from
    # the stored bits (see the bit-pattern tests); integer results do not.
    cast = node(prims.convert_element_type.default, (ln_out, torch.bfloat16), torch.bfloat16)
    wide = node(prims.convert_element_type.default, (cast, torch.float32))
    copy = node(aten._to_copy.default, (ln_out,), torch.float16, {"dtype": torch.float16})
    bf16_sum = node(aten.add.Tensor, (cast, cast), torch.bfloat16)
    conv = node(aten.convolution.default, (x, w, None, [1], [0], [1], False, [0], 1))
    scaled = node(aten._scaled_mm.default, (x, w, x, w))
    fusible = amax_module.producer_is_fusible
    ints = node(aten.add.Tensor, (x, x), torch.int32)
    assert fusible(relu) and fusible(view(relu)) and fusible(ln_out) and fusible(wide) and fusible(view(wide))
    assert fusible(cast) and fusible(view(cast)) and fusible(copy) and fusible(bf16_sum) and not fusible(ints)
    assert not fusible(x) and not fusible(view(x)) and not fusible(mm) and not fusible(view(mm))
    assert not fusible(attn) and not fusible(codes) and not fusible(conv) and not fusible(scaled)


def test_quantize_ops_take_a_given_amax_for_nvfp4_only():
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    amax = x.float().abs().amax()
    with pytest.raises(ValueError, match="only NVFP4 has a global amax to give, not mxfp4"):
        F4.quantize(x, "mxfp4", "1x32", "rne", 0, "", amax)
    with pytest.raises(ValueError, match=r"amax must hold one value, got shape \(2,\)"):
        F4.quantize(x, "nvfp4", "1x16", "rne", 0, "", torch.ones(2))
    # The reference keeps a non-finite own amax visible whatever amax it is given.
    bad = x.clone()
    bad[3, 5] = float("nan")
    assert torch.isnan(F4.quantize(bad, "nvfp4", "1x16", "rne", 0, "", amax)[2])
    rows, rht = F4.wgrad_amax(x, 16)
    assert torch.equal(rows, amax)
    from fp4compile import formats

    assert torch.equal(rht, formats.rht(x.t(), 16).float().abs().amax())
    for rounding in ("rne", "sr"):
        want = F4.rht_quantize(x.t(), 16, "nvfp4", "1x16", rounding, 9, "")
        got = F4.rht_quantize(x.t(), 16, "nvfp4", "1x16", rounding, 9, "", rht)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("decoded", [False, True])
def test_weight_quantized_once_for_fprop_and_dgrad(marked, monkeypatch, decoded):
    """Recipe(share_weight=True): the forward quantizes each FP4 weight once (16x16, NVFP4) for fprop and
    keeps it packed for the backward, whose dgrad reads it transposed (fp4.transpose_quantized; with
    decoded operands, W decoded and viewed transposed) instead of quantizing W^T. Same outputs and
    gradients, bit for bit, as quantizing W in each GEMM."""
    gm, example, ctx = marked
    import fp4compile

    passes = LOWERED
    monkeypatch.setattr(gemms_module, "decodes_on", lambda device: decoded)
    results = {}
    for share in (False, True):
        ctx.recipe = ctx.recipe.replace(share_weight=share, decoded_operands=decoded)
        fp4compile.manual_seed(5)
        results[share] = _run_with_grads(copy.deepcopy(gm), example, ctx, passes)
    (graphs, y, grads), (_, y_ref, grads_ref) = results[True], results[False]
    forward, backward = graphs["forward"], graphs["backward"]
    weight_q = [n for n in forward.graph.nodes if n.target is F4.quantize.default and n.args[2] == "16x16"]
    assert len(weight_q) == 4
    outputs = set(next(n for n in forward.graph.nodes if n.op == "output").args[0])
    for q in weight_q:
        assert q.meta["fp4_quantize"]["shared"] == "fprop+dgrad"
        assert {u.args[1] for u in q.users} == {0, 1, 2} and all(u in outputs for u in q.users)  # kept for backward
    assert [n for n in backward.graph.nodes if n.target in (F4.quantize.default, F4.fake_quantize.default)
            and n.args[2] == "16x16"] == []
    transposes = role_nodes(backward, F4.transpose_quantized.default)
    if decoded:
        # The shared weight reaches the emulated GEMMs through one decode pass each; dgrad decodes the kept
        # W as stored and reads it transposed (a view), so no packed transpose runs.
        assert transposes == []
        assert len(role_nodes(forward, F4.decode_blocks.default)) == 4
        decodes = role_nodes(backward, F4.decode_blocks.default)
        assert len(decodes) == 4 and all(d.args[0].op == "placeholder" for d in decodes)
        permute = (torch.ops.aten.permute.default, [1, 0])
        assert all([(u.target, u.args[1]) for u in d.users] == [permute] for d in decodes)
        assert len(role_nodes(forward, F4.emulated_mm.default)) == 4 and len(role_nodes(backward, F4.emulated_mm.default)) == 8
    else:
        assert len(transposes) == 4 and all(n.args[0].op == "placeholder" for n in transposes)
    assert torch.equal(y, y_ref)
    assert len(grads) == len(grads_ref) > 0
    for a, b in zip(grads, grads_ref):
        assert torch.equal(a, b)


def test_transpose_quantized_is_the_quantization_of_the_transpose():
    from fp4compile import formats

    w = torch.randn(48, 80) * torch.logspace(-3, 3, 80)
    q, qt = formats.quantize(w, "nvfp4", "16x16"), formats.quantize(w.t().contiguous(), "nvfp4", "16x16")
    data_t, scales_t = F4.transpose_quantized(q.data.view(torch.uint8), q.scales.view(torch.uint8))
    assert torch.equal(data_t, qt.data.view(torch.uint8)) and torch.equal(scales_t, qt.scales.view(torch.uint8))
    assert torch.equal(F4.decode_blocks(data_t, scales_t), formats.block_decode(qt).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"16x16-tile quantized \[N, K\] weight .*got codes \(40, 40\)"):
        F4.transpose_quantized(torch.zeros(40, 40, dtype=torch.uint8), torch.zeros(40, 5, dtype=torch.uint8))


def test_lower_gemms_keeps_a_registered_scaled_mm_as_its_call(marked, monkeypatch):
    """A ``scaled_mm`` implementation a user registered keeps its ``fp4.scaled_mm`` node with its kernel
    string where the built-in emulation would take the decoded form (CUDA; forced here on the CPU), and it
    is what runs: the same bits as the emulation it calls, once per GEMM."""
    import fp4compile
    from fp4compile import executors, reference

    calls = []

    def call(kernel, *args):
        calls.append(kernel)
        return reference.scaled_mm_reference(*args)

    gm, example, ctx = marked
    fp4compile.manual_seed(3)
    _, y_ref, grads_ref = _run_with_grads(gm, example, ctx, LOWERED)
    monkeypatch.setattr(gemms_module, "decodes_on", lambda device: True)
    executors.register("scaled_mm", "mine", lambda spec: (True, "the user's GEMM"), call, before="emulation")
    try:
        fp4compile.manual_seed(3)
        graphs, y, grads = _run_with_grads(gm, example, ctx, LOWERED)
    finally:
        executors.unregister("scaled_mm", "mine")
    for graph in graphs.values():
        assert role_nodes(graph, F4.emulated_mm.default) == [] and role_nodes(graph, F4.decode_blocks.default) == []
        assert {mm.args[8] for mm in role_nodes(graph, F4.scaled_mm.default)} == {"mine"}
    assert ctx.sites[2].roles["fprop"].kernel == "mine"
    assert len(calls) == 4 + 8
    assert torch.equal(y, y_ref) and all(torch.equal(a, b) for a, b in zip(grads, grads_ref))
