"""A Python environment WITHOUT shardstore, for testing what plain readers get.

The main venv has shardstore installed, and with it the start-up hook that teaches
zarr-python bfloat16 and float8: a plain reader there is not plain. This one has only the
readers (zarr, xarray, dask, TensorStore) and what they need, at the main venv's versions
where it has them, so pip takes them from its cache or its local wheels.

It is made once per machine (about a minute, at most ``CREATE_TIMEOUT_S``) under
``$SHARDSTORE_CACHE`` (default ``~/.cache/shardstore``), in a directory named after what it
holds, and reused by later runs; where it cannot be made (no network and no pip cache),
the tests that need it skip, saying why.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

# The readers, pinned to the main venv's versions where it has them.
READERS = ("zarr", "numpy", "ml_dtypes", "tensorstore", "xarray")
# dask is not in the main venv (shardstore needs none of it): a version known to work.
DASK = "dask==2026.8.0"
CREATE_TIMEOUT_S = 900


def requirements() -> list[str]:
    pinned = []
    for name in READERS:
        try:
            pinned.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            pinned.append(name)
    return [*pinned, DASK]


def cache_root() -> Path:
    return Path(os.environ.get("SHARDSTORE_CACHE") or Path.home() / ".cache" / "shardstore")


def plain_python() -> Path | str:
    """The interpreter of the plain venv, made if missing; or why it cannot be made."""
    wanted = requirements()
    tag = hashlib.sha256(f"{sys.version_info[:2]} {wanted}".encode()).hexdigest()[:12]
    venv = cache_root() / f"plain-readers-{tag}"
    python = venv / "bin" / "python"
    if python.exists():
        return python
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".plain-readers-{tag}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test run may be making it
        if python.exists():
            return python
        building = venv.with_name(venv.name + ".partial")
        shutil.rmtree(building, ignore_errors=True)
        try:
            subprocess.run([sys.executable, "-m", "venv", str(building)], check=True, capture_output=True,
                           timeout=120)
            subprocess.run([str(building / "bin" / "python"), "-m", "pip", "install", "-q",
                            "--disable-pip-version-check", *wanted],
                           check=True, capture_output=True, text=True, timeout=CREATE_TIMEOUT_S,
                           env={**os.environ, "PIP_NO_INPUT": "1"})
        except subprocess.CalledProcessError as exc:
            shutil.rmtree(building, ignore_errors=True)
            tail = (exc.stderr or "").strip().splitlines()[-1:] if isinstance(exc.stderr, str) else []
            return f"cannot make a venv without shardstore holding {wanted} (offline, no pip cache?): {tail}"
        except subprocess.TimeoutExpired:
            shutil.rmtree(building, ignore_errors=True)
            return f"making a venv without shardstore took over {CREATE_TIMEOUT_S} s"
        # run as bin/python -m ..., a venv may move: only its bin/ scripts name the old path
        building.rename(venv)
        return python
