"""Atomic commit under crashes (issue 7, point 1) and durability order (point 2).

One rank is SIGKILLed at several points of a 2-rank save. Every time: no commit
record, load refuses with "incomplete", an earlier checkpoint elsewhere still loads
bit-exact, a new save into the same directory succeeds, and the surviving rank fails
with a clear error within a bounded time instead of hanging.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from shardstore import CheckpointingException, ShardedObject, ShardedTensor, load, save
from shardstore.format.records import is_committed
from shardstore.stores.local import LocalStore
from shardstore.stores.locations import open_location
from tests.dist import run_distributed
from tests.scenarios import assert_bits_equal, global_tensor

SHAPE = (32, 24)
SURVIVOR_DEADLINE = 30.0  # seconds the surviving rank may take to give up


def _sd(rank: int, world: int, empty: bool = False, shift: float = 0.0) -> dict:
    sd = {}
    for name, dtype in (("w", torch.float32), ("e", torch.bfloat16)):
        full = global_tensor(name, SHAPE, dtype)
        part = (full + shift if shift else full).chunk(world)[rank]
        sd[name] = ShardedTensor.from_rank_offsets(name, torch.empty_like(part) if empty else part.clone(), (0, rank, world))
    sd["rng"] = ShardedObject("rng", torch.tensor([rank]), (world,), (rank,))
    return sd


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(point: str) -> None:
    """Makes this process kill itself at ``point`` of the next save."""
    import shardstore.execution.save as save_execution
    import shardstore.format.chunks as chunk_io

    if point == "before data writes":
        save_execution.write_ops = lambda *a, **k: _die()
    elif point == "during data writes":
        original = chunk_io.ChunkFile.write

        def write_one_then_die(self, data):
            original(self, data)  # some chunks are on disk, others are not
            _die()

        chunk_io.ChunkFile.write = write_one_then_die
    elif point == "after data writes":
        original_durable = LocalStore.make_durable

        def durable_then_die(self):
            original_durable(self)
            _die()

        LocalStore.make_durable = durable_then_die
    elif point == "just before commit":
        import shardstore.format.commit as commit

        commit.PendingCheckpoint.commit = lambda *a, **k: _die()
    else:
        raise ValueError(point)


def save_with_a_crash(rank: int, world: int, ckpt: str, point: str, victim: int, overwrite: bool) -> tuple[str, float]:
    if rank == victim:
        _arm(point)
    start = time.monotonic()
    try:
        save(_sd(rank, world, shift=1.0), ckpt, overwrite=overwrite)
    except CheckpointingException as exc:
        return str(exc), time.monotonic() - start
    raise AssertionError("the surviving rank's save returned normally")


def plain_save(rank: int, world: int, ckpt: str) -> None:
    save(_sd(rank, world), ckpt)


def check_load(rank: int, world: int, ckpt: str) -> None:
    loaded = load(_sd(rank, world, empty=True), ckpt)
    for name, dtype in (("w", torch.float32), ("e", torch.bfloat16)):
        assert_bits_equal(loaded[name], global_tensor(name, SHAPE, dtype).chunk(world)[rank], name)


CRASH_POINTS = [
    ("before data writes", 1),
    ("during data writes", 1),
    ("after data writes", 0),
    ("just before commit", 0),  # rank 0 is the coordinator that would commit
]


@pytest.mark.parametrize("point, victim", CRASH_POINTS)
def test_killed_rank_leaves_no_committed_checkpoint(tmp_path: Path, point: str, victim: int) -> None:
    previous, ckpt = tmp_path / "previous", tmp_path / "ckpt"
    run_distributed(plain_save, 2, str(previous))

    results = run_distributed(save_with_a_crash, 2, str(ckpt), point, victim, False, killed=(victim,))
    message, seconds = results[1 - victim]
    assert "rank" in message.lower() or "lost contact" in message.lower(), message
    assert seconds < SURVIVOR_DEADLINE, f"survivor took {seconds:.1f}s to fail"

    assert not is_committed(open_location(ckpt))
    with pytest.raises(CheckpointingException, match="incomplete|not a distributed checkpoint|does not exist"):
        load(_sd(0, 1, empty=True), ckpt)
    run_distributed(check_load, 2, str(previous))  # the earlier checkpoint is untouched
    run_distributed(plain_save, 2, str(ckpt))  # and the directory can be saved into again
    run_distributed(check_load, 2, str(ckpt))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "previous"], "dead save's staging not cleared"


@pytest.mark.parametrize("point, victim", CRASH_POINTS)
def test_killed_overwrite_keeps_the_old_checkpoint_loadable(tmp_path: Path, point: str, victim: int) -> None:
    ckpt = tmp_path / "ckpt"
    run_distributed(plain_save, 2, str(ckpt))
    results = run_distributed(save_with_a_crash, 2, str(ckpt), point, victim, True, killed=(victim,))
    assert results[1 - victim][1] < SURVIVOR_DEADLINE
    run_distributed(check_load, 2, str(ckpt))  # still the old values, bit-exact
    run_distributed(plain_save_overwrite, 2, str(ckpt))
    run_distributed(check_load, 2, str(ckpt))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def plain_save_overwrite(rank: int, world: int, ckpt: str) -> None:
    save(_sd(rank, world), ckpt, overwrite=True)


def test_data_is_made_durable_before_the_commit_record(ckpt_dir: Path, monkeypatch) -> None:
    import shardstore.format.chunks as chunk_io
    import shardstore.stores.local as storage

    events: list[str] = []
    real_syncfs, real_write_atomic = storage._syncfs, storage.LocalStore.put_atomic
    real_begin, real_write = storage.LocalStore.begin_writes, chunk_io.ChunkFile.write

    def begin(self):
        real_begin(self)
        events.append(f"opened fd {self._sync_fd}")

    monkeypatch.setattr(storage.LocalStore, "begin_writes", begin)
    monkeypatch.setattr(chunk_io.ChunkFile, "write", lambda self, data: (events.append("chunk"), real_write(self, data))[1])
    monkeypatch.setattr(storage, "_syncfs", lambda fd, path: (events.append(f"syncfs fd {fd}"), real_syncfs(fd, path)))
    monkeypatch.setattr(storage.LocalStore, "put_atomic",
                        lambda self, rel, data: (events.append(f"atomic {rel}"), real_write_atomic(self, rel, data)))
    save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}, ckpt_dir)
    opened = next(e for e in events if e.startswith("opened fd"))
    # errseq: write-back errors reach a descriptor only if opened before them
    assert events.index(opened) < events.index("chunk") < events.index("syncfs" + opened[len("opened"):]), events
    assert events.index("syncfs" + opened[len("opened"):]) < events.index("atomic zarr.json"), events
    assert not list(ckpt_dir.glob(".zarr.json.*")), "temp file of the atomic write left behind"


def test_files_follow_the_umask(ckpt_dir: Path) -> None:
    old = os.umask(0o022)
    try:
        save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}, ckpt_dir)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in ckpt_dir.iterdir() if p.is_file()}
    assert modes["zarr.json"] == modes["common.pt"] == 0o644, modes


def test_fsync_can_be_turned_off(ckpt_dir: Path, monkeypatch) -> None:
    import shardstore.stores.local as storage

    calls: list[Path] = []
    monkeypatch.setattr(storage, "_syncfs", calls.append)
    monkeypatch.setattr(storage.os, "fsync", lambda fd: calls.append(fd))
    save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}, open_location(ckpt_dir, fsync=False))
    assert calls == []
    assert is_committed(open_location(ckpt_dir))



def async_save_beside_another_programs_file_then_die(rank: int, world: int, ckpt: str) -> None:
    """An async save into an empty directory, another program's file written there
    before it commits; the coordinator dies while it moves its entries in beside that
    file, before the commit record (``ByRename._publish_beside``)."""
    from shardstore.strategies.async_utils import AsyncCallsQueue

    original = LocalStore.move_entries_into

    def move_then_die(self, target, names):
        if names == ["zarr.json"]:
            _die()  # everything but the commit record is in place
        original(self, target, names)

    LocalStore.move_entries_into = move_then_die
    request = save(_sd(rank, world), ckpt, async_sharded_save=True, shared_directory=True)
    Path(ckpt, "modelopt_run_config.yaml").write_text("theirs")
    queue = AsyncCallsQueue()
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True)
    raise AssertionError("the save committed")


def test_killed_while_publishing_beside_another_programs_files(tmp_path: Path) -> None:
    """No commit record, nothing of the other program's touched, and no later save
    deletes what is there: it names the files instead (the moved entries are no longer
    provably ours). The dead save's staging directory is cleared as usual."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    run_distributed(async_save_beside_another_programs_file_then_die, 1, str(ckpt), killed=(0,))
    assert not is_committed(open_location(ckpt))
    assert (ckpt / "modelopt_run_config.yaml").read_text() == "theirs"
    with pytest.raises(CheckpointingException, match="incomplete|not a distributed checkpoint"):
        load(_sd(0, 1, empty=True), ckpt)
    before = sorted(p.relative_to(ckpt) for p in ckpt.rglob("*"))
    with pytest.raises(CheckpointingException, match="holds no committed shardstore checkpoint.*modelopt_run_config"):
        save(_sd(0, 1), ckpt, overwrite=True)
    assert sorted(p.relative_to(ckpt) for p in ckpt.rglob("*")) == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"], "dead save's staging not cleared"


