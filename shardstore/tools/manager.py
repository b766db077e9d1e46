"""A checkpoint manager for a training loop: save every N steps or every T seconds or
when the job is preempted (SIGTERM), keep the last K, every M-th and the best N by a
metric, restart from the latest *committed* step (Orbax's ``CheckpointManager`` is the
model). The rule above all others: it never loses the last good checkpoint.

Entry points: ``CheckpointManager`` and its ``CheckpointManagerOptions``. The class
docstring holds the contract of each operation (what counts as a step, retention and
keep-best, deletion, resuming, when to save, preemption, rollback, what is collective
and what each call reads); docs/guide/manager.md shows the loop and where it differs
from Orbax's manager. In short:

* **A step** is a directory under the root named ``step_name(step)`` (``iter_0001000``,
  Megatron-LM's naming, by default) whose commit record reads and checks. A save that
  died midway, a damaged record and a foreign directory are not steps: never restarted
  from, never counted by retention, never deleted.
* **Retention** runs on the coordinator after each commit: it keeps the newest
  ``max_to_keep``, the multiples of ``keep_period`` and the ``keep_best`` best by
  ``best_fn`` (the metrics travel in the step's own common state), never the newest
  committed step nor the step just saved. A deletion goes in an order that a crash at
  any point leaves recoverable (a marker of ours first, the commit record next) and
  removes only the files the step's record vouches for.
* **Resuming:** ``save(step)`` stores the state *after* training step ``step``;
  ``resume`` restores the newest committed step and returns the step to train next.
  A step already committed is not saved again (False, WARNING unless expected).
* **Rollback** is explicit: ``save`` of a step older than the newest committed one is
  refused; ``rollback(step)`` deletes the newer steps first.
* **Collective:** every rank calls ``save``, ``resume``, ``restore``, ``rollback``,
  ``delete``, ``wait_until_finished`` and ``close`` with the same steps (and
  ``should_save`` when time or preemption decide); a ``save`` that is not due is one
  too while an async save is in flight (it commits that save once written). What a
  call does is decided on the coordinator and broadcast, so the ranks never disagree.
"""

from __future__ import annotations

__all__ = [
    "CheckpointManager", "CheckpointManagerOptions", "MANAGER_STATE_KEY", "Resumed",
    "StepState", "ranked_steps", "steps_to_delete",
]

import contextlib
import copy
import functools
import json
import logging
import math
import numbers
import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal, NamedTuple, TypeVar

import torch
import torch.distributed as dist

from shardstore.core import CheckpointingException, SaveOptions
from shardstore.format import (
    COMMIT_RECORD,
    CONFIG_FNAME,
    DELETION_MARKER,
    MAX_RECORD_BYTES,
    CommitRecord,
    UnsupportedFormatVersion,
    own_markers,
    read_marker,
)
from shardstore.mapping import ShardedStateDict, StateDict
from shardstore.opened import bare_location
from shardstore.protocol import Group
from shardstore.stores import Location, run_parallel
from shardstore.strategies.async_utils import AsyncCallsQueue
from shardstore.tools.preemption import Listener, listen
from shardstore.tools.root_verify import RootVerifyReport, leftovers_under, verify_checkpoints

logger = logging.getLogger(__name__)

# The common state's key under which the manager keeps what it stores in a step (its
# metrics); reserved: a state dict that holds it is refused.
MANAGER_STATE_KEY = "shardstore_manager"

T = TypeVar("T")
Metrics = Mapping[str, float]


@dataclass(frozen=True)
class CheckpointManagerOptions:
    """When to save and what to keep.

    Attributes:
        save_interval_steps: ``save`` writes steps divisible by it (None: no step is due
            by its number; ``force=True``: any).
        max_to_keep: keep the newest K committed steps (None: keep all).
        keep_period: also keep every step divisible by it, forever (None: none).
        step_prefix: a step's directory is ``step_prefix`` + the step in ``step_digits``
            digits, zero-padded (taken as written: no separator is added).
        step_digits: see ``step_prefix``; None: the step's digits, not padded.
        async_save: ``save`` returns once the state is staged in host memory; the
            writes run in the background and commit at the first ``save`` call after
            they finished on every rank (a call for a step that is not due commits
            without waiting; a due one waits for them), or at ``wait_until_finished``,
            ``resume``, ``rollback``, ``delete`` or ``close``.
        save_interval_secs: also save when this many seconds (of the coordinator's
            clock) have passed since this manager's last save or its start (None: off).
        save_on_preemption: listen for ``preemption_signals`` (one handler shared by
            every manager of the process, the one there before called too) so that the
            next ``save`` saves, whatever the intervals say (``CheckpointManager``).
        preemption_signals: the signals that mean preemption (SIGTERM: Kubernetes,
            SLURM at its time limit, torchrun's agent passing its own on).
        best_fn: scores a step's metrics (those given to ``save``); None: no ranking.
        best_mode: ``"max"``: a higher score is better; ``"min"``: lower (a loss).
        keep_best: also keep the N best committed steps by ``best_fn`` (needs
            ``max_to_keep``: the newest steps are kept besides the best).
        reuse_unchanged: an incremental save: each step shares the chunks whose bytes
            did not change with the newest committed step before it (hard links or
            clones locally, server-side copies on S3; ``shardstore.format.reuse``)
            instead of writing them again. Every step still stands alone: retention
            may delete any of them. Off: every step writes every byte.
        cache_plan: each save after the first reuses the last one's plan while every
            rank's structure is unchanged (``ZarrSaveShardedStrategy(cache_plan=True)``;
            at thousands of ranks a plan takes the coordinator a minute or more): the
            manager saves through a copy of the default save strategy that keeps the
            plan (made again when the default or one of its settings changes). A
            ``sharded_strategy`` given to ``save`` is used as it is. Off: every save
            plans anew.
    """

    save_interval_steps: int | None = 1
    max_to_keep: int | None = None
    keep_period: int | None = None
    step_prefix: str = "iter_"
    step_digits: int | None = 7
    async_save: bool = False
    save_interval_secs: float | None = None
    save_on_preemption: bool = False
    preemption_signals: tuple[int, ...] = (signal.SIGTERM,)
    best_fn: Callable[[Metrics], float] | None = None
    best_mode: Literal["max", "min"] = "max"
    keep_best: int | None = None
    reuse_unchanged: bool = True
    cache_plan: bool = True

    def __post_init__(self) -> None:
        for name in ("save_interval_steps", "max_to_keep", "keep_period", "step_digits", "keep_best"):
            _require_int_or_none(name, getattr(self, name))
        if self.save_interval_steps is not None and self.save_interval_steps < 1:
            raise ValueError(f"save_interval_steps must be >= 1 or None, got {self.save_interval_steps}")
        if self.max_to_keep is not None and self.max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None, got {self.max_to_keep}")
        if self.keep_period is not None and self.keep_period < 1:
            raise ValueError(f"keep_period must be >= 1 or None, got {self.keep_period}")
        if "/" in self.step_prefix or self.step_prefix.startswith("."):
            raise ValueError(f"step_prefix must be a plain name, got {self.step_prefix!r}")
        if self.step_digits is not None and self.step_digits < 1:
            raise ValueError(f"step_digits must be >= 1 or None, got {self.step_digits}")
        if self.save_interval_secs is not None and not self.save_interval_secs > 0:
            raise ValueError(f"save_interval_secs must be > 0 or None, got {self.save_interval_secs}")
        if self.save_on_preemption and not self.preemption_signals:
            raise ValueError("save_on_preemption needs at least one signal in preemption_signals")
        if self.best_mode not in ("max", "min"):
            raise ValueError(f"best_mode must be 'max' or 'min', got {self.best_mode!r}")
        if self.keep_best is not None:
            if self.keep_best < 1:
                raise ValueError(f"keep_best must be >= 1 or None, got {self.keep_best}")
            if self.best_fn is None:
                raise ValueError("keep_best needs best_fn, which scores a step's metrics")
            if self.max_to_keep is None:
                raise ValueError(
                    "keep_best needs max_to_keep (the newest steps kept besides the best): without it every "
                    "step is kept and keep_best changes nothing"
                )

    def step_name(self, step: int) -> str:
        digits = f"{step}" if self.step_digits is None else f"{step:0{self.step_digits}d}"
        return f"{self.step_prefix}{digits}"

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

    @property
    def decides_collectively(self) -> bool:
        """Whether a save's due-ness depends on something that differs between ranks
        (a clock, a signal), so that ranks must agree on it at every call."""
        return self.save_interval_secs is not None or self.save_on_preemption


