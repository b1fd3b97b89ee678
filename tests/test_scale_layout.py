"""Quantizers that write the 128x4 tiled scale layout CUTLASS GEMMs read, and the lowering that asks for it.

Triton kernels run in the interpreter on the CPU here; the compiled-graph tests run the CUTLASS path on a
simulated B200 (``test_cutlass_runtime.simulated_kernel``: a CPU model of the kernel reading scales at
CUTLASS's offsets) and compare it bit for bit with the emulation.
"""

from __future__ import annotations

import os
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import fp4compile  # noqa: E402
from fp4compile import executors, formats, ops, scale_layout  # noqa: E402
from fp4compile.codegen import cutlass_gemm, cutlass_runtime  # noqa: E402
from tiers import first_fast  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's 1/0 in the interpreter
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _sample(rows, cols, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g) * torch.exp(torch.randn(rows, 1, generator=g) * 2)).to(dtype)


# ----------------------------------------------------------------------------------------------
# Triton kernels: the swizzled output is the reference's row-major scales, swizzled
# ----------------------------------------------------------------------------------------------


@settings(max_examples=6, deadline=None, database=None, derandomize=True)
@given(st.integers(1, 150), st.integers(1, 7), st.sampled_from(["rne", "sr"]),
       st.sampled_from([torch.float32, torch.bfloat16]))
def test_triton_1x16_swizzled_scales_are_the_reference_swizzled(rows, k_blocks, rounding, dtype):
    pytest.importorskip("triton")
    from fp4compile.codegen import triton_kernels as tk

    x = _sample(rows, 16 * k_blocks, rows * 10 + k_blocks, dtype)
    data, scales, amax = tk.quantize_1x16(x.to(DEVICE), rounding, seed=11, swizzle=True)
    ref = formats.quantize(x, rounding=rounding, seed=11)
    expected = formats.swizzle_scales(ref.scales.view(torch.uint8))
    assert scales.dim() == 1 and scales.numel() == scale_layout.swizzled_numel(rows, k_blocks)
    assert torch.equal(scales.cpu(), expected), "tiled offsets and zero padding as formats.swizzle_scales"
    assert torch.equal(data.cpu(), ref.data.view(torch.uint8)) and torch.equal(amax.cpu(), ref.amax)


@pytest.mark.slow
@settings(max_examples=4, deadline=None, database=None, derandomize=True)
@given(st.integers(1, 9), st.integers(1, 6))
def test_triton_16x16_and_wgrad_swizzled_scales(row_tiles, k_blocks):
    pytest.importorskip("triton")
    from fp4compile.codegen import triton_kernels as tk

    w = _sample(16 * row_tiles, 16 * k_blocks, row_tiles + 7 * k_blocks)
    _, scales, _ = tk.quantize_16x16(w.to(DEVICE), swizzle=True)
    ref = formats.quantize(w, block="16x16")
    assert torch.equal(scales.cpu(), formats.swizzle_scales(ref.scales.view(torch.uint8)))
    # The weight-gradient operand: RHT(x^T) for x [tokens, K], tokens = 16 * row_tiles.
    _, scales, _ = tk.quantize_wgrad_operand(w.to(DEVICE), "sr", seed=5, swizzle=True)
    ref = formats.quantize(formats.rht(w.t().contiguous()), rounding="sr", seed=5)
    assert torch.equal(scales.cpu(), formats.swizzle_scales(ref.scales.view(torch.uint8)))


@pytest.mark.parametrize("shape", [(16, 16), (144, 80), (48, 2112)])
@pytest.mark.parametrize("swizzled, swizzle", [(False, True), (True, False), (True, True)])
def test_triton_transpose_reads_and_writes_either_layout(shape, swizzled, swizzle):
    pytest.importorskip("triton")
    from fp4compile.codegen import triton_kernels as tk

    q = formats.quantize(_sample(*shape, shape[0] + shape[1]), block="16x16")
    scales = q.scales.view(torch.uint8)
    given_scales = formats.swizzle_scales(scales) if swizzled else scales
    data, out_scales = tk.transpose_tiles(q.data.view(torch.uint8).to(DEVICE), given_scales.to(DEVICE), swizzled, swizzle)
    t = q.transpose()
    expected = t.scales.view(torch.uint8)
    assert torch.equal(data.cpu(), t.data.view(torch.uint8))
    assert torch.equal(out_scales.cpu(), formats.swizzle_scales(expected) if swizzle else expected)


