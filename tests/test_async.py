"""Asynchronous save (issue 6): snapshot at the call, background I/O, collective finalize."""

from __future__ import annotations

import errno
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from shardstore import ShardedTensor, StorageLayout, load, save
from shardstore.core import CheckpointingException
from shardstore.format.records import is_committed, read_commit_record
from shardstore.stores.locations import open_location
from shardstore.strategies.async_utils import AsyncCallsQueue
from shardstore.strategies.zarr import ZarrSaveShardedStrategy
from tests.dist import run_distributed
from tests.scenarios import assert_bits_equal, global_tensor

SHAPE = (64, 48)


def _sd(rank: int, world: int, empty: bool = False) -> dict:
    sd = {}
    for name, dtype in (("w", torch.float32), ("e", torch.bfloat16)):
        full = global_tensor(name, SHAPE, dtype)
        data = torch.empty_like(full.chunk(world)[rank]) if empty else full.chunk(world)[rank].clone()
        sd[name] = ShardedTensor.from_rank_offsets(name, data, (0, rank, world))
    return sd


def _check(rank: int, world: int, ckpt: str) -> None:
    loaded = load(_sd(rank, world, empty=True), ckpt)
    for name, dtype in (("w", torch.float32), ("e", torch.bfloat16)):
        assert_bits_equal(loaded[name], global_tensor(name, SHAPE, dtype).chunk(world)[rank], name)


def save_then_clobber(rank: int, world: int, ckpt: str, cap: int | None) -> list[int]:
    sd = _sd(rank, world)
    strategy = ZarrSaveShardedStrategy(max_staging_bytes=cap)
    queue = AsyncCallsQueue()
    request = save(sd, ckpt, strategy, async_sharded_save=True)
    for t in sd.values():  # the trainer moves on and changes its tensors at once
        t.data.fill_(-7)
    queue.schedule_async_request(request)
    assert not is_committed(open_location(ckpt)) or cap is not None
    done: list[int] = []
    deadline = time.monotonic() + 60
    while queue.get_num_unfinalized_calls():
        done += queue.maybe_finalize_async_calls(blocking=False)
        assert time.monotonic() < deadline, "async save never finished"
        time.sleep(0.01)
    queue.close()
    return done


@pytest.mark.parametrize("cap", [None, 64 * 24 * 4])
def test_snapshot_semantics_and_resharded_load(ckpt_dir: Path, cap: int | None) -> None:
    """Tensors changed right after save() returns: the checkpoint holds the old values.
    With a staging cap of one block, the save stages and writes in waves."""
    assert run_distributed(save_then_clobber, 2, str(ckpt_dir), cap) == [[0], [0]]
    run_distributed(_check, 1, str(ckpt_dir))
    run_distributed(_check, 4, str(ckpt_dir))


def two_saves_in_flight(rank: int, world: int, first: str, second: str) -> list[int]:
    queue = AsyncCallsQueue()
    for ckpt in (first, second):
        queue.schedule_async_request(save(_sd(rank, world), ckpt, async_sharded_save=True))
    assert queue.get_num_unfinalized_calls() == 2
    order = queue.maybe_finalize_async_calls(blocking=True)
    assert is_committed(open_location(first)) and is_committed(open_location(second))
    queue.close()
    return order


def test_two_saves_in_flight_finalize_in_order(tmp_path: Path) -> None:
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    assert run_distributed(two_saves_in_flight, 2, first, second) == [[0, 1], [0, 1]]
    run_distributed(_check, 2, first)
    run_distributed(_check, 1, second)


def failing_background_write(rank: int, world: int, ckpt: str) -> str:
    from shardstore.format import chunks as chunk_io

    if rank == 1:
        def no_space(self, data):
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        chunk_io.ChunkFile.write = no_space
    queue = AsyncCallsQueue()
    queue.schedule_async_request(save(_sd(rank, world), ckpt, async_sharded_save=True))
    try:
        queue.maybe_finalize_async_calls(blocking=True)
    except CheckpointingException as exc:
        message = str(exc)
    else:
        raise AssertionError("finalize did not raise")
    finally:
        queue.close(abort=True)
    assert not is_committed(open_location(ckpt))
    return message


def test_background_failure_surfaces_at_finalize_on_every_rank(ckpt_dir: Path) -> None:
    messages = run_distributed(failing_background_write, 2, str(ckpt_dir))
    for m in messages:
        assert "rank 1" in m and "No space left on device" in m, m
    with pytest.raises(CheckpointingException, match="incomplete|not a distributed checkpoint|does not exist"):
        read_commit_record(open_location(ckpt_dir))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread CPU priority is Linux only")
