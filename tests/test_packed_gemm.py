"""The FP4-operand GEMM (``fp4.packed_mm``, ``triton_kernels.packed_scaled_mm``): one Triton kernel that
reads packed NVFP4 codes and scales, decodes them in registers and applies alpha in its epilogue.

Without a CUDA device the kernel runs in Triton's interpreter on CPU tensors; the lowering that puts it
into the graphs (``FP4COMPILE_EMULATED_GEMM=packed``) is tested on the CPU with the executor table's
CUDA-only check opened, the node then running the reference; ``gpu`` tests run it compiled.
"""

from __future__ import annotations

import os

import pytest
import torch

import fp4compile
from fp4compile import config, executors, formats, reference, traffic
from fp4compile.traffic import Cost

from models import MLPStack, grads

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def tk(monkeypatch):
    pytest.importorskip("triton")
    from fp4compile.codegen import triton_kernels

    if not triton_kernels.available()[0]:
        pytest.skip(triton_kernels.available()[1])
    if not CUDA:  # small tiles: the interpreter runs every program
        monkeypatch.setitem(triton_kernels.CONFIGS, "packed_mm",
                            dict(triton_kernels.CONFIGS["packed_mm"], BLOCK_M=32, BLOCK_N=32, BLOCK_K=64))
    return triton_kernels


def _operands(m, n, k, seed, rule="6", b_kn=False, exact=False):
    """Quantized A [m, k] (1x16) and B [n, k] (16x16, given as W [k, n] with ``b_kn``), as (codes, scales,
    amax) each. ``exact``: the codes of random values with block scales drawn from 1/2, 1, 2 and 4 (a
    16x16 tile's scale the same on its 16 rows), so that the products are multiples of 1/16 up to 576 and
    every summation order gives the same fp32 sums, while a scale read from the wrong block shows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 1, k)
    w = torch.randn((k, n) if b_kn else (n, k), generator=g) * 0.3
    qa = formats.quantize(x, "nvfp4", "1x16", "rne", 0, scale_rule=rule)
    qb = formats.quantize(w, "nvfp4", "16x16", "rne", 0, scale_rule=rule)
    a, b = (qa.data, qa.scales.view(torch.uint8), qa.amax), (qb.data, qb.scales.view(torch.uint8), qb.amax)
    if exact:
        powers = torch.tensor([0x30, 0x38, 0x40, 0x48], dtype=torch.uint8)  # E4M3 1/2, 1, 2, 4
        a = (a[0], powers[torch.randint(0, 4, a[1].shape, generator=g)], a[2])
        tiles = powers[torch.randint(0, 4, (b[1].shape[0] // 16, b[1].shape[1]), generator=g)]
        b = (b[0], tiles.repeat_interleave(16, dim=0), b[2])
    return a, b


def _run(tk, a, b, **kw):
    on = lambda t: t.to(DEVICE)  # noqa: E731
    return tk.packed_scaled_mm(*map(on, a), *map(on, b), **kw).cpu()


@pytest.mark.parametrize("m, n, k", [(48, 80, 96), (32, 32, 64), (16, 48, 208)])
@pytest.mark.parametrize("b_kn", [False, True])
def test_exact_sums_give_the_reference_bits(tk, m, n, k, b_kn):
    """Where the sums are exact, the kernel's summation order cannot show: the reference's bits, through
    partial tiles (M, N, K not multiples of the tile) and dgrad's W read as stored."""
    a, b = _operands(m, n, k, seed=m + n + k, b_kn=b_kn, exact=True)
    for out_dtype in (torch.float32, torch.bfloat16):
        want = reference.packed_product(*a, *b, "nvfp4", out_dtype, b_kn=b_kn)
        got = _run(tk, a, b, out_dtype=out_dtype, b_kn=b_kn)
        assert got.dtype == out_dtype and got.shape == (m, n)
        assert torch.equal(got, want)


@pytest.mark.parametrize("rule", ["6", "4/6"])
@pytest.mark.parametrize("b_kn", [False, True])
def test_random_operands_within_fp32_summation_rounding(tk, rule, b_kn):
    """Operands over many binades: the reference's result up to fp32 accumulation rounding (the kernel sums
    K in its tiles' order); alpha follows the block scale rule."""
    m, n, k = 64, 48, 320
    a, b = _operands(m, n, k, seed=7, rule=rule, b_kn=b_kn)
    want = reference.packed_product(*a, *b, "nvfp4", torch.float32, rule, b_kn)
    got = _run(tk, a, b, out_dtype=torch.float32, scale_rule=rule, b_kn=b_kn)
    # Both sum K products in fp32 in some order: each within K * eps * sum |a_k b_k| of the exact sum.
    limit = 2 * k * torch.finfo(torch.float32).eps * _abs_product(a, b, rule, b_kn)
    assert (got - want).abs().le(limit).all()
    assert want.abs().max() > 0


def _abs_product(a, b, rule, b_kn):
    """sum_k |A[m, k] B[n, k]| times alpha: the scale of the summation's rounding."""
    if b_kn:
        b = (*reference.transpose_quantized(b[0], b[1]), b[2])
    da = reference.block_decode(a[0], a[1], a[2], "nvfp4").float().abs()
    db = reference.block_decode(b[0], b[1], b[2], "nvfp4").float().abs()
    return (da @ db.t()) * formats.gemm_alpha(a[2], b[2], rule)


