"""Operand dtypes: what eager PyTorch rejects for a GEMM, the compiled model rejects too."""

from __future__ import annotations

import torch
import torch.fx as fx

from fp4compile.vocabulary import LINEAR_TARGETS, MATMUL_TARGETS, module_path
from fp4compile.sites import example_tensor

_ENTER_AUTOCAST = torch.amp.autocast_mode._enter_autocast
_EXIT_AUTOCAST = torch.amp.autocast_mode._exit_autocast


def check_gemm_dtypes(gm: fx.GraphModule) -> None:
    """Raise the error eager PyTorch raises for a GEMM site whose operand dtypes it rejects.

    An FP4 GEMM casts its operands, so an int input or a bf16 input to an fp32 layer outside autocast
    would run silently. For each linear/matmul whose tensor operands do not share one dtype, the same
    call is made on 1-element tensors of those dtypes, under the autocast state of that point of the
    graph (the caller's, plus the ``with torch.autocast`` regions inside the graph), and its error is
    raised with the site named.
    """
    regions = []  # autocast regions of the graph entered so far, innermost last
    try:
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            if node.target is _ENTER_AUTOCAST:
                device, dtype, enabled = node.args[:3]
                regions.append(torch.autocast(device, dtype, enabled))
                regions[-1].__enter__()
                continue
            if node.target is _EXIT_AUTOCAST:
                regions.pop().__exit__(None, None, None)
                continue
            if node.target not in LINEAR_TARGETS and node.target not in MATMUL_TARGETS:
                continue
            operands = [example_tensor(a) for a in (*node.args, *node.kwargs.values())]
            operands = [t for t in operands if t is not None]
            if len(operands) < 2 or len({t.dtype for t in operands}) == 1:
                continue
            # x and W as 1x1 matrices, a bias as a 1-vector: the smallest call eager checks the same way.
            tiny = [torch.zeros((1, 1) if i < 2 else (1,), dtype=t.dtype, device=t.device)
                    for i, t in enumerate(operands)]
            try:
                node.target(*tiny)
            except Exception as exc:
                path = next(reversed(node.meta.get("nn_module_stack", {}).values()), (node.name,))[0]
                where = module_path(path) or node.name
                exc.add_note(f"fp4compile: raised for the GEMM at {where}, as eager PyTorch does")
                raise
    finally:
        for region in reversed(regions):
            region.__exit__(None, None, None)
