"""``scripts/gpu_check.sh``, the one call a run on a GPU machine makes, runs here at tiny sizes
(no CUDA: the GPU tests skip) and reports every step as passed. Marked slow: about 65 s
on 2 cores."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gpu_check_runs_every_step(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "GPU_CHECK_GIB": "0.02", "GPU_CHECK_SMALL": "50", "GPU_CHECK_WORLD": "2"}
    done = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=840)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = (tmp_path / "gpu_report.md").read_text()
    steps = [line for line in report.splitlines() if line.startswith("## ")]
    assert len(steps) == 5 and all(": passed in " in s for s in steps), steps
    assert {p.name for p in tmp_path.glob("bench_*.json")} == {"bench_device.json", "bench_tiny.json", "bench_world2.json"}
