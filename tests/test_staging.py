"""Issue 15.2-15.4: host staging. Copies are held within a byte bound, in waves whose
writes overlap the copies of the next wave; pinned buffers are reused by exact size and
what a pool keeps is bounded. CUDA itself is exercised by tests/test_gpu.py; here the
same wave logic runs on the copies an async save makes of CPU tensors, and on CPU
targets routed through the path of a load into CUDA tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import shardstore.execution.load as load_execution
import shardstore.execution.save as save_execution
from shardstore import (
    CheckpointingException,
    ShardedTensor,
    ShardstoreWriter,
    StorageLayout,
    load,
    save,
)
from shardstore.execution.staging import DeviceUploader, HostBufferPool, HostSnapshot, _Marks
from shardstore.format.records import MAX_CHUNK_BYTES
from shardstore.planning.plans import SHARD_SLACK
from shardstore.strategies.async_utils import AsyncCallsQueue
from shardstore.strategies.zarr import ZarrLoadShardedStrategy, ZarrSaveShardedStrategy
from shardstore.tools.array_writer import CheckpointWriter

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


def test_a_pool_shared_by_a_staging_thread_and_a_finalizing_thread_stays_consistent() -> None:
    """An async save's finalization gives its pinned buffers back to the strategy's
    pool, and ``AsyncCallsQueue`` may finalize on another thread (``no_dist``) while the
    training thread stages the next save, which takes from the same pool. Before, the
    pool had no lock: a ``take`` racing a ``give_back`` that evicted the same buffer
    raised a bare ``KeyError``, and the bytes the pool counted drifted from the buffers
    it held (256 counted, 192 held)."""
    import sys
    import threading

    pool = HostBufferPool(max_free_bytes=4 * 64)
    like = torch.empty(16)  # 64 bytes
    in_use: set[int] = set()
    seen = threading.Lock()
    failures: list[str] = []

    def stage_and_finalize() -> None:
        try:
            for _ in range(5000):
                buffers = [pool.take(like) for _ in range(3)]
                with seen:
                    failures.extend("a buffer in use was handed out again" for b in buffers if id(b) in in_use)
                    in_use.update(id(b) for b in buffers)
                    in_use.difference_update(id(b) for b in buffers)
                pool.give_back(buffers)
        except Exception as exc:  # reported below, with the pool's state
            failures.append(repr(exc))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, as a busy trainer's would
    try:
        threads = [threading.Thread(target=stage_and_finalize) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    held = sum(b.nbytes for buffers in pool._free.values() for b in buffers)
    assert failures == [] and pool.free_bytes == held <= 4 * 64, (failures[:3], pool.free_bytes, held)


def _state(fill: float | None = None) -> dict:
    return {f"t{i}": ShardedTensor.from_rank_offsets(
        f"t{i}", torch.full((BLOCK // 4,), float(i) if fill is None else fill)) for i in range(12)}


def test_staged_copies_stay_within_the_bound_and_overlap_the_writes(tmp_path: Path, monkeypatch) -> None:
    """12 blocks, a bound of 4: copies and wave writes interleave, never more than 4
    blocks copied and unwritten, and a wave is written only after the next one's copies
    were issued (the overlap)."""
    events: list[tuple[str, int]] = []
    original_copy, original_write = HostSnapshot.copy, save_execution.write_ops

    def copy(self, tensor, key=None):
        events.append(("copy", tensor.nbytes))
        return original_copy(self, tensor, key)

    def write_ops(location, records, ops, *args, **kwargs):
        events.append(("write", sum(op.value.nbytes for op in ops)))
        return original_write(location, records, ops, *args, **kwargs)

    monkeypatch.setattr(HostSnapshot, "copy", copy)
    monkeypatch.setattr(save_execution, "write_ops", write_ops)
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
    monkeypatch.setattr(HostSnapshot, "copy", lambda self, t, key=None: copies.append(t) or t)
    strategy = ZarrSaveShardedStrategy(**({} if bound is None else {"sync_staging_bytes": bound}))
    save(_state(), tmp_path / "ckpt", strategy)
    assert copies == []


def _upload_state(fill: float | None = None) -> dict:
    """Tensors of several sizes and dtypes: 12 blocks, one of 5 blocks (larger than
    half the bound below), a bfloat16 one and a 0-d one."""
    state = _state(fill)
    big = torch.arange(5 * BLOCK // 4, dtype=torch.float32) if fill is None else torch.full((5 * BLOCK // 4,), fill)
    state["big"] = ShardedTensor.from_rank_offsets("big", big)
    half = torch.linspace(-3, 3, 1000).to(torch.bfloat16) if fill is None else torch.full((1000,), fill).bfloat16()
    state["half"] = ShardedTensor.from_rank_offsets("half", half)
    state["scalar"] = ShardedTensor.from_rank_offsets("scalar", torch.tensor(7.5 if fill is None else fill))
    return state


def test_loads_into_device_tensors_go_through_bounded_slabs_in_overlapping_waves(tmp_path: Path, monkeypatch) -> None:
    """Issue 15.4, the logic of a load into CUDA tensors, run here on CPU targets routed
    the same way: each wave is read into one of two slabs and copied out of it; a slab
    is reused only after waiting for the copies out of it, and the next wave is read
    before that wait (the overlap). Pinned bytes stay within the bound (a tensor larger
    than half of it gets its own buffer), and the request's own tensors are filled."""
    save(_upload_state(), tmp_path / "ckpt")
    events: list[tuple[str, int]] = []
    original_views, original_sync = DeviceUploader._views, _Marks.synchronize

    def views(self, slot, like, slab_bytes):
        hosts = original_views(self, slot, like, slab_bytes)
        events.append(("read", sum(t.nbytes for t in like)))
        return hosts

    def synchronize(self):
        events.append(("wait", 0))
        original_sync(self)

    monkeypatch.setattr(load_execution, "_through_host", lambda target: True)
    monkeypatch.setattr(DeviceUploader, "_views", views)
    monkeypatch.setattr(_Marks, "synchronize", synchronize)
    request = _upload_state(fill=0.0)
    loaded = load(request, tmp_path / "ckpt", ZarrLoadShardedStrategy(load_staging_bytes=4 * BLOCK))

    expected = _upload_state()
    for key, t in expected.items():
        assert torch.equal(loaded[key], t.data), key
        assert loaded[key] is request[key].data, f"{key}: not filled in place"
    reads = [n for kind, n in events if kind == "read"]
    assert len(reads) >= 6 and max(n for n in reads if n != 5 * BLOCK) <= 2 * BLOCK, reads
    first_wait = next(i for i, (kind, _) in enumerate(events) if kind == "wait")
    assert [kind for kind, _ in events[:first_wait]] == ["read", "read"], "two waves in flight before a wait"
    assert events[first_wait + 1][0] == "read", "a slab is reused right after its own copies landed"


