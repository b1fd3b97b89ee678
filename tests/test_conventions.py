"""The compiled model behaves like PyTorch: compile arguments, argument checking, seeding, copies,
empty inputs, float64 models, the CLI's errors, and a set-up that runs the same suite as CI.

Models are tiny and compiled with the eager inner compiler on the CPU unless a test says otherwise.
"""

from __future__ import annotations

import copy
import io
import re
import shlex
import tomllib
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch._dynamo.exc import BackendCompilerFailed

import fp4compile
from fp4compile import Backend, Recipe
from models import MLPStack, grads

ROOT = Path(__file__).resolve().parents[1]
D = 16

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _all_fp4(**kw) -> dict:
    """Backend settings with every GEMM in FP4 (no first/last blocks kept in high precision)."""
    return {"high_precision_first_blocks": 0, "high_precision_last_blocks": 0, "inner": "eager", **kw}


def _x(*shape, seed=1, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _stack() -> MLPStack:
    torch.manual_seed(0)
    return MLPStack(1, d=D)


def _grads_after_step(compiled, model, x):
    compiled(x).square().mean().backward()
    return grads(model)


# ---------------------------------------------------------------------------------------------
# Compile arguments: backend=Backend(...) takes what backend="nvfp4" takes
# ---------------------------------------------------------------------------------------------


def test_backend_instance_takes_options_like_the_string_form():
    options = {"stochastic_rounding": False, "rht": False}
    model = _stack()
    by_name = _grads_after_step(
        torch.compile(model, backend="nvfp4", options={**_all_fp4(), **options}), model, _x(4, D)
    )
    torch._dynamo.reset()
    model = _stack()
    backend = Backend()
    by_instance = _grads_after_step(
        torch.compile(model, backend=backend, options={**_all_fp4(), **options}), model, _x(4, D)
    )
    assert backend.recipe.rht is False and backend.inner == "eager"
    for name, g in by_name.items():
        assert torch.equal(g, by_instance[name]), name


def test_backend_instance_takes_mode_like_the_string_form():
    backend = Backend(high_precision_first_blocks=0, high_precision_last_blocks=0)
    torch.compile(nn.Linear(D, D), backend=backend, mode="reduce-overhead")(_x(2, D))
    # reduce-overhead records CUDA graphs, whose automatic choice is decoded operands (as for the string form)
    assert backend.resolved_recipe().decoded_operands is True
    assert fp4compile.get_backend({}, "reduce-overhead").resolved_recipe().decoded_operands is True


@pytest.mark.parametrize(
    "backend, kwargs, message",
    [
        (lambda: Backend(rht=False), {"options": {"rht": True}}, "rht=True"),
        (lambda: Backend(mode="max-autotune"), {"mode": "reduce-overhead"}, "mode='reduce-overhead'"),
        (lambda: Backend(inner="eager"), {"mode": "reduce-overhead"}, "needs inner='inductor'"),
        (lambda: Backend(inner="eager"), {"options": {"no_such_field": 1}}, "no_such_field"),
    ],
)
def test_compile_arguments_that_conflict_with_the_backend_are_an_error(backend, kwargs, message):
    with pytest.raises(BackendCompilerFailed, match=re.escape(message)):
        torch.compile(_stack(), backend=backend(), **kwargs)(_x(2, D))


def test_the_string_form_rejects_what_the_instance_form_rejects():
    # torch.compile itself refuses mode and options together, so the string form's backend is asked directly.
    with pytest.raises(ValueError, match="needs inner='inductor'"):
        fp4compile.get_backend({"inner": "eager"}, "reduce-overhead")


# ---------------------------------------------------------------------------------------------
# Validation: wrong values fail at once, naming what is wrong
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("fmt", "fp4"),
        ("rht", "false"),
        ("rht_size", 16.0),
        ("stochastic_rounding", "false"),
        ("weight_2d", 1),
        ("high_precision_first_blocks", "2"),
        ("high_precision_last_blocks", -1),
        ("high_precision_modules", [1, 2]),
        ("quantize_backward", None),
        ("seed", "abc"),
        ("switch_to_high_precision_at", "10"),
        ("switch_to_high_precision_at", -1),
        ("check_finite", "yes"),
        ("include_activation_matmuls", 0),
        ("decoded_operands", "auto"),
        ("share_weight", "true"),
    ],
)
def test_every_recipe_field_is_checked_at_construction(field, value):
    with pytest.raises((TypeError, ValueError), match=rf"Recipe\.{field} must"):
        Recipe(**{field: value})


def test_every_recipe_field_has_a_check():
    checked = {f for f, _ in test_every_recipe_field_is_checked_at_construction.pytestmark[0].args[1]}
    assert checked == set(Recipe.__dataclass_fields__)


def test_string_options_are_checked_like_recipe_fields():
    with pytest.raises(BackendCompilerFailed, match=r"Recipe\.rht must be True or False, got 'false'"):
        torch.compile(_stack(), backend="nvfp4", options={"rht": "false", "inner": "eager"})(_x(2, D))


