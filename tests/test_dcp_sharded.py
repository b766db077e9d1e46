"""``ShardstoreWriter(shard_bytes=...)``: FSDP2's ``Shard(0)`` arrays saved through
``dcp.save`` as Zarr v3 shards, each gathered to one writer over the process group.

Real gloo ranks: fewer files than the same save without it, the same arrays as
``shardstore.save`` with ``ZarrSaveShardedStrategy(shard_bytes=...)``, bit-exact loads
through ``ShardstoreReader`` and ``shardstore.load`` at another world size, plain zarr and
TensorStore, ``verify``; and clear errors, on every rank, where the exchange cannot work.
"""

from __future__ import annotations

import json
import os
import pickle
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException as DcpFailure

import shardstore
from shardstore import ShardstoreReader, ShardstoreWriter
from shardstore.core import CheckpointingException
from shardstore.planning.plans import largest_shard_bytes
from shardstore.strategies.zarr import ZarrSaveShardedStrategy
from tests import fsdp_models as fm
from tests.dist import run_distributed

warnings.filterwarnings("ignore", message="FSDP2-wrapped module")

SHARD_BYTES = 1 << 20
# the tests count shard files and read each array's zarr.json: saves pin pack_arrays_up_to=0
ROWS, COLS, LAYERS = 48, 64, 6  # per layer, beside fm's model: blocks of 16-24 rows, 4-6 KiB


def _state(world: int, seed: int) -> tuple:
    """fm's FSDP2 model and AdamW after a step, and ``LAYERS`` more ``Shard(0)``
    DTensors (one in bfloat16), as a trainer's state dict."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    model, optimizer = fm.build(world, seed=seed)
    fm.train_step(model, optimizer, 0)
    state = fm.state_dict(model, optimizer)
    mesh = init_device_mesh("cpu", (world,))
    generator = torch.Generator().manual_seed(seed)
    state["extra"] = {
        f"layer{i}": distribute_tensor(
            torch.randn(ROWS, COLS, generator=generator).to(torch.bfloat16 if i == 0 else torch.float32), mesh, [Shard(0)]
        )
        for i in range(LAYERS)
    }
    return model, optimizer, state


def _request(world: int) -> tuple:
    """A state dict of other values to load into, at ``world`` ranks."""
    model, optimizer, state = _state(world, seed=world + 7)
    for tensor in state["extra"].values():
        tensor.to_local().zero_()
    return model, optimizer, state


def save_each_way(rank: int, world: int, root: str) -> bytes:
    import torch.distributed.checkpoint as dcp

    _, _, state = _state(world, seed=0)
    dcp.save(state, storage_writer=ShardstoreWriter(f"{root}/sharded", shard_bytes=SHARD_BYTES, pack_arrays_up_to=0))
    dcp.save(state, storage_writer=ShardstoreWriter(f"{root}/unsharded", pack_arrays_up_to=0))
    shardstore.save(state, f"{root}/api", ZarrSaveShardedStrategy(layout=shardstore.StorageLayout(shard_bytes=SHARD_BYTES, pack_arrays_up_to=0)))
    return fm.to_bytes(fm.full_values(state))


def load_each_way(rank: int, world: int, ckpt: str, saved: bytes) -> None:
    import torch.distributed.checkpoint as dcp

    expected = fm.from_bytes(saved)
    model, optimizer, request = _request(world)
    dcp.load(request, storage_reader=ShardstoreReader(ckpt))
    fm.apply(model, optimizer, request)
    fm.assert_same(fm.full_values(request), expected, "dcp.load")
    _, _, request = _request(world)
    loaded = shardstore.load(request, ckpt)
    fm.assert_same(fm.full_values(loaded), expected, "shardstore.load")


def _files(ckpt: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(ckpt))


def _sharded_arrays(ckpt: Path) -> dict[str, dict]:
    """Each array's ``zarr.json`` whose codec is ``sharding_indexed``."""
    arrays = {}
    for meta in ckpt.glob("*/zarr.json"):
        doc = json.loads(meta.read_text())
        if doc.get("node_type") == "array" and doc["codecs"][0]["name"] == "sharding_indexed":
            arrays[meta.parent.name] = doc
    return arrays


