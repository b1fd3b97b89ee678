"""The ``nvfp4`` torch.compile backend.

``torch.compile(model, backend="nvfp4")`` (or ``backend=fp4compile.Backend(...)``) captures the model with
dynamo, runs the dynamo-level passes (GEMM sites, blocks, precision, marking), traces forward and
backward with aot_autograd, runs the aot-level passes on both graphs (RHT, quantize, lowering to FP4
GEMMs) and hands the result to the inner compiler (Inductor, or eager for debugging).
"""

from __future__ import annotations

import itertools
import logging
from typing import Optional, Sequence

import torch
import torch.fx as fx

from fp4compile import runtime
from fp4compile.passes import pipeline
from fp4compile.recipe import HIGH, Recipe
from fp4compile.report import Report
from fp4compile.sites import CompileContext

log = logging.getLogger("fp4compile")

INNER_COMPILERS = ("inductor", "eager")
_graph_ids = itertools.count()


def _clone_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A structural copy of ``gm`` sharing its parameters (metadata copied shallowly)."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph)


class Backend:
    """A configured nvfp4 backend: ``torch.compile(model, backend=Backend(recipe=Recipe(...)))``.

    recipe: the ``Recipe`` (default: the published NVFP4 recipe).
    passes: user precision passes ``fn(gm, ctx) -> gm`` run after ``assign_precision``.
    inner: "inductor" (default) or "eager" — what compiles the rewritten graphs.
    print_ir_after: pass names (or "all") whose output graph is printed while compiling.
    The backend keeps a ``report`` of its compilations (sites, precisions, kernels, graphs).
    """

    def __init__(
        self,
        recipe: Optional[Recipe] = None,
        passes: Sequence = (),
        inner: str = "inductor",
        print_ir_after=None,
        **recipe_fields,
    ):
        if inner not in INNER_COMPILERS:
            raise ValueError(f"inner must be one of {INNER_COMPILERS}, got {inner!r}")
        recipe = recipe or Recipe()
        self.recipe = recipe.replace(**recipe_fields) if recipe_fields else recipe
        self.passes = list(passes)
        for p in self.passes:
            if not callable(p):
                raise TypeError(f"user passes must be callables fn(gm, ctx) -> gm, got {p!r}")
        self.inner = inner
        self.print_ir_after = print_ir_after
        self.report = Report(self.recipe)
        self._step = 0
        self._forced_high_precision = False
        self.inductor_config: dict = {}

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

    def state_dict(self) -> dict:
        """What a checkpoint needs to resume identically: the step and the SR stream."""
        return {"step": self._step, "forced_high_precision": self._forced_high_precision, "sr": runtime.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        self._step = int(state["step"])
        self._forced_high_precision = bool(state["forced_high_precision"])
        runtime.set_rng_state(state["sr"])

    # -- compilation ---------------------------------------------------------------------------

    def __call__(self, gm: fx.GraphModule, example_inputs):
        graph_id = next(_graph_ids)
        original = _clone_graph_module(gm)
        compiled = self._compile(gm, example_inputs, graph_id)
        return _SwitchableGraph(self, compiled, original, example_inputs, graph_id)

    def _compile(self, gm: fx.GraphModule, example_inputs, graph_id: int, high_precision: bool = False):
        recipe = self.recipe
        ctx = CompileContext(recipe, graph_id, record=None)
        if high_precision:
            user_passes = [_all_high_precision]
        else:
            user_passes = self.passes
        gm = pipeline.run_passes(gm, ctx, pipeline.dynamo_pipeline(user_passes), "dynamo", self.print_ir_after)
        self.report.add_context(ctx)

        def aot_passes(graph: fx.GraphModule, stage: str) -> fx.GraphModule:
            return pipeline.run_passes(graph, ctx, pipeline.AOT_PASSES, stage, self.print_ir_after)

        if self.inner == "inductor":
            return _compile_inductor(gm, example_inputs, aot_passes, self.inductor_config)
        return _compile_eager(gm, example_inputs, aot_passes)


def _all_high_precision(gm, ctx):
    for site in ctx.sites:
        site.set_precision(HIGH, "switched to high precision")
    return gm


_all_high_precision.pass_name = "switch_to_high_precision"


def _compile_inductor(gm, example_inputs, aot_passes, config_patches):
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner_compile(graph, inputs, **kwargs):
        stage = "backward" if kwargs.get("is_backward") else "forward"
        graph = aot_passes(graph, stage)
        return compile_fx_inner(graph, inputs, **kwargs)

    return compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=config_patches or None)


def _compile_eager(gm, example_inputs, aot_passes):
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    def compiler(stage):
        def compile_graph(graph, inputs):
            return make_boxed_func(aot_passes(graph, stage).forward)

        return compile_graph

    return aot_module_simplified(
        gm, example_inputs, fw_compiler=compiler("forward"), bw_compiler=compiler("backward")
    )


class _SwitchableGraph:
    """The callable dynamo runs: the FP4 compilation, or after the switch the high-precision one.

    Each training call (grad enabled) advances the stochastic-rounding stream, so every step's
    backward draws fresh bits and a rerun from the same state draws the same ones.
    """

    def __init__(self, backend: Backend, compiled, original: fx.GraphModule, example_inputs, graph_id: int):
        self.backend = backend
        self.compiled = compiled
        self.original = original
        self.example_inputs = example_inputs
        self.graph_id = graph_id
        self.high_precision_compiled = None

    def __call__(self, *args):
        if torch.is_grad_enabled():
            runtime.advance()
        if self.backend.high_precision:
            if self.high_precision_compiled is None:
                log.info("fp4compile: graph %d: recompiling in high precision", self.graph_id)
                self.high_precision_compiled = self.backend._compile(
                    _clone_graph_module(self.original), self.example_inputs, self.graph_id, high_precision=True
                )
            return self.high_precision_compiled(*args)
        return self.compiled(*args)


_backends: dict[str, Backend] = {}


def get_backend(options: Optional[dict] = None, mode: Optional[str] = None) -> Backend:
    """The shared ``Backend`` that ``torch.compile(backend="nvfp4", options=options, mode=mode)`` uses.

    All graphs compiled with the same options share one Backend, hence one report and one step count.
    """
    key = repr((sorted((options or {}).items()), mode))
    if key not in _backends:
        options = dict(options or {})
        backend_args = {k: options.pop(k) for k in ("inner", "passes", "print_ir_after") if k in options}
        backend = Backend(recipe=Recipe.from_options(options), **backend_args)
        if mode not in (None, "default"):
            from torch._inductor import list_mode_options

            backend.inductor_config = dict(list_mode_options(mode))
        _backends[key] = backend
    return _backends[key]


def nvfp4_backend(gm: fx.GraphModule, example_inputs, options: Optional[dict] = None, mode: Optional[str] = None):
    """The function registered as ``backend="nvfp4"``; ``options`` are Recipe fields (or "recipe"),
    plus "inner", "passes" and "print_ir_after"."""
    backend = get_backend(options, mode)
    get_backend.last = backend
    return backend(gm, example_inputs)
