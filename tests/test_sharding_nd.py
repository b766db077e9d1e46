"""Shards of arrays split along several axes (issue 44.1): Megatron's layer-stacked
arrays, TP-split along axis 1 (a column-parallel bias ``[L, n]`` in blocks ``[1, n/TP]``)
or axis 2 (a row-parallel weight ``[L, out, in]`` in blocks ``[1, out, in/TP]``), are
stored in ``sharding_indexed`` shards that merge blocks along both axes; saves and loads
at 2 ranks, at another layout, uneven last blocks, plain zarr and TensorStore, verify,
and incremental reuse."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

import shardstore
from shardstore import ShardedTensor, StorageLayout, load, save
from shardstore.format.records import read_commit_record
from shardstore.format.sharding import ShardingIndexed
from shardstore.planning.layout import GatheredShards, ShardRecord
from shardstore.planning.plans import plan_save
from shardstore.stores.locations import open_location
from shardstore.strategies.zarr import ZarrSaveShardedStrategy
from tests.dist import run_distributed


@dataclass(frozen=True)
class Stacked:
    """A layer-stacked array: ``shape[0]`` layers, each cut along ``axis`` at multiples
    of ``block`` (the last cut shorter where it does not divide); TP block ``j`` of every
    layer is held by rank ``j % world``."""

    key: str
    shape: tuple[int, ...]
    axis: int
    block: int
    dtype: torch.dtype = torch.float32

    def full(self, version: int = 0) -> torch.Tensor:
        n = int(np.prod(self.shape))
        return (torch.arange(n, dtype=torch.float32).reshape(self.shape) * (3 + version) % 251).to(self.dtype)

    def cuts(self) -> list[tuple[int, int]]:
        return [(lo, min(lo + self.block, self.shape[self.axis])) for lo in range(0, self.shape[self.axis], self.block)]

    def state(self, rank: int, world: int, version: int = 0) -> dict[str, ShardedTensor]:
        full, cuts = self.full(version), self.cuts()
        out = {}
        for layer in range(self.shape[0]):
            for j, (lo, hi) in enumerate(cuts):
                if j % world != rank:
                    continue
                region = [slice(layer, layer + 1)] + [slice(None)] * (len(self.shape) - 1)
                region[self.axis] = slice(lo, hi)
                data = full[tuple(region)][0].clone()
                offset = [layer] + [0] * (len(self.shape) - 1)
                offset[self.axis] = lo
                out[f"{self.key}.{layer}.{j}"] = ShardedTensor(
                    self.key, data, self.dtype, tuple(data.shape), self.shape, tuple(offset),
                    (self.shape[0], *(len(cuts) if a == self.axis else 1 for a in range(1, len(self.shape)))),
                    prepend_axis_num=1)
        return out


ARRAYS = [
    Stacked("bias", (6, 40), 1, 10, torch.bfloat16),  # column-parallel bias, TP=4 over 2 ranks
    Stacked("row_w", (6, 8, 12), 2, 6),  # row-parallel weight, TP=2
    Stacked("uneven", (5, 10), 1, 4),  # blocks of 4, 4 and 2 columns
    Stacked("uneven_w", (5, 6, 10), 2, 4),  # blocks of 4, 4 and 2 along the last axis
]
SHARD_BYTES = 1 << 20  # every array fits one shard


def _state(rank: int, world: int, version: int = 0) -> dict:
    return {k: v for a in ARRAYS for k, v in a.state(rank, world, version).items()}


PER_ARRAY = StorageLayout(pack_arrays_up_to=0)  # the subject is each array's own shards


def _strategy(shard_bytes: int = SHARD_BYTES) -> ZarrSaveShardedStrategy:
    return ZarrSaveShardedStrategy(layout=PER_ARRAY, shard_bytes=shard_bytes)


def _loaded_at(rank: int, world: int, ckpt: str, version: int = 0) -> None:
    """Loads at another layout: rank r asks for part r of ``world`` along the last axis
    that ``world`` divides (across the saved blocks' boundaries), or for all of it."""
    requests, expected = {}, {}
    for a in ARRAYS:
        full = a.full(version)
        axis = next((x for x in reversed(range(len(a.shape))) if a.shape[x] % world == 0), None)
        part = full if axis is None else full.chunk(world, axis)[rank]
        offsets = () if axis is None else ((axis, rank, world),)
        requests[a.key] = ShardedTensor.from_rank_offsets(a.key, torch.zeros_like(part), *offsets,
                                                          replica_id=0 if offsets else rank)
        expected[a.key] = part
    loaded = load(requests, ckpt)
    for key, part in expected.items():
        assert torch.equal(loaded[key], part), key


def saved_and_loaded(rank: int, world: int, ckpt: str) -> None:
    save(_state(rank, world), ckpt, _strategy())
    empty = {k: ShardedTensor(**{**v.__dict__, "data": torch.zeros_like(v.data)}) for k, v in _state(rank, world).items()}
    loaded = load(empty, ckpt)
    for k, v in _state(rank, world).items():
        assert torch.equal(loaded[k], v.data), k
    _loaded_at(rank, world, ckpt)


def _chunk_files(ckpt: Path, key: str) -> list[str]:
    return sorted(name for name in os.listdir(ckpt / key) if name != "zarr.json")


def test_tp_split_layer_stacks_are_one_shard_each_that_every_reader_reads(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run_distributed(saved_and_loaded, 2, str(ckpt))
    for a in ARRAYS:
        assert _chunk_files(ckpt, a.key) == [".".join(["c"] + ["0"] * len(a.shape))], a.key
        meta = json.loads((ckpt / a.key / "zarr.json").read_text())
        assert meta["codecs"][0]["name"] == "sharding_indexed"
        inner = meta["codecs"][0]["configuration"]["chunk_shape"]
        assert inner[0] == 1 and inner[a.axis] == a.block  # one layer, one TP block
    assert json.loads((ckpt / "zarr.json").read_text())["attributes"]["shardstore"]["requires"] == ["sharding_indexed"]
    import tensorstore as ts
    import zarr

    for a in ARRAYS:
        expected = a.full().view(torch.int16).numpy() if a.dtype == torch.bfloat16 else a.full().numpy()
        by_ts = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(ckpt / a.key)}}).result()
        got = by_ts.read().result()
        assert np.array_equal(got.view(np.int16) if a.dtype == torch.bfloat16 else got, expected), a.key
        if a.dtype != torch.bfloat16:  # plain zarr-python has no bfloat16 (tests/test_plain_readers.py)
            assert np.array_equal(zarr.open_array(str(ckpt / a.key), mode="r")[:], expected), a.key
    assert shardstore.verify(ckpt).ok


