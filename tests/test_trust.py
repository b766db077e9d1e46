"""Issue 13: nothing lost, nothing silently wrong, nothing hangs.

Each test here failed on the code before the fix it pins (the 0-d read into a detached
scalar, the lossy cast, the array/group clash, ...); the S3 variants live in
``test_s3.py`` next to their server.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from shardstore import (
    CheckpointingException,
    ShardedObject,
    ShardedTensor,
    StorageLayout,
    load,
    load_plain_tensors,
    save,
    verify,
)
from shardstore.format.records import object_path
from shardstore.strategies.zarr import ZarrLoadShardedStrategy
from tests.dist import run_distributed
from tests.scenarios import assert_bits_equal, global_tensor, rewrite_record

DTYPES = [
    torch.float16, torch.float32, torch.float64, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
]


def _scalar_key(dtype: torch.dtype) -> str:
    return "scalars/" + str(dtype).removeprefix("torch.")


def _scalar(dtype: torch.dtype) -> torch.Tensor:
    """A 0-d tensor whose value no uninitialised buffer is likely to hold."""
    return global_tensor(_scalar_key(dtype), (1,), dtype).reshape(())


def _scalars(empty: bool, replica: int = 0) -> dict:
    return {
        _scalar_key(d): ShardedTensor.from_rank_offsets(
            _scalar_key(d), torch.zeros((), dtype=d) if empty else _scalar(d), replica_id=replica
        )
        for d in DTYPES
    }


def save_scalars(rank: int, world: int, ckpt: str) -> None:
    sd = _scalars(empty=False, replica=rank)
    sd["step"] = ShardedTensor.from_rank_offsets("optimizer/step", torch.tensor(1000), replica_id=rank)
    save(sd, ckpt)


def load_scalars(rank: int, world: int, ckpt: str) -> None:
    loaded = load(_scalars(empty=True, replica=rank), ckpt)
    for d in DTYPES:
        assert_bits_equal(loaded[_scalar_key(d)], _scalar(d), _scalar_key(d))


@pytest.mark.parametrize("world", [1, 2])
def test_zero_dim_tensors_round_trip_every_dtype(ckpt_dir: Path, world: int) -> None:
    run_distributed(save_scalars, world, str(ckpt_dir))
    run_distributed(load_scalars, world, str(ckpt_dir))
    run_distributed(load_scalars, 3 - world, str(ckpt_dir))
    plain = load_plain_tensors(ckpt_dir)
    assert plain["optimizer/step"].item() == 1000
    for d in DTYPES:
        assert_bits_equal(plain[_scalar_key(d)], _scalar(d), _scalar_key(d))
    assert verify(ckpt_dir).ok


# ------------------------------------------------------------------ lossy casts


def _one(key: str, value: torch.Tensor) -> dict:
    return {key: ShardedTensor.from_rank_offsets(key, value)}


@pytest.mark.parametrize("requested", [torch.int64, torch.float16, torch.bool, torch.bfloat16, torch.float8_e4m3fn])
def test_lossy_cast_on_load_is_refused_naming_the_key(ckpt_dir: Path, requested: torch.dtype) -> None:
    save(_one("w", torch.tensor([0.5, 1e6, -3.25])), ckpt_dir)
    with pytest.raises(CheckpointingException, match=r"'w'.*float32.*" + str(requested).removeprefix("torch.")):
        load(_one("w", torch.empty(3, dtype=requested)), ckpt_dir)
    lossy = ZarrLoadShardedStrategy(allow_lossy_casts=True)
    loaded = load(_one("w", torch.empty(3, dtype=requested)), ckpt_dir, sharded_strategy=lossy)
    assert loaded["w"].dtype == requested  # asked for explicitly: converted


def test_exact_conversions_still_load(ckpt_dir: Path) -> None:
    save({**_one("h", torch.tensor([1.5, -2.0], dtype=torch.float16)),
          **_one("i", torch.tensor([7, -9], dtype=torch.int32))}, ckpt_dir)
    loaded = load({**_one("h", torch.empty(2, dtype=torch.float32)),
                   **_one("i", torch.empty(2, dtype=torch.int64))}, ckpt_dir)
    assert loaded["h"].tolist() == [1.5, -2.0] and loaded["h"].dtype == torch.float32
    assert loaded["i"].tolist() == [7, -9] and loaded["i"].dtype == torch.int64


@pytest.mark.parametrize(("stored", "requested"), [
    (torch.arange(12, dtype=torch.int64), torch.float32),  # what Megatron-Core's own tests do
    (torch.tensor([1.0, -2.0, 3e9]), torch.int64),
    (torch.tensor([0.5, -3.25, 1024.0]), torch.bfloat16),
    (torch.tensor([0, 1, 1, 0]), torch.bool),
    (torch.tensor([float("nan"), 1.0]), torch.float16),
])
def test_a_cast_whose_values_all_convert_exactly_loads(ckpt_dir: Path, stored: torch.Tensor,
                                                       requested: torch.dtype) -> None:
    save(_one("w", stored), ckpt_dir)
    loaded = load(_one("w", torch.empty(stored.shape, dtype=requested)), ckpt_dir)["w"]
    assert loaded.dtype == requested
    torch.testing.assert_close(loaded.to(stored.dtype), stored, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize(("stored", "requested", "value", "index"), [
    (torch.arange(2**24 - 2, 2**24 + 2, dtype=torch.int64), torch.float32, "16777217", "[3]"),
    (torch.tensor([[1.0, 2.0], [2.5, 4.0]]), torch.int64, "2.5", "[1, 0]"),
    (torch.tensor([0, 1, 2]), torch.bool, "2", "[2]"),
])
def test_a_cast_that_changes_a_value_names_the_key_and_the_value(ckpt_dir: Path, stored: torch.Tensor,
                                                                 requested: torch.dtype, value: str,
                                                                 index: str) -> None:
    save(_one("w", stored), ckpt_dir)
    with pytest.raises(CheckpointingException, match=rf"'w'.*change its value {value} at index \{index}"):
        load(_one("w", torch.empty(stored.shape, dtype=requested)), ckpt_dir)


# ------------------------------------------------------- array / group clashes


def save_clashing_keys(rank: int, world: int, ckpt: str, keys: tuple[str, str], kind: str) -> str:
    first, second = keys
    sd = {"a": ShardedTensor.from_rank_offsets(first, torch.ones(4), replica_id=rank)}
    if kind == "tensor":
        sd["b"] = ShardedTensor.from_rank_offsets(second, torch.ones(2), replica_id=rank)
    else:
        sd["b"] = ShardedObject(second, {"rank": rank}, (world,), (rank,))
    try:
        save(sd, ckpt)
    except CheckpointingException as exc:
        return str(exc)
    raise AssertionError("a save with clashing keys returned normally")


@pytest.mark.parametrize("keys, kind", [(("a", "a/b"), "tensor"), (("s/c", "s"), "tensor"),
                                        (("x", "x/y"), "object"), (("same", "same"), "object")])
def test_keys_that_clash_as_array_and_group_are_refused_on_every_rank(
    ckpt_dir: Path, keys: tuple[str, str], kind: str
) -> None:
    messages = run_distributed(save_clashing_keys, 2, str(ckpt_dir), keys, kind)
    for message in messages:
        assert "Invalid global sharding" in message and repr(keys[0] if kind == "tensor" else keys[1])[1:-1] in message
    assert not ckpt_dir.exists() or not any(ckpt_dir.iterdir()), "nothing may be written"


# ---------------------------------------------- deleting only what is ours (2)


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


FOREIGN_DIRS = {
    # what Megatron-Core's torch_dist backend leaves: its metadata.json, DCP files, common.pt
    "megatron torch_dist": {"metadata.json": b'{"sharded_backend": "torch_dist", "sharded_backend_version": 1}',
                            "__0_0.distcp": b"\x00" * 64, ".metadata": b"dcp", "common.pt": b"pickle"},
    "megatron zarr": {"metadata.json": b'{"sharded_backend": "zarr", "sharded_backend_version": 1}',
                      "decoder.weight/.zarray": b"{}", "decoder.weight/0.0": b"\x01" * 16},
    "experiment folder": {"common.pt": b"my results", "notes/plan.md": b"precious"},
    "foreign zarr group": {"zarr.json": b'{"zarr_format": 3, "node_type": "group", "attributes": {}}',
                           "a/zarr.json": b"{}"},
}


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("kind", sorted(FOREIGN_DIRS))
def test_save_never_deletes_a_foreign_directory(ckpt_dir: Path, kind: str, overwrite: bool) -> None:
    for rel, data in FOREIGN_DIRS[kind].items():
        (ckpt_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (ckpt_dir / rel).write_bytes(data)
    before = _tree(ckpt_dir)
    with pytest.raises(CheckpointingException, match=r"(no committed shardstore checkpoint|not a shardstore checkpoint)"):
        save(_one("w", torch.ones(3)), ckpt_dir, overwrite=overwrite)
    assert _tree(ckpt_dir) == before
    assert [p.name for p in ckpt_dir.parent.iterdir()] == [ckpt_dir.name], "no staging directory left behind"


# ------------------------------------ overwrite keeps the old checkpoint (3)


def _values(shift: float) -> dict:
    return {"w": ShardedTensor.from_rank_offsets("w", torch.arange(12.0).reshape(3, 4) + shift),
            "s": ShardedTensor.from_rank_offsets("s", torch.tensor(shift)),
            "step": int(shift)}


def _assert_holds(ckpt: Path, shift: float) -> None:
    loaded = load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(3, 4)),
                   "s": ShardedTensor.from_rank_offsets("s", torch.tensor(0.0))}, ckpt)
    assert torch.equal(loaded["w"], torch.arange(12.0).reshape(3, 4) + shift)
    assert loaded["s"].item() == shift and loaded["step"] == int(shift)
    assert verify(ckpt).ok


def _enospc(*args, **kwargs):
    raise OSError(28, "No space left on device")


ENOSPC_POINTS = {  # each phase of a save: (module, attribute that fails)
    "metadata.json": ("shardstore.execution.pipeline", "write_config"),  # the save pipeline begins the save
    "common.pt": ("shardstore.engine.common_state", "TorchCommonSaveStrategy.save_common"),
    "chunk write": ("shardstore.format.chunks", "ChunkFile.write"),
    "syncfs": ("shardstore.stores.local", "_syncfs"),
    "commit record": ("shardstore.stores.local", "LocalStore.put_atomic"),
    "rename": ("shardstore.stores.local", "LocalStore.rename_to"),
}


@pytest.mark.parametrize("point", sorted(ENOSPC_POINTS))
def test_full_disk_during_overwrite_keeps_the_old_checkpoint(ckpt_dir: Path, point: str, monkeypatch) -> None:
    import importlib

    save(_values(1.0), ckpt_dir)
    module, attribute = ENOSPC_POINTS[point]
    owner = importlib.import_module(module)
    *path, name = attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    monkeypatch.setattr(owner, name, _enospc)
    with pytest.raises(CheckpointingException, match="No space left on device"):
        save(_values(2.0), ckpt_dir, overwrite=True)
    monkeypatch.undo()
    _assert_holds(ckpt_dir, 1.0)
    assert [p.name for p in ckpt_dir.parent.iterdir()] == [ckpt_dir.name], "the failed save's files are gone"
    save(_values(3.0), ckpt_dir, overwrite=True)
    _assert_holds(ckpt_dir, 3.0)


# ------------------------------------------------ one save, one directory (4)


def save_to_own_directory(rank: int, world: int, root: str) -> str:
    try:
        save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2), (0, rank, world))}, f"{root}/ckpt{rank}")
    except CheckpointingException as exc:
        return str(exc)
    raise AssertionError("a save split over two directories returned normally")


def test_ranks_that_name_different_directories_fail_before_writing(tmp_path: Path) -> None:
    for message in run_distributed(save_to_own_directory, 2, str(tmp_path)):
        assert "different checkpoint directories" in message and "ckpt0" in message and "ckpt1" in message
    assert list(tmp_path.iterdir()) == []


def async_save_loses_to_a_later_sync_save(rank: int, world: int, ckpt: str, overwrite: bool) -> str:
    from shardstore.strategies.async_utils import AsyncCallsQueue

    def sd(value: float) -> dict:
        return {"w": ShardedTensor.from_rank_offsets("w", torch.full((4,), value), (0, rank, world)),
                "job": f"job {value}"}

    queue = AsyncCallsQueue()
    queue.schedule_async_request(save(sd(1.0), ckpt, async_sharded_save=True))  # job A, still running
    save(sd(2.0), ckpt, overwrite=overwrite)  # job B commits into the same directory first
    try:
        queue.maybe_finalize_async_calls(blocking=True)
    except CheckpointingException as exc:
        return str(exc)
    finally:
        queue.close(abort=True)
    raise AssertionError("both saves committed")


@pytest.mark.parametrize("overwrite", [False, True])
def test_two_saves_into_one_directory_cannot_both_commit(ckpt_dir: Path, overwrite: bool) -> None:
    for message in run_distributed(async_save_loses_to_a_later_sync_save, 2, str(ckpt_dir), overwrite):
        assert "another save committed there while it ran" in message, message
    loaded = load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(8))}, ckpt_dir)
    assert torch.equal(loaded["w"], torch.full((8,), 2.0)) and loaded["job"] == "job 2.0"  # B's, whole
    assert verify(ckpt_dir).ok
    assert [p.name for p in ckpt_dir.parent.iterdir()] == [ckpt_dir.name]


# ------------------------------------ the commit record binds every chunk (4)


def _two_arrays(ckpt: Path, shift: float = 0.0) -> None:
    save({"a": ShardedTensor.from_rank_offsets("a", torch.arange(8.0).reshape(4, 2) + shift),
          "b": ShardedTensor.from_rank_offsets("b", torch.arange(8.0).reshape(4, 2) * -1 + shift)},
         ckpt, sharded_strategy=_small_chunks())


# these tests move, corrupt and link chunk files: each array keeps its own directory
PER_ARRAY = StorageLayout(pack_arrays_up_to=0)


def _small_chunks():
    from shardstore.strategies.zarr import ZarrSaveShardedStrategy

    # one row (2 x float32) per chunk
    return ZarrSaveShardedStrategy(layout=StorageLayout(max_chunk_bytes=8, pack_arrays_up_to=0))


def _swap(x: Path, y: Path) -> None:
    data = x.read_bytes()
    x.write_bytes(y.read_bytes())
    y.write_bytes(data)


def _request() -> dict:
    return {k: ShardedTensor.from_rank_offsets(k, torch.empty(4, 2)) for k in ("a", "b")}


@pytest.mark.parametrize("tamper", ["swap within array", "swap between arrays", "copy from another checkpoint"])
def test_moved_chunks_fail_verify_and_load(tmp_path: Path, tamper: str) -> None:
    ckpt, other = tmp_path / "ckpt", tmp_path / "other"
    _two_arrays(ckpt)
    _two_arrays(other, shift=100.0)
    if tamper == "swap within array":
        _swap(ckpt / "a/c.0.0", ckpt / "a/c.2.0")
    elif tamper == "swap between arrays":
        _swap(ckpt / "a/c.1.0", ckpt / "b/c.1.0")
    else:
        (ckpt / "b/c.3.0").write_bytes((other / "b/c.3.0").read_bytes())
    report = verify(ckpt)
    assert not report.ok and "commit record keeps" in str(report), str(report)
    with pytest.raises(CheckpointingException, match=r"Wrong chunk c\.\d\.0 of array '(a|b)'"):
        load(_request(), ckpt)


def _as_legacy_layout(ckpt: Path) -> None:
    """Moves chunks ``c.i.j`` to ``c/i/j``, as formats 1 and 2 store them."""
    import json

    for chunk in sorted(ckpt.rglob("c.*")):
        target = chunk.parent / chunk.name.replace(".", "/")
        target.parent.mkdir(parents=True, exist_ok=True)
        chunk.rename(target)
    for meta in ckpt.rglob("zarr.json"):
        node = json.loads(meta.read_text())
        if node.get("node_type") == "array":
            node["chunk_key_encoding"] = {"name": "default"}
            meta.write_text(json.dumps(node))

    def legacy_consolidated(root: dict) -> None:  # and so does the root's copy of each
        for node in root["consolidated_metadata"]["metadata"].values():
            if node.get("node_type") == "array":
                node["chunk_key_encoding"] = {"name": "default"}

    rewrite_record(ckpt, legacy_consolidated)


@pytest.mark.parametrize("version", [1, 2])
def test_format_1_and_2_checkpoints_still_load(ckpt_dir: Path, version: int) -> None:
    """Chunks in ``c/i/j`` directories (format 3 writes ``c.i.j``); format 1 without
    save id and chunk checksums."""

    _two_arrays(ckpt_dir)
    _as_legacy_layout(ckpt_dir)

    def as_version(root: dict) -> None:
        record = root["attributes"]["shardstore"]
        record["format_version"] = version
        del record["record_digest"]
        if version == 1:
            del record["save_id"]
            for array in record["arrays"].values():
                del array["chunk_crc32c"]

    rewrite_record(ckpt_dir, as_version)
    loaded = load(_request(), ckpt_dir)
    assert torch.equal(loaded["a"], torch.arange(8.0).reshape(4, 2))
    assert verify(ckpt_dir).ok
    (ckpt_dir / "a/c/1/0").write_bytes(b"x" * 12)  # the legacy paths are the ones checked
    assert "a [c/1/0]" in str(verify(ckpt_dir))


def test_a_commit_missing_a_chunk_fails(ckpt_dir: Path, monkeypatch) -> None:
    import shardstore.execution.save as save_execution

    real = save_execution.write_ops
    monkeypatch.setattr(save_execution, "write_ops", lambda *a, **k: real(*a, **k)[1:])  # one report lost
    with pytest.raises(CheckpointingException, match=r"(?s)ckpt: no rank wrote chunk"):
        _two_arrays(ckpt_dir)
    assert not ckpt_dir.exists()


# ----------------------------------------- every read path checks (5)


def test_queries_refuse_files_the_record_does_not_vouch_for(tmp_path: Path) -> None:
    from shardstore import load_common_state_dict, load_sharded_metadata

    ckpt, other = tmp_path / "ckpt", tmp_path / "other"
    save({**_values(1.0), "rng": ShardedObject("rng", {"seed": 1}, (1,), (0,))}, ckpt)
    save({**_values(2.0), "rng": ShardedObject("rng", {"seed": 2}, (1,), (0,))}, other)
    (ckpt / "common.pt").write_bytes((other / "common.pt").read_bytes())
    with pytest.raises(CheckpointingException, match="Corrupt file .*common.pt"):
        load_common_state_dict(ckpt)
    with pytest.raises(CheckpointingException, match="Corrupt file .*common.pt"):
        load(_values(0.0), ckpt)
    (ckpt / "metadata.json").write_bytes((ckpt / "metadata.json").read_bytes() + b" ")
    for query in (load_common_state_dict, load_sharded_metadata, load_plain_tensors):
        with pytest.raises(CheckpointingException, match="Corrupt file .*metadata.json"):
            query(ckpt)


def test_the_seed_readers_given_a_path_check_the_record(tmp_path: Path) -> None:
    """The strategies' own readers, called with a path as Megatron's API allows, read
    through the same checks as ``load``: before, a flipped bit in ``common.pt`` came back
    as a wrong integer (12345 -> 12344), and a corrupt chunk read by the zarr module's
    ``_load_from_array`` (which also reads Megatron's bare array directories) raised
    TensorStore's bare ``ValueError``; it now reads a committed checkpoint as ``load``
    does, naming the chunk."""
    from shardstore.strategies.common import TorchCommonLoadStrategy
    from shardstore.strategies.zarr import _load_from_array

    ckpt = tmp_path / "ckpt"
    save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(8)), "step": 12345,
          "rng": ShardedObject("rng", 777, (1,), (0,))}, ckpt, layout=PER_ARRAY)
    strategy = TorchCommonLoadStrategy()
    rng = lambda: {"rng": ShardedObject("rng", None, (1,), (0,))}  # noqa: E731
    assert strategy.load_common(ckpt)["step"] == 12345 and strategy.load_sharded_objects(rng(), ckpt)["rng"] == 777
    for rel, value in (("common.pt", 12345), (object_path(ShardedObject("rng", None, (1,), (0,)).unique_key), 777)):
        data = bytearray((ckpt / rel).read_bytes())
        data[data.index(value.to_bytes(2, "little"))] ^= 1
        (ckpt / rel).write_bytes(bytes(data))
    with pytest.raises(CheckpointingException, match="Corrupt file .*common.pt"):
        strategy.load_common(str(ckpt))
    with pytest.raises(CheckpointingException, match="Corrupt file .*rng"):
        strategy.load_sharded_objects(rng(), ckpt)
    chunk = ckpt / "w/c.0"
    chunk.write_bytes(chunk.read_bytes()[:8] + bytes([chunk.read_bytes()[8] ^ 1]) + chunk.read_bytes()[9:])
    with pytest.raises(CheckpointingException, match=r"Corrupt chunk c\.0 of array 'w' \(.*ckpt.*crc32c"):
        _load_from_array(ShardedTensor.from_rank_offsets("w", torch.empty(8, dtype=torch.int64)), ckpt)
    (ckpt / "zarr.json").unlink()  # the commit record: an unfinished save is refused, not read
    with pytest.raises(CheckpointingException, match=str(ckpt)):
        strategy.load_common(ckpt)


def test_a_reader_per_tensor_parses_the_record_once_and_a_new_one_again(tmp_path: Path, monkeypatch) -> None:
    """The seed's ``_load_from_array``, called once per tensor, parsed the whole commit
    record on every call (1 s per tensor at 5,000 arrays here). The record is now parsed
    once for the same bytes, and a record replaced since (a new save into the same path)
    is read anew: its values come back, not the old record's."""
    from shardstore.format.records import CommitRecord, commit_record
    from shardstore.strategies.zarr import _load_from_array

    parses = []
    parse = CommitRecord._parse
    monkeypatch.setattr(CommitRecord, "_parse", classmethod(lambda cls, *a: parses.append(1) or parse(*a)))
    ckpt = tmp_path / "ckpt"
    keys = [f"t{i}" for i in range(5)]
    save({k: ShardedTensor.from_rank_offsets(k, torch.full((4,), float(i))) for i, k in enumerate(keys)}, ckpt)
    request = lambda k: ShardedTensor.from_rank_offsets(k, torch.empty(4))  # noqa: E731
    assert [_load_from_array(request(k), ckpt)[0].item() for k in keys] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert len(parses) == 1
    save({k: ShardedTensor.from_rank_offsets(k, torch.full((4,), -1.0)) for k in keys}, ckpt, overwrite=True)
    assert [_load_from_array(request(k), ckpt)[0].item() for k in keys] == [-1.0] * 5
    assert len(parses) == 2
    monkeypatch.setattr(commit_record, "_REMEMBERED_RECORD_BYTES", 10)  # a record larger than that is not kept
    save({k: ShardedTensor.from_rank_offsets(k, torch.full((4,), -2.0)) for k in keys}, ckpt, overwrite=True)
    assert [_load_from_array(request(k), ckpt)[0].item() for k in keys] == [-2.0] * 5
    assert len(parses) == 2 + 5


def test_an_object_shard_the_record_does_not_list_is_refused_not_read(tmp_path: Path) -> None:
    """A ShardedObject shard file under ``__objects__`` that the commit record does not
    list (copied in after the commit) is refused like an unlisted ``common.pt``. Before,
    the checked location checked only the shards the record lists, so a load (default
    strict) that asked for another object returned the planted file's contents."""
    from shardstore.format.pickles import serialize

    ckpt = tmp_path / "ckpt"
    save({**_values(1.0), "rng": ShardedObject("rng", {"seed": 1}, (1,), (0,))}, ckpt)
    planted = ShardedObject("planted", None, (1,), (0,))
    (ckpt / object_path(planted.unique_key)).parent.mkdir()
    (ckpt / object_path(planted.unique_key)).write_bytes(serialize({"seed": 666}))
    with pytest.raises(CheckpointingException, match=r"planted/shard_0_1\.pt is not vouched for by the commit record"):
        load({**_values(0.0), "planted": planted}, ckpt)


# ------------------------------- a read error on one rank reaches all (7)


def load_with_damage_on_rank_1(rank: int, world: int, ckpt: str, fully_parallel: bool) -> tuple[str, float]:
    import time

    from shardstore.strategies.zarr import ZarrLoadShardedStrategy

    request = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 2), (0, rank, world))}
    start = time.monotonic()
    try:
        load(request, ckpt, sharded_strategy=ZarrLoadShardedStrategy(fully_parallel=fully_parallel))
    except CheckpointingException as exc:
        return str(exc), time.monotonic() - start
    raise AssertionError("the load returned normally")


