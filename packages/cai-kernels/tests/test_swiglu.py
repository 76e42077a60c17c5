"""SwiGLU against a float64 reference. Tolerances relative to the largest reference magnitude: fp32 1e-5,
bf16 2e-2."""

import pytest
import torch
import torch.nn.functional as F

from cai.kernels import SwiGLUMLP, swiglu, swiglu_packed

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(1,), (3, 7), (2, 5, 100), (4097,)], ids=str)
def test_swiglu_matches_float64(shape, dtype, impl, device):
    g = torch.Generator().manual_seed(1)
    a = (torch.randn(shape, generator=g) * 3).to(device=device, dtype=dtype).requires_grad_()
    b = torch.randn(shape, generator=g).to(device=device, dtype=dtype).requires_grad_()
    dc = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    c = swiglu(a, b)
    assert c.dtype == dtype and c.shape == a.shape
    c.backward(dc)
    ad, bd = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    cd = F.silu(ad) * bd
    cd.backward(dc.double())
    for name, t, r in [("c", c, cd), ("da", a.grad, ad.grad), ("db", b.grad, bd.grad)]:
        err = (t.double() - r).abs().max().item()
        assert err <= TOL[dtype] * r.abs().max().item(), f"{name}: {err}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(2,), (3, 14), (2, 5, 200), (1, 4100)], ids=str)
def test_swiglu_packed_matches_float64(shape, dtype, impl, device):
    # [gate | up] along the last dimension, as one matmul makes them; also a strided view of a wider row
    g = torch.Generator().manual_seed(2)
    wide = (torch.randn(*shape[:-1], shape[-1] + 6, generator=g) * 3).to(device=device, dtype=dtype)
    for x in (wide[..., : shape[-1]].contiguous(), wide[..., 3 : 3 + shape[-1]]):
        f = shape[-1] // 2
        with torch.no_grad():
            c = swiglu_packed(x)
        ref = F.silu(x[..., :f].double()) * x[..., f:].double()
        assert c.dtype == dtype and c.shape == ref.shape
        assert (c.double() - ref).abs().max().item() <= TOL[dtype] * ref.abs().max().item()
    with pytest.raises(ValueError, match="must be even"):
        swiglu_packed(torch.ones(3, 5, device=device, dtype=dtype))


def test_mlp_takes_over_linears(impl, device):
    gate, up, down = (torch.nn.Linear(i, o, device=device) for i, o in ((8, 12), (8, 12), (12, 8)))
    mlp = SwiGLUMLP(gate, up, down)
    assert mlp.gate_proj is gate and list(dict(mlp.named_parameters())) == [
        "gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias", "down_proj.weight", "down_proj.bias",
    ]  # fmt: skip
    x = torch.randn(3, 8, device=device)
    torch.testing.assert_close(mlp(x), down(F.silu(gate(x)) * up(x)), rtol=1e-5, atol=1e-6)


def test_mismatched_inputs_are_rejected():
    with pytest.raises(ValueError, match="must match"):
        swiglu(torch.randn(2, 3), torch.randn(3, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mlp_gate_up_function_matches_float64(dtype, impl, device):
    # Bias-free Linear layers take one function for both projections and the SwiGLU on the Triton path (the input's
    # gradient is one matmul accumulated into the other); the torch path runs the modules. Both against float64.
    g = torch.Generator().manual_seed(3)
    gate, up, down = (torch.nn.Linear(i, o, bias=False) for i, o in ((32, 48), (32, 48), (48, 32)))
    for lin in (gate, up, down):
        lin.weight.data = (torch.randn(lin.weight.shape, generator=g) / 5).to(dtype)
    mlp = SwiGLUMLP(gate, up, down).to(device)
    ref = {n: p.detach().double().cpu().requires_grad_() for n, p in mlp.named_parameters()}
    x = torch.randn(2, 5, 32, generator=g).to(dtype)
    dy = torch.randn(2, 5, 32, generator=g).to(dtype)
    xa, xr = x.clone().to(device).requires_grad_(), x.double().requires_grad_()
    y = mlp(xa)
    y.backward(dy.to(device))
    yr = F.silu(xr @ ref["gate_proj.weight"].T) * (xr @ ref["up_proj.weight"].T) @ ref["down_proj.weight"].T
    yr.backward(dy.double())
    pairs = [("y", y, yr), ("dx", xa.grad, xr.grad)] + [
        (f"d{n}", p.grad, ref[n].grad) for n, p in mlp.named_parameters()
    ]
    for name, got, want in pairs:
        err = (got.double().cpu() - want).abs().max().item()
        assert err <= TOL[dtype] * want.abs().max().item(), f"{name}: {err}"


def test_mlp_runs_hooked_projections_as_modules(impl, device):
    # a module hook on a projection (Gemini gathers a chunk in one) must run: such an MLP takes the modules' path
    gate, up, down = (
        torch.nn.Linear(i, o, bias=False, device=device) for i, o in ((8, 12), (8, 12), (12, 8))
    )
    mlp = SwiGLUMLP(gate, up, down)
    seen = []
    up.register_forward_pre_hook(lambda m, args: seen.append("up"))
    x = torch.randn(3, 8, device=device, requires_grad=True)
    torch.testing.assert_close(mlp(x), down(F.silu(gate(x)) * up(x)), rtol=1e-5, atol=1e-6)
    assert seen == ["up", "up"]
