"""Param groups of optimizers whose ranks hold different parameters: merged for a save, cut to each rank on load.

[Note: param groups over ranks]
Pipeline stages hold disjoint parameters, data-parallel replicas the same ones, and every rank's optimizer
reports its own ``param_groups_state()``. ``param_groups.json`` describes the optimizer of the whole model:
group i lists every rank's parameters of its group i, each name once (rank by rank, in each rank's order), with
the hyperparameters of the ranks that have parameters in it, which must agree; a rank with fewer groups, or an
empty group, adds nothing and its hyperparameters do not count (they are used only when no rank has parameters
in the group). Scalar state is merged the same way. On load the name checks compare the union over the ranks
with the checkpoint, and each rank restores the checkpoint's group i cut to its own parameters, so an
optimizer's ``load_param_groups_state`` (and the plain-optimizer adapter) sees exactly its own names. Every rank
decides from the same gathered lists (one ``all_gather_object``: on save it travels with the tensor metadata),
so an error is raised on every rank at once, before anything is committed or loaded.
"""

from __future__ import annotations

from typing import Any

__all__ = ["group_mismatches", "merge_optimizer_groups", "own_groups"]


class _Absent:
    def __repr__(self) -> str:
        return "(absent)"


_ABSENT = _Absent()  # a key one rank's group has and another's lacks


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _disagreement(i: int, a: dict, rank_a: int, b: dict, rank_b: int) -> str:
    key = next(k for k in sorted(a.keys() | b.keys()) if a.get(k, _ABSENT) != b.get(k, _ABSENT))
    return (
        f"cannot save the optimizer: param group {i} has {key}={a.get(key, _ABSENT)!r} on rank {rank_a} and "
        f"{key}={b.get(key, _ABSENT)!r} on rank {rank_b}; a param group's hyperparameters must agree on every rank "
        "that has parameters in it"
    )


def merge_optimizer_groups(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """``{"param_groups", "scalar_state"}`` of the whole model from every rank's own, by rank (see
    [Note: param groups over ranks]); raises ``ValueError`` naming the group, the key and the values."""
    groups: list[dict[str, Any]] = []
    where: dict[str, int] = {}  # parameter name -> its group
    for i in range(max(len(d["param_groups"]) for d in docs)):
        names: list[str] = []
        hyper, source, fallback = None, -1, None
        for rank, d in enumerate(docs):
            if i >= len(d["param_groups"]):
                continue
            g = d["param_groups"][i]
            if not g["params"]:
                fallback = _hyper(g) if fallback is None else fallback
                continue
            if hyper is None:
                hyper, source = _hyper(g), rank
            elif _hyper(g) != hyper:
                raise ValueError(_disagreement(i, hyper, source, _hyper(g), rank))
            for n in g["params"]:
                if where.setdefault(n, i) != i:
                    raise ValueError(
                        f"cannot save the optimizer: parameter {n!r} is in param group {where[n]} on one rank and "
                        f"in param group {i} on rank {rank}"
                    )
                if n not in names:
                    names.append(n)
        groups.append({**(hyper if hyper is not None else fallback), "params": names})
    scalars: dict[str, dict[str, Any]] = {}
    source_of: dict[str, int] = {}
    for rank, d in enumerate(docs):
        for name, values in d["scalar_state"].items():
            if name in scalars and scalars[name] != values:
                raise ValueError(
                    f"cannot save the optimizer: the scalar state of {name!r} is {scalars[name]!r} on rank "
                    f"{source_of[name]} and {values!r} on rank {rank}"
                )
            scalars.setdefault(name, values)
            source_of.setdefault(name, rank)
    return {"param_groups": groups, "scalar_state": scalars}


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def group_mismatches(names: list[list[list[str]]], saved: list[dict[str, Any]], *, strict: bool) -> list[str]:
    """What keeps each rank's groups (``names[rank][i]``: the names of its group i) from being the checkpoint's
    groups cut to that rank's parameters; the same list on every rank."""
    found: dict[str, list[int]] = {}  # problem -> the ranks that have it (replicas report it once)
    most = max(len(groups) for groups in names)
    if strict and most != len(saved):
        found[f"the checkpoint has {len(saved)} param groups, the optimizer {most}"] = []
    for rank, groups in enumerate(names):
        if len(groups) > len(saved):
            found.setdefault(f"{len(groups)} param groups, the checkpoint {len(saved)}", []).append(rank)
            continue
        own = {n for g in groups for n in g}
        for i, g in enumerate(groups):
            want = {n for n in saved[i]["params"] if n in own}
            here, there = sorted(set(g) - want), sorted(want - set(g))
            parts = [f"holds {here[:5]}, which the checkpoint's group {i} does not"] if here else []
            parts += [f"lacks {there[:5]}, which the checkpoint's group {i} holds"] if there else []
            if parts:
                found.setdefault(f"param group {i} {' and '.join(parts)}", []).append(rank)
    return [f"{_ranks(ranks)}: {p}" if ranks else p for p, ranks in found.items()]


def own_groups(saved: list[dict[str, Any]], own: set[str], count: int) -> list[dict[str, Any]]:
    """The checkpoint's first ``count`` param groups, each holding only the parameters in ``own``."""
    return [{**g, "params": [n for n in g["params"] if n in own]} for g in saved[:count]]
