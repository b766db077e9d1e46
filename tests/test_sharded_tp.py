"""Shards inside blocks (issue 44.4): Megatron's row-parallel weights, split by tensor
parallelism along their last axis (``[out, in/TP]``, layer-stacked ``[1, out, in/TP]``),
are stored with ``shard_bytes`` as shards that lie inside their blocks, written by
each block's holder, with inner chunks that split the columns too; a load at another
TP size reads at most 1.25x what it needs, plain readers read them, ``verify`` and
incremental saves work on them, and unsharded saves are as before."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import shardstore
from shardstore import ShardedTensor, load, save
from shardstore.format.records import read_commit_record
from shardstore.format.sharding import ShardingIndexed
from shardstore.planning.layout import GatheredShards, ShardRecord
from shardstore.planning.plans import plan_save
from shardstore.stores.locations import open_location
from shardstore.strategies.zarr import ZarrSaveShardedStrategy
from tests.dist import run_distributed
from tests.test_sharded_arrays import _count_chunk_reads

OUT, IN, LAYERS = 256, 1536, 2  # IN divides by 2, 3 and 4: TP 2 -> 3 and 4
SHARD_BYTES = 1 << 20  # a TP 2 block (768 KiB) is at least an eighth of it: its own shard


def _proj() -> torch.Tensor:
    return torch.arange(OUT * IN, dtype=torch.float32).reshape(OUT, IN) % 1009


def _fc2() -> torch.Tensor:
    return (torch.arange(LAYERS * OUT * IN, dtype=torch.float32).reshape(LAYERS, OUT, IN) * 7) % 997


def _state(part: int, parts: int, empty: bool = False) -> dict[str, ShardedTensor]:
    """Part ``part`` of ``parts`` along the last axis of ``proj`` (``[out, in]``) and of
    every layer of ``fc2`` (``[layers, out, in]``, a ShardedTensor per layer)."""
    out = {}
    block = _proj().chunk(parts, -1)[part].clone()
    out["proj"] = ShardedTensor.from_rank_offsets("proj", torch.zeros_like(block) if empty else block, (1, part, parts))
    for layer in range(LAYERS):
        block = _fc2()[layer].chunk(parts, -1)[part].clone()
        out[f"fc2.{layer}"] = ShardedTensor.from_rank_offsets(
            "fc2", torch.zeros_like(block) if empty else block, (0, layer, LAYERS), (2, part, parts),
            prepend_axis_num=1)
    return out


def _expected(part: int, parts: int) -> dict[str, torch.Tensor]:
    return {"proj": _proj().chunk(parts, -1)[part],
            **{f"fc2.{layer}": _fc2()[layer].chunk(parts, -1)[part] for layer in range(LAYERS)}}


def saved(rank: int, world: int, ckpt: str, shard_bytes: int | None) -> None:
    save(_state(rank, world), ckpt, ZarrSaveShardedStrategy(shard_bytes=shard_bytes))


def loaded_counting_bytes(rank: int, world: int, ckpt: str) -> tuple[int, int]:
    """Loads part ``rank`` of ``world``; returns the bytes its chunk reads returned and
    the bytes it asked for."""
    read = _count_chunk_reads()
    loaded = load(_state(rank, world, empty=True), ckpt)
    for key, value in _expected(rank, world).items():
        assert torch.equal(loaded[key], value), key
    return read[0], sum(v.nbytes for v in loaded.values())


@contextlib.contextmanager
def _counting_reads() -> Iterator[list[int]]:
    """``_count_chunk_reads`` in this process, undone on leaving."""
    from shardstore.stores.local import FileChunkStore

    names = ("get_into", "get_into_folded", "get_range_into_folded", "get_suffix")
    real = {name: getattr(FileChunkStore, name) for name in names}
    try:
        yield _count_chunk_reads()
    finally:
        for name, method in real.items():
            setattr(FileChunkStore, name, method)


def _chunk_files(ckpt: Path, key: str) -> list[str]:
    return sorted(name for name in os.listdir(ckpt / key) if name != "zarr.json")


@pytest.fixture(scope="module")
def tp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Saved by 2 ranks (TP 2), sharded."""
    ckpt = tmp_path_factory.mktemp("tp") / "ckpt"
    run_distributed(saved, 2, str(ckpt), SHARD_BYTES)
    return ckpt


