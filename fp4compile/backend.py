"""The ``nvfp4`` torch.compile backend.

``torch.compile(model, backend="nvfp4")`` (or ``backend=fp4compile.Backend(...)``) captures the model with
dynamo, runs the dynamo-level passes (GEMM sites, blocks, precision, marking), traces forward and
backward with aot_autograd, runs the aot-level passes on both graphs (RHT, quantize, lowering to FP4
GEMMs) and hands the result to the inner compiler (Inductor, or eager for debugging).

Before compiling, the backend checks the GEMM operands' dtypes the way eager PyTorch does (an FP4
GEMM would otherwise accept an int or mismatched input silently) and places the graph in the model:
when dynamo compiles a frame inside the model (a graph break in a block makes dynamo run the model's
loop eagerly and compile each block's forward on its own), GEMM sites are named by their path in the
compiled model and numbered among all of its blocks, and each block instance that reuses the compiled
frame runs its own compilation (see ``_ModelScope``).

From ``torch.compile`` to the first pass, on one screen:

    torch.compile(model, backend="nvfp4", options=..., mode=...)
      -> nvfp4_backend(gm, example_inputs)      the entry point registered for "nvfp4"
      -> get_backend(options, mode)              one shared Backend per (options, mode)
      -> Backend.__call__(gm, example_inputs)   dtype checks; where the graph sits in the model (_ModelScope)
      -> _SwitchableGraph                       what dynamo calls; one compilation per (block instance,
                                                high precision), made on first use (_compiled)
      -> Backend._compile                       a CompileContext; the dynamo passes (pipeline.run_passes)
      -> _compile_inductor / _compile_eager      aot_autograd: the joint pass, then the forward and backward
                                                passes, then Inductor (or eager) on the result

``backend=fp4compile.Backend(...)`` enters at ``Backend.__call__``. The passes and their order are in
``passes/pipeline.py`` (names in ``fp4compile.pass_order``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import warnings
import weakref
from typing import Optional, Sequence

import torch
import torch.fx as fx

from fp4compile import config, grad_buffers, hf_experts, runtime
from fp4compile.diagnostics import PlanWarning
from fp4compile.quant_stats import QuantStats
from fp4compile.ranges import ActivationRanges
from fp4compile.passes import pipeline
from fp4compile.model_structure import ModelStructure, find_root
from fp4compile.operand_dtypes import check_gemm_dtypes
from fp4compile.passes.find_blocks import block_paths, model_positions
from fp4compile.recipe import HIGH, Recipe
from fp4compile.report import Report
from fp4compile.sites import CompileContext, clone_dynamo_module
from fp4compile.vocabulary import SWITCHED, module_path, parameter_name, regions

log = logging.getLogger("fp4compile")


INNER_COMPILERS = ("inductor", "eager")
# What a copy of a Backend starts afresh: graph numbers, the root models' structures (weakly held, and
# derived from the models) and the passes over the compiled graphs.
_RUN_STATE = ("_graph_ids", "_structures", "_roots", "_round", "_called", "_checked_coverage")


class Backend:
    """A configured nvfp4 backend: ``torch.compile(model, backend=Backend(recipe=Recipe(...)))``.

    recipe: the ``Recipe`` (default: the published NVFP4 recipe).
    passes: user precision passes ``fn(gm, ctx) -> gm`` run after ``assign_precision``.
    inner: "inductor" (default) or "eager" — what compiles the rewritten graphs.
    print_ir_after: pass names (or "all") whose output graph is printed while compiling.
    mode: an Inductor mode, as ``torch.compile(mode=...)``: "reduce-overhead" records each compiled
    graph in a CUDA graph and replays it, which removes the per-kernel launch cost that bounds small
    and mid-sized models in emulation. Stochastic rounding stays fresh on every replay (the SR stream's
    step lives on the device, see ``fp4compile.runtime``). ``Recipe(check_finite=True)`` reads values
    back to the host and so runs without CUDA graphs (logged).
    unused_grad_buffers: give an output that a loss in the same graph is computed from (the logits
    returned beside the loss) a buffer for its gradient, so that an unused gradient reaches the recorded
    backward graph without a copy (``fp4compile.grad_buffers``). None (default): where the graphs are
    recorded in CUDA graphs.
    model: the root model, where blocks are compiled one by one (``model.layers[i] = torch.compile(block,
    backend=backend)``): GEMM sites are named by their weight's path in it and numbered among all of its
    blocks. Compiling the whole model (``torch.compile(model)``, ``model.compile()``) needs nothing here,
    and a block compiled on its own is placed in the module whose ``forward`` calls it; without either,
    a compiled module with no repeated blocks of its own gets a warning saying so.
    total_blocks: how many blocks the whole model has, where the compiled model holds part of them (a
    pipeline stage keeps the layer keys of the whole model: ``layers.4`` ... ``layers.7`` of 8): its blocks
    are placed by their keys among that many, so the recipe's first and last blocks are the whole
    model's. Without it, blocks keyed from a number other than 0 are planned as blocks of a model of
    (largest key + 1) blocks, with a warning.
    The backend keeps a ``report`` of its compilations (sites, precisions, kernels, graphs), and in
    ``ranges`` the activation amaxes its training forwards recorded (``fp4compile.ranges``).
    ``fp4compile.config.check_finite`` (``FP4COMPILE_CHECK_FINITE=1``), as it is when the backend is made,
    turns on ``Recipe.check_finite``.
    """

    def __init__(
        self,
        recipe: Optional[Recipe] = None,
        passes: Sequence = (),
        inner: str = "inductor",
        print_ir_after=None,
        mode: Optional[str] = None,
        unused_grad_buffers: Optional[bool] = None,
        model: Optional[torch.nn.Module] = None,
        total_blocks: Optional[int] = None,
        **recipe_fields,
    ):
        if inner not in INNER_COMPILERS:
            raise ValueError(f"inner must be one of {INNER_COMPILERS}, got {inner!r}")
        if mode not in (None, "default") and inner != "inductor":
            raise ValueError(f"mode={mode!r} is an Inductor mode; it needs inner='inductor', got inner={inner!r}")
        if recipe is not None and not isinstance(recipe, Recipe):
            raise TypeError(
                f"Backend(recipe=...) takes a fp4compile.Recipe, got {type(recipe).__name__} {recipe!r}; "
                "the format is a Recipe field: Backend(fmt='nvfp4') or Backend(recipe=Recipe(fmt='nvfp4'))"
            )
        recipe = recipe or Recipe()
        recipe = recipe.replace(**recipe_fields) if recipe_fields else recipe
        hf_experts.install()  # Hugging Face experts written as an eager loop: traced in grouped form
        if config.check_finite:
            recipe = recipe.replace(check_finite=True)
        self.recipe = recipe
        self.passes = list(passes)
        for p in self.passes:
            if not callable(p):
                raise TypeError(f"user passes must be callables fn(gm, ctx) -> gm, got {p!r}")
        self.inner = inner
        self.mode = mode
        try:
            pipeline.check_pass_selection(print_ir_after, self.passes)
        except ValueError as err:
            raise ValueError(f"Backend(print_ir_after={print_ir_after!r}): {err}") from None
        self.print_ir_after = print_ir_after
        self.unused_grad_buffers = unused_grad_buffers
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"Backend(model=...) takes the root nn.Module, got {type(model).__name__}")
        self.model = model
        if total_blocks is not None and (not isinstance(total_blocks, int) or total_blocks < 1):
            raise ValueError(f"Backend(total_blocks=...) takes the whole model's number of blocks, got {total_blocks!r}")
        self.total_blocks = total_blocks
        if model is not None:
            # Where no graph ever reaches the backend (every block's GEMMs run outside dynamo's graphs),
            # the end of the model's first forward is where that can be said.
            model.register_forward_hook(_CoverageHook(self))
        self._structures: dict[int, ModelStructure] = {}  # id(module) -> its structure (weakly held)
        self._roots: dict[int, ModelStructure] = {}  # those of the root models of compiled graphs
        self._warned: set[str] = set()
        self._round: set = set()  # graphs run since the SR stream last advanced (``_advance_for``)
        # The pass over the graphs that ``_round`` holds is over once the backward of its first graph ran
        # (``_end_pass_after_backward``) or the SR stream was set since it began (``runtime.resets``).
        self._passes, self._passes_ended, self._pass_resets = 0, 0, runtime.resets()
        self._checked_coverage = False
        self._called: set = set()  # graphs called with gradients enabled (``_check_coverage`` after one pass)
        self.report = Report(self.recipe)
        self.ranges = ActivationRanges()
        # Quantization statistics (``collect_stats``): the passes left to record, whether the current pass
        # records, and which ``collect_stats`` call the recording graphs were compiled for.
        self.quant_stats: Optional[QuantStats] = None
        self._stats_left, self._collecting, self._stats_generation = 0, False, 0
        self._step = 0
        self._forced_high_precision = False
        self._graph_ids = itertools.count()  # graph numbers in this backend's report: 0, 1, ...
        self.inductor_config: dict = {}
        if mode not in (None, "default"):
            from torch._inductor import list_mode_options

            self.inductor_config = dict(list_mode_options(mode))

    def __repr__(self) -> str:
        return f"fp4compile.Backend(fmt={self.recipe.fmt!r}, inner={self.inner!r})"

    def __getstate__(self) -> dict:
        """What ``copy.deepcopy`` and ``pickle`` keep: the settings (recipe, passes, inner compiler, mode,
        options) and the step; the report comes without its compilations (``Report.__getstate__``). A
        copy compiles its own graphs (an EMA copy of a compiled model gets a backend of its own)."""
        return {k: v for k, v in self.__dict__.items() if k not in _RUN_STATE}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._graph_ids = itertools.count()
        self._structures, self._roots, self._round, self._called = {}, {}, set(), set()
        self._checked_coverage = False

    # -- training-time controls ----------------------------------------------------------------

    def step(self, n: int = 1) -> int:
        """Count optimizer steps (drives ``Recipe.switch_to_high_precision_at``); returns the step."""
        self._step += n
        return self._step

    @property
    def high_precision(self) -> bool:
        """True once every GEMM runs in high precision (``switch_to_high_precision`` or the schedule)."""
        at = self.recipe.switch_to_high_precision_at
        return self._forced_high_precision or (at is not None and self._step >= at)

    def switch_to_high_precision(self) -> None:
        """Run all GEMMs in high precision from the next call on (each graph recompiles once)."""
        self._forced_high_precision = True

    def collect_stats(self, steps: int) -> QuantStats:
        """Record quantization statistics (``fp4compile.quant_stats``) in the next ``steps`` training passes
        over the model (each forward with gradients enabled that begins a pass, and its backward: a step,
        or a micro-batch under gradient accumulation): for every FP4 linear, role and operand, the
        fraction of nonzero inputs quantized to zero, of blocks whose E4M3 scale saturates or underflows,
        the relative error and the amax, computed in the graphs on the device. ``report.stats()`` reads
        them. Each graph is compiled once more for the recording and, after the last recorded pass, once
        more without it: the graphs that run when recording is off hold no statistics node. A new call
        starts a new recording (new buffers)."""
        self.quant_stats = QuantStats(steps)
        self.report.quant_stats = self.quant_stats
        self._stats_left = steps
        self._stats_generation += 1
        return self.quant_stats

    @property
    def collecting_stats(self) -> bool:
        """Whether the current training pass records quantization statistics (``collect_stats``)."""
        return self._collecting and not self.high_precision

    def state_dict(self) -> dict:
        """What a checkpoint needs to resume identically: the step, the SR stream and the recorded
        activation ranges (for export, ``ActivationRanges.state_lists``). Numbers, strings and lists only,
        with the same keys before the first compile as after: ``torch.save`` stores it as it is, and
        ``torch.distributed.checkpoint`` loads it into a fresh backend, which is a ``Stateful`` there
        (``dcp.load({"backend": backend, ...})``), as model and optimizer state are."""
        return {"step": self._step, "forced_high_precision": self._forced_high_precision, "sr": runtime.get_rng_state(),
                "activation_ranges": self.ranges.state_lists()}

    def load_state_dict(self, state: dict) -> None:
        self._step = int(state["step"])
        self._forced_high_precision = bool(state["forced_high_precision"])
        runtime.set_rng_state(state["sr"])
        self.ranges.load_state_dict(state.get("activation_ranges"))

    def _advance_for(self, graph, quantizes: Optional[bool] = True, device=None) -> bool:
        """Advance the stochastic-rounding stream once per pass over the model's compiled graphs with FP4
        GEMMs (``quantizes``: True; False for a graph whose GEMM sites are all high, which only marks the
        first pass's end; None for a graph without GEMM sites): when such a graph runs again (the next
        step, or the next micro-batch), not at each graph of one pass; ``device``: whose torch generator
        the new base is drawn from (``runtime.advance``). So a
        model compiled whole, block by block or split by graph breaks draws the same bits (every site's
        quantizers mix in a constant of their own), and each pass draws fresh ones.

        A graph that has not run in this pass starts the next one where this pass is over: the backward
        of its first graph ran, or the stream was set since (``fp4compile.manual_seed``,
        ``load_state_dict``). So the first step of another run with this backend (a new model, or the
        graphs recompiled after ``torch._dynamo.reset()``) draws from torch's generator as it is seeded
        then, as a fresh backend does. Returns whether a pass began."""
        if quantizes is not None and graph in self._called and not self._checked_coverage:  # a second pass
            self._checked_coverage = True
            self._check_coverage()
        if quantizes is not None:
            self._called.add(graph)
        if not quantizes:
            return False
        over = self._passes_ended == self._passes or self._pass_resets != runtime.resets()
        begins = not self._round or graph in self._round or over
        if begins:
            self._collecting = self._stats_left > 0
            self._stats_left -= self._collecting
            runtime.advance(device or torch.device("cpu"), counted=self.recipe.seed is not None)
            self._round = set()
            self._passes += 1
            self._pass_resets = runtime.resets()
        self._round.add(graph)
        return begins

    def _end_pass_after_backward(self, outputs) -> None:
        """End the current pass when the backward reaches ``outputs`` (those of its first graph): autograd
        runs the hook before that graph's backward."""
        number, backend = self._passes, weakref.ref(self)

        def ended(grad_outputs) -> None:
            this = backend()
            if this is not None:
                this._passes_ended = max(this._passes_ended, number)

        nodes = {id(t.grad_fn): t.grad_fn for t in (outputs if isinstance(outputs, (list, tuple)) else (outputs,))
                 if isinstance(t, torch.Tensor) and t.grad_fn is not None}
        for node in nodes.values():
            node.register_prehook(ended)

    def _check_coverage(self) -> None:
        """After the first pass over the model: warn about GEMM weights of its middle blocks that no compiled
        graph reads (dynamo ran the code using them eagerly: they run in high precision)."""
        seen = {s.name.split("#", 1)[0] for s in self.report.sites}
        for structure in self._roots.values():
            blocks = _blocks(structure)
            placed = model_positions(blocks, self.total_blocks)
            first, last = self.recipe.high_precision_block_counts(placed.n_blocks)
            middle = [b for b in blocks if first <= placed.positions[b] < placed.n_blocks - last]
            missing = [w for w in structure.gemm_weights
                       if w not in seen and any(w.startswith(b + ".") for b in middle)]
            if missing:
                self._warn(
                    f"{len(missing)} GEMM weights of {structure.root_class}'s blocks are in no compiled graph "
                    f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): dynamo ran the code that "
                    "uses them in eager PyTorch (TORCH_LOGS=graph_breaks says why), so they run in high "
                    "precision. Checkpointed blocks that change state outside themselves (Hugging Face models) "
                    "compile with torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True"
                )

    def configure(self, mode: Optional[str] = None, options: Optional[dict] = None) -> None:
        """Apply ``torch.compile``'s ``mode`` and ``options`` (the keys ``backend="nvfp4"`` takes) to this
        backend, as the string form builds its backend from them. A value that differs from one this
        backend already has (given to ``Backend(...)`` or by an earlier ``torch.compile``) is an error,
        and so is any change once the backend has compiled a graph."""
        recipe_options, settings = _split_options(options)
        if mode is not None:
            settings["mode"] = mode
        if "recipe" in recipe_options:
            recipe_options = {**dataclasses.asdict(recipe_options.pop("recipe")), **recipe_options}
        current = {name: getattr(self, name) for name in _SETTING_DEFAULTS}
        current["passes"] = tuple(self.passes)
        settings = {k: tuple(v) if k == "passes" else v for k, v in settings.items()}
        default_recipe = Recipe()
        conflicts = [
            f"{name}={value!r} (the Backend has {current[name]!r})"
            for name, value in settings.items()
            if value != current[name] and current[name] not in (_SETTING_DEFAULTS[name], "default")
        ] + [
            f"{name}={value!r} (the Backend's recipe has {getattr(self.recipe, name)!r})"
            for name, value in recipe_options.items()
            if value != getattr(self.recipe, name) and getattr(self.recipe, name) != getattr(default_recipe, name)
        ]
        if conflicts:
            raise ValueError(f"torch.compile's mode/options conflict with the fp4compile.Backend's own settings: {'; '.join(conflicts)}")
        merged = {**current, **settings}
        wanted = Backend(recipe=self.recipe.replace(**recipe_options), **merged)  # validates as Backend(...) does
        if merged == current and wanted.recipe == self.recipe:
            return
        if self.report.contexts:
            raise ValueError(
                "torch.compile's mode/options would change an fp4compile.Backend that has already compiled "
                "graphs with other settings; give that compilation a Backend of its own"
            )
        for name in ("recipe", "passes", "inner", "mode", "print_ir_after", "unused_grad_buffers", "inductor_config",
                     "total_blocks"):
            setattr(self, name, getattr(wanted, name))
        self.report = Report(self.recipe)
        self.report.quant_stats = self.quant_stats

    # -- compilation ---------------------------------------------------------------------------

    def __call__(self, gm: fx.GraphModule, example_inputs, mode: Optional[str] = None, options: Optional[dict] = None):
        if mode is not None or options:  # torch.compile(model, backend=Backend(...), mode=..., options=...)
            self.configure(mode, options)
        hf_experts.install()  # from the next trace on, where transformers was imported after the backend was made
        check_gemm_dtypes(gm)
        original = clone_dynamo_module(gm)
        scope = _ModelScope.find(gm, example_inputs, self)
        return _SwitchableGraph(self, original, example_inputs, scope)

    def _structure(self, params: list) -> Optional[ModelStructure]:
        """The structure of the root model holding ``params``: ``Backend(model=...)``, else found from the
        modules on the call stack (``model_structure.find_root``); None where neither holds them."""
        if self.model is not None:
            structure = self._structure_of(self.model)
            if structure.holds(params):
                self._roots[id(self.model)] = structure
                return structure
            self._warn(
                f"Backend(model={type(self.model).__name__}) does not hold the parameters of a compiled graph; "
                "naming its GEMMs from the module that is compiled instead"
            )
        root = find_root(params, self._in_a_block)
        if root is None:
            return None
        structure = self._roots[id(root)] = self._structure_of(root)
        return structure

    def _structure_of(self, module: torch.nn.Module) -> ModelStructure:
        structure = self._structures.get(id(module))
        if structure is None or structure.root() is not module:
            structure = self._structures[id(module)] = ModelStructure(module)
        return structure

    def _in_a_block(self, model: torch.nn.Module, path: str) -> bool:
        """Whether the module at ``path`` of ``model`` is one of its blocks or inside one (``find_blocks``'s
        rules on the model's structure, every list taken as a stack)."""
        return any(path == b or path.startswith(b + ".") for b in _blocks(self._structure_of(model)))

    def _warn(self, message: str, key: Optional[str] = None) -> None:
        """Warn once per backend and ``key`` (``PlanWarning``) and keep the line for the report."""
        key = key or message
        if key in self._warned:
            return
        self._warned.add(key)
        self.report.warnings.append(message)
        warnings.warn(f"fp4compile: {message}", PlanWarning, stacklevel=2)

    def _compile(
        self, gm: fx.GraphModule, example_inputs, graph_id: int, high_precision: bool = False, model=None,
        parameter_names=None, quant_stats: Optional[QuantStats] = None,
    ):
        config = self._inductor_config(graph_id) if self.inner == "inductor" else {}
        recipe = self._effective_recipe(config)
        ctx = CompileContext(recipe, graph_id, model, parameter_names)
        ctx.inner = self.inner
        ctx.cuda_graphs = self._records_graphs(config)
        ctx.shape_env = getattr(torch._guards.detect_fake_mode(example_inputs), "shape_env", None)
        ctx.total_blocks = self.total_blocks
        if recipe.amax_history and torch.is_grad_enabled():  # training graphs record activation ranges
            ctx.ranges = self.ranges
        ctx.quant_stats = quant_stats
        if high_precision:
            user_passes = [_all_high_precision]
        else:
            user_passes = self.passes
        gm = pipeline.run_passes(gm, ctx, pipeline.dynamo_pipeline(user_passes), "dynamo", self.print_ir_after)
        for key, message in ctx.warnings:
            self._warn(message, key)
        self.report.add_context(ctx)
        buffer_plan = self._grad_buffer_plan(gm, config, graph_id)
        ctx.grad_buffers = list(buffer_plan.names) if buffer_plan is not None else []

        def aot_passes(graph: fx.GraphModule, stage: str) -> fx.GraphModule:
            if stage == "backward" and not any(g.stage == "joint" for g in ctx.graphs):
                self._warn(
                    "the joint-graph pass did not run (Inductor's joint-graph passes are off: "
                    "torch._inductor.config.use_joint_graph_passes, or a mode that turns them off), so no "
                    "weight or activation amax is shared between the forward and the backward: each FP4 "
                    "GEMM quantizes its operands itself (the same bits, more reads)", key="no joint pass")
            return pipeline.run_passes(graph, ctx, pipeline.AOT_PASSES, stage, self.print_ir_after)

        def joint_passes(graph: fx.GraphModule) -> None:
            if any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.graph.nodes):
                pipeline.run_passes(graph, ctx, pipeline.JOINT_PASSES, "joint", self.print_ir_after)

        if self.inner == "inductor":
            compiled = _compile_inductor(gm, example_inputs, aot_passes, joint_passes, config)
        else:
            compiled = _compile_eager(gm, example_inputs, aot_passes, joint_passes)
        return grad_buffers.wrap(compiled, buffer_plan) if buffer_plan is not None else compiled

    def _records_graphs(self, inductor_config: dict) -> bool:
        """Whether Inductor records this compilation in CUDA graphs (this backend's mode, or else
        Inductor's global setting)."""
        return self.inner == "inductor" and grad_buffers.records_cuda_graphs(inductor_config)

    def _grad_buffer_plan(self, gm: fx.GraphModule, inductor_config: dict, graph_id: int):
        """Adds the unused-gradient buffers to ``gm`` where they apply; their plan, or None."""
        buffer_plan = grad_buffers.prepare(gm, self.unused_grad_buffers, self._records_graphs(inductor_config))
        if buffer_plan is not None:
            log.info(
                "fp4compile: graph %d: outputs read by the graph's own loss get a buffer for an unused gradient: %s",
                graph_id, ", ".join(buffer_plan.names),
            )
        return buffer_plan

    def _effective_recipe(self, inductor_config: dict) -> Recipe:
        """The recipe with its automatic choices made for this compilation: ``decoded_operands=None``
        becomes True where Inductor records the graphs in CUDA graphs, False otherwise."""
        if self.recipe.decoded_operands is not None:
            return self.recipe
        return self.recipe.replace(decoded_operands=self._records_graphs(inductor_config))

    def _inductor_config(self, graph_id: int, quiet: bool = False) -> dict:
        config = dict(self.inductor_config)
        if self.recipe.check_finite and config.get("triton.cudagraphs"):
            # The check reads each amax back to the host, which a CUDA graph cannot record.
            if not quiet:
                log.warning(
                    "fp4compile: graph %d: Recipe(check_finite=True) reads values back to the host on every "
                    "quantize; compiling without CUDA graphs", graph_id,
                )
            config["triton.cudagraphs"] = False
        return config

    def resolved_recipe(self) -> Recipe:
        """The recipe as this backend compiles with it, its automatic choices made (``decoded_operands``
        True or False, by whether the graphs are recorded in CUDA graphs): what a run should record."""
        return self._effective_recipe(self._inductor_config(0, quiet=True))


