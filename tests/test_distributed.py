"""The compiled model under DDP, FSDP2 and tensor parallelism: 2 CPU processes over gloo.

One spawn runs every scenario (start-up dominates); the single-process references run in the test
process. SR is off, so the only differences allowed are those of the fp32 reduction order.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from fp4compile import Backend, distributed, formats
import gloo
from models import MLPStack

WORLD = 2
D, HIDDEN = 16, 64
BATCH, TOKENS = 4, 16  # each rank: 2 x 16 = 32 tokens, a multiple of the 16-token wgrad blocks


def _backend() -> Backend:
    # FSDP2 compiles each sharded layer on its own; the model's head then runs eagerly, so keep it
    # out of FP4 in every run for a like-for-like comparison.
    return Backend(
        inner="eager", stochastic_rounding=False, high_precision_first_blocks=0, high_precision_last_blocks=0,
        high_precision_modules=("head", "*.head"),
    )


def _model() -> MLPStack:
    torch.manual_seed(0)
    return MLPStack(2, d=D)


def _batch() -> torch.Tensor:
    return torch.randn(BATCH, TOKENS, D, generator=torch.Generator().manual_seed(1))


def _local(x: torch.Tensor, rank: int) -> torch.Tensor:
    per_rank = x.shape[0] // WORLD
    return x[rank * per_rank:(rank + 1) * per_rank]


def _step(compiled, x):
    compiled(x).square().mean().backward()


def _grads(model) -> dict:
    out = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[name.removeprefix("module.")] = grad.detach().clone()
    return out


class TensorParallelMLP(nn.Module):
    """Megatron-style MLP: ``fc`` column-parallel (rows of W), ``out`` row-parallel (columns of W); the
    partial outputs are summed across ranks outside the compiled module."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc = nn.Linear(D, hidden)
        self.out = nn.Linear(hidden, D, bias=False)

    def forward(self, x):
        return self.out(F.gelu(self.fc(x)))


def _full_mlp() -> TensorParallelMLP:
    torch.manual_seed(2)
    return TensorParallelMLP(HIDDEN)


