"""A small hybrid Mamba-2 / attention language model in plain PyTorch, trained in NVFP4 through fp4compile.

The stack mixes three block classes, as Nemotron-H, Jamba or Bamba do (``--layout``, one letter a block):

- ``M``: Mamba-2 mixer: ``in_proj`` (Linear) -> depthwise causal ``conv1d`` -> chunked SSD scan (the
  state-space dual form, written with ``einsum``) -> gated RMSNorm -> ``out_proj`` (Linear);
- ``A``: causal self-attention: ``qkv`` and ``proj`` (Linear) around ``scaled_dot_product_attention``;
- ``F``: feed-forward: ``fc`` -> GELU -> ``proj`` (Linear).

Each block is pre-norm with a residual. Nothing in the model knows about FP4: the backend finds the
GEMMs with a weight (the Linear projections) and runs them in NVFP4 except in the first and last blocks
and ``lm_head``; the scan, the convolution, the norms and the attention products have no weight operand
and stay in high precision. The script trains on the byte corpus (the Python standard library's source,
``corpus.py``) and prints the precision table and the products that are not GEMM sites:

    python examples/hybrid_mamba.py                     # 40 steps on the CPU, a minute or two
    python examples/hybrid_mamba.py --layout MFAFMFMFAFMF --steps 200 --fmt mxfp4

All GEMM dimensions of the default shapes are multiples of 16, as NVFP4 needs (the Mamba-2 ``in_proj``
writes z, x, B, C and dt: 2*256 + 2*16 + 16 = 560 features).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# Run as a script from any directory: the corpus module lives next to this file.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from corpus import VOCAB_SIZE, batches, load_corpus  # noqa: E402

__all__ = ["HybridConfig", "HybridLM", "ssd_scan", "main"]


@dataclasses.dataclass(frozen=True)
class HybridConfig:
    layout: str = "MFAFMFMF"  # M: Mamba-2, A: attention, F: feed-forward
    d_model: int = 128
    n_head: int = 4  # attention heads
    expand: int = 2  # Mamba-2 inner width = expand * d_model
    head_dim: int = 16  # Mamba-2 head size
    d_state: int = 16
    d_conv: int = 4
    chunk: int = 32  # SSD chunk length
    mlp_ratio: int = 4
    vocab: int = VOCAB_SIZE
    checkpoint: bool = False  # activation checkpointing around every block

    def __post_init__(self):
        if not self.layout or set(self.layout) - set("MAF"):
            raise ValueError(f"layout must be a string of M, A and F, got {self.layout!r}")
        if self.d_model % self.n_head or (self.expand * self.d_model) % self.head_dim:
            raise ValueError("d_model must divide into n_head heads and expand*d_model into head_dim heads")


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """[..., T] -> [..., T, T] with out[i, j] = x[j+1] + ... + x[i] below the diagonal, -inf above."""
    t = x.shape[-1]
    x = x[..., None].expand(*x.shape, t)
    below = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=-1)
    sums = torch.cumsum(x.masked_fill(~below, 0), dim=-2)
    causal = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device))
    return sums.masked_fill(~causal, -math.inf)


def ssd_scan(x, a, b, c, chunk: int) -> torch.Tensor:
    """The Mamba-2 selective scan in its chunked state-space-dual form (pure PyTorch).

    x [B, T, H, P] inputs (already scaled by dt), a [B, T, H] log decays (A * dt), b and c [B, T, H, N].
    Within a chunk the scan is a masked, attention-like product; across chunks a recurrence over the
    chunk states. T must be a multiple of ``chunk``. Returns y [B, T, H, P].
    """
    bsz, t, h, p = x.shape
    n_chunks = t // chunk
    x, b, c = (z.reshape(bsz, n_chunks, chunk, h, -1) for z in (x, b, c))
    a = a.reshape(bsz, n_chunks, chunk, h).permute(0, 3, 1, 2)  # [B, H, chunks, L]
    a_cumsum = torch.cumsum(a, dim=-1)
    # 1. Outputs within each chunk (the diagonal blocks).
    decay = torch.exp(segment_sum(a))
    y_diag = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", c, b, decay, x)
    # 2. The state each chunk leaves behind.
    decay_states = torch.exp(a_cumsum[..., -1:] - a_cumsum)
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", b, decay_states, x)
    # 3. The recurrence across chunks, from a zero initial state.
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    decay_chunk = torch.exp(segment_sum(F.pad(a_cumsum[..., -1], (1, 0))))
    states = torch.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)[:, :-1]
    # 4. Each chunk's incoming state, read out at every position.
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", c, states, torch.exp(a_cumsum))
    return (y_diag + y_off).reshape(bsz, t, h, p)


class GatedRMSNorm(nn.Module):
    """RMSNorm(y * silu(z)) * weight, the normalization before Mamba-2's output projection."""

    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, y, z):
        y = y * F.silu(z)
        return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Mamba2Mixer(nn.Module):
    def __init__(self, config: HybridConfig):
        super().__init__()
        d_inner = config.expand * config.d_model
        self.n_heads = d_inner // config.head_dim
        self.d_inner, self.d_state, self.chunk = d_inner, config.d_state, config.chunk
        conv_dim = d_inner + 2 * config.d_state  # x, B and C go through the convolution
        self.in_proj = nn.Linear(config.d_model, 2 * d_inner + 2 * config.d_state + self.n_heads, bias=False)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, config.d_conv, groups=conv_dim, padding=config.d_conv - 1)
        self.dt_bias = nn.Parameter(torch.log(torch.expm1(torch.linspace(1e-3, 1e-1, self.n_heads))))
        self.A_log = nn.Parameter(torch.log(torch.linspace(1, 16, self.n_heads)))
        self.D = nn.Parameter(torch.ones(self.n_heads))
        self.norm = GatedRMSNorm(d_inner)
        self.out_proj = nn.Linear(d_inner, config.d_model, bias=False)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        bsz, t, _ = u.shape
        z, xbc, dt = self.in_proj(u).split([self.d_inner, self.d_inner + 2 * self.d_state, self.n_heads], dim=-1)
        xbc = F.silu(self.conv1d(xbc.transpose(1, 2))[..., :t].transpose(1, 2))  # causal depthwise conv
        x, b, c = xbc.split([self.d_inner, self.d_state, self.d_state], dim=-1)
        dt = F.softplus(dt + self.dt_bias)  # [B, T, H]
        a = -torch.exp(self.A_log)
        x = x.reshape(bsz, t, self.n_heads, -1)
        # One group: every head reads the same B and C.
        b, c = (z_.unsqueeze(2).expand(bsz, t, self.n_heads, self.d_state) for z_ in (b, c))
        pad = -t % self.chunk
        xs, as_, bs, cs = (F.pad(v, (0, 0) * (v.dim() - 2) + (0, pad)) for v in (x * dt[..., None], a * dt, b, c))
        y = ssd_scan(xs, as_, bs, cs, self.chunk)[:, :t] + x * self.D[:, None]
        return self.out_proj(self.norm(y.reshape(bsz, t, self.d_inner), z))


