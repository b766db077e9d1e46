"""Issue 17.1: megatron-core's own mapping objects in, Megatron-shaped results out.

State dicts are built with ``megatron.core.dist_checkpointing.mapping`` classes the
way Megatron's layers build them: tensor-parallel column (axis 0) and row (axis 1)
splits, pipeline-stacked layers (``prepend_axis_num``), data-parallel replicas, a
fused-QKV ``ShardedTensorFactory``, a per-rank ``ShardedObject`` and a
``LocalNonpersistentObject``. They are saved at 2 ranks through ``shardstore.save``
and loaded at 1 and 4 ranks with megatron objects as the request, bit-exact.

CI installs megatron-core 0.16.1; the file also runs against 0.14.0 (flattened ranges
instead of irregular grids), e.g. ``PYTHONPATH=. /tmp/mc014/bin/python -m pytest
tests/test_megatron_objects.py`` in the venv ``tests/fixtures/legacy/make_megatron014.py``
describes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

mapping = pytest.importorskip("megatron.core.dist_checkpointing.mapping", reason="megatron-core not installed")

from shardstore import load, save  # noqa: E402
from tests.dist import run_distributed  # noqa: E402
from tests.scenarios import assert_bits_equal, global_tensor  # noqa: E402

LAYERS, HIDDEN, FFN = 2, 8, 16
FC1 = global_tensor("decoder/layers/fc1", (LAYERS, FFN, HIDDEN), torch.bfloat16)  # column parallel
FC2 = global_tensor("decoder/layers/fc2", (LAYERS, HIDDEN, FFN), torch.float32)  # row parallel
NORM = global_tensor("decoder/final_norm", (HIDDEN,), torch.float32)  # replicated
QKV = global_tensor("attn/qkv", (12, HIDDEN), torch.float32)


def _qkv(rank: int, world: int, data: torch.Tensor):
    def build(key, t, replica_id, flattened_range):
        q, kv = t[: t.shape[0] // 3], t[t.shape[0] // 3 :]
        return {"q": mapping.ShardedTensor.from_rank_offsets(f"{key}/q", q, (0, rank, world), replica_id=replica_id),
                "kv": mapping.ShardedTensor.from_rank_offsets(f"{key}/kv", kv, (0, rank, world), replica_id=replica_id)}

    def merge(sub):
        return torch.cat([sub["q"], sub["kv"]])

    return mapping.ShardedTensorFactory("attn/qkv", data, build, merge)


def megatron_state_dict(rank: int, world: int, empty: bool) -> dict:
    """Like GPTModel.sharded_state_dict() at TP=world, DP=1, two stacked layers."""

    def take(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x) if empty else x.clone()

    layers = {}
    for layer in range(LAYERS):
        layers[f"{layer}.fc1"] = mapping.ShardedTensor.from_rank_offsets(
            "decoder/layers/fc1", take(FC1[layer].chunk(world, 0)[rank]), (0, layer, LAYERS), (1, rank, world),
            prepend_axis_num=1)
        layers[f"{layer}.fc2"] = mapping.ShardedTensor.from_rank_offsets(
            "decoder/layers/fc2", take(FC2[layer].chunk(world, 1)[rank]), (0, layer, LAYERS), (2, rank, world),
            prepend_axis_num=1)
    return {
        "model": {
            "layers": layers,
            "final_norm": mapping.ShardedTensor.from_rank_offsets("decoder/final_norm", take(NORM), replica_id=rank),
            "qkv": _qkv(rank, world, take(QKV.chunk(world, 0)[rank])),
        },
        "rng": mapping.ShardedObject("rng_state", {"rank": rank} if not empty else None, (world,), (rank,)),
        "cache": mapping.LocalNonpersistentObject(f"local {rank}"),
        "iteration": 100,
    }


def save_megatron(rank: int, world: int, ckpt: str) -> None:
    save(megatron_state_dict(rank, world, empty=False), ckpt)


def load_megatron(rank: int, world: int, ckpt: str) -> None:
    loaded = load(megatron_state_dict(rank, world, empty=True), ckpt)
    model = loaded["model"]
    for layer in range(LAYERS):
        assert_bits_equal(model["layers"][f"{layer}.fc1"], FC1[layer].chunk(world, 0)[rank], f"fc1 {layer}")
        assert_bits_equal(model["layers"][f"{layer}.fc2"], FC2[layer].chunk(world, 1)[rank], f"fc2 {layer}")
    assert_bits_equal(model["final_norm"], NORM)
    assert_bits_equal(model["qkv"], QKV.chunk(world, 0)[rank], "qkv")  # merged back by the factory
    assert loaded["cache"] == f"local {rank}" and loaded["iteration"] == 100
    if world == 2:
        assert loaded["rng"] == {"rank": rank}


def test_megatron_objects_save_and_reshard(ckpt_dir: Path) -> None:
    run_distributed(save_megatron, 2, str(ckpt_dir))
    from shardstore.format.records import read_commit_record
    from shardstore.stores.locations import open_location

    arrays = read_commit_record(open_location(ckpt_dir)).arrays  # small: packed, no directory of its own
    assert arrays["decoder/layers/fc1"].shape == (LAYERS, FFN, HIDDEN), "a Zarr array, not a pickle in common.pt"
    run_distributed(load_megatron, 2, str(ckpt_dir))
    from shardstore import load_tensors_metadata

    meta = load_tensors_metadata(ckpt_dir)
    assert tuple(meta["decoder/layers/fc1"].global_shape) == (LAYERS, FFN, HIDDEN)
    assert tuple(meta["attn/qkv/q"].global_shape) == (4, HIDDEN)


def load_tensors_only(rank: int, world: int, ckpt: str) -> None:
    sd = megatron_state_dict(rank, world, empty=True)
    del sd["rng"]  # a ShardedObject's shards are per saving rank
    loaded = load(sd, ckpt)
    for layer in range(LAYERS):
        assert_bits_equal(loaded["model"]["layers"][f"{layer}.fc2"], FC2[layer].chunk(world, 1)[rank])
    assert_bits_equal(loaded["model"]["qkv"], _qkv_as_loaded(rank, world), "qkv")


def _qkv_as_loaded(rank: int, world: int, saved_world: int = 2) -> torch.Tensor:
    """The factory stores each saving rank's first third as q: the global q and kv are
    those parts concatenated, and a load at another world size merges its slices."""
    parts = [QKV.chunk(saved_world, 0)[r] for r in range(saved_world)]
    q = torch.cat([p[: p.shape[0] // 3] for p in parts])
    kv = torch.cat([p[p.shape[0] // 3 :] for p in parts])
    return torch.cat([q.chunk(world, 0)[rank], kv.chunk(world, 0)[rank]])


@pytest.mark.parametrize("world", [1, 4])
def test_megatron_objects_load_at_other_world_sizes(ckpt_dir: Path, world: int) -> None:
    run_distributed(save_megatron, 2, str(ckpt_dir))
    run_distributed(load_tensors_only, world, str(ckpt_dir))


def _irregular_buffer(rank: int, empty: bool) -> object:
    """Megatron 0.16's distributed-optimizer buffer: 24 elements cut 13 + 11."""
    cuts = [0, 13, 24]
    data = torch.arange(24, dtype=torch.float32)[cuts[rank]:cuts[rank + 1]].clone()
    return mapping.ShardedTensor("optimizer/exp_avg", torch.empty_like(data) if empty else data, torch.float32,
                                 data.shape, (24,), (cuts[rank],), None, replica_id=(0, 0, 0))


