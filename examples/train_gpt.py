"""Train a small GPT on the Python standard library's source, in BF16 or in FP4 through fp4compile.

The default (no arguments) is a CPU-sized run of the "tiny" preset that takes a minute or two on two
cores; the same script runs the GPU study with ``--preset small|medium``. Examples:

    python examples/train_gpt.py                                    # tiny, high precision, CPU
    python examples/train_gpt.py --precision nvfp4 --out runs/nvfp4.json
    python examples/train_gpt.py --precision nvfp4 --no-rht --out runs/nvfp4-no-rht.json
    python examples/train_gpt.py --preset small --steps 3000 --precision nvfp4 --bf16-switch-at 2700
    python examples/train_gpt.py --preset tiny-moe --precision nvfp4          # mixture of experts
    python examples/plot_runs.py runs/*.json --out-dir runs/plots

``--precision bf16`` means "no FP4": the model is compiled with plain ``torch.compile`` and its math
runs in the autocast dtype (BF16 on CUDA, FP32 on CPU unless ``--autocast``). FP4 runs compile through
``fp4compile.Backend`` with a Recipe built from the flags. Every run with the same seed sees the same
initial weights and the same batches in the same order.

On a CPU shared with other jobs, ``--threads 1`` can be several times faster than the default thread
count: with more threads than free cores, the threads wait for each other at every operation.

The JSON written by ``--out`` holds the arguments, model and corpus sizes, the recipe, per-step train
loss, learning rate and throughput, the periodic validation losses and a summary; it is rewritten at
every evaluation, so an interrupted run can still be plotted.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import signal
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

# Run as a script from any directory: the sibling modules live next to this file.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from corpus import SOURCES, batches, fixed_batches, load_corpus  # noqa: E402
from gpt import GPT, PRESETS  # noqa: E402

# Peak learning rates that train well at the presets' default batch sizes.
DEFAULT_LR = {"tiny": 2e-3, "small": 1e-3, "medium": 6e-4, "tiny-moe": 2e-3}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show a default only where the help text does not already explain it."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Train a small GPT on the stdlib corpus in BF16, NVFP4 or MXFP4.",
        formatter_class=_HelpFormatter,
    )
    g = p.add_argument_group("precision")
    g.add_argument("--precision", choices=("bf16", "nvfp4", "mxfp4"), default="bf16",
                   help="bf16: no FP4 (plain torch.compile); nvfp4/mxfp4: fp4compile.Backend")
    g.add_argument("--no-rht", action="store_true", help="no random Hadamard transform on wgrad inputs")
    g.add_argument("--no-sr", action="store_true", help="round gradients to nearest instead of stochastically")
    g.add_argument("--no-2d", action="store_true", help="1x16 weight scaling instead of 16x16 blocks")
    g.add_argument("--block-scale-rule", choices=("6", "4/6"), default="6",
                   help="NVFP4 block scale rule: 6 (the recipe's) or 4/6 (Four Over Six, docs/numerics.md)")
    g.add_argument("--stats-every", type=int, default=0, metavar="K",
                   help="record quantization statistics (backend.collect_stats) every K steps into the run log's "
                        "'quant_stats'; 0: never")
    g.add_argument("--stats-steps", type=int, default=1, metavar="N", help="steps recorded each time (--stats-every)")
    g.add_argument("--all-fp4", action="store_true",
                   help="no high-precision first/last transformer blocks (lm_head/embeddings stay high precision)")
    g.add_argument("--bf16-switch-at", type=int, default=None, metavar="STEP",
                   help="step at which every GEMM goes back to high precision")
    g.add_argument("--forward-only", action="store_true",
                   help="quantize only the forward (fprop) GEMMs; gradients stay high precision")
    g.add_argument("--check-finite", action="store_true",
                   help="stop with the layer and operand name when a quantized tensor holds NaN/Inf (slow)")
    g.add_argument("--inner", choices=("inductor", "eager"), default=None,
                   help="compiler for everything that is not an FP4 GEMM (the whole model for bf16); "
                        "default: inductor on CUDA, eager on CPU")
    g.add_argument("--no-compile", action="store_true", help="bf16 only: run the model eagerly")
    g.add_argument("--cuda-graphs", action="store_true",
                   help="record the compiled steps in CUDA graphs (torch.compile mode='reduce-overhead'; "
                        "GPU and --inner inductor only): same numbers, far fewer kernel launches")
    g.add_argument("--autocast", action=argparse.BooleanOptionalAction, default=None,
                   help="BF16 autocast (default: on for CUDA, off for CPU)")
    g.add_argument("--eval-high-precision", action="store_true",
                   help="validate the uncompiled model (no FP4) instead of the compiled one")
    g.add_argument("--no-served-eval", action="store_true",
                   help="nvfp4: skip the final validation of the model as its exported checkpoint serves it "
                        "(W4A16 and W4A4, docs/export.md)")
    g.add_argument("--export", type=Path, default=None, metavar="DIR",
                   help="nvfp4: write the trained model as an NVFP4 (W4A4) compressed-tensors checkpoint here")

    g = p.add_argument_group("model and data")
    g.add_argument("--preset", choices=list(PRESETS), default="tiny",
                   help="tiny ~0.9M params (CPU), small ~26M, medium ~86M (GPU); tiny-moe: tiny with 8 experts per block")
    g.add_argument("--seq-len", type=int, default=None, help="default: the preset's seq_len")
    g.add_argument("--batch-size", type=int, default=16, help="sequences per micro-batch")
    g.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--tie-embeddings", action="store_true", help="lm_head shares tok_emb's weight")
    g.add_argument("--val-fraction", type=float, default=0.05, help="fraction of files held out")
    g.add_argument("--include-tests", action="store_true",
                   help="add the stdlib's test suites to the corpus (about 2.7x the tokens)")
    g.add_argument("--corpus", choices=SOURCES, default="stdlib",
                   help="stdlib: the standard library's .py files; stdlib+packages: also the installed "
                        "packages' (many more tokens, but machine dependent; see examples/corpus.py)")
    g.add_argument("--corpus-max-mb", type=float, default=None, metavar="MB",
                   help="cap the corpus at this many MB with a deterministic sample of files (default: all)")

    g = p.add_argument_group("optimization")
    g.add_argument("--steps", type=int, default=500, help="optimizer steps")
    g.add_argument("--lr", type=float, default=None, help=f"peak learning rate (default: per preset, {DEFAULT_LR})")
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr as a fraction of the peak")
    g.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: 10%% of --steps)")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW decay of matrices")
    g.add_argument("--grad-clip", type=float, default=1.0, help="gradient-norm clipping threshold, 0 disables")

    g = p.add_argument_group("run")
    g.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    g.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    g.add_argument("--seed", type=int, default=0, help="model init, data order and FP4 rounding seed")
    g.add_argument("--eval-every", type=int, default=100, help="validation every N steps and at the end; 0: never")
    g.add_argument("--eval-batches", type=int, default=8, help="fixed validation batches per evaluation")
    g.add_argument("--out", type=Path, default=None, help="write the run log here (e.g. runs/NAME.json)")
    g.add_argument("--name", default=None, help="run label for logs and plots (default: from the flags)")
    g.add_argument("--log-every", type=int, default=None,
                   help="progress line every N steps when stderr is not a terminal (default: steps/20)")
    g.add_argument("--quiet", action="store_true", help="no progress display, summary only")

    g = p.add_argument_group("checkpoints")
    g.add_argument("--checkpoint", type=Path, default=None, metavar="PATH",
                   help="write the training state here when the run stops early (--time-limit, SIGTERM) "
                        "and at the end")
    g.add_argument("--save-at", type=int, nargs="+", default=[], metavar="STEP",
                   help="also write PATH's stem + '.stepN.pt' after these steps (e.g. to fork a run there)")
    g.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="stop before a step that would end past this wall time (from the start of this "
                        "process; its first step always runs), write --checkpoint and the log; --resume "
                        "continues the run")
    g.add_argument("--resume", type=Path, default=None, metavar="PATH",
                   help="continue from a checkpoint: the same model, data, schedule and recipe (only "
                        "--bf16-switch-at may differ, at or after the checkpoint's step)")
    args = p.parse_args(argv)

    fp4_flags = [f for f, on in (("--no-rht", args.no_rht), ("--no-sr", args.no_sr), ("--no-2d", args.no_2d),
                                 ("--all-fp4", args.all_fp4), ("--forward-only", args.forward_only),
                                 ("--check-finite", args.check_finite),
                                 ("--bf16-switch-at", args.bf16_switch_at is not None)) if on]
    if args.precision == "bf16" and fp4_flags:
        p.error(f"{', '.join(fp4_flags)} only apply to --precision nvfp4/mxfp4")
    if args.export is not None and args.precision != "nvfp4":
        p.error("--export writes NVFP4 checkpoints: it needs --precision nvfp4")
    if args.precision != "bf16" and args.no_compile:
        p.error("--no-compile only applies to --precision bf16: FP4 runs through the compiler backend")
    if min(args.steps, args.batch_size, args.grad_accum, args.eval_batches) < 1 or args.eval_every < 0:
        p.error("--steps, --batch-size, --grad-accum and --eval-batches must be positive, --eval-every >= 0")
    if args.seq_len is not None and args.seq_len > PRESETS[args.preset].seq_len:
        p.error(f"--seq-len {args.seq_len} exceeds the {args.preset} preset's {PRESETS[args.preset].seq_len}")
    if (args.save_at or args.time_limit is not None) and args.checkpoint is None:
        p.error("--save-at and --time-limit need --checkpoint PATH")
    if any(not 0 < s < args.steps for s in args.save_at):
        p.error(f"--save-at steps must lie in 1..{args.steps - 1}, got {args.save_at}")
    if args.corpus_max_mb is not None and args.corpus_max_mb <= 0:
        p.error("--corpus-max-mb must be positive")
    return args


# Arguments that define the training a checkpoint belongs to: a resumed run must repeat them.
_RUN_DEFINING = (
    "precision", "no_rht", "no_sr", "no_2d", "all_fp4", "forward_only", "inner", "no_compile", "autocast",
    "preset", "seq_len", "batch_size", "grad_accum", "tie_embeddings", "val_fraction", "include_tests",
    "corpus", "corpus_max_mb", "steps", "lr", "min_lr_ratio", "warmup", "weight_decay", "grad_clip", "seed",
)


# Corpus figures that must match for a resumed run to read the same token stream and validation set.
_CORPUS_IDENTITY = ("source", "python_version", "train_files", "val_files", "train_tokens", "val_tokens")


def check_same_corpus(stats: dict, saved: dict, path: Path) -> None:
    """Raise ValueError when the corpus read now is not the one the checkpoint's run trained on
    (e.g. another machine's installed packages under --corpus stdlib+packages)."""
    diffs = [f"{k} {stats.get(k)!r} (checkpoint: {saved.get(k)!r})" for k in _CORPUS_IDENTITY if stats.get(k) != saved.get(k)]
    if diffs:
        raise ValueError(f"cannot resume from {path}: the corpus differs: " + "; ".join(diffs))


def run_differences(args: argparse.Namespace, saved: dict, what: str = "checkpoint") -> list[str]:
    """The run-defining arguments where ``args`` differs from ``saved`` (a run's recorded arguments)."""
    return [f"--{k.replace('_', '-')} {getattr(args, k)!r} ({what}: {saved.get(k)!r})"
            for k in _RUN_DEFINING if getattr(args, k) != saved.get(k)]


def check_resume(args: argparse.Namespace, saved: dict, step: int, path: Path) -> None:
    """Raise ValueError naming what differs when ``args`` cannot continue the checkpoint's run."""
    diffs = run_differences(args, saved)
    switch, saved_switch = args.bf16_switch_at, saved.get("bf16_switch_at")
    if switch != saved_switch and (
        (switch is not None and switch < step) or (saved_switch is not None and saved_switch <= step)
    ):
        diffs.append(f"--bf16-switch-at {switch!r} (checkpoint: {saved_switch!r}, saved after step {step})")
    if diffs:
        raise ValueError(f"cannot resume from {path}: " + "; ".join(diffs))


def device_change_note(saved_device, device) -> str:
    """A note when a run moves to another kind of device: it continues, but not with the bits an
    uninterrupted run would have (GEMM summation orders and kernels differ between devices)."""
    if saved_device is None or torch.device(saved_device).type == torch.device(device).type:
        return ""
    return (f"the checkpoint's run trained on {saved_device}, this one continues on {device}: the steps after "
            "the checkpoint will not have the bits of an uninterrupted run")


def run_name(args: argparse.Namespace) -> str:
    if args.name:
        return args.name
    parts = [args.preset, args.precision]
    for flag, on in (("no-rht", args.no_rht), ("no-sr", args.no_sr), ("no-2d", args.no_2d),
                     ("all-fp4", args.all_fp4), ("fwd-only", args.forward_only)):
        if on:
            parts.append(flag)
    if args.bf16_switch_at is not None:
        parts.append(f"bf16@{args.bf16_switch_at}")
    return "-".join(parts)


def lr_at(step: int, peak: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up to ``peak`` over ``warmup`` steps, then cosine decay to ``min_ratio * peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def make_recipe(args: argparse.Namespace):
    import fp4compile

    kwargs = dict(
        fmt=args.precision,
        rht=not args.no_rht,
        stochastic_rounding=not args.no_sr,
        weight_2d=not args.no_2d,
        seed=args.seed,
    )
    if args.block_scale_rule != "6":
        kwargs["block_scale_rule"] = args.block_scale_rule
    if args.all_fp4:
        kwargs.update(high_precision_first_blocks=0, high_precision_last_blocks=0)
    if args.bf16_switch_at is not None:
        kwargs["switch_to_high_precision_at"] = args.bf16_switch_at
    if args.forward_only:
        kwargs["quantize_backward"] = False
    if args.check_finite:
        kwargs["check_finite"] = True
    return fp4compile.Recipe(**kwargs)


def _emulated_gemm(device) -> str | None:
    """Which GEMM runs emulated FP4 products on a CUDA device (cuBLASLt with alpha, or torch.mm plus an epilogue)."""
    if device.type != "cuda":
        return None
    from fp4compile.codegen import cublaslt_gemm

    return cublaslt_gemm.describe()


def _recipe_record(recipe) -> object:
    if recipe is None:
        return None
    return json.loads(json.dumps(dataclasses.asdict(recipe), default=str))


def _format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """One updating status line on a terminal (carriage returns), periodic plain lines otherwise."""

    def __init__(self, total: int, quiet: bool, log_every: Optional[int]):
        self.total = total
        self.quiet = quiet
        self.tty = sys.stderr.isatty()
        self.log_every = log_every or max(1, total // 20)
        self._last_draw = 0.0
        self._width = 0

    def update(self, step: int, loss: float, tok_per_s: float, eta_s: Optional[float]) -> None:
        if self.quiet:
            return
        done = step + 1
        eta = _format_duration(eta_s) if eta_s is not None else "?"
        line = f"step {done:>{len(str(self.total))}}/{self.total} | loss {loss:.4f} | {tok_per_s:,.0f} tok/s | ETA {eta}"
        if self.tty:
            now = time.monotonic()
            if now - self._last_draw < 0.1 and done != self.total:
                return
            self._last_draw = now
            sys.stderr.write("\r" + line.ljust(self._width))
            self._width = len(line)
            sys.stderr.flush()
        elif done % self.log_every == 0 or done == self.total or done == 1:
            print(line, file=sys.stderr, flush=True)

    def message(self, text: str) -> None:
        """Print a full line without garbling the status line."""
        if self.tty and self._width and not self.quiet:
            sys.stderr.write("\r" + " " * self._width + "\r")
            sys.stderr.flush()
            self._width = 0
        print(text, flush=True)

    def close(self) -> None:
        if self.tty and self._width and not self.quiet:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _write_json(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1, allow_nan=True))
    os.replace(tmp, path)


def checkpoint_path_at(checkpoint: Path, step: int) -> Path:
    """Where ``--save-at STEP`` writes: the checkpoint's stem + '.stepN.pt' beside it."""
    return checkpoint.with_name(f"{checkpoint.stem}.step{step}.pt")


def _save_checkpoint(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def _args_record(args: argparse.Namespace) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Train one run; returns its log record (the JSON ``--out`` writes)."""
    with contextlib.ExitStack() as cleanup:  # e.g. the SIGTERM handler, put back after the last write
        return _train(argv, cleanup)


def _train(argv: Optional[Sequence[str]], cleanup: contextlib.ExitStack) -> dict:
    process_start = time.perf_counter()
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.threads:
        torch.set_num_threads(args.threads)
    use_autocast = args.autocast if args.autocast is not None else device.type == "cuda"
    # On CPU, Inductor's first compile (C++ codegen, about a minute cold) would dominate a run of a
    # minute or two, and it does not speed up a model this small.
    inner = args.inner or ("inductor" if device.type == "cuda" else "eager")
    if args.cuda_graphs and (device.type != "cuda" or inner != "inductor" or args.no_compile):
        raise SystemExit(f"train_gpt.py: error: --cuda-graphs needs a CUDA device and the Inductor inner compiler "
                         f"(got device {device}, inner {inner!r}{', --no-compile' if args.no_compile else ''})")
    mode = "reduce-overhead" if args.cuda_graphs else None
    name = run_name(args)
    config = dataclasses.replace(
        PRESETS[args.preset],
        seq_len=args.seq_len or PRESETS[args.preset].seq_len,
        tie_embeddings=args.tie_embeddings,
    )
    peak_lr = args.lr if args.lr is not None else DEFAULT_LR[args.preset]
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 10)
    tokens_per_step = args.batch_size * config.seq_len * args.grad_accum

    load_start = time.perf_counter()
    corpus = load_corpus(
        val_fraction=args.val_fraction, include_tests=args.include_tests, packages=args.corpus == "stdlib+packages",
        max_bytes=None if args.corpus_max_mb is None else int(args.corpus_max_mb * 1e6),
    )
    load_s = time.perf_counter() - load_start
    torch.manual_seed(args.seed)
    model = GPT(config).to(device)
    optimizer = _make_optimizer(model, peak_lr, args.weight_decay, device)

    recipe = backend = None
    if args.precision == "bf16":
        compiled = model if args.no_compile else torch.compile(model, backend=inner, dynamic=False, mode=mode)
    else:
        import fp4compile

        recipe = make_recipe(args)
        backend = fp4compile.Backend(recipe=recipe, inner=inner, mode=mode)
        # The SR stream is process-global: start it where a fresh process starts it, so that two runs
        # in one process (tests, notebooks) give the same bits as two processes.
        fp4compile.manual_seed(0)
        compiled = torch.compile(model, backend=backend, dynamic=False)

    autocast = (
        (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if use_autocast else contextlib.nullcontext
    )
    checkpoint = None
    start_step = 0
    if args.resume is not None:
        checkpoint = torch.load(args.resume, map_location=device)
        start_step = int(checkpoint["step"])
        try:
            check_resume(args, checkpoint["args"], start_step, args.resume)
            check_same_corpus(corpus.stats(), checkpoint["record"]["corpus"], args.resume)
        except ValueError as error:
            raise SystemExit(f"train_gpt.py: error: {error}") from None
        note = device_change_note(checkpoint["record"].get("env", {}).get("device"), device)
        if note:
            print(f"train_gpt.py: note: {note}", flush=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        if backend is not None:
            backend.load_state_dict(checkpoint["backend"])
        torch.set_rng_state(checkpoint["torch_rng"].cpu())
        if device.type == "cuda" and checkpoint.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(checkpoint["cuda_rng"].cpu(), device)
    train_stream = batches(corpus.train, args.batch_size, config.seq_len, seed=args.seed, device=device,
                           skip=start_step * args.grad_accum)
    # The validation set is fixed (its own seed) so every run is scored on the same tokens.
    val_set = fixed_batches(corpus.val, args.eval_batches, args.batch_size, config.seq_len, device=device)

    print(f"run {name}: {args.preset} GPT, {model.num_params():,} parameters "
          f"({model.num_params(non_embedding=True):,} non-embedding), "
          f"{config.n_layer} layers, d_model {config.d_model}, seq_len {config.seq_len}", flush=True)
    print(f"{corpus.describe()} (read in {load_s:.1f} s)", flush=True)
    high = "bf16 (autocast)" if use_autocast else "fp32"
    where = (f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda"
             else f"{device} ({torch.get_num_threads()} thread{'s' if torch.get_num_threads() > 1 else ''})")
    if args.precision == "bf16":
        how = "not compiled" if args.no_compile else f"torch.compile(backend={inner!r}{', mode=' + repr(mode) if mode else ''})"
        print(f"precision: no FP4, math in {high}, {how}, on {where}", flush=True)
    else:
        print(f"precision: {args.precision} through fp4compile.Backend(inner={inner!r}"
              f"{', mode=' + repr(mode) if mode else ''}), high-precision math in {high}, on {where}", flush=True)
    epochs = args.steps * tokens_per_step / corpus.train.numel()
    print(f"schedule: {args.steps} steps x {tokens_per_step:,} tokens = {args.steps * tokens_per_step:,} tokens "
          f"({epochs:.2f} epochs of the training split), "
          f"AdamW lr {peak_lr:g}, warm-up {warmup}, cosine to {args.min_lr_ratio:g}x", flush=True)

    record = {
        "name": name,
        "args": _args_record(args),
        "model": {**dataclasses.asdict(config), "preset": args.preset, "params": model.num_params(),
                  "non_embedding_params": model.num_params(non_embedding=True)},
        "corpus": corpus.stats(),
        "recipe": _recipe_record(backend.resolved_recipe() if backend is not None else None),
        "schedule": {"peak_lr": peak_lr, "warmup": warmup, "min_lr_ratio": args.min_lr_ratio,
                     "steps": args.steps, "tokens_per_step": tokens_per_step},
        "inner": None if args.no_compile else inner,
        "cuda_graphs": args.cuda_graphs,
        "autocast": use_autocast,
        "env": {"torch": str(torch.__version__), "python": platform.python_version(), "device": str(device),
                "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine(),
                "threads": torch.get_num_threads(),
                "emulated_gemm": _emulated_gemm(device)},
        "precision_table": None,
        "quant_stats": [],  # --stats-every: rows of backend.report.stats(reduce=None), with the training step
        # Optimizer steps completed when every GEMM went back to high precision (--bf16-switch-at).
        "high_precision_from_step": None,
        "train": {"step": [], "loss": [], "lr": [], "tokens_per_s": [], "elapsed_s": []},
        "val": {"step": [], "loss": []},
        # One entry per process that trained this run: steps it ran, its first step (with compilation).
        "segments": [],
        "summary": None,
    }
    elapsed_before = 0.0  # wall time of the earlier segments of a resumed run
    steady_tokens, steady_time = 0, 0.0
    eval_s = 0.0  # the last evaluation's time (for --time-limit)
    first_step_s = None
    if checkpoint is not None:
        saved = checkpoint["record"]
        for key in ("train", "val", "segments", "precision_table", "high_precision_from_step"):
            record[key] = saved[key]
        elapsed_before = checkpoint["elapsed_s"]
        steady_tokens, steady_time = checkpoint["steady"]
        eval_s = checkpoint.get("eval_s", 0.0)
        first_step_s = saved["segments"][0]["first_step_s"] if saved["segments"] else None
        print(f"resumed from {args.resume} after step {start_step} (run {saved['name']})", flush=True)
        if backend is not None and backend.high_precision and record["high_precision_from_step"] is None:
            record["high_precision_from_step"] = start_step
            print(f"step {start_step}: every GEMM runs in high precision from the next step on", flush=True)
    segment = {"resumed_from": str(args.resume) if args.resume else None, "start_step": start_step,
               "end_step": start_step, "first_step_s": None, "wall_s": 0.0}
    record["segments"].append(segment)

    def training_state(steps_done: int, elapsed: float) -> dict:
        return {
            "step": steps_done,
            "args": _args_record(args),
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "backend": backend.state_dict() if backend is not None else None,
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
            "record": record,
            "steady": (steady_tokens, steady_time),
            "eval_s": eval_s,
            "elapsed_s": elapsed,
        }

    # Validation runs the compiled model (FP4 forward for FP4 runs; a no_grad recompile) unless
    # --eval-high-precision asks for the plain module.
    eval_model = model if args.eval_high_precision else compiled

    def evaluate() -> float:
        model.eval()
        total = 0.0
        with torch.no_grad(), autocast():
            for x, y in val_set:
                total += eval_model(x, y)[1].item()
        model.train()
        return total / len(val_set)

    if (checkpoint is not None and backend is not None and record["high_precision_from_step"] == start_step
            and record["val"]["step"] and record["val"]["step"][-1] == start_step - 1):
        # A run forked at its BF16 switch: without the stop, the evaluation after step start_step would
        # have run after the switch, in high precision. Do it again that way.
        record["val"]["loss"][-1] = evaluate()
        print(f"step {start_step}: val loss {record['val']['loss'][-1]:.4f} (evaluated again after the switch)",
              flush=True)

    progress = Progress(args.steps, args.quiet, args.log_every)
    start = time.perf_counter()
    diverged = stopped = False
    step_s = 0.0
    # With a checkpoint to write, SIGTERM (a scheduler's or run_study's stop) ends the run like the time
    # limit: after the step in progress, with its checkpoint.
    signalled = _catch_sigterm(args.checkpoint is not None, cleanup)
    stats_from = None  # the first step of the current statistics window (--stats-every)
    for step in range(start_step, args.steps):
        if signalled:
            stopped = True
            break
        eval_due = bool(args.eval_every) and ((step + 1) % args.eval_every == 0 or step == args.steps - 1)
        if args.time_limit is not None and step > start_step:
            # Stop before a step (and its evaluation) that would end past the limit. A step is predicted
            # by the steady average (the first step of a process includes compilation); an evaluation by
            # the last one, or before any by one training step per validation batch.
            per_step = steady_time / (steady_tokens / tokens_per_step) if steady_tokens else step_s
            eval_guess = eval_s or per_step * len(val_set)
            if time.perf_counter() - process_start + per_step + (eval_guess if eval_due else 0.0) > args.time_limit:
                stopped = True
                break
        step_start = time.perf_counter()
        if args.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()  # this step's replays may overwrite the last one's outputs
        if backend is not None and args.stats_every and step % args.stats_every == 0:
            stats_from = step
            backend.collect_stats(args.stats_steps)  # the next --stats-steps steps record their statistics
        lr = lr_at(step, peak_lr, warmup, args.steps, args.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum = 0.0
        for _ in range(args.grad_accum):
            x, y = next(train_stream)
            with autocast():
                loss = compiled(x, y)[1] / args.grad_accum
            loss.backward()
            loss_sum += loss.detach()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if backend is not None:
            backend.step()
            if stats_from is not None and step + 1 - stats_from == args.stats_steps:  # read once the window is full
                record["quant_stats"] += [{**r, "step": stats_from + r["step"]} for r in backend.report.stats(None)]
            if backend.high_precision and record["high_precision_from_step"] is None:
                record["high_precision_from_step"] = step + 1
                progress.message(f"step {step + 1}: every GEMM runs in high precision from the next step on")
        loss_value = float(loss_sum)  # synchronizes with the device, so the step time below is real
        step_s = time.perf_counter() - step_start
        elapsed = elapsed_before + time.perf_counter() - start

        if step == start_step:
            segment["first_step_s"] = step_s  # includes compilation
            if step == 0:
                first_step_s = step_s
            if backend is not None and record["precision_table"] is None:
                record["precision_table"] = str(backend.report.precision_table())
                progress.message("precision plan:\n" + record["precision_table"])
        else:
            steady_tokens += tokens_per_step
            steady_time += step_s
        tok_per_s = tokens_per_step / step_s
        train = record["train"]
        train["step"].append(step)
        train["loss"].append(loss_value)
        train["lr"].append(lr)
        train["tokens_per_s"].append(tok_per_s)
        train["elapsed_s"].append(elapsed)

        avg_tok_per_s = steady_tokens / steady_time if steady_time else tok_per_s
        eta = (args.steps - step - 1) * tokens_per_step / avg_tok_per_s if steady_time else None
        progress.update(step, loss_value, avg_tok_per_s, eta)

        if not math.isfinite(loss_value):
            diverged = True
            progress.message(f"step {step + 1}: loss is {loss_value}; stopping")
            break
        last = step == args.steps - 1
        segment["end_step"] = step + 1
        segment["wall_s"] = time.perf_counter() - start
        if eval_due:
            eval_start = time.perf_counter()
            val_loss = evaluate()
            eval_s = time.perf_counter() - eval_start
            record["val"]["step"].append(step)
            record["val"]["loss"].append(val_loss)
            progress.message(f"step {step + 1}: train loss {loss_value:.4f}, val loss {val_loss:.4f}")
            if args.out and not last:
                _write_json(args.out, record)
        if step + 1 in args.save_at:
            path = checkpoint_path_at(args.checkpoint, step + 1)
            _save_checkpoint(path, training_state(step + 1, elapsed_before + time.perf_counter() - start))
            progress.message(f"step {step + 1}: wrote {path}")
    progress.close()

    wall = elapsed_before + time.perf_counter() - start
    segment["wall_s"] = time.perf_counter() - start
    steps_done = len(record["train"]["step"])
    if stopped:
        _save_checkpoint(args.checkpoint, training_state(steps_done, wall))
        if args.out:
            _write_json(args.out, record)
        why = f"by {signalled[0]}" if signalled else f"by --time-limit {args.time_limit:g} s"
        print(f"stopped after step {steps_done} of {args.steps} {why}; "
              f"wrote {args.checkpoint} (continue with --resume {args.checkpoint})", flush=True)
        return record
    record["summary"] = {
        "steps": steps_done,
        "diverged": diverged,
        "train_tokens": steps_done * tokens_per_step,
        "final_train_loss": record["train"]["loss"][-1],
        # Mean over the last 10% of steps: less noisy than the last batch.
        "final_train_loss_avg": _tail_mean(record["train"]["loss"]),
        "final_val_loss": record["val"]["loss"][-1] if record["val"]["loss"] else None,
        # The deployment gap: the same validation batches through the model as exported (docs/export.md).
        "served_val_loss": None,
        "tokens_per_s": steady_tokens / steady_time if steady_time else None,
        "first_step_s": first_step_s,
        "wall_s": wall,
    }
    if args.checkpoint is not None and not diverged:
        _save_checkpoint(args.checkpoint, training_state(steps_done, wall))
    if backend is not None and args.precision == "nvfp4" and not diverged and (not args.no_served_eval or args.export):
        if backend.high_precision:
            # After the switch to BF16 the model trained and evaluated in high precision: not an FP4 model.
            print("served model: not evaluated or exported, every GEMM runs in high precision since step "
                  f"{record['high_precision_from_step']}", flush=True)
        else:
            record["summary"]["served_val_loss"] = _served_eval(args, model, backend, val_set, autocast)
    if args.out:
        _write_json(args.out, record)
    _print_summary(record, args.out)
    return record


def _served_eval(args, model, backend, val_set, autocast) -> dict:
    """Validation loss of the trained model as its exported checkpoint computes (each FP4 weight quantized
    once, as ``fp4compile.export`` writes it): weights only (W4A16), and with activations quantized in
    1x16 blocks under the global scales of the activation ranges recorded over the last training steps
    (W4A4, ``Recipe.amax_history``); writes the checkpoint with ``--export``."""
    import fp4compile

    model.eval()
    with torch.no_grad(), autocast():
        losses = {}
        for scheme in ("NVFP4A16", "NVFP4"):
            with fp4compile.served(model, backend, scheme) as served:
                losses[scheme] = sum(served(x, y)[1].item() for x, y in val_set) / len(val_set)
    model.train()
    print(f"served model: val loss {losses['NVFP4A16']:.4f} (W4A16), {losses['NVFP4']:.4f} (W4A4)", flush=True)
    if args.export:
        fp4compile.export(model, args.export, backend=backend, scheme="NVFP4")
        print(f"wrote the NVFP4 checkpoint {args.export}", flush=True)
    return {"W4A16": losses["NVFP4A16"], "W4A4": losses["NVFP4"]}


def _catch_sigterm(enabled: bool, cleanup: contextlib.ExitStack) -> list:
    """A list that receives "SIGTERM" when the signal arrives; ``cleanup`` puts the previous handler back."""
    received: list[str] = []
    if not enabled:
        return received
    try:
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append("SIGTERM"))
    except ValueError:  # not the main thread: signals cannot be caught here
        return received
    cleanup.callback(signal.signal, signal.SIGTERM, previous)
    return received


def _make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, device: torch.device):
    # Decay matrices only (GEMM weights, embeddings); not biases or LayerNorm parameters.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), fused=device.type == "cuda",
    )


def _tail_mean(values: list[float]) -> float:
    tail = values[-max(1, len(values) // 10):]
    return sum(tail) / len(tail)


def _print_summary(record: dict, out: Optional[Path]) -> None:
    s = record["summary"]
    val = f"{s['final_val_loss']:.4f}" if s["final_val_loss"] is not None else "n/a"
    tps = f"{s['tokens_per_s']:,.0f} tok/s" if s["tokens_per_s"] else "n/a"
    print(f"summary {record['name']}: {s['steps']} steps, {s['train_tokens']:,} train tokens, "
          f"train loss {s['final_train_loss']:.4f} (last-10% mean {s['final_train_loss_avg']:.4f}), "
          f"val loss {val}, {tps} after the first step ({s['first_step_s']:.1f} s incl. compile), "
          f"wall {s['wall_s']:.1f} s" + (" [DIVERGED]" if s["diverged"] else ""), flush=True)
    if out:
        print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