@pytest.mark.parametrize("fully_parallel", [False, True])
def test_read_error_on_one_rank_is_raised_on_every_rank(ckpt_dir: Path, fully_parallel: bool) -> None:
    save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(16.0).reshape(8, 2))}, ckpt_dir,
         sharded_strategy=_small_chunks())
    chunk = ckpt_dir / "w/c.6.0"  # only rank 1 reads rows 4-7
    chunk.write_bytes(b"\xff" + chunk.read_bytes()[1:])
    results = run_distributed(load_with_damage_on_rank_1, 2, str(ckpt_dir), fully_parallel, timeout=60)
    for message, seconds in results:
        assert "rank(s) 1" in message and "chunk c.6.0 of array 'w'" in message and str(ckpt_dir) in message, message
        assert seconds < 10, seconds


def plain_tensors_on_rank_0_only(rank: int, world: int, ckpt: str) -> float:
    if rank == 0:
        assert load_plain_tensors(ckpt)["w"].shape == (8, 2)
    return 0.0


def test_load_plain_tensors_on_one_rank_of_a_job_does_not_hang(ckpt_dir: Path) -> None:
    save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(16.0).reshape(8, 2))}, ckpt_dir)
    run_distributed(plain_tensors_on_rank_0_only, 2, str(ckpt_dir), timeout=60)


