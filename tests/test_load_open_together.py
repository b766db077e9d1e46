"""A load of N ranks asks the storage for the commit record, ``metadata.json`` and
``common.pt`` once, on the coordinator, which hands them to every rank
(``opened.open_read_together``); each rank still checks them against the record."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardstore import ShardedTensor, load, save
from shardstore.errors import CheckpointingException
from tests.dist import run_distributed

ROOT_FILES = {"zarr.json", "metadata.json", "common.pt"}


def _state(rank: int, world: int, empty: bool = False) -> dict:
    block = torch.zeros(4, 8) if empty else torch.arange(32.0).reshape(4, 8) + 100 * rank
    return {"w": ShardedTensor.from_rank_offsets("w", block, (0, rank, world)), "step": 7}


def _save(rank: int, world: int, path: str) -> None:
    save(_state(rank, world), path)


def _load_counting(rank: int, world: int, path: str) -> tuple[list[str], bool]:
    """Loads; the root files this rank read from storage (once per read), and whether
    the load is exact."""
    from shardstore.stores.local import LocalStore

    read: list[str] = []
    get = LocalStore.get

    def counting(self, key: str, max_bytes: int | None = None) -> bytes | None:
        read.append(key)
        return get(self, key, max_bytes)

    LocalStore.get = counting  # type: ignore[method-assign]
    try:
        loaded = load(_state(rank, world, empty=True), path)
    finally:
        LocalStore.get = get  # type: ignore[method-assign]
    exact = torch.equal(loaded["w"], _state(rank, world)["w"].data) and loaded["step"] == 7
    return sorted(key for key in read if key in ROOT_FILES), exact


def test_only_the_coordinator_reads_the_record_and_the_common_files(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    run_distributed(_save, 2, path)
    (coordinator, coordinator_exact), (other, other_exact) = run_distributed(_load_counting, 2, path)
    assert coordinator == sorted(ROOT_FILES) and coordinator_exact
    assert other == [] and other_exact


def _load_expecting_refusal(rank: int, world: int, path: str) -> str:
    with pytest.raises(CheckpointingException) as caught:
        load(_state(rank, world, empty=True), path)
    return str(caught.value)


def test_a_damaged_common_file_handed_over_is_refused_on_every_rank(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    run_distributed(_save, 2, str(path))
    common = path / "common.pt"
    data = bytearray(common.read_bytes())
    data[-1] ^= 1
    common.write_bytes(bytes(data))
    messages = run_distributed(_load_expecting_refusal, 2, str(path))
    assert all("common.pt" in m for m in messages), messages


def test_a_missing_checkpoint_is_refused_on_every_rank_naming_it(tmp_path: Path) -> None:
    messages = run_distributed(_load_expecting_refusal, 2, str(tmp_path / "nothing"))
    assert all("nothing" in m for m in messages), messages


def _load_counting_with_a_small_bound(rank: int, world: int, path: str) -> tuple[list[str], bool]:
    import shardstore.opened as opened

    opened.SHARED_FILE_BYTES = 16  # common.pt is larger: each rank reads it itself, once
    return _load_counting(rank, world, path)


def test_a_common_file_over_the_bound_is_read_by_each_rank_once(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    run_distributed(_save, 2, path)
    (coordinator, coordinator_exact), (other, other_exact) = run_distributed(
        _load_counting_with_a_small_bound, 2, path)
    assert coordinator == sorted(ROOT_FILES) and coordinator_exact
    assert other == ["common.pt"] and other_exact
