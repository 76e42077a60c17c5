"""No data loss and no silent corruption: what a save may replace, checksum verification on every load path,
and the commit protocol's failure reporting, in one process and on 2 gloo ranks."""

from __future__ import annotations

import datetime
import json
import os
import re
import warnings
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import cai.ckpt as ck
from cai.ckpt import _checksum
from cai.mesh import LocalShard, ShardSpec
from cai.mesh.testing import TinyTransformer, run_distributed


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes (what must survive a refused save)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _flip_middle(path: Path, n: int = 64) -> None:
    raw = bytearray(path.read_bytes())
    mid = len(raw) // 2
    for i in range(mid, mid + n):
        raw[i] ^= 0xFF
    path.write_bytes(bytes(raw))


def _biggest(directory: Path, prefix: str) -> Path:
    return max(directory.glob(f"{prefix}-*.safetensors"), key=lambda p: p.stat().st_size)


# ---- what a save may replace ----------------------------------------------------------------------------------
def _saves(model, opt):
    return {
        "save_model": lambda p: ck.save_model(model, p),
        "save_model async": lambda p: ck.save_model(model, p, use_async=True),
        "save_optimizer": lambda p: ck.save_optimizer(opt, p, model=model),
        "save_state": lambda p: ck.save_state(p.parent, model=model, optimizer=opt, step=int(p.name[5:])),
    }


@pytest.mark.parametrize("entry", ["save_model", "save_model async", "save_optimizer", "save_state"])
def test_save_refuses_a_directory_of_user_files_and_leaves_every_byte(tmp_path, entry):
    model = TinyTransformer(seed=0)
    opt = torch.optim.AdamW(model.parameters())
    out = tmp_path / "step-000001"  # the name save_state writes to, so one path serves every entry point
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("x\n")
    (out / "sub" / "data.bin").write_bytes(os.urandom(100))
    before = _snapshot(tmp_path)
    with pytest.raises(FileExistsError, match=f"{out}.*directory of files cai-ckpt did not write.*notes.txt"):
        _saves(model, opt)[entry](out)
    ck.wait()
    assert _snapshot(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001"]  # not even a temporary directory


@pytest.mark.parametrize("entry", ["save_model", "save_model async", "save_optimizer", "save_state"])
def test_save_refuses_a_file_or_a_link_to_one(tmp_path, entry):
    model = TinyTransformer(seed=0)
    opt = torch.optim.AdamW(model.parameters())
    (tmp_path / "step-000001").write_bytes(b"precious")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "file").write_bytes(b"also precious")
    (tmp_path / "step-000002").symlink_to(tmp_path / "elsewhere" / "file")
    before = _snapshot(tmp_path)
    with pytest.raises(FileExistsError, match="step-000001: it is a file of 8 bytes"):
        _saves(model, opt)[entry](tmp_path / "step-000001")
    with pytest.raises(FileExistsError, match=r"step-000002 \(a symbolic link to .*file\): it is a file"):
        _saves(model, opt)[entry](tmp_path / "step-000002")
    ck.wait()
    assert _snapshot(tmp_path) == before and (tmp_path / "step-000002").is_symlink()


def test_save_refuses_a_cai_checkpoint_holding_other_files_and_a_link_to_user_files(tmp_path):
    model = TinyTransformer(seed=0)
    ck.save_model(model, tmp_path / "m")
    (tmp_path / "m" / "README.md").write_text("mine\n")
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "a.txt").write_text("a\n")
    (tmp_path / "link").symlink_to(tmp_path / "user")
    before = _snapshot(tmp_path)
    with pytest.raises(FileExistsError, match=r"files its manifest does not list \(README\.md\)"):
        ck.save_model(model, tmp_path / "m")
    with pytest.raises(FileExistsError, match=r"link \(a symbolic link to .*user\).*a\.txt"):
        ck.save_model(model, tmp_path / "link")
    assert _snapshot(tmp_path) == before


def test_save_over_a_cai_checkpoint_and_into_an_empty_directory(tmp_path):
    ck.save_model(TinyTransformer(seed=0), tmp_path / "m")
    ck.save_model(TinyTransformer(seed=1), tmp_path / "m")  # replaces the earlier checkpoint
    (tmp_path / "empty").mkdir()
    ck.save_model(TinyTransformer(seed=2), tmp_path / "empty")
    for name, seed in (("m", 1), ("empty", 2)):
        dst = TinyTransformer(seed=5)
        ck.load_model(dst, tmp_path / name)
        ref = TinyTransformer(seed=seed).state_dict()
        assert all(torch.equal(v, ref[k]) for k, v in dst.state_dict().items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "m"]


