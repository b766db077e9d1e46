"""One save pipeline and one read entry, the doors adapters over them (issue 31.1)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import shardstore
import shardstore.execution.pipeline as pipeline_module
import shardstore.opened as opened_module
from shardstore import CheckpointingException, ShardedTensor, save
from shardstore.engine.walk import open_dir
from shardstore.execution.pipeline import SavePipeline
from shardstore.format.commit import (
    ByRename,
    InPlace,
    IntoCallersDirectory,
    PendingCheckpoint,
    SaveOptions,
    adopt_save,
    begin_save,
    publisher_for,
)
from shardstore.format.records import read_commit_record
from shardstore.format.storage_layout import LayoutSite
from shardstore.opened import bare_location, open_read
from shardstore.stores.locations import open_location
from shardstore.strategies.zarr import ZarrLoadShardedStrategy, ZarrSaveShardedStrategy
from shardstore.tools.array_writer import CheckpointWriter

ROOT = Path(shardstore.__file__).parent
# Doors that still compose the save protocol themselves: none since phase B of issue 31.1
# put the DCP writer and the Megatron plug-in on SavePipeline. The set only shrinks.
NOT_YET_ADAPTED: set[str] = set()


def _state(value: float = 1.0) -> dict:
    return {"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 3), value))}


def _callers(names: set[str]) -> dict[str, set[str]]:
    """``{name: modules that call it}`` over shardstore's sources."""
    found: dict[str, set[str]] = {n: set() for n in names}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                if name in found:
                    found[name].add(rel)
    return found


def test_the_save_protocol_is_composed_in_one_place() -> None:
    """Begin/join only in the pipeline, checksum binding only in the commit: the doors
    (save, the array writer, conversion, the manager) call the pipeline."""
    callers = _callers({"begin_save", "join_save", "bind_chunks", "write_commit_record"})
    assert callers["begin_save"] - NOT_YET_ADAPTED == {"execution/pipeline.py"}
    assert callers["join_save"] - NOT_YET_ADAPTED == {"execution/pipeline.py"}
    assert callers["bind_chunks"] - NOT_YET_ADAPTED == {"execution/save_commit.py"}  # in commit_save
    # the commit record is written by the publisher, and rewritten only by remove_sharded_tensors
    assert callers["write_commit_record"] == {"format/commit/begin.py", "format/removal.py"}


def test_every_save_door_opens_one_pipeline_and_commits_once(tmp_path: Path, monkeypatch) -> None:
    opened, commits = [], []
    real_init, real_commit = SavePipeline.__init__, PendingCheckpoint.commit
    monkeypatch.setattr(SavePipeline, "__init__", lambda self, *a, **k: opened.append(1) or real_init(self, *a, **k))
    monkeypatch.setattr(PendingCheckpoint, "commit", lambda self, record: commits.append(record) or real_commit(
        self, record))

    save(_state(), tmp_path / "sync")
    save(_state(), tmp_path / "async", async_sharded_save=True).execute_sync()
    with CheckpointWriter(tmp_path / "writer") as writer:
        writer.write_array("w", torch.ones(4, 3))
        writer.commit()
    with pytest.warns(UserWarning, match="single process"):  # DCP's writer: one pipeline per rank's view
        dcp.save({"w": torch.ones(4, 3)}, storage_writer=shardstore.ShardstoreWriter(tmp_path / "dcp",
                                                                                      min_array_bytes=0))
    assert (len(opened), len(commits)) == (4, 4)
    for record in commits:  # every chunk bound by the one commit, under the save's own id
        assert record.arrays["w"].chunk_crcs is not None and record.arrays["w"].chunk_digests is not None
    assert len({r.save_id for r in commits}) == 4


