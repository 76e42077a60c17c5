"""Check that every package imports only what its row of the design's package table allows.

    python .ci/check_imports.py [ROOT]      # ROOT defaults to the repository; exit 1 and one line per violation

The table ("Packages and who may import whom" in the shared DESIGN.md) is ``ROWS`` below. Every import in
``packages/cai-<name>/src`` counts, including lazy ones inside functions and ``importlib.import_module("...")``
with a literal name: a lazy import of a package outside the row is still a dependency the row does not list.
The few that exist on purpose are in ``EXCEPTIONS``, each with its reason; an exception that no longer matches
any import fails as well, so the list stays true. The standard library is always allowed. Only ``src`` is
checked: tests may use any installed package.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

_OPTIONAL = ("triton", "ninja")  # cai-kernels' optional build and kernel backends


@dataclass(frozen=True)
class Row:
    cai: tuple[str, ...]  # sibling packages it may import (its own name is always allowed)
    third_party: tuple[str, ...]  # top-level module names of other distributions


_BASE = {
    "mesh": Row((), ("torch",)),
    "kernels": Row((), ("torch", *_OPTIONAL)),
    "zero": Row(("mesh", "kernels"), ("torch",)),
    "gemini": Row(("mesh", "kernels"), ("torch",)),
    "shardformer": Row(("mesh", "kernels"), ("torch", "transformers")),
    "pipeline": Row(("mesh",), ("torch",)),
    "ckpt": Row(("mesh",), ("torch", "safetensors")),
    "infer": Row(("mesh", "kernels", "shardformer", "ckpt"), ("torch", "transformers")),
}
# cai-booster's row is "all of the above": every package and everything they may import.
ROWS: dict[str, Row] = {
    **_BASE,
    "booster": Row(tuple(_BASE), tuple(sorted({m for r in _BASE.values() for m in r.third_party}))),
}


@dataclass(frozen=True)
class Allowed:
    """A package's import outside its row that exists on purpose (keyed by package, not file, so that moving code
    inside a package does not break the rule)."""

    package: str  # "mesh"
    imports: str  # as checked: "cai.kernels" for cai packages, the top-level name ("numpy") otherwise
    reason: str


EXCEPTIONS: tuple[Allowed, ...] = (
    Allowed(
        "mesh",
        "cai.kernels",
        "`cai check` reports kernels through cai.kernels.kernel_report() when cai-kernels is installed, imported "
        "lazily and never a dependency (repo DESIGN.md, cai-mesh)",
    ),
    Allowed("mesh", "numpy", "set_seed also seeds NumPy when it is installed; optional, imported lazily"),
    Allowed(
        "ckpt",
        "numpy",
        "a declared dependency of cai-ckpt: its state exchange goes through torch's object collectives and numpy "
        "arrays (repo DESIGN.md, cai-ckpt)",
    ),
    Allowed(
        "ckpt",
        "crc32c",
        "a declared dependency of cai-ckpt: hardware CRC32C for the checksums verified on every load, with a zlib "
        "fallback when it is missing (repo DESIGN.md, cai-ckpt)",
    ),
    Allowed("booster", "numpy", "dataloader workers seed NumPy (installed through cai-ckpt)"),
    Allowed("booster", "peft", "the optional extra cai-booster[lora]; imported lazily"),
    Allowed(
        "booster", "matplotlib", "the optional extra cai-booster[plot] (`cai plan --plot`); imported lazily"
    ),
    Allowed("infer", "fastapi", "the optional extra cai-infer[serve] (the HTTP server); imported lazily"),
    Allowed("infer", "uvicorn", "the optional extra cai-infer[serve] (the HTTP server); imported lazily"),
)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every absolute import in ``path``, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            out.append((node.lineno, node.args[0].value))
    return out


def _key(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "cai" else parts[0]


def check(root: Path) -> list[str]:
    """Every violation under ``root``, one line each (empty when the tree follows the table)."""
    problems = []
    used: set[Allowed] = set()
    exceptions = {(e.package, e.imports): e for e in EXCEPTIONS}
    packages = sorted(p for p in (root / "packages").glob("cai-*") if (p / "src").is_dir())
    if not packages:
        return [f"{root}: no packages/cai-*/src found"]
    for pkg in packages:
        name = pkg.name.removeprefix("cai-")
        row = ROWS.get(name)
        if row is None:
            problems.append(
                f"{pkg}: no row for cai-{name} in ROWS; add it as the design's package table says"
            )
            continue
        allowed = {f"cai.{name}", *(f"cai.{c}" for c in row.cai), *row.third_party}
        for path in sorted((pkg / "src").rglob("*.py")):
            for line, module in _imports(path):
                key = _key(module)
                if key in allowed or (key != "cai" and key in sys.stdlib_module_names):
                    continue
                exc = exceptions.get((name, key))
                if exc is not None:
                    used.add(exc)
                    continue
                may = ", ".join(sorted(allowed))
                problems.append(
                    f"{path.relative_to(root)}:{line}: cai-{name} imports {module}, outside its row (it may import "
                    f"{may} and the standard library); depend on it through a lower package, or if it is optional "
                    "and imported lazily on purpose, add it to EXCEPTIONS in .ci/check_imports.py with the reason"
                )
    names = {p.name.removeprefix("cai-") for p in packages}
    for exc in EXCEPTIONS:
        if exc not in used and exc.package in names:
            problems.append(
                f"EXCEPTIONS: cai-{exc.package} no longer imports {exc.imports}; remove the exception"
            )
    return problems


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1]
    problems = check(root)
    for p in problems:
        print(p)
    print(
        f"import rules: {len(problems)} problem(s)"
        if problems
        else "import rules: every package within its row"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
