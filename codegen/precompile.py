"""Compile a graph's Triton kernels in the background while Inductor compiles the graph.

Without this, the first call of a compiled model compiles each of fp4compile's Triton kernels when the
graph first launches it: one after another, after Inductor has compiled the graph. The backend hands
each rewritten graph to ``start`` before passing it on; ``start`` finds the kernel specializations the
graph's fp4 ops will launch and has them compiled elsewhere while Inductor works.

How it finds them: each distinct fp4 op node (same op, non-tensor arguments and input shapes, strides,
dtypes and devices) runs its Python implementation on fake tensors made from the node's metadata, with
``triton_kernels.planning`` on, so each launch is recorded instead of made. A recorded launch becomes a
Triton ``warmup`` (compile without launching) whose tensor arguments are stand-ins carrying the dtype
and the 16-byte alignment, what Triton specializes a kernel on. The next launch of any kernel waits
for the pending compiles, so none compiles twice. A launch the plan did not foresee (a view that is
misaligned at run time, say) compiles when it is made, as it did before: the warm-up changes when
kernels compile, never what runs.

Where they compile (``fp4compile.config.precompile``, ``FP4COMPILE_PRECOMPILE``):

- ``1`` or ``threads`` (default): in a thread pool of the training process (the warm-up itself
  compiles). Triton's compiler releases the GIL for most of its work, not for its front end (the
  kernel's source to its first IR), which takes turns with Inductor's compile of the graph.
- ``processes``: in worker processes (``codegen.compile_worker``), started when the backend first
  compiles a graph, so they have imported what they need by the time the first plan is made. The
  warm-up runs in the training process with Triton's ``jit_cache_hook`` taking each specialization's
  description instead of compiling it; a worker compiles it into Triton's cache, where the first
  launch finds it. Each job carries what Triton's cache key depends on beyond the kernel and its
  specialization as the training process has it (its ptxas and that ptxas's version, the cache
  directory, the environment variables Triton's key includes): Inductor sets ``TRITON_PTXAS_PATH`` to
  PyTorch's own ptxas when it compiles a kernel in the training process, which may be after the
  workers started, and a kernel compiled under another ptxas's key would never be looked up.
- ``0``: off; each kernel compiles at its first launch.

``config.precompile_threads`` (``FP4COMPILE_PRECOMPILE_THREADS=N``) sets the number of workers, threads
or processes (default ``min(8, CPUs - 1)`` threads, ``min(4, CPUs - 1)`` processes: each imports torch,
and a graph has about five kernels). A worker that fails leaves its kernels to compile at their first launch.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
from typing import Optional

import torch
import torch.fx as fx

from fp4compile import config, ops

from . import triton_kernels

log = logging.getLogger("fp4compile")

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
_workers: Optional["_WorkerPool"] = None
_pool_lock = threading.Lock()
_no_processes: list = []  # why worker processes could not start, if they could not (threads are used then)


def mode() -> str:
    """Where the kernels compile: ``config.precompile`` ("threads", "processes" or "off"), but threads where
    worker processes could not start."""
    return "threads" if config.precompile == "processes" and _no_processes else config.precompile


def enabled() -> bool:
    return mode() != "off"


def pool_size(processes: bool = False) -> int:
    """Workers compiling in the background: ``config.precompile_threads``, else min(8, CPUs - 1) threads
    or min(4, CPUs - 1) processes (each imports torch; a graph has a handful of kernels)."""
    if config.precompile_threads is not None:
        return config.precompile_threads
    return max(1, min(4 if processes else 8, (os.cpu_count() or 2) - 1))


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            workers = pool_size()
            _pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="fp4compile-precompile")
        return _pool


class _WorkerPool:
    """``compile_worker`` processes, and a thread per worker that hands it a job and waits for the reply
    (blocked on a pipe, without the GIL)."""

    def __init__(self, size: int):
        self._idle: queue.Queue = queue.Queue()
        self._procs: list = []
        for _ in range(size):
            self._idle.put(self._spawn())
        self._threads = concurrent.futures.ThreadPoolExecutor(size, thread_name_prefix="fp4compile-precompile")
        atexit.register(self.close)

    def _spawn(self) -> subprocess.Popen:
        # The worker imports the kernels' module the way this process did: same interpreter and path.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        proc = subprocess.Popen(
            [sys.executable, "-m", f"{__package__}.compile_worker", triton_kernels.__name__],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
        )
        self._procs.append(proc)
        return proc

    def submit(self, job) -> concurrent.futures.Future:
        return self._threads.submit(self._run, job)

    def _run(self, job) -> Optional[str]:
        proc = self._idle.get()
        try:
            pickle.dump(job, proc.stdin)
            proc.stdin.flush()
            reply = pickle.load(proc.stdout)
        except (OSError, EOFError, pickle.UnpicklingError) as err:
            proc.kill()
            reply = f"the worker process ended (exit code {proc.poll()}): {type(err).__name__}: {err}"
            proc = self._spawn()
        finally:
            self._idle.put(proc)
        if reply is not None:  # the launch will compile the kernel, and raise its error if it has one
            log.debug("fp4compile: precompile of %s in a worker process failed: %s", job[1], reply)
        return reply

    def close(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    proc.stdin.close()  # the worker exits at the end of its input
                    proc.wait(timeout=5)
                except (OSError, subprocess.TimeoutExpired):
                    proc.kill()


def _worker_pool() -> "_WorkerPool":
    global _workers
    with _pool_lock:
        if _workers is None:
            _workers = _WorkerPool(pool_size(processes=True))
        return _workers


def _active() -> bool:
    """Whether ``start`` compiles anything here: the switch on, compiled Triton kernels on a CUDA GPU."""
    if not enabled() or not torch.cuda.is_available() or triton_kernels.numerics._interpreting():
        return False
    return triton_kernels.available()[0]


def prepare() -> None:
    """Start the worker processes now, so that they are ready when the first plan is made (the backend
    calls this when it first compiles a graph). Nothing happens unless they are the mode in use."""
    if _active():
        _start_workers()


def _start_workers() -> None:
    """The worker pool, where processes are the mode; if they cannot start, threads from then on."""
    if mode() == "processes":
        try:
            _worker_pool()
        except OSError as err:
            log.warning("fp4compile: no worker processes for the Triton kernels (%s); compiling them in threads", err)
            _no_processes.append(err)


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


def _specializations(launches) -> list[tuple]:
    """[(kernel, specialization data, target)] of the planned launches that this process has not compiled
    yet, one per specialization: Triton's own description of what it would compile (what its
    ``jit_cache_hook`` receives, and ``JITFunction.preload`` takes), taken while each launch is warmed up
    with that hook refusing the compile. The hook acts only in this thread; others see the one before."""
    from triton import knobs
    from triton.runtime.driver import driver

    me = threading.get_ident()
    previous = knobs.runtime.jit_cache_hook
    seen: dict = {}
    current: list = []
    targets: dict = {}  # device -> the GPUTarget its kernels compile for

    def hook(**kwargs):
        if threading.get_ident() != me:
            return previous(**kwargs) if previous is not None else None
        current.append((kwargs["fn"].jit_function, kwargs["compile"]["specialization_data"]))
        return True  # compiled elsewhere: skip it here

    knobs.runtime.jit_cache_hook = hook
    try:
        for launch in launches:
            device = _device(launch)
            if device is None:
                continue
            kernel, grid, args, kwargs = launch
            with torch.cuda.device(device):
                try:
                    kernel.warmup(*args, grid=grid, **kwargs)
                    if device not in targets:
                        targets[device] = driver.active.get_current_target()
                except Exception as err:  # the launch itself will raise it, with its own context
                    log.debug("fp4compile: precompile of %s failed: %s", kernel, err)
                    current.clear()
                    continue
            for fn, data in current:
                seen.setdefault(data, (fn, data, targets[device]))
            current.clear()
    finally:
        knobs.runtime.jit_cache_hook = previous
    return list(seen.values())


def toolchain(target) -> dict:
    """What Triton's cache key depends on besides the kernel and its specialization, as this process has
    it now: the cache directory, the ptxas for ``target`` (path and version: the version is computed once
    per process and enters the key) and the environment variables the key includes."""
    from triton import knobs
    from triton._C.libtriton import get_cache_invalidating_env_vars

    tools = {"cache_dir": knobs.cache.dir, "env": dict(get_cache_invalidating_env_vars())}
    if target.backend == "cuda":
        from triton.backends.nvidia import compiler as nvidia

        tools["ptxas"] = (nvidia.get_ptxas(target.arch).path, nvidia.get_ptxas_version(target.arch))
    return tools


def job(kernel, data, target, tools: Optional[dict] = None) -> tuple:
    """A worker's job (``compile_worker``): the kernel (module and name), its specialization data, the
    target and ``toolchain(target)`` (given, where a plan has already asked for it)."""
    return kernel.fn.__module__, kernel.fn.__name__, data, target, tools if tools is not None else toolchain(target)


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
    if not _active():
        return []
    _start_workers()
    t0 = time.perf_counter()
    try:
        launches = plan(gm)
        if mode() == "processes":
            specs = _specializations(launches)
            pool = _worker_pool()
            tools = {target: toolchain(target) for _, _, target in specs}  # one per target, not per job
            futures = [pool.submit(job(fn, data, target, tools[target])) for fn, data, target in specs]
            kernels, where = len(specs), "worker processes"
        else:
            groups: dict = {}  # (kernel, device) -> its launches
            for launch in launches:
                device = _device(launch)
                if device is not None:
                    groups.setdefault((launch[0], device), []).append(launch)
            futures = [_executor().submit(_compile, device, group) for (_, device), group in groups.items()]
            kernels, where = len(groups), "threads"
    except Exception as err:  # an optimization only: the kernels then compile at their first launch
        log.warning("fp4compile: %s: no background compile of the Triton kernels: %s: %s", what, type(err).__name__, err)
        return []
    if not futures:
        return []
    log.info(
        "fp4compile: %s: compiling %d Triton kernels (%d launches) in %s (planned in %.2f s)",
        what, kernels, len(launches), where, time.perf_counter() - t0,
    )
    remaining = [len(futures)]
    lock = threading.Lock()

    def finished(_):
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            log.info("fp4compile: %s: background compile of %d Triton kernels done after %.1f s",
                     what, kernels, time.perf_counter() - t0)

    for future in futures:
        future.add_done_callback(finished)
    triton_kernels.launch_after(futures)
    return futures