def test_loads_into_device_parameters_fill_them_in_place(tmp_path: Path, monkeypatch) -> None:
    """A model's parameters require grad, and autograd refuses in-place copies into
    them: the slabs' copies go into the same memory, detached."""
    save(_upload_state(), tmp_path / "ckpt")
    monkeypatch.setattr(load_execution, "_through_host", lambda target: True)
    request = _upload_state(fill=0.0)
    for key in ("big", "t3"):
        request[key] = ShardedTensor.from_rank_offsets(key, torch.nn.Parameter(request[key].data))
    loaded = load(request, tmp_path / "ckpt", ZarrLoadShardedStrategy(load_staging_bytes=4 * BLOCK))
    for key, t in _upload_state().items():
        assert loaded[key] is request[key].data and torch.equal(loaded[key], t.data), key
    assert loaded["big"].requires_grad and isinstance(loaded["big"], torch.nn.Parameter)


def test_a_failed_read_into_device_tensors_names_the_chunk_and_frees_the_slabs(tmp_path: Path, monkeypatch) -> None:
    save(_upload_state(), tmp_path / "ckpt", layout=StorageLayout(pack_arrays_up_to=0))  # a chunk file to corrupt
    chunk = tmp_path / "ckpt" / "t7" / "c.0"
    chunk.write_bytes(b"\0" * chunk.stat().st_size)
    monkeypatch.setattr(load_execution, "_through_host", lambda target: True)
    strategy = ZarrLoadShardedStrategy(load_staging_bytes=4 * BLOCK)
    with pytest.raises(CheckpointingException, match=r"chunk c\.0 of array 't7'.*crc32c"):
        load(_upload_state(fill=0.0), tmp_path / "ckpt", strategy)
    assert strategy._uploader._slabs == [None, None]


