"""Async save requests and the queue that runs and finalizes them (Megatron-Core semantics).

An ``AsyncRequest`` is a function that does the storage I/O (``async_fn``) plus the
functions that finalize the save once every rank's I/O is done (``finalize_fns``, which
include writing the commit record). ``AsyncCallsQueue`` schedules requests and
finalizes them in order.

Background I/O runs on one worker thread per queue, requests in scheduling order.
A thread, not a process: shardstore's I/O (``chunk_io``: ``os.writev`` and ``crc32c``;
TensorStore for object storage) releases the GIL, and a worker process would need the
staged host buffers in shared memory and a pickled copy of the plan for every save,
without saving any CPU (the kernel's copy into the page cache and the crc32c cost the
same wherever they run). One I/O thread by default
(``ZarrSaveShardedStrategy(background_io_threads=1)``): every extra runnable thread
takes a share of a core from the training loop.

The I/O thread runs at a lower CPU priority, nice 10 by default
(``AsyncCallsQueue(io_priority="low")``): on saturated cores it leaves the training
loop most of its rate, with a worst step gap close to normal priority's. ``"idle"``
(Linux SCHED_IDLE) yields more CPU, but when the cores are saturated the thread can be
preempted while it holds the GIL, and the training thread waits with it. Pass
``io_priority="normal"`` when the save's duration matters more than the loop's rate.
The figures: docs/measurements/performance.md ("Asynchronous saves and the training
loop").

The blocking part of a save is done before the request exists: host snapshot of the
tensors plus the metadata exchange.

``maybe_finalize_async_calls`` is collective: the ranks agree (one ``all_reduce`` on
the group's device) on which requests have finished everywhere, then finalize those,
oldest first. A failure in the background, or of a finalize step on any rank, surfaces
there, on every rank, once every ready request is finalized, and a checkpoint that
failed gets no commit record; a rank that died makes the others raise a
CheckpointingException naming the checkpoints left uncommitted. Finalize steps that
are collective must be ``Finalization``s: a plain callable is taken for a local step.
"""

from __future__ import annotations

__all__ = ["AsyncCallsQueue", "AsyncRequest", "Finalization", "IO_PRIORITIES"]

import logging
import os
import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import torch.distributed as dist

from shardstore.errors import CheckpointingException
from shardstore.protocol.collectives import Group

logger = logging.getLogger(__name__)

# CPU priority of the background I/O thread: "idle" (Linux SCHED_IDLE: runs on CPU
# time nothing else wants, but can stall the trainer on the GIL), "low" (nice 10) or
# "normal". See the module docstring.
IO_PRIORITIES = ("idle", "low", "normal")
DEFAULT_IO_PRIORITY = "low"
LOW_PRIORITY_NICE = 10


@runtime_checkable
class Finalization(Protocol):
    """A typed finalize step of an ``AsyncRequest`` (shardstore's own saves:
    ``execution.save.SaveFinalization``): it is given the background I/O's error, so it
    can tell every rank (collective), and it can be dropped locally. A plain callable,
    as Megatron-Core's requests hold, is called without arguments, only on success."""

    checkpoint: str  # what it commits, named in errors

    def finalize(self, error: BaseException | None) -> None:
        """Collective: commits, or raises the same error on every rank."""

    def abort(self) -> None:
        """Local: lets go of what the save holds, commits nothing."""


