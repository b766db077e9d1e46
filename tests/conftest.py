import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
# Spawned workers (forkserver) import tests.* by name.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


@pytest.fixture
def ckpt_dir(tmp_path: Path) -> Path:
    """A fresh directory path for one checkpoint (not created)."""
    return tmp_path / "ckpt"
