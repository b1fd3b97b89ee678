"""Bit-exact tests of fp4compile.formats against the numerics contract (docs/numerics.md).

The expected bits come from ``reference_impl``, an independent element-by-element implementation, and
from PyTorch's own FP4 / scale-layout test helpers.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fp4compile import formats

try:
    from . import reference_impl as ref
except ImportError:
    import reference_impl as ref


@pytest.fixture(scope="module")
def common_quantized():
    """PyTorch's FP4 / scale-layout test helpers (the module needs the ``expecttest`` package)."""
    return pytest.importorskip("torch.testing._internal.common_quantized")


PROPERTY = settings(
    max_examples=50,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FEW = settings(PROPERTY, max_examples=15)

TIES = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0}
FLT_MAX = ref.FLT_MAX


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def assert_same_f32(actual: torch.Tensor, expected: np.ndarray) -> None:
    """Bitwise equality of float32 arrays, except that any NaN matches any NaN."""
    a = actual.detach().float().numpy()
    e = np.asarray(expected, dtype=np.float32)
    assert a.shape == e.shape
    nan_a, nan_e = np.isnan(a), np.isnan(e)
    assert np.array_equal(nan_a, nan_e), "NaN positions differ"
    ok = nan_a | (a.view(np.int32) == e.view(np.int32))
    if not ok.all():
        i = tuple(np.argwhere(~ok)[0])
        raise AssertionError(f"{(~ok).sum()} values differ, first at {i}: got {a[i]!r}, expected {e[i]!r}")


def assert_same_amax(actual, expected: float) -> None:
    a = float(actual)
    assert (math.isnan(a) and math.isnan(expected)) or a == expected, (a, expected)


def check_nvfp4(x: torch.Tensor, block: str = "1x16", amax=None, rounding: str = "rne", seed: int = 0):
    """quantize/dequantize of formats against the reference, bit for bit. Returns the QTensor."""
    q = formats.quantize(
        x,
        "nvfp4",
        block,
        rounding,
        amax=None if amax is None else torch.tensor(amax, dtype=torch.float32),
        seed=seed if rounding == "sr" else None,
    )
    xf = x.float().numpy()
    codes, scales, g_amax = ref.nvfp4_quantize(xf, block, amax, rounding, seed)
    assert q.shape == x.shape and q.dtype == x.dtype and (q.fmt, q.block) == ("nvfp4", block)
    assert q.scales.dtype == torch.float8_e4m3fn
    np.testing.assert_array_equal(q.codes().numpy(), codes)
    np.testing.assert_array_equal(q.scales.view(torch.uint8).numpy(), scales)
    assert_same_amax(q.amax, g_amax)
    assert_same_f32(formats.dequantize(q), ref.nvfp4_dequantize(codes, scales, g_amax))
    return q


def check_mxfp4(x: torch.Tensor, rounding: str = "rne", seed: int = 0):
    q = formats.quantize(x, "mxfp4", "1x32", rounding, seed=seed if rounding == "sr" else None)
    codes, scales = ref.mxfp4_quantize(x.float().numpy(), rounding, seed)
    assert q.amax is None and q.scales.dtype == torch.float8_e8m0fnu
    np.testing.assert_array_equal(q.codes().numpy(), codes)
    np.testing.assert_array_equal(q.scales.view(torch.uint8).numpy(), scales)
    assert_same_f32(formats.dequantize(q), ref.mxfp4_dequantize(codes, scales))
    return q


def randn(*shape, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@st.composite
def scaled_tensors(draw, min_k_blocks: int = 1, k_unit: int = 16, tile_rows: int = 1):
    """Normal data times 10**e (e in [-30, 30]) times a per-element 2**[-spread, spread]."""
    rows = draw(st.integers(1, 3)) * tile_rows
    k = draw(st.integers(min_k_blocks, 4)) * k_unit
    decade = draw(st.integers(-30, 30))
    spread = draw(st.integers(0, 24))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g, dtype=torch.float64) * 10.0**decade
    x = x * torch.exp2(torch.randint(-spread, spread + 1, (rows, k), generator=g).double())
    return x.float()


def any_f32_tensors(k_unit: int = 16, tile_rows: int = 1):
    """Arbitrary finite float32 values: subnormals, signed zeros, FLT_MAX."""
    max_rows, max_k = (2, 3) if tile_rows == 1 else (1, 2)
    shapes = st.tuples(
        st.integers(1, max_rows).map(lambda r: r * tile_rows), st.integers(1, max_k).map(lambda k: k * k_unit)
    )
    elements = st.floats(width=32, allow_nan=False, allow_infinity=False)
    return hnp.arrays(np.float32, shapes, elements=elements).map(torch.from_numpy)


# ----------------------------------------------------------------------------------------------
# The independent reference agrees with PyTorch's own conversions
# ----------------------------------------------------------------------------------------------


def _e2m1_sweep() -> torch.Tensor:
    grid = np.array(ref.E2M1_GRID, dtype=np.float32)
    mids = np.array(list(TIES), dtype=np.float32)
    near = np.concatenate([np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(7))])
    rnd = np.random.default_rng(0).uniform(-7, 7, 3000).astype(np.float32)
    tiny = np.array([1e-45, 1e-40, 1e-38, 1e-20, 0.2499999], dtype=np.float32)
    vals = np.concatenate([grid, mids, near, rnd, tiny, [6.5, 7.0, 100.0, 3e38]]).astype(np.float32)
    vals = np.concatenate([vals, -vals])
    return torch.from_numpy(vals)


def test_e2m1_rne_matches_reference_and_torch_helper(common_quantized):
    v = _e2m1_sweep()
    ours = formats.encode_e2m1(v)
    expected = torch.tensor([ref.e2m1_code(float(a)) for a in v], dtype=torch.uint8)
    torch_codes = common_quantized._f32_to_floatx_unpacked(v.clone(), ebits=2, mbits=1)
    assert torch.equal(ours, expected)
    assert torch.equal(ours, torch_codes)


def test_e2m1_ties_go_to_even_code():
    for tie, expected in TIES.items():
        for sign in (1.0, -1.0):
            code = int(formats.encode_e2m1(torch.tensor([sign * tie]))[0])
            assert code % 2 == 0 and formats.decode_e2m1(torch.tensor([code]))[0].item() == sign * expected


