"""Shared-input projections ([Note: shared-input projections]): outputs and gradients against float64, the input
gradient accumulated inside the matmuls (no separate adds), and every case that must take the modules' own path."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from cai.kernels import convert_to_fp8
from cai.kernels._fp8 import Fp8Linear
from cai.kernels._projections import share_input

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
NAMES = ("q_proj", "k_proj", "v_proj")


class Attention(nn.Module):
    """The projections of a grouped-query attention, called one after the other as Hugging Face's are."""

    def __init__(self, hidden=32, q=32, kv=16, bias=False, dtype=torch.float32):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        for name, out in zip(NAMES, (q, kv, kv)):
            lin = nn.Linear(hidden, out, bias=bias)
            lin.weight.data = (torch.randn(out, hidden, generator=g) / 5).to(dtype)
            if bias:
                lin.bias.data = torch.randn(out, generator=g).to(dtype)
            setattr(self, name, lin)

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return q.sum(-1, keepdim=True) * k.repeat(1, 1, 2) + v.repeat(1, 1, 2)


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _run(module, x, dy):
    x = x.clone().requires_grad_()
    y = module(x)
    with OpCounter() as counter:
        y.backward(dy)
    grads = {n: p.grad for n, p in module.named_parameters()}
    return y, x.grad, grads, counter.ops


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_shared_projections_match_float64(dtype, bias, device):
    shared = Attention(bias=bias, dtype=dtype).to(device)
    assert share_input(shared)
    ref = Attention(bias=bias).double()
    ref.load_state_dict({k: v.double().cpu() for k, v in shared.state_dict().items()})
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 32, generator=g).to(dtype)
    dy = torch.randn(2, 5, 32, generator=g).to(dtype)
    y, dx, grads, _ = _run(shared, x.to(device), dy.to(device))
    yr, dxr, grads_r, _ = _run(ref, x.double(), dy.double())
    pairs = [("y", y, yr), ("dx", dx, dxr)] + [(f"d{n}", grads[n], grads_r[n]) for n in grads_r]
    for name, got, want in pairs:
        err = (got.double().cpu() - want).abs().max().item()
        assert err <= TOL[dtype] * want.abs().max().item(), f"{name}: {err}"


def test_input_gradient_is_accumulated_in_the_matmuls(device):
    # the plain modules' backward adds the three input gradients in two passes; the shared one adds none
    plain, shared = Attention().to(device), Attention().to(device)
    assert share_input(shared)
    x, dy = torch.randn(2, 5, 32, device=device), torch.randn(2, 5, 32, device=device)
    *plain_out, plain_ops = _run(plain, x, dy)
    *shared_out, shared_ops = _run(shared, x, dy)
    torch.testing.assert_close(shared_out[1], plain_out[1], rtol=1e-5, atol=1e-6)
    assert shared_ops.count("addmm_") == 2 and plain_ops.count("addmm_") == 0
    assert plain_ops.count("add") + plain_ops.count("add_") >= 2
    assert (
        shared_ops.count("add") + shared_ops.count("add_")
        == plain_ops.count("add") + plain_ops.count("add_") - 2
    )


def _grads_of(module, x):
    x = x.clone().requires_grad_()
    module(x).square().sum().backward()
    return x.grad, {n: p.grad.clone() for n, p in module.named_parameters()}


def test_hooked_replaced_or_converted_projections_take_their_own_path(device):
    x = torch.randn(2, 3, 32, device=device)
    want = _grads_of(Attention().to(device), x)
    # a hook on one projection (Gemini gathers its chunk in one): every projection runs as a module
    hooked = Attention().to(device)
    share_input(hooked)
    seen = []
    hooked.k_proj.register_forward_pre_hook(lambda m, args: seen.append("k"))
    got = _grads_of(hooked, x)
    assert seen == ["k"]
    torch.testing.assert_close(got, want)
    # one projection replaced by another module (a parallel layer, say): that module runs, the others alone
    replaced = Attention().to(device)
    share_input(replaced)
    new_q = nn.Linear(32, 32, bias=False, device=device)
    new_q.weight.data = replaced.q_proj.weight.data * 2
    replaced.q_proj = new_q
    y = replaced(x)
    q, k, v = (
        F.linear(x, new_q.weight),
        F.linear(x, replaced.k_proj.weight),
        F.linear(x, replaced.v_proj.weight),
    )
    torch.testing.assert_close(y, q.sum(-1, keepdim=True) * k.repeat(1, 1, 2) + v.repeat(1, 1, 2))
    # a class changed in place (convert_to_fp8): the new class's forward runs
    converted = Attention().to(device)
    share_input(converted)
    assert convert_to_fp8(converted) == 3
    calls = []
    original = Fp8Linear.forward
    try:
        Fp8Linear.forward = lambda self, x: calls.append(self) or original(self, x)
        converted(x)
    finally:
        Fp8Linear.forward = original
    assert calls == [converted.q_proj, converted.k_proj, converted.v_proj]


def test_no_grad_autocast_and_copies(device):
    module = Attention().to(device)
    share_input(module)
    x = torch.randn(2, 3, 32, device=device)
    ref = Attention().to(device)
    with torch.no_grad():
        torch.testing.assert_close(module(x), ref(x))
    with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16):
        got, want = module(x.requires_grad_()), ref(x)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)
    # a deep copy (a pipeline stage) computes with its own weights
    clone = copy.deepcopy(module)
    clone.v_proj.weight.data.mul_(3)
    ref.v_proj.weight.data.mul_(3)
    torch.testing.assert_close(_grads_of(clone, x.detach()), _grads_of(ref, x.detach()))
    assert clone.v_proj.forward.group is not module.v_proj.forward.group


def test_only_plain_linears_of_one_input_size_are_shared():
    module = Attention()
    module.k_proj = nn.Linear(16, 16)
    assert not share_input(module)
    assert "forward" not in module.q_proj.__dict__
