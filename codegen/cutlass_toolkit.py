"""What the CUTLASS NVFP4 GEMMs need from the machine: the CUDA toolkit, the CUTLASS headers, the GPU.

``check_toolkit(arch)`` runs before every build: it reads nvcc's release and refuses a toolkit that
cannot build for ``arch`` (older than the first release that knows it) or whose CUDA major differs from
torch's (the torch extension module would not link or load), with an error naming both versions.
``device_supports_cutlass(device)`` says whether a GPU has the block-scaled tcgen05 MMA at all.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from pathlib import Path
from typing import Optional

import torch

from .build_cache import KernelBuildError, find_nvcc, nvcc_release, nvcc_version

__all__ = [
    "SUPPORTED_ARCHS",
    "MIN_CUDA",
    "TESTED_TOOLKITS",
    "cutlass_include_dirs",
    "cutlass_version",
    "toolchain_available",
    "check_toolkit",
    "toolkit_problem",
    "device_supports_cutlass",
    "is_cutlass_device",
    "arch_for_device",
    "gencode",
]

# Architectures the kernel is built for: arch-specific SM100 / SM103 targets, or the SM100 family
# target whose cubin runs on both.
SUPPORTED_ARCHS = ("sm_100a", "sm_103a", "sm_100f")
# The first CUDA release whose nvcc builds each target: 12.8 introduced sm_100a, 12.9 sm_103a and the
# family-specific "f" targets.
MIN_CUDA = {"sm_100a": (12, 8), "sm_103a": (12, 9), "sm_100f": (12, 9)}
# The toolkits the whole configuration matrix was built with (benchmarks/build_matrix.py,
# docs/kernels.md); others within MIN_CUDA are accepted but untested.
TESTED_TOOLKITS = ("13.0",)
_NO_NVCC = "nvcc not found (set CUDA_HOME or FP4COMPILE_NVCC, or put nvcc on PATH)"


def cutlass_include_dirs() -> list[Path]:
    """CUTLASS include directories from the nvidia-cutlass wheel: include/ and tools/util/include/."""
    try:
        import cutlass_library
    except ImportError as exc:
        raise KernelBuildError("the nvidia-cutlass package is not installed (pip install nvidia-cutlass)") from exc
    source = Path(cutlass_library.__file__).resolve().parent / "source"
    dirs = [source / "include", source / "tools" / "util" / "include"]
    if not (dirs[0] / "cutlass" / "cutlass.h").exists():
        raise KernelBuildError(f"the nvidia-cutlass package has no C++ headers under {dirs[0]}")
    return dirs


@functools.lru_cache(maxsize=None)
def cutlass_version() -> str:
    """CUTLASS version of the headers (version.h) and of the wheel that ships them."""
    version_h = (cutlass_include_dirs()[0] / "cutlass" / "version.h").read_text()
    parts = [re.search(rf"#define CUTLASS_{p}\s+(\d+)", version_h) for p in ("MAJOR", "MINOR", "PATCH")]
    headers = ".".join(p.group(1) if p else "?" for p in parts)
    try:
        wheel = importlib.metadata.version("nvidia-cutlass")
    except importlib.metadata.PackageNotFoundError:
        wheel = "unknown"
    return f"headers {headers}, nvidia-cutlass {wheel}"


def toolchain_available() -> tuple[bool, str]:
    """Whether nvcc and the CUTLASS headers are present (needed to build, not to load a cached kernel)."""
    nvcc = find_nvcc()
    if nvcc is None:
        return False, _NO_NVCC
    try:
        cutlass_include_dirs()
    except KernelBuildError as exc:
        return False, str(exc)
    return True, f"{nvcc} ({nvcc_version(nvcc)}), CUTLASS {cutlass_version()}"


def toolkit_problem(release: tuple[int, int], arch: str, torch_cuda: Optional[str]) -> Optional[str]:
    """Why CUDA ``release`` (major, minor) cannot build ``arch`` kernels for a torch built with CUDA
    ``torch_cuda`` (None: CPU torch, no module is linked); None when it can."""
    if arch not in MIN_CUDA:
        return f"arch {arch!r} is not supported; choose one of {SUPPORTED_ARCHS}"
    have, need = ".".join(map(str, release)), ".".join(map(str, MIN_CUDA[arch]))
    if release < MIN_CUDA[arch]:
        return f"nvcc is CUDA {have}, too old for {arch}: it needs CUDA {need} or newer"
    if torch_cuda is not None and release[0] != int(torch_cuda.split(".")[0]):
        return (
            f"nvcc is CUDA {have} but torch {torch.__version__} is built with CUDA {torch_cuda}: the extension "
            f"module needs the same CUDA major version (install a CUDA {torch_cuda.split('.')[0]}.x toolkit and "
            "point CUDA_HOME or FP4COMPILE_NVCC at its nvcc, or a torch built for CUDA "
            f"{release[0]})"
        )
    return None


def check_toolkit(arch: str) -> str:
    """The nvcc to build ``arch`` kernels with, after checking it can (``toolkit_problem``); raises
    ``KernelBuildError`` naming nvcc's and torch's CUDA versions when it cannot, before any compile."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise KernelBuildError(_NO_NVCC)
    problem = toolkit_problem(nvcc_release(nvcc_version(nvcc)), arch, torch.version.cuda)
    if problem is not None:
        raise KernelBuildError(f"{problem} ({nvcc})")
    return nvcc


def device_supports_cutlass(device=None) -> tuple[bool, str]:
    """Whether ``device`` can run the CUTLASS NVFP4 GEMMs: CUDA torch and an sm_100 / sm_103 class GPU."""
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is built without CUDA"
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda":
        return False, f"device {dev} is not a CUDA device"
    if not torch.cuda.is_available():
        return False, "no CUDA device is available"
    major, minor = torch.cuda.get_device_capability(dev)
    name = torch.cuda.get_device_name(dev)
    if (major, minor) in ((10, 0), (10, 3)):
        return True, f"{name} is compute capability {major}.{minor} (tcgen05 block-scaled MMA)"
    return False, (
        f"{name} is compute capability {major}.{minor}; the NVFP4 tensor-core GEMM needs 10.0 or 10.3 "
        "(B200/GB200/B300 class)"
    )


def is_cutlass_device(device) -> bool:
    """``device_supports_cutlass(device)[0]``, False for anything that is not a CUDA device."""
    return torch.device(device).type == "cuda" and device_supports_cutlass(device)[0]


def arch_for_device(device=None) -> str:
    """The nvcc arch to build for ``device``: sm_100a for compute capability 10.0, sm_103a for 10.3."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}a"


def gencode(arch: str) -> str:
    """nvcc's ``-gencode`` option for ``arch``."""
    if arch not in SUPPORTED_ARCHS:
        raise KernelBuildError(f"arch {arch!r} is not supported; choose one of {SUPPORTED_ARCHS}")
    number = arch[3:]
    return f"-gencode=arch=compute_{number},code=sm_{number}"
