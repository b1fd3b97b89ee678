"""Quantization error of the FP4 formats on Gaussian data: the table in docs/numerics.md.

``python -m fp4compile.error_table`` prints it as markdown.
"""

from __future__ import annotations

import argparse
import math
from typing import Sequence

import torch

from . import formats

__all__ = ["CONFIGS", "quantization_error_table", "format_table"]

# (format, block, rounding) rows of the table, in order.
CONFIGS = (
    ("nvfp4", "1x16", "rne"),
    ("nvfp4", "1x16", "sr"),
    ("nvfp4", "16x16", "rne"),
    ("nvfp4", "16x16", "sr"),
    ("mxfp4", "1x32", "rne"),
    ("mxfp4", "1x32", "sr"),
)

COLUMNS = (
    ("format", "format"),
    ("block", "block"),
    ("rounding", "rounding"),
    ("rel_rms", "relative RMS error"),
    ("max_abs", "max abs error"),
    ("bias", "mean error (bias)"),
)


def quantization_error_table(n: int = 1024, seed: int = 0) -> list[dict]:
    """Quantize an ``n x n`` N(0, 1) matrix with every format / block / rounding of ``CONFIGS``.

    The data come from ``torch.Generator().manual_seed(seed)`` on the CPU; stochastic rounding uses
    ``seed`` as its seed, so the table is deterministic. Each row is a dict with ``format``, ``block``,
    ``rounding``, ``rel_rms`` (||x̂ - x|| / ||x||), ``max_abs`` (max |x̂ - x|), ``bias`` (mean of x̂ - x),
    ``rms`` (sqrt(mean((x̂ - x)**2))) and ``numel``. Statistics are accumulated in float64.
    """
    if n <= 0 or n % 16:
        raise ValueError(f"n must be a positive multiple of 16 (16x16 tiles), got {n}")
    x = torch.randn(n, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
    xd = x.double()
    x_norm = xd.norm().item()
    rows = []
    for fmt, block, rounding in CONFIGS:
        q = formats.quantize(x, fmt, block, rounding, seed=seed if rounding == "sr" else None)
        err = formats.dequantize(q).double() - xd
        rows.append(
            {
                "format": fmt,
                "block": block,
                "rounding": rounding,
                "rel_rms": err.norm().item() / x_norm,
                "max_abs": err.abs().max().item(),
                "bias": err.mean().item(),
                "rms": math.sqrt(err.square().mean().item()),
                "numel": err.numel(),
            }
        )
    return rows


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_table(rows: Sequence[dict]) -> str:
    """The rows as a markdown table (numbers to 4 significant digits)."""
    lines = [
        "| " + " | ".join(title for _, title in COLUMNS) + " |",
        "|" + "|".join("---" for _ in COLUMNS) + "|",
    ]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row[key]) for key, _ in COLUMNS) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1024, help="the data is an n x n N(0,1) matrix (default 1024)")
    parser.add_argument("--seed", type=int, default=0, help="data and stochastic-rounding seed (default 0)")
    args = parser.parse_args(argv)
    print(format_table(quantization_error_table(args.n, args.seed)))


if __name__ == "__main__":
    main()