def _mlp_shard(rank: int) -> TensorParallelMLP:
    full, shard = _full_mlp(), TensorParallelMLP(HIDDEN // WORLD)
    rows = slice(rank * HIDDEN // WORLD, (rank + 1) * HIDDEN // WORLD)
    with torch.no_grad():
        shard.fc.weight.copy_(full.fc.weight[rows])
        shard.fc.bias.copy_(full.fc.bias[rows])
        shard.out.weight.copy_(full.out.weight[:, rows])
    return shard


def _tp_weight() -> torch.Tensor:
    """Rows growing in magnitude, so that the shards' own amaxes differ from the full weight's."""
    w = torch.randn(HIDDEN, 2 * D, generator=torch.Generator().manual_seed(3))
    return w * torch.logspace(0, 2, HIDDEN)[:, None]


# ---------------------------------------------------------------------------------------------
# The worker: every scenario on each of the 2 ranks
# ---------------------------------------------------------------------------------------------


def _data_parallel(rank: int, wrap: str, global_amax: bool) -> dict:
    torch._dynamo.reset()
    distributed.clear()
    if global_amax:
        distributed.shard_amax("*", None, tensors=("X", "dY"))
    model = _model()
    if wrap == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        module = DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        module = fully_shard(model, mesh=mesh)
    backend = _backend()
    _step(torch.compile(module, backend=backend), _local(_batch(), rank))
    return {"grads": _grads(model), "sites": sorted(s.name for s in backend.report.sites if s.precision == "nvfp4")}


def _tensor_parallel_quantize(rank: int) -> dict:
    group = distributed.group_name(dist.group.WORLD)
    w = _tp_weight()
    shards = {"rows": w[rank * HIDDEN // WORLD:(rank + 1) * HIDDEN // WORLD], "columns": w[:, rank * D:(rank + 1) * D]}
    out = {}
    for split, shard in shards.items():
        shard = shard.contiguous()
        out[split] = tuple(torch.ops.fp4.quantize_sharded(shard, "nvfp4", "16x16", "rne", 0, "", group))
        out[split + "_local"] = tuple(torch.ops.fp4.quantize(shard, "nvfp4", "16x16", "rne", 0, ""))
        out[split + "_tiled"] = tuple(torch.ops.fp4.quantize_sharded(shard, "nvfp4", "16x16", "rne", 0, "", group,
                                                                     layout="swizzled"))
    poisoned = shards["rows"].clone()
    if rank == 1:
        poisoned[0, 0] = float("nan")
    out["nan_amax"] = torch.ops.fp4.quantize_sharded(poisoned, "nvfp4", "1x16", "rne", 0, "", group)[2]
    return out


def _tensor_parallel_mlp(rank: int) -> dict:
    torch._dynamo.reset()
    distributed.clear()
    distributed.column_parallel("fc")
    distributed.row_parallel("out")
    model = _mlp_shard(rank)
    backend = _backend()
    x = _batch().requires_grad_()
    partial = torch.compile(model, backend=backend)(x)
    partial.backward(torch.ones_like(partial))  # d(sum of the all-reduced output)/d(partial) = 1
    y = partial.detach().clone()
    dist.all_reduce(y)
    dist.all_reduce(x.grad)
    code = "\n".join(g.code for g in backend.report.graphs if g.pass_name == "insert_quantize")
    return {
        "y": y, "dx": x.grad, "fc": model.fc.weight.grad, "out": model.out.weight.grad,
        "sharded_quantizes": code.count("fp4.quantize_sharded.default("),
    }


def _worker(rank: int, port: int, out_dir: str) -> None:
    gloo.init(rank, WORLD, port)
    try:
        results = {
            "ddp": _data_parallel(rank, "ddp", global_amax=False),
            "ddp_global_amax": _data_parallel(rank, "ddp", global_amax=True),
            "fsdp2_global_amax": _data_parallel(rank, "fsdp2", global_amax=True),
            "tp_quantize": _tensor_parallel_quantize(rank),
            "tp_mlp": _tensor_parallel_mlp(rank),
        }
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        distributed.clear()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out_dir = tmp_path_factory.mktemp("distributed")
    mp.spawn(_worker, args=(gloo.free_port(), str(out_dir)), nprocs=WORLD, join=True)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD)]


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _single_process(batches) -> dict:
    """Gradients of one process running ``batches`` one after the other, averaged."""
    model = _model()
    compiled = torch.compile(model, backend=_backend())
    for x in batches:
        _step(compiled, x)
    return {name: g / len(batches) for name, g in _grads(model).items()}


def _assert_grads_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


# ---------------------------------------------------------------------------------------------
# Data parallel
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow  # starts two processes
def test_ddp_equals_one_process_accumulating_the_micro_batches(ranks):
    """Each rank quantizes its micro-batch with its own amax: DDP's gradients are those of one process
    accumulating the two micro-batches."""
    want = _single_process([_local(_batch(), r) for r in range(WORLD)])
    for r in range(WORLD):
        assert ranks[r]["ddp"]["sites"] == [f"module.layers.{b}.{m}" for b in (0, 1) for m in ("fc", "out")]
        _assert_grads_close(ranks[r]["ddp"]["grads"], want)


@pytest.mark.parametrize("scenario", ["ddp_global_amax", "fsdp2_global_amax"])
def test_data_parallel_with_reduced_amax_equals_the_global_batch(ranks, scenario):
    """With the activation and gradient amaxes all-reduced over the data-parallel group, DDP and FSDP2
    quantize exactly as one process running the whole global batch."""
    want = _single_process([_batch()])
    for r in range(WORLD):
        _assert_grads_close(ranks[r][scenario]["grads"], want)
    assert ranks[0]["fsdp2_global_amax"]["sites"] == ["layers.0.fc", "layers.0.out", "layers.1.fc", "layers.1.out"]


# ---------------------------------------------------------------------------------------------
# Tensor parallel
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("split", ["rows", "columns"])
def test_sharded_weight_quantizes_like_the_full_weight(ranks, split):
    full = formats.quantize(_tp_weight(), "nvfp4", "16x16", "rne")
    codes, scales = full.codes(), full.scales.view(torch.uint8)
    for r in range(WORLD):
        data, shard_scales, amax = ranks[r]["tp_quantize"][split]
        if split == "rows":
            rows = slice(r * HIDDEN // WORLD, (r + 1) * HIDDEN // WORLD)
            want_codes, want_scales = codes[rows], scales[rows]
        else:
            want_codes, want_scales = codes[:, r * D:(r + 1) * D], scales[:, r * D // 16:(r + 1) * D // 16]
        assert torch.equal(formats.unpack_e2m1(data), want_codes)
        assert torch.equal(shard_scales, want_scales)
        assert torch.equal(amax, full.amax)
        # For a CUTLASS GEMM: the same quantization, its scales in the 128x4 tiled layout.
        tiled = ranks[r]["tp_quantize"][split + "_tiled"]
        assert torch.equal(tiled[0], data) and torch.equal(tiled[2], amax)
        assert torch.equal(tiled[1], formats.swizzle_scales(shard_scales))
    # Without the reduction, the rank holding the smaller values picks a different scale.
    local_amaxes = [ranks[r]["tp_quantize"][split + "_local"][2] for r in range(WORLD)]
    assert any(not torch.equal(a, full.amax) for a in local_amaxes)


def test_nan_on_one_rank_reaches_every_shard(ranks):
    for r in range(WORLD):
        assert torch.isnan(ranks[r]["tp_quantize"]["nan_amax"])


def test_tensor_parallel_mlp_equals_the_full_mlp(ranks):
    model = _full_mlp()
    x = _batch().requires_grad_()
    y = torch.compile(model, backend=_backend())(x)
    y.backward(torch.ones_like(y))
    for r in range(WORLD):
        got = ranks[r]["tp_mlp"]
        assert got["sharded_quantizes"] == 8  # fc: W and dY in its 3 GEMMs (4); out: X and W (4)
        rows = slice(r * HIDDEN // WORLD, (r + 1) * HIDDEN // WORLD)
        torch.testing.assert_close(got["y"], y.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["dx"], x.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["fc"], model.fc.weight.grad[rows], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["out"], model.out.weight.grad[:, rows], rtol=1e-5, atol=1e-6)