def replace_beside_another_programs_files_then_die(rank: int, world: int, ckpt: str) -> str:
    """A 2-rank checkpoint saved into a shared directory, another program's files put into
    it, then a second save replacing it there; the coordinator is SIGKILLed in the window,
    after the old record and entries were set aside and one new entry moved in."""
    import shardstore.stores.local as local_backend

    save(_sd(rank, world), ckpt, shared_directory=True)
    if rank == 0:
        Path(ckpt, "modelopt_run_config.yaml").write_text("theirs")
        Path(ckpt, "modelopt_state").mkdir()
        Path(ckpt, "modelopt_state", "common.pt").write_text("theirs too")
    torch.distributed.barrier()
    original, renames = local_backend._rename_no_replace, []

    def rename_then_die(source: Path, destination: Path) -> None:
        renames.append(source)
        if len(renames) == 8:  # the record, 5 old entries (__objects__, common.pt, e, metadata.json, w), 1 new one
            _die()
        original(source, destination)

    local_backend._rename_no_replace = rename_then_die
    try:
        save(_sd(rank, world, shift=1.0), ckpt, shared_directory=True, overwrite=True)
    except CheckpointingException as exc:  # the survivor: its coordinator died
        return str(exc)
    raise AssertionError("the save committed")


def test_killed_while_replacing_beside_another_programs_files(tmp_path: Path) -> None:
    """Between the old record moving out and the new one moving in, no checkpoint loads
    there: the error names what happened and what to do; the other program's files are
    untouched; ``shardstore restore`` puts the old checkpoint back, bit for bit; the next
    save replaces it and leaves nothing next to it."""
    from click.testing import CliRunner

    from shardstore.tools.cli import main

    ckpt = tmp_path / "iter_0000100"

    def _tensors() -> dict:
        return {k: v for k, v in _sd(0, 1, empty=True).items() if k != "rng"}

    survivor = run_distributed(replace_beside_another_programs_files_then_die, 2, str(ckpt), killed=(0,))[1]
    assert "not committed" in survivor, survivor
    assert not is_committed(open_location(ckpt))
    with pytest.raises(CheckpointingException, match=r"was interrupted .*`shardstore restore "):
        load(_tensors(), ckpt)
    result = CliRunner().invoke(main, ["--no-progress", "restore", str(ckpt)])
    assert result.exit_code == 0 and "put back" in result.output, result.output
    loaded = load(_tensors(), ckpt)
    assert_bits_equal(loaded["w"], global_tensor("w", SHAPE, torch.float32))
    assert (ckpt / "modelopt_run_config.yaml").read_text() == "theirs"
    assert (ckpt / "modelopt_state" / "common.pt").read_text() == "theirs too"
    save(_sd(0, 1, shift=1.0), ckpt, shared_directory=True, overwrite=True)
    assert_bits_equal(load(_tensors(), ckpt)["w"], global_tensor("w", SHAPE, torch.float32) + 1.0)
    assert (ckpt / "modelopt_state" / "common.pt").read_text() == "theirs too"
    assert [p.name for p in tmp_path.iterdir()] == ["iter_0000100"], "leftovers not cleared"


