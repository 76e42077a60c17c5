"""Throughput arithmetic shared by the examples: MFU, Colossal-AI's two TFLOPS figures, peak memory.

MFU follows the torchtitan/PaLM convention: ``tokens/s x (6 N + 12 L h s) / peak``, with N all parameters,
L layers, h hidden size, s sequence length and a peak of 989 TFLOP/s (dense bf16, H100/H200). Activation
recomputation is *not* counted as useful work. Colossal-AI's README reports two other figures, printed next to
it so that numbers compare: a Megatron-style count that does include recomputation, and ``2 (3 + ckpt) N``
per token.
"""

from __future__ import annotations

import os
import resource
import sys
from dataclasses import dataclass

import torch

PEAK_FLOPS = 989e12  # dense bf16 FLOP/s of one H100/H200 SXM


@dataclass(kw_only=True, frozen=True)
class ModelShape:
    """What the FLOP formulas need from a decoder-only transformer."""

    num_params: int
    num_layers: int
    hidden_size: int
    vocab_size: int

    @classmethod
    def of(cls, model: torch.nn.Module, config) -> ModelShape:
        """Read the shape of a Hugging Face causal LM (``config`` is its ``PretrainedConfig``).

        Counts the parameters once each (tied embeddings once), before any sharding.
        """
        seen = {id(p): p.numel() for p in model.parameters()}
        return cls(
            num_params=sum(seen.values()),
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
        )

    def flops_per_token(self, seq_len: int) -> float:
        """Useful training FLOPs per token: 6 N for the matmuls plus 12 L h s for attention scores."""
        return 6 * self.num_params + 12 * self.num_layers * self.hidden_size * seq_len

    def megatron_flops(self, tokens: int, seq_len: int, grad_ckpt: bool) -> float:
        """Colossal-AI's Megatron-style count for ``tokens`` tokens, recomputation included."""
        h, L, V = self.hidden_size, self.num_layers, self.vocab_size
        factor = 3 + bool(grad_ckpt)
        return 24 * factor * tokens * L * h * h * (1.0 + seq_len / (6.0 * h) + V / (16.0 * L * h))

    def simple_flops(self, tokens: int, grad_ckpt: bool) -> float:
        """Colossal-AI's ``2 (3 + ckpt) N`` FLOPs per token, for ``tokens`` tokens."""
        return 2 * (3 + bool(grad_ckpt)) * self.num_params * tokens


@dataclass(kw_only=True, frozen=True)
class Throughput:
    """Per-device figures for ``tokens`` tokens processed by one device in ``seconds``."""

    tokens_per_s: float
    mfu: float
    tflops_megatron: float
    tflops_simple: float

    @classmethod
    def measure(
        cls,
        shape: ModelShape,
        *,
        tokens: int,
        seconds: float,
        seq_len: int,
        grad_ckpt: bool | str = False,
        peak_flops: float = PEAK_FLOPS,
    ) -> Throughput:
        rate = tokens / max(seconds, 1e-12)
        return cls(
            tokens_per_s=rate,
            mfu=rate * shape.flops_per_token(seq_len) / peak_flops,
            tflops_megatron=shape.megatron_flops(tokens, seq_len, grad_ckpt) / seconds / 1e12,
            tflops_simple=shape.simple_flops(tokens, grad_ckpt) / seconds / 1e12,
        )


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process: device memory allocated on CUDA, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return host_peak_gib()


def host_peak_gib() -> float:
    """Peak resident set size of this process, in GiB."""
    # ru_maxrss is KiB on Linux, bytes on macOS.
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**30


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ProgressBar:
    """One status line on rank 0: step, loss, tokens/s, MFU, memory.

    On a terminal the line is rewritten in place with ``\\r``; otherwise (CI logs, pipes) each update is a
    full line, so the log stays readable. Other ranks print nothing. Callers update every few steps.
    """

    def __init__(self, total: int, *, enabled: bool, stream=None) -> None:
        self.total, self.enabled = total, enabled
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() and os.environ.get("TERM") != "dumb"

    def update(self, step: int, *, loss: float, tokens_per_s: float, mfu: float, mem_gib: float) -> None:
        if not self.enabled:
            return
        width = len(str(self.total))
        frac = step / self.total
        bar = "#" * int(20 * frac) + "." * (20 - int(20 * frac))
        line = (
            f"step {step:>{width}}/{self.total} [{bar}] loss {loss:.4f} | "
            f"{tokens_per_s:,.0f} tok/s | MFU {100 * mfu:.3g}% | mem {mem_gib:.2f} GiB"
        )
        if self.tty:
            self.stream.write("\r" + line)
            if step == self.total:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def newline(self) -> None:
        """End an in-place line before printing something else."""
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
