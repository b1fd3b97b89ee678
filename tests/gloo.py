"""Several CPU processes over gloo for the distributed tests: a free port, and each worker's set-up."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(rank: int, world: int, port: int) -> None:
    """Join the ``world`` processes on ``port`` as ``rank`` (one thread each: the 2-core CI machine)."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
