"""Four Over Six ("4/6") adaptive block scaling: the reference in ``fp4compile.formats`` against a scalar
implementation written from the rule, against the ``fouroversix`` package's reference (skipped where the
package is absent), the Triton kernels in Triton's interpreter against the reference, and a compiled
model against the eager reference recipe, bit for bit.
"""

from __future__ import annotations

import copy
import math
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4compile import Backend, Recipe, executors, formats
from models import TinyGPT, grads, lm_loss
from recipe_reference import reference_recipe
from reference_impl import FLT_MAX, e2m1_code, e2m1_value, e4m3_bits, e4m3_value, f32, f32_div, f32_mul
from tiers import first_fast

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's 1/0 in the interpreter

_SIXTH = f32(1.0 / 6.0)
_INV_1536 = f32(1.0 / 1536.0)


# ----------------------------------------------------------------------------------------------
# A scalar implementation of the rule, one float32 rounding per operation
# ----------------------------------------------------------------------------------------------


def _pair_sum(values: list) -> float:
    while len(values) > 1:
        values = [f32(values[i] + values[i + 1]) for i in range(0, len(values), 2)]
    return values[0]


def _candidate(cells, x, sf_bits, s_dec, amax):
    """(codes, squared error) of the block ``cells`` quantized with the E4M3 scale ``sf_bits`` (RNE)."""
    sf = e4m3_value(sf_bits)
    enc = min(f32_div(1.0, f32_mul(sf, s_dec)), FLT_MAX)
    dscale = f32_mul(f32_mul(sf, amax), _INV_1536)
    codes = [e2m1_code(f32_mul(float(x[i]), enc)) for i in cells]
    d = [f32(f32_mul(e2m1_value(c), dscale) - float(x[i])) for c, i in zip(codes, cells)]
    sq = [f32_mul(v, v) for v in d]
    rows = len(cells) // 16
    return codes, _pair_sum([_pair_sum(sq[16 * r: 16 * r + 16]) for r in range(rows)])


def scalar_four_over_six(x: np.ndarray, block: str):
    """(codes, scale bytes) of 2-D float32 ``x`` with the 4/6 rule (RNE), from docs/numerics.md."""
    amax = max(abs(float(v)) for v in x.ravel())
    s_enc = f32_div(1536.0, amax) if amax else 1.0
    s_dec = f32_div(1.0, s_enc)
    rows, cols = x.shape
    codes = np.zeros(x.shape, dtype=np.uint8)
    scales = np.zeros((rows, cols // 16), dtype=np.uint8)
    th = 16 if block == "16x16" else 1
    for r0 in range(0, rows, th):
        for c0 in range(0, cols, 16):
            cells = [(r, c) for r in range(r0, r0 + th) for c in range(c0, c0 + 16)]
            bamax = max(abs(float(x[i])) for i in cells)
            sf32 = min(f32_mul(bamax, f32_mul(s_enc, _SIXTH)), 448.0)
            sf6, sf4 = e4m3_bits(sf32), e4m3_bits(min(f32_mul(sf32, 1.5), 448.0))
            c6, e6 = _candidate(cells, x, sf6, s_dec, amax)
            c4, e4 = _candidate(cells, x, sf4, s_dec, amax)
            chosen, sf = (c4, sf4) if e4 < e6 else (c6, sf6)
            for i, c in zip(cells, chosen):
                codes[i] = c
            scales[r0:r0 + th, c0 // 16] = sf
    return codes, scales


def _values(draw_rows, cols, seed, spread):
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp(torch.randn(draw_rows, cols, generator=g) * spread)
    return torch.where(torch.rand(draw_rows, cols, generator=g) < 0.5, -mag, mag)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), spread=st.sampled_from([0.3, 1.0, 3.0]), block=st.sampled_from(["1x16", "16x16"]))
def test_reference_matches_a_scalar_implementation_of_the_rule(seed, spread, block):
    x = _values(16, 32, seed, spread)
    q = formats.quantize(x, "nvfp4", block, scale_rule="4/6")
    codes, scales = scalar_four_over_six(x.numpy(), block)
    assert np.array_equal(q.codes().numpy(), codes)
    assert np.array_equal(q.scales.view(torch.uint8).numpy(), scales)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), spread=st.sampled_from([0.3, 1.0, 3.0]), block=st.sampled_from(["1x16", "16x16"]))
