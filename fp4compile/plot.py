"""Plots of the quantization statistics (``Backend.collect_stats``): matplotlib, the ``plot`` extra.

``quant_error(rows, path)`` draws the relative quantization error of every FP4 layer, one line per
(GEMM role, operand), layers in their order in the model, and writes a PNG::

    backend.collect_stats(steps=10)
    ...  # train 10 steps
    fp4compile.plot.quant_error(backend.report.stats(), "quant_error.png")
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from fp4compile.quant_stats import SLOTS

__all__ = ["quant_error"]


def _layer_key(name: str):
    """Layers in model order: numbers compare as numbers (``blocks.10`` after ``blocks.9``)."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.replace("#", ".").split("."))


def quant_error(rows: list[dict], path, stat: str = "relative_error", title: Optional[str] = None) -> Path:
    """Write a PNG of ``stat`` (default the relative error ||Q(x) - x|| / ||x||) per layer (x axis, in
    model order) and per role and operand (one line each) from ``rows`` (``Report.stats()``, reduced
    over steps); returns the path. Raises ImportError naming the extra without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - the extra is installed in the dev environment
        raise ImportError("fp4compile.plot needs matplotlib: pip install 'fp4compile[plot]'") from exc
    if not rows:
        raise ValueError("no quantization statistics to plot: backend.collect_stats(steps=N), train N steps, "
                         "then backend.report.stats()")
    if "step" in rows[0] and "steps" not in rows[0]:
        raise ValueError("plot rows reduced over the steps: report.stats() or report.stats('last'), not reduce=None")
    layers = sorted({r["site"] for r in rows}, key=_layer_key)
    where = {name: i for i, name in enumerate(layers)}
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(layers) + 2), 4.2))
    for role, operand in SLOTS:
        points = sorted((where[r["site"]], r[stat]) for r in rows if (r["role"], r["operand"]) == (role, operand))
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.2, label=f"{role} {operand}")
    ax.set_xticks(range(len(layers)))
    ax.set_xticklabels(layers, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel(stat.replace("_", " "))
    ax.set_title(title or f"NVFP4 {stat.replace('_', ' ')} per layer, role and operand")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
