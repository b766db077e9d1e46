"""Shared bytes proven at the cost of the store, not of the bytes (issue 64.2): on a local
file system a shared chunk whose file identity (device, inode, size, mtime_ns) matches
the one its base's record keeps is linked without reading it; any other is read back and
compared, and a scrub re-reads a bounded share of the shared chunks at every save."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

import shardstore.format.reuse as reuse
import shardstore.stores.local as local_io
from shardstore import CheckpointingException, ShardedTensor, load, save, verify
from shardstore.format.records import read_commit_record
from shardstore.stores.file_identity import FileIdentity
from shardstore.stores.locations import open_location
from tests.scenarios import global_tensor
from tests.test_incremental import PER_ARRAY, _check, _state

CHUNK = Path("base") / "c.0.0"
FROZEN = 12  # arrays of one 4 KiB chunk each (the scrub's cases)
# The scrub reads chunk files: the 4 KiB arrays and the adapter keep files of their own.


@pytest.fixture
def reads(monkeypatch) -> list[tuple[str, int]]:
    """Every read-back of a shared file: (its path inside the new checkpoint, bytes)."""
    seen: list[tuple[str, int]] = []
    blocks = local_io._file_blocks

    def counting(fd: int, limit: int):
        path = os.readlink(f"/proc/self/fd/{fd}")
        for block in blocks(fd, limit):
            seen.append((path, len(block)))
            yield block

    monkeypatch.setattr(local_io, "_file_blocks", counting)
    return seen


@pytest.fixture
def no_scrub(monkeypatch) -> None:
    """A scrub that reads one chunk per save (the smallest it reads), the adapter's:
    its key comes first and it changes every step."""
    monkeypatch.setattr(reuse, "SCRUB", reuse.ScrubPolicy(rotation_saves=10**9, min_bytes=0))


def _base_reads(reads: list[tuple[str, int]]) -> int:
    return sum(n for path, n in reads if path.endswith(str(CHUNK)))


def test_a_chunk_whose_identity_matches_is_shared_without_reading_it(tmp_path: Path, reads, no_scrub) -> None:
    save(_state(1), tmp_path / "s1", layout=PER_ARRAY)  # the scrub's one chunk is the adapter's file
    tag = read_commit_record(open_location(tmp_path / "s1")).arrays["base"].chunk_etags[0]
    assert FileIdentity.parse(tag).names(os.stat(tmp_path / "s1" / CHUNK))
    save(_state(2), tmp_path / "s2", reuse_from=tmp_path / "s1", layout=PER_ARRAY)
    assert _base_reads(reads) == 0
    assert os.stat(tmp_path / "s2" / CHUNK).st_ino == os.stat(tmp_path / "s1" / CHUNK).st_ino
    shared = FileIdentity.parse(read_commit_record(open_location(tmp_path / "s2")).arrays["base"].chunk_etags[0])
    assert shared.unread == 1 and shared.names(os.stat(tmp_path / "s1" / CHUNK))
    _check(tmp_path / "s2", 2)


def _same_bytes_written_again(path: Path) -> None:
    os.utime(path, ns=(0, os.stat(path).st_mtime_ns - 10**9))  # a write a second later moves mtime
    path.write_bytes(path.read_bytes())


def _same_bytes_in_a_new_inode(path: Path) -> None:
    copy = path.with_name("copy")
    shutil.copy2(path, copy)  # copy2 keeps mtime: only the inode tells
    os.replace(copy, path)


@pytest.mark.parametrize("change", [_same_bytes_written_again, _same_bytes_in_a_new_inode])
def test_a_chunk_whose_identity_moved_is_read_back_and_compared(tmp_path: Path, reads, no_scrub, change) -> None:
    save(_state(1), tmp_path / "s1")
    change(tmp_path / "s1" / CHUNK)
    save(_state(2), tmp_path / "s2", reuse_from=tmp_path / "s1")
    assert _base_reads(reads) == os.stat(tmp_path / "s1" / CHUNK).st_size
    assert read_commit_record(open_location(tmp_path / "s2")).reused_from.chunks == 1  # same bytes: shared
    proven = FileIdentity.parse(read_commit_record(open_location(tmp_path / "s2")).arrays["base"].chunk_etags[0])
    assert proven.unread == 0 and proven.names(os.stat(tmp_path / "s1" / CHUNK))


def test_a_chunk_whose_size_changed_is_written_though_mtime_was_set_back(tmp_path: Path, no_scrub) -> None:
    save(_state(1), tmp_path / "s1")
    path = tmp_path / "s1" / CHUNK
    info = os.stat(path)
    with open(path, "ab") as f:
        f.write(b"\0")
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))
    save(_state(2), tmp_path / "s2", reuse_from=tmp_path / "s1")
    assert read_commit_record(open_location(tmp_path / "s2")).reused_from is None
    assert os.stat(tmp_path / "s2" / CHUNK).st_ino != os.stat(path).st_ino
    _check(tmp_path / "s2", 2)


def test_a_chunk_replaced_by_a_symbolic_link_is_written_not_shared(tmp_path: Path, no_scrub) -> None:
    save(_state(1), tmp_path / "s1")
    path = tmp_path / "s1" / CHUNK
    os.replace(path, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", path)  # the same bytes, but not the checkpoint's file
    save(_state(2), tmp_path / "s2", reuse_from=tmp_path / "s1")
    assert read_commit_record(open_location(tmp_path / "s2")).reused_from is None
    assert not (tmp_path / "s2" / CHUNK).is_symlink()
    assert os.stat(tmp_path / "s2" / CHUNK).st_nlink == 1
    _check(tmp_path / "s2", 2)


def _frozen_state(step: int) -> dict:
    state = {f"f{i:02d}": ShardedTensor.from_rank_offsets(f"f{i:02d}", global_tensor(f"f{i:02d}", (32, 32),
                                                                                     torch.float32))
             for i in range(FROZEN)}
    return state | {"step": step}


def _scrubbed_by_save(tmp_path: Path, reads, saves: int) -> list[dict[str, int]]:
    """Saves ``saves`` steps after the first, each reusing from the one before; returns
    the bytes the scrub read per array, save by save."""
    save(_frozen_state(0), tmp_path / "s0", layout=PER_ARRAY)
    per_save = []
    for step in range(1, saves + 1):
        reads.clear()
        save(_frozen_state(step), tmp_path / f"s{step}", reuse_from=tmp_path / f"s{step - 1}", layout=PER_ARRAY)
        read: dict[str, int] = {}
        for path, n in reads:
            key = Path(path).parent.name
            read[key] = read.get(key, 0) + n
        per_save.append(read)
    return per_save


def test_the_scrub_reads_at_most_its_budget_and_covers_every_chunk(tmp_path: Path, reads, monkeypatch) -> None:
    chunk = 32 * 32 * 4 + 4
    monkeypatch.setattr(reuse, "SCRUB", reuse.ScrubPolicy(rotation_saves=10**9, min_bytes=3 * chunk + 100))
    per_save = _scrubbed_by_save(tmp_path, reads, saves=5)
    assert all(sum(read.values()) <= 3 * chunk + 100 for read in per_save)
    assert all(n == chunk for read in per_save for n in read.values())  # whole chunks, each once
    covered = [key for read in per_save[:4] for key in read]  # ceil(12 / 3) saves
    assert sorted(covered) == [f"f{i:02d}" for i in range(FROZEN)], "each chunk once in a rotation"
    assert sorted(per_save[4]) == ["f00", "f01", "f02"], "the next rotation starts again with the oldest"


def test_the_default_scrub_rereads_a_sixteenth_or_its_floor(tmp_path: Path) -> None:
    assert reuse.ScrubPolicy().budget(2**30) == 64 << 20
    assert reuse.ScrubPolicy().budget(2**40) == 2**36
    assert reuse.ScrubPolicy().budget(0) == 64 << 20


def test_a_bit_flipped_with_mtime_set_back_is_caught_by_the_scrub(tmp_path: Path, reads, monkeypatch, caplog) -> None:
    chunk = 32 * 32 * 4 + 4
    monkeypatch.setattr(reuse, "SCRUB", reuse.ScrubPolicy(rotation_saves=10**9, min_bytes=3 * chunk))
    save(_frozen_state(0), tmp_path / "s0", layout=PER_ARRAY)
    rotted = tmp_path / "s0" / "f10" / "c.0.0"
    info = os.stat(rotted)
    with open(rotted, "r+b") as f:  # a flipped bit that no identity field shows, as media errors do
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x08]))
    os.utime(rotted, ns=(info.st_atime_ns, info.st_mtime_ns))
    assert FileIdentity.of(info).names(os.stat(rotted))

    caught = None
    with caplog.at_level(logging.WARNING, logger="shardstore"):
        for step in range(1, 5):  # ceil(12 / 3) saves: one rotation
            save(_frozen_state(step), tmp_path / f"s{step}", reuse_from=tmp_path / f"s{step - 1}", layout=PER_ARRAY)
            if "does not hold the bytes being saved" in caplog.text:
                caught = step
                break
    assert caught is not None, "the scrub did not reach the rotted chunk within its rotation"
    assert "f10" in caplog.text and "shardstore verify" in caplog.text
    fresh = tmp_path / f"s{caught}" / "f10" / "c.0.0"
    assert os.stat(fresh).st_ino != os.stat(rotted).st_ino, "the rotted file is written anew, not shared"
    assert verify(tmp_path / f"s{caught}").ok
    load(_frozen_state(caught), tmp_path / f"s{caught}")
    assert not verify(tmp_path / "s0").ok
    with pytest.raises(CheckpointingException, match="crc32c"):
        load(_frozen_state(0), tmp_path / "s0")