class _CoverageHook:
    """A forward hook on ``Backend(model=...)``'s model: after its first forward with gradients enabled,
    the backend checks that the GEMMs of the model's middle blocks ran in its graphs
    (``Backend._check_coverage``). A copy or a pickle of the model carries a hook that does nothing:
    the backend belongs to the model it was given."""

    def __init__(self, backend: "Backend"):
        self.backend = weakref.ref(backend)

    def __call__(self, module, args, output) -> None:
        backend = self.backend()
        if backend is None or backend._checked_coverage or torch.compiler.is_compiling() or not torch.is_grad_enabled():
            return
        if backend.model is module:
            backend._roots.setdefault(id(module), backend._structure_of(module))
            backend._checked_coverage = True
            backend._check_coverage()

    def __reduce__(self):
        return (_NoCoverageHook, ())


class _NoCoverageHook:
    def __call__(self, module, args, output) -> None:
        return None


def _blocks(structure: ModelStructure) -> list[str]:
    """The blocks ``find_blocks`` sees in a model's own structure, every list taken as a stack."""
    return block_paths(structure.gemm_weights, None, structure.classes) if structure.gemm_weights else []


def _all_high_precision(gm, ctx):
    for site in ctx.sites:
        site.set_precision(HIGH, SWITCHED)
    return gm


