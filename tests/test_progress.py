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


class _Collected(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _info_lines_of_save_and_load(rank: int, world: int, path: str) -> list[str]:
    collected = _Collected()
    log = logging.getLogger("shardstore")
    log.addHandler(collected)
    log.setLevel(logging.DEBUG)
    try:
        data = torch.ones(8, 4)
        sd = {"w": ShardedTensor.from_rank_offsets("w", data, (0, rank, world))}
        save(sd, path)
        load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(8, 4), (0, rank, world))}, path)
        for _ in range(2):
            progress_module.log_once(log, "a notice every rank reaches")
    finally:
        log.removeHandler(collected)
    return [f"{logging.getLevelName(r.levelno)} {r.getMessage()}" for r in collected.records if r.name == "shardstore"]


def test_each_save_and_load_is_logged_at_info_once_per_job_not_once_per_rank(tmp_path: Path) -> None:
    """A job of N ranks logs one INFO line per save and per load (the coordinator's); the
    other ranks log the same line at DEBUG. A notice logged once per process (``log_once``)
    is INFO on rank 0 only."""
    coordinator, other = run_distributed(_info_lines_of_save_and_load, 2, str(tmp_path / "ckpt"))
    assert [line.split(":")[0] for line in coordinator if line.startswith(("INFO save ", "INFO load "))] == [
        f"INFO save {tmp_path / 'ckpt'}", f"INFO load {tmp_path / 'ckpt'}"
    ]
    assert not [line for line in other if line.startswith("INFO")]
    assert [line.split(":")[0] for line in other if line.startswith(("DEBUG save ", "DEBUG load "))] == [
        f"DEBUG save {tmp_path / 'ckpt'}", f"DEBUG load {tmp_path / 'ckpt'}"
    ]
    assert [line for line in coordinator if "notice" in line] == ["INFO a notice every rank reaches"]
    assert [line for line in other if "notice" in line] == ["DEBUG a notice every rank reaches"]


def test_an_async_save_is_logged_at_info_when_it_commits_not_when_it_returns(ckpt_dir: Path, caplog) -> None:
    """An async save logged its INFO line (duration, bytes, MiB/s) when ``save`` returned,
    before a byte was written, and nothing when it committed: the log said the save was
    done, at the rate of the host copy, whether or not it ever committed. Its line comes
    at the commit now, timed from the call; the return is a DEBUG line that says so."""
    from shardstore.strategies.async_utils import AsyncCallsQueue

    queue = AsyncCallsQueue()
    with caplog.at_level(logging.DEBUG, logger="shardstore"):
        request = save(_sd(), ckpt_dir, async_sharded_save=True)
        returned = [r.getMessage() for r in caplog.records if r.name == "shardstore"]
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
        queue.close()
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and r.name == "shardstore"]
    assert not [line for line in returned if line.startswith(f"save {ckpt_dir}: ") and "MiB/s" in line]
    assert any(line.startswith(f"save {ckpt_dir}: ") and "background" in line for line in returned)
    assert [line for line in info if line.startswith(f"save {ckpt_dir}: ")] == [
        next(line for line in info if line.startswith(f"save {ckpt_dir}: "))
    ]
    committed = next(line for line in info if line.startswith(f"save {ckpt_dir}: "))
    assert "1.0 MiB" in committed and "MiB/s" in committed
    messages = [r.getMessage() for r in caplog.records if r.name == "shardstore"]
    assert messages.index(committed) > max(i for i, m in enumerate(messages) if m.startswith("save: commit"))


def test_a_failed_async_save_logs_no_info_line(ckpt_dir: Path, caplog, monkeypatch: pytest.MonkeyPatch) -> None:
    """An async save whose background writes fail logs no INFO line for the save (it
    did before, when ``save`` returned): the failure raises from the finalize."""
    from shardstore.core import CheckpointingException
    from shardstore.execution.pipeline import SavePipeline
    from shardstore.strategies.async_utils import AsyncCallsQueue

    def fail(*args: object, **kwargs: object) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(SavePipeline, "write_staged", fail)
    queue = AsyncCallsQueue()
    with caplog.at_level(logging.DEBUG, logger="shardstore"):
        queue.schedule_async_request(save(_sd(), ckpt_dir, async_sharded_save=True))
        with pytest.raises(CheckpointingException):
            queue.maybe_finalize_async_calls(blocking=True)
        queue.close()
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and r.name == "shardstore"]
    assert not [line for line in info if line.startswith(f"save {ckpt_dir}")]


def test_an_async_save_handed_to_another_process_is_logged_when_it_commits(ckpt_dir: Path, caplog) -> None:
    """The request handed to Megatron's queue (``forked_writes.for_another_process``)
    keeps the step that logs the save's line once it committed (it kept only the
    commit, so such a save was never logged once the INFO line left ``save``'s return)."""
    from shardstore.compat.megatron.strategies.forked_writes import for_another_process
    from shardstore.strategies.async_utils import AsyncRequest

    with caplog.at_level(logging.DEBUG, logger="shardstore"):
        request = for_another_process(save(_sd(), ckpt_dir, async_sharded_save=True), AsyncRequest)
        request.async_fn(*request.async_fn_args)
        for finalize in request.finalize_fns:
            finalize()
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and r.name == "shardstore"]
    assert len([line for line in info if line.startswith(f"save {ckpt_dir}: ") and "1.0 MiB" in line]) == 1


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_an_incremental_saves_line_counts_the_shared_bytes_apart(tmp_path: Path, caplog, asynchronous: bool) -> None:
    """An incremental save that shares every chunk with its base logged the whole
    checkpoint's bytes at a rate as if it had written them. Its INFO line now says how
    much was shared and gives the rate of what was written."""
    from shardstore.strategies.async_utils import AsyncCallsQueue

    save(_sd(), tmp_path / "base")
    second = tmp_path / "second"
    with caplog.at_level(logging.INFO, logger="shardstore"):
        request = save(_sd(), second, reuse_from=tmp_path / "base", async_sharded_save=asynchronous)
        if asynchronous:
            queue = AsyncCallsQueue()
            queue.schedule_async_request(request)
            queue.close()
    line = next(r.getMessage() for r in caplog.records
                if r.levelno == logging.INFO and r.name == "shardstore" and r.getMessage().startswith(f"save {second}: "))
    assert "1.0 MiB (1.0 MiB of it shared with an earlier checkpoint, not written), 0 MiB/s written" in line, line
