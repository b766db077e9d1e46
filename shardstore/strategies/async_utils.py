"""Async save requests and the queue that runs and finalizes them (Megatron-Core semantics).

An ``AsyncRequest`` is a function that does the storage I/O (``async_fn``) plus the
functions that finalize the save once every rank's I/O is done (``finalize_fns``, which
include writing the commit record). ``AsyncCallsQueue`` schedules requests and
finalizes them in order.

This version runs ``async_fn`` synchronously when the request is scheduled (the
"synchronous fallback"): semantics and ordering are those of the asynchronous API,
so trainer code written against it is already correct.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from shardstore.core import CheckpointingException

logger = logging.getLogger(__name__)


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
    finalize_fns: list[Callable[[], Any]] = field(default_factory=list)
    async_fn_kwargs: dict[str, Any] = field(default_factory=dict)
    preload_fn: Callable[[], Any] | None = None
    is_frozen: bool = False
    call_idx: int = 0

    def add_finalize_fn(self, fn: Callable[[], Any]) -> None:
        """Appends a finalize function (not allowed once frozen)."""
        if self.is_frozen:
            raise RuntimeError("Cannot add finalize functions to a frozen AsyncRequest")
        self.finalize_fns.append(fn)

    def execute_sync(self) -> None:
        """Runs the whole request in the caller: preload, I/O, then every finalize step."""
        if self.preload_fn is not None:
            self.preload_fn()
        if self.async_fn is not None:
            self.async_fn(*self.async_fn_args, **self.async_fn_kwargs)
        for fn in self.finalize_fns:
            fn()

    def freeze(self) -> AsyncRequest:
        """A frozen copy (no more finalize functions)."""
        return replace(self, is_frozen=True, finalize_fns=list(self.finalize_fns))


class AsyncCallsQueue:
    """Schedules async save requests and finalizes them in order.

    Args:
        persistent: accepted for API compatibility (a persistent background worker).
    """

    def __init__(self, persistent: bool = False) -> None:
        self.persistent = persistent
        self._pending: deque[tuple[int, AsyncRequest, BaseException | None]] = deque()
        self._next_idx = 0
        self._closed = False

    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        """Starts the request's I/O and returns its call index."""
        if self._closed:
            raise CheckpointingException("AsyncCallsQueue is closed; create a new one")
        idx = self._next_idx
        self._next_idx += 1
        request = replace(async_request.freeze(), call_idx=idx)
        error: BaseException | None = None
        try:
            if request.preload_fn is not None:
                request.preload_fn()
            if request.async_fn is not None:
                request.async_fn(*request.async_fn_args, **request.async_fn_kwargs)
        except Exception as exc:  # surfaced by the finalize step on every rank
            logger.error("Async checkpoint save %d failed: %s", idx, exc)
            error = exc
        self._pending.append((idx, request, error))
        return idx

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> list[int]:
        """Finalizes the finished requests, oldest first; returns their call indices.

        Collective unless ``no_dist``: every rank must call it. A request whose I/O
        failed on any rank raises CheckpointingException on every rank, and its
        checkpoint is left without a commit record.
        """
        finalized = []
        while self._pending:
            idx, request, error = self._pending.popleft()
            for fn in request.finalize_fns:
                _call_finalize(fn, error)
            finalized.append(idx)
        return finalized

    def get_num_unfinalized_calls(self) -> int:
        return len(self._pending)

    def close(self, abort: bool = False) -> None:
        """Finalizes everything still pending (or drops it when ``abort``)."""
        if abort:
            self._pending.clear()
        else:
            self.maybe_finalize_async_calls(blocking=True)
        self._closed = True


def _call_finalize(fn: Callable[..., Any], error: BaseException | None) -> None:
    """Finalize functions that take the background error get it; others only run on success."""
    if getattr(fn, "accepts_async_error", False):
        fn(error)
    elif error is None:
        fn()
    else:
        raise CheckpointingException(f"Async checkpoint save failed: {error}") from error
