"""Bit-exactness of the Triton NVFP4 emulation kernels against the CPU reference (fp4compile.formats).

Without a CUDA device the kernels run in Triton's interpreter on CPU tensors (small shapes, a few
seconds each); tests marked ``gpu`` run the compiled kernels on larger shapes and compare with the
CPU reference on copies. Everything is skipped when triton is not installed.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from fp4compile import formats, ops, runtime  # noqa: E402
from fp4compile.codegen import triton_kernels as tk  # noqa: E402
from tiers import first_fast  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's 1/0 in the interpreter

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BIG_SEED = 0xDEADBEEFCAFEF00D  # both 32-bit halves have their top bit set


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def sample(shape, dtype, seed=0, spread=3.0):
    """Values over many binades (log-normal magnitudes, random signs), so every code and scale occurs."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp(torch.randn(shape, generator=g) * spread)
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    return (sign * mag).to(dtype)


def assert_same_quantization(data, scales, amax, ref: formats.QTensor, swizzled=False):
    """Same amax (NaN matches NaN), scale bytes and codes as ``ref``.

    Where the reference's scaled value is NaN (a NaN scale or amax) only the code magnitude is compared:
    the sign the CPU gives a NaN product depends on its vector unit, and the kernels write +0.
    """
    data, scales, amax = data.cpu(), scales.cpu(), amax.cpu()
    assert amax.dtype == torch.float32 and amax.shape == ()
    assert torch.equal(amax, ref.amax) or (amax.isnan() and ref.amax.isnan()), (amax, ref.amax)
    ref_scales = ref.scales.view(torch.uint8)
    if swizzled:
        ref_scales = formats.swizzle_scales(ref_scales.reshape(-1, ref_scales.shape[-1]))
    assert scales.dtype == torch.uint8 and scales.shape == ref_scales.shape
    bad = (scales != ref_scales).nonzero()
    assert len(bad) == 0, f"{len(bad)} scales differ, first at {bad[0].tolist()}"
    codes, ref_codes = formats.unpack_e2m1(data), ref.codes()
    assert codes.shape == ref_codes.shape
    nan = torch.isnan(formats.block_decode(ref))
    same = torch.where(nan, (codes & 7) == (ref_codes & 7), codes == ref_codes)
    bad = (~same).nonzero()
    assert len(bad) == 0, f"{len(bad)} codes differ, first at {bad[0].tolist()}"


def assert_same_float(actual, expected):
    actual, expected = actual.cpu(), expected.cpu()
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    nan = actual.isnan()
    assert torch.equal(nan, expected.isnan()), "NaN positions differ"
    same = nan | (actual.view(torch.uint8) == expected.view(torch.uint8)).reshape(*actual.shape, -1).all(-1)
    bad = (~same).nonzero()
    assert len(bad) == 0, f"{len(bad)} values differ, first at {bad[0].tolist()}"


def wgrad_reference(x, rounding, seed=None, amax=None):
    x2 = x.reshape(-1, x.shape[-1])
    return formats.quantize(formats.rht(x2.t()), "nvfp4", "1x16", rounding, amax=amax, seed=seed)


def special_values(dtype):
    """A [64, 64] tensor with zero blocks, -0, subnormals, E2M1 ties, tiny blocks (E4M3 subnormal
    scales) and large values next to each other."""
    x = sample((64, 64), torch.float32, seed=7)
    x[0, :16] = 0.0
    x[1, :16] = -0.0
    x[1, 16:32] = torch.tensor(formats.E2M1_VALUES + (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0)) * 2.0**-3
    x[2, :] = torch.finfo(dtype).tiny * torch.arange(64)  # subnormal and smallest normal values
    x[3, :16] = 1e-6
    x[3, 16:32] = 1e4
    x[4, :] = torch.finfo(dtype).max / 4
    return x.to(dtype)


# ----------------------------------------------------------------------------------------------
# interpreter (CPU) or GPU, small shapes
# ----------------------------------------------------------------------------------------------


def test_available_reports_a_reason():
    ok, reason = tk.available()
    assert isinstance(ok, bool) and reason


@pytest.mark.parametrize(*first_fast("dtype", DTYPES))
@pytest.mark.parametrize("rounding", ["rne", "sr"])
def test_quantize_1x16(dtype, rounding):
    x = sample((48, 96), dtype, seed=1)  # neither dim a multiple of the tile
    data, scales, amax = tk.quantize_1x16(x.to(DEVICE), rounding, seed=BIG_SEED)
    assert_same_quantization(data, scales, amax, formats.quantize(x, rounding=rounding, seed=BIG_SEED))


def test_quantize_1x16_batched_and_strided():
    x = sample((2, 3, 64), torch.bfloat16, seed=2)
    data, scales, amax = tk.quantize_1x16(x.to(DEVICE), "sr", seed=5)
    assert data.shape == (2, 3, 32) and scales.shape == (2, 3, 4)
    assert_same_quantization(data, scales, amax, formats.quantize(x, rounding="sr", seed=5))
    wide = sample((16, 128), torch.bfloat16, seed=3)
    view = wide.to(DEVICE)[:, 32:96]  # rows with a stride of 128
    data, scales, amax = tk.quantize_1x16(view)
    assert_same_quantization(data, scales, amax, formats.quantize(wide[:, 32:96]))


@pytest.mark.parametrize("fake", [False, True])
def test_quantize_1x16_bf16_rows_off_word_boundaries(fake):
    # bf16 rows are read as 32-bit words: an odd row stride or a start halfway into a word is copied
    # first, not read misaligned.
    wide = sample((24, 97), torch.bfloat16, seed=6)
    for view in (wide[:, 1:65], wide[:, 2:66], wide.flatten()[1:1 + 24 * 64].view(24, 64)):
        ref = formats.quantize(view.contiguous(), rounding="sr", seed=11)
        if fake:
            out = tk.fake_quantize_1x16(view.to(DEVICE) if CUDA else view, "sr", seed=11)[0]
            assert torch.equal(out.cpu(), formats.block_decode(ref).to(torch.bfloat16))
        else:
            data, scales, amax = tk.quantize_1x16(view.to(DEVICE) if CUDA else view, "sr", seed=11)
            assert_same_quantization(data, scales, amax, ref)


