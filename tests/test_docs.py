"""The code and output shown in README.md and docs/*.md, run and compared with what the code prints now.

A block is checked where an HTML comment on the line before its fence says how it is produced:

    <!-- checked: python -->            the Python block runs as pasted, in a fresh process
    <!-- checked: python, continued --> the same, after the file's previous Python block (its names in scope)
    <!-- checked: output -->            what the file's previous Python block printed
    <!-- checked: NAME -->              what the producer NAME (``PRODUCERS`` below) prints

Add ``, slow`` (``<!-- checked: python, slow -->``) for a block that takes more than a few seconds: it
runs with ``-m slow``. Expected text matches line by line after trailing spaces; a line ``...`` stands for
any number of lines and ``...`` inside a line for any text (left out timings, long lines).
"""

from __future__ import annotations

import functools
import io
import re
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!-- checked: ([\w-]+)((?:, *[\w-]+)*) -->\s*$")
SEPARATOR = "----8<---- next block ----8<----"


# ---------------------------------------------------------------------------------------------
# Reading the checked blocks
# ---------------------------------------------------------------------------------------------


class Block:
    def __init__(self, path: Path, line: int, kind: str, flags: set, text: str):
        self.path, self.line, self.kind, self.flags, self.text = path, line, kind, flags, text
        self.chain: list = []  # python: the blocks it runs after (continued), itself last
        self.source = None  # output: the python block whose output it shows

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}:{self.kind}"


def _fenced(lines: list, start: int) -> tuple:
    """The text of the fenced block (``` or an indented block) that starts at ``lines[start]``."""
    first = lines[start]
    if first.lstrip().startswith("```"):
        indent = len(first) - len(first.lstrip())
        end = next(i for i in range(start + 1, len(lines)) if lines[i].strip().startswith("```"))
        return "\n".join(line[indent:] for line in lines[start + 1:end]), end
    raise ValueError(f"a checked block is a fenced block right after its marker, got {first!r}")


def checked_blocks(paths=DOCS) -> list:
    blocks = []
    for path in paths:
        lines = path.read_text().splitlines()
        last_python = None
        for i, line in enumerate(lines):
            match = MARKER.match(line.strip())
            if not match:
                continue
            kind = match.group(1)
            flags = {f.strip() for f in match.group(2).split(",") if f.strip()}
            text, _ = _fenced(lines, i + 1)
            block = Block(path, i + 2, kind, flags, text)
            if kind == "python":
                block.chain = [*(last_python.chain if "continued" in flags and last_python else []), block]
                last_python = block
            elif kind == "output":
                assert last_python is not None, f"{block.id}: an output block needs a Python block before it"
                block.source = last_python
                block.flags |= last_python.flags & {"slow"}
            blocks.append(block)
    return blocks


def matches(expected: str, actual: str) -> bool:
    """Whether ``actual`` is ``expected`` line by line, with ``...`` as a wildcard (see the module doc)."""
    parts = []
    for line in expected.strip("\n").splitlines():
        line = line.rstrip()
        if line.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(".*?".join(re.escape(p) for p in line.split("...")) + r"[ \t]*\n")
    text = "\n".join(line.rstrip() for line in actual.strip("\n").splitlines()) + "\n"
    return re.fullmatch("".join(parts), text, flags=re.DOTALL) is not None


# ---------------------------------------------------------------------------------------------
# What the blocks are compared with
# ---------------------------------------------------------------------------------------------


@functools.cache
def run_python(chain: tuple) -> tuple:
    """Run the chain's code in a fresh process (as pasted into ``python``), from the repository root;
    each block's standard output."""
    code = f"\nprint({SEPARATOR!r})\n".join(b.text for b in chain)
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True,
                         timeout=1200, cwd=ROOT)
    assert out.returncode == 0, f"{chain[-1].id} failed:\n{out.stderr[-4000:]}"
    return tuple(out.stdout.split(SEPARATOR + "\n"))


