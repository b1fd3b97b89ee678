"""In-place ops on a linear's output compile with the recipe's plan and the numbers of the out-of-place code.

A small model of four blocks (fc1 -> activation -> fc2, a residual add), each block modifying a linear's
output in place: ``nn.ReLU(inplace=True)``, ``F.silu(h, inplace=True)``, ``h.mul_(0.5)``, or ``y += x``
on fc2's output (Falcon's ``mlp_output += attention_output``), with 2-D and 3-D inputs. The middle
blocks run in NVFP4: their forward values and gradients are those of the same compile of the model
written out of place, bit for bit; the first and last blocks run in high precision: their outputs are
eager PyTorch's. A training step runs.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fp4compile
from fp4compile import Backend

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

D, BLOCKS = 32, 4
VARIANTS = ("relu_module", "silu", "mul", "residual_add")


class Block(nn.Module):
    def __init__(self, variant: str, inplace: bool):
        super().__init__()
        self.variant, self.inplace = variant, inplace
        self.fc1 = nn.Linear(D, 4 * D)
        self.fc2 = nn.Linear(4 * D, D, bias=False)
        self.act = nn.ReLU(inplace=inplace)

    def forward(self, x):
        h = self.fc1(x)
        if self.variant == "relu_module":
            h = self.act(h)
        elif self.variant == "silu":
            h = F.silu(h, inplace=self.inplace)
        elif self.variant == "mul":
            if self.inplace:
                h.mul_(0.5)
            else:
                h = h.mul(0.5)
        else:
            h = F.gelu(h)
        y = self.fc2(h)
        if self.variant == "residual_add" and self.inplace:
            y += x
        else:
            y = y + x
        return y


class Model(nn.Module):
    """Returns every block's output: the high-precision blocks' are compared with eager PyTorch's."""

    def __init__(self, variant: str, inplace: bool):
        super().__init__()
        self.blocks = nn.ModuleList(Block(variant, inplace) for _ in range(BLOCKS))

    def forward(self, x):
        outputs = []
        for block in self.blocks:
            x = block(x)
            outputs.append(x)
        return outputs


def run(variant: str, rank: int, inplace: bool, inner: str = "eager"):
    """(plan {site: (block, precision, reason)}, block outputs, gradients, loss after one SGD step,
    eager model, input)."""
    fp4compile.manual_seed(0)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Model(variant, inplace)
    eager = copy.deepcopy(model)
    backend = Backend(inner=inner)
    call = torch.compile(model, backend=backend)
    shape = (2, 16, D) if rank == 3 else (32, D)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    outputs = call(x)
    outputs[-1].square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    optimizer.step()
    optimizer.zero_grad()
    loss = call(x)[-1].square().mean()
    loss.backward()
    plan = {s.name: (s.block, s.precision, s.reason) for s in backend.report.sites}
    return plan, [o.detach() for o in outputs], grads, loss.detach(), eager, x, backend


def check(variant: str, rank: int, inner: str = "eager"):
    plan, outputs, grads, loss, eager, x, backend = run(variant, rank, inplace=True, inner=inner)
    assert plan == {
        f"blocks.{i}.{fc}": (i, *(("high", "first 1 of 4 blocks") if i == 0 else
                                  ("high", "last 1 of 4 blocks") if i == BLOCKS - 1 else ("nvfp4", "recipe default")))
        for i in range(BLOCKS) for fc in ("fc1", "fc2")
    }
    assert backend.report.warnings == []
    ref_plan, ref_outputs, ref_grads, ref_loss, *_ = run(variant, rank, inplace=False, inner=inner)
    assert plan == ref_plan
    for i, (out, ref) in enumerate(zip(outputs, ref_outputs)):
        torch.testing.assert_close(out, ref, rtol=0, atol=0, msg=f"block {i} output")
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=0, msg=name)
    assert torch.isfinite(loss) and torch.equal(loss, ref_loss)
    # The high-precision blocks compute what eager PyTorch computes from the same input (to the bit
    # through the eager inner compiler; Inductor's fused kernels round in their own order).
    tol = 0 if inner == "eager" else 1e-5
    with torch.no_grad():
        torch.testing.assert_close(outputs[0], eager.blocks[0](x.clone()), rtol=tol, atol=tol)
        torch.testing.assert_close(outputs[-1], eager.blocks[-1](outputs[-2].clone()), rtol=tol, atol=tol)


@pytest.mark.parametrize("rank", [2, 3])
@pytest.mark.parametrize("variant", VARIANTS)
def test_inplace_op_on_a_linear_output_keeps_the_plan_and_the_bits(variant, rank):
    check(variant, rank)


def test_falcon_residual_add_in_place_under_inductor():
    check("residual_add", 3, inner="inductor")


@pytest.mark.slow
@pytest.mark.parametrize("rank", [2, 3])
@pytest.mark.parametrize("variant", VARIANTS)
def test_inplace_ops_under_inductor(variant, rank):
    check(variant, rank, inner="inductor")