# ------------------------------------------- hostile files inside (8)


def _saved_with_neighbour(tmp_path: Path) -> tuple[Path, Path]:
    ckpt, other = tmp_path / "ckpt", tmp_path / "other"
    _two_arrays(ckpt)
    _two_arrays(other)  # same values: only the link check can tell
    return ckpt, other


def _fifo(path: Path) -> None:
    import os

    path.unlink()
    os.mkfifo(path)


HOSTILE_FILES = {
    "fifo as chunk": lambda ckpt, other: _fifo(ckpt / "a/c.1.0"),
    "fifo as common.pt": lambda ckpt, other: _fifo(ckpt / "common.pt"),
    "zarr.json -> /dev/zero": lambda ckpt, other: ((ckpt / "zarr.json").unlink(), (ckpt / "zarr.json").symlink_to("/dev/zero")),
    "common.pt -> other checkpoint": lambda ckpt, other: ((ckpt / "common.pt").unlink(),
                                                          (ckpt / "common.pt").symlink_to(other / "common.pt")),
    "chunk -> other checkpoint": lambda ckpt, other: ((ckpt / "a/c.1.0").unlink(),
                                                      (ckpt / "a/c.1.0").symlink_to(other / "a/c.1.0")),
    "array directory -> other checkpoint": lambda ckpt, other: (__import__("shutil").rmtree(ckpt / "b"),
                                                                (ckpt / "b").symlink_to(other / "b")),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(HOSTILE_FILES))
