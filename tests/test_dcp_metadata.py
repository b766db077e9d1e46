"""Issue 42.1 and 42.3: DCP's own meaning through ``ShardstoreWriter``/``ShardstoreReader``.

42.1: ``read_metadata`` gives back the ``planner_data`` and ``storage_meta`` DCP's own
``FileSystemWriter`` records, so DCP's template-less loads (``_EmptyStateDictLoadPlanner``:
``dcp_to_torch_save``, ``_load_state_dict_from_keys``) and ``shardstore convert`` give
the caller's nesting back, and the ids round-trip; a checkpoint saved before they were
recorded still loads, with flat names. 42.3: ``dcp.load`` casts as DCP's own reader
does; empty containers round-trip.

Each state is saved at 2 gloo ranks by both writers; what DCP's own gives is the
reference.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import shardstore
from shardstore import ShardstoreReader, ShardstoreWriter
from shardstore.core import CheckpointingException
from shardstore.format.records import COMMIT_RECORD, CommitRecord, DcpMetadata
from tests import fsdp_models as fm
from tests.dist import run_distributed

warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _training_state(world: int) -> dict[str, Any]:
    """FSDP2's DTensors, AdamW's ``step`` and param groups, and plain values."""
    model, optimizer = fm.build(world)
    fm.train_step(model, optimizer, 0)
    return {**fm.state_dict(model, optimizer), "epoch": 3}


def save_both_ways(rank: int, world: int, root: str) -> tuple[str, str]:
    """The training state through DCP's writer and ours; the coordinator's save ids."""
    import torch.distributed.checkpoint as dcp

    state = _training_state(world)
    ours, theirs = ShardstoreWriter(f"{root}/ours"), dcp.FileSystemWriter(f"{root}/dcp")
    dcp.save(state, storage_writer=ours)
    dcp.save(state, storage_writer=theirs)
    return ours.save_id, theirs.save_id


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    root = tmp_path_factory.mktemp("dcp-metadata")
    ours_id, dcp_id = run_distributed(save_both_ways, 2, str(root))[0]
    return root, ours_id, dcp_id


def _template_less(reader: Any, keys: set[str] | None = None) -> dict[str, Any]:
    """What DCP loads without a state dict (``_EmptyStateDictLoadPlanner``, one process)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    return _load_state_dict_from_keys(keys, storage_reader=reader)


def _dcp_to_torch_save(checkpoint: Path, out: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, out)
    return torch.load(out, weights_only=True)


def test_planner_data_is_what_dcps_own_writer_records(saved: tuple[Path, str, str]) -> None:
    import torch.distributed.checkpoint as dcp

    root, _, _ = saved
    ours = ShardstoreReader(root / "ours").read_metadata()
    theirs = dcp.FileSystemReader(root / "dcp").read_metadata()
    assert ours.planner_data == theirs.planner_data
    assert ours.state_dict_metadata.keys() == theirs.state_dict_metadata.keys()


def test_template_less_load_gives_the_nesting_dcp_to_torch_save_gives(saved: tuple[Path, str, str]) -> None:
    root, _, _ = saved
    reference = _dcp_to_torch_save(root / "dcp", root / "dcp.pt")
    assert reference.keys() == {"model", "optim", "epoch"}
    fm.assert_same(_template_less(ShardstoreReader(root / "ours")), reference)


def test_template_less_load_of_some_keys_gives_them_nested(saved: tuple[Path, str, str]) -> None:
    import torch.distributed.checkpoint as dcp

    root, _, _ = saved
    ours = _template_less(ShardstoreReader(root / "ours"), {"model"})
    fm.assert_same(ours, _template_less(dcp.FileSystemReader(root / "dcp"), {"model"}))
    assert ours.keys() == {"model"}


def test_convert_to_a_torch_file_gives_the_nesting_dcp_to_torch_save_gives(saved: tuple[Path, str, str]) -> None:
    from shardstore.tools.cli import main

    root, _, _ = saved
    result = CliRunner().invoke(main, ["--no-progress", "convert", str(root / "ours"), str(root / "ours.pt")])
    assert result.exit_code == 0, result.output
    reference = _dcp_to_torch_save(root / "dcp", root / "dcp-for-convert.pt")
    fm.assert_same(torch.load(root / "ours.pt", weights_only=True), reference)


