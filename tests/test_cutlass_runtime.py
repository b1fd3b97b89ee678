"""The CUTLASS path on a simulated Blackwell device: pure selection, first use, self-test, failure policy.

No Blackwell GPU runs here, so the kernel is replaced by ``simulated_kernel``: a CPU model of the
generated kernel that reads exactly what the binding hands it (packed codes [rows, K/2] with K padded
to 32, E4M3 scales at the byte offsets of CUTLASS's 128x4 tiled layout, the two amax values) and
computes alpha * sum(code * scale . code * scale) in fp32. The device checks are monkeypatched to
report a compute capability 10.0 GPU.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._dynamo.source import ConstantSource
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

import fp4compile
from fp4compile import executors, formats, ops, reference
from fp4compile.codegen import cutlass_gemm, cutlass_runtime, cutlass_toolkit
from fp4compile.codegen.cutlass_gemm import GemmConfig, KernelBuildError
from fp4compile.codegen.cutlass_runtime import CutlassKernelError


def simulated_kernel(config: GemmConfig):
    """A CPU stand-in for ``torch.ops.fp4compile_cutlass.<config.name>`` with the binding's contract."""

    def run(a, sfa, a_amax, b, sfb, b_amax, bias=None):
        k = a.shape[1] * 2
        assert k % cutlass_gemm.ALIGN_K == 0, "the binding refuses K % 32 != 0"
        cutlass_runtime.check_operands(config.name, "A", a, sfa, a_amax, k)
        cutlass_runtime.check_operands(config.name, "B", b, sfb, b_amax, k)

        def decode(data, swizzled):
            rows, blocks = data.shape[0], k // 16
            r = torch.arange(rows)[:, None].expand(rows, blocks)
            c = torch.arange(blocks)[None, :].expand(rows, blocks)
            offsets = formats.swizzled_offset(r, c, blocks)  # where CUTLASS's layout reads scale (r, c)
            scales = swizzled.view(torch.float8_e4m3fn)[offsets.reshape(-1)].reshape(rows, blocks).float()
            values = formats.decode_e2m1(formats.unpack_e2m1(data.view(torch.uint8)))
            return values * scales.repeat_interleave(16, dim=1)

        acc = decode(a, sfa) @ decode(b, sfb).T
        out = acc * formats.gemm_alpha(a_amax, b_amax)
        if bias is not None:
            out = out + bias.float()
        return out.to(config.torch_out_dtype)

    return run


@pytest.fixture
def blackwell(monkeypatch):
    """Device checks that report a B200 (compute capability 10.0) as cuda:0, and a fresh first-use state."""
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA B200")
    cutlass_runtime.reset()
    yield
    cutlass_runtime.reset()


def _loader(monkeypatch, make_kernel, module=cutlass_gemm):
    """Replace ``module.load`` by one that records the configurations it loads and returns ``make_kernel(config)``."""
    loads = []

    def load(config, arch=None, progress=True, device=None):
        loads.append(config.name)
        return make_kernel(config)

    monkeypatch.setattr(module, "load", load)
    return loads