@dataclass(frozen=True)
class AsyncRequest:
    """A save whose I/O may run in the background.

    Attributes:
        async_fn: does the I/O; None when there is nothing to do in the background.
        async_fn_args: positional arguments of ``async_fn``.
        finalize_fns: run on every rank, in order, after ``async_fn`` finished on all
            ranks; collective (they agree on success and commit).
        async_fn_kwargs: keyword arguments of ``async_fn``.
        preload_fn: run before scheduling (Megatron-Core's meaning: stages the tensors
            to host memory); its result takes the place of ``async_fn_args[1]`` (the
            tensors to stage), so that ``async_fn`` writes the copies
            (``_with_preloaded_args``). When it raises, ``async_fn`` does not run and the
            save fails on every rank: the error is handed to the finalize steps as an I/O
            error is (``execute_sync``; in a queue, at the next finalize).
        is_frozen: a frozen request accepts no more finalize functions.
        call_idx: position in the queue, set when scheduled.
    """

    async_fn: Callable[..., Any] | None
    async_fn_args: tuple = ()
    finalize_fns: list[Finalization | Callable[[], Any]] = field(default_factory=list)
    async_fn_kwargs: dict[str, Any] = field(default_factory=dict)
    preload_fn: Callable[[], Any] | None = None
    is_frozen: bool = False
    call_idx: int = 0

    def add_finalize_fn(self, fn: Finalization | Callable[[], Any]) -> None:
        """Appends a finalize function (not allowed once frozen)."""
        if self.is_frozen:
            raise RuntimeError("Cannot add finalize functions to a frozen AsyncRequest")
        self.finalize_fns.append(fn)

    def execute_sync(self) -> None:
        """Runs the whole request in the caller: preload, I/O, then every finalize step
        (``_finalize_steps``), and raises the first failure.

        A preload or I/O error is handed to the finalize steps rather than raised at
        once: they are collective, and the other ranks are waiting in them to hear
        about it.
        """
        request, error = _preloaded(self)
        if error is None and request.async_fn is not None:
            try:
                request.async_fn(*request.async_fn_args, **request.async_fn_kwargs)
            except Exception as exc:  # the finalize step tells every rank (collective)
                error = exc
        failure = _finalize_steps(self.call_idx, self.finalize_fns, error).error
        if error is not None and not isinstance(error, Exception):
            raise error  # an interrupt of the preload stays one, once every rank was told
        if failure is not None:
            raise failure

    def freeze(self) -> AsyncRequest:
        """A frozen copy (no more finalize functions)."""
        return replace(self, is_frozen=True, finalize_fns=list(self.finalize_fns))