def test_storage_ids_round_trip_as_with_dcps_own_writer(saved: tuple[Path, str, str]) -> None:
    import torch.distributed.checkpoint as dcp

    root, ours_id, dcp_id = saved
    reader = ShardstoreReader(root / "ours")
    ours = reader.read_metadata().storage_meta
    theirs = dcp.FileSystemReader(root / "dcp").read_metadata().storage_meta
    assert (ours.checkpoint_id, ours.save_id, ours.load_id) == (str(root / "ours"), ours_id, reader.load_id)
    assert (str(theirs.checkpoint_id), theirs.save_id) == (str(root / "dcp"), dcp_id)
    reader.reset()
    assert reader.read_metadata().storage_meta.load_id == reader.load_id != ours.load_id, "a new load id per reset"


def _without_dcp_metadata(checkpoint: Path) -> None:
    """The commit record as a save through ShardstoreWriter wrote it before DCP's
    metadata was recorded: without its ``dcp`` block (sealed again)."""
    where = str(checkpoint / COMMIT_RECORD)
    record = CommitRecord.from_json((checkpoint / COMMIT_RECORD).read_bytes(), where)
    assert record.dcp is not None
    (checkpoint / COMMIT_RECORD).write_bytes(replace(record, dcp=None).to_json())


def load_old_style(rank: int, world: int, checkpoint: str, expected: bytes) -> None:
    import torch.distributed.checkpoint as dcp

    model, optimizer = fm.build(world, seed=5)
    request = {**fm.state_dict(model, optimizer), "epoch": 0}
    dcp.load(request, storage_reader=ShardstoreReader(checkpoint))
    fm.assert_same(fm.full_values(request), fm.from_bytes(expected))


def test_a_checkpoint_saved_before_dcp_metadata_was_recorded_loads_with_flat_names(
    saved: tuple[Path, str, str], tmp_path: Path,
) -> None:
    import shutil

    root, _, _ = saved
    old = tmp_path / "old"
    shutil.copytree(root / "ours", old)
    _without_dcp_metadata(old)
    assert shardstore.verify(old).ok
    metadata = ShardstoreReader(old).read_metadata()
    assert metadata.planner_data is None and metadata.storage_meta.save_id is None
    flat = _template_less(ShardstoreReader(old))
    assert "model.0.weight" in flat and "epoch" in flat, sorted(flat)
    reference = _dcp_to_torch_save(root / "dcp", tmp_path / "dcp.pt")
    run_distributed(load_old_style, 2, str(old), fm.to_bytes(reference))


def test_a_record_whose_dcp_paths_would_allocate_without_bound_is_refused(saved: tuple[Path, str, str]) -> None:
    root, _, _ = saved
    where = str(root / "ours" / COMMIT_RECORD)
    record = CommitRecord.from_json((root / "ours" / COMMIT_RECORD).read_bytes(), where)
    hostile = replace(record, dcp=DcpMetadata({"l.1000000000": ("l", 10**9)}))
    with pytest.raises(CheckpointingException, match=r"malformed DCP planner paths"):
        CommitRecord.from_json(hostile.to_json(), where)


# --------------------------------------------------------------------------- 42.3


def _empty_containers() -> dict[str, Any]:
    """Empty dicts and lists at every depth, beside tensors in common.pt and an array."""
    small = torch.arange(4.0)
    return {
        "l": [{}, small], "deep": {"b": [[{}, small], {}, {"x": 1}, small]}, "e": {},
        "n": [[], small], "k": {"a": [], "b": small}, "array": [{}, torch.arange(1000.0)],
    }


