"""AOTAutograd's on-disk cache for graphs with FP4 linears: what keys an entry, what a hit restores.

PyTorch keeps AOTAutograd's output (the forward and backward graphs Inductor compiled) on disk, keyed
on the dynamo graph, the example inputs and the compiler configuration. It does not cache graphs that
call functions it does not know, such as ``fp4_linear``, because their behaviour is not in that key.
For fp4compile's graphs the behaviour of an ``fp4_linear`` call depends on more than the graph: the
recipe, each GEMM site's precision, block and name (the call holds only the site's index), the
sharded-amax rules, fp4compile's own code and settings, and the devices. This module folds all of
that into one digest and hands it to Inductor as the cache key of ``fp4_linear`` and ``fp4_matmul``
(``torch._inductor.config.unsafe_marked_cacheable_functions``), so that an entry is served only to a
compilation that would rewrite the graph the same way.

A warm start (a restarted job, the same model and settings, the caches of an earlier run) then skips
the joint trace, the partition, fp4compile's forward and backward passes and Inductor's compile.
What those passes would have logged is kept next to the entry (``Record``): the GEMMs kept in high
precision for a reason are logged again on a hit. The report's forward and backward graphs, which the
passes record, are rebuilt when the report is first read (``CompileContext.restore``).

``fp4compile.config.aot_cache = False`` (``FP4COMPILE_AOT_CACHE=0``) keeps fp4compile's graphs out of the
cache (each start traces and rewrites them again; Inductor's FX graph cache still serves the compiled
kernels). Graphs are also kept out while ``print_ir_after`` or ``config.print_ir_after`` names a
forward/backward pass: a hit would print nothing. On GPUs that run CUTLASS kernels (Blackwell) the
graphs are cached like any other: which configuration a GEMM names depends on the device's
architecture (in the key), its shape and the recipe only, never on whether a build finished (kernels
are built on first use or ahead of time, ``codegen.cutlass_runtime``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Optional

import torch

log = logging.getLogger("fp4compile")

# The functions of fp4compile that dynamo graphs call, by the name AOTAutograd's check gives them.
FUNCTIONS = ("fp4compile.ops.fp4_linear", "fp4compile.ops.fp4_matmul")
# fp4compile's settings that change how or where things are compiled or cached, never what the passes
# make of a graph: left out of the key, so that changing one still finds Inductor's FX graph cache (whose
# key holds this one). Every other setting of ``fp4compile.config`` is in the key.
RUNTIME_ONLY_SETTINGS = (
    "aot_cache", "cache_dir", "nvcc", "compile_gc_threshold", "precompile", "precompile_threads", "print_ir_after",
)
# Other environment variables the passes' choices depend on.
OTHER_ENV = ("TRITON_INTERPRET", "CUDA_HOME", "CUDA_PATH")


def enabled(print_ir_after=None, example_inputs=()) -> tuple[bool, str]:
    """(whether fp4compile's graphs, compiled for ``example_inputs``, go into AOTAutograd's cache, why not).
    ``example_inputs`` does not change the answer; it is taken for callers that pass it."""
    from fp4compile import config
    from fp4compile.passes import pipeline

    if not config.aot_cache:
        return False, "fp4compile.config.aot_cache is off (FP4COMPILE_AOT_CACHE=0)"
    if any(pipeline._print_after(print_ir_after, pipeline.pass_name(p)) for p in pipeline.AOT_PASSES):
        return False, "the passes print their graphs while compiling"
    return True, ""


@functools.lru_cache(maxsize=None)
def source_digest() -> str:
    """SHA-256 of fp4compile's installed sources (the package, its passes, code generators, templates)."""
    import fp4compile

    h = hashlib.sha256(fp4compile.__version__.encode())
    roots = [Path(fp4compile.__file__).parent]
    for sub in ("passes", "codegen", "cutlass_templates"):
        module = __import__(f"fp4compile.{sub}", fromlist=["_"])
        roots.extend(Path(p) for p in module.__path__)
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path.is_file() and path.suffix in (".py", ".cu", ".cuh", ".j2", ".cpp"):
                h.update(str(path.relative_to(root)).encode())
                h.update(path.read_bytes())
    return h.hexdigest()


