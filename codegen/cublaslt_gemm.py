"""BF16 GEMMs whose epilogue applies a device-resident alpha: the emulated NVFP4 GEMM in one cuBLASLt call.

An emulated NVFP4 GEMM multiplies block-decoded operands (exact in bfloat16) with fp32 accumulation and
then applies ``alpha = formats.gemm_alpha(amax_A, amax_B)``, a value that lives on the GPU (it depends on
both operands' amax). ``torch.mm`` cannot take a device alpha, so without this module the product is
written in fp32 and read again by a separate epilogue kernel: 8 extra bytes per output element. cuBLASLt
can read alpha through a pointer (``CUBLASLT_POINTER_MODE_DEVICE``) and write the bfloat16 result
directly, which is what :func:`mm_alpha` does:

    out[M, N] = cast(alpha * sum_k A[m, k] * B[n, k])      fp32 accumulation, fp32 alpha, one rounding

The bindings are NVIDIA's ``nvmath-python`` (``pip install fp4compile[cuda]``); without them, or with
``FP4COMPILE_EMULATED_GEMM=torch``, the emulation keeps ``torch.mm`` plus the epilogue kernel, with the
same arithmetic up to the summation order. Split-K plans are restricted to reductions in fp32 (never in
the output type), so every algorithm cuBLASLt may pick sums in fp32.

Plans (descriptors, layouts and the heuristic's algorithm) are made once per shape and cached; the call
itself enqueues one GEMM on the current stream and is safe to record in a CUDA graph.
"""

from __future__ import annotations

import functools
import logging
import os
import threading

import numpy as np
import torch

__all__ = ["ENV", "Unsupported", "available", "enabled", "required", "log_fallback", "mm_alpha"]

log = logging.getLogger("fp4compile.codegen")

#: ``auto`` (default: cuBLASLt where it can run), ``cublaslt`` (required: an error if it cannot), ``torch``.
ENV = "FP4COMPILE_EMULATED_GEMM"

WORKSPACE_BYTES = 32 * 1024 * 1024  # what cuBLAS recommends for Hopper
_OUT_DTYPES = (torch.bfloat16, torch.float32)

_lock = threading.Lock()
_state: dict = {}  # "lt": the bindings module or an import error; per device index: handle, workspace, zero
_plans: dict = {}


def _bindings():
    if "lt" not in _state:
        try:
            import nvmath.bindings.cublasLt as lt

            _state["lt"] = lt
        except Exception as err:  # ImportError, or a library that fails to load
            _state["lt"] = err
    return _state["lt"]


def _mode() -> str:
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "cublaslt", "torch"):
        raise ValueError(f"{ENV}={mode!r}: expected auto, cublaslt or torch")
    return mode


@functools.lru_cache(maxsize=None)
def available() -> tuple[bool, str]:
    """(whether cuBLASLt GEMMs can run here, why or why not); fixed for the process, so asked once."""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    if torch.version.hip is not None:
        return False, "a ROCm build of PyTorch (cuBLASLt is CUDA's)"
    lt = _bindings()
    if isinstance(lt, Exception):
        return False, f"nvmath-python is not installed or cannot load cuBLASLt ({lt}); pip install fp4compile[cuda]"
    return True, f"cuBLASLt {lt.get_version()} through nvmath-python"


def enabled() -> bool:
    """Whether the emulated GEMM uses :func:`mm_alpha` (``FP4COMPILE_EMULATED_GEMM``, logged once)."""
    mode = _mode()
    if mode == "torch":
        return False
    ok, why = available()
    if not ok and mode == "cublaslt":
        raise RuntimeError(f"{ENV}=cublaslt, but cuBLASLt GEMMs cannot run here: {why}")
    key = ("logged", mode, ok)
    if key not in _state:
        _state[key] = True
        if ok:
            log.info("fp4compile: emulated FP4 GEMMs apply alpha in cuBLASLt's epilogue (%s)", why)
        else:
            # On a GPU this is the slower path: say so where it shows.
            (log.warning if torch.cuda.is_available() else log.info)(
                "fp4compile: emulated FP4 GEMMs use torch.mm with an fp32 output and a separate epilogue kernel: %s", why
            )
    return ok


def required() -> bool:
    """``FP4COMPILE_EMULATED_GEMM=cublaslt``: a problem cuBLASLt cannot take is an error, not a fallback."""
    return _mode() == "cublaslt"


def log_fallback(err: Exception) -> None:
    """Log (once per message) that one GEMM problem fell back to torch.mm, and why."""
    key = ("fallback", str(err))
    if key not in _state:
        _state[key] = True
        log.warning("fp4compile: this emulated FP4 GEMM runs as torch.mm plus an epilogue kernel: %s", err)


def _alignment(t: torch.Tensor) -> int:
    ptr = t.data_ptr()
    align = 256
    while align > 1 and ptr % align:
        align //= 2
    return align


