"""The executor table: each op's implementations in order, their checks and reasons, a user's own
implementation, and the layering (codegen never imports the ops; the ops import no codegen at import)."""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

import fp4compile
from fp4compile import Backend, executors, reference
from models import MLPStack

# A fresh process in which ``fp4compile`` is a bare package: its ``__init__`` (which loads the ops for the
# backend) does not run, so the modules loaded are those the imports of ``body`` pull in. Prints them.
_BARE = """
import importlib.util, json, sys, types
spec = importlib.util.find_spec("fp4compile")  # finds the package without running it
package = types.ModuleType("fp4compile")
package.__path__ = list(spec.submodule_search_locations)
sys.modules["fp4compile"] = package
{body}
print(json.dumps(sorted(m for m in sys.modules if m.startswith("fp4compile"))))
"""


def _loaded(body: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", _BARE.format(body=textwrap.dedent(body))],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_codegen_runs_without_the_ops():
    loaded = _loaded("""
        import os
        os.environ["TRITON_INTERPRET"] = "1"
        import torch
        from fp4compile.codegen import build_cache, cublaslt_gemm, cutlass_gemm, cutlass_runtime, cutlass_toolkit
        from fp4compile.codegen.triton_kernels import dispatch
        from fp4compile import executors, reference
        # Kernels and the table's codegen paths, run on the CPU (Triton's interpreter).
        x = torch.randn(32, 64)
        assert torch.equal(dispatch.quantize(x, "nvfp4", "1x16", "rne", 0)[0],
                           reference.quantize(x, "nvfp4", "1x16", "rne", 0)[0])
        assert executors.choose_gemm(32, 64, 64, "nvfp4", torch.bfloat16, "cpu").name == "emulation"
    """)
    assert "fp4compile.codegen.triton_kernels.dispatch" in loaded and "fp4compile.executors" in loaded
    assert "fp4compile.ops" not in loaded


def test_the_ops_import_no_codegen():
    loaded = _loaded("import fp4compile.ops")
    assert "fp4compile.ops" in loaded and "fp4compile.executors" in loaded
    assert not [m for m in loaded if m.startswith("fp4compile.codegen")], loaded


def _imported(path: pathlib.Path, package: str) -> set[str]:
    """Every module a source file imports, at any level (lazy imports included), resolved to full names."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def test_no_codegen_source_imports_the_ops():
    import fp4compile.codegen

    root = pathlib.Path(fp4compile.codegen.__path__[0])
    sources = sorted(root.rglob("*.py"))
    assert len(sources) > 10
    for path in sources:
        package = ".".join(["fp4compile", "codegen", *path.relative_to(root).parent.parts])
        imported = _imported(path, package)
        assert "fp4compile.ops" not in imported, f"{path} imports fp4compile.ops"


def test_the_table_orders_each_op():
    assert executors.implementations("quantize") == ("triton", "reference")
    assert executors.implementations("rht_quantize") == ("triton", "unfused")
    assert executors.implementations("emulated_mm") == ("cublaslt", "triton", "cuda-bf16", "reference")
    assert executors.implementations("scaled_mm") == ("cutlass", "triton", "emulation")
    assert executors.implementations("packed_mm") == ("triton", "reference")
    assert executors.arguments("wgrad_amax") == ("x", "size")


def test_a_choice_says_why_the_earlier_implementations_declined():
    x = torch.randn(32, 64)
    choice = executors.choose("fake_quantize", x, "nvfp4", "1x16", "rne", 0, None, None)
    assert choice.name == "unfused" and choice.declined == (("triton", "its input is on cpu, not CUDA"),)
    assert choice.reason == "triton declined: its input is on cpu, not CUDA"
    gemm = executors.choose_gemm(32, 64, 64, "nvfp4", torch.bfloat16, "cpu")
    assert gemm.name == "emulation" and gemm.reason == "cutlass, triton declined: device cpu is not a CUDA GPU"
    batched = executors.choose_gemm(32, 64, 64, "nvfp4", torch.bfloat16, "cpu", batched=True)
    assert batched.reason.startswith("cutlass declined: batched operands: the FP4 kernels take 2-D operands; ")


def test_bad_table_requests_name_the_op_and_the_implementation():
    with pytest.raises(ValueError, match="no op 'quantise' in the executor table"):
        executors.choose("quantise", torch.zeros(2, 16))
    with pytest.raises(ValueError, match="quantize already has an implementation 'reference'"):
        executors.register("quantize", "reference", lambda *a: (True, ""), lambda *a: None)
    with pytest.raises(ValueError, match="quantize has no implementation 'cutlass'"):
        executors.register("quantize", "mine", lambda *a: (True, ""), lambda *a: None, before="cutlass")
    with pytest.raises(ValueError, match="without ':'"):
        executors.register("scaled_mm", "my:gemm", lambda *a: (True, ""), lambda *a: None)
    with pytest.raises(ValueError, match="kernel 'mine:x' names no implementation of scaled_mm"):
        executors.run_scaled_mm("mine:x", *([torch.zeros(1)] * 6), "nvfp4", torch.float32)
    executors.register("decode_blocks", "never", lambda *a: (False, "it takes nothing"), lambda *a: None)
    removed = [executors.unregister("decode_blocks", name) for name in ("triton", "reference")]
    try:
        with pytest.raises(executors.NoImplementation, match=r"decode_blocks .*never: it takes nothing"):
            executors.run("decode_blocks", torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8))
    finally:
        anchor = "never"
        for impl in removed:
            executors.register("decode_blocks", impl.name, impl.check, impl.call, in_graph=impl.in_graph, after=anchor)
            anchor = impl.name
        executors.unregister("decode_blocks", "never")
    assert executors.implementations("decode_blocks") == ("triton", "reference")


def _train_step():
    torch._dynamo.reset()
    torch.manual_seed(0)
    fp4compile.manual_seed(3)
    model = MLPStack(4, d=64)
    backend = Backend()
    y = torch.compile(model, backend=backend)(torch.randn(32, 64))
    y.square().sum().backward()
    return backend, y.detach(), [p.grad for p in model.parameters()]


def test_a_user_quantizer_is_chosen_run_and_reported(fresh_dynamo):
    """A user's quantizer registered after Triton takes the CPU calls: every quantize node of the compiled
    step runs it, and the report names it with its reason and Triton's."""
    _, y_ref, grads_ref = _train_step()
    calls = []

    def check(x, fmt, block, *rest):
        if fmt != "nvfp4":
            return False, f"only NVFP4, not {fmt}"
        return True, "the counting quantizer takes NVFP4 on any device"

    def quantize(x, fmt, block, rounding, seed, amax=None, seed_base=None, layout="row_major", scale_rule="6"):
        calls.append(block)
        return reference.quantize(x, fmt, block, rounding, seed, amax, seed_base, layout, scale_rule)

    executors.register("quantize", "counting", check, quantize, after="triton")
    try:
        assert executors.implementations("quantize") == ("triton", "counting", "reference")
        backend, y, grads = _train_step()
    finally:
        executors.unregister("quantize", "counting")
    assert executors.implementations("quantize") == ("triton", "reference")
    # Its bits are the reference's, and it ran once per quantize node (the unfused RHT quantizers of the
    # weight gradient call the quantize entry after the RHT).
    assert torch.equal(y, y_ref) and all(torch.equal(a, b) for a, b in zip(grads, grads_ref))
    choices = backend.report.quantizer_kernels()
    assert len(calls) == sum(n for (op, _, _), n in choices.items() if op in ("fp4.quantize", "fp4.rht_quantize"))
    reason = "triton declined: its input is on cpu, not CUDA; the counting quantizer takes NVFP4 on any device"
    assert choices[("fp4.quantize", "counting", reason)] >= 4
    assert choices[("fp4.rht_quantize", "unfused", "triton declined: its input is on cpu, not CUDA")] >= 2
    assert f"nodes): counting: {reason}" in backend.report.precision_table()
