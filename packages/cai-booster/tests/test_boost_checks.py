"""What boost() checks before a plugin touches the model: ranks that built different models fail on every rank
with the same message, ranks with different weights start from rank 0's; Gemini's full state_dict; and the
clear errors that replace crashes deep inside torch when the Booster API is misused."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from cai.booster import Booster, LazyInitContext
from cai.booster._replicas import _Entry, first_difference
from cai.booster.plugin import GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin, TorchFSDPPlugin
from cai.mesh.testing import CollectiveCounter, TinyTransformer, assert_close, make_batch, run_distributed

PLUGINS = ["ddp", "fsdp", "zero", "gemini"]


def _booster(plugin: str) -> Booster:
    factory = {
        "ddp": TorchDDPPlugin,
        "fsdp": lambda: TorchFSDPPlugin(precision="fp32"),
        "zero": lambda: LowLevelZeroPlugin(stage=2, precision="fp32"),
        "gemini": lambda: GeminiPlugin(precision="fp32"),
    }
    return Booster(plugin=factory[plugin](), device="cpu")


def _full_state(plugin: str, model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer of a boosted model, whole, on this rank."""
    if plugin == "gemini":
        return model.state_dict(only_rank_0=False)
    module = model.unwrap()
    out = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
        for n, p in module.named_parameters()
    }
    out.update({n: b.detach().clone() for n, b in module.named_buffers()})
    return out


# ---- ranks that built different models ---------------------------------------------------------------------
def _boost_mismatched(plugin: str, kind: str) -> str:
    rank = dist.get_rank()
    if kind == "shape":
        model = TinyTransformer(vocab_size=64, hidden=32 if rank == 0 else 48, heads=4)
    else:  # rank 1 has a module that rank 0 lacks
        model = TinyTransformer()
        if rank == 1:
            model.extra = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with CollectiveCounter() as cc:
        try:
            _booster(plugin).boost(model, opt)
        except ValueError as e:
            # only the metadata exchange ran: nothing was broadcast, sharded or wrapped
            assert [ev.op for ev in cc.events] == ["all_gather_object"], cc.events
            return str(e)
    return "boost() did not raise"


@pytest.mark.parametrize("plugin", PLUGINS)
def test_mismatched_shapes_fail_at_boost_on_every_rank(plugin: str) -> None:
    messages = run_distributed(_boost_mismatched, 2, plugin, "shape", timeout=60)
    assert messages[0] == messages[1], messages
    msg = messages[0]
    assert (
        "parameter 'embed.weight' has shape [64, 32] float32 on rank 0 but shape [64, 48] float32 on rank 1"
        in msg
    )
    assert "more differing names" in msg and "before boost()" in msg


@pytest.mark.parametrize("plugin", PLUGINS)
def test_mismatched_names_fail_at_boost_on_every_rank(plugin: str) -> None:
    messages = run_distributed(_boost_mismatched, 2, plugin, "names", timeout=60)
    assert messages[0] == messages[1], messages
    assert "parameter 'extra.weight' exists on ranks [1] but not on ranks [0]" in messages[0]
    assert "and 1 more differing names" in messages[0]  # extra.bias


def test_first_difference_names_dtype_and_lazy_differences() -> None:
    def entry(dtype: str = "torch.float32", lazy: bool = False, name: str = "w") -> _Entry:
        return _Entry("parameter", name, (2, 3), dtype, lazy)

    assert first_difference([[entry()], [entry()]], [0, 1]) is None
    msg, n = first_difference([[entry()], [entry(), entry(name="v")], [entry("torch.bfloat16")]], [0, 1, 2])
    assert n == 2
    assert msg == "parameter 'w' has shape [2, 3] float32 on rank 0 but shape [2, 3] bfloat16 on rank 2"
    msg, _ = first_difference([[entry()], [entry(lazy=True)]], [4, 6])
    assert msg.endswith("but shape [2, 3] float32 (lazy, on the meta device) on rank 6")


# ---- ranks with different weights --------------------------------------------------------------------------
def _seeded_model(rank: int) -> nn.Module:
    model = TinyTransformer(seed=rank)  # different weights on every rank
    model.register_buffer("marker", torch.full((3,), float(rank)))  # a persistent buffer that differs too
    return model


