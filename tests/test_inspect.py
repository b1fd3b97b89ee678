"""Inspecting what the compiler did: explain, the report's views (table, per-pass graphs, diffs, MLIR,
DOT, pictures), printing the IR while compiling, and the ``fp4compile`` command."""

from __future__ import annotations

import copy
import operator
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fp4compile
from fp4compile import Backend, cli, config
from models import MLPStack, TinyGPT, lm_loss

TESTS = Path(__file__).resolve().parent
QUANTIZE = torch.ops.fp4.quantize.default
RHT = torch.ops.fp4.rht.default
RHT_QUANTIZE = torch.ops.fp4.rht_quantize.default
SCALED_MM = torch.ops.fp4.scaled_mm.default
HIGH_GEMMS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
FP4_SITES = [f"blocks.1.{m}" for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.out")]


@pytest.fixture(scope="module")
def explained():
    """A 3-block TinyGPT with gradients and AdamW state, explained once; what it held before."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyGPT(n_layer=3)
    idx = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lm_loss(model(idx), idx).backward()
    opt.step()
    lm_loss(model(idx), idx).backward()  # grads that differ from what the optimizer has seen
    before = types.SimpleNamespace(
        params={n: p.detach().clone() for n, p in model.named_parameters()},
        grads={n: p.grad.clone() for n, p in model.named_parameters()},
        grad_ids={n: id(p.grad) for n, p in model.named_parameters()},
        opt=copy.deepcopy(opt.state_dict()),
    )
    fp4compile.manual_seed(3)
    sr_state = fp4compile.get_rng_state()
    torch_state = torch.random.get_rng_state()
    report = fp4compile.explain(model, idx, loss_fn=lambda logits: lm_loss(logits, idx))
    return types.SimpleNamespace(
        model=model, idx=idx, opt=opt, before=before, report=report,
        sr_state=sr_state, torch_state=torch_state,
        sr_after=fp4compile.get_rng_state(), torch_after=torch.random.get_rng_state(),
    )


def _nodes(graph, target):
    return [n for n in graph.nodes if n.op == "call_function" and n.target is target]


# ------------------------------------------------------------------------------------- explain


def test_explain_leaves_model_grads_optimizer_and_rng_unchanged(explained):
    model, before = explained.model, explained.before
    for name, p in model.named_parameters():
        assert torch.equal(p, before.params[name]), name
        assert id(p.grad) == before.grad_ids[name] and torch.equal(p.grad, before.grads[name]), name
    state = explained.opt.state_dict()
    for key, value in before.opt["state"].items():
        for field, tensor in value.items():
            assert torch.equal(state["state"][key][field], tensor), (key, field)
    assert explained.sr_after == explained.sr_state
    assert torch.equal(explained.torch_after, explained.torch_state)
    # explain compiles a throwaway function: the model's own dynamo cache stays empty.
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    assert _debug_get_cache_entry_list(TinyGPT.forward.__code__) == []


def test_explain_in_place_when_the_model_cannot_be_copied():
    class Locked(nn.Module):
        def __init__(self):
            super().__init__()
            self.lock = threading.Lock()  # deepcopy fails on this
            self.norm = nn.BatchNorm1d(16)
            self.stack = MLPStack(3)

        def forward(self, x):
            return self.stack(self.norm(x))

    torch.manual_seed(0)
    model = Locked()
    x = torch.randn(32, 16)
    model.stack.head.weight.grad = torch.ones_like(model.stack.head.weight)
    grad = model.stack.head.weight.grad
    running_mean = model.norm.running_mean.clone()
    report = fp4compile.explain(model, x)
    assert [s.precision for s in report.sites if s.block == 1] == ["nvfp4", "nvfp4"]
    assert model.stack.head.weight.grad is grad and torch.equal(grad, torch.ones_like(grad))
    assert model.stack.layers[0].fc.weight.grad is None
    assert torch.equal(model.norm.running_mean, running_mean)


def test_explain_reports_the_shapes_given_whatever_it_explained_before():
    """Each explain call compiles for the shapes it is given: one after calls with other shapes reports
    the same graphs as a first call (dynamo's automatic dynamic shapes, kept per function name, would
    otherwise make the token count symbolic: other GEMM shapes, other amax sharing)."""
    torch.manual_seed(0)
    model = MLPStack(3, 32)

    def shapes(report):
        return [[tuple(a.meta["val"].shape) for a in n.args[:2]] for ctx in report.latest
                for n in ctx.final_graphs["joint"].nodes if n.target is torch.ops.fp4.gemm.default]

    torch._dynamo.reset()
    first = fp4compile.explain(model, torch.randn(2, 32, 32))
    for tokens in (8, 16):
        fp4compile.explain(model, torch.randn(2, tokens, 32))
    again = fp4compile.explain(model, torch.randn(2, 32, 32))
    assert shapes(again) == shapes(first) and all(isinstance(d, int) for g in shapes(again) for s in g for d in s)
    assert again.traffic_table() == first.traffic_table()


def test_report_matches_compiling_with_the_backend(explained):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyGPT(n_layer=3)
    backend = Backend(inner="eager")
    lm_loss(torch.compile(model, backend=backend)(explained.idx), explained.idx).backward()
    got = [(s.name, s.block, s.precision, s.reason, s.shapes) for s in explained.report.sites]
    want = [(s.name, s.block, s.precision, s.reason, s.shapes) for s in backend.report.sites]
    assert got == want
    assert explained.report.precision_table() == backend.report.precision_table()


# -------------------------------------------------------------------------------- the decisions


def test_sites_and_table_show_the_plan(explained):
    report = explained.report
    sites = {s.name: s for s in report.sites}
    assert [n for n, s in sites.items() if s.precision == "nvfp4"] == FP4_SITES
    for name in FP4_SITES:
        site = sites[name]
        assert site.block == 1 and site.reason == "recipe default" and site.kernel == "emulation"
        assert "not a CUDA GPU" in site.kernel_reason
        assert site.roles["wgrad"].rht and not site.roles["fprop"].rht and not site.roles["dgrad"].rht
        assert site.roles["fprop"].rounding == ("rne", "rne")
        assert site.roles["dgrad"].rounding == ("sr", "rne") and site.roles["wgrad"].rounding == ("sr", "rne")
    assert sites["lm_head"].precision == "high" and "lm_head" in sites["lm_head"].reason
    assert sites["blocks.0.mlp.fc"].reason == "first 1 of 3 blocks"
    assert sites["blocks.1.mlp.fc"].shapes == {"fprop": (64, 128, 32), "dgrad": (64, 32, 128), "wgrad": (128, 32, 64)}
    assert report.counts() == {"nvfp4": 12, "high": 27}  # 4 FP4 linears x 3 GEMMs; 9 high sites x 3
    table = report.precision_table()
    assert "blocks.1.mlp.fc     1      64 x 128 x 32      nvfp4  nvfp4+sr  nvfp4+rht+sr  emulation  recipe default" in table
    shares = report.flop_shares()
    assert table.splitlines()[-1] == (
        f"13 GEMM sites in 3 blocks; nvfp4: 12 GEMMs, {100 * shares['nvfp4']:.1f}% of GEMM FLOPs; "
        f"high precision: 27 GEMMs, {100 * shares['high']:.1f}% of GEMM FLOPs"
    )


def test_final_graphs_hold_the_reported_gemms(explained):
    report = explained.report
    forward, backward = report.fx_graph("forward"), report.fx_graph("backward")
    assert len(_nodes(forward, SCALED_MM)) == 4 and len(_nodes(backward, SCALED_MM)) == 8
    high = [n for g in (forward, backward) for n in g.nodes if n.target in HIGH_GEMMS]
    assert len(high) == report.counts()["high"]
    assert not _nodes(forward, RHT)


def test_rht_only_on_weight_gradient_operands(explained):
    report = explained.report
    quantized = report.graph("backward", "insert_quantize")
    assert quantized.count("torch.ops.fp4.rht.default(") == 8
    backward = report.fx_graph("backward")  # after fuse_rht_quantize: each RHT inside its quantize
    assert not _nodes(backward, RHT)
    fused = _nodes(backward, RHT_QUANTIZE)
    assert len(fused) == 8
    for node in fused:
        assert node.args[1] == 16 and node.meta["fp4_quantize"]["rht"] == 16
        gemms = {g for item in node.users for g in item.users if item.target is operator.getitem}
        assert [g.target for g in gemms] == [SCALED_MM]
        assert next(iter(gemms)).meta["fp4_role"].role == "wgrad"
    wgrads = [g for g in _nodes(backward, SCALED_MM) if g.meta["fp4_role"].role == "wgrad"]
    for gemm in wgrads:  # both operands of every FP4 wgrad went through an RHT
        producers = {a.args[0] for a in gemm.args[:6]}
        assert {q.target for q in producers} == {RHT_QUANTIZE}
    for stage in ("forward", "backward"):  # the other operands are plain quantizes
        for q in _nodes(report.fx_graph(stage), QUANTIZE):
            # (a weight quantized once for fprop and dgrad is also a forward output, kept for the backward)
            # (and fprop's amax of X is recorded into the layer's activation range: fp4.record_amax)
            gemms = {g for item in q.users for g in item.users if item.target is operator.getitem and g.op != "output"
                     and g.target is not torch.ops.fp4.record_amax.default}
            assert gemms and all(g.meta["fp4_role"].role != "wgrad" for g in gemms)


def test_stochastic_rounding_only_on_gradient_operands(explained):
    quantizes = [n for stage in ("forward", "backward") for n in _nodes(explained.report.fx_graph(stage), QUANTIZE)]
    quantizes += _nodes(explained.report.fx_graph("backward"), RHT_QUANTIZE)
    assert len(quantizes) == 8 + 12  # forward X and W; backward dY, dY^T and X^T (W^T: the forward's, transposed)
    for q in quantizes:
        info = q.meta["fp4_quantize"]
        rounding = q.args[4] if q.target is RHT_QUANTIZE else q.args[3]
        assert (rounding == "sr") == info["operand"].startswith("dY"), info
    assert sum(q.meta["fp4_quantize"]["rounding"] == "sr" for q in quantizes) == 8  # dY in dgrad and wgrad of 4 linears


# ---------------------------------------------------------------------------- graphs and diffs


def test_graph_after_each_pass_and_diff(explained):
    report = explained.report
    assert report.pass_names("backward") == ["input", "plan_gemm_roles", "insert_rht", "insert_quantize", "record_stats",
                                             "fuse_rht_quantize", "lower_gemms", "fuse_amax", "record_ranges", "lower_kernels"]
    assert "fp4.rht" not in report.graph("backward", "plan_gemm_roles")
    assert report.graph("backward", "insert_rht").count("torch.ops.fp4.rht.default(") == 8
    diff = report.diff("backward", "insert_rht")
    assert diff.startswith("--- graph 0 backward before insert_rht\n+++ graph 0 backward after insert_rht\n")
    added = [line for line in diff.splitlines() if line.startswith("+") and "fp4.rht.default(" in line]
    assert len(added) == 8
    assert not any(line.startswith("-") and "fp4.rht" in line for line in diff.splitlines())
    assert report.diff("backward", "plan_gemm_roles") == ""  # planning only annotates nodes
    with pytest.raises(ValueError, match="no pass 'insert_foo'.*insert_rht"):
        report.graph("backward", "insert_foo")
    with pytest.raises(ValueError, match="nothing to diff"):
        report.diff("forward", "input")


def test_pass_snapshots_render_the_graph_as_it_was():
    """A snapshot renders its code when first read, from a copy taken when it was recorded: a pass that
    changes the graph in place afterwards changes neither the snapshot's text nor its reading."""
    from fp4compile.sites import StageGraph

    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    before = gm.print_readable(print_output=False)
    snap = StageGraph(0, "forward", "input", gm)
    relu = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == "1")
    with gm.graph.inserting_after(relu):
        neg = gm.graph.call_function(torch.neg, (relu,))
    relu.replace_all_uses_with(neg, delete_user_cb=lambda user: user is not neg)
    gm.recompile()
    assert "torch.neg" in gm.print_readable(print_output=False)
    assert snap.code == before
    assert snap.code is snap.code  # rendered once


