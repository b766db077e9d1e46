import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
# Spawned workers (forkserver) import tests.* by name.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


@pytest.fixture(scope="session")
def moto_server():
    """The test run's one S3 server (moto on 127.0.0.1, a free port, the tests'
    credentials: ``tests.s3_support``), stopped when the run ends. Each module makes a
    bucket of its own on it (``create_bucket``), so modules never see each other's
    objects."""
    pytest.importorskip("moto")
    from tests.s3_support import MotoServer

    server = MotoServer().start()
    yield server
    server.stop()


@pytest.fixture
def ckpt_dir(tmp_path: Path) -> Path:
    """A fresh directory path for one checkpoint (not created)."""
    return tmp_path / "ckpt"


@pytest.fixture
def tiny_tmpfs(tmp_path: Path):
    """A 1 MiB tmpfs: a real full disk (ENOSPC); skipped where mounting is not allowed,
    where each test's fault-injected twin covers ENOSPC."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip()}); the fault-injected test covers ENOSPC")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)
