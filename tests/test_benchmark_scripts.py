"""The benchmark scripts on the CPU: the first-call benchmark's orchestration with its cold-start processes
replaced by a fake, and the end-to-end benchmark's arms (the same generic compile settings for BF16 and
nvfp4) and ratios."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(script: str):
    """The benchmark script ``script`` (without ``.py``), loaded as a module of its own."""
    spec = importlib.util.spec_from_file_location(f"{script}_under_test", BENCHMARKS / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def first_call():
    return _load("first_call")


def _fake_starts(module, monkeypatch, seconds):
    """Replace the cold start: record each call, return a row whose first step is the next of
    ``seconds`` (None: the start fails)."""
    calls, figures = [], iter(seconds)

    def cold_start(script, argv, triton_cache=None, env=None, inductor_cache=None):
        calls.append({"variant": argv[argv.index("--variant") + 1], "device": argv[argv.index("--device") + 1],
                      "generic": argv[argv.index("--generic") + 1], "cache": triton_cache, "env": env,
                      "inductor_cache": inductor_cache})
        first = next(figures)
        if first is None:
            return {"error": "Traceback: out of memory"}
        if triton_cache is not None and calls[-1]["variant"] == "prewarm":
            (Path(triton_cache) / "k.cubin").write_bytes(b"")
        return {"variant": calls[-1]["variant"], "first_step_s": first, "forward_call_s": first / 2,
                "backward_s": first / 2, "optimizer_s": 0.0, "gc_s": 0.1,
                "compile_metrics_s": {k: first / 10 for k in module.METRICS}}

    monkeypatch.setattr(module.bench_e2e, "cold_start", cold_start)
    return calls


def test_parse_setting(first_call):
    assert first_call.parse_setting("-") == {}
    assert first_call.parse_setting("A=1,B=x=y") == {"A": "1", "B": "x=y"}
    assert first_call.parse_setting("FP4COMPILE_EMULATED_GEMM=") == {"FP4COMPILE_EMULATED_GEMM": ""}
    for bad in ("A", "=1", "A=1,,B=2"):
        with pytest.raises(ValueError, match="NAME=VALUE"):
            first_call.parse_setting(bad)


def test_each_nvfp4_variant_runs_once_per_setting_and_bf16_once(first_call, monkeypatch, tmp_path):
    calls = _fake_starts(first_call, monkeypatch, [20.0, 40.0, 15.0, 35.0, 38.0, 14.0, 33.0])
    caches = iter([str(tmp_path / "a"), str(tmp_path / "b")])

    def mkdtemp():
        path = next(caches)
        Path(path).mkdir()
        return path

    monkeypatch.setattr(first_call.tempfile, "mkdtemp", mkdtemp)
    args = first_call.argparse.Namespace(variants=["bf16", "nvfp4-cg"], env=["-", "FP4COMPILE_EMULATED_GEMM=torch"],
                                         prewarm=True, d_model=1024, n_layer=12, batch=16, device="cuda",
                                         warm=False, generic="on")
    rows = first_call.sequence(args)
    processes = {"FP4COMPILE_EMULATED_GEMM": "torch"}
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert [(c["variant"], c["env"], c["cache"]) for c in calls] == [
        ("bf16", None, None),
        ("nvfp4-cg", {}, None), ("prewarm", {}, a), ("nvfp4-cg", {}, a),
        ("nvfp4-cg", processes, None), ("prewarm", processes, b), ("nvfp4-cg", processes, b),
    ]
    assert [first_call.label(r) for r in rows] == [
        "bf16", "nvfp4-cg [-]", "nvfp4-cg, fp4compile kernels cached [-]",
        "nvfp4-cg [FP4COMPILE_EMULATED_GEMM=torch]",
        "nvfp4-cg, fp4compile kernels cached [FP4COMPILE_EMULATED_GEMM=torch]",
    ]
    assert [r["first_step_s"] for r in rows] == [20.0, 40.0, 35.0, 38.0, 33.0]
    assert rows[2]["prewarm_s"] == 15.0 and rows[2]["cached_kernels"] == 1
    assert {c["device"] for c in calls} == {"cuda"} and {c["generic"] for c in calls} == {"on"}


def test_warm_starts_reuse_the_cold_starts_caches(first_call, monkeypatch, tmp_path):
    calls = _fake_starts(first_call, monkeypatch, [30.0, 3.0, 40.0, 8.0])
    made = iter(range(100))

    def mkdtemp():
        path = tmp_path / str(next(made))
        path.mkdir()
        return str(path)

    monkeypatch.setattr(first_call.tempfile, "mkdtemp", mkdtemp)
    args = first_call.argparse.Namespace(variants=["bf16", "nvfp4"], env=None, prewarm=False, d_model=256,
                                         n_layer=12, batch=1, device="cpu", warm=True, generic="off")
    rows = first_call.sequence(args)
    assert [first_call.label(r) for r in rows] == ["bf16", "bf16, warm caches", "nvfp4", "nvfp4, warm caches"]
    assert [r["first_step_s"] for r in rows] == [30.0, 3.0, 40.0, 8.0]
    caches = [(c["cache"], c["inductor_cache"]) for c in calls]
    assert caches[0] == caches[1] and caches[2] == caches[3] and caches[0] != caches[2]
    assert all(c is not None for pair in caches for c in pair)
    assert {c["device"] for c in calls} == {"cpu"} and {c["generic"] for c in calls} == {"off"}


def test_medians_over_repeats_drop_failed_starts(first_call):
    def row(variant, first, env=None):
        r = {"variant": variant, "first_step_s": first, "forward_call_s": first - 1, "backward_s": 1.0,
             "gc_s": first / 100, "compile_metrics_s": {k: first / 10 for k in first_call.METRICS}}
        return dict(r, env=env) if env else r

    rows = [row("bf16", 20.0), row("nvfp4-cg", 40.0, "A=1"), row("nvfp4-cg", 44.0),
            row("bf16", 24.0), {"variant": "nvfp4-cg", "env": "A=1", "error": "boom"}, row("nvfp4-cg", 42.0),
            row("bf16", 22.0), {"variant": "nvfp4", "error": "out of memory"}]
    table = first_call.medians(rows)
    assert [t["label"] for t in table] == ["bf16", "nvfp4-cg [A=1]", "nvfp4-cg", "nvfp4"]
    bf16, one, plain, failed = table
    assert bf16["first_step_s"] == 22.0 and bf16["all_first_step_s"] == [20.0, 24.0, 22.0] and bf16["starts"] == 3
    assert bf16["compile_metrics_s"]["GraphLowering.run"] == pytest.approx(2.2)
    assert one["starts"] == 1 and one["first_step_s"] == 40.0
    assert plain["first_step_s"] == 43.0 and plain["gc_s"] == pytest.approx(0.43)
    assert failed == {"label": "nvfp4", "error": "out of memory"}


def test_main_writes_rows_and_medians(first_call, monkeypatch, tmp_path, capsys):
    _fake_starts(first_call, monkeypatch, [20.0, 40.0, 22.0, 44.0])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a GPU")
    out = tmp_path / "fc.json"
    monkeypatch.setattr(sys, "argv", ["first_call.py", "--variants", "bf16", "nvfp4-cg", "--repeat", "2", "--out", str(out)])
    first_call.main()
    result = json.loads(out.read_text())
    assert result["device"] == "a GPU" and result["repeat"] == 2 and len(result["rows"]) == 4
    assert [(m["label"], m["first_step_s"]) for m in result["medians"]] == [("bf16", 21.0), ("nvfp4-cg", 42.0)]
    printed = capsys.readouterr().out
    assert "median of 2 starts" in printed and "nvfp4-cg" in printed


@pytest.mark.parametrize("argv, message", [
    (["--env", "NOEQUALS"], "NAME=VALUE"),
    (["--repeat", "0"], "1 or more"),
    (["--device", "cpu", "--variants", "bf16", "nvfp4-cg"], "need a GPU"),
    (["--device", "cpu", "--variants", "nvfp4", "--prewarm"], "need a GPU"),
    (["--env", "TRITON_CACHE_DIR=elsewhere"], "cache directories"),
    (["--variants", "bf16", "--env", "FP4COMPILE_CHECK_FINITE=1"], "none is selected"),
])
def test_main_rejects_bad_arguments(first_call, monkeypatch, capsys, argv, message):
    monkeypatch.setattr(sys, "argv", ["first_call.py", *argv])
    with pytest.raises(SystemExit):
        first_call.main()
    assert message in capsys.readouterr().err


@pytest.fixture
def bench_e2e():
    return _load("bench_e2e")


def _one_step(bench_e2e, arm: str, generic: bool, state: dict):
    """Compile ``arm`` of the benchmark on a small language model (logits and loss from one graph) and
    run one training step under Inductor's global CUDA-graph setting (skipped on the CPU, but what the
    settings follow): (whether the logits' gradient reached the backward through a buffer, the arm's
    recorded generic settings, the gradients)."""
    return _train_once(bench_e2e, arm, generic, state)


def _train_once(bench_e2e, arm: str, generic: bool, state: dict):
    import fp4compile
    from models import GPTWithLoss, grads

    torch._dynamo.reset()
    fp4compile.manual_seed(0)
    model = GPTWithLoss()
    model.load_state_dict(state)
    no_caches = torch._functorch.config.patch(enable_autograd_cache=False)
    inductor_config = torch._inductor.config.patch({"triton.cudagraphs": True, "fx_graph_cache": False})
    with no_caches, inductor_config:
        compiled, backend = bench_e2e.compile_arm(model, arm, generic=generic)
        idx = torch.randint(0, 512, (4, 128), generator=torch.Generator().manual_seed(1))
        logits, loss = compiled(idx)
        buffered = type(logits.grad_fn).__name__ == "_UnusedGradToBufferBackward"
        loss.backward()
        record = bench_e2e.generic_record(backend)
    return buffered, record, grads(model)


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("generic", [True, False], ids=["generic-on", "generic-off"])
def test_the_bf16_arm_gets_the_generic_settings_the_nvfp4_arm_gets(bench_e2e, generic):
    from models import GPTWithLoss

    torch.manual_seed(0)
    state = GPTWithLoss().state_dict()
    bf16 = _one_step(bench_e2e, "bf16", generic, state)
    nvfp4 = _one_step(bench_e2e, "nvfp4", generic, state)
    for buffered, record, _ in (bf16, nvfp4):
        assert buffered == generic
        assert record == {"unused_grad_buffers": ["logits"] if generic else []}
    # The BF16 arm's settings change no gradient beyond the summation order of Inductor's kernels (the
    # graph with a buffer output fuses differently; the embedding's scatter-add is where it shows).
    other = _one_step(bench_e2e, "bf16", not generic, state)[2]
    assert bf16[2].keys() == other.keys()
    for name in other:
        torch.testing.assert_close(bf16[2][name], other[name], rtol=1e-5, atol=1e-7, msg=name)


def _row(variant, d, step, first=20.0, reserved=16.0, **extra):
    return dict({"variant": variant, "d_model": d, "step_ms_median": step, "peak_reserved_gib": reserved,
                 "peak_mem_gib": reserved, "first_step_s": first,
                 "generic": {"unused_grad_buffers": ["logits"]}}, **extra)


def test_each_variant_is_compared_with_the_bf16_arm_of_its_cuda_graph_setting(bench_e2e, capsys):
    rows = [_row("bf16", 1024, 50.0), _row("bf16-cg", 1024, 40.0), _row("nvfp4", 1024, 100.0),
            _row("nvfp4-cg", 1024, 60.0), _row("bf16", 2048, 100.0), _row("nvfp4-cg", 2048, 150.0),
            {"variant": "bf16-cg", "d_model": 2048, "error": "out of memory"}]
    assert bench_e2e.baseline_row(rows, rows[3]) == (rows[1], True)
    assert bench_e2e.baseline_row(rows, rows[2]) == (rows[0], True)
    assert bench_e2e.baseline_row(rows, rows[5]) == (rows[4], False)  # bf16-cg failed at 2048
    assert bench_e2e.baseline_row(rows[2:4], rows[3]) == (None, False)
    bench_e2e.print_table(rows, True)
    lines = capsys.readouterr().out.splitlines()
    table = {tuple(line.split()[:2]): line.split() for line in lines[1:8]}
    assert table[("1024", "nvfp4-cg")][3] == "1.50" and table[("1024", "nvfp4")][3] == "2.00"
    assert table[("2048", "nvfp4-cg")][3] == "1.50*"
    assert "  nvfp4-cg d=1024: unused-gradient buffers for logits" in lines


def test_main_hands_the_generic_setting_to_every_start(bench_e2e, monkeypatch, tmp_path, capsys):
    argvs = []

    def cold_start(script, argv, triton_cache=None, env=None, inductor_cache=None):
        argvs.append(argv)
        variant = argv[argv.index("--variant") + 1]
        return _row(variant, 1024, 50.0 if variant == "bf16" else 60.0,
                    generic={"unused_grad_buffers": []})

    monkeypatch.setattr(bench_e2e, "cold_start", cold_start)
    monkeypatch.setattr(bench_e2e, "check_bit_exact", lambda: "bit-exact")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a GPU")
    out = tmp_path / "e2e.json"
    monkeypatch.setattr(sys, "argv", ["bench_e2e.py", "--d-model", "1024", "--variants", "bf16", "nvfp4",
                                      "--generic", "off", "--out", str(out)])
    bench_e2e.main()
    assert [a[a.index("--generic") + 1] for a in argvs] == ["off", "off"]
    result = json.loads(out.read_text())
    assert result["generic"] == "off" and [r["variant"] for r in result["rows"]] == ["bf16", "nvfp4"]
    printed = capsys.readouterr().out
    assert "generic settings off" in printed and "no unused-gradient buffers" in printed
