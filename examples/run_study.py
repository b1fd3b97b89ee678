"""Run the convergence study: every precision configuration of docs/convergence.md, side by side.

Starts one ``train_gpt.py`` process per configuration, ``--parallel`` at a time, all with the same
model, data, seed and schedule (the arguments after ``--``), writes ``OUT_DIR/NAME.json``,
``OUT_DIR/NAME.log`` and the checkpoint ``OUT_DIR/NAME.pt`` for each, shows one status line per run
while they train, and finishes with the plots and the table of ``plot_runs.py``. Small models leave
most of a large GPU idle, so several runs on one GPU finish sooner than the same runs one after another
(each run's tokens/s is then that of a shared GPU).

    python examples/run_study.py --out-dir runs/small --parallel 8 -- \\
        --preset small --batch-size 64 --steps 3000 --include-tests --eval-every 100

A study longer than one sitting: ``--time-limit SECONDS`` stops every run in time to write its
checkpoint; the same command again continues each run where it stopped (bit for bit where the device
is deterministic) and skips the finished ones (after checking they were trained with the same arguments).
The BF16-switch run is not trained from scratch: it
continues the NVFP4 run's checkpoint at the switch step (``--no-fork`` trains it from scratch).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

HERE = Path(__file__).resolve().parent

# name -> train_gpt.py flags; "{switch}" is replaced by --bf16-switch-at's step.
CONFIGS = {
    "bf16": ["--precision", "bf16"],
    "bf16-seed1": ["--precision", "bf16", "--seed", "1"],
    "nvfp4": ["--precision", "nvfp4"],
    "nvfp4-seed1": ["--precision", "nvfp4", "--seed", "1"],
    "mxfp4": ["--precision", "mxfp4"],
    "nvfp4-all-fp4": ["--precision", "nvfp4", "--all-fp4"],
    "nvfp4-no-rht": ["--precision", "nvfp4", "--no-rht"],
    "nvfp4-no-sr": ["--precision", "nvfp4", "--no-sr"],
    "nvfp4-no-2d": ["--precision", "nvfp4", "--no-2d"],
    "nvfp4-bf16-switch": ["--precision", "nvfp4", "--bf16-switch-at", "{switch}"],
    "nvfp4-fwd-only": ["--precision", "nvfp4", "--forward-only"],
}
DEFAULT_CONFIGS = [c for c in CONFIGS if c not in ("nvfp4-fwd-only", "nvfp4-seed1")]
# Runs identical to another one up to the switch step: they continue its checkpoint from there.
FORKS = {"nvfp4-bf16-switch": "nvfp4"}


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
    p.add_argument("--no-fork", action="store_true",
                   help="train nvfp4-bf16-switch from scratch instead of from nvfp4's checkpoint at the switch")
    p.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="stop the runs in time to checkpoint them (and plot) within this wall time; "
                        "the same command again continues them")
    p.add_argument("--refresh", type=float, default=10.0, help="seconds between status lines")
    args = p.parse_args(argv)
    for flag in ("--out", "--name", "--checkpoint", "--resume", "--save-at", "--time-limit"):
        if flag in train_args:
            p.error(f"{flag} is set per run by this script")
    if args.parallel < 1:
        p.error("--parallel must be at least 1")
    args.configs = list(dict.fromkeys(args.configs))  # each run once
    args.train_args = train_args
    args.steps = _steps(train_args)  # parsed once: the scheduling loop asks for the switch step often
    if "nvfp4-bf16-switch" in args.configs and not 0 < switch_step(args) < args.steps:
        p.error(f"--switch-fraction {args.switch_fraction} of {args.steps} steps gives switch step "
                f"{switch_step(args)}; it must fall inside the run")
    return args


def _steps(train_args: list[str]) -> int:
    from train_gpt import parse_args as train_parse

    return train_parse(train_args).steps


def switch_step(args) -> int:
    return int(args.steps * args.switch_fraction)


def fork_parent(name: str, args) -> Optional[str]:
    """The run ``name`` continues from (its checkpoint at the switch step), or None."""
    parent = FORKS.get(name)
    return parent if name in args.configs and parent in args.configs and not args.no_fork else None


def checkpoint(out_dir: Path, name: str) -> Path:
    return out_dir / f"{name}.pt"


def fork_checkpoint(name: str, args) -> Path:
    from train_gpt import checkpoint_path_at

    return checkpoint_path_at(checkpoint(args.out_dir, fork_parent(name, args)), switch_step(args))


def config_flags(name: str, args) -> list[str]:
    """The train_gpt.py flags of configuration ``name`` in this study (its switch step filled in)."""
    return [f.replace("{switch}", str(switch_step(args))) for f in CONFIGS[name]]


def command(name: str, args, time_limit: Optional[float] = None) -> list[str]:
    """The train_gpt.py command line of run ``name``: resumed from its checkpoint when it has one."""
    cmd = [sys.executable, str(HERE / "train_gpt.py"), *args.train_args, *config_flags(name, args), "--name", name,
           "--out", str(args.out_dir / f"{name}.json"), "--checkpoint", str(checkpoint(args.out_dir, name))]
    if any(fork_parent(child, args) == name for child in FORKS):
        cmd += ["--save-at", str(switch_step(args))]
    if checkpoint(args.out_dir, name).exists():
        cmd += ["--resume", str(checkpoint(args.out_dir, name))]
    elif fork_parent(name, args):
        cmd += ["--resume", str(fork_checkpoint(name, args))]
    if time_limit is not None:
        cmd += ["--time-limit", f"{time_limit:.0f}"]
    return cmd


def finished_before(out_dir: Path, name: str) -> bool:
    """Whether an earlier invocation completed run ``name`` (its log has a summary)."""
    try:
        return json.loads((out_dir / f"{name}.json").read_text()).get("summary") is not None
    except (FileNotFoundError, json.JSONDecodeError):
        return False


def check_finished_runs(args, names: list[str]) -> None:
    """Exit with an error naming the difference when a finished run in --out-dir was trained with other
    arguments than this study would give it (it would otherwise be skipped and plotted as if it matched)."""
    from train_gpt import parse_args as train_args, run_differences

    for name in names:
        saved = json.loads((args.out_dir / f"{name}.json").read_text())["args"]
        wanted = train_args([*args.train_args, *config_flags(name, args), "--name", name])
        diffs = run_differences(wanted, saved, what="finished run")
        if wanted.bf16_switch_at != saved.get("bf16_switch_at"):
            diffs.append(f"--bf16-switch-at {wanted.bf16_switch_at!r} (finished run: {saved.get('bf16_switch_at')!r})")
        if diffs:
            raise SystemExit(
                f"run_study.py: error: {args.out_dir / (name + '.json')} is a finished run with other training "
                f"arguments: {'; '.join(diffs)}. Use another --out-dir, or move that run away."
            )


class _SigtermFlag:
    """SIGTERM handler that only records the signal: the scheduling loop checks it between its steps and
    exits there, so that a run is never started without being registered for the clean-up."""

    def __init__(self):
        self.received = False

    def __call__(self, signum, frame):
        self.received = True

    def exit_if_received(self):
        if self.received:
            raise SystemExit(128 + signal.SIGTERM)


def _last_line(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except FileNotFoundError:
        return "starting"
    return lines[-1][-100:] if lines else "starting"


# Seconds a run keeps in hand under --time-limit: its checkpoint and log, and then the plots.
_MARGIN_S = 30.0
# A run is not started with less time than this: reading the corpus and compiling come first.
_MIN_RUN_S = 60.0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(HERE))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    done = [n for n in args.configs if finished_before(args.out_dir, n)]
    check_finished_runs(args, done)
    for name in done:
        print(f"{name}: finished earlier ({name}.json), skipped", flush=True)
    pending = [n for n in args.configs if n not in done]
    running: dict[str, tuple[subprocess.Popen, float]] = {}
    previous_handler = None
    sigterm = _SigtermFlag()
    if threading.current_thread() is threading.main_thread():
        # SIGTERM ends this loop through its ``finally``, which passes the signal on to the runs.
        previous_handler = signal.signal(signal.SIGTERM, sigterm)
    logs = {}
    ended: dict[str, tuple[int, float]] = {}
    start = time.monotonic()
    last_status = 0.0
    env = dict(os.environ, PYTHONUNBUFFERED="1")

    def ready(name: str) -> bool:
        """A fork starts once its parent's checkpoint is there (or its own, from an earlier invocation)."""
        return (not fork_parent(name, args) or checkpoint(args.out_dir, name).exists()
                or fork_checkpoint(name, args).exists())

    try:
        while pending or running:
            sigterm.exit_if_received()
            for name in [n for n in pending if not ready(n) and fork_parent(n, args) not in pending
                         and fork_parent(n, args) not in running]:
                pending.remove(name)  # the parent ended without reaching the switch step
                print(f"{name}: not started, {fork_parent(name, args)} ended without its checkpoint at step "
                      f"{switch_step(args)}", flush=True)
            startable = [n for n in pending if ready(n)]
            while startable and len(running) < args.parallel:
                name = startable.pop(0)
                pending.remove(name)
                limit = None
                if args.time_limit is not None:
                    limit = args.time_limit - (time.monotonic() - start) - _MARGIN_S
                    if limit < _MIN_RUN_S:
                        print(f"{name}: not started, {max(0.0, limit):.0f} s left (run the same command again)",
                              flush=True)
                        continue
                logs[name] = log = open(args.out_dir / f"{name}.log", "a")
                cmd = command(name, args, limit)
                log.write(" ".join(cmd) + "\n")
                log.flush()
                running[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), time.monotonic())
                sigterm.exit_if_received()
            for name, (proc, t0) in list(running.items()):
                if proc.poll() is not None:
                    ended[name] = (proc.returncode, time.monotonic() - t0)
                    del running[name]
                    logs.pop(name).close()
                    if proc.returncode:
                        state = f"FAILED (exit {proc.returncode}), see {name}.log"
                    elif finished_before(args.out_dir, name):
                        state = "done"
                    else:
                        state = "stopped by the time limit (run the same command again to continue)"
                    print(f"[{time.monotonic() - start:6.0f} s] {name}: {state} after {ended[name][1]:.0f} s", flush=True)
            now = time.monotonic()
            if running and now - last_status >= args.refresh:
                last_status = now
                for name in running:
                    print(f"[{now - start:6.0f} s] {name:18s} {_last_line(args.out_dir / f'{name}.log')}", flush=True)
            time.sleep(0.5)
    finally:  # interrupted (SIGTERM, Ctrl-C, an error): stop the runs still going; on SIGTERM each run
        # writes its checkpoint after its step in progress (Ctrl-C reaches the runs themselves first)
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean-up short
        for proc, _ in running.values():
            proc.terminate()
        for proc, _ in running.values():
            proc.wait()
        for log in logs.values():
            log.close()
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)
    complete = [n for n in args.configs if finished_before(args.out_dir, n)]
    if complete:
        subprocess.run([sys.executable, str(HERE / "plot_runs.py"), *(str(args.out_dir / f"{n}.json") for n in complete),
                        "--out-dir", str(args.out_dir)], check=False)
    failed = [n for n, (rc, _) in ended.items() if rc]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
