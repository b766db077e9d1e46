"""The fault attacks of the per-array layout (a failing or full disk, a killed writer,
bytes changed during an async save, damaged bytes, one rank's failure, a spawned
writer) run against packed saves (``packs/<rank>-<n>.zip``, the default layout's small
arrays): a pack that is not whole is never committed, the error names the checkpoint
and the pack, an earlier checkpoint at the same place is kept, and the next save works.
The slow-marked spawned writer needs a fresh interpreter (multiprocessing's spawn)."""

from __future__ import annotations

import errno
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from shardstore import CheckpointingException, ShardedTensor, load, save, verify
from shardstore.format import is_committed
from shardstore.format.records import read_commit_record
from shardstore.stores.base import Location
from shardstore.stores.local import FileChunkStore
from shardstore.stores.locations import open_location
from shardstore.tools.manager import CheckpointManager, CheckpointManagerOptions
from tests.dist import run_distributed
from tests.forked_python import ForkedPython

# Six arrays of 400-420 bytes: all packed by the default layout, into one pack per rank.
_KEYS = [f"layer{i}/w" for i in range(6)]


def _tensors(value: float, rank: int = 0) -> dict[str, torch.Tensor]:
    return {f"r{rank}/{k}" if rank else k: torch.arange(100.0 + i) + value for i, k in enumerate(_KEYS)}


def _sd(tensors: dict[str, torch.Tensor], empty: bool = False) -> dict[str, ShardedTensor]:
    return {k: ShardedTensor.from_rank_offsets(k, torch.empty_like(t) if empty else t, replica_id=0)
            for k, t in tensors.items()}


def _loaded(path: str | Path | Location, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return dict(load(_sd(like, empty=True), path if isinstance(path, Location) else str(path)))


def _assert_holds(path: str | Path | Location, tensors: dict[str, torch.Tensor]) -> None:
    """``path`` is committed, verifies and loads ``tensors`` bit for bit, from packs."""
    location = path if isinstance(path, Location) else open_location(str(path))
    assert is_committed(location) and set(read_commit_record(location).packed_arrays) == set(tensors)
    assert verify(location).ok
    loaded = _loaded(location, tensors)
    assert [k for k, t in tensors.items() if not torch.equal(loaded[k], t)] == []


def _assert_not_committed(path: Path, like: dict[str, torch.Tensor]) -> None:
    """Nothing at ``path`` looks like a checkpoint: load and verify refuse it, naming it."""
    assert not (path.exists() and is_committed(open_location(str(path))))
    with pytest.raises(CheckpointingException, match=str(path)):
        _loaded(path, like)
    if path.exists():
        assert not verify(path).ok


def _packs_fail(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each pack's write writes half of its pieces, then fails with ENOSPC (as a disk
    filling up would); chunk files of arrays that are not packed are written. Returns
    the packs tried."""
    real, tried = FileChunkStore.put, []

    def put(self: FileChunkStore, rel: str, buffers):  # noqa: ANN001, ANN202
        if not rel.startswith("packs/"):
            return real(self, rel, buffers)
        tried.append(rel)
        pieces = list(buffers)
        real(self, rel, pieces[: len(pieces) // 2])
        raise OSError(errno.ENOSPC, "No space left on device", self.describe(rel))

    monkeypatch.setattr(FileChunkStore, "put", put)
    return tried


# ------------------------------------------------------------ 1. a pack write that fails


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_failing_pack_write_fails_the_save_and_keeps_the_checkpoint_it_replaces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str,
) -> None:
    ckpt = tmp_path / "ckpt"
    old, new = _tensors(1.0), _tensors(2.0)
    save(_sd(old), str(ckpt))
    tried = _packs_fail(monkeypatch)
    # the pack's file in the save's staging directory beside ``ckpt``, and its arrays, as a chunk file's is named
    pack = rf"{tmp_path}/\.ckpt\.shardstore-save-\w+/packs/0-0\.zip \(arrays 'layer0/w'"
    with pytest.raises(CheckpointingException, match=rf"(?s){pack}.*No space left on device"):
        if mode == "sync":
            save(_sd(new), str(ckpt), overwrite=True)
        else:
            request = save(_sd(new), str(ckpt), overwrite=True, async_sharded_save=True)
            for t in new.values():
                t.add_(100)  # the snapshot is written, not the tensors
            request.execute_sync()
    assert tried == ["packs/0-0.zip"]
    _assert_holds(ckpt, old)  # untouched: the old checkpoint, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # the half pack went with its staging directory
    monkeypatch.undo()
    save(_sd(_tensors(3.0)), str(ckpt), overwrite=True)
    _assert_holds(ckpt, _tensors(3.0))


def test_a_failing_pack_write_in_a_managed_save_keeps_the_earlier_step(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    manager = CheckpointManager(tmp_path, CheckpointManagerOptions(max_to_keep=1))
    manager.save(1, _sd(_tensors(1.0)))
    _packs_fail(monkeypatch)
    with pytest.raises(CheckpointingException, match=r"iter_0000002.*No space left on device"):
        manager.save(2, _sd(_tensors(2.0)))
    _assert_not_committed(tmp_path / "iter_0000002", _tensors(2.0))
    assert manager.all_steps() == [1]
    _assert_holds(tmp_path / "iter_0000001", _tensors(1.0))
    monkeypatch.undo()
    manager.save(2, _sd(_tensors(2.0)))
    assert manager.all_steps() == [2]
    _assert_holds(tmp_path / "iter_0000002", _tensors(2.0))


def test_a_pack_that_fills_a_real_disk_fails_the_save_without_commit(tiny_tmpfs: Path) -> None:
    """A 1 MiB tmpfs: the small checkpoint fits, the second save's pack (40 arrays of
    40 KiB, packed together) does not."""
    ckpt = tiny_tmpfs / "ckpt"
    save(_sd(_tensors(1.0)), str(ckpt))
    many = {f"a{i}": torch.full((10_000,), float(i)) for i in range(40)}
    # the pack's file named, and the arrays it holds, as a chunk file's failure names it
    pack = rf"{tiny_tmpfs}/\.big\.shardstore-save-\w+/packs/0-0\.zip"
    with pytest.raises(CheckpointingException, match=rf"(?s){pack} \(arrays 'a0'.*No space left on device"):
        save(_sd(many), str(tiny_tmpfs / "big"))
    _assert_not_committed(tiny_tmpfs / "big", many)
    assert sorted(p.name for p in tiny_tmpfs.iterdir()) == ["ckpt"]
    _assert_holds(ckpt, _tensors(1.0))
    save(_sd(_tensors(2.0)), str(tiny_tmpfs / "big"))  # the space came back
    _assert_holds(tiny_tmpfs / "big", _tensors(2.0))


# ------------------------------------------------------------ 2. a writer killed while it writes a pack

_KILLED_WRITER = """
import sys, time
from pathlib import Path
import torch
from shardstore import ShardedTensor, save
from shardstore.stores.base import Location
from shardstore.stores.local import FileChunkStore

