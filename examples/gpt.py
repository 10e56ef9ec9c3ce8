"""A small GPT-style language model for the examples.

Token and position embeddings, ``n_layer`` pre-norm transformer blocks (causal
self-attention through ``torch.nn.functional.scaled_dot_product_attention``, then a GELU
MLP), a final LayerNorm and an output head that shares its weight with the token
embedding. ``forward(tokens)`` returns logits of shape ``(batch, time, vocab)``.

Causal attention means a position never sees later ones, so right-padded batches need no
attention mask: padded positions only matter through their labels, which are -100.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 192  # longest sequence the position embedding covers
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(f"n_embd {config.n_embd} must divide by n_head {config.n_head}")
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.out = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        heads = self.qkv(x).view(batch, time, 3, self.n_head, width // self.n_head)
        q, k, v = heads.permute(2, 0, 3, 1, 4)  # each (batch, head, time, head_width)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(batch, time, width))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.norm2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(),
            nn.Linear(4 * config.n_embd, config.n_embd), nn.Dropout(config.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tokens = nn.Embedding(config.vocab_size, config.n_embd)
        self.positions = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.head.weight = self.tokens.weight  # tied input and output embeddings
        self.apply(self._init_weights)
        # Residual branches start small so that the residual stream keeps its scale.
        for name, param in self.named_parameters():
            if name.endswith(("attn.out.weight", "mlp.2.weight")):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``position_ids``: each token's place in its sequence (default 0, 1, ...); context
        parallelism hands each rank's part of the sequences their places in the whole."""
        time = tokens.shape[1]
        if position_ids is None and time > self.config.block_size:
            raise ValueError(f"sequence of {time} tokens is longer than block_size {self.config.block_size}")
        positions = torch.arange(time, device=tokens.device) if position_ids is None else position_ids
        x = self.drop(self.tokens(tokens) + self.positions(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # the tied weight counts once

    @torch.no_grad()
    def generate(self, tokens: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
                 stop_token: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample up to ``max_new_tokens`` continuations of ``tokens`` (batch, time); stops
        early when every row produced ``stop_token``. ``temperature=0`` is greedy."""
        was_training = self.training
        self.eval()
        done = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
        try:
            for _ in range(max_new_tokens):
                logits = self(tokens[:, -self.config.block_size:])[:, -1, :]
                if temperature <= 0:
                    next_token = logits.argmax(dim=-1, keepdim=True)
                else:
                    probs = torch.softmax(logits / temperature, dim=-1)
                    next_token = torch.multinomial(probs, 1, generator=generator)
                tokens = torch.cat([tokens, next_token], dim=1)
                if stop_token is not None:
                    done |= next_token.squeeze(1) == stop_token
                    if bool(done.all()):
                        break
        finally:
            self.train(was_training)
        return tokens
