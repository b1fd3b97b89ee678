"""A high-precision baseline with the nvfp4 backend's generic compile settings.

One thing ``fp4compile.Backend`` does while it compiles has nothing to do with FP4 and helps any model
that Inductor records in CUDA graphs: unused-gradient buffers (``fp4compile.grad_buffers``). An output
that a loss of the same graph is computed from (the logits returned beside the loss) gets a buffer for
its gradient, so that an unused gradient reaches the recorded backward graph without a copy.

A BF16 model compiled by plain ``torch.compile`` lacks it, so comparing it with an FP4 model credits it
to FP4. ``Baseline`` is a ``torch.compile`` backend that is Inductor with this setting and nothing
else, for the comparison arm:

    torch.compile(model, backend=fp4compile.Baseline(), mode="reduce-overhead")

It follows the same switch as ``Backend``: ``unused_grad_buffers`` (None: where the graphs are recorded
in CUDA graphs).
"""

from __future__ import annotations

from typing import Optional

import torch.fx as fx

from fp4compile import grad_buffers


class Baseline:
    """Inductor with fp4compile's generic compile settings (see the module docstring).

    mode: an Inductor mode, as ``torch.compile(mode=...)`` (which may give it instead).
    unused_grad_buffers: as ``Backend(unused_grad_buffers=...)``; None (default): under CUDA graphs.
    ``buffered_outputs`` lists, for each graph compiled, the names of the outputs that got a buffer
    (an empty tuple where none did).
    """

    def __init__(self, mode: Optional[str] = None, unused_grad_buffers: Optional[bool] = None):
        self.mode = mode
        self.unused_grad_buffers = unused_grad_buffers
        self.buffered_outputs: list[tuple[str, ...]] = []

    def __repr__(self) -> str:
        return f"fp4compile.Baseline(mode={self.mode!r}, unused_grad_buffers={self.unused_grad_buffers!r})"

    def inductor_config(self, mode: Optional[str] = None, options: Optional[dict] = None) -> dict:
        """Inductor's config patches for ``mode`` (else this baseline's) plus ``options``."""
        from torch._inductor import list_mode_options

        mode = mode or self.mode
        patches = dict(list_mode_options(mode)) if mode not in (None, "default") else {}
        patches.update(options or {})
        return patches

    def __call__(self, gm: fx.GraphModule, example_inputs, mode: Optional[str] = None,
                 options: Optional[dict] = None):
        from torch._inductor import compile_fx as inductor

        patches = self.inductor_config(mode, options)
        buffer_plan = grad_buffers.prepare(gm, self.unused_grad_buffers, grad_buffers.records_cuda_graphs(patches))
        self.buffered_outputs.append(buffer_plan.names if buffer_plan is not None else ())

        compiled = inductor.compile_fx(gm, example_inputs, config_patches=patches or None)
        return grad_buffers.wrap(compiled, buffer_plan) if buffer_plan is not None else compiled


def generic_settings(backend) -> dict:
    """The generic settings the graphs ``backend`` (an ``fp4compile.Backend`` or ``Baseline``) compiled
    got: the outputs given an unused-gradient buffer (names, over all graphs)."""
    if isinstance(backend, Baseline):
        names = [n for names in backend.buffered_outputs for n in names]
    else:
        names = [n for ctx in backend.report.contexts for n in ctx.grad_buffers]
    return {"unused_grad_buffers": names}