ckpt, ready, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
real = FileChunkStore.put

def put(self, rel, buffers):
    if not rel.startswith("packs/"):
        return real(self, rel, buffers)
    pieces = list(buffers)
    real(self, rel, pieces[: len(pieces) // 2])  # half the pack is on disk
    ready.write_text(self.describe(rel))
    time.sleep(120)  # killed here

FileChunkStore.put = put
tensors = {f"layer{i}/w": torch.arange(100.0 + i) + 2.0 for i in range(6)}
state = {k: ShardedTensor.from_rank_offsets(k, t, replica_id=0) for k, t in tensors.items()}
if mode == "sync":
    save(state, ckpt, overwrite=True)
else:  # the pack is written by the queue's background writer
    from shardstore.strategies.async_utils import AsyncCallsQueue

    queue = AsyncCallsQueue()
    queue.schedule_async_request(save(state, ckpt, overwrite=True, async_sharded_save=True))
    queue.maybe_finalize_async_calls(blocking=True)
"""


@pytest.mark.parametrize("before,mode", [("nothing", "sync"), ("a checkpoint", "sync"), ("a checkpoint", "async")])
def test_a_writer_killed_while_writing_a_pack_commits_nothing_and_the_next_save_works(
    tmp_path: Path, before: str, mode: str,
) -> None:
    ckpt, ready = tmp_path / "ckpt", tmp_path / "ready"
    if before == "a checkpoint":
        save(_sd(_tensors(1.0)), str(ckpt))
    writer = ForkedPython([sys.executable, "-c", _KILLED_WRITER, str(ckpt), str(ready), mode])
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            try:
                code = writer.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                assert time.monotonic() < deadline, "the writer never reached its pack"
                continue
            raise AssertionError(f"the writer ended ({code}) before its pack: {writer.stderr.read().decode()}")
        half = Path(ready.read_text())
        assert half.name == "0-0.zip" and half.stat().st_size > 0
        writer.send_signal(signal.SIGKILL)
        assert writer.wait(timeout=60) == -signal.SIGKILL
    finally:
        writer.kill()
    if before == "a checkpoint":
        _assert_holds(ckpt, _tensors(1.0))  # still the old one, whole
    else:
        _assert_not_committed(ckpt, _tensors(2.0))
    save(_sd(_tensors(3.0)), str(ckpt), overwrite=True)
    _assert_holds(ckpt, _tensors(3.0))
    assert not half.exists(), "the killed save's half pack was kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "ready"]


# ------------------------------------------------------------ 3. bytes changed while a pack is written


def _changed_before_the_packs_are_laid_out(monkeypatch: pytest.MonkeyPatch, source: torch.Tensor) -> None:
    """``source`` changes through NumPy (no version counter moves) once the packed chunks
    are encoded, before they are laid out in the pack and written: the pack holds views
    of the bytes it writes (``format.packs.PackCollector``)."""
    from shardstore.execution import save as save_execution

    real = save_execution.write_packs

    def write_packs(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        source.numpy()[:5] = -1
        return real(*args, **kwargs)

    monkeypatch.setattr(save_execution, "write_packs", write_packs)


def test_an_async_packed_save_writes_the_values_at_the_call_whatever_changes_during_its_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As an async save of arrays of their own (``test_changed_bytes_while_saving``):
    the pack is written from the host snapshot taken before ``save`` returned."""
    from shardstore.strategies.async_utils import AsyncCallsQueue

    tensors = _tensors(1.0)
    originals = {k: t.clone() for k, t in tensors.items()}
    _changed_before_the_packs_are_laid_out(monkeypatch, tensors["layer2/w"])
    queue = AsyncCallsQueue()
    queue.schedule_async_request(save(_sd(tensors), str(tmp_path / "ckpt"), async_sharded_save=True))
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    assert tensors["layer2/w"][0] == -1  # the change happened during the writes
    _assert_holds(tmp_path / "ckpt", originals)


def test_a_sync_packed_save_fails_where_a_tensor_changed_before_its_pack_was_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sync save packs views of the tensors' own bytes: a pack written after a change
    would hold bytes its crc32c does not match. The save compares and fails instead."""
    tensors = _tensors(1.0)
    _changed_before_the_packs_are_laid_out(monkeypatch, tensors["layer2/w"])
    ckpt = tmp_path / "ckpt"
    with pytest.raises(CheckpointingException, match=r"tensor 'layer2/w' changed while the save read it"):
        save(_sd(tensors), str(ckpt))
    _assert_not_committed(ckpt, tensors)
    monkeypatch.undo()
    save(_sd(tensors), str(ckpt))
    _assert_holds(ckpt, tensors)


# ------------------------------------------------------------ 4. damaged packs


def _damage(location, rel: str, how: str, at: int) -> None:  # noqa: ANN001 - a Location
    data = bytearray(location.store.get(rel))
    if how == "flip":
        data[at] ^= 0x40
    else:
        del data[len(data) // 2 :]
    location.store.put(rel, bytes(data))


@pytest.mark.parametrize("how", ["flip", "truncate"])
@pytest.mark.parametrize("where", ["file", pytest.param("s3", marks=pytest.mark.integration)])
def test_a_damaged_pack_is_reported_naming_the_array_and_the_checkpoint(
    tmp_path: Path, request: pytest.FixtureRequest, how: str, where: str,
) -> None:
    if where == "s3":
        from tests.s3_support import s3_options

        server = request.getfixturevalue("moto_server")
        server.create_bucket("packfaults")
        url = f"s3://packfaults/{how}"
        location = open_location(url, options=s3_options(server.endpoint))
    else:
        url = str(tmp_path / "ckpt")
        location = open_location(url)
    tensors = _tensors(1.0)
    save(_sd(tensors), location)
    array = read_commit_record(location).arrays["layer4/w"]  # in the pack's second half
    _damage(location, array.pack, how, array.chunk_offsets[0] + 5)
    report = verify(location)
    assert not report.ok
    assert ("layer4/w", "c.0") in {(p.key, p.part) for p in report.problems}, report
    assert url in str(report)
    with pytest.raises(CheckpointingException, match=rf"(?s)(?=.*{url}/packs/0-0\.zip)(?=.*'layer4/w')"):
        load(_sd({"layer4/w": tensors["layer4/w"]}, empty=True), location)
    # all of them: read in one run from the first (a truncated pack names the run's first array)
    with pytest.raises(CheckpointingException, match=rf"(?s)(?=.*{url}/packs/0-0\.zip)(?=.*'layer[04]/w')"):
        load(_sd(tensors, empty=True), location)


# ------------------------------------------------------------ 5. one rank's pack write fails


def one_ranks_pack_write_fails(rank: int, world: int, ckpt: str) -> list[str]:
    """A sync save, then an async one (its failure raised by the finalization), each
    over ``ckpt``, rank 1's pack write failing: each rank's error of each."""
    from shardstore.strategies.async_utils import AsyncCallsQueue

    if rank == 1:
        real = FileChunkStore.put

        def put(self: FileChunkStore, rel: str, buffers):  # noqa: ANN001, ANN202
            if rel.startswith("packs/"):
                raise OSError(errno.ENOSPC, "No space left on device", self.describe(rel))
            return real(self, rel, buffers)

        FileChunkStore.put = put
    messages = []
    for mode in ("sync", "async"):
        try:
            if mode == "sync":
                save(_sd(_tensors(2.0, rank)), ckpt, overwrite=True)
            else:
                queue = AsyncCallsQueue()
                queue.schedule_async_request(save(_sd(_tensors(2.0, rank)), ckpt, overwrite=True,
                                                  async_sharded_save=True))
                queue.close()
        except CheckpointingException as exc:
            messages.append(str(exc))
            continue
        raise AssertionError(f"rank {rank}'s {mode} save returned")
    return messages


def two_ranks_save(rank: int, world: int, ckpt: str, value: float) -> None:
    save(_sd(_tensors(value, rank)), ckpt, overwrite=True)


def test_one_ranks_failing_pack_write_fails_every_rank_sync_and_async_and_nothing_is_committed(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    both = {**_tensors(1.0, 0), **_tensors(1.0, 1)}
    save(_sd(both), str(ckpt))  # one process's save: the checkpoint the failed one would replace
    messages = sum(run_distributed(one_ranks_pack_write_fails, 2, str(ckpt)), [])
    assert len(messages) == 4
    for message in messages:
        assert str(ckpt) in message and "No space left on device" in message and "rank(s) 1" in message, message
        assert "packs/1-0.zip" in message, message
    _assert_holds(ckpt, both)  # the replaced checkpoint, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    run_distributed(two_ranks_save, 2, str(ckpt), 3.0)
    _assert_holds(ckpt, {**_tensors(3.0, 0), **_tensors(3.0, 1)})
    assert sorted(read_commit_record(open_location(str(ckpt))).packs) == ["packs/0-0.zip", "packs/1-0.zip"]


# ------------------------------------------------------------ 6. a writer of another process


def test_a_packed_save_written_by_another_process_commits_and_loads(tmp_path: Path) -> None:
    """Megatron's persistent worker pickles the request and runs its writes in another
    process; here the pickled request's writes run after the tensors changed."""
    import pickle

    from shardstore.compat.megatron.strategies.forked_writes import for_another_process
    from shardstore.strategies.async_utils import AsyncRequest

    tensors = _tensors(1.0)
    originals = {k: t.clone() for k, t in tensors.items()}
    request = for_another_process(save(_sd(tensors), tmp_path / "ckpt", async_sharded_save=True), AsyncRequest)
    for t in tensors.values():
        t.numpy()[:] = -1
    copy = pickle.loads(pickle.dumps(request))
    copy.async_fn(*copy.async_fn_args)
    for finalize in request.finalize_fns:
        finalize()
    _assert_holds(tmp_path / "ckpt", originals)


@pytest.mark.slow
@pytest.mark.integration  # the helper starts the process, where conftest does not look
def test_a_packed_save_written_by_a_spawned_process_commits_and_loads(tmp_path: Path) -> None:
    """The same in a spawned process, as Megatron's persistent worker runs it (a fresh
    interpreter: about 5 s)."""
    from shardstore.compat.megatron.strategies.forked_writes import for_another_process
    from shardstore.strategies.async_utils import AsyncRequest
    from tests.test_async_handoff import _run_in_spawned_process

    tensors = _tensors(1.0)
    originals = {k: t.clone() for k, t in tensors.items()}
    request = for_another_process(save(_sd(tensors), tmp_path / "ckpt", async_sharded_save=True), AsyncRequest)
    for t in tensors.values():
        t.numpy()[:] = -1
    assert _run_in_spawned_process(request) == 0
    for finalize in request.finalize_fns:
        finalize()
    _assert_holds(tmp_path / "ckpt", originals)


def test_a_pack_write_failing_in_another_process_is_raised_by_the_finalization(tmp_path: Path) -> None:
    import pickle

    from shardstore.compat.megatron.strategies.forked_writes import for_another_process
    from shardstore.strategies.async_utils import AsyncRequest

    ckpt = tmp_path / "ckpt"
    request = for_another_process(save(_sd(_tensors(1.0)), ckpt, async_sharded_save=True), AsyncRequest)
    (staging,) = [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt")]
    (staging / "packs").mkdir(exist_ok=True)
    (staging / "packs" / "0-0.zip").mkdir()  # in the way of the pack
    copy = pickle.loads(pickle.dumps(request))
    copy.async_fn(*copy.async_fn_args)  # reports, does not raise (a worker's loop would end)
    with pytest.raises(CheckpointingException, match=rf"(?s)background write of rank 0 into .*{ckpt}.*packs/0-0\.zip"):
        for finalize in request.finalize_fns:
            finalize()
    _assert_not_committed(ckpt, _tensors(1.0))
    save(_sd(_tensors(2.0)), ckpt)
    _assert_holds(ckpt, _tensors(2.0))


# ------------------------------------------------------------ S3: a pack PUT that fails


@pytest.mark.integration
def test_a_failing_pack_put_on_s3_gives_the_claim_up_once_and_the_next_save_works(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """The failed save gives its claim up, once: it was abandoned a second time by
    ``save``'s own clean-up, which warned that another save had taken the prefix over
    (none had). What it wrote stays under its given-up claim, which the next save takes
    over at once, removing it."""
    from shardstore.format.records.claim_document import ABANDONED, ClaimDocument
    from shardstore.stores.s3 import S3ChunkStore
    from tests.s3_support import s3_options

    server = request.getfixturevalue("moto_server")
    server.create_bucket("packfaults-put")
    location = open_location("s3://packfaults-put/ckpt", options=s3_options(server.endpoint))
    real = S3ChunkStore.put

    def put(self: S3ChunkStore, rel: str, buffers):  # noqa: ANN001, ANN202
        if rel.startswith("packs/"):
            raise OSError(errno.EIO, "the PUT failed", self.describe(rel))
        return real(self, rel, buffers)

    monkeypatch.setattr(S3ChunkStore, "put", put)
    with pytest.raises(CheckpointingException, match=r"(?s)s3://packfaults-put/ckpt.*the PUT failed.*packs/0-0\.zip"):
        save(_sd(_tensors(1.0)), location)
    assert "no longer its own" not in caplog.text and "took the prefix over" not in caplog.text, caplog.text
    claim = ClaimDocument.parse(location.read_bytes("zarr.json"))
    assert claim is not None and claim.state == ABANDONED
    monkeypatch.undo()
    save(_sd(_tensors(2.0)), location)
    _assert_holds(location, _tensors(2.0))


def test_closing_a_queue_after_a_failed_pack_write_still_commits_the_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two async saves in flight, the first one's pack write failing: ``close()``
    raises the first's failure naming each save's outcome, and commits the second."""
    from shardstore.strategies.async_utils import AsyncCallsQueue

    first, second = tmp_path / "a", tmp_path / "b"
    real = FileChunkStore.put

    def put(self: FileChunkStore, rel: str, buffers):  # noqa: ANN001, ANN202
        if rel.startswith("packs/") and "/.a." in self.describe(rel):
            raise OSError(errno.ENOSPC, "No space left on device", self.describe(rel))
        return real(self, rel, buffers)

    monkeypatch.setattr(FileChunkStore, "put", put)
    queue = AsyncCallsQueue()
    for path, value in ((first, 1.0), (second, 2.0)):
        queue.schedule_async_request(save(_sd(_tensors(value)), str(path), async_sharded_save=True))
    with pytest.raises(CheckpointingException) as raised:
        queue.close()
    message = str(raised.value)
    assert "No space left on device" in message and "packs/0-0.zip" in message, message
    assert f"{first}: not committed" in message and f"{second}: committed" in message, message
    assert queue.get_num_unfinalized_calls() == 0
    _assert_not_committed(first, _tensors(1.0))
    _assert_holds(second, _tensors(2.0))
