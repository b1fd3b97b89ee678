"""The training-study tooling in examples/: corpus, GPT, train_gpt.py, plot_runs.py and run_study.py."""

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
import torch

import fp4compile

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import corpus  # noqa: E402
import gpt  # noqa: E402
import plot_runs  # noqa: E402
import run_study  # noqa: E402
import train_gpt  # noqa: E402

pytestmark = pytest.mark.slow  # runs a training example

# Small shapes so that a training run takes seconds on a CPU; one thread, since shapes this small gain
# nothing from more and a busy CI machine makes extra threads wait for each other.
QUICK = ["--steps", "3", "--batch-size", "4", "--seq-len", "32", "--eval-batches", "2", "--quiet", "--threads", "1"]


@pytest.fixture(autouse=True, scope="module")
def _restore_thread_count():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------- corpus


def _fake_stdlib(root: Path) -> None:
    files = {
        "os.py": "import sys\n",
        "json/__init__.py": "x = 1\n",
        "json/decoder.py": "y = 2\n",
        "email/mime/text.py": "z = 3\n",
        "test/test_os.py": "assert True\n",
        "idlelib/idle_test/test_x.py": "pass\n",
        "site-packages/foo/bar.py": "third party\n",
        "__pycache__/os.cpython-311.py": "cache\n",
        "notes.txt": "not python\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_source_files_exclude_site_packages_and_tests(tmp_path):
    _fake_stdlib(tmp_path)
    assert corpus.list_source_files(tmp_path) == [
        "email/mime/text.py", "json/__init__.py", "json/decoder.py", "os.py"]
    with_tests = corpus.list_source_files(tmp_path, include_tests=True)
    assert "test/test_os.py" in with_tests and "idlelib/idle_test/test_x.py" in with_tests
    assert not any("site-packages" in f or "__pycache__" in f for f in with_tests)


def test_source_files_skip_unreadable_files(tmp_path, monkeypatch):
    _fake_stdlib(tmp_path)
    access = corpus.os.access
    monkeypatch.setattr(corpus.os, "access", lambda path, mode: not str(path).endswith("decoder.py") and access(path, mode))
    assert corpus.list_source_files(tmp_path) == ["email/mime/text.py", "json/__init__.py", "os.py"]


def test_corpus_says_how_many_test_files_it_holds(tmp_path):
    _fake_stdlib(tmp_path)
    with_tests = corpus.load_corpus(tmp_path, val_fraction=0.5, include_tests=True)
    assert with_tests.test_files == 2 and with_tests.stats()["test_files"] == 2
    assert "(with tests: 2 files)" in with_tests.describe()
    bare = tmp_path / "bare"
    (bare / "json").mkdir(parents=True)
    for name in ("a.py", "b.py", "c.py", "json/d.py"):
        (bare / name).write_text("x = 1\n")
    c = corpus.load_corpus(bare, val_fraction=0.5, include_tests=True)
    assert c.test_files == 0 and "has no test suites" in c.describe()
    assert corpus.load_corpus(bare, val_fraction=0.5).describe().count("test") == 0


def test_corpus_with_packages_and_a_byte_cap(tmp_path, monkeypatch):
    stdlib, packages = tmp_path / "lib", tmp_path / "site"
    _fake_stdlib(stdlib)
    for i in range(40):
        (packages / f"pkg{i % 4}").mkdir(parents=True, exist_ok=True)
        (packages / f"pkg{i % 4}" / f"m{i}.py").write_text(f"value_{i} = {i}\n" * (i + 1))
    (packages / "pkg0" / "tests").mkdir()
    (packages / "pkg0" / "tests" / "test_a.py").write_text("assert 1\n")
    (packages / "pkg0" / "dangling.py").symlink_to(packages / "missing.py")
    monkeypatch.setattr(corpus, "package_roots", lambda: [packages])
    whole = corpus.load_corpus(stdlib, val_fraction=0.2, packages=True)
    names = whole.train_files + whole.val_files
    assert "os.py" in names and "site-packages/pkg1/m1.py" in names
    assert not any("tests/" in n or "dangling" in n for n in names)
    assert whole.stats()["package_files"] == 40 and whole.stats()["source"] == "python-stdlib+packages-py"
    total = whole.train.numel() + whole.val.numel()
    capped = corpus.load_corpus(stdlib, val_fraction=0.2, packages=True, max_bytes=total // 2)
    assert capped.train.numel() + capped.val.numel() <= total // 2
    assert capped.available_files == len(names) > len(capped.train_files) + len(capped.val_files)
    assert "MB sample of" in capped.describe()
    # The sample and the split depend only on the file names: the same files again.
    corpus._CACHE.clear()
    again = corpus.load_corpus(stdlib, val_fraction=0.2, packages=True, max_bytes=total // 2)
    assert again.train_files == capped.train_files and torch.equal(again.train, capped.train)
    with pytest.raises(ValueError, match="max_bytes"):
        corpus.load_corpus(stdlib, packages=True, max_bytes=0)


def test_batches_skip_continues_the_sequence():
    tokens = torch.arange(200, dtype=torch.uint8)
    stream = corpus.batches(tokens, 2, 8, seed=5)
    first = [next(stream) for _ in range(5)]
    later = corpus.batches(tokens, 2, 8, seed=5, skip=3)
    for expected in first[3:]:
        got = next(later)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_split_is_by_file_and_deterministic(tmp_path):
    _fake_stdlib(tmp_path)
    c = corpus.load_corpus(tmp_path, val_fraction=0.5)
    files = corpus.list_source_files(tmp_path)
    assert sorted(c.train_files + c.val_files) == files
    assert not set(c.train_files) & set(c.val_files)
    # The tokens are the files' bytes, each followed by the separator, in path order.
    expected = b"".join((tmp_path / f).read_bytes() + b"\0" for f in c.train_files)
    assert bytes(c.train.tolist()) == expected
    # The decision depends only on the relative path.
    assert [corpus.is_validation_file(f, 0.5) for f in files] == [f in c.val_files for f in files]


def test_stdlib_corpus_split():
    c = corpus.load_corpus()
    assert Path(c.root) == corpus.stdlib_root()
    assert c.train_files and c.val_files
    assert not set(c.train_files) & set(c.val_files)
    assert all(corpus.is_validation_file(f, 0.05) for f in c.val_files)
    assert not any(corpus.is_validation_file(f, 0.05) for f in c.train_files)
    assert not any(part in ("test", "tests", "site-packages") for f in c.train_files for part in f.split("/"))
    stats = c.stats()
    assert stats["train_tokens"] > 1_000_000 and stats["val_tokens"] > 10_000
    assert c.train.dtype == torch.uint8
    assert corpus.load_corpus() is c  # cached in memory


def test_batches_are_deterministic_for_a_seed():
    tokens = corpus.load_corpus().train

    def take(seed, n=3):
        stream = corpus.batches(tokens, batch_size=4, seq_len=16, seed=seed)
        return [next(stream) for _ in range(n)]

    a, b, c = take(0), take(0), take(1)
    for (xa, ya), (xb, yb) in zip(a, b):
        assert xa.dtype == torch.int64 and xa.shape == (4, 16) and ya.shape == (4, 16)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert torch.equal(xa[:, 1:], ya[:, :-1])  # y is x shifted by one token
    assert not torch.equal(a[0][0], c[0][0])
    v1 = corpus.fixed_batches(corpus.load_corpus().val, 2, 4, 16)
    v2 = corpus.fixed_batches(corpus.load_corpus().val, 2, 4, 16)
    assert all(torch.equal(x1, x2) for (x1, _), (x2, _) in zip(v1, v2))


# ------------------------------------------------------------------------------------------- GPT


@pytest.mark.parametrize("preset, low, high", [
    ("tiny", 0.5e6, 1.5e6), ("small", 20e6, 30e6), ("medium", 85e6, 125e6), ("tiny-moe", 2e6, 3e6)])
def test_preset_sizes(preset, low, high):
    with torch.device("meta"):
        model = gpt.GPT(gpt.PRESETS[preset])
    assert low <= model.num_params() <= high
    # NVFP4 needs 16-element blocks along the reduction dim and 16x16 weight tiles.
    # (MoE routers have one output per expert and stay in high precision.)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and not name.endswith(".router"):
            assert module.in_features % 16 == 0 and module.out_features % 16 == 0


@pytest.fixture
def isolated_state():
    """The SR stream, torch's RNG and dynamo's cache as they were before the test."""
    sr, rng = fp4compile.get_rng_state(), torch.get_rng_state()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    fp4compile.set_rng_state(sr)
    torch.set_rng_state(rng)


def test_moe_gpt_experts_are_grouped_fp4_sites_and_routers_high(isolated_state):
    torch.manual_seed(0)
    model = gpt.GPT(dataclasses.replace(gpt.PRESETS["tiny-moe"], seq_len=32))
    backend = fp4compile.Backend(inner="eager")
    idx = torch.randint(0, 256, (2, 32))
    _, loss = torch.compile(model, backend=backend)(idx, idx)
    loss.backward()
    sites = {s.name: s for s in backend.report.sites}
    for b in (1, 2):
        for proj, (n, k) in (("fc", (256, 128)), ("proj", (128, 256))):
            s = sites[f"blocks.{b}.mlp.{proj}"]
            assert (s.experts, s.kind, s.precision) == (8, "grouped_mm", "nvfp4")
            assert s.shapes["fprop"] == (2 * 64, n, k)  # 64 tokens, each routed to 2 experts
        assert sites[f"blocks.{b}.mlp.router"].precision == "high"
    assert torch.isfinite(model.blocks[1].mlp.fc.grad).all()


def test_gpt_forward_and_names():
    config = gpt.PRESETS["tiny"]
    torch.manual_seed(0)
    model = gpt.GPT(config)
    x = torch.randint(0, 256, (2, 24))
    logits, loss = model(x, x)
    assert logits.shape == (2, 24, 256)
    assert loss.ndim == 0 and abs(loss.item() - math.log(256)) < 0.5  # near-uniform at init
    assert model(x)[1] is None
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == config.n_layer
    names = dict(model.named_modules())
    assert {"lm_head", "tok_emb", "pos_emb", "blocks.0.attn.qkv", "blocks.3.mlp.proj"} <= names.keys()
    with pytest.raises(ValueError):
        model(torch.zeros(1, config.seq_len + 1, dtype=torch.long))


def test_gpt_tied_embeddings():
    model = gpt.GPT(dataclasses.replace(gpt.PRESETS["tiny"], tie_embeddings=True))
    assert model.lm_head.weight is model.tok_emb.weight
    assert model.num_params() == gpt.GPT(gpt.PRESETS["tiny"]).num_params() - 256 * 128


# ------------------------------------------------------------------------------------- train_gpt


def test_lr_schedule():
    lrs = [train_gpt.lr_at(s, 1.0, warmup=10, total=100, min_ratio=0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3)


def test_fp4_flags_need_an_fp4_precision():
    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--precision", "bf16", "--no-rht"])
    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--precision", "nvfp4", "--no-compile"])


def test_cuda_graphs_need_a_gpu_and_inductor():
    with pytest.raises(SystemExit, match="--cuda-graphs needs a CUDA device .* device cpu, inner 'eager'"):
        train_gpt.main(["--cuda-graphs", "--device", "cpu", "--steps", "1", "--quiet"])


def test_recipe_from_flags():
    args = train_gpt.parse_args(["--precision", "mxfp4", "--no-rht", "--no-sr", "--no-2d", "--all-fp4",
                                 "--bf16-switch-at", "7", "--forward-only", "--check-finite", "--seed", "3"])
    assert train_gpt.make_recipe(args) == fp4compile.Recipe(
        fmt="mxfp4", rht=False, stochastic_rounding=False, weight_2d=False, seed=3,
        high_precision_first_blocks=0, high_precision_last_blocks=0,
        switch_to_high_precision_at=7, quantize_backward=False, check_finite=True)
    # --seed (default 0) seeds stochastic rounding explicitly, so the example's runs keep their bits
    # whatever torch's seed; otherwise the recipe is the default.
    assert train_gpt.make_recipe(train_gpt.parse_args(["--precision", "nvfp4"])) == fp4compile.Recipe(fmt="nvfp4", seed=0)
    assert train_gpt.run_name(args) == "tiny-mxfp4-no-rht-no-sr-no-2d-all-fp4-fwd-only-bf16@7"


@pytest.fixture(scope="module")
def bf16_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    compiled = train_gpt.main(["--precision", "bf16", "--device", "cpu", "--out", str(out / "bf16.json"), *QUICK])
    eager = train_gpt.main(["--precision", "bf16", "--device", "cpu", "--no-compile", "--seed", "1",
                            "--name", "other", "--out", str(out / "other.json"), *QUICK])
    return out, compiled, eager


def test_train_gpt_bf16_writes_a_run(bf16_runs):
    out, record, _ = bf16_runs
    saved = json.loads((out / "bf16.json").read_text())
    assert saved["name"] == "tiny-bf16" == record["name"]
    assert saved["train"]["step"] == [0, 1, 2]
    assert all(math.isfinite(v) for v in saved["train"]["loss"])
    assert saved["val"]["step"] == [2] and math.isfinite(saved["val"]["loss"][0])
    s = saved["summary"]
    assert s["steps"] == 3 and s["train_tokens"] == 3 * 4 * 32 and not s["diverged"]
    assert s["tokens_per_s"] > 0 and math.isfinite(s["final_val_loss"])
    assert saved["corpus"]["train_tokens"] > 0 and saved["model"]["seq_len"] == 32
    assert saved["precision_table"] is None and saved["recipe"] is None


def test_train_gpt_same_seed_same_losses(bf16_runs, tmp_path):
    _, first, _ = bf16_runs
    again = train_gpt.main(["--precision", "bf16", "--device", "cpu", "--no-compile", *QUICK])
    assert again["train"]["loss"] == pytest.approx(first["train"]["loss"], rel=1e-4)


def test_train_gpt_nvfp4(tmp_path, capsys):
    # FP4 is emulated on the CPU: two steps and no validation keep this quick.
    argv = ["--precision", "nvfp4", "--inner", "eager", "--device", "cpu", "--out", str(tmp_path / "nvfp4.json"),
            *QUICK, "--steps", "2", "--eval-every", "0", "--bf16-switch-at", "1"]
    record = train_gpt.main(argv)
    assert "blocks.1.attn.qkv" in record["precision_table"]
    assert record["high_precision_from_step"] == 1
    assert "precision plan" in capsys.readouterr().out
    assert record["recipe"]["fmt"] == "nvfp4" and record["recipe"]["decoded_operands"] is False and record["summary"]["final_val_loss"] is None
    assert len(record["train"]["loss"]) == 2 and all(math.isfinite(v) for v in record["train"]["loss"])


def test_train_gpt_resume_is_bit_exact(tmp_path):
    base = ["--precision", "nvfp4", "--device", "cpu", *QUICK, "--steps", "4", "--eval-every", "2"]
    ckpt = tmp_path / "a.pt"
    whole = train_gpt.main([*base, "--checkpoint", str(ckpt), "--save-at", "2", "--out", str(tmp_path / "a.json")])
    assert ckpt.exists() and train_gpt.checkpoint_path_at(ckpt, 2) == tmp_path / "a.step2.pt"
    resumed = train_gpt.main([*base, "--resume", str(tmp_path / "a.step2.pt"), "--out", str(tmp_path / "b.json")])
    # Same weights, optimizer state, data position and SR stream: the same bits as one uninterrupted run.
    assert resumed["train"]["loss"] == whole["train"]["loss"]
    assert resumed["val"] == whole["val"]
    assert [(s["start_step"], s["end_step"]) for s in resumed["segments"]] == [(0, 2), (2, 4)]
    assert resumed["summary"]["steps"] == 4 and resumed["summary"]["train_tokens"] == 4 * 4 * 32
    # The model as its exported checkpoint serves it, evaluated on the same batches (docs/export.md).
    assert resumed["summary"]["served_val_loss"] == whole["summary"]["served_val_loss"]
    served = whole["summary"]["served_val_loss"]
    assert set(served) == {"W4A16", "W4A4"} and abs(served["W4A16"] - whole["val"]["loss"][-1]) < 0.05
    # A fork at the BF16 switch equals a run that switches without stopping, the evaluation after the
    # switch step included (it runs in high precision in both).
    switched = train_gpt.main([*base, "--bf16-switch-at", "2"])
    fork = train_gpt.main([*base, "--bf16-switch-at", "2", "--resume", str(tmp_path / "a.step2.pt")])
    assert fork["train"]["loss"] == switched["train"]["loss"] and fork["val"] == switched["val"]
    assert fork["val"]["loss"][0] != whole["val"]["loss"][0]
    assert fork["high_precision_from_step"] == switched["high_precision_from_step"] == 2
    assert switched["summary"]["served_val_loss"] is None  # a model that ended in BF16 is not served in FP4


def test_train_gpt_time_limit_and_resume(tmp_path, capsys):
    base = ["--precision", "bf16", "--device", "cpu", "--no-compile", *QUICK]
    whole = train_gpt.main(base)
    ckpt = tmp_path / "run.pt"
    stopped = train_gpt.main([*base, "--checkpoint", str(ckpt), "--time-limit", "0"])
    assert stopped["summary"] is None and len(stopped["train"]["step"]) == 1  # one step, then the limit
    assert "stopped after step 1 of 3 by --time-limit" in capsys.readouterr().out
    done = train_gpt.main([*base, "--resume", str(ckpt)])
    assert done["train"]["loss"] == whole["train"]["loss"] and done["summary"]["steps"] == 3


def test_train_gpt_sigterm_writes_the_checkpoint(tmp_path, capsys, monkeypatch):
    """SIGTERM during step 2 (of 3): the step finishes, the checkpoint is written, the run continues from it."""
    import os
    import signal

    base = ["--precision", "bf16", "--device", "cpu", "--no-compile", *QUICK]
    whole = train_gpt.main(base)
    ckpt = tmp_path / "run.pt"
    lr_at = train_gpt.lr_at

    def lr_then_signal(step, *args):
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return lr_at(step, *args)

    monkeypatch.setattr(train_gpt, "lr_at", lr_then_signal)
    caught_here = []  # a signal train_gpt failed to catch lands here instead of ending pytest
    guard = lambda signum, frame: caught_here.append(signum)  # noqa: E731
    before = signal.signal(signal.SIGTERM, guard)
    try:
        stopped = train_gpt.main([*base, "--checkpoint", str(ckpt)])
        assert signal.getsignal(signal.SIGTERM) is guard and not caught_here  # handled, handler put back
    finally:
        signal.signal(signal.SIGTERM, before)
    assert stopped["summary"] is None and len(stopped["train"]["step"]) == 2 and ckpt.exists()
    assert "stopped after step 2 of 3 by SIGTERM" in capsys.readouterr().out
    monkeypatch.setattr(train_gpt, "lr_at", lr_at)
    done = train_gpt.main([*base, "--resume", str(ckpt)])
    assert done["train"]["loss"] == whole["train"]["loss"] and done["summary"]["steps"] == 3


def test_train_gpt_resume_refuses_another_run(tmp_path, capsys):
    ckpt = tmp_path / "run.pt"
    base = ["--precision", "bf16", "--device", "cpu", "--no-compile", *QUICK]
    train_gpt.main([*base, "--checkpoint", str(ckpt), "--save-at", "2"])
    with pytest.raises(SystemExit, match=r"--seed 1 \(checkpoint: 0\)"):
        train_gpt.main([*base, "--seed", "1", "--resume", str(ckpt)])
    record = torch.load(ckpt)
    record["record"]["corpus"]["train_tokens"] += 1  # as if another machine's packages were read
    torch.save(record, tmp_path / "other.pt")
    with pytest.raises(SystemExit, match="the corpus differs: train_tokens"):
        train_gpt.main([*base, "--resume", str(tmp_path / "other.pt")])
    # A run trained on another kind of device resumes, with a note that the bits will differ.
    record = torch.load(ckpt)
    record["record"]["env"]["device"] = "cuda:0"
    torch.save(record, tmp_path / "moved.pt")
    train_gpt.main([*base, "--resume", str(tmp_path / "moved.pt")])
    assert "note: the checkpoint's run trained on cuda:0, this one continues on cpu" in capsys.readouterr().out
    assert train_gpt.device_change_note("cuda:1", "cuda:0") == "" and train_gpt.device_change_note(None, "cpu") == ""
    with pytest.raises(SystemExit):  # --save-at and --time-limit need somewhere to write
        train_gpt.parse_args(["--time-limit", "5"])
    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--checkpoint", "x.pt", "--save-at", "500", "--steps", "500"])


# ------------------------------------------------------------------------------------- plot_runs


def test_plot_runs_writes_pngs(bf16_runs, tmp_path, capsys):
    out, _, _ = bf16_runs
    written = plot_runs.main([str(out / "bf16.json"), str(out / "other.json"), "--out-dir", str(tmp_path)])
    assert [p.name for p in written] == ["loss.png", "gap.png"]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert "| tiny-bf16 | 3 |" in table and "| other | 3 |" in table


def test_relative_gap_matches_steps():
    steps, gap = plot_runs.relative_gap([1, 2, 3], [2.2, 1.1, 3.0], [2, 3, 4], [1.0, 2.0, 9.0])
    assert steps == [2, 3] and gap == pytest.approx([0.1, 0.5])
    assert plot_runs.smooth([1.0, 1.0, 1.0], 0.9) == pytest.approx([1.0, 1.0, 1.0])


# ------------------------------------------------------------------------------------- run_study


def test_run_study_commands(tmp_path):
    out = tmp_path / "out"
    args = run_study.parse_args(["--out-dir", str(out), "--switch-fraction", "0.8", "--",
                                 "--steps", "50", "--preset", "tiny"])
    assert args.configs == [c for c in run_study.CONFIGS if c not in ("nvfp4-fwd-only", "nvfp4-seed1")]
    cmd = run_study.command("nvfp4-bf16-switch", args)
    assert cmd[2:6] == ["--steps", "50", "--preset", "tiny"]
    assert cmd[6:] == ["--precision", "nvfp4", "--bf16-switch-at", "40", "--name", "nvfp4-bf16-switch",
                       "--out", str(out / "nvfp4-bf16-switch.json"), "--checkpoint", str(out / "nvfp4-bf16-switch.pt"),
                       "--resume", str(out / "nvfp4.step40.pt")]  # the fork continues nvfp4 from the switch
    assert run_study.command("nvfp4", args, time_limit=99.6)[-4:] == ["--save-at", "40", "--time-limit", "100"]
    assert "--resume" not in run_study.command("bf16", args)
    out.mkdir()
    (out / "bf16.pt").write_bytes(b"")  # a checkpoint from an earlier invocation: continue it
    assert run_study.command("bf16", args)[-2:] == ["--resume", str(out / "bf16.pt")]
    only_parent = run_study.parse_args(["--out-dir", str(out), "--configs", "nvfp4", "--", "--steps", "50"])
    assert "--save-at" not in run_study.command("nvfp4", only_parent)  # no fork asked for: no extra checkpoint
    with pytest.raises(SystemExit):  # the switch would fall on the last step
        run_study.parse_args(["--switch-fraction", "1.0", "--", "--steps", "50"])
    no_fork = run_study.parse_args(["--out-dir", str(out), "--no-fork", "--", "--steps", "50"])
    assert "--resume" not in run_study.command("nvfp4-bf16-switch", no_fork)
    assert "--save-at" not in run_study.command("nvfp4", no_fork)
    for name in run_study.CONFIGS:  # every configuration is a valid train_gpt.py command line
        train_gpt.parse_args(run_study.command(name, args, time_limit=10)[2:])
    for flag in ("--out", "--checkpoint", "--resume", "--time-limit"):
        with pytest.raises(SystemExit):
            run_study.parse_args(["--", flag, "x"])
    with pytest.raises(SystemExit):
        run_study.parse_args(["--parallel", "0"])
    assert run_study.parse_args(["--configs", "nvfp4", "bf16", "nvfp4"]).configs == ["nvfp4", "bf16"]


def test_run_study_runs_side_by_side(tmp_path, capfd):
    quick = [a for a in QUICK if a != "--quiet"]
    configs = ["--configs", "bf16", "nvfp4", "nvfp4-bf16-switch"]
    rc = run_study.main(["--out-dir", str(tmp_path), *configs, "--parallel", "3", "--", *quick])
    assert rc == 0
    out = capfd.readouterr().out  # the plot step is a subprocess
    assert "bf16: done" in out and "nvfp4: done" in out and "| nvfp4 | 3 |" in out
    for name in ("bf16", "nvfp4"):
        run = json.loads((tmp_path / f"{name}.json").read_text())
        assert run["name"] == name and run["summary"]["steps"] == 3
    assert (tmp_path / "loss.png").stat().st_size > 0 and (tmp_path / "gap.png").stat().st_size > 0
    # The switch run continued nvfp4's checkpoint after step 2 (int(3 * 0.9)): same first two losses.
    nvfp4 = json.loads((tmp_path / "nvfp4.json").read_text())
    switch = json.loads((tmp_path / "nvfp4-bf16-switch.json").read_text())
    assert [s["start_step"] for s in switch["segments"]] == [0, 2]
    assert switch["segments"][1]["resumed_from"] == str(tmp_path / "nvfp4.step2.pt")
    assert switch["train"]["loss"][:2] == nvfp4["train"]["loss"][:2]
    assert switch["high_precision_from_step"] == 2 and nvfp4["high_precision_from_step"] is None
    # Again: everything is finished, nothing runs.
    assert run_study.main(["--out-dir", str(tmp_path), *configs, "--", *quick]) == 0
    out = capfd.readouterr().out
    assert all(f"{n}: finished earlier" in out for n in ("bf16", "nvfp4", "nvfp4-bf16-switch"))
    # Other training arguments: the finished runs are not taken as this study's.
    longer = [("4" if i and quick[i - 1] == "--steps" else a) for i, a in enumerate(quick)]
    with pytest.raises(SystemExit, match=r"bf16.json is a finished run with other training arguments: "
                                         r"--steps 4 \(finished run: 3\)"):
        run_study.main(["--out-dir", str(tmp_path), *configs, "--", *longer])


def test_run_study_time_limit_then_continue(tmp_path, capfd, monkeypatch):
    monkeypatch.setattr(run_study, "_MARGIN_S", 0.0)
    monkeypatch.setattr(run_study, "_MIN_RUN_S", 0.0)
    argv = ["--out-dir", str(tmp_path), "--configs", "bf16", "--", *QUICK, "--no-compile"]
    # A limit that rounds to 0 s: the run trains its first step, then stops and writes its checkpoint.
    assert run_study.main(["--time-limit", "0.4", *argv]) == 0
    assert "bf16: stopped by the time limit" in capfd.readouterr().out
    partial = json.loads((tmp_path / "bf16.json").read_text())
    assert partial["summary"] is None and (tmp_path / "bf16.pt").exists()
    assert run_study.main(argv) == 0
    assert "bf16: done" in capfd.readouterr().out
    run = json.loads((tmp_path / "bf16.json").read_text())
    assert run["summary"]["steps"] == 3 and len(run["segments"]) == 2
    assert run["segments"][1]["start_step"] == len(partial["train"]["step"])


def test_run_study_sigterm_is_acted_on_between_loop_steps():
    # The handler only records the signal; the loop exits at its next check, never between starting a
    # run and registering it for the clean-up.
    import signal

    flag = run_study._SigtermFlag()
    flag.exit_if_received()  # nothing received: no exit
    flag(signal.SIGTERM, None)
    with pytest.raises(SystemExit) as stop:
        flag.exit_if_received()
    assert stop.value.code == 128 + signal.SIGTERM


def test_run_study_sigterm_stops_the_runs_with_their_checkpoints(tmp_path):
    """SIGTERM to run_study.py reaches each run, which finishes its step, writes its checkpoint and stops
    (continuing from such a checkpoint is what the time-limit test checks)."""
    import signal
    import subprocess
    import time

    args = [a for a in QUICK if a != "--quiet"]
    args[args.index("--steps") + 1] = "400"
    cmd = [sys.executable, str(EXAMPLES / "run_study.py"), "--out-dir", str(tmp_path), "--configs", "bf16",
           "--refresh", "1000", "--", *args, "--no-compile", "--log-every", "1"]
    study = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = tmp_path / "bf16.log"
    deadline = time.monotonic() + 120
    while not (log.exists() and "step   2/400" in log.read_text()):  # the run is training
        assert time.monotonic() < deadline and study.poll() is None, "the run did not start training"
        time.sleep(0.2)
    study.send_signal(signal.SIGTERM)
    out, _ = study.communicate(timeout=120)
    assert study.returncode == 128 + signal.SIGTERM
    assert "by SIGTERM" in log.read_text()
    partial = json.loads((tmp_path / "bf16.json").read_text())
    steps = len(partial["train"]["step"])
    assert partial["summary"] is None and 2 <= steps < 400 and (tmp_path / "bf16.pt").exists()