def test_hostile_files_are_refused_not_followed(tmp_path: Path, name: str) -> None:
    import time

    ckpt, other = _saved_with_neighbour(tmp_path)
    HOSTILE_FILES[name](ckpt, other)
    start = time.monotonic()
    report = verify(ckpt)  # never raises for damage
    assert not report.ok, name
    with pytest.raises(CheckpointingException, match=r"symbolic link|not a regular file|refus"):
        load(_request(), ckpt)
    assert time.monotonic() - start < 10


# ------------------------------------------------- record bombs (9)


def _edit_record(ckpt: Path, edit) -> None:

    rewrite_record(ckpt, lambda root: edit(root["attributes"]["shardstore"]))


def _bomb(version: int):
    def edit(record: dict) -> None:
        record["format_version"] = version
        record["arrays"]["a"].update(shape=[2**31, 2], chunk_shape=[1, 2], chunk_grid=[2**31, 1])
        if version == 1:
            del record["arrays"]["a"]["chunk_crc32c"]
    return edit


@pytest.mark.timeout(60)
@pytest.mark.parametrize("version", [1, 2])
def test_record_bombs_give_clear_errors_without_allocating(ckpt_dir: Path, version: int) -> None:
    from shardstore import load_common_state_dict, load_sharded_metadata, load_tensors_metadata

    _two_arrays(ckpt_dir)
    _edit_record(ckpt_dir, _bomb(version))
    report = verify(ckpt_dir)
    assert not report.ok and str(ckpt_dir) in str(report)
    for query in (load_tensors_metadata, load_sharded_metadata, load_common_state_dict, load_plain_tensors):
        with pytest.raises(CheckpointingException, match=str(ckpt_dir)):
            query(ckpt_dir)


