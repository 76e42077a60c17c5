"""What the modes of bench_infer.py share: cai engines built from its arguments, phase notes on stderr,
timing helpers and the table printer."""

from __future__ import annotations

import gc
import math
import random
import sys

import torch

from cai.infer import InferenceConfig, InferenceEngine, SamplingParams

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def note(text: str) -> None:
    """A phase without counts (a compile, a server start) on the progress stream."""
    print(text, file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    """Give the memory of a dropped engine (its KV pool) back before the next one is built."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between the closest ranks; None for no values."""
    s = sorted(values)
    if not s:
        return None
    k = (len(s) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def random_prompts(rng: random.Random, n: int, lo: int, hi: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def cai_engine(
    model,
    args,
    *,
    max_input: int,
    max_output: int,
    batch: int,
    prefix_caching: bool = False,
    drop_eos: bool = False,
) -> InferenceEngine:
    """An engine on ``model``. ``drop_eos``: built as for a model without an EOS token, so that requests that
    cannot say ``ignore_eos`` (the HTTP API has no such field) still run to their length."""
    gen = getattr(model, "generation_config", None)
    saved = getattr(gen, "eos_token_id", None)
    if drop_eos and gen is not None:
        gen.eos_token_id = None  # the engine reads the model's EOS once, when it is built
    try:
        return InferenceEngine(
            model,
            None,
            InferenceConfig(
                dtype=DTYPES[args.dtype],
                max_batch_size=batch,
                max_input_len=max_input,
                max_output_len=max_output,
                block_size=args.block_size,
                num_blocks=args.num_blocks,
                max_num_batched_tokens=args.max_num_batched_tokens,
                # Off unless measured: random prompts share nothing and the lookups would only cost.
                enable_prefix_caching=prefix_caching,
                ignore_eos=True,
                use_cuda_kernel={"default": None, "on": True, "off": False}[args.use_cuda_kernel],
            ),
        )
    finally:
        if drop_eos and gen is not None:
            gen.eos_token_id = saved


def warm(engine: InferenceEngine, vocab: int) -> None:
    """Two short untimed requests (a short and a full-length prompt): kernels compile, buffers are allocated."""
    rng = random.Random(-1)
    longest = engine.config.max_input_len
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in sorted({min(8, longest), longest})]
    engine.add_request(
        prompts_token_ids=prompts, sampling_params=SamplingParams(max_new_tokens=2, ignore_eos=True)
    )
    while engine.has_unfinished_requests():
        engine.step()


def table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, ["-" * w for w in widths], *rows]:
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        print("  " + "  ".join(cells).rstrip())


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:,.1f}"