class Attention(nn.Module):
    def __init__(self, config: HybridConfig):
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, t, d = x.shape
        q, k, v = (z.view(bsz, t, self.n_head, -1).transpose(1, 2) for z in self.qkv(x).split(d, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(bsz, t, d))


class FeedForward(nn.Module):
    def __init__(self, config: HybridConfig):
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.mlp_ratio * config.d_model, bias=False)
        self.proj = nn.Linear(config.mlp_ratio * config.d_model, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


MIXERS = {"M": Mamba2Mixer, "A": Attention, "F": FeedForward}


class HybridBlock(nn.Module):
    """Pre-norm residual block around one mixer (Mamba-2, attention or feed-forward)."""

    def __init__(self, config: HybridConfig, kind: str):
        super().__init__()
        self.kind = kind
        self.norm = nn.RMSNorm(config.d_model, eps=1e-6)
        self.mixer = MIXERS[kind](config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mixer(self.norm(x))


class HybridLM(nn.Module):
    def __init__(self, config: HybridConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.d_model)
        self.layers = nn.ModuleList(HybridBlock(config, kind) for kind in config.layout)
        self.norm_f = nn.RMSNorm(config.d_model, eps=1e-6)
        self.lm_head = nn.Linear(config.d_model, config.vocab, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None):
        x = self.embed(idx)
        for layer in self.layers:
            # Activation checkpointing: the backend sees through it, with the same plan and numbers.
            x = checkpoint(layer, x, use_reentrant=False) if self.config.checkpoint else layer(x)
        logits = self.lm_head(self.norm_f(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return logits, loss


def other_products_table(backend, model: HybridLM) -> str:
    """The matrix products that are not GEMM sites (high precision), counted per block kind."""
    counts: dict = collections.Counter()
    for ctx in backend.report.latest:
        for product in ctx.other_gemms:
            parts = product.module.split(".")
            kind = model.layers[int(parts[1])].kind if parts[0] == "layers" and len(parts) > 1 else "-"
            counts[(kind, product.op, product.reason)] += 1
    names = {"M": "Mamba-2", "A": "attention", "F": "feed-forward", "-": "outside blocks"}
    lines = ["matrix products that are not GEMM sites (they run in high precision):"]
    for (kind, op, reason), n in sorted(counts.items()):
        lines.append(f"  {names[kind]:14s} {op:30s} x{n:<3d} {reason}")
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--layout", default=HybridConfig.layout,
                   help="one letter a block: M Mamba-2, A attention, F feed-forward")
    p.add_argument("--d-model", type=int, default=HybridConfig.d_model)
    p.add_argument("--fmt", choices=("nvfp4", "mxfp4"), default="nvfp4")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--inner", choices=("inductor", "eager"), default=None,
                   help="default: inductor on CUDA, eager on CPU")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--checkpoint", action="store_true", help="activation checkpointing around every block")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    import fp4compile

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    inner = args.inner or ("inductor" if device.type == "cuda" else "eager")
    torch.manual_seed(args.seed)
    fp4compile.manual_seed(args.seed)
    config = HybridConfig(layout=args.layout, d_model=args.d_model, checkpoint=args.checkpoint)
    model = HybridLM(config).to(device)
    backend = fp4compile.Backend(inner=inner, fmt=args.fmt)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    corpus = load_corpus()
    stream = batches(corpus.train, args.batch_size, args.seq_len, seed=args.seed, device=device)
    print(f"hybrid LM, layout {config.layout}, d_model {config.d_model}, "
          f"{sum(p.numel() for p in model.parameters()):,} parameters, {args.fmt} through fp4compile on {device}")
    print(corpus.describe())
    losses = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = next(stream)
        _, loss = compiled(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if step % args.log_every == 0 or step in (1, args.steps):
            print(f"step {step:4d}  loss {losses[-1]:.3f}  ({time.perf_counter() - start:.0f} s)", flush=True)
    table = backend.report.precision_table()
    products = other_products_table(backend, model)
    print(table)
    print(products)
    return {"losses": losses, "precision_table": table, "other_products": products, "backend": backend, "model": model}


if __name__ == "__main__":
    main()