@pytest.mark.parametrize(("priority", "policy", "nice"), [("idle", "SCHED_IDLE", None), ("low", "SCHED_OTHER", 10)])
def test_background_io_runs_at_lower_cpu_priority(priority: str, policy: str, nice: int | None) -> None:
    """The I/O thread (and threads it starts) yield the CPU to the training loop;
    the caller's own priority is untouched."""
    before = (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0))
    queue = AsyncCallsQueue(io_priority=priority)

    def probe() -> tuple[int, int]:
        tid = threading.get_native_id()
        return os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)

    seen_policy, seen_nice = queue._worker.submit(probe).result()
    queue.close()
    assert seen_policy == getattr(os, policy)
    if nice is not None:
        assert seen_nice == nice
    assert (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0)) == before


def test_unknown_io_priority_is_refused() -> None:
    with pytest.raises(ValueError, match="io_priority"):
        AsyncCallsQueue(io_priority="realtime")


def close_after_a_failed_first_save(rank: int, world: int, first: str, second: str) -> tuple[str | None, int, bool]:
    from shardstore.format import chunks as chunk_io

    original = chunk_io.ChunkFile.write

    def write(self, data):  # rank 1 cannot write the FIRST save; the second one is fine
        if rank == 1 and "/.a." in str(self.path):
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        return original(self, data)

    chunk_io.ChunkFile.write = write
    queue = AsyncCallsQueue()
    # the failure is injected into chunk files, which a packed array does not have
    per_array = StorageLayout(pack_arrays_up_to=0)
    queue.schedule_async_request(save(_sd(rank, world), first, async_sharded_save=True, layout=per_array))
    queue.schedule_async_request(save(_sd(rank, world), second, async_sharded_save=True, layout=per_array))
    message = None
    try:
        queue.close()
    except CheckpointingException as exc:
        message = str(exc)
    return message, queue.get_num_unfinalized_calls(), is_committed(open_location(second))


def test_close_finalizes_every_pending_save_even_after_one_failed(tmp_path: Path) -> None:
    """Two async saves in flight; the first fails on rank 1, the second is written on
    every rank. ``close()`` raised the first's failure and stopped there: the second
    save was neither committed nor aborted, the closed queue still held it, and the
    error did not name it. Now every ready save is finalized, and the error names
    each one's outcome."""
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    for message, pending, second_committed in run_distributed(close_after_a_failed_first_save, 2, first, second):
        assert message is not None and "No space left" in message, message
        assert f"{first}: not committed" in message and f"{second}: committed" in message, message
        assert pending == 0, "close() left a save pending in a closed queue"
        assert second_committed, "the second save, written on every rank, was dropped by close()"
    assert not is_committed(open_location(first))


def finalize_callback_fails_on_one_rank(rank: int, world: int, first: str, second: str) -> tuple[float, str, bool]:
    queue = AsyncCallsQueue()
    request = save(_sd(rank, world), first, async_sharded_save=True)

    def tracker() -> None:  # e.g. Megatron-LM's tracker-file writer, rank 0 only
        if rank == 0:
            raise OSError("cannot write the tracker file")

    request.add_finalize_fn(tracker)
    queue.schedule_async_request(request)
    queue.schedule_async_request(save(_sd(rank, world), second, async_sharded_save=True))
    start = time.monotonic()
    with pytest.raises(CheckpointingException) as raised:
        queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    return time.monotonic() - start, str(raised.value), is_committed(open_location(second))


def test_a_finalize_callback_failing_on_one_rank_does_not_stall_the_others(tmp_path: Path) -> None:
    """A plain finalize callback of the first request raises on rank 0 only. Rank 0
    stopped finalizing while rank 1 went on into the second request's collective
    commit and waited there for the process group's timeout (then both reported 'lost
    contact', and the second, fully written, save was never committed). Now every rank
    finalizes both and raises the same error, naming the failing rank."""
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    results = run_distributed(finalize_callback_fails_on_one_rank, 2, first, second, timeout=150, pg_timeout=20)
    for elapsed, message, second_committed in results:
        assert elapsed < 10, f"a rank waited {elapsed:.0f} s for a timeout"
        assert second_committed
        assert f"{first}: committed, but a later finalize step failed on rank(s) 0: " in message, message
        assert "cannot write the tracker file" in message and f"{second}: committed" in message, message
    assert results[0][1] == results[1][1], "the ranks raised different errors"


