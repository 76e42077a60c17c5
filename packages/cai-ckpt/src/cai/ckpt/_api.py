"""Model and optimizer checkpoints: the free functions and the pieces ``save_state``/``load_state`` reuse."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cai.ckpt._codec import decode, encode
from cai.ckpt._format import (
    CONFIG_NAME,
    MODEL_INDEX_NAME,
    MODEL_SINGLE_NAME,
    OPTIM_INDEX_NAME,
    PARAM_GROUPS_NAME,
    CheckpointError,
    SafetensorsWriter,
    read_json,
    write_json,
)
from cai.ckpt._groups import group_mismatches, merge_optimizer_groups, own_groups
from cai.ckpt._load import CheckpointReader
from cai.ckpt._optim import TorchOptimizerAdapter
from cai.ckpt._plan import State, global_shapes, tied_names
from cai.ckpt._save import full_state, join, write_sharded
from cai.ckpt._txn import IO_THREADS, Transaction, everyone, finish, run_parallel, wait
from cai.mesh import ShardSpec


def unwrap(model: Any) -> Any:
    """The user's module under DDP (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif isinstance(model, nn.Module) and hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def model_state(source: Any) -> State:
    source = unwrap(source)
    if hasattr(source, "sharded_state_dict"):
        return dict(source.sharded_state_dict())
    if isinstance(source, nn.Module):
        return full_state(source.state_dict())
    if isinstance(source, dict):
        return full_state(source)
    raise TypeError(
        f"cannot checkpoint a {type(source).__name__}: pass an nn.Module, a dict of tensors or an object with sharded_state_dict()"
    )


def _config_json(source: Any, config: Any) -> dict | None:
    model = unwrap(source)
    if config is None:
        config = getattr(model, "config", None)
        if config is None or not (hasattr(config, "to_dict") or isinstance(config, dict)):
            return None
    if isinstance(config, dict):
        return dict(config)
    data = (
        json.loads(config.to_json_string(use_diff=False))
        if hasattr(config, "to_json_string")
        else config.to_dict()
    )
    if not data.get("architectures") and isinstance(model, nn.Module) and hasattr(model, "config"):
        data["architectures"] = [type(model).__name__]
    return data


def write_json_tensors(txn: Transaction, rel: str, obj: Any) -> None:
    """``rel.json``, and ``rel.safetensors`` for any tensors inside ``obj``."""
    tensors: dict[str, torch.Tensor] = {}
    data = encode(obj, tensors)
    txn.record(rel + ".json", write_json(txn.path(rel + ".json"), data))
    if tensors:
        writer = SafetensorsWriter(
            txn.path(rel + ".safetensors"),
            [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()],
            {"format": "pt"},
        )
        for k, v in tensors.items():
            writer.write(k, v)
        txn.record(rel + ".safetensors", writer.close())


def read_json_tensors(path: Path, check: Callable[[Path], None] | None = None) -> Any:
    """Inverse of ``write_json_tensors`` (``path`` without the suffix)."""
    from safetensors.torch import load_file

    from cai.ckpt._format import read_header

    js, st = path.with_name(path.name + ".json"), path.with_name(path.name + ".safetensors")
    if check:
        check(js)
    tensors = {}
    if st.exists():
        if check:
            check(st)
        read_header(st)
        tensors = load_file(str(st))
    return decode(read_json(js), tensors)


def write_model(
    txn: Transaction,
    subdir: str,
    source: Any,
    *,
    size_per_shard: float,
    dtype: torch.dtype | None,
    config: Any,
    use_async: bool,
) -> None:
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(
            f"save_model: dtype must be a floating torch.dtype (torch.bfloat16, ...), got {dtype!r}"
        )

    def out_dtype(name: str, d: torch.dtype) -> torch.dtype:
        return dtype if dtype is not None and d.is_floating_point else d

    state = model_state(source)
    write_sharded(
        txn,
        state,
        subdir=subdir,
        prefix="model",
        index_name=MODEL_INDEX_NAME,
        size_per_shard=size_per_shard,
        out_dtype=out_dtype,
        use_async=use_async,
    )
    cfg = _config_json(source, config)
    if cfg is not None and dtype is not None:  # from_pretrained's dtype="auto" reads it back
        name = str(dtype).removeprefix("torch.")
        cfg["dtype"] = name  # transformers 5's key
        if "torch_dtype" in cfg:  # the older key, where a config still has it
            cfg["torch_dtype"] = name
    if cfg is not None and txn.rank == 0:
        txn.record(join(subdir, CONFIG_NAME), write_json(txn.path(join(subdir, CONFIG_NAME)), cfg))