def test_e2m1_decode_table_matches_torch_helper(common_quantized):
    codes = torch.arange(16, dtype=torch.uint8)
    expected = common_quantized._floatx_unpacked_to_f32(codes, ebits=2, mbits=1)
    assert torch.equal(formats.decode_e2m1(codes), expected)
    assert [ref.e2m1_value(c) for c in range(16)] == expected.tolist()
    assert formats.E2M1_VALUES == ref.E2M1_GRID


def test_pack_unpack_low_nibble_first():
    codes = torch.tensor([[1, 2, 3, 15, 8, 0]], dtype=torch.uint8)
    packed = formats.pack_e2m1(codes)
    assert packed.dtype == torch.float4_e2m1fn_x2
    assert packed.view(torch.uint8).tolist() == [[0x21, 0xF3, 0x08]]
    assert torch.equal(formats.unpack_e2m1(packed), codes)
    with pytest.raises(ValueError):
        formats.pack_e2m1(torch.zeros(3, dtype=torch.uint8))


def test_reference_e4m3_matches_torch_float8_cast():
    """The hand-written E4M3 conversion agrees with torch's float8_e4m3fn cast (in its non-saturating range)."""
    rng = np.random.default_rng(1)
    table = np.array([ref.e4m3_value(b) for b in range(0x7F)], dtype=np.float64)
    mids = (table[1:] + table[:-1]) / 2
    vals = np.concatenate(
        [
            table,
            mids,
            np.nextafter(mids.astype(np.float32), np.float32(0)),
            np.nextafter(mids.astype(np.float32), np.float32(1000)),
            rng.uniform(0, 448, 2000),
            np.exp2(rng.uniform(-14, 8.8, 2000)),
            [2.0**-10, 2.0**-10 * 1.0000001, 2.0**-11, 1e-30, 448.0, 455.0, 463.99],
        ]
    ).astype(np.float32)
    vals = vals[vals <= 463.99]
    vals = np.concatenate([vals, -vals])
    ours = np.array([ref.e4m3_bits(float(v)) for v in vals], dtype=np.uint8)
    torch_bits = torch.from_numpy(vals).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(ours, torch_bits)
    # Saturation (satfinite) above the torch cast's overflow point.
    for v in (464.0, 480.0, 1e10, math.inf):
        assert ref.e4m3_bits(v) == 0x7E and ref.e4m3_bits(-v) == 0xFE
    assert ref.e4m3_bits(math.nan) == 0x7F


def test_reference_scale_decoding_matches_torch():
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    for view, decode in ((torch.float8_e4m3fn, ref.e4m3_value), (torch.float8_e8m0fnu, ref.e8m0_value)):
        got = raw.view(view).float().tolist()
        want = [decode(b) for b in range(256)]
        assert all((math.isnan(a) and math.isnan(b)) or a == b for a, b in zip(got, want)), view


# ----------------------------------------------------------------------------------------------
# NVFP4 / MXFP4 quantization: bit-exact against the reference
# ----------------------------------------------------------------------------------------------


@PROPERTY
@given(scaled_tensors())
def test_nvfp4_1x16_random_magnitudes(x):
    check_nvfp4(x, "1x16")


@PROPERTY
@given(scaled_tensors(tile_rows=16, k_unit=16))
def test_nvfp4_16x16_random_magnitudes(x):
    if x.shape[-1] > 32:
        x = x[:, :32].contiguous()
    check_nvfp4(x, "16x16")


@PROPERTY
@given(scaled_tensors(k_unit=32))
def test_mxfp4_random_magnitudes(x):
    check_mxfp4(x)


@PROPERTY
@given(any_f32_tensors())
def test_nvfp4_1x16_arbitrary_float32(x):
    check_nvfp4(x, "1x16")


@FEW
@given(any_f32_tensors(tile_rows=16))
def test_nvfp4_16x16_arbitrary_float32(x):
    check_nvfp4(x, "16x16")


@PROPERTY
@given(any_f32_tensors(k_unit=32))
def test_mxfp4_arbitrary_float32(x):
    check_mxfp4(x)


@pytest.mark.parametrize("decade", [-30, -20, -10, -3, 0, 3, 10, 20, 30])
def test_magnitudes_1e_minus30_to_1e30(decade):
    x = randn(4, 64, seed=decade + 100) * 10.0**decade
    check_nvfp4(x, "1x16")
    check_mxfp4(x)
    check_nvfp4(randn(32, 32, seed=decade) * 10.0**decade, "16x16")


def _tie_blocks(k: float, sign: float = 1.0) -> list[float]:
    """A 16-element block whose amax is 6*k, holding the E2M1 midpoints times k."""
    ties = list(TIES)
    return [sign * v * k for v in [6.0] + ties + [-t for t in ties] + [0.0]]


@pytest.mark.parametrize("block", ["1x16", "16x16"])
def test_nvfp4_exact_ties(block):
    # With amax = 2688 the global scale is exactly 1; a block with amax 6*2**j then gets sf = 2**j and
    # enc = 2**-j, so x*enc lands exactly on the E2M1 midpoints.
    rows = []
    for j in range(-9, 9):
        rows.append(_tie_blocks(2.0**j, sign=(-1.0) ** j) + [2688.0] + [0.0] * 15)
    x = torch.tensor(rows, dtype=torch.float32)  # [18, 32]
    x = torch.cat([x, x[:14]])  # 32 rows for 16x16 tiles
    if block == "16x16":
        # Keep each 16x16 tile's amax at 6*k by making its rows scaled copies of one tie block.
        x = torch.tensor([_tie_blocks(2.0**j) * 2 for j in range(-6, 4) for _ in range(16)][:32], dtype=torch.float32)
        x[0, 31] = 2688.0
    q = check_nvfp4(x, block)
    assert q.amax.item() == 2688.0
    vals = formats.decode_e2m1(q.codes())
    scaled = formats.block_decode(q)
    if block == "1x16":
        for r, j in enumerate(range(-9, 9)):
            k = 2.0**j
            assert q.scales[r, 0].float().item() == k
            for c, t in enumerate(TIES, start=1):
                assert abs(vals[r, c].item()) == TIES[t], (j, t)
                assert abs(scaled[r, c].item()) == TIES[t] * k


