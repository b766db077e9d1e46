"""Issue 42.2: directories as DCP users have them.

* A save through ``ShardstoreWriter`` into a directory that holds other programs' files
  (a job's log, the ``model.pt`` that ``torch_save_to_dcp`` converts) is published
  beside them and deletes none; ``verify`` names them as another program's.
  ``shardstore.save`` still refuses such a directory unless ``shared_directory=True``.
* Another tool's checkpoint there (DCP's ``.metadata`` + ``*.distcp``, Megatron-Core's
  torch_dist) is never deleted, ``overwrite=True`` included: the save is refused,
  naming every file it would have had to delete.
* A committed shardstore checkpoint that DCP's own writer later saved over is
  ambiguous: every load refuses it, naming both checkpoints' files; ``verify`` says so.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

import shardstore
from shardstore import (
    CheckpointingException,
    ShardedTensor,
    ShardstoreReader,
    ShardstoreWriter,
    StorageLayout,
)
from tests.dist import run_distributed

THEIRS = {"train.log": "step 1 loss 0.5\n", "notes/plan.txt": "keep me"}

# an array's own directory is what collides with a file of the same name; packed arrays have none
PER_ARRAY = StorageLayout(pack_arrays_up_to=0)


def _dtensor_state(world: int, value: float) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return {"w": distribute_tensor(torch.full((6, 3), value), mesh, [Shard(0)]), "step": torch.tensor(value)}


def _loaded_value(reader: object, world: int) -> float:
    import torch.distributed.checkpoint as dcp

    request = _dtensor_state(world, -1.0)
    dcp.load(request, storage_reader=reader)
    full = request["w"].full_tensor()
    assert bool((full == full[0, 0]).all()) and float(request["step"]) == float(full[0, 0])
    return float(full[0, 0])


def _write(directory: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (directory / rel).parent.mkdir(parents=True, exist_ok=True)
        (directory / rel).write_text(text)


def _tree(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------ (a) beside other files


def save_into_a_job_directory(rank: int, world: int, ckpt: str) -> float:
    import torch.distributed.checkpoint as dcp

    dcp.save(_dtensor_state(world, 2.0), storage_writer=ShardstoreWriter(ckpt))
    return _loaded_value(ShardstoreReader(ckpt), world)


def test_a_dcp_save_into_a_job_directory_is_published_beside_its_files_and_deletes_none(tmp_path: Path) -> None:
    """Before, ``ShardstoreWriter`` refused any non-empty directory; ``FileSystemWriter`` writes there."""
    ckpt = tmp_path / "job"
    ckpt.mkdir()
    _write(ckpt, THEIRS)
    assert run_distributed(save_into_a_job_directory, 2, str(ckpt)) == [2.0, 2.0]
    assert all((ckpt / rel).read_text() == text for rel, text in THEIRS.items())
    assert torch.equal(shardstore.load_plain_tensors(ckpt)["w"], torch.full((6, 3), 2.0))
    report = shardstore.verify(ckpt)
    assert report.ok and sorted(report.not_ours) == sorted(THEIRS), str(report)
    assert [p.name for p in tmp_path.iterdir()] == ["job"], "no staging directory is left"


def test_torch_save_to_dcp_writes_beside_the_model_file_it_converts(tmp_path: Path, monkeypatch) -> None:
    """``format_utils.torch_save_to_dcp(model.pt, dir)`` where ``dir`` holds ``model.pt``,
    with shardstore's writer in place of DCP's."""
    from torch.distributed.checkpoint import format_utils
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    model = {"weight": torch.arange(600.0).reshape(20, 30), "bias": torch.ones(30), "epoch": 3}
    torch.save(model, tmp_path / "model.pt")
    before = (tmp_path / "model.pt").read_bytes()
    monkeypatch.setattr(format_utils, "FileSystemWriter", ShardstoreWriter)
    format_utils.torch_save_to_dcp(tmp_path / "model.pt", tmp_path)
    assert (tmp_path / "model.pt").read_bytes() == before
    loaded = _load_state_dict_from_keys(storage_reader=ShardstoreReader(tmp_path))
    assert torch.equal(loaded["weight"], model["weight"]) and loaded["epoch"] == 3
    assert shardstore.verify(tmp_path).not_ours == ["model.pt"]


def test_shardstore_save_refuses_a_directory_of_other_files_unless_told_it_is_shared(ckpt_dir: Path) -> None:
    ckpt_dir.mkdir()
    _write(ckpt_dir, THEIRS)
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(4.0))}
    with pytest.raises(CheckpointingException, match="holds no committed shardstore checkpoint.*notes, train.log"):
        shardstore.save(state, ckpt_dir)
    assert _tree(ckpt_dir) == {rel: text.encode() for rel, text in THEIRS.items()}
    shardstore.save(state, ckpt_dir, shared_directory=True)
    assert torch.equal(shardstore.load_plain_tensors(ckpt_dir)["w"], torch.arange(4.0))
    assert all((ckpt_dir / rel).read_text() == text for rel, text in THEIRS.items())


def test_entries_under_the_formats_own_names_are_refused_and_kept(ckpt_dir: Path) -> None:
    """What a save that died while publishing beside other files leaves (our entries
    without a commit record) is not provably ours: named, never deleted."""
    import torch.distributed.checkpoint as dcp

    ckpt_dir.mkdir()
    _write(ckpt_dir, {"common.pt": "someone's", "train.log": "x"})
    before = _tree(ckpt_dir)
    with pytest.raises(CheckpointException, match=r"it holds common.pt, names a shardstore checkpoint keeps"):
        dcp.save({"w": torch.ones(4)}, storage_writer=ShardstoreWriter(ckpt_dir), no_dist=True)
    assert _tree(ckpt_dir) == before
    assert [p.name for p in ckpt_dir.parent.iterdir()] == [ckpt_dir.name]


def test_a_key_named_as_a_file_already_there_fails_the_save_and_changes_nothing(ckpt_dir: Path) -> None:
    import torch.distributed.checkpoint as dcp

    ckpt_dir.mkdir()
    _write(ckpt_dir, {"w": "a file of someone else's"})
    with pytest.raises(CheckpointException, match=r"it already held w, which the checkpoint's own entries would replace"):
        dcp.save({"w": torch.ones(1024)}, storage_writer=ShardstoreWriter(ckpt_dir, layout=PER_ARRAY),
                 no_dist=True)
    assert _tree(ckpt_dir) == {"w": b"a file of someone else's"}
    assert [p.name for p in ckpt_dir.parent.iterdir()] == [ckpt_dir.name]


def test_replacing_a_checkpoint_beside_other_files_keeps_them_in_place(ckpt_dir: Path) -> None:
    """DCP's FileSystemWriter overwrites a directory it shares with a job's files; so does
    ShardstoreWriter: only the old checkpoint's own entries are replaced, the job's file
    stays, byte for byte, and the new record names it (``beside``)."""
    import torch.distributed.checkpoint as dcp

    ckpt_dir.mkdir()
    _write(ckpt_dir, {"train.log": "x"})
    dcp.save({"w": torch.ones(4)}, storage_writer=ShardstoreWriter(ckpt_dir), no_dist=True)
    dcp.save({"w": torch.zeros(4)}, storage_writer=ShardstoreWriter(ckpt_dir, overwrite=True), no_dist=True)
    assert (ckpt_dir / "train.log").read_text() == "x"
    assert shardstore.load_common_state_dict(ckpt_dir)["w"].tolist() == [0.0] * 4
    report = shardstore.verify(ckpt_dir)
    assert report.ok and report.not_ours == ["train.log"], str(report)
    assert [p.name for p in ckpt_dir.parent.iterdir()] == [ckpt_dir.name]


def test_replacing_a_checkpoint_beside_other_files_is_refused_unless_shared(ckpt_dir: Path) -> None:
    """Without ``shared_directory`` the directory is the checkpoint's alone: a file of
    someone else's in it is named, and nothing is replaced."""
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}
    shardstore.save(state, ckpt_dir)
    _write(ckpt_dir, {"train.log": "x"})
    with pytest.raises(CheckpointingException, match=r"also holds files its save did not write \(train.log\)"):
        shardstore.save({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4))}, ckpt_dir, overwrite=True)
    assert (ckpt_dir / "train.log").read_text() == "x"
    assert shardstore.load_plain_tensors(ckpt_dir)["w"].tolist() == [1.0] * 4