def _boost_different_seeds(plugin: str, lazy: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    if lazy:
        torch.manual_seed(100 + rank)  # the initialisers at boost() draw different numbers on every rank
        with LazyInitContext():
            model = TinyTransformer(seed=None)
        model.register_buffer("marker", torch.full((3,), float(rank)))
    else:
        model = _seeded_model(rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    booster = _booster(plugin)
    with CollectiveCounter() as cc:
        model, opt, *_ = booster.boost(model, opt)
    before = _full_state(plugin, model)
    ids, labels = make_batch(batch_size=4, seq_len=8, seed=3)
    loss = TinyTransformer.loss(model(ids.chunk(world)[rank]), labels.chunk(world)[rank])
    booster.backward(loss, opt)
    opt.step()
    return {"before": before, "after": _full_state(plugin, model), "broadcasts": cc.count("broadcast")}


def _reference_step(ids: torch.Tensor, labels: torch.Tensor) -> tuple[dict, dict]:
    ref = _seeded_model(0)
    before = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    TinyTransformer.loss(ref(ids), labels).backward()
    opt.step()
    return before, {k: v.detach().clone() for k, v in ref.state_dict().items()}


@pytest.mark.parametrize("plugin", PLUGINS)
def test_different_seeds_start_from_rank_0_weights(plugin: str) -> None:
    results = run_distributed(_boost_different_seeds, 2, plugin, False)
    ids, labels = make_batch(batch_size=4, seq_len=8, seed=3)
    ref_before, ref_after = _reference_step(ids, labels)
    for rank, r in enumerate(results):
        assert_close(r["before"], ref_before, rtol=0, name=f"rank {rank} after boost")
        # one fp32 step on halves of the batch, averaged, is the step on the whole batch
        assert_close(r["after"], ref_after, rtol=1e-4, atol=1e-6, name=f"rank {rank} after one step")
        # parameters in one flat broadcast, the float buffer rides along in the same bucket
        assert r["broadcasts"] == 1, r["broadcasts"]
    assert_close(results[1]["after"], results[0]["after"], rtol=0, name="rank 1 vs rank 0")


@pytest.mark.parametrize("plugin", PLUGINS)
def test_lazy_model_with_different_rngs_ends_identical_on_all_ranks(plugin: str) -> None:
    results = run_distributed(_boost_different_seeds, 2, plugin, True)
    for key in ("before", "after"):
        assert_close(results[1][key], results[0][key], rtol=0, name=f"rank 1 vs rank 0, {key} the step")
    assert torch.equal(results[0]["before"]["marker"], torch.zeros(3))  # rank 0's buffer everywhere


# ---- Gemini's full state_dict ------------------------------------------------------------------------------
def _gemini_state_dict(only_rank_0: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = TinyTransformer(seed=0, tie_embeddings=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    booster = _booster("gemini")
    model, opt, *_ = booster.boost(model, opt)
    ids, labels = make_batch(batch_size=4, seq_len=8, seed=5)
    booster.backward(TinyTransformer.loss(model(ids.chunk(world)[rank]), labels.chunk(world)[rank]), opt)
    opt.step()
    sd = model.state_dict() if only_rank_0 else model.state_dict(only_rank_0=False)
    out: dict = {"sd": sd}
    # A full dict loads back on every rank (here: perturbed weights restored from rank 0's dict).
    full = [sd]
    dist.broadcast_object_list(full, src=0)
    model.load_state_dict({k: v + 1 for k, v in full[0].items()})
    model.load_state_dict(full[0])
    out["reloaded"] = model.state_dict(only_rank_0=False)
    # strict=False loads the names given and keeps the others
    result = model.load_state_dict(
        {"ln_f.bias": full[0]["ln_f.bias"] + 1, "unknown": torch.ones(1)}, strict=False
    )
    out["partial"] = model.state_dict(only_rank_0=False)
    out["partial_keys"] = (len(result.missing_keys), result.unexpected_keys)
    if world > 1 and rank == 1 and only_rank_0:
        try:
            model.load_state_dict(sd)
        except KeyError as e:
            out["empty_error"] = str(e)
    return out


def _gemini_reference() -> dict[str, torch.Tensor]:
    ref = TinyTransformer(seed=0, tie_embeddings=True)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ids, labels = make_batch(batch_size=4, seq_len=8, seed=5)
    TinyTransformer.loss(ref(ids), labels).backward()
    opt.step()
    return {k: v.detach().clone() for k, v in ref.state_dict().items()}


@pytest.mark.parametrize("only_rank_0", [True, False], ids=["only_rank_0", "every_rank"])
@pytest.mark.parametrize("world", [1, 2])
def test_gemini_state_dict_is_the_full_unsharded_model(world: int, only_rank_0: bool) -> None:
    results = run_distributed(_gemini_state_dict, world, only_rank_0)
    expected = _gemini_reference()
    for rank, r in enumerate(results):
        if only_rank_0 and rank > 0:
            assert r["sd"] == {}
            assert "booster.save_model/load_model" in r["empty_error"]
        else:
            # same keys as the plain module (the tied head under its own name too), fp32, unpadded
            assert_close(r["sd"], expected, rtol=1e-4, atol=1e-6, name=f"rank {rank}")
            assert all(v.dtype == torch.float32 for v in r["sd"].values())
        assert_close(r["reloaded"], results[0]["sd"], rtol=0, name=f"rank {rank} reloaded")
        partial = dict(results[0]["sd"], **{"ln_f.bias": results[0]["sd"]["ln_f.bias"] + 1})
        assert_close(r["partial"], partial, rtol=0, name=f"rank {rank} partial load")
        assert r["partial_keys"] == (len(expected) - 2, ["unknown"])  # all but ln_f.bias and the tied alias
    # what torch.save(model.state_dict()) wrote loads into the plain model
    plain = TinyTransformer(seed=1, tie_embeddings=True)
    plain.load_state_dict(results[0]["sd"])
    assert_close(dict(plain.state_dict()), expected, rtol=1e-4, atol=1e-6)


# ---- clear errors ------------------------------------------------------------------------------------------
def test_optimizer_over_another_models_parameters_is_named() -> None:
    model, other = TinyTransformer(seed=0), TinyTransformer(seed=1)
    n = len(list(model.parameters()))
    opt = torch.optim.AdamW([*other.parameters(), *model.parameters()], lr=1e-3)
    with pytest.raises(ValueError, match=rf"not in the model \({n} of its {2 * n};.*model\.parameters\(\)"):
        Booster(plugin=TorchDDPPlugin(), device="cpu").boost(model, opt)
    with pytest.raises(ValueError, match=r"not in the model"):
        Booster(plugin=LowLevelZeroPlugin(precision="fp32"), device="cpu").boost(
            model, torch.optim.AdamW(other.parameters())
        )


def test_raw_objects_passed_where_boosted_ones_are_needed() -> None:
    booster = Booster(plugin=TorchDDPPlugin(), device="cpu")
    raw = TinyTransformer(seed=0)
    raw_opt = torch.optim.AdamW(raw.parameters(), lr=1e-3)
    model, opt, *_ = booster.boost(raw, raw_opt)
    ids, labels = make_batch(batch_size=2, seq_len=8)
    loss = TinyTransformer.loss(model(ids), labels)
    with pytest.raises(
        TypeError, match=r"optimizer is a torch.optim.adamw.AdamW, not the optimizer that boost"
    ):
        booster.backward(loss, raw_opt)
    booster.backward(loss, opt)  # the boosted one works
    with pytest.raises(TypeError, match=r"Booster.save_model: model is a .*TinyTransformer, not the model"):
        booster.save_model(raw, "unused")
    with pytest.raises(TypeError, match=r"Booster.load_model: model is a"):
        booster.load_model(raw, "unused")
    with pytest.raises(TypeError, match=r"optimizer is a .*AdamW, not the optimizer"):
        booster.save_optimizer(raw_opt, "unused")
    with pytest.raises(TypeError, match=r"Booster.no_sync: model is a"), booster.no_sync(raw, opt):
        pass


def test_boosting_a_model_twice_is_refused() -> None:
    booster = Booster(plugin=TorchDDPPlugin(), device="cpu")
    raw = TinyTransformer(seed=0)
    model, opt, *_ = booster.boost(raw, torch.optim.AdamW(raw.parameters(), lr=1e-3))
    with pytest.raises(ValueError, match=r"already boosted by TorchDDPPlugin"):
        booster.boost(raw)
    booster.boost(copy.deepcopy(raw))  # a copy is another model
    with pytest.raises(ValueError, match=r"already boosted .*ModelWrapper"):
        booster.boost(model)
    with pytest.raises(ValueError, match=r"optimizer is already boosted"):
        Booster(plugin=TorchDDPPlugin(), device="cpu").boost(TinyTransformer(seed=0), opt)


def test_resizing_the_embeddings_after_boost_is_refused() -> None:
    import io

    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    raw = transformers.LlamaForCausalLM(config)
    raw.resize_token_embeddings(80)  # before boost(): the plugin lays out the resized model
    model, *_ = Booster(plugin=TorchDDPPlugin(), device="cpu").boost(raw, torch.optim.AdamW(raw.parameters()))
    with pytest.raises(
        ValueError, match=r"resize_token_embeddings after boost\(\): TorchDDPPlugin .*before boost"
    ):
        model.unwrap().resize_token_embeddings(96)
    assert model.unwrap().get_input_embeddings().weight.shape[0] == 80
    torch.save(model.unwrap(), io.BytesIO())  # the refusal does not stop the model from pickling


def test_fsdp_cpu_offload_needs_cuda() -> None:
    with pytest.raises(
        ValueError, match=r"cpu_offload=True needs CUDA .*device is 'cpu'.*use cpu_offload=False"
    ):
        Booster(plugin=TorchFSDPPlugin(cpu_offload=True), device="cpu")
    Booster(plugin=TorchFSDPPlugin(cpu_offload=False, sync_module_states=True), device="cpu")


class _Stream(IterableDataset):
    def __iter__(self):
        yield from range(4)


def test_prepare_dataloader_names_what_it_needs() -> None:
    plugin = TorchDDPPlugin()
    data = TensorDataset(torch.arange(8))
    with pytest.raises(ValueError, match=r"dataset is None"):
        plugin.prepare_dataloader(None, batch_size=2)
    with pytest.raises(
        TypeError, match=r"got a DataLoader; pass its dataset \(prepare_dataloader\(loader.dataset"
    ):
        plugin.prepare_dataloader(DataLoader(data), batch_size=2)
    with pytest.raises(TypeError, match=r"_Stream is not a map-style dataset"):
        plugin.prepare_dataloader(_Stream(), batch_size=2)
    assert len(plugin.prepare_dataloader(data, batch_size=2)) == 4
