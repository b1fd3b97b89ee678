import os

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter. Triton reads this when it is imported,
# and torch.compile imports it early, so it is set here, before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Every pass's contract is checked as it runs (fp4compile.contracts), before fp4compile reads its settings.
os.environ.setdefault("FP4COMPILE_CHECK_CONTRACTS", "1")


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)


@pytest.fixture
def fresh_dynamo():
    """A clean dynamo cache, dynamo counters and SR stream (seed 0) around a test."""
    import fp4compile

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    fp4compile.manual_seed(0)
    yield
    torch._dynamo.reset()


@pytest.fixture
def packed_on_cpu(monkeypatch):
    """``FP4COMPILE_EMULATED_GEMM=packed`` with the table's ``scaled_mm`` "triton" check taking CPU GEMMs
    too: ``lower_gemms`` then makes them ``fp4.packed_mm`` nodes, which run the reference on the CPU."""
    from fp4compile import config, executors

    monkeypatch.setattr(config, "emulated_gemm", "packed")
    entry = executors.unregister("scaled_mm", "triton")

    def check(spec):
        ok, why = entry.check(spec)
        return (True, "the FP4-operand GEMM (CPU test)") if spec.device.type == "cpu" and spec.fmt == "nvfp4" else (ok, why)

    executors.register("scaled_mm", "triton", check, entry.call, after="cutlass")
    yield
    executors.unregister("scaled_mm", "triton")
    executors.register("scaled_mm", "triton", entry.check, entry.call, after="cutlass")
