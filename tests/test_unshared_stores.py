"""Stores that processes do not share, and concurrent saves into them (issue 34.4).

``memory://`` lives inside one process: a save by several ranks is refused before it
writes anything (each rank would have written into its own copy, and rank 0 committed a
checkpoint without the other ranks' chunks). Threads of one process that save into one
prefix at once leave a loadable checkpoint or a clear error, never a save that reported
success and cannot be loaded.
"""

from __future__ import annotations

import threading
import uuid

import pytest
import torch

from shardstore import CheckpointingException, ShardedTensor, load, save, verify
from shardstore.format.commit import check_shared
from shardstore.stores.locations import open_location
from shardstore.strategies.zarr import ZarrSaveShardedStrategy
from tests.dist import run_distributed


def _state(fill: float, rank: int = 0, world: int = 1) -> dict:
    rows = 8 // world
    return {"w": ShardedTensor.from_rank_offsets("w", torch.full((rows, 256), fill), (0, rank, world))}


def _save_to_memory_on_every_rank(rank: int, world: int, url: str) -> tuple[str, bool]:
    try:
        save(_state(1.0, rank, world), url)
    except CheckpointingException as exc:
        return str(exc), open_location(url).is_empty()
    return "", open_location(url).is_empty()


def test_a_multi_rank_save_to_memory_is_refused_before_it_writes() -> None:
    url = f"memory://unshared/{uuid.uuid4().hex}"
    outcomes = run_distributed(_save_to_memory_on_every_rank, 2, url)
    for message, empty in outcomes:
        assert url in message and "2 ranks" in message and "s3://" in message, message
        assert empty  # nothing was written, on any rank


def _dcp_save_to_memory_on_every_rank(rank: int, world: int, url: str) -> tuple[str, bool]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from shardstore import ShardstoreWriter

    try:
        dcp.save({"w": torch.full((64, 64), float(rank))}, storage_writer=ShardstoreWriter(url))
    except CheckpointException as exc:  # DCP's wrapper of every rank's failure (a BaseException)
        return str(exc), open_location(url).is_empty()
    return "", open_location(url).is_empty()


def test_a_multi_rank_dcp_save_to_memory_is_refused_before_it_writes() -> None:
    url = f"memory://unshared/{uuid.uuid4().hex}"
    outcomes = run_distributed(_dcp_save_to_memory_on_every_rank, 2, url)
    for message, empty in outcomes:
        assert "2 ranks" in message and "keep memory://" in message, message
        assert empty


def test_check_shared_refuses_only_several_ranks_on_a_private_store(tmp_path) -> None:
    memory = open_location(f"memory://unshared/{uuid.uuid4().hex}")
    check_shared(memory, 1)
    check_shared(open_location(tmp_path / "ckpt"), 4)
    with pytest.raises(CheckpointingException, match=r"from 4 ranks.*keep memory:// for single-process saves"):
        check_shared(memory, 4)


def test_threads_saving_into_one_memory_prefix_commit_one_at_a_time() -> None:
    url = f"memory://unshared/{uuid.uuid4().hex}"
    save(_state(0.0), url)
    threads, start = 6, threading.Barrier(6)
    committed: list[float] = []
    refused: list[str] = []

    def save_one(fill: float) -> None:
        start.wait()
        try:
            # many small chunks, so that the saves overlap
            save(_state(fill), url, ZarrSaveShardedStrategy(max_chunk_bytes=256), overwrite=True)
        except CheckpointingException as exc:
            refused.append(str(exc))
        else:
            committed.append(fill)

    workers = [threading.Thread(target=save_one, args=(float(i + 1),)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert committed and len(committed) + len(refused) == threads
    for message in refused:
        assert url in message and ("is still running in this process" in message or "another save" in message), message
    loaded = load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(8, 256))}, url)
    assert torch.equal(loaded["w"], torch.full((8, 256), committed[-1]))
    assert verify(url).ok


def test_a_failed_save_lets_go_of_its_memory_prefix(monkeypatch) -> None:
    url = f"memory://unshared/{uuid.uuid4().hex}"
    import shardstore.engine.save as engine_save  # where the save looks its writes up

    monkeypatch.setattr(engine_save, "sharded_writes", lambda *a, **k: (_ for _ in ()).throw(
        CheckpointingException("injected failure")))
    with pytest.raises(CheckpointingException, match="injected failure"):
        save(_state(1.0), url, ZarrSaveShardedStrategy())
    monkeypatch.undo()
    save(_state(2.0), url)
    loaded = load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(8, 256))}, url)
    assert torch.equal(loaded["w"], torch.full((8, 256), 2.0))


def test_saves_into_nested_memory_prefixes_exclude_each_other() -> None:
    from shardstore.stores.base import StorageError

    outer = open_location(f"memory://unshared/{uuid.uuid4().hex}")
    inner = outer.child("step1")
    release = outer.store.claim_for_save("a" * 32)
    try:
        with pytest.raises(StorageError, match="is still running in this process"):
            inner.store.claim_for_save("b" * 32)
    finally:
        release()
    inner.store.claim_for_save("b" * 32)()
