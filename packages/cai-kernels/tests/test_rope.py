"""Rotary embedding against Hugging Face's formula evaluated in float64, forward and backward.
Tolerances relative to the largest reference magnitude: fp32 1e-5, bf16 2e-2."""

from dataclasses import dataclass

import pytest
import torch

from cai.kernels import apply_rotary_pos_emb

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def reference(q, k, cos, sin):
    # HF layout (B, H, T, D), cos/sin (B, T, R); partial rotary rotates the first R dims.
    r = cos.shape[-1]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    out = []
    for x in (q, k):
        xr, xp = x[..., :r], x[..., r:]
        out.append(torch.cat((xr * c + rotate_half(xr) * s, xp), dim=-1))
    return out


def hf_cos_sin(positions, dim, base=10000.0):
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freqs = positions[..., None].double() * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


@dataclass(frozen=True, kw_only=True)
class Case:
    b: int
    t: int
    hq: int
    hk: int
    d: int
    rot: int
    dtype: torch.dtype

    def __str__(self):
        return f"b{self.b}t{self.t}hq{self.hq}hk{self.hk}d{self.d}r{self.rot}-{str(self.dtype)[6:]}"


CASES = [
    Case(b=2, t=5, hq=4, hk=2, d=16, rot=16, dtype=torch.float32),
    Case(b=1, t=7, hq=3, hk=3, d=12, rot=12, dtype=torch.bfloat16),
    Case(b=2, t=3, hq=6, hk=1, d=20, rot=8, dtype=torch.float32),  # partial rotary, odd head counts
    Case(b=1, t=5, hq=5, hk=5, d=24, rot=12, dtype=torch.bfloat16),
]


@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_rope_matches_float64(case, layout, impl, device):
    g = torch.Generator().manual_seed(2)
    c = case
    positions = torch.randint(0, 100, (c.b, c.t), generator=g)
    cos, sin = hf_cos_sin(positions, c.rot)  # (B, T, R) float64
    # (B, T, H, D) projections viewed as (B, H, T, D): the non-contiguous layout HF attention passes.
    q = torch.randn(c.b, c.t, c.hq, c.d, generator=g).to(device=device, dtype=c.dtype)
    k = torch.randn(c.b, c.t, c.hk, c.d, generator=g).to(device=device, dtype=c.dtype)
    q, k = q.transpose(1, 2).requires_grad_(), k.transpose(1, 2).requires_grad_()
    cos_in, sin_in = cos.to(device=device, dtype=c.dtype), sin.to(device=device, dtype=c.dtype)
    if layout == "bhtd":
        qo, ko = apply_rotary_pos_emb(q, k, cos_in, sin_in)
    else:
        qo, ko = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos_in, sin_in, unsqueeze_dim=2)
        qo, ko = qo.transpose(1, 2), ko.transpose(1, 2)
    dq, dk = (
        torch.randn(qo.shape, generator=g).to(device, c.dtype),
        torch.randn(ko.shape, generator=g).to(device, c.dtype),
    )
    ((qo.float() * dq.float()).sum() + (ko.float() * dk.float()).sum()).backward()
    qd, kd = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    rq, rk = reference(qd, kd, cos_in.double(), sin_in.double())
    ((rq * dq.double()).sum() + (rk * dk.double()).sum()).backward()
    for name, t, r in [("q", qo, rq), ("k", ko, rk), ("dq", q.grad, qd.grad), ("dk", k.grad, kd.grad)]:
        assert t.shape == r.shape
        err = (t.double() - r).abs().max().item()
        assert err <= TOL[c.dtype] * r.abs().max().item(), f"{name}: {err}"


def test_position_ids_index_tables(impl, device):
    cos_t, sin_t = hf_cos_sin(torch.arange(32), 8)
    pos = torch.tensor([[3, 1, 4], [9, 2, 6]])
    q, k = torch.randn(2, 2, 3, 8, device=device), torch.randn(2, 1, 3, 8, device=device)
    got = apply_rotary_pos_emb(
        q, k, cos_t.float().to(device), sin_t.float().to(device), position_ids=pos.to(device)
    )
    cos, sin = hf_cos_sin(pos, 8)
    want = reference(q.double(), k.double(), cos.to(device), sin.to(device))
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)


