"""Lazy initialisation: meta parameters, real buffers, tying kept; sharded plugins allocate only their part and
read pretrained safetensors straight into it."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from cai.booster import Booster, LazyInitContext, set_pretrained_path
from cai.booster._lazy import is_lazy
from cai.booster.plugin import LowLevelZeroPlugin, TorchDDPPlugin, TorchFSDPPlugin
from cai.mesh.testing import TinyTransformer, assert_close, run_distributed


class WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.arange(4.0), persistent=False)


def test_parameters_are_meta_buffers_are_real_and_ties_survive() -> None:
    with LazyInitContext():
        model = TinyTransformer(tie_embeddings=True)
        other = WithBuffer()
    assert is_lazy(model) and all(p.device.type == "meta" for p in model.parameters())
    assert model.head.weight is model.embed.weight
    assert torch.equal(other.scale, torch.arange(4.0))
    LazyInitContext.materialize(model)
    assert not is_lazy(model)
    assert model.head.weight is model.embed.weight
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert torch.equal(model.blocks[0].ln1.weight, torch.ones(33))  # LayerNorm.reset_parameters ran
    assert float(model.blocks[0].qkv.weight.detach().std()) > 0


def test_context_restores_eager_construction() -> None:
    with LazyInitContext():
        pass
    assert nn.Linear(2, 2).weight.device.type == "cpu"


def _pretrained_dir() -> tuple[str, dict[str, torch.Tensor]]:
    path = tempfile.mkdtemp(prefix="cai-lazy-")
    state = {k: v.contiguous() for k, v in TinyTransformer(seed=123).state_dict().items()}
    if dist.get_rank() == 0:
        save_file(state, os.path.join(path, "model.safetensors"))
    obj = [path]
    dist.broadcast_object_list(obj, src=0)  # every rank uses rank 0's directory
    dist.barrier()
    return obj[0], state


def _lazy_pretrained(plugin_name: str) -> dict:
    path, expected = _pretrained_dir()
    with LazyInitContext():
        model = TinyTransformer(seed=0)
    set_pretrained_path(model, path)
    plugin = {
        "ddp": TorchDDPPlugin,
        "fsdp": lambda: TorchFSDPPlugin(precision="fp32"),
        "zero": lambda: LowLevelZeroPlugin(precision="fp32"),
    }[plugin_name]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, *_ = Booster(plugin=plugin, device="cpu").boost(model, opt)
    module = model.unwrap()
    local_numel = sum(
        p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in module.parameters()
    )
    full = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in module.named_parameters()
    }
    assert_close(full, expected, rtol=0, name="pretrained")
    # The optimizer was rebound to the materialised parameters: one step moves them.
    x = torch.randint(0, 64, (2, 8))
    opt.backward(model(x).float().mean())
    opt.step()
    moved = any(
        not torch.equal((p.full_tensor() if hasattr(p, "full_tensor") else p), full[n])
        for n, p in module.named_parameters()
    )
    # FSDP splits rows: a rank holds at most one row more than half of a tensor whose rows do not split evenly
    slack = sum(t.numel() // t.shape[0] for t in expected.values() if t.dim() and t.shape[0])
    total = sum(t.numel() for t in expected.values())
    return {"local_numel": local_numel, "total": total, "slack": slack, "moved": moved}


@pytest.mark.parametrize("plugin", ["ddp", "fsdp", "zero"])
def test_lazy_model_loads_pretrained_after_boost(plugin: str) -> None:
    results = run_distributed(_lazy_pretrained, 2, plugin)
    for r in results:
        assert r["moved"]
        if plugin == "fsdp":
            assert r["local_numel"] <= r["total"] // 2 + r["slack"]  # only this rank's shard was allocated
        else:
            assert r["local_numel"] == r["total"]


def _lazy_random(plugin_name: str) -> dict:
    torch.manual_seed(dist.get_rank())  # different RNGs per rank: replicas must still start equal
    with LazyInitContext():
        model = TinyTransformer(seed=None)
    plugin = {
        "fsdp": lambda: TorchFSDPPlugin(precision="fp32"),
        "zero": lambda: LowLevelZeroPlugin(precision="fp32"),
    }
    model, opt, *_ = Booster(plugin=plugin[plugin_name](), device="cpu").boost(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    )
    module = model.unwrap()
    params = {n: p.to_local() if hasattr(p, "to_local") else p for n, p in module.named_parameters()}
    finite = all(bool(torch.isfinite(p).all()) for p in params.values())
    x = torch.randint(0, 64, (2, 8))
    opt.backward(model(x).float().mean())
    opt.step()
    return {
        "finite": finite,
        "ln": params["ln_f.weight"].detach().clone(),
        "qkv": params["blocks.0.qkv.weight"].detach().clone(),
    }


@pytest.mark.parametrize("plugin", ["fsdp", "zero"])
def test_lazy_model_without_pretrained_is_initialised(plugin: str) -> None:
    results = run_distributed(_lazy_random, 2, plugin)
    assert all(r["finite"] for r in results)
    if plugin == "zero":  # replicated: every rank holds the same initial values
        assert torch.equal(results[0]["qkv"], results[1]["qkv"])


def test_gemini_materialises_on_the_host_what_the_device_cannot_hold(monkeypatch) -> None:
    # Gemini moves each parameter into its chunk as it builds them: a lazy model larger than the device, or one
    # whose parameters go to the host, is materialised on the host first rather than whole on the device.
    from cai.booster.plugin import GeminiPlugin, _gemini

    with LazyInitContext():
        model = TinyTransformer()
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    plugin = GeminiPlugin(precision="bf16")
    monkeypatch.setattr(_gemini, "free_device_bytes", lambda device: 2 * size)
    assert plugin._materialize_on(model, cuda) == cuda
    monkeypatch.setattr(_gemini, "free_device_bytes", lambda device: size)
    assert plugin._materialize_on(model, cuda) == cpu
    assert GeminiPlugin(precision="bf16", offload_param_frac=1.0)._materialize_on(model, cuda) == cpu
    assert plugin._materialize_on(model, cpu) == cpu