_all_high_precision.pass_name = "switch_to_high_precision"


@functools.lru_cache(maxsize=1)
def _code_version() -> bytes:
    """A hash of fp4compile's installed code: its modules, passes, code generators and kernel templates."""
    import hashlib
    import os
    from pathlib import Path

    import fp4compile.codegen
    import fp4compile.cutlass_templates
    import fp4compile.passes

    folders = {Path(m.__file__).resolve().parent for m in (
        fp4compile, fp4compile.passes, fp4compile.codegen, fp4compile.cutlass_templates)}
    files = sorted({f for d in folders for f in d.rglob("*") if f.suffix in (".py", ".j2", ".cu", ".cuh", ".cpp")})
    digest = hashlib.sha256(b"fp4compile")
    for f in files:
        digest.update(os.path.relpath(f, Path(fp4compile.__file__).resolve().parent).encode())
        digest.update(f.read_bytes())
    return digest.digest()


def _version_pass(user, own=None):
    """A custom pass fp4compile gives Inductor (its post-grad or joint-graph pre-pass): fp4compile's own
    pass ``own(graph)`` if any, then the user's passes of that setting (``user``, as Inductor's setting
    holds them: None, one pass or a list), run in order, under a ``uuid()`` that adds fp4compile's code
    version to theirs. Inductor's FX graph cache keys its entries on
    it, so a graph compiled by another version of fp4compile (whose ops, kernels or generated calls may
    differ) is compiled again rather than served from the cache. A user pass without a uuid makes the
    cache bypass the graph, as it would without fp4compile. One pass rather than a list, because not every
    supported PyTorch takes a list there."""
    from torch._inductor import custom_graph_pass as cgp

    passes = () if user is None else tuple(user) if isinstance(user, (list, tuple)) else (user,)
    aware = getattr(cgp, "CustomInferenceAwareGraphPass", None)

    class _CodeVersion(aware or cgp.CustomGraphPass):
        def __call__(self, graph, is_inference: bool = False) -> None:
            if own is not None:
                own(graph)
            for p in passes:
                if aware is not None and isinstance(p, aware):
                    p(graph, is_inference)
                else:
                    p(graph)

        def uuid(self):
            parts = [p.uuid() if isinstance(p, cgp.CustomGraphPass) else None for p in passes]
            if not all(parts):
                return None
            return repr((tuple(parts), _code_version())).encode()

    return _CodeVersion()


