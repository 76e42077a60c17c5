"""The default data set of the examples: reverse a short sequence of digits.

A sample reads ``<bos> 3 1 4 1 5 <sep> 5 1 4 1 3 <eos>``. Only the answer (the reversed digits and ``<eos>``)
carries labels, so the loss measures the task and nothing else, and exact-match accuracy by greedy decoding
says whether the model learned it. The data is generated from a seed on the fly: nothing is downloaded.

Why reversal: with rotary positions the k-th answer digit sits at a fixed distance (2k + 1) from the digit it
copies whatever the length, so a small model learns it in a few hundred steps, and a wrong answer is easy to
read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

# Token ids: digits are their own ids, then the specials. The vocabulary is padded to 16.
PAD, BOS, SEP, EOS = 10, 11, 12, 13
VOCAB_SIZE = 16
IGNORE = -100


@dataclass(kw_only=True, frozen=True)
class DigitTask:
    """Lengths of the digit sequences to reverse, inclusive."""

    min_digits: int = 4
    max_digits: int = 8

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(
                f"DigitTask needs 1 <= min_digits <= max_digits, got min_digits={self.min_digits}, "
                f"max_digits={self.max_digits}; for example min_digits=4, max_digits=8"
            )

    @property
    def max_len(self) -> int:
        """Longest sample in tokens: bos, digits, sep, reversed digits, eos."""
        return 2 * self.max_digits + 3

    def sample(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """One (input_ids, labels) pair of length ``2 n + 3``; labels are -100 outside the answer."""
        n = int(torch.randint(self.min_digits, self.max_digits + 1, (1,), generator=gen))
        digits = torch.randint(0, 10, (n,), generator=gen)
        ids = torch.cat(
            [torch.tensor([BOS]), digits, torch.tensor([SEP]), digits.flip(0), torch.tensor([EOS])]
        )
        labels = torch.full_like(ids, IGNORE)
        labels[n + 2 :] = ids[n + 2 :]  # the model predicts each answer token (HF shifts labels inside)
        return ids, labels


class DigitReversal(Dataset):
    """``num_samples`` samples of ``task``, sample ``i`` drawn from seed ``seed + i`` (same on every rank)."""

    def __init__(self, task: DigitTask, num_samples: int, seed: int = 0) -> None:
        self.task, self.num_samples, self.seed = task, num_samples, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        ids, labels = self.task.sample(gen)
        return {"input_ids": ids, "labels": labels}


def collate(samples: list[dict[str, torch.Tensor]], *, pad_to: int = 1) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample, rounded up to a multiple of ``pad_to`` (sequence parallelism cuts the
    sequence evenly). Causal attention never looks right, so padding changes nothing before it, and its labels
    are ignored."""
    width = -(-max(s["input_ids"].numel() for s in samples) // pad_to) * pad_to
    ids = torch.full((len(samples), width), PAD, dtype=torch.long)
    labels = torch.full((len(samples), width), IGNORE, dtype=torch.long)
    for row, s in enumerate(samples):
        n = s["input_ids"].numel()
        ids[row, :n], labels[row, :n] = s["input_ids"], s["labels"]
    return {"input_ids": ids, "labels": labels}


@torch.no_grad()
def exact_match(model: torch.nn.Module, task: DigitTask, num_samples: int, seed: int, device) -> float:
    """Fraction of held-out prompts whose greedy answer (digits and ``<eos>``) is exactly right.

    Decodes without a KV cache (a full forward per token): the sequences are at most ~20 tokens, and this
    works for any wrapped or sharded model whose forward returns logits.
    """
    data = DigitReversal(task, num_samples, seed=seed)
    by_len: dict[int, list[torch.Tensor]] = {}
    for i in range(num_samples):
        ids = data[i]["input_ids"]
        by_len.setdefault(ids.numel(), []).append(ids)
    correct = 0
    for length, rows in sorted(by_len.items()):
        batch = torch.stack(rows).to(device)  # (B, 2n + 3), same n in the whole group
        n = (length - 3) // 2
        out = batch[:, : n + 2]  # <bos> digits <sep>
        for _ in range(n + 1):
            logits = _logits(model(input_ids=out))  # (B, T, V)
            out = torch.cat([out, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        correct += int((out == batch).all(dim=1).sum())
    return correct / num_samples


def _logits(output) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output[0] if isinstance(output, tuple) else output
