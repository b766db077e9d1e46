"""The typed async hand-off (issue 24.4): a request's finalize steps are ``Finalization``s
(``finalize(error)``, ``abort()``) or plain callables, as Megatron-Core's requests hold."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from shardstore import CheckpointingException, StorageLayout
from shardstore.execution.pipeline import SaveFinalization
from shardstore.strategies.async_utils import AsyncCallsQueue, AsyncRequest, Finalization


@dataclass
class Recorded:
    """A Finalization that records what it was given."""

    checkpoint: str = "/ckpt/recorded"
    calls: list = field(default_factory=list)

    def finalize(self, error: BaseException | None) -> None:
        self.calls.append(("finalize", error))

    def abort(self) -> None:
        self.calls.append(("abort",))

# a chunk file linked from the base and an array directory put in the way: per-array storage
PER_ARRAY = StorageLayout(pack_arrays_up_to=0)


def test_shardstores_finalization_is_typed_and_a_plain_callable_is_not() -> None:
    pipeline = SimpleNamespace(describe=lambda: "/ckpt/a")
    assert isinstance(SaveFinalization(pipeline), Finalization)
    assert isinstance(Recorded(), Finalization)
    assert not isinstance(lambda: None, Finalization)


def test_a_finalization_gets_the_background_error_and_a_plain_callable_is_refused_it() -> None:
    step, plain_calls = Recorded(), []
    failing = AsyncRequest(async_fn=lambda: 1 / 0, finalize_fns=[step])
    failing.execute_sync()
    assert step.calls[0][0] == "finalize" and isinstance(step.calls[0][1], ZeroDivisionError)
    with pytest.raises(CheckpointingException, match="Async checkpoint save failed"):
        AsyncRequest(async_fn=lambda: 1 / 0, finalize_fns=[lambda: plain_calls.append(1)]).execute_sync()
    assert plain_calls == []


def test_closing_a_queue_with_abort_aborts_typed_steps_only() -> None:
    step, plain_calls = Recorded(), []
    queue = AsyncCallsQueue()
    queue.schedule_async_request(AsyncRequest(async_fn=None, finalize_fns=[step, lambda: plain_calls.append(1)]))
    queue.close(abort=True)
    assert step.calls == [("abort",)] and plain_calls == []


def _run_in_spawned_process(request: AsyncRequest) -> int:
    """What Megatron's persistent checkpoint worker does with a request: pickles it
    into a spawned process, which runs its ``async_fn``; the exit status."""
    import multiprocessing

    process = multiprocessing.get_context("spawn").Process(target=request.async_fn, args=request.async_fn_args)
    process.start()
    process.join(timeout=120)
    return process.exitcode


def test_a_save_written_by_a_spawned_process_commits_and_reuses(tmp_path) -> None:
    """Megatron's persistent worker (``AsyncCallsQueue(persistent=True)``) pickles the
    request: the pending save held a lock and a descriptor, so the worker dropped it and
    the queue waited forever. The spawned writer shares the unchanged chunk with the
    checkpoint it reuses from (a hard link), and the finalization commits here."""
    import torch

    from shardstore import ShardedTensor, load, save, verify
    from shardstore.compat.megatron.strategies.forked_writes import for_another_process

    state = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(4096.0)), "step": 2}
    save(state, tmp_path / "step1", layout=PER_ARRAY)
    request = for_another_process(
        save(state, tmp_path / "step2", async_sharded_save=True, reuse_from=tmp_path / "step1", layout=PER_ARRAY),
        AsyncRequest,
    )
    assert _run_in_spawned_process(request) == 0
    for finalize in request.finalize_fns:
        finalize()
    assert verify(tmp_path / "step2").ok and load(state, tmp_path / "step2")["step"] == 2
    assert (tmp_path / "step2/w/c.0").stat().st_ino == (tmp_path / "step1/w/c.0").stat().st_ino
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step1", "step2"]


def test_a_spawned_writers_failure_is_raised_by_the_finalization_not_by_the_worker(tmp_path) -> None:
    """An exception would end Megatron's persistent worker loop (and hang its queue):
    the writer reports it, exits normally, and the finalization raises it."""
    import torch

    from shardstore import ShardedTensor, save
    from shardstore.compat.megatron.strategies.forked_writes import for_another_process

    request = for_another_process(
        save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(8))}, tmp_path / "ckpt", async_sharded_save=True,
             layout=PER_ARRAY),
        AsyncRequest,
    )
    (staging,) = [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt")]
    (staging / "w").write_text("in the way of the array's directory")
    assert _run_in_spawned_process(request) == 0
    with pytest.raises(CheckpointingException, match=r"(?s)background write of rank 0 into .* failed.*w/zarr.json"):
        for finalize in request.finalize_fns:
            finalize()
    assert not (tmp_path / "ckpt").exists()


def test_a_forked_writer_leaves_the_commit_records_encoding_to_the_committer(tmp_path, monkeypatch) -> None:
    """Megatron's temporal writer forks: the child holds the coordinator's commit
    record, but the finalization in the training process commits and encodes it.
    Encoding it ahead in the child (``CommitRecord.encode_ahead``, during ``syncfs``)
    was CPU spent beside the training loop for nothing."""
    import multiprocessing
    import os

    import torch

    from shardstore import ShardedTensor, save, verify
    from shardstore.compat.megatron.strategies.forked_writes import for_another_process
    from shardstore.format.records import CommitRecord

    encoded_in = tmp_path / "encoded-in"
    original = CommitRecord.encode_ahead

    def encode_ahead(self: CommitRecord) -> None:
        with open(encoded_in, "a") as f:
            f.write(f"{os.getpid()}\n")
        original(self)

    monkeypatch.setattr(CommitRecord, "encode_ahead", encode_ahead)
    request = for_another_process(
        save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(64.0))}, tmp_path / "ckpt",
             async_sharded_save=True),
        AsyncRequest,
    )
    writer = multiprocessing.get_context("fork").Process(target=request.async_fn, args=request.async_fn_args)
    writer.start()
    writer.join(timeout=120)
    assert writer.exitcode == 0
    for finalize in request.finalize_fns:
        finalize()
    assert verify(tmp_path / "ckpt").ok
    assert not encoded_in.exists() or str(writer.pid) not in encoded_in.read_text().split()
    # in the training process's own background thread, it still encodes ahead
    save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(64.0))}, tmp_path / "ckpt2",
         async_sharded_save=True).execute_sync()
    assert str(os.getpid()) in encoded_in.read_text().split()


def test_a_failed_plain_step_is_handed_to_the_later_finalization_and_stops_later_plain_steps() -> None:
    """A plain step that raised stopped the request: a Finalization after it, collective,
    was not run on this rank while the other ranks waited in it. Now it runs, handed the
    failure (so the save fails on every rank), and later plain steps are skipped."""
    step, plain_calls = Recorded(), []

    def tracker() -> None:
        raise OSError("cannot write the tracker file")

    queue = AsyncCallsQueue()
    queue.schedule_async_request(
        AsyncRequest(async_fn=None, finalize_fns=[tracker, step, lambda: plain_calls.append(1)])
    )
    with pytest.raises(CheckpointingException, match=r"/ckpt/recorded: not committed on rank\(s\) 0: OSError: cannot write"):
        queue.close()
    assert [call[0] for call in step.calls] == ["finalize"] and isinstance(step.calls[0][1], OSError)
    assert plain_calls == [] and queue.get_num_unfinalized_calls() == 0


@dataclass
class FailingAbort(Recorded):
    """A Finalization whose abort raises."""

    def abort(self) -> None:
        super().abort()
        raise OSError("cannot close the save's files")


def test_closing_with_abort_aborts_every_save_even_after_an_abort_failed() -> None:
    """``close(abort=True)`` stopped at the first ``abort()`` that raised: the saves after
    it kept their locks and descriptors, and the error named none of them."""
    failing, later = FailingAbort(checkpoint="/ckpt/a"), Recorded(checkpoint="/ckpt/b")
    queue = AsyncCallsQueue()
    for step in (failing, later):
        queue.schedule_async_request(AsyncRequest(async_fn=None, finalize_fns=[step]))
    with pytest.raises(CheckpointingException, match=r"(?s)dropped /ckpt/a, /ckpt/b uncommitted.*aborting /ckpt/a "
                       r"failed: OSError: cannot close"):
        queue.close(abort=True)
    assert failing.calls == [("abort",)] and later.calls == [("abort",)]
    assert queue.get_num_unfinalized_calls() == 0


def test_closing_twice_does_nothing_the_second_time(monkeypatch) -> None:
    """A second ``close()`` ran the ranks' agreement (an ``all_reduce``) again, which the
    other ranks, closed once, never joined."""
    step = Recorded()
    queue = AsyncCallsQueue()
    queue.schedule_async_request(AsyncRequest(async_fn=None, finalize_fns=[step]))
    queue.close()
    agreements = []
    monkeypatch.setattr(queue, "_finished_everywhere", lambda no_dist: agreements.append(no_dist) or 0)
    queue.close()
    queue.close(abort=True)
    assert agreements == [] and step.calls == [("finalize", None)]


def test_a_queue_scheduled_from_one_thread_and_finalized_from_others_loses_nothing() -> None:
    """A training thread schedules while helper threads finalize (``no_dist``). The
    finalizers iterated the pending requests while the scheduler appended to them and
    died with a bare ``RuntimeError: deque mutated during iteration``; two finalizers
    could pop the same ready request. Now every request is finalized exactly once, in
    order, whatever thread calls."""
    import threading
    import time

    queue = AsyncCallsQueue()
    finalized: list[int] = []
    errors: list[BaseException] = []
    scheduled = 2000
    done = threading.Event()

    def schedule() -> None:
        try:
            for n in range(scheduled):
                queue.schedule_async_request(AsyncRequest(None, finalize_fns=[lambda n=n: finalized.append(n)]))
        finally:
            done.set()

    def finalize() -> None:
        try:
            while not done.is_set() or queue.get_num_unfinalized_calls():
                queue.maybe_finalize_async_calls(no_dist=True)
                time.sleep(0)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=schedule)] + [threading.Thread(target=finalize) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    queue.close()
    assert not errors, errors
    assert finalized == list(range(scheduled)), "a request was finalized twice, out of order, or not at all"


def test_a_writer_that_cannot_leave_its_report_still_does_not_raise(tmp_path, monkeypatch) -> None:
    """The disk is full: the chunk writes fail, and so does the writer's report of that
    failure. The report's OSError escaped ``write_and_report``, which ends Megatron's
    persistent worker loop, whose queue then waits forever for this request and every
    later one. Now the writer logs it and returns; the finalization finds no report and
    fails, naming the rank, with nothing committed."""
    import errno

    import torch

    from shardstore import ShardedTensor, save
    from shardstore.compat.megatron.strategies import forked_writes
    from shardstore.stores.base import Location

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    request = forked_writes.for_another_process(
        save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(8))}, tmp_path / "ckpt", async_sharded_save=True,
             layout=PER_ARRAY),
        AsyncRequest,
    )
    monkeypatch.setattr(forked_writes, "write_staged", full)
    with monkeypatch.context() as patched:
        patched.setattr(Location, "write_atomic", full)
        request.async_fn(*request.async_fn_args)  # as the worker runs it: must not raise
    with pytest.raises(CheckpointingException, match=r"background write of rank 0 into .* left no report"):
        for finalize in request.finalize_fns:
            finalize()
    assert not (tmp_path / "ckpt").exists()


def test_a_request_for_another_process_leaves_the_host_snapshot_behind(tmp_path, monkeypatch) -> None:
    """The snapshot of an async save holds the copy streams of its CUDA copies
    (``torch.cuda.Stream``, which Megatron's persistent worker cannot pickle) and the
    pool of pinned buffers kept from earlier saves; the writer needs neither (its writes
    point into the host copies themselves, which travel with them). Before, the request
    pickled the snapshot: here, copy streams that refuse pickling, as CUDA's do, failed
    the pickle."""
    import pickle

    import torch

    from shardstore import ShardedTensor, save, verify
    from shardstore.compat.megatron.strategies.forked_writes import for_another_process
    from shardstore.execution import staging

    class StreamsThatDoNotPickle(staging._CopyStreams):
        def __reduce_ex__(self, protocol: object) -> object:
            raise TypeError("cannot pickle 'torch.cuda.Stream' object")

    monkeypatch.setattr(staging, "_CopyStreams", StreamsThatDoNotPickle)
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(64.0))}
    request = for_another_process(save(state, tmp_path / "ckpt", async_sharded_save=True), AsyncRequest)
    copy = pickle.loads(pickle.dumps(request))
    copy.async_fn(*copy.async_fn_args)  # the writer's part, as the worker runs it
    for finalize in request.finalize_fns:
        finalize()
    assert verify(tmp_path / "ckpt").ok



def _megatron_style_request(live, staged: list, written: list) -> AsyncRequest:
    """A request built as Megatron-Core's torch_dist strategy builds one: ``async_fn``
    writes ``async_fn_args[1]`` (the write buckets, still on the device), and
    ``preload_fn`` returns their host copies (kept in ``staged``), which take that
    argument's place."""

    def write(rank: int, buckets, results: list) -> None:
        written.append(buckets)

    def preload():
        staged.append(live.clone())
        return staged[-1]

    return AsyncRequest(async_fn=write, async_fn_args=(0, live, []), finalize_fns=[lambda: None], preload_fn=preload)


@pytest.mark.parametrize("run", ["queue", "execute_sync"])
def test_a_preloaded_request_writes_what_its_preload_staged(run: str) -> None:
    """Megatron-Core's ``AsyncRequest.preload_fn`` stages the tensors to host memory, and
    its result replaces ``async_fn_args[1]`` (Megatron's ``execute_sync`` and both of its
    async callers). Ours called it and dropped its result: ``async_fn`` wrote the live
    tensors, so the checkpoint held the values they had when the background write ran
    (here, after the training step changed them), not at the call."""
    import time

    import torch

    live, staged, written = torch.arange(8.0), [], []
    request = _megatron_style_request(live, staged, written)
    if run == "execute_sync":
        request.execute_sync()
    else:
        queue = AsyncCallsQueue()
        gate = queue._worker.submit(time.sleep, 0.5)  # the I/O runs after the training step
        queue.schedule_async_request(request)
        live.fill_(-1.0)  # the training step changes the tensor in place
        gate.result()
        queue.close()
    assert len(staged) == 1 and len(written) == 1 and written[0] is staged[0], "async_fn did not get the preload's copy"
    assert torch.equal(written[0], torch.arange(8.0)), written


def test_a_report_left_by_an_earlier_save_into_the_directory_is_not_taken(tmp_path) -> None:
    """Megatron-Core saves into a directory that an earlier, crashed save wrote into
    (it only warns, "Overwriting old incomplete / corrupted checkpoint"). The crashed
    save's background writer had left its report; the new save's writer died without
    one. Before, the finalization read the old report as the new save's and committed
    the old chunks' checksums: the checkpoint verified and loaded the crashed save's
    values. Now a report names its save, and one of another save is no report."""
    import torch

    from shardstore import ShardedTensor, verify
    from shardstore.compat.megatron.strategies.forked_writes import for_another_process
    from shardstore.strategies.zarr import ZarrSaveShardedStrategy

    ckpt = tmp_path / "iter_0000010"
    ckpt.mkdir()

    def request(value: float) -> AsyncRequest:
        state = {"w": ShardedTensor.from_rank_offsets("w", torch.full((8,), value))}
        return for_another_process(ZarrSaveShardedStrategy().async_save(state, ckpt), AsyncRequest)

    crashed = request(1.0)
    crashed.async_fn(*crashed.async_fn_args)  # written and reported; the job died before its finalization
    again = request(2.0)  # its writer dies before writing anything
    with pytest.raises(CheckpointingException, match=r"background write of rank 0 into .* left no report"):
        for finalize in again.finalize_fns:
            finalize()
    assert not verify(ckpt).ok  # nothing committed