def save_and_load_empty_containers(rank: int, world: int, root: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(_empty_containers(), storage_writer=ShardstoreWriter(f"{root}/ours"))
    request = _empty_containers()
    for value in (request["l"][1], request["array"][1]):
        value.zero_()
    dcp.load(request, storage_reader=ShardstoreReader(f"{root}/ours"))
    fm.assert_same(request, _empty_containers())


def test_empty_containers_at_any_depth_round_trip_through_dcp(tmp_path: Path) -> None:
    run_distributed(save_and_load_empty_containers, 2, str(tmp_path))


def test_an_empty_dict_in_a_list_comes_back_without_a_state_dict(tmp_path: Path) -> None:
    """DCP's own ``dcp_to_torch_save`` of ``{"l": [{}, t]}`` fails ("Missing key l.0");
    ours gives it back (a top-level empty dict, which DCP's flattening leaves no trace of,
    is absent as there)."""
    import torch.distributed.checkpoint as dcp

    state = _empty_containers()
    dcp.save(state, storage_writer=ShardstoreWriter(tmp_path / "ours"))
    del state["e"]
    fm.assert_same(_template_less(ShardstoreReader(tmp_path / "ours")), state)
    fm.assert_same(shardstore.load_common_state_dict(tmp_path / "ours")["l"], state["l"])


def _float32_state(world: int) -> dict[str, Any]:
    """0.1 and friends, which bfloat16 cannot hold: a DTensor, an array, a small tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    values = torch.linspace(0.1, 0.9, 2048)
    return {"d": distribute_tensor(values.reshape(16, 128), mesh, [Shard(0)]), "w": values.clone(),
            "b": values[:8].clone()}


def cast_both_ways(rank: int, world: int, root: str) -> None:
    import torch.distributed.checkpoint as dcp

    state = _float32_state(world)
    dcp.save(state, storage_writer=ShardstoreWriter(f"{root}/ours"))
    dcp.save(state, storage_writer=dcp.FileSystemWriter(f"{root}/dcp"))
    loaded = []
    for reader in (ShardstoreReader(f"{root}/ours"), dcp.FileSystemReader(f"{root}/dcp")):
        request = {key: value.to(torch.bfloat16).zero_() for key, value in _float32_state(world).items()}
        dcp.load(request, storage_reader=reader)
        loaded.append(fm.full_values(request))
    fm.assert_same(loaded[0], loaded[1])
    assert loaded[0]["w"].dtype == torch.bfloat16 and torch.equal(loaded[0]["w"], state["w"].to(torch.bfloat16))


def test_dcp_load_casts_to_the_requested_dtype_as_dcps_own_reader(tmp_path: Path) -> None:
    run_distributed(cast_both_ways, 2, str(tmp_path))


def test_shardstore_load_still_refuses_a_lossy_cast(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.linspace(0.1, 0.9, 2048)}, storage_writer=ShardstoreWriter(tmp_path / "ours"))
    with pytest.raises(CheckpointingException, match=r"allow_lossy_casts"):
        shardstore.load({"w": torch.zeros(2048, dtype=torch.bfloat16)}, tmp_path / "ours")


def test_a_save_dcp_did_not_flatten_loads_by_the_names_it_saved(tmp_path: Path) -> None:
    """``DefaultSavePlanner(flatten_state_dict=False)`` saves each top-level value under
    its own name (a nested dict as one value; no planner data). Loading it back with the
    same planner settings failed "Missing key in checkpoint state_dict: model": the
    reader named the common values by flattening them (``model.w``), never by the names
    saved; DCP's own reader loads it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

    def state(fill: float) -> dict[str, Any]:
        return {"model": {"w": torch.full((4, 4), fill), "b": torch.full((3,), fill)},
                "top": torch.full((500,), fill), "note": f"{fill}"}

    loaded = []
    for name, writer, reader in (("ours", ShardstoreWriter, ShardstoreReader),
                                 ("dcp", dcp.FileSystemWriter, dcp.FileSystemReader)):
        dcp.save(state(1.0), storage_writer=writer(tmp_path / name), planner=DefaultSavePlanner(flatten_state_dict=False))
        request = state(0.0)
        dcp.load(request, storage_reader=reader(tmp_path / name),
                 planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False))
        loaded.append(request)
        assert sorted(reader(tmp_path / name).read_metadata().state_dict_metadata) == ["model", "note", "top"]
    fm.assert_same(loaded[0], state(1.0))
    fm.assert_same(loaded[0], loaded[1])


def test_the_metadata_dcp_save_returns_carries_the_storage_ids_and_version(tmp_path: Path) -> None:
    """``dcp.save`` (and ``dcp.async_save``'s future) returns the checkpoint's Metadata,
    which DCP's own writer completes in ``finish`` with its ``storage_meta`` (checkpoint
    id, save id) and its ``version``. Through ``ShardstoreWriter`` both were None, and
    ``read_metadata().version`` was None where ``FileSystemReader`` gives DCP's."""
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(512.0), "step": 3}
    ours, theirs = ShardstoreWriter(tmp_path / "ours"), dcp.FileSystemWriter(tmp_path / "dcp")
    returned = {"ours": dcp.save(state, storage_writer=ours), "dcp": dcp.save(state, storage_writer=theirs)}
    for name, writer in (("ours", ours), ("dcp", theirs)):
        meta = returned[name].storage_meta
        assert meta is not None, name
        assert (str(meta.checkpoint_id), meta.save_id) == (str(tmp_path / name), writer.save_id), name
    assert returned["ours"].version == returned["dcp"].version is not None
    later = ShardstoreWriter(tmp_path / "async")
    assert dcp.async_save(state, storage_writer=later).result().storage_meta.save_id == later.save_id
    read = ShardstoreReader(tmp_path / "ours").read_metadata()
    assert read.version == dcp.FileSystemReader(tmp_path / "dcp").read_metadata().version
