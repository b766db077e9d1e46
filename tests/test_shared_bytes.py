"""Shared bytes are proven, not trusted (issue 41): a chunk an incremental save shares
with an earlier checkpoint is checked against the bytes the trainer handed over before
the commit binds it; a base that cannot serve a chunk costs that chunk a write, never
the save."""

from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path

import crc32c
import numpy as np
import pytest
import torch

from shardstore import CheckpointingException, ShardedTensor, load, save, verify
from shardstore.format.records import read_commit_record
from shardstore.stores.locations import open_location
from shardstore.tools.manager import CheckpointManager
from tests.scenarios import assert_bits_equal, global_tensor
from tests.test_incremental import BASE, _check, _same_crc32c_other_bytes, _state

CHUNK = Path("base") / "c.0.0"


def _flip_a_byte(path: Path, at: int = 100) -> None:
    """Bit rot in place: the file keeps its inode (and so every hard link to it)."""
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))


def _replace_with_other_bytes(path: Path) -> None:
    """What a save replacing the checkpoint does to a chunk: a new file (a new inode)
    with other values and a valid crc32c."""
    data = (np.frombuffer(path.read_bytes()[:-4], dtype=np.uint32) ^ 1).tobytes()
    path.unlink()
    path.write_bytes(data + crc32c.crc32c(data).to_bytes(4, "little"))


def _shares_inode(a: Path, b: Path) -> bool:
    return os.stat(a).st_ino == os.stat(b).st_ino


def _reused_chunks(ckpt: Path) -> int:
    reused = read_commit_record(open_location(ckpt)).reused_from
    return 0 if reused is None else reused.chunks


def test_an_unchanged_chunk_is_still_shared_once_proven(tmp_path: Path) -> None:
    save(_state(1), tmp_path / "s1")
    save(_state(2), tmp_path / "s2", reuse_from=tmp_path / "s1")
    assert _reused_chunks(tmp_path / "s2") == 1
    assert _shares_inode(tmp_path / "s1" / CHUNK, tmp_path / "s2" / CHUNK)


def test_a_rotted_chunk_of_the_base_is_written_not_shared(tmp_path: Path, caplog) -> None:
    save(_state(1), tmp_path / "s1")
    _flip_a_byte(tmp_path / "s1" / CHUNK)
    with caplog.at_level(logging.INFO, logger="shardstore"):
        save(_state(2), tmp_path / "s2", reuse_from=tmp_path / "s1")
    assert not _shares_inode(tmp_path / "s1" / CHUNK, tmp_path / "s2" / CHUNK)
    assert _reused_chunks(tmp_path / "s2") == 0
    _check(tmp_path / "s2", 2)
    assert verify(tmp_path / "s2").ok
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "does not hold the bytes being saved" in warnings[0].getMessage()
    assert f"shardstore verify {tmp_path / 's1'}" in warnings[0].getMessage()


def test_a_base_chunk_edited_with_its_crc32c_forged_is_written_not_shared(tmp_path: Path) -> None:
    """The crc32c (the file's own and the record's) still match: only a 128-bit digest
    of what the file holds now tells."""
    save(_state(1), tmp_path / "s1")
    chunk = tmp_path / "s1" / CHUNK
    stored = chunk.read_bytes()
    with open(chunk, "r+b") as f:  # in place, as rot or another tool would
        f.write(_same_crc32c_other_bytes(stored[:-4]))
    save(_state(2), tmp_path / "s2", reuse_from=tmp_path / "s1")
    assert _reused_chunks(tmp_path / "s2") == 0
    _check(tmp_path / "s2", 2)


def test_a_base_replaced_while_the_save_runs_is_not_shared(tmp_path: Path, monkeypatch) -> None:
    """Another job replaces step 1 after this save checked its save id and before it
    shares the chunks: the new files are not the trainer's bytes."""
    import shardstore.stores.local as local_io

    save(_state(1), tmp_path / "s1")
    original = local_io.FileChunkStore.share_from

    def replaced_first(self, source, rel, held):
        if (tmp_path / "s1" / CHUNK).stat().st_nlink == 1:  # not yet replaced or linked
            _replace_with_other_bytes(tmp_path / "s1" / CHUNK)
        return original(self, source, rel, held)

    monkeypatch.setattr(local_io.FileChunkStore, "share_from", replaced_first)
    save(_state(2), tmp_path / "s2", reuse_from=tmp_path / "s1")
    assert _reused_chunks(tmp_path / "s2") == 0
    _check(tmp_path / "s2", 2)