class AsyncCallsQueue:
    """Schedules async save requests, runs their I/O in the background, finalizes them
    in order.

    Threads may share a queue: scheduling takes a short lock, and finalizations (and
    ``close``) run one at a time, so each request is finalized once, in order. A
    collective finalization still needs its group to itself: finalize from another
    thread than the training loop's only with ``no_dist``, or on a process group that
    no other thread uses meanwhile.

    Args:
        persistent: accepted for API compatibility; the worker thread always persists
            for the queue's lifetime.
        process_group: the ranks that finalize together (default: the world).
        io_priority: CPU priority of the background I/O thread and the threads it
            starts: "low" (default; nice 10), "idle" (Linux SCHED_IDLE: yields the most
            CPU, but may stall the training thread on the GIL for hundreds of ms on
            saturated cores) or "normal" (the caller's). Only
            applied on Linux, where priority is per thread.
    """

    def __init__(
        self, persistent: bool = True, process_group: dist.ProcessGroup | None = None,
        io_priority: str = DEFAULT_IO_PRIORITY,
    ) -> None:
        if io_priority not in IO_PRIORITIES:
            raise ValueError(f"io_priority must be one of {IO_PRIORITIES}, not {io_priority!r}")
        self.persistent = persistent
        self.process_group = process_group
        self._worker = ThreadPoolExecutor(
            1, thread_name_prefix="shardstore-async-save", initializer=set_thread_priority, initargs=(io_priority,)
        )
        self._pending: deque[tuple[int, AsyncRequest, Future]] = deque()
        self._next_idx = 0
        self._closed = False
        self._distributed = False  # a request was scheduled while torch.distributed was initialized
        self._lock = threading.RLock()  # ``_pending``, ``_next_idx``, ``_closed`` (and a preload_fn)
        self._finalizing = threading.RLock()  # one finalization (or close) at a time
        # at exit, or once the queue is dropped: the saves it never finalized are named
        weakref.finalize(self, _warn_unfinalized, self._pending)

    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        """Starts the request's I/O in the background and returns its call index.

        Raises:
            BaseException: what the request's ``preload_fn`` raised. The request is
                queued all the same, failed, with no I/O run: the ranks' queues stay in
                step, and the next finalize fails the save on every rank (its
                Finalizations are handed the error) and goes on with the saves after it.
        """
        with self._lock:
            if self._closed:
                raise CheckpointingException("AsyncCallsQueue is closed; create a new one")
            idx = self._next_idx
            self._next_idx += 1
            request, error = _preloaded(replace(async_request.freeze(), call_idx=idx))
            self._distributed = self._distributed or dist.is_initialized()
            future = self._worker.submit(_run_io, request) if error is None else _failed(error)
            self._pending.append((idx, request, future))
        if error is not None:
            error.add_note(f"The async save of {_describe(idx, _checkpoints(request.finalize_fns))} stays queued, "
                           "failed: the next maybe_finalize_async_calls() (or close()) fails it on every rank.")
            raise error
        return idx

    def _pending_now(self) -> list[tuple[int, AsyncRequest, Future]]:
        """The requests pending now, oldest first (a copy: another thread may schedule)."""
        with self._lock:
            return list(self._pending)

    def _pop_oldest(self) -> tuple[int, AsyncRequest, Future]:
        with self._lock:
            return self._pending.popleft()

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> list[int]:
        """Finalizes the requests finished on every rank, oldest first; returns their
        call indices.

        Collective unless ``no_dist``: every rank must call it. Every ready request is
        finalized (``_finalize_steps``), even after a step of one of them failed: its
        Finalizations, collective, still run on every rank, so nobody waits in one alone.
        Then, when something was finalized, the ranks agree on the outcome (one
        ``all_reduce``, and a gather of the outcomes when a step failed on some rank
        only): a failure on any rank raises CheckpointingException on every rank, naming
        each request's outcome (a failure of the only request finalized, the same on
        every rank, is raised as it is). A save that failed has no commit record.
        """
        with self._finalizing:
            if blocking:
                for _, _, future in self._pending_now():
                    future.exception()  # waits
            ready = self._finished_everywhere(no_dist)
            finalized = [self._finalize_oldest() for _ in range(ready)]
            if finalized:
                self._raise_failures(finalized, no_dist)
            return [done.outcome.call_idx for done in finalized]

    def _finalize_oldest(self) -> _Finalized:
        """Pops the oldest request and runs its finalize steps; raises nothing."""
        idx, request, future = self._pop_oldest()
        return _finalize_steps(idx, request.finalize_fns, future.exception())

    def _raise_failures(self, finalized: list[_Finalized], no_dist: bool) -> None:
        """Collective unless ``no_dist``: raises, on every rank, when a finalize step of
        one of ``finalized`` (this call's requests, the same on every rank) failed on
        any rank; this rank's first failure is the cause."""
        by_rank = self._outcomes_everywhere([done.outcome for done in finalized], no_dist)
        if not any(outcome.failure for outcomes in by_rank.values() for outcome in outcomes):
            return
        cause = next((done.error for done in finalized if done.error is not None), None)
        if len(finalized) == 1 and len(by_rank) == 1 and finalized[0].outcome.everywhere:
            raise finalized[0].error  # names its checkpoint, as every rank says it
        raise CheckpointingException(_failure_report(by_rank)) from cause

    def _outcomes_everywhere(self, outcomes: list[_Outcome], no_dist: bool) -> dict[int, list[_Outcome]]:
        """Collective unless ``no_dist``: ``outcomes`` by group rank; every rank's when a
        step failed on some rank only (those of a Finalization are the same on every
        rank: this rank's view then suffices)."""
        group = Group(self.process_group)
        if no_dist or not group.active:
            return {group.rank: outcomes}
        local_failure = any(outcome.failure is not None and not outcome.everywhere for outcome in outcomes)
        try:
            if not group.reduce_over_ranks([int(local_failure)], "max", "async finalization outcome")[0]:
                return {group.rank: outcomes}
            return dict(enumerate(group.all_gather_object(outcomes)))
        except CheckpointingException as exc:
            lines = "\n".join(outcome.line() for outcome in outcomes)
            raise CheckpointingException(
                f"Finalized async checkpoint saves, but could not agree with the other ranks on how it went "
                f"({exc}); on this rank:\n{lines}\nCheck on each one (shardstore verify) before relying on it."
            ) from exc

    def _finished_everywhere(self, no_dist: bool) -> int:
        """How many of the oldest requests have finished on every rank."""
        pending = self._pending_now()
        done = 0
        for _, _, future in pending:
            if not future.done():
                break
            done += 1
        if no_dist:
            return done
        if not dist.is_initialized():
            if self._distributed and pending:
                raise CheckpointingException(
                    f"Async checkpoint save(s) of {_named(pending)} not committed: torch.distributed was shut down "
                    "(destroy_process_group) while they were pending, and their commit is collective. Finalize them "
                    "first (AsyncCallsQueue.close() on every rank), then call destroy_process_group()."
                )
            return done
        try:
            return Group(self.process_group).reduce_over_ranks([done], "min", "async finalization")[0]
        except CheckpointingException as exc:
            raise CheckpointingException(f"Async checkpoint save(s) of {_named(pending)} not committed: {exc}") from exc

    def get_num_unfinalized_calls(self) -> int:
        return len(self._pending)

    def close(self, abort: bool = False) -> None:
        """Finalizes everything still pending (collective, as
        ``maybe_finalize_async_calls(blocking=True)``), or, with ``abort``, waits for the
        I/O and drops it uncommitted (local: nothing is committed, and the next save into
        the same place removes what the dropped save wrote); stops the worker thread.
        What finalizing leaves pending (a lost peer) is dropped the same way. A second
        call does nothing.

        Raises:
            CheckpointingException: the finalization's failure, once what it left is
                dropped; else, every pending request having been tried, an ``abort()``
                that failed, or a request left pending without ``abort`` (ranks that
                scheduled different saves), naming each request dropped.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            with self._finalizing:
                failure = None if abort else self._finalize_all()
                dropped = self._drop_pending(expected=abort or failure is not None)
        finally:
            self._worker.shutdown(wait=True)
        if failure is not None:
            if dropped is not None:
                failure.add_note(str(dropped))
            raise failure
        if dropped is not None:
            raise dropped

    def _finalize_all(self) -> Exception | None:
        """``maybe_finalize_async_calls(blocking=True)``; its failure returned, not raised."""
        try:
            self.maybe_finalize_async_calls(blocking=True)
        except Exception as exc:  # close() raises it once what is left is dropped
            return exc
        return None

    def _drop_pending(self, expected: bool) -> CheckpointingException | None:
        """Local: waits for the I/O of every request still pending and drops each one
        uncommitted (its Finalizations' ``abort()``), every one even after an abort
        failed. Returns an error naming them when an abort failed, or when requests
        were left that were not ``expected`` to be."""
        dropped: list[str] = []
        failed: list[tuple[str, Exception]] = []
        while self._pending:
            idx, request, future = self._pop_oldest()
            future.exception()  # waits: the save's files are let go once nothing writes them
            dropped.append(_describe(idx, _checkpoints(request.finalize_fns)))
            error = _abort_steps(request.finalize_fns)
            if error is not None:
                failed.append((dropped[-1], error))
        if not failed and (expected or not dropped):
            return None
        said = "".join(f"\n  aborting {name} failed: {type(exc).__name__}: {exc}" for name, exc in failed)
        error = CheckpointingException(
            f"Closing the async save queue dropped {', '.join(dropped)} uncommitted"
            + ("" if expected else " (finished on this rank, not on every rank: did the ranks schedule the same saves?)")
            + f":{said}\nThey have no commit record: save them again (the next save into the same place removes "
            "what they wrote; what a failed abort holds is let go when this process exits)."
        )
        error.__cause__ = failed[0][1] if failed else None
        return error


def _named(pending: list[tuple[int, AsyncRequest, Future]]) -> list[str]:
    """The checkpoints the Finalizations of ``pending`` commit, sorted ("?" for a request
    of plain callables only)."""
    return sorted({fn.checkpoint if isinstance(fn, Finalization) else "?"
                   for _, request, _ in pending for fn in request.finalize_fns})


def _warn_unfinalized(pending: deque[tuple[int, AsyncRequest, Future]]) -> None:
    """WARNING naming the requests a queue still held when the process exited, or when
    the queue was dropped, without ``close()``: never finalized, they were never
    committed (their writes may even have been cut off by the interpreter's shutdown)."""
    if not pending:
        return
    names = ", ".join(_describe(idx, _checkpoints(request.finalize_fns)) for idx, request, _ in list(pending))
    logger.warning(
        "%d async checkpoint save(s) were never finalized, so never committed: %s. Call "
        "AsyncCallsQueue.close() (or maybe_finalize_async_calls(blocking=True)) on every rank before the process "
        "exits; the next save into the same place removes what they wrote.", len(pending), names,
    )


def set_thread_priority(priority: str) -> None:
    """Lowers the calling thread's CPU priority ("idle", "low"; "normal" leaves it).

    On Linux the scheduling policy and nice value belong to the thread, threads it
    starts inherit them, and lowering them needs no privilege. Elsewhere they would
    apply to the whole process, so nothing is done.
    """
    if priority == "normal" or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        if priority == "idle":
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        else:
            os.setpriority(os.PRIO_PROCESS, tid, LOW_PRIORITY_NICE)
    except OSError as exc:  # e.g. a seccomp profile forbids it: the save still works
        logger.warning("Could not lower the CPU priority of the async checkpoint I/O thread: %s", exc)


@dataclass(frozen=True)
class _Outcome:
    """How one request's finalization went on one rank; picklable, ranks exchange it."""

    call_idx: int
    checkpoints: tuple[str, ...]  # what its Finalizations commit (none: plain callables only)
    committed: bool  # a Finalization completed with nothing failed before it
    failure: str | None  # the first failure of its finalize steps
    everywhere: bool  # that failure was raised by a Finalization: every rank has it

    def describe(self) -> str:
        """The request as errors name it (``_describe``)."""
        return _describe(self.call_idx, self.checkpoints)

    @property
    def state(self) -> str:
        if self.failure is None:
            return "committed" if self.committed else "finalized"
        if self.committed:
            return "committed, but a later finalize step failed"
        return "not committed" if self.checkpoints else "failed"

    def line(self) -> str:
        """One line of a combined error: the request, its state, its failure."""
        if self.failure is None:
            return f"  {self.describe()}: {self.state}"
        return f"  {self.describe()}: {self.state}: {_indented(self.failure)}"


@dataclass(frozen=True)
class _Finalized:
    """One request finalized on this rank: its outcome and the exception behind it."""

    outcome: _Outcome
    error: BaseException | None


def _finalize_steps(
    call_idx: int, fns: list[Finalization | Callable[[], Any]], io_error: BaseException | None
) -> _Finalized:
    """Runs one request's finalize steps in order, given its background I/O's error;
    raises nothing (an ``Exception``), returns the first failure.

    Every Finalization runs, whatever failed before it: it is collective (the other
    ranks are in it), and it is handed the failure, so that the save fails on every rank
    rather than commit on some. A plain callable is a local step: it runs only while
    nothing has failed, the I/O included. A Finalization's failure (the same on every
    rank) is the one reported in place of a local one it was handed.
    """
    error: BaseException | None = None
    everywhere = committed = False
    for fn in fns:
        handed = io_error if error is None else error
        try:
            if isinstance(fn, Finalization):
                fn.finalize(handed)
                committed = committed or handed is None
            elif handed is None:
                fn()
            elif error is None:
                raise CheckpointingException(f"Async checkpoint save failed: {handed}") from handed
        except Exception as exc:  # the request's other steps still run; reported once all are done
            if error is None or (isinstance(fn, Finalization) and not everywhere):
                error, everywhere = exc, isinstance(fn, Finalization)
    failure = None if error is None else f"{type(error).__name__}: {error}"
    return _Finalized(_Outcome(call_idx, _checkpoints(fns), committed, failure, everywhere), error)


def _failure_report(by_rank: dict[int, list[_Outcome]]) -> str:
    """What every rank says when a finalize step failed: each request's outcome, the
    failing ranks named where a failure is not the same on every rank, what to do."""
    per_request = [dict(zip(by_rank, outcomes)) for outcomes in zip(*by_rank.values())]
    lines = [_request_line(outcomes) for outcomes in per_request]
    failed = [line for line, outcomes in zip(lines, per_request) if any(o.failure for o in outcomes.values())]
    return (
        f"Finalizing {len(lines)} async checkpoint save(s): {len(failed)} failed:\n" + "\n".join(lines)
        + "\nA save not committed has no commit record: save it again (the next save into the same place "
        "removes what it wrote). A committed one is complete; a step that failed after its commit (e.g. "
        "writing a tracker file) did not do its work: redo it, or save again."
    )


def _request_line(outcomes: dict[int, _Outcome]) -> str:
    """One request's line: its state and failure, by rank where the ranks differ."""
    failed = {rank: o for rank, o in outcomes.items() if o.failure is not None}
    first = next(iter(failed.values()), next(iter(outcomes.values())))
    if first.failure is None or all(o.everywhere for o in failed.values()):
        return first.line()
    ranks_by_failure: dict[str, list[int]] = {}
    for rank, outcome in failed.items():
        ranks_by_failure.setdefault(outcome.failure, []).append(rank)
    said = "; ".join(
        f"rank(s) {', '.join(map(str, ranks))}: {_indented(failure)}" for failure, ranks in ranks_by_failure.items()
    )
    return f"  {first.describe()}: {first.state} on {said}"


def _indented(text: str) -> str:
    """``text``'s later lines indented under a line of the combined error."""
    return text.replace("\n", "\n    ")


def _abort_steps(fns: list[Finalization | Callable[[], Any]]) -> Exception | None:
    """Local: aborts every Finalization among ``fns``, each even after one raised;
    returns the first failure."""
    first: Exception | None = None
    for fn in fns:
        if isinstance(fn, Finalization):
            try:
                fn.abort()
            except Exception as exc:  # the other steps still let go; close() raises it
                first = first or exc
    return first


def _describe(call_idx: int, checkpoints: tuple[str, ...]) -> str:
    """A request as errors name it: its checkpoints, else its call index."""
    return ", ".join(checkpoints) or f"async save {call_idx}"


def _checkpoints(fns: list[Finalization | Callable[[], Any]]) -> tuple[str, ...]:
    """The checkpoints the Finalizations among ``fns`` commit."""
    return tuple(fn.checkpoint for fn in fns if isinstance(fn, Finalization))


def _with_preloaded_args(request: AsyncRequest) -> AsyncRequest:
    """``request`` with what its ``preload_fn`` returned in place of ``async_fn_args[1]``,
    as Megatron-Core's callers run a request (its ``execute_sync``, its forked and
    persistent writers): the host copies the preload staged, not the tensors the caller
    goes on changing, are what ``async_fn`` writes. ``request`` itself without a
    ``preload_fn``.

    Raises:
        CheckpointingException: a ``preload_fn`` with fewer than two ``async_fn_args``
            (nothing for its result to replace), before it runs.
    """
    if request.preload_fn is None:
        return request
    args = list(request.async_fn_args)
    if len(args) < 2:
        raise CheckpointingException(
            f"Cannot run the async request of {_describe(request.call_idx, _checkpoints(request.finalize_fns))}: "
            f"it has a preload_fn but {len(args)} async_fn_args, and the preload's result (the tensors staged to "
            "host memory) takes the place of async_fn_args[1], as in Megatron-Core. Pass the tensors to stage as "
            "async_fn_args[1], or stage them before building the request and pass no preload_fn"
        )
    args[1] = request.preload_fn()
    return replace(request, async_fn_args=tuple(args))


def _preloaded(request: AsyncRequest) -> tuple[AsyncRequest, BaseException | None]:
    """``_with_preloaded_args``, or ``request`` and what its preload raised (or why it
    could not run): the caller hands that error to the finalize steps, which are
    collective, rather than leave the other ranks waiting in them."""
    try:
        return _with_preloaded_args(request), None
    except BaseException as exc:  # the finalize steps tell every rank; the caller raises it
        return request, exc


def _failed(error: BaseException) -> Future:
    """A finished ``Future`` holding ``error``: the result of a request whose I/O never ran."""
    future: Future = Future()
    future.set_exception(error)
    return future


def _run_io(request: AsyncRequest) -> None:
    if request.async_fn is None:
        return
    try:
        request.async_fn(*request.async_fn_args, **request.async_fn_kwargs)
    except Exception as exc:
        logger.error("Background I/O of async checkpoint save %d failed: %s", request.call_idx, exc)
        raise
