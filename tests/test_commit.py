"""The commit record: incomplete checkpoints are refused; metadata from one read
(issue 3, points 7 and 8)."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from shardstore import (
    CheckpointingException,
    ShardedObject,
    ShardedTensor,
    StorageLayout,
    load,
    load_sharded_metadata,
    load_tensors_metadata,
    remove_sharded_tensors,
    save,
    verify,
)
from shardstore.core import check_is_distributed_checkpoint
from shardstore.format.records import (
    COMMIT_RECORD,
    DELETION_MARKER,
    REPLACED_TAG,
    SAVE_MARKER,
    STAGING_TAG,
    is_committed,
    read_commit_record,
)
from shardstore.format.records.claim_document import ABANDONED, ClaimDocument
from shardstore.stores import local as local_backend
from shardstore.stores.base import StorageError
from shardstore.stores.local import LocalStore
from shardstore.stores.locations import open_location
from shardstore.stores.memory import MemoryStore

# these tests name, remove or add files inside an array's own directory
PER_ARRAY = StorageLayout(pack_arrays_up_to=0)


def _save_small(ckpt: Path, layout: StorageLayout | None = None) -> None:
    save({"w": ShardedTensor.from_rank_offsets("enc/w", torch.arange(12.0).reshape(3, 4)),
          "b": ShardedTensor.from_rank_offsets("enc/b", torch.ones(5, dtype=torch.bfloat16)),
          "x": ShardedTensor.from_rank_offsets("x", torch.zeros(2, 2, 2, dtype=torch.int8))}, ckpt, layout=layout)


def test_directory_without_commit_record_is_refused_as_incomplete(ckpt_dir: Path) -> None:
    _save_small(ckpt_dir)
    (ckpt_dir / "zarr.json").unlink()
    assert check_is_distributed_checkpoint(ckpt_dir)  # metadata.json alone does not make it complete
    request = {"w": ShardedTensor.from_rank_offsets("enc/w", torch.empty(3, 4))}
    with pytest.raises(CheckpointingException, match="incomplete"):
        load(request, ckpt_dir)
    with pytest.raises(CheckpointingException, match="incomplete"):
        load_tensors_metadata(ckpt_dir)


def test_an_empty_path_or_a_file_is_no_distributed_checkpoint(tmp_path: Path, monkeypatch) -> None:
    """As in Megatron-Core: False, not an error. Before, ``""`` looked in the current
    directory and a file raised a ``StorageError`` ("Not a directory")."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "metadata.json").write_text('{"sharded_backend": "zarr"}')
    assert not check_is_distributed_checkpoint("")
    a_file = tmp_path / "model.pt"
    a_file.write_bytes(b"not a checkpoint")
    assert not check_is_distributed_checkpoint(a_file)
    assert not check_is_distributed_checkpoint(str(a_file))


def test_the_core_reads_the_config_at_a_location_and_megatrons_names_take_a_directory(tmp_path: Path) -> None:
    """Issue 66.1: the format reads ``metadata.json`` at a Location (``read_config``);
    Megatron-Core's functions of a checkpoint directory, ``maybe_load_config`` and
    ``check_is_distributed_checkpoint``, are its dialect's (``shardstore.core``)."""
    import shardstore
    import shardstore.core
    import shardstore.format
    from shardstore.format import read_config

    (tmp_path / "metadata.json").write_text('{"sharded_backend": "zarr"}')
    assert read_config(open_location(tmp_path)).sharded_backend == "zarr"
    assert read_config(open_location(tmp_path / "metadata.json")) is None  # a file: no checkpoint
    assert shardstore.core.maybe_load_config(str(tmp_path)) == read_config(open_location(tmp_path))
    assert shardstore.check_is_distributed_checkpoint is shardstore.core.check_is_distributed_checkpoint
    assert not {"maybe_load_config", "check_is_distributed_checkpoint"} & set(shardstore.format.__all__)


def test_load_tensors_metadata_needs_only_the_root_record(ckpt_dir: Path) -> None:
    _save_small(ckpt_dir)
    for child in ckpt_dir.iterdir():  # leave only the commit record and the config
        if child.name not in ("zarr.json", "metadata.json"):
            shutil.rmtree(child) if child.is_dir() else child.unlink()
    metadata = load_tensors_metadata(ckpt_dir)
    assert {k: (v.global_shape, v.dtype) for k, v in metadata.items()} == {
        "enc/w": ((3, 4), torch.float32),
        "enc/b": ((5,), torch.bfloat16),
        "x": ((2, 2, 2), torch.int8),
    }
    assert all(v.data is None for v in metadata.values())


def test_saving_over_a_committed_checkpoint_needs_overwrite(ckpt_dir: Path) -> None:
    _save_small(ckpt_dir)
    with pytest.raises(CheckpointingException, match="overwrite=True"):
        _save_small(ckpt_dir)
    save({"y": ShardedTensor.from_rank_offsets("y", torch.ones(1))}, ckpt_dir, overwrite=True)
    assert set(load_sharded_metadata(ckpt_dir)) == {"y"}
    assert not (ckpt_dir / "enc").exists(), "the old arrays are gone"


def test_leftovers_of_an_interrupted_save_are_cleared(ckpt_dir: Path) -> None:
    _save_small(ckpt_dir)
    dead = ckpt_dir.parent / ".ckpt.shardstore-save-0123abcd"  # what a save that died leaves
    shutil.copytree(ckpt_dir, dead)
    (dead / ".shardstore-save.json").write_text('{"save_id": "0123abcd"}')
    save({"y": ShardedTensor.from_rank_offsets("y", torch.ones(1))}, ckpt_dir, overwrite=True)
    assert set(load_tensors_metadata(ckpt_dir)) == {"y"}
    assert not dead.exists()


