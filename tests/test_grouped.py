"""Grouped (MoE expert) quantization and GEMMs: per-expert scales, bit for bit against quantizing each
expert on its own, and every token distribution (experts with no, one, or most tokens)."""

from __future__ import annotations

import pytest
import torch

from fp4compile import formats, grouped, reference

E, N, K = 4, 32, 48
COUNTS = [(0, 1, 37, 18), (16, 16, 16, 16), (0, 0, 0, 5), (0, 0, 0, 0), (1, 0, 0, 0)]


def _expert_range(scale_per_expert):
    """Experts whose values differ by orders of magnitude: each one's range must set only its own scale."""
    return torch.tensor(scale_per_expert, dtype=torch.float32)


def _rows(counts, k=K, seed=0):
    g = torch.Generator().manual_seed(seed)
    scale = torch.cat([torch.full((c, 1), 10.0 ** (e - 2)) for e, c in enumerate(counts)] or [torch.zeros(0, 1)])
    return torch.randn(sum(counts), k, generator=g) * scale


def _packed(q: formats.QTensor):
    return q.data.view(torch.uint8), q.scales.view(torch.uint8)


def test_weight_quantization_is_per_expert_bit_exact():
    w = torch.randn(E, N, K) * _expert_range([1e-3, 1.0, 30.0, 1e2])[:, None, None]
    codes, scales, amax = grouped.quantize_weight(w)
    for e in range(E):
        ref = formats.quantize(w[e], "nvfp4", "16x16")
        assert torch.equal(codes[e], _packed(ref)[0]) and torch.equal(scales[e].view(torch.uint8), _packed(ref)[1])
        assert torch.equal(amax[e], ref.amax)


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("sr", [False, True])
def test_row_quantization_is_per_expert_bit_exact(counts, sr):
    x = _rows(counts)
    seeds = [11 + 7 * e for e in range(E)] if sr else None
    codes, scales, amax = grouped.quantize_rows(x, counts, seeds)
    start = 0
    for e, c in enumerate(counts):
        ref = formats.quantize(x[start:start + c], "nvfp4", "1x16", "sr" if sr else "rne", seed=seeds[e] if sr else None)
        assert torch.equal(codes[start:start + c], _packed(ref)[0])
        assert torch.equal(scales[start:start + c].view(torch.uint8), _packed(ref)[1])
        assert amax[e].item() == ref.amax.item()
        start += c