def megatron_api_irregular(rank: int, world: int, ckpt: str) -> None:
    from megatron.core import dist_checkpointing

    from shardstore.tools.megatron_strategy import (
        ShardstoreLoadShardedStrategy,
        ShardstoreSaveShardedStrategy,
    )

    if rank == 0:
        Path(ckpt).mkdir()
    torch.distributed.barrier()
    dist_checkpointing.save({"buf": _irregular_buffer(rank, False)}, ckpt,
                            sharded_strategy=ShardstoreSaveShardedStrategy())
    loaded = dist_checkpointing.load({"buf": _irregular_buffer(rank, True)}, ckpt,
                                     sharded_strategy=ShardstoreLoadShardedStrategy())
    assert_bits_equal(loaded["buf"], _irregular_buffer(rank, False).data)


def _megatron_has_flattened_ranges() -> bool:
    """megatron-core <= 0.14 builds flattened ranges; 0.16 raises on them and builds
    irregular grids instead (which 0.14 refuses)."""
    try:
        mapping.ShardedTensor.from_rank_offsets_flat("x", torch.zeros(2), (4,), flattened_range=slice(0, 2))
    except Exception:  # noqa: BLE001  (0.16: "flattened_range is not supported")
        return False
    return True


HAS_FLATTENED_RANGES = _megatron_has_flattened_ranges()