def _leave_own_marker(where: Path | str, name: str = SAVE_MARKER, save_id: str | None = None) -> None:
    """What a crash right after the publishing rename (before the marker's removal), or
    after the in-place commit record's PUT (before the marker's DELETE), leaves: a
    committed checkpoint that still holds a marker, naming its own save by default."""
    location = open_location(where)
    save_id = save_id or read_commit_record(location).save_id
    location.write_bytes(name, json.dumps({"step": 1, "save_id": save_id}).encode())


def test_own_marker_left_in_a_committed_local_checkpoint_does_not_block_overwrite(ckpt_dir: Path) -> None:
    """The save's own marker, left in the checkpoint it committed, was counted as a file
    its save did not write: every overwrite was refused ("holds files its save did not
    write"), though the marker names the record's own save id."""
    _save_small(ckpt_dir)
    _leave_own_marker(ckpt_dir)
    save({"y": ShardedTensor.from_rank_offsets("y", torch.ones(1))}, ckpt_dir, overwrite=True)
    assert set(load_sharded_metadata(ckpt_dir)) == {"y"}
    assert not (ckpt_dir / SAVE_MARKER).exists()


def test_own_marker_left_in_a_committed_in_place_checkpoint_does_not_block_overwrite() -> None:
    """As on disk, in place (``memory://``, as on S3): the overwrite was refused."""
    url = "memory://commit-own-marker/ckpt"
    save({"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 3), 1.0))}, url)
    _leave_own_marker(url)
    save({"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 3), 2.0))}, url, overwrite=True)
    loaded = load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 3))}, url)
    assert torch.equal(loaded["w"], torch.full((4, 3), 2.0))
    assert not open_location(url).exists(SAVE_MARKER)


def test_in_place_overwrite_interrupted_while_deleting_the_old_checkpoint_is_recoverable(monkeypatch) -> None:
    """An in-place overwrite that fails while it deletes the old checkpoint's objects
    (S3 DeleteObjects errors after retries, Ctrl-C) gives its claim up: what is left
    stays proven a save's that is over, and the next save removes it and commits."""
    url = "memory://commit-interrupted-delete/ckpt"
    save({"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 3), 1.0))}, url)
    real_delete_many = MemoryStore.delete_many

    def fail_after_one(self: MemoryStore, keys: list[str]) -> None:
        real_delete_many(self, keys[:1])  # a first object went, then the service failed
        raise StorageError("DeleteObjects: InternalError (injected, after retries)")

    monkeypatch.setattr(MemoryStore, "delete_many", fail_after_one)
    with pytest.raises(StorageError, match="injected"):
        save({"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 3), 2.0))}, url, overwrite=True)
    monkeypatch.setattr(MemoryStore, "delete_many", real_delete_many)
    claim = ClaimDocument.parse(open_location(url).read_bytes(COMMIT_RECORD))
    assert claim is not None and claim.state == ABANDONED, "what the interrupted save left is proven a save's"
    with pytest.raises(CheckpointingException, match="ended without a commit"):
        load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 3))}, url)
    save({"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 3), 3.0))}, url, overwrite=True)
    loaded = load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 3))}, url)
    assert torch.equal(loaded["w"], torch.full((4, 3), 3.0))


def test_in_place_overwrite_interrupted_before_it_removed_anything_puts_the_old_record_back(monkeypatch) -> None:
    """Interrupted after its claim replaced the old record, before it removed anything
    (the listing failed): the old record is put back, so the old checkpoint still loads
    and verifies, and the next overwrite works."""
    url = "memory://commit-interrupted-record/ckpt"
    save({"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 3), 1.0))}, url)
    real_list = MemoryStore.list

    def fail_the_listing(self: MemoryStore, prefix: str = "") -> list[str]:
        if not prefix and self.exists(COMMIT_RECORD) and not is_committed(open_location(url)):
            raise StorageError("ListObjectsV2: InternalError (injected)")
        return real_list(self, prefix)

    monkeypatch.setattr(MemoryStore, "list", fail_the_listing)
    with pytest.raises(StorageError, match="injected"):
        save({"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 3), 2.0))}, url, overwrite=True)
    monkeypatch.undo()
    assert verify(url).ok, str(verify(url))
    loaded = load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 3))}, url)
    assert torch.equal(loaded["w"], torch.full((4, 3), 1.0))
    save({"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 3), 3.0))}, url, overwrite=True)
    loaded = load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 3))}, url)
    assert torch.equal(loaded["w"], torch.full((4, 3), 3.0))


def test_a_deletion_marker_naming_the_checkpoints_save_does_not_block_overwrite(ckpt_dir: Path) -> None:
    """The manager's deletion marker, left where a deletion stopped before the commit
    record went, names the checkpoint's save: it is not another program's file."""
    _save_small(ckpt_dir)
    _leave_own_marker(ckpt_dir, DELETION_MARKER)
    assert verify(ckpt_dir).ok, str(verify(ckpt_dir))
    # as the manager writes it: with a copy of the commit record, larger than a save's marker
    record = (ckpt_dir / COMMIT_RECORD).read_text()
    marker = {"step": 1, "save_id": read_commit_record(open_location(ckpt_dir)).save_id, "record": record + " " * 8192}
    (ckpt_dir / DELETION_MARKER).write_text(json.dumps(marker))
    assert verify(ckpt_dir).ok, str(verify(ckpt_dir))
    save({"y": ShardedTensor.from_rank_offsets("y", torch.ones(1))}, ckpt_dir, overwrite=True)
    assert set(load_sharded_metadata(ckpt_dir)) == {"y"}


@pytest.mark.parametrize("name", [SAVE_MARKER, DELETION_MARKER])
def test_a_marker_naming_another_save_still_blocks_overwrite(ckpt_dir: Path, name: str) -> None:
    """Only what a marker holds proves it ours: one naming another save is kept, and
    replacing the checkpoint would delete it."""
    _save_small(ckpt_dir)
    _leave_own_marker(ckpt_dir, name, save_id="0123abcd" * 4)
    assert [p.key for p in verify(ckpt_dir).problems] == [name]
    with pytest.raises(CheckpointingException, match="holds files its save did not write"):
        save({"y": ShardedTensor.from_rank_offsets("y", torch.ones(1))}, ckpt_dir, overwrite=True)
    assert (ckpt_dir / name).exists()


