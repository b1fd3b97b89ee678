"""fp4compile: train PyTorch models with NVFP4 arithmetic through torch.compile."""

from . import formats

__version__ = "0.1.0"