def _devices(example_inputs) -> list:
    devices = sorted({str(t.device) for t in example_inputs if isinstance(t, torch.Tensor)})
    out = []
    for name in devices:
        device = torch.device(name)
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            out.append([name, props.name, list(torch.cuda.get_device_capability(device))])
        else:
            out.append([name])
    return out


def digest(ctx, example_inputs, grad_buffers=()) -> str:
    """The key of everything besides the dynamo graph that decides what fp4compile makes of it."""
    from fp4compile import config, distributed
    from fp4compile.codegen import triton_kernels
    from fp4compile.passes import pipeline

    state = {
        "source": source_digest(),
        "passes": [f"{getattr(p, '__module__', '')}.{getattr(p, '__qualname__', repr(p))}" for p in pipeline.AOT_PASSES],
        "torch": torch.__version__,
        "recipe": repr(ctx.recipe),
        "graph": ctx.graph_id,
        "sites": [repr(s) for s in ctx.sites],
        "blocks": [ctx.n_blocks, list(ctx.block_names)],
        "model": None if ctx.model is None else [ctx.model.gemm_weights, sorted(ctx.parameter_names.items())],
        "grad_buffers": list(grad_buffers),
        "sharded_amax": distributed.cache_state(ctx.sharded_amax),
        "settings": {name: getattr(config, name) for name in config.SETTINGS if name not in RUNTIME_ONLY_SETTINGS},
        "env": sorted((k, v) for k, v in os.environ.items() if k in OTHER_ENV),
        "devices": _devices(example_inputs),
        "triton": list(triton_kernels.available()),
    }
    return hashlib.sha256(json.dumps(state, sort_keys=True, default=repr).encode()).hexdigest()


def config_patches(key: str, config: dict) -> dict:
    """Inductor config patches ``config`` plus fp4compile's functions marked cacheable under ``key``."""
    from torch._inductor import config as inductor_config

    marked = dict(config.get("unsafe_marked_cacheable_functions", inductor_config.unsafe_marked_cacheable_functions))
    marked.update({name: key for name in FUNCTIONS})
    return dict(config, unsafe_marked_cacheable_functions=marked)


def runtime_state() -> dict:
    """The grad mode and each device's autocast dtype (None: off) now: with the example inputs, what
    tells AOTAutograd's entries for one graph apart (a training and an inference compile)."""
    return {
        "grad": torch.is_grad_enabled(),
        "autocast": {
            device: torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
            for device in torch._C._autocast_supported_devices()
        },
    }


def inputs_text(example_inputs) -> list:
    """Each example input as text: a tensor's dtype, shape, strides and device, anything else's repr."""
    return [
        [str(t.dtype), [str(d) for d in t.shape], [str(d) for d in t.stride()], str(t.device)]
        if isinstance(t, torch.Tensor) else repr(t)
        for t in example_inputs
    ]


class Record:
    """What the passes of one compilation logged, kept beside its cache entry: per stage ("forward",
    "backward"), the GEMMs kept in high precision for a reason (``CompileContext.fallback``).

    Stored as JSON under Inductor's cache directory, named by the key, the dynamo graph's code, its
    example inputs (dynamo's example values: sizes as symbolic as the graph's) and the grad and
    autocast modes, as AOTAutograd's entry is."""

    def __init__(self, key: str, code: str, example_inputs=()):
        state = json.dumps([key, code, inputs_text(example_inputs), runtime_state()], default=str)
        name = hashlib.sha256(state.encode()).hexdigest()[:40]
        self.path = Path(_cache_dir()) / "fp4compile_aot" / f"{name}.json"
        self._stages: dict = {}  # what this compilation's passes logged so far, by stage

    def load(self) -> Optional[dict]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def save(self, stage: str, fallbacks: list) -> None:
        self._stages[stage] = list(fallbacks)
        data = self._stages
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.replace(tmp, self.path)
        except OSError as exc:  # a read-only cache: the next hit rebuilds the graphs to log them
            log.info("fp4compile: could not keep the compile record %s: %s", self.path, exc)


def _cache_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()
