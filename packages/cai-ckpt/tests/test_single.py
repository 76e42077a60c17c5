"""Single-process behaviour: format, Hugging Face layout, dtype, optimizer round trip, bad input, atomicity."""

from __future__ import annotations

import json
import pickle
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import cai.ckpt as ck
from cai.ckpt._codec import decode, encode
from cai.ckpt._plan import make_plan
from cai.mesh import ShardSpec
from cai.mesh.testing import TinyTransformer, make_batch


def _model(seed: int = 0, tie: bool = True) -> TinyTransformer:
    return TinyTransformer(tie_embeddings=tie, seed=seed)


def _equal_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _train(model, opt, steps, start=0):
    losses = []
    for s in range(start, start + steps):
        x, y = make_batch(seed=s)
        loss = model.loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


def test_hf_layout_files_index_and_manifest(tmp_path):
    m = _model()
    ck.save_model(m, tmp_path / "m", size_per_shard=0.01, config={"model_type": "tiny"})
    files = sorted(p.name for p in (tmp_path / "m").iterdir())
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert {"model.safetensors.index.json", "manifest.json", "config.json"} <= set(files)
    index = json.loads((tmp_path / "m/model.safetensors.index.json").read_text())
    # tied weights are stored once; the index records the alias
    assert "head.weight" not in index["weight_map"] and index["metadata"]["aliases"] == {
        "head.weight": "embed.weight"
    }
    full = {}
    for f in shards:
        full.update(load_file(str(tmp_path / "m" / f)))
    sd = m.state_dict()
    assert set(full) == set(sd) - {"head.weight"}
    assert all(torch.equal(full[k], sd[k]) for k in full)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in full.values())
    manifest = json.loads((tmp_path / "m/manifest.json").read_text())
    assert set(manifest["files"]) == set(files) - {"manifest.json"}
    assert manifest["layout"]["world_size"] == 1


def test_round_trip_tied_and_untied(tmp_path):
    for tie in (True, False):
        src, dst = _model(0, tie), _model(1, tie)
        ck.save_model(src, tmp_path / f"m{tie}")
        ck.load_model(dst, tmp_path / f"m{tie}", verify=True)
        assert _equal_state(src, dst)
        if tie:
            assert dst.head.weight is dst.embed.weight


def test_dtype_conversion_on_save_and_load(tmp_path):
    src = _model()
    ck.save_model(src, tmp_path / "bf16", dtype=torch.bfloat16)
    stored = load_file(str(tmp_path / "bf16/model-00001-of-00001.safetensors"))
    assert all(v.dtype == torch.bfloat16 for v in stored.values())
    dst = _model(1)
    ck.load_model(dst, tmp_path / "bf16")
    for k, v in src.state_dict().items():
        assert dst.state_dict()[k].dtype == torch.float32
        assert torch.equal(dst.state_dict()[k], v.to(torch.bfloat16).float())


def test_plain_optimizer_round_trip_continues_identically(tmp_path):
    ref = _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.8, 0.95))
    _train(ref, ref_opt, 3)
    ck.save_model(ref, tmp_path / "m")
    ck.save_optimizer(ref_opt, tmp_path / "o", model=ref)
    new = _model(1)
    new_opt = torch.optim.AdamW(new.parameters(), lr=5.0)
    ck.load_model(new, tmp_path / "m")
    ck.load_optimizer(new_opt, tmp_path / "o", model=new)
    assert new_opt.param_groups[0]["lr"] == 1e-2 and new_opt.param_groups[0]["betas"] == (0.8, 0.95)
    assert torch.equal(_train(ref, ref_opt, 5, 3), _train(new, new_opt, 5, 3))
    assert _equal_state(ref, new)


def test_optimizer_files_are_fp32_by_name(tmp_path):
    m = _model(tie=False).to(torch.bfloat16)
    opt = torch.optim.Adam(m.parameters())
    x, y = make_batch()
    m.loss(m(x), y).backward()
    opt.step()
    ck.save_optimizer(opt, tmp_path / "o", param_names=[n for n, _ in m.named_parameters()])
    index = json.loads((tmp_path / "o/optimizer.safetensors.index.json").read_text())
    assert "blocks.0.attn.in_proj_weight.exp_avg" in index["weight_map"] or any(
        k.endswith(".exp_avg_sq") for k in index["weight_map"]
    )
    stored = load_file(str(tmp_path / "o" / next(iter(set(index["weight_map"].values())))))
    assert all(v.dtype == torch.float32 for v in stored.values())
    groups = json.loads((tmp_path / "o/param_groups.json").read_text())["param_groups"]
    assert groups[0]["params"] == [n for n, _ in m.named_parameters()]