def test_each_block_keeps_the_candidate_with_the_smaller_error(seed, spread, block):
    """Per block, the kept scale's error is the smaller of the two candidates' (ties keep 6), and the
    dequantized tensor follows the 256 rule: value * ((sf * amax) * fp32(1/1536))."""
    x = _values(32, 64, seed, spread)
    q = formats.quantize(x, "nvfp4", block, scale_rule="4/6")
    g = q.amax
    s_enc = formats.global_encode_scale(g, "4/6")
    assert torch.equal(s_enc, torch.tensor(1536.0).div(g))
    sf32 = torch.clamp(formats._block_amax(x, block) * (s_enc * torch.tensor(1 / 6, dtype=torch.float32)), max=448)
    sf6, sf4 = sf32.to(torch.float8_e4m3fn), torch.clamp(sf32 * 1.5, max=448).to(torch.float8_e4m3fn)
    rows = 16 if block == "16x16" else 1
    e6, e4 = formats.four_over_six_errors(x, sf6, sf4, g, 16, rows)
    want = torch.where(e4 < e6, sf4.float(), sf6.float())
    assert torch.equal(q.scales.float(), want)
    deq = formats.dequantize(q)
    vals = formats.decode_e2m1(q.codes())
    scale = (q.scales.float() * g) * torch.tensor(1 / 1536, dtype=torch.float32)
    assert torch.equal(deq, vals * scale.repeat_interleave(16, -1))


def test_four_over_six_lowers_the_error_of_1x16_blocks():
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    err = {rule: float((formats.dequantize(formats.quantize(x, scale_rule=rule)) - x).norm() / x.norm())
           for rule in ("6", "4/6")}
    assert err["4/6"] < err["6"] * 0.95, err


def test_sr_rounds_with_the_scale_chosen_by_nearest_rounding():
    x = _values(16, 64, 3, 1.0)
    rne = formats.quantize(x, scale_rule="4/6")
    sr = formats.quantize(x, rounding="sr", seed=11, scale_rule="4/6")
    assert torch.equal(sr.scales.view(torch.uint8), rne.scales.view(torch.uint8))
    # SR with the kept scale: E[x^] = x, so the mean of many draws approaches x.
    mean = torch.stack([formats.dequantize(formats.quantize(x, rounding="sr", seed=s, scale_rule="4/6"))
                        for s in range(200)]).mean(0)
    assert float((mean - x).abs().max()) < 0.12 * float(x.abs().max())


def test_gemm_alpha_dequantize_and_global_scales_follow_the_rule():
    a, b = torch.tensor(3.5), torch.tensor(0.71)
    inv = torch.tensor(1 / 1536, dtype=torch.float32)
    assert torch.equal(formats.gemm_alpha(a, b, "4/6"), (a * inv) * (b * inv))
    assert formats.global_constant("4/6") == 1536.0 and formats.global_constant("6") == 2688.0
    assert torch.equal(formats.global_encode_scale(a, "4/6"), torch.tensor(1536.0) / a)


def test_mxfp4_and_unknown_rules_are_refused():
    with pytest.raises(ValueError, match="NVFP4 block scale rule"):
        formats.quantize(torch.randn(4, 32), "mxfp4", "1x32", scale_rule="4/6")
    with pytest.raises(ValueError, match="scale_rule must be one of"):
        formats.quantize(torch.randn(4, 32), scale_rule="4")
    with pytest.raises(ValueError, match="NVFP4 rule"):
        Recipe(fmt="mxfp4", block_scale_rule="4/6")
    with pytest.raises(ValueError, match="block_scale_rule must be one of"):
        Recipe(block_scale_rule="four-six")


