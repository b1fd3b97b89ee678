"""The CUTLASS grouped (MoE) kernel path on a simulated Blackwell device: selection, packing of the
per-expert arrays, first use, fallback and the allow_emulation error; and, where nvcc and the CUTLASS
headers exist (marker ``nvcc``), a real sm_100a build whose PTX holds the block-scaled tcgen05 MMA.

The kernel is replaced by ``simulated_grouped_kernel``: a CPU model of the binding's contract that
reads each group through the table (byte offsets of its codes and scales, expert, M, N, K), decodes
the scales at CUTLASS's tiled-layout offsets of that group and writes alpha[e] * A_g . B_g^T at D's
offset."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import test_cutlass_runtime
from test_cutlass_runtime import blackwell  # noqa: F401  (fixture)

from fp4compile import executors, formats, grouped
from fp4compile.codegen import cutlass_gemm, cutlass_grouped, cutlass_grouped_runtime as cgr
from fp4compile.codegen.cutlass_gemm import KernelBuildError
from fp4compile.codegen.cutlass_grouped import GROUP_COLUMNS, GroupedGemmConfig
from fp4compile.codegen.cutlass_runtime import CutlassKernelError
from fp4compile.recipe import Recipe
from fp4compile.passes import grouped_sites


def _decode(codes: torch.Tensor, swizzled: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """What the kernel multiplies for one group: code value * scale read at the tiled-layout offset."""
    blocks = k // 16
    r = torch.arange(rows)[:, None].expand(rows, blocks)
    c = torch.arange(blocks)[None, :].expand(rows, blocks)
    scales = swizzled.view(torch.float8_e4m3fn)[formats.swizzled_offset(r, c, blocks).reshape(-1)].float()
    values = formats.decode_e2m1(formats.unpack_e2m1(codes.reshape(rows, k // 2)))
    return values * scales.reshape(rows, blocks).repeat_interleave(16, dim=1)


def simulated_grouped_kernel(config: GroupedGemmConfig, calls=None):
    def run(a, sa, a_amax, b, sb, b_amax, groups, out):
        assert groups.device.type == "cpu" and groups.dtype == torch.int64 and groups.shape[1] == len(GROUP_COLUMNS)
        assert out.dtype == config.torch_out_dtype and out.is_contiguous()
        flat = out.view(-1)
        for e, m, n, k, ao, bo, sao, sbo, do in groups.tolist():
            assert m > 0 and n % 32 == 0 and k % 32 == 0 and all(o % 16 == 0 for o in (ao, bo, sao, sbo, do))
            pad = lambda rows: -(-rows // 128) * 128 * (-(-(k // 16) // 4) * 4)  # noqa: E731
            a_g = _decode(a[ao:ao + m * k // 2], sa[sao:sao + pad(m)], m, k)
            b_g = _decode(b[bo:bo + n * k // 2], sb[sbo:sbo + pad(n)], n, k)
            d = (a_g @ b_g.T) * formats.gemm_alpha(a_amax[e], b_amax[e])
            at = do // out.element_size()
            flat[at:at + m * n] = d.to(out.dtype).reshape(-1)
        if calls is not None:
            calls.append(groups.clone())

    return run


def _loader(monkeypatch, make_kernel):
    return test_cutlass_runtime._loader(monkeypatch, make_kernel, cutlass_grouped)


@pytest.fixture
def grouped_blackwell(blackwell):  # noqa: F811
    cgr.reset()
    yield
    cgr.reset()


# ----------------------------------------------------------------------------------------------
# Configurations and selection
# ----------------------------------------------------------------------------------------------


def test_configs_render_and_round_trip():
    configs = cutlass_grouped.supported_configs()
    assert {(c.schedule, c.tile_n, c.out_dtype) for c in configs} == {
        (s, n, o) for s in ("1sm", "2sm") for n in (64, 128) for o in ("bf16", "fp32")}
    for config in configs:
        assert GroupedGemmConfig.from_name(config.name) == config
        source = cutlass_grouped.render(config)
        sm = config.sms_per_tile
        assert f"KernelPtrArrayTmaWarpSpecialized{sm}SmNvf4Sm100" in source and "GroupProblemShape" in source
        assert f"Shape<_{config.tile_m}, _{config.tile_n}, _256>" in source
        assert f"kColumns = {len(GROUP_COLUMNS)}" in cutlass_grouped.render_binding(config)
    with pytest.raises(ValueError, match="not a CUTLASS NVFP4 grouped GEMM"):
        GroupedGemmConfig.from_name("nvfp4_gemm_1sm_128x128x256_c1x1_bf16")
    with pytest.raises(ValueError, match="tile_n must be one of"):
        GroupedGemmConfig("1sm", 192)


@pytest.mark.parametrize("role, n, k, why", [
    ("fprop", 100, 64, "N=100 is not a multiple of 32"),
    ("fprop", 64, 48, "K=48 is not a multiple of 32"),
    ("dgrad", 48, 64, "K=48 is not a multiple of 32"),  # dgrad reduces over the out features
    ("dgrad", 64, 48, "N=48 is not a multiple of 32"),
    ("wgrad", 64, 48, "N=48 is not a multiple of 32"),
])
def test_selection_rules(role, n, k, why):
    config, reason = cutlass_grouped.select_grouped_config(role, n, k, 512, 4)
    assert config is None and why in reason and role in reason


def test_selection_sizes_tiles_by_the_rows_per_expert():
    few, reason = cutlass_grouped.select_grouped_config("fprop", 1024, 1024, 64 * 8, 8, torch.bfloat16)
    many, _ = cutlass_grouped.select_grouped_config("fprop", 4096, 4096, 8192 * 8, 8, torch.bfloat16)
    assert few.schedule == "1sm" and many.schedule == "2sm"
    assert "8 experts" in reason and "64 tokens per expert" in reason
    # wgrad's K is the token count of each expert: any count is taken (padded when packed).
    assert cutlass_grouped.select_grouped_config("wgrad", 64, 96, 8 * 7, 8)[0] is not None
    assert cutlass_grouped.select_grouped_config("fprop", 64, 64, 64, 2, torch.float16)[0] is None
    assert cutlass_grouped.select_grouped_config("fprop", 64, 64, 64, 2, torch.float32)[0].out_dtype == "fp32"


# ----------------------------------------------------------------------------------------------
# Packing: the per-expert arrays against the offsets
# ----------------------------------------------------------------------------------------------


def _up(x, m):
    return -(-x // m) * m


def test_row_packing_matches_the_offsets():
    counts, n, k = [5, 0, 130, 3], 64, 96
    x = torch.randn(sum(counts) + 4, k)
    w = torch.randn(len(counts), n, k)
    ca, sa, _ = grouped.quantize_rows(x, counts)
    cw, sw, _ = grouped.quantize_weight(w)
    packed = cgr.pack_rows(ca, sa, counts, cw, sw, torch.bfloat16)
    sf_cols = _up(k // 16, 4)
    starts = [sum(counts[:e]) for e in range(len(counts))]
    sfa_at = [sum(_up(c, 128) * sf_cols for c in counts[:e]) for e in range(len(counts))]
    expected = [
        (e, counts[e], n, k, starts[e] * k // 2, e * n * k // 2, sfa_at[e], e * 128 * sf_cols, starts[e] * n * 2)
        for e in range(len(counts)) if counts[e]
    ]
    assert packed.table.tolist() == [list(r) for r in expected]  # the zero-token expert is left out
    assert packed.a.numel() == ca.numel() and packed.b.numel() == cw.numel()
    assert packed.a_scales.numel() == sfa_at[-1] + _up(counts[-1], 128) * sf_cols
    assert packed.out.shape == (sum(counts) + 4, n) and torch.equal(packed.out[sum(counts):], torch.zeros(4, n, dtype=torch.bfloat16))
    for e, m, _, _, _, bo, sao, sbo, _ in packed.table.tolist():
        size = _up(m, 128) * sf_cols
        group_scales = formats.unswizzle_scales(packed.a_scales[sao:sao + size], m, k // 16)
        assert torch.equal(group_scales, sa[starts[e]:starts[e] + m].view(torch.uint8))
        w_scales = formats.unswizzle_scales(packed.b_scales[sbo:sbo + 128 * sf_cols], n, k // 16)
        assert torch.equal(w_scales, sw[e].view(torch.uint8))
        assert torch.equal(packed.b[bo:bo + n * k // 2].view(n, k // 2), cw[e])


def test_token_slab_packing_pads_each_expert_to_32():
    widths, n, k = [16, 0, 48, 32], 64, 96
    a = torch.randn(n, sum(widths))
    b = torch.randn(k, sum(widths))
    ca, sa, _ = grouped.quantize_columns(a, widths)
    cb, sb, _ = grouped.quantize_columns(b, widths)
    packed = cgr.pack_token_slabs(ca, sa, cb, sb, widths, torch.float32)
    rows = packed.table.tolist()
    assert [r[0] for r in rows] == [0, 2, 3] and [r[3] for r in rows] == [32, 64, 32]
    assert all(r[1:3] == [n, k] and r[8] == r[0] * n * k * 4 for r in rows)
    assert packed.out.shape == (4, n, k) and not packed.out.any()
    starts = [sum(widths[:e]) for e in range(len(widths))]
    for e, _, _, kp, ao, bo, sao, sbo, _ in rows:
        w, s = widths[e], starts[e]
        for codes, scales, rows_, off, soff, buf, sbuf in ((ca, sa, n, ao, sao, packed.a, packed.a_scales),
                                                           (cb, sb, k, bo, sbo, packed.b, packed.b_scales)):
            slab = buf[off:off + rows_ * kp // 2].view(rows_, kp // 2)
            assert torch.equal(slab[:, :w // 2], codes[:, s // 2:(s + w) // 2]) and not slab[:, w // 2:].any()
            size = _up(rows_, 128) * _up(kp // 16, 4)
            assert torch.equal(formats.unswizzle_scales(sbuf[soff:soff + size], rows_, w // 16),
                               scales[:, s // 16:(s + w) // 16].view(torch.uint8))


# ----------------------------------------------------------------------------------------------
# The path on a simulated B200
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("counts", [[40, 0, 150, 7], [0, 0, 0, 0], [3, 1, 0, 60]])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_simulated_grouped_kernel_matches_emulation(grouped_blackwell, monkeypatch, counts, dtype):
    calls = []
    loads = _loader(monkeypatch, lambda c: simulated_grouped_kernel(c, calls))
    experts, n, k, s = len(counts), 64, 96, sum(counts) + 5
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(s, k, generator=g), torch.randn(s, n, generator=g)
    w = torch.randn(experts, n, k, generator=g) * torch.tensor([1e-2, 1.0, 10.0, 3.0])[:, None, None]
    offs = torch.tensor(counts).cumsum(0)
    seeds = [[5 + e for e in range(experts)], [50 + e for e in range(experts)]]
    used = [e for e, c in enumerate(counts) if c]
    for role, a, b in (("fprop", x, w), ("dgrad", dy, w), ("wgrad", dy, x)):
        choice = cgr.choose(role, n, k, s, experts, dtype, "cuda:0", allow_emulation=False)
        assert choice.name.startswith("cutlass_grouped:nvfp4_grouped_")
        calls.clear()
        got = grouped.grouped_gemm(a, b, offs, role, True, True, *seeds, dtype, choice.name)
        ref = grouped.grouped_gemm(a, b, offs, role, True, True, *seeds, dtype)
        assert got.dtype == ref.dtype and torch.equal(got, ref), role
        if used:  # the launch (after a first use's self-test): one group per expert that got tokens
            assert calls[-1][:, 0].tolist() == used, role
    assert loads and len(set(loads)) == len(loads)  # each configuration loaded (and self-tested) once


def test_plan_names_the_kernel_of_each_role_and_falls_back_with_the_reason(grouped_blackwell, monkeypatch, caplog):
    site = SimpleNamespace(name="layers.0.mlp.experts.down_proj", tokens=512, input_shape=(512, 96), out_features=64,
                           in_features=96, experts=8, precision="nvfp4", reason="NVFP4", roles={})
    kernels = grouped_sites.plan_roles(site, Recipe(), True, torch.device("cuda:0"), torch.bfloat16)
    assert [site.roles[r].kernel for r in ("fprop", "dgrad", "wgrad")] == list(kernels)
    assert all(k.startswith("cutlass_grouped:") and not k.endswith("+emulation") for k in kernels)
    assert "8 experts" in site.roles["fprop"].kernel_reason
    site.out_features = 100  # N (fprop) and K (dgrad) off the 32 grid; wgrad's M is free but its N=96 is fine
    with pytest.raises(executors.CutlassRequired, match=r"layers\.0\.mlp\.experts\.down_proj fprop GEMM .*"
                                                       r"N=100 is not a multiple of 32.*allow_emulation=True"):
        grouped_sites.plan_roles(site, Recipe(), True, torch.device("cuda:0"), torch.bfloat16)
    with caplog.at_level("WARNING", logger="fp4compile"):
        kernels = grouped_sites.plan_roles(site, Recipe(allow_emulation=True), True, torch.device("cuda:0"), torch.bfloat16)
    assert kernels[:2] == (cgr.EMULATION, cgr.EMULATION) and kernels[2].endswith("+emulation")
    assert "N=100 is not a multiple of 32" in site.roles["fprop"].kernel_reason
    assert any("grouped expert GEMMs run in emulation" in r.message for r in caplog.records)
    # Off Blackwell (CPU here): the emulation, whatever the option.
    assert grouped_sites.plan_roles(site, Recipe(), True, torch.device("cpu"), torch.bfloat16) == (cgr.EMULATION,) * 3


def _failing(config):
    raise KernelBuildError(f"nvcc failed for {config.name}")


def _wrong(config):
    good = simulated_grouped_kernel(config)

    def run(*args):
        good(*args)
        args[-1].mul_(2)  # alpha applied twice

    return run


@pytest.mark.parametrize("make_kernel, reason", [(_failing, "nvcc failed"), (_wrong, "disagrees with the emulated GEMM")])
def test_a_failing_grouped_kernel_is_an_error_unless_emulation_is_allowed(grouped_blackwell, monkeypatch, make_kernel, reason):
    loads = _loader(monkeypatch, make_kernel)
    counts, n, k = [9, 0, 20], 64, 64
    x, w, offs = torch.randn(sum(counts), k), torch.randn(3, n, k), torch.tensor(counts).cumsum(0)
    name = cgr.choose("fprop", n, k, 29, 3, torch.bfloat16, "cuda:0", allow_emulation=False).name
    with pytest.raises(CutlassKernelError, match=re.escape(name.split(":")[1]) + ".*" + reason):
        grouped.grouped_gemm(x, w, offs, "fprop", False, False, [0] * 3, [0] * 3, torch.bfloat16, name)
    ref = grouped.grouped_gemm(x, w, offs, "fprop", False, False, [0] * 3, [0] * 3, torch.bfloat16)
    with pytest.warns(UserWarning, match="run in emulation.*" + reason):
        out = grouped.grouped_gemm(x, w, offs, "fprop", False, False, [0] * 3, [0] * 3, torch.bfloat16, name + "+emulation")
    assert torch.equal(out, ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per configuration and device
        grouped.grouped_gemm(x, w, offs, "fprop", False, False, [0] * 3, [0] * 3, torch.bfloat16, name + "+emulation")
    assert len(loads) == 1  # the outcome is remembered


# ----------------------------------------------------------------------------------------------
# Real toolchain (nvcc + CUTLASS headers); no GPU needed
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.nvcc
def test_real_sm100a_grouped_build_uses_block_scaled_tcgen05(tmp_path):
    from test_codegen_cutlass import _toolchain_or_skip

    from fp4compile import config as settings

    _toolchain_or_skip()
    config = GroupedGemmConfig("1sm", 128, "bf16")
    with settings.patch(cache_dir=str(tmp_path / "cache")):
        result = cutlass_grouped.build(config, arch="sm_100a", progress=True)
    ptx = result.ptx.read_text()
    assert ".target sm_100a" in ptx
    assert re.search(r"tcgen05\.mma\.cta_group::1\.kind::mxf4nvf4\.block_scale\.block16", ptx), "no NVFP4 block-scaled MMA"
    stats = cutlass_gemm.build_stats(result)
    assert stats["stages"] >= 3 and stats["spill_stores"] == 0 and stats["spill_loads"] == 0, stats
    cubin = result.paths["cubin"]
    assert cubin.read_bytes()[:4] == b"\x7fELF"
    import shutil
    import subprocess

    import triton  # its package carries a cuobjdump (benchmarks/kernel_sass.py uses it too)

    cuobjdump = shutil.which("cuobjdump") or str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")
    try:
        sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    except (FileNotFoundError, subprocess.CalledProcessError):
        sass = None
    if sass is not None:  # the block-scaled UMMA (4 per 256-deep k-tile) and the scale copies into tensor memory
        assert re.search(r"UTCOMMA\.4X", sass) and "UTCCP" in sass, "no block-scaled UMMA in the SASS"
    nm = shutil.which("nm")
    if nm:
        symbols = subprocess.run([nm, str(result.paths["object"])], capture_output=True, text=True).stdout
        assert f" T {config.name}_run" in symbols and f" T {config.name}_workspace_size" in symbols
