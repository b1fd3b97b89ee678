"""FSDP2's all-gather of FP4 layers' weights: BF16 (as ``fully_shard`` gathers them) against NVFP4 codes and
scales (``fp4compile.enable_fp4_all_gather``).

Each rank builds the same stack of MLP blocks (Linear d -> 4d, Linear 4d -> d; every block's linears in
NVFP4), shards each block with ``fully_shard`` (``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``,
fp32 master weights) and unshards and reshards every block ``--iters`` times. It prints, per variant:
the bytes the all-gathers put in each rank's buffers for one gather of every block and per training
step (a forward and, with ``reshard_after_forward``, a backward gather), the time of one gather of all
blocks (FSDP2's unshard: for FP4 the amax all-reduce and each shard's quantization, the collective and
the copy-out; median over the iterations) and the part of it spent in the collectives themselves.
On CPU the processes talk over gloo; with ``--device cuda`` (one GPU per rank) over NCCL.

    python benchmarks/bench_all_gather.py --ranks 2 --d-model 512 --blocks 4
    torchrun is not needed: the script spawns its ranks itself.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.out(torch.nn.functional.gelu(self.fc(x)))


class Stack(nn.Module):
    def __init__(self, d: int, blocks: int):
        super().__init__()
        self.layers = nn.ModuleList([Block(d) for _ in range(blocks)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure(args, rank: int, device: torch.device, fp4: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import fp4compile

    torch.manual_seed(0)
    model = Stack(args.d_model, args.blocks).to(device)
    backend = fp4compile.Backend(high_precision_first_blocks=0, high_precision_last_blocks=0)
    if fp4:
        fp4compile.enable_fp4_all_gather(model, backend=backend)
    mesh = init_device_mesh(device.type, (args.ranks,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)

    collective = {"bytes": 0, "seconds": 0.0}
    original = dist.all_gather_single

    def counted(output_tensor, input_tensor, *a, **k):
        _sync(device)
        start = time.perf_counter()
        work = original(output_tensor, input_tensor, *a, **k)
        _sync(device)
        collective["seconds"] += time.perf_counter() - start
        collective["bytes"] += output_tensor.numel() * output_tensor.element_size()
        return work

    dist.all_gather_single = counted
    try:
        rounds, in_collectives, nbytes = [], [], 0
        for i in range(args.warmup + args.iters):
            collective.update(bytes=0, seconds=0.0)
            dist.barrier()
            _sync(device)
            start = time.perf_counter()
            for layer in model.layers:
                layer.unshard()
                layer.reshard()
            _sync(device)
            if i >= args.warmup:
                rounds.append(time.perf_counter() - start)
                in_collectives.append(collective["seconds"])
            nbytes = collective["bytes"]
    finally:
        dist.all_gather_single = original
    return {"bytes_per_gather": nbytes, "gather_s": statistics.median(rounds),
            "collective_s": statistics.median(in_collectives)}


def _worker(rank: int, args, port: int, results) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.ranks))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=args.ranks)
    try:
        out = {variant: _measure(args, rank, device, variant == "fp4") for variant in ("bf16", "fp4")}
        if rank == 0:
            results.update(out)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        parser.error(f"--device cuda takes one GPU per rank: {args.ranks} ranks, {torch.cuda.device_count()} GPUs")
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(args, _free_port(), results), nprocs=args.ranks, join=True)
        results = dict(results)
    params = args.blocks * 8 * args.d_model * args.d_model
    transport = "NCCL" if args.device == "cuda" else "gloo"
    print(f"{args.ranks} ranks ({args.device}, {transport}), {args.blocks} blocks of d={args.d_model}: "
          f"{params / 1e6:.2f} M linear weights, BF16 gather (fp32 master weights); biases gather in BF16 either way")
    print(f"{'variant':8} {'bytes/gather':>13} {'bytes/step':>13} {'gather ms':>10} {'in collective ms':>17}")
    for variant, row in results.items():
        print(f"{variant:8} {row['bytes_per_gather']:>13,} {2 * row['bytes_per_gather']:>13,} "
              f"{1e3 * row['gather_s']:>10.2f} {1e3 * row['collective_s']:>17.2f}")
    bf16, fp4 = results["bf16"], results["fp4"]
    print(f"FP4 / BF16: bytes {fp4['bytes_per_gather'] / bf16['bytes_per_gather']:.3f}, "
          f"gather time {fp4['gather_s'] / bf16['gather_s']:.2f}, collective time "
          f"{fp4['collective_s'] / bf16['collective_s']:.2f} (bytes/step: a forward and a backward gather, "
          "reshard_after_forward=True)")
    return results


if __name__ == "__main__":
    main()