def test_a_failed_marker_removal_after_the_commit_is_logged_not_raised(ckpt_dir: Path, monkeypatch, caplog) -> None:
    """The save is committed once published: a failed removal of its marker raised,
    reporting a committed save as failed."""
    real_delete = LocalStore.delete

    def delete(self: LocalStore, key: str) -> None:
        if key == SAVE_MARKER:
            raise StorageError(f"Cannot delete {key} (injected)")
        real_delete(self, key)

    monkeypatch.setattr(LocalStore, "delete", delete)
    _save_small(ckpt_dir)
    monkeypatch.undo()
    assert "could not remove its save marker" in caplog.text
    assert verify(ckpt_dir).ok, str(verify(ckpt_dir))


def test_replaced_checkpoint_that_could_not_be_removed_is_removed_by_the_next_save(ckpt_dir: Path, monkeypatch) -> None:
    """After RENAME_EXCHANGE the old checkpoint sat at ``.ckpt.shardstore-save-<new id>``
    with no marker naming that id (its record names the old one): where removing it
    failed (or the process died right then), ``remove_dead_saves`` never removed it,
    though the log said the next save would. It is now moved to the replaced name,
    which its commit record proves ours, before the removal."""
    save({"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 3), 1.0))}, ckpt_dir)
    real_remove_directory, calls = LocalStore.remove_directory, []

    def fail_once(self: LocalStore) -> None:
        calls.append(self.root.name)
        if len(calls) == 1:
            raise OSError("EIO (injected)")  # or a SIGKILL right after the exchange
        real_remove_directory(self)

    monkeypatch.setattr(LocalStore, "remove_directory", fail_once)
    for value in (2.0, 3.0, 4.0):
        save({"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 3), value))}, ckpt_dir, overwrite=True)
    assert calls and REPLACED_TAG in calls[0]
    loaded = load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 3))}, ckpt_dir)
    assert torch.equal(loaded["w"], torch.full((4, 3), 4.0))
    left = sorted(p.name for p in ckpt_dir.parent.iterdir() if p.name != ckpt_dir.name)
    assert left == [], f"a replaced checkpoint is never removed: {left}"


def test_a_checkpoint_an_exchange_left_at_the_staging_path_is_removed_by_the_next_save(ckpt_dir: Path) -> None:
    """A save killed right after RENAME_EXCHANGE, before the old checkpoint moved on to
    its replaced name, leaves it at ``.ckpt.shardstore-save-<new id>``, with no marker
    (the save's marker went into the target with the exchange). Before, no later save
    removed it (``remove_dead_saves`` proves a staging directory ours by its marker
    alone): a whole checkpoint's disk space lost for good, without a word. The target
    committing that very save id proves the exchange happened, and the commit record it
    holds proves it a checkpoint of ours: the next save removes it."""
    old, w = ckpt_dir.parent / "old", lambda value: ShardedTensor.from_rank_offsets("w", torch.full((4, 3), value))
    save({"w": w(1.0)}, old)  # the checkpoint replaced
    save({"w": w(2.0)}, ckpt_dir)  # the one that replaced it
    new_id = read_commit_record(open_location(ckpt_dir)).save_id
    old.rename(ckpt_dir.parent / f".{ckpt_dir.name}{STAGING_TAG}{new_id}")  # where the exchange put it
    save({"w": w(3.0)}, ckpt_dir, overwrite=True)
    left = sorted(p.name for p in ckpt_dir.parent.iterdir() if p.name != ckpt_dir.name)
    assert left == [], f"the checkpoint the exchange left at the staging path is never removed: {left}"
    loaded = load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 3))}, ckpt_dir)
    assert torch.equal(loaded["w"], torch.full((4, 3), 3.0))


def test_a_failed_publishing_rename_without_exchange_puts_the_old_checkpoint_back(ckpt_dir: Path, monkeypatch) -> None:
    """Where the file system cannot exchange (NFS), the old checkpoint is renamed aside,
    then the staging directory onto the target. When that second rename failed (ESTALE,
    EIO), the save was abandoned with the target missing and the old checkpoint at
    ``.ckpt.shardstore-replaced-<id>``, which the next save deleted: no loadable
    checkpoint was left. It is renamed back before the failure is raised."""
    save({"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 3), 1.0))}, ckpt_dir)
    monkeypatch.setattr(local_backend, "_rename_exchange", lambda a, b: False)
    real_rename = os.rename

    def rename(source, destination) -> None:
        if STAGING_TAG in str(source):
            raise OSError(errno.ESTALE, "Stale file handle (injected)")
        real_rename(source, destination)

    monkeypatch.setattr(local_backend.os, "rename", rename)
    with pytest.raises(CheckpointingException, match="Stale file handle"):
        save({"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 3), 2.0))}, ckpt_dir, overwrite=True)
    monkeypatch.undo()
    loaded = load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 3))}, ckpt_dir)
    assert torch.equal(loaded["w"], torch.full((4, 3), 1.0)), "the old checkpoint is no longer loadable"
    assert sorted(p.name for p in ckpt_dir.parent.iterdir()) == [ckpt_dir.name]


