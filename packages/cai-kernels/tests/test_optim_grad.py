"""The working-precision gradient shard shared by cai-zero and cai-gemini."""

from __future__ import annotations

import torch

from cai.kernels.optim import accumulate_grad_shard


def _grads() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, generator=g).to(torch.bfloat16), torch.randn(64, generator=g).to(torch.bfloat16)


def test_first_gradient_is_kept_as_it_arrived_and_the_second_sums_in_fp32() -> None:
    a, b = _grads()
    acc = accumulate_grad_shard(None, a)
    assert acc is a and acc.dtype == torch.bfloat16  # no fp32 copy for one micro-batch
    acc = accumulate_grad_shard(acc, b)
    assert acc.dtype == torch.float32
    assert torch.equal(acc, a.float() + b.float())  # exact: bf16 values are exact in fp32
    assert torch.equal(a, _grads()[0])  # the kept gradient was not modified


def test_borrowed_gradient_is_copied_and_a_scale_goes_to_fp32_at_once() -> None:
    a, _ = _grads()
    kept = accumulate_grad_shard(None, a, owned=False)
    assert kept is not a and torch.equal(kept, a)
    scaled = accumulate_grad_shard(None, a, scale=0.25)
    assert scaled.dtype == torch.float32 and torch.equal(scaled, a.float() * 0.25)
    f = a.float()
    assert accumulate_grad_shard(None, f, scale=0.5) is f  # owned fp32: scaled in place, no allocation
    borrowed = a.float()
    out = accumulate_grad_shard(None, borrowed, scale=0.5, owned=False)
    assert out is not borrowed and torch.equal(borrowed, a.float())


def test_sum_moves_into_the_given_fp32_buffer_only_when_needed() -> None:
    a, b = _grads()
    buffer = torch.full((64,), float("nan"))
    asked = []

    def fp32() -> torch.Tensor:
        asked.append(1)
        return buffer

    acc = accumulate_grad_shard(None, a, fp32=fp32)
    assert acc is a and not asked  # one micro-batch never touches the buffer
    acc = accumulate_grad_shard(acc, b, fp32=fp32)
    assert acc is buffer and torch.equal(buffer, a.float() + b.float())
    acc = accumulate_grad_shard(acc, a, fp32=fp32)
    assert acc is buffer and len(asked) == 1
    first32 = a.float()
    assert (
        accumulate_grad_shard(None, first32, fp32=fp32) is buffer
    )  # an fp32 first gradient goes into the buffer
    assert torch.equal(buffer, first32)