def _flat_state(rank: int, cuts: list[int], empty: bool) -> dict:
    """Megatron 0.14's distributed optimizer: each rank a contiguous range of the
    flattened parameters (a 1-D one and an 8 x 6 one)."""
    vector, matrix = torch.arange(24, dtype=torch.float32), FC2[0][:, :6].float()
    lo, hi = cuts[rank], cuts[rank + 1]
    matrix_cut = [c * 2 for c in cuts]  # 48 elements, cut at twice the vector's cut
    m_lo, m_hi = matrix_cut[rank], matrix_cut[rank + 1]

    def take(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x) if empty else x.clone()

    return {
        "vector": mapping.ShardedTensor.from_rank_offsets_flat(
            "optimizer/exp_avg", take(vector[lo:hi]), (24,), flattened_range=slice(lo, hi)),
        "matrix": mapping.ShardedTensor.from_rank_offsets_flat(
            "optimizer/fc2_exp_avg", take(matrix.flatten()[m_lo:m_hi]), (8, 6), flattened_range=slice(m_lo, m_hi)),
    }


def save_flat(rank: int, world: int, ckpt: str) -> None:
    save(_flat_state(rank, [0, 13, 24], empty=False), ckpt)


def load_flat(rank: int, world: int, ckpt: str) -> None:
    cuts = [0, 5, 24] if world == 2 else [0, 24]
    loaded = load(_flat_state(rank, cuts, empty=True), ckpt)
    expected = _flat_state(rank, cuts, empty=False)
    for name in ("vector", "matrix"):
        assert_bits_equal(loaded[name], expected[name].data, name)


@pytest.mark.skipif(not HAS_FLATTENED_RANGES, reason="this megatron-core builds irregular grids, not flattened ranges")
def test_megatron_014_flattened_ranges_save_and_reshard(ckpt_dir: Path) -> None:
    """0.14's from_rank_offsets_flat objects, cut 13 + 11 (and 26 + 22 of 48), saved at
    2 ranks, loaded at 1 and at another cut at 2."""
    run_distributed(save_flat, 2, str(ckpt_dir))
    run_distributed(load_flat, 1, str(ckpt_dir))
    run_distributed(load_flat, 2, str(ckpt_dir))


@pytest.mark.skipif(HAS_FLATTENED_RANGES, reason="this megatron-core (<= 0.14) refuses irregular grids")
def test_irregular_grids_through_megatrons_own_save_and_load(ckpt_dir: Path) -> None:
    """The plug-in stores Megatron 0.16's irregular buffers too (tests/test_irregular.py
    covers resharding them through shardstore's API)."""
    run_distributed(megatron_api_irregular, 2, str(ckpt_dir))
    from shardstore import load_plain_tensors

    assert_bits_equal(load_plain_tensors(ckpt_dir)["optimizer/exp_avg"], torch.arange(24, dtype=torch.float32))


def _factory_of_irregular_shards(rank: int, world: int, empty: bool) -> object:
    """A Megatron factory whose build cuts its rank's part of a 24-element buffer
    irregularly (13 + 11 at 2 ranks, whole at 1), as Megatron 0.16's optimizer cuts."""
    cuts = {1: [0, 24], 2: [0, 13, 24]}[world]
    data = torch.arange(24, dtype=torch.float32)[cuts[rank]:cuts[rank + 1]].clone()

    def build(key, t, replica_id, flattened_range):
        return {"shard": mapping.ShardedTensor(f"{key}/shard", t, t.dtype, tuple(t.shape), (24,), (cuts[rank],),
                                               None, replica_id=replica_id)}

    return mapping.ShardedTensorFactory("buffer", torch.empty_like(data) if empty else data, build,
                                        lambda sub: sub["shard"])