def test_codec_round_trip_and_refuses_callables():
    tensors: dict = {}
    obj = {"a": (1, 2.5, [None, True]), "t": torch.arange(3), 7: float("inf"), "s": "x"}
    back = decode(json.loads(json.dumps(encode(obj, tensors))), tensors)
    assert (
        back["a"] == (1, 2.5, [None, True]) and torch.equal(back["t"], obj["t"]) and back[7] == float("inf")
    )
    with pytest.raises(TypeError, match="lambda"):
        encode({"f": lambda s: s}, {})


def test_plan_balances_files_over_ranks_by_bytes():
    sizes = [40, 30, 20, 10, 10, 10]
    metas = [
        {
            "tensors": {
                f"t{i}": {"specs": [ShardSpec.full((s, 1024 * 256)).to_dict()], "dtype": "F32"}
                for i, s in enumerate(sizes)
            },
            "aliases": {},
        }
        for _ in range(2)
    ]
    files, _ = make_plan(metas, prefix="model", size_per_shard_mb=1, out_dtype=lambda n, d: d)
    assert len(files) == 6
    load = [sum(f.nbytes for f in files if f.owner == r) for r in range(2)]
    assert load == [60 << 20, 60 << 20]
    # a replicated tensor is read from the file owner's own copy: no communication
    assert all(src == f.owner for f in files for t in f.tensors for src, _ in t.sources)


# ---- bad input: each a clear error, and the target unchanged ------------------------------------------------
def _saved(tmp_path: Path) -> tuple[Path, list[str]]:
    ck.save_model(_model(), tmp_path / "good", size_per_shard=0.01)
    d = tmp_path / "good"
    return d, sorted(p.name for p in d.glob("model-*.safetensors"))


def _expect_error(path: Path, match: str, **kw) -> None:
    dst = _model(1)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(ck.CheckpointError, match=match):
        ck.load_model(dst, path, **kw)
    assert all(torch.equal(before[k], v) for k, v in dst.state_dict().items()), "the model was half-loaded"


def test_truncated_file(tmp_path):
    d, shards = _saved(tmp_path)
    f = d / shards[1]
    f.write_bytes(f.read_bytes()[:-7])
    _expect_error(d, f"{shards[1]}.*truncated")
    (d / "manifest.json").unlink()  # without a manifest, the header check still finds it
    _expect_error(d, f"{shards[1]} is truncated")


def test_corrupted_header(tmp_path):
    d, shards = _saved(tmp_path)
    (d / "manifest.json").unlink()
    f = d / shards[2]
    raw = bytearray(f.read_bytes())
    raw[9:14] = b"#####"
    f.write_bytes(bytes(raw))
    _expect_error(d, f"{shards[2]} has a corrupted safetensors header")


def test_corrupted_data_found_by_default(tmp_path):
    d, shards = _saved(tmp_path)
    f = d / shards[3]
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0xFF
    f.write_bytes(bytes(raw))
    # Found as the bytes are read (not before): the error says the target may be partly loaded.
    with pytest.raises(ck.CheckpointError, match=f"{shards[3]} fails checksum verification.*tensor '"):
        ck.load_model(_model(1), d)
    ck.load_model(_model(1), d, verify=False)


def test_missing_shard(tmp_path):
    d, shards = _saved(tmp_path)
    (d / shards[-1]).unlink()
    _expect_error(d, f"missing checkpoint file .*{shards[-1]}")


def test_shard_of_another_model(tmp_path):
    d, shards = _saved(tmp_path)
    ck.save_model(TinyTransformer(hidden=16, heads=4, layers=1), tmp_path / "other")
    foreign = (tmp_path / "other/model-00001-of-00001.safetensors").read_bytes()
    (d / shards[1]).write_bytes(foreign)
    _expect_error(d, f"{shards[1]} has .* bytes, its manifest says")  # the manifest notices first
    (d / "manifest.json").unlink()
    _expect_error(
        d, f"{shards[1]} does not contain .*another checkpoint|{shards[1]}\\), the current model needs"
    )


def test_pickle_file_is_never_loaded(tmp_path):
    d, shards = _saved(tmp_path)
    (d / "manifest.json").unlink()
    (d / shards[0]).write_bytes(pickle.dumps({"x": 1}, protocol=4))
    _expect_error(d, f"{shards[0]} is a pickle")
    (tmp_path / "pt").mkdir()
    torch.save(_model().state_dict(), tmp_path / "pt" / "pytorch_model.bin")
    _expect_error(tmp_path / "pt", "pytorch_model.bin are pickle files")


def test_missing_unexpected_keys_and_shape_mismatch(tmp_path):
    ck.save_model(_model(tie=False), tmp_path / "m")
    dst = TinyTransformer(layers=3, tie_embeddings=False)
    with pytest.raises(ck.CheckpointError, match=r"missing keys \(\d+\): blocks\.2\."):
        ck.load_model(dst, tmp_path / "m")
    dst = TinyTransformer(layers=1, tie_embeddings=False)
    with pytest.raises(ck.CheckpointError, match=r"unexpected keys \(\d+\): blocks\.1\."):
        ck.load_model(dst, tmp_path / "m")
    ck.load_model(dst, tmp_path / "m", strict=False)
    with pytest.raises(
        ck.CheckpointError,
        match=r"shape mismatch for 'embed.weight': checkpoint has \(251, 33\) \(in model-00001-of-00001.safetensors\), the current model needs \(80, 33\)",
    ):
        ck.load_model(TinyTransformer(vocab_size=80, tie_embeddings=False), tmp_path / "m")