def _die_at_the_atomic_rename_of(name: str) -> None:
    """Makes this process SIGKILL itself when ``LocalStore.put_atomic`` renames its
    temporary file onto ``name``: the temporary file is written and synced, the rename
    never happens."""
    import shardstore.stores.local as local_backend

    original = local_backend.os.replace

    def replace_or_die(source, destination):
        if os.path.basename(destination) == name:
            _die()
        original(source, destination)

    local_backend.os.replace = replace_or_die


def delete_step_then_die(rank: int, world: int, root: str) -> None:
    from shardstore.format.records import DELETION_MARKER
    from shardstore.tools.manager import CheckpointManager, CheckpointManagerOptions

    manager = CheckpointManager(root, CheckpointManagerOptions(max_to_keep=5))
    _die_at_the_atomic_rename_of(DELETION_MARKER)
    manager.delete(0)
    raise AssertionError("the deletion went through")


def test_a_deletion_killed_while_writing_its_marker_leaves_the_step_whole(tmp_path: Path) -> None:
    """Killed while the manager writes its deletion marker (``put_atomic``: the temporary
    file written, not yet renamed), the step is still committed and whole. Before, the
    temporary file (``..shardstore-deleting.json.<hex>.tmp``) stayed in it: ``verify``
    reported it as a file the save did not write, ``save(overwrite=True)`` refused to
    replace the step, and a later deletion left the step's directory behind."""
    from shardstore import verify
    from shardstore.tools.manager import CheckpointManager, CheckpointManagerOptions

    options = CheckpointManagerOptions(max_to_keep=5)
    manager = CheckpointManager(tmp_path, options)
    for step in range(2):
        manager.save(step, _sd(0, 1, shift=float(step)))
    run_distributed(delete_step_then_die, 1, str(tmp_path), killed=(0,))

    manager = CheckpointManager(tmp_path, options)
    assert manager.all_steps() == [0, 1]
    step_dir = Path(manager.location(0).describe())
    assert verify(step_dir).ok, verify(step_dir)
    save(_sd(0, 1, shift=2.0), step_dir, overwrite=True)  # the step can be replaced
    check_load_shifted = load(_sd(0, 1, empty=True), step_dir)
    assert_bits_equal(check_load_shifted["w"], global_tensor("w", SHAPE, torch.float32) + 2.0, "w")
    manager.delete(0)
    assert not step_dir.exists(), sorted(p.name for p in step_dir.iterdir())


