"""The fault attacks of the per-array layout (a failing or full disk, a killed writer,
bytes changed during an async save, damaged bytes, one rank's failure, a spawned
writer) run against packed saves (``packs/<rank>-<n>.zip``, the default layout's small
arrays): a pack that is not whole is never committed, the error names the checkpoint,
an earlier checkpoint at the same place is kept, and the next save works."""

from __future__ import annotations

import errno
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from shardstore import CheckpointingException, ShardedTensor, load, save, verify
from shardstore.format import is_committed
from shardstore.format.records import read_commit_record
from shardstore.stores.local import FileChunkStore
from shardstore.stores.locations import open_location
from shardstore.tools.manager import CheckpointManager, CheckpointManagerOptions
from tests.forked_python import ForkedPython

# Six arrays of 400-420 bytes: all packed by the default layout, into one pack per rank.
_KEYS = [f"layer{i}/w" for i in range(6)]


def _tensors(value: float, rank: int = 0) -> dict[str, torch.Tensor]:
    return {f"r{rank}/{k}" if rank else k: torch.arange(100.0 + i) + value for i, k in enumerate(_KEYS)}


def _sd(tensors: dict[str, torch.Tensor], empty: bool = False) -> dict[str, ShardedTensor]:
    return {k: ShardedTensor.from_rank_offsets(k, torch.empty_like(t) if empty else t, replica_id=0)
            for k, t in tensors.items()}


