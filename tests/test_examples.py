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
    ("tiny", 0.5e6, 1.5e6), ("small", 20e6, 30e6), ("medium", 85e6, 125e6)])
def test_preset_sizes(preset, low, high):
    with torch.device("meta"):
        model = gpt.GPT(gpt.PRESETS[preset])
    assert low <= model.num_params() <= high
    # NVFP4 needs 16-element blocks along the reduction dim and 16x16 weight tiles.
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            assert module.in_features % 16 == 0 and module.out_features % 16 == 0


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


def test_recipe_from_flags():
    args = train_gpt.parse_args(["--precision", "mxfp4", "--no-rht", "--no-sr", "--no-2d", "--all-fp4",
                                 "--bf16-switch-at", "7", "--forward-only", "--check-finite", "--seed", "3"])
    assert train_gpt.make_recipe(args) == fp4compile.Recipe(
        fmt="mxfp4", rht=False, stochastic_rounding=False, weight_2d=False, seed=3,
        high_precision_first_blocks=0, high_precision_last_blocks=0,
        switch_to_high_precision_at=7, quantize_backward=False, check_finite=True)
    assert train_gpt.make_recipe(train_gpt.parse_args(["--precision", "nvfp4"])) == fp4compile.Recipe(fmt="nvfp4")
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
    assert record["recipe"]["fmt"] == "nvfp4" and record["summary"]["final_val_loss"] is None
    assert len(record["train"]["loss"]) == 2 and all(math.isfinite(v) for v in record["train"]["loss"])


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


def test_run_study_commands():
    args = run_study.parse_args(["--out-dir", "out", "--switch-fraction", "0.8", "--", "--steps", "50", "--preset", "tiny"])
    assert args.configs == [c for c in run_study.CONFIGS if c != "nvfp4-fwd-only"]
    cmd = run_study.command("nvfp4-bf16-switch", args)
    assert cmd[-8:] == ["--precision", "nvfp4", "--bf16-switch-at", "40", "--name", "nvfp4-bf16-switch",
                        "--out", str(Path("out") / "nvfp4-bf16-switch.json")]
    assert cmd[2:6] == ["--steps", "50", "--preset", "tiny"]
    for name in run_study.CONFIGS:  # every configuration is a valid train_gpt.py command line
        train_gpt.parse_args(run_study.command(name, args)[2:])
    with pytest.raises(SystemExit):
        run_study.parse_args(["--", "--out", "x.json"])
    with pytest.raises(SystemExit):
        run_study.parse_args(["--parallel", "0"])
    assert run_study.parse_args(["--configs", "nvfp4", "bf16", "nvfp4"]).configs == ["nvfp4", "bf16"]


def test_run_study_runs_side_by_side(tmp_path, capfd):
    quick = [a for a in QUICK if a != "--quiet"]
    rc = run_study.main(["--out-dir", str(tmp_path), "--configs", "bf16", "nvfp4", "--parallel", "2", "--", *quick])
    assert rc == 0
    out = capfd.readouterr().out  # the plot step is a subprocess
    assert "bf16: done" in out and "nvfp4: done" in out and "| nvfp4 | 3 |" in out
    for name in ("bf16", "nvfp4"):
        run = json.loads((tmp_path / f"{name}.json").read_text())
        assert run["name"] == name and run["summary"]["steps"] == 3
    assert (tmp_path / "loss.png").stat().st_size > 0 and (tmp_path / "gap.png").stat().st_size > 0
