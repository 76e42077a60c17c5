"""InferenceEngine: Colossal-AI's facade (``generate``, ``add_request``, ``step``) over the paged engine."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._attention import defer_rotary
from ._blocks import BlockManager
from ._config import InferenceConfig
from ._fuse import fuse_projections
from ._parallel import shard_for_inference, shared_seed
from ._residual import carry_residuals
from ._runner import ModelRunner, graph_batch_sizes, kv_cache_for
from ._sampling import SamplingParams, apply_penalties_and_masks, logprobs_of, sample
from ._scheduler import ScheduledBatch, Scheduler, Sequence, SequenceStatus
from ._speculative import ModelDrafter, PromptLookupDrafter, verify


def _triton_runs(device: torch.device) -> bool:
    from cai.kernels import use_triton

    return use_triton(torch.empty(0, device=device))


@dataclass(frozen=True)
class RequestOutput:
    """A request's state after a step: its output tokens so far, their text and whether it is done."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None  # the output tokens decoded (None without a tokenizer)
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    logprobs: list[dict[int, float]] | None = None  # per output token, when the request asked for them


class InferenceEngine:
    """Generates text with a Hugging Face causal LM, batching requests continuously over a paged KV cache.

    Args:
        model_or_path: an ``nn.Module`` (a transformers causal LM, used on the device it is on) or a path / hub
            name that ``AutoModelForCausalLM.from_pretrained`` loads (safetensors, including cai-ckpt's model
            output) onto the process's accelerator (``cai.mesh.get_current_device()``).
        tokenizer: a transformers tokenizer, or None: loaded from ``model_or_path`` when it is a path; without
            one, requests pass token ids and outputs carry no text.
        inference_config: batching, cache and sampling defaults (``InferenceConfig()`` when None). The model is
            cast to its ``dtype`` and switched to the engine's attention (``attn_implementation="cai_paged"``);
            on CUDA decode steps replay CUDA graphs captured here (``use_cuda_graph``).
        verbose: unused; kept for Colossal-AI's signature.

    Example::

        engine = InferenceEngine(model, tokenizer, InferenceConfig(max_batch_size=4, dtype="fp32"))
        texts = engine.generate(prompts=["Hello", "The sky is"], generation_config=GenerationConfig(max_new_tokens=8))

    ``add_request`` queues requests and ``step`` runs one batch, returning a ``RequestOutput`` for every
    request that got a token (streaming); ``generate`` runs steps until every queued request is done.
    """

    def __init__(
        self,
        model_or_path: nn.Module | str | os.PathLike,
        tokenizer: Any = None,
        inference_config: InferenceConfig | None = None,
        verbose: bool = False,
    ) -> None:
        config = inference_config or InferenceConfig()
        unsupported = config.unsupported()
        if unsupported:
            raise NotImplementedError(
                f"InferenceConfig sets {', '.join(unsupported)}, which cai-infer does not build yet; leave these at "
                "their defaults"
            )
        if isinstance(model_or_path, (str, os.PathLike)):
            from transformers import AutoModelForCausalLM, AutoTokenizer

            from cai.mesh import get_current_device

            model = AutoModelForCausalLM.from_pretrained(model_or_path, dtype=config.dtype)
            model = model.to(get_current_device())  # the process's accelerator: cuda:<local rank>, else cpu
            if tokenizer is None:
                try:
                    tokenizer = AutoTokenizer.from_pretrained(model_or_path)
                except (OSError, ValueError):
                    tokenizer = None  # a weights-only directory: requests pass token ids
        elif isinstance(model_or_path, nn.Module):
            model = model_or_path.to(config.dtype)
        else:
            raise TypeError(f"model_or_path is a {type(model_or_path).__name__}; pass an nn.Module or a path")
        self._tp_group = None
        if config.tp_size > 1:  # see _parallel.py [Note: tensor-parallel engine]
            model, self._tp_group = shard_for_inference(model, config.tp_size)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config
        self.cache = kv_cache_for(
            model,
            num_blocks=config.total_blocks,
            block_size=config.block_size,
            dtype=config.dtype,
            tp_size=config.tp_size,
        )
        self.blocks = BlockManager(
            config.total_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.blocks, max_batch_size=config.max_batch_size, token_budget=config.token_budget
        )
        self.runner = ModelRunner(model, self.cache)
        on_cuda = self.runner.device.type == "cuda"
        default_kernels = on_cuda and config.tp_size == 1 and _triton_runs(self.runner.device)
        if config.use_cuda_kernel or (config.use_cuda_kernel is None and default_kernels):
            from cai.kernels import patch_hf_model

            patch_hf_model(
                model, fused_loss=False, shared_qkv=False, fused_residual=False
            )  # fused RMSNorm, SwiGLU and rotary; the same weights
            carry_residuals(model)  # residual adds inside those RMSNorms: [Note: carried residual]
            defer_rotary(model)  # rotary inside the K/V cache write: [Note: rotary in the cache write]
        if config.tp_size == 1:  # one matmul for q/k/v and one for gate/up: [Note: fused projections]
            fuse_projections(model)
        if config.use_cuda_graph and not on_cuda:
            raise ValueError(
                f"InferenceConfig.use_cuda_graph=True but the model is on {self.runner.device}; CUDA graphs need a "
                "CUDA device (leave use_cuda_graph=None to use them where they run)"
            )
        if config.use_cuda_graph or (config.use_cuda_graph is None and on_cuda and config.tp_size == 1):
            self.runner.use_decode_graphs(
                graph_batch_sizes(config.max_batch_size), config.max_blocks_per_sequence
            )
        self._arrivals = itertools.count()
        self._requests: dict[str, Sequence] = {}
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if eos is None and tokenizer is not None:
            eos = getattr(tokenizer, "eos_token_id", None)
        self._eos = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self._drafter: ModelDrafter | PromptLookupDrafter | None = None
        self.n_spec_tokens = 0
        self.num_drafted = 0  # draft tokens verified, since construction
        self.num_accepted = 0  # of them, accepted
        if config.use_spec_dec:
            self.enable_spec_dec()  # prompt lookup; a draft model comes through enable_spec_dec

    # -- speculative decoding -----------------------------------------------------------------------------------
    def enable_spec_dec(
        self,
        drafter_model: nn.Module | None = None,
        n_spec_tokens: int | None = None,
        use_glide_drafter: bool = False,
    ) -> None:
        """Decode speculatively: each decoding sequence gets up to ``n_spec_tokens`` (default
        ``InferenceConfig.max_n_spec_tokens``) draft tokens per step, verified in the same target forward (see
        _speculative.py [Note: speculative step]). ``drafter_model``: a small causal LM with the target's
        vocabulary (cast to the config's dtype, moved to the target's device); None drafts by prompt lookup."""
        if use_glide_drafter:
            raise NotImplementedError(
                "use_glide_drafter=True (GLIDE, a drafter reading the target's KV cache) is not built; pass a plain "
                "drafter_model or none (prompt lookup)"
            )
        k = self.config.max_n_spec_tokens if n_spec_tokens is None else n_spec_tokens
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"n_spec_tokens={k!r} must be a positive int")
        if drafter_model is None:
            self._drafter = PromptLookupDrafter()
        else:
            if drafter_model is self.model:
                raise ValueError("drafter_model is the target model itself; pass a separate, smaller model")
            drafter_model = drafter_model.to(device=self.runner.device, dtype=self.config.dtype)
            self._drafter = ModelDrafter(
                drafter_model, vocab_size=self.model.get_output_embeddings().weight.shape[0]
            )
        self.n_spec_tokens = k

    def disable_spec_dec(self) -> None:
        """Back to one token per sequence per step (the drafter is kept for ``enable_spec_dec`` to reuse)."""
        self.n_spec_tokens = 0

    def clear_spec_dec(self) -> None:
        """Stop decoding speculatively and drop the drafter."""
        self.n_spec_tokens = 0
        self._drafter = None

    @property
    def use_spec_dec(self) -> bool:
        return self._drafter is not None and self.n_spec_tokens > 0

    def _draft(self, batch: Any) -> list[list[int]] | None:
        """Draft tokens for each decoding sequence of ``batch`` whose blocks can be reserved, within the step's
        token budget; the drafter's probabilities go to ``self._draft_probs``."""
        budget = self.config.token_budget - sum(batch.num_new)
        drafts: list[list[int]] = []
        self._draft_probs: dict[int, torch.Tensor | None] = {}
        for i, (seq, c, n, take) in enumerate(
            zip(batch.seqs, batch.num_computed, batch.num_new, batch.samples, strict=True)
        ):
            k = min(self.n_spec_tokens, seq.max_new_tokens - seq.num_output_tokens - 1, budget)
            proposal: list[int] = []
            if take and n == 1 and c == seq.num_tokens - 1 and k > 0:
                proposal, probs = self._drafter.propose(
                    seq.request_id, seq.tokens, k, seq.params, seq.generator
                )
                if proposal and self.scheduler.reserve_more(seq, 1 + len(proposal), batch.copies):
                    self._draft_probs[i] = probs
                    budget -= len(proposal)
                else:
                    proposal = []
            drafts.append(proposal)
        return drafts if any(drafts) else None

    # -- requests -----------------------------------------------------------------------------------------------
    def add_request(
        self,
        request_ids: str | int | list[str | int] | None = None,
        prompts: str | list[str] | None = None,
        prompts_token_ids: list[int] | list[list[int]] | torch.Tensor | None = None,
        generation_config: Any = None,
        sampling_params: SamplingParams | None = None,
    ) -> list[str]:
        """Queue requests; returns their ids. A request that can never run (prompt over ``max_input_len``,
        ``max_new_tokens`` over ``max_output_len``, or more tokens than the whole KV pool) raises ValueError and
        nothing of this call is queued."""
        ids, token_lists, params = self.resolve_requests(
            request_ids, prompts, prompts_token_ids, generation_config, sampling_params
        )
        seqs = [self._make_sequence(rid, toks, params) for rid, toks in zip(ids, token_lists, strict=True)]
        names = [s.request_id for s in seqs]
        if len(set(names)) != len(names):
            raise ValueError(f"request ids {names} repeat within one call; pass distinct ids")
        for seq in seqs:
            self._requests[seq.request_id] = seq
            self.scheduler.add(seq)
        return [s.request_id for s in seqs]

    def resolve_requests(
        self,
        request_ids: str | int | list[str | int] | None,
        prompts: str | list[str] | None,
        prompts_token_ids: list[int] | list[list[int]] | torch.Tensor | None,
        generation_config: Any = None,
        sampling_params: SamplingParams | None = None,
    ) -> tuple[list[Any], list[list[int]], SamplingParams]:
        """``add_request``'s arguments as one id per prompt (None: the engine names it), the prompts' token ids
        (text tokenized) and the sampling parameters; raises ValueError when ids and prompts do not pair up."""
        token_lists = self._token_lists(prompts, prompts_token_ids)
        if request_ids is None:
            ids: list[Any] = [None] * len(token_lists)
        elif isinstance(request_ids, (str, int)):
            ids = [request_ids]
        else:
            ids = list(request_ids)
        if len(ids) != len(token_lists):
            raise ValueError(f"{len(ids)} request ids for {len(token_lists)} prompts; pass one id per prompt")
        params = sampling_params or SamplingParams.from_config(self.config, generation_config)
        return ids, token_lists, params

    def _token_lists(self, prompts: Any, prompts_token_ids: Any) -> list[list[int]]:
        if prompts_token_ids is not None:
            if isinstance(prompts_token_ids, torch.Tensor):
                prompts_token_ids = prompts_token_ids.tolist()
            if prompts_token_ids and isinstance(prompts_token_ids[0], int):
                prompts_token_ids = [prompts_token_ids]
            return [list(map(int, t)) for t in prompts_token_ids]
        if prompts is None:
            raise ValueError("add_request got neither prompts nor prompts_token_ids; pass one of them")
        if self.tokenizer is None:
            raise ValueError(
                "text prompts need a tokenizer; pass one to InferenceEngine or use prompts_token_ids"
            )
        if isinstance(prompts, str):
            prompts = [prompts]
        return [self.tokenizer(p)["input_ids"] for p in prompts]

    def _make_sequence(self, request_id: Any, tokens: list[int], params: SamplingParams) -> Sequence:
        arrival = next(self._arrivals)
        rid = str(arrival) if request_id is None else str(request_id)
        cfg = self.config
        max_new = params.max_new_tokens or cfg.max_output_len
        pool = cfg.total_blocks * cfg.block_size
        if rid in self._requests and not self._requests[rid].status.finished:
            raise ValueError(f"request id {rid!r} is already queued or running; use a new id")
        if not tokens:
            raise ValueError(f"request {rid!r} has an empty prompt; pass at least one token")
        if params.stop and self.tokenizer is None:
            raise ValueError(
                f"request {rid!r} has stop strings {params.stop!r} but the engine has no tokenizer"
            )
        if len(tokens) > cfg.max_input_len:
            raise ValueError(
                f"request {rid!r} has a {len(tokens)}-token prompt, over max_input_len={cfg.max_input_len}; "
                "shorten it or raise InferenceConfig.max_input_len"
            )
        if max_new > cfg.max_output_len:
            raise ValueError(
                f"request {rid!r} asks for max_new_tokens={max_new}, over max_output_len={cfg.max_output_len}; "
                "ask for fewer or raise InferenceConfig.max_output_len"
            )
        if len(tokens) + max_new > pool:
            raise ValueError(
                f"request {rid!r} needs up to {len(tokens)} + {max_new} tokens of KV cache but the pool holds "
                f"{pool} ({cfg.total_blocks} blocks of {cfg.block_size}); raise InferenceConfig.num_blocks or ask "
                "for fewer tokens"
            )
        generator = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else shared_seed(self._tp_group, self.runner.device)
            generator = torch.Generator(self.runner.device).manual_seed(seed)
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self._eos))
        return Sequence(rid, arrival, tokens, params, max_new, frozenset(stop), generator)

    def abort_request(self, request_id: str | int) -> None:
        """Stop a queued or running request and free its blocks (an unknown or finished id is ignored)."""
        self.scheduler.abort(str(request_id))
        self._requests.pop(str(request_id), None)
        if self._drafter is not None:
            self._drafter.forget(str(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- running ------------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch; returns a ``RequestOutput`` for each request that got a new token this step."""
        return [self._output(s) for s in self._step()]

    def _step(self) -> list[Sequence]:
        batch = self.scheduler.schedule()
        if not len(batch):
            return []
        drafts = self._draft(batch) if self.use_spec_dec else None
        if drafts is None and self.runner.greedy_covers(batch):
            tokens = self.runner.greedy(batch, ahead=self.scheduler.can_run_ahead(batch))
            return self._advance(batch, tokens, [1] * len(batch.seqs), None)
        raw = self.runner.run(batch, drafts)
        sampling = [i for i, take in enumerate(batch.samples) if take]
        spans = [1 + (len(drafts[i]) if drafts else 0) for i in sampling]
        params: list[SamplingParams] = []
        history: list[list[int]] = []
        for i, span in zip(sampling, spans, strict=True):
            seq = batch.seqs[i]
            for j in range(span):
                params.append(seq.params)
                history.append(seq.tokens + drafts[i][:j] if j else seq.tokens)
        logits = apply_penalties_and_masks(raw, params, history)
        if drafts is None:
            tokens: list[int] | list[list[int]] = sample(
                logits, params, [batch.seqs[i].generator for i in sampling]
            )
        else:
            emitted: list[list[int]] = []
            row = 0
            for i, span in zip(sampling, spans, strict=True):
                seq = batch.seqs[i]
                probs = self._draft_probs.get(i)
                emitted.append(
                    verify(
                        logits[row : row + span],
                        drafts[i],
                        None if probs is None else probs.to(logits.device),
                        seq.params,
                        seq.generator,
                    )
                )
                row += span
                self.num_drafted += len(drafts[i])
                self.num_accepted += len(emitted[-1]) - 1
            tokens = emitted
        return self._advance(batch, tokens, spans, raw)

    def _advance(
        self,
        batch: ScheduledBatch,
        tokens: list[int] | list[list[int]],
        spans: list[int],
        raw: torch.Tensor | None,
    ) -> list[Sequence]:
        """Give the sampling sequences of ``batch`` their ``tokens``; ``raw`` holds the logits of the ``spans``
        rows of each (for logprobs)."""
        sampling = [i for i, take in enumerate(batch.samples) if take]
        rows = [sum(spans[:j]) for j in range(len(spans))]
        before = [batch.seqs[i].num_output_tokens for i in sampling]
        advanced = self.scheduler.update(batch, tokens)
        for i, first_row, old in zip(sampling, rows, before, strict=True):
            seq = batch.seqs[i]
            if seq.params.logprobs is not None:
                for j, token in enumerate(seq.output_token_ids[old:]):
                    seq.logprobs.append(logprobs_of(raw[first_row + j], token, seq.params.logprobs))
        for seq in advanced:
            if seq.params.stop and not seq.status.finished:
                self._check_stop_strings(seq)
            if seq.status.finished:
                del self._requests[seq.request_id]
                if self._drafter is not None:
                    self._drafter.forget(seq.request_id)
        return advanced

    def _check_stop_strings(self, seq: Sequence) -> None:
        text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        found = [i for i in (text.find(s) for s in seq.params.stop) if i >= 0]
        if found:
            seq.text_end = min(found)
            self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)

    def _output(self, seq: Sequence) -> RequestOutput:
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)[: seq.text_end]
        finished = seq.status.finished
        return RequestOutput(
            seq.request_id,
            seq.prompt_token_ids,
            seq.output_token_ids,
            text,
            finished,
            seq.status.value if finished else None,
            list(seq.logprobs) if seq.params.logprobs is not None else None,
        )

    def generate(
        self,
        request_ids: str | int | list[str | int] | None = None,
        prompts: str | list[str] | None = None,
        prompts_token_ids: list[int] | list[list[int]] | torch.Tensor | None = None,
        return_token_ids: bool = False,
        generation_config: Any = None,
    ) -> list[str | None] | tuple[list[str | None], list[list[int]]]:
        """Add the given prompts (if any) and run until every request is done.

        Returns the output texts of the requests that finished in this call, in arrival order, and with
        ``return_token_ids=True`` also their new token ids. ``generation_config`` is a transformers
        ``GenerationConfig`` (``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
        ``min_p``, ``repetition_penalty``, ``eos_token_id``) or a ``SamplingParams``."""
        if prompts is not None or prompts_token_ids is not None:
            if isinstance(generation_config, SamplingParams):
                self.add_request(request_ids, prompts, prompts_token_ids, sampling_params=generation_config)
            else:
                self.add_request(request_ids, prompts, prompts_token_ids, generation_config=generation_config)
        done: list[Sequence] = []
        while self.scheduler.has_unfinished():
            done.extend(s for s in self._step() if s.status.finished)
        done.sort(key=lambda s: s.arrival)
        texts = [self._output(s).text for s in done]
        if return_token_ids:
            return texts, [s.output_token_ids for s in done]
        return texts

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free