def test_cutlass_declines_the_rule_with_its_reason():
    spec = executors.GemmSpec(128, 128, 128, "nvfp4", torch.bfloat16, torch.device("cuda"), scale_rule="4/6")
    ok, why = executors._check_cutlass(spec)
    assert not ok and "6 x 448" in why


# ----------------------------------------------------------------------------------------------
# The fouroversix package's reference implementation (CPU)
# ----------------------------------------------------------------------------------------------


def test_matches_the_fouroversix_reference():
    """Codes and scales equal those of ``fouroversix``'s PyTorch reference (MSE rule, RNE), 1x16 and 16x16."""
    ref = pytest.importorskip("fouroversix.quantize.pytorch.reference")
    from fouroversix.utils import ScaleRule

    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(128, 256, generator=g) * torch.rand(128, 1, generator=g) * 3
        for two_d in (False, True):
            codes, scales, amax = ref.quantize_to_fp4(x, block_scale_2d=two_d, scale_rule=ScaleRule.mse,
                                                      use_blackwell_scale_layout=False)
            q = formats.quantize(x, "nvfp4", "16x16" if two_d else "1x16", scale_rule="4/6")
            assert torch.equal(q.amax, amax.reshape(()))
            assert torch.equal(q.scales.view(torch.uint8), scales.view(torch.uint8).reshape(q.scales.shape))
            assert torch.equal(q.data.view(torch.uint8), codes.view(torch.uint8))


# ----------------------------------------------------------------------------------------------
# Triton kernels in the interpreter
# ----------------------------------------------------------------------------------------------

_KERNEL_CASES = [(b, r, d, s) for b in ("1x16", "16x16") for r in ("rne", "sr") for d in ("float32", "bfloat16")
                 for s in (False, True)]