@pytest.mark.parametrize("world, other", [(2, 3), (3, 2)])
def test_dcp_save_with_shard_bytes_writes_fewer_files_that_load_bit_exact_at_another_world_size(
    tmp_path: Path, world: int, other: int,
) -> None:
    saved = run_distributed(save_each_way, world, str(tmp_path))[0]
    sharded, unsharded, api = tmp_path / "sharded", tmp_path / "unsharded", tmp_path / "api"
    arrays = _sharded_arrays(sharded)
    # every Shard(0) array: fm's weights, biases and their AdamW moments, and the extras
    assert {f"extra.layer{i}" for i in range(LAYERS)} <= arrays.keys() and len(arrays) >= 12 + LAYERS, sorted(arrays)
    assert arrays == _sharded_arrays(api), "not the arrays shardstore.save with the strategy stores"
    # one shard per array where there was a chunk per rank
    assert _files(sharded) <= _files(unsharded) - (world - 1) * len(arrays), (_files(sharded), _files(unsharded))
    for ckpt in (sharded, unsharded):
        report = shardstore.verify(ckpt)
        assert report.ok, report
    run_distributed(load_each_way, other, str(sharded), saved)

    import tensorstore as ts
    import zarr

    values = fm.from_bytes(saved)
    for key, expected in (("extra.layer0", values["extra"]["layer0"]), ("extra.layer3", values["extra"]["layer3"]),
                          ("model.0.weight", values["model"]["0.weight"])):
        by_ts = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{sharded}/{key}/"}}).result()
        by_zarr = zarr.open_group(str(sharded), mode="r")[key][...]
        wanted = expected.view(torch.int16).numpy() if expected.dtype == torch.bfloat16 else expected.numpy()
        for got in (by_ts.read().result(), by_zarr):
            got = np.asarray(got)
            got = got.view(np.int16) if expected.dtype == torch.bfloat16 else got
            assert np.array_equal(got, wanted), key


def _blocks(world: int) -> dict:
    return _state(world, seed=0)[2]["extra"]


def async_save_on_the_writers_own_group(rank: int, world: int, root: str) -> None:
    import torch.distributed.checkpoint as dcp

    from shardstore import StorageLayout
    from shardstore.compat.dcp import exchange as dcp_exchange

    state = _blocks(world)
    dcp.async_save(state, storage_writer=ShardstoreWriter(f"{root}/default", shard_bytes=SHARD_BYTES, pack_arrays_up_to=0)).result(timeout=60)
    own = dcp_exchange.own_group()  # made by that save, on its thread; the same for every later writer
    named = ShardstoreWriter(f"{root}/named", layout=StorageLayout(shard_bytes=SHARD_BYTES, pack_arrays_up_to=0), process_group=dist.group.WORLD)
    dcp.async_save(state, storage_writer=named).result(timeout=60)
    assert dcp_exchange.own_group() is own
    dist.barrier()  # the training loop's own collective, on the default group, meanwhile
    background = dist.new_group(backend="gloo")
    writer = ShardstoreWriter(f"{root}/given", shard_bytes=SHARD_BYTES, pack_arrays_up_to=0, process_group=background)
    with pytest.raises(CheckpointingException, match="cannot travel to another process"):
        pickle.dumps(writer)  # what AsyncCheckpointerType.PROCESS would send its save process
    dcp.async_save(state, storage_writer=writer, process_group=background).result(timeout=60)
    for name in ("default", "named", "given"):
        loaded = shardstore.load(_request(world)[2]["extra"], f"{root}/{name}")
        fm.assert_same(fm.full_values(loaded), fm.full_values(state), name)


@pytest.mark.parametrize("world", [2, 3])
def test_async_save_exchanges_on_the_writers_own_group_bit_exact(tmp_path: Path, world: int) -> None:
    """Under ``dcp.async_save`` the default group is the training loop's: the writer
    exchanges on a gloo group of its own, made once per process on the save's thread
    (``tools.dcp_exchange``), where it used to refuse ``shard_bytes``."""
    run_distributed(async_save_on_the_writers_own_group, world, str(tmp_path), timeout=240)
    for name in ("default", "named", "given"):
        assert len(_sharded_arrays(tmp_path / name)) == LAYERS and shardstore.verify(tmp_path / name).ok, name


