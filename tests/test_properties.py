"""Property tests (issue 7, point 7): random global shapes, sharding grids, replicas and
flattened ranges round-trip bit-exact through a 2-rank save and a resharded load.

Hypothesis draws the layout in the test process; the save (2 ranks) and the loads
(1 rank, then 2 ranks on a different grid) run on real gloo ranks. Each example costs
a few seconds, so the default run tries a handful; SHARDSTORE_SLOW=1 tries more.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardstore import ShardedTensor, load, save
from shardstore.strategies.zarr import ZarrSaveShardedStrategy
from tests.dist import run_distributed
from tests.scenarios import assert_bits_equal, global_tensor, grid_shard

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool, torch.float8_e4m3fn]
EXAMPLES = 25 if os.environ.get("SHARDSTORE_SLOW") == "1" else 6


@dataclass(frozen=True)
class Spec:
    """One tensor of the random layout."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    save_axes: tuple[int, ...]  # grid over 2 ranks (empty: replicated on both)
    load_axes: tuple[int, ...]
    flat_cut: float | None  # the save uses 2 flat ranges of the whole tensor, cut here


@st.composite
def specs(draw) -> list[Spec]:
    out = []
    for i in range(draw(st.integers(1, 3))):
        ndim = draw(st.integers(1, 3))
        shape = tuple(draw(st.sampled_from([2, 4, 6, 8])) for _ in range(ndim))
        dtype = draw(st.sampled_from(DTYPES))
        flat = draw(st.none() | st.floats(0.0, 1.0))
        axes = () if flat is not None else tuple(draw(st.sets(st.integers(0, ndim - 1), max_size=1)))
        load_axes = tuple(draw(st.sets(st.integers(0, ndim - 1), max_size=1)))
        out.append(Spec(f"t{i}/x", shape, dtype, axes, load_axes, flat))
    return out


def _shard(spec: Spec, rank: int, world: int, for_save: bool, empty: bool) -> ShardedTensor:
    full = global_tensor(spec.key, spec.shape, spec.dtype)
    if for_save and spec.flat_cut is not None:
        n = full.numel()
        cut = int(spec.flat_cut * n)
        start, stop = (0, cut) if rank == 0 else (cut, n)
        data = full.flatten()[start:stop].clone()
        return ShardedTensor.from_rank_offsets_flat(
            spec.key, torch.empty_like(data) if empty else data, spec.shape, flattened_range=slice(start, stop)
        )
    axes = spec.save_axes if for_save else spec.load_axes
    if not axes:  # replicated: every rank holds it all
        data = torch.empty_like(full) if empty else full.clone()
        return ShardedTensor.from_rank_offsets(spec.key, data, replica_id=rank)
    return grid_shard(spec.key, full, rank, world, axes, empty=empty)


def save_specs(rank: int, world: int, ckpt: str, layout: list[Spec], chunk_bytes: int) -> None:
    sd = {s.key: _shard(s, rank, world, True, False) for s in layout}
    save(sd, ckpt, ZarrSaveShardedStrategy(max_chunk_bytes=chunk_bytes))


def load_specs(rank: int, world: int, ckpt: str, layout: list[Spec]) -> None:
    request = {s.key: _shard(s, rank, world, False, True) for s in layout}
    loaded = load(request, ckpt)
    for s in layout:
        expected = global_tensor(s.key, s.shape, s.dtype)[request[s.key].global_slice()]
        assert_bits_equal(loaded[s.key], expected.reshape(request[s.key].local_shape), f"{s} rank {rank}")


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(layout=specs(), chunk_items=st.sampled_from([1, 3, 16, 10**6]))
def test_random_layouts_round_trip_and_reshard(layout: list[Spec], chunk_items: int) -> None:
    itemsize = max(torch.empty((), dtype=s.dtype).element_size() for s in layout)
    chunk_bytes = max(1, min(chunk_items, max(math.prod(s.shape) for s in layout)) * itemsize)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        run_distributed(save_specs, 2, ckpt, layout, chunk_bytes)
        run_distributed(load_specs, 1, ckpt, layout)
        run_distributed(load_specs, 2, ckpt, layout)
