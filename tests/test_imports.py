"""``import fp4compile`` and ``fp4compile --help`` stay light: torch's compiler stack, Triton, networkx,
transformers, torch-mlir and the CUTLASS tooling are imported where they are used, not before; and
nothing a user reaches through the package changes for it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "torch._dynamo", "torch._inductor", "triton", "networkx", "transformers", "torch_mlir", "jinja2",
         "fp4compile.codegen", "fp4compile.ops", "fp4compile.backend")


def _loaded_after(code: str) -> set:
    probe = f"import sys\n{code}\nprint(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    return set(out.stdout.split())


def test_import_fp4compile_loads_none_of_the_heavy_modules():
    assert not _loaded_after("import fp4compile") & set(HEAVY)


def test_cli_help_loads_none_of_the_heavy_modules():
    code = ("from fp4compile import cli\n"
            "for argv in (['--help'], ['kernels', '--help'], ['export', '--help']):\n"
            "    try:\n        cli.main(argv)\n    except SystemExit:\n        pass")
    assert not _loaded_after(code) & set(HEAVY)


@pytest.mark.slow  # a fresh process that imports torch and compiles
def test_names_resolve_on_first_use_and_the_backend_string_works():
    code = """
import types, importlib, torch
import fp4compile
from fp4compile import Backend, Recipe, ops, cli
assert isinstance(fp4compile.export, types.FunctionType) and isinstance(fp4compile.explain, types.FunctionType)
assert isinstance(importlib.import_module("fp4compile.export"), types.ModuleType)
assert isinstance(fp4compile.export, types.FunctionType)  # importing the module leaves the function
assert sorted(fp4compile.__all__) == sorted(n for n in fp4compile.__all__ if getattr(fp4compile, n) is not None)
assert hasattr(torch.ops.fp4, "quantize")
model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
torch.compile(model, backend="nvfp4")(torch.randn(16, 32)).sum().backward()
try:
    fp4compile.no_such_name
except AttributeError as err:
    assert "no attribute 'no_such_name'" in str(err)
else:
    raise AssertionError("no error")
print("ok")
"""
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