def test_saving_again_into_the_same_directory_replaces_as_dcps_default_does(ckpt_dir: Path) -> None:
    """DCP's FileSystemWriter overwrites by default; ShardstoreWriter too, atomically:
    the first checkpoint stays whole until the second commits. overwrite=False refuses."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(4)}, storage_writer=ShardstoreWriter(ckpt_dir), no_dist=True)
    dcp.save({"w": torch.full((4,), 2.0)}, storage_writer=ShardstoreWriter(ckpt_dir), no_dist=True)
    assert shardstore.load_common_state_dict(ckpt_dir)["w"].tolist() == [2.0] * 4
    with pytest.raises(CheckpointException, match="already holds a committed checkpoint; pass overwrite=True"):
        dcp.save({"w": torch.zeros(4)}, storage_writer=ShardstoreWriter(ckpt_dir, overwrite=False), no_dist=True)
    assert shardstore.load_common_state_dict(ckpt_dir)["w"].tolist() == [2.0] * 4


# ------------------------------------------------------------------ (b) another tool's checkpoint


def save_over_a_dcp_checkpoint(rank: int, world: int, root: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(_dtensor_state(world, 1.0), storage_writer=dcp.FileSystemWriter(f"{root}/dcp"))
    dist.barrier()
    for overwrite in (False, True):
        with pytest.raises(CheckpointException, match="holds no committed shardstore checkpoint but a PyTorch DCP "
                                                      r"checkpoint \(.metadata, __0_0.distcp, __1_0.distcp\)"):
            dcp.save(_dtensor_state(world, 2.0), storage_writer=ShardstoreWriter(f"{root}/dcp", overwrite=overwrite))
    assert _loaded_value(dcp.FileSystemReader(f"{root}/dcp"), world) == 1.0


def test_overwrite_onto_a_dcp_checkpoint_is_refused_naming_every_file_it_would_delete(tmp_path: Path) -> None:
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / "train.log").write_text("x")
    run_distributed(save_over_a_dcp_checkpoint, 2, str(tmp_path))
    assert sorted(p.name for p in (tmp_path / "dcp").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "train.log"]
    assert [p.name for p in tmp_path.iterdir()] == ["dcp"]


def test_overwrite_onto_a_megatron_torch_dist_checkpoint_is_refused_naming_its_files(ckpt_dir: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(4)}, storage_writer=dcp.FileSystemWriter(ckpt_dir), no_dist=True)
    (ckpt_dir / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                        "common_backend": "torch", "common_backend_version": 1}))
    torch.save({"iteration": 7}, ckpt_dir / "common.pt")
    before = _tree(ckpt_dir)
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4))}
    message = r"Megatron-Core 'torch_dist' checkpoint \(.metadata, __0_0.distcp, common.pt, metadata.json\).*" \
              "overwrite=True included"
    with pytest.raises(CheckpointingException, match=message):
        shardstore.save(state, ckpt_dir, overwrite=True)
    with pytest.raises(CheckpointingException, match=message):
        shardstore.save(state, ckpt_dir, overwrite=True, shared_directory=True)
    assert _tree(ckpt_dir) == before


def test_a_dcp_checkpoint_written_while_a_shared_save_runs_fails_its_commit(ckpt_dir: Path) -> None:
    """Published beside it, the directory would hold two checkpoints."""
    import torch.distributed.checkpoint as dcp

    from shardstore.strategies.async_utils import AsyncCallsQueue

    ckpt_dir.mkdir()
    request = shardstore.save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0))}, ckpt_dir,
                              async_sharded_save=True, shared_directory=True)
    dcp.save({"w": torch.ones(4)}, storage_writer=dcp.FileSystemWriter(ckpt_dir), no_dist=True)
    before = _tree(ckpt_dir)
    queue = AsyncCallsQueue()
    try:
        queue.schedule_async_request(request)
        with pytest.raises(CheckpointingException, match=r"Not committing the save.*a PyTorch DCP checkpoint "
                                                         r"\(.metadata, __0_0.distcp\)"):
            queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()
    assert _tree(ckpt_dir) == before
    assert [p.name for p in ckpt_dir.parent.iterdir()] == [ckpt_dir.name]


# ------------------------------------------------------------------ (c) two checkpoints in one directory


def dcp_saved_over_ours(rank: int, world: int, ckpt: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(_dtensor_state(world, 1.0), storage_writer=ShardstoreWriter(ckpt))
    dcp.save(_dtensor_state(world, 2.0), storage_writer=dcp.FileSystemWriter(ckpt))  # DCP's own, later
    with pytest.raises(CheckpointException, match="holds two checkpoints"):
        _loaded_value(ShardstoreReader(ckpt), world)
    assert _loaded_value(dcp.FileSystemReader(ckpt), world) == 2.0


def test_a_dcp_checkpoint_saved_over_ours_is_refused_as_ambiguous_naming_both(tmp_path: Path) -> None:
    """Before, ``ShardstoreReader`` and ``shardstore.load`` silently returned the older
    shardstore weights."""
    ckpt = tmp_path / "ckpt"
    run_distributed(dcp_saved_over_ours, 2, str(ckpt))
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(6, 3))}
    both = (r"holds two checkpoints.*a shardstore checkpoint \(save [0-9a-f]{32}: common.pt, metadata.json, packs, "
            r"zarr.json\) and a PyTorch DCP checkpoint \(.metadata, __0_0.distcp, __1_0.distcp\).*Move one of the two")
    with pytest.raises(CheckpointingException, match=both):
        shardstore.load(request, ckpt)
    with pytest.raises(CheckpointingException, match=both):
        shardstore.load_tensors_metadata(ckpt)
    assert not ShardstoreReader.validate_checkpoint_id(ckpt)


def test_verify_names_a_dcp_checkpoint_saved_over_ours(ckpt_dir: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(4)}, storage_writer=ShardstoreWriter(ckpt_dir), no_dist=True)
    assert shardstore.verify(ckpt_dir).ok
    dcp.save({"w": torch.zeros(4)}, storage_writer=dcp.FileSystemWriter(ckpt_dir), no_dist=True)
    report = shardstore.verify(ckpt_dir)
    assert not report.ok and sorted(p.key for p in report.problems) == [".metadata", "__0_0.distcp"]
    assert all("a file of a PyTorch DCP checkpoint" in p.message and "ambiguous" in p.message
               for p in report.problems)
    (ckpt_dir / ".metadata").unlink()
    (ckpt_dir / "__0_0.distcp").unlink()
    assert shardstore.verify(ckpt_dir).ok
    assert shardstore.load_common_state_dict(ckpt_dir)["w"].tolist() == [1.0] * 4
