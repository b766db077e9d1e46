"""A tensor's bytes changed while a save reads them, in a way PyTorch's version counter
does not see (a write through ``tensor.data``, a NumPy view, a raw pointer): before, a
checkpoint whose chunk 0 held the values from before the write and chunk 1 those from
after loaded and verified. The save now compares the source's bytes once it reads them
no more with what it wrote (``execution.changes``) and fails, committing nothing."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from shardstore import CheckpointingException, ShardedTensor, StorageLayout, load, save, verify
from shardstore.execution import changes, staging
from shardstore.format import chunks, is_committed
from shardstore.format.dtypes import byte_view
from shardstore.stores.locations import open_location
from shardstore.strategies.zarr import ZarrSaveShardedStrategy
from tests.dist import run_distributed

# 16 KiB of float32 in chunks of 4 KiB: four chunks of one tensor.
_CHUNK_BYTES = 4096
_N = 4096


def _state(w: torch.Tensor) -> dict:
    return {"w": ShardedTensor.from_rank_offsets("w", w)}


def _written_then(monkeypatch, change) -> None:
    """``change()`` runs once the first chunk is written, while the others are written:
    a write the version counter does not count."""
    real = chunks.ChunkFile.write
    done = threading.Lock()

    def write(self, data, digest=None):
        sums = real(self, data, digest)
        if done.acquire(blocking=False):
            change()
        return sums

    monkeypatch.setattr(chunks.ChunkFile, "write", write)


def _strategy() -> ZarrSaveShardedStrategy:
    return ZarrSaveShardedStrategy(max_chunk_bytes=_CHUNK_BYTES)


@pytest.mark.parametrize("how", ["numpy", "data"])
def test_a_sync_save_fails_where_a_tensor_changed_unseen_by_its_counter_during_its_writes(
    tmp_path: Path, monkeypatch, how: str,
) -> None:
    w = torch.arange(float(_N))

    def change() -> None:
        if how == "numpy":
            w.numpy()[:] += 1  # NumPy's view: no counter moves
        else:
            w.data.add_(1)  # ``.data`` keeps a counter of its own

    _written_then(monkeypatch, change)
    ckpt = tmp_path / "ckpt"
    with pytest.raises(CheckpointingException, match=r"tensor 'w' changed while the save read it.*Nothing was committed"):
        save(_state(w), str(ckpt), _strategy())
    assert not is_committed(open_location(ckpt))
    monkeypatch.undo()
    save(_state(w), str(ckpt), _strategy())  # unchanged now: saved and loaded bit-exact
    assert torch.equal(load(_state(torch.empty(_N)), str(ckpt))["w"], w) and verify(ckpt).ok


def _changed_once_copied(monkeypatch, source: torch.Tensor) -> None:
    """``source`` changes through NumPy once its host copy is made, before the save
    compares them: the copy is of another state than the source's."""
    real = staging.HostSnapshot.copy

    def copy(self, tensor, *args, **kwargs):
        out = real(self, tensor, *args, **kwargs)
        if tensor.data_ptr() == source.data_ptr():
            source.numpy()[..., :5] = -1
        return out

    monkeypatch.setattr(staging.HostSnapshot, "copy", copy)


def test_an_async_save_fails_where_a_tensor_changed_once_copied(tmp_path: Path, monkeypatch) -> None:
    """An async save writes its host copies: the source is compared with its copy once
    the copies landed, before ``save`` returns (which raises, on every rank)."""
    w, b = torch.arange(float(_N)), torch.ones(16)
    _changed_once_copied(monkeypatch, w)
    state = _state(w) | {"b": ShardedTensor.from_rank_offsets("b", b)}
    with pytest.raises(CheckpointingException, match=r"tensor 'w' changed while the save read it"):
        save(state, str(tmp_path / "ckpt"), _strategy(), async_sharded_save=True)  # its staging stage fails
    assert not (tmp_path / "ckpt").exists()


