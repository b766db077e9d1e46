"""Reads at the layout's grain (issue 65.7): with the default layout, blocks split along
their first axis are stored as one shard per chunk, written by the block's holder, whose
inner chunks cut the rows, so a 2 -> 4 rank load reads at most 1.25x what it loads (2x
with whole chunks); loads are bit-exact at 4, 3 and 1 ranks, plain readers read it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import shardstore
from shardstore import ShardedTensor, StorageLayout, load, save
from shardstore.format.storage_layout import DEFAULT_READ_GRAIN, LayoutSite
from tests.dist import run_distributed
from tests.test_sharded_arrays import _count_chunk_reads

SHAPES = {  # rows divide by 2, 3 and 4; blocks at 2 ranks of 4.1 MiB, 8 MiB and 6 layers of 1 MiB
    "w": ((768, 2816), torch.float32),
    "emb": ((1020, 8192), torch.bfloat16),
    "stack": ((12, 64, 4096), torch.float32),
}


def _full(key: str) -> torch.Tensor:
    shape, dtype = SHAPES[key]
    gen = torch.Generator().manual_seed(len(key))
    return torch.randint(0, 256, (int(np.prod(shape)) * dtype.itemsize,), dtype=torch.uint8, generator=gen).view(
        dtype).reshape(shape)


def _state(rank: int, world: int, empty: bool = False) -> dict[str, ShardedTensor]:
    out = {}
    for key in SHAPES:
        block = _full(key).chunk(world, 0)[rank].clone()
        out[key] = ShardedTensor.from_rank_offsets(key, torch.empty_like(block) if empty else block, (0, rank, world))
    return out


def saved(rank: int, world: int, ckpt: str, layout: StorageLayout) -> None:
    save(_state(rank, world), ckpt, layout=layout)


def loaded_counting_bytes(rank: int, world: int, ckpt: str) -> tuple[int, int]:
    """Loads part ``rank`` of ``world`` bit-exact; returns the bytes its chunk reads
    returned (indexes included) and the bytes it loaded."""
    read = _count_chunk_reads()
    loaded = load(_state(rank, world, empty=True), ckpt)
    for key in SHAPES:
        want = _full(key).chunk(world, 0)[rank]
        assert torch.equal(loaded[key].view(torch.uint8), want.view(torch.uint8)), (rank, key)
    return read[0], sum(v.nbytes for v in loaded.values())


@pytest.fixture(scope="module")
def default(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ckpt = tmp_path_factory.mktemp("grain") / "ckpt"
    run_distributed(saved, 2, str(ckpt), StorageLayout())
    return ckpt


@pytest.mark.parametrize("site", [LayoutSite(world_size=2), LayoutSite(world_size=64, object_store=True),
                                  LayoutSite(world_size=2, can_exchange=False)])
def test_the_default_read_grain_is_1_mib_and_checked(site: LayoutSite) -> None:
    assert StorageLayout().chosen_for(site).read_grain == DEFAULT_READ_GRAIN == 1 << 20
    assert StorageLayout(read_grain=None).chosen_for(LayoutSite()).read_grain is None
    with pytest.raises(ValueError, match="read_grain"):
        StorageLayout(read_grain=0)


def test_each_block_is_one_shard_whose_inner_chunks_cut_its_rows(default: Path) -> None:
    for key, inner in (("w", [96, 2816]), ("emb", [85, 8192]), ("stack", [1, 64, 4096])):
        assert sorted(os.listdir(default / key)) == [f"c.{i}{'.0' * (len(SHAPES[key][0]) - 1)}" for i in (0, 1)] + [
            "zarr.json"], key  # one file per block, as with whole chunks
        codec = json.loads((default / key / "zarr.json").read_text())["codecs"][0]
        assert (codec["name"], codec["configuration"]["chunk_shape"]) == ("sharding_indexed", inner), key
    assert shardstore.verify(default).ok


@pytest.mark.parametrize("world, bound", [(4, 1.25), (3, 1.5), (1, 1.01)])
def test_a_load_at_another_world_size_reads_near_what_it_loads(default: Path, world: int, bound: float) -> None:
    """The 4-rank edges fall on the inner chunks (1.0x and the shards' indexes); the
    3-rank ones fall inside those of ``w`` (4 a block): an inner chunk more per end."""
    for read, needed in run_distributed(loaded_counting_bytes, world, str(default), timeout=240):
        assert needed <= read <= bound * needed, (world, read, needed)


def test_whole_chunks_read_twice_what_a_4_rank_load_needs(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run_distributed(saved, 2, str(ckpt), StorageLayout(read_grain=None))
    for read, needed in run_distributed(loaded_counting_bytes, 4, str(ckpt), timeout=240):
        assert read >= 1.9 * needed, (read, needed)


def test_plain_zarr_and_tensorstore_read_it(default: Path) -> None:
    import tensorstore as ts
    import zarr

    for key in ("w", "stack"):  # float32: zarr-python has no bfloat16
        full = _full(key).numpy().view(np.uint32)  # random bits, NaNs included
        assert np.array_equal(zarr.open_array(str(default / key), mode="r")[:].view(np.uint32), full), key
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(default / key)}}
        part = ts.open(spec).result()[3:9].read().result()  # a few rows, across the blocks' edge for "stack"
        assert np.array_equal(part.view(np.uint32), full[3:9]), key
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(default / "emb")}}
    assert np.array_equal(ts.open(spec).result().read().result().view(np.uint16),
                          _full("emb").view(torch.int16).numpy().view(np.uint16))