@pytest.mark.parametrize("rounding", ["rne", "sr"])
def test_quantize_1x16_swizzled(rounding):
    x = sample((130, 80), torch.bfloat16, seed=4)  # padded to 256 x 8 scales
    data, scales, amax = tk.quantize_1x16(x.to(DEVICE), rounding, seed=9, swizzle=True)
    ref = formats.quantize(x, rounding=rounding, seed=9)
    assert_same_quantization(data, scales, amax, ref, swizzled=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_16x16(dtype):
    w = sample((48, 80), dtype, seed=5)
    data, scales, amax = tk.quantize_16x16(w.to(DEVICE))
    assert_same_quantization(data, scales, amax, formats.quantize(w, block="16x16"))


@pytest.mark.parametrize(*first_fast("dtype", DTYPES))
@pytest.mark.parametrize("rounding", ["rne", "sr"])
def test_quantize_wgrad_operand(dtype, rounding):
    x = sample((96, 40), dtype, seed=6)  # 96 tokens, 40 features
    data, scales, amax = tk.quantize_wgrad_operand(x.to(DEVICE), rounding, seed=BIG_SEED)
    assert data.shape == (40, 48) and scales.shape == (40, 6)
    assert_same_quantization(data, scales, amax, wgrad_reference(x, rounding, seed=BIG_SEED))


def test_quantize_wgrad_operand_swizzled_batched():
    x = sample((2, 64, 24), torch.bfloat16, seed=7)  # 128 tokens
    data, scales, amax = tk.quantize_wgrad_operand(x.to(DEVICE), "sr", seed=3, swizzle=True)
    assert_same_quantization(data, scales, amax, wgrad_reference(x, "sr", seed=3), swizzled=True)


@pytest.mark.parametrize(*first_fast("dtype", DTYPES))
@pytest.mark.parametrize("rounding, rounding_t", [("sr", "sr"), ("rne", "sr")])
def test_fake_quantize_dual_equals_the_two_quantizations(dtype, rounding, rounding_t):
    """One launch for a gradient's two decoded operands (1x16, and RHT(x^T)): the bits of the two kernels."""
    x = sample((96, 80), dtype, seed=12).to(DEVICE)  # 96 tokens (two tiles along them), 80 features
    amax, amax_t = tk.wgrad_amax(x)
    rows, transformed = tk.fake_quantize_dual(x, rounding, 7, amax, rounding_t, BIG_SEED, amax_t)
    want_rows, _ = tk.fake_quantize_1x16(x, rounding, 7, amax=amax, amax_is_own=True)
    want_t, _ = tk.fake_quantize_wgrad_operand(x, rounding_t, BIG_SEED, amax=amax_t, amax_is_own=True)
    assert rows.shape == (96, 80) and transformed.shape == (80, 96)
    assert torch.equal(rows, want_rows)
    assert torch.equal(transformed, want_t)
    ref = wgrad_reference(x.cpu(), rounding_t, seed=BIG_SEED)
    assert torch.equal(transformed.cpu().float(), formats.block_decode(ref).float())


@pytest.mark.parametrize(*first_fast("dtype", DTYPES))
@pytest.mark.parametrize("rounding, rounding_t", [("sr", "sr"), ("rne", "sr")])
def test_quantize_dual_equals_the_two_packed_quantizations(dtype, rounding, rounding_t):
    """The packed form of the dual launch: the codes and scales of the 1x16 and the RHT(x^T) quantizers."""
    x = sample((96, 80), dtype, seed=13).to(DEVICE)
    amax, amax_t = tk.wgrad_amax(x)
    data, scales, data_t, scales_t = tk.quantize_dual(x, rounding, 7, amax, rounding_t, BIG_SEED, amax_t)
    want = tk.quantize_1x16(x, rounding, 7, amax=amax, amax_is_own=True)
    want_t = tk.quantize_wgrad_operand(x, rounding_t, BIG_SEED, amax=amax_t, amax_is_own=True)
    assert data.shape == (96, 40) and scales.shape == (96, 5) and data_t.shape == (80, 48) and scales_t.shape == (80, 6)
    for got, expected in zip((data, scales, data_t, scales_t), (*want[:2], *want_t[:2])):
        assert torch.equal(got, expected)
    assert_same_quantization(data_t, scales_t, amax_t, wgrad_reference(x.cpu(), rounding_t, seed=BIG_SEED))


def test_global_amax_and_wgrad_amax():
    x = sample((64, 48), torch.bfloat16, seed=8)
    assert torch.equal(tk.global_amax(x.to(DEVICE)).cpu(), x.float().abs().amax())
    amax_x, amax_rht = tk.wgrad_amax(x.to(DEVICE))
    assert torch.equal(amax_x.cpu(), x.float().abs().amax())
    assert torch.equal(amax_rht.cpu(), formats.rht(x.t()).float().abs().amax())


@pytest.mark.parametrize("programs", [1024, 3, 1])
def test_global_amax_at_each_tiles_per_program(monkeypatch, programs):
    """A small tensor takes fewer tiles per program (ITERS 8 down to 1): the same amax either way."""
    monkeypatch.setattr(tk.api, "_AMAX_PROGRAMS", programs)
    for n, dtype in ((1, torch.float32), (4096 * 3 + 5, torch.bfloat16), (4096 * 8 * 2 + 17, torch.float32)):
        x = sample((n,), dtype, seed=n)
        x[n // 2] = -1e4  # a largest |x| in the middle, negative
        assert torch.equal(tk.global_amax(x.to(DEVICE)).cpu(), x.float().abs().amax())


def assert_amaxes_and_1x16_as_reference(x):
    """``wgrad_amax`` and the packed and decoded 1x16 quantizers (RNE and SR) of x give the reference's
    bits; returns the two amaxes (on the device)."""
    amax, amax_t = tk.wgrad_amax(x.to(DEVICE))
    assert torch.equal(amax.cpu(), x.float().abs().amax())
    assert torch.equal(amax_t.cpu(), formats.rht(x.t()).float().abs().amax())
    for rounding in ("rne", "sr"):
        ref = formats.quantize(x, rounding=rounding, seed=BIG_SEED)
        assert_same_quantization(*tk.quantize_1x16(x.to(DEVICE), rounding, seed=BIG_SEED), ref)
        bd, _ = tk.fake_quantize_1x16(x.to(DEVICE), rounding, BIG_SEED)
        assert torch.equal(bd.cpu().float(), formats.block_decode(ref).float())
    return amax, amax_t


@pytest.mark.slow
@pytest.mark.parametrize("k_first", [False, True])
def test_tile_order_changes_no_bits(monkeypatch, k_first):
    """Programs stepping along K first or along M first compute the same tiles: the reference's bits
    either way, for every kernel that takes the order from its configuration, at sizes that are not
    tile multiples."""
    for key in ("quantize_rows", "fake_rows", "rht_amax", "rht_quantize", "dual_quantize"):
        monkeypatch.setitem(tk.CONFIGS, key, dict(tk.CONFIGS[key], K_FIRST=k_first))
    x = sample((80, 176), torch.bfloat16, seed=21)
    amax, amax_t = assert_amaxes_and_1x16_as_reference(x)
    for rounding in ("rne", "sr"):
        ref = formats.quantize(x, rounding=rounding, seed=BIG_SEED)
        ref_t = wgrad_reference(x, rounding, seed=BIG_SEED)
        assert_same_quantization(*tk.quantize_wgrad_operand(x.to(DEVICE), rounding, seed=BIG_SEED), ref_t)
        rows, transformed = tk.fake_quantize_dual(x.to(DEVICE), rounding, BIG_SEED, amax, rounding, BIG_SEED, amax_t)
        assert torch.equal(rows.cpu().float(), formats.block_decode(ref).float())
        assert torch.equal(transformed.cpu().float(), formats.block_decode(ref_t).float())


@pytest.mark.slow
@pytest.mark.parametrize("iters", [2, 3])
def test_tiles_per_program_change_no_bits(monkeypatch, iters):
    """Programs that take several tiles along K, loading the next before they quantize the one loaded,
    give the reference's bits: with a K that is no multiple of the tiles a program takes (its last tiles
    lie past K), with a given amax whose fix-up pass quantizes again (an Inf in the tensor), for the
    packed and the decoded 1x16 quantizers and for wgrad_amax, on bf16 (pair words) and fp32 rows."""
    for key in ("quantize_rows", "fake_rows"):
        monkeypatch.setitem(tk.CONFIGS, key, dict(tk.CONFIGS[key], BLOCK_M=16, BLOCK_K=32, ITERS=iters))
    monkeypatch.setitem(tk.CONFIGS, "rht_amax", dict(tk.CONFIGS["rht_amax"], BLOCK_M=16, BLOCK_K=32, ITERS=iters))
    for dtype in (torch.bfloat16, torch.float32):
        x = sample((48, 208), dtype, seed=23)  # 7 column tiles of 32 (the last partial)
        assert_amaxes_and_1x16_as_reference(x)
        given = torch.tensor(5.0)
        y = x.clone()
        y[30, 190] = float("inf")
        out = tk.quantize_1x16(y.to(DEVICE), "sr", seed=8, amax=given.to(DEVICE))
        assert_same_quantization(*out, formats.quantize(y, rounding="sr", seed=8, amax=given))
        out = tk.quantize_1x16(x.to(DEVICE), "rne", amax=given.to(DEVICE))
        assert_same_quantization(*out, formats.quantize(x, amax=given))


def test_tile_grid_keeps_m_first_past_the_grids_second_dimension():
    cfg = dict(K_FIRST=True)
    assert tk.launch._tiles(cfg, 65535, 3) == ((3, 65535), {"K_FIRST": True})
    assert tk.launch._tiles(cfg, 65536, 3) == ((65536, 3), {"K_FIRST": False})
    assert tk.launch._tiles({}, 10, 3) == ((10, 3), {"K_FIRST": False})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_wgrad_amax_rounds_the_largest_rht_value_as_the_reference(dtype):
    """The kernel rounds max |RHT(x^T)| to x's dtype once; the reference rounds every RHT value: the same
    bits, also where the largest value overflows the dtype (float16) and where x holds a NaN."""
    x = sample((48, 32), dtype, seed=31)
    x[16:32, 5] = 6.0e4 * torch.tensor(formats.DEFAULT_RHT_SIGNS, dtype=dtype)  # overflows float16 after the RHT
    x[16:32, 6] = 6.0e4  # (one of these two chunks sums 16 values of one sign: |y| = 16 * 6e4 / 4)
    x[0:16, 7] = torch.linspace(-3, 3, 16, dtype=dtype) * 1.001  # values off the dtype's grid after the RHT
    for case in ("finite", "nan"):
        if case == "nan":
            x[40, 9] = float("nan")
        amax_x, amax_rht = tk.wgrad_amax(x.to(DEVICE))
        want = formats.rht(x.t()).float().abs().amax()
        assert torch.equal(amax_rht.cpu().isnan(), want.isnan())
        if case == "finite":
            assert torch.equal(amax_rht.cpu(), want)
            assert torch.equal(amax_x.cpu(), x.float().abs().amax())


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_e2m1_ties_and_steps(dtype):
    """With amax = inf the global scale is 1 and a block holding 6 has scale 1: codes see x itself
    (bf16: the packed RNE form takes the signs from the input's words)."""
    f32 = np.float32
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    around = [np.nextafter(f32(t), f32(d)) for t in ties + [0.5, 1.0, 6.0] for d in (0, 8)]
    grid = list(formats.E2M1_VALUES) + ties + around + [7.0, 1e-30, 1e-40, 0.1, 2.9, 4.9]
    values = torch.tensor(grid, dtype=torch.float32)
    values = torch.cat([values, -values, torch.rand(512, generator=torch.Generator().manual_seed(0)) * 6.5])
    x = torch.cat([torch.full((values.numel(), 1), 6.0), values[:, None].expand(-1, 15)], dim=1).to(dtype)
    amax = torch.tensor(float("inf"))
    for rounding in ("rne", "sr"):
        out = tk.quantize_1x16(x.to(DEVICE), rounding, seed=21, amax=amax.to(DEVICE))
        assert_same_quantization(*out, formats.quantize(x, rounding=rounding, seed=21, amax=amax))


@pytest.mark.slow
@pytest.mark.parametrize("decoded", [False, True], ids=["codes", "decoded"])
def test_e2m1_sr_at_each_elements_draw(decoded):
    """SR decides hi when u = bits * 2**-16 < frac: every element is put exactly on its own draw (frac ==
    u: lo) and one float32 step either side, in each grid interval; below 0.5 those steps are finer
    than 2**-23, the resolution of the kernel's fixed point there. Elements whose draw is 0 hold
    subnormal float32 values: any frac > 0 beats that draw, so they round up to 0.5 (an addition that
    flushed subnormals to zero would keep them at 0). Global and block scale 1 (amax = inf, a 6 in
    each block), so codes see x itself. The packed codes and the decoded form (its own arithmetic on
    the GPU: m + 1 rounded upward) are both checked."""
    rows, seed = 4096, 77
    bits = formats.sr_random_bits(rows * 16, seed).reshape(rows, 16).float()
    gen = torch.Generator().manual_seed(3)
    grid = torch.tensor(formats.E2M1_VALUES)
    lo_idx = torch.randint(0, 7, (rows, 16), generator=gen)
    lo, step = grid[lo_idx], grid[lo_idx + 1] - grid[lo_idx]
    on_draw = (lo + bits * 2.0**-16 * step).float()  # exact: at most 17 significant bits
    shift = torch.randint(-1, 2, (rows, 16), generator=gen)  # -1, 0 or +1 float32 step
    x = torch.where(shift > 0, torch.nextafter(on_draw, torch.tensor(8.0)),
                    torch.where(shift < 0, torch.nextafter(on_draw, torch.tensor(0.0)), on_draw))
    zero_draw = bits == 0
    zero_draw[:, 0] = False
    assert zero_draw.sum() >= 1  # this seed and size hold such draws
    x = torch.where(zero_draw, torch.finfo(torch.float32).tiny / 8, x)
    lo_idx = torch.where(zero_draw, 0, lo_idx)
    shift = torch.where(zero_draw, 1, shift)
    x[:, 0] = 6.0
    x = x * torch.where(torch.rand(rows, 16, generator=gen) < 0.5, -1.0, 1.0)
    amax = torch.tensor(float("inf"))
    ref = formats.quantize(x, rounding="sr", seed=seed, amax=amax)
    up = ref.codes()[:, 1:] & 7 > lo_idx[:, 1:]
    assert torch.equal(up, (shift > 0)[:, 1:])  # the reference: hi only above the draw
    if decoded:
        bd, _ = tk.fake_quantize_1x16(x.to(DEVICE), "sr", seed=seed, amax=amax.to(DEVICE))
        assert_same_float(bd, formats.block_decode(ref).to(torch.bfloat16))
    else:
        out = tk.quantize_1x16(x.to(DEVICE), "sr", seed=seed, amax=amax.to(DEVICE))
        assert_same_quantization(*out, ref)


def e4m3_sweep() -> tuple[torch.Tensor, torch.Tensor]:
    """(x, amax): blocks whose maxima put the scale 6 * bamax * fp32(1/6) on every E4M3 value, their
    midpoints (ties to even), next to them, in the subnormal range and above 448; global scale 1."""
    f32 = np.float32
    one_sixth = f32(1.0 / 6.0)
    e4m3 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    targets = np.concatenate([e4m3, (e4m3[1:] + e4m3[:-1]) / 2, [449.0, 464.0, 470.0, 480.0, 1e6, 2.0**-12]])
    bamax = []
    for t in targets.astype(f32):
        b = f32(t / one_sixth)
        for _ in range(3):  # step to a block max whose scaled value is exactly the target, if one exists
            if f32(b * one_sixth) == t:
                break
            b = np.nextafter(b, f32(np.inf) if f32(b * one_sixth) < t else f32(0))
        bamax += [b, np.nextafter(b, f32(0)), np.nextafter(b, f32(np.inf))]
    bamax = torch.tensor(np.array(bamax, dtype=f32))
    return bamax[:, None] * torch.linspace(-1.0, 1.0, 16)[None, :], torch.tensor(float("inf"))


def test_every_scale_converting_launch_says_whether_the_gpu_converts_e4m3(monkeypatch):
    """The kernels default to the bit-level scale conversion; a launch that forgot the E4M3 argument
    would lose the hardware conversion on sm_89 and later without a trace (the bits are the same)."""
    launches = []
    launch = tk.api._launch

    def watch(kernel, grid, *args, **kwargs):
        launches.append((kernel, kwargs))
        return launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(tk.api, "_launch", watch)
    x = sample((32, 64), torch.bfloat16, seed=3).to(DEVICE)
    for rounding in ("rne", "sr"):
        tk.quantize_1x16(x, rounding, seed=1)
        tk.quantize_16x16(x, rounding, seed=1)
        tk.quantize_wgrad_operand(x, rounding, seed=1)
        tk.fake_quantize_1x16(x, rounding, seed=1)
        tk.fake_quantize_wgrad_operand(x, rounding, seed=1)
    amax, amax_t = tk.wgrad_amax(x)
    tk.fake_quantize_dual(x, "sr", 1, amax, "sr", 2, amax_t)
    converting = (tk.rows._quantize_rows_kernel, tk.rht._rht_quantize_kernel, tk.rht._dual_quantize_kernel)
    seen = [kwargs for kernel, kwargs in launches if kernel in converting]
    assert len(seen) >= 11 and all(kwargs.get("E4M3") is tk.launch._hw_e4m3(x.device) for kwargs in seen)


@pytest.mark.slow
def test_e4m3_scale_rounding():
    x, amax = e4m3_sweep()
    out = tk.quantize_1x16(x.to(DEVICE), amax=amax.to(DEVICE))
    assert_same_quantization(*out, formats.quantize(x, amax=amax))


@pytest.mark.parametrize(*first_fast("dtype", DTYPES))
def test_special_values(dtype):
    x = special_values(dtype)
    for rounding in ("rne", "sr"):
        out = tk.quantize_1x16(x.to(DEVICE), rounding, seed=11)
        assert_same_quantization(*out, formats.quantize(x, rounding=rounding, seed=11))
    out = tk.quantize_16x16(x.to(DEVICE))
    assert_same_quantization(*out, formats.quantize(x, block="16x16"))
    out = tk.quantize_wgrad_operand(x.to(DEVICE), "sr", seed=11)
    assert_same_quantization(*out, wgrad_reference(x, "sr", seed=11))


@pytest.mark.parametrize(*first_fast("fill", [0.0, float("inf"), float("nan")]))
def test_zero_and_non_finite(fill):
    x = sample((32, 32), torch.bfloat16, seed=9)
    if fill == 0.0:
        x.zero_()
    else:
        x[5, 7] = fill
        x[20, 30] = -fill
    for rounding in ("rne", "sr"):
        out = tk.quantize_1x16(x.to(DEVICE), rounding, seed=1)
        assert_same_quantization(*out, formats.quantize(x, rounding=rounding, seed=1))
        out = tk.quantize_wgrad_operand(x.to(DEVICE), rounding, seed=1)
        assert_same_quantization(*out, wgrad_reference(x, rounding, seed=1))
    out = tk.quantize_16x16(x.to(DEVICE))
    assert_same_quantization(*out, formats.quantize(x, block="16x16"))
    bd, amax = tk.fake_quantize_1x16(x.to(DEVICE))
    ref = formats.quantize(x)
    assert_same_float(bd, formats.block_decode(ref).to(torch.bfloat16))
    if fill != 0.0:  # NaN/Inf stay visible after quantize -> dequantize
        assert not torch.isfinite(formats.dequantize(ref)).all()


@pytest.mark.parametrize(
    *first_fast("given, fill", [(3.5, None), (0.0, None), (float("inf"), None), (2.0, float("nan")), (2.0, float("inf"))])
)
def test_given_amax(given, fill):
    x = sample((32, 48), torch.bfloat16, seed=10)
    if fill is not None:
        x[3, 3] = fill
    amax = torch.tensor(given)
    out = tk.quantize_1x16(x.to(DEVICE), "sr", seed=2, amax=amax.to(DEVICE))
    assert_same_quantization(*out, formats.quantize(x, rounding="sr", seed=2, amax=amax))
    out = tk.quantize_wgrad_operand(x.to(DEVICE), "rne", amax=amax.to(DEVICE))
    assert_same_quantization(*out, wgrad_reference(x, "rne", amax=amax))


@pytest.mark.parametrize(*first_fast("fill", [None, float("nan"), float("inf")]))
@pytest.mark.parametrize("rounding", ["rne", "sr"])
def test_own_amax_is_one_pass_with_the_same_bits(rounding, fill):
    # The amax computed elsewhere (here by wgrad_amax, as one pass would give both) and passed as the
    # tensor's own: the quantizing pass alone runs, and the bits are those of the two-pass path.
    x = sample((64, 48), torch.bfloat16, seed=12)
    if fill is not None:
        x[5, 7] = fill
    xd = x.to(DEVICE)
    amax_x, amax_rht = tk.wgrad_amax(xd)
    out = tk.quantize_1x16(xd, rounding, seed=3, amax=amax_x, amax_is_own=True)
    assert_same_quantization(*out, formats.quantize(x, rounding=rounding, seed=3))
    out = tk.quantize_wgrad_operand(xd, rounding, seed=3, amax=amax_rht, amax_is_own=True)
    assert_same_quantization(*out, wgrad_reference(x, rounding, seed=3))
    bd, amax = tk.fake_quantize_1x16(xd, rounding, seed=3, amax=amax_x, amax_is_own=True)
    assert_same_float(bd, formats.block_decode(formats.quantize(x, rounding=rounding, seed=3)).to(torch.bfloat16))
    bd, amax = tk.fake_quantize_wgrad_operand(xd, rounding, seed=3, amax=amax_rht, amax_is_own=True)
    assert_same_float(bd, formats.block_decode(wgrad_reference(x, rounding, seed=3)).to(torch.bfloat16))
    out = tk.quantize_16x16(xd, amax=amax_x, amax_is_own=True)
    assert_same_quantization(*out, formats.quantize(x, block="16x16"))
    with pytest.raises(ValueError, match="amax_is_own"):
        tk.quantize_1x16(xd, amax_is_own=True)


@pytest.mark.parametrize("rounding", ["rne", "sr"])
def test_fake_quantize(rounding):
    x = sample((32, 64), torch.bfloat16, seed=11)
    bd, amax = tk.fake_quantize_1x16(x.to(DEVICE), rounding, seed=4)
    ref = formats.quantize(x, rounding=rounding, seed=4)
    assert_same_float(bd, formats.block_decode(ref).to(torch.bfloat16))
    assert torch.equal(amax.cpu(), ref.amax)
    bd, amax = tk.fake_quantize_16x16(x.to(DEVICE))
    assert_same_float(bd, formats.block_decode(formats.quantize(x, block="16x16")).to(torch.bfloat16))
    bd, amax = tk.fake_quantize_wgrad_operand(x.to(DEVICE), rounding, seed=4)
    ref = wgrad_reference(x, rounding, seed=4)
    assert_same_float(bd, formats.block_decode(ref).to(torch.bfloat16))
    assert torch.equal(amax.cpu(), ref.amax)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_and_block_decode(dtype):
    x = special_values(torch.float32)[:48]
    ref = formats.quantize(x, rounding="sr", seed=3)
    data, scales = ref.data.view(torch.uint8), ref.scales.view(torch.uint8)
    out = tk.dequantize(data.to(DEVICE), scales.to(DEVICE), ref.amax.to(DEVICE), dtype)
    assert_same_float(out, formats.dequantize(ref, dtype))
    out = tk.dequantize(data.to(DEVICE), formats.swizzle_scales(scales).to(DEVICE), ref.amax.to(DEVICE), dtype, swizzled=True)
    assert_same_float(out, formats.dequantize(ref, dtype))
    assert_same_float(tk.block_decode(data.to(DEVICE), scales.to(DEVICE)), formats.block_decode(ref).to(torch.bfloat16))


@pytest.mark.parametrize("shape", [(16, 16), (48, 80), (128, 192), (80, 256)])
def test_transpose_tiles_equals_the_reference_transpose(shape):
    # Shapes that fill the 64x64 tile and shapes the tile masks; every code and scale value occurs.
    w = sample(shape, torch.float32, seed=shape[0] + shape[1])
    q = formats.quantize(w, block="16x16")
    data, scales = tk.transpose_tiles(q.data.view(torch.uint8).to(DEVICE), q.scales.view(torch.uint8).to(DEVICE))
    t = q.transpose()
    assert torch.equal(data.cpu(), t.data.view(torch.uint8)) and data.shape == (shape[1], shape[0] // 2)
    assert torch.equal(scales.cpu(), t.scales.view(torch.uint8)) and scales.shape == (shape[1], shape[0] // 16)
    # Transposing twice gives the weight back; the op on CUDA runs this kernel.
    back = tk.transpose_tiles(data, scales)
    assert torch.equal(back[0].cpu(), q.data.view(torch.uint8)) and torch.equal(back[1].cpu(), q.scales.view(torch.uint8))


def test_emulated_scaled_mm():
    a, b = sample((32, 64), torch.bfloat16, seed=12), sample((48, 64), torch.bfloat16, seed=13)
    a_bd, amax_a = tk.fake_quantize_1x16(a.to(DEVICE))
    b_bd, amax_b = tk.fake_quantize_16x16(b.to(DEVICE))
    out = tk.emulated_scaled_mm(a_bd, amax_a, b_bd, amax_b, torch.float32).cpu()
    qa, qb = formats.quantize(a), formats.quantize(b, block="16x16")
    expected = formats.dequantize(qa).double() @ formats.dequantize(qb).double().t()
    assert out.shape == (32, 48)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def _exact_sum_operands(m, n, k, seed):
    """bf16 operands whose products and fp32 sums are exact (small integers): every summation order
    gives the same fp32 accumulator, so only the epilogue decides the output bits."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-6, 7, (m, k), generator=g).to(torch.bfloat16)
    b = torch.randint(-6, 7, (n, k), generator=g).to(torch.bfloat16)
    return a, b


def test_emulated_scaled_mm_applies_alpha_once():
    """cast(acc * alpha) with alpha = (amax_a / 2688) * (amax_b / 2688), not (acc * s_a) * s_b: amaxes
    chosen so that the two orders round differently for some outputs."""
    a, b = _exact_sum_operands(32, 48, 64, seed=3)
    amax_a, amax_b = torch.tensor(3.0e-3), torch.tensor(7.77e2)
    acc = a.double() @ b.double().t()
    alpha = formats.gemm_alpha(amax_a, amax_b)
    assert alpha.dtype == torch.float32 and alpha == formats.global_decode_scale(amax_a) * formats.global_decode_scale(amax_b)
    once = acc.float() * alpha
    twice = acc.float() * formats.global_decode_scale(amax_a) * formats.global_decode_scale(amax_b)
    assert not torch.equal(once, twice)  # the fp32 output tells the two orders apart
    for out_dtype in (torch.bfloat16, torch.float32):
        out = tk.emulated_scaled_mm(a.to(DEVICE), amax_a.to(DEVICE), b.to(DEVICE), amax_b.to(DEVICE), out_dtype).cpu()
        assert out.dtype == out_dtype
        assert_same_float(out, (acc.float() * alpha).to(out_dtype))
        # The CPU reference of the emulated GEMM applies the same single alpha.
        assert_same_float(ops.emulated_mm(a, amax_a, b, amax_b, "nvfp4", out_dtype), (acc.float() * alpha).to(out_dtype))
    assert torch.equal(tk.gemm_alpha(amax_a.to(DEVICE), amax_b.to(DEVICE), 5).cpu(), alpha.expand(5))


def test_shape_errors():
    with pytest.raises(ValueError, match="multiple of 16"):
        tk.quantize_1x16(torch.zeros(4, 24, device=DEVICE))
    with pytest.raises(ValueError, match="multiple of 16"):
        tk.quantize_wgrad_operand(torch.zeros(24, 16, device=DEVICE))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        tk.quantize_1x16(torch.zeros(4, 16, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match="rounding"):
        tk.quantize_1x16(torch.zeros(4, 16, device=DEVICE), "stochastic")


# ----------------------------------------------------------------------------------------------
# GPU, larger shapes
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rounding", ["rne", "sr"])
def test_gpu_large(rounding):
    x = sample((1024, 2048), torch.bfloat16, seed=20, spread=2.0)
    seed = 0x123456789ABCDEF
    out = tk.quantize_1x16(x.cuda(), rounding, seed=seed)
    assert_same_quantization(*out, formats.quantize(x, rounding=rounding, seed=seed))
    out = tk.quantize_1x16(x.cuda(), rounding, seed=seed, swizzle=True)
    assert_same_quantization(*out, formats.quantize(x, rounding=rounding, seed=seed), swizzled=True)
    out = tk.quantize_16x16(x.cuda(), rounding, seed=seed)
    assert_same_quantization(*out, formats.quantize(x, block="16x16", rounding=rounding, seed=seed))
    out = tk.quantize_wgrad_operand(x.cuda(), rounding, seed=seed)
    assert_same_quantization(*out, wgrad_reference(x, rounding, seed=seed))
    bd, _ = tk.fake_quantize_wgrad_operand(x.cuda(), rounding, seed=seed)
    assert_same_float(bd, formats.block_decode(wgrad_reference(x, rounding, seed=seed)).to(torch.bfloat16))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_special_values(dtype):
    x = special_values(dtype).repeat(4, 8)
    for rounding in ("rne", "sr"):
        out = tk.quantize_1x16(x.cuda(), rounding, seed=77)
        assert_same_quantization(*out, formats.quantize(x, rounding=rounding, seed=77))
        out = tk.quantize_wgrad_operand(x.cuda(), rounding, seed=77)
        assert_same_quantization(*out, wgrad_reference(x, rounding, seed=77))
    data, scales, amax = tk.quantize_1x16(x.cuda())
    ref = formats.quantize(x)
    assert_same_float(tk.dequantize(data, scales, amax), formats.dequantize(ref))


@pytest.mark.gpu
@gpu
def test_gpu_given_amax_non_finite():
    x = sample((256, 512), torch.bfloat16, seed=21)
    x[100, 200] = float("inf")
    amax = torch.tensor(5.0)
    out = tk.quantize_1x16(x.cuda(), "sr", seed=8, amax=amax.cuda())
    assert_same_quantization(*out, formats.quantize(x, rounding="sr", seed=8, amax=amax))
    out = tk.quantize_wgrad_operand(x.cuda(), "sr", seed=8, amax=amax.cuda())
    assert_same_quantization(*out, wgrad_reference(x, "sr", seed=8, amax=amax))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rounding", ["rne", "sr"])
def test_gpu_block_scales_without_fp8_hardware(monkeypatch, rounding):
    """The path GPUs before sm_89 (A100, A10) take, run on this GPU: block scales converted to E4M3 on
    the bits (``_e4m3``) instead of by the hardware, the same bits as the reference, special values
    included, in every kernel that converts scales."""
    monkeypatch.setattr(tk.api, "_hw_e4m3", lambda device: False)
    flags = []
    launch = tk.api._launch

    def watch(kernel, grid, *args, **kwargs):
        if "E4M3" in kwargs:
            flags.append(kwargs["E4M3"])
        return launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(tk.api, "_launch", watch)
    sweep, inf = e4m3_sweep()  # every E4M3 scale code, midpoints and neighbours
    out = tk.quantize_1x16(sweep.cuda(), amax=inf.cuda())
    assert_same_quantization(*out, formats.quantize(sweep, amax=inf))
    # Zero blocks, -0, E2M1 ties, subnormal inputs and tiny blocks next to ordinary ones (not the bf16-max
    # row, which would leave every other block with a zero scale): many scale codes, subnormal ones too.
    x = sample((512, 1024), torch.bfloat16, seed=23, spread=4.0)
    x[:4, :64] = special_values(torch.bfloat16)[:4]
    codes = formats.quantize(x).scales.view(torch.uint8)
    assert codes.unique().numel() > 50 and ((codes > 0) & (codes < 8)).any()
    seed = 0x5EED
    assert_same_quantization(*tk.quantize_1x16(x.cuda(), rounding, seed=seed),
                             formats.quantize(x, rounding=rounding, seed=seed))
    ref = formats.quantize(x, block="16x16", rounding=rounding, seed=seed)
    assert_same_quantization(*tk.quantize_16x16(x.cuda(), rounding, seed=seed), ref)
    bd, _ = tk.fake_quantize_1x16(x.cuda(), rounding, seed=seed)
    assert_same_float(bd, formats.block_decode(formats.quantize(x, rounding=rounding, seed=seed)).to(torch.bfloat16))
    ref_t = wgrad_reference(x, rounding, seed=seed)
    bd_t, _ = tk.fake_quantize_wgrad_operand(x.cuda(), rounding, seed=seed)
    assert_same_float(bd_t, formats.block_decode(ref_t).to(torch.bfloat16))
    amax, amax_t = tk.wgrad_amax(x.cuda())
    dual, dual_t = tk.fake_quantize_dual(x.cuda(), rounding, seed, amax, "sr", seed + 1, amax_t)
    assert_same_float(dual, tk.fake_quantize_1x16(x.cuda(), rounding, seed=seed, amax=amax, amax_is_own=True)[0])
    assert_same_float(dual_t, tk.fake_quantize_wgrad_operand(x.cuda(), "sr", seed=seed + 1, amax=amax_t,
                                                             amax_is_own=True)[0])
    assert flags and not any(flags)  # every quantizer launch took the bit-level path


# ----------------------------------------------------------------------------------------------
# The fused fp4.rht_quantize op the weight-gradient operands use
# ----------------------------------------------------------------------------------------------


def _op_reference(x, rounding, seed, fmt="nvfp4", block="1x16"):
    """fp4.quantize(fp4.rht(x)) on the CPU: the two unfused ops, same SR stream."""
    import fp4compile  # noqa: F401  (registers the ops)

    return torch.ops.fp4.quantize(torch.ops.fp4.rht(x.cpu(), 16), fmt, block, rounding, seed, "")


FORMAT_BLOCKS = [("nvfp4", "1x16"), ("mxfp4", "1x32")]


@pytest.mark.parametrize("fmt, block", FORMAT_BLOCKS)
@pytest.mark.parametrize("rounding", ["rne", "sr"])
def test_rht_quantize_op_equals_the_two_ops_on_cpu(rounding, fmt, block):
    x = sample((64, 64), torch.bfloat16, seed=30)
    got = torch.ops.fp4.rht_quantize(x, 16, fmt, block, rounding, 1234, "")
    for g, w in zip(got, _op_reference(x, rounding, 1234, fmt, block)):
        assert torch.equal(g, w)
    with pytest.raises(FloatingPointError, match="layer 'l' wgrad operand X"):
        x[3, 5] = float("nan")
        torch.ops.fp4.rht_quantize(x, 16, fmt, block, rounding, 1234, "layer 'l' wgrad operand X")
    # A finite operand that overflows in the transform: the error counts the transformed values.
    big = torch.full((32, 32), 60000.0, dtype=torch.float16)
    with pytest.raises(FloatingPointError, match=r"0 NaN, (\d+) Inf") as err:
        torch.ops.fp4.rht_quantize(big, 16, fmt, block, rounding, 1, "layer 'l' wgrad operand dY^T")
    assert int(err.value.args[0].split(" NaN, ")[1].split(" Inf")[0]) > 0


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt, block", FORMAT_BLOCKS)
@pytest.mark.parametrize("rounding", ["rne", "sr"])
def test_gpu_rht_quantize_op_takes_the_fused_kernel(rounding, fmt, block):
    from fp4compile import executors

    tokens = sample((2048, 768), torch.bfloat16, seed=31)  # [tokens, K]: the wgrad operand is its transpose
    assert executors.choose("rht_quantize", tokens.cuda().t(), 16, fmt, block, rounding, 99, None, None).name == "triton"
    want = _op_reference(tokens.t(), rounding, 99, fmt, block)
    for operand in (tokens.cuda().t(), tokens.t().contiguous().cuda()):  # transposed view and contiguous
        got = torch.ops.fp4.rht_quantize(operand, 16, fmt, block, rounding, 99, "")
        for g, w in zip(got, want):
            assert torch.equal(g.cpu(), w)


# ----------------------------------------------------------------------------------------------
# MXFP4
# ----------------------------------------------------------------------------------------------


def _mx_special_values(dtype):
    x = special_values(dtype)
    x[5, :32] = 0.0
    x[6, 32:] = float("inf")  # an Inf block: scale NaN, codes as the reference computes them
    x[7, 3] = float("-inf")
    x[8, 40] = float("nan")
    # Subnormal block maxima (the interpreter reads bf16 subnormals as zero, so bf16 gets them on the GPU only).
    x[9, :32] = torch.finfo(dtype).tiny / (4 if dtype != torch.bfloat16 or CUDA else 0.25)
    return x


def assert_same_mx_quantization(data, scales, amax, ref: formats.QTensor, ref_input):
    """Same scale bytes and codes as the MXFP4 ``ref`` (code magnitudes only where the reference's scaled
    value is NaN, as ``assert_same_quantization``), and amax = max |ref_input|, what ``fp4.quantize``
    reports for MXFP4: the same bits, or NaN where that is NaN (the NaN's payload is not compared)."""
    data, scales, amax = data.cpu(), scales.cpu(), amax.cpu()
    assert scales.dtype == torch.uint8 and scales.shape == ref.scales.shape
    bad = (scales != ref.scales.view(torch.uint8)).nonzero()
    assert len(bad) == 0, f"{len(bad)} scales differ, first at {bad[0].tolist()}"
    codes, ref_codes = formats.unpack_e2m1(data), ref.codes()
    assert codes.shape == ref_codes.shape
    nan = torch.isnan(formats.block_decode(ref))
    same = torch.where(nan, (codes & 7) == (ref_codes & 7), codes == ref_codes)
    assert same.all(), f"{int((~same).sum())} codes differ, first at {(~same).nonzero()[0].tolist()}"
    want = ref_input.float().abs().amax()
    assert amax.dtype == torch.float32 and amax.shape == ()
    assert torch.equal(amax, want) or (amax.isnan().item() and want.isnan().item()), (amax, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rounding", ["rne", "sr"])
def test_quantize_mxfp4(dtype, rounding):
    for x in (sample((32, 128), dtype, seed=40), _mx_special_values(dtype)):
        data, scales, amax = tk.quantize_mxfp4(x.to(DEVICE), rounding, seed=BIG_SEED)
        ref = formats.quantize(x, "mxfp4", "1x32", rounding, seed=BIG_SEED)
        assert scales.shape == (x.shape[0], x.shape[1] // 32)
        assert_same_mx_quantization(data, scales, amax, ref, x)
        # The amax comes from the quantizing pass: the bits of the separate amax reduction, NaN included.
        assert torch.equal(amax.view(torch.int32), tk.global_amax(x.to(DEVICE)).view(torch.int32))


def test_mxfp4_choice_and_shape_errors():
    from fp4compile import executors

    x = torch.zeros(4, 48, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of 32"):
        tk.quantize_mxfp4(x)
    choice = executors.choose("quantize", torch.zeros(4, 64), "mxfp4", "1x32", "rne", 0, None, None)
    assert choice.name == "reference"  # CPU tensors: the reference
    assert choice.declined == (("triton", "its input is on cpu, not CUDA"),)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rounding", ["rne", "sr"])
def test_gpu_mxfp4_large(rounding):
    x = sample((1024, 2048), torch.bfloat16, seed=41, spread=4.0)
    data, scales, amax = tk.quantize_mxfp4(x.cuda(), rounding, seed=5)
    ref = formats.quantize(x, "mxfp4", "1x32", rounding, seed=5)
    assert torch.equal(scales.cpu(), ref.scales.view(torch.uint8))
    assert torch.equal(formats.unpack_e2m1(data.cpu()), ref.codes())
    for dtype in DTYPES:
        x = _mx_special_values(dtype).repeat(4, 4)
        data, scales, amax = tk.quantize_mxfp4(x.cuda(), rounding, seed=6)
        ref = formats.quantize(x, "mxfp4", "1x32", rounding, seed=6)
        assert torch.equal(scales.cpu(), ref.scales.view(torch.uint8))
        nan = torch.isnan(formats.block_decode(ref))
        codes, ref_codes = formats.unpack_e2m1(data.cpu()), ref.codes()
        assert torch.where(nan, (codes & 7) == (ref_codes & 7), codes == ref_codes).all()


def _wide_range(rows, cols, seed, decade, spread, dtype):
    """Normal values scaled by 2**decade, each times 2**U[-spread, spread], in ``dtype`` (overflow -> 0)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g, dtype=torch.float64) * 2.0**decade
    x = (x * torch.exp2(torch.randint(-spread, spread + 1, x.shape, generator=g).double())).to(dtype)
    return x if torch.isfinite(x).all() else torch.nan_to_num(x, posinf=0.0, neginf=0.0)


@settings(max_examples=15, deadline=None, database=None, derandomize=True)
@given(
    st.integers(1, 40), st.integers(1, 3), st.integers(-40, 40), st.integers(0, 30),
    st.sampled_from(["rne", "sr"]), st.sampled_from(DTYPES), st.integers(0, 2**64 - 1),
)
def test_quantize_mxfp4_property(rows, k_blocks, decade, spread, rounding, dtype, seed):
    x = _wide_range(rows, 32 * k_blocks, rows * 1000 + k_blocks * 100 + spread, decade, spread, dtype)
    data, scales, _ = tk.quantize_mxfp4(x.to(DEVICE), rounding, seed=seed)
    ref = formats.quantize(x, "mxfp4", "1x32", rounding, seed=seed)
    assert torch.equal(scales.cpu(), ref.scales.view(torch.uint8))
    assert torch.equal(formats.unpack_e2m1(data.cpu()), ref.codes())


# ----------------------------------------------------------------------------------------------
# MXFP4 weight-gradient operand: quantize(RHT(x^T)) with 32-token blocks of two RHT chunks
# ----------------------------------------------------------------------------------------------


def mx_wgrad_reference(x, rounding, seed=None):
    """(formats.quantize(rht(x2^T), "mxfp4", "1x32"), rht(x2^T)) with x2 = x as [tokens, K]."""
    x2 = x.reshape(-1, x.shape[-1])
    y = formats.rht(x2.t().contiguous(), 16)
    return formats.quantize(y, "mxfp4", "1x32", rounding, seed=seed), y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rounding", ["rne", "sr"])
def test_quantize_wgrad_operand_mxfp4(dtype, rounding):
    x = sample((96, 48), dtype, seed=42)  # 96 tokens, 48 features: neither a multiple of the tile
    data, scales, amax = tk.quantize_wgrad_operand_mxfp4(x.to(DEVICE), rounding, seed=BIG_SEED)
    assert data.shape == (48, 48) and scales.shape == (48, 3)
    assert_same_mx_quantization(data, scales, amax, *mx_wgrad_reference(x, rounding, seed=BIG_SEED))
    # The same seed gives the same bits.
    again = tk.quantize_wgrad_operand_mxfp4(x.to(DEVICE), rounding, seed=BIG_SEED)
    assert all(torch.equal(a, b) for a, b in zip(again, (data, scales, amax)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_wgrad_operand_mxfp4_special_values(dtype):
    """Zero blocks, -0, subnormals, ties, tiny and huge blocks, an Inf block, a lone -Inf and a NaN (each
    spreads over its 16-token RHT chunk), and for float16 an overflow to Inf in the transform."""
    x = _mx_special_values(dtype).t().contiguous()  # [64 tokens, 64 features]: the special rows become columns
    if dtype == torch.float16:
        x[32:48, 10] = 60000.0  # finite, but 16 * 60000 / 4 overflows float16 after the RHT
    for rounding in ("rne", "sr"):
        out = tk.quantize_wgrad_operand_mxfp4(x.to(DEVICE), rounding, seed=11)
        ref, y = mx_wgrad_reference(x, rounding, seed=11)
        assert_same_mx_quantization(*out, ref, y)
        assert out[2].isnan()  # the NaN wins the amax, as in the reference


@pytest.mark.parametrize("fill", [0.0, float("inf"), float("nan")])
def test_quantize_wgrad_operand_mxfp4_zero_and_non_finite(fill):
    """The reported amax: 0 for a zero tensor, Inf for an Inf (its chunk becomes +-Inf), NaN for a NaN
    (the kernel's atomic max over the |y| bits sorts NaN above Inf, so any NaN wins, as in torch.amax)."""
    x = sample((64, 32), torch.bfloat16, seed=43)
    if fill == 0.0:
        x.zero_()
    else:
        x[5, 7] = fill
    for rounding in ("rne", "sr"):
        data, scales, amax = tk.quantize_wgrad_operand_mxfp4(x.to(DEVICE), rounding, seed=1)
        ref, y = mx_wgrad_reference(x, rounding, seed=1)
        assert_same_mx_quantization(data, scales, amax, ref, y)
        if fill == 0.0:
            assert amax.item() == 0.0 and (scales.cpu() == 0).all()  # E8M0 2**-127
        elif fill == float("inf"):
            assert amax.item() == float("inf") and (scales.cpu()[7, :1] == 0xFF).all()
        else:
            assert amax.isnan() and (scales.cpu()[7, :1] == 0xFF).all()


def test_quantize_wgrad_operand_mxfp4_batched_and_strided():
    x = sample((2, 48, 40), torch.bfloat16, seed=44)  # 96 tokens in two leading dims
    data, scales, amax = tk.quantize_wgrad_operand_mxfp4(x.to(DEVICE), "sr", seed=3)
    assert data.shape == (40, 48) and scales.shape == (40, 3)
    assert_same_mx_quantization(data, scales, amax, *mx_wgrad_reference(x, "sr", seed=3))
    wide = sample((32, 96), torch.float16, seed=45)
    view = wide.to(DEVICE)[:, 16:56]  # token rows with a stride of 96
    out = tk.quantize_wgrad_operand_mxfp4(view, "rne")
    assert_same_mx_quantization(*out, *mx_wgrad_reference(wide[:, 16:56], "rne"))


@pytest.mark.parametrize("config", [dict(BLOCK_M=64, BLOCK_K=16, num_warps=4), dict(BLOCK_M=128, BLOCK_K=32, num_warps=4)])
def test_quantize_wgrad_operand_mxfp4_tiles(monkeypatch, config):
    """Other launch configurations give the same bits: partial token tiles, several tiles along K."""
    monkeypatch.setitem(tk.CONFIGS, "rht_quantize_mx", config)
    x = sample((96, 48), torch.float16, seed=48)
    out = tk.quantize_wgrad_operand_mxfp4(x.to(DEVICE), "sr", seed=BIG_SEED)
    assert_same_mx_quantization(*out, *mx_wgrad_reference(x, "sr", seed=BIG_SEED))


def test_quantize_wgrad_operand_mxfp4_shape_errors():
    with pytest.raises(ValueError, match=r"48 rows \(shape \(48, 16\)\) is not a multiple of 32"):
        tk.quantize_wgrad_operand_mxfp4(torch.zeros(48, 16, device=DEVICE))
    with pytest.raises(ValueError, match=r"48 rows \(shape \(3, 16, 8\)\) is not a multiple of 32"):
        tk.quantize_wgrad_operand_mxfp4(torch.zeros(3, 16, 8, device=DEVICE))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        tk.quantize_wgrad_operand_mxfp4(torch.zeros(32, 16, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match="rounding"):
        tk.quantize_wgrad_operand_mxfp4(torch.zeros(32, 16, device=DEVICE), "stochastic")


class _CudaOperand:
    """What the Triton checks read of an operand, as a CUDA tensor of that shape and dtype shows it."""

    is_cuda = True

    def __init__(self, shape, dtype=torch.bfloat16):
        self.shape, self.dtype = torch.Size(shape), dtype

    def dim(self):
        return len(self.shape)

    def numel(self):
        return self.shape.numel()


def test_rht_quantize_check():
    """The fused kernels take [K, tokens] operands of the shapes they handle; otherwise the check says why."""
    assert tk.available()[0]  # the interpreter, here
    check = tk.dispatch.check_rht_quantize
    for fmt, block, tokens in (("nvfp4", "1x16", 48), ("mxfp4", "1x32", 64)):
        assert check(_CudaOperand((40, tokens)), 16, fmt, block) == (True, "")
    declined = {
        "rows of 48 elements, not a multiple of 32": (_CudaOperand((40, 48)), 16, "mxfp4", "1x32"),  # 48 tokens
        "a 32-point RHT": (_CudaOperand((40, 64)), 32, "mxfp4", "1x32"),
        "no fused RHT quantizer for mxfp4 with 1x16 blocks": (_CudaOperand((40, 64)), 16, "mxfp4", "1x16"),
        "no fused RHT quantizer for nvfp4 with 16x16 blocks": (_CudaOperand((40, 64)), 16, "nvfp4", "16x16"),
        "a 3-D operand": (_CudaOperand((2, 40, 64)), 16, "mxfp4", "1x32"),
        "an input of shape (0, 64)": (_CudaOperand((0, 64)), 16, "mxfp4", "1x32"),
        "a torch.float64 input": (_CudaOperand((40, 64), torch.float64), 16, "mxfp4", "1x32"),
        "its input is on cpu, not CUDA": (torch.zeros(40, 64), 16, "mxfp4", "1x32"),
    }
    for why, args in declined.items():
        ok, reason = check(*args)
        assert not ok and reason.startswith(why), (why, reason)
    # The MXFP4 kernel takes the [K, tokens] operand (transposed view) and returns what the op's reference
    # does; off CUDA the node's stream is the host's ``runtime.sr_seed``.
    tokens = sample((64, 40), torch.bfloat16, seed=46)
    for rounding in ("rne", "sr"):
        got = tk.dispatch.rht_quantize(tokens.to(DEVICE).t(), 16, "mxfp4", "1x32", rounding, 77)
        y = formats.rht(tokens.t(), 16)
        seed = runtime.sr_seed(77) if rounding == "sr" else 0
        assert_same_mx_quantization(*got, formats.quantize(y, "mxfp4", "1x32", rounding, seed=seed), y)


@settings(max_examples=15, deadline=None, database=None, derandomize=True)
@given(
    st.integers(1, 3), st.integers(1, 40), st.integers(-40, 40), st.integers(0, 30),
    st.sampled_from(["rne", "sr"]), st.sampled_from(DTYPES), st.integers(0, 2**64 - 1),
)
def test_quantize_wgrad_operand_mxfp4_property(t_blocks, k, decade, spread, rounding, dtype, seed):
    x = _wide_range(32 * t_blocks, k, t_blocks * 1000 + k * 100 + spread, decade, spread, dtype)
    data, scales, amax = tk.quantize_wgrad_operand_mxfp4(x.to(DEVICE), rounding, seed=seed)
    assert_same_mx_quantization(data, scales, amax, *mx_wgrad_reference(x, rounding, seed=seed))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rounding", ["rne", "sr"])
def test_gpu_wgrad_mxfp4_large(rounding):
    x = sample((2048, 1024), torch.bfloat16, seed=47, spread=4.0)  # [tokens, K]
    out = tk.quantize_wgrad_operand_mxfp4(x.cuda(), rounding, seed=0x123456789ABCDEF)
    assert_same_mx_quantization(*out, *mx_wgrad_reference(x, rounding, seed=0x123456789ABCDEF))
    for dtype in DTYPES:
        x = _mx_special_values(dtype).t().contiguous().repeat(4, 4)
        if dtype == torch.float16:
            x[32:48, 10] = 60000.0
        out = tk.quantize_wgrad_operand_mxfp4(x.cuda(), rounding, seed=6)
        assert_same_mx_quantization(*out, *mx_wgrad_reference(x, rounding, seed=6))


# ----------------------------------------------------------------------------------------------
# SR seeds read on the device (runtime.DeviceSeed): what CUDA-graph replays rely on
# ----------------------------------------------------------------------------------------------

NODES = (0, 1, (1 << 63) - 1, 0x5DEECE66D2A3F0B1)  # node constants are 63-bit


@pytest.fixture
def sr_state():
    from fp4compile import runtime

    saved = runtime.get_rng_state()
    runtime.set_rng_state({"seed": 0xC0FFEE, "step": 41})
    yield runtime
    runtime.set_rng_state(saved)


def _device_seed_cases():
    def wgrad(x, rounding, seed):
        return tk.quantize_wgrad_operand(x, rounding, seed=seed)

    def wgrad_ref(x, seed):
        return wgrad_reference(x, "sr", seed=seed)

    return {
        "1x16": (tk.quantize_1x16, lambda x, s: formats.quantize(x, rounding="sr", seed=s), (48, 96)),
        "16x16": (tk.quantize_16x16, lambda x, s: formats.quantize(x, block="16x16", rounding="sr", seed=s), (32, 48)),
        "wgrad": (wgrad, wgrad_ref, (64, 40)),
        "mxfp4": (tk.quantize_mxfp4, lambda x, s: formats.quantize(x, "mxfp4", "1x32", "sr", seed=s), (40, 96)),
        "wgrad_mxfp4": (
            tk.quantize_wgrad_operand_mxfp4,
            lambda x, s: formats.quantize(formats.rht(x.t()), "mxfp4", "1x32", "sr", seed=s),
            (64, 24),
        ),
    }


@pytest.mark.parametrize(*first_fast("case", list(_device_seed_cases())))
def test_device_seed_equals_the_host_seed(case, sr_state):
    """A DeviceSeed(node) gives the bits of runtime.sr_seed(node), and after the step advances the same
    arguments give the next step's bits: the kernel reads the base when it runs."""
    runtime = sr_state
    kernel, reference, shape = _device_seed_cases()[case]
    x = sample(shape, torch.bfloat16, seed=40)
    for node in NODES:
        seed = runtime.device_seed(node, DEVICE)
        data, scales, amax = kernel(x.to(DEVICE), "sr", seed)
        ref = reference(x, runtime.sr_seed(node))
        assert torch.equal(data.cpu(), ref.data.view(torch.uint8)), node
        assert torch.equal(scales.cpu(), ref.scales.view(torch.uint8)), node
    before = data.cpu()
    runtime.advance()
    data, _, _ = kernel(x.to(DEVICE), "sr", seed)  # same arguments, new step
    assert torch.equal(data.cpu(), reference(x, runtime.sr_seed(NODES[-1])).data.view(torch.uint8))
    assert not torch.equal(data.cpu(), before)


def test_device_base_follows_the_rng_state(sr_state):
    runtime = sr_state
    base = runtime.device_base(DEVICE)
    assert base is runtime.device_base(DEVICE) and base.dtype == torch.int64 and base.shape == (1,)

    def expected():
        state = runtime.get_rng_state()
        return runtime._signed64(runtime._mix64(state["seed"] ^ runtime._mix64(state["step"])))

    assert int(base) == expected()
    runtime.advance()
    assert int(base) == expected()
    runtime.set_rng_state({"seed": 5, "step": 2})
    assert int(base) == expected()
    runtime.manual_seed(9)
    state = runtime.get_rng_state()
    assert int(base) == expected() and (state["seed"], state["step"]) == (9, 0)


def test_device_base_made_under_inference_mode_still_advances(sr_state, monkeypatch):
    """An evaluation under inference_mode may be the first to ask for the base: it must stay an ordinary
    tensor, which training steps then update in place."""
    runtime = sr_state
    monkeypatch.setattr(runtime, "_device_bases", {})
    with torch.inference_mode():
        base = runtime.device_base(DEVICE)
    assert not base.is_inference()
    runtime.advance()
    runtime.manual_seed(4)
    state = runtime.get_rng_state()
    assert int(base) == runtime._signed64(runtime._mix64(state["seed"] ^ runtime._mix64(state["step"])))


def test_sr_state_refuses_to_change_while_a_cuda_graph_records(sr_state, monkeypatch):
    """Capturing the whole training step by hand would freeze the step's base into the graph: the state
    change (and a first allocation of a base) raises instead, and the state stays as it was."""
    runtime = sr_state
    runtime.device_base(DEVICE)
    before = runtime.get_rng_state()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    for change in (runtime.advance, lambda: runtime.manual_seed(1), lambda: runtime.set_rng_state(before)):
        with pytest.raises(RuntimeError, match="mode='reduce-overhead'"):
            change()
    assert runtime.get_rng_state() == before
    monkeypatch.setattr(runtime, "_device_bases", {})
    with pytest.raises(RuntimeError, match="call runtime.device_base first"):
        runtime.device_base("cpu")


def test_device_seed_errors_and_rne(sr_state):
    runtime = sr_state
    x = sample((16, 32), torch.bfloat16, seed=41).to(DEVICE)
    wrong = runtime.DeviceSeed(3, torch.zeros(1, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="DeviceSeed base must be one int64"):
        tk.quantize_1x16(x, "sr", seed=wrong)
    # Round-to-nearest ignores the seed, whatever it is.
    for a, b in zip(tk.quantize_1x16(x, "rne", seed=wrong), tk.quantize_1x16(x, "rne")):
        assert torch.equal(a, b)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rounding", ["rne", "sr"])
def test_gpu_decoded_ops_equal_decoded_packed_ops(rounding, sr_state):
    """fp4.fake_quantize / fake_rht_quantize / emulated_mm on CUDA (the Triton fake-quant kernels) against
    fp4.quantize / rht_quantize / scaled_mm on the same operands: the same bits."""
    import fp4compile  # noqa: F401

    ops = torch.ops.fp4
    x = sample((1024, 768), torch.bfloat16, seed=50, spread=2.0).cuda()
    w = sample((512, 768), torch.float32, seed=51).cuda()
    for t, block in ((x, "1x16"), (w, "16x16"), (w.t(), "16x16")):
        decoded, amax = ops.fake_quantize(t, "nvfp4", block, rounding, 77, "")
        data, scales, amax_q = ops.quantize(t, "nvfp4", block, rounding, 77, "")
        assert torch.equal(amax, amax_q)
        assert torch.equal(decoded, tk.block_decode(data, scales))
    xt = x.t()  # the [K, tokens] view a wgrad quantizes
    decoded, amax = ops.fake_rht_quantize(xt, 16, "nvfp4", "1x16", rounding, 78, "")
    data, scales, amax_q = ops.rht_quantize(xt, 16, "nvfp4", "1x16", rounding, 78, "")
    assert torch.equal(amax, amax_q) and torch.equal(decoded, tk.block_decode(data, scales))
    a, b = ops.quantize(x, "nvfp4", "1x16", rounding, 1, ""), ops.quantize(w, "nvfp4", "16x16", "rne", 2, "")
    a_bd, a_amax = ops.fake_quantize(x, "nvfp4", "1x16", rounding, 1, "")
    b_bd, b_amax = ops.fake_quantize(w, "nvfp4", "16x16", "rne", 2, "")
    for dtype in (torch.float32, torch.bfloat16):
        packed = ops.scaled_mm(*a, *b, "nvfp4", dtype, "emulation")
        assert torch.equal(ops.emulated_mm(a_bd, a_amax, b_bd, b_amax, "nvfp4", dtype), packed)


# ----------------------------------------------------------------------------------------------
# machine code for sm_90, built without a GPU
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_kernels_compile_for_hopper_with_whole_blocks_per_thread():
    # The interpreter does not compile anything; this builds the default-configuration kernels for
    # sm_90 (benchmarks/kernel_sass.py, in a fresh process without TRITON_INTERPRET) and bounds their
    # instructions per element. Bounds sit a little above the counts of the layout that keeps whole
    # blocks in one thread, draws SR bits for two elements from one hash and rounds stochastically in
    # fixed point (24, 36, 34.0, 46.0; the decoded-output RHT form 33.8 and both SR quantizations of the
    # dual launch 72.2, 83.2 before the decoded forms took the ceiling by an upward-rounded addition)
    # and takes the RHT amax before rounding (13.1; 15 rounding every value). The
    # decoded-output 1x16 form runs at a tile measured faster at the training step's shapes, 16 elements
    # per thread, which spreads each thread's fixed work over fewer elements: 27.0 (21.2 at 32). The layout
    # that spread blocks measured 30, 60, 63, 94, 26, one hash per element 57 and 69 for SR, and SR through
    # the grid neighbours in floating point 47 and 59. Reading bf16 1x16 blocks as pair words, their block
    # maxima as float maxima and the hardware E4M3 conversion of scales (decoded RHT form and 1x16 only)
    # took the 1x16 forms to 23.0, 32.5 and 26.0 and the dual launch to 70.2. One hash per SR word (the
    # stream key hashed once per block of pairs) took 1x16 SR to 29.5, RHT + SR to 42.2 and the dual
    # launch to 63.8. The packed 1x16 form now takes 4 tiles per program, loading the next before it
    # quantizes the one loaded: the count covers the first tile's loads and one pass of the loop
    # (25.8 RNE, 32.0 SR); the wgrad amax likewise (14.2, with its per-tile reduction gone). Packed 1x16
    # RNE codes read off r * 2**-126 on the FMA pipe, and the pair signs from the bf16 words: 23.2. The
    # wgrad amax counts its programs with an atomic and the last one copies both maxima out of the one
    # zero-filled accumulator buffer (32 instructions, run once per program of 4 tiles): 14.4 to 14.9.
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, os.path.join(root, "benchmarks", "kernel_sass.py")],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    per_element = {line.split()[0]: float(line.split()[-1]) for line in out.stdout.splitlines()[1:]}
    bounds = {"rows_rne": 24.5, "rht_rne": 40, "rows_sr": 34, "rht_sr": 45, "rows_rne_fake": 28, "rht_rne_fake": 37,
              "dual_sr_fake": 67, "wgrad_amax": 15}
    assert set(per_element) == set(bounds), out.stdout
    for name, bound in bounds.items():
        assert per_element[name] <= bound, (name, per_element[name], out.stdout)


@pytest.mark.slow
def test_kernels_compile_for_the_a100():
    """GPUs before sm_89 have no fp32 -> E4M3 conversion and Triton refuses to emit one for them: every
    kernel specialization that converts block scales (and the others kernel_sass.py builds) must still
    compile for sm_80 (block scales on the bits, ``_e4m3``), as it is launched there."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, os.path.join(root, "benchmarks", "kernel_sass.py"), "--arch", "80", "--extra"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    names = {line.split()[0] for line in out.stdout.splitlines()[1:]}
    assert names == {"rows_rne", "rht_rne", "rows_sr", "rht_sr", "rows_rne_fake", "rht_rne_fake", "dual_sr_fake",
                     "tiles16_sr", "wgrad_amax"}, out.stdout
