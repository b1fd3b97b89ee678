"""The pipeline's passes by name, in the order they run: the one declaration ``passes/pipeline.py`` runs
and the settings that name passes (``print_ir_after``) are checked against, in the core, so that checking
a setting imports no pass.

User precision passes run after ``USER_PASSES_AFTER``; passes made with ``fp4compile.precision_pass``
add their names to ``precision_pass_names`` as they are made.
"""

from __future__ import annotations

import difflib
from typing import Sequence

DYNAMO = ("find_gemm_sites", "find_blocks", "assign_precision", "keep_routers_high", "check_plan", "mark_fp4_linear")
USER_PASSES_AFTER = "keep_routers_high"
JOINT = ("plan_sharing",)
AOT = ("plan_gemm_roles", "insert_rht", "insert_quantize", "record_stats", "fuse_rht_quantize", "lower_gemms",
       "fuse_amax", "record_ranges", "lower_kernels")

precision_pass_names: set[str] = set()


def names(user_names: Sequence[str] = ()) -> list[str]:
    """Every pass's name in pipeline order, the user passes' names ``user_names`` in their place."""
    at = DYNAMO.index(USER_PASSES_AFTER) + 1
    return [*DYNAMO[:at], *user_names, *DYNAMO[at:], *JOINT, *AOT]


def check_selection(selection, user_names: Sequence[str] = ()) -> None:
    """Raise a ValueError unless every name in ``selection`` (a comma list or a sequence of names, as
    ``print_ir_after`` takes) is "all", a pass of the pipeline, one of ``user_names`` or a pass made with
    ``precision_pass``; the error lists the names there are."""
    if selection is None:
        return
    chosen = [s.strip() for s in (selection.split(",") if isinstance(selection, str) else selection)]
    known = ["all", *names(user_names)]
    known += sorted(precision_pass_names - set(known))
    unknown = [n for n in chosen if n and n not in known]
    if unknown:
        close = [m for n in unknown for m in difflib.get_close_matches(n, known, n=1)]
        hint = f" (did you mean {', '.join(repr(m) for m in close)}?)" if close else ""
        raise ValueError(f"no pass is named {', '.join(repr(n) for n in unknown)}{hint}; the names are: {', '.join(known)}")
