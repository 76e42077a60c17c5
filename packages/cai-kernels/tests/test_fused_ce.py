"""Fused linear cross-entropy against `F.cross_entropy(h @ W.T)` in float64, forward and backward.

Tolerances relative to the largest reference magnitude: fp32 1e-5 (loss: 1e-5 relative); bf16 3e-2 for the
gradients and 1e-2 for the loss (logits and logit gradients are rounded to bf16 inside the chunk loop).
"""

import multiprocessing as mp
import os
import tempfile
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from cai.kernels import fused_linear_cross_entropy

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 3e-2)}  # (loss, grads)


def reference(h, w, b, y, *, ignore_index=-100, smoothing=0.0, z_loss=0.0, reduction="mean"):
    logits = h @ w.T + (b if b is not None else 0)
    loss = F.cross_entropy(
        logits, y, ignore_index=ignore_index, label_smoothing=smoothing, reduction=reduction
    )
    if z_loss:
        valid = y != ignore_index
        z = torch.logsumexp(logits, -1)[valid].pow(2)
        loss = loss + z_loss * (z.mean() if reduction == "mean" else z.sum())
    return loss


@dataclass(frozen=True, kw_only=True)
class Case:
    t: int
    h: int
    v: int
    dtype: torch.dtype
    chunk: int | None = None
    smoothing: float = 0.0
    z_loss: float = 0.0
    bias: bool = False
    reduction: str = "mean"

    def __str__(self):
        extra = f"-ls{self.smoothing}" * bool(self.smoothing) + f"-z{self.z_loss}" * bool(self.z_loss)
        extra += "-bias" * self.bias + f"-{self.reduction}" + f"-c{self.chunk}" * bool(self.chunk)
        return f"t{self.t}h{self.h}v{self.v}-{str(self.dtype)[6:]}{extra}"


