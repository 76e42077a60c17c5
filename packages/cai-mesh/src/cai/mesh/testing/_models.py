"""The small model every package's parity tests train: a pre-norm decoder-only transformer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TinyTransformer", "make_batch"]


class _Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=-1)
        q, k, v = (
            t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v)
        )  # (B, nh, T, hs)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(B, T, C))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyTransformer(nn.Module):
    """A GPT-style model small enough to train for 20 steps in well under a second on one CPU core.

    ``seed`` makes the initial weights independent of the global RNG, so a reference and a sharded run build the
    same model. ``tie_embeddings`` shares the input embedding with the output head. ``heads`` defaults to 4 when
    ``hidden`` divides by 4, else 3.

    [Note: odd test sizes]
    The default sizes are odd on purpose: a vocabulary of 251 (prime) and a width of 33 (3 heads of 11) make most
    parameters' element counts odd (``qkv.weight`` 3267, ``embed.weight`` 8283, the norms 33), so flat buckets,
    chunks and even flat splits over 2 or 4 ranks end with padding on the last rank. With sizes that are
    multiples of 32 every split divides evenly and a bug in the padded last piece goes unnoticed.
    """

    def __init__(
        self,
        vocab_size: int = 251,
        hidden: int = 33,
        layers: int = 2,
        heads: int | None = None,
        max_seq: int = 32,
        tie_embeddings: bool = False,
        seed: int | None = 0,
    ) -> None:
        super().__init__()
        if heads is None:  # 4 for the usual widths (the default before the odd sizes), 3 of 11 for 33
            heads = 4 if hidden % 4 == 0 else 3
        if hidden % heads:
            raise ValueError(
                f"TinyTransformer: hidden={hidden} is not divisible by heads={heads}; pick heads that divide it"
            )
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            self.embed = nn.Embedding(vocab_size, hidden)
            self.pos = nn.Embedding(max_seq, hidden)
            self.blocks = nn.ModuleList(_Block(hidden, heads) for _ in range(layers))
            self.ln_f = nn.LayerNorm(hidden)
            self.head = nn.Linear(hidden, vocab_size, bias=False)
        if tie_embeddings:
            self.head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        T = input_ids.shape[1]
        x = self.embed(input_ids) + self.pos(torch.arange(T, device=input_ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, V)

    @staticmethod
    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over labels that are not -100."""
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


def make_batch(
    batch_size: int = 4, seq_len: int = 16, vocab_size: int = 251, *, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch ``(input_ids, labels)``; labels are the inputs shifted left, the last one ignored."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[:, -1] = -100
    return ids[:, :-1].contiguous(), labels