def _operands(m, n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qa = formats.quantize(torch.randn(m, k, generator=gen) * 3)
    qb = formats.quantize(torch.randn(n, k, generator=gen), block="16x16")
    return qa, qb


def _args(qa, qb):
    """The GEMM's operands with their scales in the tiled layout, as the quantizers write them for CUTLASS."""
    return (qa.data, formats.swizzle_scales(qa.scales), qa.amax, qb.data, formats.swizzle_scales(qb.scales), qb.amax)


# ----------------------------------------------------------------------------------------------
# Selection: pure, symbolic M, K padded
# ----------------------------------------------------------------------------------------------


def _symint(hint: int):
    env = ShapeEnv()
    return env.create_symintnode(env.create_symbol(hint, ConstantSource("tokens"), dynamic_dim=DimDynamic.DYNAMIC), hint=hint)


def test_symbolic_m_selects_from_its_size_hint():
    m = _symint(16384)
    config, reason = cutlass_gemm.select_config(m, 4096, 4096, torch.bfloat16)
    assert config == cutlass_gemm.select_config(16384, 4096, 4096, torch.bfloat16)[0]
    assert "symbolic, sized for its hint 16384" in reason
    unknown, reason = cutlass_gemm.select_config(None, 4096, 4096)
    assert unknown == cutlass_gemm.select_config(cutlass_gemm.DEFAULT_M_HINT, 4096, 4096)[0]
    # wgrad: K is the token count, symbolic under dynamic shapes; padded at run time.
    config, reason = cutlass_gemm.select_config(4096, 1024, _symint(4112))
    assert config is not None and "zero-padded to a multiple of 32" in reason
    assert cutlass_gemm.select_config(4096, _symint(1024), 4096)[0] is None


def test_selection_builds_nothing(blackwell, monkeypatch):
    def no_build(*args, **kwargs):
        raise AssertionError("selection built or loaded a kernel")

    monkeypatch.setattr(cutlass_gemm, "build", no_build)
    monkeypatch.setattr(cutlass_gemm, "load", no_build)
    choice = executors.choose_gemm(_symint(3000), 4096, 4096, "nvfp4", torch.bfloat16, "cuda:0", allow_emulation=False)
    assert choice.name.startswith("cutlass:nvfp4_gemm_") and not choice.name.endswith("+emulation")
    allowed = executors.choose_gemm(3000, 4096, 4096, "nvfp4", torch.bfloat16, "cuda:0", allow_emulation=True)
    assert allowed.name == choice.name + "+emulation"
    assert cutlass_runtime.parse_kernel(allowed.name) == (GemmConfig.from_name(choice.name[len("cutlass:"):]), True)


@pytest.mark.parametrize(
    "shape, fmt, why", [((128, 100, 64), "nvfp4", "N=100 is not a multiple of 32"), ((128, 128, 64), "mxfp4", "NVFP4 only")]
)
def test_off_the_kernels_on_blackwell_is_an_error_unless_emulation_is_allowed(blackwell, monkeypatch, shape, fmt, why):
    monkeypatch.setattr(executors, "_notices", set())
    with pytest.raises(executors.CutlassRequired, match=why) as info:
        executors.choose_gemm(*shape, fmt, torch.bfloat16, "cuda:0", allow_emulation=False)
    assert "allow_emulation=True" in str(info.value)
    choice = executors.choose_gemm(*shape, fmt, torch.bfloat16, "cuda:0", allow_emulation=True)
    assert choice.name == "emulation" and why in choice.reason


def test_other_gpus_emulate_without_the_option(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")
    monkeypatch.setattr(executors, "_notices", set())
    choice = executors.choose_gemm(128, 128, 64, "nvfp4", torch.bfloat16, "cuda:0", allow_emulation=False)
    assert choice.name == "emulation" and "9.0" in choice.reason


# ----------------------------------------------------------------------------------------------
# The simulated path: bit-equal to emulation, wgrad's K padded to 32
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m, n, k", [(300, 256, 512), (130, 64, 16 * 37), (64, 96, 48)])  # K % 32 == 16 twice
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_simulated_cutlass_path_is_bit_equal_to_emulation(blackwell, monkeypatch, m, n, k, out_dtype):
    loads = _loader(monkeypatch, simulated_kernel)
    qa, qb = _operands(m, n, k)
    config = cutlass_gemm.select_config(m, n, k, out_dtype)[0]
    kernel = cutlass_runtime.kernel_name(config, allow_emulation=False)
    got = executors.run_scaled_mm(kernel, *_args(qa, qb), "nvfp4", out_dtype)
    expected = reference.scaled_mm_reference(*_args(qa, qb), "nvfp4", out_dtype)
    assert torch.equal(got.view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32),
                       expected.view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32))
    executors.run_scaled_mm(kernel, *_args(qa, qb), "nvfp4", out_dtype)
    assert loads == [config.name], "loaded and self-tested once per configuration and device"


def test_padded_wgrad_operands_are_bit_equal_to_emulation(blackwell, monkeypatch):
    """dW = dY^T X with 272 tokens (272 % 32 == 16): both operands quantized along tokens, K padded to 288
    with zero codes; the tiled scale layout already has the column."""
    _loader(monkeypatch, simulated_kernel)
    gen = torch.Generator().manual_seed(3)
    dy, x = torch.randn(272, 64, generator=gen), torch.randn(272, 96, generator=gen)
    qa = formats.quantize(formats.rht(dy.T.contiguous()), rounding="sr", seed=7)
    qb = formats.quantize(formats.rht(x.T.contiguous()))
    a, sa, b, sb = cutlass_runtime.prepare_operands(*_args(qa, qb)[:2], *_args(qa, qb)[3:5])
    assert a.shape == (64, 144) and b.shape == (96, 144)  # 288 / 2 bytes per row
    assert sa.numel() == formats.swizzle_scales(qa.scales).numel() == cutlass_gemm.expected_scales_numel(64, 288)
    assert torch.equal(a.view(torch.uint8)[:, 136:], torch.zeros(64, 8, dtype=torch.uint8))
    kernel = cutlass_runtime.kernel_name(cutlass_gemm.select_config(64, 96, 272, torch.float32)[0], False)
    got = executors.run_scaled_mm(kernel, *_args(qa, qb), "nvfp4", torch.float32)
    assert torch.equal(got.view(torch.int32), reference.scaled_mm_reference(*_args(qa, qb), "nvfp4", torch.float32).view(torch.int32))


