"""Per-request sampling: parameters, logits processors and the sampler."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ._config import InferenceConfig


@dataclass(kw_only=True, frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    Args:
        max_new_tokens: tokens to generate at most (``None``: the config's ``max_output_len``).
        do_sample: False picks the most likely token (greedy); True samples after the processors below.
        temperature: divides the logits; 0 means greedy.
        top_k: keep the k most likely tokens (0 or None: all).
        top_p: keep the smallest set of most likely tokens whose probability reaches p (1.0: all).
        min_p: drop tokens less likely than ``min_p`` times the most likely one (0: none).
        repetition_penalty: divide positive logits (multiply negative ones) of tokens already in the prompt or
            output by this (1.0: off), as transformers' ``RepetitionPenaltyLogitsProcessor``.
        stop_token_ids: tokens that end the request (besides the model's EOS unless ``ignore_eos``); the stop
            token is part of the output, as in transformers' ``generate``.
        ignore_eos: do not stop at EOS.
        seed: this request's own random generator seed, so its samples do not depend on what else is batched
            with it (None: drawn from torch's global generator when the request is added).
        stop: strings that end the request when the output text contains one; the text is cut before it, the
            tokens keep the one that completed it (needs a tokenizer).
        logprobs: None, or return for each new token its log-probability under the model (before any processor)
            and those of the ``logprobs`` most likely tokens.
    """

    max_new_tokens: int | None = None
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature} must be >= 0 (0: greedy)")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k={self.top_k} must be >= 0 (0 or None: no top-k)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p={self.top_p} must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplingParams.min_p={self.min_p} must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise ValueError(f"SamplingParams.repetition_penalty={self.repetition_penalty} must be > 0")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(
                f"SamplingParams.logprobs={self.logprobs} must be >= 0 (0: the chosen token's only)"
            )
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not s for s in stop):
            raise ValueError(f"SamplingParams.stop={stop!r} holds an empty string, which would stop at once")
        object.__setattr__(self, "stop", stop)

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    @classmethod
    def from_config(cls, config: InferenceConfig, generation_config: Any = None) -> SamplingParams:
        """Defaults from ``config``, overridden by the fields a transformers ``GenerationConfig`` sets."""
        values: dict[str, Any] = dict(
            max_new_tokens=config.max_output_len,
            do_sample=config.do_sample,
            temperature=config.temperature if config.temperature is not None else 1.0,
            top_k=config.top_k,
            top_p=config.top_p if config.top_p is not None else 1.0,
            min_p=config.min_p or 0.0,
            repetition_penalty=config.repetition_penalty or 1.0,
            ignore_eos=config.ignore_eos,
        )
        if generation_config is not None:
            for name in (
                "max_new_tokens",
                "do_sample",
                "temperature",
                "top_k",
                "top_p",
                "min_p",
                "repetition_penalty",
            ):
                value = getattr(generation_config, name, None)
                if value is not None:
                    values[name] = value
            stop = getattr(generation_config, "stop_strings", None)
            if stop:
                values["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
            eos = getattr(generation_config, "eos_token_id", None)
            if eos is not None and not values["ignore_eos"]:
                values["stop_token_ids"] = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        return cls(**values)


def apply_penalties_and_masks(
    logits: torch.Tensor, params: list[SamplingParams], history: list[list[int]]
) -> torch.Tensor:
    """The processed logits (fp32, one row per request): repetition penalty, temperature, top-k, top-p, min-p.

    Masked tokens get ``-inf``. Rows of greedy requests only get the repetition penalty (the rest do not change
    the argmax). The order is transformers' (penalty, temperature, top-k, top-p, min-p)."""
    if all(p.greedy and p.repetition_penalty == 1.0 for p in params):
        return logits.float()  # nothing to change: no copy
    logits = logits.float().clone()  # (S, V)
    for i, (p, seen) in enumerate(zip(params, history, strict=True)):
        if p.greedy and p.repetition_penalty == 1.0:
            continue
        row = logits[i]
        if p.repetition_penalty != 1.0 and seen:
            ids = torch.tensor(sorted(set(seen)), dtype=torch.long, device=row.device)
            picked = row[ids]
            row[ids] = torch.where(picked < 0, picked * p.repetition_penalty, picked / p.repetition_penalty)
        if p.greedy:
            continue
        if p.temperature != 1.0:
            row.div_(p.temperature)
        if p.top_k:
            row.copy_(top_k_mask(row, p.top_k))
        if p.top_p < 1.0:
            row.copy_(top_p_mask(row, p.top_p))
        if p.min_p > 0.0:
            row.copy_(min_p_mask(row, p.min_p))
    return logits


def top_k_mask(logits: torch.Tensor, k: int) -> torch.Tensor:
    """``logits`` with all but the k largest set to -inf (ties with the k-th kept)."""
    k = min(k, logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_mask(logits: torch.Tensor, p: float) -> torch.Tensor:
    """``logits`` keeping the smallest set of most likely tokens whose probability sum reaches ``p``.

    The most likely token is always kept."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    cum = sorted_logits.softmax(-1).cumsum(-1)
    # drop a token when the tokens before it already reach p
    drop_sorted = (cum - sorted_logits.softmax(-1)) >= p
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def min_p_mask(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """``logits`` with tokens less likely than ``min_p`` times the most likely one set to -inf."""
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, float("-inf"))


def logprobs_of(logits: torch.Tensor, token: int, n: int) -> dict[int, float]:
    """Log-probabilities of ``token`` and of the ``n`` most likely tokens, from one row of raw logits."""
    lp = logits.float().log_softmax(-1)
    top = lp.topk(n) if n else None
    out = {} if top is None else dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    out[token] = float(lp[token])
    return out


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> list[int]:
    """One token per row of processed logits: argmax for greedy rows, else a draw from the row's own generator."""
    out = logits.argmax(-1).tolist()  # one device sync for every greedy row
    for i, p in enumerate(params):
        if not p.greedy:
            probs = logits[i].softmax(-1)
            out[i] = int(torch.multinomial(probs, 1, generator=generators[i]))
    return out
