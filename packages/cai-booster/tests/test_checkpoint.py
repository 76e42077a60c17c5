"""Checkpoint round trips through the Booster, save safety and load verification (the cross-plugin matrix is in
integration-tests)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import cai.ckpt
from cai.booster import Booster
from cai.mesh.testing import TinyTransformer, make_batch, run_distributed


def _boosted(seed: int):
    booster = Booster(device="cpu")
    model = TinyTransformer(seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, *_ = booster.boost(model, opt)
    return booster, model, opt


def test_save_before_the_first_step_loads_and_steps_identically(tmp_path) -> None:
    booster, model, opt = _boosted(0)
    booster.save_model(model, tmp_path / "model")
    booster.save_optimizer(opt, tmp_path / "optim")
    assert "model.safetensors.index.json" in os.listdir(tmp_path / "model")
    other_booster, other, other_opt = _boosted(5)
    other_booster.load_model(other, tmp_path / "model")
    other_booster.load_optimizer(other_opt, tmp_path / "optim")
    ids, labels = make_batch()
    for m, o in ((model, opt), (other, other_opt)):
        o.backward(TinyTransformer.loss(m(ids), labels))
        o.step()
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(p, q)


def test_lr_scheduler_round_trip(tmp_path) -> None:
    booster, _, opt = _boosted(0)
    sched = torch.optim.lr_scheduler.StepLR(opt.unwrap(), step_size=2, gamma=0.5)
    for _ in range(3):
        opt.step()
        sched.step()
    booster.save_lr_scheduler(sched, tmp_path / "sched.json")
    fresh = torch.optim.lr_scheduler.StepLR(_boosted(0)[2].unwrap(), step_size=2, gamma=0.5)
    booster.load_lr_scheduler(fresh, tmp_path / "sched.json")
    assert fresh.state_dict() == sched.state_dict()


def test_async_save_then_load(tmp_path) -> None:
    booster, model, opt = _boosted(0)
    ids, labels = make_batch()
    opt.backward(TinyTransformer.loss(model(ids), labels))
    opt.step()
    booster.save_model(model, tmp_path / "model", use_async=True)
    booster.save_optimizer(opt, tmp_path / "optim", use_async=True)
    other_booster, other, other_opt = _boosted(5)
    other_booster.load_model(other, tmp_path / "model")  # waits for the pending writes first
    other_booster.load_optimizer(other_opt, tmp_path / "optim")
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(p, q)
    assert opt.state_dict()["state"][0]["step"] == other_opt.state_dict()["state"][0]["step"]


# ---- save safety and verification through the Booster -----------------------------------------------------------
def _snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _flip_middle_of_biggest(directory: Path, prefix: str) -> Path:
    shard = max(directory.glob(f"{prefix}-*.safetensors"), key=lambda p: p.stat().st_size)
    raw = bytearray(shard.read_bytes())
    mid = len(raw) // 2
    for i in range(mid, mid + 64):
        raw[i] ^= 0xFF
    shard.write_bytes(bytes(raw))
    return shard


def test_saves_refuse_user_files_and_leave_them(tmp_path) -> None:
    booster, model, opt = _boosted(0)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("x\n")
    (tmp_path / "file").write_bytes(b"data")
    (tmp_path / "run" / "step-000001").mkdir(parents=True)
    (tmp_path / "run" / "step-000001" / "notes.txt").write_text("y\n")
    before = _snapshot(tmp_path)
    for save in (
        lambda p: booster.save_model(model, p, shard=True),
        lambda p: booster.save_model(model, p, use_async=True),
        lambda p: booster.save_optimizer(opt, p, shard=True),
        lambda p: booster.save_optimizer(opt, p, use_async=True),
    ):
        with pytest.raises(FileExistsError, match="out: it is a directory of files cai-ckpt did not write"):
            save(tmp_path / "out")
        with pytest.raises(FileExistsError, match="file: it is a file of 4 bytes"):
            save(tmp_path / "file")
    with pytest.raises(FileExistsError, match="step-000001: it is a directory of files"):
        booster.save_state(tmp_path / "run", step=1, model=model, optimizer=opt)
    assert _snapshot(tmp_path) == before
    booster.save_model(model, tmp_path / "model")
    booster.save_model(model, tmp_path / "model")  # an earlier cai checkpoint is replaced


def test_flipped_bytes_fail_load_model_and_load_optimizer_unless_verify_is_off(tmp_path) -> None:
    booster, model, opt = _boosted(0)
    ids, labels = make_batch()
    opt.backward(TinyTransformer.loss(model(ids), labels))
    opt.step()
    booster.save_model(model, tmp_path / "model", shard=True, size_per_shard=0.01)
    booster.save_optimizer(opt, tmp_path / "optim", shard=True, size_per_shard=0.01)
    shard = _flip_middle_of_biggest(tmp_path / "model", "model")
    other_booster, other, other_opt = _boosted(5)
    with pytest.raises(cai.ckpt.CheckpointError, match=f"{shard} fails checksum verification \\(tensor '"):
        other_booster.load_model(other, tmp_path / "model")
    other_booster.load_model(other, tmp_path / "model", verify=False)
    shard = _flip_middle_of_biggest(tmp_path / "optim", "optimizer")
    with pytest.raises(cai.ckpt.CheckpointError, match=f"{shard} fails checksum verification \\(tensor '"):
        other_booster.load_optimizer(other_opt, tmp_path / "optim")
    other_booster.load_optimizer(other_opt, tmp_path / "optim", verify=False)
    booster.save_state(tmp_path / "run", step=1, model=model, optimizer=opt)
    shard = _flip_middle_of_biggest(tmp_path / "run" / "step-000001" / "model", "model")
    with pytest.raises(cai.ckpt.CheckpointError, match=f"{shard} fails checksum verification"):
        other_booster.load_state(tmp_path / "run", model=other, optimizer=other_opt)
    other_booster.load_state(tmp_path / "run", model=other, optimizer=other_opt, verify=False)


def _zero_run(path: str) -> dict[str, str]:
    import torch.distributed as dist

    from cai.booster.plugin import LowLevelZeroPlugin

    def boosted(seed: int):
        booster = Booster(plugin=LowLevelZeroPlugin(stage=2, precision="fp32"), device="cpu")
        model = TinyTransformer(seed=seed, hidden=64)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt, *_ = booster.boost(model, opt)
        return booster, model, opt

    root = Path(path)
    booster, model, opt = boosted(0)
    ids, labels = make_batch(seed=dist.get_rank())
    booster.backward(TinyTransformer.loss(model(ids), labels), opt)
    opt.step()
    out = {}
    try:
        booster.save_model(model, root / "user", shard=True)
        out["user"] = "saved"
    except FileExistsError as e:
        out["user"] = str(e)
    booster.save_model(model, root / "model", shard=True, size_per_shard=0.02)
    booster.save_optimizer(opt, root / "optim", shard=True, size_per_shard=0.02)
    dist.barrier()
    if dist.get_rank() == 0:
        _flip_middle_of_biggest(root / "model", "model")
        _flip_middle_of_biggest(root / "optim", "optimizer")
    dist.barrier()
    other_booster, other, other_opt = boosted(5)
    for name, load in (
        ("model", lambda **kw: other_booster.load_model(other, root / "model", **kw)),
        ("optim", lambda **kw: other_booster.load_optimizer(other_opt, root / "optim", **kw)),
    ):
        try:
            load()
            out[name] = "loaded"
        except cai.ckpt.CheckpointError as e:
            out[name] = str(e)
        load(verify=False)
    return out


def test_two_ranks_zero_refuses_user_files_and_every_rank_fails_a_damaged_load(tmp_path) -> None:
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "notes.txt").write_text("x\n")
    results = run_distributed(_zero_run, 2, str(tmp_path), timeout=300)
    assert (
        results[0]["user"] == results[1]["user"]
        and "directory of files cai-ckpt did not write" in (results[0]["user"])
    )
    assert (tmp_path / "user" / "notes.txt").read_text() == "x\n"
    assert sorted(p.name for p in (tmp_path / "user").iterdir()) == ["notes.txt"]
    for name in ("model", "optim"):
        for r in results:
            assert "fails checksum verification (tensor '" in r[name] and "found by ranks" in r[name], r[name]


def test_gemini_fp16_save_state_resumes_the_loss_scale(tmp_path) -> None:
    from cai.booster.plugin import GeminiPlugin

    def fresh():
        booster = Booster(
            plugin=GeminiPlugin(precision="fp16", initial_scale=2.0**10, hysteresis=1), device="cpu"
        )
        model = TinyTransformer(seed=0)
        model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        return booster, model, opt

    booster, model, opt = fresh()
    ids, labels = make_batch()
    opt.backward(TinyTransformer.loss(model(ids), labels) * float("inf"))  # overflow: the scale backs off
    opt.step()
    opt.zero_grad()
    assert opt.scaler.scale == 2.0**9
    booster.save_state(tmp_path / "ckpt", step=1, model=model, optimizer=opt)

    other_booster, other, other_opt = fresh()
    assert other_opt.scaler.scale == 2.0**10
    other_booster.load_state(tmp_path / "ckpt", model=other, optimizer=other_opt)
    assert other_opt.scaler.state_dict() == opt.scaler.state_dict()
    assert other_opt.scaler.skipped_steps == 1


def test_save_model_in_a_dtype_loads_back_through_from_pretrained(tmp_path) -> None:
    # the floating tensors are stored in the asked dtype and config.json names it, so from_pretrained's
    # default dtype ("auto") builds the model in it
    import json

    import transformers

    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=64
    )
    torch.manual_seed(0)
    booster = Booster(device="cpu")
    model, *_ = booster.boost(transformers.LlamaForCausalLM(config))
    booster.save_model(model, tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((tmp_path / "bf16/config.json").read_text())["dtype"] == "bfloat16"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    want = model.unwrap().state_dict()
    for name, tensor in loaded.state_dict().items():
        assert tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor, want[name].to(torch.bfloat16)), name
    with pytest.raises(ValueError, match=r"floating torch\.dtype"):
        booster.save_model(model, tmp_path / "int", dtype=torch.int8)