def save_factory_of_irregular_shards(rank: int, world: int, ckpt: str) -> None:
    save({"buf": _factory_of_irregular_shards(rank, world, False)}, ckpt)


def load_factory_of_irregular_shards(rank: int, world: int, ckpt: str) -> None:
    loaded = load({"buf": _factory_of_irregular_shards(rank, world, True)}, ckpt)
    assert_bits_equal(loaded["buf"], _factory_of_irregular_shards(rank, world, False).data)


@pytest.mark.skipif(HAS_FLATTENED_RANGES, reason="this megatron-core (<= 0.14) refuses irregular grids")
def test_a_megatron_factory_building_irregular_shards_saves_and_loads(ckpt_dir: Path) -> None:
    """Before, the conversion made each irregular shard of the build a factory of its
    own, which the walk did not build: the save committed a checkpoint without
    ``buffer/shard`` and the load returned a ShardedTensorFactory as ``buf``."""
    run_distributed(save_factory_of_irregular_shards, 2, str(ckpt_dir))
    from shardstore import load_plain_tensors

    assert_bits_equal(load_plain_tensors(ckpt_dir)["buffer/shard"], torch.arange(24, dtype=torch.float32))
    run_distributed(load_factory_of_irregular_shards, 2, str(ckpt_dir))
    run_distributed(load_factory_of_irregular_shards, 1, str(ckpt_dir))


# ------------------------------------------- issue 17.3: the strategy plug-in


def megatron_api_save(rank: int, world: int, ckpt: str) -> None:
    from megatron.core import dist_checkpointing

    from shardstore.tools.megatron_strategy import ShardstoreSaveShardedStrategy

    if rank == 0:
        Path(ckpt).mkdir()  # Megatron's save expects the directory to exist
    torch.distributed.barrier()
    sd = megatron_state_dict(rank, world, empty=False)
    dist_checkpointing.save(sd, ckpt, sharded_strategy=ShardstoreSaveShardedStrategy())


def megatron_api_load(rank: int, world: int, ckpt: str) -> None:
    from megatron.core import dist_checkpointing

    from shardstore.tools.megatron_strategy import ShardstoreLoadShardedStrategy

    sd = megatron_state_dict(rank, world, empty=True)
    loaded = dist_checkpointing.load(sd, ckpt, sharded_strategy=ShardstoreLoadShardedStrategy())
    for layer in range(LAYERS):
        assert_bits_equal(loaded["model"]["layers"][f"{layer}.fc1"], FC1[layer].chunk(world, 0)[rank], "fc1")
    assert_bits_equal(loaded["model"]["qkv"], QKV.chunk(world, 0)[rank], "qkv")
    assert loaded["rng"] == {"rank": rank} and loaded["iteration"] == 100


def test_megatron_save_and_load_with_the_plugin(ckpt_dir: Path) -> None:
    import json

    run_distributed(megatron_api_save, 2, str(ckpt_dir))
    config = json.loads((ckpt_dir / "metadata.json").read_text())
    assert config["sharded_backend"] == "shardstore", config
    assert (ckpt_dir / "decoder/layers/fc1/zarr.json").exists()
    run_distributed(megatron_api_load, 2, str(ckpt_dir))
    run_distributed(load_tensors_only, 1, str(ckpt_dir))  # shardstore.load reads it too
    from shardstore import verify
    from shardstore.format.records import read_commit_record
    from shardstore.stores.locations import open_location

    assert verify(ckpt_dir).ok
    # Megatron's own save wrote its sharded objects before calling ours: the record lists them too
    external = read_commit_record(open_location(ckpt_dir)).external_files
    assert external and all(path.endswith(".pt") for path in external), external
    damaged = ckpt_dir / sorted(external)[0]
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    assert [p.key for p in verify(ckpt_dir).problems] == [sorted(external)[0]]


