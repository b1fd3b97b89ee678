"""The executor table: for each fp4 op, its implementations in the order they are offered a call.

An implementation has a name, a check ``(op's arguments) -> (ok, reason)`` and a call with the same
arguments. ``choose(op, *args)`` asks the checks in order and returns the first implementation that
takes the call, with the reasons of those before it that declined; ``run(op, *args)`` calls it. The fp4
ops (``fp4compile.ops``) run through ``run``; the ``lower_kernels`` pass asks ``choose`` with a graph's
fake values and records the answer in the report (``Report.quantizer_kernels``), and ``lower_gemms``
asks ``choose_gemm`` for each FP4 GEMM (``Report.kernels``). Checks therefore read only what a fake
tensor has too (device, dtype, shape) and the op's constant arguments.

| op | arguments | implementations, in order |
|---|---|---|
| ``quantize`` | x, fmt, block, rounding, seed, amax, seed_base, layout, scale_rule | ``triton``, ``reference`` |
| ``rht_quantize`` | x, size, fmt, block, rounding, seed, amax, seed_base, layout, scale_rule | ``triton`` (fused), ``unfused`` (``formats.rht``, then the ``quantize`` entry) |
| ``fake_quantize`` | as ``quantize``, without ``layout`` | ``triton``, ``unfused`` (the ``quantize`` entry, then the decode) |
| ``fake_rht_quantize`` | as ``rht_quantize`` | ``triton``, ``unfused`` |
| ``fake_dual_quantize`` | x, size, fmt, rounding, seed, amax, rounding_t, seed_t, amax_t, seed_base, seed_base_t, scale_rule | ``triton`` (one launch), ``unfused`` (the two entries above) |
| ``dual_quantize`` | as ``fake_dual_quantize`` | ``triton`` (one launch), ``unfused`` (the ``quantize`` and ``rht_quantize`` entries) |
| ``wgrad_amax`` | x, size | ``triton``, ``reference`` |
| ``transpose_quantized`` | data, scales, layout | ``triton``, ``reference`` |
| ``decode_blocks`` | data, scales | ``triton``, ``reference`` |
| ``emulated_mm`` | a, a_amax, b, b_amax, fmt, out_dtype, scale_rule | ``cublaslt`` (alpha in its epilogue), ``triton`` (torch.mm to fp32, then the epilogue kernel; in the graph), ``cuda-bf16`` (MXFP4), ``reference`` |
| ``packed_mm`` | a, a_scales, a_amax, b, b_scales, b_amax, fmt, out_dtype, scale_rule, b_kn | ``triton`` (one kernel, operands decoded in registers; in the graph), ``reference`` |
| ``scaled_mm`` | a ``GemmSpec``, when the graph is compiled | ``cutlass`` (sm_100), ``triton`` (``FP4COMPILE_EMULATED_GEMM=packed``: ``lower_gemms`` makes it an ``fp4.packed_mm`` node), ``emulation`` |

``triton`` takes CUDA tensors where ``codegen.triton_kernels`` can run (its checks and calls are in
``codegen/triton_kernels/dispatch.py``, imported on the first CUDA call); ``reference`` is
``fp4compile.reference``, which takes every call. Every implementation gives the reference's bits.

``scaled_mm`` is chosen when the graph is compiled, from the GEMM's shape, format, output dtype and
device (``choose_gemm``), and the graph carries the choice as its kernel string (``cutlass:<config>``,
``+emulation`` where the recipe allows emulation, or ``emulation``); ``run_scaled_mm`` runs the
implementation the string names. Its calls take ``(kernel, a, a_scales, a_amax, b, b_scales, b_amax,
fmt, out_dtype, scale_rule)``; a call that returns None (a CUTLASS configuration that failed its first use, where
emulation is allowed) is run by ``emulation``. On a Blackwell GPU ``emulation`` declines unless the
recipe allows it, and ``choose_gemm`` raises ``CutlassRequired`` with both reasons.

``register`` adds an implementation at a position (a user's quantizer, say); ``unregister`` removes one.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, Callable, Optional

import torch

from . import formats, reference

log = logging.getLogger("fp4compile")

__all__ = [
    "Implementation", "Choice", "GemmSpec", "NoImplementation", "CutlassRequired", "register", "unregister",
    "implementations", "arguments", "choose", "run", "choose_gemm", "run_scaled_mm", "is_blackwell",
]


@dataclasses.dataclass(frozen=True)
class Implementation:
    """``check(*args) -> (ok, reason)``, ``call(*args)``. ``in_graph``: ``lower_kernels`` may trace the call
    into the graph Inductor compiles (PyTorch ops and ``wrap_triton`` kernels only). ``kernel`` (``scaled_mm``
    only): the kernel string the graph carries for a ``GemmSpec`` (default: the name)."""

    name: str
    check: Callable[..., tuple[bool, str]]
    call: Callable
    in_graph: bool = False
    kernel: Optional[Callable[..., str]] = None


@dataclasses.dataclass(frozen=True)
class Choice:
    """The implementation that takes a call; ``declined``: (name, reason) of each one asked before it."""

    op: str
    implementation: Implementation
    own_reason: str
    declined: tuple = ()
    kernel: str = ""

    @property
    def name(self) -> str:
        """The implementation's name, or for ``scaled_mm`` the kernel string."""
        return self.kernel or self.implementation.name

    @property
    def reason(self) -> str:
        """Why: the implementations before it that declined, with their reasons (those that gave one reason
        named together), then its own reason."""
        names: dict[str, list[str]] = {}  # reason -> the implementations that gave it, in order
        for name, why in self.declined:
            names.setdefault(why, []).append(name)
        parts = [f"{', '.join(who)} declined: {why}" for why, who in names.items()]
        return "; ".join(parts + ([self.own_reason] if self.own_reason else []))