def _unbound_arrays(count: int, chunks: int):
    """A version 1 record (no chunk checksums) of ``count`` arrays of ``chunks`` chunks."""

    def edit(record: dict) -> None:
        record["format_version"] = 1
        del record["save_id"]
        record["arrays"] = {
            f"bomb{i}": {"shape": [chunks], "dtype": "uint8", "chunk_shape": [1], "chunk_grid": [chunks]}
            for i in range(count)
        }
    return edit


@pytest.mark.timeout(60)
def test_a_version_1_record_bounds_its_chunks_in_all_not_per_array(ckpt_dir: Path) -> None:
    """A version 1 record lists no checksum per chunk, so its size does not bound its
    chunks: MAX_UNBOUND_CHUNKS bounds them over all its arrays. Before, it bounded each
    array alone, and a record of a few hundred bytes naming arrays each just under the
    bound made ``verify`` (and a save with overwrite=True, which lists the paths the
    record vouches for) walk tens of millions of chunk paths: minutes and gigabytes."""
    from shardstore.format.records.array_record import MAX_UNBOUND_CHUNKS

    _two_arrays(ckpt_dir)
    _edit_record(ckpt_dir, _unbound_arrays(2, MAX_UNBOUND_CHUNKS))
    assert len((ckpt_dir / "zarr.json").read_bytes()) < 4096
    report = verify(ckpt_dir)
    assert not report.ok and "absurd" in str(report)
    with pytest.raises(CheckpointingException, match="absurd"):
        save(_values(1.0), ckpt_dir, overwrite=True)


