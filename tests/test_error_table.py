"""The quantization error table: its qualitative facts, and that docs/numerics.md shows what it computes."""

from __future__ import annotations

import math
import re
import runpy
import sys
from pathlib import Path

import pytest

from fp4compile import error_table

DOC = Path(__file__).resolve().parents[1] / "docs" / "numerics.md"
KEYS = ("rel_rms", "max_abs", "bias")


@pytest.fixture(scope="module")
def rows():
    # The defaults are the ones the documented table was produced with.
    return error_table.quantization_error_table()


def _by_config(rows):
    return {(r["format"], r["block"], r["rounding"]): r for r in rows}


def test_rows_cover_every_config(rows):
    assert [(r["format"], r["block"], r["rounding"]) for r in rows] == list(error_table.CONFIGS)
    for r in rows:
        assert r["numel"] == 1024 * 1024
        assert all(math.isfinite(r[k]) for k in KEYS + ("rms",))
        assert 0 < r["rel_rms"] < 0.5 and r["max_abs"] > 0


def test_nvfp4_1x16_beats_mxfp4(rows):
    t = _by_config(rows)
    for rnd in ("rne", "sr"):
        assert t["nvfp4", "1x16", rnd]["rel_rms"] < t["mxfp4", "1x32", rnd]["rel_rms"]


def test_sr_error_exceeds_rne_error(rows):
    t = _by_config(rows)
    for fmt, block, _ in error_table.CONFIGS[::2]:
        assert t[fmt, block, "sr"]["rel_rms"] > t[fmt, block, "rne"]["rel_rms"]


def test_16x16_tiles_are_no_better_than_1x16_blocks(rows):
    t = _by_config(rows)
    for rnd in ("rne", "sr"):
        assert t["nvfp4", "16x16", rnd]["rel_rms"] >= t["nvfp4", "1x16", rnd]["rel_rms"]


def test_bias_is_within_the_standard_error(rows):
    """The mean of N errors with RMS r has standard error at most r / sqrt(N); allow 5 of them."""
    for r in rows:
        se = r["rms"] / math.sqrt(r["numel"])
        assert abs(r["bias"]) <= 5 * se, r


def test_small_tables_and_bad_sizes():
    small = error_table.quantization_error_table(n=64, seed=3)
    assert len(small) == len(error_table.CONFIGS)
    assert small == error_table.quantization_error_table(n=64, seed=3)  # deterministic
    with pytest.raises(ValueError):
        error_table.quantization_error_table(n=24)


def test_format_table_is_markdown():
    small = error_table.quantization_error_table(n=32)
    lines = error_table.format_table(small).splitlines()
    assert len(lines) == 2 + len(small)
    assert lines[0].startswith("| format | block | rounding |")
    assert set(lines[1]) <= set("|-")
    assert all(line.startswith("| ") and line.endswith(" |") for line in lines[2:])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # runpy: the module is already imported
def test_module_prints_the_table(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["error_table", "--n", "32", "--seed", "1"])
    runpy.run_module("fp4compile.error_table", run_name="__main__")
    out = capsys.readouterr().out
    assert out.strip() == error_table.format_table(error_table.quantization_error_table(32, 1))


def _doc_table() -> dict:
    text = DOC.read_text()
    m = re.search(r"<!-- error-table:begin -->(.*?)<!-- error-table:end -->", text, re.S)
    assert m, "docs/numerics.md must hold the error table between error-table markers"
    table = {}
    for line in m.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 6 or cells[0] not in ("nvfp4", "mxfp4"):
            continue
        table[tuple(cells[:3])] = dict(zip(KEYS, map(float, cells[3:])))
    return table


def _same_to_3_significant_digits(documented: float, computed: float) -> bool:
    if computed == 0:
        return documented == 0
    half_unit = 0.5 * 10 ** (math.floor(math.log10(abs(computed))) - 2)
    return abs(documented - computed) <= half_unit


def test_documented_table_matches_the_computed_one(rows):
    doc = _doc_table()
    assert set(doc) == set(error_table.CONFIGS)
    for r in rows:
        d = doc[r["format"], r["block"], r["rounding"]]
        for k in KEYS:
            assert _same_to_3_significant_digits(d[k], r[k]), (r["format"], r["block"], r["rounding"], k, d[k], r[k])