@dataclasses.dataclass(frozen=True)
class GemmSpec:
    """What ``scaled_mm``'s checks see: C[m, n] = A[m, k] @ B[n, k]^T (M and K may be symbolic)."""

    m: Any
    n: Any
    k: Any
    fmt: str
    out_dtype: torch.dtype
    device: torch.device
    allow_emulation: bool = True
    batched: bool = False
    scale_rule: str = "6"


class NoImplementation(RuntimeError):
    """No implementation of an op takes a call; ``declined`` holds each one's (name, reason)."""

    def __init__(self, message: str, declined: tuple = ()):
        super().__init__(message)
        self.declined = declined


class CutlassRequired(NoImplementation):
    """An FP4 GEMM on a Blackwell GPU has no CUTLASS kernel and the recipe does not allow emulation."""


_lock = threading.Lock()
_TABLE: dict[str, tuple[Implementation, ...]] = {}  # replaced whole on a change: readers need no lock
_ARGUMENTS: dict[str, tuple[str, ...]] = {}
_notices: set[str] = set()


def _entries(op: str) -> tuple[Implementation, ...]:
    entries = _TABLE.get(op)
    if entries is None:
        raise ValueError(f"fp4compile.executors: no op {op!r} in the executor table; its ops are {sorted(_TABLE)}")
    return entries


def arguments(op: str) -> tuple[str, ...]:
    """The names of the arguments ``op``'s checks and calls take (``scaled_mm``: its calls)."""
    _entries(op)
    return _ARGUMENTS[op]


def implementations(op: str) -> tuple[str, ...]:
    """The names of ``op``'s implementations, in the order they are asked."""
    return tuple(impl.name for impl in _entries(op))


def register(op: str, name: str, check: Callable[..., tuple[bool, str]], call: Callable, *,
             before: Optional[str] = None, after: Optional[str] = None, in_graph: bool = False,
             kernel: Optional[Callable[..., str]] = None) -> None:
    """Offer ``op``'s calls to a new implementation: ``check(*args) -> (ok, reason)`` says whether it takes
    one (reading only devices, dtypes, shapes and constant arguments: the compiler asks it with fake
    tensors) and ``call(*args)`` returns what the op's reference returns, with ``arguments(op)``.
    It is asked first, or just ``before`` or ``after`` the implementation of that name."""
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"fp4compile.executors.register({op!r}, ...): the name must be a non-empty string without ':', got {name!r}")
    if not callable(check) or not callable(call):
        raise TypeError(f"fp4compile.executors.register({op!r}, {name!r}, ...): check and call must be callables")
    if before is not None and after is not None:
        raise ValueError(f"fp4compile.executors.register({op!r}, {name!r}, ...): give before or after, not both")
    with _lock:
        entries = list(_entries(op))
        names = [impl.name for impl in entries]
        if name in names:
            raise ValueError(f"fp4compile.executors.register: {op} already has an implementation {name!r} ({names})")
        anchor = before if before is not None else after
        if anchor is not None and anchor not in names:
            raise ValueError(f"fp4compile.executors.register({op!r}, {name!r}, ...): {op} has no implementation {anchor!r} ({names})")
        index = 0 if anchor is None else names.index(anchor) + (after is not None)
        entries.insert(index, Implementation(name, check, call, in_graph, kernel))
        _TABLE[op] = tuple(entries)