def test_a_save_opens_its_target_once_and_its_reuse_source_once(tmp_path: Path, monkeypatch) -> None:
    per_array = shardstore.StorageLayout(pack_arrays_up_to=0)  # packed arrays are never reused
    save(_state(), tmp_path / "base", layout=per_array)
    opens = []

    def counted(t, **o):
        if isinstance(t, Path):  # a Location handed down is not opened again
            opens.append(t)
        return open_location(t, **o)

    monkeypatch.setattr(pipeline_module, "open_location", counted)  # the reuse source's
    monkeypatch.setattr(opened_module, "open_location", counted)  # the target's, at the door
    save(_state(), tmp_path / "next", reuse_from=tmp_path / "base", layout=per_array)
    assert sorted(opens) == [tmp_path / "base", tmp_path / "next"]
    assert read_commit_record(open_location(tmp_path / "next")).reused_from is not None  # issue 32 kept


def test_a_save_walks_the_state_dict_once_and_sets_nothing_on_its_pending_save(tmp_path: Path, monkeypatch) -> None:
    """Issue 43.1: the split walks the state dict; the strategy writes the tensors the
    pipeline planned (no second walk, no relinking by position across walks); the pending
    save's facts are all given at construction."""
    import shardstore.engine.save as serialization
    import shardstore.engine.zarr_strategies as zarr_strategy

    walks, sets = [], []
    real_flatten, real_items = serialization.flatten, zarr_strategy.local_sharded_items
    monkeypatch.setattr(serialization, "flatten", lambda *a, **k: walks.append("split") or real_flatten(*a, **k))
    monkeypatch.setattr(zarr_strategy, "local_sharded_items",
                        lambda *a, **k: walks.append("strategy") or real_items(*a, **k))
    real_setattr = PendingCheckpoint.__setattr__

    def recording_setattr(self, name, value):
        if "location" in self.__dict__:  # constructed: its last public fact is set
            sets.append(name)
        real_setattr(self, name, value)

    monkeypatch.setattr(PendingCheckpoint, "__setattr__", recording_setattr)
    save(_state(), tmp_path / "sync")
    save(_state(), tmp_path / "async", async_sharded_save=True).execute_sync()
    save(_state(2.0), tmp_path / "next", reuse_from=tmp_path / "sync", shared_directory=True)
    assert walks == ["split"] * 3
    assert [name for name in sets if not name.startswith("_")] == []
    assert torch.equal(ZarrLoadShardedStrategy().load(_state(0.0), tmp_path / "next")["w"], torch.full((4, 3), 2.0))


def test_save_combines_its_options_object_and_keywords_and_refuses_a_contradiction(tmp_path: Path) -> None:
    """``options=`` and keywords combine where they do not contradict (a keyword at its
    default takes the object's value); two different values for one field are refused,
    naming the field."""
    options = shardstore.SaveOptions(overwrite=True)
    save(_state(), tmp_path / "ckpt")
    save(_state(3.0), tmp_path / "ckpt", options=options)
    assert torch.equal(ZarrLoadShardedStrategy().load(_state(0.0), tmp_path / "ckpt")["w"], torch.full((4, 3), 3.0))
    save(_state(4.0), tmp_path / "ckpt", options=options, layout=shardstore.StorageLayout(pack_arrays_up_to=0))
    assert torch.equal(ZarrLoadShardedStrategy().load(_state(0.0), tmp_path / "ckpt")["w"], torch.full((4, 3), 4.0))
    assert (tmp_path / "ckpt" / "w" / "zarr.json").is_file()  # the keyword's layout: w has its own directory
    with pytest.raises(CheckpointingException, match="reuse_from"):
        save(_state(), tmp_path / "other", options=shardstore.SaveOptions(reuse_from=tmp_path / "ckpt"),
             reuse_from=tmp_path / "elsewhere")
    packed = shardstore.SaveOptions(overwrite=True, layout=shardstore.StorageLayout(pack_arrays_up_to=1 << 16))
    with pytest.raises(CheckpointingException, match="pack_arrays_up_to"):
        save(_state(), tmp_path / "ckpt", options=packed, layout=shardstore.StorageLayout(pack_arrays_up_to=0))
    assert not (tmp_path / "other").exists()


