"""Issue 25.2: DCP's own API (``dcp.save``, ``dcp.async_save``, ``dcp.load``) on
shardstore's format through ``shardstore.ShardstoreWriter``.

A real ``fully_shard`` model with AdamW at 2 gloo ranks is saved by ``dcp.save`` with our
writer, by ``shardstore.save`` and by DCP's own ``FileSystemWriter``; each of ours loads
both ways (DCP's reader, ``shardstore.load``), bit-exact against DCP's, also at another
world size with DCP's planner resharding, and the next training step from ours is the
one from DCP's. The hierarchies the two ways write are the same, verify, and open in
TensorStore and zarr-python by fully qualified name. A failed or killed rank commits
nothing and keeps the previous checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import shardstore
from shardstore import CheckpointingException, ShardedTensor, ShardstoreReader, ShardstoreWriter
from shardstore.compat.dcp import writer as dcp_storage
from tests import fsdp_models as fm
from tests.dist import run_distributed
from tests.test_plain_readers_recipe import plain_read

warnings.filterwarnings("ignore", message="FSDP2-wrapped module")


def _fresh(world: int) -> tuple:
    model, optimizer = fm.build(world, seed=world + 11)
    fm.train_step(model, optimizer, 99)
    return model, optimizer


def _loaded(world: int, load) -> tuple:
    """A fresh model and optimizer with ``load(request)`` applied (it returns the
    loaded state dict)."""
    model, optimizer = _fresh(world)
    fm.apply(model, optimizer, load(fm.state_dict(model, optimizer)))
    return model, optimizer


def _dcp_load(reader):
    import torch.distributed.checkpoint as dcp

    def load(request: dict) -> dict:
        dcp.load(request, storage_reader=reader)
        return request

    return load


def save_three_ways_and_load_each(rank: int, world: int, root: str) -> bytes:
    import torch.distributed.checkpoint as dcp

    model, optimizer = fm.build(world)
    fm.train_step(model, optimizer, 0)
    state = fm.state_dict(model, optimizer)
    saved = fm.full_values(state)
    dcp.save(state, storage_writer=ShardstoreWriter(f"{root}/dcp-ours"))
    shardstore.save(state, f"{root}/api")
    dcp.save(state, storage_writer=dcp.FileSystemWriter(f"{root}/dcp"))
    # DCP's background save runs its collectives on a group of its own: the training
    # step's run on the default one meanwhile (two threads on one gloo group would mix them)
    background = dist.new_group(backend="gloo")
    future = dcp.async_save(state, storage_writer=ShardstoreWriter(f"{root}/async"), process_group=background)
    fm.train_step(model, optimizer, 1)  # while it writes: the async save holds the state it was given
    future.result()

    reference = _loaded(world, _dcp_load(dcp.FileSystemReader(f"{root}/dcp")))
    fm.assert_same(fm.full_values(fm.state_dict(*reference)), saved)
    ways = {
        "dcp.save -> dcp.load": _dcp_load(ShardstoreReader(f"{root}/dcp-ours")),
        "dcp.save -> shardstore.load": lambda request: shardstore.load(request, f"{root}/dcp-ours"),
        "shardstore.save -> dcp.load": _dcp_load(ShardstoreReader(f"{root}/api")),
        "dcp.async_save -> dcp.load": _dcp_load(ShardstoreReader(f"{root}/async")),
    }
    for way, load in ways.items():
        ours = _loaded(world, load)
        fm.assert_same(fm.full_values(fm.state_dict(*ours)), saved, way)
    fm.train_step(*ours, 1)
    fm.train_step(*reference, 1)
    fm.assert_same(fm.full_values(fm.state_dict(*ours)), fm.full_values(fm.state_dict(*reference)), "next step")
    return fm.to_bytes(saved)


def load_at_one_rank(rank: int, world: int, root: str, saved: bytes) -> None:
    for ckpt in ("dcp-ours", "api"):
        model, optimizer = _loaded(world, _dcp_load(ShardstoreReader(f"{root}/{ckpt}")))
        fm.assert_same(fm.full_values(fm.state_dict(model, optimizer)), fm.from_bytes(saved), ckpt)


def test_dcp_api_and_shardstore_api_write_one_format_that_loads_both_ways(tmp_path: Path) -> None:
    saved = run_distributed(save_three_ways_and_load_each, 2, str(tmp_path))[0]
    run_distributed(load_at_one_rank, 1, str(tmp_path), saved)
    values = fm.from_bytes(saved)
    ours, api = tmp_path / "dcp-ours", tmp_path / "api"
    for ckpt in (ours, api, tmp_path / "async"):
        report = shardstore.verify(ckpt)
        assert report.ok and report.arrays_checked == 12, report
    assert shardstore.load_tensors_metadata(ours).keys() == shardstore.load_tensors_metadata(api).keys()
    fm.assert_same(shardstore.load_common_state_dict(ours), shardstore.load_common_state_dict(api))
    record = json.loads((ours / "zarr.json").read_text())
    assert record["attributes"]["shardstore"]["world_size"] == 2, record["attributes"]["shardstore"].keys()
    # plain readers, without shardstore, by the recipe the root group gives (the default layout packs small
    # arrays split over the ranks: gathered whole into a rank's pack)
    plainly = plain_read([str(ours)], "http://127.0.0.1:9", tmp_path)[str(ours)]
    for key, expected in (("model.0.weight", values["model"]["0.weight"]),
                          ("optim.state.2.weight.exp_avg_sq", values["optim"]["state"]["2.weight"]["exp_avg_sq"])):
        assert plainly[key]["shape"] == list(expected.shape), key
        assert plainly[key]["sha256"] == hashlib.sha256(expected.contiguous().numpy().tobytes()).hexdigest(), key


# ----------------------------------------------------------------- names


# Three pairs of names that differ only by '.' versus '/', one pair per way a value is
# stored (sharded array, plain array, common state), each with a value of its own.
_DOT_AND_SLASH = {"model.w": 1.0, "model/w": 2.0, "optim.m": 3.0, "optim/m": 4.0, "step.n": 5.0, "step/n": 6.0}


def _dot_and_slash_state(world: int, sign: float) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    values = {key: sign * value for key, value in _DOT_AND_SLASH.items()}
    return {
        **{key: distribute_tensor(torch.full((8, 4), values[key]), mesh, [Shard(0)]) for key in ("model.w", "model/w")},
        **{key: torch.full((64, 64), values[key]) for key in ("optim.m", "optim/m")},
        **{key: torch.tensor(values[key]) for key in ("step.n", "step/n")},
    }


def save_and_load_dot_and_slash_names(rank: int, world: int, ckpt: str) -> dict[str, list[float]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    dcp.save(_dot_and_slash_state(world, 1.0), storage_writer=ShardstoreWriter(ckpt, min_array_bytes=1024))
    loaded = {}
    for way, load in (("dcp.load", _dcp_load(ShardstoreReader(ckpt))),
                      ("shardstore.load", lambda request: shardstore.load(request, ckpt))):
        for key, value in load(_dot_and_slash_state(world, -1.0)).items():
            full = value.full_tensor() if isinstance(value, DTensor) else value
            loaded[f"{way} {key}"] = sorted(set(full.flatten().tolist()))
    return loaded


def test_names_differing_only_by_dot_or_slash_keep_their_own_values_through_dcp(tmp_path: Path) -> None:
    """Issue 41.7a: a name's '.' is part of the array's name and its '/' a group, so
    ``model.w`` and ``model/w`` are two arrays; neither overwrites the other."""
    ckpt = tmp_path / "ckpt"
    expected = {f"{way} {key}": [value] for way in ("dcp.load", "shardstore.load")
                for key, value in _DOT_AND_SLASH.items()}
    for loaded in run_distributed(save_and_load_dot_and_slash_names, 2, str(ckpt)):
        assert loaded == expected, loaded
    assert {"model.w", "model/w", "optim.m", "optim/m"} <= shardstore.load_tensors_metadata(ckpt).keys()
    assert shardstore.verify(ckpt).ok


# ----------------------------------------------------------------- failures


def _state(world: int, value: float) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return {"w": distribute_tensor(torch.full((6, 3), value), mesh, [Shard(0)]), "step": torch.tensor(value)}


def _load_value(ckpt: str, world: int) -> float:
    import torch.distributed.checkpoint as dcp

    request = _state(world, -1.0)
    dcp.load(request, storage_reader=ShardstoreReader(ckpt))
    full = request["w"].full_tensor()
    assert bool((full == full[0, 0]).all()) and float(request["step"]) == float(full[0, 0])
    return float(full[0, 0])


def failed_then_killed(rank: int, world: int, ckpt: str) -> str | None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    writer = ShardstoreWriter(ckpt, overwrite=True)
    dcp.save(_state(world, 1.0), storage_writer=writer)
    original = dcp_storage._resolved  # where a rank's data enters the save (the ranks may exchange blocks)
    if rank == 1:
        def disk_full(*args, **kwargs):
            raise OSError(28, "No space left on device (injected)")
        dcp_storage._resolved = disk_full
    with pytest.raises(CheckpointException, match="injected"):
        dcp.save(_state(world, 2.0), storage_writer=writer)
    assert _load_value(ckpt, world) == 1.0, "a failed save keeps the checkpoint it was to replace"
    dcp_storage._resolved = original
    dcp.save(_state(world, 3.0), storage_writer=writer)  # the same writer: the failed save is abandoned first
    assert _load_value(ckpt, world) == 3.0
    dist.barrier()

    if rank == 1:
        def killed(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        dcp_storage._resolved = killed
    future = dcp.async_save(_state(world, 4.0), storage_writer=ShardstoreWriter(ckpt, overwrite=True),
                            process_group=dist.new_group(backend="gloo"))
    try:
        future.result()
    except Exception as exc:  # noqa: BLE001  (rank 0 sees whatever DCP raises for a lost peer)
        return str(exc)
    raise AssertionError("the async save committed without rank 1")


def test_a_failed_or_killed_rank_commits_nothing_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    message = run_distributed(failed_then_killed, 2, str(ckpt), killed=(1,))[0]
    assert message, message
    assert torch.equal(shardstore.load_plain_tensors(ckpt)["w"], torch.full((6, 3), 3.0))
    assert shardstore.load_common_state_dict(ckpt)["step"] == 3.0
    shardstore.save({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2))}, ckpt, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"], "the dead saves' staging areas are removed"


def save_without_collectives(rank: int, world: int, ckpt: str) -> None:
    import torch.distributed.checkpoint as dcp

    state = {"shared": torch.ones(300), f"rank{rank}": torch.full((300,), float(rank)), "epoch": 3}
    with pytest.raises(CheckpointingException, match=r"use_collectives=False.*ShardstoreWriter"):
        dcp.save(state, storage_writer=ShardstoreWriter(ckpt), use_collectives=False)
    dist.barrier()


def test_a_save_without_dcps_collectives_is_refused_on_every_rank(tmp_path: Path) -> None:
    """``dcp.save(use_collectives=False)`` runs every rank's save alone (each its own
    global plan and ``finish``; DCP's writer writes a metadata file per rank). Each
    rank planned and committed a checkpoint of its own state into the one directory:
    one of them won (``rank1`` held, ``rank0`` missing) and looked complete, the other
    failed its commit. Now every rank refuses before anything is written; one process
    may still save so."""
    import torch.distributed.checkpoint as dcp

    ckpt = tmp_path / "ckpt"
    run_distributed(save_without_collectives, 2, str(ckpt))
    assert not ckpt.exists() or not any(ckpt.iterdir()), sorted(p.name for p in ckpt.iterdir())
    dcp.save({"w": torch.ones(300)}, storage_writer=ShardstoreWriter(tmp_path / "one"), use_collectives=False)
    assert torch.equal(shardstore.load_plain_tensors(tmp_path / "one")["w"], torch.ones(300))


class Opaque:
    """A value that ``torch.load(weights_only=True)`` refuses."""


def test_non_tensor_values_that_need_code_to_load_are_refused_naming_them(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException, match=r"Cannot store 'extra' in the common state"):  # DCP wraps ours
        dcp.save({"w": torch.ones(2), "extra": Opaque()}, storage_writer=ShardstoreWriter(tmp_path / "ckpt"))
    assert list(tmp_path.iterdir()) == [], "nothing is left behind"


def test_dcp_api_writes_and_reads_our_format_on_s3(moto_server) -> None:
    """One process (DCP without a process group); the sharded items are shardstore
    ShardedTensors through DCP's checkpointable protocol, so arrays are written."""
    import torch.distributed.checkpoint as dcp

    from shardstore.stores.locations import open_location
    from shardstore.stores.s3 import S3Options
    from shardstore.strategies.checkpointable import to_dcp_state_dict
    from tests.s3_support import KEY, REGION, SECRET

    server = moto_server
    server.create_bucket("dcp")
    options = S3Options(endpoint_url=server.endpoint, key=KEY, secret=SECRET, region=REGION)
    location = open_location("s3://dcp/run/step-10", options=options)
    weight = torch.arange(24, dtype=torch.bfloat16).reshape(6, 4)
    state = {**to_dcp_state_dict({"w": ShardedTensor.from_rank_offsets("model.w", weight.clone())}),
             "step": torch.tensor(10.0), "lr": 0.5}
    dcp.save(state, storage_writer=ShardstoreWriter(location))
    assert shardstore.verify(location).ok
    assert torch.equal(shardstore.load_plain_tensors(location)["model.w"], weight)
    request = {**to_dcp_state_dict({"w": ShardedTensor.from_rank_offsets("model.w", torch.zeros(6, 4, dtype=torch.bfloat16))}),
               "step": torch.tensor(0.0), "lr": 0.0}
    target = request["model.w"]._data
    dcp.load(request, storage_reader=ShardstoreReader(location))
    assert torch.equal(target, weight) and float(request["step"]) == 10.0 and request["lr"] == 0.5