def test_a_sync_save_fails_where_a_tensor_it_copies_changed_once_copied(tmp_path: Path, monkeypatch) -> None:
    """The path of CUDA tensors, run on CPU: a sync save copies a tensor whose memory
    does not hold its values in order (columns of a matrix), and writes the copy."""
    matrix = torch.arange(float(2 * _N)).reshape(2, _N)
    _changed_once_copied(monkeypatch, matrix)
    columns = matrix[:, : _N // 2]
    with pytest.raises(CheckpointingException, match=r"tensor 'w' changed while the save read it"):
        save({"w": ShardedTensor.from_rank_offsets("w", columns)}, str(tmp_path / "ckpt"), _strategy())
    assert not is_committed(open_location(tmp_path / "ckpt"))


def test_an_unchanged_save_of_every_path_passes_the_check(tmp_path: Path) -> None:
    """NaNs of any payload, non-contiguous tensors and edge chunks compare bit for bit."""
    w = torch.full((_N + 3,), float("nan"))
    w.view(torch.int32)[::2] = 0x7FC00001  # another NaN payload
    columns = torch.arange(float(4 * 1000)).reshape(4, 1000)[:, :999]
    state = {"w": ShardedTensor.from_rank_offsets("w", w), "c": ShardedTensor.from_rank_offsets("c", columns)}
    save(state, str(tmp_path / "sync"), _strategy())
    save(state, str(tmp_path / "async"), _strategy(), async_sharded_save=True).execute_sync()
    for name in ("sync", "async"):
        loaded = load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(_N + 3)),
                       "c": ShardedTensor.from_rank_offsets("c", torch.empty(4, 999))}, str(tmp_path / name))
        assert np.array_equal(loaded["w"].view(torch.int32).numpy(), w.view(torch.int32).numpy())
        assert torch.equal(loaded["c"], columns)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.complex128, torch.int8])
def test_a_copy_is_compared_bit_for_bit_on_the_host_and_on_a_device(monkeypatch, dtype: torch.dtype) -> None:
    """The comparison a CUDA tensor's copy gets (``same_on_device``), run on the CPU in
    pieces of a few rows, and the host one: NaN payloads compare by their bits."""
    monkeypatch.setattr(changes, "_COMPARED_BYTES", 64)
    source = torch.arange(600).reshape(20, 30).to(dtype)
    if dtype.is_floating_point:
        source[3, 4] = float("nan")
    columns = source[:, 3:25]  # strided, as a CUDA tensor's slice may be
    for compared in (source, columns, source[0, 0]):
        copy = compared.clone()
        assert changes.same_bytes(compared, copy) and changes.same_on_device(compared, copy)
        byte_view(copy)[-1] ^= 1  # one bit of its last element
        assert not changes.same_bytes(compared, copy) and not changes.same_on_device(compared, copy)


def changed_through_numpy_on_one_rank(rank: int, world: int, root: str) -> str:
    import pytest as _pytest

    from shardstore.format import chunks as _chunks

    w = torch.arange(float(_N)) + rank * _N
    if rank == 1:
        real = _chunks.ChunkFile.write

        def write(self, data, digest=None):
            sums = real(self, data, digest)
            w.numpy()[:] += 1
            return sums

        _chunks.ChunkFile.write = write
    state = {"w": ShardedTensor.from_rank_offsets("w", w, (0, rank, world))}
    # the change is injected into a chunk file's write: the array keeps files of its own
    per_array = ZarrSaveShardedStrategy(layout=StorageLayout(max_chunk_bytes=_CHUNK_BYTES, pack_arrays_up_to=0))
    with _pytest.raises(CheckpointingException) as raised:
        save(state, f"{root}/ckpt", per_array)
    return str(raised.value)


def test_a_change_through_numpy_on_one_rank_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    messages = run_distributed(changed_through_numpy_on_one_rank, 2, str(tmp_path))
    assert all("tensor 'w' changed while the save read it" in m for m in messages), messages
    assert not (tmp_path / "ckpt").exists()
