"""Issue 23.5: a save or load that fails, at any phase, or a save that is abandoned,
leaves nothing of itself in the process: no descriptor (into the checkpoint's
directory or anywhere), no flock, no thread; and the next save into the same place
succeeds and leaves only the checkpoint behind.

Failures are injected by monkeypatching the storage layer (disk full while creating
the staging directory, writing its marker, a file, a chunk; a failed syncfs or commit;
a rank lost during an async commit) and each failing save runs several times, as a
trainer that retries would: a leak grows with every failure.
"""

from __future__ import annotations

import errno
import gc
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from shardstore import ShardedObject, ShardedTensor, StorageLayout, load, save
from shardstore.core import CheckpointingException
from shardstore.format.commit import ByRename
from shardstore.format.config import CONFIG_FNAME
from shardstore.format.records import (
    COMMIT_RECORD,
    COMMON_FILE,
    OBJECTS_DIR,
    SAVE_MARKER,
    STAGING_TAG,
)
from shardstore.stores.base import StorageError
from shardstore.stores.local import FileChunkStore, LocalStore
from shardstore.strategies.async_utils import AsyncCallsQueue
from tests.dist import run_distributed

PER_ARRAY = StorageLayout(pack_arrays_up_to=0)  # every array in chunk files of its own
ATTEMPTS = 3  # failures in a row, as a trainer retrying its save would have them
WEIGHTS = torch.arange(64, dtype=torch.float32).reshape(8, 8)


def state(rank: int = 0, world: int = 1) -> dict[str, Any]:
    """A small state dict with every part a save writes: arrays, an object, common state."""
    return {
        "w": ShardedTensor.from_rank_offsets("w", WEIGHTS.chunk(world)[rank].clone(), (0, rank, world)),
        "rng": ShardedObject("rng", torch.tensor([rank]), (world,), (rank,)),
        "iteration": 7,
    }


def disk_full(*_: Any, **__: Any) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


# ------------------------------------------------------------------ what a process holds


def descriptor_targets() -> list[str]:
    """Where this process's open descriptors point (``/proc/self/fd``)."""
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the descriptor listdir itself used, closed by now
            continue
    return targets


def own_flocks() -> list[str]:
    """The ``flock``s this process holds (``/proc/locks`` names the holder's pid)."""
    pid = str(os.getpid())
    with open("/proc/locks") as locks:
        return [line for line in locks if "FLOCK" in line and line.split()[4] == pid]


@dataclass(frozen=True)
class Held:
    """What the process holds at one moment."""

    descriptors: int
    into: tuple[str, ...]  # descriptors pointing into the checkpoints' directory
    flocks: tuple[str, ...]
    threads: frozenset[threading.Thread]

    @classmethod
    def now(cls, directory: Path, sockets: bool = False) -> Held:
        """``sockets``: count them too. Off in the test process, whose local S3 server
        (``tests/s3_support.py``, started by earlier tests) closes its idle connections
        on its own threads whenever it likes, and whose saves open none; on in a rank's
        process (``run_distributed``), where a process group's connections live."""
        gc.collect()  # what the process dropped is released by now, or never
        targets = [t for t in descriptor_targets() if sockets or not t.startswith("socket:")]
        inside = tuple(t for t in targets if t.startswith(str(directory)))
        return cls(len(targets), inside, tuple(own_flocks()), frozenset(threading.enumerate()))


def assert_released(before: Held, directory: Path) -> None:
    after = Held.now(directory)
    assert after.into == (), f"descriptors left open into {directory}: {after.into}"
    assert after.descriptors == before.descriptors, f"{before.descriptors} descriptors before, {after.descriptors} after"
    assert after.flocks == before.flocks, f"flocks left held: {set(after.flocks) - set(before.flocks)}"
    assert after.threads <= before.threads, f"threads left running: {after.threads - before.threads}"


def assert_next_save_succeeds(target: Path) -> None:
    """The place is free again: a save commits there, loads back, and leaves nothing
    else beside it (leftovers of the failed saves are gone)."""
    save(state(), target, overwrite=True)
    loaded = load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(8, 8))}, target)
    assert torch.equal(loaded["w"], WEIGHTS)
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]


# ------------------------------------------------------------------ failing saves, world 1


@dataclass(frozen=True)
class Failure:
    """A save failing at one phase: ``inject`` breaks it (monkeypatch), ``attempt``
    runs one failing operation on the target and raises what the caller sees."""

    inject: Callable[[pytest.MonkeyPatch], None]
    attempt: Callable[[Path], None] = lambda target: save(state(), target, overwrite=True)


