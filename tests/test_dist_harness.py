"""The distributed test harness itself (``tests/dist.py``): a hang must fail the test
with every process's Python stacks, forked writers included, and leave no process
behind; what a rank returns reaches the test even when the rank has already exited."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time

import pytest
import torch

import tests.dist as dist_harness
from tests.dist import run_distributed


def _writer_that_hangs(pid_file: str) -> None:
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(3600)


def hang_in_a_forked_writer(rank: int, world: int, pid_dir: str) -> None:
    """Rank 0 forks a writer (as Megatron's async queue does) that never ends, from a
    thread (as DCP's process executor does: a child of that thread, not of the main
    one), and waits for it; rank 1 returns."""
    if rank == 0:
        writer = mp.get_context("fork").Process(target=_writer_that_hangs, args=(os.path.join(pid_dir, "writer"),))
        starter = threading.Thread(target=lambda: (writer.start(), writer.join()))
        starter.start()
        starter.join()


def exit_without_a_report(rank: int, world: int) -> None:
    if rank == 1:
        os._exit(3)  # a crash: no traceback, no report
    time.sleep(3600)


def test_a_hang_fails_with_the_stacks_of_every_process_and_leaves_none(tmp_path) -> None:
    with pytest.raises(AssertionError) as raised:
        run_distributed(hang_in_a_forked_writer, 2, str(tmp_path), timeout=5)
    message = str(raised.value)
    assert "timed out after 5s; ranks that reported: [1]" in message, message
    assert "stacks of rank 0" in message and "hang_in_a_forked_writer" in message, message
    assert "_writer_that_hangs" in message, message  # the forked writer's own stack
    writer = int((tmp_path / "writer").read_text())
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{writer}") and time.monotonic() < deadline:
        time.sleep(0.1)  # killed, then reaped by init
    assert not os.path.exists(f"/proc/{writer}") or "Z" in open(f"/proc/{writer}/stat").read().split()[2]


def test_a_rank_that_ends_without_a_report_fails_the_test_at_once() -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError) as raised:
        run_distributed(exit_without_a_report, 2, timeout=120)
    assert "rank(s) [1] ended without a report (exit codes [3])" in str(raised.value), str(raised.value)
    assert time.monotonic() - start < 60  # not the 120 s timeout


def a_small_tensor(rank: int, world: int) -> torch.Tensor:
    return torch.full((4,), float(rank))


def test_a_rank_s_tensor_arrives_when_the_rank_has_exited_before_it_is_read(monkeypatch) -> None:
    """On a loaded machine the parent reads a report after its rank has exited: what a
    rank returns must travel by value, not as a handle that ends with the rank."""
    collect = dist_harness._collect

    def collect_once_every_rank_has_exited(results, procs, *rest):
        for p in procs:
            p.join(timeout=60)
        return collect(results, procs, *rest)

    monkeypatch.setattr(dist_harness, "_collect", collect_once_every_rank_has_exited)
    values = run_distributed(a_small_tensor, 2)
    assert [t.tolist() for t in values] == [[0.0] * 4, [1.0] * 4]
