"""Lazy initialisation: meta parameters, real buffers, tying kept; materialising gives eager construction's
values bitwise, directly and under each plugin; sharded plugins allocate only their part and read pretrained
safetensors straight into it."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import transformers
from safetensors.torch import save_file
from torch import nn

from cai.booster import Booster, LazyInitContext, _lazy, set_pretrained_path
from cai.booster._lazy import is_lazy, pretrained_path
from cai.booster.plugin import (
    GeminiPlugin,
    HybridParallelPlugin,
    LowLevelZeroPlugin,
    TorchDDPPlugin,
    TorchFSDPPlugin,
)
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


# ---- materialised values are eager construction's ---------------------------------------------------------
class CustomInit(nn.Module):
    """Initialisation done in ``__init__``: explicit inits, bare parameters, an init torch skips for meta
    tensors, real draws between deferred ones, a reseed inside ``fork_rng`` and a write through a view."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8, padding_idx=0)
        self.proj = nn.Linear(8, 8)
        nn.init.zeros_(self.proj.weight)
        self.out = nn.Linear(8, 16)
        torch.nn.init.normal_(self.out.weight, std=0.02)
        nn.init.trunc_normal_(self.out.bias, std=0.1)
        self.scale = nn.Parameter(torch.ones(8))
        self.shift = nn.Parameter(torch.randn(8) * 0.1)
        self.register_buffer("keep", torch.rand(8) > 0.5)
        self.gate = nn.Linear(8, 8)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(3)
            nn.init.orthogonal_(self.gate.weight)
        with torch.no_grad():
            self.gate.bias[:4].fill_(1.0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) * self.scale + self.shift
        return self.out(h * self.keep + self.gate(self.proj(h)))


def _llama() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


_MODELS = {
    "custom": CustomInit,
    "llama": _llama,
    "tiny": lambda: TinyTransformer(seed=None, tie_embeddings=True),
}


def _eager_and_lazy(name: str) -> tuple[dict[str, torch.Tensor], nn.Module]:
    torch.manual_seed(7)
    eager = _MODELS[name]().state_dict()
    torch.manual_seed(7)
    with LazyInitContext():
        lazy = _MODELS[name]()
    return eager, lazy


@pytest.mark.parametrize("name", list(_MODELS))
def test_materialize_gives_eager_values(name: str) -> None:
    eager, model = _eager_and_lazy(name)
    rng = torch.get_rng_state()
    LazyInitContext.materialize(model)
    assert_close(model.state_dict(), eager, rtol=0, atol=0, name=name)
    assert torch.equal(torch.get_rng_state(), rng)  # replaying drew nothing from the global generator


def test_a_block_materialised_alone_gets_its_eager_values() -> None:
    # what a pipeline stage does: its blocks replay without the others being allocated
    eager, model = _eager_and_lazy("llama")
    LazyInitContext.materialize(model.model.layers[1])
    assert is_lazy(model) and not is_lazy(model.model.layers[1])
    LazyInitContext.materialize(model)
    assert_close(model.state_dict(), eager, rtol=0, atol=0, name="llama")


def _boosted_equals_eager(plugin: str) -> dict[str, list[str]]:
    made = {
        "ddp": TorchDDPPlugin,
        "zero": lambda: LowLevelZeroPlugin(stage=2, precision="fp32"),
        "gemini": lambda: GeminiPlugin(precision="fp32"),
        "hybrid": lambda: HybridParallelPlugin(tp_size=1, pp_size=1, zero_stage=1, precision="fp32"),
        "hybrid_tp2": lambda: HybridParallelPlugin(
            tp_size=2, pp_size=1, precision="fp32", make_vocab_size_divisible_by=1
        ),
    }
    differ = {}
    for name in ["llama"] if plugin == "hybrid_tp2" else ["custom", "llama"]:
        eager, model = _eager_and_lazy(name)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        boosted, *_ = Booster(plugin=made[plugin](), device="cpu").boost(model, opt)
        if plugin == "gemini":
            state = boosted.state_dict(only_rank_0=False)
        else:
            state = {n: p.detach() for n, p in boosted.unwrap().named_parameters()}
        if plugin == "hybrid_tp2":  # tensor-parallel layers are new parameters: eager's distributions only
            assert all(bool(torch.isfinite(p).all()) for p in state.values())
            state = {n: p for n, p in state.items() if "norm" in n}
            assert len(state) == 5
        differ[name] = [n for n, p in state.items() if not torch.equal(p, eager[n])]
    return differ


@pytest.mark.parametrize("plugin", ["ddp", "zero", "gemini", "hybrid", "hybrid_tp2"])
def test_boost_materialises_eager_values(plugin: str) -> None:
    for differ in run_distributed(_boosted_equals_eager, 2, plugin):
        assert differ == {name: [] for name in differ}


class _Unset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.w = nn.Parameter(torch.empty(3))
        self.v = nn.Parameter(torch.empty(4))
        self.v.data[:2].zero_()  # half of it