def _compile_inductor(gm, example_inputs, aot_passes, joint_passes, config_patches):
    """Inductor's compile of ``gm`` with fp4compile's passes run on the joint graph (Inductor's
    ``joint_custom_pre_pass``, before the user's own there) and on the forward and backward graphs.

    The passes run on every compile; Inductor's FX graph cache, keyed on the graphs they produce and on
    fp4compile's code version (``_version_pass``), serves the compiled code of a graph it has seen (a
    restarted job). AOTAutograd's own cache would skip the passes: it keys its entries on the dynamo
    graph, which holds neither the recipe nor what the passes make of each block instance (SR seeds,
    site names), so it is off for a graph that calls fp4compile anywhere (``_quantizes``). PyTorch
    bypasses it by itself only where such a call is at the graph's top level, not inside a region,
    where it would serve one checkpoint-wrapped block's compiled graphs to another block compiled from
    the same frame, and the graphs compiled under one recipe to a run with another."""
    import torch._functorch.config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner_compile(graph, inputs, **kwargs):
        stage = "backward" if kwargs.get("is_backward") else "forward"
        return compile_fx_inner(aot_passes(graph, stage), inputs, **kwargs)

    user = config_patches.get("post_grad_custom_pre_pass", inductor_config.post_grad_custom_pre_pass)
    user_joint = config_patches.get("joint_custom_pre_pass", inductor_config.joint_custom_pre_pass)
    patches = {**config_patches, "post_grad_custom_pre_pass": _version_pass(user),
               "joint_custom_pre_pass": _version_pass(user_joint, lambda graph: joint_passes(graph.owning_module))}
    no_aot_cache = {name: False for name in ("enable_autograd_cache", "enable_remote_autograd_cache")
                    if hasattr(functorch_config, name)} if _quantizes(gm) else {}
    with functorch_config.patch(no_aot_cache):
        return compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=patches)


