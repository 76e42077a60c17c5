"""The package installs on its own and exposes its version from the installed metadata."""

from importlib.metadata import requires, version

import cai.pipeline


def test_version_comes_from_metadata():
    assert cai.pipeline.__version__ == version("cai-pipeline") == "0.1.0"


def test_declared_dependencies_import():
    for req in requires("cai-pipeline") or []:
        if "extra ==" in req:
            continue
        name = req.split(">")[0].split("=")[0].split("<")[0].strip()
        module = "cai." + name[4:] if name.startswith("cai-") else name
        __import__(module)
