"""Issue 16.6: the README's quick start runs as written: ``save.py`` on 2 ranks under
torchrun, ``load.py`` on 1 rank and on 2 (so at another world size)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from shardstore.testing import free_port

README = Path(__file__).resolve().parent.parent / "README.md"


def _quick_start_blocks() -> tuple[str, str]:
    text = README.read_text()
    section = text[text.index("## Quick start"):]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return blocks[0], blocks[1]  # save.py, load.py


def _run(script: Path, ranks: int, ckpt: Path) -> None:
    env = {**os.environ, "CKPT": str(ckpt)}
    if ranks == 1:
        command = [sys.executable, str(script)]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
                   "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(script)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, f"{script.name} on {ranks} rank(s):\n{result.stdout}\n{result.stderr}"


def test_quick_start_runs_as_written(tmp_path: Path) -> None:
    save_py, load_py = _quick_start_blocks()
    (tmp_path / "save.py").write_text(save_py)
    (tmp_path / "load.py").write_text(load_py)
    ckpt = tmp_path / "ckpt" / "iter_0001000"
    _run(tmp_path / "save.py", 2, ckpt)
    _run(tmp_path / "load.py", 1, ckpt)
    _run(tmp_path / "load.py", 2, ckpt)
