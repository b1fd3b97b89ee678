"""See what fp4compile does to a small GPT: the precision table, the backward graph as a picture, MLIR.

    python examples/inspect_gpt.py                      # prints the table and an MLIR excerpt,
                                                        # writes gpt_backward.png in the current directory
    python examples/inspect_gpt.py --image out.png --mlir out.mlir
    python examples/inspect_gpt.py --image docs/images/gpt_backward.png   # the picture docs/inspect.md shows

The same model from the command line (``gpt`` below is the factory):

    fp4compile inspect examples/inspect_gpt.py:gpt --input-shape 2x64 --input-dtype long
    fp4compile inspect examples/inspect_gpt.py:gpt --input-shape 2x64 --input-dtype long --show mlir

Nothing here changes the model: ``fp4compile.explain`` compiles a copy, runs one forward and one
backward through the nvfp4 backend and returns the backend's report.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

import fp4compile

# Run as a script from any directory: the sibling modules live next to this file.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt import GPT, PRESETS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def gpt(preset: str = "tiny") -> GPT:
    """The training study's GPT (4 blocks of d_model 128 for "tiny"), seeded."""
    torch.manual_seed(0)
    return GPT(PRESETS[preset])


def mlir_excerpt(mlir: str) -> str:
    """The backward function's header and its first FP4 weight-gradient GEMM: the transposed operands,
    RHT + quantize of both (dY^T with SR, X^T round-to-nearest) and the block-scaled GEMM."""
    lines = mlir.splitlines()
    header = next(i for i, line in enumerate(lines) if "func.func" in line)
    first = next(i for i, line in enumerate(lines) if '"torch.fp4.rht_quantize"' in line)
    gemm = next(i for i in range(first, len(lines)) if '"torch.fp4.scaled_mm"' in lines[i])
    start = next(i for i in range(first, 0, -1) if "torch.aten.t " in lines[i] and "torch.aten.t " in lines[i - 1]) - 1
    return "\n".join([lines[header][:120] + " ...", "    ...", *lines[start:gemm + 1], "    ..."])


def _shown(path: Path) -> Path:
    """``path`` relative to the repository when it lies inside it."""
    path = path.resolve()
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--image", type=Path, default=Path("gpt_backward.png"),
                   help="where to write the picture of the backward graph (default: gpt_backward.png here)")
    p.add_argument("--mlir", type=Path, help="also write the whole backward graph as MLIR to this file")
    args = p.parse_args(argv)

    model = gpt(args.preset)
    idx = torch.randint(0, model.config.vocab, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    # GPT returns (logits, loss) when given targets: the backward starts from that loss.
    report = fp4compile.explain(model, idx, idx, loss_fn=lambda out: out[1])

    print(report.precision_table())
    print()
    args.image.parent.mkdir(parents=True, exist_ok=True)
    report.save_image(args.image, stage="backward", title=f"GPT ({args.preset}) backward graph")
    print(f"wrote {_shown(args.image)}")
    mlir = report.to_mlir("backward")
    if args.mlir is not None:
        args.mlir.write_text(mlir)
        print(f"wrote {_shown(args.mlir)}")
    print()
    print(mlir_excerpt(mlir))


if __name__ == "__main__":
    main()
