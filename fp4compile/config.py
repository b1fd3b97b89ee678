"""fp4compile's settings: one typed field each, read from the environment once, when this module loads.

Each field has an ``FP4COMPILE_*`` environment variable (``SETTINGS``; the README's settings table
lists them). An unset or empty variable leaves the field's default; an invalid value raises a
ValueError naming the variable. Code changes fields for a block or a function with ``patch``:

    with fp4compile.config.patch(print_ir_after="all"):
        compiled(x)

The rest of fp4compile reads the fields here each time it needs one, so a change applies from the
next use on.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Mapping, NamedTuple, Optional, Union

check_finite: bool = False
"""``Recipe(check_finite=True)`` in every ``Backend`` made: a NaN or Inf in a quantized tensor raises."""

print_ir_after: str = ""
"""Passes (a comma list, or "all") whose output graph is printed while compiling."""

emulated_gemm: str = "auto"
"""The GEMM the emulation runs on CUDA: "auto" (cuBLASLt where it can run, on operands decoded to BF16),
"cublaslt" (required), "torch" (``torch.mm`` to fp32 and an epilogue kernel), "packed" (one Triton
kernel that reads the packed operands and decodes them in registers: ``fp4.packed_mm``)."""

in_graph_kernels: Union[bool, str] = True
"""Under Inductor on CUDA, the fp4 ops' Triton kernels go into Inductor's generated code (the
``lower_kernels`` pass); off: each op runs as one opaque call that launches its kernels itself; "auto":
op calls where Inductor records the graphs in CUDA graphs (a replay costs an op call no host time, and
the graphs compile faster), in-graph kernels elsewhere."""

kernel_analysis_cache: bool = True
"""Inductor's analysis of which buffers one of fp4compile's Triton kernels writes (a TTIR compile of the
kernel) is done once per kernel and argument types and constants, and reused at every launch site; off:
at every site, as Inductor does for other kernels."""

check_contracts: bool = False
"""Each pass's contract (``fp4compile.contracts``: the passes it must follow, what it requires of the
graph, what it guarantees, fake values on the nodes it adds) is checked as it runs; a broken one raises
``ContractError``. The test suite turns it on; it costs compile time."""

cache_dir: Optional[str] = None
"""Where built CUTLASS kernels are cached; None: ``~/.cache/fp4compile``."""

nvcc: Optional[str] = None
"""The nvcc that builds CUTLASS kernels; None: ``$CUDA_HOME/bin/nvcc``, else nvcc on ``PATH``."""

_OFF = ("0", "false", "no", "off")


class _Flag:
    """On or off: "0", "false", "no" and "off" (any case) turn it off, any other text on."""

    def parse(self, text: str) -> bool:
        return text.lower() not in _OFF

    def check(self, value) -> bool:
        if not isinstance(value, bool):
            raise ValueError("expected True or False")
        return value


class _FlagOrAuto(_Flag):
    """On, off (as ``_Flag``) or "auto"."""

    def parse(self, text: str):
        return "auto" if text.lower() == "auto" else super().parse(text)

    def check(self, value):
        if value == "auto":
            return value
        if not isinstance(value, bool):
            raise ValueError('expected True, False or "auto"')
        return value


class _Choice:
    """One of ``values``; ``aliases`` (lower case) name them too."""

    def __init__(self, values: tuple, expected: str, aliases: Optional[Mapping[str, str]] = None):
        self.values, self.expected, self.aliases = values, expected, dict(aliases or {})

    def parse(self, text: str) -> str:
        return self.check(text.lower())

    def check(self, value) -> str:
        value = self.aliases.get(value, value) if isinstance(value, str) else value
        if value not in self.values:
            raise ValueError(f"expected {self.expected}")
        return value


class _Text:
    """Text as given (a path, a list of names)."""

    def parse(self, text: str) -> str:
        return text

    def check(self, value) -> str:
        if not isinstance(value, str):
            raise ValueError("expected a string")
        return value


class _PassNames:
    """"all" or a comma list of pass names (``fp4compile.print_pipeline()`` lists them, and passes made
    with ``fp4compile.precision_pass``), checked against the passes there are."""

    def parse(self, text: str) -> str:
        return self.check(text)

    def check(self, value) -> str:
        if not isinstance(value, str):
            raise ValueError("expected a string: \"all\" or a comma list of pass names")
        from fp4compile import pass_order

        pass_order.check_selection(value)
        return value


class Setting(NamedTuple):
    variable: str  # the environment variable that sets the field
    kind: Any  # parses the variable's text and checks a value set in code


SETTINGS: dict[str, Setting] = {
    "check_finite": Setting("FP4COMPILE_CHECK_FINITE", _Flag()),
    "print_ir_after": Setting("FP4COMPILE_PRINT_IR_AFTER", _PassNames()),
    "emulated_gemm": Setting("FP4COMPILE_EMULATED_GEMM", _Choice(("auto", "cublaslt", "torch", "packed"), "auto, cublaslt, torch or packed")),
    "in_graph_kernels": Setting("FP4COMPILE_IN_GRAPH_KERNELS", _FlagOrAuto()),
    "kernel_analysis_cache": Setting("FP4COMPILE_KERNEL_ANALYSIS_CACHE", _Flag()),
    "check_contracts": Setting("FP4COMPILE_CHECK_CONTRACTS", _Flag()),
    "cache_dir": Setting("FP4COMPILE_CACHE_DIR", _Text()),
    "nvcc": Setting("FP4COMPILE_NVCC", _Text()),
}

DEFAULTS: dict[str, Any] = {name: globals()[name] for name in SETTINGS}


def from_environment(env: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """Every field's value as ``env`` sets it (the default where its variable is unset or empty)."""
    values = dict(DEFAULTS)
    for name, setting in SETTINGS.items():
        text = env.get(setting.variable, "").strip()
        if text:
            try:
                values[name] = setting.kind.parse(text)
            except ValueError as err:
                raise ValueError(f"{setting.variable}={text!r}: {err}") from None
    return values


def _checked(name: str, value) -> Any:
    if name not in SETTINGS:
        raise AttributeError(f"fp4compile.config has no setting {name!r}; the settings are {', '.join(SETTINGS)}")
    if value is None and DEFAULTS[name] is None:
        return None
    try:
        return SETTINGS[name].kind.check(value)
    except ValueError as err:
        raise ValueError(f"fp4compile.config.{name}={value!r}: {err}") from None


@contextlib.contextmanager
def patch(**changes):
    """Set fields for a ``with`` block or, as a decorator, for each call of a function; the values they
    had come back at its end."""
    new = {name: _checked(name, value) for name, value in changes.items()}
    saved = {name: globals()[name] for name in new}
    globals().update(new)
    try:
        yield
    finally:
        globals().update(saved)


globals().update(from_environment())
