"""The README's first command: ``scripts/demo.py`` (what ``scripts/demo.sh`` runs once the
venv is there) passes end to end, both legs, as a new user runs it: a local disk, then
the embedded S3 server it starts itself (no AWS settings in its environment).

A fresh interpreter (``subprocess``), as ``demo.sh`` starts: the demo spawns its ranks
with torch.multiprocessing and its plain reader in another interpreter of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_demo_passes_on_disk_and_on_its_own_s3_server() -> None:
    env = {name: value for name, value in os.environ.items() if not name.startswith("AWS_")}
    started = time.monotonic()
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py")], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    report = f"exit {result.returncode} after {time.monotonic() - started:.0f} s\n{result.stdout}\n{result.stderr}"
    assert result.returncode == 0, report
    out = result.stdout
    assert "== Local disk ==" in out and "== S3 ==" in out and "Started an embedded S3 server" in out, report
    # step 5 on each leg: the packed arrays read from their packs, every array's bytes as saved
    assert out.count("packs/") >= 6 and out.count("zarr-python's ZipStore") >= 3, report
    assert out.count("its zip kvstore over S3") >= 3, report
    assert out.count("equal what was saved (4 arrays)") == 2, report
    assert out.rstrip().endswith("Demo finished: all tensors round-tripped exactly, on disk and on S3."), report
