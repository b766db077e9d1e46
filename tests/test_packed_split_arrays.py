"""Packed small arrays split over ranks (issue 44.3, FSDP2's ``Shard(0)``): with
``SaveOptions(pack_arrays_up_to=...)`` an array of at most that many bytes whose blocks
several ranks hold is stored as one chunk, assembled on one writer from the ranks'
blocks (balanced by bytes) and packed there: no directory of its own, one pack PUT per
rank on S3 instead of a shard and a document per array."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from shardstore import ShardedTensor, StorageLayout, load, save, verify
from shardstore.format.commit import SaveOptions
from shardstore.format.records import read_commit_record
from shardstore.stores.locations import open_location
from tests.dist import run_distributed

PACK = SaveOptions(pack_arrays_up_to=64 << 10)
SMALL = [(12, 16), (36, 5), (6,), (24, 8, 3)]  # rows a multiple of 2 and 3 ranks, all under the bound
BIG = (192, 128)  # 96 KiB of float32: above the bound, stored as before


def _global() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    tensors = {f"layer{i}/w": torch.randn(*shape, generator=gen) for i, shape in enumerate(SMALL)}
    tensors["emb_bf16"] = torch.randn(18, 4, generator=gen).to(torch.bfloat16)
    tensors["big"] = torch.randn(*BIG, generator=gen)
    return tensors


def _fsdp(rank: int, world: int, empty: bool = False) -> dict[str, ShardedTensor]:
    """Every array split along its rows over ``world`` ranks (FSDP2's ``Shard(0)``)."""
    out = {}
    for key, t in _global().items():
        block = t.chunk(world)[rank].clone()
        out[key] = ShardedTensor.from_rank_offsets(key, torch.empty_like(block) if empty else block, (0, rank, world))
    return out


def _save(rank: int, world: int, path: str) -> None:
    save(_fsdp(rank, world), path, options=PACK)


def _load(rank: int, world: int, path: str) -> None:
    loaded = load(_fsdp(rank, world, empty=True), path)
    expected = _fsdp(rank, world)
    assert [k for k, t in expected.items() if not torch.equal(loaded[k], t.data)] == []


def _check_packed(path: str, world: int) -> None:
    record = read_commit_record(open_location(path))
    small = set(_global()) - {"big"}
    assert set(record.packed_arrays) == small
    assert record.arrays["big"].pack is None
    for key in small:
        array = record.arrays[key]
        assert array.chunk_shape == array.shape, key  # one chunk, the whole array
        assert not (Path(path) / key).exists(), key  # no directory of its own
    assert 1 < len(record.packs) <= world, record.packs  # spread over the writers
    report = verify(path)
    assert report.ok, report
    tensors = _global()
    for key in small:
        group = zarr.open_group(zarr.storage.ZipStore(Path(path) / record.arrays[key].pack, mode="r"), mode="r")
        got = group[key][...]
        if key == "emb_bf16":
            np.testing.assert_array_equal(got.view(np.int16), tensors[key].view(torch.int16).numpy())
        else:
            np.testing.assert_array_equal(got, tensors[key].numpy())


@pytest.mark.parametrize(("world", "other"), [(2, 3), (3, 2)])
def test_fsdp_split_small_arrays_are_packed_and_load_at_any_layout(tmp_path: Path, world: int, other: int) -> None:
    path = str(tmp_path / "ckpt")
    run_distributed(_save, world, path)
    _check_packed(path, world)
    run_distributed(_load, world, path)
    run_distributed(_load, other, path)
    _load(0, 1, path)


def _save_twice(rank: int, world: int, first: str, second: str) -> None:
    save(_fsdp(rank, world), first, options=PACK)
    save(_fsdp(rank, world), second, options=SaveOptions(pack_arrays_up_to=64 << 10, reuse_from=first))


def test_an_incremental_save_of_split_packed_arrays_shares_nothing_and_loads(tmp_path: Path) -> None:
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    run_distributed(_save_twice, 2, first, second)
    _check_packed(second, 2)
    record = read_commit_record(open_location(second))
    assert all(record.arrays[k].pack is not None for k in set(_global()) - {"big"})
    run_distributed(_load, 2, second)


def _save_in_waves(rank: int, world: int, path: str) -> None:
    from shardstore.strategies.zarr import ZarrSaveShardedStrategy

    # waves of 4 KiB: the writers assemble the split arrays over several exchange waves
    save(_fsdp(rank, world), path, ZarrSaveShardedStrategy(sync_staging_bytes=16 << 10), options=PACK)


def test_split_arrays_assembled_in_exchange_waves_load_and_verify(tmp_path: Path) -> None:
    """Under a staging bound the chunks assembled in an earlier exchange wave are written
    then, as their own files (not packed: their pack is written after the last wave);
    the checkpoint is whole either way."""
    path = str(tmp_path / "ckpt")
    run_distributed(_save_in_waves, 2, path)
    record = read_commit_record(open_location(path))
    for key, array in record.arrays.items():
        assert (array.pack is None) == (Path(path) / key / "zarr.json").is_file(), key
    report = verify(path)
    assert report.ok, report
    run_distributed(_load, 2, path)
    _load(0, 1, path)


def _save_cached(rank: int, world: int, root: str) -> tuple[int, int]:
    from shardstore.strategies.zarr import ZarrSaveShardedStrategy

    strategy = ZarrSaveShardedStrategy(cache_plan=True)
    save(_fsdp(rank, world), f"{root}/a", strategy, options=PACK)
    save(_fsdp(rank, world), f"{root}/b", strategy, options=PACK)  # the same plan, reused
    save(_fsdp(rank, world), f"{root}/c", strategy, layout=StorageLayout(pack_arrays_up_to=0))  # planned anew
    cache = strategy.plan_cache
    return cache.planned, cache.reused


def test_a_cached_plan_is_reused_for_packing_saves_and_not_for_others(tmp_path: Path) -> None:
    counts = run_distributed(_save_cached, 2, str(tmp_path))
    assert counts == [(2, 1), (2, 1)]
    for name, packed in (("a", True), ("b", True), ("c", False)):
        record = read_commit_record(open_location(str(tmp_path / name)))
        assert bool(record.packed_arrays) == packed, name
        assert record.arrays["layer0/w"].chunk_shape == (record.arrays["layer0/w"].shape if packed else (6, 16)), name
    run_distributed(_load, 2, str(tmp_path / "b"))


# Blocks of 96 KiB (rows of 256 float32, 96 per rank at 2 ranks): each a chunk of its
# own inside the pack, so a rank loading its block reads that member only.
BLOCKED = (192, 256)  # 192 KiB, under the default bound


def _blocked(rank: int, world: int, empty: bool = False) -> dict[str, ShardedTensor]:
    gen = torch.Generator().manual_seed(11)
    out = {}
    for key in ("a", "b"):
        block = torch.randn(*BLOCKED, generator=gen).chunk(world)[rank].clone()
        out[key] = ShardedTensor.from_rank_offsets(key, torch.empty_like(block) if empty else block, (0, rank, world))
    return out


def _save_blocked(rank: int, world: int, path: str) -> None:
    save(_blocked(rank, world), path)  # the default layout


def _load_blocked(rank: int, world: int, path: str) -> int:
    """Loads this rank's blocks bit-exact; the bytes this process read doing it."""
    with open("/proc/self/io") as f:
        before = next(int(line.split()[1]) for line in f if line.startswith("rchar:"))
    loaded = load(_blocked(rank, world, empty=True), path)
    with open("/proc/self/io") as f:
        read = next(int(line.split()[1]) for line in f if line.startswith("rchar:")) - before
    expected = _blocked(rank, world)
    assert [k for k, t in expected.items() if not torch.equal(loaded[k], t.data)] == []
    return read


def test_blocks_of_a_packed_split_array_stay_chunks_a_load_reads_alone(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    run_distributed(_save_blocked, 2, path)
    record = read_commit_record(open_location(path))
    for key in ("a", "b"):
        array = record.arrays[key]
        assert array.pack is not None and array.chunk_shape == (96, 256), (key, array.chunk_shape)
        assert not (Path(path) / key).exists()
    assert verify(path).ok
    block_bytes = 96 * 256 * 4
    reads = run_distributed(_load_blocked, 2, path)
    # each rank reads its two blocks (and the record), not the whole arrays
    assert all(2 * block_bytes <= read < 3 * block_bytes for read in reads), reads
    run_distributed(_load_blocked, 3, path)
    _load_blocked(0, 1, path)
    with zarr.storage.ZipStore(Path(path) / record.arrays["a"].pack, mode="r") as store:
        got = zarr.open_group(store, mode="r")["a"][...]
    gen = torch.Generator().manual_seed(11)
    np.testing.assert_array_equal(got, torch.randn(*BLOCKED, generator=gen).numpy())


def _blocked4(rank: int, world: int) -> dict[str, ShardedTensor]:
    gen = torch.Generator().manual_seed(12)
    return {key: ShardedTensor.from_rank_offsets(key, torch.randn(*BLOCKED, generator=gen).chunk(world)[rank].clone(),
                                                 (0, rank, world)) for key in "abcd"}


def _save_blocked4(rank: int, world: int, path: str) -> None:
    save(_blocked4(rank, world), path)


def test_a_pack_lays_each_ranks_blocks_side_by_side(tmp_path: Path) -> None:
    """Every array's first block, then every array's second: the blocks a rank loads
    again are one run of each pack, read with one ranged read (``format.packs.pack_runs``)
    however many arrays the pack holds."""
    import zipfile

    from shardstore.format.packs import pack_runs

    path = str(tmp_path / "ckpt")
    run_distributed(_save_blocked4, 2, path)
    record = read_commit_record(open_location(path))
    packs: dict[str, list[str]] = {}
    for key in "abcd":
        packs.setdefault(record.arrays[key].pack, []).append(key)
    assert sorted(map(len, packs.values())) == [2, 2], packs  # two writers, two arrays each
    stored = 96 * 256 * 4 + 4
    for pack, keys in packs.items():
        with zipfile.ZipFile(Path(path) / pack) as zip_:
            chunks = [i.filename for i in sorted(zip_.infolist(), key=lambda i: i.header_offset)
                      if not i.filename.endswith("zarr.json")]
        assert chunks == [f"{k}/c.{block}.0" for block in (0, 1) for k in keys], chunks
        for block in (0, 1):
            spans = [(record.arrays[key].chunk_offsets[block], stored) for key in keys]
            assert len(pack_runs(spans)) == 1, spans
