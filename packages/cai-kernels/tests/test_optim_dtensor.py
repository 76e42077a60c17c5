"""HybridAdam on FSDP2 (DTensor) parameters: the native kernel must update the local shards."""

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from cai.kernels.optim import HybridAdam


def test_hybrid_adam_updates_dtensor_parameters(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
        ref = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
        ref.load_state_dict(model.state_dict())
        fully_shard(model)
        opt = HybridAdam(model.parameters(), lr=1e-2, weight_decay=0.01)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
        x = torch.randn(4, 8)
        for _ in range(5):
            for m, o in ((model, opt), (ref, ref_opt)):
                m(x).square().mean().backward()
                o.step()
                o.zero_grad()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-6, atol=1e-7)
    finally:
        dist.destroy_process_group()
