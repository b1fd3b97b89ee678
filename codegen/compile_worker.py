"""A process that compiles Triton kernel specializations for ``codegen.precompile``.

    python -m fp4compile.codegen.compile_worker MODULE...

imports the modules that define the kernels, then reads jobs from stdin until it closes, each a pickled
``(module, kernel name, specialization data, target, toolchain)`` (``precompile.job``): the
specialization data is what Triton's ``jit_cache_hook`` hands over for a launch
(``JITFunction.preload`` takes it back), ``target`` the ``GPUTarget`` the training process compiles
for, ``toolchain`` what else Triton's cache key depends on there (cache directory, ptxas and its
version, environment). The kernel is compiled into that cache under the key the training process's
first launch of the same specialization looks up, and the reply (pickled on stdout) is None or the
error's text.

Compiling needs no GPU: Triton's driver is replaced by one that only names the target (the kernels'
module asks torch whether a GPU is present when imported, nothing more). Compiling in another process
keeps Triton's front end (Python, holding the GIL) out of the training process, where Inductor
compiles the graph meanwhile.
"""

from __future__ import annotations

import importlib
import os
import pickle
import sys


class _TargetOnlyDriver:
    """What ``JITFunction.preload`` asks of Triton's driver, for a target given by the training process."""

    def __init__(self):
        self.target = None

    def get_current_device(self) -> int:
        return 0

    def get_current_target(self):
        return self.target


def _use_toolchain(toolchain: dict, arch: int) -> None:
    """Make Triton here compute the training process's cache key and write to its cache: its cache
    directory, its cache-invalidating environment variables, and its ptxas with the version it read."""
    from triton._C.libtriton import get_cache_invalidating_env_vars

    os.environ["TRITON_CACHE_DIR"] = toolchain["cache_dir"]
    for name in get_cache_invalidating_env_vars():
        if name not in toolchain["env"]:
            del os.environ[name]
    os.environ.update(toolchain["env"])
    if "ptxas" in toolchain:
        from triton import knobs
        from triton.backends.nvidia import compiler as nvidia

        path, version = toolchain["ptxas"]
        os.environ["TRITON_PTXAS_BLACKWELL_PATH" if arch >= 100 else "TRITON_PTXAS_PATH"] = path
        # The key takes ptxas's version as read once per process; take the training process's reading
        # (Triton's knob for a fixed version string, which it then returns instead of asking ptxas).
        knobs.nvidia.mock_ptx_version = version
        nvidia.get_ptxas_version.cache_clear()


def _compile(driver: _TargetOnlyDriver, job) -> "str | None":
    module, name, data, target, toolchain = job
    _use_toolchain(toolchain, target.arch)
    driver.target = target
    kernel = getattr(importlib.import_module(module), name)
    # A kernel keeps its binder and backend per device (here always 0), made for the target of the time.
    cached = kernel.device_caches.get(0)
    if cached is not None and cached[2] != target:
        kernel.device_caches.clear()
    kernel.preload(data)
    return None


def main(argv) -> int:
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed while importing or compiling goes to stderr, not into the replies
    for module in argv:
        importlib.import_module(module)
    from triton.runtime.driver import driver as triton_driver

    driver = _TargetOnlyDriver()
    triton_driver.set_active(driver)
    jobs = sys.stdin.buffer
    while True:
        try:
            job = pickle.load(jobs)
        except EOFError:
            return 0
        try:
            reply = _compile(driver, job)
        except Exception as err:  # reported to the training process, which then compiles the kernel itself
            reply = f"{type(err).__name__}: {err}"
        pickle.dump(reply, replies)
        replies.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
