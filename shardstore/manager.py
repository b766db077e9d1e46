"""A checkpoint manager for a training loop: save every N steps, keep the last K and
every M-th, restart from the latest *committed* step (Orbax's ``CheckpointManager`` is
the model). The rule above all others: it never loses the last good checkpoint.

Each step is a checkpoint directory under one root, named ``iter_0001000`` (Megatron-LM's
naming) by default. What counts as a step:

* **A step is a directory with a commit record that reads and checks** (the check of
  ``shardstore.format.read_commit_record``: ``CommitRecord.from_json``). A save that
  died midway (its staging directory, see ``shardstore.commit``) is not one; neither is
  a directory whose record is damaged (not JSON, not a shardstore record, unreadable):
  it is never counted, so it can neither be restarted from nor push a good step out of
  the newest ``max_to_keep``. Retention logs it at WARNING and leaves it alone. Names
  must be exactly ``step_name(step)``; other names are not steps.

**Retention** runs on the coordinator after each commit. It deletes the committed
steps beyond the newest ``max_to_keep`` that are not multiples of ``keep_period``, and
never the newest committed step nor the step just saved (which is not the newest when
another manager committed a newer step meanwhile). It never touches a directory it
cannot prove is one of its own checkpoints: foreign directories (a user's folder, a
DCP or Megatron checkpoint named like a step), damaged records and saves in progress
stay. Because a damaged or unreadable record is not counted, an unreadable *newer*
directory makes retention keep more, never less: ``max_to_keep`` readable steps
always remain besides it.

**Deletion** of a step goes in an order that a crash at any point leaves recoverable:
(1) a marker ``.shardstore-deleting.json`` naming the step and its record's save id is
written into the step (durably), (2) the commit record goes (from here on it is not a
step), (3) everything but the marker, (4) the marker, (5) the empty directory. A
directory with that marker and no commit record is an interrupted deletion, provably
ours: the next retention (or ``rollback``, or a save of that step) finishes it. A
directory without a record and without our marker is never deleted (an interrupted
deletion by a shardstore older than the marker cannot be told from someone else's
directory: delete it yourself). A crash between (4) and (5) can leave an empty
directory, which a later save of that step replaces. A failed deletion is logged
(WARNING) and kept in ``retention_errors``: it must not kill a training job whose save
succeeded.

**Resuming** at the latest step is a no-op: ``save(step)`` for a step that is already
committed writes nothing and returns False (INFO log), sync and async, so the loop
``start = latest_step(); restore; for step in range(start, ...): save(step)`` restarts
cleanly. Pass ``overwrite=True`` (a keyword of ``shardstore.save``) to replace it.

**Rollback** is explicit. Orbax's ``CheckpointManager.should_save`` returns False for
any step at or below its latest step, so ``save`` silently skips it until training
passes the latest step again; with ``force=True`` it saves the older step, refuses one
that exists (``StepAlreadyExistsError``), and its retention (``LatestN`` over the steps
in the order saved, so the older step just saved counts as the newest) can then delete
committed steps *newer* than it (orbax ``checkpoint_manager.py``: ``should_save``,
``save``, ``_get_old_steps_to_remove``).
Neither fits "never lose a committed checkpoint, and restart from the right one": a
skipped save loses the progress after the rollback, and keeping the newer steps would
make a restart resume from the abandoned history (``latest_step`` names the newest)
while ``save`` of those step numbers later would find the old ones. So here:

* ``save(step)`` older than the newest committed step raises a CheckpointingException
  before anything is written (every rank, sync and async), naming the newer step and
  ``rollback``; nothing is deleted.
* ``rollback(step)`` (collective) makes the committed ``step`` the newest: it deletes
  every committed step after it, newest first, through the deletion above, and
  returns them. Training then saves onward from ``step``. It is not atomic: if it is
  interrupted, ``latest_step`` may still name a newer step; call it again (it finishes
  what it began). Damaged or foreign directories after ``step`` stay (WARNING).

Collective like ``save``: every rank of the group calls ``save``, ``restore``,
``rollback``, ``wait_until_finished`` and ``close`` with the same steps. Whether a due
``save`` writes (new step), is a no-op (committed) or is refused (older than the
newest) is decided on the coordinator and broadcast, so the ranks never disagree.
Retention runs on the coordinator after the commit without a barrier, so another rank
may still list a step that is being deleted. Finding steps reads commit records: each
``latest_step`` reads the newest records until one checks; ``all_steps`` reads every
step's; retention reads the newest ``max_to_keep`` and those it may delete (one GET each
on object stores), not the ``keep_period`` steps older than those.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch.distributed as dist

from shardstore.core import CheckpointingException
from shardstore.distributed import Group
from shardstore.format import COMMIT_RECORD, DELETION_MARKER, MAX_RECORD_BYTES, CommitRecord
from shardstore.locations import open_location
from shardstore.mapping import ShardedStateDict, StateDict
from shardstore.storage import Location
from shardstore.strategies.async_utils import AsyncCallsQueue

logger = logging.getLogger(__name__)

MAX_MARKER_BYTES = 4096

T = TypeVar("T")


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
            ``wait_until_finished``, ``rollback`` or ``close``.
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
        """The step a directory name stands for, or None for any other name. Only the
        name ``step_name`` gives (``iter_00000100`` is not step 100 when ``step_digits``
        is 7): the manager reads and deletes a step at ``step_name(step)``, so a name it
        would not write is not one of its steps."""
        digits = name[len(self.step_prefix) :] if name.startswith(self.step_prefix) else ""
        if not (digits.isdigit() and digits.isascii()):
            return None
        step = int(digits)
        return step if self.step_name(step) == name else None

    def is_kept_forever(self, step: int) -> bool:
        """Whether ``keep_period`` keeps ``step`` whatever is newer."""
        return self.keep_period is not None and step % self.keep_period == 0


def steps_to_delete(
    committed: Iterable[int], options: CheckpointManagerOptions, protected: Iterable[int] = ()
) -> list[int]:
    """The committed steps retention removes, ascending: all but the newest
    ``max_to_keep`` and the multiples of ``keep_period``; never the newest step and
    never a ``protected`` one (the step just saved, which another manager's newer
    commit may have pushed out of the newest ``max_to_keep``)."""
    ordered = sorted(set(committed))
    if options.max_to_keep is None or not ordered:
        return []
    kept = set(ordered[-options.max_to_keep :]) | {ordered[-1]} | set(protected)
    return [s for s in ordered if s not in kept and not options.is_kept_forever(s)]


@dataclass(frozen=True)
class StepState:
    """What a directory named like a step holds.

    Attributes:
        step: the step its name stands for.
        kind: ``committed`` (its commit record reads and checks: a step),
            ``deleting`` (no commit record, our deletion marker: a deletion to finish),
            ``damaged`` (a commit record that does not read or check: not a step, left
            alone) or ``other`` (no commit record and no marker of ours: a save in
            progress, a foreign directory; left alone).
        save_id: committed: its record's save id; deleting: the marker's.
        reason: damaged: why the record does not count.
    """

    step: int
    kind: Literal["committed", "deleting", "damaged", "other"]
    save_id: str = ""
    reason: str = ""


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
            manager.save(step, sharded_state_dict(model))  # a no-op unless due and new
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
        self._damaged_seen: set[tuple[int, str]] = set()
        self._queue = AsyncCallsQueue(process_group=process_group) if self.options.async_save else None

    # ------------------------------------------------------------------ finding steps

    def location(self, step: int) -> Location:
        """Where ``step`` is (or would be) saved."""
        return self.root.child(self.options.step_name(step))

    def all_steps(self) -> list[int]:
        """The committed steps (commit record reads and checks), ascending. Incomplete
        saves, damaged records (WARNING) and other directories are left out. Reads every
        step's commit record."""
        states = [self.step_state(step) for step in self._named_steps()]
        for state in states:
            self._warn_if_damaged(state)
        return [s.step for s in states if s.kind == "committed"]

    def latest_step(self) -> int | None:
        """The newest committed step, or None: newer directories whose record is
        damaged (WARNING) or missing are skipped. Reads the newest records until one
        checks."""
        return self._newest_committed(self._named_steps())

    def step_state(self, step: int) -> StepState:
        """What the directory of ``step`` holds (``StepState``); reads its commit record
        (the check of ``shardstore.format.read_commit_record``) and, without one, our
        deletion marker. Never raises for what it finds: an unreadable record is
        ``damaged``."""
        location = self.location(step)
        try:
            data = location.read_bytes_or_none(COMMIT_RECORD, max_bytes=MAX_RECORD_BYTES)
            if data is None:
                marker = _marker_save_id(location, step)
                return StepState(step, "other") if marker is None else StepState(step, "deleting", save_id=marker)
            record = CommitRecord.from_json(data, where=location.describe(COMMIT_RECORD))
        except Exception as exc:  # a record crafted to trip the parser is damaged too
            return StepState(step, "damaged", reason=f"{type(exc).__name__}: {exc}")
        return StepState(step, "committed", save_id=record.save_id)

    def should_save(self, step: int) -> bool:
        return step % self.options.save_interval_steps == 0

    def _named_steps(self) -> list[int]:
        """Steps that have a directory named for them (committed or not), ascending."""
        steps = (self.options.parse_step(name) for name in self.root.list_top(limit=None))
        return sorted(s for s in steps if s is not None)

    def _newest_committed(self, named: list[int], above: int | None = None) -> int | None:
        for step in reversed(named):
            if above is not None and step <= above:
                return None
            state = self.step_state(step)
            if state.kind == "committed":
                return step
            self._warn_if_damaged(state)
        return None

    def _warn_if_damaged(self, state: StepState) -> None:
        """WARNING the first time this manager meets a damaged record (each save reads it
        again: one line per save would bury the rest of the log), DEBUG after that."""
        if state.kind != "damaged":
            return
        first = (state.step, state.reason) not in self._damaged_seen
        self._damaged_seen.add((state.step, state.reason))
        logger.log(
            logging.WARNING if first else logging.DEBUG,
            "%s is not counted as a checkpoint step: its commit record does not read (%s). Retention "
            "leaves it alone; repair or delete it yourself.",
            self.location(state.step).describe(),
            state.reason,
        )

    # ------------------------------------------------------------------ saving

    def save(self, step: int, sharded_state_dict: ShardedStateDict, *, force: bool = False, **save_kwargs: Any) -> bool:
        """Saves ``step`` when it is due (``should_save``) or ``force``; returns whether it
        saved. Collective.

        An async save first commits the previous one (one in flight at a time). A step
        that is already committed is not saved again (returns False, INFO log: resuming
        at the latest step), unless ``overwrite=True``. A step older than the newest
        committed one is refused (CheckpointingException, nothing written): call
        ``rollback`` first. Extra keyword arguments go to ``shardstore.save``.
        """
        if not (force or self.should_save(step)):
            return False
        from shardstore.serialization import save

        if self._queue is not None:
            self._queue.maybe_finalize_async_calls(blocking=True)  # the check below sees it
        overwrite = bool(save_kwargs.get("overwrite", False))
        if self._on_coordinator(lambda: self._is_committed_or_refused(step, overwrite)):
            logger.info(
                "Not saving step %d: %s already holds it committed (resuming at this step); "
                "pass overwrite=True to replace it",
                step,
                self.location(step).describe(),
            )
            return False
        target = self.location(step)
        retention = functools.partial(self._apply_retention, step)
        if self._queue is None:
            save(sharded_state_dict, target, process_group=self.process_group, **save_kwargs)
            retention()
            return True
        request = save(
            sharded_state_dict, target, async_sharded_save=True, process_group=self.process_group, **save_kwargs
        )
        request.add_finalize_fn(retention)
        self._queue.schedule_async_request(request)
        return True

    def _is_committed_or_refused(self, step: int, overwrite: bool) -> bool:
        """Coordinator, before a save: True if ``step`` is committed (nothing to save);
        raises if a newer step is committed; finishes an interrupted deletion of ours in
        the step's directory so that the save can go there."""
        named = self._named_steps()
        if step in named:
            state = self.step_state(step)
            if state.kind == "committed" and not overwrite:
                return True
            if state.kind == "deleting":
                try:
                    self._finish_deletion(step)
                except (CheckpointingException, OSError) as exc:
                    raise CheckpointingException(
                        f"Cannot save step {step} into {self.location(step).describe()}: it holds a deletion of "
                        f"an old checkpoint that was cut short, and finishing it failed ({exc}). Save again, or "
                        "delete that directory yourself. Nothing was written."
                    ) from exc
            # damaged or foreign: the save refuses it, saying what is there
        newer = self._newest_committed(named, above=step)
        if newer is not None:
            below = self._newest_committed([s for s in named if s <= step])
            how = (
                f"call manager.rollback({below}) first (it deletes the committed steps after {below}), "
                if below is not None
                else "delete the newer steps first, "
            )
            raise CheckpointingException(
                f"Not saving step {step} under {self.root.describe()}: step {newer} there is a newer committed "
                f"checkpoint, and a restart resumes from the newest committed step, so this save would mix two "
                f"training histories. To continue training from an older step, {how}or save this run under "
                "another root. Nothing was written or deleted."
            )
        return False

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

    # ------------------------------------------------------------------ rollback

    def rollback(self, step: int) -> list[int]:
        """Makes the committed ``step`` the newest step by deleting every committed step
        after it, newest first; returns those steps, descending. Collective: every rank
        calls it (after async saves in flight commit); the coordinator deletes.

        Use it to continue training from an older step (restore ``step``, ``rollback``,
        save onward): ``save`` refuses a step older than the newest committed one. Not
        atomic: if it is interrupted, call it again. Directories after ``step`` that are
        not committed shardstore steps are left alone (WARNING), except interrupted
        deletions of ours, which it finishes.

        Raises:
            CheckpointingException: ``step`` is not a committed step (nothing deleted),
                or a deletion failed (call it again).
        """
        self.wait_until_finished()
        return self._on_coordinator(lambda: self._rollback(step))

    def _rollback(self, step: int) -> list[int]:
        named = self._named_steps()
        target = self.step_state(step) if step in named else StepState(step, "other")
        if target.kind != "committed":
            reason = target.reason or "no commit record"
            raise CheckpointingException(
                f"Cannot roll back to step {step} under {self.root.describe()}: it is not a committed checkpoint "
                f"({reason}). Committed steps: {self.all_steps()}. Nothing was deleted."
            )
        deleted = []
        for newer in reversed([s for s in named if s > step]):
            state = self.step_state(newer)
            try:
                if state.kind == "committed":
                    self._delete(state)
                    deleted.append(newer)
                elif state.kind == "deleting":
                    self._finish_deletion(newer)
                elif state.kind == "damaged":
                    self._warn_if_damaged(state)
                else:
                    logger.warning(
                        "Rollback to step %d leaves %s alone: it holds no shardstore checkpoint",
                        step,
                        self.location(newer).describe(),
                    )
            except (CheckpointingException, OSError) as exc:
                raise CheckpointingException(
                    f"Rollback to step {step} under {self.root.describe()} is incomplete: could not delete step "
                    f"{newer} ({exc}); deleted so far: {deleted}. Call rollback({step}) again."
                ) from exc
        logger.info("Rolled back %s to step %d: deleted steps %s", self.root.describe(), step, deleted)
        return deleted

    # ------------------------------------------------------------------ retention

    def _apply_retention(self, just_saved: int) -> None:
        """Coordinator, after the commit of ``just_saved``: finishes interrupted
        deletions and deletes the steps retention no longer keeps. Failures are logged
        and listed in ``retention_errors``, never raised: the save succeeded."""
        if not Group(self.process_group).is_coordinator:
            return
        try:
            unfinished, doomed = self._retention_plan(just_saved)
        except (CheckpointingException, OSError) as exc:
            self._retention_failed(f"Retention under {self.root.describe()} skipped: cannot list its steps: {exc}")
            return
        for step in unfinished:
            self._retain_safely(step, "finish the interrupted deletion of", lambda s=step: self._finish_deletion(s))
        for state in doomed:
            self._retain_safely(state.step, "delete old checkpoint", lambda s=state: self._delete(s))

    def _retention_plan(self, just_saved: int) -> tuple[list[int], list[StepState]]:
        """(interrupted deletions to finish, committed steps to delete). Walks the steps
        newest first: the records of the newest ``max_to_keep`` and of the steps that
        may go are read; ``keep_period`` steps older than those are kept whatever they
        hold, so only a missing record is looked for there (an interrupted deletion)."""
        options = self.options
        unfinished: list[int] = []
        committed: dict[int, StepState] = {}
        for step in reversed(self._named_steps()):
            newest_found = options.max_to_keep is not None and len(committed) >= options.max_to_keep
            if step != just_saved and (options.max_to_keep is None or (newest_found and options.is_kept_forever(step))):
                if self.location(step).exists(COMMIT_RECORD):
                    continue
            state = self.step_state(step)
            if state.kind == "committed":
                committed[step] = state
            elif state.kind == "deleting":
                unfinished.append(step)
            else:
                self._warn_if_damaged(state)
        doomed = steps_to_delete(committed, options, protected=(just_saved,))
        return unfinished, [committed[s] for s in doomed]

    def _retain_safely(self, step: int, what: str, action: Callable[[], None]) -> None:
        try:
            action()
        except (CheckpointingException, OSError) as exc:
            self._retention_failed(f"Could not {what} step {step} at {self.location(step).describe()}: {exc}")

    def _retention_failed(self, message: str) -> None:
        logger.warning("%s", message)
        self.retention_errors.append(message)

    # ------------------------------------------------------------------ deleting

    def _delete(self, state: StepState) -> None:
        """Deletes the committed step ``state`` (read just before) in the order the
        module docstring gives."""
        location = self.location(state.step)
        _refuse_links(location)
        marker = json.dumps({"step": state.step, "save_id": state.save_id}).encode()
        location.write_atomic(DELETION_MARKER, marker)  # durable before the record goes
        current = self.step_state(state.step)
        if current.kind != "committed" or current.save_id != state.save_id:  # replaced meanwhile: not ours to delete
            location.remove(DELETION_MARKER)
            raise CheckpointingException(
                f"{location.describe()} changed while retention read it (save {state.save_id} -> "
                f"{current.save_id or current.kind}); left as it is"
            )
        location.remove(COMMIT_RECORD)  # from here on it is no longer a step
        self._finish_deletion(state.step)
        logger.info("Deleted checkpoint step %d at %s", state.step, location.describe())

    def _finish_deletion(self, step: int) -> None:
        """Removes a step whose deletion began (our marker, no commit record): the
        marker goes last, so a crash here leaves it provably ours still."""
        location = self.location(step)
        _refuse_links(location)
        if location.exists(COMMIT_RECORD) or _marker_save_id(location, step) is None:
            raise CheckpointingException(f"{location.describe()} is not a deletion of ours to finish; left as it is")
        for name in location.list_top(limit=None):
            if name != DELETION_MARKER:
                location.remove_tree(name)
        location.remove(DELETION_MARKER)
        path = location.local_path()
        if path is not None:  # object stores have no directories: nothing is left there
            try:
                path.rmdir()  # only if empty: whatever appeared meanwhile is not ours
            except FileNotFoundError:
                pass
        logger.debug("Finished deleting checkpoint step %d at %s", step, location.describe())

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

    # ------------------------------------------------------------------ collectives

    def _on_coordinator(self, work: Callable[[], T]) -> T:
        """Collective: runs ``work`` on the coordinator and gives every rank its result,
        or the same CheckpointingException, so that all ranks take the same branch."""
        group = Group(self.process_group)
        result: Any = None
        error: BaseException | None = None
        if group.is_coordinator:
            try:
                result = work()
            except Exception as exc:  # sent to the other ranks, then raised here
                error = exc
        outcome = group.broadcast_object((result, None if error is None else f"{error}"))
        if error is not None:
            raise error
        if outcome[1] is not None:
            raise CheckpointingException(outcome[1])
        return outcome[0]


def _marker_save_id(location: Location, step: int) -> str | None:
    """The save id in our deletion marker for ``step`` at ``location``; None when there
    is no marker, or one that is not ours (a file of that name we did not write)."""
    data = location.read_bytes_or_none(DELETION_MARKER, max_bytes=MAX_MARKER_BYTES)
    if data is None:
        return None
    try:
        marker = json.loads(data)
    except ValueError:
        return None
    if not isinstance(marker, dict) or marker.get("step") != step or not isinstance(marker.get("save_id"), str):
        return None
    return marker["save_id"]


def _refuse_links(location: Location) -> None:
    """Deleting through a symbolic link would delete what it points to, which may be
    another run's checkpoint: a linked step is never deleted."""
    path = location.local_path()
    if path is not None and path.is_symlink():
        raise CheckpointingException(f"{path} is a symbolic link; retention does not delete through links")
