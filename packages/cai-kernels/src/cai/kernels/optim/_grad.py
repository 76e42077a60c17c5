"""The gradient shard of a sharded optimizer, summed over micro-batches (cai-zero's buckets, cai-gemini's chunks).

[Note: working-precision gradient shard]
One reduction's gradient shard is kept as it arrived, in the precision it was reduced in (bf16 for bf16
parameters): the same values an fp32 copy would hold, at 2 instead of 4 bytes a parameter, which is what lets an
8B model with fp32 master weights and Adam train on one 141 GB GPU. The update reads it as fp32 (cai.kernels' Adam
reads low-precision gradients directly). A second micro-batch moves the sum to fp32, since adding two bf16
gradients would round; a loss scale other than 1 also goes to fp32 at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["accumulate_grad_shard"]


def accumulate_grad_shard(
    acc: torch.Tensor | None,
    grad: torch.Tensor,
    *,
    scale: float = 1.0,
    owned: bool = True,
    fp32: Callable[[], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The shard's gradient after adding ``grad * scale`` to ``acc`` (None: no gradient yet); see
    [Note: working-precision gradient shard].

    Args:
        acc: what an earlier call returned, or None.
        grad: one reduction's gradient shard, any floating dtype.
        scale: multiplies ``grad`` (the inverse of a loss scale).
        owned: nothing else uses ``grad``'s memory, so it may be kept or scaled in place (else it is copied).
        fp32: returns the fp32 buffer the sum moves into (allocated when first asked for and reused across steps,
            so memory plans can count it); None allocates. With a buffer, an fp32 first gradient is copied into it.

    The result is ``grad`` itself (or its copy) for a first unscaled gradient, else an fp32 tensor.
    """
    if acc is None:
        if scale == 1.0 and (fp32 is None or grad.dtype != torch.float32):
            return grad if owned else grad.clone()
        if fp32 is None and owned and grad.dtype == torch.float32:
            return grad.mul_(scale)
        out = fp32() if fp32 is not None else torch.empty(grad.shape, dtype=torch.float32, device=grad.device)
        out.copy_(grad)
        return out.mul_(scale) if scale != 1.0 else out
    if acc.dtype != torch.float32:  # a second micro-batch: the sum moves to fp32
        out = fp32() if fp32 is not None else torch.empty(acc.shape, dtype=torch.float32, device=acc.device)
        acc = out.copy_(acc)
    return acc.add_(grad, alpha=scale)