def test_pass_snapshots_render_what_a_copy_of_the_graph_renders(monkeypatch):
    """Every snapshot of a compile (dynamo, joint, forward and backward graphs, all passes) renders the text that
    ``copy_graph`` of the graph at that point renders: the compact record loses nothing."""
    from fp4compile import sites

    expected = []
    record = sites.CompileContext.record

    def record_and_render(self, stage, pass_name, gm):
        copy = torch.fx.GraphModule(gm, sites.copy_graph(gm.graph), class_name=type(gm).__name__)
        expected.append(copy.print_readable(print_output=False))
        record(self, stage, pass_name, gm)

    monkeypatch.setattr(sites.CompileContext, "record", record_and_render)
    torch._dynamo.reset()
    backend = Backend(inner="eager")
    torch.compile(MLPStack(3), backend=backend)(torch.randn(2, 16, 16)).sum().backward()
    codes = [g.code for g in backend.report.graphs]
    assert len(codes) == len(expected) > 10 and {g.stage for g in backend.report.graphs} == {"dynamo", "joint", "forward", "backward"}
    assert codes == expected


def test_print_ir_after_a_pass_while_compiling(capsys):
    torch._dynamo.reset()
    model = MLPStack(3)
    x = torch.randn(2, 16, 16)
    torch.compile(model, backend=Backend(inner="eager", print_ir_after=["insert_rht"]))(x).sum().backward()
    out = capsys.readouterr().out
    assert "fp4compile: graph" in out and "backward after insert_rht ----" in out
    assert "forward after insert_rht" in out and "after insert_quantize" not in out
    assert out.count("torch.ops.fp4.rht.default(") == 4  # the wgrads of block 1's two linears (the head is high)

    torch._dynamo.reset()
    with config.patch(print_ir_after="all"), torch.no_grad():
        torch.compile(model, backend=Backend(inner="eager"))(x)
    out = capsys.readouterr().out
    for name in ("find_gemm_sites", "mark_fp4_linear", "plan_gemm_roles", "lower_gemms"):
        assert f"after {name} ----" in out
    assert "fp4.scaled_mm.default(" in out


