"""The host Adam stepper shared by cai-zero's and cai-gemini's offloaded optimizers (CPU paths; the CUDA side-stream
copies run in packages/cai-zero/tests/test_gpu.py and packages/cai-gemini/tests/test_gpu.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from cai.kernels.optim import CPUAdam, HostStepper, adam_step, adam_update, adamw_mode


def test_adamw_mode_reads_the_group_or_the_optimizer_type() -> None:
    p = [torch.nn.Parameter(torch.zeros(2))]
    assert adamw_mode(torch.optim.AdamW(p), torch.optim.AdamW(p).param_groups[0])
    assert not adamw_mode(torch.optim.Adam(p), torch.optim.Adam(p).param_groups[0])
    assert adamw_mode(torch.optim.Adam(p, decoupled_weight_decay=True), {"decoupled_weight_decay": True})
    assert not adamw_mode(CPUAdam(p, adamw_mode=False), CPUAdam(p, adamw_mode=False).param_groups[0])


@pytest.mark.parametrize("adamw", [True, False])
def test_adam_step_is_adam_update_with_the_group_hyperparameters(adamw: bool) -> None:
    g = torch.Generator().manual_seed(0)
    master, grad = torch.randn(37, generator=g), torch.randn(37, generator=g).to(torch.bfloat16)
    group = {
        "lr": torch.tensor(3e-3),
        "betas": (0.8, 0.95),
        "eps": 1e-6,
        "weight_decay": 0.1,
        "bias_correction": False,
    }
    mine = [master.clone(), torch.zeros(37), torch.zeros(37)]
    ref = [master.clone(), torch.zeros(37), torch.zeros(37)]
    out, ref_out = torch.empty(37, dtype=torch.bfloat16), torch.empty(37, dtype=torch.bfloat16)
    for step in (1, 2):
        adam_step(mine[0], grad, mine[1], mine[2], group, step=step, adamw=adamw, out=out)
        adam_update(
            ref[0], grad, ref[1], ref[2], step=step, lr=3e-3, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1,
            adamw_mode=adamw, bias_correction=False, out=ref_out,
        )  # fmt: skip
    for a, b in zip([*mine, out], [*ref, ref_out]):
        assert torch.equal(a, b)
    assert not torch.equal(mine[0], master)


def test_worker_runs_submissions_in_order_off_the_calling_thread() -> None:
    stepper = HostStepper(torch.device("cpu"), name="test-host-step")
    order: list[tuple[int, str]] = []
    futures = [
        stepper.submit(lambda i=i: order.append((i, threading.current_thread().name)) or i) for i in range(5)
    ]
    assert [f.result() for f in futures] == list(range(5))
    assert [i for i, _ in order] == list(range(5))
    assert all(name.startswith("test-host-step") for _, name in order)
    assert 1 <= HostStepper.worker_threads() <= max(1, torch.get_num_threads())


def test_copy_up_off_cuda_is_synchronous_into_or_new() -> None:
    stepper = HostStepper(torch.device("cpu"), name="test-host-copy")
    src = torch.arange(6, dtype=torch.bfloat16)
    into = torch.zeros(6, dtype=torch.bfloat16)
    out, event = stepper.copy_up(src, into=into)
    assert out is into and event is None and torch.equal(into, src)
    fresh, event = stepper.copy_up(src)
    assert event is None and torch.equal(fresh, src)
    stepper.join(event, fresh)  # nothing to order off CUDA
