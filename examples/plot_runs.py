"""Plot the loss curves of several train_gpt.py runs and their gap to the BF16 baseline.

    python examples/plot_runs.py runs/*.json --out-dir runs/plots

Writes ``loss.png`` (smoothed train loss as lines, validation loss as markers, one colour per run, a
dotted line where a run switched to high precision) and ``gap.png`` (relative gap to the baseline,
``(loss - baseline) / baseline`` in percent at the steps both runs logged, for the smoothed train loss
and for the validation loss). The baseline is ``--baseline`` (a run name or JSON path), else the first
run with ``--precision bf16``. A Markdown table of the final losses and gaps is printed for
docs/convergence.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Optional, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load_run(path: Path) -> dict:
    run = json.loads(Path(path).read_text())
    run["path"] = str(path)
    run.setdefault("name", Path(path).stem)
    return run


def smooth(values: list[float], ema: float) -> list[float]:
    """Bias-corrected exponential moving average (ema=0: no smoothing). NaN/inf propagate."""
    out, avg = [], 0.0
    for i, v in enumerate(values, start=1):
        avg = ema * avg + (1.0 - ema) * v
        out.append(avg / (1.0 - ema**i) if ema > 0 else v)
    return out


def relative_gap(steps: list[int], values: list[float], base_steps: list[int], base_values: list[float]):
    """(value - base) / base at the steps present in both series, in step order."""
    base = dict(zip(base_steps, base_values))
    pairs = [(s, (v - base[s]) / base[s]) for s, v in zip(steps, values) if s in base and base[s] != 0]
    return [s for s, _ in pairs], [g for _, g in pairs]


def pick_baseline(runs: list[dict], wanted: Optional[str]) -> Optional[dict]:
    if wanted is not None:
        for run in runs:
            if wanted in (run["name"], run["path"]) or Path(run["path"]).stem == wanted:
                return run
        raise SystemExit(f"baseline {wanted!r} is not among the runs: {[r['name'] for r in runs]}")
    for run in runs:
        if run.get("args", {}).get("precision") == "bf16":
            return run
    return None


def setup_key(run: dict) -> dict:
    """What must match for a gap to measure arithmetic alone: model, data, batch and schedule."""
    corpus, schedule = run.get("corpus", {}), run.get("schedule", {})
    return {
        "preset": run.get("model", {}).get("preset"),
        "seq_len": run.get("model", {}).get("seq_len"),
        "python": corpus.get("python_version"),
        "include_tests": corpus.get("include_tests"),
        "tokens_per_step": schedule.get("tokens_per_step"),
        "steps": schedule.get("steps"),
        "peak_lr": schedule.get("peak_lr"),
    }


def _train_series(run: dict, ema: float) -> tuple[list[int], list[float]]:
    train = run["train"]
    # train_gpt.py logs 0-based steps; plot steps completed.
    return [s + 1 for s in train["step"]], smooth(train["loss"], ema)


def _val_series(run: dict) -> tuple[list[int], list[float]]:
    return [s + 1 for s in run["val"]["step"]], list(run["val"]["loss"])


def plot_losses(runs: list[dict], ema: float, path: Path, title: str, log_y: bool) -> None:
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        ax.plot(*_train_series(run, ema), color=color, lw=1.3, label=f"{run['name']} train")
        vs, vl = _val_series(run)
        if vs:
            ax.plot(vs, vl, color=color, ls="--", marker="o", ms=4, lw=1, label=f"{run['name']} val")
        if run.get("high_precision_from_step") is not None:
            ax.axvline(run["high_precision_from_step"], color=color, ls=":", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    if log_y:
        ax.set_yscale("log")
    ax.set_title(f"{title} (train: EMA {ema:g})" if ema else title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def default_gap_start(baseline: dict) -> int:
    """The baseline's warm-up length: earlier gaps are large and say little about the recipe."""
    warmup = baseline.get("schedule", {}).get("warmup")
    return int(warmup) if warmup is not None else max(1, len(baseline["train"]["step"]) // 10)


def plot_gaps(runs: list[dict], baseline: dict, ema: float, path: Path, title: str, start: int) -> None:
    fig, ax = plt.subplots(figsize=(8, 5))
    base_train, base_val = _train_series(baseline, ema), _val_series(baseline)

    def after_start(steps, gap):
        kept = [(s, 100 * g) for s, g in zip(steps, gap) if s > start]
        return [s for s, _ in kept], [g for _, g in kept]

    for i, run in enumerate(runs):
        if run is baseline:
            continue
        color = f"C{i % 10}"
        steps, gap = after_start(*relative_gap(*_train_series(run, ema), *base_train))
        ax.plot(steps, gap, color=color, lw=1.3, label=f"{run['name']} train")
        steps, gap = after_start(*relative_gap(*_val_series(run), *base_val))
        if steps:
            ax.plot(steps, gap, color=color, ls="--", marker="o", ms=4, lw=1, label=f"{run['name']} val")
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel(f"relative gap to {baseline['name']} (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fmt(value: Optional[float], percent: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{100 * value:+.2f}%" if percent else f"{value:.4f}"


def summary_table(runs: list[dict], baseline: Optional[dict]) -> str:
    """Markdown table of final losses and their gaps to the baseline.

    Train loss is the mean over the run's last 10% of steps; validation loss is the last evaluation.
    Gaps compare with the baseline at the same steps, so runs of different lengths stay comparable
    (n/a when the baseline did not log those steps).
    """
    rows = ["| run | steps | train loss (last 10%) | val loss | train gap | val gap |",
            "|---|---|---|---|---|---|"]
    base_train = dict(zip(baseline["train"]["step"], baseline["train"]["loss"])) if baseline else {}
    base_val = dict(zip(baseline["val"]["step"], baseline["val"]["loss"])) if baseline else {}
    for run in runs:
        steps, losses = run["train"]["step"], run["train"]["loss"]
        tail = max(1, len(losses) // 10)
        train = sum(losses[-tail:]) / tail if losses else None
        gap_t = None
        if losses and all(s in base_train for s in steps[-tail:]):
            base = sum(base_train[s] for s in steps[-tail:]) / tail
            gap_t = (train - base) / base
        val = run["val"]["loss"][-1] if run["val"]["loss"] else None
        gap_v = None
        if val is not None and run["val"]["step"][-1] in base_val:
            base = base_val[run["val"]["step"][-1]]
            gap_v = (val - base) / base
        rows.append(f"| {run['name']} | {len(steps)} | {_fmt(train)} | {_fmt(val)} | "
                    f"{_fmt(gap_t, True)} | {_fmt(gap_v, True)} |")
    return "\n".join(rows)


def main(argv: Optional[Sequence[str]] = None) -> list[Path]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="run JSONs written by train_gpt.py --out")
    p.add_argument("--out-dir", type=Path, default=Path("runs/plots"))
    p.add_argument("--prefix", default="", help="prepended to the PNG file names")
    p.add_argument("--baseline", default=None, help="run name or path (default: first bf16 run)")
    p.add_argument("--ema", type=float, default=0.9, help="train-loss smoothing factor, 0 = none")
    p.add_argument("--title", default=None)
    p.add_argument("--log-y", action="store_true", help="logarithmic loss axis")
    p.add_argument("--gap-start", type=int, default=None,
                   help="first step of the gap plot (default: the baseline's warm-up)")
    args = p.parse_args(argv)
    if not 0.0 <= args.ema < 1.0:
        p.error("--ema must be in [0, 1)")

    runs = [load_run(path) for path in args.runs]
    names = [run["name"] for run in runs]
    for run in runs:
        if names.count(run["name"]) > 1:  # same flags, e.g. two seeds: tell them apart by file
            run["name"] = f"{run['name']} ({Path(run['path']).stem})"
    baseline = pick_baseline(runs, args.baseline)
    if baseline is not None:
        base_key = setup_key(baseline)
        for run in runs:
            differs = {k: v for k, v in setup_key(run).items() if v != base_key[k]}
            if differs:
                print(f"warning: {run['name']} differs from the baseline in {differs} "
                      f"(baseline: { {k: base_key[k] for k in differs} }); its gap is not FP4 alone",
                      file=sys.stderr)
    title = args.title or ", ".join(sorted({r.get("args", {}).get("preset", "?") for r in runs})) + " GPT"
    args.out_dir.mkdir(parents=True, exist_ok=True)

    written = [args.out_dir / f"{args.prefix}loss.png"]
    plot_losses(runs, args.ema, written[0], title, args.log_y)
    if baseline is not None and len(runs) > 1:
        written.append(args.out_dir / f"{args.prefix}gap.png")
        start = args.gap_start if args.gap_start is not None else default_gap_start(baseline)
        plot_gaps(runs, baseline, args.ema, written[-1], title, start)
    else:
        print("no gap plot: needs a baseline (a bf16 run or --baseline) and another run", file=sys.stderr)
    print(summary_table(runs, baseline))
    for path in written:
        print(f"wrote {path}")
    return written


if __name__ == "__main__":
    main()
