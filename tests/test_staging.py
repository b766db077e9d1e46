"""Issue 15.2/15.3: host staging. Copies are held within a byte bound, in waves whose
writes overlap the copies of the next wave; pinned buffers are reused by exact size and
what a pool keeps is bounded. CUDA itself is exercised by tests/test_gpu.py; here the
same wave logic runs on the copies an async save makes of CPU tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import shardstore.strategies.zarr as zarr_strategy
from shardstore import ShardedTensor, load, save
from shardstore.staging import HostBufferPool, HostSnapshot
from shardstore.strategies.async_utils import AsyncCallsQueue
from shardstore.strategies.zarr import ZarrSaveShardedStrategy

BLOCK = 64 * 1024  # bytes of each of the 12 tensors below


def test_a_pool_reuses_buffers_by_exact_shape_and_bounds_what_it_keeps() -> None:
    pool = HostBufferPool(max_free_bytes=3 * 4096)
    like = torch.empty(1024)  # 4 KiB of float32
    buffers = [pool.take(like) for _ in range(4)]
    pool.give_back(buffers)
    assert pool.free_bytes == 3 * 4096, "the oldest buffer beyond the bound is freed"
    again = pool.take(like)
    assert any(again is b for b in buffers[1:]), "a returned buffer of that exact shape is reused"
    assert pool.take(torch.empty(1025)).shape == (1025,), "no rounding up: another shape is a new buffer"
    pool.clear()
    assert pool.free_bytes == 0


def _state(fill: float | None = None) -> dict:
    return {f"t{i}": ShardedTensor.from_rank_offsets(
        f"t{i}", torch.full((BLOCK // 4,), float(i) if fill is None else fill)) for i in range(12)}


def test_staged_copies_stay_within_the_bound_and_overlap_the_writes(tmp_path: Path, monkeypatch) -> None:
    """12 blocks, a bound of 4: copies and wave writes interleave, never more than 4
    blocks copied and unwritten, and a wave is written only after the next one's copies
    were issued (the overlap)."""
    events: list[tuple[str, int]] = []
    original_copy, original_write = HostSnapshot.copy, zarr_strategy.write_ops

    def copy(self, tensor):
        events.append(("copy", tensor.nbytes))
        return original_copy(self, tensor)

    def write_ops(location, records, ops, *args, **kwargs):
        events.append(("write", sum(op.value.nbytes for op in ops)))
        return original_write(location, records, ops, *args, **kwargs)

    monkeypatch.setattr(HostSnapshot, "copy", copy)
    monkeypatch.setattr(zarr_strategy, "write_ops", write_ops)
    queue = AsyncCallsQueue()
    state = _state()
    queue.schedule_async_request(save(state, tmp_path / "ckpt", ZarrSaveShardedStrategy(max_staging_bytes=4 * BLOCK),
                                      async_sharded_save=True))
    staged_events = list(events)  # what happened before save returned
    for t in state.values():
        t.data.fill_(-1)
    queue.close()

    outstanding, peak, writes_in_save = 0, 0, 0
    for kind, nbytes in staged_events:
        outstanding += nbytes if kind == "copy" else -nbytes
        peak = max(peak, outstanding)
        if kind == "write":
            writes_in_save += 1
            assert outstanding > 0, "a wave was written with no other copies in flight: no overlap"
    assert peak <= 4 * BLOCK, f"{peak} bytes held, bound {4 * BLOCK}"
    assert writes_in_save >= 4, staged_events
    loaded = load(_state(fill=0.0), tmp_path / "ckpt")
    assert all(torch.equal(loaded[f"t{i}"], torch.full((BLOCK // 4,), float(i))) for i in range(12))


@pytest.mark.parametrize("bound", [None, 2 * BLOCK])
def test_a_sync_save_of_cpu_tensors_copies_nothing(tmp_path: Path, monkeypatch, bound: int | None) -> None:
    """CPU tensors are written from their own memory by a sync save, whatever the
    bound (which is for CUDA tensors)."""
    copies = []
    monkeypatch.setattr(HostSnapshot, "copy", lambda self, t: copies.append(t) or t)
    strategy = ZarrSaveShardedStrategy(**({} if bound is None else {"sync_staging_bytes": bound}))
    save(_state(), tmp_path / "ckpt", strategy)
    assert copies == []