def _writes_of(predicate: Callable[[str], bool]) -> Callable[[pytest.MonkeyPatch], None]:
    """Disk full on the small-file writes whose relative path ``predicate`` accepts."""
    original = LocalStore.put

    def write_bytes(self: LocalStore, rel: str, data: bytes) -> None:
        if predicate(rel):
            raise StorageError(f"Cannot write {self.describe(rel)}: {os.strerror(errno.ENOSPC)}")
        original(self, rel, data)

    return lambda mp: mp.setattr(LocalStore, "put", write_bytes)


def _staging_mkdir_fails(mp: pytest.MonkeyPatch) -> None:
    original = LocalStore.prepare

    def prepare(self: LocalStore) -> None:
        if STAGING_TAG in self.root.name:
            raise StorageError(f"Cannot create checkpoint directory {self.root}: {os.strerror(errno.ENOSPC)}")
        original(self)

    mp.setattr(LocalStore, "prepare", prepare)


def _syncfs_fails(mp: pytest.MonkeyPatch) -> None:
    original = LocalStore.make_durable

    def make_durable(self: LocalStore) -> None:
        original(self)  # closes the descriptor it synced through, as a real failing syncfs does
        raise StorageError(f"syncfs failed on {self.root}: {os.strerror(errno.EIO)}")

    mp.setattr(LocalStore, "make_durable", make_durable)


def _commit_record_fails(mp: pytest.MonkeyPatch) -> None:
    original = LocalStore.put_atomic

    def write_atomic(self: LocalStore, rel: str, data: bytes) -> None:
        if rel == COMMIT_RECORD:
            disk_full()
        original(self, rel, data)

    mp.setattr(LocalStore, "put_atomic", write_atomic)


def _async_save(target: Path, close: Callable[[AsyncCallsQueue], None]) -> None:
    queue = AsyncCallsQueue()
    try:
        queue.schedule_async_request(save(state(), target, overwrite=True, async_sharded_save=True))
    finally:
        close(queue)


def _async_save_aborted(target: Path) -> None:
    _async_save(target, lambda queue: queue.close(abort=True))
    raise CheckpointingException("aborted")  # what a trainer sees: nothing committed


def _async_save_dropped(target: Path) -> None:
    """The request is never scheduled nor finalized: dropped (e.g. the trainer's step
    raised between ``save`` and ``schedule_async_request``)."""
    save(state(), target, overwrite=True, async_sharded_save=True)
    raise CheckpointingException("dropped")


def _rank_lost_during_commit(target: Path) -> None:
    """The async commit's collective fails as it does when a rank died (only the
    commit's: the save itself went through). One process makes no collective, so the
    stage's reduction on the coordinator raises what a lost peer raises."""
    from shardstore.protocol import stage
    from shardstore.protocol.collectives import PeerLost

    def lost(*args: Any, **kwargs: Any) -> Any:
        raise PeerLost("Lost contact with the other ranks during a checkpoint gather")

    def close(queue: AsyncCallsQueue) -> None:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(stage, "_reduce_on_coordinator", lost)
            queue.close()

    _async_save(target, close)


def _load_of_corrupt_chunk(target: Path) -> None:
    load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(8, 8))}, target)


def _corrupt_a_chunk(target: Path) -> None:
    save(state(), target, layout=PER_ARRAY)  # the corrupted chunk is a file of its own
    chunk = next(p for p in (target / "w").rglob("*") if p.is_file() and p.name != "zarr.json")
    data = bytearray(chunk.read_bytes())
    data[0] ^= 0xFF
    chunk.write_bytes(bytes(data))


FAILURES = {
    "staging directory cannot be made": Failure(_staging_mkdir_fails),
    "staging marker cannot be written": Failure(_writes_of(lambda rel: rel == SAVE_MARKER)),
    "metadata.json cannot be written": Failure(_writes_of(lambda rel: rel == CONFIG_FNAME)),
    "common state cannot be written": Failure(_writes_of(lambda rel: rel == COMMON_FILE)),
    "sharded object cannot be written": Failure(_writes_of(lambda rel: rel.startswith(OBJECTS_DIR))),
    "chunk write fails": Failure(lambda mp: mp.setattr(FileChunkStore, "put", disk_full)),
    "syncfs fails": Failure(_syncfs_fails),
    "commit record cannot be written": Failure(_commit_record_fails),
    "commit refused": Failure(lambda mp: mp.setattr(ByRename, "commit", disk_full)),
    "async save, its write fails": Failure(
        lambda mp: mp.setattr(FileChunkStore, "put", disk_full), lambda target: _async_save(target, AsyncCallsQueue.close)
    ),
    "async save, a rank lost in its commit": Failure(lambda mp: None, _rank_lost_during_commit),
    "async save aborted": Failure(lambda mp: None, _async_save_aborted),
    "async save dropped unscheduled": Failure(lambda mp: None, _async_save_dropped),
}


