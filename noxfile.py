"""Every entry point of the repository: tests, isolated installs, wheels, lint, the main job, GPU runs.

nox -s tests       every package's tests and integration-tests, one environment, pytest-xdist
nox -s isolated    each package alone: its wheel plus declared dependencies, then its own tests
nox -s build       wheels and sdists for all packages, with a metadata check
nox -s lint        ruff format --check, ruff check, and who may import whom (.ci/check_imports.py)
nox -s demo        the main job (examples/train_llama.py, 2 gloo processes on CPU)
nox -s gpu         GPU tests and benchmarks on a machine that already has torch (no installs)
"""

from __future__ import annotations

import email
import os
import shutil
import tarfile
import zipfile
from pathlib import Path

import nox
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).parent
CONSTRAINTS = str(ROOT / "constraints" / "ci.txt")
PACKAGES = ["mesh", "kernels", "zero", "gemini", "shardformer", "pipeline", "ckpt", "infer", "booster"]
VERSION = "0.1.0"
SIBLING_RANGE = ">=0.1,<0.2"
DIST = ROOT / "dist"

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True


def _cpu_env() -> dict[str, str]:
    # Triton kernels run in the interpreter on CPU; one BLAS thread per process keeps many ranks on 2 cores sane.
    return {"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}


def _install_workspace(session: nox.Session) -> None:
    session.install(
        "-c", CONSTRAINTS, "torch", "transformers", "triton", "safetensors", "numpy", "ninja", "peft"
    )
    session.install("-c", CONSTRAINTS, "pytest", "pytest-xdist", "hypothesis", "hatchling", "editables")
    session.install("-c", CONSTRAINTS, "crc32c")  # cai-ckpt's checksums (it falls back to zlib without it)
    session.install("-c", CONSTRAINTS, "fastapi", "uvicorn")  # cai-infer[serve]
    editable = [arg for p in PACKAGES for arg in ("-e", str(ROOT / "packages" / f"cai-{p}"))]
    session.install("-c", CONSTRAINTS, "--no-deps", "--no-build-isolation", *editable)


@nox.session
def tests(session: nox.Session) -> None:
    """All package tests and integration tests in one environment (GPU tests skip without CUDA)."""
    _install_workspace(session)
    workers = os.environ.get("CAI_TEST_WORKERS", "2")
    session.run(
        "pytest",
        "-n",
        workers,
        "--durations=25",
        *(session.posargs or ["packages", "integration-tests"]),
        env=_cpu_env(),
    )


def _build(session: nox.Session, packages: list[str]) -> None:
    session.install("-c", CONSTRAINTS, "build", "hatchling")
    for p in packages:
        session.run(
            "python",
            "-m",
            "build",
            "--no-isolation",
            "-o",
            str(DIST),
            str(ROOT / "packages" / f"cai-{p}"),
            silent=True,
        )


def _check_metadata(meta: email.message.Message, package: str) -> None:
    name = f"cai-{package}"
    if meta["Name"] != name or meta["Version"] != VERSION:
        raise RuntimeError(
            f"{name}: metadata says {meta['Name']} {meta['Version']}, expected {name} {VERSION}"
        )
    for line in meta.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.name.startswith("cai-") and req.specifier != SpecifierSet(SIBLING_RANGE):
            raise RuntimeError(f"{name}: sibling dependency {line!r} must use the range {SIBLING_RANGE}")


@nox.session
def build(session: nox.Session) -> None:
    """Wheels and sdists for every package; checks name, version and sibling ranges in both."""
    shutil.rmtree(DIST, ignore_errors=True)
    _build(session, PACKAGES)
    for p in PACKAGES:
        stem = f"cai_{p}-{VERSION}"
        wheel = DIST / f"{stem}-py3-none-any.whl"
        with zipfile.ZipFile(wheel) as zf:
            names = zf.namelist()
            if any(n.startswith("cai/__init__") for n in names):
                raise RuntimeError(f"{wheel.name} ships cai/__init__.py: cai must stay a namespace package")
            _check_metadata(email.message_from_bytes(zf.read(f"{stem}.dist-info/METADATA")), p)
        with tarfile.open(DIST / f"{stem}.tar.gz") as tf:
            pkg_info = tf.extractfile(f"{stem}/PKG-INFO")
            _check_metadata(email.message_from_bytes(pkg_info.read()), p)
        session.log(f"cai-{p}: wheel ({len(names)} files) and sdist OK")


@nox.session
@nox.parametrize("package", PACKAGES)
def isolated(session: nox.Session, package: str) -> None:
    """One package alone: its wheel and declared dependencies in a fresh environment, then its own tests."""
    _build(session, PACKAGES)  # siblings are not on an index: resolve them from the local wheels
    wheel = DIST / f"cai_{package}-{VERSION}-py3-none-any.whl"
    session.install("-c", CONSTRAINTS, "--find-links", str(DIST), f"{wheel}[test]")
    session.run("python", "-c", f"import cai.{package} as m; print(m.__name__, m.__version__)")
    tests_dir = ROOT / "packages" / f"cai-{package}" / "tests"
    # Run from a scratch folder with the repo's config switched off so that only the installed wheel is imported.
    tmp = session.create_tmp()
    session.chdir(tmp)
    session.run(
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-c",
        os.devnull,
        "--rootdir",
        str(tests_dir),
        "-o",
        "addopts=--import-mode=importlib",
        "-o",
        "markers=gpu: needs a CUDA device",
        str(tests_dir),
        env=_cpu_env(),
    )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff format --check, ruff check, and the package import rules (.ci/check_imports.py, standard library only)."""
    session.install("-c", CONSTRAINTS, "ruff")
    session.run("ruff", "format", "--check", ".")
    session.run("ruff", "check", ".")
    session.run("python", str(ROOT / ".ci" / "check_imports.py"), str(ROOT))


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: train a small Llama on a synthetic task with 2 gloo processes, checkpoint, resume, evaluate."""
    _install_workspace(session)
    session.run("cai", "check")
    session.run("python", "examples/train_llama.py", *session.posargs, env=_cpu_env())


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """GPU tests and benchmarks with the interpreter at hand (no installs): see integration-tests/gpu/README.md."""
    session.run("bash", "integration-tests/gpu/run.sh", *session.posargs, external=True)