class _ReadFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.u = nn.Parameter(torch.empty(4))
        self.t = nn.Parameter(self.u.detach() * 2)  # from u before anything wrote u
        nn.init.ones_(self.u)


def test_a_parameter_nothing_initialises_raises_naming_it() -> None:
    with LazyInitContext():
        model = _Unset()
    with pytest.raises(RuntimeError, match="no initial values for v, w: nothing wrote"):
        Booster(device="cpu").boost(model)
    # u is set whole later, so only what was made from it first is reported
    with LazyInitContext():
        model = _ReadFirst()
    with pytest.raises(RuntimeError, match="no initial values for t: nothing wrote"):
        Booster(device="cpu").boost(model)


def test_from_pretrained_inside_the_context_takes_from_pretrained_keywords(tmp_path) -> None:
    torch.manual_seed(0)
    _llama().save_pretrained(tmp_path)
    kwargs = {"attn_implementation": "eager", "max_position_embeddings": 77, "dtype": "bfloat16"}
    eager = transformers.LlamaForCausalLM.from_pretrained(tmp_path, **kwargs)
    with LazyInitContext():
        model = transformers.LlamaForCausalLM.from_pretrained(tmp_path, trust_remote_code=True, **kwargs)
        auto = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, use_cache=False)
        with pytest.raises(ValueError, match="device_map not supported"):
            transformers.LlamaForCausalLM.from_pretrained(tmp_path, device_map="auto")
    assert model.config.to_dict() == eager.config.to_dict()
    assert model.config._attn_implementation == "eager" and model.config.max_position_embeddings == 77
    assert model.dtype == torch.bfloat16 and not model.training and pretrained_path(model) == str(tmp_path)
    assert auto.config.use_cache is False and pretrained_path(auto) == str(tmp_path)
    boosted, *_ = Booster(device="cpu").boost(model)
    assert_close(boosted.unwrap().state_dict(), eager.state_dict(), rtol=0, atol=0, name="from_pretrained")


def test_colossal_arguments(monkeypatch) -> None:
    # tensor_cls is accepted; materialize() without a device uses the default_device of the building context
    seen = []
    monkeypatch.setattr(_lazy, "materialize", lambda module, device, init: seen.append(device))
    with LazyInitContext(tensor_cls=object, default_device="cuda"):
        model = nn.Linear(2, 2)
    LazyInitContext.materialize(model)
    assert seen == [torch.device("cuda")]


def test_from_pretrained_of_a_class_first_touched_inside_the_context(tmp_path) -> None:
    # transformers imports its modules lazily: a fresh process that only ran `import transformers` has not loaded
    # `from_pretrained`'s module when the context opens
    torch.manual_seed(0)
    _llama().save_pretrained(tmp_path)
    script = f"""
import sys, transformers
assert "transformers.modeling_utils" not in sys.modules
from cai.booster import LazyInitContext
from cai.booster._lazy import pretrained_path
with LazyInitContext():
    model = transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})
assert pretrained_path(model) == {str(tmp_path)!r}
assert all(p.is_meta for p in model.parameters())
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)


def test_a_checkpoint_that_does_not_match_the_model_fails_at_boost_naming_the_tensors(tmp_path) -> None:
    # A 2-layer config over a 3-layer checkpoint would load all but the last layer, silently; one without a tensor
    # the model reads fails before any plugin work; both lists are in one message.
    torch.manual_seed(0)
    deep = _llama()
    deep.config.num_hidden_layers = 3
    transformers.LlamaForCausalLM(deep.config).save_pretrained(tmp_path / "deep")
    with LazyInitContext():
        model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "deep", num_hidden_layers=2)
    with pytest.raises(ValueError, match=r"9 in it that the model has no place for \(model\.layers\.2\."):
        Booster(device="cpu").boost(model)

    state = _llama().state_dict()
    del state["model.norm.weight"]
    # older checkpoints hold the rotary frequencies of every layer: skipped, as Hugging Face skips them
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    (tmp_path / "partial").mkdir()
    save_file(state, tmp_path / "partial" / "model.safetensors")
    _llama().config.save_pretrained(tmp_path / "partial")
    with LazyInitContext():
        model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "partial")
    with pytest.raises(ValueError, match=r"1 missing from it \(model\.norm\.weight\)\. Build") as e:
        Booster(device="cpu").boost(model)
    assert "no place for" not in str(e.value)

    # leaving the extra layer out on purpose, the Hugging Face way
    with LazyInitContext():
        model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "deep", num_hidden_layers=2)
    model._keys_to_ignore_on_load_unexpected = [r"model\.layers\.2\."]
    boosted, *_ = Booster(device="cpu").boost(model)
    eager = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "deep", num_hidden_layers=2)
    assert_close(boosted.unwrap().state_dict(), eager.state_dict(), rtol=0, atol=0, name="first two layers")
