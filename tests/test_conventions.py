"""The compiled model behaves like PyTorch: compile arguments, argument checking, seeding, copies,
empty inputs, float64 models, the CLI's errors, and a set-up that runs the same suite as CI.

Models are tiny and compiled with the eager inner compiler on the CPU unless a test says otherwise.
"""

from __future__ import annotations

import copy
import io
import pickle
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
    """Backend settings with every GEMM in FP4 (no first/last blocks, nor the layers outside the blocks,
    kept in high precision)."""
    return {"high_precision_first_blocks": 0, "high_precision_last_blocks": 0,
            "high_precision_outside_blocks": False, "inner": "eager", **kw}


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
        ("high_precision_outside_blocks", "no"),
        ("quantize_backward", None),
        ("seed", "abc"),
        ("switch_to_high_precision_at", "10"),
        ("switch_to_high_precision_at", -1),
        ("amax_history", -1),
        ("check_finite", "yes"),
        ("include_activation_matmuls", 0),
        ("decoded_operands", "auto"),
        ("share_weight", "true"),
        ("allow_emulation", 1),
        ("high_precision_routers", "yes"),
        ("block_scale_rule", 4),
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
# Copies and pickles
# ---------------------------------------------------------------------------------------------


def test_deepcopy_of_a_compiled_model_after_a_step_trains_like_the_original():
    model = _stack()
    compiled = torch.compile(model, backend=Backend(**_all_fp4()))
    compiled(_x(2, 16, D)).square().mean().backward()
    ema = copy.deepcopy(compiled)  # the EMA copy of a training loop, after the first step
    x = _x(2, 16, D, seed=5)
    with torch.no_grad():
        assert torch.equal(ema(x), compiled(x))  # forward rounding is to nearest: the same bits
    ema(x).square().mean().backward()
    assert all(p.grad is not None for p in ema.parameters())


def test_a_used_backend_and_its_report_pickle_with_their_settings():
    backend = Backend(passes=[fp4compile.precision_pass(_module_level_pass)], **_all_fp4(rht=False))
    _train(_stack(), backend, steps=1)
    backend.step(3)
    for copied in (pickle.loads(pickle.dumps(backend)), copy.deepcopy(backend)):
        assert copied.recipe == backend.recipe and copied.inner == "eager"
        assert copied.passes == backend.passes and copied.state_dict()["step"] == 3
        assert copied.report.recipe == backend.recipe and copied.report.sites == []  # compilations stay behind
    assert pickle.loads(pickle.dumps(backend.report)).recipe == backend.recipe


def _module_level_pass(gm, ctx):
    """A precision pass that pickles (by reference, as Python pickles functions)."""
    return gm


# ---------------------------------------------------------------------------------------------
# Empty inputs: a GEMM with no tokens gives what eager gives
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt, block", [("nvfp4", "1x16"), ("nvfp4", "16x16"), ("mxfp4", "1x32")])
@pytest.mark.parametrize("rounding", ["rne", "sr"])
def test_quantize_and_dequantize_an_empty_tensor(fmt, block, rounding):
    from fp4compile import formats

    q = formats.quantize(torch.zeros(0, 64), fmt, block, rounding, seed=1)
    assert formats.dequantize(q).shape == (0, 64)


def test_a_linear_without_tokens_gives_an_empty_output_and_zero_weight_gradient():
    model = _stack()
    x = torch.zeros(0, D, requires_grad=True)
    y = torch.compile(model, backend=Backend(**_all_fp4()))(x)
    y.sum().backward()
    assert y.shape == (0, D) and x.grad.shape == (0, D)
    for name, g in grads(model).items():
        assert torch.equal(g, torch.zeros_like(g)), name


def test_emulated_gemm_without_tokens_launches_nothing():
    pytest.importorskip("triton")
    from fp4compile.codegen import triton_kernels as tk

    out = tk.emulated_scaled_mm(torch.zeros(0, 32), torch.tensor(1.0), torch.zeros(16, 32), torch.tensor(1.0))
    assert out.shape == (0, 16)


def test_cutlass_gemm_without_tokens_returns_eager_results_without_a_kernel():
    from fp4compile.codegen import cutlass_gemm

    config = cutlass_gemm.supported_configs()[0]
    amax = torch.tensor(1.0)
    empty = cutlass_gemm.scaled_mm(config, torch.zeros(0, 16, dtype=torch.uint8), torch.zeros(0, 2), amax,
                                   torch.zeros(8, 16, dtype=torch.uint8), torch.zeros(8, 2), amax)
    assert empty.shape == (0, 8) and empty.dtype == config.torch_out_dtype
    bias = torch.arange(8.0)
    no_k = cutlass_gemm.scaled_mm(config, torch.zeros(4, 0, dtype=torch.uint8), torch.zeros(4, 0), amax,
                                  torch.zeros(8, 0, dtype=torch.uint8), torch.zeros(8, 0), amax, bias)
    assert torch.equal(no_k.float(), bias.expand(4, 8))


# ---------------------------------------------------------------------------------------------
# float64 models run their GEMMs in high precision, with the reason recorded
# ---------------------------------------------------------------------------------------------


def test_float64_model_runs_in_high_precision_with_the_reason():
    model = _stack().double()
    backend = Backend(**_all_fp4())
    x = _x(2, 16, D, dtype=torch.float64)
    y = torch.compile(model, backend=backend)(x)
    assert y.dtype == torch.float64 and torch.equal(y, model(x))
    assert {s.name: s.precision for s in backend.report.sites} == {"layers.0.fc": "high", "layers.0.out": "high", "head": "high"}
    assert all("float64" in s.reason for s in backend.report.sites)


# ---------------------------------------------------------------------------------------------
# The CLI says what to do in one line
# ---------------------------------------------------------------------------------------------


def test_cli_image_without_matplotlib_says_what_to_install(monkeypatch, capsys):
    import importlib.util

    from fp4compile import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    argv = ["inspect", str(ROOT / "examples" / "inspect_gpt.py") + ":gpt", "--input-shape", "2x32",
            "--input-dtype", "long", "--image", "out.png"]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.strip() == (
        "fp4compile inspect: error: --image needs matplotlib: pip install matplotlib (or the [plot] extra)"
    )


def test_cli_float_input_to_an_embedding_model_names_the_flag(capsys):
    from fp4compile import cli

    argv = ["inspect", str(ROOT / "examples" / "inspect_gpt.py") + ":gpt", "--input-shape", "2x32"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.endswith("pass --input-dtype long"), err


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


def test_readme_test_command_runs_the_suites_ci_runs():
    readme = (ROOT / "README.md").read_text()
    command = next(line.strip() for line in readme.splitlines() if line.strip().startswith("python -m pytest"))
    ci = next(line.strip() for line in (ROOT / ".ci/run").read_text().splitlines() if "pytest" in line)
    assert ci.replace(" -p no:cacheprovider", "") == command
    assert command.split(" && ") == ["python -m pytest -q", "python -m pytest -q -m slow"]  # fast tier, slow tier
    assert "-m 'not slow'" in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