def test_leftover_cleanup_removes_only_directories_a_save_created(tmp_path):
    # A killed save's leftover carries the marker; a user's directory with a similar name does not.
    killed = tmp_path / ".tmp-m-0123abcd"
    killed.mkdir()
    (killed / ".cai-ckpt-partial").write_text("")
    (killed / "model-00001-of-00002.safetensors").write_bytes(b"partial")
    lookalike = tmp_path / ".tmp-m-deadbeef"
    lookalike.mkdir()
    (lookalike / "mine.txt").write_text("keep\n")
    other = tmp_path / ".tmp-m-notes"
    other.write_text("keep too\n")
    ck.save_model(TinyTransformer(seed=0), tmp_path / "m")
    ck.save_model(TinyTransformer(seed=0), tmp_path / "m")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-m-deadbeef", ".tmp-m-notes", "m"]
    assert (lookalike / "mine.txt").read_text() == "keep\n"


# ---- verification on load ------------------------------------------------------------------------------------
def _trained(seed: int = 0):
    model = TinyTransformer(seed=seed, tie_embeddings=False, hidden=64)
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


def test_flipped_bytes_in_a_model_shard_fail_the_load_naming_file_and_tensor(tmp_path):
    model, _ = _trained()
    ck.save_model(model, tmp_path / "m", size_per_shard=0.05)
    shard = _biggest(tmp_path / "m", "model")
    _flip_middle(shard)
    pattern = f"checkpoint {tmp_path / 'm'}: {shard} fails checksum verification \\(tensor '[^']+'"
    with pytest.raises(ck.CheckpointError, match=pattern):
        ck.load_model(TinyTransformer(seed=1, tie_embeddings=False, hidden=64), tmp_path / "m")
    dst = TinyTransformer(seed=1, tie_embeddings=False, hidden=64)
    ck.load_model(dst, tmp_path / "m", verify=False)  # the opt-out loads the damaged bytes
    ref = model.state_dict()
    assert [k for k, v in dst.state_dict().items() if not torch.equal(v, ref[k])], "nothing was corrupted"


def test_flipped_bytes_in_an_optimizer_shard_fail_the_load_and_leave_the_optimizer(tmp_path):
    model, opt = _trained()
    ck.save_optimizer(opt, tmp_path / "o", model=model, size_per_shard=0.05)
    shard = _biggest(tmp_path / "o", "optimizer")
    _flip_middle(shard)
    fresh = torch.optim.AdamW(model.parameters())
    with pytest.raises(
        ck.CheckpointError, match=f"{shard} fails checksum verification \\(tensor '[^']+\\.exp_avg"
    ):
        ck.load_optimizer(fresh, tmp_path / "o", model=model)
    assert not fresh.state  # a plain optimizer is loaded only after every tensor was read and verified
    ck.load_optimizer(fresh, tmp_path / "o", model=model, verify=False)
    assert fresh.state