CASES = [
    Case(t=37, h=24, v=101, dtype=torch.float32, chunk=16),
    Case(t=37, h=24, v=101, dtype=torch.bfloat16, chunk=16),
    Case(t=20, h=16, v=257, dtype=torch.float32, smoothing=0.1, z_loss=1e-3, bias=True),
    Case(t=20, h=16, v=257, dtype=torch.bfloat16, smoothing=0.1, z_loss=1e-3, bias=True),
    Case(t=9, h=8, v=5000, dtype=torch.float32, chunk=4, reduction="sum"),  # several vocab blocks per row
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_cross_entropy_float64(case, impl, device):
    g = torch.Generator().manual_seed(3)
    c = case
    h = (torch.randn(c.t, c.h, generator=g) * 0.5).to(device, c.dtype).requires_grad_()
    w = (torch.randn(c.v, c.h, generator=g) * 0.5).to(device, c.dtype).requires_grad_()
    b = torch.randn(c.v, generator=g).to(device, c.dtype).requires_grad_() if c.bias else None
    y = torch.randint(0, c.v, (c.t,), generator=g)
    y[::3] = -100  # ignored tokens
    y = y.to(device)
    kw = dict(label_smoothing=c.smoothing, z_loss=c.z_loss, reduction=c.reduction)
    loss = fused_linear_cross_entropy(h, w, y, bias=b, chunk_size=c.chunk, **kw)
    (loss * 1.5).backward()  # a non-unit upstream gradient exercises the backward scaling
    leaves = [h, w] + ([b] if b is not None else [])
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = reference(*ref_leaves[:2], ref_leaves[2] if b is not None else None, y, smoothing=c.smoothing,
                    z_loss=c.z_loss, reduction=c.reduction)  # fmt: skip
    (ref * 1.5).backward()
    loss_tol, grad_tol = TOL[c.dtype]
    assert loss.dtype == torch.float32
    assert abs(loss.item() - ref.item()) <= loss_tol * abs(ref.item())
    for name, t, r in zip(["dh", "dw", "db"], leaves, ref_leaves):
        assert t.grad.dtype == t.dtype
        err = (t.grad.double() - r.grad).abs().max().item()
        assert err <= grad_tol * r.grad.abs().max().item(), f"{name}: {err}"


def test_retained_graph_backward_again_gives_each_upstream_gradient(impl, device):
    # The first backward scales the saved gradients in place ([Note: fused CE backward scaling]): a graph kept
    # for more backwards gives each its own upstream gradient's result and leaves earlier results as they were.
    g = torch.Generator().manual_seed(4)
    h0, w0 = torch.randn(19, 16, generator=g), torch.randn(41, 16, generator=g)
    y = torch.randint(0, 41, (19,), generator=g)
    hd, wd = h0.double().requires_grad_(), w0.double().requires_grad_()
    ref = torch.autograd.grad(F.cross_entropy(hd @ wd.T, y), (hd, wd))
    h, w = h0.to(device).requires_grad_(), w0.to(device).requires_grad_()
    loss = fused_linear_cross_entropy(h, w, y.to(device), chunk_size=8)
    results = []
    for upstream in (2.0, -0.5, 1.0):
        grad_out = torch.tensor(upstream, device=device)
        results.append((upstream, torch.autograd.grad(loss, (h, w), grad_out, retain_graph=True)))
    for upstream, got in results:
        for a, r in zip(got, ref):
            torch.testing.assert_close(a.cpu().double(), upstream * r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ignore_index", [7, -1], ids=["in-vocab-7", "minus-1"])
@pytest.mark.parametrize("extra", [{}, {"label_smoothing": 0.1, "z_loss": 1e-3, "reduction": "sum"}],
                         ids=["plain", "smooth-z-sum"])  # fmt: skip
def test_non_default_ignore_index_matches_float64(ignore_index, extra, impl, device):
    # Hugging Face's loss hook passes the caller's ignore_index through, so -100 is only the default. The ignored
    # label is present in the targets and no label is -100: masking -100 instead would count the ignored tokens
    # (an in-vocabulary 7 as a real target; -1 as a target no vocabulary shard holds), and masking nothing at all
    # would count them too.
    g = torch.Generator().manual_seed(5)
    t, hdim, v = 29, 16, 53
    h = (torch.randn(t, hdim, generator=g) * 0.5).to(device).requires_grad_()
    w = (torch.randn(v, hdim, generator=g) * 0.5).to(device).requires_grad_()
    y = torch.randint(0, v, (t,), generator=g)
    y[y == ignore_index] = ignore_index + 1  # the ignored value appears exactly where it is put below
    y[::4] = ignore_index
    y = y.to(device)
    assert int((y == ignore_index).sum()) == 8 and not (y == -100).any()
    loss = fused_linear_cross_entropy(h, w, y, ignore_index=ignore_index, chunk_size=8, **extra)
    (loss * 1.5).backward()
    hd, wd = (x.detach().double().requires_grad_() for x in (h, w))
    kw = dict(smoothing=extra.get("label_smoothing", 0.0), z_loss=extra.get("z_loss", 0.0),
              reduction=extra.get("reduction", "mean"))  # fmt: skip
    ref = reference(hd, wd, None, y, ignore_index=ignore_index, **kw)
    (ref * 1.5).backward()
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
    for name, got, want in (("dh", h.grad, hd.grad), ("dw", w.grad, wd.grad)):
        err = (got.double() - want).abs().max().item()
        assert err <= 1e-5 * want.abs().max().item(), f"{name}: {err}"
    assert not h.grad[::4].any(), "ignored tokens must get no gradient"


def test_batched_hidden_and_no_grad(impl, monkeypatch):
    from cai.kernels import _fused_ce

    h, w = torch.randn(2, 5, 8, requires_grad=True), torch.randn(11, 8)
    y = torch.randint(0, 11, (2, 5))

    def no_grad_work(*args):
        raise AssertionError("gradient work under torch.no_grad()")

    with monkeypatch.context() as patch, torch.no_grad():
        patch.setattr(_fused_ce, "_grad_torch_", no_grad_work)
        patch.setattr(_fused_ce, "_grad_triton_", no_grad_work)
        loss = fused_linear_cross_entropy(h, w, y)
    h = h.detach()
    ref = F.cross_entropy((h @ w.T).reshape(-1, 11), y.reshape(-1))
    assert abs(loss.item() - ref.item()) < 1e-5
    hg = h.clone().requires_grad_()
    fused_linear_cross_entropy(hg, w, y).backward()  # weight without grad: only dh
    assert hg.grad.shape == (2, 5, 8)


def test_autocast_runs_matmuls_in_the_autocast_dtype(impl):
    # fp32 master weights under bf16 autocast: gradients come back in fp32, values at bf16 accuracy.
    h = torch.randn(12, 16, requires_grad=True)
    w = (torch.randn(50, 16) * 0.5).requires_grad_()
    y = torch.randint(0, 50, (12,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(h, w, y)
    loss.backward()
    assert h.grad.dtype == w.grad.dtype == torch.float32
    hd, wd = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = F.cross_entropy(hd @ wd.T, y)
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 1e-2 * ref.item()
    assert (h.grad - hd.grad).abs().max() <= 3e-2 * hd.grad.abs().max()
    assert (w.grad - wd.grad).abs().max() <= 3e-2 * wd.grad.abs().max()
    assert (h.grad - hd.grad).abs().max() > 1e-7  # the bf16 matmuls did run (fp32 would be ~1e-8)


def test_all_ignored_gives_zero_loss_and_grads(impl):
    h, w = torch.randn(4, 8, requires_grad=True), torch.randn(7, 8, requires_grad=True)
    loss = fused_linear_cross_entropy(h, w, torch.full((4,), -100))
    loss.backward()
    assert loss.item() == 0.0 and not h.grad.any() and not w.grad.any()


def test_invalid_arguments_are_rejected():
    h, w, y = torch.randn(4, 8), torch.randn(7, 8), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="reduction='none'"):
        fused_linear_cross_entropy(h, w, y, reduction="none")
    with pytest.raises(ValueError, match=r"weight \(7, 9\)"):
        fused_linear_cross_entropy(h, torch.randn(7, 9), y)
    with pytest.raises(ValueError, match=r"label_smoothing=1\.5"):
        fused_linear_cross_entropy(h, w, y, label_smoothing=1.5)
    with pytest.raises(ValueError, match="needs a process_group"):
        fused_linear_cross_entropy(h, w, y, vocab_start_index=3)


# Vocab-parallel hook: 2 gloo ranks, each holding half of the vocabulary (uneven halves), compared with the
# unsharded loss. Ranks are forked so the worker need not be importable by name.
def _vocab_parallel_worker(rank, world, store_path, impl, queue):
    os.environ["CAI_KERNELS_IMPL"] = impl
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(4)
        h = torch.randn(13, 8, generator=g, dtype=torch.float64).float()
        w = torch.randn(23, 8, generator=g, dtype=torch.float64).float()
        y = torch.randint(0, 23, (13,), generator=g)
        y[::4] = -100
        bounds = [0, 10, 23]
        lo, hi = bounds[rank], bounds[rank + 1]
        hs, ws = h.clone().requires_grad_(), w[lo:hi].clone().requires_grad_()
        loss = fused_linear_cross_entropy(hs, ws, y, label_smoothing=0.1, z_loss=1e-3, chunk_size=5,
                                          process_group=dist.group.WORLD, vocab_start_index=lo)  # fmt: skip
        loss.backward()
        # numpy arrays travel by value (tensors would be shared through the exiting process's file descriptors)
        queue.put((rank, loss.item(), *(t.numpy() for t in (hs.grad, ws.grad, h, w, y))))
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_matches_unsharded(impl):
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=_vocab_parallel_worker, args=(r, 2, f"{tmp}/store", impl, queue))
            for r in (0, 1)
        ]
        for p in procs:
            p.start()
        results = sorted((queue.get(timeout=120) for _ in procs), key=lambda r: r[0])
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
    results = [(rank, loss, *map(torch.from_numpy, arrays)) for rank, loss, *arrays in results]
    _, _, _, _, h, w, y = results[0]
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    ref = reference(hd, wd, None, y, smoothing=0.1, z_loss=1e-3)
    ref.backward()
    for rank, loss, dh, dw_shard, *_ in results:
        assert abs(loss - ref.item()) <= 1e-5 * abs(ref.item()), rank
        torch.testing.assert_close(dh.double(), hd.grad, rtol=1e-5, atol=1e-6)
        lo, hi = (0, 10) if rank == 0 else (10, 23)
        torch.testing.assert_close(dw_shard.double(), wd.grad[lo:hi], rtol=1e-5, atol=1e-6)
