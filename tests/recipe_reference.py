"""An eager implementation of the NVFP4 recipe, written straight from the numerics contract.

It replaces chosen ``nn.Linear`` modules by a quantize -> dequantize -> matmul autograd function, to
compare the compiled backend against. Stochastic rounding is not modelled (tests turn SR off).
"""

from __future__ import annotations

import contextlib

import torch

from fp4compile import formats


def emulated_mm(qa: formats.QTensor, qb: formats.QTensor) -> torch.Tensor:
    """A @ B.T from quantized operands: block-decoded values, fp32 accumulation, then alpha (the global
    constant 6 x 448, or 6 x 256 for the Four Over Six block scale rule)."""
    acc = formats.block_decode(qa) @ formats.block_decode(qb).t()
    if qa.fmt == "nvfp4":
        inv = torch.tensor(1.0 / (2688.0 if qa.scale_rule == "6" else 1536.0))
        acc = acc * ((qa.amax * inv) * (qb.amax * inv))  # one alpha, one rounding
    return acc


class ReferenceLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, fmt, weight_2d, rht, rule="6"):
        act = "1x32" if fmt == "mxfp4" else "1x16"
        wblock = act if (fmt == "mxfp4" or not weight_2d) else "16x16"
        x2 = x.reshape(-1, x.shape[-1])
        y = emulated_mm(formats.quantize(x2, fmt, act, scale_rule=rule), formats.quantize(w, fmt, wblock, scale_rule=rule))
        if b is not None:
            y = y + b
        ctx.save_for_backward(x2, w)
        ctx.cfg = (fmt, act, wblock, rht, x.shape, b is not None, rule)
        return y.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, w = ctx.saved_tensors
        fmt, act, wblock, rht, x_shape, has_bias, rule = ctx.cfg
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = emulated_mm(formats.quantize(dy2, fmt, act, scale_rule=rule),
                         formats.quantize(w.t().contiguous(), fmt, wblock, scale_rule=rule))
        a, b = dy2.t().contiguous(), x2.t().contiguous()
        if rht:
            a, b = formats.rht(a), formats.rht(b)
        dw = emulated_mm(formats.quantize(a, fmt, act, scale_rule=rule), formats.quantize(b, fmt, act, scale_rule=rule))
        db = dy2.sum(0) if has_bias else None
        return dx.reshape(x_shape), dw, db, None, None, None, None


@contextlib.contextmanager
def reference_recipe(model: torch.nn.Module, fp4_names, fmt="nvfp4", weight_2d=True, rht=True, scale_rule="6"):
    """Within the block, the named linears of ``model`` compute with the eager reference recipe
    (``scale_rule``: NVFP4's block scale rule, "6" or "4/6")."""
    modules = dict(model.named_modules())
    saved = {}
    for name in fp4_names:
        mod = modules[name]
        saved[name] = mod.forward
        mod.forward = (lambda m: lambda x: ReferenceLinear.apply(x, m.weight, m.bias, fmt, weight_2d, rht, scale_rule))(mod)
    try:
        yield
    finally:
        for name, fwd in saved.items():
            del modules[name].forward