def test_load_state_verifies_model_optimizer_and_training_state(tmp_path):
    model, opt = _trained()
    ck.save_state(tmp_path / "run", model=model, optimizer=opt, step=1, size_per_shard=0.05)
    root = tmp_path / "run" / "step-000001"
    dst, dst_opt = _trained(seed=3)
    for victim in (_biggest(root / "optimizer", "optimizer"), root / "training_state" / "rank-00000.json"):
        saved = victim.read_bytes()
        raw = bytearray(saved)
        raw[len(raw) // 2] ^= 0x01
        victim.write_bytes(bytes(raw))
        with pytest.raises(ck.CheckpointError, match=f"{victim} fails checksum verification"):
            ck.load_state(tmp_path / "run", model=dst, optimizer=dst_opt)
        if victim.suffix == ".safetensors":
            ck.load_state(tmp_path / "run", model=dst, optimizer=dst_opt, verify=False)
        victim.write_bytes(saved)
    ck.load_state(tmp_path / "run", model=dst, optimizer=dst_opt)


def test_a_slice_read_verifies_the_blocks_it_overlaps_and_no_others(tmp_path):
    block = _checksum.BLOCK // 4  # float32 elements per checksum block
    full = torch.arange(10 * block, dtype=torch.float32)
    ck.save_model({"w": full}, tmp_path / "m")
    shard = tmp_path / "m" / "model-00001-of-00001.safetensors"
    start = 8 + int.from_bytes(shard.read_bytes()[:8], "little")
    spec = ShardSpec(
        global_shape=full.shape, flat_range=(3 * block + 10, 5 * block - 10)
    )  # inside blocks 3, 4

    def read_after_damage(element: int) -> None:
        saved = shard.read_bytes()
        raw = bytearray(saved)
        raw[start + 4 * element] ^= 0x01
        shard.write_bytes(bytes(raw))
        try:
            with ck.CheckpointReader(tmp_path / "m") as reader:
                assert torch.equal(reader.read("w", spec), spec.cut(full))
        finally:
            shard.write_bytes(saved)

    with pytest.raises(ck.CheckpointError, match=r"tensor 'w', its bytes \d+\.\.\d+, crc32c block 4"):
        read_after_damage(4 * block + 100)  # inside the slice
    with pytest.raises(ck.CheckpointError, match="block 3"):
        read_after_damage(3 * block + 1)  # outside the slice, in a block it overlaps: its bytes are read too
    read_after_damage(6 * block)  # a block this reader does not touch is another rank's to verify


def test_a_large_read_is_verified_by_several_threads_and_names_the_damaged_block(tmp_path, monkeypatch):
    from cai.ckpt import _load

    monkeypatch.setattr(_load, "_CRC_THREADS", 4)
    block = _checksum.BLOCK // 4
    full = torch.randn(300 * block)  # 300 blocks: 4 threads of 75
    ck.save_model({"w": full}, tmp_path / "m")
    shard = tmp_path / "m" / "model-00001-of-00001.safetensors"
    start = 8 + int.from_bytes(shard.read_bytes()[:8], "little")
    target = {"w": torch.empty_like(full)}
    ck.load_model(target, tmp_path / "m")
    assert torch.equal(target["w"], full)
    raw = bytearray(shard.read_bytes())
    raw[start + 4 * (230 * block + 7)] ^= 0x10  # in the fourth thread's range
    shard.write_bytes(bytes(raw))
    with pytest.raises(ck.CheckpointError, match=r"crc32c block 230\)"):
        ck.load_model(target, tmp_path / "m")


def test_checkpoints_with_only_file_crc32s_still_verify(tmp_path):
    """Checkpoints written before block checksums list one zlib CRC32 per file."""
    ck.save_model(TinyTransformer(seed=0), tmp_path / "m", size_per_shard=0.01)
    manifest_path = tmp_path / "m" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["version"] = 1
    for rel in manifest["files"]:
        data = (tmp_path / "m" / rel).read_bytes()
        manifest["files"][rel] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    manifest_path.write_text(json.dumps(manifest))
    dst = TinyTransformer(seed=1)
    ck.load_model(dst, tmp_path / "m")
    assert all(torch.equal(v, TinyTransformer(seed=0).state_dict()[k]) for k, v in dst.state_dict().items())
    shard = _biggest(tmp_path / "m", "model")
    _flip_middle(shard)
    with pytest.raises(ck.CheckpointError, match=f"{shard} fails checksum verification \\(crc32 "):
        ck.load_model(TinyTransformer(seed=1), tmp_path / "m")
    ck.load_model(TinyTransformer(seed=1), tmp_path / "m", verify=False)


def test_without_the_crc32c_wheel_saves_use_zlib_and_loads_still_verify(tmp_path, monkeypatch):
    ck.save_model(TinyTransformer(seed=0), tmp_path / "hw", size_per_shard=0.05)
    monkeypatch.setattr(_checksum, "_crc32c", None)
    monkeypatch.setattr(_checksum, "_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _checksum.checksum_function("crc32c")(b"123456789", 0) == 0xE3069283  # CRC32C's check value
        ck.save_model(TinyTransformer(seed=0), tmp_path / "sw", size_per_shard=0.05)
        ck.load_model(TinyTransformer(seed=1), tmp_path / "hw")  # CRC32C verified in pure Python
    assert len([w for w in caught if "crc32c package is not installed" in str(w.message)]) == 1
    entries = json.loads((tmp_path / "sw" / "manifest.json").read_text())["files"]
    assert {e["checksums"]["algorithm"] for e in entries.values() if "checksums" in e} == {"crc32"}
    for d in ("hw", "sw"):
        shard = _biggest(tmp_path / d, "model")
        _flip_middle(shard)
        with pytest.raises(ck.CheckpointError, match=f"{shard} fails checksum verification"):
            ck.load_model(TinyTransformer(seed=1), tmp_path / d)


# ---- 2 ranks ---------------------------------------------------------------------------------------------------
class _FlatShards:
    """ZeRO-style state: each rank holds the rank-th flat piece of every tensor (model and optimizer protocol)."""

    def __init__(self, full: dict[str, torch.Tensor]):
        rank, world = dist.get_rank(), dist.get_world_size()
        self.specs = {n: ShardSpec.flat_shard(t.shape, rank=rank, world_size=world) for n, t in full.items()}
        self.local = {n: self.specs[n].cut(t).clone() for n, t in full.items()}
        self.groups = [{"lr": 0.1, "params": sorted({n.rsplit(".", 1)[0] for n in full})}]

    def sharded_state_dict(self) -> dict[str, LocalShard]:
        return {n: LocalShard(t, self.specs[n]) for n, t in self.local.items()}

    def load_sharded_state_dict(self, read) -> None:
        for n, spec in self.specs.items():
            self.local[n].copy_(read(n, spec, self.local[n].dtype))

    def param_groups_state(self) -> list[dict]:
        return self.groups

    def load_param_groups_state(self, groups: list[dict]) -> None:
        self.groups = groups


def _full_state(suffix: str = "") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"embed.weight": (64, 32), "w": (800, 500), "norm.weight": (32,)}
    return {f"{n}{suffix}": torch.randn(s, generator=g) for n, s in shapes.items()}


def _shared_dir(path: str) -> Path:
    dist.barrier()
    return Path(path)


def _flipped_loads(path: str) -> dict[str, str]:
    root = _shared_dir(path)
    out = {}
    for kind, suffix in (("model", ""), ("optimizer", ".exp_avg")):
        src = _FlatShards(_full_state(suffix))
        if kind == "model":
            ck.save_model(src, root / kind, size_per_shard=1)
        else:
            ck.save_optimizer(src, root / kind, size_per_shard=1)
        dist.barrier()
        if dist.get_rank() == 0:
            _flip_middle(_biggest(root / kind, kind))
        dist.barrier()
        dst = _FlatShards({n: torch.zeros_like(t) for n, t in _full_state(suffix).items()})
        load = ck.load_model if kind == "model" else ck.load_optimizer
        try:
            load(dst, root / kind)
            out[kind] = "loaded"
        except ck.CheckpointError as e:
            out[kind] = str(e)
        load(dst, root / kind, verify=False)
        wrong = [n for n, t in dst.local.items() if not torch.equal(t, src.local[n])]
        out[kind + " verify=False"] = ",".join(wrong)
    return out


def test_two_ranks_flipped_bytes_fail_the_sharded_load_on_every_rank(tmp_path):
    results = run_distributed(_flipped_loads, 2, str(tmp_path), timeout=240)
    for kind, tensor in (("model", "w"), ("optimizer", "w.exp_avg")):
        shard = _biggest(tmp_path / kind, kind)
        for r in results:
            assert (
                f"checkpoint {tmp_path / kind}: {shard} fails checksum verification (tensor '{tensor}'"
                in r[kind]
            )
        # The middle of the file lies in rank 1's half of the tensor: its read finds it (rank 0's too, as its
        # last block overlaps), and every rank raises.
        assert re.search(r"found by ranks \[(0, )?1\]", results[0][kind]), results[0][kind]
        assert results[1][kind + " verify=False"] == tensor  # the opt-out loads the damaged piece


def _refused(path: str) -> list[str]:
    root = _shared_dir(path)
    src = _FlatShards(_full_state())
    messages = []
    for save in (
        lambda: ck.save_model(src, root / "user", size_per_shard=1),
        lambda: ck.save_model(src, root / "user", size_per_shard=1, use_async=True),
        lambda: ck.save_optimizer(src, root / "user", size_per_shard=1),
        lambda: ck.save_model(src, root / "file", size_per_shard=1),
    ):
        try:
            save()
            messages.append("saved")
        except FileExistsError as e:
            messages.append(str(e))
    ck.wait()
    return messages


def test_two_ranks_refuse_a_directory_of_user_files_before_writing(tmp_path):
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "notes.txt").write_text("x\n")
    (tmp_path / "file").write_bytes(b"data")
    before = _snapshot(tmp_path)
    results = run_distributed(_refused, 2, str(tmp_path), timeout=240)
    assert results[0] == results[1]  # every rank raises the same error
    assert all(
        "user: it is a directory of files cai-ckpt did not write (notes.txt" in m for m in results[0][:3]
    )
    assert "file: it is a file of 4 bytes" in results[0][3]
    assert _snapshot(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["file", "user"]


def _relayed_failure(path: str) -> list[str]:
    import cai.ckpt._save as save_module

    root = _shared_dir(path)
    src = _FlatShards(_full_state())
    ck.save_model(src, root / "m", size_per_shard=1)
    original = save_module._write_file

    def broken(*args, **kwargs) -> None:
        raise OSError("No space left on device (injected)")

    if dist.get_rank() == 1:
        save_module._write_file = broken
    out = []
    try:
        for use_async in (False, True):
            try:
                ck.save_model(src, root / "m", size_per_shard=1, use_async=use_async)
                ck.wait()
                out.append("saved")
            except Exception as e:
                out.append(f"{type(e).__name__}: {e}")
    finally:
        save_module._write_file = original
    return out


def test_two_ranks_a_failure_relayed_through_rank_0_names_the_rank_it_started_on(tmp_path):
    """One file set per save: rank 1's write error reaches rank 0 only through the commit's reports (sync), or
    from the background thread (async)."""
    results = run_distributed(_relayed_failure, 2, str(tmp_path), timeout=240)
    for message in results[0]:
        assert "was not saved: rank-00001 failed: OSError('No space left on device (injected)')" in message
    assert all("No space left on device (injected)" in m for m in results[1])
    # The earlier checkpoint is intact (the failed saves' partial files stay in .tmp-m-* until the next save).
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".tmp-m-")) == ["m"]
    with ck.CheckpointReader(tmp_path / "m") as reader:
        for n, t in _full_state().items():
            assert torch.equal(reader.read(n, ShardSpec.full(t.shape)), t)