# ------------------------------------------------------------------------------- MLIR and DOT


def test_to_mlir_has_the_fp4_ops_and_parses_back(explained):
    from torch_mlir import ir
    from torch_mlir.dialects import torch as torch_dialect

    report = explained.report
    forward, backward = report.to_mlir("forward"), report.to_mlir("backward")
    assert "func.func @graph0_forward(" in forward and "func.func @graph0_backward(" in backward
    assert forward.count('torch.operator "torch.fp4.quantize"') == 8
    assert forward.count('torch.operator "torch.fp4.scaled_mm"') == 4
    assert backward.count('torch.operator "torch.fp4.rht_quantize"') == 8
    assert backward.count('torch.operator "torch.fp4.scaled_mm"') == 8
    assert "torch.aten.mm" in backward
    context = ir.Context()
    torch_dialect.register_dialect(context)
    module = ir.Module.parse(backward, context)
    assert module.operation.verify()
    names = [op.attributes["name"].value for op in module.body.operations[0].regions[0].blocks[0].operations
             if op.operation.name == "torch.operator"]
    # dgrad's W^T is the forward's quantized W, transposed (Recipe(share_weight=True)): 4 dY quantizes.
    assert names.count("torch.fp4.quantize") == 4 and names.count("torch.fp4.rht_quantize") == 8
    assert names.count("torch.fp4.transpose_quantized") == 4
    with pytest.raises(ValueError, match="dynamo"):
        report.to_mlir("dynamo")