def test_nvfp4_ties_with_amax_override():
    for j in (-9, -4, 0, 5, 8):
        x = torch.tensor([_tie_blocks(2.0**j)], dtype=torch.float32)
        q = check_nvfp4(x, amax=2688.0)
        got = formats.decode_e2m1(q.codes())[0, 1:8].tolist()
        assert got == list(TIES.values())


def test_mxfp4_exact_ties():
    # bamax = 4 * 2**e gives scale 2**e, so x/scale is exactly the listed midpoints.
    rows = []
    for e in (-127, -100, -20, -1, 0, 3, 60, 125):
        k = 2.0**e
        row = [4.0 * k] + [t * k for t in TIES] + [-t * k for t in TIES] + [0.0] * 17
        rows.append(row)
    x = torch.tensor(rows, dtype=torch.float32)
    q = check_mxfp4(x)
    vals = formats.decode_e2m1(q.codes())
    assert vals[:, 1:8].abs().tolist() == [list(TIES.values())] * len(rows)


@PROPERTY
@given(st.integers(-9, 8), st.sampled_from(sorted(TIES)), st.sampled_from([1.0, -1.0]), st.integers(0, 15))
def test_nvfp4_tie_property(j, tie, sign, pos):
    k = 2.0**j
    block = [0.0] * 16
    block[(pos + 1) % 16] = 6.0 * k
    block[pos] = sign * tie * k
    x = torch.tensor([block + [2688.0] + [0.0] * 15], dtype=torch.float32)
    q = check_nvfp4(x)
    assert formats.decode_e2m1(q.codes())[0, pos].item() == sign * TIES[tie]


@pytest.mark.parametrize("shape", [(1, 16), (3, 64), (2, 3, 32)])
def test_all_zero_tensors(shape):
    x = torch.zeros(shape)
    q = check_nvfp4(x)
    assert q.amax.item() == 0.0 and not q.scales.float().any()
    assert not formats.dequantize(q).any()
    check_nvfp4(-x)
    if shape[-1] % 32 == 0:
        check_mxfp4(x)
        assert formats.dequantize(formats.quantize(x, "mxfp4", "1x32")).abs().sum() == 0


def test_zero_blocks_among_nonzero():
    x = randn(4, 64)
    x[1] = 0.0
    x[2, 16:32] = 0.0
    x[3, ::2] = 0.0
    check_nvfp4(x)
    check_mxfp4(x)
    w = randn(32, 32)
    w[:16, :16] = 0.0
    check_nvfp4(w, "16x16")


@pytest.mark.parametrize("value", [1.0, -3.0, 1e-30, 7.5e-20, 1e30, 448.0, 6.0, 2688.0])
def test_all_equal_blocks(value):
    x = torch.full((2, 64), value)
    q = check_nvfp4(x)
    check_mxfp4(x)
    check_nvfp4(torch.full((32, 16), value), "16x16")
    # Every element of a constant tensor is its block's and the tensor's amax.
    assert len(set(q.codes().flatten().tolist())) == 1


def test_tiny_blocks_next_to_huge_ones_scale_underflows():
    x = torch.tensor([[1e30] * 16 + [1e-10] * 8 + [-1e-10] * 8, [3e-20] * 16 + [2e25] * 16], dtype=torch.float32)
    q = check_nvfp4(x)
    sf = q.scales.view(torch.uint8)
    assert sf[0, 1].item() == 0 and sf[1, 0].item() == 0, "tiny blocks should get an E4M3 scale of 0"
    deq = formats.dequantize(q)
    assert (deq[0, 16:] == 0).all() and (deq[1, :16] == 0).all()
    check_mxfp4(x)
    w = torch.full((32, 32), 1e-12)
    w[:16, :16] = 1e28
    check_nvfp4(w, "16x16")


def test_subnormal_float32_inputs():
    sub = torch.tensor([1e-45, 3e-45, 1e-42, 2e-40, 1.1e-38, -5e-41, -1e-45, 0.0] * 8, dtype=torch.float32).reshape(2, 32)
    assert (sub.abs() < torch.finfo(torch.float32).tiny).all()
    check_nvfp4(sub)
    check_mxfp4(sub)
    mixed = sub.clone()
    mixed[0, 0] = 1.0
    check_nvfp4(mixed)
    check_mxfp4(mixed)
    check_nvfp4(sub.repeat(16, 1)[:, :16].contiguous(), "16x16")


def test_extreme_float32_inputs():
    big = torch.tensor([FLT_MAX, -FLT_MAX, 1e38, 2.0**-149] + [1.0] * 28, dtype=torch.float32).reshape(1, 32)
    check_nvfp4(big)
    check_mxfp4(big)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("decade", [-4, 0, 3])
def test_input_dtypes(dtype, decade):
    x = (randn(3, 64, seed=7) * 10.0**decade).to(dtype)
    q = check_nvfp4(x)
    assert q.dtype == dtype
    check_mxfp4(x)
    check_nvfp4((randn(32, 16, seed=8) * 10.0**decade).to(dtype), "16x16")
    assert formats.dequantize(q, dtype).dtype == dtype


def test_bfloat16_wide_range():
    x = (randn(2, 32, seed=9) * 1e30).to(torch.bfloat16)
    check_nvfp4(x)
    check_mxfp4(x)


def test_leading_batch_dims():
    check_nvfp4(randn(2, 3, 32, seed=1))
    check_nvfp4(randn(2, 1, 2, 16, seed=2))
    check_mxfp4(randn(2, 3, 64, seed=3))
    q = check_nvfp4(randn(2, 32, 16, seed=4), "16x16")
    assert q.scales.shape == (2, 32, 1)


def test_batched_quantize_uses_one_global_amax():
    x = randn(3, 4, 32, seed=5)
    x[1] *= 100
    q = formats.quantize(x)
    assert q.amax.item() == x.abs().max().item()
    flat = formats.quantize(x.reshape(12, 32))
    assert torch.equal(q.codes().reshape(12, 32), flat.codes())
    assert torch.equal(q.scales.view(torch.uint8).reshape(12, 2), flat.scales.view(torch.uint8))


def test_non_contiguous_input():
    x = randn(64, 32, seed=6)
    check_nvfp4(x.T)  # [32, 64] strided view
    check_nvfp4(x.T, "16x16")
    check_mxfp4(x.T)