def test_backend_recipe_must_be_a_recipe():
    with pytest.raises(TypeError, match=r"Backend\(recipe=\.\.\.\) takes a fp4compile\.Recipe, got str 'nvfp4'"):
        Backend(recipe="nvfp4")


def test_a_pass_returning_something_else_is_named():
    def returns_42(gm, ctx):
        return 42

    with pytest.raises(BackendCompilerFailed, match="pass 'returns_42' returned int 42"):
        torch.compile(_stack(), backend=Backend(passes=[returns_42], **_all_fp4()))(_x(2, D))


def test_a_site_in_another_format_than_the_recipe_is_refused_naming_it():
    def mxfp4_fc(gm, ctx):
        for site in ctx.sites:
            if site.name.endswith("fc"):
                site.set_precision("mxfp4", "try MXFP4")
        return gm

    message = r"GEMM site 'layers\.0\.fc' was set to 'mxfp4', but the recipe's fmt is 'nvfp4'"
    with pytest.raises(BackendCompilerFailed, match=message):
        torch.compile(_stack(), backend=Backend(passes=[mxfp4_fc], **_all_fp4()))(_x(2, D))


# ---------------------------------------------------------------------------------------------
# Seeding: torch.manual_seed governs stochastic rounding, as it governs dropout
# ---------------------------------------------------------------------------------------------


def _train(model, backend, steps=2, start=0, opt=None):
    """``steps`` training steps on fixed data; the losses and the optimizer."""
    compiled = torch.compile(model, backend=backend)
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(start, start + steps):
        loss = compiled(_x(2, 16, D, seed=100 + step)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, opt


def _sr_run(torch_seed, **recipe):
    """Weight gradients of a fresh model's second step after ``torch.manual_seed(torch_seed)``."""
    torch._dynamo.reset()
    model = _stack()
    torch.manual_seed(torch_seed)
    _train(model, Backend(**_all_fp4(rht=False, **recipe)))
    return grads(model)


def test_torch_manual_seed_governs_stochastic_rounding():
    fp4compile.manual_seed(None)  # the default: no fp4compile seed (tests start from a fixed one)
    first, again, other = _sr_run(0), _sr_run(0), _sr_run(1)
    for name, g in first.items():
        assert torch.equal(g, again[name]), name  # two runs in one process, as in a notebook or a sweep
    assert not torch.equal(first["layers.0.fc.weight"], other["layers.0.fc.weight"])


def test_fp4compile_seeds_override_torch_seed():
    fp4compile.manual_seed(3)
    first = _sr_run(0)
    fp4compile.manual_seed(3)
    assert torch.equal(first["layers.0.fc.weight"], _sr_run(1)["layers.0.fc.weight"])
    fp4compile.manual_seed(None)
    by_recipe = _sr_run(0, seed=5)
    fp4compile.manual_seed(None)
    assert torch.equal(by_recipe["layers.0.fc.weight"], _sr_run(1, seed=5)["layers.0.fc.weight"])


def test_resume_with_torch_rng_state_continues_identically():
    fp4compile.manual_seed(None)
    model = _stack()
    torch.manual_seed(7)
    losses_4, _ = _train(model, Backend(**_all_fp4()), steps=4)

    torch._dynamo.reset()
    model, backend = _stack(), Backend(**_all_fp4())
    torch.manual_seed(7)
    first, opt = _train(model, backend)
    assert first == losses_4[:2]
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "fp4": backend.state_dict(),
                "torch_rng": torch.get_rng_state()}, buffer)

    torch._dynamo.reset()
    torch.manual_seed(999)
    fp4compile.manual_seed(None)
    resumed, resumed_backend = _stack(), Backend(**_all_fp4())
    resumed_opt = torch.optim.SGD(resumed.parameters(), lr=0.1)
    buffer.seek(0)
    state = torch.load(buffer)
    resumed.load_state_dict(state["model"])
    resumed_opt.load_state_dict(state["opt"])
    resumed_backend.load_state_dict(state["fp4"])
    torch.set_rng_state(state["torch_rng"])
    rest, _ = _train(resumed, resumed_backend, start=2, opt=resumed_opt)
    assert rest == losses_4[2:]


# ---------------------------------------------------------------------------------------------
# The README's set-up installs what CI installs
# ---------------------------------------------------------------------------------------------


def _pip_installs(commands: str) -> list[list[str]]:
    """The arguments of each ``pip install`` in a shell text, quiet flags dropped."""
    installs = []
    for line in commands.replace("&&", "\n").splitlines():
        words = shlex.split(line, comments=True)
        if "pip" in words and "install" in words:
            installs.append([w for w in words[words.index("install") + 1:] if w != "-q"])
    return installs


def test_readme_set_up_installs_what_ci_installs():
    readme = (ROOT / "README.md").read_text()
    first_command = next(line for line in readme.splitlines() if line.strip().startswith("python3 -m venv"))
    assert _pip_installs(first_command) == _pip_installs((ROOT / ".ci/run").read_text())
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    assert "triton==3.6.0" in dev  # the Triton kernel tests run in its interpreter on a CPU-only machine
