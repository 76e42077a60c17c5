"""InferenceConfig: Colossal-AI's field names and defaults, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

_DTYPES = {
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}


def _dtype(value: str | torch.dtype) -> torch.dtype:
    if isinstance(value, torch.dtype):
        if value not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"InferenceConfig.dtype={value} is not supported; use fp16, bf16 or fp32")
        return value
    if isinstance(value, str) and value.lower() in _DTYPES:
        return _DTYPES[value.lower()]
    raise ValueError(
        f"InferenceConfig.dtype={value!r} is not a known dtype; pass a torch dtype or one of {sorted(_DTYPES)}"
    )


@dataclass(kw_only=True, frozen=True)
class InferenceConfig:
    """How the engine batches, caches and samples. Field names and defaults are Colossal-AI's.

    Args:
        max_batch_size: most sequences in one step (running, i.e. holding KV blocks). Default 8.
        max_input_len: longest prompt accepted, in tokens; longer prompts are refused by ``add_request``. Default 256.
        max_output_len: most new tokens per request, and the default ``max_new_tokens``. Default 256.
        dtype: the model's dtype, a torch dtype or ``"fp16"`` / ``"bf16"`` / ``"fp32"``; stored as a torch dtype.
        block_size: tokens per KV-cache block. Default 16.
        num_blocks: blocks in the KV-cache pool. ``None`` sizes it as Colossal-AI does,
            ``max_batch_size * ceil((max_input_len + max_output_len) / block_size)``, which never preempts; a
            smaller pool shares memory between requests and preempts (recompute) when it runs out.
        max_num_batched_tokens: token budget of one step (prefill chunks plus one token per decoding
            sequence). ``None``: ``max(max_input_len, max_batch_size, 2048)``, so a prompt is prefilled in one
            step and prefill steps are large enough to keep the GPU busy.
        enable_prefix_caching: share the KV blocks of identical prompt prefixes between requests. Default True.
        do_sample, top_k, top_p, temperature, repetition_penalty, min_p: default sampling of requests that bring
            no generation config; ``do_sample=False`` is greedy.
        ignore_eos: keep generating after the end-of-sequence token, up to the request's limit.
        use_cuda_graph: replay CUDA graphs for decode steps (see _runner.py [Note: decode graphs]). ``None``
            (cai's default): on when the model is on a CUDA device and ``tp_size == 1``; ``True`` where that does
            not hold is an error. The graphs are captured when the engine is built.
        use_cuda_kernel: run the model's RMSNorm, SwiGLU MLP and rotary embedding through cai-kernels' fused
            Triton kernels (``cai.kernels.patch_hf_model``, which replaces those modules in place), with each
            residual add inside the RMSNorm after it where the decoder layers are of the usual pre-norm form
            (_residual.py [Note: carried residual]). ``None``
            (cai's default; Colossal-AI's is False): on when the model is on a CUDA device, Triton imports and
            ``tp_size == 1``, where they make decode 25% faster (see cai-infer's README).

    ``prefill_ratio``, ``pad_input``, ``early_stopping``, ``high_precision``, ``micro_batch_size``,
    ``micro_batch_buffer_size`` and ``max_context_len_to_capture`` are accepted and have no effect: batches are
    never padded (decode graphs pad to their captured size only), prefill and decode share every step under the
    token budget, the decode graphs cover every context length, and scores are always fp32.

    ``use_spec_dec=True`` decodes speculatively from the start with prompt-lookup drafts of up to
    ``max_n_spec_tokens`` tokens (``InferenceEngine.enable_spec_dec`` takes a draft model).

    ``tp_size > 1`` shards the model over the default process group, which must hold ``tp_size`` ranks, each
    running its own engine on the same requests (see _parallel.py [Note: tensor-parallel engine]).

    Colossal-AI fields for features this engine does not build yet (``pp_size`` > 1, ``kv_cache_dtype``,
    ``beam_width`` > 1,
    ``enable_streamingllm``, ``no_repeat_ngram_size``, ``forced_eos_token_id``, ``prompt_template``) are accepted
    here and refused by ``InferenceEngine`` with an error that names them.

    Example::

        config = InferenceConfig(max_batch_size=4, max_input_len=128, max_output_len=32, dtype="bf16")
    """

    max_batch_size: int = 8
    max_output_len: int = 256
    max_input_len: int = 256
    dtype: str | torch.dtype = torch.float16
    kv_cache_dtype: str | None = None
    prompt_template: str | None = None
    do_sample: bool = False
    beam_width: int = 1
    prefill_ratio: float = 1.2
    pad_input: bool = False
    early_stopping: bool = False
    top_k: int | None = 50
    top_p: float | None = 1.0
    temperature: float | None = 1.0
    no_repeat_ngram_size: int | None = 0
    repetition_penalty: float | None = 1.0
    forced_eos_token_id: int | None = None
    ignore_eos: bool = False
    use_spec_dec: bool = False
    max_n_spec_tokens: int = 5
    glimpse_large_kv: bool = False
    block_size: int = 16
    tp_size: int = 1
    pp_size: int = 1
    micro_batch_size: int = 1
    micro_batch_buffer_size: int | None = None
    use_cuda_kernel: bool | None = None
    high_precision: bool | None = False
    use_cuda_graph: bool | None = None  # Colossal-AI: False; None is "where it runs" (see above)
    max_context_len_to_capture: int = 512
    enable_streamingllm: bool = False
    start_token_size: int = 4
    generated_token_size: int = 512
    patched_parallelism_size: int = 1
    # cai additions
    num_blocks: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    min_p: float | None = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", _dtype(self.dtype))
        for name in (
            "max_batch_size",
            "max_output_len",
            "max_input_len",
            "block_size",
            "tp_size",
            "pp_size",
            "max_n_spec_tokens",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"InferenceConfig.{name}={value!r} must be a positive int")
        for name in ("num_blocks", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(
                    f"InferenceConfig.{name}={value!r} must be a positive int or None (automatic)"
                )
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_batch_size:
            raise ValueError(
                f"InferenceConfig.max_num_batched_tokens={self.max_num_batched_tokens} is below max_batch_size="
                f"{self.max_batch_size}: a full batch could not decode one token per sequence each step; raise it "
                "or lower max_batch_size"
            )
        for name in ("use_cuda_graph", "use_cuda_kernel"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(
                    f"InferenceConfig.{name}={value!r} must be True, False or None (where it runs)"
                )
        if self.use_cuda_graph and self.tp_size > 1:
            raise ValueError(
                f"InferenceConfig.use_cuda_graph=True with tp_size={self.tp_size}: decode graphs are built for one "
                "rank only; leave use_cuda_graph=None (off under tensor parallelism) or set tp_size=1"
            )
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"InferenceConfig.top_k={self.top_k} must be >= 0 (0 or None: no top-k)")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"InferenceConfig.top_p={self.top_p} must be in (0, 1]")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"InferenceConfig.min_p={self.min_p} must be in [0, 1]")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"InferenceConfig.temperature={self.temperature} must be >= 0 (0: greedy)")
        if self.repetition_penalty is not None and self.repetition_penalty <= 0:
            raise ValueError(f"InferenceConfig.repetition_penalty={self.repetition_penalty} must be > 0")
        if self.enable_streamingllm and self.start_token_size > self.block_size:
            raise ValueError(
                f"InferenceConfig.start_token_size={self.start_token_size} must be <= block_size={self.block_size}"
            )

    @property
    def max_blocks_per_sequence(self) -> int:
        return math.ceil((self.max_input_len + self.max_output_len) / self.block_size)

    @property
    def total_blocks(self) -> int:
        """Blocks in the pool: ``num_blocks``, or enough for ``max_batch_size`` sequences of the longest length."""
        if self.num_blocks is not None:
            return self.num_blocks
        return self.max_batch_size * self.max_blocks_per_sequence

    @property
    def token_budget(self) -> int:
        """Tokens one step may run: ``max_num_batched_tokens`` or ``max(max_input_len, max_batch_size, 2048)``."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return max(self.max_input_len, self.max_batch_size, 2048)

    def unsupported(self) -> list[str]:
        """``name=value`` for each field set to a feature this engine does not build (empty when all are built)."""
        defaults = {f.name: f.default for f in fields(self)}
        off = [
            "kv_cache_dtype",
            "prompt_template",
            "beam_width",
            "no_repeat_ngram_size",
            "forced_eos_token_id",
            "glimpse_large_kv",
            "pp_size",
            "enable_streamingllm",
            "patched_parallelism_size",
        ]
        out = []
        for name in off:
            value = getattr(self, name)
            if value != defaults[name] and not (name == "no_repeat_ngram_size" and not value):
                out.append(f"{name}={value!r}")
        return out
