"""The model a compiled graph belongs to: parameter names and module structure from the root model.

A graph dynamo captures reads the model's parameters as inputs, however the code reaches them (a module
call, ``F.linear`` on a module's weight, ``x @ W.t()``, a checkpointed region, a block compiled on its
own). The backend names each parameter by its identity in the *root* model, so that a GEMM site is named
the same way whichever of these the model uses, and it takes the blocks from the root's module tree, so
that a graph holding one block is numbered among all of the model's blocks.

The root is the model given as ``Backend(model=...)``; else the outermost module on the call stack that
holds the compiled module inside one of its blocks (a block compiled on its own, called from its model's
``forward``); else the module that was compiled (``torch.compile(model)``, ``model.compile()``), also
for the graphs of frames inside it that graph breaks make.
"""

from __future__ import annotations

import sys
import weakref
from typing import Iterable, Optional

import torch

# Modules whose 2-D weight is a lookup table, not a GEMM operand.
_LOOKUP_MODULES = (torch.nn.Embedding, torch.nn.EmbeddingBag)


# Modules that wrap one module without being a level of the model: ``torch.compile``'s ``OptimizedModule``,
# the activation-checkpoint and offload wrappers of ``torch.distributed`` (torchtitan's ``apply_ac``) and
# FSDP1's wrapper. Their child's path component is dropped, so that a site is named as in the plain
# model (and as the wrapper's ``state_dict`` names its weight) however the model is wrapped.
WRAPPER_ATTRIBUTES = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def without_wrappers(path: str) -> str:
    """``layers.3._checkpoint_wrapped_module.mlp.fc`` -> ``layers.3.mlp.fc``."""
    if not any(w in path for w in WRAPPER_ATTRIBUTES):
        return path
    return ".".join(p for p in path.split(".") if p not in WRAPPER_ATTRIBUTES)


def site_name(parameter_name: str) -> str:
    """A GEMM site's name from its weight's qualified name: ``layers.3.attn.wq.weight`` -> ``layers.3.attn.wq``
    (other parameter names, such as ``attn.in_proj_weight``, stay whole)."""
    return parameter_name[: -len(".weight")] if parameter_name.endswith(".weight") else parameter_name


class ModelStructure:
    """Names and structure of one root model, indexed once (and again when its parameters change).

    ``names[id(p)]`` lists every qualified name of parameter ``p`` (a tied weight has several, in
    registration order); ``classes`` maps module paths to class names; ``gemm_weights`` lists the site
    names of the 2-D parameters of the model's modules outside embedding tables and of the 3-D weights of
    stacked MoE experts, the GEMM weights
    ``find_blocks`` groups into blocks whether or not the graph at hand computes them.
    """

    def __init__(self, root: torch.nn.Module):
        self.root = weakref.ref(root)
        self.root_class = type(root).__name__
        self.names: dict[int, list[str]] = {}
        self.classes: dict[str, str] = {}
        self.gemm_weights: list[str] = []
        self._index(root)

    def _index(self, root: torch.nn.Module) -> None:
        from torch._dynamo.eval_frame import OptimizedModule

        self.names, self.classes, self.gemm_weights = {}, {}, []
        for path, module in root.named_modules(remove_duplicate=False):
            # A block compiled on its own, or checkpoint-wrapped, sits in the model as a wrapper around
            # it: not a level (the wrapped module's class is the one at its path).
            wrapped = path.rsplit(".", 1)[-1] in WRAPPER_ATTRIBUTES
            path = without_wrappers(path)
            if isinstance(module, OptimizedModule):
                continue
            if wrapped:
                self.classes[path] = type(module).__name__
            else:
                self.classes.setdefault(path, type(module).__name__)
            for name, p in module.named_parameters(recurse=False):
                full = f"{path}.{name}" if path else name
                self.names.setdefault(id(p), []).append(full)
                # The root's own 2-D parameters are left to the graphs that use them (a position table
                # is no GEMM weight; a GEMM on one is a site of the graph either way).
                # 3-D: the stacked weights of MoE experts ([experts, out, in]), but not a convolution's.
                if path and (p.dim() == 2 and not isinstance(module, _LOOKUP_MODULES)
                             or p.dim() == 3 and not isinstance(module, torch.nn.modules.conv._ConvNd)):
                    self.gemm_weights.append(site_name(full))
        self.gemm_weights = list(dict.fromkeys(self.gemm_weights))

    def name_of(self, param: torch.Tensor) -> Optional[str]:
        """The qualified name of ``param`` in the root (the first, for a tied weight)."""
        names = self.names.get(id(param))
        if names is None:
            root = self.root()
            if root is None:
                return None
            self._index(root)  # parameters replaced since (a module swapped in)
            names = self.names.get(id(param))
        return names[0] if names else None

    def holds(self, params: Iterable[torch.Tensor]) -> bool:
        return all(id(p) in self.names for p in params)


def _modules_on_stack() -> list[tuple[torch.nn.Module, bool]]:
    """(module, compiled) for the modules whose call is running, innermost first; a compiled module
    (``torch.compile(module)``'s ``OptimizedModule``, or ``module.compile()``) counts as the module it
    wraps, with ``compiled`` True."""
    from torch._dynamo.eval_frame import OptimizedModule

    found: dict[int, list] = {}
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        frame = frame.f_back
        if not isinstance(owner, torch.nn.Module):
            continue
        wrapped = isinstance(owner, OptimizedModule)
        module = owner._orig_mod if wrapped else owner
        compiled = wrapped or getattr(module, "_compiled_call_impl", None) is not None
        entry = found.setdefault(id(module), [module, False])
        entry[1] = entry[1] or compiled
    return [(m, c) for m, c in found.values()]


def _holds_all(module: torch.nn.Module, param_ids: set) -> bool:
    return param_ids <= {id(p) for p in module.parameters()}


def find_root(params: list, in_a_block) -> Optional[torch.nn.Module]:
    """The root model of a graph reading ``params``, from the modules on the call stack; None where no
    module there holds them.

    The outermost compiled module holding them (the innermost holder where none is compiled) is the
    model that was compiled; a graph of a frame inside it (a graph break) belongs to it too. It is the
    root unless a module further out holds it inside one of its blocks (``in_a_block(outer, path of the
    compiled module in it)``): then it is a block compiled on its own, and that module is the root.
    """
    ids = {id(p) for p in params}
    holders = [(m, c) for m, c in _modules_on_stack() if _holds_all(m, ids)]
    if not holders:
        return None
    compiled_ones = [i for i, (_, c) in enumerate(holders) if c]
    at = compiled_ones[-1] if compiled_ones else 0
    compiled = holders[at][0]
    for outer, _ in reversed(holders[at + 1:]):
        path = next((name for name, m in outer.named_modules() if m is compiled), None)
        if path is not None and in_a_block(outer, path):
            return outer
    return compiled
