import os

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter. Triton reads this when it is imported,
# and torch.compile imports it early, so it is set here, before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _is_blackwell() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    no_blackwell = pytest.mark.skip(reason="needs an sm_100 (Blackwell) GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if "blackwell" in item.keywords and not _is_blackwell():
            item.add_marker(no_blackwell)


@pytest.fixture
def fresh_dynamo():
    """A clean dynamo cache and SR stream (seed 0) around a test."""
    import fp4compile

    torch._dynamo.reset()
    fp4compile.manual_seed(0)
    yield
    torch._dynamo.reset()