def optimizer_view(optimizer: Any, param_names: Any) -> Any:
    if hasattr(optimizer, "sharded_state_dict") and hasattr(optimizer, "param_groups_state"):
        return optimizer
    if isinstance(optimizer, torch.optim.Optimizer):
        return TorchOptimizerAdapter(optimizer, unwrap(param_names))
    raise TypeError(
        f"cannot checkpoint optimizer {type(optimizer).__name__}: pass a torch Optimizer or an object with sharded_state_dict()/param_groups_state()"
    )


def write_optimizer(
    txn: Transaction, subdir: str, optimizer: Any, param_names: Any, *, size_per_shard: float, use_async: bool
) -> None:
    view = optimizer_view(optimizer, param_names)
    state = dict(view.sharded_state_dict())
    # Each rank's groups travel with its tensor metadata; merged over the ranks (see [Note: param groups over ranks]).
    own = {
        "param_groups": view.param_groups_state(),
        "scalar_state": view.scalar_state() if hasattr(view, "scalar_state") else {},
    }
    doc = write_sharded(
        txn,
        state,
        subdir=subdir,
        prefix="optimizer",
        index_name=OPTIM_INDEX_NAME,
        size_per_shard=size_per_shard,
        out_dtype=lambda n, d: torch.float32 if d.is_floating_point else d,
        use_async=use_async,
        extra=own,
        merge=merge_optimizer_groups,
    )
    if txn.rank == 0:
        write_json_tensors(txn, join(subdir, PARAM_GROUPS_NAME.removesuffix(".json")), doc)


def save_model(
    source: Any,
    path: str | Path,
    *,
    size_per_shard: float = 1024,
    use_async: bool = False,
    config: Any = None,
    dtype: torch.dtype | None = None,
    group: Any = None,
) -> None:
    """Save a model as a Hugging Face-loadable directory of safetensors shards, from any layout.

    Args:
        source: an ``nn.Module`` (its state dict; DDP/compile wrappers are unwrapped), a dict of full tensors,
            or an object with ``sharded_state_dict()`` (the state protocol; fp32 masters when it has them).
        path: the directory to create. An existing checkpoint written by cai-ckpt is replaced atomically; an
            empty directory is filled; anything else there (a file, a directory with other files) makes every
            rank raise ``FileExistsError`` before any rank writes.
        size_per_shard: the largest shard file, in MB (a bigger tensor gets a file of its own).
        use_async: copy to host buffers, then write in a background thread; ``wait()`` (or the next save, or
            exit) blocks until it is committed.
        config: written as ``config.json``: a dict or an object with ``to_dict()`` (default: ``source.config``).
        dtype: store floating tensors in this dtype (e.g. ``torch.bfloat16``), and name it as the config's
            ``dtype``; default: as they are.
        group: the process group whose ranks share the work (default: the world; no group is fine).

    Every rank of ``group`` must call it. Files are ``model-0000i-of-0000N.safetensors`` with
    ``model.safetensors.index.json`` and a ``manifest.json`` of checksums; tied weights are stored once.

    Example::

        cai.ckpt.save_model(model, "out/model", config=model.config, dtype=torch.bfloat16)
        AutoModelForCausalLM.from_pretrained("out/model")
    """
    wait()
    txn = Transaction(Path(path), group=group, info={"kind": "model"})
    with txn.guard():
        write_model(
            txn, "", source, size_per_shard=size_per_shard, dtype=dtype, config=config, use_async=use_async
        )
    finish(txn, use_async=use_async)