@pytest.mark.parametrize("m, n, k", [(128, 64, 64), (48, 80, 112)])  # the second pads the tiled layout
@pytest.mark.parametrize("b_kn", [False, True])
def test_swizzled_scales_read_as_row_major(tk, m, n, k, b_kn):
    a, b = _operands(m, n, k, seed=3, b_kn=b_kn, exact=True)
    want = _run(tk, a, b, out_dtype=torch.float32, b_kn=b_kn)
    tiled = lambda q: (q[0], formats.swizzle_scales(q[1]), q[2])  # noqa: E731
    for a_, b_ in ((tiled(a), b), (a, tiled(b)), (tiled(a), tiled(b))):
        assert torch.equal(_run(tk, a_, b_, out_dtype=torch.float32, b_kn=b_kn), want)


def test_shapes_it_refuses(tk):
    a, b = _operands(32, 32, 64, seed=1)
    with pytest.raises(ValueError, match="K=64"):
        tk.packed_scaled_mm(*a, b[0][:, :16], b[1], b[2])
    with pytest.raises(ValueError, match=r"B's scales hold 64 bytes; \[32, 4\]"):
        tk.packed_scaled_mm(*a, b[0], b[1][:16], b[2])
    with pytest.raises(ValueError, match="2-D"):
        tk.packed_scaled_mm(a[0][None], a[1], a[2], *b)


# -- the lowering ----------------------------------------------------------------------------------


def _step(**options):
    torch._dynamo.reset()
    fp4compile.manual_seed(0)
    torch.manual_seed(0)
    model = MLPStack(3, 32)
    x = torch.randn(2, 32, 32)
    backend = fp4compile.Backend(**options)
    out = torch.compile(model, backend=backend)(x)
    out.square().mean().backward()
    return backend.report, out.detach(), grads(model)


def test_packed_gemms_replace_the_decoded_form_and_keep_the_bits(packed_on_cpu):
    report, out, g = _step()
    nodes = [n for ctx in report.latest for stage in ("forward", "backward")
             for n in report.fx_graph(stage, ctx.graph_id).nodes if n.op == "call_function"]
    packed = [n for n in nodes if n.target is torch.ops.fp4.packed_mm.default]
    fp4_sites = [s for s in report.sites if s.precision == "nvfp4"]
    assert len(fp4_sites) == 2 and len(packed) == 3 * len(fp4_sites)  # fprop, dgrad, wgrad of each
    assert not [n for n in nodes if n.target in (torch.ops.fp4.scaled_mm.default, torch.ops.fp4.decode_blocks.default,
                                                 torch.ops.fp4.transpose_quantized.default)]
    # dgrad reads W as stored (no packed transpose); fprop and wgrad read their B operand's rows.
    assert sorted(n.kwargs.get("b_kn", False) for n in packed) == [False] * 4 + [True] * 2
    for site in fp4_sites:
        assert {r.kernel for r in site.roles.values()} == {"triton"}
    # The same arithmetic as the packed emulation: outputs and gradients to the bit.
    executors_default = executors.unregister("scaled_mm", "triton")
    try:
        _, out_ref, g_ref = _step()
    finally:
        executors.register("scaled_mm", "triton", executors_default.check, executors_default.call, after="cutlass")
    assert torch.equal(out, out_ref)
    assert g.keys() == g_ref.keys() and all(torch.equal(g[k], g_ref[k]) for k in g)
    # Each role: one GEMM launch and no decode, transpose or epilogue kernel.
    items = [t for ctx in report.latest for t in traffic.node_traffic(ctx) if t.op == "fp4.packed_mm"]
    assert len(items) == 6 and all(t.cost == Cost(0, 1, 0, 0) and t.implementation == "triton" for t in items)


def test_the_table_says_why_packed_gemms_are_not_chosen():
    spec = dict(m=64, n=128, k=32, fmt="nvfp4", out_dtype=torch.float32)
    with config.patch(emulated_gemm="packed"):
        choice = executors.choose_gemm(**spec, device="cpu")
    assert choice.name == "emulation" and "triton declined: device cpu is not a CUDA GPU" in choice.reason
    if CUDA:
        choice = executors.choose_gemm(**spec, device="cuda")  # the default: decoded operands
        assert choice.name == "emulation" and "FP4COMPILE_EMULATED_GEMM=auto" in choice.reason
        with config.patch(emulated_gemm="packed"):
            assert executors.choose_gemm(**spec, device="cuda").name == "triton"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_packed_gemms_in_inductor_code_train_like_the_decoded_form():
    torch.manual_seed(0)
    results = {}
    for mode in ("auto", "packed"):
        torch._dynamo.reset()
        with config.patch(emulated_gemm=mode):
            fp4compile.manual_seed(0)
            torch.manual_seed(0)
            model = MLPStack(3, 256).cuda()
            x = torch.randn(4, 512, 256, device="cuda")
            backend = fp4compile.Backend(inner="inductor")
            compiled = torch.compile(model, backend=backend)
            losses = []
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            for _ in range(3):
                loss = compiled(x).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            results[mode] = (losses, backend.report)
    kernels = results["packed"][1].quantizer_kernels()
    assert any(op == "fp4.packed_mm" and impl == "in-graph triton" for op, impl, _ in kernels), kernels
    assert not any(op in ("fp4.decode_blocks", "fp4.emulated_mm") for op, _, _ in kernels)
    # Only the GEMMs' summation order differs: the losses agree to fp32 rounding over three steps.
    torch.testing.assert_close(results["packed"][0], results["auto"][0], rtol=1e-4, atol=0)