def _loaded(path: str | Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return dict(load(_sd(like, empty=True), str(path)))


def _assert_holds(path: str | Path, tensors: dict[str, torch.Tensor]) -> None:
    """``path`` is committed, verifies and loads ``tensors`` bit for bit, from packs."""
    location = open_location(str(path))
    assert is_committed(location) and set(read_commit_record(location).packed_arrays) == set(tensors)
    assert verify(path).ok
    loaded = _loaded(path, tensors)
    assert [k for k, t in tensors.items() if not torch.equal(loaded[k], t)] == []


def _assert_not_committed(path: Path, like: dict[str, torch.Tensor]) -> None:
    """Nothing at ``path`` looks like a checkpoint: load and verify refuse it, naming it."""
    assert not (path.exists() and is_committed(open_location(str(path))))
    with pytest.raises(CheckpointingException, match=str(path)):
        _loaded(path, like)
    if path.exists():
        assert not verify(path).ok


def _packs_fail(monkeypatch: pytest.MonkeyPatch, when: str = "always") -> list[str]:
    """Each pack's write writes half of its pieces, then fails with ENOSPC (as a disk
    filling up would); chunk files of arrays that are not packed are written. Returns
    the packs tried."""
    real, tried = FileChunkStore.put, []

    def put(self: FileChunkStore, rel: str, buffers):  # noqa: ANN001, ANN202
        if not rel.startswith("packs/"):
            return real(self, rel, buffers)
        tried.append(rel)
        pieces = list(buffers)
        real(self, rel, pieces[: len(pieces) // 2])
        raise OSError(errno.ENOSPC, "No space left on device", self.describe(rel))

    monkeypatch.setattr(FileChunkStore, "put", put)
    return tried


# ------------------------------------------------------------ 1. a pack write that fails


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_failing_pack_write_fails_the_save_and_keeps_the_checkpoint_it_replaces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str,
) -> None:
    ckpt = tmp_path / "ckpt"
    old, new = _tensors(1.0), _tensors(2.0)
    save(_sd(old), str(ckpt))
    tried = _packs_fail(monkeypatch)
    with pytest.raises(CheckpointingException, match=rf"(?s){ckpt}.*No space left on device.*packs/0-0\.zip"):
        if mode == "sync":
            save(_sd(new), str(ckpt), overwrite=True)
        else:
            request = save(_sd(new), str(ckpt), overwrite=True, async_sharded_save=True)
            for t in new.values():
                t.add_(100)  # the snapshot is written, not the tensors
            request.execute_sync()
    assert tried == ["packs/0-0.zip"]
    _assert_holds(ckpt, old)  # untouched: the old checkpoint, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # the half pack went with its staging directory
    monkeypatch.undo()
    save(_sd(_tensors(3.0)), str(ckpt), overwrite=True)
    _assert_holds(ckpt, _tensors(3.0))


def test_a_failing_pack_write_in_a_managed_save_keeps_the_earlier_step(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    manager = CheckpointManager(tmp_path, CheckpointManagerOptions(max_to_keep=1))
    manager.save(1, _sd(_tensors(1.0)))
    _packs_fail(monkeypatch)
    with pytest.raises(CheckpointingException, match=r"iter_0000002.*No space left on device"):
        manager.save(2, _sd(_tensors(2.0)))
    _assert_not_committed(tmp_path / "iter_0000002", _tensors(2.0))
    assert manager.all_steps() == [1]
    _assert_holds(tmp_path / "iter_0000001", _tensors(1.0))
    monkeypatch.undo()
    manager.save(2, _sd(_tensors(2.0)))
    assert manager.all_steps() == [2]
    _assert_holds(tmp_path / "iter_0000002", _tensors(2.0))


def test_a_pack_that_fills_a_real_disk_fails_the_save_without_commit(tiny_tmpfs: Path) -> None:
    """A 1 MiB tmpfs: the small checkpoint fits, the second save's pack (40 arrays of
    40 KiB, packed together) does not."""
    ckpt = tiny_tmpfs / "ckpt"
    save(_sd(_tensors(1.0)), str(ckpt))
    many = {f"a{i}": torch.full((10_000,), float(i)) for i in range(40)}
    with pytest.raises(CheckpointingException, match=rf"(?s){tiny_tmpfs / 'big'}.*No space left on device"):
        save(_sd(many), str(tiny_tmpfs / "big"))
    _assert_not_committed(tiny_tmpfs / "big", many)
    assert sorted(p.name for p in tiny_tmpfs.iterdir()) == ["ckpt"]
    _assert_holds(ckpt, _tensors(1.0))
    save(_sd(_tensors(2.0)), str(tiny_tmpfs / "big"))  # the space came back
    _assert_holds(tiny_tmpfs / "big", _tensors(2.0))


# ------------------------------------------------------------ 2. a writer killed while it writes a pack

_KILLED_WRITER = """
import sys, time
from pathlib import Path
import torch
from shardstore import ShardedTensor, save
from shardstore.stores.local import FileChunkStore

ckpt, ready = sys.argv[1], Path(sys.argv[2])
real = FileChunkStore.put

def put(self, rel, buffers):
    if not rel.startswith("packs/"):
        return real(self, rel, buffers)
    pieces = list(buffers)
    real(self, rel, pieces[: len(pieces) // 2])  # half the pack is on disk
    ready.write_text(self.describe(rel))
    time.sleep(120)  # killed here

FileChunkStore.put = put
tensors = {f"layer{i}/w": torch.arange(100.0 + i) + 2.0 for i in range(6)}
save({k: ShardedTensor.from_rank_offsets(k, t, replica_id=0) for k, t in tensors.items()}, ckpt, overwrite=True)
"""


@pytest.mark.parametrize("before", ["nothing", "a checkpoint"])
def test_a_writer_killed_while_writing_a_pack_commits_nothing_and_the_next_save_works(
    tmp_path: Path, before: str,
) -> None:
    ckpt, ready = tmp_path / "ckpt", tmp_path / "ready"
    if before == "a checkpoint":
        save(_sd(_tensors(1.0)), str(ckpt))
    writer = ForkedPython([sys.executable, "-c", _KILLED_WRITER, str(ckpt), str(ready)])
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            try:
                code = writer.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                assert time.monotonic() < deadline, "the writer never reached its pack"
                continue
            raise AssertionError(f"the writer ended ({code}) before its pack: {writer.stderr.read().decode()}")
        half = Path(ready.read_text())
        assert half.name == "0-0.zip" and half.stat().st_size > 0
        writer.send_signal(signal.SIGKILL)
        assert writer.wait(timeout=60) == -signal.SIGKILL
    finally:
        writer.kill()
    if before == "a checkpoint":
        _assert_holds(ckpt, _tensors(1.0))  # still the old one, whole
    else:
        _assert_not_committed(ckpt, _tensors(2.0))
    save(_sd(_tensors(3.0)), str(ckpt), overwrite=True)
    _assert_holds(ckpt, _tensors(3.0))
    assert not half.exists(), "the killed save's half pack was kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "ready"]
