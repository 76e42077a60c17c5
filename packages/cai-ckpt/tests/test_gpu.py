"""CUDA paths: saving device tensors (synchronously, and asynchronously through pinned buffers) and loading
into device tensors. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import cai.ckpt as ck
from cai.mesh.testing import TinyTransformer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_cuda_model_round_trip(tmp_path, use_async):
    src = TinyTransformer(seed=0).cuda().to(torch.bfloat16)
    expected = {k: v.clone() for k, v in src.state_dict().items()}
    ck.save_model(src, tmp_path / "m", use_async=use_async, size_per_shard=0.01)
    with torch.no_grad():
        for p in src.parameters():
            p.add_(1)  # the asynchronous save took its snapshot before returning
    ck.wait()
    dst = TinyTransformer(seed=1).cuda().to(torch.bfloat16)
    ck.load_model(dst, tmp_path / "m", verify=True)
    for k, v in dst.state_dict().items():
        assert v.is_cuda and torch.equal(v, expected[k]), k


def test_cuda_optimizer_and_state(tmp_path):
    model = TinyTransformer(seed=0).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (2, 8), device="cuda")
    model(ids).float().mean().backward()
    opt.step()
    torch.cuda.manual_seed(5)
    ck.save_state(tmp_path / "run", model=model, optimizer=opt, step=1, use_async=True)
    ck.wait()
    before = torch.cuda.get_rng_state()
    torch.cuda.manual_seed(9)
    model2 = TinyTransformer(seed=3).cuda()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    ck.load_state(tmp_path / "run", model=model2, optimizer=opt2)
    assert torch.equal(torch.cuda.get_rng_state(), before)
    for (n, a), b in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(a, b), n
        assert opt2.state[b]["exp_avg"].is_cuda and torch.equal(
            opt.state[a]["exp_avg"], opt2.state[b]["exp_avg"]
        )