def test_a_base_whose_array_directory_is_a_symbolic_link_is_skipped(tmp_path: Path, caplog) -> None:
    """A large frozen array moved to another disk and linked back: the save writes it."""
    save(_state(1), tmp_path / "s1")
    moved = tmp_path / "other-disk" / "base"
    moved.parent.mkdir()
    shutil.move(tmp_path / "s1" / "base", moved)
    (tmp_path / "s1" / "base").symlink_to(moved)
    with caplog.at_level(logging.INFO, logger="shardstore"):
        save(_state(2), tmp_path / "s2", reuse_from=tmp_path / "s1")
    _check(tmp_path / "s2", 2)
    assert not (tmp_path / "s2" / "base").is_symlink()
    assert "symbolic link" in caplog.text


def test_an_error_of_the_base_storage_costs_a_write_not_the_save(tmp_path: Path, monkeypatch, caplog) -> None:
    import shardstore.stores.local as local_io

    def failing(source: str, target: str, nbytes: int) -> bool:
        raise OSError(errno.EIO, "Input/output error", source)

    save(_state(1), tmp_path / "s1")
    monkeypatch.setattr(local_io, "share_file", failing)
    with caplog.at_level(logging.INFO, logger="shardstore"):
        save(_state(2), tmp_path / "s2", reuse_from=tmp_path / "s1")
    _check(tmp_path / "s2", 2)
    assert "Input/output error" in caplog.text


def test_a_base_whose_record_cannot_be_read_is_skipped(tmp_path: Path, monkeypatch) -> None:
    import shardstore.format.reuse as reuse

    def unreadable(location):
        raise PermissionError(errno.EACCES, "Permission denied", location.describe())

    save(_state(1), tmp_path / "s1")
    monkeypatch.setattr(reuse, "read_commit_record", unreadable)
    save(_state(2), tmp_path / "s2", reuse_from=tmp_path / "s1")
    _check(tmp_path / "s2", 2)