def test_each_block_is_one_shard_whose_inner_chunks_split_its_columns(tp2: Path) -> None:
    assert _chunk_files(tp2, "proj") == ["c.0.0", "c.0.1"]  # one shard per block, written by its holder
    assert _chunk_files(tp2, "fc2") == ["c.0.0.0", "c.0.0.1", "c.1.0.0", "c.1.0.1"]
    for key, inner in (("proj", [OUT, IN // 16]), ("fc2", [1, OUT, IN // 16])):
        meta = json.loads((tp2 / key / "zarr.json").read_text())
        assert meta["codecs"][0]["name"] == "sharding_indexed"
        assert meta["codecs"][0]["configuration"]["chunk_shape"] == inner  # an eighth of a block's columns
    assert shardstore.verify(tp2).ok


@pytest.mark.parametrize("world", [4, 3])
def test_a_load_at_another_tp_size_reads_at_most_a_quarter_more(tp2: Path, world: int) -> None:
    """TP 2 -> 4: each rank reads its half of each block's inner chunks (1.0x, plus
    each shard's crc table and index); TP 2 -> 3: at most one inner chunk more per end
    off the inner grid (1.125x)."""
    for read, needed in run_distributed(loaded_counting_bytes, world, str(tp2), timeout=240):
        assert needed <= read <= (1.01 if world == 4 else 1.25) * needed, (read, needed)


def test_one_rank_loads_the_whole(tp2: Path) -> None:
    with _counting_reads() as read:
        loaded = load(_state(0, 1, empty=True), tp2)
    for key, value in _expected(0, 1).items():
        assert torch.equal(loaded[key], value), key
    needed = sum(v.nbytes for v in loaded.values())
    assert needed <= read[0] <= 1.01 * needed


def test_plain_zarr_and_tensorstore_read_the_shards(tp2: Path) -> None:
    import tensorstore as ts
    import zarr

    for key, full in (("proj", _proj()), ("fc2", _fc2())):
        assert np.array_equal(zarr.open_array(str(tp2 / key), mode="r")[:], full.numpy()), key
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tp2 / key)}}
        assert np.array_equal(ts.open(spec).result().read().result(), full.numpy()), key
        part = ts.open(spec).result()[..., IN // 4 : IN // 2].read().result()  # a TP 4 reader's part
        assert np.array_equal(part, full[..., IN // 4 : IN // 2].numpy()), key


def test_unsharded_saves_are_unchanged(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run_distributed(saved, 2, str(ckpt), None)
    meta = json.loads((ckpt / "proj" / "zarr.json").read_text())
    assert [c["name"] for c in meta["codecs"]] == ["bytes", "crc32c"]
    assert meta["chunk_grid"]["configuration"]["chunk_shape"] == [OUT, IN // 2]
    assert _chunk_files(ckpt, "proj") == ["c.0.0", "c.0.1"]


def saved_then_reused(rank: int, world: int, root: str) -> None:
    strategy = ZarrSaveShardedStrategy(shard_bytes=SHARD_BYTES)
    save(_state(rank, world), f"{root}/1", strategy)
    state = _state(rank, world)
    if rank == 1:
        state["proj"].data[5, 7] += 1  # one shard changes
    save(state, f"{root}/2", strategy, reuse_from=f"{root}/1")
    loaded = load(_state(rank, world, empty=True), f"{root}/2")
    for key, value in state.items():
        assert torch.equal(loaded[key], value.data), key


def test_an_incremental_save_shares_the_unchanged_shards(tmp_path: Path) -> None:
    run_distributed(saved_then_reused, 2, str(tmp_path))
    record = read_commit_record(open_location(tmp_path / "2"))
    assert record.reused_from is not None and record.reused_from.chunks == 5  # of 6 shards
    same = {name: os.stat(tmp_path / "1" / "proj" / name).st_ino == os.stat(tmp_path / "2" / "proj" / name).st_ino
            for name in ("c.0.0", "c.0.1")}
    assert same == {"c.0.0": True, "c.0.1": False}
    assert shardstore.verify(tmp_path / "2").ok


BIG_OUT, BIG_IN = 2048, 4096  # TP 2 blocks of 16 MiB: inner chunks of 1 MiB split rows too


def _big() -> torch.Tensor:
    return torch.arange(BIG_OUT * BIG_IN, dtype=torch.float32).reshape(BIG_OUT, BIG_IN) % 4093


def big_part_loaded_counting_bytes(rank: int, world: int, ckpt: str) -> tuple[int, int]:
    read = _count_chunk_reads()
    part = _big().chunk(world, -1)[rank]
    loaded = load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros_like(part), (1, rank, world))}, ckpt)
    assert torch.equal(loaded["w"], part)
    return read[0], part.nbytes


def test_inner_chunks_of_a_large_block_split_its_rows_and_are_read_back(tmp_path: Path) -> None:
    """One process holds both TP 2 blocks; inner chunks ``[1024, 256]`` (1 MiB); a
    reader of a TP 4 part reads its half of each of the two rows of inner chunks."""
    state = {f"w.{j}": ShardedTensor.from_rank_offsets("w", half.clone(), (1, j, 2))
             for j, half in enumerate(_big().chunk(2, -1))}
    save(state, tmp_path / "ckpt", ZarrSaveShardedStrategy(shard_bytes=64 << 20))
    meta = json.loads((tmp_path / "ckpt" / "w" / "zarr.json").read_text())
    assert meta["codecs"][0]["configuration"]["chunk_shape"] == [1024, 256]
    for read, needed in run_distributed(big_part_loaded_counting_bytes, 4, str(tmp_path / "ckpt"), timeout=240):
        assert needed <= read <= 1.01 * needed, (read, needed)
    assert shardstore.verify(tmp_path / "ckpt").ok


def test_pack_orders_a_shard_inner_chunk_major() -> None:
    values = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    codec = ShardingIndexed((4, 3), 4)
    expected = np.concatenate([values[r : r + 4, c : c + 3].reshape(-1) for r in (0, 4) for c in (0, 3, 6, 9)])
    assert np.array_equal(codec.pack(values).view(np.float32), expected)
    assert np.array_equal(codec.pack(np.asfortranarray(values)).view(np.float32), expected)  # any strides


def _layout(out: int, cols: int, tp: int, itemsize_dtype: torch.dtype) -> GatheredShards:
    """``[out, cols]`` split along its last axis over ``tp`` ranks."""
    gathered = []
    for rank in range(tp):
        t = ShardedTensor.from_rank_offsets("w", torch.empty(out, cols // tp, dtype=itemsize_dtype),
                                            (1, rank, tp))
        gathered.append(([ShardRecord.from_sharded_tensor(t, rank, 0)], []))
    return GatheredShards.from_gathered(gathered)


@pytest.mark.parametrize(("out", "cols", "inner"), [
    (4096, 4096, (2048, 256)),  # Megatron's linear_proj at hidden 4096, TP 2: 16 MiB blocks
    (4096, 14336, (512, 896)),  # linear_fc2 at ffn 14336: 56 MiB blocks
])
def test_megatron_shaped_row_parallel_weights_get_inner_chunks_of_at_most_1_mib(
        out: int, cols: int, inner: tuple[int, int]) -> None:
    plans = plan_save(_layout(out, cols, 2, torch.bfloat16), 64 << 20, False, 64 << 20)
    record = plans[0].commit.arrays["w"]
    assert record.chunk_shape == (out, cols // 2) and record.codec == ShardingIndexed(inner, 2)
    assert not any(p.gathered or p.straddling for p in plans)  # each holder writes its own


def test_a_block_larger_than_shard_bytes_is_still_one_file() -> None:
    """``shard_bytes`` merges small chunks; it does not cut a large one into more files."""
    record = plan_save(_layout(4096, 4096, 2, torch.bfloat16), 64 << 20, False, 1 << 20)[0].commit.arrays["w"]
    assert record.chunk_shape == (4096, 2048) and record.codec == ShardingIndexed((2048, 256), 2)


def test_small_blocks_still_gather_across_blocks() -> None:
    """A block under an eighth of ``shard_bytes`` is gathered with others (files first)."""
    plans = plan_save(_layout(64, 256, 2, torch.float32), 64 << 20, False, 64 << 20)
    record = plans[0].commit.arrays["w"]
    assert isinstance(record.codec, ShardingIndexed) and record.chunk_shape == (64, 256)
    assert any(p.gathered for p in plans)


def test_an_async_save_in_waves_packs_each_wave(tmp_path: Path) -> None:
    """An async save whose snapshot is bounded (``max_staging_bytes``) writes its blocks
    in waves, each packed as it is written."""
    state = {**_state(0, 2), **{f"{k}.1": v for k, v in _state(1, 2).items()}}
    strategy = ZarrSaveShardedStrategy(shard_bytes=SHARD_BYTES, max_staging_bytes=1 << 20)
    save(state, tmp_path / "ckpt", strategy, async_sharded_save=True).execute_sync()
    requests = {f"{k}.{j}": v for j in range(4) for k, v in _state(j, 4, empty=True).items()}
    loaded = load(requests, tmp_path / "ckpt")
    for j in range(4):
        for key, value in _expected(j, 4).items():
            assert torch.equal(loaded[f"{key}.{j}"], value), (key, j)
    assert shardstore.verify(tmp_path / "ckpt").ok


def _batches_written(monkeypatch: pytest.MonkeyPatch, bound: int) -> list[int]:
    """With ``MAX_COPIED_BYTES`` set to ``bound``, the bytes of each batch of chunk
    writes a save runs (``execution.save.write_ops``), filled as it saves."""
    import shardstore.execution.save as rank_save

    batches: list[int] = []
    real = rank_save.run_writes

    def counting(jobs, *args, **kwargs):
        batches.append(sum(data.nbytes for _, data in jobs))
        return real(jobs, *args, **kwargs)

    monkeypatch.setattr(rank_save, "run_writes", counting)
    monkeypatch.setattr(rank_save, "MAX_COPIED_BYTES", bound)
    return batches


def test_packed_shards_are_written_in_batches_of_bounded_copies(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Packing copies a shard; a sync save holds at most ``MAX_COPIED_BYTES`` of such
    copies at once (here less than a block: one block's shards per batch)."""
    batches = _batches_written(monkeypatch, bound=1)
    state = {**_state(0, 2), **{f"{k}.1": v for k, v in _state(1, 2).items()}}
    save(state, tmp_path / "ckpt", ZarrSaveShardedStrategy(shard_bytes=SHARD_BYTES))
    block = OUT * IN // 2 * 4
    assert batches == [block] * 6  # one block (its one shard) per batch
    loaded = load({k: ShardedTensor(**{**v.__dict__, "data": torch.zeros_like(v.data)}) for k, v in state.items()},
                  tmp_path / "ckpt")
    assert all(torch.equal(loaded[k], v.data) for k, v in state.items())


def test_the_copies_bound_holds_per_shard_for_blocks_of_several_shards(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block of several chunks (8 MiB in 1 MiB shards) is packed shard by shard: no
    batch holds more than ``MAX_COPIED_BYTES`` of packed copies (a block's own batch
    did, whole, before)."""
    batches = _batches_written(monkeypatch, bound=1 << 20)
    full = torch.randn(2048, 2048)
    state = {f"w.{j}": ShardedTensor.from_rank_offsets("w", h.clone(), (1, j, 2)) for j, h in enumerate(full.chunk(2, 1))}
    save(state, tmp_path / "ckpt", ZarrSaveShardedStrategy(shard_bytes=1 << 20, max_chunk_bytes=1 << 20))
    assert len(batches) == 16 and max(batches) <= 1 << 20, batches
    loaded = load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2048, 2048))}, tmp_path / "ckpt")
    assert torch.equal(loaded["w"], full)


def test_on_s3_shards_inside_blocks_save_load_and_verify(moto_server) -> None:
    """One process holds both TP 2 blocks and saves to the local S3 server (TensorStore's
    kvstore writes the packed shards); the TP 4 parts load bit-exact."""
    from shardstore.stores.s3 import S3Options
    from tests.s3_support import KEY, REGION, SECRET

    moto_server.create_bucket("tp-sharded")
    options = S3Options(endpoint_url=moto_server.endpoint, key=KEY, secret=SECRET, region=REGION)
    target = open_location("s3://tp-sharded/ckpt", options=options)
    save({**_state(0, 2), **{f"{k}.1": v for k, v in _state(1, 2).items()}}, target,
         ZarrSaveShardedStrategy(shard_bytes=SHARD_BYTES))
    assert sorted(n for n in target.list_files() if n.startswith("proj/")) == [  # documents: the root's only
        "proj/c.0.0", "proj/c.0.1"]
    requests = {f"{k}.{j}": v for j in range(4) for k, v in _state(j, 4, empty=True).items()}
    loaded = load(requests, target)
    for j in range(4):
        for key, value in _expected(j, 4).items():
            assert torch.equal(loaded[f"{key}.{j}"], value), (key, j)
    assert shardstore.verify(target).ok
