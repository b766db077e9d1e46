"""A tensor changed in place while a save reads it (``execution.changes``): the caller's
race, which before committed a checkpoint whose chunk every load refused (a crc32c of
other bytes than the file held, measured with a thread adding to a 64 MiB tensor). The
save now fails on every rank, committing nothing, naming the key; an async save reads
the tensors only until it returns, so later changes are the caller's to make."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import shardstore
from shardstore import CheckpointingException, ShardedTensor, load, save, verify
from shardstore.execution import save as rank_save
from shardstore.execution.changes import SourceVersions
from shardstore.format import is_committed
from shardstore.stores.locations import open_location
from tests.dist import run_distributed


def _state(w: torch.Tensor, b: torch.Tensor) -> dict:
    return {"w": ShardedTensor.from_rank_offsets("w", w), "b": ShardedTensor.from_rank_offsets("b", b)}


def _changing_during_writes(monkeypatch, tensor: torch.Tensor) -> None:
    """``tensor`` changes in place as the rank's writes start, as another thread's
    optimizer step would."""
    real = rank_save.write_ops

    def write_ops(*args, **kwargs):
        tensor.add_(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(rank_save, "write_ops", write_ops)


def test_a_sync_save_fails_and_commits_nothing_where_a_tensor_changed_during_its_writes(
    tmp_path: Path, monkeypatch,
) -> None:
    w, b = torch.arange(4096.0), torch.ones(16)
    _changing_during_writes(monkeypatch, w)
    ckpt = tmp_path / "ckpt"
    with pytest.raises(CheckpointingException, match=r"tensor 'w' changed in place.*Nothing was committed"):
        save(_state(w, b), str(ckpt))
    assert not ckpt.exists() and not is_committed(open_location(ckpt))
    monkeypatch.undo()
    save(_state(w, b), str(ckpt))  # unchanged now: saved, loaded bit-exact
    loaded = load(_state(torch.empty(4096), torch.empty(16)), str(ckpt))
    assert torch.equal(loaded["w"], w) and verify(ckpt).ok


def test_an_async_save_fails_where_a_tensor_changed_while_it_copied_and_not_after(tmp_path: Path, monkeypatch) -> None:
    w, b = torch.arange(4096.0), torch.ones(16)
    real = rank_save.stage_save

    def stage_save(tensors, *args, **kwargs):
        staged = real(tensors, *args, **kwargs)
        b.mul_(2)  # during the copies (the stage has not returned)
        return staged

    monkeypatch.setattr(rank_save, "stage_save", stage_save)
    request = save(_state(w, b), str(tmp_path / "during"), async_sharded_save=True)
    with pytest.raises(CheckpointingException, match=r"tensor 'b' changed.*before its host copies were made"):
        request.execute_sync()
    assert not (tmp_path / "during").exists()
    monkeypatch.undo()
    request = save(_state(w, b), str(tmp_path / "after"), async_sharded_save=True)
    expected = b.clone()
    b.add_(5)  # after save returned: the copies are the save's
    request.execute_sync()
    loaded = load(_state(torch.empty(4096), torch.empty(16)), str(tmp_path / "after"))
    assert torch.equal(loaded["b"], expected)


def test_inference_tensors_keep_no_counter_and_save_as_before(tmp_path: Path) -> None:
    with torch.inference_mode():
        w = torch.arange(64.0)
    assert SourceVersions.of([ShardedTensor.from_rank_offsets("w", w)]).keys == ()
    save({"w": ShardedTensor.from_rank_offsets("w", w)}, str(tmp_path / "ckpt"))
    assert verify(tmp_path / "ckpt").ok


def test_the_error_names_at_most_five_keys() -> None:
    tensors = [ShardedTensor.from_rank_offsets(f"t{i}", torch.zeros(2)) for i in range(7)]
    versions = SourceVersions.of(tensors)
    assert versions.error("ckpt", "now") is None
    for t in tensors:
        t.data.add_(1)
    message = str(versions.error("ckpt", "now"))
    assert "tensors 't0', 't1', 't2', 't3', 't4' and 2 more" in message, message


def changed_on_one_rank(rank: int, world: int, root: str) -> str:
    import pytest as _pytest

    w = torch.full((8,), float(rank))
    state = {"w": ShardedTensor.from_rank_offsets("w", w, (0, rank, world))}
    if rank == 1:
        real = rank_save.write_ops

        def write_ops(*args, **kwargs):
            w.add_(1)
            return real(*args, **kwargs)

        rank_save.write_ops = write_ops
    with _pytest.raises(CheckpointingException) as raised:
        shardstore.save(state, f"{root}/ckpt")
    return str(raised.value)


def test_a_change_on_one_rank_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    messages = run_distributed(changed_on_one_rank, 2, str(tmp_path))
    assert all("changed in place" in m and "'w'" in m for m in messages), messages
    assert not (tmp_path / "ckpt").exists()


def test_a_dcp_save_fails_where_a_tensor_changed_during_its_writes(tmp_path: Path, monkeypatch) -> None:
    import torch.distributed.checkpoint as dcp

    from shardstore import ShardstoreWriter

    w = torch.arange(4096.0)
    _changing_during_writes(monkeypatch, w)
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException) as raised:
        dcp.save({"w": w}, storage_writer=ShardstoreWriter(str(tmp_path / "ckpt")), no_dist=True)
    assert "tensor 'w' changed in place" in str(raised.value.failures[0]), raised.value.failures
    assert not is_committed(open_location(tmp_path / "ckpt"))


def test_a_checkpoint_writer_refuses_an_array_changed_during_its_write(tmp_path: Path, monkeypatch) -> None:
    from shardstore.tools.array_writer import CheckpointWriter

    w = torch.arange(4096.0)
    _changing_during_writes(monkeypatch, w)
    ckpt = tmp_path / "ckpt"
    with pytest.raises(CheckpointingException, match=r"tensor 'w' changed in place"), CheckpointWriter(ckpt) as writer:
        writer.write_array("w", w)
    assert not is_committed(open_location(ckpt))
    with CheckpointWriter(ckpt) as writer:
        with pytest.raises(CheckpointingException, match=r"tensor 'w' changed in place"):
            writer.write_array("w", w)
        monkeypatch.undo()
        writer.write_array("w", w)  # unchanged now: written again, committed, loaded bit-exact
        writer.commit()
    assert torch.equal(load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(4096))}, str(ckpt))["w"], w)
    assert verify(ckpt).ok


@pytest.mark.parametrize("where", ["local", "memory"])
def test_an_array_a_checkpoint_writer_refused_leaves_nothing_in_what_it_commits(tmp_path: Path, monkeypatch, where) -> None:
    """Before, the refused array's ``zarr.json`` and chunks stayed in the staging area:
    ``commit`` published them unlisted, and ``verify`` found 9 problems."""
    from shardstore.format import read_commit_record
    from shardstore.tools.array_writer import CheckpointWriter

    w, b = torch.arange(4096.0), torch.ones(16)
    _changing_during_writes(monkeypatch, w)
    ckpt = str(tmp_path / "ckpt") if where == "local" else f"memory://refused-{id(w)}/ckpt"
    with CheckpointWriter(ckpt, max_chunk_bytes=4096) as writer:
        with pytest.raises(CheckpointingException, match=r"tensor 'w/weight' changed in place"):
            writer.write_array("w/weight", w)
        monkeypatch.undo()
        writer.write_array("b", b)
        writer.commit()
    location = open_location(ckpt)
    assert set(read_commit_record(location).arrays) == {"b"}
    assert verify(ckpt).ok, verify(ckpt).problems
    assert [name for name in location.store.list() if name.startswith("w/")] == []
    if where == "local":
        assert not (tmp_path / "ckpt" / "w").exists()
    assert torch.equal(load({"b": ShardedTensor.from_rank_offsets("b", torch.empty(16))}, ckpt)["b"], b)


def test_a_checkpoint_writer_refuses_to_commit_the_files_a_failed_write_left(tmp_path: Path, monkeypatch) -> None:
    """Where removing a failed array's files was itself cut short, ``commit`` refuses,
    naming the array, instead of publishing files its record does not list."""
    from shardstore.execution.array_writes import ArrayWrites
    from shardstore.tools.array_writer import CheckpointWriter

    w = torch.arange(4096.0)
    _changing_during_writes(monkeypatch, w)

    def unwrite_array(self, record):
        raise OSError("removal cut short")

    monkeypatch.setattr(ArrayWrites, "unwrite_array", unwrite_array)
    ckpt = tmp_path / "ckpt"
    with CheckpointWriter(ckpt, max_chunk_bytes=4096) as writer:
        with pytest.raises(OSError, match="removal cut short"):
            writer.write_array("w", w)
        with pytest.raises(CheckpointingException, match=r"Cannot commit .*write of 'w' \(5 files, e\.g\. w/zarr\.json\)"):
            writer.commit()
        monkeypatch.undo()
        writer.write_array("w", w)  # written again: committed whole
        writer.commit()
    assert verify(ckpt).ok