@pytest.mark.parametrize("sr", [False, True])
def test_column_quantization_is_per_expert_bit_exact(sr):
    widths = [0, 16, 48, 32]
    x = torch.randn(N, sum(widths)) * torch.cat([torch.full((w,), 10.0 ** e) for e, w in enumerate(widths)])
    seeds = [3, 5, 7, 9] if sr else None
    codes, scales, amax = grouped.quantize_columns(x, widths, seeds)
    start = 0
    for e, w in enumerate(widths):
        ref = formats.quantize(x[:, start:start + w].contiguous(), "nvfp4", "1x16", "sr" if sr else "rne",
                               seed=seeds[e] if sr else None)
        assert torch.equal(codes[:, start // 2:(start + w) // 2], _packed(ref)[0])
        assert torch.equal(scales[:, start // 16:(start + w) // 16].view(torch.uint8), _packed(ref)[1])
        assert amax[e].item() == ref.amax.item()
        start += w


def test_nan_in_one_expert_stays_in_that_expert():
    x = _rows([4, 4, 4, 4])
    x[5, 3] = float("nan")
    _, _, amax = grouped.quantize_rows(x, [4, 4, 4, 4])
    assert torch.isnan(amax[1]) and torch.isfinite(amax[[0, 2, 3]]).all()


@pytest.mark.parametrize("counts", COUNTS)
def test_grouped_gemms_match_per_expert_dense_reference(counts):
    torch.manual_seed(0)
    x, dy = _rows(counts), _rows(counts, N, seed=1)
    w = torch.randn(E, N, K)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    seeds = [[100 + e for e in range(E)], [200 + e for e in range(E)]]
    fprop = grouped.grouped_gemm(x, w, offs, "fprop", True, True, *seeds, torch.float32)
    dgrad = grouped.grouped_gemm(dy, w, offs, "dgrad", True, False, *seeds, torch.float32)
    wgrad = grouped.grouped_gemm(dy, x, offs, "wgrad", True, False, *seeds, torch.float32)
    assert fprop.shape == (sum(counts), N) and dgrad.shape == (sum(counts), K) and wgrad.shape == (E, N, K)
    start = 0
    for e, c in enumerate(counts):
        rows = slice(start, start + c)
        q = lambda t, block="1x16": formats.quantize(t.contiguous(), "nvfp4", block)  # noqa: E731
        qx, qw, qdy = q(x[rows]), q(w[e], "16x16"), q(dy[rows])
        ref = reference.decoded_product(formats.block_decode(qx), qx.amax, formats.block_decode(qw), qw.amax, "nvfp4", torch.float32)
        torch.testing.assert_close(fprop[rows], ref, rtol=1e-6, atol=0)
        ref = reference.decoded_product(formats.block_decode(qdy), qdy.amax, formats.block_decode(qw).t(), qw.amax, "nvfp4",
                                   torch.float32)
        torch.testing.assert_close(dgrad[rows], ref, rtol=1e-6, atol=0)
        # wgrad: the expert's tokens zero-padded to 16, RHT along them, 1x16 blocks along them.
        pad = -c % 16
        dyt = formats.rht(torch.nn.functional.pad(dy[rows].t(), (0, pad)), 16)
        xt = formats.rht(torch.nn.functional.pad(x[rows].t(), (0, pad)), 16)
        if c:
            qa, qb = q(dyt), q(xt)
            ref = reference.decoded_product(formats.block_decode(qa), qa.amax, formats.block_decode(qb), qb.amax, "nvfp4",
                                       torch.float32)
        else:
            ref = torch.zeros(N, K)
        torch.testing.assert_close(wgrad[e], ref, rtol=1e-6, atol=0)
        start += c


@pytest.mark.parametrize("counts", COUNTS)
def test_grouped_linear_trains_close_to_high_precision(counts):
    torch.manual_seed(0)
    x = torch.randn(sum(counts), K, requires_grad=True)
    w = torch.randn(E, N, K, requires_grad=True)
    offs = torch.tensor(counts).cumsum(0)
    plan = grouped.site_plan(fp4compile_recipe(), "experts.gate_up_proj", E)
    y = grouped.linear(x, w, offs, plan)
    y.square().sum().backward()
    ref_x, ref_w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ends = offs.tolist()
    ref = torch.cat([ref_x[a:b] @ ref_w[e].t() for e, (a, b) in enumerate(zip([0, *ends[:-1]], ends))])
    ref.square().sum().backward()
    for got, want in ((y, ref), (x.grad, ref_x.grad), (w.grad, ref_w.grad)):
        assert got.shape == want.shape and torch.isfinite(got).all()
        if want.numel():
            assert (got - want).norm() <= 0.25 * want.norm() + 1e-6
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.equal(w.grad[e], torch.zeros(N, K))  # an expert without tokens gets no gradient


def fp4compile_recipe():
    import fp4compile

    return fp4compile.Recipe()


def test_gathered_bmm_is_the_grouped_linear_in_token_order():
    torch.manual_seed(0)
    ids = torch.tensor([3, 0, 3, 3, 1, 0, 3])
    x = torch.randn(len(ids), K)
    w = torch.randn(E, N, K)
    plan = grouped.site_plan(fp4compile_recipe(), "experts.down_proj", E)
    out = grouped.gathered_bmm(w, x.unsqueeze(-1), ids, True, plan)
    assert out.shape == (len(ids), N, 1)
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids, minlength=E)
    sorted_out = grouped.linear(x[order], w, counts.cumsum(0), plan)
    assert torch.equal(out.squeeze(-1)[order], sorted_out)
    transposed = grouped.gathered_bmm(x.unsqueeze(1), w.transpose(1, 2).contiguous(), ids, False, plan)
    assert torch.equal(transposed.squeeze(1), out.squeeze(-1))


def test_bad_offsets_and_shapes_are_named():
    w = torch.randn(E, N, K)
    with pytest.raises(ValueError, match="non-decreasing"):
        grouped.grouped_gemm(torch.randn(8, K), w, torch.tensor([4, 2, 8, 8]), "fprop", True, False, [0] * E, [0] * E,
                             torch.float32)
    with pytest.raises(ValueError, match=r"grouped weight .*\(4, 32, 40\)"):
        grouped.quantize_weight(torch.randn(E, N, 40))