def unregister(op: str, name: str) -> Implementation:
    """Remove ``op``'s implementation ``name``; returns it (``register`` puts it back)."""
    with _lock:
        entries = _entries(op)
        removed = [impl for impl in entries if impl.name == name]
        if not removed:
            raise ValueError(f"fp4compile.executors.unregister: {op} has no implementation {name!r} ({implementations(op)})")
        _TABLE[op] = tuple(impl for impl in entries if impl.name != name)
    return removed[0]


def choose(op: str, *args) -> Choice:
    """The first implementation of ``op`` whose check takes ``args``; ``NoImplementation`` if none does."""
    declined = []
    for impl in _entries(op):
        ok, why = impl.check(*args)
        if ok:
            kernel = impl.kernel(*args) if impl.kernel is not None else ""
            return Choice(op, impl, why, tuple(declined), kernel)
        declined.append((impl.name, why))
    reasons = "; ".join(f"{name}: {why}" for name, why in declined) or "it has no implementations"
    raise NoImplementation(f"fp4compile: no implementation of {op} takes this call ({reasons})", tuple(declined))


def run(op: str, *args):
    """``op`` on ``args`` by the implementation ``choose`` picks."""
    return choose(op, *args).implementation.call(*args)


def _define(op: str, names: str, *entries: Implementation) -> None:
    _TABLE[op] = entries
    _ARGUMENTS[op] = tuple(names.split())


def _takes_all(*args) -> tuple[bool, str]:
    return True, ""


def _dispatch():
    from fp4compile.codegen.triton_kernels import dispatch

    return dispatch


def _triton(op: str, in_graph: bool = True, name: str = "triton") -> Implementation:
    """The Triton kernels' entry for ``op`` (``codegen.triton_kernels.dispatch``: ``check_<op>`` and
    ``<op>``), imported on the first call with a CUDA tensor, so that CPU runs never import Triton."""

    def check(first, *args):
        if first.device.type != "cuda":
            return False, f"its input is on {first.device.type}, not CUDA"
        return getattr(_dispatch(), "check_" + op)(first, *args)

    def call(*args):
        return getattr(_dispatch(), op)(*args)

    return Implementation(name, check, call, in_graph)


# -- the run-time ops -----------------------------------------------------------------------------