def test_a_replaced_checkpoint_is_kept_while_the_target_holds_none(ckpt_dir: Path) -> None:
    """A replacement without exchange that died between its two renames leaves the old
    checkpoint, complete, at the replaced name and the target missing: the next save
    deleted it as replaced, though it was the last checkpoint there. It is kept until a
    checkpoint is committed at the target again."""
    save({"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 3), 1.0))}, ckpt_dir)
    save_id = read_commit_record(open_location(ckpt_dir)).save_id
    aside = ckpt_dir.parent / f".{ckpt_dir.name}{REPLACED_TAG}{save_id}"
    ckpt_dir.rename(aside)  # what the crash between the two renames leaves
    save({"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 3), 2.0))}, ckpt_dir)
    assert verify(aside).ok, "the last checkpoint was deleted while nothing had replaced it"
    save({"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 3), 3.0))}, ckpt_dir, overwrite=True)
    assert not aside.exists(), "once a checkpoint is committed there, the replaced one goes"


def test_a_target_that_is_a_regular_file_is_refused_before_the_save_writes(tmp_path: Path, monkeypatch) -> None:
    """A regular file listed as an empty directory (``LocalStore.list_dir`` reads
    NotADirectoryError as empty), so the save began, wrote every chunk, and only the
    publishing rename failed, naming the staging directory and not what to do."""
    target = tmp_path / "ckpt"
    target.write_text("someone's file")
    written = []
    real_put = local_backend.FileChunkStore.put
    monkeypatch.setattr(local_backend.FileChunkStore, "put",
                        lambda self, rel, buffers: (written.append(rel), real_put(self, rel, buffers))[1])
    with pytest.raises(CheckpointingException, match="is a file, not a directory") as refused:
        save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4, 3))}, target)
    assert written == [], f"chunks written before the refusal: {written}"
    assert str(target) in str(refused.value) and STAGING_TAG not in str(refused.value)
    assert target.read_text() == "someone's file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_directory_without_commit_record_is_never_deleted(ckpt_dir: Path) -> None:
    _save_small(ckpt_dir)
    (ckpt_dir / "zarr.json").unlink()  # no proof that a shardstore save wrote the rest
    before = sorted(p.relative_to(ckpt_dir) for p in ckpt_dir.rglob("*"))
    for overwrite in (False, True):
        with pytest.raises(CheckpointingException, match="holds no committed shardstore checkpoint.*metadata.json"):
            save({"y": ShardedTensor.from_rank_offsets("y", torch.ones(1))}, ckpt_dir, overwrite=overwrite)
    assert sorted(p.relative_to(ckpt_dir) for p in ckpt_dir.rglob("*")) == before


def test_refuses_to_clear_a_directory_that_is_not_a_checkpoint(ckpt_dir: Path) -> None:
    ckpt_dir.mkdir()
    (ckpt_dir / "thesis.tex").write_text("precious")
    with pytest.raises(CheckpointingException, match="holds no committed shardstore checkpoint.*thesis.tex"):
        _save_small(ckpt_dir)
    assert (ckpt_dir / "thesis.tex").read_text() == "precious"


def _async_save_while_another_program_writes(ckpt: Path, theirs: dict[str, str], shared: bool = True) -> None:
    """An async save into an empty directory (``shared_directory=shared``); before it
    commits, another program writes ``theirs`` there (as ModelOpt does into Megatron-LM's
    iteration directory)."""
    from shardstore.strategies.async_utils import AsyncCallsQueue

    ckpt.mkdir()
    request = save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0)), "step": 7}, ckpt,
                   async_sharded_save=True, shared_directory=shared)
    for rel, text in theirs.items():
        (ckpt / rel).parent.mkdir(parents=True, exist_ok=True)
        (ckpt / rel).write_text(text)
    queue = AsyncCallsQueue()
    try:
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()


def test_files_another_program_writes_during_a_save_are_kept_beside_it(ckpt_dir: Path) -> None:
    """Before, the commit saw a directory that was no longer empty and gave up: the
    checkpoint was lost ("another save committed there")."""
    from shardstore import verify

    theirs = {"modelopt_run_config.yaml": "a: 1", "modelopt_state/state.pt": "x"}
    _async_save_while_another_program_writes(ckpt_dir, theirs)
    loaded = load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(8))}, ckpt_dir)
    assert torch.equal(loaded["w"], torch.arange(8.0)) and loaded["step"] == 7
    assert all((ckpt_dir / rel).read_text() == text for rel, text in theirs.items())
    assert [p.name for p in ckpt_dir.parent.iterdir()] == [ckpt_dir.name]  # no staging left
    # The record names them as another program's: verify passes and lists them apart (before, each was a
    # problem, and Megatron-LM's load(verify_integrity=True) refused every checkpoint with ModelOpt's state).
    report = verify(ckpt_dir)
    assert report.ok and sorted(report.not_ours) == sorted(theirs)
    assert "2 file(s) of another program beside it, not checked" in str(report)
    (ckpt_dir / "later.txt").write_text("added after the commit")
    (ckpt_dir / "modelopt_state" / "later.pt").write_text("theirs, later")
    assert [p.key for p in verify(ckpt_dir).problems] == ["later.txt"]
    with pytest.raises(CheckpointingException, match="also holds files its save did not write"):
        save({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8))}, ckpt_dir, overwrite=True)
    assert (ckpt_dir / "modelopt_state" / "state.pt").read_text() == "x"


def test_a_name_beside_that_the_record_cannot_carry_is_left_out_and_the_checkpoint_loads(ckpt_dir: Path) -> None:
    """Before, ``__pycache__`` (reserved: a leading ``__``) or ``__objects__`` went into
    the record's ``beside``, which every later read then refused: the save committed a
    checkpoint nothing could load or replace."""
    from shardstore import verify

    theirs = {"__pycache__/x.pyc": "b", "__objects__/x": "c", "modelopt_run_config.yaml": "a: 1"}
    _async_save_while_another_program_writes(ckpt_dir, theirs)
    loaded = load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(8))}, ckpt_dir)
    assert torch.equal(loaded["w"], torch.arange(8.0))
    report = verify(ckpt_dir)
    assert report.not_ours == ["modelopt_run_config.yaml"]
    assert sorted(p.key for p in report.problems) == ["__objects__/x", "__pycache__/x.pyc"]