# ----------------------------------------------------------------------------------------------
# The ops: layout argument, readers of either layout, errors
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows, k", [(130, 48), (16, 16), (128, 64)])
def test_quantize_ops_write_the_swizzled_layout(rows, k):
    x = _sample(rows, k, rows + k)
    plain = ops.quantize(x, "nvfp4", "1x16", "rne", 3, "")
    tiled = ops.quantize(x, "nvfp4", "1x16", "rne", 3, "", layout="swizzled")
    assert torch.equal(tiled[0], plain[0]) and torch.equal(tiled[2], plain[2])
    assert torch.equal(tiled[1], formats.swizzle_scales(plain[1]))
    assert ops.block_decode(tiled[0], tiled[1], tiled[2], "nvfp4").equal(ops.block_decode(*plain, "nvfp4"))
    rht = ops.rht_quantize(x.t(), 16, "nvfp4", "1x16", "sr", 9, "", layout="swizzled") if rows % 16 == 0 else None
    if rht is not None:
        expected = ops.rht_quantize(x.t(), 16, "nvfp4", "1x16", "sr", 9, "")
        assert torch.equal(rht[1], formats.swizzle_scales(expected[1])) and torch.equal(rht[0], expected[0])


def test_transpose_and_decode_ops_take_swizzled_weights():
    q = ops.quantize(_sample(48, 80, 1), "nvfp4", "16x16", "rne", 0, "")
    tiled = formats.swizzle_scales(q[1])
    plain_t = ops.transpose_quantized(q[0], q[1])
    for scales in (q[1], tiled):
        assert torch.equal(ops.transpose_quantized(q[0], scales)[1], plain_t[1])
        got = ops.transpose_quantized(q[0], scales, layout="swizzled")
        assert torch.equal(got[0], plain_t[0]) and torch.equal(got[1], formats.swizzle_scales(plain_t[1]))
        assert torch.equal(ops.decode_blocks(q[0], scales), ops.decode_blocks(q[0], q[1]))


def test_bad_layouts_are_refused():
    x = _sample(32, 64, 2)
    with pytest.raises(ValueError, match="fp4.quantize of a \\(32, 64\\) tensor: layout must be one of"):
        ops.quantize(x, "nvfp4", "1x16", "rne", 0, "", layout="tiled")
    with pytest.raises(ValueError, match="swizzled scale layout is for 2-D NVFP4 operands"):
        ops.quantize(x, "mxfp4", "1x32", "rne", 0, "", layout="swizzled")
    with pytest.raises(ValueError, match="swizzled scale layout is for 2-D NVFP4"):
        ops.quantize(x.reshape(2, 16, 64), "nvfp4", "1x16", "rne", 0, "", layout="swizzled")
    q = ops.quantize(x, "nvfp4", "1x16", "rne", 0, "")
    with pytest.raises(ValueError, match="must be in the 128x4 tiled layout .* got a \\(32, 4\\) tensor"):
        cutlass_runtime.prepare_operands(q[0], q[1], q[0], q[1])


# ----------------------------------------------------------------------------------------------
# Compiled training step on a simulated B200: the lowering asks the quantizers for the tiled layout
# ----------------------------------------------------------------------------------------------


def _simulated_blackwell(monkeypatch):
    """2-D FP4 GEMMs get CUTLASS kernels (on the CPU), run by the simulated kernel of test_cutlass_runtime."""
    from test_cutlass_runtime import simulated_kernel

    def choose(m, n, k, fmt, out_dtype, device, allow_emulation=True, batched=False, scale_rule="6"):
        config, why = cutlass_gemm.select_config(m, n, k, out_dtype)
        if fmt != "nvfp4" or config is None or batched or scale_rule != "6":  # CUTLASS: the 6 rule
            return types.SimpleNamespace(name="emulation", reason=why)
        return types.SimpleNamespace(name=cutlass_runtime.kernel_name(config, allow_emulation), reason=why)

    monkeypatch.setattr(executors, "choose_gemm", choose)
    monkeypatch.setattr(cutlass_gemm, "load", lambda config, arch=None, progress=True, device=None: simulated_kernel(config))
    cutlass_runtime.reset()


def _step(model, x, backend):
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    out = compiled(x)
    out.float().square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return out.detach(), grads


def _nodes(graph, target, **arguments):
    """The graph's ``target`` nodes whose named arguments (given by position or by name) are ``arguments``."""
    def bound(n):
        return {**dict(zip((a.name for a in target._schema.arguments), n.args)), **n.kwargs}

    return [n for n in graph.nodes if n.target is target and all(bound(n).get(k) == v for k, v in arguments.items())]