# --------------------------------------------------- async failures (11)


def async_save_with_rank_1_killed(rank: int, world: int, ckpt: str) -> tuple[str, float]:
    import os
    import signal
    import time

    from shardstore.strategies.async_utils import AsyncCallsQueue

    queue = AsyncCallsQueue()
    request = save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(64, 4), (0, rank, world))}, ckpt,
                   async_sharded_save=True)
    queue.schedule_async_request(request)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # dies during its background I/O
    start = time.monotonic()
    try:
        queue.maybe_finalize_async_calls(blocking=True)
    except CheckpointingException as exc:
        return str(exc), time.monotonic() - start
    raise AssertionError("finalize succeeded without rank 1")


@pytest.mark.timeout(120)
def test_a_rank_killed_during_async_io_gives_a_clear_error(ckpt_dir: Path) -> None:
    (message, seconds), = [r for r in run_distributed(async_save_with_rank_1_killed, 2, str(ckpt_dir), killed=(1,))
                           if r is not None]
    assert "not committed" in message and str(ckpt_dir) in message, message
    assert seconds < 30
    with pytest.raises(CheckpointingException, match="incomplete|not a distributed checkpoint|does not exist"):
        load(_one("w", torch.empty(128, 4)), ckpt_dir)


# ------------------------------------------- a load racing an overwrite (4)


@pytest.mark.timeout(120)
def test_a_load_racing_overwrites_reads_one_checkpoint_or_fails_clearly(ckpt_dir: Path) -> None:
    import threading

    def state(version: int) -> dict:
        return {"a": ShardedTensor.from_rank_offsets("a", torch.full((64, 16), float(version))),
                "b": ShardedTensor.from_rank_offsets("b", torch.full((8,), float(version))),
                "version": version}

    save(state(0), ckpt_dir, sharded_strategy=_small_chunks())
    stop = threading.Event()

    def overwrite() -> None:
        version = 1
        while not stop.is_set():
            save(state(version), ckpt_dir, sharded_strategy=_small_chunks(), overwrite=True)
            version += 1

    writer = threading.Thread(target=overwrite)
    writer.start()
    outcomes = {"consistent": 0, "failed": 0}
    try:
        for _ in range(40):
            request = {"a": ShardedTensor.from_rank_offsets("a", torch.empty(64, 16)),
                       "b": ShardedTensor.from_rank_offsets("b", torch.empty(8))}
            try:
                loaded = load(request, ckpt_dir)
            except CheckpointingException:
                outcomes["failed"] += 1
                continue
            version = float(loaded["version"])
            assert torch.all(loaded["a"] == version) and torch.all(loaded["b"] == version), "a mix of two saves"
            outcomes["consistent"] += 1
    finally:
        stop.set()
        writer.join()
    print("racing load outcomes:", outcomes)
    assert outcomes["consistent"] > 0, outcomes