def loaded_at_one_rank(rank: int, world: int, ckpt: str) -> None:
    _loaded_at(rank, world, ckpt)


def bias_saved(rank: int, world: int, path: str) -> None:
    bias = ARRAYS[0]
    save(bias.state(rank, world), path, _strategy(12 * bias.block * 2))


def test_several_shards_per_array_merge_along_layers_then_tp(tmp_path: Path) -> None:
    """Shards of 12 inner chunks: all 6 layers, then 2 of the 4 TP blocks (2 shards,
    each gathered from both ranks)."""
    ckpt = tmp_path / "ckpt"
    bias = ARRAYS[0]
    run_distributed(bias_saved, 2, str(ckpt))
    assert _chunk_files(ckpt, "bias") == ["c.0.0", "c.0.1"]
    meta = json.loads((ckpt / "bias" / "zarr.json").read_text())
    assert meta["chunk_grid"]["configuration"]["chunk_shape"] == [6, 20]
    requests = {"bias": ShardedTensor.from_rank_offsets("bias", torch.zeros(bias.shape, dtype=bias.dtype))}
    assert torch.equal(load(requests, ckpt)["bias"], bias.full())
    assert shardstore.verify(ckpt).ok


def test_a_load_at_three_ranks_reads_across_blocks(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run_distributed(saved_and_loaded, 2, str(ckpt))
    run_distributed(loaded_at_one_rank, 3, str(ckpt))


def saved_then_reused(rank: int, world: int, root: str) -> None:
    save(_state(rank, world), f"{root}/1", _strategy())
    state = _state(rank, world)
    for v in state.values():  # one array changes
        if v.key == "row_w":
            v.data.add_(1)
    save(state, f"{root}/2", _strategy(), reuse_from=f"{root}/1")
    loaded = load({k: ShardedTensor(**{**v.__dict__, "data": torch.zeros_like(v.data)}) for k, v in state.items()},
                  f"{root}/2")
    for k, v in state.items():
        assert torch.equal(loaded[k], v.data), k


def test_an_incremental_save_shares_unchanged_nd_shards(tmp_path: Path) -> None:
    run_distributed(saved_then_reused, 2, str(tmp_path))
    record = read_commit_record(open_location(tmp_path / "2"))
    assert record.reused_from is not None and record.reused_from.chunks == len(ARRAYS) - 1
    for a in ARRAYS:
        name = ".".join(["c"] + ["0"] * len(a.shape))
        same = os.stat(tmp_path / "1" / a.key / name).st_ino == os.stat(tmp_path / "2" / a.key / name).st_ino
        assert same == (a.key != "row_w"), a.key
    assert shardstore.verify(tmp_path / "2").ok


def _records(world: int, arrays: list[Stacked]) -> GatheredShards:
    gathered = []
    for rank in range(world):
        tensors = [t for a in arrays for t in a.state(rank, world).values()]
        gathered.append(([ShardRecord.from_sharded_tensor(t, rank, i) for i, t in enumerate(tensors)], []))
    return GatheredShards.from_gathered(gathered)


def test_the_plan_sends_each_block_as_one_piece_and_balances_writers() -> None:
    bias = Stacked("bias", (8, 64), 1, 8)  # TP=8 over 4 ranks, 8 layers
    plans = plan_save(_records(4, [bias]), 1 << 30, True, 1 << 20)
    record = plans[0].commit.arrays["bias"]
    assert record.chunk_shape == (8, 64) and record.codec == ShardingIndexed((1, 8), 4)
    (chunk,) = [c for p in plans for _, c in p.straddling if c.writer == p.rank]
    assert len(chunk.pieces) == 64  # one per block: inner chunk = block
    assert sorted(p[4] for p in chunk.pieces) == list(range(0, 512, 8))  # packed, inner-chunk-major


def _cut_layout(cuts_per_layer: list[list[int]]) -> GatheredShards:
    """Layers of a ``[layers, 10, 12]`` weight cut along its last axis at ``cuts``
    (per layer), block ``j`` of a layer held by rank ``j % 2``."""
    shape = (len(cuts_per_layer), 10, 12)
    gathered: list[tuple[list[ShardRecord], list]] = [([], []), ([], [])]
    for layer, cuts in enumerate(cuts_per_layer):
        for j, (lo, hi) in enumerate(zip(cuts, [*cuts[1:], 12])):
            records = gathered[j % 2][0]
            t = ShardedTensor("w", torch.zeros(10, hi - lo), torch.float32, (10, hi - lo), shape, (layer, 0, lo), None,
                              prepend_axis_num=1)
            records.append(ShardRecord.from_sharded_tensor(t, j % 2, len(records)))
    return GatheredShards.from_gathered(gathered)


@pytest.mark.parametrize(("cuts", "sharded"), [
    ([[0, 6], [0, 6]], True),  # even TP blocks
    ([[0, 4], [0, 4]], False),  # blocks of 4 and 8: chunks of 4 columns, not contiguous in a block of 8
    ([[0, 6], [0, 4]], False),  # layers cut at different columns: no grid
])
def test_only_blocks_on_a_grid_of_contiguous_chunks_are_sharded(cuts: list[list[int]], sharded: bool) -> None:
    record = plan_save(_cut_layout(cuts), 1 << 30, True, 1 << 20)[0].commit.arrays["w"]
    assert isinstance(record.codec, ShardingIndexed) == sharded


def test_on_s3_nd_shards_save_load_at_another_layout_and_verify(moto_server) -> None:
    """The same arrays from one process to the local S3 server: one object per shard
    (TensorStore's kvstore writes it), read back by ranged or whole requests."""
    from shardstore.stores.s3 import S3Options
    from tests.s3_support import KEY, REGION, SECRET

    moto_server.create_bucket("nd-sharded")
    options = S3Options(endpoint_url=moto_server.endpoint, key=KEY, secret=SECRET, region=REGION)
    target = open_location("s3://nd-sharded/ckpt", options=options)
    save(_state(0, 1), target, _strategy())
    data = sorted(n for n in target.list_files() if not n.endswith("zarr.json") and "/" in n)
    assert data == [f"{a.key}/" + ".".join(["c"] + ["0"] * len(a.shape)) for a in sorted(ARRAYS, key=lambda a: a.key)]
    requests = {}
    for a in ARRAYS:  # the last axis in halves, across the saved blocks' boundaries
        for i, half in enumerate(a.full().chunk(2, -1)):
            requests[f"{a.key}.{i}"] = ShardedTensor.from_rank_offsets(
                a.key, torch.zeros_like(half), (len(a.shape) - 1, i, 2))
    loaded = load(requests, target)
    for a in ARRAYS:
        for i, half in enumerate(a.full().chunk(2, -1)):
            assert torch.equal(loaded[f"{a.key}.{i}"], half), a.key
    assert shardstore.verify(target).ok
