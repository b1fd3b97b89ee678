"""The README's settings table lists exactly ``fp4compile.config``'s settings, each with its variable, and no
other module names an ``FP4COMPILE_*`` variable that is not one of them."""

from __future__ import annotations

import re
from pathlib import Path

from fp4compile import config

ROOT = Path(__file__).resolve().parent.parent


def test_the_readme_table_lists_every_setting_with_its_variable():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Settings"):]
    table = table[: table.index("\n## ", 1)]
    rows = re.findall(r"^\| `(FP4COMPILE_[A-Z0-9_]*[A-Z0-9])[^|]*\| `fp4compile\.config\.(\w+)` \|", table, flags=re.M)
    assert rows, "no settings row found in the README"
    assert dict(rows) == {setting.variable: name for name, setting in config.SETTINGS.items()}
    assert len(rows) == len(config.SETTINGS)


def test_the_sources_name_no_variable_but_the_settings():
    variables = {setting.variable for setting in config.SETTINGS.values()}
    named = set()
    for package in ("fp4compile", "passes", "codegen"):
        for path in (ROOT / package).rglob("*.py"):
            named |= set(re.findall(r"FP4COMPILE_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    assert named - variables == set(), f"named in the sources but not a setting of fp4compile.config: {sorted(named - variables)}"