def _example(name: str):
    import importlib.util

    sys.path.insert(0, str(ROOT / "examples"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def _inspect_gpt_report():
    """``examples/inspect_gpt.py``'s report: its GPT (tiny) explained on 2 x 64 tokens."""
    import torch

    import fp4compile

    torch._dynamo.reset()
    example = _example("inspect_gpt")
    model = example.gpt("tiny")
    idx = torch.randint(0, model.config.vocab, (2, 64), generator=torch.Generator().manual_seed(0))
    return fp4compile.explain(model, idx, idx, loss_fn=lambda out: out[1])


def _pipeline() -> str:
    import fp4compile

    return fp4compile.pipeline_text()


def _inspect_gpt_table() -> str:
    return _inspect_gpt_report().precision_table()


def _inspect_gpt_diff() -> str:
    return _inspect_gpt_report().diff("backward", "insert_rht")


@functools.cache
def _main_job() -> str:
    """The README's main job, as ``python examples/train_gpt.py --precision nvfp4 --steps 200
    --eval-every 50`` prints it (minutes on a CPU)."""
    out = subprocess.run([sys.executable, "examples/train_gpt.py", "--precision", "nvfp4", "--steps", "200",
                          "--eval-every", "50"], capture_output=True, text=True, timeout=3600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


@functools.cache
def _hybrid_mamba() -> str:
    """``python examples/hybrid_mamba.py`` as it prints (minutes on a CPU)."""
    out = subprocess.run([sys.executable, "examples/hybrid_mamba.py"], capture_output=True, text=True,
                         timeout=3600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


PRODUCERS = {
    "pipeline": _pipeline,
    "hybrid-mamba": _hybrid_mamba,
    "inspect-gpt-table": _inspect_gpt_table,
    "inspect-gpt-diff": _inspect_gpt_diff,
    "main-job": _main_job,
}


def produce(block: Block) -> str:
    if block.kind == "python":
        return run_python(tuple(block.chain))[-1]
    if block.kind == "output":
        return run_python(tuple(block.source.chain))[-1]
    with redirect_stdout(io.StringIO()) as printed:
        text = PRODUCERS[block.kind]()
    return text if text is not None else printed.getvalue()


BLOCKS = checked_blocks()


def test_markers_name_what_exists():
    kinds = {b.kind for b in BLOCKS}
    assert kinds <= {"python", "output", *PRODUCERS}, kinds - {"python", "output", *PRODUCERS}
    assert set(PRODUCERS) <= kinds, f"producers no document uses: {set(PRODUCERS) - kinds}"
    assert {f for b in BLOCKS for f in b.flags} <= {"continued", "slow"}
    for b in BLOCKS:
        assert b.kind != "python" or b.text.strip(), b.id


def test_matching_with_wildcards():
    assert matches("a\n...\nd", "a\nb\nc\nd") and matches("a ... c", "a b c") and not matches("a\nc", "a\nb\nc")
    assert matches("x\n...", "x\ny") and not matches("step 2: loss 5.153", "step 2: loss 5.150")


@pytest.mark.parametrize(
    "block", [pytest.param(b, id=b.id, marks=[pytest.mark.slow] if "slow" in b.flags else []) for b in BLOCKS])
def test_documented_block_is_what_the_code_prints(block):
    actual = produce(block)
    if block.kind == "python":
        return  # it ran without an error; an output block after it shows what it prints
    assert matches(block.text, actual), f"{block.id}: the document shows\n{block.text}\n\nthe code prints\n{actual}"


@pytest.mark.slow
def test_convergence_table_and_text_have_the_main_job_figures():
    """docs/convergence.md's NVFP4 row and deployment-gap sentence quote the main job's figures."""
    printed = _main_job()
    summary = re.search(r"last-10% mean ([\d.]+)\), val loss ([\d.]+)", printed)
    served = re.search(r"served model: val loss ([\d.]+) \(W4A16\), ([\d.]+) \(W4A4\)", printed)
    doc = (ROOT / "docs" / "convergence.md").read_text()
    assert f"| tiny-nvfp4 (full recipe, emulated) | 200 | {summary[1]} | {summary[2]} |" in doc
    assert (f"training forward {summary[2]}, served W4A16\n{served[1]}, served W4A4 {served[2]}" in doc
            or f"training forward {summary[2]}, served W4A16 {served[1]}, served W4A4 {served[2]}" in doc)
