"""Small models for the backend tests (own code, no downloads)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, d: int, bias: bool = True):
        super().__init__()
        self.fc = nn.Linear(d, 4 * d, bias=bias)
        self.out = nn.Linear(4 * d, d, bias=bias)

    def forward(self, x):
        return self.out(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d: int, n_head: int, bias: bool = True):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, n_head)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = MLP(d, bias)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, n_layer=4, d=32, n_head=2, vocab=64, seq=32, tied=False, bias=True):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d)
        self.pos_emb = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList([Block(d, n_head, bias) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.tok_emb.weight

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class GPTWithLoss(nn.Module):
    """The usual language-model signature: the logits and the loss computed from them in one graph."""

    def __init__(self, vocab=512, seq=128, n_layer=2, d=32):
        super().__init__()
        self.gpt = TinyGPT(n_layer=n_layer, d=d, n_head=2, vocab=vocab, seq=seq)

    def forward(self, idx):
        logits = self.gpt(idx)
        return logits, lm_loss(logits, idx)


class NormMLP(nn.Module):
    """LayerNorm -> Linear -> GELU -> Linear: both X operands have producers Inductor fuses an amax into."""

    def __init__(self, d: int = 256):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.blocks = nn.ModuleList([nn.Linear(d, 4 * d), nn.Linear(4 * d, d)])

    def forward(self, x):
        return self.blocks[1](nn.functional.gelu(self.blocks[0](self.norm(x))))


class MLPStack(nn.Module):
    """n blocks of Linear-GELU-Linear with a residual, for precision-plan tests of any depth."""

    def __init__(self, n_blocks: int, d: int = 16):
        super().__init__()
        self.layers = nn.ModuleList([MLP(d) for _ in range(n_blocks)])
        self.head = nn.Linear(d, d)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def lm_loss(logits, idx):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))


def grads(model):
    """A copy of every parameter gradient, by name."""
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# A model file for the command line's MODULE:FACTORY (written to a temporary folder by the tests).
MODEL_FILE = '''
import torch.nn as nn

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)

    def forward(self, x):
        return x + self.down(self.up(x).relu())

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)
'''
