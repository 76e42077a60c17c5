"""Make the shared helpers of this folder importable (``from _booster_cases import ...``) here and in the pooled
worker processes, which start with this process's ``sys.path``; and ``root``, where a test module's checkpoints go."""

import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="module")
def root():
    """The directory under which the module's checkpoints go, removed after its tests."""
    path = tempfile.mkdtemp(prefix="cai-integration-")
    yield path
    shutil.rmtree(path, ignore_errors=True)
