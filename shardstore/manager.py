"""A checkpoint manager for a training loop: save every N steps, keep the last K and
every M-th, restart from the latest *committed* step (Orbax's ``CheckpointManager`` is
the model).

Each step is a checkpoint directory under one root, named ``iter_0001000`` (Megatron-LM's
naming) by default. A step counts once its commit record exists, so a save that died
midway (its staging directory, see ``shardstore.commit``) is never a candidate for
restart. Old steps are deleted only after a newer save committed, by the coordinator,
and only directories whose commit record proves they are shardstore checkpoints: the
commit record goes first, so a deletion cut short never leaves a directory that looks
complete. A failed deletion is logged (WARNING) and kept in ``retention_errors``: it
must not kill a training job whose save succeeded.

Collective like ``save``: every rank of the group calls ``save``, ``restore``,
``wait_until_finished`` and ``close`` with the same steps. Retention runs on the
coordinator after the commit without a barrier, so another rank may still list a step
that is being deleted.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from shardstore.core import CheckpointingException
from shardstore.distributed import Group
from shardstore.format import COMMIT_RECORD, read_commit_record
from shardstore.locations import open_location
from shardstore.mapping import ShardedStateDict, StateDict
from shardstore.storage import Location
from shardstore.strategies.async_utils import AsyncCallsQueue

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointManagerOptions:
    """When to save and what to keep.

    Attributes:
        save_interval_steps: ``save`` writes steps divisible by it (``force=True``: any).
        max_to_keep: keep the newest K committed steps (None: keep all).
        keep_period: also keep every step divisible by it, forever (None: none).
        step_prefix: a step's directory is ``step_prefix`` + the step in ``step_digits``
            digits, zero-padded.
        step_digits: see ``step_prefix``.
        async_save: ``save`` returns once the state is staged in host memory; the
            writes run in the background and commit at the next ``save``,
            ``wait_until_finished`` or ``close``.
    """

    save_interval_steps: int = 1
    max_to_keep: int | None = None
    keep_period: int | None = None
    step_prefix: str = "iter_"
    step_digits: int = 7
    async_save: bool = False

    def __post_init__(self) -> None:
        if self.save_interval_steps < 1:
            raise ValueError(f"save_interval_steps must be >= 1, got {self.save_interval_steps}")
        if self.max_to_keep is not None and self.max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None, got {self.max_to_keep}")
        if self.keep_period is not None and self.keep_period < 1:
            raise ValueError(f"keep_period must be >= 1 or None, got {self.keep_period}")
        if "/" in self.step_prefix or self.step_prefix.startswith("."):
            raise ValueError(f"step_prefix must be a plain name, got {self.step_prefix!r}")

    def step_name(self, step: int) -> str:
        return f"{self.step_prefix}{step:0{self.step_digits}d}"

    def parse_step(self, name: str) -> int | None:
        """The step a directory name stands for, or None for any other name."""
        digits = name[len(self.step_prefix) :] if name.startswith(self.step_prefix) else ""
        return int(digits) if digits.isdigit() and digits.isascii() else None


def steps_to_delete(committed: list[int], options: CheckpointManagerOptions) -> list[int]:
    """The committed steps retention removes: all but the newest ``max_to_keep`` and the
    multiples of ``keep_period``; never the newest step."""
    if options.max_to_keep is None or not committed:
        return []
    ordered = sorted(committed)
    kept = set(ordered[-options.max_to_keep :])
    if options.keep_period is not None:
        kept |= {s for s in ordered if s % options.keep_period == 0}
    return [s for s in ordered[:-1] if s not in kept]


class CheckpointManager:
    """Saves, finds and prunes the checkpoints of one training run under ``root``.

    Args:
        root: directory (local path, ``s3://bucket/prefix`` or a Location) holding one
            checkpoint per step.
        options: when to save and what to keep.
        process_group: the ranks that save together (default: the world).

    Example::

        manager = CheckpointManager("/ckpt/run1", CheckpointManagerOptions(
            save_interval_steps=1000, max_to_keep=3, keep_period=10000, async_save=True))
        start = manager.latest_step()
        if start is not None:
            state = manager.restore(sharded_state_dict(model), start)
        for step in range(start or 0, steps):
            ...
            manager.save(step, sharded_state_dict(model))  # a no-op unless step % 1000 == 0
        manager.close()
    """

    def __init__(
        self,
        root: str | os.PathLike | Location,
        options: CheckpointManagerOptions | None = None,
        *,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.root = open_location(root)
        self.options = options or CheckpointManagerOptions()
        self.process_group = process_group
        self.retention_errors: list[str] = []
        self._queue = AsyncCallsQueue(process_group=process_group) if self.options.async_save else None

    # ------------------------------------------------------------------ finding steps

    def location(self, step: int) -> Location:
        """Where ``step`` is (or would be) saved."""
        return self.root.child(self.options.step_name(step))

    def all_steps(self) -> list[int]:
        """Steps whose checkpoint has committed (its commit record exists), ascending;
        incomplete saves and other directories are left out."""
        steps = []
        for name in self.root.list_top(limit=None):
            step = self.options.parse_step(name)
            if step is not None and self.root.exists(f"{name}/{COMMIT_RECORD}"):
                steps.append(step)
        return sorted(steps)

    def latest_step(self) -> int | None:
        """The newest step whose commit record reads back as a valid shardstore record
        (a damaged or foreign newer one is skipped with a WARNING), or None."""
        for step in reversed(self.all_steps()):
            try:
                read_commit_record(self.location(step))
            except CheckpointingException as exc:
                logger.warning("Skipping step %d: %s", step, exc)
                continue
            return step
        return None

    def should_save(self, step: int) -> bool:
        return step % self.options.save_interval_steps == 0

    # ------------------------------------------------------------------ saving

    def save(self, step: int, sharded_state_dict: ShardedStateDict, *, force: bool = False, **save_kwargs: Any) -> bool:
        """Saves ``step`` when it is due (``should_save``) or ``force``; returns whether it
        saved. An async save first commits the previous one (one in flight at a time).
        Extra keyword arguments go to ``shardstore.save``."""
        if not (force or self.should_save(step)):
            return False
        from shardstore.serialization import save

        target = self.location(step)
        if self._queue is None:
            save(sharded_state_dict, target, process_group=self.process_group, **save_kwargs)
            self._apply_retention()
            return True
        self._queue.maybe_finalize_async_calls(blocking=True)
        request = save(
            sharded_state_dict, target, async_sharded_save=True, process_group=self.process_group, **save_kwargs
        )
        request.add_finalize_fn(self._apply_retention)
        self._queue.schedule_async_request(request)
        return True

    def wait_until_finished(self) -> None:
        """Blocks until every async save has committed (collective)."""
        if self._queue is not None:
            self._queue.maybe_finalize_async_calls(blocking=True)

    def close(self) -> None:
        """Commits the async saves still in flight and stops the background worker."""
        if self._queue is not None:
            self._queue.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _apply_retention(self) -> None:
        """Coordinator: deletes the steps retention no longer keeps (after a commit)."""
        if not Group(self.process_group).is_coordinator:
            return
        for step in steps_to_delete(self.all_steps(), self.options):
            try:
                self._delete(step)
            except (CheckpointingException, OSError) as exc:
                message = f"Could not delete old checkpoint step {step} at {self.location(step).describe()}: {exc}"
                logger.warning("%s", message)
                self.retention_errors.append(message)

    def _delete(self, step: int) -> None:
        location = self.location(step)
        read_commit_record(location)  # proves it is a shardstore checkpoint before anything goes
        location.remove(COMMIT_RECORD)  # from here on it no longer looks complete
        self.root.remove_tree(self.options.step_name(step))
        logger.info("Deleted checkpoint step %d at %s", step, location.describe())

    # ------------------------------------------------------------------ restoring

    def restore(self, sharded_state_dict: ShardedStateDict, step: int | None = None, **load_kwargs: Any) -> StateDict:
        """Loads ``step`` (default: ``latest_step()``) into the layout ``sharded_state_dict``
        describes. Extra keyword arguments go to ``shardstore.load``."""
        from shardstore.serialization import load

        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointingException(f"No committed checkpoint under {self.root.describe()} to restore")
        return load(sharded_state_dict, self.location(step), process_group=self.process_group, **load_kwargs)
