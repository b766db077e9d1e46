"""Incremental checkpoints (issue 32): a save given an earlier checkpoint shares the
chunks whose bytes did not change instead of writing them again, and every checkpoint
still stands alone."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import crc32c
import numpy as np
import pytest
import torch

import shardstore.stores.local_files as local_files
from shardstore import CheckpointingException, ShardedTensor, StorageLayout, load, save, verify
from shardstore.format.records import is_committed, read_commit_record
from shardstore.stores.file_identity import FileIdentity
from shardstore.stores.locations import open_location
from shardstore.stores.s3 import S3Options
from shardstore.tools.manager import CheckpointManager, CheckpointManagerOptions
from tests.dist import run_distributed
from tests.s3_support import KEY, REGION, SECRET, Faults, FaultyProxy, MotoServer
from tests.scenarios import assert_bits_equal, global_tensor, rewrite_record

BASE, ADAPTER = (2048, 64), (8, 64)  # float32: 512 KiB of frozen base, above the 256 KiB pack bound; 2 KiB trained
BASE_BYTES = BASE[0] * BASE[1] * 4
PER_ARRAY = StorageLayout(pack_arrays_up_to=0)  # every array in chunk files of its own


def _state(step: int, empty: bool = False) -> dict:
    """A frozen base (the same at every step) and a small adapter that changes."""
    base = global_tensor("base", BASE, torch.float32)
    adapter = global_tensor("adapter", ADAPTER, torch.float32) + step
    return {
        "base": ShardedTensor.from_rank_offsets("base", torch.empty_like(base) if empty else base),
        "adapter": ShardedTensor.from_rank_offsets("adapter", torch.empty_like(adapter) if empty else adapter),
        "step": step,
    }


def _check(ckpt: Path | str, step: int) -> None:
    loaded = load(_state(step, empty=True), ckpt)
    assert_bits_equal(loaded["base"], global_tensor("base", BASE, torch.float32), "base")
    assert_bits_equal(loaded["adapter"], global_tensor("adapter", ADAPTER, torch.float32) + step, "adapter")
    assert loaded["step"] == step


def _file_digests(ckpt: Path) -> dict[str, str]:
    return {str(p.relative_to(ckpt)): hashlib.sha256(p.read_bytes()).hexdigest() for p in ckpt.rglob("*") if p.is_file()}


def _new_bytes(ckpt: Path) -> int:
    """Bytes of the files only this checkpoint holds (hard links shared with another
    checkpoint have a link count above 1)."""
    return sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file() and p.stat().st_nlink == 1)


def test_an_unchanged_chunk_is_shared_and_a_changed_one_written(tmp_path: Path) -> None:
    save(_state(1), tmp_path / "s1")
    before = _file_digests(tmp_path / "s1")
    save(_state(2), tmp_path / "s2", reuse_from=tmp_path / "s1")

    record = read_commit_record(open_location(tmp_path / "s2"))
    assert record.reused_from is not None
    assert record.reused_from.chunks == 1
    assert record.reused_from.nbytes == BASE_BYTES + 4  # the base chunk and its crc32c
    assert record.reused_from.save_id == read_commit_record(open_location(tmp_path / "s1")).save_id
    assert _new_bytes(tmp_path / "s2") < 8 * 64 * 4 + 16 * 1024  # the adapter and small files
    assert _file_digests(tmp_path / "s1") == before, "the earlier checkpoint's files changed"
    _check(tmp_path / "s2", 2)
    _check(tmp_path / "s1", 1)
    assert verify(tmp_path / "s2").ok


def test_the_new_checkpoint_stands_alone_once_the_old_is_deleted(tmp_path: Path) -> None:
    save(_state(1), tmp_path / "s1")
    save(_state(2), tmp_path / "s2", reuse_from=tmp_path / "s1")
    shutil.rmtree(tmp_path / "s1")
    _check(tmp_path / "s2", 2)
    report = verify(tmp_path / "s2")
    assert report.ok, report


def test_every_chunk_keeps_a_128_bit_digest_in_the_record(tmp_path: Path) -> None:
    save(_state(1), tmp_path / "s1")
    arrays = json.loads((tmp_path / "s1" / "zarr.json").read_bytes())["attributes"]["shardstore"]["arrays"]
    for key, summary in arrays.items():
        assert len(summary["chunk_xxh3_128"]) == len(summary["chunk_crc32c"]), key
        assert all(len(d) == 32 for d in summary["chunk_xxh3_128"]), key


def _same_crc32c_other_bytes(data: bytes) -> bytes:
    """``data`` with some bits of its last 16 bytes flipped so that its crc32c stays the
    same: crc32c is affine in the bits, so flips whose effects cancel (a dependent set
    among 128 single-bit flips, found by Gaussian elimination over GF(2)) forge it."""
    zero = crc32c.crc32c(bytes(len(data)))

    def effect(i: int) -> int:
        flipped = bytearray(len(data))
        flipped[i // 8] ^= 1 << (i % 8)
        return crc32c.crc32c(bytes(flipped)) ^ zero

    start = (len(data) - 16) * 8
    basis: dict[int, tuple[int, int]] = {}  # pivot bit -> (effect, set of flips as a bit mask)
    for i in range(start, start + 128):
        value, flips = effect(i), 1 << (i - start)
        while value:
            pivot = value.bit_length() - 1
            if pivot not in basis:
                basis[pivot] = (value, flips)
                break
            value, flips = value ^ basis[pivot][0], flips ^ basis[pivot][1]
        else:  # these flips change nothing in the crc32c
            out = bytearray(data)
            for bit in range(128):
                if flips >> bit & 1:
                    out[(start + bit) // 8] ^= 1 << ((start + bit) % 8)
            return bytes(out)
    raise AssertionError("no dependent set of flips found")


def test_a_chunk_with_the_same_crc32c_but_other_bytes_is_written_not_shared(tmp_path: Path) -> None:
    original = global_tensor("base", BASE, torch.float32)
    forged_bytes = _same_crc32c_other_bytes(original.numpy().tobytes())
    forged = torch.from_numpy(np.frombuffer(forged_bytes, dtype=np.float32).reshape(BASE).copy())
    assert crc32c.crc32c(forged.numpy().tobytes()) == crc32c.crc32c(original.numpy().tobytes())
    assert not torch.equal(forged, original)

    save({"base": ShardedTensor.from_rank_offsets("base", original)}, tmp_path / "s1")
    save({"base": ShardedTensor.from_rank_offsets("base", forged)}, tmp_path / "s2", reuse_from=tmp_path / "s1")

    assert read_commit_record(open_location(tmp_path / "s2")).reused_from is None
    loaded = load({"base": ShardedTensor.from_rank_offsets("base", torch.empty(BASE))}, tmp_path / "s2")
    assert_bits_equal(loaded["base"], forged, "base")


def test_an_array_stored_another_way_is_not_reused(tmp_path: Path) -> None:
    base = global_tensor("base", BASE, torch.float32)
    save({"base": ShardedTensor.from_rank_offsets("base", base)}, tmp_path / "s1")
    as_other_shape = base.reshape(BASE[1], BASE[0])
    save({"base": ShardedTensor.from_rank_offsets("base", as_other_shape)}, tmp_path / "s2", reuse_from=tmp_path / "s1")
    assert read_commit_record(open_location(tmp_path / "s2")).reused_from is None
    loaded = load({"base": ShardedTensor.from_rank_offsets("base", torch.empty(BASE[1], BASE[0]))}, tmp_path / "s2")
    assert_bits_equal(loaded["base"], as_other_shape, "base")


@pytest.mark.parametrize("source", ["missing", "not a checkpoint", "uncommitted", "older record"])
def test_a_source_that_cannot_be_reused_from_is_logged_not_an_error(tmp_path: Path, caplog, source: str) -> None:
    origin = tmp_path / "origin"
    if source == "not a checkpoint":
        origin.mkdir()
        (origin / "model.bin").write_bytes(b"weights of another tool")
    elif source == "uncommitted":
        save(_state(1), origin)
        (origin / "zarr.json").unlink()
    elif source == "older record":  # written before digests were kept
        save(_state(1), origin)
        root = json.loads((origin / "zarr.json").read_bytes())
        for summary in root["attributes"]["shardstore"]["arrays"].values():
            del summary["chunk_xxh3_128"]
        from shardstore.format.records.encoding import RECORD_DIGEST, UNSEALED_DIGEST, seal_record

        root["attributes"]["shardstore"][RECORD_DIGEST] = UNSEALED_DIGEST
        (origin / "zarr.json").write_bytes(seal_record(json.dumps(root, separators=(",", ":")).encode()))
    with caplog.at_level(logging.INFO, logger="shardstore"):
        save(_state(2), tmp_path / "s2", reuse_from=origin)
    assert "Not reusing chunks from" in caplog.text
    assert read_commit_record(open_location(tmp_path / "s2")).reused_from is None
    _check(tmp_path / "s2", 2)


def test_overwriting_the_checkpoint_it_reuses_from_keeps_the_shared_chunks(tmp_path: Path) -> None:
    save(_state(1), tmp_path / "ckpt")
    save(_state(2), tmp_path / "ckpt", reuse_from=tmp_path / "ckpt", overwrite=True)
    assert read_commit_record(open_location(tmp_path / "ckpt")).reused_from is not None
    _check(tmp_path / "ckpt", 2)
    assert verify(tmp_path / "ckpt").ok


def test_a_later_save_never_writes_through_a_shared_file(tmp_path: Path) -> None:
    """A chunk file hard-linked into two checkpoints is replaced, not truncated, by any
    later write of shardstore's: the other checkpoint keeps its bytes."""
    save(_state(1), tmp_path / "s1")
    save(_state(2), tmp_path / "s2", reuse_from=tmp_path / "s1")
    before = _file_digests(tmp_path / "s1")
    changed = _state(3)
    changed["base"] = ShardedTensor.from_rank_offsets("base", global_tensor("base", BASE, torch.float32) * 2)
    save(changed, tmp_path / "s2", overwrite=True)
    assert _file_digests(tmp_path / "s1") == before
    _check(tmp_path / "s1", 1)