def _row_major(t: torch.Tensor, rows: int, cols: int):
    """(tensor, stored row-major?, leading dimension) for the [rows, cols] matrix ``t``, without a copy
    where its strides are row-major or column-major with a padded leading dimension."""
    if t.stride(1) == 1 and t.stride(0) >= max(cols, 1):
        return t, True, t.stride(0)
    if t.stride(0) == 1 and t.stride(1) >= max(rows, 1):
        return t, False, t.stride(1)
    return t.contiguous(), True, cols


def _device_alloc(nbytes: int, zero: bool = False) -> int:
    """cudaMalloc on the current device, outside PyTorch's caching allocator: memory this module keeps
    for the process must not come from a CUDA-graph pool (Inductor's CUDA graph trees route every
    allocation made while they warm up or record into the graph's private pool)."""
    from cuda.bindings import runtime as cudart

    err, ptr = cudart.cudaMalloc(nbytes)
    if err != cudart.cudaError_t.cudaSuccess:
        raise Unsupported(f"cudaMalloc({nbytes}) for the cuBLASLt workspace failed: {err.name}")
    if zero:
        (err,) = cudart.cudaMemset(ptr, 0, nbytes)
        if err == cudart.cudaError_t.cudaSuccess:
            (err,) = cudart.cudaDeviceSynchronize()
        if err != cudart.cudaError_t.cudaSuccess:
            raise Unsupported(f"clearing the cuBLASLt beta scalar failed: {err.name}")
    return int(ptr)


def _device_state(device: torch.device):
    """(device index, (cuBLASLt handle, workspace pointer, pointer to a float32 zero)), made once per device."""
    lt = _bindings()
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        st = _state.get(index)
        if st is None:
            if torch.cuda.is_current_stream_capturing():
                raise Unsupported(
                    f"the first cuBLASLt GEMM on cuda:{index} runs inside a CUDA graph capture, where its "
                    "workspace cannot be allocated; run one step before capturing"
                )
            with torch.cuda.device(index):
                handle = lt.create()
                st = _state[index] = (handle, _device_alloc(WORKSPACE_BYTES), _device_alloc(4, zero=True))
    return index, st


def _set(setter, obj, attr, value, dtype) -> np.ndarray:
    buf = np.array([value], dtype=dtype)
    setter(obj, int(attr), buf.ctypes.data, buf.nbytes)
    return buf


def _cuda_dtype(dtype: torch.dtype) -> int:
    import nvmath

    return int({torch.bfloat16: nvmath.CudaDataType.CUDA_R_16BF, torch.float32: nvmath.CudaDataType.CUDA_R_32F}[dtype])


class Unsupported(RuntimeError):
    """cuBLASLt offers no algorithm for a GEMM problem under this module's constraints."""


