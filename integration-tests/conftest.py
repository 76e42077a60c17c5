"""Make the shared helpers of this folder importable (``from _booster_cases import ...``) here and in the pooled
worker processes, which start with this process's ``sys.path``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