def test_tensors_autograd_tracks_are_saved_from_their_values(tmp_path: Path) -> None:
    """A parameter that requires grad (and a view of one) is staged through a detached
    view; the others as they are: both round-trip bit-exact."""
    weight = torch.nn.Parameter(torch.randn(4, 3))
    state = {
        "weight": ShardedTensor.from_rank_offsets("weight", weight),
        "row": ShardedTensor.from_rank_offsets("row", weight[1]),
        "plain": ShardedTensor.from_rank_offsets("plain", torch.arange(5.0)),
    }
    save(state, tmp_path / "ckpt")
    empty = {k: ShardedTensor.from_rank_offsets(k, torch.empty_like(v.data.detach())) for k, v in state.items()}
    loaded = load(empty, tmp_path / "ckpt")
    assert all(torch.equal(loaded[k], state[k].data.detach()) for k in state)


@pytest.mark.parametrize("bound", [float("nan"), float("inf"), "64MiB", None, 0])
def test_a_max_chunk_bytes_that_is_no_number_of_bytes_is_refused(bound: object) -> None:
    """``max_chunk_bytes`` as the memory bounds are checked. Before, ``nan`` and ``inf``
    were taken (an 8x4 tensor saved as 32 one-element chunks under ``nan``), a string
    or None failed with a bare ``TypeError``."""
    with pytest.raises(ValueError, match="max_chunk_bytes must be a positive, finite number of bytes"):
        ZarrSaveShardedStrategy(max_chunk_bytes=bound)


_READABLE = MAX_CHUNK_BYTES  # the most data bytes of one chunk or shard that a reader accepts


@pytest.mark.parametrize(("make", "option", "most"), [
    (lambda n, where: ZarrSaveShardedStrategy(max_chunk_bytes=n), "max_chunk_bytes", _READABLE),
    (lambda n, where: ZarrSaveShardedStrategy(shard_bytes=n), "shard_bytes", int(_READABLE / SHARD_SLACK)),
    (lambda n, where: ShardstoreWriter(where, max_chunk_bytes=n), "max_chunk_bytes", _READABLE),
    (lambda n, where: ShardstoreWriter(where, shard_bytes=n), "shard_bytes", int(_READABLE / SHARD_SLACK)),
    (lambda n, where: CheckpointWriter(where, max_chunk_bytes=n), "max_chunk_bytes", _READABLE),
])
def test_a_chunk_or_shard_size_that_readers_refuse_is_refused_when_given(
    tmp_path: Path, make, option: str, most: int,
) -> None:
    """A reader refuses a chunk (or a shard: up to ``SHARD_SLACK`` times ``shard_bytes``)
    of more than ``MAX_CHUNK_BYTES`` of data as absurd. Before, a larger
    ``max_chunk_bytes`` or ``shard_bytes`` was taken: a save of a tensor that large
    committed a checkpoint whose every load failed ("absurd chunk shape")."""
    with pytest.raises(ValueError, match=f"{option}={most + 1} .* {_READABLE} bytes .* at most {most}"):
        make(most + 1, str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()
    accepted = make(most, str(tmp_path / "ckpt"))  # the largest a reader accepts
    if isinstance(accepted, CheckpointWriter):
        accepted.abandon()


@pytest.mark.parametrize("bound", [None, "1GiB", 0, -1, float("inf")])
def test_a_load_staging_bound_that_is_no_number_of_bytes_is_refused_when_the_strategy_is_made(
    tmp_path: Path, monkeypatch, bound: object,
) -> None:
    """``load_staging_bytes`` bounds the pinned memory of a load into device tensors. A
    value that is no positive number of bytes (None, which a save's
    ``max_staging_bytes`` takes as "no bound") is refused where it is given, naming
    the option, as a save's bounds are. Before, it was taken as it was and a load into
    device tensors failed in its reads with a bare ``TypeError`` (None, a string) or
    pinned memory without any bound (0, negative, infinite)."""
    with pytest.raises(ValueError, match="load_staging_bytes must be a positive, finite number of bytes"):
        ZarrLoadShardedStrategy(load_staging_bytes=bound)