def load_objects_with_shardstore(rank: int, world: int, ckpt: str) -> None:
    loaded = load(megatron_state_dict(rank, world, empty=True), ckpt)
    assert loaded["rng"] == {"rank": rank}, loaded.get("rng")
    from shardstore import load_sharded_metadata

    assert f"rng_state/shard_{rank}_{world}" in load_sharded_metadata(ckpt)


def test_objects_megatrons_save_wrote_through_the_plugin_load_with_shardstore(ckpt_dir: Path) -> None:
    """Megatron's own save with the plug-in writes its ShardedObjects itself, as
    ``<unique key>.pt`` (its common strategy's layout), which the commit record lists
    among the caller's files. ``shardstore.load`` looked for them under ``__objects__/``
    only and refused the load ("ShardedObject 'rng_state' ... missing"), and
    ``load_sharded_metadata`` did not list them: they are read from where Megatron put
    them, checked against the record."""
    run_distributed(megatron_api_save, 2, str(ckpt_dir))
    run_distributed(load_objects_with_shardstore, 2, str(ckpt_dir))


def test_the_plugin_loads_objects_shardstore_saved(ckpt_dir: Path) -> None:
    """``shardstore.save`` keeps ShardedObjects under ``__objects__/``; Megatron's own load
    with the plug-in's load strategy handed them to Megatron's common strategy, which
    looks for ``<unique key>.pt`` and failed to find them. The plug-in loads them itself."""
    run_distributed(save_megatron, 2, str(ckpt_dir))
    run_distributed(megatron_api_load, 2, str(ckpt_dir))


def test_a_damaged_object_file_megatron_wrote_is_refused_by_the_plugins_load(ckpt_dir: Path) -> None:
    """The object files Megatron's save wrote are read through the record's checksums:
    one damaged after the commit fails the load, naming it, instead of being unpickled."""
    run_distributed(megatron_api_save, 2, str(ckpt_dir))
    damaged = ckpt_dir / "rng_state" / "shard_0_2.pt"
    data = bytearray(damaged.read_bytes())
    data[-3] ^= 0x01
    damaged.write_bytes(bytes(data))
    with pytest.raises(Exception, match="shard_0_2.pt"):
        run_distributed(megatron_api_load, 2, str(ckpt_dir))


def test_plugin_without_megatron_says_what_to_install(monkeypatch) -> None:
    import importlib
    import sys

    names = ("shardstore.tools.megatron_strategy", "shardstore.compat.megatron.strategy")  # the name users import, home
    monkeypatch.setitem(sys.modules, "megatron.core.dist_checkpointing.strategies", None)
    for name in names:
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(ImportError, match="needs megatron-core"):
        importlib.import_module("shardstore.tools.megatron_strategy")
    for name in names:
        monkeypatch.delitem(sys.modules, name, raising=False)


