"""Single-process logic: configuration errors, the loss-scale state machine, layout, full state round trip."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

from cai.kernels.optim import DynamicLossScaler
from cai.zero import LossScaleConfig, LowLevelZeroOptimizer, ZeroConfig, ZeroOptimizer


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(stage=3), "stage=3"),
        (dict(stage=-1), "stage=-1 is not supported; use 0 "),
        (dict(bucket_size_mb=0), "bucket_size_mb=0"),
        (dict(comm_dtype=torch.int8), "comm_dtype"),
        (dict(max_norm=-1.0), "max_norm=-1.0"),
    ],
)
def test_zero_config_names_the_bad_value(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        ZeroConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(reduce_bucket_size=-1), "LowLevelZeroOptimizer: reduce_bucket_size=-1 must be > 0 (elements"),
        (dict(reduce_bucket_size=0), "LowLevelZeroOptimizer: reduce_bucket_size=0 must be > 0"),
        (dict(clip_grad_norm=-1.0), "LowLevelZeroOptimizer: clip_grad_norm=-1.0 must be >= 0"),
    ],
)
def test_low_level_zero_optimizer_errors_use_its_own_names_and_units(kwargs, message) -> None:
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        LowLevelZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, **kwargs)
    assert "bucket_size_mb" not in str(info.value) and "max_norm" not in str(info.value)


@pytest.mark.parametrize(
    "kwargs", [dict(initial_scale=0.5), dict(growth_factor=1.0), dict(backoff_factor=1.0), dict(hysteresis=0)]
)
def test_loss_scale_config_rejects(kwargs) -> None:
    with pytest.raises(ValueError, match="LossScaleConfig"):
        LossScaleConfig(**kwargs)


def test_loss_scaler_hysteresis_backoff_growth_and_bounds() -> None:
    s = DynamicLossScaler(
        LossScaleConfig(initial_scale=8.0, growth_interval=2, hysteresis=2, min_scale=2.0, max_scale=16.0)
    )
    s.update(True)
    assert s.scale == 8.0  # first overflow absorbed by hysteresis
    s.update(True)
    assert s.scale == 4.0
    s.update(True), s.update(True)
    assert s.scale == 2.0
    s.update(True), s.update(True)
    assert s.scale == 2.0 and s.overflow_count == 6  # min_scale
    for _ in range(6):
        s.update(False)
    assert s.scale == 16.0  # grew every 2 clean steps, capped at max_scale
    state = s.state_dict()
    t = DynamicLossScaler(LossScaleConfig())
    t.load_state_dict(state)
    assert t.state_dict() == state


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 24), nn.Tanh(), nn.Linear(24, 5), nn.Tanh(), nn.Linear(5, 3))


def _zero(model: nn.Module, **config) -> ZeroOptimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return ZeroOptimizer(opt, model=model, config=ZeroConfig(bucket_size_mb=64 * 4 / 2**20, **config))


def _train(model: nn.Module, opt, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).mean()
        (opt.backward(loss) if isinstance(opt, ZeroOptimizer) else loss.backward())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_parameters_are_views_of_flat_buckets_and_single_process_matches_torch() -> None:
    model, ref = _mlp(), _mlp()
    opt = _zero(model)
    assert len(opt.buckets) > 1
    for b in opt.buckets:
        for s in b.slots:
            assert s.param.data_ptr() == b.working[s.offset :].data_ptr()
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    assert _train(model, opt, range(5)) == _train(ref, ropt, range(5))
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    assert all(p.grad is None for p in model.parameters())


def test_full_state_dict_round_trip_continues_identically() -> None:
    model = _mlp()
    opt = _zero(model)
    _train(model, opt, range(3))
    sd = copy.deepcopy(opt.state_dict())
    assert set(sd["state"]["0.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert sd["state"]["0.weight"]["exp_avg"].shape == (24, 8)
    assert sd["param_groups"][0]["params"] == [
        "0.weight",
        "0.bias",
        "2.weight",
        "2.bias",
        "4.weight",
        "4.bias",
    ]
    snapshot = copy.deepcopy(model.state_dict())
    expected = _train(model, opt, range(3, 6))

    model2 = _mlp()
    model2.load_state_dict(snapshot)
    opt2 = _zero(model2, stage=1)  # another layout loads the same state
    opt2.load_state_dict(sd)
    assert _train(model2, opt2, range(3, 6)) == expected


def test_construction_errors_name_the_problem() -> None:
    model = _mlp()
    stray = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="not among the model's named parameters"):
        ZeroOptimizer(torch.optim.SGD([*model.parameters(), stray], lr=0.1), model=model)
    with pytest.raises(ValueError, match="only for fp16"):
        ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, loss_scale=LossScaleConfig())
    frozen = _mlp().requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter with requires_grad=True"):
        ZeroOptimizer(torch.optim.SGD(frozen.parameters(), lr=0.1), model=frozen)
    with pytest.raises(ValueError, match="overlap_allgather=True needs the model"):
        ZeroOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model=list(model.named_parameters()),
            config=ZeroConfig(overlap_allgather=True),
        )


def test_replicas_and_shared_must_name_parameters() -> None:
    model = _mlp()
    model[4].bias.requires_grad_(False)

    def build(**kwargs) -> ZeroOptimizer:
        m = _mlp()
        return ZeroOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), model=m, **kwargs)

    with pytest.raises(ValueError, match=re.escape("replicas names ['1.weight', 'head']")):
        build(replicas={"0.weight": 2, "head": 2, "1.weight": 2})
    with pytest.raises(ValueError, match=re.escape("replicas {'0.bias': 0, '2.bias': 1.5}: each count")):
        build(replicas={"0.weight": 2, "0.bias": 0, "2.bias": 1.5})
    with pytest.raises(ValueError, match=re.escape("shared names ['embed']")):
        build(shared={"0.weight": None, "embed": None})
    # a frozen parameter has no gradient to sum: its peers would wait for this rank's
    with pytest.raises(ValueError, match=re.escape("shared names ['4.bias'], which are not trainable")):
        ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, shared={"4.bias": None})
    # but a frozen one may be replicated (a plugin names every layer norm, also under LoRA)
    ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, replicas={"4.bias": 2})
    from cai.kernels.optim import CPUAdam

    config = ZeroConfig(cpu_offload=True, overlap_cpu_step=True)
    with pytest.raises(
        ValueError, match=re.escape("shared parameters ['0.weight'] need overlap_cpu_step=False")
    ):
        ZeroOptimizer(CPUAdam(model.parameters()), model=model, config=config, shared={"0.weight": None})


def test_a_shared_parameter_gets_a_bucket_of_its_own_and_is_summed_once_per_step() -> None:
    plain = _mlp()
    opt = ZeroOptimizer(torch.optim.AdamW(plain.parameters()), model=plain, config=ZeroConfig(stage=1))
    assert len(opt.buckets) == 1
    model = _mlp()
    # one process: no group to sum over (None), so the sum is the identity and only the bookkeeping is checked
    opt = ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        model=model,
        config=ZeroConfig(stage=1),
        shared={"2.weight": None},
    )
    assert [[s.name for s in b.slots] for b in opt.buckets] == [
        ["4.bias", "4.weight", "2.bias"],
        ["2.weight"],
        ["0.bias", "0.weight"],
    ]
    x = torch.randn(4, 8)
    opt.backward(model(x).sum())
    opt.grad_norm()
    with pytest.raises(RuntimeError, match=re.escape("after grad_norm()/clip_grad_norm() summed it")):
        opt.backward(model(x).sum())  # would add to a gradient already summed over its group
    opt.zero_grad()
    opt.backward(model(x).sum())  # a new window
    opt.step()


def test_stage0_in_one_process_matches_torch_and_reports_whole_parameters() -> None:
    from cai.mesh import ShardSpec

    model, ref = _mlp(), _mlp()
    opt = _zero(model, stage=0)
    assert len(opt.buckets) > 1 and all(b.replicated and (b.lo, b.hi) == (0, b.padded) for b in opt.buckets)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    assert _train(model, opt, range(3)) == _train(ref, ropt, range(3))
    masters = opt.model_sharded_state_dict()
    state = opt.sharded_state_dict()
    for name, p in ref.named_parameters():
        assert masters[name].spec == ShardSpec.full(p.shape) and torch.equal(masters[name].tensor, p), name
        exp_avg = state[f"{name}.exp_avg"]
        assert exp_avg.spec == ShardSpec.full(p.shape), name
        assert torch.equal(exp_avg.tensor, ropt.state[p]["exp_avg"]), name
    full = {n: t.tensor.clone() for n, t in {**masters, **state}.items()}

    model2 = _mlp()
    opt2 = _zero(model2, stage=0)
    read = lambda name, spec, dtype: spec.cut(full[name]).to(dtype)  # noqa: E731
    opt2.load_model_sharded_state_dict(read)
    opt2.load_sharded_state_dict(read)
    assert _train(model2, opt2, range(3, 5)) == _train(ref, ropt, range(3, 5))


def test_low_level_zero_optimizer_maps_colossal_names() -> None:
    model = _mlp().half()
    opt = LowLevelZeroOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        partition_grad=True,
        reduce_bucket_size=100,
        initial_scale=2**10,
        hysteresis=3,
        clip_grad_norm=1.0,
    )
    assert opt.config.stage == 2 and opt.config.max_norm == 1.0
    assert opt.config.bucket_numel(torch.float16) == 100
    assert opt.loss_scale == 2**10 and opt.scaler.config.hysteresis == 3


def test_offload_with_a_torch_optimizer_matches_torch() -> None:
    model, ref = _mlp(), _mlp()
    opt = ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        model=model,
        config=ZeroConfig(bucket_size_mb=64 * 4 / 2**20, cpu_offload=True),
    )
    assert _train(model, opt, range(4)) == _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), range(4))
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_overlap_cpu_step_requirements() -> None:
    from cai.kernels.optim import CPUAdam

    with pytest.raises(ValueError, match="overlap_cpu_step=True needs cpu_offload=True"):
        ZeroConfig(overlap_cpu_step=True)
    with pytest.raises(ValueError, match="overlap_cpu_step=True needs cpu_offload=True and max_norm=0"):
        ZeroConfig(overlap_cpu_step=True, cpu_offload=True, max_norm=1.0)
    model = _mlp()
    config = ZeroConfig(cpu_offload=True, overlap_cpu_step=True)
    with pytest.raises(ValueError, match=r"needs cai\.kernels\.optim\.CPUAdam/HybridAdam"):
        ZeroOptimizer(torch.optim.AdamW(model.parameters()), model=model, config=config)
    opt = ZeroOptimizer(CPUAdam(model.parameters()), model=model, config=config)
    x = torch.randn(4, 8)
    opt.backward(model(x).sum())
    with pytest.raises(RuntimeError, match="one synchronising backward per step"):
        opt.backward(model(x).sum())


def test_update_master_params_after_loading_weights_into_the_model() -> None:
    model, ref = _mlp(), _mlp()
    with torch.no_grad():
        for q in ref.parameters():
            q.mul_(-0.5)
    opt = _zero(model)
    model.load_state_dict(ref.state_dict())  # copies into the bucket views
    model[4].bias.data = ref[4].bias.detach().clone()  # replaced storage: re-linked by update_master_params
    opt.update_master_params()
    assert _train(model, opt, range(3)) == _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), range(3))
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("window_bytes", [1 << 30, 4096], ids=["one-window", "many-windows"])
def test_bf16_gradient_shard_stays_bf16_and_steps_exactly(monkeypatch, window_bytes: int) -> None:
    """A bf16 model's reduced gradient is kept in bf16 (half an fp32 gradient's memory) and the update equals, bit
    for bit, AdamW on fp32 masters with the same gradient in fp32, also when the step casts window by window."""
    from cai.mesh.testing import TinyTransformer, make_batch
    from cai.zero import _optimizer

    monkeypatch.setattr(_optimizer, "_CAST_WINDOW_BYTES", window_bytes)
    torch.manual_seed(0)
    model = TinyTransformer().to(torch.bfloat16)
    ref = copy.deepcopy(model)
    masters = [p.detach().float().clone() for p in ref.parameters()]
    ref_opt = torch.optim.AdamW(masters, lr=1e-2)
    opt = ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        model=model,
        config=ZeroConfig(stage=2, bucket_size_mb=8192 * 2 / 2**20),
    )
    assert len(opt.buckets) > 2
    for step in range(3):
        ids, labels = make_batch(seed=step)
        opt.backward(TinyTransformer.loss(model(ids), labels))
        assert {b.grad_shard.dtype for b in opt.buckets} == {torch.bfloat16}
        opt.step()
        opt.zero_grad()
        TinyTransformer.loss(ref(ids), labels).backward()
        for master, p in zip(masters, ref.parameters()):
            master.grad = p.grad.float()
            p.grad = None
        ref_opt.step()
        with torch.no_grad():
            for master, p in zip(masters, ref.parameters()):
                p.copy_(master)
    got = {n: s.tensor for n, s in opt.model_sharded_state_dict().items()}
    for (name, _), master in zip(ref.named_parameters(), masters):
        assert torch.equal(got[name], master.reshape(-1)), name

    ids, labels = make_batch(seed=7)
    for _ in range(2):  # a second micro-step sums in fp32
        opt.backward(TinyTransformer.loss(model(ids), labels))
    assert {b.grad_shard.dtype for b in opt.buckets} == {torch.float32}


def test_optimizer_is_freed_with_its_last_reference_and_unhooks_the_model() -> None:
    import gc
    import weakref

    from cai.mesh.testing import TinyTransformer, make_batch

    model = TinyTransformer()
    opt = ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, config=ZeroConfig(stage=2)
    )
    ids, labels = make_batch()
    opt.backward(TinyTransformer.loss(model(ids), labels))
    opt.step()
    refs = [weakref.ref(opt), weakref.ref(opt.buckets[0].master)]
    del opt
    gc.collect()
    assert [r() for r in refs] == [None, None]  # the parameters' hooks did not keep it alive
    TinyTransformer.loss(model(ids), labels).backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)  # plain autograd again


def test_cai_adam_step_keeps_the_wrapped_step_s_hooks_and_lr_scheduler() -> None:
    """A cai.kernels Adam is stepped bucket by bucket, not through its step(); that step still runs (with no
    gradient) so that step hooks fire once per step and an LR scheduler sees the optimizer step before its own."""
    import warnings

    from cai.kernels.optim import HybridAdam

    model = _mlp()
    adam = HybridAdam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(adam, lambda step: 0.5**step)
    calls = []
    adam.register_step_pre_hook(lambda *_: calls.append("pre"))
    opt = ZeroOptimizer(adam, model=model, config=ZeroConfig(bucket_size_mb=64 * 4 / 2**20))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when the scheduler steps before the optimizer
        for _ in range(3):
            opt.backward(model(torch.randn(6, 8)).pow(2).mean())
            opt.step()
            opt.zero_grad()
            scheduler.step()
    assert calls == ["pre"] * 3
    assert adam.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**3)
    assert {float(adam.state[b.master]["step"]) for b in opt.buckets} == {3.0}