def test_without_shared_directory_another_programs_write_makes_the_save_lose(ckpt_dir: Path) -> None:
    """The default: a directory that is not ours is never published into."""
    with pytest.raises(CheckpointingException, match="found files of a directory that is not a checkpoint"):
        _async_save_while_another_program_writes(ckpt_dir, {"__0_0.distcp": "DCP's"}, shared=False)
    assert [p.name for p in ckpt_dir.iterdir()] == ["__0_0.distcp"]
    assert [p.name for p in ckpt_dir.parent.iterdir()] == [ckpt_dir.name]


def test_a_name_another_program_took_during_a_save_fails_it_and_changes_nothing(ckpt_dir: Path) -> None:
    with pytest.raises(CheckpointingException, match="another program wrote common.pt there while it ran"):
        _async_save_while_another_program_writes(ckpt_dir, {"common.pt": "theirs"})
    assert [p.name for p in ckpt_dir.iterdir()] == ["common.pt"] and (ckpt_dir / "common.pt").read_text() == "theirs"
    assert [p.name for p in ckpt_dir.parent.iterdir()] == [ckpt_dir.name]


def test_replacing_a_checkpoint_never_deletes_files_its_save_did_not_write(ckpt_dir: Path) -> None:
    """Before, ``overwrite=True`` replaced the whole directory, another program's files
    (ModelOpt's beside Megatron's checkpoint) with it."""
    _save_small(ckpt_dir)
    (ckpt_dir / "modelopt_run_config.yaml").write_text("a: 1")
    with pytest.raises(CheckpointingException, match=r"also holds files its save did not write \(modelopt_run"):
        save({"y": ShardedTensor.from_rank_offsets("y", torch.ones(1))}, ckpt_dir, overwrite=True)
    assert (ckpt_dir / "modelopt_run_config.yaml").read_text() == "a: 1"
    assert set(load_sharded_metadata(ckpt_dir)) == {"enc/w", "enc/b", "x"}  # the old checkpoint, whole
    (ckpt_dir / "modelopt_run_config.yaml").unlink()
    save({"y": ShardedTensor.from_rank_offsets("y", torch.ones(1))}, ckpt_dir, overwrite=True)
    assert set(load_sharded_metadata(ckpt_dir)) == {"y"}


def test_a_file_another_program_adds_while_a_replacing_save_runs_is_not_deleted_with_the_old_checkpoint(
    ckpt_dir: Path,
) -> None:
    """Before, only the files present when the replacing save began were checked: one
    added while it ran went with the old checkpoint."""
    from shardstore.strategies.async_utils import AsyncCallsQueue

    _save_small(ckpt_dir)
    request = save({"y": ShardedTensor.from_rank_offsets("y", torch.ones(1))}, ckpt_dir, overwrite=True,
                   async_sharded_save=True)
    (ckpt_dir / "modelopt_run_config.yaml").write_text("a: 1")
    queue = AsyncCallsQueue()
    try:
        queue.schedule_async_request(request)
        with pytest.raises(CheckpointingException, match="another program wrote modelopt_run_config.yaml into the "
                                                          "checkpoint it replaces"):
            queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()
    assert (ckpt_dir / "modelopt_run_config.yaml").read_text() == "a: 1"
    assert set(load_sharded_metadata(ckpt_dir)) == {"enc/w", "enc/b", "x"}  # the old checkpoint, whole
    assert [p.name for p in ckpt_dir.parent.iterdir()] == [ckpt_dir.name]  # the new save's staging is gone


def test_what_the_replaced_checkpoint_held_when_the_save_began_does_not_fail_its_commit(ckpt_dir: Path) -> None:
    """An empty directory (no file, so no unlisted one) passes the check at the start;
    before, the commit-time check compared with the record only and failed the save
    after every chunk was written."""
    _save_small(ckpt_dir)
    (ckpt_dir / "empty_dir").mkdir()
    save({"y": ShardedTensor.from_rank_offsets("y", torch.ones(1))}, ckpt_dir, overwrite=True)
    assert set(load_sharded_metadata(ckpt_dir)) == {"y"}


def test_remove_sharded_tensors_updates_the_commit_record(ckpt_dir: Path) -> None:
    _save_small(ckpt_dir)
    remove_sharded_tensors(ckpt_dir, "enc/")
    assert set(load_tensors_metadata(ckpt_dir)) == {"x"}
    assert not (ckpt_dir / "enc/w").exists()
    loaded = load({"x": ShardedTensor.from_rank_offsets("x", torch.empty(2, 2, 2, dtype=torch.int8))}, ckpt_dir)
    assert torch.equal(loaded["x"], torch.zeros(2, 2, 2, dtype=torch.int8))


def test_remove_sharded_tensors_removes_sharded_objects_under_the_prefix_too(ckpt_dir: Path) -> None:
    """As Megatron-Core 0.16's torch_dist, which drops every entry of its metadata whose
    key starts with the prefix, ShardedObjects included (by their unique keys). Before,
    only arrays went: the objects stayed listed by ``load_sharded_metadata`` and loadable."""
    save({"w": ShardedTensor.from_rank_offsets("enc/w", torch.ones(3)),
          "state": ShardedObject("enc/state", {"step": 3}, (2,), (0,)),
          "state1": ShardedObject("enc/state", {"step": 4}, (2,), (1,)),
          "x": ShardedTensor.from_rank_offsets("x", torch.zeros(2)),
          "extra": ShardedObject("extra", {"a": 1}, (1,), (0,))}, ckpt_dir)
    remove_sharded_tensors(ckpt_dir, "enc/")
    assert set(load_sharded_metadata(ckpt_dir)) == {"x", "extra/shard_0_1"}
    assert not (ckpt_dir / "__objects__" / "enc").exists()
    assert verify(ckpt_dir).ok, str(verify(ckpt_dir))
    with pytest.raises(CheckpointingException, match="enc/state"):
        load({"state": ShardedObject("enc/state", None, (2,), (0,))}, ckpt_dir)
    assert load({"extra": ShardedObject("extra", None, (1,), (0,))}, ckpt_dir)["extra"] == {"a": 1}