def test_the_publisher_comes_from_the_store_and_is_held_by_the_save(tmp_path: Path) -> None:
    local, memory = open_location(tmp_path / "ckpt"), open_location("memory://entries/ckpt")
    assert isinstance(publisher_for(local.capabilities), ByRename)
    assert isinstance(publisher_for(memory.capabilities), InPlace)
    pending = begin_save(memory, SaveOptions().chosen_for(LayoutSite()))
    try:
        assert isinstance(pending.publisher, InPlace) and adopt_save(pending.location) is pending
    finally:
        pending.abandon()
    assert isinstance(SavePipeline.open(open_location(tmp_path / "ckpt")).publisher, ByRename)


def test_a_callers_directory_is_committed_in_place_and_never_deleted(tmp_path: Path) -> None:
    """Megatron-Core's save makes the directory and writes its common.pt first; the seed's
    strategy API called on it adopts the directory (IntoCallersDirectory)."""
    ckpt = tmp_path / "megatron"
    ckpt.mkdir()
    (ckpt / "common.pt").write_bytes(b"the caller's")
    adopted = SavePipeline.into_callers_directory(open_location(ckpt))
    assert isinstance(adopted.publisher, IntoCallersDirectory)
    adopted.abandon()
    assert (ckpt / "common.pt").read_bytes() == b"the caller's"
    ZarrSaveShardedStrategy().save(_state(2.0), ckpt)
    record = read_commit_record(open_location(ckpt))
    assert "common.pt" in record.files and record.arrays["w"].chunk_crcs is not None
    assert (ckpt / "common.pt").read_bytes() == b"the caller's"
    assert torch.equal(ZarrLoadShardedStrategy().load(_state(0.0), ckpt)["w"], torch.full((4, 3), 2.0))


def test_open_read_opens_once_and_tells_ours_from_another_tools(tmp_path: Path) -> None:
    save(_state(), tmp_path / "ours")
    ours = open_read(bare_location(tmp_path / "ours"))
    assert ours.is_shardstore and set(ours.require_record().arrays) == {"w"} and open_read(ours) is ours
    assert ours.config() is not None
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "dcp")
    theirs = open_read(bare_location(tmp_path / "dcp"))
    assert theirs.other_format is not None and theirs.record is None
    with pytest.raises(CheckpointingException, match="not a shardstore checkpoint"):
        theirs.require_record()
    with pytest.raises(CheckpointingException):
        open_read(bare_location(tmp_path / "nothing"))


def test_a_callers_directory_is_opened_by_one_function() -> None:
    """The seed's signatures (save_with_plan, async_save_with_plan, async_save) and the
    Megatron plug-in reach ``SavePipeline.into_callers_directory`` through
    ``ZarrSaveShardedStrategy.into_callers_directory`` only, and plan through its
    ``plan_into``: one composition, not one per door."""
    direct: list[str] = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("into_callers_directory", "plan")
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "SavePipeline"):
                direct.append(path.relative_to(ROOT).as_posix())
    assert direct == ["engine/zarr_strategies.py"]


