"""A small, plain GPT for the training study.

Pre-norm transformer blocks (LayerNorm -> causal self-attention -> residual, LayerNorm -> GELU MLP ->
residual), learned absolute position embeddings, GPT-2 initialisation. Nothing in the model knows
about FP4: the fp4compile backend finds its GEMMs from the traced graph and its blocks (the members of
``blocks``) from its structure; the output projection ``lm_head`` is outside the blocks and the
embeddings ``tok_emb`` and ``pos_emb`` are lookups, not GEMMs.

All GEMM dimensions of the presets are multiples of 16, as NVFP4 blocks and 16x16 weight tiles need.

With ``n_experts`` > 0 (preset "tiny-moe") each block's MLP is a mixture of experts: a linear router
picks ``top_k`` experts per token, whose weights are two 3-D parameters (``fc`` [E, hidden, d],
``proj`` [E, d, hidden]) computed as grouped GEMMs on the tokens sorted by expert
(``torch._grouped_mm``, in BF16 as it requires). The backend makes each of them one grouped NVFP4 site
with per-expert scales and keeps the router in high precision. Each expert's hidden size is
``mlp_ratio * d_model / top_k``, so a token costs the dense MLP's FLOPs. No load-balancing loss.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTConfig", "GPT", "PRESETS"]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    n_head: int
    d_model: int
    seq_len: int
    vocab: int = 256
    mlp_ratio: int = 4
    dropout: float = 0.0
    tie_embeddings: bool = False
    n_experts: int = 0  # > 0: a mixture-of-experts MLP in every block
    top_k: int = 2

    def __post_init__(self):
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")


# Parameter counts (untied embeddings, vocab 256) are in the test suite.
PRESETS: dict[str, GPTConfig] = {
    # CPU: the default run of train_gpt.py and the tests (~0.87M parameters).
    "tiny": GPTConfig(n_layer=4, n_head=4, d_model=128, seq_len=128),
    # One GPU, minutes (~25.6M parameters).
    "small": GPTConfig(n_layer=8, n_head=8, d_model=512, seq_len=512),
    # One GPU, GPT-2-small shape (~86M parameters).
    "medium": GPTConfig(n_layer=12, n_head=12, d_model=768, seq_len=1024),
    # CPU: "tiny" with 8 experts per block, 2 per token (the same FLOPs per token, ~2.4M parameters).
    "tiny-moe": GPTConfig(n_layer=4, n_head=4, d_model=128, seq_len=128, n_experts=8, top_k=2),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        q, k, v = self.qkv(x).split(d_model, dim=-1)
        # [B, T, C] -> [B, heads, T, C/heads]
        q, k, v = (t.view(batch, seq, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(batch, seq, d_model))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.mlp_ratio * config.d_model)
        self.proj = nn.Linear(config.mlp_ratio * config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


def _grouped(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [S, in] sorted by expert times each expert's w [E, out, in] transposed, in BF16."""
    return torch._grouped_mm(x.bfloat16(), w.bfloat16().transpose(-2, -1), offs=offs)


class MoEMLP(nn.Module):
    """Top-k routed experts: router logits -> softmax -> top-k (weights renormalised), tokens sorted by
    expert, two grouped GEMMs with a GELU between, outputs weighted and summed back per token."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        d, e = config.d_model, config.n_experts
        hidden = config.mlp_ratio * d // config.top_k
        self.top_k = config.top_k
        self.router = nn.Linear(d, e, bias=False)
        self.fc = nn.Parameter(torch.randn(e, hidden, d) * 0.02)
        self.proj = nn.Parameter(torch.randn(e, d, hidden) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, x = x.shape, x.reshape(-1, x.shape[-1])
        weight, chosen = self.router(x).float().softmax(-1).topk(self.top_k, dim=-1)
        weight = weight / weight.sum(-1, keepdim=True)
        experts = chosen.reshape(-1)
        order = torch.argsort(experts, stable=True)
        counts = torch.zeros(self.fc.shape[0], dtype=torch.int64, device=x.device).index_add_(
            0, experts, torch.ones_like(experts))
        offs = counts.cumsum(0).to(torch.int32)
        h = F.gelu(_grouped(x[order // self.top_k], self.fc, offs), approximate="tanh")
        y = _grouped(h, self.proj, offs).float() * weight.reshape(-1)[order, None]
        out = torch.zeros_like(x, dtype=torch.float32).index_add(0, order // self.top_k, y)
        return out.to(x.dtype).reshape(shape)


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = MoEMLP(config) if config.n_experts else MLP(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.ln_1(x)))
        return x + self.dropout(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2: residual-path output projections scaled by 1/sqrt(2 * n_layer), one per sublayer.
        residual_std = 0.02 / math.sqrt(2 * config.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            proj = block.mlp.proj
            nn.init.normal_(proj if isinstance(proj, nn.Parameter) else proj.weight, mean=0.0, std=residual_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count (shared tensors counted once); optionally without the embedding tables."""
        total = sum(p.numel() for p in self.parameters())
        if non_embedding:
            total -= self.pos_emb.weight.numel()
            if not self.config.tie_embeddings:
                total -= self.tok_emb.weight.numel()
        return total

    def forward(
        self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``idx``: int64 [B, T] with T <= seq_len. Returns (logits [B, T, vocab], mean loss or None)."""
        seq = idx.shape[1]
        if seq > self.config.seq_len:
            raise ValueError(f"sequence length {seq} exceeds the model's seq_len {self.config.seq_len}")
        positions = torch.arange(seq, device=idx.device)
        x = self.dropout(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))
        return logits, loss