# ----------------------------------------------------------------------------------------------
# 16x16 tiles: W and W^T share one quantization
# ----------------------------------------------------------------------------------------------


def _assert_same_q(a: formats.QTensor, b: formats.QTensor) -> None:
    assert a.shape == b.shape
    assert torch.equal(a.codes(), b.codes())
    assert torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))
    assert torch.equal(a.amax, b.amax)
    assert_same_f32(formats.dequantize(a), formats.dequantize(b).numpy())


@pytest.mark.parametrize("shape", [(16, 16), (48, 32), (32, 64), (2, 32, 48)])
@pytest.mark.parametrize("decade", [-20, 0, 25])
def test_16x16_transpose_equals_quantized_transpose(shape, decade):
    w = randn(*shape, seed=sum(shape)) * 10.0**decade
    w.view(-1)[::7] *= 1000.0  # uneven tile amaxes
    q = formats.quantize(w, "nvfp4", "16x16")
    qt = formats.quantize(w.transpose(-1, -2).contiguous(), "nvfp4", "16x16")
    _assert_same_q(q.transpose(), qt)
    _assert_same_q(qt.transpose(), q)
    assert_same_f32(formats.dequantize(q).transpose(-1, -2), formats.dequantize(qt).numpy())


@FEW
@given(any_f32_tensors(tile_rows=16))
def test_16x16_transpose_property(w):
    q = formats.quantize(w, "nvfp4", "16x16")
    qt = formats.quantize(w.T.contiguous(), "nvfp4", "16x16")
    _assert_same_q(q.transpose(), qt)


def test_16x16_scales_are_shared_by_the_tile_rows():
    w = randn(32, 48, seed=3)
    s = formats.quantize(w, "nvfp4", "16x16").scales.view(torch.uint8)
    assert s.shape == (32, 3)
    assert (s[:16] == s[:1]).all() and (s[16:] == s[16:17]).all()


def test_transpose_needs_16x16():
    q = formats.quantize(randn(16, 16))
    with pytest.raises(ValueError, match="16x16"):
        q.transpose()


# ----------------------------------------------------------------------------------------------
# amax override
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("factor", [1.0, 1.5, 4.0, 1000.0, 0.5, 0.01])
@pytest.mark.parametrize("block", ["1x16", "16x16"])
def test_amax_override(factor, block):
    x = randn(32, 32, seed=11)
    a = ref.f32(float(x.abs().max()) * factor)
    q = check_nvfp4(x, block, amax=a)
    assert q.amax.item() == a
    assert q.amax.shape == ()


def test_amax_override_of_zero_and_odd_shapes():
    x = randn(2, 32, seed=12)
    check_nvfp4(x, amax=0.0)
    q1 = formats.quantize(x, amax=torch.tensor([3.0]))
    q2 = formats.quantize(x, amax=torch.tensor(3.0, dtype=torch.bfloat16))
    assert q1.amax.shape == () and q1.amax.item() == 3.0
    _assert_same_q(q1, q2)


def test_amax_override_equal_to_own_amax_changes_nothing():
    x = randn(4, 64, seed=13)
    _assert_same_q(formats.quantize(x), formats.quantize(x, amax=x.abs().amax()))


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


def test_error_k_not_multiple_of_block():
    with pytest.raises(ValueError, match=r"\(2, 24\).*1x16"):
        formats.quantize(torch.zeros(2, 24))
    with pytest.raises(ValueError, match=r"\(4, 48\).*1x32"):
        formats.quantize(torch.zeros(4, 48), "mxfp4", "1x32")
    with pytest.raises(ValueError, match=r"\(16, 40\).*16x16"):
        formats.quantize(torch.zeros(16, 40), "nvfp4", "16x16")
    with pytest.raises(ValueError, match=r"\(24, 16\).*16x16"):
        formats.quantize(torch.zeros(24, 16), "nvfp4", "16x16")
    with pytest.raises(ValueError, match="16x16"):
        formats.quantize(torch.zeros(32), "nvfp4", "16x16")


@pytest.mark.parametrize(
    "fmt, block, rounding",
    [("fp4", "1x16", "rne"), ("nvfp8", "1x16", "rne"), ("nvfp4", "1x32", "rne"), ("mxfp4", "1x16", "rne"),
     ("mxfp4", "16x16", "rne"), ("nvfp4", "2x2", "rne"), ("nvfp4", "1x16", "rtz"), ("nvfp4", "1x16", "SR")],
)
def test_error_bad_arguments(fmt, block, rounding):
    with pytest.raises(ValueError):
        formats.quantize(torch.zeros(16, 32), fmt, block, rounding)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.int8, torch.bool])
def test_error_integer_tensors(dtype):
    with pytest.raises(TypeError):
        formats.quantize(torch.zeros(2, 32, dtype=dtype))


def test_encode_e2m1_errors():
    with pytest.raises(ValueError):
        formats.encode_e2m1(torch.zeros(4), "sr")
    with pytest.raises(ValueError):
        formats.encode_e2m1(torch.zeros(4), "nearest")


# ----------------------------------------------------------------------------------------------
# dequantize is the decode formula
# ----------------------------------------------------------------------------------------------