def test_the_zarr_modules_seed_functions_round_trip_and_read_through_open_read(tmp_path: Path, monkeypatch) -> None:
    from shardstore.engine import zarr_arrays  # where the seed's functions live
    from shardstore.engine import zarr_strategies as zarr_module

    ckpt = tmp_path / "seed"
    ckpt.mkdir()
    tensors = [ShardedTensor.from_rank_offsets(key, torch.arange(12.0).reshape(4, 3) + i)
               for i, key in enumerate(("a", "b/c"))]
    for tensor, array in zip(tensors, zarr_module._create_or_open_zarr_arrays(tensors, ckpt)):
        zarr_module._save_to_existing_array(tensor, array)
    for tensor in tensors:
        loaded = zarr_module._load_from_array(ShardedTensor.from_rank_offsets(tensor.key, torch.empty(4, 3)), ckpt)
        assert torch.equal(loaded, tensor.data)

    save(_state(3.0), tmp_path / "ours")
    reads = []
    monkeypatch.setattr(zarr_arrays, "open_dir", lambda c: reads.append(c) or open_dir(c))
    metadata = zarr_module.load_zarr_based_sharded_metadata(tmp_path / "ours", lambda path: ((4, 3), "float32"))
    assert reads == [tmp_path / "ours"] and set(metadata) == {"w"} and metadata["w"].global_shape == (4, 3)
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "dcp")
    with pytest.raises(CheckpointingException, match="not a shardstore checkpoint"):
        zarr_module.load_zarr_based_sharded_metadata(tmp_path / "dcp", lambda path: ((2,), "float32"))


def test_the_seeds_writers_refuse_a_committed_checkpoint_given_by_path(tmp_path: Path) -> None:
    """Megatron's protocol writes files into a caller's directory outside our commit; given
    the path of a committed checkpoint, each writer refuses (``checkpoint_dirs.write_dir``)
    instead of changing a file its record vouches for, and the checkpoint stays whole."""
    from shardstore import verify
    from shardstore.core import CheckpointingConfig, save_config
    from shardstore.engine import zarr_strategies as zarr_module
    from shardstore.mapping import ShardedObject
    from shardstore.strategies.common import TorchCommonSaveStrategy

    ckpt = tmp_path / "ours"
    save({**_state(1.0), "step": 1}, ckpt)
    before = {p.relative_to(ckpt): p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    common = TorchCommonSaveStrategy()
    tensor = ShardedTensor.from_rank_offsets("w2", torch.ones(2))
    writers = {
        "save_common": lambda: common.save_common({"step": 2}, ckpt),
        "save_sharded_objects": lambda: common.save_sharded_objects({"o": ShardedObject("o", 1, (1,), (0,))}, ckpt),
        "_create_or_open_zarr_arrays": lambda: zarr_module._create_or_open_zarr_arrays([tensor], str(ckpt)),
        "_create_zarr_array": lambda: zarr_module._create_zarr_array(tensor, ckpt),
        "save_config": lambda: save_config(CheckpointingConfig("zarr", 1, "torch", 1), ckpt),
    }
    writers["save_common into its Location"] = lambda: common.save_common({"step": 2}, bare_location(ckpt))
    for name, write in writers.items():
        try:
            write()
        except CheckpointingException as exc:
            assert str(ckpt) in str(exc) and "committed shardstore checkpoint" in str(exc), name
        else:
            pytest.fail(f"{name} wrote into a committed checkpoint")
    assert {p.relative_to(ckpt): p.read_bytes() for p in ckpt.rglob("*") if p.is_file()} == before
    assert verify(ckpt).ok


def test_the_seeds_writers_in_megatrons_order_write_metadata_after_the_commit(tmp_path: Path) -> None:
    """Megatron-Core's own order through the seed's API: the common state, the sharded
    save (committed in place), then ``metadata.json``, which the format admits after the
    commit where the record does not list it."""
    from shardstore import load, verify
    from shardstore.core import CheckpointingConfig, save_config
    from shardstore.strategies.common import TorchCommonSaveStrategy
    from shardstore.strategies.zarr import SHARDSTORE_BACKEND, ZARR_VERSION

    ckpt = tmp_path / "megatron_order"
    ckpt.mkdir()
    TorchCommonSaveStrategy().save_common({"step": 7}, ckpt)
    ZarrSaveShardedStrategy().save(_state(2.0), ckpt)
    save_config(CheckpointingConfig(SHARDSTORE_BACKEND, ZARR_VERSION, "torch", 1), ckpt)
    assert json.loads((ckpt / "metadata.json").read_text())["sharded_backend"] == SHARDSTORE_BACKEND
    assert verify(ckpt).ok
    loaded = load({**_state(0.0), "step": None}, ckpt)
    assert torch.equal(loaded["w"], torch.full((4, 3), 2.0)) and loaded["step"] == 7


def test_only_the_entries_turn_a_path_into_a_location() -> None:
    """Issue 31.1: ``open_location`` is called by ``opened.bare_location`` (the doors'
    one conversion) and one format function whose seed signature takes a path
    (``verify``); every other module goes through them (the save pipeline hands it to
    ``SaveOptions.opened`` for the reuse source; Megatron-Core's ``maybe_load_config``
    converts by ``bare_location`` in its dialect, issue 66.1)."""
    from tests.script_support import load_script

    count_doors = load_script("count_doors")
    assert count_doors.counts() == {
        "open_location calls": 2, "tools imports of lower layers": 0, "location subclass probes": 0,
    }


def _saves_into_callers_directories(rank: int, world: int, root: str) -> int:
    """Three saves through the seed's strategy into directories rank 0 made; the keys
    they left in the process group's store."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    dist.barrier()
    before = store.num_keys()
    for i in range(3):
        ckpt = Path(root) / f"megatron{i}"
        if rank == 0:
            ckpt.mkdir()
        dist.barrier()
        ZarrSaveShardedStrategy().save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2), (0, rank, world))}, ckpt)
    dist.barrier()
    return store.num_keys() - before


def test_saves_into_a_callers_directory_leave_nothing_in_the_store(tmp_path: Path) -> None:
    """Each rank of a save into a caller's directory (Megatron-Core's save, the plug-in)
    makes its own save id, so the count of ranks that stopped writing
    (``protocol.stopped_writers``) can never be met there. Before, every rank but the
    coordinator still added its own counter to the c10d store, which only the
    coordinator's was dropped from: world size - 1 keys left in the store per save."""
    from tests.dist import run_distributed

    assert run_distributed(_saves_into_callers_directories, 2, str(tmp_path)) == [0, 0]


