"""fp4compile.config: the environment maps onto the settings; ``patch`` changes them and checks the values."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fp4compile import config


def test_unset_or_empty_variables_give_the_defaults():
    assert config.from_environment({}) == config.DEFAULTS
    assert config.from_environment({s.variable: "  " for s in config.SETTINGS.values()}) == config.DEFAULTS


def test_each_variable_sets_its_field():
    env = {
        "FP4COMPILE_CHECK_FINITE": "1", "FP4COMPILE_PRINT_IR_AFTER": "insert_rht,lower_gemms",
        "FP4COMPILE_EMULATED_GEMM": "Torch", "FP4COMPILE_IN_GRAPH_KERNELS": "off",
        "FP4COMPILE_KERNEL_ANALYSIS_CACHE": "0", "FP4COMPILE_CACHE_DIR": "~/kernels", "FP4COMPILE_NVCC": "/opt/cuda/bin/nvcc",
        "FP4COMPILE_CHECK_CONTRACTS": "yes",
    }
    assert set(env) == {s.variable for s in config.SETTINGS.values()}
    assert config.from_environment(env) == dict(
        check_finite=True, print_ir_after="insert_rht,lower_gemms", emulated_gemm="torch",
        in_graph_kernels=False, kernel_analysis_cache=False, cache_dir="~/kernels", nvcc="/opt/cuda/bin/nvcc",
        check_contracts=True,
    )
    for off in ("0", "false", "No", "OFF"):
        assert config.from_environment({"FP4COMPILE_CHECK_FINITE": off})["check_finite"] is False
    assert config.from_environment({"FP4COMPILE_IN_GRAPH_KERNELS": "Auto"})["in_graph_kernels"] == "auto"


def test_in_graph_kernels_takes_on_off_or_auto():
    for value in (True, False, "auto"):
        with config.patch(in_graph_kernels=value):
            assert config.in_graph_kernels == value
    with pytest.raises(ValueError, match='expected True, False or "auto"'), config.patch(in_graph_kernels="yes"):
        pass


@pytest.mark.parametrize("variable, value", [
    ("FP4COMPILE_EMULATED_GEMM", "cublas"), ("FP4COMPILE_EMULATED_GEMM", "fast"),
])
def test_an_invalid_value_names_its_variable(variable, value):
    with pytest.raises(ValueError, match=f"{variable}='{value}': expected"):
        config.from_environment({variable: value})


PASS_LIST = "the names are: all, find_gemm_sites, find_blocks, assign_precision"


@pytest.mark.parametrize("value", ["insert_rhtt", "all,lower_gemm", "dynamo"])
def test_print_ir_after_names_a_pass_there_is(value):
    """A misspelled pass name is an error naming the variable, with the names there are; as a setting
    in code, and as Backend's argument (which knows its own passes too)."""
    from fp4compile import Backend, precision_pass

    with pytest.raises(ValueError, match=f"FP4COMPILE_PRINT_IR_AFTER='{value}': no pass is named .*{PASS_LIST}"):
        config.from_environment({"FP4COMPILE_PRINT_IR_AFTER": value})
    with pytest.raises(ValueError, match=f"print_ir_after='{value}': no pass is named .*{PASS_LIST}"), \
            config.patch(print_ir_after=value):
        pass
    with pytest.raises(ValueError, match=rf"Backend\(print_ir_after=\['{value}'\]\): no pass is named"):
        Backend(inner="eager", print_ir_after=[value])
    with pytest.raises(ValueError, match="did you mean 'insert_rht'"):
        Backend(inner="eager", print_ir_after="insert_rhtt")

    def mine(gm, ctx):
        return gm

    Backend(inner="eager", passes=[mine], print_ir_after=["mine", "insert_rht"])  # a pass of its own
    named = precision_pass(mine, name="keep_mine_high")
    with config.patch(print_ir_after="keep_mine_high,all"):
        Backend(inner="eager", passes=[named])


def test_the_environment_is_read_when_fp4compile_is_imported():
    code = "import fp4compile; print(fp4compile.config.emulated_gemm, fp4compile.config.check_finite)"
    env = {"FP4COMPILE_EMULATED_GEMM": "torch", "FP4COMPILE_CHECK_FINITE": "1", "PATH": ""}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["torch", "True"], out.stderr[-2000:]
    env["FP4COMPILE_EMULATED_GEMM"] = "many"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "FP4COMPILE_EMULATED_GEMM='many'" in out.stderr


def test_patch_sets_fields_for_a_block_and_a_function():
    before = config.emulated_gemm
    with config.patch(emulated_gemm="torch", check_finite=True):
        assert (config.emulated_gemm, config.check_finite) == ("torch", True)
    assert config.emulated_gemm == before

    @config.patch(print_ir_after="all")
    def printed():
        return config.print_ir_after

    assert printed() == "all" and printed() == "all" and config.print_ir_after != "all"


@pytest.mark.parametrize("changes, message", [
    (dict(emulated_gemm="cublas"), "emulated_gemm='cublas': expected auto, cublaslt, torch or packed"),
    (dict(check_finite="yes"), "check_finite='yes': expected True or False"),
    (dict(cache_dir=3), "cache_dir=3: expected a string"),
])
def test_patch_rejects_a_bad_value_and_changes_nothing(changes, message):
    before = {name: getattr(config, name) for name in config.SETTINGS}
    with pytest.raises(ValueError, match=message), config.patch(print_ir_after="all", **changes):
        pass
    assert {name: getattr(config, name) for name in config.SETTINGS} == before


def test_patch_rejects_an_unknown_setting():
    with pytest.raises(AttributeError, match="no setting 'emulated_gem'"), config.patch(emulated_gem="torch"):
        pass