def save_optimizer(
    optimizer: Any,
    path: str | Path,
    *,
    model: Any = None,
    param_names: Any = None,
    size_per_shard: float = 1024,
    use_async: bool = False,
    group: Any = None,
) -> None:
    """Save optimizer state by parameter name (``<name>.exp_avg`` ... in fp32) plus ``param_groups.json``.

    ``optimizer`` is a sharded optimizer (state protocol) or a plain torch optimizer, whose parameters are named
    by ``model`` (``named_parameters``) or ``param_names`` (a list in optimizer order, or a dict param -> name).
    ``path`` follows ``save_model``'s rule: only nothing, an empty directory or an earlier cai-ckpt checkpoint may
    be there.

    The ranks of ``group`` may hold different parameters (pipeline stages, each naming its parameters with the
    full model's names): ``param_groups.json`` then lists, in group i, every rank's parameters of its group i.
    The hyperparameters of a group must agree on the ranks that have parameters in it; otherwise every rank
    raises ``ValueError`` naming the group, the key and the values, and nothing is saved.
    """
    wait()
    txn = Transaction(Path(path), group=group, info={"kind": "optimizer"})
    with txn.guard():
        write_optimizer(
            txn,
            "",
            optimizer,
            model if model is not None else param_names,
            size_per_shard=size_per_shard,
            use_async=use_async,
        )
    finish(txn, use_async=use_async)


def _union_over_ranks(state: State, group: Any) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """Names and global shapes reported by any rank, and the tied names found by any rank: a sharded object lists
    only the pieces it holds (a small ZeRO tensor can lie wholly on another rank), while a checkpoint holds them
    all."""
    shapes: dict[str, tuple[int, ...]] = {}
    ties: dict[str, str] = {}
    for other_shapes, other_ties in everyone((global_shapes(state), tied_names(state)), group):
        shapes.update(other_shapes)
        ties.update(other_ties)
    return shapes, ties


def prepare_model_load(
    target: Any, path: Path, *, strict: bool, verify: bool, group: Any = None
) -> Callable[[], None]:
    """Check everything about loading ``path`` into ``target``; returns the function that loads it."""
    target = unwrap(target)
    reader = CheckpointReader(path, index_name=MODEL_INDEX_NAME, single_name=MODEL_SINGLE_NAME, verify=verify)
    if hasattr(target, "load_sharded_state_dict"):
        shapes, ties = _union_over_ranks(target.sharded_state_dict(), group)
        reader.add_ties(ties)
        reader.check(shapes, strict=strict)
        # Each rank reads (and verifies) different bytes: the load runs to its end on every rank, then all raise.
        reader.defer_failures = True

        def apply() -> None:
            with reader:
                target.load_sharded_state_dict(reader.read)
            reader.raise_if_corrupt(group)

        return apply
    if isinstance(target, nn.Module):
        sd = target.state_dict()
    elif isinstance(target, dict) and all(isinstance(v, torch.Tensor) for v in target.values()):
        sd = target  # loaded in place
    else:
        raise TypeError(
            f"cannot load a model checkpoint into {type(target).__name__}: pass an nn.Module, a dict of tensors or a state-protocol object"
        )
    tied = set(tied_names(full_state(sd)))  # stored once; loading the other name fills it
    reader.check({k: tuple(v.shape) for k, v in sd.items()}, strict=strict, optional=tied)
    stored = reader.names()
    for k in sd:
        if k in stored:
            reader.header(k)  # every file's header is validated before anything is copied

    by_file: dict[str, list[str]] = {}
    for k in sd:
        if k in stored:
            by_file.setdefault(reader.file_of(k), []).append(k)

    def load_file(keys: list[str]) -> None:
        with torch.no_grad():
            for k in keys:
                v = sd[k]
                if not reader.read_whole_into(k, v):
                    v.copy_(
                        reader.read(
                            k, ShardSpec.full(v.shape), v.dtype if v.dtype.is_floating_point else None
                        )
                    )

    def apply() -> None:
        with reader:
            run_parallel([lambda keys=keys: load_file(keys) for keys in by_file.values()], IO_THREADS)

    return apply


def load_model(
    target: Any, path: str | Path, *, strict: bool = True, verify: bool = True, group: Any = None
) -> None:
    """Load a model checkpoint (cai's or a Hugging Face safetensors directory) into ``target``, any layout.

    Args:
        target: an ``nn.Module`` or an object with ``sharded_state_dict()``/``load_sharded_state_dict(read)``;
            each rank reads only the slices its layout needs.
        strict: missing or unexpected keys raise ``CheckpointError`` listing them (tied weights stored once are fine).
        verify: check the bytes read against the manifest's checksums (each rank the blocks it reads); a
            mismatch raises ``CheckpointError`` naming the file and the tensor. ``False`` skips it.
        group: the ranks that load together (a sharded target's keys are checked as their union).

    Keys, shapes, file sizes and headers are checked, each damaged file is named, and tensors are converted to
    the target's dtype; nothing is copied until those checks have passed. Checksums are verified as the bytes are
    read, so a corrupted file raises with part of the target loaded (every rank raises, for a sharded target).
    """
    wait()
    prepare_model_load(target, Path(path), strict=strict, verify=verify, group=group)()