def test_async_pinned_pool_stays_within_max_staging_bytes(tmp_path: Path, monkeypatch) -> None:
    """The async snapshots' pool of pinned buffers kept every buffer returned to it
    (``HostBufferPool()`` without a bound): with shapes that differ, the pinned memory
    the strategy held grew to the whole state, not ``max_staging_bytes``. CUDA is
    emulated on CPU: ``HostSnapshot.copy`` routes every tensor through the pool, as it
    does CUDA tensors; 12 blocks of distinct shapes, a cap of 4."""
    from shardstore.execution.staging import HostSnapshot

    def copy(self, tensor, key=None):
        out = self.pool.take(tensor)
        out.copy_(tensor.detach())
        self.buffers.append(out)
        return out

    monkeypatch.setattr(HostSnapshot, "copy", copy)
    block = 16 * 1024  # float32 elements, 64 KiB
    state = {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.full((block + i,), float(i))) for i in range(12)}
    cap = 4 * block * 4 + 1024
    strategy = ZarrSaveShardedStrategy(max_staging_bytes=cap)
    queue = AsyncCallsQueue()
    queue.schedule_async_request(save(state, tmp_path / "ckpt", strategy, async_sharded_save=True))
    queue.close()
    assert 0 < strategy._buffers.free_bytes <= cap, (
        f"the async pool keeps {strategy._buffers.free_bytes} bytes of pinned buffers, max_staging_bytes={cap}"
    )
    assert is_committed(open_location(tmp_path / "ckpt"))


def saves_scheduled_in_another_order(rank: int, world: int, first: str, second: str) -> str:
    """Both saves made in the same order on every rank (``save`` is collective), then
    scheduled in the opposite order on rank 1."""
    requests = [save(_sd(rank, world), ckpt, async_sharded_save=True) for ckpt in (first, second)]
    queue = AsyncCallsQueue()
    for request in requests if rank == 0 else requests[::-1]:
        queue.schedule_async_request(request)
    with pytest.raises(CheckpointingException) as raised:
        queue.close()
    return str(raised.value)


def test_saves_finalized_in_another_order_on_some_rank_are_refused_not_mixed(tmp_path: Path) -> None:
    """Rank 0 scheduled save a then b, rank 1 b then a. Each rank's commit step joined
    the other's: the coordinator committed a with rank 1's report of b's chunks (and b
    with a's), so both were committed, every rank said so, and neither verified nor
    loaded (the chunks' recorded checksums were another save's). Now the commit stage
    compares the saves the ranks report for, and both fail on every rank, uncommitted."""
    from shardstore import verify

    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    for message in run_distributed(saves_scheduled_in_another_order, 2, first, second):
        assert "another save" in message and "same order" in message, message
    for ckpt in (first, second):
        assert not is_committed(open_location(ckpt)) or verify(ckpt).ok, f"{ckpt} committed and damaged"


def test_a_failed_preload_lets_go_of_its_save(tmp_path: Path) -> None:
    """A request whose ``preload_fn`` raises. Its save kept its staging directory locked
    (descriptors, flock) for as long as anything referenced the request (the caller's
    variable, the traceback), so the next save into the same place could not remove it.
    The request now stays queued, failed (every rank must finalize the same saves: see
    test_a_preload_failing_on_one_rank_fails_that_save_on_every_rank): the next
    finalize fails it, naming the preload's error, and lets go of it; nothing is left
    behind, and the next save into the same place commits."""
    from dataclasses import replace

    def preload() -> None:
        raise RuntimeError("device-to-host copy failed")

    ckpt = tmp_path / "ckpt"
    queue = AsyncCallsQueue()
    request = save(_sd(0, 1), ckpt, async_sharded_save=True)
    with pytest.raises(RuntimeError, match="device-to-host copy failed"):
        queue.schedule_async_request(replace(request, preload_fn=preload))
    with pytest.raises(CheckpointingException, match="device-to-host copy failed"):
        queue.maybe_finalize_async_calls(blocking=True)
    assert queue.get_num_unfinalized_calls() == 0
    assert list(tmp_path.iterdir()) == [], "the failed save left files behind"
    queue.schedule_async_request(save(_sd(0, 1), ckpt, async_sharded_save=True))
    queue.close()
    assert is_committed(open_location(ckpt))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"], "the failed save's staging directory is still there"


def test_exiting_with_an_async_save_pending_says_it_was_not_committed(tmp_path: Path) -> None:
    """A script schedules an async save and ends without ``close()``. The save was never
    committed, and all the process said was 'Background I/O of async checkpoint save 0
    failed: cannot schedule new futures after interpreter shutdown' (the writes, cut off
    by the interpreter's shutdown), or nothing at all: nothing named the checkpoint
    lost. Now a WARNING at exit names it, and what to call."""
    import subprocess

    script = (
        "import sys, torch\n"
        "from shardstore import ShardedTensor, save\n"
        "from shardstore.strategies.async_utils import AsyncCallsQueue\n"
        "queue = AsyncCallsQueue()\n"
        "state = {'w': ShardedTensor.from_rank_offsets('w', torch.ones(8))}\n"
        "queue.schedule_async_request(save(state, sys.argv[1], async_sharded_save=True))\n"
    )
    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", script, str(ckpt)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "never finalized" in done.stderr and str(ckpt) in done.stderr and "close()" in done.stderr, done.stderr
    assert not is_committed(open_location(ckpt))


