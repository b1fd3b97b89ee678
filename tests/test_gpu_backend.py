"""The compiled model on a CUDA GPU (Triton quantizers, fused RHT + quantize, emulated GEMM) against the
same compiled model on the CPU (reference quantizers). Skipped without a GPU.

One linear layer, so both devices quantize identical operands: the codes and scales are the same bits,
and the outputs and gradients differ only by the GEMMs' fp32 summation order. The MXFP4 case runs
without the RHT (its transform is ``formats.rht`` on both devices, covered by the CPU tests).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from fp4compile import Backend, runtime  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


class Proj(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(256, 256)])

    def forward(self, x):
        return self.blocks[0](x)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_gpu_compiled_linear_matches_cpu(inner, fmt, fresh_dynamo):
    torch.manual_seed(0)
    model = Proj()
    x = torch.randn(4, 512, 256)
    g = torch.randn(4, 512, 256)
    results = {}
    for device in ("cpu", "cuda"):
        torch._dynamo.reset()
        runtime.manual_seed(5)
        m = Proj().to(device)
        m.load_state_dict(model.state_dict())
        xd = x.detach().to(device).requires_grad_()  # a leaf on each device
        backend = Backend(inner=inner, fmt=fmt, high_precision_first_blocks=0, high_precision_last_blocks=0,
                          rht=fmt == "nvfp4")
        y = torch.compile(m, backend=backend)(xd)
        (y * g.to(device)).sum().backward()
        results[device] = (y.detach().cpu(), xd.grad.cpu(), m.blocks[0].weight.grad.cpu())
        site = next(s for s in backend.report.sites if s.name == "blocks.0")
        assert site.precision == fmt
    for cpu, gpu in zip(results["cpu"], results["cuda"]):
        # A flipped FP4 code would move a value by a whole grid step (>= 1/12 of its block's largest);
        # fp32 summation order moves it by ~1e-6 relative.
        torch.testing.assert_close(gpu, cpu, rtol=1e-4, atol=1e-4 * cpu.abs().max().item())
