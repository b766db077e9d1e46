"""Tensors of 0 or 1 elements through the exchanges (a randomized reshard stress found
these): torch calls them contiguous whatever their strides (numpy's empty arrays have
stride 0; one element sliced from a column keeps the column's stride), but a byte view
of a wider dtype needs a last stride of 1, so sending or assembling them failed with
"self.stride(-1) must be 1 to view ... as Byte". Megatron meets the empty case: a
norm replicated over tensor-parallel ranks whose distributed-optimizer range is empty
on a data-parallel rank is asked for by every tensor-parallel rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import shardstore
from shardstore import ShardedTensor
from shardstore.strategies.zarr import ZarrLoadShardedStrategy, ZarrSaveShardedStrategy
from tests.dist import run_distributed


def _one_element(value: float) -> torch.Tensor:
    """A (1,) tensor of stride (17,), as one element sliced out of a column is (a clone
    keeps the stride)."""
    x = torch.zeros(3, 17)[:, 3:4].reshape(-1)[0:1].clone()
    x.fill_(value)
    assert x.is_contiguous() and x.stride() == (17,)
    return x


def _flat(key: str, lo: int, hi: int, dtype: torch.dtype, replica_id: int = 0) -> ShardedTensor:
    return ShardedTensor.from_rank_offsets_flat(key, torch.zeros(hi - lo, dtype=dtype), (8,),
                                                flattened_range=slice(lo, hi), replica_id=replica_id)


def loaded_empty_replicas(rank: int, world: int, ckpt: str, dtype: torch.dtype) -> dict[str, list]:
    request = {"all": _flat("w", 0, 8, dtype), "none": _flat("w", 0, 0, dtype)} if rank == 0 else {
        "none": _flat("w", 0, 0, dtype, replica_id=1)}
    return {k: v.tolist() for k, v in shardstore.load(request, ckpt).items()}


@pytest.mark.parametrize("shard_bytes", [None, 512], ids=["chunks", "sharded"])
def test_an_empty_range_asked_for_by_two_ranks_loads_empty(tmp_path: Path, shard_bytes: int | None) -> None:
    ckpt = str(tmp_path / "ckpt")
    values = torch.arange(8).to(torch.bfloat16)
    shardstore.save({"w": ShardedTensor.from_rank_offsets("w", values.clone())}, ckpt,
                    ZarrSaveShardedStrategy(shard_bytes=shard_bytes))
    got = run_distributed(loaded_empty_replicas, 2, ckpt, torch.bfloat16)
    assert got == [{"all": values.tolist(), "none": []}, {"none": []}]


def loaded_empty_cast(rank: int, world: int, ckpt: str) -> tuple[int, ...]:
    request = {"e": ShardedTensor.from_rank_offsets("e", torch.empty(0, dtype=torch.float32), replica_id=rank)}
    return tuple(shardstore.load(request, ckpt)["e"].shape)


def test_an_empty_tensor_cast_on_load_reaches_every_replica(tmp_path: Path) -> None:
    """Stored float16, asked for as float32 by both ranks (an exact cast): the read
    result is a new tensor, which goes to the other rank."""
    ckpt = str(tmp_path / "ckpt")
    shardstore.save({"e": ShardedTensor.from_rank_offsets("e", torch.empty(0, dtype=torch.float16))}, ckpt)
    assert run_distributed(loaded_empty_cast, 2, ckpt) == [(0,), (0,)]


def saved_one_strided_element(rank: int, world: int, ckpt: str, gathered: bool) -> None:
    if gathered:  # a (2,) array in blocks of 1, gathered into one shard
        data = torch.zeros(1) if rank == 0 else _one_element(1.0)
        state = {"w": ShardedTensor.from_rank_offsets("w", data, (0, rank, world))}
    else:  # elements [0, 7) and [7, 8): the one chunk straddles both ranks
        lo, hi = [(0, 7), (7, 8)][rank]
        data = torch.arange(7.0) if rank == 0 else _one_element(7.0)
        state = {"w": ShardedTensor.from_rank_offsets_flat("w", data, (8,), flattened_range=slice(lo, hi))}
    shardstore.save(state, ckpt, ZarrSaveShardedStrategy(shard_bytes=1024 if gathered else None))


@pytest.mark.parametrize("gathered", [False, True], ids=["straddling", "gathered"])
def test_a_strided_single_element_is_sent_to_its_chunk_writer(tmp_path: Path, gathered: bool) -> None:
    ckpt = str(tmp_path / "ckpt")
    run_distributed(saved_one_strided_element, 2, ckpt, gathered)
    want = torch.arange(2.0) if gathered else torch.arange(8.0)
    assert torch.equal(shardstore.load_plain_tensors(ckpt)["w"], want)
    assert shardstore.verify(ckpt).ok


def loaded_into_a_strided_element(rank: int, world: int, ckpt: str) -> list[float]:
    request = {"w": ShardedTensor.from_rank_offsets("w", _one_element(-1.0), replica_id=rank)}
    loaded = shardstore.load(request, ckpt, ZarrLoadShardedStrategy(fully_parallel=True))
    return loaded["w"].tolist()


def test_a_strided_single_element_buffer_is_filled_and_sent_to_a_replica(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    shardstore.save({"w": ShardedTensor.from_rank_offsets("w", torch.tensor([5.0]))}, ckpt)
    assert run_distributed(loaded_into_a_strided_element, 2, ckpt) == [[5.0], [5.0]]


def test_a_flattened_range_of_a_stacked_scalar_is_built_as_its_whole_form_is() -> None:
    """``from_rank_offsets_flat`` with ``non_flat_local_shape=()`` (a per-layer scalar
    stacked with ``prepend_axis_num=1``) raised a bare ``TypeError``."""
    whole = ShardedTensor.from_rank_offsets("s", torch.tensor(1.0), (0, 2, 4), prepend_axis_num=1)
    flat = ShardedTensor.from_rank_offsets_flat("s", torch.tensor([1.0]), (), (0, 2, 4), prepend_axis_num=1,
                                                flattened_range=slice(0, 1))
    assert (flat.local_shape, flat.global_shape, flat.global_offset) == (
        whole.local_shape, whole.global_shape, whole.global_offset)
    assert flat.flattened_range == slice(0, 1)


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_a_load_into_a_sparse_request_returns_its_dense_values(tmp_path: Path, layout: str) -> None:
    """A request whose tensor is sparse gets the stored values as a dense tensor (the
    array holds dense values; a sparse tensor cannot be filled in place). Before, a CSR
    request failed every load with torch's "Sparse CSR tensors do not have
    is_contiguous"."""
    stored = torch.arange(6.0).reshape(2, 3)
    shardstore.save({"w": ShardedTensor.from_rank_offsets("w", stored)}, tmp_path / "c")
    target = torch.zeros(2, 3).to_sparse() if layout == "coo" else torch.zeros(2, 3).to_sparse_csr()
    loaded = shardstore.load({"w": ShardedTensor.from_rank_offsets("w", target)}, tmp_path / "c")["w"]
    assert loaded.layout == torch.strided and torch.equal(loaded, stored)
