"""LoRA through the Booster (peft is an optional extra; these tests need it installed)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from cai.booster import Booster
from cai.booster.plugin import HybridParallelPlugin, LowLevelZeroPlugin, TorchDDPPlugin
from cai.mesh.testing import TinyTransformer, make_batch, run_distributed

peft = pytest.importorskip("peft")


def _lora_run(plugin: str) -> dict:
    plugins = {
        "ddp": TorchDDPPlugin,
        "zero2": lambda: LowLevelZeroPlugin(stage=2, precision="fp32"),
        "hybrid-zero1": lambda: HybridParallelPlugin(tp_size=1, pp_size=1, zero_stage=1, precision="fp32"),
    }
    booster = Booster(plugin=plugins[plugin](), device="cpu")
    base = TinyTransformer(seed=0)
    frozen_before = {n: p.detach().clone() for n, p in base.named_parameters()}
    model = booster.enable_lora(
        base, lora_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules=["qkv", "proj"])
    )
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    model, opt, *_ = booster.boost(model, opt)
    ids, labels = make_batch(batch_size=4, seq_len=16, seed=0)
    rank, world = dist.get_rank(), dist.get_world_size()
    for _ in range(3):
        booster.backward(TinyTransformer.loss(model(ids.chunk(world)[rank]), labels.chunk(world)[rank]), opt)
        opt.step()
        opt.zero_grad()
    obj = [tempfile.mkdtemp(prefix="cai-lora-") if rank == 0 else None]
    dist.broadcast_object_list(obj, src=0)
    booster.save_lora_as_pretrained(model, obj[0])
    with torch.no_grad():
        logits = model(ids).detach()
    # The saved adapter, loaded by peft on a fresh base model, reproduces the trained model's logits.
    reloaded = peft.PeftModel.from_pretrained(TinyTransformer(seed=0), obj[0])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids), logits, rtol=1e-5, atol=1e-6)
    base_now = dict(model.unwrap().named_parameters())
    unchanged = all(
        torch.equal(base_now[n.replace("qkv.", "qkv.base_layer.").replace("proj.", "proj.base_layer.")], p)
        if ("qkv." in n or "proj." in n)
        else torch.equal(base_now[n], p)
        for n, p in frozen_before.items()
    )
    return {"files": sorted(os.listdir(obj[0])), "base_unchanged": unchanged}


@pytest.mark.parametrize("plugin", ["ddp", "zero2", "hybrid-zero1"])
def test_lora_trains_adapters_only_and_saves_in_peft_format(plugin: str) -> None:
    for r in run_distributed(_lora_run, 2, plugin):
        assert r["base_unchanged"]
        assert "adapter_config.json" in r["files"] and "adapter_model.safetensors" in r["files"]


def test_enable_lora_needs_a_config() -> None:
    booster = Booster(device="cpu")
    with pytest.raises(ValueError, match="give lora_config"):
        booster.enable_lora(TinyTransformer())


def test_hybrid_lora_needs_tp_and_pp_of_one() -> None:
    booster = Booster(plugin=HybridParallelPlugin(tp_size=2, pp_size=1), device="cpu")
    with pytest.raises(ValueError, match="LoRA needs tp_size=1, pp_size=1"):
        booster.enable_lora(TinyTransformer(seed=0), lora_config=peft.LoraConfig(r=4, target_modules=["qkv"]))
