"""The package installs on its own and exposes its version from the installed metadata."""

from importlib.metadata import requires, version

import cai.infer


def test_version_comes_from_metadata():
    assert cai.infer.__version__ == version("cai-infer") == "0.1.0"


def test_declared_dependencies_import():
    for req in requires("cai-infer") or []:
        if "extra ==" in req:
            continue
        name = req.split(">")[0].split("=")[0].split("<")[0].strip()
        module = "cai." + name[4:] if name.startswith("cai-") else name
        __import__(module)
