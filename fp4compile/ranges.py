"""Activation ranges recorded while training: the input amax of every FP4 layer, for W4A4 export.

The fprop quantizer of an NVFP4 linear computes the global amax of its activation operand, max |X|,
on every forward. Where the backend compiles a graph with gradients enabled and
``Recipe.amax_history`` is above 0, each such site gets a history: a float32 tensor of
``amax_history`` entries on the activation's device, owned by the backend's ``ActivationRanges`` and
handed to the compiled graph as a buffer (an input that CUDA graphs keep in place). After the
quantizer, the forward graph calls ``fp4.record_amax(history, amax)``, which shifts the history by one
and writes the new amax last, in place on the device: no host sync, and a recorded CUDA graph replays
it with each step's amax. Entries not written yet hold -inf, so the recorded range of a site,
``max(history)``, is the largest amax of the last ``amax_history`` training forwards (or of those
seen so far), and -inf where nothing was recorded.

``fp4compile.export(scheme="NVFP4")`` reads ``ActivationRanges.amax()``: one value per layer, the
maximum over its GEMM sites (a module called twice has sites ``name`` and ``name#2``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = ["ActivationRanges", "record_amax"]


@torch.library.custom_op("fp4::record_amax", mutates_args=("history",))
def record_amax(history: torch.Tensor, amax: torch.Tensor) -> None:
    """Shift ``history`` (float32 [H]) left by one and write ``amax`` (a 0-dim or 1-element tensor)
    last, in place: the window of the last H amaxes, newest last."""
    history.copy_(torch.cat((history[1:], amax.detach().reshape(1).to(history.dtype))))


@record_amax.register_fake
def _(history, amax):
    return None


def _values(history: torch.Tensor) -> torch.Tensor:
    """A history's entries on the CPU. One made for a model traced on the meta device holds no values:
    nothing recorded (-inf)."""
    if history.is_meta:
        return torch.full(history.shape, -math.inf, dtype=torch.float32)
    return history.detach().cpu()


class ActivationRanges:
    """The amax histories of a backend's FP4 sites, {site name: float32 [H] tensor}.

    ``history(name, device, length)`` gives the tensor a compiled graph records into (made on first
    use, or taken over from a checkpoint's values); ``amax()`` the recorded range of each layer.
    ``state_dict`` / ``load_state_dict`` carry the histories through a checkpoint.
    """

    def __init__(self):
        self._histories: dict[str, torch.Tensor] = {}
        self._loaded: dict[str, torch.Tensor] = {}  # from a checkpoint, for sites not compiled yet

    def history(self, name: str, device, length: int) -> torch.Tensor:
        """The history of site ``name`` on ``device``, ``length`` entries (the newest ones kept where
        an earlier history of the site was longer, or lived on another device)."""
        if length < 1:
            raise ValueError(f"an amax history of site {name!r} needs at least one entry, got {length}")
        device = torch.device(device)
        current = self._histories.get(name)
        if current is not None and current.device == device and current.numel() == length:
            return current
        before = current if current is not None else self._loaded.pop(name, None)
        if before is not None and before.is_meta:  # traced on the meta device: nothing was recorded
            before = None
        # A normal tensor even under inference_mode: it is written in place on every training step.
        with torch.inference_mode(False):
            tensor = torch.full((length,), -math.inf, dtype=torch.float32, device=device)
            if before is not None:
                kept = before.detach()[-length:].to(device=device, dtype=torch.float32)
                tensor[length - kept.numel():] = kept
        self._histories[name] = tensor
        return tensor

    def amax(self) -> dict[str, torch.Tensor]:
        """{layer name: recorded activation amax (float32 0-dim, on the CPU)}: the maximum over the
        window of every GEMM site of the layer; layers with nothing recorded are left out."""
        out: dict[str, torch.Tensor] = {}
        for name, history in {**self._loaded, **self._histories}.items():
            value = _values(history).max().float()
            if not value > -math.inf:
                continue
            layer = name.split("#", 1)[0]
            out[layer] = torch.maximum(out[layer], value) if layer in out else value
        return out

    def __len__(self) -> int:
        return len(self._histories) + len(self._loaded)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """{site name: history on the CPU}."""
        return {name: _values(h).clone() for name, h in {**self._loaded, **self._histories}.items()}

    def state_lists(self) -> list:
        """The histories as ``[[site name, [entries, oldest first]], ...]`` in plain Python lists (float32
        values, exact as Python floats): the form ``Backend.state_dict()`` holds them in. A distributed
        checkpoint (``torch.distributed.checkpoint``) stores a list without tensors as one value and loads
        it whole, so a fresh backend, which has no sites before it compiles, gets every history; from a
        dict of tensors it would load only the sites the fresh backend already has: none."""
        return [[name, history.tolist()] for name, history in self.state_dict().items()]

    def load_state_dict(self, state) -> None:
        """Replace every history by ``state``'s (``state_dict()`` or ``state_lists()``); a site the state
        lacks is cleared. Histories that compiled graphs record into are written in place."""
        state = dict(state or {})
        for name, value in state.items():
            value = torch.as_tensor(value)
            if value.dim() != 1 or not value.is_floating_point():
                raise ValueError(f"activation ranges: the history of site {name!r} must be a 1-D float tensor, got {tuple(value.shape)} {value.dtype}")
        self._loaded = {}
        for name, tensor in self._histories.items():
            with torch.no_grad():
                tensor.fill_(-math.inf)
                if name in state:
                    kept = torch.as_tensor(state.pop(name))[-tensor.numel():].to(tensor.device, torch.float32)
                    tensor[tensor.numel() - kept.numel():] = kept
        self._loaded = {name: torch.as_tensor(value).detach().float().cpu().clone() for name, value in state.items()}