def test_strict_reader_converts_dtypes_only_where_every_value_survives(tmp_path: Path) -> None:
    """``allow_lossy_casts=False``, as ``shardstore.load``: whole numbers stored as
    float32 load into int64; 0.5 into int64 is refused, naming the key; the default
    casts, as DCP's own reader (``test_dcp_metadata``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from shardstore.strategies.checkpointable import to_dcp_state_dict

    def state(values: torch.Tensor) -> dict:
        return to_dcp_state_dict({"x": ShardedTensor.from_rank_offsets("x", values)})

    for name, values in (("whole", torch.tensor([1.0, 2.0])), ("half", torch.tensor([1.0, 0.5]))):
        dcp.save(state(values), storage_writer=ShardstoreWriter(tmp_path / name))
    request = state(torch.zeros(2, dtype=torch.int64))
    dcp.load(request, storage_reader=ShardstoreReader(tmp_path / "whole", allow_lossy_casts=False))
    assert request["x"]._data.tolist() == [1, 2]
    with pytest.raises(CheckpointException, match=r"'x' is stored in another dtype .* index \[1\]"):
        dcp.load(state(torch.zeros(2, dtype=torch.int64)),
                 storage_reader=ShardstoreReader(tmp_path / "half", allow_lossy_casts=False))
    request = state(torch.zeros(2, dtype=torch.int64))
    dcp.load(request, storage_reader=ShardstoreReader(tmp_path / "half"))
    assert request["x"]._data.tolist() == [1, 0]


def test_a_sharded_tensor_of_a_dtype_the_format_does_not_store_is_refused_naming_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """A DTensor (any sharded item) of a dtype the format does not store (complex32,
    float8_e8m0fnu) was refused with "UnsupportedDTypeError: dtype torch.complex32 is not
    supported", naming neither the key nor what to do, and its traceback was logged as
    an unexpected planning failure; ``shardstore.save`` names the key and says to cast.
    Nothing is written either way."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from shardstore.strategies.checkpointable import to_dcp_state_dict

    state = {**to_dcp_state_dict({"w": ShardedTensor.from_rank_offsets("model.w", torch.zeros(4, dtype=torch.complex32))}),
             "step": 1}
    with pytest.raises(CheckpointException, match=r"'model\.w' in .*ckpt.*complex32 is not supported.*cast it"):
        dcp.save(state, storage_writer=ShardstoreWriter(tmp_path / "ckpt"))
    assert not [record for record in caplog.records if record.name.startswith("shardstore")], caplog.text
    assert list(tmp_path.iterdir()) == [], "nothing is written"
