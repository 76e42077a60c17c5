"""Expert compute: permute/unpermute and the grouped GEMM against a per-expert loop of torch matmuls (fp32 1e-5,
outputs and gradients), with the Triton kernels (interpreted on CPU) and the torch fallback."""

import pytest
import torch

from cai.kernels import grouped_linear, permute_tokens, unpermute_tokens


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


@pytest.mark.parametrize("case", CASES, ids=str)
def test_moe_mlp_matches_per_expert_loop(case, impl, device):
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
    hidden = torch.relu(grouped_linear(rows, w_up, counts))
    out = unpermute_tokens(grouped_linear(hidden, w_down, counts), order, weights)
    grads = torch.autograd.grad(out, (x, w_up, w_down, weights), dy)

    leaves = [v.detach().clone().requires_grad_() for v in (x, w_up, w_down, weights)]
    ref = _reference(leaves[0], leaves[1], leaves[2], index, leaves[3])
    ref_grads = torch.autograd.grad(ref, leaves, dy)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for name, got, want in zip(["x", "w_up", "w_down", "weights"], grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert grads[1][-1].abs().max() == 0 and grads[2][-1].abs().max() == 0


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
