"""CUTLASS block-scaled NVFP4 GEMMs for Blackwell: choose a configuration, render, build, cache, load.

The kernel computes ``out[M, N] = alpha * A[M, K] . B[N, K]^T + bias[N]`` with A and B NVFP4 (E2M1
codes two per byte, K-major; E4M3 scales per 16 elements in the 128x4 tiled layout of
``fp4compile.formats.swizzle_scales``) and ``alpha = (amax_A / 2688) * (amax_B / 2688)`` computed on
the device. Output is BF16 or FP32, accumulation FP32.

Flow:

1. ``device_supports_cutlass(device)`` -> (ok, reason): only sm_100 / sm_103 class GPUs with CUDA torch
   (``cutlass_toolkit``).
2. ``select_config(m, n, k, out_dtype)`` -> (GemmConfig | None, reason): what the lowering pass calls.
   Pure: alignment rules and a wave-quantization cost model over N, K and M (or a size hint of M)
   pick the MMA tile and 1-SM / 2-SM schedule; nothing is built.
3. ``load(config)`` -> callable ``(a_data, a_scales, a_amax, b_data, b_scales, b_amax, bias=None) -> out``,
   what the op calls on first use of a configuration (``cutlass_runtime``), and ``build`` ahead of
   time (``fp4compile kernels build``). ``build`` (cached) renders ``cutlass_templates/nvfp4_gemm_sm100.cu.j2``
   (the kernel, no torch headers) and ``nvfp4_gemm_binding.cpp.j2`` (the torch op), checks the toolkit
   (``cutlass_toolkit.check_toolkit``), compiles the kernel with nvcc to PTX, cubin and a host object
   everywhere nvcc exists, and links the torch extension module only where torch has CUDA. Any failure
   raises ``KernelBuildError``.

A configuration is shape-independent (M, N, K are runtime arguments), so one build serves every GEMM
shape that selects it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import re
import shutil
import subprocess
from pathlib import Path
from typing import Callable, Optional, Union

import jinja2
import torch

from .build_cache import (
    KernelBuildError,
    cache_dir,
    cached_build,
    find_nvcc,
    list_entries,
    nvcc_version,
    run_compiler,
)
from .cutlass_toolkit import (
    SUPPORTED_ARCHS,
    arch_for_device,
    check_toolkit,
    cutlass_include_dirs,
    cutlass_version,
    device_supports_cutlass,
    gencode,
    toolchain_available,
)

__all__ = [
    "GemmConfig", "BuildResult", "KernelBuildError", "SUPPORTED_ARCHS", "OP_NAMESPACE", "supported_configs",
    "select_config", "render", "render_binding", "build", "load", "scaled_mm", "cache_dir", "list_entries",
    "cutlass_include_dirs", "cutlass_version", "device_supports_cutlass", "arch_for_device",
    "toolchain_available", "expected_scales_numel", "scale_layout_probe", "compile_kernel",
    "find_prebuilt_entry", "load_op",
]

OP_NAMESPACE = "fp4compile_cutlass"

# Alignment rules. TMA moves 16-byte aligned rows: K % 32 for the FP4 operands (32 codes = 16 bytes);
# a K that is a multiple of the 16-element block but not of 32 (wgrad's token count) is zero-padded to
# the next multiple of 32 by the op (``cutlass_runtime.pad_k``), so selection asks for K % 16 only.
# N % 32 is stricter than the 16-byte output rows need (N % 8 for BF16, N % 4 for FP32): a margin that
# keeps the output and the bias vector aligned for every tile and epilogue configuration.
ALIGN_K = 32
ALIGN_N = 32
BLOCK_K = 16
# M of a GEMM whose token count is symbolic (dynamo's dynamic shapes) when no size hint is known.
DEFAULT_M_HINT = 8192
# Default SM count for the cost model: B200 has 148 SMs.
DEFAULT_NUM_SMS = 148

KERNEL_TEMPLATE = "nvfp4_gemm_sm100.cu.j2"
BINDING_TEMPLATE = "nvfp4_gemm_binding.cpp.j2"
PROBE_SOURCE = "scale_layout_probe.cu"

_OUT_DTYPES = {
    "bf16": ("cutlass::bfloat16_t", torch.bfloat16, "at::kBFloat16"),
    "fp32": ("float", torch.float32, "at::kFloat"),
}
_TORCH_TO_OUT = {torch.bfloat16: "bf16", torch.float32: "fp32"}
# N = 256 is not offered: with nvcc 13.0 / CUTLASS 4.2 its 1-SM (128x256) and 2-SM (256x256) builds
# use 255 registers and spill 144-248 bytes, with 1-4 pipeline stages (benchmarks/build_matrix.py).
_TILE_N = (64, 128, 192)
# Cluster shapes (M, N) each schedule is offered with; the first is the default.
_CLUSTERS = {"1sm": ((1, 1), (2, 1)), "2sm": ((2, 1), (4, 1))}
_TILE_M = {"1sm": 128, "2sm": 256}
# Tiles the selection heuristic chooses among (every supported tile can still be built explicitly).
_CANDIDATE_TILES = (("1sm", 64), ("1sm", 128), ("1sm", 192), ("2sm", 128), ("2sm", 192))
# Weight of operand traffic against MMA work in the cost model (see select_config).
_TRAFFIC_WEIGHT = 32.0

NVCC_FLAGS = (
    "-std=c++17",
    "-O3",
    "-DNDEBUG",
    "--expt-relaxed-constexpr",
    "-Xcompiler=-fPIC",
    "--resource-usage",  # ptxas's registers, spills and stack per kernel, kept in build.log (build_stats)
)
BINDING_FLAGS = ("-std=c++20", "-O2", "-Xcompiler=-fPIC")


def _template_dir() -> Path:
    """The package fp4compile.cutlass_templates (cutlass_templates/ in a checkout)."""
    from importlib.resources import files

    return Path(str(files("fp4compile.cutlass_templates")))


@functools.lru_cache(maxsize=None)
def _template_text(name: str) -> str:
    return (_template_dir() / name).read_text()


@functools.lru_cache(maxsize=None)
def _jinja(name: str) -> jinja2.Template:
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    return env.from_string(_template_text(name))


# ----------------------------------------------------------------------------------------------
# Configurations
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One compiled kernel: MMA tile, 1-SM or 2-SM schedule, cluster shape, output dtype.

    ``schedule`` "1sm": one SM per MMA tile of 128 x tile_n x 256 (``KernelTmaWarpSpecialized1SmNvf4Sm100``).
    ``schedule`` "2sm": a pair of SMs shares a 256 x tile_n x 256 MMA tile, each loading half of B
    (``KernelTmaWarpSpecialized2SmNvf4Sm100``); the cluster's M extent must be even.
    """

    schedule: str = "1sm"
    tile_n: int = 128
    out_dtype: str = "bf16"
    cluster_m: Optional[int] = None  # None: the schedule's default cluster
    cluster_n: int = 1
    tile_k: int = 256

    def __post_init__(self):
        if self.schedule not in _TILE_M:
            raise ValueError(f"schedule must be one of {sorted(_TILE_M)}, got {self.schedule!r}")
        if self.cluster_m is None:
            object.__setattr__(self, "cluster_m", _CLUSTERS[self.schedule][0][0])
        if self.out_dtype not in _OUT_DTYPES:
            raise ValueError(f"out_dtype must be one of {sorted(_OUT_DTYPES)}, got {self.out_dtype!r}")
        if self.tile_n == 256:
            raise ValueError(
                "tile_n=256 is not offered: its builds spill registers and get 1-4 pipeline stages "
                f"(benchmarks/RESULTS.md); choose one of {_TILE_N}"
            )
        if self.tile_n not in _TILE_N:
            raise ValueError(f"tile_n must be one of {_TILE_N} for NVFP4 MMAs, got {self.tile_n}")
        if self.tile_k != 256:
            raise ValueError(f"NVFP4 MMA tiles are 256 deep along K (4 MMAs of K=64), got tile_k={self.tile_k}")
        if (self.cluster_m, self.cluster_n) not in _CLUSTERS[self.schedule]:
            raise ValueError(
                f"cluster {self.cluster_m}x{self.cluster_n} is not offered for the {self.schedule} schedule; "
                f"choose one of {_CLUSTERS[self.schedule]}"
            )

    @classmethod
    def from_name(cls, name: str) -> "GemmConfig":
        """The configuration whose ``name`` is ``name`` (kernel names travel through graphs as strings)."""
        match = re.fullmatch(r"nvfp4_gemm_(1sm|2sm)_(\d+)x(\d+)x(\d+)_c(\d+)x(\d+)_(bf16|fp32)", name)
        if not match:
            raise ValueError(f"{name!r} is not a CUTLASS NVFP4 GEMM kernel name")
        schedule, tile_m, tile_n, tile_k, cluster_m, cluster_n, out = match.groups()
        config = cls(schedule, int(tile_n), out, int(cluster_m), int(cluster_n), int(tile_k))
        if config.tile_m != int(tile_m):
            raise ValueError(f"{name!r}: the {schedule} schedule has {config.tile_m}-row tiles, not {tile_m}")
        return config

    @property
    def tile_m(self) -> int:
        return _TILE_M[self.schedule]

    @property
    def sms_per_tile(self) -> int:
        return 2 if self.schedule == "2sm" else 1

    @property
    def name(self) -> str:
        """A C identifier naming the kernel, unique per configuration."""
        return (
            f"nvfp4_gemm_{self.schedule}_{self.tile_m}x{self.tile_n}x{self.tile_k}"
            f"_c{self.cluster_m}x{self.cluster_n}_{self.out_dtype}"
        )

    @property
    def torch_out_dtype(self) -> torch.dtype:
        return _OUT_DTYPES[self.out_dtype][1]

    def template_params(self) -> dict:
        sm = self.sms_per_tile
        return {
            "name": self.name,
            "schedule": self.schedule,
            "tile_m": self.tile_m,
            "tile_n": self.tile_n,
            "tile_k": self.tile_k,
            "cluster_m": self.cluster_m,
            "cluster_n": self.cluster_n,
            "out_ctype": _OUT_DTYPES[self.out_dtype][0],
            "mainloop_schedule": f"KernelTmaWarpSpecialized{sm}SmNvf4Sm100",
            "epilogue_schedule": f"TmaWarpSpecialized{sm}Sm",
            "inv_global_hex": _inv_global_hex(),
        }