def save_killed_before_its_marker(rank: int, world: int, ckpt: str) -> None:
    """Dies right after making its staging directory, before the marker that names it."""
    import shardstore.format.commit.pending as pending

    pending._write_marker = lambda *args, **kwargs: _die()
    save(_sd(rank, world, shift=1.0), ckpt, overwrite=True, shared_directory=True)
    raise AssertionError("the save went on")


def remove_proven_then_die(rank: int, world: int, ckpt: str) -> None:
    """Saves, then dies when its staging directory, emptied and its marker gone, is about
    to go (the last ``rmdir`` of ``_remove_proven``)."""
    import shardstore.stores.local as local_backend

    original = local_backend.LocalStore.remove_directory

    def remove_then_die(self):
        if STAGING in self.root.name:
            for child in self.root.iterdir():
                child.unlink()  # the marker, the last entry left
            _die()
        original(self)

    local_backend.LocalStore.remove_directory = remove_then_die
    save(_sd(rank, world, shift=1.0), ckpt, overwrite=True, shared_directory=True)
    raise AssertionError("the save went on")


STAGING = ".shardstore-save-"


@pytest.mark.parametrize("killed", [save_killed_before_its_marker, remove_proven_then_die])
def test_an_empty_staging_directory_of_a_killed_save_is_removed_by_the_next_save(tmp_path: Path, killed) -> None:
    """A save killed between making its staging directory and writing its marker, or
    after removing its marker while it removed that directory, leaves the directory
    empty. Before, no later save removed it (no marker proves it a save's), and every
    load error of the directory named it as an unfinished save. An empty directory whose
    lock is free is removed now (``rmdir`` never removes a file)."""
    ckpt = tmp_path / "ckpt"
    save(_sd(0, 1), ckpt, shared_directory=True)
    (ckpt / "modelopt_run_config.yaml").write_text("theirs")
    run_distributed(killed, 1, str(ckpt), killed=(0,))
    left = [p for p in tmp_path.iterdir() if STAGING in p.name]
    assert len(left) == 1 and not any(left[0].iterdir()), left
    save(_sd(0, 1, shift=2.0), ckpt, overwrite=True, shared_directory=True)
    assert_bits_equal(load(_sd(0, 1, empty=True), ckpt)["w"], global_tensor("w", SHAPE, torch.float32) + 2.0, "w")
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"], "the empty staging directory was left"