@pytest.mark.parametrize("phase", FAILURES)
def test_a_failed_save_releases_everything_it_took(tmp_path: Path, phase: str) -> None:
    target = tmp_path / "ckpt" / "iter_0000007"
    target.parent.mkdir()
    failure = FAILURES[phase]
    before = Held.now(tmp_path)
    with pytest.MonkeyPatch.context() as mp:
        failure.inject(mp)
        for _ in range(ATTEMPTS):
            with pytest.raises(CheckpointingException):
                failure.attempt(target)
    assert_released(before, tmp_path)
    assert not (target / COMMIT_RECORD).exists()
    assert_next_save_succeeds(target)
    assert_released(before, tmp_path)


def test_a_failed_overwrite_releases_everything_and_keeps_the_old_checkpoint(tmp_path: Path) -> None:
    target = tmp_path / "ckpt" / "iter_0000007"
    target.parent.mkdir()
    save(state(), target)
    before = Held.now(tmp_path)
    with pytest.MonkeyPatch.context() as mp:
        _writes_of(lambda rel: rel == SAVE_MARKER)(mp)
        for _ in range(ATTEMPTS):
            with pytest.raises(CheckpointingException, match="No space left on device"):
                save(state(), target, overwrite=True)
    assert_released(before, tmp_path)
    assert_next_save_succeeds(target)


def test_a_load_that_fails_on_a_corrupt_chunk_releases_everything(tmp_path: Path) -> None:
    target = tmp_path / "ckpt" / "iter_0000007"
    target.parent.mkdir()
    _corrupt_a_chunk(target)
    before = Held.now(tmp_path)
    for _ in range(ATTEMPTS):
        with pytest.raises(CheckpointingException, match="Corrupt chunk"):
            _load_of_corrupt_chunk(target)
    assert_released(before, tmp_path)
    assert_next_save_succeeds(target)


def test_a_dropped_save_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A save dropped unfinished is released when collected, with a warning that names
    it (the trainer forgot to schedule or finalize an async save)."""
    target = tmp_path / "ckpt"
    with pytest.raises(CheckpointingException):
        _async_save_dropped(target)
    gc.collect()
    assert f"A save into {target} was dropped before it was committed or abandoned" in caplog.text


# ------------------------------------------------------------------ two ranks


def _save_failing_on_rank_1(rank: int, world: int, directory: str) -> tuple[int, int, list[str]]:
    """Rank 1's chunk writes fail ``ATTEMPTS`` times, then a save succeeds; returns this
    rank's descriptor counts before and after, and what stays open into ``directory``."""
    target = Path(directory) / "iter_0000007"
    before = Held.now(Path(directory), sockets=True)
    with pytest.MonkeyPatch.context() as mp:
        if rank == 1:
            mp.setattr(FileChunkStore, "put", disk_full)
        for _ in range(ATTEMPTS):
            with pytest.raises(CheckpointingException, match="rank\\(s\\) 1"):
                # the failure is injected into chunk files' writes
                save(state(rank, world), target, overwrite=True, layout=PER_ARRAY)
    after = Held.now(Path(directory), sockets=True)
    save(state(rank, world), target, overwrite=True)
    return before.descriptors, after.descriptors, list(after.into)


def test_every_rank_releases_a_save_that_failed_on_one(tmp_path: Path) -> None:
    """Every rank holds a descriptor on the staging directory (the one it syncs
    through): all of them close it when one rank's write fails."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    for before, after, inside in run_distributed(_save_failing_on_rank_1, 2, str(directory)):
        assert inside == [] and after == before
    assert sorted(p.name for p in directory.iterdir()) == ["iter_0000007"]


def test_a_save_interrupted_by_an_exception_of_its_own_releases_everything(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Not a CheckpointingException (an interrupt, a bug in a strategy): every rank lets
    go of its descriptors and lock, nothing is deleted under ranks that may still write,
    and the next save removes the dead staging directory."""
    from shardstore.strategies.common import TorchCommonSaveStrategy

    target = tmp_path / "ckpt" / "iter_0000007"
    target.parent.mkdir()
    before = Held.now(tmp_path)

    def interrupted(*_: Any, **__: Any) -> None:
        raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TorchCommonSaveStrategy, "save_common", interrupted)
        for _ in range(ATTEMPTS):
            with pytest.raises(KeyboardInterrupt):
                save(state(), target, overwrite=True)
    gc.collect()
    assert_released(before, tmp_path)
    assert "was dropped before it was committed or abandoned" not in caplog.text  # released, not collected
    assert_next_save_succeeds(target)
    assert_released(before, tmp_path)