def test_dataflow_and_dot_colour_the_fp4_nodes(explained):
    report = explained.report
    graph = report.dataflow("backward")
    kinds = {}
    for _, attrs in graph.nodes(data=True):
        kinds[attrs["kind"]] = kinds.get(attrs["kind"], 0) + 1
    assert kinds["fp4_gemm"] == 8 and kinds["rht_quantize"] == 8 and kinds["quantize"] == 8 and kinds["high_gemm"] == 18
    assert "rht" not in kinds
    wgrad = next(a for _, a in graph.nodes(data=True) if a["kind"] == "fp4_gemm" and a["role"] == "wgrad")
    assert wgrad["site"] in FP4_SITES and wgrad["label"] == f"FP4 wgrad\n{wgrad['site']}"
    compact = report.dataflow("backward", compact=True)
    assert {a["kind"] for _, a in compact.nodes(data=True)} <= {"fp4_gemm", "high_gemm", "quantize", "rht_quantize",
                                                                 "attention"}
    for name, attrs in compact.nodes(data=True):
        if attrs["kind"] == "rht_quantize":  # RHT + quantize -> wgrad
            assert attrs["label"].startswith("RHT + quantize d") or attrs["label"].startswith("RHT + quantize X")
            (gemm,) = compact.successors(name)
            assert compact.nodes[gemm]["role"] == "wgrad" and compact.nodes[gemm]["site"] == attrs["site"]

    dot = report.to_dot("backward")
    assert dot.startswith('digraph "graph0_backward" {') and dot.rstrip().endswith("}")
    colour = {kind: fill for kind, (fill, _) in fp4compile.report.NODE_KINDS.items()}
    assert dot.count(f'fillcolor="{colour["fp4_gemm"]}"') == 8
    assert dot.count(f'fillcolor="{colour["rht_quantize"]}"') == 8
    assert dot.count(f'fillcolor="{colour["quantize"]}"') == 8
    assert dot.count(f'fillcolor="{colour["high_gemm"]}"') == 18
    assert dot.count(" -> ") == graph.number_of_edges()