@PROPERTY
@given(scaled_tensors(), st.sampled_from(["rne", "sr"]))
def test_dequantize_is_the_decode_formula(x, rounding):
    q = formats.quantize(x, rounding=rounding, seed=3)
    codes = q.codes().numpy()
    sf = q.scales.view(torch.uint8).numpy()
    expected = ref.nvfp4_dequantize(codes, sf, float(q.amax))
    assert_same_f32(formats.dequantize(q), expected)
    # block_decode is value * sf, exact in float32
    bd = np.array([[ref.e2m1_value(int(c)) * ref.e4m3_value(int(sf[i, j // 16])) for j, c in enumerate(row)]
                   for i, row in enumerate(codes)], dtype=np.float32)
    assert_same_f32(formats.block_decode(q), bd)


def test_dequantize_output_dtype():
    q = formats.quantize(randn(2, 32))
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        assert formats.dequantize(q, dt).dtype == dt
    assert torch.equal(formats.dequantize(q, torch.bfloat16), formats.dequantize(q).to(torch.bfloat16))


# The decode formula multiplies fp32(sf) * amax in float32, and the encode side clamps S_enc at
# FLT_MAX: NVFP4 round trips are accurate for a global amax in [2688 / FLT_MAX, FLT_MAX / 448].
NVFP4_AMAX_RANGE = (2688.0 * float(np.finfo(np.float32).tiny), FLT_MAX / 448.0)


def _in_nvfp4_range(x: torch.Tensor) -> bool:
    a = float(x.abs().max())
    return NVFP4_AMAX_RANGE[0] <= a < NVFP4_AMAX_RANGE[1]


@PROPERTY
@given(scaled_tensors(k_unit=32))
def test_finite_inputs_dequantize_finite(x):
    assert torch.isfinite(formats.dequantize(formats.quantize(x, "mxfp4", "1x32"))).all()
    if _in_nvfp4_range(x):
        assert torch.isfinite(formats.dequantize(formats.quantize(x))).all()


def test_nvfp4_amax_limits_of_the_decode_formula():
    """Outside [2688 / FLT_MAX, FLT_MAX / 448] the contract's formulas lose the tensor (documented limits)."""
    big = torch.full((1, 16), NVFP4_AMAX_RANGE[1] * 2)
    assert torch.isinf(formats.dequantize(formats.quantize(big))).all()  # fp32(sf) * amax overflows
    tiny = torch.full((1, 16), 2688.0 / FLT_MAX / 100)  # S_enc clamps at FLT_MAX, decode uses amax / 2688
    deq = formats.dequantize(formats.quantize(tiny))
    assert (deq < tiny / 10).all()
    ok = torch.full((1, 16), NVFP4_AMAX_RANGE[0] * 2)
    assert torch.allclose(formats.dequantize(formats.quantize(ok)), ok, rtol=1e-5)


@PROPERTY
@given(scaled_tensors(k_unit=32))
def test_rne_error_is_at_most_half_a_step(x):
    """Away from saturation, |x̂ - x| <= half the E2M1 step around x times the block scale (plus fp32 slack)."""
    for fmt, block in (("nvfp4", "1x16"), ("mxfp4", "1x32")):
        q = formats.quantize(x, fmt, block)
        deq = formats.dequantize(q).double()
        if fmt == "nvfp4":
            v = torch.from_numpy(ref.nvfp4_scaled_values(x.numpy(), "1x16"))
            scale = (q.scales.double() * q.amax.double() / 2688.0).repeat_interleave(16, -1)
        else:
            scale = q.scales.double().repeat_interleave(32, -1)
            v = x.double() / scale
        if fmt == "nvfp4" and not _in_nvfp4_range(x):
            continue
        inside = (v.abs() <= 6) & (scale > 0)
        lo_hi = [ref.e2m1_neighbours(float(m)) for m in v.abs().flatten()]
        half_step = torch.tensor([(h - l) / 2 for l, h in lo_hi], dtype=torch.float64).reshape(x.shape)
        bound = half_step * scale * (1 + 1e-6) + 1e-6 * x.double().abs() + 1e-300
        assert ((deq - x.double()).abs() <= bound)[inside].all()


# ----------------------------------------------------------------------------------------------
# Non-finite input stays visible
# ----------------------------------------------------------------------------------------------

NON_FINITE = [math.nan, math.inf, -math.inf]
FORMATS = [("nvfp4", "1x16"), ("nvfp4", "16x16"), ("mxfp4", "1x32")]


def _visible(q: formats.QTensor, deq: torch.Tensor) -> bool:
    return not (torch.isfinite(deq).all() and (q.amax is None or torch.isfinite(q.amax).all()))


@pytest.mark.parametrize("value", NON_FINITE)
@pytest.mark.parametrize("fmt, block", FORMATS)
@pytest.mark.parametrize("override", [None, 1.0, 1e30, 0.0])
@pytest.mark.parametrize("rounding", ["rne", "sr"])
def test_non_finite_input_never_silently_finite(value, fmt, block, override, rounding):
    x = randn(32, 64, seed=21)
    x[5, 17] = value
    amax = None if override is None else torch.tensor(override)
    q = formats.quantize(x, fmt, block, rounding, amax=amax, seed=1)
    deq = formats.dequantize(q)
    assert _visible(q, deq)
    assert not torch.isfinite(deq[5, 17]), "the non-finite element itself must dequantize non-finite"


@PROPERTY
@given(
    scaled_tensors(k_unit=32, tile_rows=16),
    st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(NON_FINITE)), min_size=1, max_size=4),
    st.sampled_from(FORMATS),
    st.sampled_from([None, 1.0, 1e-20, 1e20]),
)
def test_non_finite_property(x, bad, fmt_block, override):
    x = x.clone()
    for pos, v in bad:
        x.view(-1)[pos % x.numel()] = v
    q = formats.quantize(x, *fmt_block, amax=None if override is None else torch.tensor(override))
    deq = formats.dequantize(q)
    assert _visible(q, deq)
    assert not torch.isfinite(deq[~torch.isfinite(x)]).any()


def test_nan_amax_override_is_visible():
    x = randn(2, 32)
    q = formats.quantize(x, amax=torch.tensor(math.nan))
    assert _visible(q, formats.dequantize(q))


# ----------------------------------------------------------------------------------------------
# Stochastic rounding
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 5, 2**31 - 1, 2**32 - 1, 2**32, 2**32 + 7, 2**40 + 3, 2**63 + 5, 2**64 - 1])
def test_sr_random_bits_match_the_documented_hash(seed):
    n = 70000
    bits = formats.sr_random_bits(n, seed)
    assert bits.dtype == torch.int64 and bits.shape == (n,)
    assert int(bits.min()) >= 0 and int(bits.max()) < 2**16
    for i in (0, 1, 2, 3, 255, 65535, 65536, 69998, 69999):
        assert int(bits[i]) == ref.sr_bits(i, seed), (i, seed)