def async_save_of_a_subgroup(rank: int, world: int, root: str) -> str | None:
    """Ranks 0 and 1 of 3 save on a subgroup under ``dcp.async_save``; rank 2 saves nothing."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    pair = dist.new_group([0, 1])
    refusal = None
    if rank < 2:
        mesh = DeviceMesh.from_group(pair, "cpu")
        state = {"w": distribute_tensor(torch.arange(64.0).reshape(16, 4), mesh, [Shard(0)])}
        with pytest.raises(DcpFailure) as refused:  # the writers' own group would need rank 2
            dcp.async_save(state, storage_writer=ShardstoreWriter(f"{root}/explicit", shard_bytes=SHARD_BYTES, pack_arrays_up_to=0),
                           process_group=pair).result(timeout=60)
        refusal = str(refused.value)
        dcp.async_save(state, storage_writer=ShardstoreWriter(f"{root}/auto", pack_arrays_up_to=0), process_group=pair).result(timeout=60)
    dist.barrier()
    return refusal


def test_an_async_save_of_some_ranks_makes_no_group_and_refuses_only_an_explicit_shard_size(tmp_path: Path) -> None:
    errors = run_distributed(async_save_of_a_subgroup, 3, str(tmp_path), timeout=180)
    for error in errors[:2]:
        assert "not DCP's [(0, 2), (1, 2)]" in error, error
    assert shardstore.verify(tmp_path / "auto").ok and not _sharded_arrays(tmp_path / "auto")
    assert torch.equal(shardstore.load_plain_tensors(tmp_path / "auto")["w"], torch.arange(64.0).reshape(16, 4))


def save_on_a_thread_of_the_callers_own(rank: int, world: int, root: str) -> None:
    """A synchronous dcp.save run by a thread of the caller's (as Ray Train runs the
    training function), its writer made there: the default group is the caller's."""
    import threading

    import torch.distributed.checkpoint as dcp

    state, errors = _blocks(world), []

    def train() -> None:
        try:
            dcp.save(state, storage_writer=ShardstoreWriter(root, shard_bytes=SHARD_BYTES, pack_arrays_up_to=0))
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=train)
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive() and not errors, errors
    loaded = shardstore.load(_request(world)[2]["extra"], root)
    fm.assert_same(fm.full_values(loaded), fm.full_values(state))


def test_a_save_on_a_thread_of_the_callers_own_uses_the_default_group(tmp_path: Path) -> None:
    run_distributed(save_on_a_thread_of_the_callers_own, 2, str(tmp_path / "ckpt"), timeout=180)
    assert len(_sharded_arrays(tmp_path / "ckpt")) == LAYERS and shardstore.verify(tmp_path / "ckpt").ok


def save_on_a_subgroup_with_the_default_group(rank: int, world: int, root: str) -> str | None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    pair = dist.new_group([0, 1])
    if rank == 2:
        return None
    mesh = DeviceMesh.from_group(pair, "cpu")
    state = {"w": distribute_tensor(torch.arange(64.0).reshape(16, 4), mesh, [Shard(0)])}
    with pytest.raises(DcpFailure) as refused:
        writer = ShardstoreWriter(f"{root}/refused", shard_bytes=SHARD_BYTES, pack_arrays_up_to=0)
        dcp.save(state, storage_writer=writer, process_group=pair)
    writer = ShardstoreWriter(f"{root}/pair", shard_bytes=SHARD_BYTES, pack_arrays_up_to=0, max_chunk_bytes=64, process_group=pair)
    dcp.save(state, storage_writer=writer, process_group=pair)
    return str(refused.value)


