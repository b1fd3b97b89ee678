"""Kernels for the fp4 ops: CUTLASS block-scaled GEMMs on Blackwell, Triton kernels on CUDA GPUs.

The executor table (``fp4compile.executors``) decides which implementation runs a call and records
why; this package holds what it offers. Nothing here imports ``fp4compile.ops``: the reference
numerics the kernels are checked against are ``fp4compile.formats`` and ``fp4compile.reference``.

| module | what |
|---|---|
| ``cutlass_gemm`` | configuration selection (``select_config``), rendering and building the CUTLASS SM100 NVFP4 GEMMs |
| ``cutlass_runtime`` | running a configuration a graph names (``cutlass:<config>[+emulation]``): first use, self-test, failure policy |
| ``cutlass_toolkit``, ``build_cache`` | the nvcc toolkit checks and the on-disk kernel cache |
| ``cublaslt_gemm`` | the emulated GEMM's cuBLASLt call with alpha in its epilogue |
| ``triton_kernels`` | the fused quantize, RHT, decode and epilogue kernels; ``triton_kernels.dispatch`` has their checks for the table |
"""
