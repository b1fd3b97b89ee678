"""Hugging Face experts modules written as an eager loop, traced in their grouped form.

Hugging Face MoE models pick how their experts module computes (``experts_implementation=``). The
``"eager"`` form loops in Python over the experts that received tokens: the loop's length and each
expert's tokens are data (``nonzero``, ``where``), so dynamo breaks the graph there and runs the loop in
eager PyTorch, where no expert GEMM can be an FP4 site. ``install`` registers, in transformers' experts
interface, an ``"eager"`` entry that runs the module's own eager forward as before, except while dynamo
traces it: then it is traced as transformers' ``"grouped_mm"`` form (the same sums: each token's
top-k expert outputs weighted and added), whose expert GEMMs ``passes.grouped_sites`` finds. The
sites record the form the model was written in (``GemmSite.form``).

The backend installs it when it is created and when it compiles a graph (transformers already imported:
a Hugging Face model exists). Nothing changes outside ``torch.compile``; under ``torch.compile`` with
any backend, such a module is traced in the grouped form instead of breaking the graph.
"""

from __future__ import annotations

import sys

import torch

_installed = []


def _traced_grouped(self, *args, **kwargs):
    """The experts module's ``"eager"`` entry: its own eager forward, or the grouped form while traced."""
    if torch.compiler.is_compiling():
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(self, *args, **kwargs)
    return type(self).forward.__wrapped__(self, *args, **kwargs)


def install() -> bool:
    """Register the ``"eager"`` entry where transformers' experts interface is loaded; True when it is."""
    if _installed:
        return True
    moe = sys.modules.get("transformers.integrations.moe")
    interface = getattr(moe, "ALL_EXPERTS_FUNCTIONS", None)
    if interface is None or not hasattr(moe, "grouped_mm_experts_forward"):
        return False
    if "eager" not in interface:
        interface["eager"] = _traced_grouped
    _installed.append(interface)
    return True
