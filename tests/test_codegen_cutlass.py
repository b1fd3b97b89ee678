"""CUTLASS NVFP4 GEMM code generation: configurations, selection, rendering, build cache, layouts.

Without a Blackwell GPU the kernel cannot run, so the checks here are what can be verified anywhere:
the rendered source, the selection table, the cache's behaviour (with a stand-in compiler), the operand
layout the binding expects, and, where nvcc and the CUTLASS headers exist (marker ``nvcc``), one real
sm_100a build whose PTX must use the block-scaled tcgen05 MMA, and CUTLASS's scale-factor layout
compared offset by offset with fp4compile.formats.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fp4compile import config as settings
from fp4compile import formats
from fp4compile.codegen import build_cache, cutlass_gemm, cutlass_toolkit
from fp4compile.codegen.cutlass_gemm import GemmConfig, KernelBuildError

# ----------------------------------------------------------------------------------------------
# Configurations and rendering
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", cutlass_gemm.supported_configs(), ids=lambda c: c.name)
def test_every_supported_config_renders(config):
    src = cutlass_gemm.render(config)
    sm = config.sms_per_tile
    for needle in (
        "cutlass::arch::Sm100",
        "cutlass::arch::OpClassBlockScaledTensorOp",
        "using ElementA = cutlass::nv_float4_t<cutlass::float_e2m1_t>;",
        "using ElementB = cutlass::nv_float4_t<cutlass::float_e2m1_t>;",
        "using LayoutA = cutlass::layout::RowMajor;",
        "using LayoutB = cutlass::layout::ColumnMajor;",
        f"cutlass::gemm::KernelTmaWarpSpecialized{sm}SmNvf4Sm100",
        f"cutlass::epilogue::TmaWarpSpecialized{sm}Sm",
        f"Shape<_{config.tile_m}, _{config.tile_n}, _256>",
        f"Shape<_{config.cluster_m}, _{config.cluster_n}, _1>",
        "LinCombPerColBias",
        "fusion.a_amax_ptr = a_amax;",
        "fusion.b_amax_ptr = b_amax;",
        "fusion.bias_ptr",
        "tile_atom_to_shape_SFA",
        f"size_t {config.name}_workspace_size(int m, int n, int k)",
        f"int {config.name}_run(",
        "using ElementD = cutlass::bfloat16_t;" if config.out_dtype == "bf16" else "using ElementD = float;",
    ):
        assert needle in src, f"{needle!r} missing from the {config.name} kernel source"
    assert "{{" not in src and "{%" not in src
    includes = re.findall(r'#include [<"](.+)[>"]', src)
    assert includes and not any(i.startswith(("torch", "ATen", "c10")) for i in includes), "kernel TU includes torch"

    binding = cutlass_gemm.render_binding(config)
    assert f'TORCH_LIBRARY_FRAGMENT({cutlass_gemm.OP_NAMESPACE}, m)' in binding
    assert f'm.def("{config.name}(Tensor a_data, Tensor a_scales, Tensor a_amax, Tensor b_data' in binding
    assert "Tensor? bias=None) -> Tensor" in binding
    assert f"{config.name}_run(" in binding and "{{" not in binding


def test_supported_configs_cover_both_schedules_tiles_and_dtypes():
    configs = cutlass_gemm.supported_configs()
    assert len(set(c.name for c in configs)) == len(configs) == 24
    assert {(c.schedule, c.tile_m) for c in configs} == {("1sm", 128), ("2sm", 256)}
    assert {c.tile_n for c in configs} == {64, 128, 192}
    assert {c.out_dtype for c in configs} == {"bf16", "fp32"}
    assert all(c.cluster_m % 2 == 0 for c in configs if c.schedule == "2sm")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tile_n=96), "tile_n"),
        (dict(tile_n=256), "spill registers"),
        (dict(schedule="4sm"), "schedule"),
        (dict(out_dtype="fp16"), "out_dtype"),
        (dict(tile_k=128), "tile_k"),
        (dict(schedule="2sm", cluster_m=1), "cluster"),
    ],
)
def test_invalid_configs_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GemmConfig(**kwargs)


def test_config_names_round_trip():
    for config in cutlass_gemm.supported_configs():
        assert GemmConfig.from_name(config.name) == config
    with pytest.raises(ValueError):
        GemmConfig.from_name("nvfp4_gemm_1sm_256x128x256_c1x1_bf16")  # 1-SM tiles have 128 rows
    with pytest.raises(ValueError):
        GemmConfig.from_name("emulated")


def test_default_clusters():
    assert GemmConfig("1sm").cluster_m == 1
    assert GemmConfig("2sm").cluster_m == 2
    assert GemmConfig("1sm") == GemmConfig("1sm", cluster_m=1, cluster_n=1)


def test_alpha_constant_is_the_formats_decode_constant():
    src = cutlass_gemm.render(GemmConfig())
    literal = re.search(r"T const inv_global = T\((0x[0-9a-fp.+-]+)f\);", src).group(1)
    expected = torch.tensor(1.0 / formats.NVFP4_GLOBAL, dtype=torch.float32)
    assert torch.tensor(float.fromhex(literal), dtype=torch.float32).view(torch.int32) == expected.view(torch.int32)
    # formats.gemm_alpha's order, computed by the epilogue's two-pointer scalar broadcast: no kernel of its own.
    assert "return (a_amax * inv_global) * (b_amax * inv_global);" in src
    assert "Sm90ScalarBroadcast<" in src and ", 2," in src and "<<<" not in src


def test_kernel_alpha_matches_the_emulated_gemm():
    """The kernel computes alpha * sum(codes*sf . codes*sf) with alpha = (amax_A/2688)(amax_B/2688):
    the same product as dequantize(A) . dequantize(B)^T, up to fp32 rounding."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(64, 128, generator=gen)
    b = torch.randn(32, 128, generator=gen) * 3
    qa, qb = formats.quantize(a), formats.quantize(b, block="16x16")
    inv = torch.tensor(1.0 / formats.NVFP4_GLOBAL, dtype=torch.float32)
    alpha = (qa.amax * inv) * (qb.amax * inv)
    kernel_math = alpha * (formats.block_decode(qa).double() @ formats.block_decode(qb).double().T)
    emulated = formats.dequantize(qa).double() @ formats.dequantize(qb).double().T
    torch.testing.assert_close(kernel_math.float(), emulated.float(), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Selection
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, out_dtype, expected",
    [
        ((16, 4096, 4096), "bf16", ("1sm", 64)),  # decode-like: the most tiles wins
        ((1024, 1024, 1024), "bf16", ("1sm", 64)),  # 128 tiles of 128x64 fill one wave of 148 SMs
        ((4096, 4096, 4096), "bf16", ("2sm", 128)),
        ((8192, 8192, 8192), "fp32", ("2sm", 192)),
        ((2048, 11008, 4096), "bf16", ("2sm", 192)),
        ((32768, 4096, 4096), "bf16", ("2sm", 192)),
        ((1, 32, 32), "bf16", ("1sm", 64)),
        ((100, 100, 64), "bf16", None),  # N % 32
        ((128, 128, 48), ("bf16"), ("1sm", 64)),  # K % 32 == 16: padded at run time
        ((128, 128, 40), "bf16", None),  # K % 16
        ((0, 128, 128), "bf16", None),
        ((128, 128, 128), "fp16", None),
    ],
)
def test_select_config_table(shape, out_dtype, expected):
    config, reason = cutlass_gemm.select_config(*shape, out_dtype)
    assert reason
    if expected is None:
        assert config is None
    else:
        assert (config.schedule, config.tile_n) == expected, reason
        assert config.out_dtype == out_dtype
        assert config.name in reason and "wave" in reason