def test_remove_sharded_tensors_removes_the_object_shards_whose_unique_key_has_the_prefix(ckpt_dir: Path) -> None:
    """Megatron-Core matches a ShardedObject's unique key (``key/shard_<offset>_<shape>``),
    so a prefix may take some of its shards: the others stay, listed and verified."""
    save({"a": ShardedObject("obj", 1, (2,), (0,)), "b": ShardedObject("obj", 2, (2,), (1,))}, ckpt_dir)
    remove_sharded_tensors(ckpt_dir, "obj/shard_1")
    assert set(load_sharded_metadata(ckpt_dir)) == {"obj/shard_0_2"}
    assert verify(ckpt_dir).ok, str(verify(ckpt_dir))
    assert [p.name for p in (ckpt_dir / "__objects__" / "obj").iterdir()] == ["shard_0_2.pt"]


def test_remove_sharded_tensors_never_deletes_another_checkpoints_array_through_a_link(tmp_path: Path) -> None:
    """A checkpoint whose array directory ``enc`` was replaced by a link into an earlier
    checkpoint (by hand, to share unchanged arrays): loads and verify refuse to follow the
    link, and ``remove_sharded_tensors(ckpt, "enc/w")`` deleted the earlier checkpoint's
    array through it. It is refused now, naming the link."""
    earlier, ckpt = tmp_path / "earlier", tmp_path / "ckpt"
    for where in (earlier, ckpt):
        save({"w": ShardedTensor.from_rank_offsets("enc/w", torch.ones(4, 3)),
              "x": ShardedTensor.from_rank_offsets("x", torch.ones(2))}, where)
    shutil.rmtree(ckpt / "enc")
    (ckpt / "enc").symlink_to(earlier / "enc")
    with pytest.raises(CheckpointingException, match="symbolic link"):
        remove_sharded_tensors(ckpt, "enc/w")
    assert verify(earlier).ok, str(verify(earlier))


def test_missing_chunk_is_an_error_not_zeros(ckpt_dir: Path) -> None:
    _save_small(ckpt_dir, PER_ARRAY)
    chunk = next((ckpt_dir / "enc/w").glob("c.*"))
    chunk.unlink()
    with pytest.raises(CheckpointingException, match="enc/w"):
        load({"w": ShardedTensor.from_rank_offsets("enc/w", torch.empty(3, 4))}, ckpt_dir)