class _WritesItsOwnFiles:
    """A save strategy of someone else's (Megatron-style code subclassing the seed's
    interface): writes a file of its own format, commits nothing of shardstore's."""

    @staticmethod
    def make(asynchronous: bool) -> object:
        from shardstore.strategies.async_utils import AsyncRequest
        from shardstore.strategies.base import AsyncSaveShardedStrategy, SaveShardedStrategy

        def write(checkpoint_dir: object) -> None:
            checkpoint_dir.write_bytes("theirs.bin", b"their format")

        class Sync(SaveShardedStrategy):
            def save(self, sharded_state_dict: dict, checkpoint_dir: object) -> None:
                write(checkpoint_dir)

        class Async(AsyncSaveShardedStrategy):
            def async_save(self, sharded_state_dict: dict, checkpoint_dir: object) -> AsyncRequest:
                return AsyncRequest(async_fn=write, async_fn_args=(checkpoint_dir,), finalize_fns=[])

        return (Async if asynchronous else Sync)("theirs", 1)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_save_through_a_strategy_that_commits_nothing_fails(tmp_path: Path, asynchronous: bool) -> None:
    """``shardstore.save`` with a save strategy that is not shardstore's (it writes through
    the location the save hands it and commits nothing). Before, ``save`` returned (and
    the async request finished) as after a successful save, with no checkpoint at all:
    only a staging directory the next save would remove. Now the save fails, saying so,
    and leaves nothing behind."""
    ckpt = tmp_path / "ckpt"
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(2)), "step": 1}
    with pytest.raises(CheckpointingException, match=r"(?s)committed nothing.*ZarrSaveShardedStrategy"):
        request = save(state, ckpt, _WritesItsOwnFiles.make(asynchronous), async_sharded_save=asynchronous)
        if asynchronous:
            request.execute_sync()
    assert list(tmp_path.iterdir()) == []
