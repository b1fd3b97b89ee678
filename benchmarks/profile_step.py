"""Where the time of one training step goes: a torch.profiler breakdown of the benchmark GPT.

Prints the kernels and operators that take the most GPU time, the GPU-busy time of a step against
its wall time (a step whose GPU is idle much of the time is bound by the launching CPU), and the
number of kernel launches per step.

    python benchmarks/profile_step.py --variant nvfp4 --d-model 1024 --trace trace.json

The variant gets fp4compile's generic compile settings as in ``bench_e2e.py`` (``--generic off``: it does not).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_e2e import VARIANTS, training_step  # noqa: E402


def kernel_label(name: str, width: int = 110) -> str:
    """A kernel's name for the table: nested C++ template arguments elided (``reduce_kernel<128, 4,
    ReduceOp<...>>``, the kernel's own arguments kept), at most ``width`` characters."""
    out, depth = [], 0
    for ch in name:
        if ch == "<":
            depth += 1
            if depth <= 2:
                out.append("<" if depth == 1 else "<...")
        elif ch == ">" and depth:
            depth -= 1
            if depth <= 1:
                out.append(">")
        elif depth <= 1:
            out.append(ch)
    return "".join(out)[:width]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--variant", choices=VARIANTS, default="nvfp4",
                   help="as bench_e2e.py: -cg records the step in CUDA graphs, -dec / -packed set decoded operands on / off")
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rows", type=int, default=30)
    p.add_argument("--trace", help="write a Chrome trace here")
    p.add_argument("--generic", choices=("on", "off"), default="on",
                   help="as bench_e2e.py: on, the variant gets fp4compile's generic compile settings (BF16 through "
                        "fp4compile.Baseline); off, it does not")
    args = p.parse_args()

    if args.variant == "naive":
        p.error("the naive variant is measured by bench_e2e.py only")
    generic = args.generic == "on"
    profile_variant(args, generic)


def profile_variant(args, generic: bool) -> None:
    step, _, _ = training_step(args.variant, args.d_model, args.n_layer, args.batch, generic)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3 / args.steps
    events = prof.key_averages()
    # GPU kernels only: user annotations (such as the optimizer's step) span kernels counted on their own.
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False)]
    gpu_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / args.steps
    launches = sum(e.count for e in kernels) / args.steps
    print(f"{args.variant} d={args.d_model}: wall {wall_ms:.1f} ms/step (profiled), GPU busy {gpu_ms:.1f} ms/step, "
          f"{launches:.0f} kernel launches/step")
    print(f"\nGPU kernels by time (per step):\n{'ms':>8} {'%':>6} {'calls':>6}  kernel")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[: args.rows]:
        ms = e.self_device_time_total / 1e3 / args.steps
        print(f"{ms:8.2f} {100 * ms / gpu_ms:6.1f} {e.count // args.steps:6d}  {kernel_label(e.key)}")
    ops = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.key.startswith("fp4::")]
    if ops:
        print(f"\nfp4 operators (per step):\n{'CPU ms':>8} {'GPU ms':>8} {'calls':>6}  op")
        for e in sorted(ops, key=lambda e: -e.device_time_total):
            print(f"{e.cpu_time_total / 1e3 / args.steps:8.2f} {e.device_time_total / 1e3 / args.steps:8.2f} "
                  f"{e.count // args.steps:6d}  {e.key}")
    if args.trace:
        prof.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main()
