"""Packed small arrays (issue 44.6) through the other doors a save comes by: DCP's own
``dcp.save`` with ``ShardstoreWriter(pack_arrays_up_to=...)`` and Megatron-Core's own
``dist_checkpointing.save`` after ``shardstore.megatron.install(pack_arrays_up_to=...)``,
as ``SaveOptions(pack_arrays_up_to=...)`` does for ``shardstore.save``.

DCP at 2 gloo ranks: many small plain tensors (replicated: one writer each), small
DTensors split over the ranks (gathered whole to one writer over the writer's exchange
group, and packed), a DTensor one rank holds whole and a replicated DTensor (packed by
their one writer), Python values (DCP's byte items:
common.pt, never packed). Each save loads back bit-exact through ``dcp.load`` with
``ShardstoreReader`` and through ``shardstore.load``, verifies, and gives DCP the same
metadata as an unpacked save; a save beside another program's file, and a save over a
packed one, packed or not, leave no pack behind that the record does not list.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

import shardstore
from shardstore import ShardstoreReader, ShardstoreWriter
from shardstore.format.records import read_commit_record
from shardstore.stores.locations import open_location
from tests import fsdp_models as fm
from tests.dist import run_distributed

PACK_BYTES = 64 * 1024
SMALL = 24  # plain tensors of 0.1-6 KiB: packed
SPLIT = 4  # DTensors split over both ranks: gathered whole to one writer, packed


def _state(world: int, seed: int, empty: bool = False) -> dict[str, Any]:
    """Every rank's state dict (the same seed gives every rank the same values): plain
    tensors (a replicated model), DTensors of each kind, Python values."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    gen = torch.Generator().manual_seed(seed)

    def value(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        t = torch.randn(*shape, generator=gen).to(dtype)
        return torch.zeros_like(t) if empty else t

    mesh = init_device_mesh("cpu", (world,))
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    plain = {f"block{i % 5}.w{i}": value(8 + 13 * i, dtype=dtypes[i % 4]) for i in range(SMALL)}
    plain["ids"] = torch.arange(300, dtype=torch.int64) * (0 if empty else 1)
    plain["big"] = value(128, 256)  # 128 KiB: above the bound, a directory of its own
    sharded = {f"split{i}": distribute_tensor(value(2 * world * (i + 1), 16), mesh, [Shard(0)]) for i in range(SPLIT)}
    sharded["lonely"] = distribute_tensor(value(1, 40), mesh, [Shard(0)])  # rank 0 holds it whole
    sharded["everywhere"] = distribute_tensor(value(6, 10), mesh, [Replicate()])
    return {
        "model": plain,
        "dtensors": sharded,
        "step": torch.tensor(7.0 if not empty else 0.0),  # 0-d: common.pt
        "extra": {"name": "run-1" if not empty else "", "lrs": [0.1, 0.01] if not empty else []},
    }


def _packed_keys() -> set[str]:
    return {*(f"model.block{i % 5}.w{i}" for i in range(SMALL)), "model.ids", "dtensors.lonely", "dtensors.everywhere",
            *(f"dtensors.split{i}" for i in range(SPLIT))}


def _comparable(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` gathered whole."""
    return fm.full_values(state)


def _dcp_load(ckpt: str, world: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    request = _state(world, seed=0, empty=True)
    dcp.load(request, storage_reader=ShardstoreReader(ckpt))
    return request


def _metadata(ckpt: str) -> tuple:
    """What DCP's load planners see of a checkpoint, its ids but the path and load id."""
    metadata = ShardstoreReader(ckpt).read_metadata()
    meta = metadata.storage_meta
    return metadata.state_dict_metadata, metadata.planner_data, meta.save_id is not None, meta.modules


def save_packed_and_load_both_ways(rank: int, world: int, root: str) -> bytes:
    import torch.distributed.checkpoint as dcp

    state = _state(world, seed=1)
    saved = _comparable(state)
    dcp.save(state, storage_writer=ShardstoreWriter(f"{root}/packed", min_array_bytes=0,
                                                    pack_arrays_up_to=PACK_BYTES))
    dcp.save(state, storage_writer=ShardstoreWriter(f"{root}/unpacked", min_array_bytes=0, pack_arrays_up_to=0))
    fm.assert_same(_comparable(_dcp_load(f"{root}/packed", world)), saved)
    loaded = shardstore.load(_state(world, seed=0, empty=True), f"{root}/packed")
    fm.assert_same(_comparable(loaded), saved)
    packed, unpacked = _metadata(f"{root}/packed"), _metadata(f"{root}/unpacked")
    assert packed == unpacked, "DCP's metadata of a packed save differs from an unpacked one's"
    return fm.to_bytes(saved)


def test_dcp_save_packs_small_arrays_of_one_writer_and_loads_both_ways(tmp_path: Path) -> None:
    saved = fm.from_bytes(run_distributed(save_packed_and_load_both_ways, 2, str(tmp_path))[0])
    ckpt = tmp_path / "packed"
    record = read_commit_record(open_location(ckpt))
    assert record.requires == ("packs",)
    packed = {key for key, array in record.arrays.items() if array.pack is not None}
    assert packed == _packed_keys(), sorted(packed ^ _packed_keys())
    assert sorted(record.packs) == ["packs/0-0.zip", "packs/1-0.zip"], record.packs  # both ranks wrote some
    members: list[str] = []  # a replicated array is in one pack only: one rank wrote it
    for pack, size in record.packs.items():
        assert (ckpt / pack).stat().st_size == size, pack
        with zipfile.ZipFile(ckpt / pack) as zipped:
            members += [name.rsplit("/", 1)[0] for name in zipped.namelist() if "/c" in name]
    assert sorted(members) == sorted(packed), sorted(members)
    assert (ckpt / "model.big").is_dir()
    for key in packed:
        assert not (ckpt / key).exists(), key
    report = shardstore.verify(ckpt)
    assert report.ok, report
    common = shardstore.load_common_state_dict(ckpt)
    assert common["extra"] == saved["extra"] and common["step"] == saved["step"]
    unpacked = read_commit_record(open_location(tmp_path / "unpacked"))
    assert not unpacked.packs and all(a.pack is None for a in unpacked.arrays.values())


def save_packed_exchanging(rank: int, world: int, root: str) -> None:
    import torch.distributed.checkpoint as dcp

    state = _state(world, seed=2)
    saved = _comparable(state)
    dcp.save(state, storage_writer=ShardstoreWriter(f"{root}/packed", min_array_bytes=0, shard_bytes=1 << 20,
                                                    pack_arrays_up_to=PACK_BYTES))
    fm.assert_same(_comparable(_dcp_load(f"{root}/packed", world)), saved)


def test_dcp_save_with_shard_bytes_packs_split_dtensors_gathered_whole(tmp_path: Path) -> None:
    """With ``shard_bytes`` the ranks exchange blocks in ``write_data``: a small DTensor
    split over them is gathered whole to one writer and packed there, as
    ``shardstore.save`` does, as without it (above)."""
    run_distributed(save_packed_exchanging, 2, str(tmp_path))  # loads it back through DCP, bit-exact
    ckpt = tmp_path / "packed"
    record = read_commit_record(open_location(ckpt))
    packed = {key for key, array in record.arrays.items() if array.pack is not None}
    split = {f"dtensors.split{i}" for i in range(SPLIT)}
    assert packed == _packed_keys() | split, sorted(packed ^ (_packed_keys() | split))
    assert not [key for key in split if (ckpt / key).exists()]
    assert shardstore.verify(ckpt).ok


def save_beside_and_over(rank: int, world: int, ckpt: str) -> bytes:
    """Packed into a directory that holds another program's file, then packed again over
    it with other values, then unpacked over that."""
    import torch.distributed.checkpoint as dcp

    for seed, up_to in ((1, PACK_BYTES), (2, PACK_BYTES), (3, 0)):
        state = _state(world, seed)
        dcp.save(state, storage_writer=ShardstoreWriter(ckpt, min_array_bytes=0, pack_arrays_up_to=up_to))
        fm.assert_same(_comparable(_dcp_load(ckpt, world)), _comparable(state))
        torch.distributed.barrier()
        if rank == 0:
            report = shardstore.verify(ckpt)
            assert report.ok, (seed, report)
            packs = sorted(str(p.relative_to(ckpt)) for p in Path(ckpt).rglob("*.zip"))
            assert packs == sorted(read_commit_record(open_location(ckpt)).packs), (seed, packs)
        torch.distributed.barrier()
    return fm.to_bytes(_comparable(state))


def test_dcp_packed_saves_beside_other_files_and_over_each_other_leave_no_stale_pack(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "train.log").write_text("step 1\n")
    run_distributed(save_beside_and_over, 2, str(ckpt))
    assert (ckpt / "train.log").read_text() == "step 1\n"
    assert not (ckpt / "packs").exists()
    assert "packs" not in read_commit_record(open_location(ckpt)).requires


def test_dcp_writer_refuses_a_bad_bound_at_construction(tmp_path: Path) -> None:
    for bad in (-1, 1.5, "64k"):
        with pytest.raises(ValueError, match="pack_arrays_up_to"):
            ShardstoreWriter(tmp_path / "c", pack_arrays_up_to=bad)
    assert ShardstoreWriter(tmp_path / "c").layout.pack_arrays_up_to == "auto"  # chosen per save


def save_packed_twice_with_a_reused_plan(rank: int, world: int, root: str) -> None:
    """DCP's plan cache hands the second save the first one's plans; the third, by a
    writer that does not pack, must not get a packing plan for them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    for step, seed, bound in ((1, 1, PACK_BYTES), (2, 2, PACK_BYTES), (3, 3, 0)):
        state = _state(world, seed)
        dcp.save(state, storage_writer=ShardstoreWriter(f"{root}/step{step}", min_array_bytes=0,
                                                        pack_arrays_up_to=bound),
                 planner=DefaultSavePlanner(enable_plan_caching=True))
        fm.assert_same(_comparable(_dcp_load(f"{root}/step{step}", world)), _comparable(state))


def test_dcp_packed_saves_under_dcps_plan_cache(tmp_path: Path) -> None:
    run_distributed(save_packed_twice_with_a_reused_plan, 2, str(tmp_path))
    for step in (1, 2):
        ckpt = tmp_path / f"step{step}"
        assert shardstore.verify(ckpt).ok, step
        record = read_commit_record(open_location(ckpt))
        assert {k for k, a in record.arrays.items() if a.pack is not None} == _packed_keys(), step
        assert json.loads((ckpt / "metadata.json").read_text())["sharded_backend"] == "shardstore"
    unpacked = read_commit_record(open_location(tmp_path / "step3"))
    assert shardstore.verify(tmp_path / "step3").ok
    assert [k for k, a in unpacked.arrays.items() if a.pack is not None] == [] and not unpacked.packs


def save_unpacked_then_packed_exchanging_with_a_cached_plan(rank: int, world: int, root: str) -> None:
    """With ``shard_bytes`` the plan itself gathers a small split DTensor to one writer
    where it packs: a writer that packs must not take the plan a writer that did not
    pack made for the same items (DCP's plan cache hands it back)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    for step, bound in ((1, 0), (2, PACK_BYTES)):
        state = _state(world, seed=step)
        dcp.save(state, storage_writer=ShardstoreWriter(f"{root}/step{step}", min_array_bytes=0, shard_bytes=1 << 20,
                                                        pack_arrays_up_to=bound),
                 planner=DefaultSavePlanner(enable_plan_caching=True))
        fm.assert_same(_comparable(_dcp_load(f"{root}/step{step}", world)), _comparable(state))


def test_dcp_plan_cache_keeps_plans_of_other_pack_bounds_apart(tmp_path: Path) -> None:
    run_distributed(save_unpacked_then_packed_exchanging_with_a_cached_plan, 2, str(tmp_path))
    assert not read_commit_record(open_location(tmp_path / "step1")).packs
    record = read_commit_record(open_location(tmp_path / "step2"))
    packed = {key for key, array in record.arrays.items() if array.pack is not None}
    split = {f"dtensors.split{i}" for i in range(SPLIT)}
    assert packed == _packed_keys() | split, sorted(packed ^ (_packed_keys() | split))
    assert shardstore.verify(tmp_path / "step2").ok


def save_async_then_incremental(rank: int, world: int, root: str) -> None:
    """``dcp.async_save`` packing into step1 (on a group of its own), then ``dcp.save``
    packing into step2, reusing from step1."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    state = _state(world, seed=4)
    background = dist.new_group(backend="gloo")
    dcp.async_save(state, storage_writer=ShardstoreWriter(f"{root}/step1", min_array_bytes=0,
                                                          pack_arrays_up_to=PACK_BYTES, process_group=background),
                   process_group=background).result()
    dcp.save(state, storage_writer=ShardstoreWriter(f"{root}/step2", min_array_bytes=0, pack_arrays_up_to=PACK_BYTES,
                                                    reuse_from=f"{root}/step1"))
    torch.distributed.barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(f"{root}/step1")
    torch.distributed.barrier()
    fm.assert_same(_comparable(_dcp_load(f"{root}/step2", world)), _comparable(state))


def test_dcp_async_and_incremental_saves_pack_and_share_only_unpacked_chunks(tmp_path: Path) -> None:
    run_distributed(save_async_then_incremental, 2, str(tmp_path))
    record = read_commit_record(open_location(tmp_path / "step2"))
    assert {k for k, a in record.arrays.items() if a.pack is not None} == _packed_keys()
    assert record.reused_from is not None and record.reused_from.chunks > 0, record.reused_from
    report = shardstore.verify(tmp_path / "step2")
    assert report.ok, report


@pytest.mark.parametrize("committed", [False, True], ids=["empty", "beside_a_checkpoint"])
def test_a_packed_save_beside_another_programs_packs_entry_is_refused_before_it_writes(
    tmp_path: Path, committed: bool,
) -> None:
    """A directory another program keeps ``packs/`` in (alone, or beside an unpacked
    checkpoint): a packed save would need that name for its zips. Refused when the save
    begins, naming the option, not after every rank wrote (where the error said to
    rename state dict keys, which no key can fix)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # DCP's: a BaseException

    ckpt = tmp_path / "ckpt"
    (ckpt / "packs").mkdir(parents=True)
    (ckpt / "packs" / "notes.txt").write_text("theirs")
    state = {"w": torch.arange(300.0), "v": torch.ones(400)}
    if committed:
        dcp.save(state, storage_writer=ShardstoreWriter(ckpt, pack_arrays_up_to=0))  # the default packs: refused
    before = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*"))
    began = []
    original = ShardstoreWriter._write_shards

    def recording(self, *args, **kwargs):  # noqa: ANN001, ANN202
        began.append(True)
        return original(self, *args, **kwargs)

    ShardstoreWriter._write_shards = recording
    try:
        with pytest.raises(CheckpointException, match="pack_arrays_up_to") as refused:
            dcp.save(state, storage_writer=ShardstoreWriter(ckpt, pack_arrays_up_to=PACK_BYTES))
    finally:
        ShardstoreWriter._write_shards = original
    assert "rename those keys" not in str(refused.value)
    assert not began, "refused only after the ranks wrote"
    assert sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*")) == before
    assert (ckpt / "packs" / "notes.txt").read_text() == "theirs"
    if committed:
        assert shardstore.verify(ckpt).ok
    dcp.save(state, storage_writer=ShardstoreWriter(ckpt, pack_arrays_up_to=0))  # unpacked, published beside them
    assert (ckpt / "packs" / "notes.txt").read_text() == "theirs" and shardstore.verify(ckpt).ok


def test_dcp_packed_save_to_s3_writes_each_pack_as_one_object_and_saves_over_it(moto_server) -> None:  # noqa: ANN001
    """One process, plain tensors, on object storage (published in place): packed, then
    packed again over it (overwrite), each loading back through DCP's reader."""
    import torch.distributed.checkpoint as dcp

    from shardstore.stores.s3 import S3Options
    from tests.s3_support import KEY, REGION, SECRET

    moto_server.create_bucket("packed")
    options = S3Options(endpoint_url=moto_server.endpoint, key=KEY, secret=SECRET, region=REGION)
    location = open_location("s3://packed/run/step-1", options=options)
    for seed in (1, 2):
        gen = torch.Generator().manual_seed(seed)
        state = {f"layer{i}.bias": torch.randn(300 + i, generator=gen) for i in range(30)}
        dcp.save(state, storage_writer=ShardstoreWriter(location, pack_arrays_up_to=PACK_BYTES))
        record = read_commit_record(location)
        assert list(record.packs) == ["packs/0-0.zip"] and all(a.pack for a in record.arrays.values()), seed
        assert [rel for rel in location.list_files() if rel.endswith(".zip")] == ["packs/0-0.zip"]
        report = shardstore.verify(location)
        assert report.ok, report
        request = {key: torch.zeros_like(t) for key, t in state.items()}
        dcp.load(request, storage_reader=ShardstoreReader(location))
        assert all(torch.equal(request[key], t) for key, t in state.items()), seed


# --------------------------------------------------------------------------- Megatron

NORMS = 12  # replicated layer norms of 64 floats: packed by their one writer


def _megatron_state(rank: int, world: int, empty: bool) -> dict[str, Any]:
    """``tests.test_megatron_objects``' state dict (TP-split layers, a replicated norm, a
    fused-QKV factory, a per-rank ShardedObject) with more small arrays: replicated
    norms and an array each rank holds whole under a key of its own."""
    from megatron.core.dist_checkpointing import mapping

    from tests.scenarios import global_tensor
    from tests.test_megatron_objects import megatron_state_dict

    state = megatron_state_dict(rank, world, empty)
    norms = {}
    for i in range(NORMS):
        value = global_tensor(f"decoder/norm{i}", (64,), torch.float32)
        norms[f"norm{i}"] = mapping.ShardedTensor.from_rank_offsets(
            f"decoder/norm{i}", torch.empty_like(value) if empty else value.clone(), replica_id=rank)
    own = global_tensor(f"router/rank{rank}", (5, 3), torch.bfloat16)
    norms["own"] = mapping.ShardedTensor.from_rank_offsets(
        f"router/rank{rank}", torch.empty_like(own) if empty else own.clone(), replica_id=0)
    state["model"]["norms"] = norms
    return state


def _megatron_packed_keys(world: int) -> set[str]:
    """The small arrays: replicated, held whole by one rank, or split over the ranks in
    blocks each a run of the array (gathered to one writer): all but the row-parallel
    ``fc2``, whose blocks split its last axis."""
    return {"decoder/final_norm", *(f"decoder/norm{i}" for i in range(NORMS)),
            *(f"router/rank{r}" for r in range(world)), "attn/qkv/q", "attn/qkv/kv", "decoder/layers/fc1"}


def _megatron_load_and_compare(ckpt: str, rank: int, world: int) -> None:
    from megatron.core import dist_checkpointing

    from tests.scenarios import assert_bits_equal, global_tensor
    from tests.test_megatron_objects import FC1, FC2, LAYERS, NORM, QKV

    loaded = dist_checkpointing.load(_megatron_state(rank, world, empty=True), ckpt)
    model = loaded["model"]
    for layer in range(LAYERS):
        assert_bits_equal(model["layers"][f"{layer}.fc1"], FC1[layer].chunk(world, 0)[rank], f"fc1 {layer}")
        assert_bits_equal(model["layers"][f"{layer}.fc2"], FC2[layer].chunk(world, 1)[rank], f"fc2 {layer}")
    assert_bits_equal(model["final_norm"], NORM, "final_norm")
    assert_bits_equal(model["qkv"], QKV.chunk(world, 0)[rank], "qkv")
    for i in range(NORMS):
        assert_bits_equal(model["norms"][f"norm{i}"], global_tensor(f"decoder/norm{i}", (64,), torch.float32), str(i))
    assert_bits_equal(model["norms"]["own"], global_tensor(f"router/rank{rank}", (5, 3), torch.bfloat16), "own")
    assert loaded["rng"] == {"rank": rank} and loaded["iteration"] == 100


def megatron_packed_saves(rank: int, world: int, root: str) -> None:
    """Megatron-LM's way: rank 0 makes each iteration's directory, every rank calls
    ``dist_checkpointing.save`` and ``load`` by module attribute; iter_200 reuses from
    iter_100 (``install``'s default)."""
    from megatron.core import dist_checkpointing

    import shardstore.megatron as shardstore_megatron

    shardstore_megatron.install(pack_arrays_up_to=PACK_BYTES)
    try:
        for step in (100, 200):
            ckpt = f"{root}/iter_{step:07d}"
            if rank == 0:
                Path(ckpt).mkdir(parents=True)
            torch.distributed.barrier()
            dist_checkpointing.save(_megatron_state(rank, world, empty=False), ckpt)
            _megatron_load_and_compare(ckpt, rank, world)
    finally:
        shardstore_megatron.uninstall()


def test_megatron_install_packs_small_arrays_and_an_incremental_save_is_complete(tmp_path: Path) -> None:
    import shutil

    pytest.importorskip("megatron.core.dist_checkpointing", reason="megatron-core not installed")
    run_distributed(megatron_packed_saves, 2, str(tmp_path), timeout=240)
    first, second = tmp_path / "iter_0000100", tmp_path / "iter_0000200"
    for ckpt in (first, second):
        record = read_commit_record(open_location(ckpt))
        assert "packs" in record.requires, ckpt
        packed = {key for key, array in record.arrays.items() if array.pack is not None}
        assert packed == _megatron_packed_keys(2), (ckpt, sorted(packed ^ _megatron_packed_keys(2)))
        assert sorted(record.packs) == ["packs/0-0.zip", "packs/1-0.zip"], record.packs
        assert (ckpt / "decoder/layers/fc2").is_dir() and (ckpt / "__objects__").is_dir()
    reused = read_commit_record(open_location(second)).reused_from
    assert reused is not None and reused.chunks > 0, "the unpacked arrays' chunks are shared"
    assert all((second / pack).stat().st_nlink == 1 for pack in record.packs), "a pack is never shared"
    shutil.rmtree(first)
    report = shardstore.verify(second)
    assert report.ok, report
    run_distributed(megatron_load_only, 2, str(second), timeout=240)


def megatron_load_only(rank: int, world: int, ckpt: str) -> None:
    import shardstore.megatron as shardstore_megatron

    shardstore_megatron.install()
    try:
        _megatron_load_and_compare(ckpt, rank, world)
    finally:
        shardstore_megatron.uninstall()


def test_megatron_install_refuses_a_bad_bound_and_keeps_zero_by_default() -> None:
    shardstore_megatron = pytest.importorskip("shardstore.megatron")
    pytest.importorskip("megatron.core.dist_checkpointing", reason="megatron-core not installed")
    with pytest.raises(ValueError, match="pack_arrays_up_to"):
        shardstore_megatron.install(pack_arrays_up_to=-1)
    assert not shardstore_megatron.is_installed()


def megatron_async_packed_save(rank: int, world: int, ckpt: str) -> None:
    """Megatron-LM's async save: the request runs on Megatron's own AsyncCallsQueue (a
    forked writer, which writes the packs); CPU stand-ins for its CUDA calls."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    import shardstore.megatron as shardstore_megatron

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    shardstore_megatron.install(pack_arrays_up_to=PACK_BYTES)
    try:
        if rank == 0:
            Path(ckpt).mkdir(parents=True)
        torch.distributed.barrier()
        request = dist_checkpointing.save(_megatron_state(rank, world, empty=False), ckpt, async_sharded_save=True)
        queue = AsyncCallsQueue()
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
        queue.close()
        _megatron_load_and_compare(ckpt, rank, world)
    finally:
        shardstore_megatron.uninstall()


def test_megatron_async_save_through_install_packs_in_the_forked_writer(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core.dist_checkpointing", reason="megatron-core not installed")
    ckpt = tmp_path / "iter_0000100"
    run_distributed(megatron_async_packed_save, 2, str(ckpt), timeout=240)
    record = read_commit_record(open_location(ckpt))
    assert {k for k, a in record.arrays.items() if a.pack is not None} == _megatron_packed_keys(2)
    report = shardstore.verify(ckpt)
    assert report.ok, report
