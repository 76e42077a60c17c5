"""The package table's import rules (.ci/check_imports.py, run by ``nox -s lint``): the real tree passes, and a
copy with a forbidden import, even a lazy one inside a function, fails with the file, the line and the import."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKER = ROOT / ".ci" / "check_imports.py"


def _run(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(CHECKER), str(root)], capture_output=True, text=True, timeout=120, check=False
    )


def _copy_sources(dst: Path) -> None:
    for src in (ROOT / "packages").glob("cai-*/src"):
        shutil.copytree(
            src,
            dst / "packages" / src.parent.name / "src",
            ignore=lambda d, names: [
                n for n in names if not n.endswith(".py") and not (Path(d) / n).is_dir()
            ],
            symlinks=True,
        )


def test_the_repository_follows_the_table() -> None:
    proc = _run(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "every package within its row" in proc.stdout


def test_a_forbidden_import_fails(tmp_path: Path) -> None:
    _copy_sources(tmp_path)
    assert _run(tmp_path).returncode == 0  # the copy alone is clean
    # cai-zero may import cai-mesh and cai-kernels, not its sibling cai-gemini; lazy imports count too
    bad = tmp_path / "packages" / "cai-zero" / "src" / "cai" / "zero" / "_forbidden.py"
    bad.write_text("def f():\n    from cai.gemini import shard\n    return shard\n")
    proc = _run(tmp_path)
    assert proc.returncode == 1
    assert (
        "packages/cai-zero/src/cai/zero/_forbidden.py:2: cai-zero imports cai.gemini, outside its row"
        in proc.stdout
    )
    # a third-party module outside the row fails as well, and so does an importlib call with a literal name
    bad.write_text("import importlib\nimport safetensors\nm = importlib.import_module('cai.booster')\n")
    out = _run(tmp_path).stdout
    assert (
        "_forbidden.py:2: cai-zero imports safetensors" in out
        and "_forbidden.py:3: cai-zero imports cai.booster" in out
    )


def test_a_stale_exception_fails(tmp_path: Path) -> None:
    _copy_sources(tmp_path)
    # drop cai-mesh's lazy cai.kernels import: the listed exception no longer matches anything
    for path in (tmp_path / "packages" / "cai-mesh" / "src").rglob("*.py"):
        text = path.read_text()
        if "cai.kernels" in text:
            path.write_text(text.replace("import cai.kernels", "import json"))
    proc = _run(tmp_path)
    assert proc.returncode == 1
    assert "EXCEPTIONS: cai-mesh no longer imports cai.kernels; remove the exception" in proc.stdout