@pytest.mark.parametrize("kind, what, on_load", [
    # both are read as they are (tests/test_legacy.py); these hold junk metadata
    ("megatron torch_dist", "Megatron-Core 'torch_dist' checkpoint", "is not valid PyTorch DCP metadata"),
    ("megatron zarr", "Megatron-Core zarr checkpoint", r"decoder.weight/.zarray is not a Zarr v2 array"),
])
def test_foreign_checkpoints_are_named_on_load_and_save(ckpt_dir: Path, kind: str, what: str, on_load: str) -> None:
    for rel, data in FOREIGN_DIRS[kind].items():
        (ckpt_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (ckpt_dir / rel).write_bytes(data)
    with pytest.raises(CheckpointingException, match=on_load):
        load(_one("w", torch.empty(3)), ckpt_dir)
    with pytest.raises(CheckpointingException, match=what):
        save(_one("w", torch.ones(3)), ckpt_dir, overwrite=True)


# --------------------------- nothing sharded goes into common.pt (issue 17.2)


def test_foreign_sharded_objects_in_the_common_state_are_refused(ckpt_dir: Path) -> None:
    # Stand-ins with the class names such libraries use (Megatron-Core's own objects are
    # converted instead: tests/test_megatron_objects.py); no library is imported.
    ShardedTensor_ = type("ShardedTensor", (), {"__module__": "another_trainer.checkpointing"})
    DTensor = type("DTensor", (torch.Tensor,), {"__module__": "torch.distributed.tensor"})
    for value, where in ((ShardedTensor_(), "/model/fc1"), ([1, DTensor()], "/model/fc1[1]")):
        with pytest.raises(CheckpointingException, match=re.escape(where) + ".*would be pickled whole"):
            save({"model": {"fc1": value}, **_one("w", torch.ones(2))}, ckpt_dir)
        assert not ckpt_dir.exists()


# ------------------------------------- Megatron's phrases and names (issue 17.7)


def test_errors_keep_megatron_key_phrases(tmp_path: Path) -> None:
    from shardstore import StrictHandling
    from shardstore.strategies.base import LoadShardedStrategy

    with pytest.raises(CheckpointingException, match="does not exist"):
        load(_one("w", torch.empty(3)), tmp_path / "nowhere")
    save({**_one("w", torch.ones(3)), **_one("v", torch.ones(2))}, tmp_path / "ckpt")
    with pytest.raises(CheckpointingException, match=r"(?s)Unexpected keys.*'x'.*Missing keys.*'v'"):
        load({**_one("w", torch.empty(3)), **_one("x", torch.empty(1))}, tmp_path / "ckpt", strict=StrictHandling.RAISE_ALL)

    class Minimal(LoadShardedStrategy):  # what a custom strategy in Megatron-style code implements
        def load(self, sharded_state_dict, checkpoint_dir):
            return {}

        def load_tensors_metadata(self, checkpoint_dir):
            return {}

        def check_backend_compatibility(self, loaded_backend):
            pass

        def check_version_compatibility(self, loaded_version):
            pass

    with pytest.raises(NotImplementedError):
        Minimal().remove_sharded_tensors(tmp_path / "ckpt", "w")


def save_and_load_through_megatron_names(rank: int, world: int, ckpt: str) -> None:
    from shardstore.serialization import load_content_metadata
    from shardstore.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
        FullyParallelSaveStrategyWrapper,
    )
    from shardstore.strategies.zarr import ZarrLoadShardedStrategy, ZarrSaveShardedStrategy
    from shardstore.validation import determine_global_metadata

    def sd(empty: bool) -> dict:
        data = torch.empty(4) if empty else torch.arange(4.0) + 10 * rank
        return {"w": ShardedTensor.from_rank_offsets("w", data, (0, rank, world)),
                "norm": ShardedTensor.from_rank_offsets("norm", torch.empty(3) if empty else torch.ones(3),
                                                        replica_id=rank)}

    local, everyone = determine_global_metadata(sd(False))
    assert [t.key for t in local] == ["w", "norm"] and len(everyone) == world and local[0].data is None
    save(sd(False), ckpt, FullyParallelSaveStrategyWrapper(ZarrSaveShardedStrategy(fully_parallel=False)),
         content_metadata={"tp": world, "distrib_optim_sharding_type": "dp_zero_gather_scatter"})
    loaded = load(sd(True), ckpt, FullyParallelLoadStrategyWrapper(ZarrLoadShardedStrategy(fully_parallel=False)))
    assert torch.equal(loaded["w"], torch.arange(4.0) + 10 * rank) and torch.equal(loaded["norm"], torch.ones(3))
    assert load_content_metadata(ckpt) == {"tp": world, "distrib_optim_sharding_type": "dp_zero_gather_scatter"}
    assert load_content_metadata(preloaded_state_dict=loaded)["tp"] == world


def test_megatron_training_names_work(ckpt_dir: Path) -> None:
    run_distributed(save_and_load_through_megatron_names, 2, str(ckpt_dir))


def test_factory_inside_a_list_merges_back_at_its_index(ckpt_dir: Path) -> None:
    from shardstore import ShardedTensorFactory

    def factory(data: torch.Tensor) -> ShardedTensorFactory:
        def build(key, t, replica_id, flattened_range):
            return {"a": ShardedTensor.from_rank_offsets(f"{key}/a", t[:2]),
                    "b": ShardedTensor.from_rank_offsets(f"{key}/b", t[2:])}

        return ShardedTensorFactory("f", data, build, lambda sub: torch.cat([sub["a"], sub["b"]]))

    def layers(empty: bool) -> list:
        return [ShardedTensor.from_rank_offsets("x", torch.empty(2) if empty else torch.ones(2)),
                factory(torch.empty(4) if empty else torch.arange(4.0)),
                ShardedTensor.from_rank_offsets("y", torch.empty(1) if empty else torch.zeros(1))]

    save({"layers": layers(False)}, ckpt_dir)
    loaded = load({"layers": layers(True)}, ckpt_dir)["layers"]
    assert [t.tolist() for t in loaded] == [[1.0, 1.0], [0.0, 1.0, 2.0, 3.0], [0.0]]


def test_dict_utils_diff_has_megatron_semantics() -> None:
    import numpy as np

    from shardstore.dict_utils import diff

    left = {"a": [1, (2, torch.ones(2))], "n": np.ones(3), "o": ShardedObject("o", {"v": 1}, (1,), (0,)), "x": 1}
    right = {"a": [1, (2, torch.ones(2, dtype=torch.float64))], "n": np.ones(3),
             "o": ShardedObject("o", {"v": 1}, (1,), (0,)), "y": 2}
    assert diff(left, right) == ([("x",)], [("y",)], [])  # equal values in other dtypes are equal
    _, _, mismatch = diff({"t": [torch.zeros(2)], "n": np.zeros(3)}, {"t": [torch.ones(2)], "n": np.ones(3)})
    assert [m[0] for m in mismatch] == [("t", 0), ("n", 0), ("n", 1), ("n", 2)]  # arrays are sequences


@pytest.mark.parametrize("sequence", [list, tuple, np.array])
@pytest.mark.parametrize("longer_on_left", [True, False])
def test_dict_utils_diff_names_missing_sequence_elements_by_path(sequence, longer_on_left: bool) -> None:
    from shardstore.dict_utils import diff

    short, long = {"layers": [sequence([1])]}, {"layers": [sequence([1, 2, 3])]}
    left, right = (long, short) if longer_on_left else (short, long)
    only_left, only_right, mismatch = diff(left, right, prefix=("ckpt",))
    missing = [("ckpt", "layers", 0, 2), ("ckpt", "layers", 0, 1)]  # highest index first
    assert (only_left, only_right, mismatch) == ((missing, [], []) if longer_on_left else ([], missing, []))


def test_dict_utils_diff_of_sequences_at_the_root_and_of_shared_elements() -> None:
    from shardstore.dict_utils import diff

    assert diff([1, 2], []) == ([(1,), (0,)], [], [])
    assert diff([], [1, 2]) == ([], [(1,), (0,)], [])
    assert diff([], []) == ([], [], [])
    assert diff({"layers": [1, 2]}, {"layers": [1, 3]}) == ([], [], [(("layers", 1), int, int)])
    assert diff({"a": [1]}, {"a": (1,)}) == ([], [], [(("a",), list, tuple)])
    assert diff(np.array(3), np.array(3)) == ([], [], [])  # 0-d arrays are values


