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
oldest first. A failure in the background surfaces there, on every rank, and the
checkpoint gets no commit record; a rank that died makes the others raise a
CheckpointingException naming the checkpoints left uncommitted.
"""

from __future__ import annotations

__all__ = ["AsyncCallsQueue", "AsyncRequest", "Finalization", "IO_PRIORITIES"]

import logging
import os
import sys
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import torch.distributed as dist

from shardstore.core import CheckpointingException
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
        preload_fn: run before scheduling (e.g. copy to host); its result is unused.
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
        """Runs the whole request in the caller: preload, I/O, then every finalize step.

        An I/O error is handed to the finalize steps rather than raised at once: they
        are collective, and the other ranks are waiting in them to hear about it.
        """
        if self.preload_fn is not None:
            self.preload_fn()
        error: BaseException | None = None
        if self.async_fn is not None:
            try:
                self.async_fn(*self.async_fn_args, **self.async_fn_kwargs)
            except Exception as exc:  # the finalize step tells every rank (collective)
                error = exc
        for fn in self.finalize_fns:
            _call_finalize(fn, error)

    def freeze(self) -> AsyncRequest:
        """A frozen copy (no more finalize functions)."""
        return replace(self, is_frozen=True, finalize_fns=list(self.finalize_fns))


class AsyncCallsQueue:
    """Schedules async save requests, runs their I/O in the background, finalizes them
    in order.

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

    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        """Starts the request's I/O in the background and returns its call index."""
        if self._closed:
            raise CheckpointingException("AsyncCallsQueue is closed; create a new one")
        idx = self._next_idx
        self._next_idx += 1
        request = replace(async_request.freeze(), call_idx=idx)
        if request.preload_fn is not None:
            request.preload_fn()
        self._pending.append((idx, request, self._worker.submit(_run_io, request)))
        return idx

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> list[int]:
        """Finalizes the requests finished on every rank, oldest first; returns their
        call indices.

        Collective unless ``no_dist``: every rank must call it. Every ready request is
        finalized even after one of them fails (the others are written on every rank:
        each is committed or fails on its own). A request whose I/O failed on any rank
        is left without a commit record and raises CheckpointingException on every rank,
        once all of them are done; with several finalized, the error names each one's
        outcome.
        """
        if blocking:
            for _, _, future in self._pending:
                future.exception()  # waits
        ready = self._finished_everywhere(no_dist)
        finalized = [self._finalize_oldest() for _ in range(ready)]
        _raise_failures(finalized)
        return [outcome.call_idx for outcome in finalized]

    def _finalize_oldest(self) -> _Outcome:
        """Pops the oldest request and runs its finalize steps; what became of it."""
        idx, request, future = self._pending.popleft()
        error = future.exception()
        try:
            for fn in request.finalize_fns:
                _call_finalize(fn, error)
        except Exception as exc:  # raised once every ready request is finalized
            return _Outcome(idx, _checkpoints(request), exc)
        return _Outcome(idx, _checkpoints(request), None)

    def _finished_everywhere(self, no_dist: bool) -> int:
        """How many of the oldest requests have finished on every rank."""
        done = 0
        for _, _, future in self._pending:
            if not future.done():
                break
            done += 1
        if no_dist or not dist.is_initialized():
            return done
        try:
            return Group(self.process_group).reduce_over_ranks([done], "min", "async finalization")[0]
        except CheckpointingException as exc:
            pending = [fn.checkpoint if isinstance(fn, Finalization) else "?"
                       for _, r, _ in self._pending for fn in r.finalize_fns]
            raise CheckpointingException(
                f"Async checkpoint save(s) of {sorted(set(pending))} not committed: {exc}"
            ) from exc

    def get_num_unfinalized_calls(self) -> int:
        return len(self._pending)

    def close(self, abort: bool = False) -> None:
        """Finalizes everything still pending (or, with ``abort``, waits for the I/O and
        drops it uncommitted: nothing is committed, and the next save into the same
        place removes what the dropped save wrote); stops the worker thread."""
        try:
            if abort:
                for _, request, future in self._pending:
                    future.exception()
                    for fn in request.finalize_fns:  # local: closes what the save holds open
                        if isinstance(fn, Finalization):
                            fn.abort()
                self._pending.clear()
            else:
                self.maybe_finalize_async_calls(blocking=True)
        finally:
            self._closed = True
            self._worker.shutdown(wait=True)


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
    """How one request's finalization went on this rank."""

    call_idx: int
    checkpoints: tuple[str, ...]  # what its Finalizations commit (may be none: plain callables only)
    error: Exception | None  # the first failure of its finalize steps

    def describe(self) -> str:
        """The request as errors name it: its checkpoints, else its call index."""
        return ", ".join(self.checkpoints) or f"async save {self.call_idx}"

    def line(self) -> str:
        """One line of a combined error: the request and whether it was committed."""
        if self.error is None:
            return f"  {self.describe()}: committed"
        failure = str(self.error).replace("\n", "\n    ")
        return f"  {self.describe()}: not committed: {failure}"


def _raise_failures(finalized: list[_Outcome]) -> None:
    """Raises the first failure among ``finalized`` (one call's requests): as it is when
    it was the only request finalized, else a CheckpointingException naming every
    request's outcome."""
    failed = [outcome for outcome in finalized if outcome.error is not None]
    if not failed:
        return
    if len(finalized) == 1:
        raise failed[0].error
    lines = "\n".join(outcome.line() for outcome in finalized)
    raise CheckpointingException(
        f"Finalizing {len(finalized)} async checkpoint saves: {len(failed)} failed (first: {failed[0].describe()}):\n"
        f"{lines}\nA save not committed has no commit record: save it again (the next save into the same "
        "place removes what it wrote); the committed ones are complete."
    ) from failed[0].error


def _checkpoints(request: AsyncRequest) -> tuple[str, ...]:
    """The checkpoints ``request``'s Finalizations commit."""
    return tuple(fn.checkpoint for fn in request.finalize_fns if isinstance(fn, Finalization))


def _run_io(request: AsyncRequest) -> None:
    if request.async_fn is None:
        return
    try:
        request.async_fn(*request.async_fn_args, **request.async_fn_kwargs)
    except Exception as exc:
        logger.error("Background I/O of async checkpoint save %d failed: %s", request.call_idx, exc)
        raise


def _call_finalize(fn: Finalization | Callable[[], Any], error: BaseException | None) -> None:
    """A ``Finalization`` gets the background error; a plain callable only runs on success."""
    if isinstance(fn, Finalization):
        fn.finalize(error)
    elif error is None:
        fn()
    else:
        raise CheckpointingException(f"Async checkpoint save failed: {error}") from error