@pytest.mark.parametrize("seed", [0, 3, 2**32 - 1, 2**40 + 3, 2**64 - 1])
def test_sr_random_bits_cpu_path_equals_the_tensor_path(seed):
    # On CPU the bits are computed in numpy uint32; on other devices in int64 tensor arithmetic
    # (the path taken here through the meta-free int64 formula, on CPU tensors).
    n = 5001  # odd: the last pair's high half is dropped
    pair = torch.arange((n + 1) // 2, dtype=torch.int64)
    k0, k1 = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    words = formats._hash32((pair & 0xFFFFFFFF) ^ k0 ^ formats._hash32((pair >> 32) ^ k1))
    want = torch.stack([words & 0xFFFF, words >> 16], dim=-1).reshape(-1)[:n]
    assert torch.equal(formats.sr_random_bits(n, seed), want)
    assert torch.equal(formats.sr_random_bits(n, seed, device="cpu"), want)


def test_sr_random_bits_known_values():
    # lowbias32(0) == 0, so the word of pair 0 of seed 0 is 0: elements 0 and 1 draw 0.
    bits = formats.sr_random_bits(6, 0).tolist()
    assert bits == [ref.sr_bits(i, 0) for i in range(6)]
    assert bits[:2] == [0, 0] and len(set(bits[2:])) == 4


def test_sr_random_bits_look_uniform():
    bits = formats.sr_random_bits(1 << 16, 123)
    u = bits.double() * 2.0**-16
    n = u.numel()
    # mean of U(0,1) has sd sqrt(1/12/n); each bit is a fair coin; the two halves of a word are uncorrelated.
    assert abs(u.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / n)
    even, odd = u[0::2] - 0.5, u[1::2] - 0.5
    assert abs((even * odd).mean().item()) < 5 * (1 / 12) / math.sqrt(n / 2)
    # One hash per word of consecutive counters: neighbouring words (and every lag up to a block of 16
    # elements) are uncorrelated too.
    centred = u - 0.5
    for lag in range(2, 17):
        assert abs((centred[:-lag] * centred[lag:]).mean().item()) < 5 * (1 / 12) / math.sqrt(n - lag), lag
    for b in range(16):
        ones = ((bits >> b) & 1).sum().item()
        assert abs(ones - n / 2) < 5 * math.sqrt(n / 4), b


@PROPERTY
@given(scaled_tensors(), st.integers(0, 2**64 - 1))
def test_sr_codes_are_grid_neighbours(x, seed):
    q = formats.quantize(x, rounding="sr", seed=seed)
    v = ref.nvfp4_scaled_values(x.numpy(), "1x16")
    vals = formats.decode_e2m1(q.codes()).numpy()
    for got, exact in zip(vals.flat, v.flat):
        lo, hi = ref.e2m1_neighbours(exact)
        assert abs(got) in (lo, hi), (got, exact)
        if got != 0:
            assert math.copysign(1, got) == math.copysign(1, exact)


@PROPERTY
@given(scaled_tensors(k_unit=32), st.integers(0, 2**64 - 1))
def test_sr_mxfp4_codes_are_grid_neighbours(x, seed):
    q = formats.quantize(x, "mxfp4", "1x32", "sr", seed=seed)
    scale = q.scales.double().repeat_interleave(32, -1)
    v = (x.double() / scale).numpy()
    vals = formats.decode_e2m1(q.codes()).numpy()
    for got, exact in zip(vals.flat, v.flat):
        lo, hi = ref.e2m1_neighbours(exact)
        assert abs(got) in (lo, hi), (got, exact)


@FEW
@given(scaled_tensors(), st.integers(0, 2**64 - 1))
def test_sr_bits_exact_against_reference(x, seed):
    """SR draws u = bits * 2**-16 from sr_random_bits(element index, seed), hi iff u < frac."""
    check_nvfp4(x, "1x16", rounding="sr", seed=seed)
    check_mxfp4(torch.cat([x, x], -1), rounding="sr", seed=seed)


def test_sr_bits_exact_16x16():
    check_nvfp4(randn(32, 32, seed=31), "16x16", rounding="sr", seed=2**33 + 1)


def test_sr_leaves_scales_and_amax_round_to_nearest():
    x = randn(32, 64, seed=4)
    for fmt, block in FORMATS:
        a = formats.quantize(x, fmt, block, "rne")
        b = formats.quantize(x, fmt, block, "sr", seed=9)
        assert torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))
        assert (a.amax is None and b.amax is None) or torch.equal(a.amax, b.amax)
        assert not torch.equal(a.codes(), b.codes())


def test_sr_on_grid_values_is_exact():
    # amax 2688 makes the global scale 1 and the 6-amax block scale 1, so grid values are exact.
    row = [v * s for v in ref.E2M1_GRID for s in (1, -1)] + [6.0] * 16 + [2688.0] + [0.0] * 15
    x = torch.tensor([row], dtype=torch.float32)
    for seed in range(20):
        q = formats.quantize(x, rounding="sr", seed=seed)
        assert torch.equal(formats.block_decode(q)[0, :16], x[0, :16])


@pytest.mark.parametrize("fmt, block", FORMATS)
def test_sr_mean_converges_to_input(fmt, block):
    """E[SR(v)] = v: over S seeds the mean of x̂ approaches x within a few standard errors.

    For each element the SR draw is Bernoulli between the grid neighbours lo <= |v| <= hi, so
    Var(x̂) = (hi - |v|) (|v| - lo) * scale**2, and the mean of S draws has variance Var/S.
    """
    rows = 16 if block == "16x16" else 2
    x = randn(rows, 32, seed=17) * 3.0
    q0 = formats.quantize(x, fmt, block)
    cols = 32 if fmt == "mxfp4" else 16
    if fmt == "nvfp4":
        one_over_2688 = torch.tensor(1 / 2688, dtype=torch.float32)
        scale = ((q0.scales.float() * q0.amax) * one_over_2688).double().repeat_interleave(cols, -1)
        v = torch.from_numpy(ref.nvfp4_scaled_values(x.numpy(), block))
    else:
        scale = q0.scales.double().repeat_interleave(cols, -1)
        v = x.double() / scale
    lo_hi = torch.tensor([ref.e2m1_neighbours(float(m)) for m in v.abs().flatten()], dtype=torch.float64)
    lo, hi = lo_hi[:, 0].reshape(x.shape), lo_hi[:, 1].reshape(x.shape)
    var = (hi - v.abs()) * (v.abs() - lo) * scale**2
    S = 1500
    total = torch.zeros(x.shape, dtype=torch.float64)
    for s in range(S):
        total += formats.dequantize(formats.quantize(x, fmt, block, "sr", seed=s)).double()
    mean = total / S
    inside = v.abs() < 6  # saturated elements are deterministic, not unbiased
    assert inside.float().mean() > 0.9
    expected = v * scale  # E[x̂] (scale as dequantize computes it); equals x up to float32 rounding
    assert torch.allclose(expected[inside], x.double()[inside], rtol=1e-6, atol=0)
    se = (var / S).sqrt()
    dev = (mean - expected).abs()
    # 6 standard errors, plus the granularity of one draw and double-precision summation slack.
    bound = 6 * se + (hi - lo) * scale / S + 1e-9 * expected.abs()
    assert (dev[inside] <= bound[inside]).all()
    # Pooled: the sum of deviations is N(0, sum var / S).
    z = (mean - expected)[inside].sum() / (var[inside].sum() / S).sqrt()
    assert abs(z.item()) < 5
    # And SR really is random: the mean differs from the RNE result where |v| is off-grid.
    off_grid = inside & (var > 0)
    assert (mean[off_grid] != formats.dequantize(q0).double()[off_grid]).any()