def _require_int_or_none(name: str, value: Any) -> None:
    """Refuses a count of steps or digits that is not an int (a float from a config file,
    a bool): it would fail every save later, after the commit, or save other steps."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
        raise ValueError(f"CheckpointManagerOptions.{name} must be an int or None, got {value!r}")


def ranked_steps(scores: Mapping[int, float | None], best_mode: Literal["max", "min"]) -> list[int]:
    """The steps of ``scores`` (step -> ``best_fn`` score; None: saved without metrics,
    not ranked), best first: by score as ``best_mode`` says, ties to the newer step,
    NaN last."""

    def rank(step: int) -> tuple[bool, float, int]:
        score = scores[step]
        assert score is not None
        if math.isnan(score):
            return (False, 0.0, step)
        return (True, score if best_mode == "max" else -score, step)

    return sorted((s for s, score in scores.items() if score is not None), key=rank, reverse=True)


def steps_to_delete(
    committed: Iterable[int],
    options: CheckpointManagerOptions,
    protected: Iterable[int] = (),
    scores: Mapping[int, float | None] | None = None,
) -> list[int]:
    """The committed steps retention removes, ascending: all but the newest
    ``max_to_keep``, the multiples of ``keep_period`` and (with ``keep_best``) the best
    by ``scores``; never the newest step and never a ``protected`` one (the step just
    saved, which another manager's newer commit may have pushed out of the newest
    ``max_to_keep``). With ``keep_best``, a committed step missing from ``scores`` (its
    metrics could not be read: it may be among the best) is kept."""
    ordered = sorted(set(committed))
    if options.max_to_keep is None or not ordered:
        return []
    kept = set(ordered[-options.max_to_keep :]) | {ordered[-1]} | set(protected)
    if options.keep_best is not None:
        known = scores or {}
        best = ranked_steps(known, options.best_mode)[: options.keep_best]
        kept |= set(best) | {s for s in ordered if s not in known}
    return [s for s in ordered if s not in kept and not options.is_kept_forever(s)]


class Resumed(NamedTuple):
    """What ``CheckpointManager.resume`` found (a tuple, so that
    ``start, restored = manager.resume(state)`` unpacks it).

    Attributes:
        next_step: the step to train next: the newest committed step + 1 (0: none).
        state: what ``restore`` returned for the newest committed step (None: nothing
            was committed, a fresh start). The request's tensors of the stored dtype and
            shape were loaded in place; plain values and ShardedObjects (an iteration
            count, RNG states) are here only.
    """

    next_step: int
    state: StateDict | None


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

    **Steps.** Each step is a checkpoint directory under ``root``, named
    ``options.step_name(step)``: ``step_prefix`` followed by the step, zero-padded to
    ``step_digits`` digits (``iter_0001000``, Megatron-LM's naming, by default;
    ``step_digits=None``: not padded; ``step_prefix=""``: the bare number, Orbax's
    default). Orbax appends an underscore to its ``step_prefix``; here the prefix is
    taken as written, so Orbax's ``step_prefix="step", step_format_fixed_length=4`` is
    ``step_prefix="step_", step_digits=4``. A step is a directory with a commit record
    that reads and checks (``shardstore.format.records.read_commit_record``'s check). A
    save that died midway (its staging directory: ``shardstore.format.commit``) is not
    one; neither is a directory whose record is damaged (not JSON, not a shardstore
    record, unreadable): it is never counted, so it can neither be restarted from nor
    push a good step out of the newest ``max_to_keep``. Retention logs it at WARNING and
    leaves it alone. Other names are not steps.

    **Retention** runs on the coordinator after each commit. It deletes the committed
    steps beyond the newest ``max_to_keep`` that are not multiples of ``keep_period`` nor
    among the ``keep_best`` best (below), and never the newest committed step nor the
    step just saved (which is not the newest when another manager committed a newer step
    meanwhile). It never touches a directory it cannot prove is one of its own
    checkpoints: foreign directories (a user's folder, a DCP or Megatron checkpoint
    named like a step), damaged records and saves in progress stay. Because a damaged
    or unreadable record is not counted, an unreadable *newer* directory makes retention
    keep more, never less: ``max_to_keep`` readable steps always remain besides it.

    **Keep-best.** ``save(step, state, metrics={"loss": 1.7})`` stores the metrics (a
    flat mapping of names to numbers, the coordinator's) in the step itself, in its
    common state under the reserved key ``shardstore_manager`` (``{"metrics": {...}}``),
    so a restarted manager ranks the old steps as the one that saved them. With
    ``best_fn`` (metrics -> number, higher is better unless ``best_mode="min"``) and
    ``keep_best=N``, retention also keeps the N best committed steps. Unlike Orbax, where
    ``best_fn`` turns ``max_to_keep`` into "keep the N best" and the newest steps go when
    they are not among them (``_get_default_preservation_policy``: ``BestN`` replaces
    ``LatestN``), both hold here: the newest ``max_to_keep`` *and* the best
    ``keep_best``. A step saved without metrics is ranked nowhere and goes by the other
    rules; a step whose metrics cannot be read (an unreadable or refused common state, a
    ``best_fn`` that fails on them) may be among the best, so it is kept (WARNING once);
    Orbax's ``keep_checkpoints_without_metrics=True`` keeps both kinds.
    Ties go to the newer step; a NaN score ranks last. The metrics live in the common
    state because that is what every save already writes: atomically with the step,
    bound to it by its sealed record, read by every shardstore version (a record field
    or a file of their own would need a hook into the commit that ``shardstore.save``
    does not offer, and older versions refuse a record listing a file they do not
    know). ``restore`` removes the key again; a plain ``shardstore.load`` shows it.

    **Deletion** of a step goes in an order that a crash at any point leaves
    recoverable: (1) a marker ``.shardstore-deleting.json`` naming the step and its
    record's save id, with a copy of the record, is written into the step (durably),
    (2) the commit record goes (from here on it is not a step), (3) the files the
    record vouches for (``CommitRecord.vouched_paths``) and ``metadata.json``, (4) the
    marker, (5) the directory, if nothing else is in it. Anything else stays, WARNING
    naming it: another program's files that a save with ``shared_directory=True`` was
    published beside (the record's ``beside``), a file added into the step after its
    commit (``eval_results.json``). A directory with that marker and no commit record is
    an interrupted deletion, provably ours: the next retention (or ``rollback``, or a
    save of that step) finishes it (a marker of a shardstore before the record was
    copied into it does not say what the save wrote: there, everything in the
    directory goes, as that shardstore did). A directory without a record and without
    our marker is never deleted (an interrupted deletion by a shardstore older than the
    marker cannot be told from someone else's directory: delete it yourself). A crash
    between (1) and (2) leaves the step committed with our marker of its save in it:
    where the manager then keeps the step (retention keeps it, ``rollback`` goes back
    to it, a save replaces it), it removes that marker (INFO). A crash
    between (4) and (5) can leave an empty directory, which a later save of that step
    replaces. A failed deletion is logged (WARNING) and kept in ``retention_errors``: it
    must not kill a training job whose save succeeded.

    **Resuming.** ``save(step)`` stores the state *after* training step ``step`` (Orbax's
    convention), so a restart restores the newest committed step and trains the one
    after it: ``resume`` does both, so the loop
    ``start, restored = manager.resume(state); for step in range(start, n): train; save(step)``
    trains every step exactly once across restarts. Resuming *at* ``latest_step()``
    instead trains the restored step a second time.

    ``save(step)`` of a step that is already committed writes nothing and returns False
    (sync and async, decided on the coordinator, so every rank agrees);
    ``overwrite=True`` (a keyword of ``shardstore.save``) replaces it. When this manager
    saved that step itself (a final ``save(step, force=True)`` after the loop saved it)
    that is expected and logged at INFO. Otherwise it is logged at WARNING: the step was
    committed before this manager started or by another manager, which is what a loop
    that trains the restored step again does (so is ``save`` of a step at or before the
    one ``restore`` or ``resume`` loaded, warned about even when the step is not due). It
    is not an error: nothing on disk is wrong (the committed step is kept, not replaced
    by a state trained one step further), such a loop must not fail at every restart,
    and the cost is one step trained twice; the warning names the fix.

    **When to save.** ``save(step, ...)`` writes when the step is due: a multiple of
    ``save_interval_steps`` (None: never by steps), or ``save_interval_secs`` seconds
    have passed since this manager's last save (or its creation), or a preemption signal
    arrived (``save_on_preemption``), or ``force=True``. Time and signals are not the
    same on every rank, so with either option set every ``save`` and ``should_save``
    call is a collective (one all-reduce of two integers): the coordinator's clock
    decides the interval, and a signal on *any* rank counts, so every rank takes the
    same branch. The interval counts from this manager's start, not from the newest
    checkpoint's commit as Orbax's ``ContinuousCheckpointingPolicy`` does: after a
    restart the work at risk is what was trained since the restore.

    **Preemption** (``save_on_preemption=True``, opt-in): the manager, created in the
    main thread (CheckpointingException otherwise), listens for ``preemption_signals``
    (SIGTERM) through one process-wide handler (``shardstore.tools.preemption``): every
    manager that listens sees each signal, and a handler that was installed before them
    (a framework's, the user's) is called after them; the signal's *default* action
    (SIGTERM ends the process) is held back while a manager listens, since it would end
    the process before the save. ``close`` stops listening; the last manager to close,
    in any order, puts the previous handler back exactly, unless someone installed their
    own over it meanwhile (theirs stays). A signal no ``save`` acted on (one during
    ``close``) then takes that default, after ``close`` committed the save in flight. The manager's part of the handler only counts
    the signal (no I/O, no logging, no lock: it runs between two bytecodes of whatever
    the main thread was doing). The next ``save`` agrees on it across ranks and saves
    that step whatever the intervals say; it first commits an async save in flight, and
    an async preemption save is waited for, so the step is committed when ``save``
    returns. ``reached_preemption()`` then stays True on every rank: the trainer stops
    (``close``, exit). Orbax's ``reached_preemption(step)`` asks JAX's preemption sync
    point; here it reports what the last agreement found, with no collective of its own.

    **delete(step)** (collective) deletes one committed step through the deletion above.
    It refuses the newest committed step (the one a restart resumes from; also the only
    one) unless ``force=True``: dropping the newest loses the latest progress, which the
    manager never does on its own; ``rollback`` is the way to make an older step the
    newest. A step that is not committed is refused (Orbax: FileNotFoundError), except
    an interrupted deletion of ours, which it finishes. **reload()** forgets what the
    manager remembers (the metrics it read, the damaged records it warned about); the
    steps themselves are listed from storage at every call, also without it, so steps
    that another process saved or deleted are always seen.

    **Rollback** is explicit (``rollback``'s docstring says why Orbax's way does not fit):

    * ``save(step)`` older than the newest committed step raises a CheckpointingException
      before anything is written (every rank, sync and async), naming the newer step and
      ``rollback``; nothing is deleted.
    * ``rollback(step)`` (collective) makes the committed ``step`` the newest: it deletes
      every committed step after it, newest first, through the deletion above, and
      returns them. Training then saves onward from ``step``. It is not atomic: if it is
      interrupted, ``latest_step`` may still name a newer step; call it again (it
      finishes what it began). Damaged or foreign directories after ``step`` stay
      (WARNING).

    **Collective** like ``save``: every rank of the group calls ``save``, ``resume``,
    ``restore``, ``rollback``, ``delete``, ``wait_until_finished`` and ``close`` with the
    same steps (and ``should_save`` when time or preemption decide). With
    ``async_save``, a ``save`` call that is not due is a collective too while a save is
    in flight: it commits that save, without waiting, once its writes finished on every
    rank (one all-reduce; Megatron-LM finalizes at every step the same way). So call
    ``save`` at the same steps on every rank; calling it at every step (the loop below)
    commits an async save at the first step after its writes finish, while a loop that
    calls it only at due steps commits it at the next due one (or ``close``). Whether a due
    ``save`` writes (new step), is a no-op (committed) or is refused (older than the
    newest) is decided on the coordinator and broadcast, so the ranks never disagree.
    Retention runs on the coordinator after the commit without a barrier, so another
    rank may still list a step that is being deleted. Finding steps reads commit
    records: each ``latest_step`` reads the newest records until one checks;
    ``all_steps`` reads every step's; retention reads the newest ``max_to_keep`` and
    those it may delete (one GET each on object stores), not the ``keep_period`` steps
    older than those (with ``keep_best``: every step's record, and each step's metrics
    once per manager). Reading a step's metrics costs its record, its ``metadata.json``
    and its ``common.pt`` once per manager (cached by save id).

    Args:
        root: directory (local path, ``s3://bucket/prefix`` or a Location) holding one
            checkpoint per step.
        options: when to save and what to keep.
        process_group: the ranks that save together (default: the world).
        clock: seconds, for ``save_interval_secs`` (default ``time.monotonic``: a
            wall clock set back or forward must not skip or force a save); tests
            inject their own.

    Example::

        manager = CheckpointManager("/ckpt/run1", CheckpointManagerOptions(
            save_interval_steps=1000, max_to_keep=3, keep_period=10000, async_save=True,
            save_on_preemption=True, best_fn=lambda m: m["loss"], best_mode="min", keep_best=2))
        state = sharded_state_dict(model)
        start, restored = manager.resume(state)  # the step after the newest committed one (0: none)
        for step in range(start, steps):
            loss = ...  # train step `step`
            manager.save(step, state, metrics={"loss": loss})  # writes when due
            if manager.reached_preemption():
                break
        manager.close()
    """

    def __init__(
        self,
        root: str | os.PathLike | Location,
        options: CheckpointManagerOptions | None = None,
        *,
        process_group: dist.ProcessGroup | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root = bare_location(root)
        self.options = options or CheckpointManagerOptions()
        self.process_group = process_group
        self.retention_errors: list[str] = []
        self._damaged_seen: set[tuple[int, str]] = set()
        self._metrics_cache: dict[tuple[int, str], dict[str, float] | None] = {}
        self._unreadable_metrics_seen: set[tuple[int, str]] = set()
        self._markers_checked: set[tuple[int, str]] = set()  # committed steps seen without our marker
        self._clock = clock
        self._last_save_time = clock()
        self._signals_heard: list[int] = []  # appended to by the signal handler only
        self._signals_acted_on = 0
        self._preempted = False
        self._restored_step: int | None = None  # the step restore or resume loaded last
        self._warned_resaving_restored = False
        self._saved_steps: set[int] = set()  # the steps this manager saved (committed or in flight)
        self._failed_bases: set[int] = set()  # steps whose reuse a failed save had (not chosen again)
        self._async_base: tuple[int, int] | None = None  # (base, step) of the async save in flight reusing base
        self._queue = AsyncCallsQueue(process_group=process_group) if self.options.async_save else None
        self._strategy: tuple[Any, dict[str, Any], Any] | None = None  # ``_plan_keeping_strategy``
        self._preemption: Listener | None = None
        self._closed = False
        if self.options.save_on_preemption:
            try:  # main thread only; every manager sees the signal, and the handler before them too
                self._preemption = listen(self.options.preemption_signals, self._on_preemption_signal)
            except CheckpointingException:
                self.close()
                raise

    # ------------------------------------------------------------------ finding steps

    def location(self, step: int) -> Location:
        """Where ``step`` is (or would be) saved."""
        return self.root.child(self.options.step_name(step))

    def all_steps(self) -> list[int]:
        """The committed steps (commit record reads and checks), ascending. Incomplete
        saves, damaged records (WARNING) and other directories are left out. Reads every
        step's commit record."""
        return sorted(self._committed_states())

    def latest_step(self) -> int | None:
        """The newest committed step, or None: newer directories whose record is
        damaged (WARNING) or missing are skipped. Reads the newest records until one
        checks."""
        return self._newest_committed(self._named_steps())

    def step_state(self, step: int) -> StepState:
        """What the directory of ``step`` holds (``StepState``); reads its commit record
        (the check of ``shardstore.format.records.read_commit_record``) and, without one, our
        deletion marker. Never raises for what it finds: a record that does not parse
        or check (or is larger than any record) is ``damaged``.

        Raises:
            CheckpointingException: the record or marker could not be read now (an I/O
                or network error, after the store's retries), or the record is of a
                format version this shardstore cannot read (``UnsupportedFormatVersion``:
                upgrade shardstore): counted as damaged, the step would be skipped, and
                a resume would silently start from an older one."""
        location = self.location(step)
        try:
            data = location.read_bytes_or_none(COMMIT_RECORD, max_bytes=MAX_RECORD_BYTES)
            if data is None:
                marker = _marker_save_id(location, step)
                return StepState(step, "other") if marker is None else StepState(step, "deleting", save_id=marker)
            record = CommitRecord.from_json(data, where=location.describe(COMMIT_RECORD))
        except OSError as exc:
            if exc.__cause__ is None:  # the store's own refusal (an oversized file): what is there is damaged
                return StepState(step, "damaged", reason=f"{type(exc).__name__}: {exc}")
            raise CheckpointingException(
                f"Cannot read step {step}'s commit record under {self.root.describe()} now ({exc}); not counting "
                "the step as damaged, so that no resume or retention goes by an older one: retry when the "
                "storage answers"
            ) from exc
        except UnsupportedFormatVersion:  # a newer shardstore's step: not damage
            raise
        except Exception as exc:  # a record crafted to trip the parser is damaged too
            return StepState(step, "damaged", reason=f"{type(exc).__name__}: {exc}")
        return StepState(step, "committed", save_id=record.save_id)

    def verify(self, progress: bool = False) -> RootVerifyReport:
        """``shardstore.verify`` of every step that has a commit record, a damaged one
        included (``all_steps`` leaves those out), with each damaged file listed once
        with every step that shares it (incremental saves hard-link unchanged chunks:
        ``tools.root_verify``). Never raises for damage. Not collective: call it on one
        rank."""
        steps = {self.options.step_name(step): self.location(step) for step in self._named_steps()}
        return verify_checkpoints(
            self.root.describe(), {name: loc for name, loc in steps.items() if loc.exists(COMMIT_RECORD)}, progress,
            leftovers_under(self.root),
        )

    def metrics(self, step: int) -> dict[str, float] | None:
        """The metrics saved with the committed ``step`` (``save(metrics=...)``), or None
        if it was saved without. Read from the step's common state (cached by save id).

        Raises:
            CheckpointingException: ``step`` is not committed, or its common state
                cannot be read.
        """
        state = self.step_state(step)
        if state.kind != "committed":
            raise CheckpointingException(
                f"No metrics for step {step} under {self.root.describe()}: it is not a committed checkpoint "
                f"({state.reason or state.kind}). Committed steps: {self.all_steps()}."
            )
        return self._read_metrics(state)

    def best_step(self) -> int | None:
        """The committed step whose metrics ``best_fn`` scores best (ties: the newer), or
        None when no step has metrics it can score; without ``best_fn``, the latest step.
        Reads every step's record and (once per manager) its metrics."""
        if self.options.best_fn is None:
            return self.latest_step()
        ranked = ranked_steps(self._scores(self._committed_states()), self.options.best_mode)
        return ranked[0] if ranked else None

    def should_save(self, step: int) -> bool:
        """Whether ``save(step, ...)`` would save now: ``step`` is a multiple of
        ``save_interval_steps``, or ``save_interval_secs`` have passed, or a preemption
        signal arrived. Collective when time or signals decide (class docstring): every
        rank calls it, and every rank gets the same answer. Says nothing about whether
        the step is already committed (then ``save`` is a no-op)."""
        due, _, _ = self._due(step, force=False)
        return due

    def reached_preemption(self) -> bool:
        """True once a ``save`` or ``should_save`` found that a preemption signal reached
        a rank (``save_on_preemption``); the same on every rank, since it comes from
        their agreement. No collective of its own: the trainer checks it after ``save``
        and stops."""
        return self._preempted

    def reload(self) -> None:
        """Forgets what this manager remembers of the root: the metrics it read and the
        damaged records and unreadable metrics it warned about (they are warned about
        again). The steps are read from storage at every call anyway."""
        self._metrics_cache.clear()
        self._unreadable_metrics_seen.clear()
        self._markers_checked.clear()
        self._damaged_seen.clear()

    def _named_steps(self) -> list[int]:
        """Steps that have a directory named for them (committed or not), ascending."""
        steps = (self.options.parse_step(name) for name in self.root.list_top(limit=None))
        return sorted(s for s in steps if s is not None)

    def _committed_states(self) -> dict[int, StepState]:
        states = [self.step_state(step) for step in self._named_steps()]
        for state in states:
            self._warn_if_damaged(state)
        return {s.step: s for s in states if s.kind == "committed"}

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

    # ------------------------------------------------------------------ metrics

    def _read_metrics(self, state: StepState) -> dict[str, float] | None:
        """The metrics in the committed step ``state``'s common state (None: saved
        without), read through its commit record, so they are the bytes it vouches for;
        raises if they cannot be read. Cached by (step, save id): a replaced step has a
        new save id, so the cache never answers for another save."""
        from shardstore.opened import open_read
        from shardstore.serialization import load_common_state_dict

        key = (state.step, state.save_id)
        if key in self._metrics_cache:
            return self._metrics_cache[key]
        opened = open_read(self.location(state.step))
        if opened.require_record().save_id != state.save_id:
            raise CheckpointingException(f"{opened.describe()} was replaced while its metrics were read")
        common = load_common_state_dict(opened)
        entry = common.get(MANAGER_STATE_KEY) if isinstance(common, dict) else None
        metrics = entry.get("metrics") if isinstance(entry, dict) else None
        if metrics is not None:
            metrics = _checked_metrics(metrics, f"step {state.step} at {opened.describe()}")
        self._metrics_cache[key] = metrics
        return metrics

    def _scores(self, committed: Mapping[int, StepState]) -> dict[int, float | None]:
        """``best_fn`` of each committed step's metrics (None: saved without metrics). A
        step whose metrics cannot be read or scored is left out (WARNING once): it may
        be among the best, so retention keeps it."""
        best_fn = self.options.best_fn
        assert best_fn is not None
        scores: dict[int, float | None] = {}
        for step, state in committed.items():
            try:
                metrics = self._read_metrics(state)
                scores[step] = None if metrics is None else _score(best_fn, metrics)
            except Exception as exc:  # kept, never deleted for what could not be read
                key = (step, state.save_id)
                first = key not in self._unreadable_metrics_seen
                self._unreadable_metrics_seen.add(key)
                logger.log(
                    logging.WARNING if first else logging.DEBUG,
                    "Cannot rank checkpoint step %d at %s by its metrics (%s: %s); retention keeps it",
                    step,
                    self.location(step).describe(),
                    type(exc).__name__,
                    exc,
                )
        return scores

    # ------------------------------------------------------------------ saving

    def save(
        self,
        step: int,
        sharded_state_dict: ShardedStateDict,
        *,
        metrics: Metrics | None = None,
        force: bool = False,
        **save_kwargs: Any,
    ) -> bool:
        """Saves ``step`` when it is due (``should_save``) or ``force``; returns whether it
        saved. Collective.

        ``step`` is the state after training step ``step``: a restarted loop continues
        at the step after the restored one (``resume``). An async save first commits
        the previous one (one in flight at a time); a call for a step that is not due
        commits, without waiting, an async save whose writes have finished (collective
        while one is in flight: call ``save`` at the same steps on every rank). A step
        that is already committed is not saved again (returns False; WARNING unless
        this manager saved it: class docstring, Resuming), unless ``overwrite=True``.
        A step older than the newest
        committed one is refused (CheckpointingException, nothing written): call
        ``rollback`` first. A save due to a preemption signal is committed when ``save``
        returns, also an async one. Extra keyword arguments go to ``shardstore.save``,
        except ``async_sharded_save`` and ``process_group``, which the manager sets
        (``CheckpointManagerOptions.async_save``, ``process_group``): refused.

        Args:
            step: an int from 0 on (another type is refused).
            metrics: numbers to keep with the step (``{"loss": 1.7}``), for ``best_fn``
                and ``metrics(step)``; the coordinator's are saved. With ``best_fn``,
                they must be scorable: a ``best_fn`` that fails on them refuses the save.
        """
        self._refuse_if_closed(f"save step {step}")
        step = self._checked_step(step, "Not saving")
        self._refuse_managers_arguments(save_kwargs, f"Not saving step {step}")
        if MANAGER_STATE_KEY in sharded_state_dict:
            raise CheckpointingException(
                f"Not saving step {step} under {self.root.describe()}: the state dict holds the key "
                f"{MANAGER_STATE_KEY!r}, which the manager keeps for its metrics; rename that entry"
            )
        if step < 0:
            raise CheckpointingException(
                f"Not saving step {step} under {self.root.describe()}: steps are numbers from 0 on"
            )
        caller_chose_base = "reuse_from" in save_kwargs  # reuse_from=None too: no base
        options = SaveOptions.resolve(save_kwargs.pop("options", None), SaveOptions(
            **{name: save_kwargs.pop(name) for name in ("overwrite", "reuse_from", "shared_directory") if name in save_kwargs}
        ))
        overwrite = bool(options.overwrite)
        if not overwrite and self._restored_step is not None and step <= self._restored_step:
            self._warn_resaving_restored(step)
        due, preempted, signals = self._due(step, force)
        if not due:
            self._commit_finished_saves()
            return False
        from shardstore.serialization import save

        if self._queue is not None:
            self._finalize_async_saves(blocking=True)  # the check below sees it
        committed, checked, reuse_step = self._on_coordinator(lambda: self._prepare_save(step, overwrite, metrics))
        self._last_save_time = self._clock()
        if preempted:
            self._signals_acted_on = signals
        if committed:
            self._log_not_saving_committed(step)
            return False
        self._saved_steps.add(step)
        if checked is not None:
            sharded_state_dict = {**sharded_state_dict, MANAGER_STATE_KEY: {"metrics": checked}}
        target = self.location(step)
        chosen_base = None
        if reuse_step is not None and self.options.reuse_unchanged and not caller_chose_base and options.reuse_from is None:
            chosen_base = reuse_step
            options = replace(options, reuse_from=self.location(reuse_step))
        if self.options.cache_plan and "sharded_strategy" not in save_kwargs:
            save_kwargs["sharded_strategy"] = self._plan_keeping_strategy()
        retention = functools.partial(self._apply_retention, step, checked)
        with self._base_failures_noted(chosen_base, step):
            request = save(
                sharded_state_dict, target, async_sharded_save=self._queue is not None,
                process_group=self.process_group, options=options, **save_kwargs,
            )
        if self._queue is None:
            retention()
            return True
        request.add_finalize_fn(retention)
        self._async_base = None if chosen_base is None else (chosen_base, step)
        self._queue.schedule_async_request(request)  # a failed preload stays queued: the finalize says it
        if preempted:  # the job may be killed any moment now: commit before returning
            self._finalize_async_saves(blocking=True)
        return True

    def _commit_finished_saves(self) -> None:
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
        from shardstore.serialization import get_default_save_sharded_strategy
        from shardstore.strategies.zarr import ZarrSaveShardedStrategy

        default = get_default_save_sharded_strategy()
        if not isinstance(default, ZarrSaveShardedStrategy) or default.cache_plan:
            return None
        settings = dict(vars(default))  # the objects it holds: a setting changed is another one
        if self._strategy is None or self._strategy[0] is not default or not _same_objects(self._strategy[1], settings):
            copied = copy.copy(default)
            copied.cache_plan = True
            self._strategy = (default, settings, copied)
        return self._strategy[2]

    def _due(self, step: int, force: bool) -> tuple[bool, bool, int]:
        """(due, preempted, signals counted here when it was decided). Without time or
        signals: the step's number decides, on each rank alike. With them: one
        all-reduce, in which the coordinator says whether ``save_interval_secs`` have
        passed and every rank whether a signal arrived since the last save it counted."""
        options = self.options
        by_step = force or (options.save_interval_steps is not None and step % options.save_interval_steps == 0)
        if not options.decides_collectively:
            return by_step, False, 0
        signals = len(self._signals_heard)  # read once: a signal from here on counts next time
        group = Group(self.process_group)
        by_time = (
            group.is_coordinator
            and options.save_interval_secs is not None
            and self._clock() - self._last_save_time >= options.save_interval_secs
        )
        by_time, preempted = _any_rank(group, (by_time, signals > self._signals_acted_on))
        if preempted and not self._preempted:
            logger.warning(
                "A preemption signal reached a rank: saving step %d now under %s%s",
                step,
                self.root.describe(),
                " and waiting for its commit" if self._queue is not None else "",
            )
        self._preempted = self._preempted or preempted
        return by_step or by_time or preempted, preempted, signals

    def _prepare_save(
        self, step: int, overwrite: bool, metrics: Metrics | None
    ) -> tuple[bool, dict | None, int | None]:
        """Coordinator, before a save: (whether ``step`` is committed already, the
        metrics to store, checked, the newest committed step up to ``step`` to reuse
        unchanged chunks from). Raises what refuses the save."""
        checked = None
        if metrics is not None:
            checked = _checked_metrics(metrics, f"the metrics given to save({step})")
            if self.options.best_fn is not None:
                try:
                    _score(self.options.best_fn, checked)
                except Exception as exc:
                    raise CheckpointingException(
                        f"Not saving step {step} under {self.root.describe()}: best_fn cannot score its metrics "
                        f"{checked} ({type(exc).__name__}: {exc}); pass the metrics best_fn reads. Nothing was "
                        "written."
                    ) from exc
        elif self.options.best_fn is not None:
            logger.info("Saving step %d without metrics: best_fn does not rank it", step)
        committed = self._is_committed_or_refused(step, overwrite)
        reuse_step = None
        if self.options.reuse_unchanged and not committed:
            reuse_step = self._newest_committed([s for s in self._named_steps() if s <= step])
            if reuse_step in self._failed_bases:
                reuse_step = None  # not an older step instead: it would share less
        return committed, checked, reuse_step

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
                    "do not share chunks with step %d", step, base, self.root.describe(), base,
                )
            raise

    def _is_committed_or_refused(self, step: int, overwrite: bool) -> bool:
        """Coordinator, before a save: True if ``step`` is committed (nothing to save);
        raises if a newer step is committed; finishes an interrupted deletion of ours in
        the step's directory so that the save can go there."""
        named = self._named_steps()
        if step in named:
            state = self.step_state(step)
            if state.kind == "committed" and not overwrite:
                return True
            if state.kind == "committed":
                self._keep_with_its_marker_removed(state)  # shardstore.save refuses to replace a step holding it
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

    def _warn_resaving_restored(self, step: int) -> None:
        """WARNING (once per manager) for a save of a step at or before the one restored:
        the state in memory has been trained past it (class docstring: Resuming)."""
        if self._warned_resaving_restored:
            return
        self._warned_resaving_restored = True
        logger.warning(
            "Saving step %d after restoring step %d from %s: the restored state is the state after step %d, so "
            "training step %d again trains it twice. Start the loop at the step after the restored one: "
            "`start, restored = manager.resume(state)`; `for step in range(start, ...)`",
            step,
            self._restored_step,
            self.root.describe(),
            self._restored_step,
            step,
        )

    def _log_not_saving_committed(self, step: int) -> None:
        """``save`` of a committed step writes nothing: expected when this manager saved it
        (INFO), a sign of a loop that trains a restored step again otherwise (WARNING,
        unless ``_warn_resaving_restored`` said so already)."""
        where = self.location(step).describe()
        if step in self._saved_steps:
            logger.info("Not saving step %d again: this manager committed it to %s", step, where)
            return
        already_warned = self._restored_step is not None and step <= self._restored_step
        logger.log(
            logging.DEBUG if already_warned else logging.WARNING,
            "Not saving step %d: %s already holds it committed, saved before this manager started or by another "
            "manager; nothing was written. If this run restored that step and trained it again, start the loop "
            "at the step after it (`start, restored = manager.resume(state)`). Pass overwrite=True to replace it.",
            step,
            where,
        )

    def wait_until_finished(self) -> None:
        """Blocks until every async save has committed (collective)."""
        if self._queue is not None:
            self._finalize_async_saves(blocking=True)

    def close(self) -> None:
        """Commits the async saves still in flight, stops the background worker and puts
        back the signal handlers that ``save_on_preemption`` replaced. A preemption
        signal that no ``save`` acted on (one that arrived during ``close`` or after the
        last ``save``) then takes its default, which was held back for that save, once
        no manager listens (SIGTERM ends the process). The manager then refuses
        ``save``, ``resume``, ``restore``, ``rollback`` and ``delete``; calling ``close``
        again does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._queue is not None:
                with self._async_failures_noted():
                    self._queue.close()
        except BaseException as exc:
            self._stop_listening(exc)
            raise
        self._stop_listening(None)

    def _stop_listening(self, failure: BaseException | None) -> None:
        """Stops listening for preemption signals, then hands the ones no save acted on
        to the default held back for them (``Listener.take_held_back_defaults``); says
        so first, with what ``close`` failed with, since SIGTERM's default ends the
        process at once."""
        if self._preemption is None:
            return
        self._preemption.close()
        unheeded = set(self._signals_heard[self._signals_acted_on :])  # all: it hears nothing more
        if not unheeded:
            return
        closing = "committed what was in flight" if failure is None else f"failed ({type(failure).__name__}: {failure})"
        logger.warning(
            "Preemption signal(s) %s reached this process after its last save under %s; closing the manager %s; "
            "passing the signal on",
            sorted(unheeded),
            self.root.describe(),
            closing,
        )
        self._preemption.take_held_back_defaults(unheeded)

    def _checked_step(self, step: Any, refusal: str) -> int:
        """``step`` as an int; a float, a bool or anything else not an integer is
        refused (its directory name would not be a step's)."""
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise CheckpointingException(
                f"{refusal} step {step!r} under {self.root.describe()}: a step is an int, got "
                f"{type(step).__name__}; pass the training step's number (int(step))"
            )
        return int(step)

    def _refuse_managers_arguments(self, kwargs: Mapping[str, Any], refusal: str) -> None:
        """Refuses keyword arguments for ``shardstore.save``/``load`` that the manager
        sets itself, naming the option that chooses them."""
        chosen = {
            "async_sharded_save": "CheckpointManagerOptions(async_save=...)",
            "process_group": "CheckpointManager(..., process_group=...)",
        }
        for name, where in chosen.items():
            if name in kwargs:
                raise CheckpointingException(
                    f"{refusal} under {self.root.describe()}: the manager passes {name}= itself; set it with "
                    f"{where} instead"
                )

    def _refuse_if_closed(self, action: str) -> None:
        """Raises before ``action`` does anything once ``close`` was called."""
        if self._closed:
            raise CheckpointingException(
                f"Cannot {action} under {self.root.describe()}: this CheckpointManager was closed; create a new "
                "CheckpointManager for the root. Nothing was written or deleted."
            )

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ preemption

    def _on_preemption_signal(self, signum: int) -> None:
        """Called by the process-wide handler (``shardstore.tools.preemption``): notes it,
        nothing else (no I/O, no logging, no lock; the next ``save`` acts on it)."""
        self._signals_heard.append(signum)

    # ------------------------------------------------------------------ rollback and delete

    def rollback(self, step: int) -> list[int]:
        """Makes the committed ``step`` the newest step by deleting every committed step
        after it, newest first; returns those steps, descending. Collective: every rank
        calls it (after async saves in flight commit); the coordinator deletes.

        Use it to continue training from an older step (restore ``step``, ``rollback``,
        save onward): ``save`` refuses a step older than the newest committed one. Not
        atomic: if it is interrupted, call it again. Directories after ``step`` that are
        not committed shardstore steps are left alone (WARNING), except interrupted
        deletions of ours, which it finishes.

        Why not Orbax's way: its ``CheckpointManager.should_save`` returns False for any
        step at or below its latest step, so ``save`` silently skips it until training
        passes the latest step again; with ``force=True`` it saves the older step,
        refuses one that exists (``StepAlreadyExistsError``), and its retention
        (``LatestN`` over the steps in the order saved, so the older step just saved
        counts as the newest) can then delete committed steps *newer* than it (orbax
        ``checkpoint_manager.py``: ``should_save``, ``save``, ``_get_old_steps_to_remove``).
        Neither fits "never lose a committed checkpoint, and restart from the right
        one": a skipped save loses the progress after the rollback, and keeping the newer
        steps would make a restart resume from the abandoned history (``latest_step``
        names the newest) while ``save`` of those step numbers later would find the old
        ones.

        Raises:
            CheckpointingException: ``step`` is not a committed step (nothing deleted),
                or a deletion failed (call it again).
        """
        self._refuse_if_closed(f"roll back to step {step}")
        step = self._checked_step(step, "Not rolling back to")
        self.wait_until_finished()
        deleted = self._on_coordinator(lambda: self._rollback(step))
        self._saved_steps.difference_update(deleted)
        return deleted

    def _rollback(self, step: int) -> list[int]:
        named = self._named_steps()
        target = self.step_state(step) if step in named else StepState(step, "other")
        if target.kind != "committed":
            reason = target.reason or "no commit record"
            raise CheckpointingException(
                f"Cannot roll back to step {step} under {self.root.describe()}: it is not a committed checkpoint "
                f"({reason}). Committed steps: {self.all_steps()}. Nothing was deleted."
            )
        self._keep_with_its_marker_removed(target)
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

    def delete(self, step: int, *, force: bool = False) -> None:
        """Deletes the committed ``step`` (marker first, as retention does). Collective:
        every rank calls it (after async saves in flight commit); the coordinator deletes.

        The newest committed step (the one a restart resumes from, and the only one when
        there is one) is refused unless ``force=True``; ``rollback`` makes an older step
        the newest. An interrupted deletion of ``step`` (ours) is finished. If the
        deletion fails midway, the step is no longer committed; call ``delete`` again.

        Raises:
            CheckpointingException: ``step`` is not committed or is the newest (nothing
                deleted), or the deletion failed.
        """
        self._refuse_if_closed(f"delete step {step}")
        step = self._checked_step(step, "Not deleting")
        self.wait_until_finished()
        self._on_coordinator(lambda: self._delete_step(step, force))
        self._saved_steps.discard(step)

    def _delete_step(self, step: int, force: bool) -> None:
        named = self._named_steps()
        state = self.step_state(step) if step in named else StepState(step, "other")
        where = f"step {step} under {self.root.describe()}"
        if state.kind not in ("committed", "deleting"):
            raise CheckpointingException(
                f"Cannot delete {where}: it is not a committed checkpoint ({state.reason or 'no commit record'}); "
                f"committed steps: {self.all_steps()}. Nothing was deleted."
            )
        newest = self._newest_committed(named) == step
        if newest and not force:
            only = " and the only one" if self._newest_committed([s for s in named if s < step]) is None else ""
            raise CheckpointingException(
                f"Not deleting {where}: it is the newest committed checkpoint{only}, the one a restart resumes "
                "from. Pass force=True to delete it anyway, or call rollback(<older step>) to go back to an older "
                "one. Nothing was deleted."
            )
        try:
            if state.kind == "deleting":
                self._finish_deletion(step)  # an interrupted deletion of ours: finished
            else:
                self._delete(state)
        except OSError as exc:
            raise CheckpointingException(
                f"Deleting {where} failed ({exc}); it is no longer a committed step. Call delete({step}) again "
                "to finish it."
            ) from exc
        if newest:
            logger.warning("Deleted the newest committed checkpoint, %s (force=True)", where)

    # ------------------------------------------------------------------ retention

    def _apply_retention(self, just_saved: int, metrics: dict[str, float] | None = None) -> None:
        """Coordinator, after the commit of ``just_saved``: finishes interrupted
        deletions and deletes the steps retention no longer keeps. Failures are logged
        and listed in ``retention_errors``, never raised: the save succeeded."""
        if not Group(self.process_group).is_coordinator:
            return
        try:
            unfinished, doomed, kept = self._retention_plan(just_saved, metrics)
        except (CheckpointingException, OSError) as exc:
            self._retention_failed(f"Retention under {self.root.describe()} skipped: cannot list its steps: {exc}")
            return
        for step in unfinished:
            self._retain_safely(step, "finish the interrupted deletion of", lambda s=step: self._finish_deletion(s))
        for state in doomed:
            self._retain_safely(state.step, "delete old checkpoint", lambda s=state: self._delete(s))
        for state in kept:
            self._keep_with_its_marker_removed(state)

    def _retention_plan(
        self, just_saved: int, metrics: dict[str, float] | None = None
    ) -> tuple[list[int], list[StepState], list[StepState]]:
        """(interrupted deletions to finish, committed steps to delete, committed steps
        read and kept). Walks the steps
        newest first: the records of the newest ``max_to_keep`` and of the steps that
        may go are read; ``keep_period`` steps older than those are kept whatever they
        hold, so only a missing record is looked for there (an interrupted deletion),
        unless ``keep_best`` ranks every step (then every record and, once per manager,
        every step's metrics are read). ``metrics``: those ``just_saved`` was saved with,
        ranked as they are, not read back: a common state that also holds a value the
        safe unpickler refuses (``allow_unsafe_pickle``) left every step unranked, and so
        kept, for good."""
        options = self.options
        unfinished: list[int] = []
        committed: dict[int, StepState] = {}
        for step in reversed(self._named_steps()):
            newest_found = options.max_to_keep is not None and len(committed) >= options.max_to_keep
            kept_unread = options.max_to_keep is None or (
                newest_found and options.is_kept_forever(step) and options.keep_best is None
            )
            if step != just_saved and kept_unread and self.location(step).exists(COMMIT_RECORD):
                continue
            state = self.step_state(step)
            if state.kind == "committed":
                committed[step] = state
                if step == just_saved:
                    self._metrics_cache.setdefault((step, state.save_id), metrics)
            elif state.kind == "deleting":
                unfinished.append(step)
            else:
                self._warn_if_damaged(state)
        scores = self._scores(committed) if options.keep_best is not None and options.max_to_keep is not None else None
        doomed = steps_to_delete(committed, options, protected=(just_saved,), scores=scores)
        kept = [state for step, state in sorted(committed.items()) if step not in doomed]
        return unfinished, [committed[s] for s in doomed], kept

    def _retain_safely(self, step: int, what: str, action: Callable[[], None]) -> None:
        try:
            action()
        except (CheckpointingException, OSError) as exc:
            self._retention_failed(f"Could not {what} step {step} at {self.location(step).describe()}: {exc}")

    def _retention_failed(self, message: str) -> None:
        logger.warning("%s", message)
        self.retention_errors.append(message)

    # ------------------------------------------------------------------ deleting

    def _keep_with_its_marker_removed(self, state: StepState) -> None:
        """Coordinator: removes our deletion marker from the committed step ``state``,
        which is kept, where the marker is of this very save (a deletion cut short
        before the commit record went: left there, ``verify`` reports the step damaged
        and a save with ``overwrite=True`` refuses it). Looked for once per step and
        save id per manager (``reload`` forgets). A deletion of this step that another
        manager is making at this moment then fails and leaves a directory without a
        record (not a step; delete it yourself). A failure is logged and kept in
        ``retention_errors``, as retention's are: the step itself is whole."""
        key = (state.step, state.save_id)
        if key in self._markers_checked:
            return
        location = self.location(state.step)
        try:
            if _marker_save_id(location, state.step) != state.save_id:
                self._markers_checked.add(key)
                return
            location.remove(DELETION_MARKER)
        except (CheckpointingException, OSError) as exc:
            self._retention_failed(
                f"Could not remove {DELETION_MARKER} (a deletion cut short) from the kept step {state.step} at "
                f"{location.describe()}: {exc}; remove it yourself"
            )
            return
        self._markers_checked.add(key)
        logger.info(
            "Removed %s from the committed step %d at %s: a deletion of it was cut short before its commit record "
            "went, and the step is kept",
            DELETION_MARKER,
            state.step,
            location.describe(),
        )

    def _delete(self, state: StepState) -> None:
        """Deletes the committed step ``state`` (read just before) in the order the
        class docstring gives (Deletion)."""
        location = self.location(state.step)
        _refuse_links(location)
        record = location.read_bytes_or_none(COMMIT_RECORD, max_bytes=MAX_RECORD_BYTES)
        if record is None or CommitRecord.from_json(record, where=location.describe(COMMIT_RECORD)).save_id != state.save_id:
            raise CheckpointingException(
                f"{location.describe()} changed while retention read it (save {state.save_id} replaced or removed); "
                "left as it is"
            )
        marker = {"step": state.step, "save_id": state.save_id, "record": record.decode()}
        self._markers_checked.discard((state.step, state.save_id))  # if this is cut short and the step kept
        location.write_atomic(DELETION_MARKER, json.dumps(marker).encode())  # durable before the record goes
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
        """Removes a step whose deletion began (our marker, no commit record): what the
        record copied into the marker vouches for (and ``metadata.json``), then the
        marker (last, so a crash here leaves it provably ours still), then the directory
        if nothing else is in it. Anything else (another program's files saved beside
        the step, a file added after its commit) stays, WARNING."""
        location = self.location(step)
        _refuse_links(location)
        marker = None if location.exists(COMMIT_RECORD) else _read_marker(location, step)
        if marker is None:
            raise CheckpointingException(f"{location.describe()} is not a deletion of ours to finish; left as it is")
        if marker.record is None:
            # A marker of a shardstore before the record was copied into it: it was
            # written after that record was read, so the directory is one of our steps
            # whose deletion began; what its save wrote is not known any more.
            for name in location.list_top(limit=None):
                if name != DELETION_MARKER:
                    location.remove_tree(name)
        else:
            # its save's own marker, left where removing it failed after the publishing (or an
            # in-place replacement's, naming the record under "replaces"), is the save's too, and
            # so are the files an interrupted remove_sharded_tensors left (anywhere in the step)
            own = own_markers(location, marker.record, location.list_files()) - {DELETION_MARKER}
            _remove_vouched(location, marker.record.vouched_paths() | {CONFIG_FNAME} | own)
        location.remove(DELETION_MARKER)
        _remove_directory_if_empty(location, f"checkpoint step {step}")
        logger.debug("Finished deleting checkpoint step %d at %s", step, location.describe())

    # ------------------------------------------------------------------ restoring

    def resume(self, sharded_state_dict: ShardedStateDict, **load_kwargs: Any) -> Resumed:
        """Restores the newest committed step into ``sharded_state_dict`` and returns the
        step to train next with what was loaded (``Resumed``): ``(latest + 1, state)``, or
        ``(0, None)`` when nothing is committed. Collective: every rank calls it; the
        coordinator picks the step, so every rank loads the same one (async saves in
        flight commit first). Extra keyword arguments go to ``shardstore.load``.

        ``save(step)`` stores the state after training step ``step``, so::

            start, restored = manager.resume(state)
            for step in range(start, total_steps):
                ...  # train step `step`
                manager.save(step, state)

        trains every step once, however often the run restarts.
        """
        self._refuse_if_closed("resume")
        self.wait_until_finished()
        step = self._on_coordinator(self.latest_step)
        if step is None:
            logger.info("No committed checkpoint under %s: starting at step 0", self.root.describe())
            return Resumed(0, None)
        state = self.restore(sharded_state_dict, step, **load_kwargs)
        logger.info(
            "Resumed from step %d under %s: training continues at step %d", step, self.root.describe(), step + 1
        )
        return Resumed(step + 1, state)

    def restore(
        self, sharded_state_dict: ShardedStateDict, step: int | None = None, **load_kwargs: Any
    ) -> StateDict | tuple[StateDict, set[str], set[str]]:
        """Loads ``step`` (default: ``latest_step()``, picked on the coordinator so that
        every rank loads the same step) into the layout ``sharded_state_dict`` describes.
        Collective. Extra keyword arguments go to ``shardstore.load``, and what it
        returns is returned (with a ``strict`` mode that returns the mismatched keys, the
        tuple), less the manager's own ``shardstore_manager`` entry in every case. Async
        saves in flight commit first, as for ``resume``. To continue training, ``resume``
        says which step comes next."""
        from shardstore.serialization import load

        self._refuse_if_closed("restore " + ("the latest step" if step is None else f"step {step}"))
        self._refuse_managers_arguments(load_kwargs, "Not restoring")
        if step is not None:
            step = self._checked_step(step, "Not restoring")
        self.wait_until_finished()
        if step is None:
            step = self._on_coordinator(self.latest_step)
            if step is None:
                raise CheckpointingException(f"No committed checkpoint under {self.root.describe()} to restore")
        result = load(sharded_state_dict, self.location(step), process_group=self.process_group, **load_kwargs)
        state = result[0] if isinstance(result, tuple) else result  # strict="return_...": (state, keys...)
        if isinstance(state, dict):
            state.pop(MANAGER_STATE_KEY, None)  # the manager's own, not the trainer's
        self._restored_step = step
        self._warned_resaving_restored = False
        return result

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
        if isinstance(error, CheckpointingException):
            raise error
        if error is not None:  # the other ranks raise a CheckpointingException: so does this one
            raise CheckpointingException(f"{error}") from error
        if outcome[1] is not None:
            raise CheckpointingException(outcome[1])
        return outcome[0]


def _any_rank(group: Group, flags: tuple[bool, bool]) -> tuple[bool, bool]:
    """Collective: each flag True on some rank (one all-reduce of the flags' maximum)."""
    first, second = group.reduce_over_ranks([int(f) for f in flags], "max", "save decision")
    return bool(first), bool(second)


def _checked_metrics(metrics: Any, what: str) -> dict[str, float]:
    """``metrics`` as the flat ``{name: float}`` the manager stores: plain numbers only,
    so that they pickle into the common state and read back through the restricted
    unpickler of any shardstore; one-element tensors (a loss) become their value."""
    if not isinstance(metrics, Mapping):
        raise CheckpointingException(f"{what}: metrics must be a mapping of names to numbers, got {type(metrics).__name__}")
    checked = {}
    for name, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if not isinstance(name, str) or not isinstance(value, numbers.Real):
            raise CheckpointingException(
                f"{what}: metrics must map names (str) to numbers; {name!r} maps to {type(value).__name__}"
            )
        checked[name] = float(value)
    return checked


def _score(best_fn: Callable[[Metrics], float], metrics: Metrics) -> float:
    """``best_fn(metrics)`` as a float; raises if it fails or gives no number."""
    score = best_fn(metrics)
    if isinstance(score, torch.Tensor) and score.numel() == 1:
        score = score.item()
    if not isinstance(score, numbers.Real):
        raise TypeError(f"best_fn returned {type(score).__name__}, not a number")
    return float(score)


class _DeletionMarker(NamedTuple):
    """Our deletion marker: the save id of the step being deleted and its commit record
    (None: a marker written before the record was copied into it)."""

    save_id: str
    record: CommitRecord | None


def _marker_save_id(location: Location, step: int) -> str | None:
    """The save id in our deletion marker for ``step`` at ``location``; None when there
    is no marker, or one that is not ours (a file of that name we did not write)."""
    marker = _marker_json(location, step)
    return None if marker is None else marker["save_id"]


def _read_marker(location: Location, step: int) -> _DeletionMarker | None:
    """Our deletion marker for ``step`` at ``location`` with the commit record it holds
    (checked, and of the marker's save), or None as ``_marker_save_id`` says.

    Raises:
        CheckpointingException: the marker's record does not read or is another save's.
    """
    marker = _marker_json(location, step)
    if marker is None:
        return None
    if "record" not in marker:
        return _DeletionMarker(marker["save_id"], None)
    where = location.describe(DELETION_MARKER)
    text = marker["record"]
    record = CommitRecord.from_json(text.encode(), where=where) if isinstance(text, str) else None
    if record is None or record.save_id != marker["save_id"]:
        raise CheckpointingException(
            f"{where}: the commit record copied into this deletion marker is not the one of save "
            f"{marker['save_id']}, so what to delete is not known; {location.describe()} is left as it is: "
            "delete it yourself"
        )
    return _DeletionMarker(marker["save_id"], record)


def _marker_json(location: Location, step: int) -> dict[str, Any] | None:
    """Our deletion marker for ``step`` as JSON, or None (no marker, or not ours)."""
    marker = read_marker(location, DELETION_MARKER)
    if marker is None or marker.get("step") != step or not isinstance(marker.get("save_id"), str):
        return None
    return marker


def _remove_vouched(location: Location, vouched: set[str]) -> None:
    """Removes the files of ``vouched`` (relative paths) under ``location``, and the
    directories they leave empty; nothing else. A top-level entry whose every file is
    vouched for goes at once (one prefix deletion on object stores)."""
    found: dict[str, list[str]] = {}
    for rel in location.list_files():
        found.setdefault(rel.split("/", 1)[0], []).append(rel)
    for top in sorted({rel.split("/", 1)[0] for rel in vouched}):
        files = found.get(top, [])
        if all(rel in vouched for rel in files):
            location.remove_tree(top)
            continue
        run_parallel(location.remove, [rel for rel in files if rel in vouched])
        _remove_emptied_directories(location, {rel.rsplit("/", 1)[0] for rel in vouched if rel.startswith(f"{top}/")})


def _remove_emptied_directories(location: Location, directories: set[str]) -> None:
    """Removes those of ``directories`` (and their parents) that are empty, deepest
    first; local directories only (object stores have none)."""
    root = location.local_path()
    if root is None:
        return
    parents = set()
    for rel in directories:
        parts = rel.split("/")
        parents.update("/".join(parts[:n]) for n in range(1, len(parts) + 1))
    for rel in sorted(parents, key=lambda r: r.count("/"), reverse=True):
        path = root / rel
        if path.is_dir() and not path.is_symlink() and not any(path.iterdir()):  # else: holds what is not ours
            path.rmdir()


def _remove_directory_if_empty(location: Location, what: str) -> None:
    """Removes the directory of ``location`` where nothing is left in it; otherwise logs
    what stays (WARNING): what it holds was not written by the save being deleted."""
    left = location.list_top(limit=None)
    if left:
        logger.warning(
            "Deleted %s at %s but kept what its save did not write: %s (another program's files saved beside "
            "it, or files added after its commit); move or delete them yourself",
            what,
            location.describe(),
            ", ".join(left),
        )
        return
    path = location.local_path()
    if path is not None:  # object stores have no directories: nothing is left there
        with contextlib.suppress(FileNotFoundError):
            path.rmdir()


def _refuse_links(location: Location) -> None:
    """Deleting through a symbolic link would delete what it points to, which may be
    another run's checkpoint: a linked step is never deleted."""
    path = location.local_path()
    if path is not None and path.is_symlink():
        raise CheckpointingException(f"{path} is a symbolic link; retention does not delete through links")


def _same_objects(before: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether two snapshots of an object's attributes name the same objects (by
    identity: a setting assigned an equal new value counts as changed, which costs one
    plan, never a stale one)."""
    return before.keys() == now.keys() and all(before[k] is now[k] for k in before)