def test_a_writer_on_a_group_that_is_not_dcps_is_refused_and_on_dcps_subgroup_saves(tmp_path: Path) -> None:
    errors = run_distributed(save_on_a_subgroup_with_the_default_group, 3, str(tmp_path))
    for error in errors[:2]:
        assert "not DCP's [(0, 2), (1, 2)]" in error and "ShardstoreWriter(process_group=...)" in error, error
    assert not (tmp_path / "refused").exists() or not any((tmp_path / "refused").iterdir())
    assert list(_sharded_arrays(tmp_path / "pair")) == ["w"] and shardstore.verify(tmp_path / "pair").ok
    assert torch.equal(shardstore.load_plain_tensors(tmp_path / "pair")["w"], torch.arange(64.0).reshape(16, 4))


def fail_before_the_exchange(rank: int, world: int, root: str, where: str) -> str:
    import time

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from shardstore.execution import SavePipeline

    def fail(*args, **kwargs):
        raise RuntimeError("device lost")

    class FailsOnRankOne(DefaultSavePlanner):  # its blocks cannot be read
        def resolve_data(self, write_item):
            return fail() if rank == 1 and where == "blocks" else super().resolve_data(write_item)

    if rank == 1 and where == "join":  # the save it joins cannot be opened
        SavePipeline.join = fail
    state = _blocks(world)
    started = time.monotonic()
    with pytest.raises(DcpFailure) as failed:
        dcp.save(state, storage_writer=ShardstoreWriter(root, shard_bytes=SHARD_BYTES, pack_arrays_up_to=0), planner=FailsOnRankOne())
    assert time.monotonic() - started < 30
    return str(failed.value)


@pytest.mark.parametrize("where", ["blocks", "join"])
def test_a_rank_failing_before_the_exchange_fails_every_rank_without_waiting(tmp_path: Path, where: str) -> None:
    errors = run_distributed(fail_before_the_exchange, 2, str(tmp_path / "ckpt"), where)
    assert all("device lost" in error for error in errors), errors
    assert not (tmp_path / "ckpt" / "zarr.json").exists()


def async_save_of_one_rank_alone(rank: int, world: int, root: str) -> None:
    import torch.distributed.checkpoint as dcp

    if rank == 0:  # a full state dict, saved by one rank on its own (no_dist=True)
        state = {f"w{i}": torch.randn(64, 32) for i in range(3)}
        writer = ShardstoreWriter(f"{root}/alone", shard_bytes=SHARD_BYTES, pack_arrays_up_to=0, max_chunk_bytes=1024)
        dcp.async_save(state, storage_writer=writer, no_dist=True).result(timeout=60)
        loaded = {key: torch.zeros_like(value) for key, value in state.items()}
        dcp.load(loaded, storage_reader=ShardstoreReader(f"{root}/alone"), no_dist=True)
        fm.assert_same(loaded, state)
    dist.barrier()


def test_an_async_save_of_one_rank_alone_exchanges_nothing_and_is_not_refused(tmp_path: Path) -> None:
    """``dcp.async_save(..., no_dist=True)`` on one rank of a job (a full state dict,
    saved by rank 0) with ``shard_bytes`` was refused: "exchanges blocks between the
    ranks ... this save runs on a background thread", from its local plan, although a
    save of one rank exchanges nothing and runs no collective on any group."""
    run_distributed(async_save_of_one_rank_alone, 2, str(tmp_path), timeout=180)
    assert len(_sharded_arrays(tmp_path / "alone")) == 3 and shardstore.verify(tmp_path / "alone").ok