def test_under_the_manager_a_rotted_step_costs_only_itself(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(1, _state(1))
    manager.wait_until_finished()
    _flip_a_byte(manager.location(1).local_path() / CHUNK)
    for step in (2, 3):
        manager.save(step, _state(step))
    manager.close()
    for step in (2, 3):
        _check(manager.location(step).local_path(), step)
        assert verify(manager.location(step)).ok
    # step 3 shares the chunk step 2 wrote anew
    assert _shares_inode(manager.location(2).local_path() / CHUNK, manager.location(3).local_path() / CHUNK)


def test_a_large_chunk_is_proven_across_read_blocks(tmp_path: Path, monkeypatch) -> None:
    """The check reads a shared file in blocks; a chunk longer than one block is hashed
    across them and still shared."""
    import shardstore.stores.local as local_io

    monkeypatch.setattr(local_io, "CHECK_READ_BYTES", 4096)
    base = global_tensor("base", BASE, torch.float32)
    for name in ("s1", "s2"):
        save({"base": ShardedTensor.from_rank_offsets("base", base)}, tmp_path / name,
             reuse_from=tmp_path / "s1" if name == "s2" else None)
    assert _reused_chunks(tmp_path / "s2") == 1
    loaded = load({"base": ShardedTensor.from_rank_offsets("base", torch.empty(BASE))}, tmp_path / "s2")
    assert_bits_equal(loaded["base"], base, "base")


@pytest.mark.parametrize("stored", ["longer", "shorter", "trailer"])
def test_the_proof_refuses_a_file_of_the_wrong_length_or_trailer(stored: str) -> None:
    from shardstore.format.chunks import HeldChunk, chunk_digest

    data = memoryview(bytes(range(256)) * 64)
    crc = crc32c.crc32c(data)
    held = HeldChunk(data, crc, chunk_digest(data))
    good = bytes(data) + crc.to_bytes(4, "little")
    assert held.holds([memoryview(good[:1000]), memoryview(good[1000:])])
    bad = {"longer": good + b"\0", "shorter": good[:-1], "trailer": good[:-1] + bytes([good[-1] ^ 1])}[stored]
    assert not held.holds([memoryview(bad)])


def test_the_manager_stops_choosing_a_base_whose_save_failed(tmp_path: Path, monkeypatch, caplog) -> None:
    import shardstore.format.reuse as reuse

    manager = CheckpointManager(tmp_path)
    manager.save(1, _state(1))
    original = reuse.ChunkReuse.sharer
    monkeypatch.setattr(reuse.ChunkReuse, "sharer", lambda self, target: (_ for _ in ()).throw(RuntimeError("bug")))
    with caplog.at_level(logging.WARNING, logger="shardstore"), pytest.raises(Exception, match="bug"):
        manager.save(2, _state(2))
    assert "do not share chunks with step 1" in caplog.text
    monkeypatch.setattr(reuse.ChunkReuse, "sharer", original)
    manager.save(3, _state(3))
    assert read_commit_record(manager.location(3)).reused_from is None  # neither step 1 nor an older one
    manager.save(4, _state(4))
    manager.close()
    assert read_commit_record(manager.location(4)).reused_from.save_id == read_commit_record(
        manager.location(3)).save_id  # a newer committed step serves again
    _check(manager.location(3).local_path(), 3)


def test_the_manager_verify_names_every_step_sharing_a_damaged_file(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    for step in (1, 2, 3):
        manager.save(step, _state(step))
    manager.close()
    assert manager.verify().ok
    _flip_a_byte(manager.location(1).local_path() / CHUNK)  # one inode, linked by all three steps
    report = manager.verify()
    assert not report.ok
    names = tuple(manager.options.step_name(s) for s in (1, 2, 3))
    assert [(d.key, d.part, d.checkpoints) for d in report.damage] == [("base", "c.0.0", names)]
    assert "one file shared by 3 checkpoints" in str(report)


def test_verify_of_a_root_keeps_unshared_damage_apart(tmp_path: Path) -> None:
    from shardstore.tools.root_verify import verify_root

    save(_state(1), tmp_path / "a")
    save(_state(2), tmp_path / "b")  # no reuse: nothing shared
    (tmp_path / "notes").mkdir()
    for name in ("a", "b"):
        _flip_a_byte(tmp_path / name / CHUNK)
    report = verify_root(tmp_path)
    assert sorted(report.reports) == ["a", "b"]
    assert sorted(d.checkpoints for d in report.damage) == [("a",), ("b",)]


def test_verify_of_a_root_names_the_leftovers_of_interrupted_saves_unchecked(tmp_path: Path) -> None:
    """An old checkpoint a replacement set aside (``.a.shardstore-replaced-<id>``), half
    moved, was verified as a checkpoint of the root and reported as damage, which a
    cleanup script answers by deleting it, though it may be the last copy. Leftovers of
    interrupted saves are now named, not verified; the root's checkpoints still are."""
    import shutil

    from shardstore.format import REPLACED_TAG, read_commit_record
    from shardstore.opened import bare_location
    from shardstore.tools.root_verify import verify_root

    save(_state(1), tmp_path / "a")
    save_id = read_commit_record(bare_location(tmp_path / "a")).save_id
    aside = tmp_path / f".a{REPLACED_TAG}{save_id}"
    shutil.copytree(tmp_path / "a", aside)
    (aside / CHUNK).unlink()  # moved back already
    report = verify_root(tmp_path)
    assert sorted(report.reports) == ["a"] and report.ok
    assert report.leftovers == (aside.name,)
    assert f"left by interrupted saves, not checked: {aside.name}" in str(report)
    _flip_a_byte(tmp_path / "a" / CHUNK)
    assert not verify_root(tmp_path).ok


def test_the_cli_verifies_a_root_and_names_the_steps_sharing_a_damaged_file(tmp_path: Path) -> None:
    import json
    import sys

    from tests import forked_python

    manager = CheckpointManager(tmp_path)
    for step in (1, 2):
        manager.save(step, _state(step))
    manager.close()
    command = [sys.executable, "-m", "shardstore.tools.cli", "verify", str(tmp_path)]
    assert forked_python.run(command).returncode == 0
    _flip_a_byte(manager.location(1).local_path() / CHUNK)
    text = forked_python.run(command)
    assert text.returncode == 1, text.stderr
    names = [manager.options.step_name(s) for s in (1, 2)]
    assert f"base [c.0.0] in {names[0]}, {names[1]} (one file shared by 2 checkpoints)" in text.stdout
    document = json.loads(forked_python.run([*command, "--json"]).stdout)
    assert document["ok"] is False and document["damage"][0]["checkpoints"] == names
    assert sorted(document["checkpoints"]) == names


def test_a_base_chunk_of_the_wrong_size_is_reported_as_damage(tmp_path: Path, caplog) -> None:
    save(_state(1), tmp_path / "s1")
    chunk = tmp_path / "s1" / CHUNK
    os.truncate(chunk, chunk.stat().st_size - 1)
    with caplog.at_level(logging.INFO, logger="shardstore"):
        save(_state(2), tmp_path / "s2", reuse_from=tmp_path / "s1")
    _check(tmp_path / "s2", 2)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "not the" in warnings[0] and "shardstore verify" in warnings[0], warnings
    assert ".shardstore-save-" not in warnings[0]  # names the checkpoints, not the staging directory


def test_the_manager_verify_covers_a_step_whose_record_is_damaged(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    for step in (1, 2):
        manager.save(step, _state(step))
    manager.close()
    (manager.location(2).local_path() / "zarr.json").write_bytes(b"{not json")
    report = manager.verify()
    assert not report.ok and manager.options.step_name(2) in report.reports


def test_the_megatron_guard_lets_a_scheme_shardstore_cannot_open_through(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core.dist_checkpointing.strategies.common", reason="megatron-core not installed")
    from shardstore.engine.walk import (
        holds_committed_checkpoint as _holds_a_committed_checkpoint,
    )

    assert not _holds_a_committed_checkpoint("msc://profile/ckpt/iter_0000001")
    assert not _holds_a_committed_checkpoint(tmp_path / "empty")
    save(_state(1), tmp_path / "s1")
    assert _holds_a_committed_checkpoint(tmp_path / "s1")


def test_a_base_that_cannot_serve_is_logged_at_the_documented_levels(tmp_path: Path, monkeypatch, caplog) -> None:
    """docs/guide/incremental.md said every failure to share but damage is logged at
    INFO; an error of the base's storage (here EIO) is a WARNING, as it should be: a
    disk that answers EIO wants attention. Only a storage that cannot share at all (no
    link, clone or copy; the chunk gone) is INFO. The page now says so."""
    import shardstore.stores.local as local_io

    def levels(share_file) -> set[int]:
        caplog.clear()
        monkeypatch.setattr(local_io, "share_file", share_file)
        with caplog.at_level(logging.INFO, logger="shardstore"):
            save(_state(2), tmp_path / "s2", reuse_from=tmp_path / "s1", overwrite=True)
        _check(tmp_path / "s2", 2)
        return {r.levelno for r in caplog.records if "share" in r.getMessage() and "base" in r.getMessage()}

    def failing(source: str, target: str, nbytes: int) -> bool:
        raise OSError(errno.EIO, "Input/output error", source)

    save(_state(1), tmp_path / "s1")
    assert levels(failing) == {logging.WARNING}
    assert levels(lambda source, target, nbytes: False) == {logging.INFO}
    docs = (Path(__file__).parents[1] / "docs" / "guide" / "incremental.md").read_text()
    assert "WARNING for damage (naming `shardstore verify`), INFO otherwise" not in " ".join(docs.split())


def _guard_with_a_failing_check(rank: int, world: int, path: str) -> str:
    import shardstore.engine.walk as checkpoint_dirs

    def failing(location) -> bool:
        raise PermissionError(13, "Permission denied", path)

    if rank == 0:
        checkpoint_dirs.is_committed = failing
    try:
        checkpoint_dirs.holds_committed_checkpoint(path)
    except CheckpointingException as exc:
        return str(exc)
    return "no error"


def test_the_megatron_guard_fails_on_every_rank_when_the_coordinators_check_fails(tmp_path: Path) -> None:
    """The coordinator alone checks whether the directory holds a committed checkpoint;
    where that check raised (a permission error, an S3 error other than 404) it raised on
    the coordinator only, and every other rank waited in the broadcast until the
    collective timeout. Now every rank raises, naming the directory and the error."""
    from tests.dist import run_distributed

    errors = run_distributed(_guard_with_a_failing_check, 2, str(tmp_path / "ckpt"))
    assert all("Could not tell whether" in e and "Permission denied" in e for e in errors), errors