def close_after_destroying_the_process_group(rank: int, world: int, ckpt: str) -> str:
    import torch.distributed as dist

    queue = AsyncCallsQueue()
    queue.schedule_async_request(save(_sd(rank, world), ckpt, async_sharded_save=True))
    dist.destroy_process_group()
    with pytest.raises(CheckpointingException) as raised:
        queue.close()
    return str(raised.value)


def test_finalizing_after_the_process_group_is_gone_names_the_saves_lost(ckpt_dir: Path) -> None:
    """``destroy_process_group()`` before ``close()``: the collective commit raised
    torch's bare 'ValueError: Default process group has not been initialized' from deep
    inside the commit stage, naming neither the checkpoint nor what to do. Now a
    CheckpointingException names the saves left uncommitted and the order to call."""
    for message in run_distributed(close_after_destroying_the_process_group, 2, str(ckpt_dir)):
        assert str(ckpt_dir) in message and "destroy_process_group" in message, message
    assert not is_committed(open_location(ckpt_dir))


def preload_fails_on_rank_1(rank: int, world: int, first: str, second: str) -> tuple[str | None, str | None, bool]:
    """Save ``first`` with a preload that raises on rank 1 only, finalize, then save
    ``second`` into another place and finalize it."""
    from dataclasses import replace

    def preload() -> None:
        raise RuntimeError("device-to-host copy failed")

    queue = AsyncCallsQueue()
    request = save(_sd(rank, world), first, async_sharded_save=True)
    scheduled: str | None = None
    try:
        queue.schedule_async_request(replace(request, preload_fn=preload) if rank == 1 else request)
    except RuntimeError as exc:
        scheduled = str(exc)
    finalized: str | None = None
    try:
        queue.maybe_finalize_async_calls(blocking=True)
    except CheckpointingException as exc:
        finalized = str(exc)
    queue.schedule_async_request(save(_sd(rank, world), second, async_sharded_save=True))
    try:
        queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close(abort=True)
    return scheduled, finalized, is_committed(open_location(second))


def test_a_preload_failing_on_one_rank_fails_that_save_on_every_rank(tmp_path: Path) -> None:
    """The ``preload_fn`` of a save raises on rank 1 only. Rank 1 dropped the request
    (not scheduled, finalizations aborted) while rank 0 kept it: the queues went out of
    step, rank 0 was never told of the failure, and every later async save failed at
    commit ('rank(s) 1 finalized another save in its place'). Now rank 1's queue keeps
    the request with its failure as its result: the save fails on every rank at the
    next finalize, naming the preload's error, and the next save commits."""
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    results = run_distributed(preload_fails_on_rank_1, 2, first, second, timeout=150, pg_timeout=30)
    assert results[0][0] is None and "device-to-host copy failed" in (results[1][0] or ""), results
    for _, finalized, second_committed in results:
        assert finalized is not None and "device-to-host copy failed" in finalized, finalized
        assert second_committed, "the save after the failed one was not committed"
    assert results[0][1] == results[1][1], "the ranks raised different errors"
    assert not is_committed(open_location(first))
    assert [p.name for p in tmp_path.iterdir()] == ["b"], "the failed save left files behind"


def execute_sync_with_preload_failing_on_rank_1(rank: int, world: int, ckpt: str) -> tuple[float, str]:
    from dataclasses import replace

    def preload() -> None:
        raise RuntimeError("device-to-host copy failed")

    request = save(_sd(rank, world), ckpt, async_sharded_save=True)
    start = time.monotonic()
    with pytest.raises(Exception) as raised:  # noqa: PT011 - the same failure on every rank, checked below
        (replace(request, preload_fn=preload) if rank == 1 else request).execute_sync()
    return time.monotonic() - start, str(raised.value)


def test_execute_sync_with_a_preload_failing_on_one_rank_fails_on_every_rank(ckpt_dir: Path) -> None:
    """``AsyncRequest.execute_sync`` whose ``preload_fn`` raises on rank 1 only. Rank 1
    raised at once, skipping the collective finalize, while rank 0 waited in the commit
    for the process group's timeout, then reported lost contact, not the preload's
    error. Now the error is handed to the finalize steps, as an I/O error is: every
    rank raises it at once, and nothing is committed."""
    results = run_distributed(execute_sync_with_preload_failing_on_rank_1, 2, str(ckpt_dir), timeout=150,
                              pg_timeout=20)
    for elapsed, message in results:
        assert elapsed < 10, f"a rank waited {elapsed:.0f} s for a timeout"
        assert "device-to-host copy failed" in message, message
    assert results[0][1] == results[1][1], "the ranks raised different errors"
    assert not is_committed(open_location(ckpt_dir))
