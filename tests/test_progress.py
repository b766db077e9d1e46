"""Issue 16.2: stages logged with durations and bytes on the ``shardstore`` logger;
progress bars on the coordinator only when asked for."""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import pytest
import torch

from shardstore import ShardedTensor, load, save, verify
from shardstore import progress as progress_module
from tests.dist import run_distributed


def _sd(empty: bool = False) -> dict:
    data = torch.empty(256, 1024) if empty else torch.arange(256 * 1024, dtype=torch.float32).reshape(256, 1024)
    return {"w": ShardedTensor.from_rank_offsets("w", data), "step": 3}


def test_save_and_load_log_each_stage_with_duration_and_bytes(ckpt_dir: Path, caplog) -> None:
    with caplog.at_level(logging.DEBUG, logger="shardstore"):
        save(_sd(), ckpt_dir)
        load(_sd(empty=True), ckpt_dir)
        verify(ckpt_dir)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("shardstore")]
    for name in ("save: plan", "save: begin", "save: common", "save: stage", "save: write", "save: durable",
                 "save: commit", "load: record", "load: read"):
        assert any(re.match(rf"{name} {ckpt_dir}: \d+\.\d{{3}} s", line) for line in lines), name
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and r.name == "shardstore"]
    assert any(line.startswith(f"save {ckpt_dir}: ") and "1.0 MiB" in line and "MiB/s" in line for line in info)
    assert any(line.startswith(f"load {ckpt_dir}: ") and "1.0 MiB" in line for line in info)
    assert any(line.startswith(f"verify {ckpt_dir}: ") and "1.0 MiB" in line for line in info)
    write = next(line for line in lines if line.startswith("save: write"))
    assert "1.0 MiB" in write


def test_nothing_is_logged_at_info_by_default(ckpt_dir: Path, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        save(_sd(), ckpt_dir)
    assert not [r for r in caplog.records if r.name.startswith("shardstore")]


def test_progress_bars_only_when_asked(ckpt_dir: Path, capfd, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress_module, "MIN_PROGRESS_BYTES", 0)
    save(_sd(), ckpt_dir)
    load(_sd(empty=True), ckpt_dir)
    assert capfd.readouterr().err == ""
    save(_sd(), ckpt_dir, overwrite=True, progress=True)
    load(_sd(empty=True), ckpt_dir, progress=True)
    verify(ckpt_dir, progress=True)
    err = capfd.readouterr().err
    assert "write" in err and "read" in err and "verify" in err and "1.00M" in err


def _save_with_progress(rank: int, world: int, path: str, err_dir: str) -> str:
    progress_module.MIN_PROGRESS_BYTES = 0
    data = torch.ones(64, 1024)
    with open(Path(err_dir) / f"stderr.{rank}", "w") as err:
        sys.stderr = err  # the bar goes to sys.stderr as it is when the bar starts
        try:
            save({"w": ShardedTensor.from_rank_offsets("w", data, (0, rank, world))}, path, progress=True)
        finally:
            sys.stderr = sys.__stderr__
    return (Path(err_dir) / f"stderr.{rank}").read_text()


def test_progress_shows_on_the_coordinator_only(tmp_path: Path) -> None:
    coordinator, other = run_distributed(_save_with_progress, 2, str(tmp_path / "ckpt"), str(tmp_path))
    assert coordinator.count("write:") == 1
    assert "/256k" in coordinator  # rank 0's half of the 512 KiB
    assert other == ""