def prepare_optimizer_load(
    optimizer: Any, path: Path, param_names: Any, *, strict: bool, verify: bool, group: Any = None
) -> Callable[[], None]:
    reader = CheckpointReader(path, index_name=OPTIM_INDEX_NAME, single_name=None, verify=verify)
    groups_doc = read_json_tensors(path / PARAM_GROUPS_NAME.removesuffix(".json"), reader._check_file)
    saved_groups = groups_doc["param_groups"]
    view = optimizer_view(optimizer, param_names)
    # Parameter names, not state keys, decide what matches: a sharded optimizer may hold no state before its
    # first step, and a parameter that never had a gradient has none in the checkpoint either. The checks see
    # every rank's names (pipeline stages hold different parameters; see [Note: param groups over ranks]).
    mine = view.param_groups_state()
    group_names = everyone([g["params"] for g in mine], group)
    own = {n for g in mine for n in g["params"]}
    names = {n for groups in group_names for g in groups for n in g}
    saved = {n for g in saved_groups for n in g["params"]}
    missing, unexpected = names - saved, (saved - names) if strict else set()
    foreign = sorted(k for k in reader.names() if k.rsplit(".", 1)[0] not in names) if strict else []
    if missing or unexpected or foreign:
        raise CheckpointError(
            f"optimizer checkpoint {path} does not match the optimizer: parameters missing from the checkpoint "
            f"{sorted(missing)[:20]}, unexpected parameters {sorted(unexpected)[:20]}, state of unknown parameters {foreign[:20]}"
        )
    problems = group_mismatches(group_names, saved_groups, strict=strict)
    if problems:
        raise CheckpointError(
            f"optimizer checkpoint {path} has other param groups than the optimizer: {'; '.join(problems[:10])}; "
            "build the optimizer's param groups from the same parameters as the one that was saved"
        )
    groups = own_groups(saved_groups, own, len(mine))
    for k in reader.weight_map:
        reader.header(k)  # every file's header is validated before anything is copied
    if not isinstance(view, TorchOptimizerAdapter):
        current = global_shapes(view.sharded_state_dict())
        reader.check(current, strict=False)
        reader.defer_failures = True  # as for a sharded model: every rank raises together

        def apply_sharded() -> None:
            with reader:
                view.load_sharded_state_dict(reader.read)
            reader.raise_if_corrupt(group)
            view.load_param_groups_state(groups)

        return apply_sharded

    scalars = {n: kv for n, kv in (groups_doc.get("scalar_state") or {}).items() if n in own}

    def apply() -> None:
        with reader:
            tensors = {
                k: reader.read(k, ShardSpec.full(reader.header(k)["shape"]))
                for k in reader.names()
                if k.rsplit(".", 1)[0] in own
            }
        view.load(groups, tensors, scalars)

    return apply


def load_optimizer(
    optimizer: Any,
    path: str | Path,
    *,
    model: Any = None,
    param_names: Any = None,
    strict: bool = True,
    verify: bool = True,
    group: Any = None,
) -> None:
    """Load optimizer state saved by ``save_optimizer`` under any layout (see ``load_model`` for the checks).

    ``verify`` (default) checks the bytes read against the manifest's checksums; a plain torch optimizer is left
    untouched when they do not match (it is loaded after every tensor was read), a sharded one may be partly
    loaded. ``group``: the ranks that load together (default: the world).

    The names are checked as the union over the ranks of ``group``, so ranks that hold different parameters
    (pipeline stages) load a checkpoint of the whole model, and one process loads theirs; each rank restores the
    state and hyperparameters of its own parameters only (a plain optimizer reads only their tensors), its group
    i from the checkpoint's group i. A parameter of any rank that the checkpoint lacks raises on every rank.
    """
    wait()
    prepare_optimizer_load(
        optimizer,
        Path(path),
        model if model is not None else param_names,
        strict=strict,
        verify=verify,
        group=group,
    )()