def test_every_gemm_of_a_site_has_its_role_where_shapes_tie():
    """d_model 64 and 64 tokens: the dgrad and wgrad outputs of a d x d layer are both 64 x 64, which the
    shapes alone cannot tell apart; the high-precision ones are labelled by role all the same."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyGPT(n_layer=3, d=64)
    idx = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    report = fp4compile.explain(model, idx, loss_fn=lambda logits: lm_loss(logits, idx))
    roles = {}
    for _, attrs in report.dataflow("backward").nodes(data=True):
        if attrs["kind"] in ("high_gemm", "fp4_gemm"):
            roles.setdefault(attrs["site"], []).append(attrs["role"])
            assert attrs["role"] in attrs["label"], attrs["label"]
    assert roles.keys() == {s.name for s in report.sites}
    assert all(sorted(r) == ["dgrad", "wgrad"] for r in roles.values()), roles


def test_save_image_writes_a_png(explained, tmp_path):
    path = tmp_path / "backward.png"
    explained.report.save_image(path, stage="backward")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.image import imread

    height, width = imread(path).shape[:2]
    assert height > width > 500


# ---------------------------------------------------------------------------------------- CLI

_TINY_FACTORY = """
import torch.nn as nn

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x

def build():
    return Tiny()

NOT_CALLABLE = 3

def not_a_module():
    return (1, 2)