def test_header_length_bomb(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ck.CheckpointError, match=r"model\.safetensors has a corrupted or truncated header"):
        ck.load_model(_model(), tmp_path)


# ---- atomicity, async ---------------------------------------------------------------------------------------
def test_overwrite_is_atomic_and_leaves_no_temporaries(tmp_path):
    ck.save_model(_model(0), tmp_path / "m")
    ck.save_model(_model(1), tmp_path / "m")
    dst = _model(2)
    ck.load_model(dst, tmp_path / "m")
    assert _equal_state(dst, _model(1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_async_save_snapshots_state_and_commits_on_wait(tmp_path):
    m = _model()
    expected = {k: v.clone() for k, v in m.state_dict().items()}
    ck.save_model(m, tmp_path / "m", use_async=True)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)  # training continues while the files are written
    ck.wait()
    dst = _model(1)
    ck.load_model(dst, tmp_path / "m", verify=True)
    assert all(torch.equal(dst.state_dict()[k], v) for k, v in expected.items())


def test_single_file_hf_directory_loads(tmp_path):
    """A directory with one ``model.safetensors`` and no index (what small Hugging Face models ship)."""
    from cai.ckpt._format import SafetensorsWriter

    m = _model(tie=False)
    sd = m.state_dict()
    writer = SafetensorsWriter(
        tmp_path / "model.safetensors",
        [(k, v.dtype, tuple(v.shape)) for k, v in sd.items()],
        {"format": "pt"},
    )
    for k, v in sd.items():
        writer.write(k, v)
    writer.close()
    assert set(load_file(str(tmp_path / "model.safetensors"))) == set(sd)  # the safetensors library reads it
    dst = _model(1, tie=False)
    ck.load_model(dst, tmp_path)
    assert _equal_state(m, dst)


class _SharedStepState:
    """A state-protocol optimizer that reports one ``step`` tensor under every parameter (as ZeRO buckets do)."""

    def __init__(self, model: torch.nn.Module):
        self.names = [n for n, _ in model.named_parameters()]
        self.step = torch.tensor(4.0)
        self.moments = {n: torch.full(p.shape, float(i)) for i, (n, p) in enumerate(model.named_parameters())}

    def sharded_state_dict(self):
        from cai.mesh import LocalShard

        out = {}
        for n in self.names:
            out[f"{n}.exp_avg"] = LocalShard(self.moments[n], ShardSpec.full(self.moments[n].shape))
            out[f"{n}.exp_avg_sq"] = LocalShard(self.moments[n], ShardSpec.full(self.moments[n].shape))
            out[f"{n}.step"] = LocalShard(self.step, ShardSpec.full(()))
        return out

    def param_groups_state(self):
        return [
            {
                "lr": 0.5,
                "betas": [0.9, 0.999],
                "eps": 1e-8,
                "weight_decay": 0.0,
                "amsgrad": False,
                "params": self.names,
            }
        ]


def test_shared_state_tensors_load_into_a_plain_optimizer(tmp_path):
    m = _model(tie=False)
    ck.save_optimizer(_SharedStepState(m), tmp_path / "o")
    opt = torch.optim.Adam(m.parameters(), lr=1.0)
    ck.load_optimizer(opt, tmp_path / "o", model=m)
    assert opt.param_groups[0]["lr"] == 0.5 and opt.param_groups[0]["betas"] == (0.9, 0.999)
    for i, p in enumerate(m.parameters()):
        st = opt.state[p]
        assert float(st["step"]) == 4.0 and torch.equal(st["exp_avg"], torch.full(p.shape, float(i)))


def test_load_state_checks_every_part_before_changing_any(tmp_path):
    src = _model(0, tie=False)
    opt = torch.optim.AdamW(src.parameters())
    _train(src, opt, 1)
    ck.save_state(tmp_path / "run", model=src, optimizer=opt, step=1)
    shard = next((tmp_path / "run/step-000001/optimizer").glob("optimizer-*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:100])
    dst = _model(1, tie=False)
    dst_opt = torch.optim.AdamW(dst.parameters())
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(ck.CheckpointError, match=f"{shard.name} has 100 bytes"):
        ck.load_state(tmp_path / "run", model=dst, optimizer=dst_opt)
    assert all(torch.equal(before[k], v) for k, v in dst.state_dict().items()), "the model was loaded anyway"
    assert not dst_opt.state