def _async_commit(path: str) -> list[str]:
    root = _shared_dir(path)
    src = _FlatShards(_full_state())
    ck.save_model(src, root / "m", size_per_shard=1)
    for t in src.local.values():
        t.add_(1.0)
    expected = {n: t.clone() for n, t in src.local.items()}
    ck.save_model(src, root / "m", size_per_shard=1, use_async=True)  # replaces the first, in the background
    for t in src.local.values():
        t.add_(1.0)  # training goes on; the save holds its own copy
    ck.wait()
    dst = _FlatShards({n: torch.zeros_like(t) for n, t in _full_state().items()})
    ck.load_model(dst, root / "m")
    return [n for n in dst.local if not torch.equal(dst.local[n], expected[n])]


def test_two_ranks_async_save_commits(tmp_path):
    results = run_distributed(_async_commit, 2, str(tmp_path), timeout=240)
    assert results == [[], []]  # every rank loads the state as it was when the save was called
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def _never_reports(path: str) -> str:
    from cai.ckpt._txn import Transaction

    root = _shared_dir(path)
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=3))
    src = _FlatShards(_full_state())
    original = Transaction._report
    if dist.get_rank() == 1:
        Transaction._report = lambda self, payload: None  # a rank that wrote but never reports (a hang)
    try:
        ck.save_model(src, root / "m", size_per_shard=1, group=group)
        return "saved"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        Transaction._report = original


def test_two_ranks_commit_waits_are_bounded_by_the_group_timeout_and_name_the_missing_rank(tmp_path):
    results = run_distributed(_never_reports, 2, str(tmp_path), timeout=240)
    assert results[0].startswith("TimeoutError:") and "the process group's timeout (3 s)" in results[0]
    for r in results:
        assert "ranks [1] never finished writing" in r
    assert not (tmp_path / "m").exists()
