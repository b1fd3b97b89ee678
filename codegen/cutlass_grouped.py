"""CUTLASS grouped block-scaled NVFP4 GEMMs for Blackwell: the experts of a MoE projection in one launch.

A grouped site (``fp4compile.grouped``) computes, per expert e, one GEMM of each role over the rows
(tokens) routed to it. The kernel here runs every non-empty expert of one role as a group of CUTLASS's
SM100 grouped block-scaled GEMM (``KernelPtrArrayTmaWarpSpecialized{1,2}SmNvf4Sm100``, the collective
``MainloopSm100ArrayTmaUmmaWarpSpecializedBlockScaled``)::

    D_g[M_g, N_g] = alpha[e_g] * A_g[M_g, K_g] . B_g[N_g, K_g]^T

with A_g and B_g packed NVFP4 (K-major), each group's E4M3 scales a 128x4 tiled buffer of its own, and
``alpha[e] = (amax_A[e] / 2688) * (amax_B[e] / 2688)`` computed on the device from the per-expert amax
arrays. What each role's groups are:

| role | group e: M x N x K | A_e | B_e | D_e |
|---|---|---|---|---|
| fprop | tokens_e x N x K | X rows of e | W_e [N, K] | Y rows of e |
| dgrad | tokens_e x K x N | dY rows of e | W_e^T [K, N] (16x16 tiles read transposed) | dX rows of e |
| wgrad | N x K x pad32(tokens_e) | RHT(dY_e^T) [N, tokens] | RHT(X_e^T) [K, tokens] | dW_e |

The per-group pointers, problem shapes, strides and scale layouts are packed by
``cutlass_grouped_runtime.pack`` as a table of byte offsets (``GROUP_COLUMNS``); the binding checks
it and the kernel's host code turns it into CUTLASS's device arrays. Experts with no tokens are left
out of the table (their rows do not exist; their weight gradient is zero).

Flow as for the dense kernels (``cutlass_gemm``): ``select_grouped_config`` is pure (alignment rules and
the wave cost model over the experts' tiles), ``build``/``load`` render
``cutlass_templates/nvfp4_grouped_gemm_sm100.cu.j2`` and ``nvfp4_grouped_gemm_binding.cpp.j2``, compile
them with nvcc (``cutlass_gemm.compile_kernel``: toolkit check, cache, PTX, cubin, module) and load
``torch.ops.fp4compile_cutlass.<name>``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable, Optional, Union

import torch

from . import cutlass_gemm
from .build_cache import KernelBuildError
from .cutlass_gemm import (
    ALIGN_K,
    ALIGN_N,
    DEFAULT_NUM_SMS,
    OP_NAMESPACE,
    BuildResult,
    _jinja,
    size_hint,
)
from .cutlass_toolkit import arch_for_device

__all__ = [
    "GroupedGemmConfig", "GROUP_COLUMNS", "ROLES", "supported_configs", "select_grouped_config", "group_dims",
    "render", "render_binding", "build", "load", "KernelBuildError",
]

KERNEL_TEMPLATE = "nvfp4_grouped_gemm_sm100.cu.j2"
BINDING_TEMPLATE = "nvfp4_grouped_gemm_binding.cpp.j2"
# One row of the group table: the expert, the problem and the byte offsets of each group's operands.
GROUP_COLUMNS = ("expert", "m", "n", "k", "a_offset", "b_offset", "sfa_offset", "sfb_offset", "d_offset")
ROLES = ("fprop", "dgrad", "wgrad")

_OUT_DTYPES = cutlass_gemm._OUT_DTYPES
_TILE_M = cutlass_gemm._TILE_M
_TILE_N = (64, 128)
_CLUSTER_M = {"1sm": 1, "2sm": 2}
# Tiles the selection chooses among (all supported ones): a 1-SM tile suits the few rows most experts
# get; the 2-SM tile halves the B traffic per SM of experts with many rows.
_CANDIDATE_TILES = (("1sm", 64), ("1sm", 128), ("2sm", 128))
_TRAFFIC_WEIGHT = 32.0


@dataclasses.dataclass(frozen=True)
class GroupedGemmConfig(cutlass_gemm.GemmConfig):
    """One compiled grouped kernel: MMA tile (``tile_m`` from the schedule) x ``tile_n`` x 256, the
    1-SM or 2-SM schedule with its default cluster (1x1 or 2x1), output dtype. A configuration of its
    own type: it never equals a dense one."""

    def __post_init__(self):
        super().__post_init__()
        if self.tile_n not in _TILE_N:
            raise ValueError(f"grouped kernel tile_n must be one of {_TILE_N}, got {self.tile_n}")
        if (self.cluster_m, self.cluster_n) != (_CLUSTER_M[self.schedule], 1):
            raise ValueError(f"grouped kernels use the {self.schedule} schedule's {_CLUSTER_M[self.schedule]}x1 cluster")

    @classmethod
    def from_name(cls, name: str) -> "GroupedGemmConfig":
        match = re.fullmatch(r"nvfp4_grouped_(1sm|2sm)_(\d+)x(\d+)x256_c(\d)x1_(bf16|fp32)", name)
        if not match:
            raise ValueError(f"{name!r} is not a CUTLASS NVFP4 grouped GEMM kernel name")
        schedule, _, tile_n, _, out = match.groups()
        config = cls(schedule, int(tile_n), out)
        if config.name != name:
            raise ValueError(f"{name!r}: the {schedule} schedule has {config.tile_m}-row tiles and a {config.cluster_m}x1 cluster")
        return config

    @property
    def name(self) -> str:
        return f"nvfp4_grouped_{self.schedule}_{self.tile_m}x{self.tile_n}x256_c{self.cluster_m}x1_{self.out_dtype}"

    def template_params(self) -> dict:
        sm = self.sms_per_tile
        return {
            "name": self.name, "schedule": self.schedule, "tile_m": self.tile_m, "tile_n": self.tile_n, "tile_k": 256,
            "cluster_m": self.cluster_m, "cluster_n": 1, "out_ctype": _OUT_DTYPES[self.out_dtype][0],
            "mainloop_schedule": f"KernelPtrArrayTmaWarpSpecialized{sm}SmNvf4Sm100",
            "epilogue_schedule": f"PtrArrayTmaWarpSpecialized{sm}Sm",
            "inv_global_hex": cutlass_gemm._inv_global_hex(),
        }


def supported_configs() -> list[GroupedGemmConfig]:
    """Every grouped configuration the templates support (each renders and compiles for sm_100a)."""
    return [GroupedGemmConfig(s, n, out) for s in _TILE_M for n in _TILE_N for out in _OUT_DTYPES]


def group_dims(role: str, out_features, in_features, tokens) -> tuple:
    """(M, N, K) of one expert's ``role`` GEMM for a site of ``out_features`` x ``in_features`` when it
    receives ``tokens`` rows (wgrad's K is the token count, padded to 32 per expert by the packing)."""
    if role == "fprop":
        return tokens, out_features, in_features
    if role == "dgrad":
        return tokens, in_features, out_features
    if role == "wgrad":
        return out_features, in_features, tokens
    raise ValueError(f"grouped GEMM role must be one of {ROLES}, got {role!r}")


def select_grouped_config(
    role: str, out_features: int, in_features: int, tokens, experts: int,
    out_dtype: Union[str, torch.dtype] = "bf16", *, num_sms: int = DEFAULT_NUM_SMS,
) -> tuple[Optional[GroupedGemmConfig], str]:
    """The grouped configuration for one role of a grouped site, and why; (None, why not). Pure.

    ``tokens`` is the routed row count S (an int, a SymInt whose hint is used, or None); the experts
    are assumed to share it evenly (S / E rows each), which is what the cost model sizes tiles for.
    Rules: output BF16 or FP32; the GEMM's N a multiple of 32 (16-byte output rows and TMA boxes);
    fprop and dgrad K (the site's in or out features) a multiple of 32 (16-byte rows of codes; these
    are not padded); wgrad K is each expert's token count, padded to 32 when packed. Heuristic: the
    dense wave cost model (``cutlass_gemm.select_config``) over the tiles of all experts.
    """
    out = cutlass_gemm._out_name(out_dtype)
    if out is None:
        return None, f"output dtype {out_dtype} is not supported by the CUTLASS NVFP4 grouped GEMM (bf16 or fp32)"
    if experts <= 0:
        return None, f"no experts ({experts})"
    rows = max(size_hint(tokens) // experts, 1)
    m, n, k = group_dims(role, out_features, in_features, rows)
    rules = [("N", n, ALIGN_N)] + ([] if role == "wgrad" else [("K", k, ALIGN_K)])
    bad = [f"{dim}={v} is not a multiple of {a}" for dim, v, a in rules if not isinstance(v, int) or v <= 0 or v % a]
    if bad:
        return None, f"alignment of the {role} GEMM (per expert M x N x K = {m}x{n}x{k}): " + " and ".join(bad) + \
            " (16-byte TMA rows)"
    best = None
    for schedule, tile_n in _CANDIDATE_TILES:
        config = GroupedGemmConfig(schedule, tile_n, out)
        tiles = experts * math.ceil(m / config.tile_m) * math.ceil(n / tile_n)
        waves = math.ceil(tiles / max(num_sms // config.sms_per_tile, 1))
        rows_per_sm = config.tile_m // config.sms_per_tile
        area = rows_per_sm * tile_n
        cost = waves * area * (1.0 + _TRAFFIC_WEIGHT * (rows_per_sm + tile_n / config.sms_per_tile) / area)
        rank = (cost, -config.tile_m * tile_n)
        if best is None or rank < best[0]:
            best = (rank, config, tiles, waves)
    (cost, _), config, tiles, waves = best
    reason = (
        f"{config.name}: {experts} experts x {m}x{n}x{k} ({rows} tokens per expert on average) = {tiles} tile(s) "
        f"of {config.tile_m}x{config.tile_n} on {num_sms} SMs = {waves} wave(s), estimated cost {cost:.0f}, "
        f"lowest of {len(_CANDIDATE_TILES)} candidates"
    )
    return config, reason


def render(config: GroupedGemmConfig) -> str:
    """CUDA source of the grouped kernel translation unit (CUTLASS only, no torch headers)."""
    return _jinja(KERNEL_TEMPLATE).render(**config.template_params())


def render_binding(config: GroupedGemmConfig) -> str:
    """C++ source of the torch binding that registers ``torch.ops.fp4compile_cutlass.<config.name>``."""
    return _jinja(BINDING_TEMPLATE).render(
        name=config.name, namespace=OP_NAMESPACE, columns=len(GROUP_COLUMNS), align_k=ALIGN_K, align_n=ALIGN_N,
        out_torch_dtype=str(config.torch_out_dtype), out_scalar_type=_OUT_DTYPES[config.out_dtype][2],
    )


def _build_material(config: GroupedGemmConfig, arch: str, nvcc: Optional[str]) -> dict:
    """Everything a grouped build's output depends on: its hash is the cache key."""
    return cutlass_gemm._build_material(config, arch, nvcc, "nvfp4_grouped_gemm", (KERNEL_TEMPLATE, BINDING_TEMPLATE))


def build(config: GroupedGemmConfig, arch: str = "sm_100a", progress: bool = True) -> BuildResult:
    """Render, compile and cache the grouped ``config`` for ``arch`` (as ``cutlass_gemm.build``)."""
    return cutlass_gemm.compile_kernel(
        config.name, arch, lambda nvcc: _build_material(config, arch, nvcc), lambda: render(config),
        lambda: render_binding(config), progress,
    )


def load(config: GroupedGemmConfig, arch: Optional[str] = None, progress: bool = True, device=None) -> Callable:
    """The grouped kernel as ``torch.ops.fp4compile_cutlass.<config.name>`` (a, a_scales, a_amax, b,
    b_scales, b_amax, groups, out) -> None, built or taken from the cache and loaded once per process.
    Raises ``KernelBuildError`` when the module cannot be built or loaded here."""
    arch = arch or arch_for_device(device)
    return cutlass_gemm.load_op(
        config.name, arch, lambda: build(config, arch=arch, progress=progress),
        lambda: cutlass_gemm.find_prebuilt_entry(lambda: _build_material(config, arch, None)),
    )