def test_inspect_says_what_a_checkpoint_reuses(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from shardstore.tools.cli import main

    save(_state(1), tmp_path / "s1")
    save(_state(2), tmp_path / "s2", reuse_from=tmp_path / "s1")
    result = CliRunner().invoke(main, ["inspect", str(tmp_path / "s2")])
    assert result.exit_code == 0, result.output
    assert "reuses 1 chunk" in result.output
    assert str(tmp_path / "s1") in result.output


# ---------------------------------------------------------------- the manager


def test_the_manager_reuses_from_its_newest_step_by_default(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, CheckpointManagerOptions(max_to_keep=1))
    for step in range(3):
        assert manager.save(step, _state(step))
    manager.close()
    assert manager.all_steps() == [2]  # retention deleted the steps the last one shared with
    record = read_commit_record(manager.location(2))
    assert record.reused_from is not None and record.reused_from.chunks == 1
    _check(manager.location(2).local_path(), 2)
    assert verify(manager.location(2)).ok


def test_the_manager_can_be_told_not_to_reuse(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, CheckpointManagerOptions(reuse_unchanged=False))
    for step in range(2):
        manager.save(step, _state(step))
    manager.close()
    assert read_commit_record(manager.location(1)).reused_from is None


# ---------------------------------------------------------------- two ranks, crashes


def _ranked_state(rank: int, world: int, step: int, empty: bool = False) -> dict:
    base = global_tensor("base", BASE, torch.float32).chunk(world)[rank]
    adapter = (global_tensor("adapter", ADAPTER, torch.float32) + step).chunk(world)[rank]
    return {
        "base": ShardedTensor.from_rank_offsets("base", torch.empty_like(base) if empty else base.clone(),
                                                (0, rank, world)),
        "adapter": ShardedTensor.from_rank_offsets("adapter", torch.empty_like(adapter) if empty else adapter.clone(),
                                                   (0, rank, world)),
    }


def save_ranked(rank: int, world: int, ckpt: str, step: int, reuse_from: str | None) -> int:
    save(_ranked_state(rank, world, step), ckpt, reuse_from=reuse_from)
    return 0


def check_ranked(rank: int, world: int, ckpt: str, step: int) -> None:
    loaded = load(_ranked_state(rank, world, step, empty=True), ckpt)
    expected = _ranked_state(rank, world, step)
    for key in ("base", "adapter"):
        assert_bits_equal(loaded[key], expected[key].data, key)


def test_two_ranks_each_share_their_own_unchanged_chunks(tmp_path: Path) -> None:
    run_distributed(save_ranked, 2, str(tmp_path / "s1"), 1, None)
    run_distributed(save_ranked, 2, str(tmp_path / "s2"), 2, str(tmp_path / "s1"))
    record = read_commit_record(open_location(tmp_path / "s2"))
    assert record.reused_from is not None and record.reused_from.chunks == 2  # each rank's half of the base
    shutil.rmtree(tmp_path / "s1")
    run_distributed(check_ranked, 2, str(tmp_path / "s2"), 2)


def save_ranked_from_own_base(rank: int, world: int, ckpt: str, bases: list[str]) -> str:
    """``save_ranked`` with each rank's own ``reuse_from`` (Megatron's door picks the base
    on every rank for itself); returns what this rank logged of the reuse."""
    records: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("shardstore").addHandler(handler)
    logging.getLogger("shardstore").setLevel(logging.INFO)
    save(_ranked_state(rank, world, 2), ckpt, reuse_from=bases[rank])
    return "\n".join(m for m in records if "Not reusing" in m)


def test_a_rank_whose_base_is_not_the_coordinators_says_so(tmp_path: Path) -> None:
    """Ranks that chose other bases (``megatron.previous_checkpoint`` runs on each rank;
    a file system in flux) only lose the reuse. Before, such a rank logged that
    "another save ... replaced it since this save began", though nothing had replaced
    anything: it now names both saves and says the coordinator chose another base."""
    s0, s1, s2 = (tmp_path / name for name in ("s0", "s1", "s2"))
    run_distributed(save_ranked, 2, str(s0), 1, None)
    run_distributed(save_ranked, 2, str(s1), 1, None)
    logs = run_distributed(save_ranked_from_own_base, 2, str(s2), [str(s1), str(s0)])
    first, other = (read_commit_record(open_location(p)).save_id for p in (s1, s0))
    assert logs[0] == "", logs
    assert "replaced it since" not in logs[1] and first in logs[1] and other in logs[1], logs
    assert "another checkpoint than the coordinator" in logs[1], logs
    run_distributed(check_ranked, 2, str(s2), 2)


def save_ranked_with_a_crash(rank: int, world: int, ckpt: str, reuse_from: str, point: str) -> str:
    if rank == 1:
        import shardstore.format.chunks as chunk_io

        if point == "while sharing":
            import shardstore.stores.local as local_io

            original = local_io.FileChunkStore.share_from

            def share_then_die(self, *args, **kwargs):
                original(self, *args, **kwargs)
                os.kill(os.getpid(), 9)

            local_io.FileChunkStore.share_from = share_then_die
        elif point == "after sharing":
            def die_on_write(self, data, digest=None):
                os.kill(os.getpid(), 9)

            chunk_io.ChunkFile.write = die_on_write
    try:
        # the crash is injected into a chunk file's write: the changed adapter must have one
        save(_ranked_state(rank, world, 2), ckpt, reuse_from=reuse_from, layout=PER_ARRAY)
    except CheckpointingException as exc:
        return str(exc)
    raise AssertionError("the surviving rank's save returned normally")


@pytest.mark.parametrize("point", ["while sharing", "after sharing"])
def test_a_crash_in_a_reusing_save_leaves_both_steps_as_they_were(tmp_path: Path, point: str) -> None:
    s1, s2 = tmp_path / "s1", tmp_path / "s2"
    run_distributed(save_ranked, 2, str(s1), 1, None)
    before = _file_digests(s1)
    run_distributed(save_ranked_with_a_crash, 2, str(s2), str(s1), point, killed=(1,))
    assert _file_digests(s1) == before
    assert not is_committed(open_location(s2))
    run_distributed(check_ranked, 2, str(s1), 1)
    run_distributed(save_ranked, 2, str(s2), 2, str(s1))  # the next save clears the dead one's
    run_distributed(check_ranked, 2, str(s2), 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s1", "s2"]


# ---------------------------------------------------------------- object stores


@pytest.fixture(scope="module")
def s3(moto_server: MotoServer) -> Iterator[tuple[MotoServer, FaultyProxy]]:
    moto_server.create_bucket("incremental")
    proxy = FaultyProxy(moto_server.port, Faults()).start()
    yield moto_server, proxy
    proxy.stop()


def test_s3_shares_by_server_side_copy_and_uploads_only_what_changed(s3) -> None:
    _, proxy = s3
    options = S3Options(endpoint_url=proxy.endpoint, key=KEY, secret=SECRET, region=REGION)
    first, second = (open_location(f"s3://incremental/run/step{i}", options=options) for i in (1, 2))
    save(_state(1), first, layout=PER_ARRAY)
    uploaded = proxy.bytes_received
    save(_state(2), second, reuse_from=first, layout=PER_ARRAY)
    step2_upload = proxy.bytes_received - uploaded
    record = read_commit_record(second)
    assert record.reused_from is not None and record.reused_from.chunks == 1
    assert step2_upload < BASE_BYTES / 2, f"step 2 uploaded {step2_upload} bytes"  # the base is not sent
    first.remove_tree("")
    _check(second, 2)
    assert verify(second).ok


@pytest.mark.parametrize("sharded", [False, True], ids=["chunks", "shards"])
def test_s3_copies_are_proven_by_the_recorded_etag_without_hashing(s3, monkeypatch, sharded: bool) -> None:
    """A save to S3 records each chunk object's ETag (the MD5 S3 computed of the bytes
    it stored); a later save proves its copies by that ETag. The process hashes one
    object of the bucket (its first copy shows that the bucket's ETags are MD5s), none
    after, through a chain of steps (a shared chunk's ETag is its copy's)."""
    from shardstore.format.codecs import HeldChunk
    from shardstore.format.sharding import HeldShard
    from shardstore.stores import kv_chunks
    from shardstore.strategies.zarr import ZarrSaveShardedStrategy

    monkeypatch.setattr(kv_chunks, "_MD5_ETAG_BUCKETS", set())  # as in a new process

    _, proxy = s3
    options = S3Options(endpoint_url=proxy.endpoint, key=KEY, secret=SECRET, region=REGION)
    steps = [open_location(f"s3://incremental/etags-{sharded}/step{i}", options=options) for i in (1, 2, 3)]
    strategy = ZarrSaveShardedStrategy(shard_bytes=2**20, max_chunk_bytes=16 << 10) if sharded else None
    frozen = {f"frozen{i}": ShardedTensor.from_rank_offsets(f"frozen{i}", global_tensor(f"f{i}", BASE, torch.float32))
              for i in range(3)}
    save(frozen, steps[0], strategy, layout=PER_ARRAY)
    first = read_commit_record(steps[0])
    assert (first.arrays["frozen0"].codec.name == "sharding_indexed") == sharded
    stored = steps[0].read_bytes("frozen0/" + first.arrays["frozen0"].chunk_key((0,) * len(BASE)))
    assert first.arrays["frozen0"].chunk_etags == (hashlib.md5(stored).hexdigest(),)
    hashed = []
    for held in (HeldChunk, HeldShard):
        monkeypatch.setattr(held, "md5_hex", lambda self, original=held.md5_hex: hashed.append(1) or original(self))
    for source, target, expected in zip(steps, steps[1:], (1, 0)):
        hashed.clear()
        save(frozen, target, strategy, reuse_from=source, layout=PER_ARRAY)
        record = read_commit_record(target)
        assert record.reused_from is not None and record.reused_from.chunks == 3, record.reused_from
        assert all(record.arrays[k].chunk_etags == first.arrays[k].chunk_etags for k in frozen)
        assert len(hashed) == expected, f"{len(hashed)} objects hashed; the recorded ETags prove the others"
    loaded = load({k: ShardedTensor.from_rank_offsets(k, torch.empty(BASE)) for k in frozen}, steps[2])
    for i in range(3):
        assert_bits_equal(loaded[f"frozen{i}"], global_tensor(f"f{i}", BASE, torch.float32), f"frozen{i}")
    assert verify(steps[2]).ok


def test_s3_etags_that_name_versions_not_bytes_end_sharing(s3, monkeypatch) -> None:
    """A store whose ETags look like MD5s but are not the bytes' (equal on a copy
    whatever the bytes): the save's first copy finds it out, and nothing is shared."""
    from shardstore.stores import kv_chunks, s3_fenced
    from shardstore.stores.base import CopiedObject
    from shardstore.stores.s3 import S3Store

    _, proxy = s3
    options = S3Options(endpoint_url=proxy.endpoint, key=KEY, secret=SECRET, region=REGION)
    first, second = (open_location(f"s3://incremental/versions/step{i}", options=options) for i in (1, 2))
    monkeypatch.setattr(kv_chunks, "_MD5_ETAG_BUCKETS", set())  # as in a new process
    version = "ab" * 16  # hex, 32 digits, and no MD5 of anything saved here
    monkeypatch.setattr(kv_chunks, "_etag_of", lambda generation: version)
    monkeypatch.setattr(s3_fenced, "_etag", lambda reply: version)
    save(_state(1), first, layout=PER_ARRAY)
    assert read_commit_record(first).arrays["base"].chunk_etags == (version,)
    monkeypatch.setattr(S3Store, "copy_from", lambda self, source, key: CopiedObject(version))
    save(_state(2), second, reuse_from=first, layout=PER_ARRAY)
    assert read_commit_record(second).reused_from is None
    _check(second, 2)


def test_local_records_keep_each_chunk_files_identity(tmp_path: Path) -> None:
    """Not an ETag: the file's identity (``stores.file_identity``), which a later save
    proves a shared chunk by (tests/test_identity_proof.py)."""
    save(_state(1), tmp_path / "s1", layout=PER_ARRAY)  # every array's chunk file has an identity
    for key, array in read_commit_record(open_location(tmp_path / "s1")).arrays.items():
        assert len(array.chunk_etags) == 1 and array.chunk_etags[0].startswith("file:")
        assert FileIdentity.parse(array.chunk_etags[0]).names(os.stat(tmp_path / "s1" / key / "c.0.0"))


@pytest.mark.parametrize("etags", [["x" * 129], ["a", "b"], "abc", [7]])
def test_a_record_with_malformed_etags_is_refused(tmp_path: Path, etags) -> None:
    save(_state(1), tmp_path / "s1")

    def edit(root: dict) -> None:
        root["attributes"]["shardstore"]["arrays"]["base"]["chunk_etags"] = etags

    rewrite_record(tmp_path / "s1", edit)
    with pytest.raises(CheckpointingException, match="must list an ETag .* for each of its 1 chunks"):
        read_commit_record(open_location(tmp_path / "s1"))


def test_memory_store_shares_by_copy(tmp_path: Path) -> None:
    first, second = "memory://incremental/step1", "memory://incremental/step2"
    save(_state(1), first)
    save(_state(2), second, reuse_from=first)
    assert read_commit_record(open_location(second)).reused_from is not None
    _check(second, 2)


def test_a_source_on_another_kind_of_storage_is_not_reused(tmp_path: Path) -> None:
    save(_state(1), tmp_path / "s1")
    save(_state(2), "memory://incremental-other/step2", reuse_from=tmp_path / "s1")
    assert read_commit_record(open_location("memory://incremental-other/step2")).reused_from is None
    _check("memory://incremental-other/step2", 2)


def test_verify_finds_a_chunk_edited_with_its_crc32c_forged(tmp_path: Path) -> None:
    """A chunk changed on disk so that its crc32c still matches (the record's too) passes
    a load's checks; ``verify`` compares its 128-bit digest and names it."""
    save(_state(1), tmp_path / "s1")
    chunk = tmp_path / "s1" / "base" / "c.0.0"
    stored = chunk.read_bytes()
    chunk.write_bytes(_same_crc32c_other_bytes(stored[:-4]) + stored[-4:])
    report = verify(tmp_path / "s1")
    assert not report.ok
    assert [(p.key, p.part) for p in report.problems] == [("base", "c.0.0")], report.problems
    assert "128-bit digest" in report.problems[0].message


def test_an_async_save_of_the_manager_reuses_too(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, CheckpointManagerOptions(async_save=True))
    for step in range(2):
        manager.save(step, _state(step))
    manager.close()
    record = read_commit_record(manager.location(1))
    assert record.reused_from is not None and record.reused_from.chunks == 1
    _check(manager.location(1).local_path(), 1)


def test_s3_an_object_overwritten_after_its_commit_is_not_copied(s3, caplog) -> None:
    """The copy's ETag (the MD5 S3 computes of what it stored) must be the MD5 of the
    bytes being saved; an object changed since its commit fails that and is uploaded."""
    _, proxy = s3
    options = S3Options(endpoint_url=proxy.endpoint, key=KEY, secret=SECRET, region=REGION)
    first, second = (open_location(f"s3://incremental/overwritten/step{i}", options=options) for i in (1, 2))
    save(_state(1), first, layout=PER_ARRAY)
    stored = first.read_bytes("base/c.0.0")
    other = (np.frombuffer(stored[:-4], dtype=np.uint32) ^ 1).tobytes()
    first.write_bytes("base/c.0.0", other + crc32c.crc32c(other).to_bytes(4, "little"))
    with caplog.at_level(logging.INFO, logger="shardstore"):
        save(_state(2), second, reuse_from=first, layout=PER_ARRAY)
    assert read_commit_record(second).reused_from is None
    assert "is not their MD5" in caplog.text
    _check(second, 2)
    assert verify(second).ok


def test_s3_copies_whose_etag_is_no_md5_are_tried_once_per_save(s3, monkeypatch) -> None:
    """An encrypted (SSE-KMS, SSE-C) or multipart object's ETag proves nothing of its
    bytes: after the first such copy the save writes every other chunk without copying."""
    from shardstore.stores.base import CopiedObject
    from shardstore.stores.s3 import S3Store, _encrypted_by_key

    assert _encrypted_by_key({"ServerSideEncryption": "aws:kms"}) and _encrypted_by_key({"SSECustomerAlgorithm": "AES256"})
    assert not _encrypted_by_key({"ServerSideEncryption": "AES256"})
    _, proxy = s3
    options = S3Options(endpoint_url=proxy.endpoint, key=KEY, secret=SECRET, region=REGION)
    first, second = (open_location(f"s3://incremental/kms/step{i}", options=options) for i in (1, 2))
    frozen = {f"frozen{i}": ShardedTensor.from_rank_offsets(f"frozen{i}", global_tensor(f"f{i}", BASE, torch.float32))
              for i in range(3)}
    save(frozen, first, layout=PER_ARRAY)
    copies = []

    def encrypted_copy(self, source, key):
        copies.append(key)
        return CopiedObject()

    monkeypatch.setattr(S3Store, "copy_from", encrypted_copy)
    save(frozen, second, reuse_from=first, layout=PER_ARRAY)
    assert len(copies) == 1, copies
    assert read_commit_record(second).reused_from is None
    loaded = load({k: ShardedTensor.from_rank_offsets(k, torch.empty(BASE)) for k in frozen}, second)
    for i in range(3):
        assert_bits_equal(loaded[f"frozen{i}"], global_tensor(f"f{i}", BASE, torch.float32), f"frozen{i}")


CHUNK = Path("base") / "c.0.0"


class _CloningFcntl:
    """``fcntl`` of a file system that clones (Btrfs, XFS): FICLONE copies the bytes
    within one device and fails with EXDEV across devices, as the kernel does."""

    def __getattr__(self, name: str):
        return getattr(fcntl, name)

    def ioctl(self, fd: int, request: int, arg: int) -> int:
        assert request == local_files.FICLONE
        if os.fstat(fd).st_dev != os.fstat(arg).st_dev:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        size = os.fstat(arg).st_size
        os.write(fd, os.pread(arg, size, 0))
        return 0


def test_one_cross_device_reuse_does_not_turn_later_clones_into_hard_links(tmp_path: Path, monkeypatch) -> None:
    """On a file system that clones, a chunk shared with an earlier step must be a clone
    (an independent file: rot in the old step costs only the old step). One save whose
    target is on another device (FICLONE and link both say EXDEV, so it writes) must not
    make every later same-device save of the process hard-link instead: the EXDEV
    marked the *source's* device as unable to clone (stores/local_files.py, ``_clone``)."""
    other = Path(tempfile.mkdtemp(dir="/dev/shm")) if os.path.isdir("/dev/shm") else None
    if other is None or os.stat(other).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs a second file system (/dev/shm)")
    try:
        monkeypatch.setattr(local_files, "fcntl", _CloningFcntl())
        monkeypatch.setattr(local_files, "_clone_unsupported", set())
        save(_state(1), tmp_path / "s1")
        save(_state(2), tmp_path / "s2", reuse_from=tmp_path / "s1")
        assert (tmp_path / "s2" / CHUNK).stat().st_nlink == 1  # a clone
        save(_state(3), other / "s3", reuse_from=tmp_path / "s1")  # another device: written
        save(_state(4), tmp_path / "s4", reuse_from=tmp_path / "s1")
        assert read_commit_record(open_location(tmp_path / "s4")).reused_from is not None
        assert (tmp_path / "s4" / CHUNK).stat().st_nlink == 1, (
            "step 4 hard-links step 1's chunk although the file system clones: a byte that rots in step 1 now "
            "costs step 4 too"
        )
        _check(tmp_path / "s4", 4)
    finally:
        shutil.rmtree(other, ignore_errors=True)


def _reuse_notes_by_level(rank: int, world: int, root: str) -> list[int]:
    """Saves ``s2`` reusing from ``base``, whose one array has another shape; returns the
    levels this rank logged "Not reusing chunks" at."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger("shardstore")
    log.addHandler(handler)
    level = log.level
    log.setLevel(logging.DEBUG)
    try:
        w = torch.arange(8.0 * world)[rank * 8 : (rank + 1) * 8]
        save({"w": ShardedTensor.from_rank_offsets("w", w, (0, rank, world))}, Path(root) / "s2",
             reuse_from=Path(root) / "base")
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    return [r.levelno for r in records if r.getMessage().startswith("Not reusing chunks from")]


def test_a_base_no_rank_can_share_from_is_noted_at_info_once_per_job(tmp_path: Path) -> None:
    """Every rank found that none of the base's arrays is stored as the save's are, and
    each logged it at INFO: a job of 1,000 ranks logged 1,000 lines per save. Rank 0
    logs it at INFO, the others at DEBUG."""
    save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(3), replica_id=0)}, tmp_path / "base")
    assert run_distributed(_reuse_notes_by_level, 2, str(tmp_path)) == [[logging.INFO], [logging.DEBUG]]


def test_a_default_save_shares_a_large_frozen_array_and_packs_the_small_ones_anew(tmp_path: Path) -> None:
    """On the default layout the 2 KiB adapter is packed (never shared) and the 512 KiB
    base keeps chunk files of its own, which a reusing save shares."""
    save(_state(1), tmp_path / "s1")
    save(_state(2), tmp_path / "s2", reuse_from=tmp_path / "s1")

    record = read_commit_record(open_location(tmp_path / "s2"))
    assert record.reused_from is not None
    assert (record.reused_from.chunks, record.reused_from.nbytes) == (1, BASE_BYTES + 4)
    assert _new_bytes(tmp_path / "s2") < BASE_BYTES, "the base's chunk was written again"
    assert not (tmp_path / "s2" / "adapter").exists(), "the adapter has no directory: it is packed"
    packs = sorted(p.name for p in (tmp_path / "s2" / "packs").iterdir())
    assert packs == ["0-0.zip"]
    assert (tmp_path / "s2" / "packs" / "0-0.zip").stat().st_nlink == 1, "the pack is written anew"
    _check(tmp_path / "s2", 2)
    _check(tmp_path / "s1", 1)
    assert verify(tmp_path / "s2").ok
