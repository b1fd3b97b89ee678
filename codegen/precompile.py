"""Compile a graph's Triton kernels in the background while Inductor compiles the graph.

Without this, the first call of a compiled model compiles each of fp4compile's Triton kernels when the
graph first launches it: one after another, after Inductor has compiled the graph. The backend hands
each rewritten graph to ``start`` before passing it on; ``start`` finds the kernel specializations the
graph's fp4 ops will launch and compiles them in a thread pool, one kernel per thread, while Inductor
works (Triton's compiler releases the GIL for most of its work).

How it finds them: each distinct fp4 op node (same op, non-tensor arguments and input shapes, strides,
dtypes and devices) runs its Python implementation on fake tensors made from the node's metadata, with
``triton_kernels.planning`` on, so each launch is recorded instead of made. A recorded launch becomes a
Triton ``warmup`` (compile without launching) whose tensor arguments are stand-ins carrying the dtype
and the 16-byte alignment, what Triton specializes a kernel on. The next launch of any kernel waits
for the pending compiles, so none compiles twice. A launch the plan did not foresee (a view that is
misaligned at run time, say) compiles when it is made, as it did before: the warm-up changes when
kernels compile, never what runs.

``FP4COMPILE_PRECOMPILE=0`` turns it off; ``FP4COMPILE_PRECOMPILE_THREADS=N`` sets the pool's size
(default ``min(8, CPUs - 1)``). Triton's front end (the kernel's source to its first IR) is Python and
holds the GIL, which Inductor's compile in the launching thread needs too: fewer threads leave it more
of the GIL but take longer over the kernels (on an H200 host, 2 threads made the first call slower
than the default).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from typing import Optional

import torch
import torch.fx as fx

from fp4compile import ops, runtime

from . import triton_kernels

log = logging.getLogger("fp4compile")

ENV = "FP4COMPILE_PRECOMPILE"
THREADS_ENV = "FP4COMPILE_PRECOMPILE_THREADS"

# The ops whose implementations launch only Triton kernels and torch operations; fp4.scaled_mm only
# with the emulation kernel (a CUTLASS kernel is built and run by its own code, which a plan must not do).
PLANNED_OPS = frozenset(
    f"fp4::{name}"
    for name in (
        "quantize", "rht_quantize", "wgrad_amax", "fake_quantize", "fake_rht_quantize", "fake_dual_quantize",
        "transpose_quantized", "decode_blocks", "emulated_mm", "scaled_mm",
    )
)


def _plannable(node: fx.Node) -> bool:
    if node.op != "call_function" or ops.implementation(node.target) is None:
        return False
    name = node.target._schema.name
    if name == "fp4::scaled_mm":
        return (node.kwargs["kernel"] if "kernel" in node.kwargs else node.args[8]) == "emulation"
    return name in PLANNED_OPS


_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
_pool_lock = threading.Lock()


def enabled() -> bool:
    return runtime.env_flag(ENV, True)


def pool_size() -> int:
    """Threads compiling in the background: ``FP4COMPILE_PRECOMPILE_THREADS``, else min(8, CPUs - 1)."""
    value = os.environ.get(THREADS_ENV, "").strip()
    if value:
        try:
            size = int(value)
        except ValueError:
            size = 0
        if size < 1:
            raise ValueError(f"{THREADS_ENV}={value!r}: expected a whole number of threads, 1 or more")
        return size
    return max(1, min(8, (os.cpu_count() or 2) - 1))


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            workers = pool_size()
            _pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="fp4compile-precompile")
        return _pool


class _StandIn:
    """A tensor argument of a planned launch as Triton's specialization sees it: dtype and address
    alignment (an allocation's start is aligned; a view's offset may not be)."""

    def __init__(self, t: torch.Tensor):
        self.dtype = t.dtype
        self.device = t.device
        self._address = (t.storage_offset() * t.element_size()) % 16

    def data_ptr(self) -> int:
        return self._address


def _stand_in(value):
    return _StandIn(value) if isinstance(value, torch.Tensor) else value


class _Unplannable(Exception):
    pass


def _fake(mode, value):
    """A node argument as the plan passes it: for a node, a fake tensor with its value's shape, strides,
    storage offset, dtype and device."""
    if not isinstance(value, fx.Node):
        return value
    val = value.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise _Unplannable(f"{value.name} has no tensor value")
    try:
        shape = [int(s) for s in val.shape]
        stride = [int(s) for s in val.stride()]
        offset = int(val.storage_offset())
    except (TypeError, RuntimeError) as err:  # symbolic sizes have no int value
        raise _Unplannable(f"{value.name} has a symbolic shape") from err
    span = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0
    with mode:
        return torch.empty(offset + span, dtype=val.dtype, device=val.device).as_strided(shape, stride, offset)


def _describe(value):
    """What of a node argument the launches depend on (a node's value: its layout, not its data)."""
    if isinstance(value, fx.Node):
        val = value.meta.get("val")
        if isinstance(val, torch.Tensor):
            return (tuple(val.shape), tuple(val.stride()), val.storage_offset(), val.dtype, str(val.device))
        return value.name
    return repr(value)


def plan(gm: fx.GraphModule) -> list[tuple]:
    """The launches the graph's fp4 ops will make: [(kernel, grid, args, kwargs)] with tensor arguments
    as stand-ins, once per distinct op call (nodes whose inputs differ only in their values launch the
    same kernels)."""
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

    launches: list[tuple] = []
    seen = set()

    def record(kernel, grid, args, kwargs):
        launches.append((kernel, grid, tuple(map(_stand_in, args)), {k: _stand_in(v) for k, v in kwargs.items()}))

    with unset_fake_temporarily():
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        for node in gm.graph.nodes:
            if not _plannable(node):
                continue
            key = (node.target, tuple(map(_describe, node.args)), tuple((k, _describe(v)) for k, v in node.kwargs.items()))
            if key in seen:
                continue
            seen.add(key)
            try:
                args = [_fake(mode, a) for a in node.args]
                kwargs = {k: _fake(mode, v) for k, v in node.kwargs.items()}
                with mode, triton_kernels.planning(record):
                    ops.implementation(node.target)(*args, **kwargs)
            except Exception as err:  # a data-dependent check, say: the launches planned before it stay
                log.debug("fp4compile: precompile: planning %s stopped: %s: %s", node.name, type(err).__name__, err)
    return launches


def _compile(device, launches) -> None:
    """Compile one kernel's planned launches in turn (the same specialization twice is a cache hit)."""
    with torch.cuda.device(device):
        for kernel, grid, args, kwargs in launches:
            try:
                kernel.warmup(*args, grid=grid, **kwargs)
            except Exception as err:  # the launch itself will raise it, with its own context
                log.debug("fp4compile: precompile of %s failed: %s", kernel, err)


def _device(launch) -> Optional[torch.device]:
    """The CUDA device of a planned launch (that of its tensor arguments); None off CUDA."""
    for value in (*launch[2], *launch[3].values()):
        if isinstance(value, _StandIn):
            return value.device if value.device.type == "cuda" else None
    return None


def start(gm: fx.GraphModule, what: str) -> list[concurrent.futures.Future]:
    """Plan ``gm``'s launches and compile their kernels in the background; returns the futures (the
    next launch waits for them). Nothing happens without compiled Triton kernels on a CUDA GPU, or with
    the switch off."""
    if not enabled() or not torch.cuda.is_available() or triton_kernels._interpreting():
        return []
    if not triton_kernels.available()[0]:
        return []
    t0 = time.perf_counter()
    try:
        launches = plan(gm)
    except Exception as err:  # an optimization only: the kernels then compile at their first launch
        log.warning("fp4compile: %s: no background compile of the Triton kernels: %s: %s", what, type(err).__name__, err)
        return []
    groups: dict = {}  # (kernel, device) -> its launches
    for launch in launches:
        device = _device(launch)
        if device is not None:
            groups.setdefault((launch[0], device), []).append(launch)
    if not groups:
        return []
    futures = [_executor().submit(_compile, device, group) for (_, device), group in groups.items()]
    log.info(
        "fp4compile: %s: compiling %d Triton kernels (%d launches) in the background (planned in %.2f s)",
        what, len(groups), sum(map(len, groups.values())), time.perf_counter() - t0,
    )
    remaining = [len(futures)]
    lock = threading.Lock()

    def finished(_):
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            log.info("fp4compile: %s: background compile of %d Triton kernels done after %.1f s",
                     what, len(groups), time.perf_counter() - t0)

    for future in futures:
        future.add_done_callback(finished)
    triton_kernels.launch_after(futures)
    return futures