def test_select_config_reasons_name_the_rule():
    assert "K=40 is not a multiple of 16" in cutlass_gemm.select_config(128, 128, 40)[1]
    assert "K=48 zero-padded to a multiple of 32" in cutlass_gemm.select_config(128, 128, 48)[1]
    assert "N=100 is not a multiple of 32" in cutlass_gemm.select_config(128, 100, 64)[1]
    assert "bf16 or fp32" in cutlass_gemm.select_config(128, 128, 64, torch.float16)[1]


def test_select_config_accepts_torch_dtypes_and_sm_count():
    config, _ = cutlass_gemm.select_config(4096, 4096, 4096, torch.float32)
    assert config.out_dtype == "fp32" and config.torch_out_dtype == torch.float32
    # With few SMs, big tiles waste nothing to wave quantization and win on operand traffic.
    small, _ = cutlass_gemm.select_config(4096, 4096, 4096, torch.bfloat16, num_sms=8)
    assert (small.schedule, small.tile_n) == ("2sm", 192)


# ----------------------------------------------------------------------------------------------
# Devices
# ----------------------------------------------------------------------------------------------


def test_device_support_without_cuda_torch(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    ok, reason = cutlass_gemm.device_supports_cutlass("cuda")
    assert not ok and "without CUDA" in reason


@pytest.mark.parametrize(
    "capability, supported", [((10, 0), True), ((10, 3), True), ((9, 0), False), ((12, 0), False), ((8, 0), False)]
)
def test_device_support_by_capability(monkeypatch, capability, supported):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU")
    ok, reason = cutlass_gemm.device_supports_cutlass("cuda:0")
    assert ok is supported
    assert f"{capability[0]}.{capability[1]}" in reason
    assert cutlass_gemm.device_supports_cutlass("cpu")[0] is False
    assert cutlass_gemm.arch_for_device() == f"sm_{capability[0]}{capability[1]}a"


# ----------------------------------------------------------------------------------------------
# Operand layout: what formats.quantize produces is what the binding expects
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m, n, k", [(64, 96, 128), (130, 32, 96), (1, 64, 32)])
def test_quantized_operands_are_k_major_with_the_expected_scale_size(m, n, k):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    qa = formats.quantize(x)
    qb = formats.quantize(w, block="16x16") if n % 16 == 0 else formats.quantize(w)
    for q, rows in ((qa, m), (qb, n)):
        assert q.data.dtype == torch.float4_e2m1fn_x2
        assert q.data.shape == (rows, k // 2) and q.data.stride() == (k // 2, 1) and q.data.is_contiguous()
        raw = q.data.view(torch.uint8)
        codes = q.codes()
        # K-major packing: element (r, 2j) in the low nibble, (r, 2j+1) in the high nibble of byte (r, j).
        assert torch.equal(raw & 0xF, codes[:, 0::2]) and torch.equal(raw >> 4, codes[:, 1::2])
        assert q.scales.dtype == torch.float8_e4m3fn and q.scales.shape == (rows, k // 16)
        swizzled = formats.swizzle_scales(q.scales)
        assert swizzled.dim() == 1 and swizzled.element_size() == 1
        assert swizzled.numel() == cutlass_gemm.expected_scales_numel(rows, k)
        assert q.amax.dtype == torch.float32 and q.amax.dim() == 0
    # The binding checks exactly these sizes (same formula in C++).
    binding = cutlass_gemm.render_binding(GemmConfig())
    assert "round_up(data.size(0), 128) * round_up(k_bytes * 2 / 16, 4)" in binding
    assert "data.is_contiguous()" in binding and "scales.dim() == 1" in binding
    assert "ScalarType::Float4_e2m1fn_x2" in binding and "ScalarType::Float8_e4m3fn" in binding


def test_wgrad_operands_are_k_major_after_transpose():
    """dW = dY^T . X: both operands are quantized along tokens, i.e. [out, tokens] and [in, tokens] rows."""
    dy = torch.randn(64, 32)  # [tokens, out]
    x = torch.randn(64, 96)  # [tokens, in]
    qa = formats.quantize(dy.T.contiguous())
    qb = formats.quantize(x.T.contiguous())
    assert qa.data.shape == (32, 32) and qb.data.shape == (96, 32)
    assert qa.data.shape[1] == qb.data.shape[1]  # shared K/2: the kernel's A [M, K] and B [N, K]


# ----------------------------------------------------------------------------------------------
# Build cache, with a stand-in compiler
# ----------------------------------------------------------------------------------------------

_FAKE_NVCC = textwrap.dedent(
    """\
    #!{python}
    # Stand-in for nvcc: logs each compile, writes plausible outputs, can sleep or fail.
    import json, os, sys, time
    args = sys.argv[1:]
    if args == ["--version"]:
        print("Cuda compilation tools, release " + os.environ.get("FAKE_NVCC_RELEASE", "13.0") + ", V0")
        sys.exit(0)
    with open(os.environ["FAKE_NVCC_LOG"], "a") as log:
        log.write(json.dumps({{"pid": os.getpid(), "args": args}}) + "\\n")
    time.sleep(float(os.environ.get("FAKE_NVCC_SLEEP", "0")))
    if os.environ.get("FAKE_NVCC_FAIL"):
        print("kernel.cu(1): error: fake compiler failure", file=sys.stderr)
        sys.exit(1)
    out = args[args.index("-o") + 1]
    open(out, "wb").write(b"fake output")
    keep = [a.split("=", 1)[1] for a in args if a.startswith("-keep-dir=")]
    if keep:
        open(os.path.join(keep[0], "kernel.ptx"), "w").write("tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale\\n")
        open(os.path.join(keep[0], "kernel.cubin"), "wb").write(b"cubin")
        open(os.path.join(keep[0], "kernel.cpp1.ii"), "w").write("intermediate")
    """
)


@pytest.fixture
def fake_nvcc(tmp_path, monkeypatch):
    """A stand-in nvcc and a private cache directory; returns a function counting kernel compiles."""
    script = tmp_path / "bin" / "nvcc"
    script.parent.mkdir()
    script.write_text(_FAKE_NVCC.format(python=sys.executable))
    script.chmod(0o755)
    log = tmp_path / "nvcc.log"
    log.touch()
    monkeypatch.setenv("FAKE_NVCC_LOG", str(log))
    monkeypatch.delenv("FAKE_NVCC_FAIL", raising=False)
    monkeypatch.delenv("FAKE_NVCC_SLEEP", raising=False)
    # Where torch has CUDA the module is linked too, which needs nvcc's CUDA major to match torch's.
    monkeypatch.setenv("FAKE_NVCC_RELEASE", torch.version.cuda or "13.0")

    def kernel_compiles() -> int:
        return sum("-c" in json.loads(line)["args"] for line in log.read_text().splitlines())

    with settings.patch(nvcc=str(script), cache_dir=str(tmp_path / "cache")):
        yield kernel_compiles


def _entries(root: Path) -> list[Path]:
    kernels = root / "kernels"
    return sorted(p for p in kernels.iterdir() if not p.name.startswith(".")) if kernels.exists() else []


def test_cache_dir_honours_the_setting(monkeypatch, tmp_path):
    with settings.patch(cache_dir=str(tmp_path / "elsewhere")):
        assert cutlass_gemm.cache_dir() == tmp_path / "elsewhere"
    assert settings.from_environment({"FP4COMPILE_CACHE_DIR": "~/cache"})["cache_dir"] == "~/cache"
    monkeypatch.setenv("HOME", str(tmp_path))
    with settings.patch(cache_dir=None):
        assert cutlass_gemm.cache_dir() == tmp_path / ".cache" / "fp4compile"
    with settings.patch(cache_dir="~/cache"):
        assert cutlass_gemm.cache_dir() == tmp_path / "cache"


def test_second_build_runs_no_compiler(fake_nvcc, monkeypatch, tmp_path):
    config = GemmConfig("1sm", 128, "bf16")
    first = cutlass_gemm.build(config, progress=False)
    assert not first.from_cache and fake_nvcc() == 1
    assert first.entry_dir.parent == tmp_path / "cache" / "kernels"
    assert {"cu", "binding", "ptx", "cubin", "object"} <= set(first.paths)
    assert first.cu.read_text() == cutlass_gemm.render(config)
    assert "kind::mxf4nvf4.block_scale" in first.ptx.read_text()
    assert not any(p.name.endswith(".ii") for p in first.entry_dir.iterdir()), "nvcc intermediates must not be kept"
    assert ("module" in first.paths) == (torch.version.cuda is not None)

    def no_compiler(*args, **kwargs):
        raise AssertionError("the compiler ran for a cached kernel")

    monkeypatch.setattr(cutlass_gemm, "run_compiler", no_compiler)
    second = cutlass_gemm.build(config, progress=False)
    assert second.from_cache and second.paths == first.paths and second.key == first.key
    assert fake_nvcc() == 1
    assert len(_entries(tmp_path / "cache")) == 1


@pytest.mark.parametrize("damage", ["truncate", "edit", "delete_file", "delete_manifest", "garble_manifest"])
def test_corrupt_entry_is_rebuilt(fake_nvcc, tmp_path, damage):
    config = GemmConfig("2sm", 192, "fp32")
    first = cutlass_gemm.build(config, progress=False)
    manifest = first.entry_dir / build_cache.MANIFEST
    if damage == "truncate":
        first.ptx.write_text(first.ptx.read_text()[:5])
    elif damage == "edit":
        first.paths["object"].write_bytes(b"fake outpuT")  # same size, different bytes
    elif damage == "delete_file":
        first.paths["cubin"].unlink()
    elif damage == "delete_manifest":
        manifest.unlink()
    else:
        manifest.write_text("{not json")
    rebuilt = cutlass_gemm.build(config, progress=False)
    assert not rebuilt.from_cache and fake_nvcc() == 2
    assert rebuilt.entry_dir == first.entry_dir
    assert "kind::mxf4nvf4.block_scale" in rebuilt.ptx.read_text()
    assert cutlass_gemm.build(config, progress=False).from_cache
    assert [e["ok"] for e in cutlass_gemm.list_entries()] == [True]


def test_leftovers_of_a_killed_build_are_removed(fake_nvcc, tmp_path):
    config = GemmConfig("1sm", 192, "bf16")
    entry = cutlass_gemm.build(config, progress=False).entry_dir
    shutil.rmtree(entry)
    stale = [entry.parent / f".tmp-{entry.name}-killed", entry.parent / f".trash-{entry.name}-killed"]
    for path in stale:
        (path / "keep").mkdir(parents=True)
    assert not cutlass_gemm.build(config, progress=False).from_cache
    assert not any(path.exists() for path in stale)


def test_cache_key_covers_config_arch_and_compiler(fake_nvcc, monkeypatch, tmp_path):
    keys = {
        cutlass_gemm.build(GemmConfig("1sm", 128, "bf16"), progress=False).key,
        cutlass_gemm.build(GemmConfig("1sm", 128, "fp32"), progress=False).key,
        cutlass_gemm.build(GemmConfig("1sm", 128, "bf16", cluster_m=2), progress=False).key,
        cutlass_gemm.build(GemmConfig("1sm", 128, "bf16"), arch="sm_103a", progress=False).key,
    }
    assert len(keys) == 4 and fake_nvcc() == 4
    # Another compiler version is another key (nvcc_version is cached per path, so use a second copy).
    other = tmp_path / "bin2" / "nvcc"
    other.parent.mkdir()
    shutil.copy2(settings.nvcc, other)
    monkeypatch.setenv("FAKE_NVCC_RELEASE", (torch.version.cuda or "13.0").split(".")[0] + ".99")
    with settings.patch(nvcc=str(other)):
        assert cutlass_gemm.build(GemmConfig("1sm", 128, "bf16"), progress=False).key not in keys
    assert len(_entries(tmp_path / "cache")) == 5


@pytest.mark.slow
def test_concurrent_builds_in_two_processes_compile_once(fake_nvcc, monkeypatch, tmp_path):
    monkeypatch.setenv("FAKE_NVCC_SLEEP", "2")
    script = (
        "from fp4compile.codegen import cutlass_gemm as g\n"
        "r = g.build(g.GemmConfig('1sm', 192, 'bf16'), progress=True)\n"
        "print(r.entry_dir, r.from_cache)\n"
    )
    env = dict(os.environ, FP4COMPILE_NVCC=settings.nvcc, FP4COMPILE_CACHE_DIR=settings.cache_dir)  # the fixture's
    procs = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]
    results = [p.communicate(timeout=120) + (p.returncode,) for p in procs]
    for out, err, rc in results:
        assert rc == 0, err
    outputs = sorted(out.split()[1] for out, _, _ in results)
    assert outputs == ["False", "True"], results  # one built, the other waited and reused it
    assert len({out.split()[0] for out, _, _ in results}) == 1
    assert fake_nvcc() == 1
    assert len(_entries(tmp_path / "cache")) == 1
    leftovers = [p.name for p in (tmp_path / "cache" / "kernels").iterdir() if p.name.startswith((".tmp", ".trash"))]
    assert leftovers == []


def test_compiler_failure_raises_with_its_stderr(fake_nvcc, monkeypatch, tmp_path):
    monkeypatch.setenv("FAKE_NVCC_FAIL", "1")
    with pytest.raises(KernelBuildError) as info:
        cutlass_gemm.build(GemmConfig(), progress=False)
    assert "fake compiler failure" in info.value.stderr
    assert "fake compiler failure" in str(info.value)
    assert info.value.command[0] == settings.nvcc
    assert _entries(tmp_path / "cache") == []
    assert [p for p in (tmp_path / "cache" / "kernels").iterdir() if p.name.startswith(".tmp")] == []


def test_missing_compiler_raises(tmp_path):
    with settings.patch(nvcc=str(tmp_path / "no-nvcc"), cache_dir=str(tmp_path / "cache")):
        with pytest.raises(KernelBuildError, match="nvcc not found"):
            cutlass_gemm.build(GemmConfig(), progress=False)
        assert not cutlass_gemm.toolchain_available()[0]


@pytest.mark.parametrize("release, arch, message", [
    ("12.6", "sm_100a", "nvcc is CUDA 12.6, too old for sm_100a: it needs CUDA 12.8 or newer"),
    ("12.8", "sm_103a", "nvcc is CUDA 12.8, too old for sm_103a: it needs CUDA 12.9 or newer"),
])
def test_a_toolkit_too_old_for_the_arch_is_refused_before_compiling(fake_nvcc, monkeypatch, release, arch, message):
    monkeypatch.setenv("FAKE_NVCC_RELEASE", release)
    build_cache.nvcc_version.cache_clear()
    try:
        with pytest.raises(KernelBuildError, match=message):
            cutlass_gemm.build(GemmConfig(), arch=arch, progress=False)
    finally:
        build_cache.nvcc_version.cache_clear()
    assert fake_nvcc() == 0


def test_unsupported_arch_raises(fake_nvcc):
    with pytest.raises(KernelBuildError, match="sm_90a"):
        cutlass_gemm.build(GemmConfig(), arch="sm_90a", progress=False)


def test_progress_is_reported_on_stderr(fake_nvcc, monkeypatch, capfd):
    monkeypatch.setattr(build_cache, "_PROGRESS_LOG_INTERVAL_S", 0.2)
    monkeypatch.setenv("FAKE_NVCC_SLEEP", "0.8")
    cutlass_gemm.build(GemmConfig("1sm", 64, "bf16"), progress=True)
    err = capfd.readouterr().err
    assert "[fp4compile] compiling nvfp4_gemm_1sm_128x64x256_c1x1_bf16 for sm_100a" in err
    assert re.search(r"\d+s elapsed", err) and re.search(r"done in \d+s", err)


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks the CPU-only torch path")
def test_load_without_cuda_torch_raises_build_error():
    with pytest.raises(KernelBuildError, match="no CUDA"):
        cutlass_gemm.load(GemmConfig(), arch="sm_100a")


def test_scaled_mm_needs_cuda_tensors():
    q = formats.quantize(torch.randn(32, 32))
    with pytest.raises(ValueError, match="CUDA tensors"):
        cutlass_gemm.scaled_mm(GemmConfig(), q.data, q.scales, q.amax, q.data, q.scales, q.amax)


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def _cli(*argv) -> int:
    from fp4compile import cli_kernels

    parser = argparse.ArgumentParser(prog="fp4compile")
    cli_kernels.add_subparser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(list(argv))
    return args.func(args)


def test_cli_build_and_list(fake_nvcc, tmp_path, capsys):
    out_dir = tmp_path / "out"
    argv = ["kernels", "build", "--arch", "sm_100a", "--shape", "4096x4096x4096", "--out", str(out_dir), "--quiet"]
    assert _cli(*argv) == 0
    printed = capsys.readouterr().out
    assert "nvfp4_gemm_2sm_256x128x256_c2x1_bf16" in printed
    for suffix in (".kernel.cu", ".kernel.ptx", ".kernel.cubin", ".kernel.o"):
        path = out_dir / f"nvfp4_gemm_2sm_256x128x256_c2x1_bf16{suffix}"
        assert path.exists() and str(path) in printed
    assert _cli("kernels", "build", "--shape", "4096x4096x4096", "--quiet") == 0
    assert "cached:" in capsys.readouterr().out
    assert _cli("kernels", "list") == 0
    listed = capsys.readouterr().out
    assert "1 entry" in listed and "nvfp4_gemm_2sm_256x128x256_c2x1_bf16" in listed and " ok " in listed


def test_cli_builds_every_configuration_of_a_shape_list_once(fake_nvcc, capsys):
    shapes = "4096x4096x4096,8192x4096x4096,?x4096x4096,16x4096x4096,128x100x64"
    assert _cli("kernels", "build", "--shapes", shapes, "--out-dtype", "fp32", "--quiet") == 0
    captured = capsys.readouterr()
    chosen, rejected = cutlass_gemm.configs_for_shapes(
        [(4096, 4096, 4096), (8192, 4096, 4096), (None, 4096, 4096), (16, 4096, 4096), (128, 100, 64)], "fp32"
    )
    assert len(rejected) == 1 and "no CUTLASS kernel for 128x100x64" in captured.err
    assert fake_nvcc() == len(chosen) and len(chosen) >= 2
    for config in chosen:
        assert config.name in captured.out
    assert "?x4096x4096" in captured.out


def test_cli_builds_the_kernels_of_a_model(fake_nvcc, tmp_path, monkeypatch, capsys, fresh_dynamo):
    (tmp_path / "aot_model.py").write_text(textwrap.dedent(
        """\
        import torch

        def make():
            torch.manual_seed(0)
            blocks = [torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
                      for _ in range(6)]
            model = torch.nn.Sequential(*blocks)
            return model, (torch.randn(4, 24, 64),)
        """
    ))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _cli("kernels", "build", "--model", "aot_model:make", "--quiet") == 0
    out = capsys.readouterr().out
    # 4 middle blocks x 2 linears x (fprop, dgrad, wgrad); wgrad's K = 96 tokens: padded at run time.
    shapes = re.search(r"\] nvfp4_gemm_\w+ for (.*)", out).group(1).split(", ")
    # fprop and dgrad of the two linears ([96 tokens, 64] -> 128 -> 64), and their wgrad: K = 96 tokens.
    assert sorted(shapes) == sorted(["96x128x64", "96x64x128", "128x64x96", "64x128x96"])
    assert fake_nvcc() >= 1
    assert _cli("kernels", "build", "--model", "no_such_module:make") == 2


def test_build_matrix_records_each_configuration_and_resumes(fake_nvcc, monkeypatch, tmp_path, capsys):
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "build_matrix.py"
    spec = importlib.util.spec_from_file_location("build_matrix_under_test", path)
    matrix = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(matrix)
    out = tmp_path / "matrix.json"
    names = ["nvfp4_gemm_2sm_256x192x256_c2x1_bf16", "nvfp4_gemm_1sm_128x64x256_c1x1_fp32"]
    assert matrix.main(["--only", *names, "--arch", "sm_100a", "--arch", "sm_103a", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "[1/4] sm_100a/nvfp4_gemm_2sm_256x192x256_c2x1_bf16: ok" in printed and "[4/4] sm_103a/" in printed
    results = json.loads(out.read_text())["results"]
    assert sorted(results) == sorted(f"{a}/{n}" for a in ("sm_100a", "sm_103a") for n in names)
    assert all(r["status"] == "ok" and r["seconds"] is not None for r in results.values())
    assert fake_nvcc() == 4
    # Run again: everything is recorded, nothing compiles.
    assert matrix.main(["--only", *names, "--arch", "sm_100a", "--arch", "sm_103a", "--out", str(out)]) == 0
    assert capsys.readouterr().out.count("recorded earlier (ok)") == 4 and fake_nvcc() == 4
    # A toolkit too old for sm_103a: refused there before compiling, built for sm_100a.
    monkeypatch.setenv("FAKE_NVCC_RELEASE", "12.8")
    build_cache.nvcc_version.cache_clear()
    try:
        other = tmp_path / "old.json"
        assert matrix.main(["--only", names[0], "--arch", "sm_100a", "--arch", "sm_103a", "--out", str(other)]) == 0
    finally:
        build_cache.nvcc_version.cache_clear()
    results = json.loads(other.read_text())["results"]
    assert results[f"sm_100a/{names[0]}"]["status"] == "ok"
    assert results[f"sm_103a/{names[0]}"] == {"status": "refused", "error": cutlass_toolkit.toolkit_problem((12, 8), "sm_103a", None)}


def test_cli_rejects_bad_shapes(fake_nvcc, capsys):
    assert _cli("kernels", "build", "--shape", "128x100x64") == 2
    assert "not a multiple of 32" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _cli("kernels", "build", "--shape", "128x128")


# ----------------------------------------------------------------------------------------------
# Real toolchain (nvcc + CUTLASS headers); no GPU needed
# ----------------------------------------------------------------------------------------------


def _toolchain_or_skip():
    ok, reason = cutlass_gemm.toolchain_available()
    if not ok or settings.nvcc:
        pytest.skip(reason if not ok else "FP4COMPILE_NVCC (fp4compile.config.nvcc) overrides the real nvcc")
    if torch.version.cuda is not None:
        nvcc_major = build_cache.nvcc_release(build_cache.nvcc_version(cutlass_gemm.find_nvcc()))[0]
        if nvcc_major != int(torch.version.cuda.split(".")[0]):
            pytest.skip(f"nvcc is CUDA {nvcc_major}, torch CUDA {torch.version.cuda}: the module cannot be linked")


@pytest.fixture(scope="module")
def real_cache_dir(tmp_path_factory):
    """A cache directory shared by the real-nvcc tests of this module (each kernel compiles once)."""
    return tmp_path_factory.mktemp("nvcc-cache")


@pytest.fixture
def real_cache(real_cache_dir):
    """The shared cache directory, set as fp4compile's kernel cache for the test."""
    with settings.patch(cache_dir=str(real_cache_dir)):
        yield real_cache_dir


@pytest.mark.slow
@pytest.mark.nvcc
def test_real_sm100a_build_uses_block_scaled_tcgen05(real_cache, monkeypatch):
    _toolchain_or_skip()
    config = GemmConfig("1sm", 128, "bf16")
    result = cutlass_gemm.build(config, arch="sm_100a", progress=True)
    ptx = result.ptx.read_text()
    assert ".target sm_100a" in ptx
    assert re.search(r"tcgen05\.mma\.cta_group::1\.kind::mxf4nvf4\.block_scale", ptx), "no NVFP4 block-scaled MMA"
    assert "block16" in ptx  # one scale per 16 elements (NVFP4), not 32 (MXFP4)
    # One kernel: alpha is computed by the GEMM's epilogue, not by a kernel launched before it.
    assert len(re.findall(r"^\.(?:visible )?\.?entry\s", ptx, re.M)) == 1, re.findall(r"\.entry\s+\S+", ptx)
    assert result.paths["cubin"].read_bytes()[:4] == b"\x7fELF"
    nm = shutil.which("nm")
    if nm:
        symbols = subprocess.run([nm, str(result.paths["object"])], capture_output=True, text=True).stdout
        assert f" T {config.name}_run" in symbols and f" T {config.name}_workspace_size" in symbols
    monkeypatch.setattr(cutlass_gemm, "run_compiler", lambda *a, **k: pytest.fail("recompiled a cached kernel"))
    assert cutlass_gemm.build(config, arch="sm_100a").from_cache


@pytest.mark.slow
@pytest.mark.nvcc
def test_real_sm100a_build_of_a_2sm_configuration(real_cache):
    """A 2-SM configuration (the schedule large GEMMs select): a pair of CTAs issues the MMA, the mainloop
    is pipelined, and the kernel spills nothing."""
    _toolchain_or_skip()
    config = GemmConfig("2sm", 128, "bf16")
    result = cutlass_gemm.build(config, arch="sm_100a", progress=True)
    ptx = result.ptx.read_text()
    assert re.search(r"tcgen05\.mma\.cta_group::2\.kind::mxf4nvf4\.block_scale", ptx), "no 2-SM block-scaled MMA"
    stats = cutlass_gemm.build_stats(result)
    assert stats["stages"] >= 3, stats
    assert stats["spill_stores"] == 0 and stats["spill_loads"] == 0, stats
    assert result.paths["cubin"].read_bytes()[:4] == b"\x7fELF"


@pytest.mark.nvcc
@pytest.mark.slow  # compiles a probe against the CUTLASS headers
@pytest.mark.parametrize("m, n, k", [(1, 32, 32), (130, 64, 96), (256, 300, 512), (129, 257, 80)])
def test_scale_layout_matches_cutlass(real_cache, monkeypatch, m, n, k):
    _toolchain_or_skip()
    probe = cutlass_gemm.scale_layout_probe(m, n, k)
    kb = k // 16
    for operand, rows in (("SFA", m), ("SFB", n)):
        r = torch.arange(rows)[:, None].expand(rows, kb)
        c = torch.arange(kb)[None, :].expand(rows, kb)
        assert torch.equal(probe[operand], formats.swizzled_offset(r, c, kb)), operand
        assert probe[f"SIZE_{operand}"] == cutlass_gemm.expected_scales_numel(rows, k)
        # swizzle_scales puts scale (r, c) exactly where CUTLASS reads it.
        scales = torch.randint(1, 255, (rows, kb), dtype=torch.uint8)
        swizzled = formats.swizzle_scales(scales)
        assert torch.equal(swizzled[probe[operand].reshape(-1)], scales.reshape(-1))


def _torch_cuda_headers_stub(tmp_path: Path) -> list[str]:
    """CPU torch wheels ship c10/cuda headers but not the generated cuda_cmake_macros.h."""
    torch_include = Path(torch.__file__).parent / "include"
    if (torch_include / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").exists():
        return []
    stub = tmp_path / "stub" / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    return [f"-I{tmp_path / 'stub'}"]


@pytest.mark.slow
@pytest.mark.nvcc
def test_binding_compiles_against_torch_headers(tmp_path):
    """The binding is only linked where torch has CUDA; here at least it must type-check."""
    _toolchain_or_skip()
    cxx = shutil.which("c++") or shutil.which("g++")
    nvcc = Path(cutlass_gemm.find_nvcc()).resolve()
    homes = [os.environ.get("CUDA_HOME"), nvcc.parent.parent, "/usr/local/cuda"]
    found = [Path(h) / "include" for h in homes if h and (Path(h) / "include" / "cuda_runtime_api.h").exists()]
    torch_include = Path(torch.__file__).parent / "include"
    if cxx is None or not found or not (torch_include / "c10" / "cuda").exists():
        pytest.skip("needs a C++ compiler, the CUDA headers and torch's c10/cuda headers")
    source = tmp_path / "binding.cpp"
    source.write_text(cutlass_gemm.render_binding(GemmConfig("2sm", 192, "fp32")))
    from torch.utils import cpp_extension

    cmd = [
        cxx, "-std=c++20", "-fsyntax-only", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *_torch_cuda_headers_stub(tmp_path), *(f"-I{d}" for d in cpp_extension.include_paths()),
        f"-I{found[0]}", str(source),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_unwritable_cache_serves_complete_entries_and_reports_missing_ones(tmp_path, monkeypatch):
    """A read-only cache still serves complete entries; a missing one fails with a KernelBuildError
    (which the lowering turns into an emulation fallback), never an OSError mid-training."""
    from fp4compile.codegen import build_cache

    with settings.patch(cache_dir=str(tmp_path / "cache")):
        def produce(out):
            (out / "artifact.txt").write_text("built")
            return ["artifact.txt"]

        first = build_cache.cached_build("probe", {"v": 1}, produce, progress=False)
        assert not first.from_cache
        real_mkdir = build_cache.Path.mkdir

        def read_only(self, *args, **kwargs):
            raise PermissionError(13, "Read-only file system", str(self))

        monkeypatch.setattr(build_cache.Path, "mkdir", read_only)
        again = build_cache.cached_build("probe", {"v": 1}, produce, progress=False)
        assert again.from_cache and again.file("artifact.txt").read_text() == "built"
        with pytest.raises(build_cache.KernelBuildError, match="not writable.*FP4COMPILE_CACHE_DIR"):
            build_cache.cached_build("probe", {"v": 2}, produce, progress=False)
        monkeypatch.setattr(build_cache.Path, "mkdir", real_mkdir)