def test_sr_same_seed_same_bits():
    x = randn(8, 64, seed=2)
    for fmt, block in FORMATS:
        xx = x.repeat(2, 1) if block == "16x16" else x
        a = formats.quantize(xx, fmt, block, "sr", seed=77)
        b = formats.quantize(xx, fmt, block, "sr", seed=77)
        c = formats.quantize(xx, fmt, block, "sr", seed=78)
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
        assert not torch.equal(a.data.view(torch.uint8), c.data.view(torch.uint8))


def test_sr_generator_reproducible():
    x = randn(8, 64, seed=3)

    def run(s):
        return formats.quantize(x, rounding="sr", generator=torch.Generator().manual_seed(s)).codes()

    assert torch.equal(run(5), run(5))
    assert not torch.equal(run(5), run(6))
    g = torch.Generator().manual_seed(5)
    first = formats.quantize(x, rounding="sr", generator=g).codes()
    second = formats.quantize(x, rounding="sr", generator=g).codes()
    assert torch.equal(first, run(5)) and not torch.equal(first, second)


def test_sr_default_generator_follows_manual_seed():
    x = randn(4, 32, seed=4)
    torch.manual_seed(1234)
    a = formats.quantize(x, rounding="sr").codes()
    torch.manual_seed(1234)
    b = formats.quantize(x, rounding="sr").codes()
    assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------
# Random Hadamard transform
# ----------------------------------------------------------------------------------------------


def test_hadamard_matrix_is_the_documented_one():
    h = formats.hadamard_matrix()
    assert h.dtype == torch.float32 and h.shape == (16, 16)
    assert torch.equal(h.double(), torch.from_numpy(ref.hadamard16()))
    assert tuple(formats.DEFAULT_RHT_SIGNS) == ref.RHT_SIGNS


@pytest.mark.parametrize("size, signs", [(16, None), (16, [1] * 16), (2, [1, -1]), (32, [(-1) ** (i % 3) for i in range(32)])])
def test_hadamard_matrix_is_orthogonal(size, signs):
    h = formats.hadamard_matrix(size, signs)
    eye = torch.eye(size)
    assert torch.allclose(h @ h.T, eye, atol=1e-6, rtol=0)
    assert torch.allclose(h.T @ h, eye, atol=1e-6, rtol=0)


