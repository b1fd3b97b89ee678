"""Quantization statistics recorded while training: what each FP4 operand loses to its quantization.

``backend.collect_stats(steps=N)`` turns recording on for the next N training passes over the model
(each forward with gradients enabled that begins a pass, with its backward: a step, or a micro-batch
under gradient accumulation). While it is on, every FP4 linear of the graphs the backend compiles gets
a statistics buffer of its site, float64 [6, N, 5] on the activation's device, owned by the backend's
``QuantStats`` and handed to the compiled graph as a buffer (an input that CUDA graphs keep in place),
the way the activation-range histories are (``fp4compile.ranges``). The ``record_stats`` pass follows
each quantizer of the site's three GEMMs (fprop X and W, dgrad dY and W^T, wgrad dY^T and X^T, after
the RHT where the recipe applies it) with ``fp4.record_stats(buffer, slot, x, codes, scales, amax,
block, scale_rule)``, which computes ``formats.quantization_stats_tensor`` of that quantization on the
device and writes it, shifting the slot's window by one, in place: no host sync, and a recorded CUDA
graph replays it with each step's values. Entries not written hold NaN.

Off costs nothing: the graphs compiled while recording are the backend's recording versions; when the
N passes are over, each graph is compiled again without the buffers and the ops (once, the way the
switch to high precision recompiles: ``_SwitchableGraph`` keys its compilations on whether they
record), and from then on the graphs that run hold no statistics node.

A weight quantized once for fprop and dgrad (``plan_sharing``) is recorded once, as fprop's W; dgrad's
W^T row then repeats it (the same codes, transposed). The forward recomputed in the backward of a
checkpointed block records nothing. Grouped expert GEMMs and activation matmuls record nothing.
"""

from __future__ import annotations

import math

import torch

from fp4compile import formats, reference
from fp4compile.tables import columns

__all__ = ["QuantStats", "SLOTS", "STATS", "record_stats", "reduce_rows", "table"]

STATS = formats.STATS
# (role, operand) of each slot of a site's buffer: the six quantized operands of its three GEMMs.
SLOTS = (("fprop", "X"), ("fprop", "W"), ("dgrad", "dY"), ("dgrad", "W^T"), ("wgrad", "dY^T"), ("wgrad", "X^T"))
ROLES = ("fprop", "dgrad", "wgrad")


def slot(role: str, operand: int) -> int:
    """The buffer slot of operand ``operand`` (0: a, 1: b) of the ``role`` GEMM."""
    return 2 * ROLES.index(role) + operand


@torch.library.custom_op("fp4::record_stats", mutates_args=("stats",))
def record_stats(stats: torch.Tensor, slot: int, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                 amax: torch.Tensor, block: str, scale_rule: str = "6") -> None:
    """Shift ``stats[slot]`` (float64 [H, 5]) left by one and write last the statistics
    (``formats.quantization_stats_tensor``) of x's NVFP4 quantization ``codes, scales, amax`` (packed
    uint8 codes, row-major uint8 E4M3 scales, as ``fp4.quantize`` returns them), in place."""
    q = reference.qtensor(codes, scales, amax, "nvfp4", block, x.shape, x.dtype, scale_rule)
    values = formats.quantization_stats_tensor(x, q).to(stats.dtype)
    window = stats[slot]
    window.copy_(torch.cat((window[1:], values.reshape(1, -1))))


@record_stats.register_fake
def _(stats, slot, x, codes, scales, amax, block, scale_rule="6"):
    return None


class QuantStats:
    """The statistics buffers of a backend's FP4 sites, {site name: float64 [6, steps, 5]}.

    ``buffer(name, device)`` gives the tensor a compiled graph records into (made on first use);
    ``rows(reduce)`` reads them back (``Report.stats``).
    """

    def __init__(self, steps: int):
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"collect_stats(steps=...) takes a number of training steps >= 1, got {steps!r}")
        self.steps = steps
        self._buffers: dict[str, torch.Tensor] = {}

    def buffer(self, name: str, device) -> torch.Tensor:
        device = torch.device(device)
        current = self._buffers.get(name)
        if current is None or current.device != device:
            with torch.inference_mode(False):
                current = torch.full((len(SLOTS), self.steps, len(STATS)), math.nan, dtype=torch.float64, device=device)
            self._buffers[name] = current
        return current

    def __len__(self) -> int:
        return len(self._buffers)

    def rows(self, reduce: str = "mean") -> list[dict]:
        """One dict per (site, role, operand) with recorded values: ``site``, ``layer`` (the site's module
        path), ``role``, ``operand``, ``steps`` (how many were recorded) and the ``STATS``; reduced over
        the recorded steps by ``reduce``: "mean" (``amax``: the maximum), "last", or None for one row per
        recorded step (with ``step``, 0 the oldest kept)."""
        if reduce not in ("mean", "last", None):
            raise ValueError(f"reduce must be 'mean', 'last' or None, got {reduce!r}")
        out = []
        for name, buffer in self._buffers.items():
            values = buffer.detach().cpu() if not buffer.is_meta else torch.full(buffer.shape, math.nan, dtype=torch.float64)
            for s, (role, operand) in enumerate(SLOTS):
                window = values[s]
                kept = window[~torch.isnan(window[:, 0])]
                if not len(kept):
                    continue
                base = {"site": name, "layer": name.split("#", 1)[0], "role": role, "operand": operand}
                if reduce is None:
                    out += [{**base, "step": i, **dict(zip(STATS, row.tolist()))} for i, row in enumerate(kept)]
                    continue
                if reduce == "last":
                    stat = dict(zip(STATS, kept[-1].tolist()))
                else:
                    stat = dict(zip(STATS, kept.mean(0).tolist()))
                    stat["amax"] = float(kept[:, -1].max())
                out.append({**base, "steps": len(kept), **stat})
        return out


def reduce_rows(rows: list[dict]) -> list[dict]:
    """Per-step rows (``rows(None)``, or a run log's, gathered over several recordings) reduced as
    ``rows("mean")`` reduces them: per (site, role, operand) the mean of each statistic over the steps
    (in the order given), ``amax`` their maximum, ``steps`` their number."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["site"], r["role"], r["operand"]), []).append(r)
    out = []
    for (site, role, operand), group in groups.items():
        values = torch.tensor([[r[k] for k in STATS] for r in group], dtype=torch.float64)
        stat = dict(zip(STATS, values.mean(0).tolist()))
        stat["amax"] = float(values[:, -1].max())
        out.append({"site": site, "layer": group[0].get("layer", site.split("#", 1)[0]), "role": role,
                    "operand": operand, "steps": len(group), **stat})
    return out


def table(rows: list[dict]) -> str:
    """``rows`` (``QuantStats.rows``) as a fixed-width text table, the largest relative error first."""
    if not rows:
        return "no quantization statistics recorded (backend.collect_stats(steps=N), then train N steps)"
    rows = sorted(rows, key=lambda r: -r["relative_error"])
    header = ["site", "role", "operand", "rel. error", "zeros", "sat. blocks", "underflow blocks", "amax"]
    body = [[r["site"], r["role"], r["operand"], f"{r['relative_error']:.4f}", f"{r['zero_fraction']:.4f}",
             f"{r['scale_saturated']:.4f}", f"{r['scale_underflow']:.4f}", f"{r['amax']:.4g}"] for r in rows]
    return "\n".join(columns([header, *body], right=lambda column, _: column >= 3))
