"""BF16 GEMMs whose epilogue applies a device-resident alpha: the emulated NVFP4 GEMM in one cuBLASLt call.

An emulated NVFP4 GEMM multiplies block-decoded operands (exact in bfloat16) with fp32 accumulation and
then applies ``alpha = formats.gemm_alpha(amax_A, amax_B)``, a value that lives on the GPU (it depends on
both operands' amax). ``torch.mm`` cannot take a device alpha, so without this module the product is
written in fp32 and read again by a separate epilogue kernel: 8 extra bytes per output element. cuBLASLt
can read alpha through a pointer (``CUBLASLT_POINTER_MODE_DEVICE``) and write the bfloat16 result
directly, which is what :func:`mm_alpha` does:

    out[M, N] = cast(alpha * sum_k A[m, k] * B[n, k])      fp32 accumulation, fp32 alpha, one rounding

The bindings are NVIDIA's ``nvmath-python`` (``pip install fp4compile[cuda]``); without them, or with
``fp4compile.config.emulated_gemm = "torch"`` (``FP4COMPILE_EMULATED_GEMM=torch``), the emulation keeps ``torch.mm`` plus the epilogue kernel, with the
same arithmetic up to the summation order. Split-K plans are restricted to reductions in fp32 (never in
the output type), so every algorithm cuBLASLt may pick sums in fp32.

Plans (descriptors, layouts and the heuristic's algorithm) are made once per shape and cached; the call
itself enqueues one GEMM on the current stream and is safe to record in a CUDA graph.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading

import numpy as np
import torch

from fp4compile import config

__all__ = ["Unsupported", "available", "enabled", "describe", "required", "log_fallback", "mm_alpha"]

log = logging.getLogger("fp4compile.codegen")

WORKSPACE_BYTES = 32 * 1024 * 1024  # the most a plan may ask for (what cuBLAS recommends for Hopper)
_OUT_DTYPES = (torch.bfloat16, torch.float32)

_lock = threading.Lock()
_state: dict = {}  # "lt": the bindings module or an import error; per device index: (handle, zero) or the failure
# (device index, problem) -> plan or Unsupported, least recently used first. Bounded: under dynamic shapes
# every new token count is a new problem; the oldest plans' descriptors are destroyed past the bound.
_plans: "collections.OrderedDict" = collections.OrderedDict()
MAX_PLANS = 512


def _bindings():
    if "lt" not in _state:
        try:
            import nvmath.bindings.cublasLt as lt

            _state["lt"] = lt
        except Exception as err:  # ImportError, or a library that fails to load
            _state["lt"] = err
    return _state["lt"]


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
    if not hasattr(lt, "matmul_heuristic_result_dtype"):
        return False, "this nvmath-python lacks cublasLt.matmul_heuristic_result_dtype (tested with 1.0)"
    return True, f"cuBLASLt {lt.get_version()} through nvmath-python"


def enabled() -> bool:
    """Whether the emulated GEMM uses :func:`mm_alpha` (``config.emulated_gemm``, logged once)."""
    mode = config.emulated_gemm
    if mode == "torch":
        return False
    ok, why = available()
    if not ok and mode == "cublaslt":
        raise RuntimeError(f"FP4COMPILE_EMULATED_GEMM=cublaslt, but cuBLASLt GEMMs cannot run here: {why}")
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


def describe() -> str:
    """Which GEMM the emulation runs on this machine and why, for the report (``enabled()``'s choice)."""
    if config.emulated_gemm == "packed":
        return "one Triton kernel on the packed operands where it takes the GEMM (FP4COMPILE_EMULATED_GEMM=packed)"
    try:
        if enabled():
            return f"alpha in cuBLASLt's epilogue ({available()[1]})"
    except RuntimeError as err:
        return f"not decided: {err}"
    why = "FP4COMPILE_EMULATED_GEMM=torch" if config.emulated_gemm == "torch" else available()[1]
    return f"torch.mm to fp32 and an epilogue kernel ({why})"


def required() -> bool:
    """``config.emulated_gemm == "cublaslt"``: a problem cuBLASLt cannot take is an error, not a fallback."""
    return config.emulated_gemm == "cublaslt"


def log_fallback(err: Exception) -> None:
    """Log (once per message) that one GEMM problem fell back to torch.mm, and why."""
    key = ("fallback", str(err))
    if key not in _state:
        _state[key] = True
        log.warning("fp4compile: this emulated FP4 GEMM runs as torch.mm plus an epilogue kernel: %s", err)


def _alignment(t: torch.Tensor) -> int:
    """The largest power of two up to 256 that divides the tensor's address."""
    ptr = t.data_ptr()
    return min(ptr & -ptr, 256) if ptr else 256


def _row_major(t: torch.Tensor, rows: int, cols: int):
    """(tensor, stored row-major?, leading dimension) for the [rows, cols] matrix ``t``, without a copy
    where its strides are row-major or column-major with a padded leading dimension."""
    if t.stride(1) == 1 and t.stride(0) >= max(cols, 1):
        return t, True, t.stride(0)
    if t.stride(0) == 1 and t.stride(1) >= max(rows, 1):
        return t, False, t.stride(1)
    return t.contiguous(), True, cols


def _device_zero() -> int:
    """A float32 zero in device memory (beta), from cudaMalloc on the current device: outside PyTorch's
    caching allocator, because memory this module keeps for the process must not come from a CUDA-graph
    pool (Inductor's CUDA graph trees claim every allocation made while they warm up or record)."""
    from cuda.bindings import runtime as cudart

    err, ptr = cudart.cudaMalloc(4)
    if err != cudart.cudaError_t.cudaSuccess:
        raise Unsupported(f"cudaMalloc of cuBLASLt's beta scalar failed: {err.name}")
    (err,) = cudart.cudaMemset(ptr, 0, 4)
    if err == cudart.cudaError_t.cudaSuccess:
        (err,) = cudart.cudaDeviceSynchronize()
    if err != cudart.cudaError_t.cudaSuccess:
        cudart.cudaFree(ptr)
        raise Unsupported(f"clearing cuBLASLt's beta scalar failed: {err.name}")
    return int(ptr)


def _device_state(index: int):
    """(cuBLASLt handle, pointer to a float32 zero) of device ``index``, made once; a failure to make
    them is kept too, so that every later call falls back at once."""
    lt = _bindings()
    with _lock:
        st = _state.get(index)
        if st is None:
            if torch.cuda.is_current_stream_capturing():
                # Not kept: the next call outside a capture may make them.
                raise Unsupported(
                    f"the first cuBLASLt GEMM on cuda:{index} runs inside a CUDA graph capture, where its "
                    "scalar cannot be allocated; run one step before capturing"
                )
            handle = None
            try:
                handle = lt.create()
                st = (handle, _device_zero())
            except (Unsupported, lt.cuBLASLtError) as err:
                if handle is not None:
                    lt.destroy(handle)
                st = err if isinstance(err, Unsupported) else Unsupported(f"cublasLtCreate failed: {err}")
            _state[index] = st
    if isinstance(st, Exception):
        raise st
    return st


def _set(setter, dtype_of, obj, attr, value) -> None:
    """Set one descriptor or preference attribute (cuBLASLt copies the value)."""
    buf = np.array([value], dtype=dtype_of(attr))
    setter(obj, int(attr), buf.ctypes.data, buf.nbytes)


def _cuda_dtype(dtype: torch.dtype) -> int:
    import nvmath

    return int({torch.bfloat16: nvmath.CudaDataType.CUDA_R_16BF, torch.float32: nvmath.CudaDataType.CUDA_R_32F}[dtype])


def dtype_problem(a_dtype: torch.dtype, b_dtype: torch.dtype, out_dtype: torch.dtype) -> str:
    """Why :func:`mm_alpha` cannot take operands and an output of these dtypes ("" where it can)."""
    if out_dtype not in _OUT_DTYPES or not a_dtype == b_dtype == torch.bfloat16:
        return (f"the cuBLASLt path takes bfloat16 operands and a bfloat16 or float32 output, got "
                f"{a_dtype} x {b_dtype} -> {out_dtype}")
    return ""


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
    attr = lt.MatmulDescAttribute
    set_desc = functools.partial(_set, lt.matmul_desc_set_attribute, lt.get_matmul_desc_attribute_dtype, desc)
    set_desc(attr.POINTER_MODE, int(lt.PointerMode.DEVICE))
    set_desc(attr.TRANSA, int(op.T if b_row_major else op.N))
    set_desc(attr.TRANSB, int(op.N if a_row_major else op.T))
    bf16 = _cuda_dtype(torch.bfloat16)
    # The row-major output [m, n] is cuBLASLt's column-major D [n, m] = op(B) [n, k] . op(A) [k, m]. A
    # row-major [r, c] matrix is a column-major [c, r] one: B row-major is read transposed, A as stored.
    layout_b = lt.matrix_layout_create(bf16, k if b_row_major else n, n if b_row_major else k, ldb)
    layout_a = lt.matrix_layout_create(bf16, k if a_row_major else m, m if a_row_major else k, lda)
    layout_d = lt.matrix_layout_create(_cuda_dtype(out_dtype), n, m, n)
    pref = lt.matmul_preference_create()
    pattr = lt.MatmulPreferenceAttribute
    set_pref = functools.partial(_set, lt.matmul_preference_set_attribute, lt.get_matmul_preference_attribute_dtype, pref)
    set_pref(pattr.MAX_WORKSPACE_BYTES, WORKSPACE_BYTES)
    # Split-K partial sums in fp32 only: never in place in the output (bf16) or in the output type.
    set_pref(pattr.REDUCTION_SCHEME_MASK, int(lt.ReductionScheme.COMPUTE_TYPE))
    for name, align in zip(("MIN_ALIGNMENT_A_BYTES", "MIN_ALIGNMENT_B_BYTES", "MIN_ALIGNMENT_C_BYTES", "MIN_ALIGNMENT_D_BYTES"), aligns):
        set_pref(getattr(pattr, name), align)
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
            f"(alignments {aligns}): {reason}; FP4COMPILE_EMULATED_GEMM=torch uses torch.mm"
        )
    # What every call passes, read out of the heuristic's result once (``results`` stays alive with the plan).
    return dict(desc=desc, layouts=(layout_b, layout_a, layout_d), results=results, algo=results.ctypes.data,
                workspace_bytes=int(results["workspace_size"][0]))


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
    if k == 0:  # alpha * (empty sum): zeros, or NaN where alpha is not finite
        return out.copy_((alpha * 0).reshape(1, 1).expand(m, n))
    b, b_row_major, ldb = _row_major(b, n, k)
    a, a_row_major, lda = _row_major(a, m, k)
    aligns = tuple(min(_alignment(t), 16) for t in (b, a, out, out))
    index = a.device.index
    with torch.cuda.device(index):  # the heuristic and the launch use the operands' device
        handle, zero = _device_state(index)
        key = (m, n, k, b_row_major, ldb, a_row_major, lda, out_dtype, aligns)
        # The lock also covers the launch: no other thread can destroy this plan's descriptors (an
        # eviction) while cuBLASLt reads them.
        with _lock:
            plan = _cached_plan(index, key, handle)
            if isinstance(plan, Exception):
                raise plan
            lt = _bindings()
            layout_b, layout_a, layout_d = plan["layouts"]
            # A workspace per call, from the caching allocator on this stream: concurrent GEMMs on other
            # streams never share it, and inside a CUDA graph it is one of the graph's temporaries.
            ws_bytes = plan["workspace_bytes"]
            workspace = torch.empty(ws_bytes, dtype=torch.uint8, device=a.device) if ws_bytes else None
            lt.matmul(
                handle, plan["desc"], alpha.data_ptr(), b.data_ptr(), layout_b, a.data_ptr(), layout_a, zero,
                out.data_ptr(), layout_d, out.data_ptr(), layout_d, plan["algo"],
                workspace.data_ptr() if ws_bytes else 0, ws_bytes, torch.cuda.current_stream(a.device).cuda_stream,
            )
    return out


def _cached_plan(index, key, handle):
    """The plan (or the Unsupported error, kept so the same problem falls back at once next time) of
    ``key`` on device ``index``, made on first use; the least recently used past ``MAX_PLANS`` are
    destroyed. Called with ``_lock`` held."""
    plan = _plans.get((index, key))
    if plan is not None:
        _plans.move_to_end((index, key))
        return plan
    try:
        plan = _plan(key, handle)
    except Unsupported as err:
        plan = err
    _plans[(index, key)] = plan
    while len(_plans) > MAX_PLANS:
        _destroy(_plans.popitem(last=False)[1])
    return plan


def _destroy(plan) -> None:
    """Free a plan's cuBLASLt descriptors (an Unsupported entry holds none)."""
    if isinstance(plan, Exception):
        return
    lt = _bindings()
    for layout in plan["layouts"]:
        lt.matrix_layout_destroy(layout)
    lt.matmul_desc_destroy(plan["desc"])