@pytest.mark.parametrize(*first_fast("share_weight", [True, False]))
def test_simulated_b200_step_reads_swizzled_scales_and_equals_emulation(monkeypatch, fresh_dynamo, share_weight):
    from models import MLPStack

    torch.manual_seed(0)
    model = MLPStack(3, d=32)
    x = torch.randn(2, 32, 32)
    recipe = dict(high_precision_first_blocks=0, high_precision_last_blocks=0, seed=5, share_weight=share_weight)
    fp4compile.manual_seed(1)
    emulated = _step(model, x, fp4compile.Backend(**recipe))
    _simulated_blackwell(monkeypatch)
    fp4compile.manual_seed(1)
    backend = fp4compile.Backend(**recipe)
    out, grads = _step(model, x, backend)
    assert torch.equal(out, emulated[0])
    assert all(torch.equal(grads[n], emulated[1][n]) for n in grads)

    fp4 = torch.ops.fp4
    (ctx,) = backend.report.latest
    forward, backward = ctx.final_graphs["forward"], ctx.final_graphs["backward"]
    mms = [n for g in (forward, backward) for n in _nodes(g, fp4.scaled_mm.default)]
    # 6 linears: 6 fprop, 6 wgrad, 5 dgrad (the input needs no gradient).
    assert len(mms) == 17 and all(n.args[8].startswith("cutlass:") for n in mms)
    # Forward: every quantizer writes the tiled layout, the weight kept for the backward's transpose too
    # (its layout decided on the joint graph), so no operand is swizzled separately.
    assert len(_nodes(forward, fp4.quantize.default, layout="swizzled")) == 12
    assert not _nodes(forward, fp4.swizzle_scales.default)
    # Backward: dY for dgrad, W^T (the transpose of the kept weight, or quantized again), both wgrad operands.
    tiled = _nodes(backward, fp4.quantize.default, layout="swizzled") + _nodes(backward, fp4.rht_quantize.default, layout="swizzled")
    assert len(tiled) + len(_nodes(backward, fp4.transpose_quantized.default, layout="swizzled")) == 5 * 2 + 6 * 2
    # Shared: each dgrad reads the kept weight transposed (planned on the joint graph Inductor partitions).
    assert len(_nodes(backward, fp4.transpose_quantized.default)) == (5 if share_weight else 0)
    assert not _nodes(backward, fp4.swizzle_scales.default)
    # Every CUTLASS GEMM reads 1-D (tiled) scales.
    assert all(mm.args[i].meta["val"].dim() == 1 for mm in mms for i in (1, 4))


def test_sharded_quantizers_of_cutlass_operands_write_the_tiled_layout():
    """A weight quantized with its amax reduced over a process group (``fp4.quantize_sharded``) and read by a
    CUTLASS GEMM alone is asked for the tiled layout like ``fp4.quantize``: no separate swizzle node."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from fp4compile.passes.lower_gemms import lower_gemms
    from fp4compile.sites import CompileContext

    import fp4compile.distributed  # noqa: F401  (registers fp4.quantize_sharded)

    kernel = cutlass_runtime.kernel_name(cutlass_gemm.select_config(64, 64, 64, torch.bfloat16)[0], True)

    def f(x, w):
        xa, xs, xm = torch.ops.fp4.quantize(x, "nvfp4", "1x16", "rne", 1, "")
        wa, ws, wm = torch.ops.fp4.quantize_sharded(w, "nvfp4", "16x16", "rne", 2, "", "world")
        return torch.ops.fp4.scaled_mm(xa, xs, xm, wa, ws, wm, "nvfp4", torch.bfloat16, kernel)

    with FakeTensorMode():
        gm = make_fx(f)(torch.empty(64, 64, dtype=torch.bfloat16), torch.empty(64, 64))
    gm = lower_gemms(gm, CompileContext(fp4compile.Recipe(), 0))
    sharded = _nodes(gm.graph, torch.ops.fp4.quantize_sharded.default, layout="swizzled")
    assert len(sharded) == 1 and len(_nodes(gm.graph, torch.ops.fp4.quantize.default, layout="swizzled")) == 1
    assert not _nodes(gm.graph, torch.ops.fp4.swizzle_scales.default)
    (mm,) = _nodes(gm.graph, torch.ops.fp4.scaled_mm.default)
    assert mm.args[1].meta["val"].dim() == 1 and mm.args[4].meta["val"].dim() == 1
    assert mm.args[4].meta["val"].numel() == scale_layout.swizzled_numel(64, 4)