def test_a_replaced_checkpoint_that_cannot_be_removed_does_not_fail_every_later_save(
    ckpt_dir: Path, monkeypatch
) -> None:
    """Since 0c543d9 an exchanged-out checkpoint is renamed to its REPLACED_TAG name
    and removed best-effort (``_remove_dir`` logs a failure: "the next save into the same
    place will"). ``remove_dead_saves`` retries that removal at the next save's begin
    without catching anything, so a removal that keeps failing (a directory a user made
    read-only, an NFS ``.nfsXXXX`` held open by a reader) fails every later save into the
    target with a bare OSError naming neither the checkpoint nor what to do; before,
    the leftover sat at the staging path and saves went on."""
    from shardstore import ShardedTensor, load, save
    from shardstore.format.records import REPLACED_TAG

    real_remove_directory = LocalStore.remove_directory

    def remove_directory(self: LocalStore) -> None:
        if REPLACED_TAG in self.root.name:
            raise PermissionError(13, "Permission denied (injected)", str(self.root / "w"))
        real_remove_directory(self)

    save({"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 3), 1.0))}, ckpt_dir)
    monkeypatch.setattr(LocalStore, "remove_directory", remove_directory)
    save({"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 3), 2.0))}, ckpt_dir, overwrite=True)  # logged
    save({"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 3), 3.0))}, ckpt_dir, overwrite=True)
    loaded = load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 3))}, ckpt_dir)
    assert torch.equal(loaded["w"], torch.full((4, 3), 3.0))


def test_a_replaced_checkpoint_whose_removal_was_cut_short_is_still_removed_by_the_next_save(
    ckpt_dir: Path, monkeypatch
) -> None:
    """The exchanged-out checkpoint was removed with one ``shutil.rmtree``, which may
    take the commit record (the only proof ``remove_dead_saves`` accepts) before a kill
    or an error stops it: what was left was never removed by any later save, though the
    log promised the next save would. Now everything but the record goes first, the
    record last (as ``_remove_marked`` does with the marker): a removal cut short leaves
    the record, and the next save removes the rest."""
    from shardstore import ShardedTensor, save
    from shardstore.format.records import COMMIT_RECORD, REPLACED_TAG

    real_delete_prefix, real_remove_directory, calls = LocalStore.delete_prefix, LocalStore.remove_directory, []

    def killed_first_time(root: Path, removed: Path) -> None:
        calls.append(root.name)
        if REPLACED_TAG in root.name and len(calls) == 1:
            removed.unlink()  # some of it went, in the file system's order, then the process died
            raise OSError("killed mid-removal (injected)")

    def delete_prefix(self: LocalStore, prefix: str = "", keep: tuple = ()) -> None:
        killed_first_time(self.root, self.root / "w" / "zarr.json")
        real_delete_prefix(self, prefix, keep)

    def remove_directory(self: LocalStore) -> None:  # one rmtree: the record may go first
        killed_first_time(self.root, self.root / COMMIT_RECORD)
        real_remove_directory(self)

    save({"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 3), 1.0))}, ckpt_dir)
    monkeypatch.setattr(LocalStore, "delete_prefix", delete_prefix)
    monkeypatch.setattr(LocalStore, "remove_directory", remove_directory)
    for value in (2.0, 3.0):
        save({"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 3), value))}, ckpt_dir, overwrite=True)
    left = sorted(p.name for p in ckpt_dir.parent.iterdir() if p.name != ckpt_dir.name)
    assert left == [], f"a replaced checkpoint is never removed: {left}"


def test_a_marker_nested_past_the_json_parsers_depth_is_not_ours(ckpt_dir: Path) -> None:
    """A file named like our marker holding JSON nested 2,000 deep raised the parser's
    RecursionError out of every check that reads markers; it is no marker of ours."""
    from shardstore.format.records import read_marker

    _save_small(ckpt_dir)
    (ckpt_dir / SAVE_MARKER).write_text("[" * 2_000 + "]" * 2_000)  # within the 4 KiB a marker may hold
    assert read_marker(open_location(ckpt_dir), SAVE_MARKER) is None
    assert [p.key for p in verify(ckpt_dir).problems] == [SAVE_MARKER]


# ------------------------------------------------------------------ replacing beside other programs' files

# What ModelOpt writes into a Megatron-LM iteration after its save returns.
THEIRS_BESIDE = {"modelopt_run_config.yaml": b"nvidia_modelopt_version: 0.0\n", "modelopt_state/common.pt": b"theirs"}
# Renames of a replacement beside them, old {common.pt, metadata.json, v, w} -> new {common.pt,
# metadata.json, u, w}: the old record, its 4 entries, the new 4 entries, the new record.
RENAMES_OF_A_REPLACEMENT = 10


def _beside_state(value: float, extra: str) -> dict:
    return {"w": ShardedTensor.from_rank_offsets("w", torch.full((4,), value)),
            extra: ShardedTensor.from_rank_offsets(extra, torch.full((2,), value)), "step": value}


def _saved_beside_theirs(ckpt: Path) -> None:
    """The old checkpoint (w, v), then another program's files put into it after the commit."""
    save(_beside_state(1.0, "v"), ckpt, shared_directory=True, layout=PER_ARRAY)
    for rel, data in THEIRS_BESIDE.items():
        (ckpt / rel).parent.mkdir(exist_ok=True)
        (ckpt / rel).write_bytes(data)


def _replace_beside(ckpt: Path) -> None:
    save(_beside_state(2.0, "u"), ckpt, shared_directory=True, overwrite=True, layout=PER_ARRAY)


def _loads(ckpt: Path) -> float:
    from shardstore import load_plain_tensors

    return load_plain_tensors(ckpt)["w"][0].item()


def _old_verifies(ckpt: Path) -> bool:
    """Every chunk and file of the old checkpoint checks; their files, written after its
    commit, are the only files its record does not list."""
    report = verify(ckpt)
    return {p.key for p in report.problems} <= set(THEIRS_BESIDE) and sorted(report.unlisted) == sorted(THEIRS_BESIDE)


def _assert_theirs_untouched(ckpt: Path) -> None:
    assert {rel: (ckpt / rel).read_bytes() for rel in THEIRS_BESIDE} == THEIRS_BESIDE
    assert sorted(p.name for p in (ckpt / "modelopt_state").iterdir()) == ["common.pt"]


def _fail_rename(monkeypatch, at: int) -> None:
    """The ``at``-th entry rename from now on fails (as a full or read-only disk would)."""
    original, calls = local_backend._rename_no_replace, []

    def rename(source: Path, destination: Path) -> None:
        calls.append(source)
        if len(calls) == at:
            raise OSError(errno.EIO, "injected", str(source))
        original(source, destination)

    monkeypatch.setattr(local_backend, "_rename_no_replace", rename)


def test_replacing_a_checkpoint_beside_other_programs_files_keeps_them_in_place(ckpt_dir: Path) -> None:
    """Megatron-LM reaching an iteration again after a restart: its shared iteration
    directory holds ModelOpt's files, which stay where they are, byte for byte; only the
    checkpoint's own entries are replaced, and the new record names theirs."""
    _saved_beside_theirs(ckpt_dir)
    _replace_beside(ckpt_dir)
    assert _loads(ckpt_dir) == 2.0
    _assert_theirs_untouched(ckpt_dir)
    assert not (ckpt_dir / "v").exists() and (ckpt_dir / "u").is_dir()
    assert read_commit_record(open_location(ckpt_dir)).beside == ("modelopt_run_config.yaml", "modelopt_state")
    report = verify(ckpt_dir)
    assert report.ok and sorted(report.not_ours) == sorted(THEIRS_BESIDE), str(report)
    assert sorted(p.name for p in ckpt_dir.parent.iterdir()) == [ckpt_dir.name], "no leftovers next to it"
    assert not (ckpt_dir / SAVE_MARKER).exists()


def test_replacing_beside_refuses_a_file_inside_the_checkpoints_own_entries(ckpt_dir: Path) -> None:
    """A file another program put inside one of the checkpoint's arrays would be set aside
    and deleted with it: refused, naming it, nothing changed."""
    _saved_beside_theirs(ckpt_dir)
    (ckpt_dir / "w" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointingException, match=r"holds w/notes.txt, which its save did not write, inside"):
        _replace_beside(ckpt_dir)
    assert _loads(ckpt_dir) == 1.0 and (ckpt_dir / "w" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("at", range(1, RENAMES_OF_A_REPLACEMENT + 1))
def test_a_replacement_beside_that_fails_at_any_rename_puts_the_old_checkpoint_back(
    ckpt_dir: Path, monkeypatch, at: int
) -> None:
    """A rename that fails part way (setting the old entries aside, moving the new ones in,
    the new record itself): the save fails, the old checkpoint is whole and loadable
    again, their files untouched, nothing left next to it; the next save replaces it."""
    _saved_beside_theirs(ckpt_dir)
    _fail_rename(monkeypatch, at)
    with pytest.raises(CheckpointingException, match="injected"):
        _replace_beside(ckpt_dir)
    monkeypatch.undo()
    assert _loads(ckpt_dir) == 1.0 and _old_verifies(ckpt_dir)
    _assert_theirs_untouched(ckpt_dir)
    assert sorted(p.name for p in ckpt_dir.parent.iterdir()) == [ckpt_dir.name]
    _replace_beside(ckpt_dir)
    assert _loads(ckpt_dir) == 2.0
    _assert_theirs_untouched(ckpt_dir)


# Renames of a first save beside them: its 4 entries (common.pt, metadata.json, v, w), then its record.
RENAMES_OF_A_SAVE_BESIDE = 5


@pytest.mark.parametrize("at", range(1, RENAMES_OF_A_SAVE_BESIDE + 1))
def test_a_save_beside_that_fails_at_any_rename_leaves_only_their_files(ckpt_dir: Path, monkeypatch, at: int) -> None:
    """A first save into a shared directory whose publishing rename fails part way (a
    full or failing disk): the save fails, the directory holds their files only, nothing
    is left next to it, and the same save again succeeds. Before, the entries moved in
    before the failure stayed in the directory without a record, and every later save
    there was refused (\"holds common.pt, metadata.json, names a shardstore checkpoint
    keeps\", or \"it already held v\") until the user deleted them by hand."""
    for rel, data in THEIRS_BESIDE.items():
        (ckpt_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (ckpt_dir / rel).write_bytes(data)
    _fail_rename(monkeypatch, at)
    with pytest.raises(CheckpointingException, match="injected"):
        save(_beside_state(1.0, "v"), ckpt_dir, shared_directory=True, layout=PER_ARRAY)
    monkeypatch.undo()
    assert sorted(p.name for p in ckpt_dir.iterdir()) == sorted({rel.split("/")[0] for rel in THEIRS_BESIDE})
    _assert_theirs_untouched(ckpt_dir)
    assert sorted(p.name for p in ckpt_dir.parent.iterdir()) == [ckpt_dir.name]
    save(_beside_state(1.0, "v"), ckpt_dir, shared_directory=True, layout=PER_ARRAY)
    assert _loads(ckpt_dir) == 1.0
    _assert_theirs_untouched(ckpt_dir)


@pytest.mark.parametrize("phase", [1, 2])
def test_a_replacement_beside_whose_marker_cannot_be_written_changes_nothing(
    ckpt_dir: Path, monkeypatch, phase: int
) -> None:
    """The marker's first write (nothing moved yet) or its second (the old entries all set
    aside): the old checkpoint is put back."""
    _saved_beside_theirs(ckpt_dir)
    original, writes = LocalStore.put_atomic, []

    def put_atomic(self, key: str, data: bytes) -> None:
        if key == SAVE_MARKER and self.root == ckpt_dir:
            writes.append(data)
            if len(writes) == phase:
                raise StorageError(f"Cannot write {key}: injected")
        original(self, key, data)

    monkeypatch.setattr(LocalStore, "put_atomic", put_atomic)
    with pytest.raises(CheckpointingException, match="injected"):
        _replace_beside(ckpt_dir)
    monkeypatch.undo()
    assert _loads(ckpt_dir) == 1.0
    _assert_theirs_untouched(ckpt_dir)
    assert sorted(p.name for p in ckpt_dir.parent.iterdir()) == [ckpt_dir.name]


def _crash_at_rename(ckpt_dir: Path, monkeypatch, at: int) -> None:
    """A replacement beside their files that dies at its ``at``-th rename: its own putting
    back never runs (a process killed there runs nothing more)."""
    import shardstore.format.commit.by_rename as by_rename

    _saved_beside_theirs(ckpt_dir)
    _fail_rename(monkeypatch, at)

    def killed(*args, **kwargs) -> None:
        raise OSError("killed before it could put anything back")

    monkeypatch.setattr(by_rename, "_put_back", killed)
    with pytest.raises(CheckpointingException, match="injected"):
        _replace_beside(ckpt_dir)
    monkeypatch.undo()
    _assert_theirs_untouched(ckpt_dir)


@pytest.mark.parametrize("at", range(1, RENAMES_OF_A_REPLACEMENT + 1))
def test_a_replacement_beside_killed_at_any_rename_is_put_back_by_restore(
    ckpt_dir: Path, monkeypatch, at: int
) -> None:
    """Killed before the old record moved: the old checkpoint is still there. Killed in the
    window: no checkpoint loads, the error names the interrupted replacement and what to
    do, and ``restore_replaced`` (``shardstore restore``) puts the old one back whole.
    Killed at the new record's move, likewise (it never committed)."""
    from shardstore.format.commit import restore_replaced

    _crash_at_rename(ckpt_dir, monkeypatch, at)
    if at == 1:
        assert _loads(ckpt_dir) == 1.0
    else:
        with pytest.raises(CheckpointingException, match=r"was interrupted .*`shardstore restore "):
            _loads(ckpt_dir)
        assert restore_replaced(open_location(ckpt_dir))
    assert _loads(ckpt_dir) == 1.0 and _old_verifies(ckpt_dir)
    _assert_theirs_untouched(ckpt_dir)
    assert not restore_replaced(open_location(ckpt_dir)), "nothing more to put back"
    _replace_beside(ckpt_dir)
    assert _loads(ckpt_dir) == 2.0 and verify(ckpt_dir).ok
    _assert_theirs_untouched(ckpt_dir)
    assert sorted(p.name for p in ckpt_dir.parent.iterdir()) == [ckpt_dir.name], "leftovers removed"


@pytest.mark.parametrize("at", [3, 7])
def test_the_next_save_puts_back_what_a_killed_replacement_beside_set_aside(
    ckpt_dir: Path, monkeypatch, caplog, at: int
) -> None:
    """Killed setting the old entries aside (3) or moving the new ones in (7): the next
    save into the directory puts the old checkpoint back first, then replaces it."""
    _crash_at_rename(ckpt_dir, monkeypatch, at)
    with caplog.at_level("WARNING", logger="shardstore"):
        _replace_beside(ckpt_dir)
    assert "Put back the checkpoint" in caplog.text
    assert _loads(ckpt_dir) == 2.0 and verify(ckpt_dir).ok
    _assert_theirs_untouched(ckpt_dir)
    assert sorted(p.name for p in ckpt_dir.parent.iterdir()) == [ckpt_dir.name]
