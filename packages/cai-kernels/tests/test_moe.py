"""Expert compute: permute/unpermute and the grouped GEMM against a per-expert loop of torch matmuls (fp32 1e-5,
outputs and gradients), with the Triton kernels (interpreted on CPU), torch._grouped_mm (torch's CPU kernel, and a
stand-in that checks the layouts its CUDA kernel needs) and the loop fallback; which path is picked for which
device, dtype and shape."""

from dataclasses import dataclass

import pytest
import torch

from cai.kernels import _moe, grouped_linear, permute_tokens, unpermute_tokens

HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


def _reference(x, w_up, w_down, index, weights):
    # Token by token, expert by expert: what a mixture-of-experts layer computes, written as plainly as possible.
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(index.shape[1]):
            e = int(index[t, j])
            h = torch.relu(x[t] @ w_up[e].t())
            out[t] = out[t] + weights[t, j] * (h @ w_down[e].t())
    return out


# (tokens, top-k, experts, hidden, ffn): ragged counts, idle experts, rows and columns that do not fill a tile.
CASES = [(13, 2, 5, 20, 17), (7, 3, 4, 8, 24)]


def _mlp_parity(case, device, backend="auto"):
    t, k, e, h, f = case
    g = torch.Generator().manual_seed(sum(case))
    x = torch.randn(t, h, generator=g).to(device).requires_grad_()
    w_up = (torch.randn(e, f, h, generator=g) / h**0.5).to(device).requires_grad_()
    w_down = (torch.randn(e, h, f, generator=g) / f**0.5).to(device).requires_grad_()
    # Skewed routing: expert 0 is picked often, the last expert never (an idle expert must get a zero gradient).
    scores = torch.randn(t, e, generator=g)
    scores[:, 0] += 1.5
    scores[:, -1] -= 100
    weights, index = torch.softmax(scores.to(device), -1).topk(k, dim=-1)
    weights = weights.detach().requires_grad_()
    dy = torch.randn(t, h, generator=g).to(device)

    rows, order, counts = permute_tokens(x, index, e)
    assert counts.tolist() == torch.bincount(index.flatten(), minlength=e).tolist() and counts[-1] == 0
    assert rows.device == x.device
    hidden = torch.relu(grouped_linear(rows, w_up, counts, backend=backend))
    out = unpermute_tokens(grouped_linear(hidden, w_down, counts, backend=backend), order, weights)
    grads = torch.autograd.grad(out, (x, w_up, w_down, weights), dy)

    leaves = [v.detach().clone().requires_grad_() for v in (x, w_up, w_down, weights)]
    ref = _reference(leaves[0], leaves[1], leaves[2], index, leaves[3])
    ref_grads = torch.autograd.grad(ref, leaves, dy)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for name, got, want in zip(["x", "w_up", "w_down", "weights"], grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert grads[1][-1].abs().max() == 0 and grads[2][-1].abs().max() == 0


@pytest.mark.parametrize("case", CASES, ids=str)
def test_moe_mlp_matches_per_expert_loop(case, impl, device):
    _mlp_parity(case, device)


@pytest.mark.skipif(not HAS_GROUPED_MM, reason="this torch has no torch._grouped_mm")
def test_moe_mlp_grouped_mm_matches_per_expert_loop(device):
    _mlp_parity((13, 2, 5, 16, 24), device, backend="grouped_mm")  # 16-byte rows, as torch._grouped_mm needs


def test_permutation_is_a_stable_sort():
    index = torch.tensor([[2, 0], [0, 1], [2, 1]])
    x = torch.arange(3.0).unsqueeze(1)
    rows, order, counts = permute_tokens(x, index, 4)
    assert order.tolist() == [1, 2, 3, 5, 0, 4] and counts.tolist() == [2, 2, 2, 0]
    assert rows.flatten().tolist() == [0, 1, 1, 2, 0, 2]
    back = unpermute_tokens(rows, order, torch.ones(3, 2))
    assert back.flatten().tolist() == [0, 2, 4]


def test_bad_shapes_name_the_values(impl):
    with pytest.raises(ValueError, match=r"counts \[2, 2\] must be >= 0 and sum to x's 3 rows"):
        grouped_linear(torch.randn(3, 4), torch.randn(2, 5, 4), torch.tensor([2, 2]))
    with pytest.raises(ValueError, match=r"weight \(2, 5, 3\) \(E, out, in\)"):
        grouped_linear(torch.randn(3, 4), torch.randn(2, 5, 3), torch.tensor([2, 1]))
    with pytest.raises(ValueError, match="num_experts=2"):
        permute_tokens(torch.randn(2, 4), torch.tensor([[0], [3]]), 2)


def test_grouped_linear_bf16_accumulates_in_fp32(impl, device):
    g = torch.Generator().manual_seed(3)
    counts = torch.tensor([5, 0, 9])
    x = torch.randn(14, 24, generator=g).to(device, torch.bfloat16).requires_grad_()
    w = torch.randn(3, 20, 24, generator=g).to(device, torch.bfloat16).requires_grad_()
    dy = torch.randn(14, 20, generator=g).to(device, torch.bfloat16)
    y = grouped_linear(x, w, counts)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    yf = torch.cat([xf[:5] @ wf[0].t(), xf[5:] @ wf[2].t()])
    dxf, dwf = torch.autograd.grad(yf, (xf, wf), dy.float())
    assert y.dtype == dx.dtype == dw.dtype == torch.bfloat16
    for got, want in [(y, yf), (dx, dxf), (dw, dwf)]:
        err = (got.float() - want).abs().max().item()
        assert err <= 2e-2 * want.abs().max().item(), err


def _loop_reference(x, w, counts, dy):
    xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    parts = [xe @ wf[e].t() for e, xe in enumerate(torch.split(xf, counts))]
    y = torch.cat(parts)
    return (y, *torch.autograd.grad(y, (xf, wf), dy.float()))


def _grouped_mm_case(dtype, device, counts=(0, 5, 0, 9, 3, 0), in_f=16, out_f=24):
    g = torch.Generator().manual_seed(11)
    n = sum(counts)
    x = torch.randn(n, in_f, generator=g).to(device, dtype).requires_grad_()
    w = torch.randn(len(counts), out_f, in_f, generator=g).to(device, dtype).requires_grad_()
    dy = torch.randn(n, out_f, generator=g).to(device, dtype)
    return x, w, torch.tensor(counts), dy


@pytest.mark.skipif(not HAS_GROUPED_MM, reason="this torch has no torch._grouped_mm")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_grouped_mm_path_matches_loop(dtype, device):
    # Forward, input gradient and weight gradient through torch._grouped_mm, idle experts first, inside and last.
    x, w, counts, dy = _grouped_mm_case(dtype, device)
    y = grouped_linear(x, w, counts, backend="grouped_mm")
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    want = _loop_reference(x, w, counts.tolist(), dy)
    assert y.dtype == dx.dtype == dw.dtype == dtype
    for name, got, ref in zip(["y", "dx", "dw"], (y, dx, dw), want, strict=True):
        if dtype == torch.float32:
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        else:
            err = (got.float() - ref).abs().max().item()
            assert err <= 2e-2 * ref.abs().max().item(), (name, err)
    assert dw[[0, 2, 5]].abs().max() == 0


def _checking_grouped_mm(calls):
    """A stand-in for torch._grouped_mm that checks the operands against what its CUDA kernel requires and computes
    with a loop; a group with no rows comes back NaN, as torch leaves it undefined on some GPUs."""

    def check_strides(m):
        # torch's check: one of the last two strides is 1 and the other a multiple of 16 bytes.
        align = 16 // m.element_size()
        s = m.stride()
        assert (s[-2] == 1 and s[-1] % align == 0) or (s[-1] == 1 and s[-2] % align == 0), s
        assert m.data_ptr() % 16 == 0

    def fake(a, b, offs=None, bias=None, out_dtype=None):
        assert offs.dtype == torch.int32 and offs.dim() == 1 and bias is None and out_dtype is None
        check_strides(a)
        check_strides(b)
        ends = offs.tolist()
        starts = [0, *ends[:-1]]
        if b.dim() == 3:
            # (rows, K) @ (E, K, N): a row-major, so torch walks groups along rows and needs no group alignment.
            assert a.stride(-1) == 1 and ends[-1] == a.shape[0] and len(ends) == b.shape[0]
            calls.append(("2d x 3d", tuple(a.shape), tuple(b.shape), b.stride(-1) == 1))
            return torch.cat([a[s:e] @ b[i] for i, (s, e) in enumerate(zip(starts, ends))])
        # (M, rows) @ (rows, N) per group: a column-major and b row-major, the layout without group alignment.
        assert a.stride(-2) == 1 and b.stride(-1) == 1 and ends[-1] == a.shape[1] == b.shape[0]
        calls.append(("2d x 2d", tuple(a.shape), tuple(b.shape), True))
        out = [a[:, s:e] @ b[s:e] if e > s else torch.full((a.shape[0], b.shape[1]), float("nan"))
               for s, e in zip(starts, ends)]  # fmt: skip
        return torch.stack(out)

    return fake


def test_grouped_mm_calls_follow_the_cuda_layout_rules(monkeypatch):
    # Row counts that are not multiples of 8 and idle experts: no padding, and the idle experts' gradient is zero.
    calls = []
    monkeypatch.setattr(torch, "_grouped_mm", _checking_grouped_mm(calls), raising=False)
    x, w, counts, dy = _grouped_mm_case(torch.float32, "cpu", counts=(3, 0, 7, 5, 0), in_f=8, out_f=16)
    y = grouped_linear(x, w, counts, backend="grouped_mm")
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    assert calls == [
        ("2d x 3d", (15, 8), (5, 8, 16), False),  # forward: x @ W^T, W^T a transposed view
        ("2d x 3d", (15, 16), (5, 16, 8), True),  # input gradient: dy @ W
        ("2d x 2d", (16, 15), (15, 8), True),  # weight gradient: dy^T @ x per expert
    ]
    for got, want in zip((y, dx, dw), _loop_reference(x, w, counts.tolist(), dy), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert dw[[1, 4]].abs().max() == 0


@dataclass(frozen=True, kw_only=True)
class Pick:
    """One dispatch decision: the facts `_choose` sees and the path it must take."""

    name: str
    want: str
    device: str = "cuda"
    capability: tuple[int, int] = (9, 0)
    dtype: torch.dtype = torch.bfloat16
    experts: int = 8
    out_f: int = 28672
    in_f: int = 4096
    grouped_mm: bool = True  # whether torch has _grouped_mm
    triton: bool = True  # whether triton imports
    env: str = ""  # CAI_KERNELS_IMPL
    backend: str = "auto"


PICKS = [
    Pick(name="hopper-bf16", want="grouped_mm"),
    Pick(name="hopper-one-small-expert", experts=1, out_f=8, in_f=8, want="grouped_mm"),
    Pick(name="hopper-fp16", dtype=torch.float16, want="triton"),
    Pick(name="hopper-fp32", dtype=torch.float32, want="triton"),
    Pick(name="ampere-bf16", capability=(8, 0), want="triton"),
    Pick(name="blackwell-bf16", capability=(10, 0), want="triton"),
    Pick(name="hopper-unaligned-in", in_f=4100, want="triton"),
    Pick(name="hopper-unaligned-out", out_f=20, want="triton"),
    Pick(name="hopper-1024-experts", experts=1024, want="triton"),
    Pick(name="hopper-no-grouped-mm", grouped_mm=False, want="triton"),
    Pick(name="hopper-no-triton", triton=False, want="grouped_mm"),
    Pick(name="ampere-no-triton", capability=(8, 0), triton=False, want="loop"),
    Pick(name="cpu", device="cpu", want="loop"),
    Pick(name="env-torch", env="torch", want="loop"),
    Pick(name="env-triton", env="triton", want="triton"),
    Pick(name="forced-loop", backend="loop", want="loop"),
    Pick(name="forced-triton-hopper", backend="triton", want="triton"),
    Pick(name="forced-grouped-mm-ampere", capability=(8, 0), backend="grouped_mm", want="grouped_mm"),
    Pick(
        name="forced-grouped-mm-cpu",
        device="cpu",
        dtype=torch.float32,
        backend="grouped_mm",
        want="grouped_mm",
    ),
]


def _facts(monkeypatch, pick: Pick):
    monkeypatch.delenv("CAI_KERNELS_FALLBACK", raising=False)
    monkeypatch.setenv("CAI_KERNELS_IMPL", pick.env or "auto")
    monkeypatch.setattr(_moe, "_capability", lambda device: pick.capability)
    if pick.grouped_mm:
        monkeypatch.setattr(torch, "_grouped_mm", _checking_grouped_mm([]), raising=False)
    else:
        monkeypatch.delattr(torch, "_grouped_mm", raising=False)
    why = "triton 3.6.0" if pick.triton else "triton is not importable (test)"
    monkeypatch.setattr(_moe, "_triton_import", lambda: (pick.triton, why))


@pytest.mark.parametrize("pick", PICKS, ids=lambda p: p.name)
def test_dispatch_picks_the_path(monkeypatch, pick):
    _facts(monkeypatch, pick)
    path, reason = _moe._choose(
        torch.device(pick.device), pick.dtype, pick.experts, pick.out_f, pick.in_f, pick.backend
    )
    assert path == pick.want and reason


def test_dispatch_reasons_and_refusals(monkeypatch):
    _facts(monkeypatch, Pick(name="ampere", capability=(8, 6), want="triton"))
    assert _moe._choose(torch.device("cuda"), torch.bfloat16, 8, 64, 32) == (
        "triton",
        "Triton kernels (sm_86: torch._grouped_mm is picked on compute capability 9.x only)",
    )
    with pytest.raises(ValueError, match=r"in=20 and out=64 features must be multiples of 8"):
        _moe._choose(torch.device("cuda"), torch.bfloat16, 8, 64, 20, "grouped_mm")
    with pytest.raises(ValueError, match="backend='gmm' is not one of"):
        _moe._choose(torch.device("cuda"), torch.bfloat16, 8, 64, 32, "gmm")
    monkeypatch.delattr(torch, "_grouped_mm")
    with pytest.raises(ValueError, match=r"has no torch\._grouped_mm"):
        grouped_linear(torch.randn(3, 8), torch.randn(2, 8, 8), torch.tensor([1, 2]), backend="grouped_mm")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match=r"backend='triton'.* needs TRITON_INTERPRET=1"):
        _moe._choose(torch.device("cpu"), torch.float32, 2, 8, 8, "triton")


def test_triton_autotune_configs(monkeypatch):
    # The interpreter tunes nothing (one config, so CPU tests stay fast); on a GPU a handful of tiles are timed.
    from cai.kernels import _moe_triton

    if _moe._interpret():
        assert (
            len(_moe_triton.grouped_mm_kernel.configs)
            == len(_moe_triton.grouped_mm_wgrad_kernel.configs)
            == 1
        )
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for configs in (_moe_triton._forward_configs(), _moe_triton._wgrad_configs()):
        assert 4 <= len(configs) <= 8
        assert all(v % 16 == 0 for c in configs for k, v in c.kwargs.items() if k.startswith("B"))
