"""fp4compile: train PyTorch models with NVFP4 arithmetic through ``torch.compile``.

    import fp4compile
    model = torch.compile(model, backend="nvfp4")
"""

from . import config, formats, ops, runtime
from .backend import Backend, PlanWarning, get_backend, nvfp4_backend
from .baseline import Baseline
from .explain import explain
from .export import calibrate, export, served
from .passes.pipeline import pipeline_text, precision_pass, print_pipeline
from .recipe import Recipe
from .report import Report
from .runtime import get_rng_state, manual_seed, set_rng_state
from .sites import GemmSite

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "Baseline",
    "PlanWarning",
    "GemmSite",
    "Recipe",
    "Report",
    "calibrate",
    "config",
    "explain",
    "export",
    "formats",
    "get_backend",
    "get_rng_state",
    "manual_seed",
    "nvfp4_backend",
    "ops",
    "pipeline_text",
    "precision_pass",
    "print_pipeline",
    "runtime",
    "served",
    "set_rng_state",
]


def _register() -> None:
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "nvfp4" not in _BACKENDS or _BACKENDS["nvfp4"] is None:
        register_backend(name="nvfp4")(nvfp4_backend)


_register()