def _plan(key, handle):
    """Descriptors and the heuristic's first algorithm for one GEMM problem (cached by the caller).

    alpha and beta are device pointers (``CUBLASLT_POINTER_MODE_DEVICE``; the vector modes that would
    let beta be a known zero have no BF16 algorithms on Hopper); beta points at a device zero, and with
    beta zero the epilogue does not read C (checked on the GPU with a NaN-filled output).
    """
    import nvmath
    from nvmath.bindings import cublas

    lt = _bindings()
    m, n, k, b_row_major, ldb, a_row_major, lda, out_dtype, aligns = key
    op = cublas.Operation
    desc = lt.matmul_desc_create(int(cublas.ComputeType.COMPUTE_32F), int(nvmath.CudaDataType.CUDA_R_32F))
    attr, dt = lt.MatmulDescAttribute, lt.get_matmul_desc_attribute_dtype
    keep = [
        _set(lt.matmul_desc_set_attribute, desc, attr.POINTER_MODE, int(lt.PointerMode.DEVICE), dt(attr.POINTER_MODE)),
        _set(lt.matmul_desc_set_attribute, desc, attr.TRANSA, int(op.T if b_row_major else op.N), dt(attr.TRANSA)),
        _set(lt.matmul_desc_set_attribute, desc, attr.TRANSB, int(op.N if a_row_major else op.T), dt(attr.TRANSB)),
    ]
    bf16 = _cuda_dtype(torch.bfloat16)
    # The row-major output [m, n] is cuBLASLt's column-major D [n, m] = op(B) [n, k] . op(A) [k, m]. A
    # row-major [r, c] matrix is a column-major [c, r] one: B row-major is read transposed, A as stored.
    layout_b = lt.matrix_layout_create(bf16, k if b_row_major else n, n if b_row_major else k, ldb)
    layout_a = lt.matrix_layout_create(bf16, k if a_row_major else m, m if a_row_major else k, lda)
    layout_d = lt.matrix_layout_create(_cuda_dtype(out_dtype), n, m, n)
    pref = lt.matmul_preference_create()
    pattr, pdt = lt.MatmulPreferenceAttribute, lt.get_matmul_preference_attribute_dtype
    keep.append(_set(lt.matmul_preference_set_attribute, pref, pattr.MAX_WORKSPACE_BYTES, WORKSPACE_BYTES, pdt(pattr.MAX_WORKSPACE_BYTES)))
    # Split-K partial sums in fp32 only: never in place in the output (bf16) or in the output type.
    keep.append(_set(lt.matmul_preference_set_attribute, pref, pattr.REDUCTION_SCHEME_MASK,
                     int(lt.ReductionScheme.COMPUTE_TYPE), pdt(pattr.REDUCTION_SCHEME_MASK)))
    for name, align in zip(("MIN_ALIGNMENT_A_BYTES", "MIN_ALIGNMENT_B_BYTES", "MIN_ALIGNMENT_C_BYTES", "MIN_ALIGNMENT_D_BYTES"), aligns):
        a = getattr(pattr, name)
        keep.append(_set(lt.matmul_preference_set_attribute, pref, a, align, pdt(a)))
    results = np.zeros(1, dtype=lt.matmul_heuristic_result_dtype)
    count = np.zeros(1, dtype=np.int32)
    try:
        lt.matmul_algo_get_heuristic(handle, desc, layout_b, layout_a, layout_d, layout_d, pref, 1, results.ctypes.data, count.ctypes.data)
    except lt.cuBLASLtError as err:
        count[0] = 0
        reason = str(err).split(". ")[0]
    else:
        reason = "the heuristic returned no algorithm"
    finally:
        lt.matmul_preference_destroy(pref)
    if count[0] < 1:
        for layout in (layout_b, layout_a, layout_d):
            lt.matrix_layout_destroy(layout)
        lt.matmul_desc_destroy(desc)
        raise Unsupported(
            f"cuBLASLt has no algorithm for the emulated FP4 GEMM [{m}, {k}] x [{n}, {k}]^T -> {out_dtype} "
            f"(alignments {aligns}): {reason}; {ENV}=torch uses torch.mm"
        )
    return dict(desc=desc, layouts=(layout_b, layout_a, layout_d), results=results, keep=keep)


def mm_alpha(
    a: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16, out=None
) -> torch.Tensor:
    """out[M, N] = out_dtype(alpha * (A @ B^T)) for bfloat16 A [M, K], B [N, K] on one CUDA device.

    ``alpha`` is one float32 value in device memory, read by the GEMM's epilogue: it may change between
    the replays of a CUDA graph. ``out``, if
    given, is a contiguous [M, N] tensor of ``out_dtype`` whose contents are overwritten, never read.
    Raises :class:`Unsupported` where cuBLASLt has no algorithm for the problem.
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"mm_alpha needs A [M, K] and B [N, K], got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        raise TypeError(f"mm_alpha multiplies bfloat16 operands, got {a.dtype} and {b.dtype}")
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"mm_alpha writes bfloat16 or float32, not {out_dtype}")
    m, k = a.shape
    n = b.shape[0]
    if not (a.is_cuda and b.device == a.device and alpha.device == a.device):
        raise ValueError(f"mm_alpha needs A, B and alpha on one CUDA device, got {a.device}, {b.device}, {alpha.device}")
    if alpha.dtype != torch.float32 or alpha.numel() != 1:
        raise ValueError(f"mm_alpha needs alpha as one float32 value, got {alpha.dtype} {tuple(alpha.shape)}")
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    elif out.shape != (m, n) or out.dtype != out_dtype or out.device != a.device or not out.is_contiguous():
        raise ValueError(
            f"mm_alpha's out must be a contiguous [{m}, {n}] {out_dtype} tensor on {a.device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    b, b_row_major, ldb = _row_major(b, n, k)
    a, a_row_major, lda = _row_major(a, m, k)
    aligns = tuple(min(_alignment(t), 16) for t in (b, a, out, out))
    index, (handle, workspace, zero) = _device_state(a.device)  # raw device pointers
    key = (m, n, k, b_row_major, ldb, a_row_major, lda, out_dtype, aligns)
    plan = _plans.get((index, key))
    if plan is None:
        with _lock:
            plan = _plans.get((index, key))
            if plan is None:
                plan = _plans[(index, key)] = _plan(key, handle)
    lt = _bindings()
    layout_b, layout_a, layout_d = plan["layouts"]
    lt.matmul(
        handle, plan["desc"], alpha.data_ptr(), b.data_ptr(), layout_b, a.data_ptr(), layout_a, zero,
        out.data_ptr(), layout_d, out.data_ptr(), layout_d, plan["results"].ctypes.data,
        workspace, WORKSPACE_BYTES, torch.cuda.current_stream(a.device).cuda_stream,
    )
    return out
