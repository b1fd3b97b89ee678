"""A Triton kernel for the compile-worker test (``test_precompile.py``): a JIT function even where the
tests run kernels in Triton's interpreter, since the worker compiles it for a GPU target."""

import triton.language as tl
from triton.runtime.jit import JITFunction


def add_one(x_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + 1.0, mask=mask)


add_one = JITFunction(add_one)  # under its function's name, as triton.jit leaves a kernel