def _inv_global_hex() -> str:
    """fp32(1/2688) as a C hex-float literal: the decode constant of fp4compile.formats, bit for bit."""
    from fp4compile.formats import NVFP4_GLOBAL

    return float(torch.tensor(1.0 / NVFP4_GLOBAL, dtype=torch.float32)).hex()


def supported_configs() -> list[GemmConfig]:
    """Every configuration the templates support (each renders and compiles for sm_100a)."""
    return [
        GemmConfig(schedule, tile_n, out, cm, cn)
        for schedule, clusters in _CLUSTERS.items()
        for (cm, cn) in clusters
        for tile_n in _TILE_N
        for out in _OUT_DTYPES
    ]


def _out_name(out_dtype: Union[str, torch.dtype]) -> Optional[str]:
    if isinstance(out_dtype, torch.dtype):
        return _TORCH_TO_OUT.get(out_dtype)
    return out_dtype if out_dtype in _OUT_DTYPES else None


def _static_int(d) -> Optional[int]:
    """``d`` as an int when it is one (or a SymInt with a constant value), else None."""
    if isinstance(d, int):
        return d
    node = getattr(d, "node", None)
    if node is not None and node.is_constant():
        return int(d)
    return None


def size_hint(d, default: int = DEFAULT_M_HINT) -> int:
    """An int standing for the size ``d``: itself when static, else the SymInt's hint (the size dynamo
    last saw), else ``default``. Never adds a shape guard."""
    value = _static_int(d)
    if value is not None:
        return value
    hint = getattr(getattr(d, "node", None), "hint", None)
    return int(hint) if isinstance(hint, int) and hint > 0 else default