def save_with_differing_common_state(rank: int, world: int, ckpt: str, drop_timer: bool) -> list[str]:
    import logging

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("shardstore").addHandler(Keep(logging.WARNING))
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(2), replica_id=rank),
             "iteration": 7, "timer": rank * 1.5, "args": {"lr": 0.1 * (1 + rank)}}
    save(state, ckpt, preprocess_common_before_consistancy_check=(
        (lambda common: {k: v for k, v in common.items() if k != "timer"}) if drop_timer else None))
    return records


@pytest.mark.parametrize("drop_timer", [False, True])
def test_common_state_differences_between_ranks_are_logged(tmp_path: Path, drop_timer: bool) -> None:
    logs = run_distributed(save_with_differing_common_state, 2, str(tmp_path / "c"), drop_timer)
    warning = " ".join(logs[0])  # Megatron's summary, on the coordinator (tests/test_common_state.py)
    assert "There is difference in the common state dict in different ranks" in warning
    assert "('args', 'lr')" in warning
    assert ("('timer',)" in warning) != drop_timer  # the preprocess function is honoured
    assert "'iteration'" not in warning
    assert len(logs[1]) == 1 and logs[1][0].startswith("Rank 1 common state dict differs from rank 0")


def test_an_aborted_async_save_is_cleared_by_the_next_save(ckpt_dir: Path) -> None:
    from shardstore.strategies.async_utils import AsyncCallsQueue

    queue = AsyncCallsQueue()
    queue.schedule_async_request(save(_one("w", torch.ones(4)), ckpt_dir, async_sharded_save=True))
    queue.close(abort=True)  # nothing committed; its staging directory's lock is released
    assert not ckpt_dir.exists() and any(".shardstore-save-" in p.name for p in ckpt_dir.parent.iterdir())
    save(_one("w", torch.full((4,), 2.0)), ckpt_dir)
    assert [p.name for p in ckpt_dir.parent.iterdir()] == [ckpt_dir.name]
    assert torch.equal(load(_one("w", torch.empty(4)), ckpt_dir)["w"], torch.full((4,), 2.0))


# ------------------------------------------- loads into the caller's tensors


def test_a_load_reads_into_the_requests_own_cpu_tensors(tmp_path: Path) -> None:
    """A contiguous CPU tensor of the stored dtype and shape is filled in place and
    returned (no second copy of the state); any other request gets a new tensor and its
    own tensor is left alone."""
    values = torch.arange(24.0).reshape(4, 6)
    save({"w": ShardedTensor.from_rank_offsets("w", values), "h": ShardedTensor.from_rank_offsets(
        "h", values.half())}, tmp_path / "ckpt")
    mine = torch.full((4, 6), float("nan"))
    strided = torch.full((6, 4), float("nan")).t()  # not contiguous
    upcast = torch.full((4, 6), float("nan"))  # float16 stored, float32 asked: converted
    loaded = load({"w": ShardedTensor.from_rank_offsets("w", mine),
                   "h": ShardedTensor.from_rank_offsets("h", upcast)}, tmp_path / "ckpt")
    assert loaded["w"] is mine and torch.equal(mine, values)
    assert loaded["h"] is not upcast and torch.equal(loaded["h"], values) and upcast.isnan().all()
    again = load({"w": ShardedTensor.from_rank_offsets("w", strided)}, tmp_path / "ckpt")
    assert again["w"] is not strided and torch.equal(again["w"], values) and strided.isnan().all()


def test_tied_request_tensors_each_get_their_own_values(tmp_path: Path) -> None:
    """One tensor requested under two keys (tied weights) that the checkpoint holds with
    different values: each key's result has its own values."""
    save({"a": ShardedTensor.from_rank_offsets("a", torch.ones(3)),
          "b": ShardedTensor.from_rank_offsets("b", torch.full((3,), 2.0))}, tmp_path / "ckpt")
    tied = torch.zeros(3)
    loaded = load({"a": ShardedTensor.from_rank_offsets("a", tied), "b": ShardedTensor.from_rank_offsets("b", tied)},
                  tmp_path / "ckpt")
    assert torch.equal(loaded["a"], torch.ones(3)) and torch.equal(loaded["b"], torch.full((3,), 2.0))


@pytest.mark.parametrize("kind", [torch.zeros, lambda *shape: torch.nn.Parameter(torch.zeros(*shape))],
                         ids=["tensors", "parameters"])
def test_one_block_asked_for_twice_is_read_once_into_both_requests_tensors(
    tmp_path: Path, monkeypatch, kind
) -> None:
    """Two requests for the same block (same key and region) in one state dict: the
    block is read from storage once, and each request's own tensor gets the values
    (also a model's parameters, which require grad); one tensor given to both gets them
    once, the other key a new tensor."""
    import shardstore.execution.load as load_execution

    values = torch.arange(12.0).reshape(3, 4)
    save({"w": ShardedTensor.from_rank_offsets("w", values)}, tmp_path / "ckpt")
    reads = []
    original = load_execution.load_tensors
    monkeypatch.setattr(load_execution, "load_tensors", lambda ts, *a, **k: reads.append(len(ts)) or original(ts, *a, **k))
    first, second = kind(3, 4), kind(3, 4)
    loaded = load({"a": ShardedTensor.from_rank_offsets("w", first),
                   "b": ShardedTensor.from_rank_offsets("w", second, replica_id=1)}, tmp_path / "ckpt")
    assert reads == [1], reads
    assert loaded["a"] is first and loaded["b"] is second
    assert torch.equal(first, values) and torch.equal(second, values)
    tied = kind(3, 4)
    loaded = load({"a": ShardedTensor.from_rank_offsets("w", tied),
                   "b": ShardedTensor.from_rank_offsets("w", tied, replica_id=1)}, tmp_path / "ckpt")
    assert sum(loaded[k] is tied for k in "ab") == 1 and all(torch.equal(loaded[k], values) for k in "ab")