"""


@pytest.fixture
def factory_file(tmp_path):
    path = tmp_path / "tiny_factory.py"
    path.write_text(_TINY_FACTORY)
    return path


def test_cli_inspect_on_the_example_gpt_prints_the_table(capsys, tmp_path):
    torch._dynamo.reset()
    image = tmp_path / "gpt.png"
    example = TESTS.parent / "examples" / "inspect_gpt.py"
    argv = ["inspect", f"{example}:gpt", "--input-shape", "2x32", "--input-dtype", "long",
            "--recipe-option", "rht=false", "--image", str(image)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "blocks.1.mlp.fc     1      64 x 512 x 128     nvfp4  nvfp4+sr  nvfp4+sr" in out
    assert out.rstrip().splitlines()[-1].startswith("17 GEMM sites in 4 blocks; nvfp4: 24 GEMMs")
    assert image.read_bytes()[:4] == b"\x89PNG"


def test_cli_in_a_subprocess(factory_file):
    result = subprocess.run(
        [sys.executable, "-m", "fp4compile.cli", "inspect", f"{factory_file}:build", "--input-shape", "2x16x32",
         "--show", "mlir", "--stage", "backward"],
        capture_output=True, text=True, timeout=300, cwd=TESTS.parent,
    )
    assert result.returncode == 0, result.stderr
    assert "func.func @graph" in result.stdout and 'torch.operator "torch.fp4.rht_quantize"' in result.stdout


def test_cli_pipeline(capsys):
    assert cli.main(["pipeline"]) == 0
    out = capsys.readouterr().out
    assert out.strip() == fp4compile.pipeline_text() and out.startswith("dynamo graph:\n  find_gemm_sites")


def test_cli_kernels_help_reads_as_a_sentence(capsys):
    pytest.importorskip("fp4compile.cli_kernels")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["kernels", "--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "build build ahead of time the kernels of the given GEMM shapes, or of a model's FP4 GEMMs" in out
    assert "list list the kernel cache entries" in out


def test_print_pipeline_prints_and_pipeline_text_returns(capsys):
    assert fp4compile.print_pipeline() is None
    assert capsys.readouterr().out == fp4compile.pipeline_text() + "\n"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_such_module_xyz:build", "module 'no_such_module_xyz' not found"),
        ("{dir}/missing.py:build", "missing.py' not found"),
        ("{file}:nope", "has no attribute 'nope'; callables defined there: Tiny, build, not_a_module"),
        ("{file}:NOT_CALLABLE", "is not callable (it is a int)"),
        ("{file}:not_a_module", "not_a_module() returned a tuple, not a torch.nn.Module"),
        ("{file}", "expected MODULE:FACTORY"),
    ],
)
def test_cli_bad_factory_is_a_clear_error(spec, message, factory_file, capsys):
    spec = spec.format(dir=factory_file.parent, file=factory_file)
    assert cli.main(["inspect", spec, "--input-shape", "2x32"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fp4compile inspect: error: ") and message in err, err


def test_cli_bad_recipe_option(factory_file, capsys):
    argv = ["inspect", f"{factory_file}:build", "--input-shape", "2x32", "--recipe-option", "rhtt=false"]
    assert cli.main(argv) == 2
    assert "unknown nvfp4 backend options ['rhtt']" in capsys.readouterr().err


def test_inspect_gpt_example_prints_table_and_mlir_excerpt(capsys, tmp_path, monkeypatch):
    import importlib.util

    torch._dynamo.reset()
    spec = importlib.util.spec_from_file_location("inspect_gpt", TESTS.parent / "examples" / "inspect_gpt.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    tracked = TESTS.parent / "docs" / "images" / "gpt_backward.png"
    before = tracked.stat().st_mtime_ns
    monkeypatch.chdir(tmp_path)
    example.main(["--seq-len", "32"])  # no --image: the picture goes to the working directory
    assert tracked.stat().st_mtime_ns == before
    (tmp_path / "gpt_backward.png").rename(tmp_path / "g.png")
    out = capsys.readouterr().out
    assert "17 GEMM sites in 4 blocks; nvfp4: 24 GEMMs" in out
    excerpt = out[out.index("func.func @graph0_backward"):]
    assert excerpt.count('torch.operator "torch.fp4.rht_quantize"') == 2
    assert excerpt.count("torch.aten.t ") == 2 and excerpt.count('torch.operator "torch.fp4.scaled_mm"') == 1
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"


class _RunsCodeWhenUnpickled:
    """A pickled callable: unpickling it calls ``os.mkdir(path)``."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        import os

        return (os.mkdir, (self.path,))


def test_cli_export_loads_weights_only_and_refuses_a_checkpoint_that_would_run_code(factory_file, tmp_path, capsys):
    torch._dynamo.reset()
    spec = f"{factory_file}:build"
    state = cli.load_factory(spec).state_dict()
    marker = tmp_path / "ran"
    torch.save({"model": state, "extra": _RunsCodeWhenUnpickled(marker)}, tmp_path / "evil.pt")
    argv = [spec, str(tmp_path / "evil.pt"), str(tmp_path / "out"), "--input-shape", "2x16x32"]
    assert cli.main(["export", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fp4compile export: error: ") and "(it names posix.mkdir)" in err
    assert "--trust-checkpoint" in err and not marker.exists() and not (tmp_path / "out").exists()
    # A checkpoint of tensors and plain data (as examples/train_gpt.py saves) loads without the flag.
    torch.save({"model": state, "step": 3, "record": {"loss": [1.5], "args": {"out": None}}}, tmp_path / "ok.pt")
    assert cli.main(["export", spec, str(tmp_path / "ok.pt"), str(tmp_path / "ok"), "--input-shape", "2x16x32"]) == 0
    # The explicit opt-in unpickles everything, after a warning.
    assert cli.main(["export", *argv, "--trust-checkpoint"]) == 0
    assert marker.is_dir()
    assert "warning: --trust-checkpoint: unpickling" in capsys.readouterr().err