def _quantizes(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` or one of its regions calls what the marking passes put in a dynamo graph
    (``fp4_linear``, ``fp4_matmul``, the grouped GEMMs) or an ``fp4`` op."""
    for graph in (gm, *(body for _, body in regions(gm))):
        for node in graph.graph.nodes:
            if node.op != "call_function":
                continue
            if isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "fp4":
                return True
            if (getattr(node.target, "__module__", None) or "").partition(".")[0] == "fp4compile":
                return True
    return False


def _compile_eager(gm, example_inputs, aot_passes, joint_passes):
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import default_partition

    def partition(joint, joint_inputs, **kwargs):
        joint_passes(joint)
        return default_partition(joint, joint_inputs, **kwargs)

    def compiler(stage):
        def compile_graph(graph, inputs):
            return make_boxed_func(aot_passes(graph, stage).forward)

        return compile_graph

    return aot_module_simplified(
        gm, example_inputs, fw_compiler=compiler("forward"), bw_compiler=compiler("backward"), partition_fn=partition
    )


class _SwitchableGraph:
    """The callable dynamo runs: the FP4 compilation, or after the switch the high-precision one.

    Each pass over the model's graphs with gradients enabled advances the stochastic-rounding stream
    (``Backend._advance_for``), so every step's backward draws fresh bits and a rerun from the same state
    draws the same ones. Compilations are
    cached by (model scope, high precision, statistics): the switch to high precision recompiles each
    graph once, and a frame compiled inside the model compiles once per block instance that runs it.
    While the backend collects quantization statistics (``Backend.collect_stats``) a training pass runs
    the graphs compiled to record them (keyed by the ``collect_stats`` call); once it is over, the graphs
    compiled without them (their recording versions are dropped), so statistics cost nothing when off.
    """

    def __init__(self, backend: Backend, original: fx.GraphModule, example_inputs, scope: Optional["_ModelScope"]):
        self.backend = backend
        self.original = original
        self.example_inputs = example_inputs
        self.scope = scope
        # Later compilations (high precision, other block instances) run outside dynamo's compile
        # step; they reuse its tracing context so that they trace with the same (symbolic) shapes.
        self.tracing_context = torch._guards.TracingContext.try_get()
        # The SR base of each GPU the graph runs on exists before any CUDA graph is recorded.
        gpus = {t.device for t in example_inputs if isinstance(t, torch.Tensor) and t.is_cuda}
        for device in gpus:
            runtime.device_base(device)
        # Whose torch generator stochastic rounding draws from, as dropout in this graph would.
        self.device = min(gpus, key=str) if gpus else torch.device("cpu")
        # A model built on the meta device computes no values: its passes draw no SR bits.
        self.on_meta = any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in example_inputs)
        self.compiled: dict = {}
        self.graph_ids: dict[str, int] = {}  # one graph id per block instance; recompiles keep it
        # Whether each instance quantizes anything: graphs without FP4 GEMMs draw no SR bits and do not
        # mark the passes over the model (a frame of the model's loop runs once per block).
        self.rounds: dict[str, Optional[bool]] = {}
        prefix = scope.prefix if scope is not None else ""
        # Compiled as the first call will most likely run it: recording statistics where they are asked for.
        recording = torch.is_grad_enabled() and (backend._collecting or backend._stats_left > 0)
        self._compiled(prefix, False, example_inputs, recording and not backend.high_precision)

    def _compiled(self, prefix: str, high_precision: bool, args, recording: bool = False):
        stats = self.backend._stats_generation if recording else None
        key = (prefix, high_precision, stats)
        if stats is None:
            for old in [k for k in self.compiled if k[0] == prefix and k[2] is not None]:
                del self.compiled[old]  # the recording versions, once recording is over
        if key not in self.compiled:
            if prefix not in self.graph_ids:
                self.graph_ids[prefix] = next(self.backend._graph_ids)
            graph_id = self.graph_ids[prefix]
            gm = clone_dynamo_module(self.original)  # shares the parameters
            model, names = None, None
            if self.scope is not None:
                self.scope.rebase(gm, prefix)
                model, names = self.scope.structure, self.scope.parameter_names(args)
            if high_precision:
                log.info("fp4compile: graph %d: recompiling in high precision", graph_id)
            elif recording or any(k[0] == prefix for k in self.compiled):
                log.info("fp4compile: graph %d: compiling %s quantization statistics", graph_id,
                         "to record" if recording else "without")
            with torch._guards.tracing(self.tracing_context):
                self.compiled[key] = self.backend._compile(
                    gm, self.example_inputs, graph_id, high_precision, model, names,
                    self.backend.quant_stats if recording else None,
                )
            sites = self.backend.report.contexts[-1].sites
            self.rounds[prefix] = any(s.is_low_precision for s in sites) if sites else None
        return self.compiled[key]

    def __call__(self, *args):
        prefix = self.scope.prefix_of(args) if self.scope is not None else ""
        begins = False
        if torch.is_grad_enabled() and not self.on_meta:
            begins = self.backend._advance_for((id(self), prefix), self.rounds.get(prefix, True), self.device)
        runtime.set_backend_step(self.backend._step)
        recording = torch.is_grad_enabled() and not self.on_meta and self.backend.collecting_stats
        outputs = self._compiled(prefix, self.backend.high_precision, args, recording)(*args)
        if begins:
            self.backend._end_pass_after_backward(outputs)
        return outputs


class _ModelScope:
    """Where a compiled graph sits in its root model (``model_structure``).

    The graph's parameters are named by their identity in the root model, however the graph reaches
    them. A frame compiled inside the model (a block compiled on its own, or a block's ``forward`` that a
    graph break makes dynamo compile separately) has module paths that start at the block (``mlp.fc``),
    and dynamo reuses its compiled code for every block of the same class: the scope tells from the
    parameters a call receives which block instance runs (its ``prefix``, ``blocks.3.``), so that each
    instance gets its own precision plan and SR streams, and rewrites the module paths of the graph's
    metadata to start at the root.
    """

    def __init__(self, structure: ModelStructure, params: list):
        self.structure = structure
        self.params = params  # [(argument position, placeholder name, path relative to the frame's module)]
        self.prefix = ""  # the instance that was compiled first
        self._prefixes: dict[int, tuple] = {}  # id(parameter) -> (weakref to it, prefix)

    @classmethod
    def find(cls, gm: fx.GraphModule, example_inputs, backend: "Backend") -> Optional["_ModelScope"]:
        params = []
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for position, (node, value) in enumerate(zip(placeholders, example_inputs)):
            if isinstance(value, torch.nn.Parameter):
                params.append((position, node.name, parameter_name(node, gm) or "", value))
        if not params:
            return None
        structure = backend._structure([p for *_, p in params])
        if structure is None:
            return None
        scope = cls(structure, [(position, name, relative) for position, name, relative, _ in params])
        scope.prefix = scope._prefix(example_inputs[params[0][0]], params[0][2]) or ""
        return scope

    def _prefix(self, param, relative: str) -> Optional[str]:
        full = self.structure.name_of(param)
        if full is None or not (full == relative or full.endswith("." + relative)):
            return None
        return full[: len(full) - len(relative)]

    def prefix_of(self, args) -> str:
        """The module path prefix (``blocks.3.``) of the block instance whose parameters ``args`` holds."""
        position, _, relative = self.params[0]
        param = args[position]
        cached = self._prefixes.get(id(param))
        if cached is not None and cached[0]() is param:
            return cached[1]
        prefix = self._prefix(param, relative)
        prefix = self.prefix if prefix is None else prefix
        self._prefixes[id(param)] = (weakref.ref(param), prefix)
        return prefix

    def parameter_names(self, args) -> dict[str, tuple]:
        """{placeholder name: the parameter's qualified names in the root} for the instance ``args`` holds."""
        names = {}
        for position, placeholder, _ in self.params:
            param = args[position]
            if self.structure.name_of(param) is not None:  # indexes the root again if it changed
                names[placeholder] = tuple(self.structure.names[id(param)])
        return names

    def rebase(self, gm: fx.GraphModule, prefix: str) -> None:
        """Make the module paths of ``gm`` (a clone) start at the root model: ``prefix`` + path."""
        if not prefix:
            return
        root = self.structure.root()
        parts = prefix.rstrip(".").split(".")
        ancestors = {}
        qualified = "L['self']"
        module = root
        for i, part in enumerate(parts):
            qualified += f"._modules['{part}']"
            module = module.get_submodule(part) if module is not None else None
            ancestors[f"fp4_scope_{i}"] = (qualified, type(module) if module is not None else torch.nn.Module)
        for graph in (gm, *(body for _, body in regions(gm))):
            for node in graph.graph.nodes:
                stack = node.meta.get("nn_module_stack")
                if not stack:
                    continue
                rebased = dict(ancestors)
                for key, (path, cls) in stack.items():
                    relative = module_path(path)
                    rebased[key] = (qualified + "".join(f"._modules['{p}']" for p in relative.split(".") if p), cls)
                node.meta["nn_module_stack"] = rebased


_backends: dict[str, Backend] = {}


def get_backend(options: Optional[dict] = None, mode: Optional[str] = None) -> Backend:
    """The shared ``Backend`` that ``torch.compile(backend="nvfp4", options=options, mode=mode)`` uses.

    All graphs compiled with the same options share one Backend, hence one report and one step count.
    """
    key = repr((sorted((options or {}).items()), mode))
    if key not in _backends:
        recipe_options, backend_args = _split_options(options)
        _backends[key] = Backend(recipe=Recipe.from_options(recipe_options), mode=mode, **backend_args)
    return _backends[key]


# Backend settings that torch.compile's options may hold besides Recipe fields, with Backend's defaults.
_SETTING_DEFAULTS = {"inner": "inductor", "passes": (), "print_ir_after": None, "unused_grad_buffers": None, "mode": None,
                     "total_blocks": None}


def _split_options(options: Optional[dict]) -> tuple[dict, dict]:
    """torch.compile's options as (Recipe fields or "recipe", Backend settings); unknown keys are an error."""
    options = dict(options or {})
    settings = {k: options.pop(k) for k in _SETTING_DEFAULTS if k != "mode" and k in options}
    Recipe.from_options(options)  # names an unknown key or a bad value now
    return options, settings


def nvfp4_backend(gm: fx.GraphModule, example_inputs, options: Optional[dict] = None, mode: Optional[str] = None):
    """The function registered as ``backend="nvfp4"``; ``options`` are Recipe fields (or "recipe"),
    plus "inner", "passes" and "print_ir_after"."""
    return get_backend(options, mode)(gm, example_inputs)
