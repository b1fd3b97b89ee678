"""From FP4 training to FP4 serving: the trained model as an NVFP4 checkpoint (docs/export.md).

``export(model, path, backend=backend)`` writes a folder in the compressed-tensors format
(``quantization_config.quant_method = "compressed-tensors"``, format ``nvfp4-pack-quantized``), which
transformers and vLLM read. Every FP4 GEMM site of the backend's plan is written as

- ``<site>.weight_packed``: uint8 [N, K/2], two E2M1 codes per byte, the even element in the low nibble;
- ``<site>.weight_scale``: float8_e4m3fn [N, K/16], one scale per 16 elements of a row;
- ``<site>.weight_global_scale``: float32 [1], compressed-tensors' ``448 * 6 / amax``;
- with ``scheme="NVFP4"`` (W4A4) also ``<site>.input_global_scale``: float32 [1], ``448 * 6 / amax``
  of the layer's activation range: the one its training forwards recorded (``fp4compile.ranges``), or
  the one given (``calibrate``);

holding the codes and scales of the training forward's quantization of the weight as it is now (NVFP4
16x16 tiles, round-to-nearest-even, the tensor's own amax: a tile's scale repeated on its 16 rows is
exactly the 1x16 scale of each row). High-precision layers are written as plain BF16 weights and
their ``nn.Linear`` modules listed under ``ignore``.

``served(model, backend, scheme)`` runs a model as the exported checkpoint computes (FP4 weights
quantized once; activations quantized as in serving with W4A4), and ``calibrate`` measures the
activation ranges W4A4 needs where none were recorded (a model loaded from a checkpoint) or to
override them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch

from . import formats
from .ops import autocast_dtype
from .model_structure import site_name

__all__ = [
    "SCHEMES", "ExportSite", "activation_amax", "calibrate", "export", "export_sites", "quantized_weight", "served",
    "site_tensors",
]

# scheme -> whether the activations are quantized too (compressed-tensors' preset names).
SCHEMES = {"NVFP4": True, "NVFP4A16": False}
FORMAT = "nvfp4-pack-quantized"
QUANTIZATION_CONFIG_FILE = "quantization_config.json"
_SAFETENSORS_INDEX = "model.safetensors.index.json"


@dataclasses.dataclass(frozen=True)
class ExportSite:
    """An FP4 GEMM site as export sees it: ``name`` (the weight's path without ``.weight``), the weight's
    parameter name, and whether the GEMM multiplies by the parameter's transpose (GPT-2's Conv1D
    ``addmm(b, x, W)`` and ``x @ W`` hold W as [in, out])."""

    name: str
    parameter: str
    transposed: bool


def export_sites(backend) -> list[ExportSite]:
    """The FP4 weight sites of ``backend``'s plan (products of two activations have no weight to
    export), in plan order; a weight that several GEMMs read (``name#2``) once. Grouped MoE expert
    weights (3-D, ``experts``) are left out: they are written in high precision, as stored (no
    compressed-tensors layout for stacked experts is written yet)."""
    if backend is None or not hasattr(backend, "report"):
        raise TypeError(
            "export needs the fp4compile.Backend the model was trained with (backend=...): its plan says which "
            f"GEMMs ran in FP4; got {type(backend).__name__}"
        )
    views = backend.report.sites
    if not views:
        raise ValueError(
            "the backend has compiled no GEMM site yet: run the compiled model once (a training step) before "
            "exporting, so that its precision plan exists"
        )
    fmts = sorted({v.precision for v in views if v.precision != "high"})
    if "mxfp4" in fmts:
        raise NotImplementedError(
            "export writes NVFP4 checkpoints; this model was trained with MXFP4 (Recipe(fmt='mxfp4')), whose "
            "power-of-two 1x32 scales the nvfp4-pack-quantized format cannot hold. Exporting it as NVFP4 would "
            "quantize again with another format's error; compressed-tensors' mxfp4-pack-quantized format is not "
            "written yet"
        )
    sites: dict[str, ExportSite] = {}
    for view in views:
        if view.precision == "high" or view.kind == "activation_matmul" or view.experts is not None:
            continue
        name = view.name.split("#", 1)[0]
        sites.setdefault(name, ExportSite(name, name + ".weight", view.kind in ("addmm", "matmul")))
    return list(sites.values())


def activation_amax(backend, sites: list[ExportSite], input_amax: Optional[dict] = None) -> dict:
    """{site: activation amax} for W4A4: the ranges ``backend``'s training forwards recorded
    (``backend.ranges``), with ``input_amax`` (``calibrate``'s result) taking precedence where given.
    A site with neither is an error naming it and both remedies."""
    ranges = getattr(backend, "ranges", None)
    amax = {**(ranges.amax() if ranges is not None else {}), **(input_amax or {})}
    missing = [s.name for s in sites if s.name not in amax]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(
            f"scheme='NVFP4' quantizes each FP4 layer's input with a global scale from its range, and no range "
            f"was recorded or given for {shown}. Either train those layers with the backend first (its training "
            "forwards record the ranges: Recipe.amax_history > 0; a checkpoint keeps them in Backend.state_dict()), "
            "or pass input_amax=fp4compile.calibrate(model, batches, backend=backend); scheme='NVFP4A16' writes "
            "the weights only"
        )
    bad = {k: float(v) for k, v in amax.items() if not (torch.isfinite(torch.as_tensor(v)) and float(v) >= 0)}
    if bad:
        raise ValueError(f"activation amaxes must be finite and >= 0; got {bad}")
    return {s.name: amax[s.name] for s in sites}


def _weight_block(backend) -> str:
    return backend.recipe.weight_block


def quantized_weight(weight: torch.Tensor, transposed: bool = False, block: str = "16x16",
                     scale_rule: str = "6") -> formats.QTensor:
    """The training forward's NVFP4 quantization of a GEMM weight as it is now: the parameter as stored
    (float32 master weights), [out, in] as the GEMM multiplies it, round-to-nearest-even with its own
    amax (``fp4.quantize(W, "nvfp4", "16x16", "rne", ...)`` in fprop; the next forward uses exactly these
    bits). ``transposed``: the parameter is [in, out] (GPT-2's Conv1D); ``scale_rule``: the recipe's block
    scale rule."""
    w = weight.detach()
    if transposed:
        w = w.t()
    return formats.quantize(w, "nvfp4", block, "rne", scale_rule=scale_rule)


def site_tensors(q: formats.QTensor, input_amax: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
    """The compressed-tensors tensors of one site (names without the ``<site>.`` prefix) from its weight's
    quantization ``q`` and, for W4A4, its activation amax."""
    if q.fmt != "nvfp4" or q.block not in ("16x16", "1x16") or len(q.shape) != 2:
        raise ValueError(f"site_tensors takes a 2-D NVFP4 weight quantization, got {q.fmt} {q.block} of shape {tuple(q.shape)}")
    out = {
        "weight_packed": q.data.view(torch.uint8),
        # A 16x16 tile's scale is stored on each of its rows: the [N, K/16] row scales serving expects.
        "weight_scale": q.scales.contiguous(),
        # compressed-tensors decodes value * (weight_scale / global_scale); the training decode is
        # value * weight_scale * amax / 2688, and the training quantizer's S_enc = 2688 / amax is that
        # global scale (the same float32 the codes were made with; 1536 instead of 2688 with the
        # block scale rule "4/6", whose scales the same decode reads).
        "weight_global_scale": formats.global_encode_scale(q.amax.float(), q.scale_rule).reshape(1),
    }
    if input_amax is not None:
        out["input_global_scale"] = formats.global_encode_scale(torch.as_tensor(input_amax, dtype=torch.float32),
                                                                q.scale_rule).reshape(1)
    return out


def _is_hf_model(model: torch.nn.Module) -> bool:
    return hasattr(model, "config") and hasattr(model.config, "to_json_string") and hasattr(model, "save_pretrained")


def _check_sites(model: torch.nn.Module, sites: list[ExportSite], hf: bool) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    for site in sites:
        p = params.get(site.parameter)
        if p is None or p.dim() != 2:
            raise ValueError(
                f"FP4 site {site.name!r} of the backend's plan has no 2-D parameter {site.parameter!r} in "
                f"{type(model).__name__}: export the model the backend compiled (the root model)"
            )
        if not hf:
            continue
        owner = _module_of(model, site)
        if not isinstance(owner, torch.nn.Linear):
            reason = ""
            if site.transposed:
                reason = (
                    f" ({type(owner).__name__} holds its weight as [in, out]; transformers keeps these modules "
                    "when loading, and compressed-tensors quantizes nn.Linear and nn.Embedding only, so the "
                    "packed weights would not be loaded)"
                )
            raise NotImplementedError(
                f"cannot export FP4 site {site.name!r} as compressed-tensors: it is a {type(owner).__name__}, "
                f"not an nn.Linear{reason}. Keep it in high precision (Recipe(high_precision_modules=...)) or "
                "export with save_pretrained"
            )


def quantization_config(scheme: str, ignore: list[str], weight_block: str = "16x16") -> dict:
    """The ``quantization_config`` entry of config.json: compressed-tensors' NVFP4 / NVFP4A16 presets,
    targeting ``nn.Linear`` modules, ``ignore`` the high-precision ones."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {sorted(SCHEMES)}, got {scheme!r}")
    fp4 = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group",
           "scale_dtype": "torch.float8_e4m3fn"}
    group = {"targets": ["Linear"], "weights": dict(fp4, dynamic=False), "input_activations": None,
             "output_activations": None, "format": None}
    if SCHEMES[scheme]:
        # Block scales per token at run time (dynamic "local"), the global scale from the checkpoint.
        group["input_activations"] = dict(fp4, dynamic="local", observer="static_minmax")
    return {
        "quant_method": "compressed-tensors",
        "format": FORMAT,
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "transform_config": {},
        # Where this checkpoint came from: the training forward's own quantization, not a PTQ pass.
        "producer": {"name": "fp4compile", "weight_block": weight_block},
    }


EXPORT_MANIFEST = "fp4compile_export.json"


def _written_by_export(out: Path) -> set:
    """The names of the files an earlier export wrote into ``out``, as its manifest lists them."""
    try:
        files = json.loads((out / EXPORT_MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return set()
    return {*map(str, files), EXPORT_MANIFEST}


def _check_folder(out: Path, overwrite: bool) -> None:
    """Refuse ``out`` where it is not a folder, or (unless ``overwrite``) holds files no earlier export wrote."""
    if not out.exists():
        return
    if not out.is_dir():
        raise FileExistsError(f"export writes a folder, and {out} is a file")
    foreign = sorted(p.name for p in out.iterdir() if p.name not in _written_by_export(out))
    if foreign and not overwrite:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise FileExistsError(
            f"{out} holds files that no earlier export wrote ({shown}); export into a new or empty folder, or "
            "pass overwrite=True to replace the folder and everything in it"
        )


@contextlib.contextmanager
def _staging(out: Path) -> Iterator[Path]:
    """A new folder beside ``out`` to write an export into. When the block ends without an error, the
    folder gets its manifest and replaces ``out`` whole (``_replace``); after an error it is removed and
    ``out`` is left as it was."""
    out.parent.mkdir(parents=True, exist_ok=True)
    folder = out.parent / f".{out.name}.{uuid.uuid4().hex[:12]}.partial"
    folder.mkdir()
    try:
        yield folder
        files = sorted(p.name for p in folder.iterdir())
        (folder / EXPORT_MANIFEST).write_text(json.dumps({"files": files}, indent=2) + "\n")
        _replace(folder, out)
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # still there only after an error


def _replace(folder: Path, out: Path) -> None:
    """Make ``folder`` (beside ``out``) the folder ``out`` by renames: an earlier ``out`` is moved aside
    first and deleted after, so that ``out`` never holds files of both."""
    if not out.exists():
        os.rename(folder, out)
        return
    old = out.parent / f".{out.name}.{uuid.uuid4().hex[:12]}.old"
    os.rename(out, old)
    try:
        os.rename(folder, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


class _ShardWriter:
    """Writes safetensors shards of at most ``max_bytes`` each as tensors arrive, so that export holds
    one shard of converted tensors at a time, never a second copy of the whole model."""

    def __init__(self, path: Path, max_bytes: int):
        self.path, self.max_bytes = path, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[tuple[str, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        name = f"model-{len(self.shards) + 1:05d}.safetensors.part"
        save_file(self.pending, str(self.path / name), metadata={"format": "pt"})
        self.shards.append((name, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        """Name the shards as transformers expects: ``model.safetensors``, or numbered shards and an index."""
        self.flush()
        n = len(self.shards)
        if n == 1:
            os.replace(self.path / self.shards[0][0], self.path / "model.safetensors")
            return
        weight_map = {}
        for i, (part, names) in enumerate(self.shards, 1):
            final = f"model-{i:05d}-of-{n:05d}.safetensors"
            os.replace(self.path / part, self.path / final)
            weight_map.update({k: final for k in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.path / _SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _tensors(model: torch.nn.Module, sites: list[ExportSite], input_amax: Optional[dict], dtype: torch.dtype,
             block: str, scale_rule: str = "6") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the checkpoint, one state-dict entry at a time: an FP4 weight becomes its site's
    compressed tensors (quantized when its turn comes), a tied duplicate is left out (transformers ties
    it again on load), other floating tensors are cast to ``dtype``."""
    by_param = {s.parameter: s for s in sites}
    seen: set = set()
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape)) if tensor.numel() else None
        if key is not None and key in seen:
            continue
        if key is not None:
            seen.add(key)
        site = by_param.get(name)
        if site is not None:
            amax = None if input_amax is None else input_amax[site.name]
            q = quantized_weight(tensor, site.transposed, block, scale_rule)
            for suffix, t in site_tensors(q, amax).items():
                yield f"{site.name}.{suffix}", t
        elif tensor.is_floating_point():
            yield name, tensor.detach().to(dtype)
        else:
            yield name, tensor.detach()


def export(
    model: torch.nn.Module,
    path,
    backend=None,
    scheme: str = "NVFP4",
    input_amax: Optional[dict] = None,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_size: int = 2 * 1024**3,
    overwrite: bool = False,
) -> Path:
    """Write ``model`` (trained with ``backend``) as an NVFP4 checkpoint in the compressed-tensors format.

    scheme: "NVFP4" (W4A4: FP4 weights and activations) or "NVFP4A16" (FP4 weights, activations in
    ``dtype``).
    input_amax: for W4A4, {site name: activation amax} (``calibrate``'s result), used instead of the
    ranges the backend recorded in training (``backend.ranges``); a site with neither is an error.
    dtype: the type of every tensor that is not an FP4 weight (high-precision layers, norms, embeddings).
    max_shard_size: bytes per safetensors file; export holds at most one file's tensors at a time.
    overwrite: replace a folder that holds files no earlier export wrote (they are deleted); without it
    such a folder is refused.

    A Hugging Face model gets the folder ``save_pretrained`` writes (config.json with the
    ``quantization_config``, generation_config.json, safetensors shards); any other model the same
    safetensors files and ``quantization_config.json``; both with ``fp4compile_export.json``, the list
    of the files the export wrote. The folder is written beside ``path`` and then moved into place, so
    ``path`` holds either the earlier export or this one, whole, never a mix of the two (an earlier
    ``model.safetensors`` beside new shards would be loaded in their place). Returns the folder's path.
    A model compiled block by block (``model.layers[i] = torch.compile(block)``) is exported with its
    blocks' own parameter names.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {sorted(SCHEMES)}, got {scheme!r}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"export takes the trained nn.Module, got {type(model).__name__}")
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper: the model itself
    with _plain_modules(model):  # a model compiled block by block: its blocks' own names and modules
        sites = export_sites(backend)
        hf = _is_hf_model(model)
        _check_sites(model, sites, hf)
        block = _weight_block(backend)
        if block not in ("16x16", "1x16"):
            raise NotImplementedError(f"export writes NVFP4 weights; the recipe quantizes weights in {block} blocks")
        input_amax = activation_amax(backend, sites, input_amax) if SCHEMES[scheme] else None
        if max_shard_size <= 0:
            raise ValueError(f"max_shard_size must be a positive number of bytes, got {max_shard_size}")
        out = Path(path)
        _check_folder(out, overwrite)
        exported = {s.name for s in sites}
        ignore = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n not in exported]
        config = quantization_config(scheme, ignore, block)

        with _staging(out) as folder:
            writer = _ShardWriter(folder, max_shard_size)
            with torch.no_grad():
                for name, tensor in _tensors(model, sites, input_amax, dtype, block, backend.recipe.block_scale_rule):
                    writer.add(name, tensor)
            writer.close()

            if hf:
                model.config.save_pretrained(folder)
                generation = getattr(model, "generation_config", None)
                if generation is not None and getattr(model, "can_generate", lambda: False)():
                    generation.save_pretrained(folder)
                config_file = folder / "config.json"
                data = json.loads(config_file.read_text())
                data["quantization_config"] = config
                data["dtype"] = str(dtype).removeprefix("torch.")
                config_file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
            else:
                (folder / QUANTIZATION_CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


# ---------------------------------------------------------------------------------------------
# The served model: what the exported checkpoint computes
# ---------------------------------------------------------------------------------------------


def _module_of(model: torch.nn.Module, site: ExportSite) -> torch.nn.Module:
    path = site.parameter.rsplit(".", 1)[0] if "." in site.parameter else ""
    return model.get_submodule(path)


@contextlib.contextmanager
def _plain_modules(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``model`` with its compiled parts as the modules they compile, while the block lasts: a child
    replaced by ``torch.compile(child)`` is the child again (so its parameters have their names without
    ``_orig_mod``), and a module compiled in place (``module.compile()``) runs its own forward."""
    from torch._dynamo.eval_frame import OptimizedModule

    swapped, compiled_calls, seen, todo = [], [], set(), [model]
    try:
        while todo:
            module = todo.pop()
            if id(module) in seen:
                continue
            seen.add(id(module))
            if module.__dict__.get("_compiled_call_impl") is not None:
                compiled_calls.append((module, module.__dict__["_compiled_call_impl"]))
                module._compiled_call_impl = None
            for name, child in list(module._modules.items()):
                plain = child
                while isinstance(plain, OptimizedModule):
                    plain = plain._orig_mod
                if plain is not child:
                    swapped.append((module, name, child))
                    module._modules[name] = plain
                if plain is not None:
                    todo.append(plain)
        yield model
    finally:
        for module, name, child in reversed(swapped):
            module._modules[name] = child
        for module, call in compiled_calls:
            module._compiled_call_impl = call


def _quantize_activation(x: torch.Tensor, amax: torch.Tensor, scale_rule: str = "6") -> torch.Tensor:
    """x as a W4A4 server sees it: NVFP4 1x16 blocks along the features with the checkpoint's static
    global scale (from ``amax``: ``input_global_scale``, 2688 / amax, or 1536 / amax with the block scale
    rule "4/6") and per-block scales of this x, by the recipe's rule; values above amax saturate."""
    q = formats.quantize(x, "nvfp4", "1x16", "rne", amax=amax.to(x.device), scale_rule=scale_rule)
    return formats.dequantize(q, x.dtype)


@contextlib.contextmanager
def served(model: torch.nn.Module, backend, scheme: str = "NVFP4A16", input_amax: Optional[dict] = None):
    """Run ``model`` as its exported checkpoint computes, for evaluation (no gradients):

    each FP4 weight is quantized once on entry, as ``export`` writes it, and its decoded values replace
    the parameter's while the block runs (the master weights come back on exit); with ``scheme="NVFP4"``
    (W4A4) each FP4 layer's input is quantized in 1x16 blocks with the global scale ``input_amax`` gives
    it (default: the ranges the backend recorded in training, as ``export``), as a W4A4 server does,
    by the recipe's block scale rule (``Recipe.block_scale_rule``, as the weights).
    The model it yields runs its plain modules: blocks compiled one by one (``model.layers[i] =
    torch.compile(block)``, ``block.compile()``) run uncompiled inside, as they do in serving (the
    compiled training forward would quantize the activations again); call the model it yields, not a
    ``torch.compile`` wrapper around it.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {sorted(SCHEMES)}, got {scheme!r}")
    model = getattr(model, "_orig_mod", model)
    with _plain_modules(model):
        sites = export_sites(backend)
        _check_sites(model, sites, hf=False)
        if SCHEMES[scheme]:
            input_amax = activation_amax(backend, sites, input_amax)
        block = _weight_block(backend)
        params = dict(model.named_parameters(remove_duplicate=False))
        saved, hooks = [], []
        try:
            with torch.no_grad():
                for site in sites:
                    p = params[site.parameter]
                    decoded = formats.dequantize(quantized_weight(p, site.transposed, block, backend.recipe.block_scale_rule),
                                                 p.dtype)
                    saved.append((p, p.data))
                    p.data = decoded.t().contiguous() if site.transposed else decoded
                    if SCHEMES[scheme]:
                        amax = torch.as_tensor(input_amax[site.name], dtype=torch.float32)
                        hooks.append(_module_of(model, site).register_forward_pre_hook(
                            lambda m, args, amax=amax: (_quantize_activation(args[0], amax, backend.recipe.block_scale_rule),
                                                        *args[1:])
                        ))
            with torch.no_grad():
                yield model
        finally:
            for h in hooks:
                h.remove()
            for p, data in saved:
                p.data = data


def calibrate(model: torch.nn.Module, batches: Iterable, backend, forward=None) -> dict[str, torch.Tensor]:
    """{FP4 site: max |input|} over ``batches``, for ``export(scheme="NVFP4")``'s activation global scales
    where the backend recorded none in training (a model loaded from a checkpoint), or instead of them.

    Runs the model with its FP4 weights as served (``served(..., "NVFP4A16")``), without gradients,
    so the ranges are those the exported model's layers see. ``forward(model, batch)`` runs one batch
    (default ``model(batch)``, or ``model(*batch)`` for a tuple, ``model(**batch)`` for a dict). Under
    ``torch.autocast`` the inputs are measured in the autocast type, as the GEMMs read them. The result
    is the running maximum over the batches: a checkpoint's ``input_global_scale`` maps it to the largest
    FP4 value, and larger activations in serving saturate.
    """
    model = getattr(model, "_orig_mod", model)
    sites = export_sites(backend)
    amax: dict[str, torch.Tensor] = {}

    def record(name):
        def hook(module, args):
            x = args[0]
            dtype = autocast_dtype(x.device.type)
            if dtype is not None and x.is_floating_point():
                x = x.to(dtype)
            value = x.detach().abs().amax().float() if x.numel() else torch.zeros(())
            # One running max per site, on the device: no host sync per batch.
            amax[name] = torch.maximum(amax[name], value) if name in amax else value
        return hook

    run = forward or _call
    n = 0
    with served(model, backend, "NVFP4A16") as m:
        hooks = [_module_of(m, s).register_forward_pre_hook(record(s.name)) for s in sites]
        try:
            for batch in batches:
                run(m, batch)
                n += 1
        finally:
            for h in hooks:
                h.remove()
    if n == 0:
        raise ValueError("calibrate got no batches")
    missing = [s.name for s in sites if s.name not in amax]
    if missing:
        raise ValueError(f"calibrate: the batches never reached FP4 sites {missing[:5]}")
    return {k: v.cpu() for k, v in amax.items()}


def _call(model, batch):
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)
