"""Small models for tensor-parallel tests: a Llama-shaped transformer (attention with heads,
an MLP, norms that stay replicated) in float64, and its plan."""

from __future__ import annotations

import math

import torch

from tests.support.reference import DTYPE

PLAN = {"embed": "embedding_rowwise",
        "layers.*.attn.q": "colwise", "layers.*.attn.k": "colwise", "layers.*.attn.v": "colwise",
        "layers.*.attn.o": "rowwise", "layers.*.mlp.0": "colwise", "layers.*.mlp.2": "rowwise",
        "head": "colwise_rep"}


class Attention(torch.nn.Module):
    def __init__(self, width: int, heads: int, dtype):
        super().__init__()
        self.head_dim = width // heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(width, width, dtype=dtype) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (proj(x).view(b, s, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        attended = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        return self.o(attended.transpose(1, 2).reshape(b, s, -1))


class Block(torch.nn.Module):
    def __init__(self, width: int, heads: int, dtype):
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(width, dtype=dtype)
        self.attn = Attention(width, heads, dtype)
        self.norm2 = torch.nn.LayerNorm(width, dtype=dtype)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 2 * width, dtype=dtype), torch.nn.Tanh(),
                                       torch.nn.Linear(2 * width, width, dtype=dtype))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(torch.nn.Module):
    def __init__(self, vocab: int = 12, width: int = 8, heads: int = 4, layers: int = 2, seed: int = 0, dtype=DTYPE):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(vocab, width, dtype=dtype)
        self.layers = torch.nn.ModuleList(Block(width, heads, dtype) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(width, dtype=dtype)
        self.head = torch.nn.Linear(width, vocab, dtype=dtype)
        with torch.no_grad():  # norms that are not the identity, so their gradients matter
            for name, p in self.named_parameters():
                if "norm" in name:
                    p.add_(0.3 * torch.randn_like(p))

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class TinyTransformerLM(TinyTransformer):
    """TinyTransformer called as a Hugging Face causal LM is: ``model(input_ids=..., attention_mask=...)``
    (causal, so right padding never reaches a real token)."""

    def forward(self, input_ids, attention_mask=None):
        return super().forward(input_ids)