def test_matches_transformers_function(impl):
    hf = pytest.importorskip("transformers.models.llama.modeling_llama")
    q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 3, 16)
    cos, sin = (t.float() for t in hf_cos_sin(torch.arange(3).expand(1, 3), 16))
    for a, b in zip(apply_rotary_pos_emb(q, k, cos, sin), hf.apply_rotary_pos_emb(q, k, cos, sin)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bad_cos_shape_is_rejected():
    with pytest.raises(ValueError, match="R even and R <= head dim 8"):
        apply_rotary_pos_emb(
            torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 3, 10), torch.randn(1, 3, 10)
        )


@pytest.mark.parametrize(
    "cfg", [(1, 8, 4), (2, 4, 4), (4, 2, 2), (16, 1, 4)], ids=lambda c: "t{}h{}w{}".format(*c)
)
def test_every_tile_shape(cfg, monkeypatch, device):
    # The autotuner may pick any tile on a GPU: each must cover ragged token and head blocks, q and k alike.
    from cai.kernels import _rope, _tune

    monkeypatch.delenv("CAI_KERNELS_FALLBACK", raising=False)
    monkeypatch.setenv("CAI_KERNELS_IMPL", "triton")
    monkeypatch.setattr(_rope, "_candidates", lambda hq, hk, head_major: [cfg])
    monkeypatch.setattr(_tune, "_CHOICES", {})
    g = torch.Generator().manual_seed(2)
    b, t, hq, hk, d, rot = 2, 7, 5, 3, 20, 16
    q = torch.randn(b, t, hq, d, generator=g).transpose(1, 2).to(device).requires_grad_()
    k = torch.randn(b, hk, t, d, generator=g).to(device).requires_grad_()
    cos, sin = (c.float().expand(b, t, rot).to(device) for c in hf_cos_sin(torch.arange(t), rot))
    qo, ko = apply_rotary_pos_emb(q, k, cos, sin)
    dq, dk = (
        torch.randn(b, hq, t, d, generator=g).to(device),
        torch.randn(b, t, hk, d, generator=g).to(device),
    )
    (qo * dq).sum().add((ko * dk.transpose(1, 2)).sum()).backward()
    qd, kd = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    rq, rk = reference(qd, kd, cos.double(), sin.double())
    (rq * dq.double()).sum().add((rk * dk.transpose(1, 2).double()).sum()).backward()
    for name, a, e in (("q", qo, rq), ("k", ko, rk), ("dq", q.grad, qd.grad), ("dk", k.grad, kd.grad)):
        err = (a.double() - e).abs().max().item()
        assert err <= 1e-5 * e.abs().max().item(), f"{name}: {err}"


def test_gradients_keep_the_inputs_layout(monkeypatch, device):
    # q viewed (B, H, T, D) from a (B, T, H, D) projection, upstream gradient (B, H, T, D)-contiguous (what HF
    # attention returns): the kernel's gradient of q must come back in q's own layout, so the view's backward
    # is free. (The torch fallback's gradient layout is autograd's choice.)
    monkeypatch.delenv("CAI_KERNELS_FALLBACK", raising=False)
    monkeypatch.setenv("CAI_KERNELS_IMPL", "triton")
    b, t, h, d = 2, 5, 4, 16
    base = torch.randn(b, t, h, d, device=device, requires_grad=True)
    q = base.transpose(1, 2)
    k = torch.randn(b, t, 2, d, device=device).transpose(1, 2).requires_grad_()
    cos, sin = (c.float().expand(b, t, d).to(device) for c in hf_cos_sin(torch.arange(t), d))
    seen = []
    q.register_hook(lambda g: seen.append(g.stride()))
    qo, ko = apply_rotary_pos_emb(q, k, cos, sin)
    assert qo.stride() == q.stride()
    torch.autograd.backward(
        (qo, ko), (torch.randn(b, h, t, d, device=device), torch.randn(b, 2, t, d, device=device))
    )
    assert seen == [q.stride()]
    assert base.grad is not None and base.grad.is_contiguous()