def _decoded(outputs: tuple, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(block-decoded bf16, amax) of a quantizer's (codes, scales, amax): exact in bfloat16."""
    data, scales, amax = outputs
    return reference.block_decode(data, scales, amax, fmt).to(torch.bfloat16), amax


def _rht_then_quantize(x, size, fmt, block, rounding, seed, amax=None, seed_base=None, layout="row_major",
                       scale_rule="6"):
    return run("quantize", formats.rht(x, size), fmt, block, rounding, seed, amax, seed_base, layout, scale_rule)


def _quantize_then_decode(x, fmt, block, rounding, seed, amax=None, seed_base=None, scale_rule="6"):
    return _decoded(run("quantize", x, fmt, block, rounding, seed, amax, seed_base, "row_major", scale_rule), fmt)


def _rht_quantize_then_decode(x, size, fmt, block, rounding, seed, amax=None, seed_base=None, scale_rule="6"):
    return _decoded(run("rht_quantize", x, size, fmt, block, rounding, seed, amax, seed_base, "row_major", scale_rule),
                    fmt)


def _two_decoded(x, size, fmt, rounding, seed, amax, rounding_t, seed_t, amax_t, seed_base=None, seed_base_t=None,
                 scale_rule="6"):
    rows = run("fake_quantize", x, fmt, "1x16", rounding, seed, amax, seed_base, scale_rule)[0]
    transformed = run("fake_rht_quantize", x.t(), size, fmt, "1x16", rounding_t, seed_t, amax_t, seed_base_t,
                      scale_rule)[0]
    return rows, transformed


def _two_packed(x, size, fmt, rounding, seed, amax, rounding_t, seed_t, amax_t, seed_base=None, seed_base_t=None,
                scale_rule="6"):
    rows = run("quantize", x, fmt, "1x16", rounding, seed, amax, seed_base, "row_major", scale_rule)
    transformed = run("rht_quantize", x.t(), size, fmt, "1x16", rounding_t, seed_t, amax_t, seed_base_t, "row_major",
                      scale_rule)
    return rows[0], rows[1], transformed[0], transformed[1]


def _check_cuda_bf16(a, a_amax, b, b_amax, fmt, out_dtype, scale_rule="6") -> tuple[bool, str]:
    if fmt == "nvfp4":
        return False, "NVFP4 needs alpha in the epilogue"
    if not a.is_cuda:
        return False, f"its input is on {a.device.type}, not CUDA"
    if a.dim() != 2 or b.dim() != 2:
        return False, f"batched operands ({a.dim()}-D and {b.dim()}-D)"
    return True, ""


def _cuda_bf16(a, a_amax, b, b_amax, fmt, out_dtype, scale_rule="6") -> torch.Tensor:
    """Decoded operands are exact in BF16: a BF16 GEMM with fp32 output accumulates the same products."""
    return torch.mm(a.to(torch.bfloat16), b.to(torch.bfloat16).t(), out_dtype=torch.float32).to(out_dtype)


def _reference(call: Callable) -> Implementation:
    return Implementation("reference", _takes_all, call)


def _unfused(call: Callable) -> Implementation:
    return Implementation("unfused", _takes_all, call)


_QUANTIZE_ARGS = "x fmt block rounding seed amax seed_base"
_RHT_QUANTIZE_ARGS = "x size fmt block rounding seed amax seed_base"
_define("quantize", _QUANTIZE_ARGS + " layout scale_rule", _triton("quantize"), _reference(reference.quantize))
_define("rht_quantize", _RHT_QUANTIZE_ARGS + " layout scale_rule", _triton("rht_quantize"), _unfused(_rht_then_quantize))
_define("fake_quantize", _QUANTIZE_ARGS + " scale_rule", _triton("fake_quantize"), _unfused(_quantize_then_decode))
_define("fake_rht_quantize", _RHT_QUANTIZE_ARGS + " scale_rule", _triton("fake_rht_quantize"),
        _unfused(_rht_quantize_then_decode))
_define("fake_dual_quantize", "x size fmt rounding seed amax rounding_t seed_t amax_t seed_base seed_base_t scale_rule",
        _triton("fake_dual_quantize"), _unfused(_two_decoded))
_define("dual_quantize", "x size fmt rounding seed amax rounding_t seed_t amax_t seed_base seed_base_t scale_rule",
        _triton("dual_quantize"), _unfused(_two_packed))
_define("wgrad_amax", "x size", _triton("wgrad_amax"), _reference(reference.wgrad_amax))
_define("transpose_quantized", "data scales layout", _triton("transpose_quantized"), _reference(reference.transpose_quantized))
_define("decode_blocks", "data scales", _triton("decode_blocks"), _reference(reference.decode_blocks))
# The emulated GEMM by cuBLASLt: ``lower_kernels`` rewrites the calls this entry takes in a graph Inductor
# compiles into alpha in the graph and ``fp4.cublaslt_mm`` (the same GEMM and arithmetic).
CUBLASLT = _triton("cublaslt_mm", in_graph=False, name="cublaslt")
_define("emulated_mm", "a a_amax b b_amax fmt out_dtype scale_rule", CUBLASLT,
        _triton("emulated_mm"),
        Implementation("cuda-bf16", _check_cuda_bf16, _cuda_bf16), _reference(reference.decoded_product))
_define("packed_mm", "a a_scales a_amax b b_scales b_amax fmt out_dtype scale_rule b_kn", _triton("packed_mm"),
        _reference(reference.packed_product))


# -- scaled_mm: chosen when the graph is compiled -------------------------------------------------


def is_blackwell(device) -> bool:
    """Whether ``device`` runs CUTLASS NVFP4 GEMMs (where an FP4 GEMM off them needs ``allow_emulation``)."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    try:
        from fp4compile.codegen.cutlass_toolkit import is_cutlass_device
    except ImportError:
        return False
    return is_cutlass_device(device)


def _check_cutlass(spec: GemmSpec) -> tuple[bool, str]:
    """Pure: from the device's architecture and the GEMM's N, K and M (or M's size hint); builds nothing
    (``cutlass_runtime`` builds on first use)."""
    if spec.batched:
        return False, "batched operands: the FP4 kernels take 2-D operands"
    if spec.fmt != "nvfp4":
        return False, f"CUTLASS kernels are generated for NVFP4 only, not {spec.fmt}"
    if spec.scale_rule != "6":
        return False, (f"the CUTLASS kernels' epilogue computes alpha with the 6 x 448 global constant, not that of "
                       f"the block scale rule {spec.scale_rule!r} (6 x 256)")
    if spec.device.type != "cuda":
        return False, f"device {spec.device} is not a CUDA GPU"
    try:
        from fp4compile.codegen import cutlass_gemm, cutlass_runtime  # noqa: F401
    except ImportError as exc:
        return False, f"CUTLASS code generation unavailable: {exc}"
    ok, why = cutlass_gemm.device_supports_cutlass(spec.device)
    if not ok:
        return False, why
    config, why = cutlass_gemm.select_config(spec.m, spec.n, spec.k, spec.out_dtype)
    return config is not None, why


def _cutlass_kernel(spec: GemmSpec) -> str:
    from fp4compile.codegen import cutlass_gemm, cutlass_runtime

    config, _ = cutlass_gemm.select_config(spec.m, spec.n, spec.k, spec.out_dtype)
    return cutlass_runtime.kernel_name(config, spec.allow_emulation)


def _cutlass(kernel, a, a_scales, a_amax, b, b_scales, b_amax, fmt, out_dtype, scale_rule="6"):
    from fp4compile.codegen import cutlass_runtime

    if scale_rule != "6":
        raise NotImplementedError(
            f"fp4.scaled_mm {kernel}: the CUTLASS kernels compute alpha with the 6 x 448 constant, not for the "
            f"block scale rule {scale_rule!r} (choose_gemm gives such GEMMs to emulation)"
        )
    return cutlass_runtime.scaled_mm(kernel, a, a_scales, a_amax, b, b_scales, b_amax, out_dtype)


def _check_emulation(spec: GemmSpec) -> tuple[bool, str]:
    if spec.device.type != "cuda":
        return True, ""
    if not spec.allow_emulation and is_blackwell(spec.device):
        return False, ("on a Blackwell GPU FP4 GEMMs run on CUTLASS kernels only: Recipe(allow_emulation=True) "
                       "(or Backend(allow_emulation=True)) runs such GEMMs in emulation")
    if spec.fmt == "nvfp4":
        from fp4compile.codegen import cublaslt_gemm

        return True, f"emulated GEMM: {cublaslt_gemm.describe()}"
    return True, ""


def _check_packed(spec: GemmSpec) -> tuple[bool, str]:
    """The FP4-operand Triton GEMM (``fp4.packed_mm``), where ``config.emulated_gemm`` asks for it."""
    from fp4compile import config

    if spec.device.type != "cuda":
        return False, f"device {spec.device} is not a CUDA GPU"
    if spec.fmt != "nvfp4" or spec.batched:
        return False, "it takes 2-D NVFP4 operands" + (" (these are batched)" if spec.batched else f", not {spec.fmt}")
    if not spec.allow_emulation and is_blackwell(spec.device):
        return False, "on a Blackwell GPU FP4 GEMMs run on CUTLASS kernels only"
    if config.emulated_gemm != "packed":
        return False, (f"FP4COMPILE_EMULATED_GEMM={config.emulated_gemm}: emulated GEMMs read decoded operands "
                       "(packed: one Triton kernel reads the packed operands)")
    ok, why = _dispatch().check_kernels()
    return ok, ("one Triton kernel reads the packed operands and decodes them in registers" if ok else why)


def _packed(kernel, a, a_scales, a_amax, b, b_scales, b_amax, fmt, out_dtype, scale_rule="6"):
    return run("packed_mm", a, a_scales, a_amax, b, b_scales, b_amax, fmt, out_dtype, scale_rule, False)


def _emulation(kernel, a, a_scales, a_amax, b, b_scales, b_amax, fmt, out_dtype, scale_rule="6"):
    """Block-decode both operands (exact) and multiply with fp32 accumulation, then alpha. On CUDA the
    operands are decoded to BF16 (exact) for a tensor-core GEMM: the ``decode_blocks`` and ``emulated_mm``
    entries."""
    if a.is_cuda and a.dim() == 2 and b.dim() == 2:
        if fmt == "nvfp4":
            a_bd, b_bd = run("decode_blocks", a, a_scales), run("decode_blocks", b, b_scales)
        else:
            a_bd = reference.block_decode(a, a_scales, a_amax, fmt).to(torch.bfloat16)
            b_bd = reference.block_decode(b, b_scales, b_amax, fmt).to(torch.bfloat16)
        return run("emulated_mm", a_bd, a_amax, b_bd, b_amax, fmt, out_dtype, scale_rule)
    return reference.scaled_mm_reference(a, a_scales, a_amax, b, b_scales, b_amax, fmt, out_dtype, scale_rule)


_define("scaled_mm", "kernel a a_scales a_amax b b_scales b_amax fmt out_dtype scale_rule",
        Implementation("cutlass", _check_cutlass, _cutlass, kernel=_cutlass_kernel),
        Implementation("triton", _check_packed, _packed),
        Implementation("emulation", _check_emulation, _emulation))


def _notice(message: str) -> None:
    if message not in _notices:
        _notices.add(message)
        log.warning("fp4compile: %s", message)


def choose_gemm(m, n, k, fmt: str, out_dtype: torch.dtype, device, allow_emulation: bool = True,
                batched: bool = False, scale_rule: str = "6") -> Choice:
    """The ``scaled_mm`` implementation of C[m, n] = A[m, k] @ B[n, k]^T in ``fmt`` on ``device``
    (``choice.name`` is the kernel string the graph carries). On a Blackwell GPU a GEMM that gets no
    CUTLASS kernel raises ``CutlassRequired`` with the reasons unless ``allow_emulation``."""
    spec = GemmSpec(m, n, k, fmt, out_dtype, torch.device(device), allow_emulation, batched, scale_rule)
    try:
        choice = choose("scaled_mm", spec)
    except NoImplementation as exc:
        raise CutlassRequired("; ".join(why for _, why in exc.declined), exc.declined) from None
    if choice.implementation.name == "emulation" and spec.device.type == "cuda":
        why_not = "; ".join(why for _, why in choice.declined)
        _notice(f"FP4 GEMMs run in emulation on {torch.cuda.get_device_name(spec.device)}: {why_not}")
    return choice


def is_cutlass_kernel(kernel: str) -> bool:
    """Whether the kernel string ``kernel`` (``choose_gemm``'s ``choice.name``) names a CUTLASS GEMM."""
    return kernel.split(":", 1)[0] == "cutlass"


def run_scaled_mm(kernel: str, a, a_scales, a_amax, b, b_scales, b_amax, fmt: str, out_dtype: torch.dtype,
                  scale_rule: str = "6"):
    """``fp4.scaled_mm`` by the implementation its kernel string names (the part before any ':')."""
    args = (a, a_scales, a_amax, b, b_scales, b_amax, fmt, out_dtype, scale_rule)
    name = kernel.split(":", 1)[0]
    entries = {impl.name: impl for impl in _entries("scaled_mm")}
    if name not in entries:
        raise ValueError(f"fp4.scaled_mm: kernel {kernel!r} names no implementation of scaled_mm ({sorted(entries)})")
    out = entries[name].call(kernel, *args)
    if out is None:  # the kernel failed on this device and the recipe allows emulation
        out = _emulation("emulation", *args)
    return out
