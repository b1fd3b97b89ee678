"""``report.traffic()``: the kernel launches and bytes of a step on CUDA, modelled from the final graphs.

The graphs are compiled on the CPU twice: as for the CPU, and as for a CUDA GPU (``for_cuda``: the passes
take their CUDA decisions, decoded emulated GEMMs and fused amaxes, and the graphs still run on the CPU
through the reference implementations), so that the counts of the graphs a GPU compiles are held here.
"""

from __future__ import annotations

import pytest
import torch

import fp4compile
from fp4compile import traffic
from fp4compile.traffic import Cost, TrafficRow

from models import MLPStack

TOKENS, D = 64, 32  # a batch of 2 x 32 tokens; layers.1.fc: Y [64, 128] = X [64, 32] W[128, 32]^T


@pytest.fixture
def for_cuda(monkeypatch):
    """Compile as for a CUDA GPU: ``lower_gemms`` lowers emulated NVFP4 GEMMs to their decoded form and the
    quantizers' amaxes come from shared passes (``plan_sharing``, ``fuse_amax``), as on a GPU."""
    from fp4compile import vocabulary
    from fp4compile.passes import lower_gemms

    monkeypatch.setattr(lower_gemms, "decodes_on", lambda device: True)
    monkeypatch.setattr(vocabulary, "separate_amax_costs_a_read", lambda val: True)


