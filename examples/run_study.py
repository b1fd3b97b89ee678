"""Run the convergence study: every precision configuration of docs/convergence.md, side by side.

Starts one ``train_gpt.py`` process per configuration, ``--parallel`` at a time, all with the same
model, data, seed and schedule (the arguments after ``--``), writes ``OUT_DIR/NAME.json`` and
``OUT_DIR/NAME.log`` for each, shows one status line per run while they train, and finishes with the
plots and the table of ``plot_runs.py``. Small models leave most of a large GPU idle, so several runs
on one GPU finish sooner than the same runs one after another (each run's tokens/s is then that of a
shared GPU).

    python examples/run_study.py --out-dir runs/small --parallel 9 -- \\
        --preset small --batch-size 64 --steps 3000 --include-tests --eval-every 100
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

HERE = Path(__file__).resolve().parent

# name -> train_gpt.py flags; "{switch}" is replaced by --bf16-switch-at's step.
CONFIGS = {
    "bf16": ["--precision", "bf16"],
    "bf16-seed1": ["--precision", "bf16", "--seed", "1"],
    "nvfp4": ["--precision", "nvfp4"],
    "mxfp4": ["--precision", "mxfp4"],
    "nvfp4-all-fp4": ["--precision", "nvfp4", "--all-fp4"],
    "nvfp4-no-rht": ["--precision", "nvfp4", "--no-rht"],
    "nvfp4-no-sr": ["--precision", "nvfp4", "--no-sr"],
    "nvfp4-no-2d": ["--precision", "nvfp4", "--no-2d"],
    "nvfp4-bf16-switch": ["--precision", "nvfp4", "--bf16-switch-at", "{switch}"],
    "nvfp4-fwd-only": ["--precision", "nvfp4", "--forward-only"],
}
DEFAULT_CONFIGS = [c for c in CONFIGS if c != "nvfp4-fwd-only"]


def parse_args(argv: Optional[Sequence[str]] = None):
    argv = list(sys.argv[1:] if argv is None else argv)
    train_args = []
    if "--" in argv:
        i = argv.index("--")
        argv, train_args = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", type=Path, default=Path("runs/study"))
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=DEFAULT_CONFIGS)
    p.add_argument("--parallel", type=int, default=1, help="runs at a time")
    p.add_argument("--switch-fraction", type=float, default=0.9,
                   help="nvfp4-bf16-switch: switch to BF16 after this fraction of --steps")
    p.add_argument("--refresh", type=float, default=10.0, help="seconds between status lines")
    args = p.parse_args(argv)
    if "--out" in train_args or "--name" in train_args:
        p.error("--out and --name are set per run by this script")
    if args.parallel < 1:
        p.error("--parallel must be at least 1")
    args.configs = list(dict.fromkeys(args.configs))  # each run once
    args.train_args = train_args
    return args


def _steps(train_args: list[str]) -> int:
    from train_gpt import parse_args as train_parse

    return train_parse(train_args).steps


def command(name: str, args) -> list[str]:
    flags = [f.replace("{switch}", str(int(_steps(args.train_args) * args.switch_fraction))) for f in CONFIGS[name]]
    return [sys.executable, str(HERE / "train_gpt.py"), *args.train_args, *flags, "--name", name,
            "--out", str(args.out_dir / f"{name}.json")]


def _last_line(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except FileNotFoundError:
        return "starting"
    return lines[-1][-100:] if lines else "starting"


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(HERE))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    pending = list(args.configs)
    running: dict[str, tuple[subprocess.Popen, float]] = {}
    logs = {}
    finished: dict[str, tuple[int, float]] = {}
    start = time.monotonic()
    last_status = 0.0
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        while pending or running:
            while pending and len(running) < args.parallel:
                name = pending.pop(0)
                logs[name] = log = open(args.out_dir / f"{name}.log", "w")
                cmd = command(name, args)
                log.write(" ".join(cmd) + "\n")
                log.flush()
                running[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), time.monotonic())
            for name, (proc, t0) in list(running.items()):
                if proc.poll() is not None:
                    finished[name] = (proc.returncode, time.monotonic() - t0)
                    del running[name]
                    logs.pop(name).close()
                    state = "done" if proc.returncode == 0 else f"FAILED (exit {proc.returncode}), see {name}.log"
                    print(f"[{time.monotonic() - start:6.0f} s] {name}: {state} in {finished[name][1]:.0f} s", flush=True)
            now = time.monotonic()
            if running and now - last_status >= args.refresh:
                last_status = now
                for name in running:
                    print(f"[{now - start:6.0f} s] {name:18s} {_last_line(args.out_dir / f'{name}.log')}", flush=True)
            time.sleep(0.5)
    finally:  # interrupted (Ctrl-C, an error): stop the runs still going
        for proc, _ in running.values():
            proc.terminate()
        for proc, _ in running.values():
            proc.wait()
        for log in logs.values():
            log.close()
    runs = [args.out_dir / f"{n}.json" for n in args.configs if finished[n][0] == 0]
    if runs:
        subprocess.run([sys.executable, str(HERE / "plot_runs.py"), *map(str, runs), "--out-dir", str(args.out_dir)],
                       check=False)
    failed = [n for n, (rc, _) in finished.items() if rc]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