@pytest.mark.parametrize("m, n, k", [(8, 4, 16), (5, 7, 64), (3, 2, 256)])
def test_rht_on_both_operands_keeps_the_product(m, n, k):
    a = randn(m, k, seed=1) * 3
    b = randn(n, k, seed=2)
    ra, rb = formats.rht(a), formats.rht(b)
    exact = a.double() @ b.double().T
    tol = 1e-5 * (a.double().abs() @ b.double().abs().T) + 1e-6
    assert ((ra.double() @ rb.double().T - exact).abs() <= tol).all()
    # the transform is blockwise: each 16-chunk c -> c @ H
    h = torch.from_numpy(ref.hadamard16())
    chunks = a.double().reshape(m, k // 16, 16) @ h
    assert torch.allclose(ra.double(), chunks.reshape(m, k), atol=1e-5, rtol=1e-6)


def test_rht_then_transpose_restores():
    x = randn(6, 4, 48, seed=3) * 10
    y = formats.rht(x)
    h = formats.hadamard_matrix()
    back = (y.reshape(-1, 16) @ h.T).reshape(x.shape)
    assert torch.allclose(back, x, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(y, x)


def test_rht_keeps_dtype_and_norm():
    for dt in (torch.float32, torch.bfloat16):
        x = randn(4, 32, seed=4).to(dt)
        y = formats.rht(x)
        assert y.dtype == dt and y.shape == x.shape
    x = randn(4, 32, seed=5)
    chunk_norms = x.reshape(4, 2, 16).norm(dim=-1)
    assert torch.allclose(formats.rht(x).reshape(4, 2, 16).norm(dim=-1), chunk_norms, rtol=1e-5)


def test_rht_custom_signs():
    signs = [(-1) ** i for i in range(16)]
    x = randn(3, 16, seed=6)
    y = formats.rht(x, signs=signs)
    assert torch.allclose(y.double(), x.double() @ torch.from_numpy(ref.hadamard16(signs)), atol=1e-6)


@FEW
@given(any_f32_tensors())
def test_rht_equals_the_exact_butterfly(x):
    # Arbitrary finite float32 values (subnormals, FLT_MAX: sums that overflow to inf included).
    assert_same_f32(formats.rht(x), ref.rht_butterfly(x.numpy()))


@FEW
@given(scaled_tensors(), st.sampled_from([torch.bfloat16, torch.float16]))
def test_rht_of_half_precision_inputs_equals_the_exact_butterfly(x, dtype):
    x = x.clamp(-6e4, 6e4).to(dtype)  # finite in both dtypes
    want = torch.from_numpy(ref.rht_butterfly(x.float().numpy())).to(dtype)
    assert_same_f32(formats.rht(x).float(), want.float().numpy())


def test_rht_sums_in_butterfly_order():
    # z0 = 1/4 and z4 = -z12 = 2**-26, half an ulp of 1/4. For j = 8..11 (+z4 and -z12) the butterfly
    # adds the two small terms first (2**-25, exact), then to 1/4 (exact); a chain over i = 0..15 adds each
    # half ulp to 1/4 on its own, and each time the tie rounds back to 1/4.
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 4], x[0, 12] = 1.0, 2.0**-24, 2.0**-24
    y = formats.rht(x)
    assert_same_f32(y, ref.rht_butterfly(x.numpy()))
    chain = torch.from_numpy(ref.rht_fma_chain(x.numpy()))
    for j in range(8, 12):
        assert y[0, j].item() == 0.25 + 2.0**-25 and chain[0, j].item() == 0.25, j
    # bfloat16 input: the transform is computed in float32 and rounded once to bfloat16.
    xb = (randn(8, 64, seed=9) * 100).to(torch.bfloat16)
    assert torch.equal(formats.rht(xb), formats.rht(xb.float()).to(torch.bfloat16))


def test_rht_bad_sizes_raise():
    with pytest.raises(ValueError):
        formats.rht(torch.zeros(2, 24))
    with pytest.raises(ValueError):
        formats.rht(torch.zeros(2, 12), size=12)
    with pytest.raises(ValueError):
        formats.hadamard_matrix(12)
    with pytest.raises(ValueError):
        formats.hadamard_matrix(0)
    with pytest.raises(ValueError):
        formats.hadamard_matrix(32)  # the default signs have 16 entries
    with pytest.raises(ValueError):
        formats.hadamard_matrix(16, [1] * 8)


# ----------------------------------------------------------------------------------------------
# Swizzled scale layout
# ----------------------------------------------------------------------------------------------

SWIZZLE_SHAPES = [(1, 1), (5, 3), (32, 4), (128, 4), (130, 7), (127, 5), (257, 9), (64, 12), (256, 8), (300, 2)]


def _scales(rows, cols, dtype=torch.uint8, seed=0):
    raw = torch.randint(1, 255, (rows, cols), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
    return raw.to(torch.uint8).view(dtype)


@pytest.mark.parametrize("rows, cols", SWIZZLE_SHAPES)
def test_swizzle_matches_torch_to_blocked(rows, cols, common_quantized):
    s = _scales(rows, cols)
    ours = formats.swizzle_scales(s.view(torch.float8_e4m3fn))
    assert ours.dtype == torch.float8_e4m3fn
    assert torch.equal(ours.view(torch.uint8), common_quantized.to_blocked(s))


@pytest.mark.parametrize("rows, cols", [(5, 3), (130, 7), (128, 4)])
def test_unswizzle_matches_torch_from_blocked(rows, cols, common_quantized):
    s = _scales(rows, cols, seed=1)
    sw = formats.swizzle_scales(s)
    dummy = torch.empty(rows, cols * 16)
    theirs = common_quantized.from_blocked(dummy, sw, 16)
    assert torch.equal(formats.unswizzle_scales(sw, rows, cols), theirs)


@pytest.mark.parametrize("rows, cols", SWIZZLE_SHAPES)
def test_swizzle_follows_the_offset_formula(rows, cols):
    s = _scales(rows, cols, seed=2)
    sw = formats.swizzle_scales(s)
    expected = ref.swizzle(s.numpy())
    assert sw.shape == (-(-rows // 128) * 128 * (-(-cols // 4) * 4),)
    np.testing.assert_array_equal(sw.numpy(), expected)
    filled = np.zeros(sw.numel(), dtype=bool)
    for r in range(rows):
        for c in range(cols):
            off = ref.swizzle_offset(r, c, cols)
            assert formats.swizzled_offset(r, c, cols) == off
            filled[off] = True
    assert filled.sum() == rows * cols
    assert (sw.numpy()[~filled] == 0).all(), "padding must be zero-filled"


def test_swizzled_offset_on_tensors():
    r = torch.arange(300).repeat_interleave(9)
    c = torch.arange(9).repeat(300)
    off = formats.swizzled_offset(r, c, 9)
    assert off.tolist() == [ref.swizzle_offset(int(a), int(b), 9) for a, b in zip(r, c)]
    assert len(set(off.tolist())) == off.numel()


@pytest.mark.parametrize("rows, cols", SWIZZLE_SHAPES)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn, torch.float8_e8m0fnu])
def test_swizzle_roundtrip(rows, cols, dtype):
    s = _scales(rows, cols, dtype, seed=3)
    back = formats.unswizzle_scales(formats.swizzle_scales(s), rows, cols)
    assert back.dtype == dtype and back.shape == (rows, cols)
    assert torch.equal(back.view(torch.uint8), s.view(torch.uint8))


def test_swizzle_of_real_scales(common_quantized):
    q = formats.quantize(randn(200, 96, seed=8))
    s = q.scales
    sw = formats.swizzle_scales(s)
    assert torch.equal(sw.view(torch.uint8), common_quantized.to_blocked(s.view(torch.uint8)))
    assert torch.equal(formats.unswizzle_scales(sw, 200, 6).view(torch.uint8), s.view(torch.uint8))


def test_swizzle_errors():
    with pytest.raises(ValueError):
        formats.swizzle_scales(torch.zeros(2, 3, 4, dtype=torch.uint8))
    with pytest.raises(ValueError):
        formats.unswizzle_scales(torch.zeros(100, dtype=torch.uint8), 5, 3)


def test_global_encode_scale_is_one_ieee_division():
    """S_enc = 2688 / amax rounded once (not reciprocal-then-multiply, which differs for many amax)."""
    import numpy as np

    amax = torch.rand(20000, dtype=torch.float32, generator=torch.Generator().manual_seed(0)) * 100 + 1e-3
    want = np.float32(2688.0) / amax.numpy()
    got = formats.global_encode_scale(amax).numpy()
    assert np.array_equal(got, want)


def test_rht_keeps_the_sign_vector_on_the_device_and_takes_empty_tensors():
    # The default scaled sign vector is made once per device (a host-to-device copy on every call could
    # not be recorded in a CUDA graph): the same tensor object each time.
    x = randn(4, 32, seed=13)
    formats.rht(x)
    assert formats._default_rht_scale(16, x.device) is formats._default_rht_scale(16, x.device)
    empty = torch.zeros(3, 0)
    assert formats.rht(empty).shape == (3, 0)
    assert formats.rht(torch.zeros(0, 16)).shape == (0, 16)