def _report(**recipe):
    torch.manual_seed(0)
    model = MLPStack(3, D)  # 3 blocks: only block 1 (layers.1.fc, layers.1.out) runs in NVFP4
    return fp4compile.explain(model, torch.randn(2, TOKENS // 2, D), recipe=fp4compile.Recipe(**recipe))


def _rows(report) -> dict:
    return {(r.site, r.role): r for r in report.traffic()}


def _ops(report, site: str, role: str) -> list[str]:
    return sorted(t.op for ctx in report.latest for t in traffic.node_traffic(ctx) if (t.site, t.role) == (site, role))


def test_traffic_of_a_linear_compiled_for_cuda(for_cuda):
    report = _report()
    rows = _rows(report)
    # Only the FP4 sites have rows: the first and last blocks and the head run in high precision.
    assert {site for site, _ in rows} == {"layers.1.fc", "layers.1.out"}
    m, n, k, f32 = TOKENS, 4 * D, D, 4  # layers.1.fc, float32 activations and weights
    codes = lambda rows, cols: rows * cols // 2 + rows * cols // 16  # noqa: E731  (packed codes + E4M3 scales)
    # fprop: W [n, k] quantized 16x16 with its own amax pass (the accumulator's zero-fill, the amax pass and
    # the quantizing pass: 3 launches, 2 reads); one wgrad_amax read of X (after the fill of its
    # accumulators) gives X's amaxes (for fprop and, saved, for wgrad's X^T); X quantized 1x16 in one pass;
    # the amax history (16 floats) recorded (cat + copy); both operands decoded to BF16; the GEMM writes
    # an fp32 [m, n] accumulator that the epilogue kernel reads and writes as the fp32 output.
    assert rows["layers.1.fc", "fprop"] == TrafficRow(
        "layers.1.fc", "fprop", launches=3 + 2 + 1 + 2 + 2 + 1, gemm_launches=1,
        bytes_read=2 * n * k * f32 + m * k * f32 + m * k * f32 + 2 * 16 * f32 + codes(m, k) + codes(n, k) + m * n * f32,
        bytes_written=codes(n, k) + codes(m, k) + 2 * 16 * f32 + 2 * m * k + 2 * n * k + m * n * f32,
    )
    assert _ops(report, "layers.1.fc", "fprop") == sorted(
        ["fp4.quantize", "fp4.quantize", "fp4.wgrad_amax", "fp4.record_amax", "fp4.decode_blocks", "fp4.decode_blocks",
         "fp4.emulated_mm"])
    # dgrad: dX [m, k] = dY [m, n] W: one wgrad_amax read of dY (its two amaxes; fill and pass), one dual
    # launch that reads dY once and writes it quantized 1x16 and, with the RHT, transposed for wgrad
    # (counted here, with the dual node's dgrad label), dY and the stored W decoded (W^T is W read
    # transposed: no packed transpose), the epilogue.
    assert rows["layers.1.fc", "dgrad"] == TrafficRow(
        "layers.1.fc", "dgrad", launches=2 + 1 + 2 + 1, gemm_launches=1,
        bytes_read=m * n * f32 + m * n * f32 + codes(m, n) + codes(n, k) + m * k * f32,
        bytes_written=codes(m, n) + codes(n, m) + 2 * m * n + 2 * n * k + m * k * f32,
    )
    # wgrad: dW [n, k] = RHT(dY^T) RHT(X^T)^T: RHT(dY^T) comes from the dual launch; RHT(X^T) quantized in
    # one pass (amax given); both decoded, the epilogue over [n, k].
    assert rows["layers.1.fc", "wgrad"] == TrafficRow(
        "layers.1.fc", "wgrad", launches=1 + 2 + 1, gemm_launches=1,
        bytes_read=m * k * f32 + codes(n, m) + codes(k, m) + n * k * f32,
        bytes_written=codes(k, m) + 2 * n * m + 2 * k * m + n * k * f32,
    )
    assert rows["layers.1.fc", "fprop"].bytes_read == 85504 and rows["layers.1.fc", "wgrad"].bytes_written == 38016
    # The table's total row is the sum of the rows.
    total = sum((Cost(r.launches, r.gemm_launches, r.bytes_read, r.bytes_written) for r in report.traffic()), Cost())
    # Two FP4 sites: the dual launch reads each dY once for dgrad and wgrad (fc's dY [64, 128], out's [64, 32]).
    assert total == Cost(42, 6, 458496 - 4 * (64 * 128 + 64 * 32), 257280)
    last = report.traffic_table().splitlines()[-1].split()
    assert last == ["total", *map(str, (total.launches, total.gemm_launches, total.bytes_read, total.bytes_written))]
    assert "not modelled" not in report.traffic_table()


def test_decoded_operands_cut_the_decode_launches(for_cuda):
    packed, decoded = _rows(_report(decoded_operands=False)), _rows(_report(decoded_operands=True))
    assert packed.keys() == decoded.keys()
    for key in packed:
        assert decoded[key].launches <= packed[key].launches, key
        assert decoded[key].gemm_launches == packed[key].gemm_launches == 1, key
    # wgrad: both operands written decoded (RHT(dY^T) by the dual launch): no decode pass, 2 launches fewer.
    assert [decoded[s, "wgrad"].launches for s in ("layers.1.fc", "layers.1.out")] == [2, 2]
    assert [packed[s, "wgrad"].launches for s in ("layers.1.fc", "layers.1.out")] == [4, 4]  # dY^T: the dual's
    # fprop: X written decoded (W, quantized once for fprop and dgrad, is still decoded): one launch fewer.
    assert decoded["layers.1.fc", "fprop"].launches == packed["layers.1.fc", "fprop"].launches - 1
    launches = lambda rows: sum(r.launches for r in rows.values())  # noqa: E731
    written = lambda rows: sum(r.bytes_written for r in rows.values())  # noqa: E731
    assert launches(decoded) < launches(packed) and written(decoded) < written(packed)


def test_a_graph_compiled_for_the_cpu_is_costed_as_cuda_runs_its_nodes():
    report = _report()
    rows = _rows(report)
    items = [t for ctx in report.latest for t in traffic.node_traffic(ctx)]
    # The packed emulated GEMM, as CUDA runs it: both operands decoded, the GEMM, its epilogue.
    gemm = next(t for t in items if t.op == "fp4.scaled_mm" and (t.site, t.role) == ("layers.1.fc", "fprop"))
    m, n, k = TOKENS, 4 * D, D
    assert gemm.implementation == "emulation"
    assert gemm.cost == Cost(3, 1, (m * k // 2 + m * k // 16) + (n * k // 2 + n * k // 16) + 4 * m * n,
                             2 * m * k + 2 * n * k + 4 * m * n)
    # Without the CUDA forms, every quantizer makes its own amax pass (after the fill of its accumulator)
    # and dgrad reads W^T's packed transpose.
    assert all(t.cost.launches == 3 for t in items if t.op in ("fp4.quantize", "fp4.rht_quantize"))
    assert rows["layers.1.fc", "dgrad"].launches == 3 + 1 + 3
    # An implementation's entry decides its nodes' cost: an FP4 GEMM reading the packed operands itself.
    saved = traffic.COSTS["scaled_mm", "emulation"]
    try:
        traffic.COSTS["scaled_mm", "emulation"] = traffic.gemm_only
        assert _rows(report)["layers.1.fc", "fprop"].launches == rows["layers.1.fc", "fprop"].launches - 3
        del traffic.COSTS["scaled_mm", "emulation"]
        assert "not modelled: fp4.scaled_mm by emulation (6 nodes)" in report.traffic_table()
    finally:
        traffic.COSTS["scaled_mm", "emulation"] = saved


def test_the_fp4_operand_gemm_halves_the_launches(for_cuda, packed_on_cpu):
    """FP4COMPILE_EMULATED_GEMM=packed, as a GPU compiles it: each GEMM reads its packed operands itself (no
    decode, epilogue or packed transpose kernel; dgrad reads W as stored), so of a linear's non-GEMM
    launches only the quantizers and amax passes remain."""
    rows = _rows(_report())
    m, n, k, f32 = TOKENS, 4 * D, D, 4
    codes = lambda rows, cols: rows * cols // 2 + rows * cols // 16  # noqa: E731
    # fprop: W's amax pass and quantization, X's wgrad_amax and quantization (each amax pass after the
    # zero-fill of its accumulator), the amax record (cat, copy).
    assert rows["layers.1.fc", "fprop"] == TrafficRow(
        "layers.1.fc", "fprop", launches=3 + 2 + 1 + 2, gemm_launches=1,
        bytes_read=2 * n * k * f32 + m * k * f32 + m * k * f32 + 2 * 16 * f32,
        bytes_written=codes(n, k) + codes(m, k) + 2 * 16 * f32,
    )
    # dgrad: dY's wgrad_amax (fill and pass) and the dual launch (dY 1x16 and RHT(dY^T) packed); wgrad:
    # RHT(X^T) alone.
    assert rows["layers.1.fc", "dgrad"] == TrafficRow(
        "layers.1.fc", "dgrad", launches=3, gemm_launches=1, bytes_read=2 * m * n * f32,
        bytes_written=codes(m, n) + codes(n, m))
    assert rows["layers.1.fc", "wgrad"] == TrafficRow(
        "layers.1.fc", "wgrad", launches=1, gemm_launches=1, bytes_read=m * k * f32, bytes_written=codes(k, m))
    total = sum((Cost(r.launches, r.gemm_launches, r.bytes_read, r.bytes_written) for r in rows.values()), Cost())
    assert (total.launches, total.gemm_launches) == (24, 6)  # 42 non-GEMM launches with decoded GEMMs


@pytest.mark.slow
def test_an_amax_reduced_in_the_producer_costs_its_second_stage(for_cuda):
    """Without the RHT, X operands take their amax from a reduction Inductor fuses into their producer
    (``fuse_amax``, under Inductor only): its second stage is a launch, and X's quantizer then makes one
    pass, where its own amax would cost a fill and a pass more."""
    torch.manual_seed(0)
    report = fp4compile.explain(MLPStack(3, D), torch.randn(2, TOKENS // 2, D), recipe=fp4compile.Recipe(rht=False),
                                inner="inductor")
    items = [t for ctx in report.latest for t in traffic.node_traffic(ctx)]
    for site in ("layers.1.fc", "layers.1.out"):
        fprop = [t for t in items if (t.site, t.role) == (site, "fprop")]
        assert [t.cost for t in fprop if t.op == "aten.amax"] == [Cost(1, 0, 0, 0)]
        # W (16x16, own amax: fill, amax pass, quantizing pass) and X (amax given: one pass).
        assert sorted(t.cost.launches for t in fprop if t.op == "fp4.quantize") == [1, 3]
