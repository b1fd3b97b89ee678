"""Background compilation of the Triton kernels (``codegen.precompile``): the plan made on fake tensors
names the kernel specializations the real launches use, and a launch waits for pending compiles.

The plan and the wait run on the CPU (the kernels in Triton's interpreter); tests marked ``gpu`` check
on a GPU that a compiled model's first call compiles none of the kernels in the training thread.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.nvidia.compiler import CUDABackend  # noqa: E402

from fp4compile import config, ops, runtime  # noqa: E402
from fp4compile.codegen import precompile  # noqa: E402
from fp4compile.codegen import triton_kernels as tk  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def specialization(launch):
    """What Triton compiles a launch for: the kernel, the grid, and each argument (tensors: dtype and
    16-byte alignment; the other arguments as they are: sizes, constexprs, options)."""
    kernel, grid, args, kwargs = launch
    spec = lambda v: native_specialize_impl(CUDABackend, v, False, True, True) if hasattr(v, "data_ptr") else v  # noqa: E731
    return kernel.fn.__name__, grid, [spec(a) for a in args], {k: spec(v) for k, v in kwargs.items()}


def planned(fn, *args):
    launches = []
    with tk.planning(lambda kernel, grid, a, kw: launches.append((kernel, grid, a, kw))):
        fn(*args)
    return launches


def calls(amax, amax_t, seed):
    """Launchers of the kernels a training step uses, as functions of x [tokens, K]."""
    return [
        lambda x: tk.fake_quantize_1x16(x, "rne", 0),
        lambda x: tk.fake_quantize_1x16(x, "sr", seed, amax=amax(x), amax_is_own=True),
        lambda x: tk.fake_quantize_16x16(x, "rne", 0, amax=amax(x)),
        lambda x: tk.quantize_wgrad_operand(x, "sr", seed),
        lambda x: tk.fake_quantize_dual(x, "sr", seed, amax(x), "sr", seed, amax_t(x)),
        lambda x: tk.wgrad_amax(x),
        lambda x: tk.emulated_scaled_mm(x, amax(x), x, amax(x)),
    ]


@pytest.mark.parametrize("shape", [(64, 96), (48, 48)])
def test_plan_on_fake_tensors_names_the_real_launches(shape):
    """The same kernels, grids, constexprs and argument specializations from fake tensors (through the
    stand-ins the warm-up compiles with) as from real ones, at two shapes, and for a
    view whose start is not 16-byte aligned (its pointer loses the alignment specialization)."""
    seed = runtime.DeviceSeed(12345, torch.zeros(1, dtype=torch.int64, device=DEVICE))
    amax = lambda x: x.float().abs().amax()  # noqa: E731
    amax_t = lambda x: x.float().abs().amax() * 2  # noqa: E731
    m, k = shape
    real = torch.randn(m * k + 2, dtype=torch.bfloat16, device=DEVICE)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fake = torch.empty(m * k + 2, dtype=torch.bfloat16, device=DEVICE)
    # The second starts 4 bytes in: on a 32-bit word, as the 1x16 kernels read bf16 (a view starting
    # halfway into a word is copied first), but not 16-byte aligned.
    views = lambda t: (t[:-2].view(m, k), t[2:].view(m, k))  # noqa: E731
    for x, x_fake in zip(views(real), views(fake)):
        for call in calls(amax, amax_t, seed):
            expected = [specialization(launch) for launch in planned(call, x)]
            with mode:
                stand_ins = [
                    (k, g, tuple(map(precompile._stand_in, a)), {n: precompile._stand_in(v) for n, v in kw.items()})
                    for k, g, a, kw in planned(call, x_fake)
                ]
            assert expected and [specialization(launch) for launch in stand_ins] == expected
    aligned, misaligned = (specialization(planned(calls(amax, amax_t, seed)[0], x)[0])[2][0] for x in views(real))
    assert aligned == ("*bf16", "D") and misaligned[1] != "D"


def test_planning_launches_nothing():
    x = torch.randn(32, 32, device=DEVICE)
    out = planned(lambda t: tk.fake_quantize_1x16(t, "rne", 0), x)
    assert [launch[0].fn.__name__ for launch in out] == ["_amax_kernel", "_quantize_rows_kernel"]
    # Outside the plan, the launch runs (and the decoded values are the reference's).
    decoded, amax = tk.fake_quantize_1x16(x, "rne", 0)
    assert torch.equal(amax.cpu(), x.cpu().abs().amax())


def test_a_launch_waits_for_pending_compiles():
    events = []
    pending = concurrent.futures.Future()

    def finish():
        events.append("compiled")
        pending.set_result(1)

    tk.launch_after([pending])
    timer = threading.Timer(0.2, finish)
    timer.start()
    amax = tk.global_amax(torch.ones(64, device=DEVICE))
    events.append("launched")
    timer.join()
    assert events == ["compiled", "launched"] and float(amax) == 1.0
    assert not tk.launch._pending


def test_ops_expose_their_implementations():
    assert ops.implementation(torch.ops.fp4.fake_dual_quantize.default).__name__ == "fake_dual_quantize"
    assert ops.implementation(torch.ops.aten.mm.default) is None
    assert all(name in ops._IMPLEMENTATIONS for name in precompile.PLANNED_OPS)


@config.patch(precompile_threads=None)
def test_pool_size_from_the_setting():
    assert precompile.pool_size() == max(1, min(8, (os.cpu_count() or 2) - 1))
    assert precompile.pool_size(processes=True) == max(1, min(4, (os.cpu_count() or 2) - 1))
    with config.patch(precompile_threads=2):
        assert precompile.pool_size() == precompile.pool_size(processes=True) == 2
    variable = config.SETTINGS["precompile_threads"].variable
    assert config.from_environment({variable: "2"})["precompile_threads"] == 2
    for bad in ("0", "-1", "two"):
        with pytest.raises(ValueError, match=variable):
            config.from_environment({variable: bad})


@pytest.mark.skipif(CUDA, reason="the no-GPU case")
def test_no_background_compile_without_a_gpu():
    gm = torch.fx.symbolic_trace(torch.nn.Linear(16, 16))
    assert precompile.start(gm, "graph 0 forward") == []


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(256, 512), torch.nn.Linear(512, 256)])

    def forward(self, x):
        return self.blocks[1](torch.nn.functional.gelu(self.blocks[0](x)))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_gpu_first_call_compiles_no_kernel_in_the_training_thread(fresh_dynamo, monkeypatch, tmp_path, mode):
    """Every kernel the compiled step launches was compiled in the background while Inductor compiled
    the graphs: with threads (the default) none in the thread that launches it (the caller's for the
    forward, autograd's for the backward); with worker processes none in this process, its launches
    load them from Triton's cache (where Inductor has by then pointed Triton at PyTorch's ptxas, the
    workers' compiles must still be found). Each way gives the bits of a call without the warm-up,
    which compiles them in the caller. Each round starts from an empty Triton cache."""
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from fp4compile import Backend

    ours = [k for k in vars(tk).values() if isinstance(k, JITFunction)]
    names = {k.fn.__name__ for k in ours}
    loads, builds = [], []
    original_do_compile, original_make_ir = JITFunction._do_compile, ASTSource.make_ir

    def do_compile(self, *args, **kwargs):  # the launch's compile: a build, or a load from the cache
        if self.fn.__name__ in names:
            loads.append(self.fn.__name__)
        return original_do_compile(self, *args, **kwargs)

    def make_ir(self, *args, **kwargs):  # Triton's front end: runs only when the kernel is built here
        if self.fn.__name__ in names:
            builds.append((self.fn.__name__, not threading.current_thread().name.startswith("fp4compile-precompile")))
        return original_make_ir(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "_do_compile", do_compile)
    monkeypatch.setattr(ASTSource, "make_ir", make_ir)
    torch.manual_seed(0)
    model = MLP().cuda()
    x = torch.randn(512, 256, device="cuda")
    results = []
    for switch in ("processes", "threads", "0"):
        with config.patch(precompile=switch):
            monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / switch))
            for kernel in ours:  # forget what earlier tests (or rounds) compiled in this process
                kernel.device_caches.clear()
            loads.clear()
            builds.clear()
            torch._dynamo.reset()
            runtime.manual_seed(3)
            backend = Backend(mode=mode, high_precision_first_blocks=0, high_precision_last_blocks=0)
            m = MLP().cuda()
            m.load_state_dict(model.state_dict())
            with torch.autocast("cuda", torch.bfloat16):
                y = torch.compile(m, backend=backend)(x)
            y.float().square().sum().backward()
            results.append([y.detach().float().cpu()] + [p.grad.cpu() for p in m.parameters()])
            assert len(set(loads)) >= 3, loads
            in_caller = sorted({name for name, caller in builds if caller})
            if switch == "processes":
                assert not builds, f"built in the training process: {builds}"
                assert len(list((tmp_path / switch).rglob("*.cubin"))) >= len(set(loads))
            elif switch == "threads":
                assert builds and not in_caller, f"built by the caller: {in_caller}"
            else:
                assert in_caller and all(caller for _, caller in builds)
    for on, off in zip(results[0], results[2]):
        assert torch.equal(on, off)
    for on, off in zip(results[1], results[2]):
        assert torch.equal(on, off)



def test_device_constants_stay_real_when_first_built_on_fake_tensors():
    """A plan runs reference code on fake tensors too (an op without a kernel for its input): the
    per-device constants it builds and caches must be real tensors, or every later real call breaks."""
    from fp4compile import formats

    x = torch.randn(32, 64)
    expected = formats.quantize(x, "nvfp4", "1x16", "sr", seed=7)
    formats._e2m1_table.cache_clear()
    formats._default_rht_scale.cache_clear()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        formats.quantize(formats.rht(mode.from_tensor(x).t(), 16), "nvfp4", "1x16", "sr", seed=7)
    assert not isinstance(formats._e2m1_table(x.device), torch._subclasses.FakeTensor)
    got = formats.quantize(x, "nvfp4", "1x16", "sr", seed=7)
    assert torch.equal(got.data.view(torch.uint8), expected.data.view(torch.uint8))
    assert torch.equal(formats.rht(x, 16), formats.rht(x.clone(), 16))


def test_plan_runs_each_distinct_node_once(monkeypatch):
    """One plan per distinct (op, arguments, input layouts): nodes that differ only in their inputs'
    values share it, another shape gets its own, and a node whose input has no tensor value is skipped.
    The ops choose their kernels for CUDA tensors only, so here the quantize op's implementation is one
    that calls the kernel's launcher whatever the device."""
    calls = []

    def quantize(x, fmt, block, rounding, seed, check, amax=None):
        calls.append(tuple(x.shape))
        return tk.quantize_1x16(x, rounding, seed)

    monkeypatch.setitem(ops._IMPLEMENTATIONS, "fp4::quantize", quantize)
    graph = torch.fx.Graph()
    mode = FakeTensorMode()
    values = {"a": (64, 32), "b": (64, 32), "c": (32, 64), "d": None}
    for name, shape in values.items():
        node = graph.placeholder(name)
        if shape is not None:
            with mode:
                node.meta["val"] = torch.empty(shape, dtype=torch.bfloat16)
        graph.call_function(torch.ops.fp4.quantize.default, (node, "nvfp4", "1x16", "rne", 0, ""))
    graph.output(None)
    launches = precompile.plan(torch.fx.GraphModule(torch.nn.Module(), graph))
    assert calls == [(64, 32), (32, 64)]
    assert [launch[0].fn.__name__ for launch in launches] == ["_amax_kernel", "_quantize_rows_kernel"] * 2
    assert [launch[2][7:9] for launch in launches if launch[0] is tk.rows._quantize_rows_kernel] == [(64, 32), (32, 64)]


def test_precompile_mode_from_the_setting():
    variable = config.SETTINGS["precompile"].variable
    assert config.from_environment({})["precompile"] == "threads"
    for value, want in (("1", "threads"), ("threads", "threads"), ("processes", "processes"), ("0", "off")):
        assert config.from_environment({variable: value})["precompile"] == want
        with config.patch(precompile=value):
            assert precompile.mode() == want
    with pytest.raises(ValueError, match=variable):
        config.from_environment({variable: "process"})


def test_worker_process_compiles_into_the_cache_the_training_process_reads(tmp_path, monkeypatch):
    """A worker compiles a specialization for a GPU target without touching a GPU, from Triton's own
    description of it (taken by the ``jit_cache_hook`` of a warm-up here, as ``start`` does), under the
    key this process's launch path looks up: a warm-up here afterwards adds nothing to the cache. The
    worker starts with Triton's own ptxas; where another ptxas is at hand, this process switches to it
    after the worker started (as Inductor does when it compiles), and the job must carry that."""
    import shutil

    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia import compiler as nvidia
    from triton.runtime.driver import driver

    import compile_worker_kernels as kernels

    target = GPUTarget("cuda", 90, 32)

    class SM90Driver:  # what a warm-up asks of the driver; nothing runs
        def get_current_device(self):
            return 0

        def get_current_stream(self, device):
            return 0

        def get_current_target(self):
            return target

    def cache_files():
        return sorted(p.relative_to(cache) for p in cache.rglob("*") if p.is_file())

    def warm_up():
        kernels.add_one.warmup(torch.empty(1024), 1024, BLOCK=256, grid=(4,))

    cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    interpret = os.environ.pop("TRITON_INTERPRET", None)  # the worker compiles for the GPU; nothing runs
    try:
        pool = precompile._WorkerPool(1)  # started before this process changes its ptxas
    finally:
        if interpret is not None:
            os.environ["TRITON_INTERPRET"] = interpret
    own_ptxas = nvidia.get_ptxas(90).path
    other = shutil.which("ptxas") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "ptxas")
    previous_driver, previous_hook = driver._active, knobs.runtime.jit_cache_hook
    taken = []
    try:
        if os.path.isfile(other) and os.path.realpath(other) != os.path.realpath(own_ptxas):
            monkeypatch.setenv("TRITON_PTXAS_PATH", other)
        nvidia.get_ptxas_version.cache_clear()
        driver.set_active(SM90Driver())
        kernels.add_one.device_caches.clear()
        knobs.runtime.jit_cache_hook = lambda **kw: taken.append((kw["fn"].jit_function, kw["compile"])) or True
        warm_up()
        knobs.runtime.jit_cache_hook = previous_hook
        assert len(taken) == 1 and not cache.exists()  # described, not compiled
        fn, compile_args = taken[0]
        work = precompile.job(fn, compile_args["specialization_data"], target)
        bad = pool.submit((work[0], "no_such_kernel", *work[2:])).result(timeout=600)
        reply = pool.submit(work).result(timeout=600)
        assert "no_such_kernel" in bad  # an error comes back as text; the worker goes on
        assert reply is None
        compiled = cache_files()
        assert any(p.suffix == ".cubin" for p in compiled), compiled
        warm_up()  # this process's own compile: finds the worker's
        assert cache_files() == compiled
    finally:
        knobs.runtime.jit_cache_hook = previous_hook
        driver._active = previous_driver
        kernels.add_one.device_caches.clear()
        nvidia.get_ptxas_version.cache_clear()
        pool.close()