def megatron_api_async_save(rank: int, world: int, ckpt: str, fail_rank: int | None) -> str | None:
    """Megatron's own async path: save(..., async_sharded_save=True) and its
    AsyncCallsQueue (a forked writer process). Megatron's queue puts a tensor on
    ``torch.cuda.current_device()``: on a CPU torch that is a stand-in, "cpu"."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    import shardstore.execution.save as save_execution
    from shardstore.tools.megatron_strategy import ShardstoreSaveShardedStrategy

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    if rank == 0:
        Path(ckpt).mkdir()
    torch.distributed.barrier()
    if rank == fail_rank:  # the background writer of this rank fails (after the fork)
        def failing_write(*args, **kwargs):
            raise OSError(28, "No space left on device")
        save_execution.run_writes = failing_write
    sd = megatron_state_dict(rank, world, empty=False)
    request = dist_checkpointing.save(sd, ckpt, sharded_strategy=ShardstoreSaveShardedStrategy(),
                                      async_sharded_save=True)
    for layer in range(LAYERS):  # the caller may change its tensors once save returns
        sd["model"]["layers"][f"{layer}.fc1"].data.fill_(-1)
    queue = AsyncCallsQueue()
    queue.schedule_async_request(request)
    try:
        queue.maybe_finalize_async_calls(blocking=True)
    except Exception as exc:  # noqa: BLE001  (the failing case: every rank must see it)
        return f"{type(exc).__name__}: {exc}"
    finally:
        queue.close()
    return None


def test_megatron_async_save_with_the_plugin(ckpt_dir: Path) -> None:
    """17.3: the plug-in through Megatron's async save, the tensors changed right after
    save returned: the checkpoint holds the values at the call, is verified, and no
    report file is left."""
    from shardstore import load_plain_tensors, verify

    assert run_distributed(megatron_api_async_save, 2, str(ckpt_dir), None) == [None, None]
    assert verify(ckpt_dir).ok
    assert_bits_equal(load_plain_tensors(ckpt_dir)["decoder/layers/fc1"], FC1)
    assert not list(ckpt_dir.glob(".shardstore-written-*"))


def test_megatron_async_save_failing_in_the_background_fails_every_rank(ckpt_dir: Path) -> None:
    from shardstore import CheckpointingException, load_plain_tensors

    errors = run_distributed(megatron_api_async_save, 2, str(ckpt_dir), 1)
    assert all(e and "failed on rank(s) 1" in e and "No space left on device" in e for e in errors), errors
    with pytest.raises(CheckpointingException, match="commit record"):
        load_plain_tensors(ckpt_dir)


def test_megatrons_own_queries_refuse_a_shardstore_checkpoint(tmp_path: Path) -> None:
    """17.6: Megatron-Core opening our checkpoint without the plug-in gets an error that
    names the backend, not an empty result (as when we claimed its zarr backend)."""
    from megatron.core import dist_checkpointing

    from shardstore import ShardedTensor

    save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}, tmp_path / "ckpt")
    for query in (dist_checkpointing.load_tensors_metadata, dist_checkpointing.load_common_state_dict):
        with pytest.raises(Exception, match="shardstore"):
            query(str(tmp_path / "ckpt"))


def megatron_api_save_again(rank: int, world: int, ckpt: str) -> str:
    """Megatron's own save with the plug-in into a directory that holds a committed
    checkpoint: returns what this rank raised."""
    from megatron.core import dist_checkpointing

    from shardstore.tools.megatron_strategy import ShardstoreSaveShardedStrategy

    sd = megatron_state_dict(rank, world, empty=False)
    sd["iteration"] = 200
    try:
        dist_checkpointing.save(sd, ckpt, sharded_strategy=ShardstoreSaveShardedStrategy())
    except Exception as exc:  # noqa: BLE001  (every rank must refuse)
        return f"{type(exc).__name__}: {exc}"
    raise AssertionError("the save into a committed checkpoint returned normally")


def test_the_plugin_refuses_to_rewrite_a_committed_checkpoint_in_place(ckpt_dir: Path) -> None:
    """Issue 41.4: Megatron-Core's save rewrites the directory in place, common.pt first,
    so a crash midway would lose both checkpoints; it is refused on every rank before
    anything is written, and the old checkpoint stays whole."""
    import hashlib

    from shardstore import verify

    run_distributed(megatron_api_save, 2, str(ckpt_dir))
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in ckpt_dir.rglob("*") if p.is_file()}
    errors = run_distributed(megatron_api_save_again, 2, str(ckpt_dir))
    assert all("holds a committed shardstore checkpoint" in e and "Nothing was written" in e for e in errors), errors
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in ckpt_dir.rglob("*") if p.is_file()} == before
    assert verify(ckpt_dir).ok
    run_distributed(megatron_api_load, 2, str(ckpt_dir))


def test_an_object_file_added_after_the_commit_in_megatrons_layout_is_refused(ckpt_dir: Path) -> None:
    """A shard file in Megatron's layout (``<unique key>.pt``) that the record does not
    list was put there after the commit: a shardstore load refuses it rather than
    unpickling it unchecked."""
    run_distributed(save_megatron, 2, str(ckpt_dir))
    for path in (ckpt_dir / "__objects__" / "rng_state").iterdir():
        (ckpt_dir / "rng_state").mkdir(exist_ok=True)
        path.rename(ckpt_dir / "rng_state" / path.name)
    with pytest.raises(Exception, match="not vouched for by the commit record"):
        run_distributed(load_objects_with_shardstore, 2, str(ckpt_dir))
