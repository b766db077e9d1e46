"""Running a manager's saves (``SaveRunner``): synchronously, or one async save in flight
at a time; sharing unchanged chunks with a committed step (``reuse_unchanged``); one
plan kept across saves (``cache_plan``).

An async save commits at the first ``save`` call after its writes finished on every
rank (``commit_finished``: collective while one is in flight), or at ``wait``. A save
that shared chunks with a base step and failed makes the runner stop choosing that base.
"""

from __future__ import annotations

__all__ = ["SaveRunner"]

import contextlib
import copy
import logging
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch.distributed as dist

from shardstore.engine.async_requests import AsyncCallsQueue
from shardstore.format import SaveOptions
from shardstore.mapping import ShardedStateDict
from shardstore.tools.manager.options import CheckpointManagerOptions
from shardstore.tools.manager.steps import StepDirectories

logger = logging.getLogger(__name__)


class SaveRunner:
    """Runs the saves of a manager over ``steps``; ``options.async_save`` chooses a
    background queue (collective calls: every rank makes them alike)."""

    def __init__(
        self, steps: StepDirectories, options: CheckpointManagerOptions, process_group: dist.ProcessGroup | None
    ) -> None:
        self.steps = steps
        self.options = options
        self.process_group = process_group
        self._failed_bases: set[int] = set()  # steps whose reuse a failed save had (not chosen again)
        self._async_base: tuple[int, int] | None = None  # (base, step) of the async save in flight reusing base
        self._strategy: tuple[Any, dict[str, Any], Any] | None = None  # ``_plan_keeping_strategy``
        self._queue = AsyncCallsQueue(process_group=process_group) if options.async_save else None

    def base_for(self, step: int) -> int | None:
        """Coordinator: the newest committed step up to ``step`` to share unchanged chunks
        with, None without ``reuse_unchanged`` or where that step's reuse failed before
        (not an older step instead: it would share less)."""
        if not self.options.reuse_unchanged:
            return None
        base = self.steps.newest_committed([s for s in self.steps.named() if s <= step])
        return None if base in self._failed_bases else base

    def run(
        self,
        sharded_state_dict: ShardedStateDict,
        step: int,
        base: int | None,
        options: SaveOptions,
        save_kwargs: dict[str, Any],
        after_commit: Callable[[], None],
        commit_now: bool,
    ) -> None:
        """Saves ``step`` (``shardstore.save``), sharing unchanged chunks with ``base``
        (None: the caller chose, or no base) unless ``options.reuse_from`` names one, and
        calls ``after_commit`` once it committed. Async: returns once staged, unless
        ``commit_now`` (a preemption save: the job may be killed any moment)."""
        from shardstore.engine.save import save

        chosen_base = None
        if base is not None and options.reuse_from is None:
            chosen_base = base
            options = replace(options, reuse_from=self.steps.location(base))
        if self.options.cache_plan and "sharded_strategy" not in save_kwargs:
            save_kwargs["sharded_strategy"] = self._plan_keeping_strategy()
        with self._base_failures_noted(chosen_base, step):
            request = save(
                sharded_state_dict, self.steps.location(step), async_sharded_save=self._queue is not None,
                process_group=self.process_group, options=options, **save_kwargs,
            )
        if self._queue is None:
            after_commit()
            return
        request.add_finalize_fn(after_commit)
        self._async_base = None if chosen_base is None else (chosen_base, step)
        self._queue.schedule_async_request(request)  # a failed preload stays queued: the finalize says it
        if commit_now:
            self.wait()

    def wait(self) -> None:
        """Blocks until every async save has committed (collective)."""
        if self._queue is not None:
            self._finalize_async_saves(blocking=True)

    def close(self) -> None:
        """Commits the async saves still in flight and stops the background worker."""
        if self._queue is not None:
            with self._async_failures_noted():
                self._queue.close()

    def commit_finished(self) -> None:
        """Commits, without waiting, the async saves whose writes have finished on every
        rank (Megatron-LM finalizes at every training step the same way), so that a save
        that is not due does not leave a finished one uncommitted until the next due
        one. Collective while an async save is in flight (one all-reduce: the queue's
        ranks agree on what finished); nothing otherwise. Every rank has the same
        saves in flight, so every rank takes the same branch."""
        if self._queue is not None and self._queue.get_num_unfinalized_calls():
            self._finalize_async_saves(blocking=False)

    def _plan_keeping_strategy(self) -> Any:
        """The save strategy of this manager's saves (``CheckpointManagerOptions.
        cache_plan``): a copy of the registered default that keeps its plan (its buffer
        pools shared with the default, as every save's are), made again whenever the
        default is replaced or one of its settings changes (so the manager follows it as
        ``save`` does); the default itself where it keeps plans already or is not
        shardstore's own (None: ``save`` then takes the default)."""
        from shardstore.engine.save import get_default_save_sharded_strategy
        from shardstore.engine.zarr_strategies import ZarrSaveShardedStrategy

        default = get_default_save_sharded_strategy()
        if not isinstance(default, ZarrSaveShardedStrategy) or default.cache_plan:
            return None
        settings = dict(vars(default))  # the objects it holds: a setting changed is another one
        if self._strategy is None or self._strategy[0] is not default or not _same_objects(self._strategy[1], settings):
            copied = copy.copy(default)
            copied.cache_plan = True
            self._strategy = (default, settings, copied)
        return self._strategy[2]

    def _finalize_async_saves(self, blocking: bool) -> None:
        """The queue's ``maybe_finalize_async_calls`` (collective), a failure of the save
        in flight noted against its base (``_async_failures_noted``)."""
        assert self._queue is not None
        with self._async_failures_noted():
            self._queue.maybe_finalize_async_calls(blocking=blocking)

    @contextlib.contextmanager
    def _async_failures_noted(self) -> Iterator[None]:
        """Around a finalize of the async save queue: a failure of the save in flight (its
        background I/O, its commit) is noted against the base it reused from, as a
        synchronous save's is (``_base_failures_noted``). One async save is in flight
        at a time, so a failure there is that save's."""
        assert self._queue is not None
        base, step = self._async_base or (None, 0)
        try:
            with self._base_failures_noted(base, step):
                yield
        finally:
            if not self._queue.get_num_unfinalized_calls():
                self._async_base = None

    @contextlib.contextmanager
    def _base_failures_noted(self, base: int | None, step: int) -> Iterator[None]:
        """A save that reused from ``base`` (the manager's choice) and failed (a
        synchronous save, an async one when it starts or is finalized:
        ``_async_failures_noted``) makes the manager stop choosing
        ``base``: whatever failed, later saves share nothing with it (nor with an older
        step instead, which would share less); a newer committed step serves again. A
        base that cannot serve a chunk costs that chunk a write, not the save
        (``format.reuse``); this covers whatever that does not."""
        try:
            yield
        except Exception:
            if base is not None and base not in self._failed_bases:
                self._failed_bases.add(base)
                logger.warning(
                    "The save of step %d, which shared unchanged chunks with step %d, failed: later saves under %s "
                    "do not share chunks with step %d", step, base, self.steps.root.describe(), base,
                )
            raise


def _same_objects(before: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether two snapshots of an object's attributes name the same objects (by
    identity: a setting assigned an equal new value counts as changed, which costs one
    plan, never a stale one)."""
    return before.keys() == now.keys() and all(before[k] is now[k] for k in before)
