"""Imports go one way: the API on top, then the passes, then the core, with the code generators beside
the core, and a pass never imports another pass.

- the API (``backend``, ``explain``, ``cli``, ``fsdp``, the package's ``__init__``) may import anything;
- a pass (a module of ``passes`` that the pipeline runs) imports the core, the code generators and the
  passes' helper modules, never another pass; ``passes/pipeline.py`` imports every pass;
- the core (every other module of ``fp4compile``) and the code generators import neither the passes nor
  the API; the shared graph vocabulary lives in ``fp4compile.vocabulary``, the warnings in
  ``fp4compile.diagnostics``.

Every import counts, those inside functions too (a lazy import is an import).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import fp4compile
from fp4compile.passes import pipeline

PACKAGE = Path(fp4compile.__file__).resolve().parent
ROOT = PACKAGE.parent
FOLDERS = {"fp4compile": PACKAGE, "fp4compile.passes": ROOT / "passes", "fp4compile.codegen": ROOT / "codegen"}
API = {"fp4compile", "fp4compile.backend", "fp4compile.explain", "fp4compile.cli", "fp4compile.cli_kernels",
       "fp4compile.fsdp"}
PASSES = {f"fp4compile.passes.{pipeline.pass_name(p)}" for p in
          pipeline.DYNAMO_PASSES + pipeline.JOINT_PASSES + pipeline.AOT_PASSES}


def modules() -> dict[str, Path]:
    out = {}
    for package, folder in FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts))
            out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def imports(name: str, path: Path) -> set[str]:
    """The fp4compile modules ``path`` (module ``name``) imports, anywhere in its code."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    known = modules()
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:  # ``from . import grouped_sites`` imports that module, not the package
                found.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module)
    return {m for m in found if m in known and m != name}


def layer(name: str) -> str:
    if name in API:
        return "api"
    if name == "fp4compile.passes.pipeline":
        return "pipeline"
    if name in PASSES:
        return "pass"
    if name.startswith("fp4compile.passes"):
        return "pass helper"
    if name.startswith("fp4compile.codegen"):
        return "codegen"
    return "core"


def upward(importer: str, imported: str) -> bool:
    below, above = layer(importer), layer(imported)
    if below in ("api", "pipeline"):
        return False
    if below == "pass":
        return above in ("api", "pipeline", "pass")
    return above in ("api", "pipeline", "pass", "pass helper")  # core, codegen, pass helpers


def test_the_layers_are_known():
    found = modules()
    assert PASSES <= found.keys() and len(PASSES) == len(pipeline.pass_names())
    assert {layer(m) for m in found} == {"api", "pipeline", "pass", "pass helper", "codegen", "core"}


def test_no_module_imports_upward():
    wrong = sorted(
        f"{name} ({layer(name)}) imports {imported} ({layer(imported)})"
        for name, path in modules().items() for imported in imports(name, path) if upward(name, imported)
    )
    assert wrong == []


@pytest.mark.parametrize("importer, imported, expected", [
    ("fp4compile.codegen.cutlass_runtime", "fp4compile.backend", True),
    ("fp4compile.report", "fp4compile.passes.find_gemm_sites", True),
    ("fp4compile.passes.fuse_amax", "fp4compile.passes.lower_gemms", True),
    ("fp4compile.passes.mark_fp4_linear", "fp4compile.passes.grouped_sites", False),
    ("fp4compile.passes.lower_gemms", "fp4compile.vocabulary", False),
    ("fp4compile.backend", "fp4compile.passes.pipeline", False),
])
def test_what_counts_as_upward(importer, imported, expected):
    assert upward(importer, imported) is expected


def test_imports_inside_functions_count(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from fp4compile.passes import lower_gemms\n    from .backend import Backend\n")
    assert imports("fp4compile.m", module) >= {"fp4compile.passes.lower_gemms", "fp4compile.backend"}
