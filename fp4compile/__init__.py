"""fp4compile: train PyTorch models with NVFP4 arithmetic through ``torch.compile``.

    import fp4compile
    model = torch.compile(model, backend="nvfp4")

Importing the package reads the settings (``fp4compile.config``) and nothing heavier: each name below
imports its module on first use (the backend imports the fp4 ops, whose registration loads torch's
compiler stack), so that ``import fp4compile`` and ``fp4compile --help`` stay quick. ``backend="nvfp4"``
is found through the package's ``torch_dynamo_backends`` entry point.
"""

import importlib
import sys
import types

__version__ = "0.1.0"

# Public name -> the module that defines it (imported on first use).
_LAZY = {
    "Backend": "backend", "PlanWarning": "diagnostics", "get_backend": "backend", "nvfp4_backend": "backend",
    "Baseline": "baseline",
    "explain": "explain",
    "enable_fp4_all_gather": "fsdp",
    "calibrate": "export", "export": "export", "served": "export",
    "pipeline_text": "passes.pipeline", "precision_pass": "passes.pipeline", "print_pipeline": "passes.pipeline",
    "Recipe": "recipe",
    "Report": "report",
    "get_rng_state": "runtime", "manual_seed": "runtime", "set_rng_state": "runtime",
    "GemmSite": "sites",
}
_SUBMODULES = ("config", "formats", "ops", "runtime")

__all__ = sorted([*_LAZY, *_SUBMODULES], key=lambda n: (n[0].islower(), n))


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """``fp4compile.export`` and ``fp4compile.explain`` are the functions, not the modules of the same name
    that define them: importing those modules (which sets the package's attribute) leaves them so."""

    def __setattr__(self, name: str, value) -> None:
        if name in ("export", "explain") and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

from . import config  # noqa: E402  (the settings: read from the environment now, where a bad value fails)


def _register() -> None:
    """Register ``backend="nvfp4"`` where dynamo is already loaded (the entry point covers the rest: an
    installed package, dynamo imported later), without loading dynamo for it."""
    if "torch._dynamo" not in sys.modules:
        return
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "nvfp4" not in _BACKENDS or _BACKENDS["nvfp4"] is None:
        from .backend import nvfp4_backend

        register_backend(name="nvfp4")(nvfp4_backend)


_register()