# ----------------------------------------------------------------------------------------------
# First use: failures are errors, or emulation with one warning where the recipe allows it
# ----------------------------------------------------------------------------------------------


def _raising(message):
    def make(config):
        def run(*args):
            raise RuntimeError(f"{config.name}: {message}")

        return run

    return make


def _wrong_layout(config):
    """A kernel that reads the scales row-major instead of tiled (what an unswizzled operand would give)."""
    simulated = simulated_kernel(config)

    def run(a, sfa, a_amax, b, sfb, b_amax, bias=None):
        k = a.shape[1] * 2
        row_major = [formats.swizzle_scales(s.view(torch.uint8)[: rows * (k // 16)].reshape(rows, k // 16))
                     for s, rows in ((sfa, a.shape[0]), (sfb, b.shape[0]))]
        return simulated(a, row_major[0].view(sfa.dtype), a_amax, b, row_major[1].view(sfb.dtype), b_amax, bias)

    return run


def _build_fails(config):
    raise KernelBuildError("nvcc is CUDA 12.6, too old for sm_100a: it needs CUDA 12.8 or newer")


@pytest.mark.parametrize(
    "make_kernel, reason",
    [
        (_raising("initialize failed: Error Internal"), "raised RuntimeError: .*initialize failed"),
        (_raising("launch failed: cluster launch"), "cluster launch"),
        (_wrong_layout, "disagrees with the emulated GEMM"),
        (_build_fails, "too old for sm_100a"),
    ],
    ids=["initialize", "cluster-launch", "wrong-result", "build"],
)
def test_a_failing_configuration_is_an_error_naming_the_option(blackwell, monkeypatch, make_kernel, reason):
    _loader(monkeypatch, make_kernel)
    qa, qb = _operands(256, 128, 256)
    kernel = cutlass_runtime.kernel_name(GemmConfig("1sm", 128, "bf16"), allow_emulation=False)
    with pytest.raises(CutlassKernelError, match=reason) as info:
        executors.run_scaled_mm(kernel, *_args(qa, qb), "nvfp4", torch.bfloat16)
    assert "nvfp4_gemm_1sm_128x128x256_c1x1_bf16" in str(info.value) and "allow_emulation=True" in str(info.value)


def test_a_failing_configuration_falls_back_once_where_emulation_is_allowed(blackwell, monkeypatch):
    loads = _loader(monkeypatch, _raising("initialize failed: TMA descriptor"))
    qa, qb = _operands(256, 128, 256)
    kernel = cutlass_runtime.kernel_name(GemmConfig("1sm", 128, "bf16"), allow_emulation=True)
    expected = reference.scaled_mm_reference(*_args(qa, qb), "nvfp4", torch.bfloat16)
    with pytest.warns(fp4compile.PlanWarning, match="run in emulation .*TMA descriptor"):
        got = executors.run_scaled_mm(kernel, *_args(qa, qb), "nvfp4", torch.bfloat16)
    assert torch.equal(got, expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once
        assert torch.equal(executors.run_scaled_mm(kernel, *_args(qa, qb), "nvfp4", torch.bfloat16), expected)
    assert loads == ["nvfp4_gemm_1sm_128x128x256_c1x1_bf16"]


def test_warm_up_reports_each_configuration(blackwell, monkeypatch):
    good, bad = GemmConfig("1sm", 64, "bf16"), GemmConfig("2sm", 192, "bf16")
    _loader(monkeypatch, lambda c: simulated_kernel(c) if c == good else _raising("launch failed")(c))
    outcome = cutlass_runtime.warm_up([good, bad], device="cpu")
    assert outcome[good.name] is None and "launch failed" in outcome[bad.name]


# ----------------------------------------------------------------------------------------------
# Operand checks (what the binding checks too)
# ----------------------------------------------------------------------------------------------


def test_operand_checks_refuse_unswizzled_scales_and_wrong_dtypes():
    qa, _ = _operands(128, 32, 64)
    swizzled = formats.swizzle_scales(qa.scales)
    name = "nvfp4_gemm_1sm_128x64x256_c1x1_bf16"
    cutlass_runtime.check_operands(name, "A", qa.data, swizzled, qa.amax, 64)
    # 128 rows and 4 scale columns: the row-major scales have the tiled layout's byte count.
    assert qa.scales.numel() == swizzled.numel()
    with pytest.raises(ValueError, match="operand A: scales must be in the 128x4 tiled layout"):
        cutlass_runtime.check_operands(name, "A", qa.data, qa.scales, qa.amax, 64)
    with pytest.raises(ValueError, match="codes must be uint8 or float4_e2m1fn_x2, got torch.int8"):
        cutlass_runtime.check_operands(name, "A", qa.data.view(torch.int8), swizzled, qa.amax, 64)
    with pytest.raises(ValueError, match="scales must be float8_e4m3fn or uint8, got torch.int8"):
        cutlass_runtime.check_operands(name, "A", qa.data, swizzled.view(torch.int8), qa.amax, 64)
    with pytest.raises(ValueError, match="amax must be a float32 scalar"):
        cutlass_runtime.check_operands(name, "A", qa.data, swizzled, qa.amax.double(), 64)
    with pytest.raises(ValueError, match=r"\[\*, 32\]"):
        cutlass_runtime.check_operands(name, "A", qa.data[:, :16], swizzled, qa.amax, 64)
    with pytest.raises(ValueError, match="codes .* got torch.float32 and"):
        cutlass_runtime.prepare_operands(qa.data.view(torch.uint8).float(), qa.scales, qa.data, qa.scales)
    with pytest.raises(ValueError, match="K=40 is not a multiple"):
        cutlass_runtime.prepare_operands(qa.data[:, :20], qa.scales, qa.data[:, :20], qa.scales)


# ----------------------------------------------------------------------------------------------
# Toolkits: detected before the build
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "release, arch, torch_cuda, problem",
    [
        ((13, 0), "sm_100a", "13.0", None),
        ((13, 0), "sm_103a", None, None),
        ((12, 8), "sm_100a", "12.8", None),
        ((12, 9), "sm_100a", "12.9", None),
        ((12, 6), "sm_100a", "12.6", "nvcc is CUDA 12.6, too old for sm_100a: it needs CUDA 12.8"),
        ((12, 8), "sm_103a", "12.8", "too old for sm_103a: it needs CUDA 12.9"),
        ((12, 8), "sm_100f", None, "too old for sm_100f"),
        ((12, 9), "sm_100a", "13.0", "nvcc is CUDA 12.9 but torch .* is built with CUDA 13.0"),
        ((13, 0), "sm_100a", "12.8", "nvcc is CUDA 13.0 but torch .* is built with CUDA 12.8"),
    ],
)
def test_toolkit_problems(release, arch, torch_cuda, problem):
    found = cutlass_toolkit.toolkit_problem(release, arch, torch_cuda)
    if problem is None:
        assert found is None
    else:
        assert found is not None
        import re

        assert re.search(problem, found), found


def test_the_lowering_names_the_site_of_a_gemm_without_a_kernel(monkeypatch, fresh_dynamo):
    """The pass turns ``CutlassRequired`` into an error naming the layer, role and shape."""

    choose_gemm = executors.choose_gemm

    def no_kernel(m, n, k, fmt, out_dtype, device, allow_emulation=True, batched=False, scale_rule="6"):
        if not allow_emulation:
            raise executors.CutlassRequired("N is not a multiple of 32; Recipe(allow_emulation=True) ...")
        return choose_gemm(m, n, k, fmt, out_dtype, device, allow_emulation, batched, scale_rule=scale_rule)

    monkeypatch.setattr(executors, "choose_gemm", no_kernel)
    from models import MLPStack

    model = MLPStack(4, d=32)
    with pytest.raises(Exception, match=r"layers\.1\.fc fprop GEMM \(M x N x K = 24x128x32\): N is not"):
        torch.compile(model, backend=fp4compile.Backend(high_precision_first_blocks=1, high_precision_last_blocks=1))(
            torch.randn(24, 32)
        )
    torch._dynamo.reset()
    out = torch.compile(model, backend=fp4compile.Backend(allow_emulation=True))(torch.randn(24, 32))
    assert out.shape == (24, 32)