def _kernels():
    """(``codegen.triton_kernels``, the device its kernels read): CUDA, or Triton's interpreter on the CPU."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    from fp4compile.codegen import triton_kernels as tk

    if not tk.available()[0]:
        pytest.skip(tk.available()[1])
    return tk, "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(*first_fast("block,rounding,dtype,swizzle", _KERNEL_CASES))
def test_triton_quantizers_match_the_reference(block, rounding, dtype, swizzle):
    tk, device = _kernels()
    x = (_values(48, 96, 5, 1.5) * 3).to(getattr(torch, dtype))
    q = formats.quantize(x, "nvfp4", block, rounding, seed=7, scale_rule="4/6")
    quantize, decode = ((tk.quantize_1x16, tk.fake_quantize_1x16) if block == "1x16"
                        else (tk.quantize_16x16, tk.fake_quantize_16x16))
    data, scales, amax = quantize(x.to(device), rounding, 7, swizzle=swizzle, scale_rule="4/6")
    want_scales = q.scales.view(torch.uint8)
    if swizzle:
        want_scales = formats.swizzle_scales(want_scales)
    assert torch.equal(data.cpu(), q.data.view(torch.uint8))
    assert torch.equal(scales.cpu().view(torch.uint8), want_scales)
    assert torch.equal(amax.cpu(), q.amax)
    decoded, _ = decode(x.to(device), rounding, 7, scale_rule="4/6")
    assert torch.equal(decoded.cpu(), formats.block_decode(q).to(torch.bfloat16))
    # A given amax (another rank's, larger) as the reference takes it.
    given = torch.tensor(float(q.amax) * 1.5)
    q2 = formats.quantize(x, "nvfp4", block, rounding, seed=7, amax=given, scale_rule="4/6")
    data2, scales2, _ = quantize(x.to(device), rounding, 7, amax=given.to(device), scale_rule="4/6")
    assert torch.equal(data2.cpu(), q2.data.view(torch.uint8))
    assert torch.equal(scales2.cpu().view(torch.uint8), q2.scales.view(torch.uint8))


def test_triton_epilogue_applies_the_rules_alpha():
    from fp4compile import reference

    tk, device = _kernels()
    a, b = _values(32, 64, 1, 1.0), _values(16, 64, 2, 1.0)
    qa, qb = formats.quantize(a, scale_rule="4/6"), formats.quantize(b, scale_rule="4/6")
    a_bd, b_bd = formats.block_decode(qa).to(torch.bfloat16), formats.block_decode(qb).to(torch.bfloat16)
    want = reference.decoded_product(a_bd, qa.amax, b_bd, qb.amax, "nvfp4", torch.float32, "4/6")
    got = tk.emulated_scaled_mm(a_bd.to(device), qa.amax.to(device), b_bd.to(device), qb.amax.to(device),
                                torch.float32, scale_rule="4/6")
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)
    alpha = tk.gemm_alpha(qa.amax.to(device), qb.amax.to(device), scale_rule="4/6")
    assert torch.equal(alpha.cpu()[0], formats.gemm_alpha(qa.amax, qb.amax, "4/6"))


# ----------------------------------------------------------------------------------------------
# A compiled model
# ----------------------------------------------------------------------------------------------


def test_compiled_model_matches_the_eager_reference_recipe(fresh_dynamo):
    """Forward and all gradients of a compiled GPT with Recipe(block_scale_rule="4/6") equal the eager
    quantize -> dequantize -> matmul recipe with the 4/6 rule (SR off), bit for bit."""
    torch.manual_seed(0)
    model = TinyGPT(n_layer=4, d=32)
    ref_model = copy.deepcopy(model)
    idx = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    backend = Backend(inner="eager", stochastic_rounding=False, block_scale_rule="4/6")
    logits = torch.compile(model, backend=backend)(idx)
    lm_loss(logits, idx).backward()
    fp4_sites = [s.name for s in backend.report.sites if s.precision == "nvfp4"]
    assert fp4_sites
    with reference_recipe(ref_model, fp4_sites, scale_rule="4/6"):
        ref_logits = ref_model(idx)
        lm_loss(ref_logits, idx).backward()
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
    got, want = grads(model), grads(ref_model)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


def test_export_global_scales_follow_the_rule():
    """The checkpoint's global scales are 1536 / amax, so that compressed-tensors' decode, value *
    weight_scale / global_scale, gives the training dequantization."""
    import importlib

    fp4export = importlib.import_module("fp4compile.export")
    w = _values(32, 64, 4, 1.0)
    q = fp4export.quantized_weight(w, scale_rule="4/6")
    tensors = fp4export.site_tensors(q, torch.tensor(2.5))
    assert torch.equal(tensors["weight_global_scale"], torch.tensor([1536.0]) / q.amax)
    assert torch.equal(tensors["input_global_scale"], torch.tensor([1536.0 / 2.5]))
    served = formats.decode_e2m1(q.codes()) * (q.scales.float() / tensors["weight_global_scale"]).repeat_interleave(16, -1)
    torch.testing.assert_close(served, formats.dequantize(q), rtol=2**-22, atol=0)


# ----------------------------------------------------------------------------------------------
# Quantization statistics (the reference of issue #50's statistics)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", ["6", "4/6"])
def test_quantization_stats_count_what_was_lost(rule):
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    x[0, :16] = 1e-9  # a block far below the tensor's range: its scale underflows, its values become 0
    x[1, 0] = 0.0
    q = formats.quantize(x, scale_rule=rule)
    stats = formats.quantization_stats(x, q)
    nonzero = int((x != 0).sum())
    codes = q.codes()
    assert stats["zero_fraction"] == int(((codes & 7) == 0)[x != 0].sum()) / nonzero
    assert stats["zero_fraction"] >= 16 / nonzero
    assert stats["scale_underflow"] == 1 / (32 * 4)
    assert stats["scale_saturated"] == 0.0
    want = float((formats.dequantize(q).double() - x.double()).norm() / x.double().norm())
    assert stats["relative_error"] == want and stats["amax"] == float(x.abs().max())
    # A given amax below the tensor's own makes the largest blocks' scales saturate at 448.
    small = formats.quantize(x, amax=torch.tensor(float(x.abs().max()) / 4), scale_rule=rule)
    assert formats.quantization_stats(x, small)["scale_saturated"] > 0
