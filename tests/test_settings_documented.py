"""Every environment variable fp4compile reads is in the README's settings table."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_fp4compile_environment_variable_is_in_the_readme_table():
    read = set()
    for package in ("fp4compile", "passes", "codegen"):
        for path in (ROOT / package).rglob("*.py"):
            read |= set(re.findall(r"FP4COMPILE_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Settings"):]
    table = table[: table.index("\n## ", 1)]
    documented = set(re.findall(r"^\| `(FP4COMPILE_[A-Z0-9_]*[A-Z0-9])", table, flags=re.M))
    assert read, "no FP4COMPILE_ variable found in the sources"
    assert read - documented == set(), f"read but not in the README's settings table: {sorted(read - documented)}"
    assert documented - read == set(), f"in the table but read nowhere: {sorted(documented - read)}"