def select_config(
    m, n, k, out_dtype: Union[str, torch.dtype] = "bf16", *, num_sms: int = DEFAULT_NUM_SMS
) -> tuple[Optional[GemmConfig], str]:
    """The configuration for an (M, N, K) GEMM with the given output dtype, and why; (None, why not).

    Pure: depends on its arguments only, builds nothing. M and K may be symbolic (SymInt, or None for
    unknown): the configuration does not depend on K, and M is replaced by its size hint
    (``size_hint``). N must be static.

    Rules: N, K > 0 where static, M >= 0; N % 32 == 0 (16-byte aligned TMA rows); K % 16 == 0 (the
    block; a K that is not a multiple of 32 is zero-padded to one at run time); output BF16 or FP32.
    Heuristic (wave quantization): for each candidate tile (1-SM 128x64, 128x128, 128x192; 2-SM
    256x128, 256x192) count the output tiles, the waves needed to run them with ``num_sms`` SMs (a 2-SM tile
    occupies two), and estimate ``waves * per-SM tile area * (1 + 32 * per-SM operand rows / per-SM
    tile area)``: the MMA work of the slowest SM plus a term for loading A and B, which is what larger
    tiles and the 2-SM split of B save. The lowest estimate wins; ties go to the larger tile.
    """
    out = _out_name(out_dtype)
    if out is None:
        return None, f"output dtype {out_dtype} is not supported by the CUTLASS NVFP4 GEMM (bf16 or fp32)"
    n_static, k_static = _static_int(n), _static_int(k)
    if n_static is None:
        return None, f"N={n} is symbolic; CUTLASS configurations need a static N"
    m_static = _static_int(m)
    m_used = size_hint(m)
    if n_static <= 0 or (k_static is not None and k_static <= 0) or (m_static is not None and m_static <= 0):
        return None, f"empty GEMM (M={m}, N={n}, K={k})"
    rules = [("N", n_static, ALIGN_N)] + ([("K", k_static, BLOCK_K)] if k_static is not None else [])
    misaligned = [f"{dim}={v} is not a multiple of {a}" for dim, v, a in rules if v % a]
    if misaligned:
        return None, "alignment: " + " and ".join(misaligned) + " (16-byte TMA rows); use emulation or pad"
    best = None
    for schedule, tile_n in _CANDIDATE_TILES:
        config = GemmConfig(schedule, tile_n, out)
        tiles = math.ceil(m_used / config.tile_m) * math.ceil(n_static / tile_n)
        slots = max(num_sms // config.sms_per_tile, 1)
        waves = math.ceil(tiles / slots)
        rows_per_sm = config.tile_m // config.sms_per_tile
        area = rows_per_sm * tile_n
        traffic = rows_per_sm + tile_n / config.sms_per_tile
        cost = waves * area * (1.0 + _TRAFFIC_WEIGHT * traffic / area)
        rank = (cost, -config.tile_m * tile_n)
        if best is None or rank < best[0]:
            best = (rank, config, tiles, waves)
    (cost, _), config, tiles, waves = best
    notes = []
    if m_static is None:
        notes.append(f"M={m} symbolic, sized for its hint {m_used}")
    if k_static is None or k_static % ALIGN_K:
        notes.append(f"K={k} zero-padded to a multiple of {ALIGN_K} at run time when it is not one")
    reason = (
        f"{config.name}: {tiles} tile(s) of {config.tile_m}x{config.tile_n} on {num_sms} SMs "
        f"({config.sms_per_tile} SM per tile) = {waves} wave(s), estimated cost {cost:.0f}, "
        f"lowest of {len(_CANDIDATE_TILES)} candidates" + "".join(f"; {note}" for note in notes)
    )
    return config, reason


def report_shapes(report) -> list[tuple]:
    """(M, N, K) of every NVFP4 GEMM in a ``fp4compile.Report`` (each site's fprop, dgrad and wgrad);
    a symbolic dim (text in the report) is None."""
    shapes = []
    for site in report.sites:
        for info in site.roles.values():
            if info.precision == "nvfp4" and info.shape:
                shapes.append(tuple(d if isinstance(d, int) else None for d in info.shape))
    return shapes


def configs_for_shapes(shapes, out_dtype: Union[str, torch.dtype] = "bf16") -> tuple[dict, list]:
    """({configuration: [the shapes that select it]}, [(shape, reason) of those that select none]), as
    ``select_config`` chooses for each (M, N, K); None stands for a symbolic dim."""
    chosen: dict = {}
    rejected = []
    for shape in shapes:
        config, reason = select_config(*shape, out_dtype)
        if config is None:
            rejected.append((shape, reason))
        else:
            chosen.setdefault(config, []).append(shape)
    return chosen, rejected


def expected_scales_numel(rows: int, k: int) -> int:
    """Bytes of swizzled scales the kernel reads for a [rows, K] operand: round_up(rows,128) * round_up(K/16,4)."""
    return -(-rows // 128) * 128 * (-(-(k // 16) // 4) * 4)


# ----------------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------------


def render(config: GemmConfig) -> str:
    """CUDA source of the kernel translation unit (CUTLASS only, no torch headers)."""
    return _jinja(KERNEL_TEMPLATE).render(**config.template_params())


def render_binding(config: GemmConfig) -> str:
    """C++ source of the torch binding that registers ``torch.ops.fp4compile_cutlass.<config.name>``."""
    return _jinja(BINDING_TEMPLATE).render(
        name=config.name,
        namespace=OP_NAMESPACE,
        align_k=ALIGN_K,
        align_n=ALIGN_N,
        out_torch_dtype=str(config.torch_out_dtype),
        out_scalar_type=_OUT_DTYPES[config.out_dtype][2],
    )


# ----------------------------------------------------------------------------------------------
# Building
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BuildResult:
    """Files of one built kernel (all inside its cache entry).

    ``paths`` maps "cu" (kernel source), "binding" (torch binding source), "ptx", "cubin",
    "object" (host object of the kernel TU) and, where torch has CUDA, "module" (the loadable torch
    extension). ``from_cache`` is True when no compiler ran.
    """

    paths: dict
    from_cache: bool
    key: str
    entry_dir: Path

    @property
    def cu(self) -> Path:
        return self.paths["cu"]

    @property
    def ptx(self) -> Path:
        return self.paths["ptx"]

    @property
    def module(self) -> Optional[Path]:
        return self.paths.get("module")


_ENTRY_FILES = {
    "cu": "kernel.cu",
    "binding": "binding.cpp",
    "ptx": "kernel.ptx",
    "cubin": "kernel.cubin",
    "object": "kernel.o",
    "module": "module.so",
    "log": "build.log",
}


def _torch_build_identity() -> dict:
    """What the torch extension module depends on; None fields when torch has no CUDA (no module built)."""
    return {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
    }


def _build_material(config, arch: str, nvcc: Optional[str], kind: str = "nvfp4_gemm",
                    templates: tuple = (KERNEL_TEMPLATE, BINDING_TEMPLATE)) -> dict:
    """Everything a build's output depends on: its hash is the cache key."""
    return {
        "kind": kind,
        "kernel_template_sha256": hashlib.sha256(_template_text(templates[0]).encode()).hexdigest(),
        "binding_template_sha256": hashlib.sha256(_template_text(templates[1]).encode()).hexdigest(),
        "config": dataclasses.asdict(config),
        "params": config.template_params(),
        "arch": arch,
        "nvcc": nvcc_version(nvcc) if nvcc else None,
        "nvcc_flags": list(NVCC_FLAGS),
        "binding_flags": list(BINDING_FLAGS),
        "cutlass": cutlass_version(),
        **_torch_build_identity(),
    }


def build(config: GemmConfig, arch: str = "sm_100a", progress: bool = True) -> BuildResult:
    """Render, compile and cache ``config`` for ``arch``; return the files, from the cache when present.

    Always produces the kernel source, PTX, cubin and host object (needs nvcc and the CUTLASS headers,
    not a GPU). The torch extension module is linked too when torch has CUDA, which needs nvcc of the
    same CUDA major version as torch. Raises ``KernelBuildError`` when anything is missing or fails.
    """
    return compile_kernel(
        config.name, arch, lambda nvcc: _build_material(config, arch, nvcc), lambda: render(config),
        lambda: render_binding(config), progress,
    )


def compile_kernel(name: str, arch: str, material_of: Callable, kernel_source: Callable, binding_source: Callable,
                   progress: bool = True) -> BuildResult:
    """Build (or find in the cache) the kernel ``name`` for ``arch``: ``material_of(nvcc)`` is what the
    output depends on (the cache key), ``kernel_source()`` and ``binding_source()`` the two translation
    units. Shared by every generated CUTLASS kernel (``cutlass_grouped`` too)."""
    arch_flag = gencode(arch)
    nvcc = check_toolkit(arch)  # before any compile: a toolkit that cannot build this arch or link with torch
    includes = cutlass_include_dirs()
    material = material_of(nvcc)
    with_module = torch.version.cuda is not None

    def produce(tmp: Path) -> list[str]:
        files = _ENTRY_FILES
        (tmp / files["cu"]).write_text(kernel_source())
        (tmp / files["binding"]).write_text(binding_source())
        keep_dir = tmp / "keep"
        keep_dir.mkdir()
        log = run_compiler(
            [nvcc, arch_flag, *NVCC_FLAGS, *(f"-I{d}" for d in includes),
             "-c", files["cu"], "-o", files["object"], "-keep", f"-keep-dir={keep_dir.name}"],
            label=f"{name} for {arch}",
            progress=progress,
            cwd=tmp,
        )
        for suffix, target in ((".ptx", files["ptx"]), (".cubin", files["cubin"])):
            found = sorted(keep_dir.glob(f"*{suffix}"))
            if not found:
                raise KernelBuildError(f"nvcc produced no {suffix} file for {name}", stderr=log)
            shutil.move(str(found[0]), tmp / target)
        shutil.rmtree(keep_dir)
        kept = [files[k] for k in ("cu", "binding", "ptx", "cubin", "object")]
        if with_module:
            log += _link_module(nvcc, tmp, files, name, progress)
            kept.append(files["module"])
        (tmp / files["log"]).write_text(log)
        return kept + [files["log"]]

    entry = cached_build(name, material, produce, progress=progress)
    paths = {k: entry.file(v) for k, v in _ENTRY_FILES.items() if (entry.path / v).exists()}
    return BuildResult(paths=paths, from_cache=entry.from_cache, key=entry.key, entry_dir=entry.path)


def _link_module(nvcc: str, tmp: Path, files: dict, name: str, progress: bool) -> str:
    """Compile the binding against torch and link it with the kernel object into module.so."""
    from torch.utils import cpp_extension

    abi = int(bool(torch._C._GLIBCXX_USE_CXX11_ABI))
    cmd = [
        nvcc, "-shared", *BINDING_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{d}" for d in cpp_extension.include_paths()),
        files["binding"], files["object"], "-o", files["module"],
        *(f"-L{d}" for d in cpp_extension.library_paths()),
        "-lc10", "-lc10_cuda", "-ltorch", "-ltorch_cpu", "-ltorch_cuda", "-cudart=shared",
    ]
    return run_compiler(cmd, label=f"torch binding of {name}", progress=progress, cwd=tmp)


def find_prebuilt(config: GemmConfig, arch: str) -> Optional[BuildResult]:
    """A verified cache entry of ``config`` for ``arch`` with a torch extension module built for this
    torch by any nvcc (a cache filled ahead of time on another machine), or None."""
    return find_prebuilt_entry(lambda: _build_material(config, arch, None))


def find_prebuilt_entry(material_of: Callable) -> Optional[BuildResult]:
    """The newest verified cache entry whose material, nvcc aside, is ``material_of()`` and that holds
    a torch extension module, or None."""
    try:
        want = {k: v for k, v in material_of().items() if k != "nvcc"}
    except KernelBuildError:  # no CUTLASS headers: their version is part of the material
        return None
    for entry in reversed(list_entries()):
        material = {k: v for k, v in entry["material"].items() if k != "nvcc"}
        if entry["ok"] and material == json.loads(json.dumps(want, default=str)) and _ENTRY_FILES["module"] in entry["files"]:
            paths = {k: entry["path"] / v for k, v in _ENTRY_FILES.items() if (entry["path"] / v).exists()}
            return BuildResult(paths=paths, from_cache=True, key=entry["key"], entry_dir=entry["path"])
    return None


def build_stats(result: BuildResult) -> dict:
    """What a build says about its kernel without a GPU: the mainloop's pipeline stages (from the PTX)
    and, for the GEMM kernel (the largest register count of the TU), ptxas's registers and spill bytes
    (from build.log)."""
    stats: dict = {}
    stages = re.search(r"_pipeline_stages = (\d+);", result.ptx.read_text())
    if stages:
        stats["stages"] = int(stages.group(1))
    log_path = result.paths.get("log")
    text = log_path.read_text() if log_path is not None else ""
    kernels = re.findall(
        r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads\s*\n.*?Used (\d+) registers", text
    )
    if kernels:
        stack, stores, loads, regs = max((tuple(map(int, k)) for k in kernels), key=lambda k: k[3])
        stats.update(registers=regs, spill_stores=stores, spill_loads=loads, stack=stack)
    return stats


_LOADED: dict[tuple[str, str], Callable] = {}


def load(config: GemmConfig, arch: Optional[str] = None, progress: bool = True, device=None) -> Callable:
    """The kernel as a callable ``(a_data, a_scales, a_amax, b_data, b_scales, b_amax, bias=None) -> out``.

    Builds (or reuses the cache) for ``arch`` (default: that of ``device``, else of the current
    device), loads the torch extension once per process and returns
    ``torch.ops.fp4compile_cutlass.<config.name>``. Operands: data [rows, K/2] uint8 or
    float4_e2m1fn_x2 (K-major, contiguous), scales swizzled (``formats.swizzle_scales``), amax fp32
    scalars, bias [N] or None; all on one CUDA device. Raises ``KernelBuildError`` when the module
    cannot be built or loaded here.
    """
    arch = arch or arch_for_device(device)
    return load_op(config.name, arch, lambda: build(config, arch=arch, progress=progress),
                   lambda: find_prebuilt(config, arch))


def load_op(name: str, arch: str, build_it: Callable, prebuilt: Callable) -> Callable:
    """``torch.ops.fp4compile_cutlass.<name>`` for ``arch``, loading its module once per process: from
    ``build_it()``, else (no usable nvcc here) from ``prebuilt()``, a build made ahead of time."""
    if torch.version.cuda is None:
        raise KernelBuildError(f"torch {torch.__version__} has no CUDA: the CUTLASS kernel module cannot be loaded")
    if (name, arch) not in _LOADED:
        try:
            result = build_it()
        except KernelBuildError:
            # No (usable) nvcc here: a build made ahead of time by another toolkit for this torch serves.
            result = prebuilt()
            if result is None:
                raise
        if result.module is None:
            raise KernelBuildError(f"the cache entry {result.entry_dir} has no torch extension module")
        try:
            torch.ops.load_library(str(result.module))
            _LOADED[name, arch] = getattr(getattr(torch.ops, OP_NAMESPACE), name)
        except (OSError, RuntimeError, AttributeError) as exc:
            raise KernelBuildError(f"cannot load {result.module}: {exc}") from exc
    return _LOADED[name, arch]


def scaled_mm(
    config: GemmConfig,
    a_data: torch.Tensor,
    a_scales: torch.Tensor,
    a_amax: torch.Tensor,
    b_data: torch.Tensor,
    b_scales: torch.Tensor,
    b_amax: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``alpha * A . B^T (+ bias)`` with the CUTLASS kernel of ``config``, from ``formats.quantize`` output.

    Scales may be given as ``quantize`` returns them ([rows, K/16], swizzled here with
    ``formats.swizzle_scales``) or already swizzled (1-D); a K that is not a multiple of 32 is padded
    with zero codes (``cutlass_runtime.prepare_operands``). Operand dtypes and layouts are checked
    (``cutlass_runtime.check_operands``). Raises ``KernelBuildError`` when the kernel cannot be built
    or loaded on this machine.
    """
    from .cutlass_runtime import check_operands, prepare_operands

    m, n, k = a_data.shape[0], b_data.shape[0], a_data.shape[-1] * 2
    if m == 0 or n == 0 or k == 0:
        # Nothing to multiply (an expert that got no tokens): eager's result, without building or launching.
        out = torch.zeros((m, n), dtype=config.torch_out_dtype, device=a_data.device)
        return out + bias.to(out.dtype) if bias is not None else out
    if a_data.device.type != "cuda":
        raise ValueError(f"the CUTLASS NVFP4 GEMM runs on CUDA tensors, got a tensor on {a_data.device}")
    from fp4compile.formats import swizzle_scales

    # A direct call with quantize's row-major scales: swizzled here (compiled graphs hand the tiled layout).
    a_scales, b_scales = (swizzle_scales(s) if s.dim() == 2 else s for s in (a_scales, b_scales))
    a_data, a_scales, b_data, b_scales = prepare_operands(a_data, a_scales, b_data, b_scales)
    padded_k = a_data.shape[-1] * 2
    check_operands(config.name, "A", a_data, a_scales, a_amax, padded_k)
    check_operands(config.name, "B", b_data, b_scales, b_amax, padded_k)
    kernel = load(config, device=a_data.device)
    return kernel(a_data, a_scales, a_amax, b_data, b_scales, b_amax, bias)


# ----------------------------------------------------------------------------------------------
# Scale-layout cross-check against CUTLASS (host only)
# ----------------------------------------------------------------------------------------------


def scale_layout_probe(m: int, n: int, k: int, progress: bool = False) -> dict:
    """Scale offsets of CUTLASS's ``Sm1xxBlockScaledConfig<16>`` layouts for an M x N x K problem.

    Compiles ``cutlass_templates/scale_layout_probe.cu`` (host code, cached like the kernels) and runs
    it on this machine. Returns ``{"SFA": int64 tensor [M, K/16], "SFB": [N, K/16], "SIZE_SFA": bytes,
    "SIZE_SFB": bytes}`` with the byte offset of each (row, 16-element block) scale.
    """
    nvcc = find_nvcc()
    if nvcc is None:
        raise KernelBuildError("nvcc not found (set CUDA_HOME or FP4COMPILE_NVCC, or put nvcc on PATH)")
    includes = cutlass_include_dirs()
    source = _template_text(PROBE_SOURCE)
    material = {
        "kind": "scale_layout_probe",
        "source_sha256": hashlib.sha256(source.encode()).hexdigest(),
        "nvcc": nvcc_version(nvcc),
        "cutlass": cutlass_version(),
    }

    def produce(tmp: Path) -> list[str]:
        (tmp / PROBE_SOURCE).write_text(source)
        # PTX only for the (empty) device side keeps the compile short; the program runs on the host.
        run_compiler(
            [nvcc, "-std=c++17", "-arch=compute_100a", "-code=compute_100a", *(f"-I{d}" for d in includes),
             PROBE_SOURCE, "-o", "scale_layout_probe"],
            label="scale layout probe",
            progress=progress,
            cwd=tmp,
        )
        return [PROBE_SOURCE, "scale_layout_probe"]

    entry = cached_build("scale_layout_probe", material, produce, progress=progress)
    exe = entry.file("scale_layout_probe")
    exe.chmod(exe.stat().st_mode | 0o100)
    out = subprocess.run([str(exe), str(m), str(n), str(k)], capture_output=True, text=True, check=True).stdout
    result = {name: torch.full((rows, k // 16), -1, dtype=torch.int64) for name, rows in (("SFA", m), ("SFB", n))}
    for line in out.splitlines():
        fields = line.split()
        if fields[0] == "SIZE":
            result[f"SIZE_{fields[1]}"] = int(fields[2])
        else:
            result[fields[0]][int(fields[1]), int(fields[2])] = int(fields[3])
    return result
