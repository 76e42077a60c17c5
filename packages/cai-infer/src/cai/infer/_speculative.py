"""Speculative decoding: drafters (prompt lookup, a small draft model) and the rule that verifies their drafts.

[Note: speculative step]
A decoding sequence gets up to ``n_spec_tokens`` draft tokens ``d_1 .. d_k``; the target model runs once on its
last token followed by the drafts (their K/V written into blocks reserved past the sequence, like any chunk),
which gives the target's distributions ``p_0 .. p_k`` after each prefix. ``verify`` accepts a prefix of the
drafts and adds one token of its own, so a step yields 1 to k + 1 tokens:
  - greedy: ``d_i`` is accepted while it equals the argmax of ``p_{i-1}``; the first mismatch is replaced by that
    argmax, and when all match the argmax of ``p_k`` follows. The output is exactly plain greedy decoding's.
  - sampling (rejection sampling): ``d_i``, drawn from the drafter's ``q_{i-1}``, is accepted with probability
    ``min(1, p(d_i) / q(d_i))``; on the first rejection the replacement is drawn from ``max(p - q, 0)``
    normalized; when all are accepted the next token is drawn from ``p_k``. Each emitted token is then
    distributed exactly as ``p`` (``q(x) min(1, p(x)/q(x)) + P(reject) residual(x) = p(x)``). Prompt lookup
    proposes deterministically, so its ``q`` is a point mass on the draft.
``p`` and ``q`` are the request's processed distributions (penalties, temperature, top-k/p, min-p), each with the
history it would have at that position. Rejected drafts are revoked by the scheduler (see _scheduler.py
[Note: speculative advance]).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ._sampling import SamplingParams, apply_penalties_and_masks


def acceptance_probabilities(p: torch.Tensor, q: torch.Tensor, drafts: list[int]) -> torch.Tensor:
    """``min(1, p_i(d_i) / q_i(d_i))`` for each draft, from rows of target ``p`` and draft ``q`` probabilities."""
    idx = torch.tensor(drafts, device=p.device)[:, None]
    pd, qd = p.gather(-1, idx)[:, 0], q.gather(-1, idx)[:, 0]
    return (pd / qd).clamp(max=1.0)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``max(p - q, 0)`` normalized: what a rejected draft is replaced by (``p`` itself where ``p == q``)."""
    r = (p - q).clamp(min=0.0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=torch.finfo(r.dtype).tiny), p)


def verify(
    logits: torch.Tensor,
    drafts: list[int],
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> list[int]:
    """The tokens a speculative step emits: the accepted drafts, then one more (see [Note: speculative step]).

    Args:
        logits: (k + 1, vocab) processed target logits after the last token and after each of the k drafts.
        drafts: the k draft tokens.
        draft_probs: (k, vocab) the drafter's probabilities that ``drafts`` were drawn from, or None for a
            deterministic drafter (a point mass on each draft).
        params: the request's sampling parameters (greedy or not).
        generator: the request's generator (sampling only).
    """
    k = len(drafts)
    if params.greedy:
        best = logits.argmax(-1).tolist()
        out = []
        for i in range(k):
            if drafts[i] != best[i]:
                return [*out, best[i]]
            out.append(drafts[i])
        return [*out, best[k]]
    p = logits.softmax(-1)
    if k == 0:
        return [int(torch.multinomial(p[0], 1, generator=generator))]
    if draft_probs is None:
        draft_probs = torch.zeros_like(p[:k]).scatter_(
            -1, torch.tensor(drafts, device=p.device)[:, None], 1.0
        )
    accept = acceptance_probabilities(p[:k], draft_probs, drafts)
    u = torch.rand(k, generator=generator, device=p.device)
    out = []
    for i in range(k):
        if u[i] >= accept[i]:
            residual = residual_distribution(p[i], draft_probs[i])
            return [*out, int(torch.multinomial(residual, 1, generator=generator))]
        out.append(drafts[i])
    return [*out, int(torch.multinomial(p[k], 1, generator=generator))]


class PromptLookupDrafter:
    """Drafts by prompt lookup: finds the latest earlier occurrence of the sequence's last ``n`` tokens (longest
    ``n`` from ``max_ngram`` down to ``min_ngram``) and proposes the tokens that followed it."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup needs 1 <= min_ngram={min_ngram} <= max_ngram={max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, request_id: str, tokens: list[int], k: int, params: SamplingParams, generator: Any):
        """Up to ``k`` draft tokens (possibly none) and None (the drafts are deterministic)."""
        n_tok = len(tokens)
        for n in range(min(self.max_ngram, n_tok - 1), self.min_ngram - 1, -1):
            tail = tokens[n_tok - n :]
            # latest match first: recent text predicts the continuation best
            for start in range(n_tok - n - 1, -1, -1):
                if tokens[start : start + n] == tail:
                    return tokens[start + n : start + n + k], None
        return [], None

    def forget(self, request_id: str) -> None:
        pass


class ModelDrafter:
    """Drafts with a small causal LM sharing the target's vocabulary, sampled with the request's own parameters.

    Each request keeps the draft model's own (non-paged) KV cache, cropped back to the tokens that stay after
    verification; the draft model runs one request at a time."""

    def __init__(self, model: nn.Module, *, vocab_size: int) -> None:
        draft_vocab = model.get_output_embeddings().weight.shape[0]
        if draft_vocab != vocab_size:
            raise ValueError(
                f"the draft model's vocabulary has {draft_vocab} tokens but the target's has {vocab_size}; a "
                "drafter must share the target's tokenizer (pick a draft model of the same family)"
            )
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self._caches: dict[str, tuple[Any, list[int]]] = {}  # request -> (cache, the tokens it holds)

    @torch.inference_mode()
    def propose(
        self, request_id: str, tokens: list[int], k: int, params: SamplingParams, generator: Any
    ) -> tuple[list[int], torch.Tensor | None]:
        from transformers import DynamicCache

        cache, held = self._caches.get(request_id, (None, []))
        common = 0
        for a, b in zip(held, tokens, strict=False):
            if a != b:
                break
            common += 1
        common = min(common, len(tokens) - 1)  # at least one token to feed
        if cache is None or common == 0:
            cache, common = DynamicCache(), 0
        elif cache.get_seq_length() > common:
            cache.crop(common - cache.get_seq_length())  # drop the tokens past the common prefix
        history = list(tokens)
        feed = tokens[common:]
        drafts: list[int] = []
        rows: list[torch.Tensor] = []
        for _ in range(k):
            out = self.model(
                input_ids=torch.tensor([feed], device=self.device), past_key_values=cache, use_cache=True
            )
            logits = apply_penalties_and_masks(out.logits[0, -1:].float(), [params], [history])
            if params.greedy:
                token = int(logits[0].argmax())
            else:
                probs = logits[0].softmax(-1)
                token = int(torch.multinomial(probs, 1, generator=generator))
                rows.append(probs)
            drafts.append(token)
            history.append(token)
            feed = [token]
        # the cache holds every token but the last draft
        self._caches[request_id] = (cache, history[:-1])
        return drafts, (torch.stack(rows) if rows else None)

    def forget(self, request_id: str) -> None:
        self._caches.pop(request_id, None)