def test_one_process_without_a_process_group_shards_too(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = {f"w{i}": torch.randn(64, 32) for i in range(3)}
    dcp.save(state, storage_writer=ShardstoreWriter(tmp_path / "one", shard_bytes=SHARD_BYTES, pack_arrays_up_to=0, max_chunk_bytes=1024))
    assert len(_sharded_arrays(tmp_path / "one")) == 3 and shardstore.verify(tmp_path / "one").ok
    loaded = {key: torch.zeros_like(value) for key, value in state.items()}
    dcp.load(loaded, storage_reader=ShardstoreReader(tmp_path / "one"))
    fm.assert_same(loaded, state)


def save_on_s3(rank: int, world: int, location) -> bytes:
    import torch.distributed.checkpoint as dcp

    state = _blocks(world)
    dcp.save(state, storage_writer=ShardstoreWriter(location, shard_bytes=SHARD_BYTES, pack_arrays_up_to=0))
    return fm.to_bytes(fm.full_values(state))


def load_from_s3(rank: int, world: int, location, saved: bytes) -> None:
    import torch.distributed.checkpoint as dcp

    request = _request(world)[2]["extra"]
    dcp.load(request, storage_reader=ShardstoreReader(location))
    fm.assert_same(fm.full_values(request), fm.from_bytes(saved))


def test_on_s3_dcp_save_with_shard_bytes_writes_one_object_per_array(moto_server) -> None:
    from shardstore.stores.locations import open_location
    from shardstore.stores.s3 import S3Options
    from tests.s3_support import KEY, REGION, SECRET

    moto_server.create_bucket("dcp-sharded")
    options = S3Options(endpoint_url=moto_server.endpoint, key=KEY, secret=SECRET, region=REGION)
    location = open_location("s3://dcp-sharded/run/step-1", options=options)
    saved = run_distributed(save_on_s3, 2, location)[0]
    chunks = [key for key in location.list_files() if key.startswith("layer") and "/c" in key]
    assert len(chunks) == LAYERS, chunks  # one shard object per array, not one chunk per rank
    assert shardstore.verify(location).ok
    run_distributed(load_from_s3, 3, location, saved)


def async_save_in_a_save_process(rank: int, world: int, root: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    state = _blocks(world)
    writer = ShardstoreWriter(root, shard_bytes=SHARD_BYTES, pack_arrays_up_to=0)
    future = dcp.async_save(state, storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    future.result(timeout=240)
    assert not writer.is_coordinator  # a copy of it saved, in the save process
    loaded = shardstore.load(_request(world)[2]["extra"], root)
    fm.assert_same(fm.full_values(loaded), fm.full_values(state))


@pytest.mark.timeout(420)  # over run_distributed's 300 s, so its stacks come first
def test_async_save_in_a_process_of_its_own_exchanges_on_that_process_default_group(tmp_path: Path) -> None:
    run_distributed(async_save_in_a_save_process, 2, str(tmp_path / "ckpt"), timeout=300)
    assert len(_sharded_arrays(tmp_path / "ckpt")) == LAYERS and shardstore.verify(tmp_path / "ckpt").ok


def test_a_bound_above_the_s3_object_limit_is_refused_before_anything_is_written(moto_server) -> None:
    import torch.distributed.checkpoint as dcp

    from shardstore.stores.locations import open_location
    from shardstore.stores.s3 import S3Options
    from tests.s3_support import KEY, REGION, SECRET

    moto_server.create_bucket("dcp-bounds")
    options = S3Options(endpoint_url=moto_server.endpoint, key=KEY, secret=SECRET, region=REGION)
    location = open_location("s3://dcp-bounds/run/step-1", options=options)
    with pytest.raises((CheckpointingException, DcpFailure), match=rf"shard_bytes=6442450944 exceeds the .*object limit .*\(objects of up to {largest_shard_bytes(6 << 30)} bytes\)"):
        dcp.save({"w": torch.ones(4)}, storage_writer=ShardstoreWriter(location, shard_bytes=6 * 2**30), no_dist=True)
    assert location.list_files() == []


def test_the_writer_saves_consolidated_metadata_only_when_asked(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(4)}
    writer = ShardstoreWriter(tmp_path / "ckpt", zarr_metadata="consolidated_only", min_array_bytes=1)
    dcp.save(state, storage_writer=writer, no_dist=True)
    assert sorted(p.name for p in (tmp_path / "ckpt").rglob("zarr.json")) == ["zarr.json"]  # the root's alone
    loaded = {"w": torch.zeros(3, 4), "b": torch.zeros(4)}
    dcp.load(loaded, storage_reader=ShardstoreReader(tmp_path / "ckpt"), no_dist=True)
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["b"], state["b"])
    assert shardstore.verify(tmp_path / "ckpt").ok
    with pytest.raises(ValueError, match="zarr_metadata must be one of"):
        ShardstoreWriter(tmp_path / "other", zarr_metadata="nowhere")
