"""What a manager keeps (``Retention``): the newest ``max_to_keep``, the multiples of
``keep_period`` and the ``keep_best`` best by ``best_fn``; never the newest committed
step nor the step just saved.

Retention runs on the coordinator after each commit and deletes through
``StepDeletion``. It never touches a directory it cannot prove is one of its own
checkpoints, and a damaged or unreadable record is not counted, so an unreadable newer
directory makes it keep more, never less. A step's metrics (``save(metrics=...)``)
live in its own common state under ``MANAGER_STATE_KEY``, committed with it; a step
whose metrics cannot be read or scored may be among the best, so it is kept (WARNING
once). Ties go to the newer step; a NaN score ranks last. Failures are logged and kept
in the manager's ``retention_errors``, never raised: the save succeeded.
"""

from __future__ import annotations

__all__ = ["Retention", "checked_metrics", "ranked_steps", "score", "steps_to_delete"]

import logging
import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import torch

from shardstore.errors import CheckpointingException
from shardstore.format import is_committed, remove_unfinished
from shardstore.tools.manager.deletion import StepDeletion
from shardstore.tools.manager.options import MANAGER_STATE_KEY, CheckpointManagerOptions, Metrics
from shardstore.tools.manager.steps import StepDirectories, StepState

logger = logging.getLogger(__name__)


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


class Retention:
    """Retention over ``steps`` with ``options``; remembers each step's metrics by save
    id (``forget`` drops them)."""

    def __init__(self, steps: StepDirectories, deletion: StepDeletion, options: CheckpointManagerOptions) -> None:
        self.steps = steps
        self.deletion = deletion
        self.options = options
        self._metrics_cache: dict[tuple[int, str], dict[str, float] | None] = {}
        self._unreadable_metrics_seen: set[tuple[int, str]] = set()

    def forget(self) -> None:
        """Read the metrics again, and warn again about those that do not read."""
        self._metrics_cache.clear()
        self._unreadable_metrics_seen.clear()

    def best_step(self) -> int | None:
        """The committed step whose metrics ``best_fn`` scores best (ties: the newer), or
        None when no step has metrics it can score."""
        return next(iter(ranked_steps(self.scores(self.steps.committed()), self.options.best_mode)), None)

    def apply(self, just_saved: int, metrics: dict[str, float] | None = None) -> None:
        """Coordinator, after the commit of ``just_saved``: finishes interrupted
        deletions and deletes the steps retention no longer keeps. Failures are logged
        and listed in ``retention_errors``, never raised: the save succeeded."""
        try:
            unfinished, doomed, kept, interrupted = self.plan(just_saved, metrics)
        except (CheckpointingException, OSError) as exc:
            self.deletion.failed(f"Retention under {self.steps.root.describe()} skipped: cannot list its steps: {exc}")
            return
        for step in unfinished:
            self._safely(step, "finish the interrupted deletion of", lambda s=step: self.deletion.finish(s))
        for step in interrupted:
            self._safely(step, "remove what an interrupted save left in",
                         lambda s=step: remove_unfinished(self.steps.location(s)))
        for state in doomed:
            self._safely(state.step, "delete old checkpoint", lambda s=state: self.deletion.delete(s))
        for state in kept:
            self.deletion.keep_with_its_marker_removed(state)

    def plan(
        self, just_saved: int, metrics: dict[str, float] | None = None
    ) -> tuple[list[int], list[StepState], list[StepState], list[int]]:
        """(interrupted deletions to finish, committed steps to delete, committed steps
        read and kept, older steps where an in-place save's claim stands: what an
        interrupted save left, for ``format.remove_unfinished``). Walks the steps newest
        first, reading the records of the newest ``max_to_keep`` and of the steps that
        may go; older ``keep_period`` steps are kept unread unless ``keep_best`` ranks
        every step. ``metrics``: those ``just_saved`` was saved with, ranked as given
        (not read back: a common state the safe unpickler refuses left every step
        unranked, and kept, for good)."""
        options = self.options
        unfinished: list[int] = []
        interrupted: list[int] = []
        committed: dict[int, StepState] = {}
        for step in reversed(self.steps.named()):
            newest_found = options.max_to_keep is not None and len(committed) >= options.max_to_keep
            kept_unread = options.max_to_keep is None or (
                newest_found and options.is_kept_forever(step) and options.keep_best is None
            )
            if step != just_saved and kept_unread and is_committed(self.steps.location(step)):
                continue
            state = self.steps.step_state(step)
            if state.kind == "committed":
                committed[step] = state
                if step == just_saved:
                    self._metrics_cache.setdefault((step, state.save_id), metrics)
            elif state.kind == "deleting":
                unfinished.append(step)
            elif state.kind == "unfinished" and step < just_saved:
                interrupted.append(step)
            else:
                self.steps.warn_if_damaged(state)
        scores = self.scores(committed) if options.keep_best is not None and options.max_to_keep is not None else None
        doomed = steps_to_delete(committed, options, protected=(just_saved,), scores=scores)
        kept = [state for step, state in sorted(committed.items()) if step not in doomed]
        return unfinished, [committed[s] for s in doomed], kept, interrupted

    def _safely(self, step: int, what: str, action: Callable[[], object]) -> None:
        try:
            action()
        except (CheckpointingException, OSError) as exc:
            self.deletion.failed(f"Could not {what} step {step} at {self.steps.location(step).describe()}: {exc}")

    def read_metrics(self, state: StepState) -> dict[str, float] | None:
        """The metrics in the committed step ``state``'s common state (None: saved
        without), read through its commit record, so they are the bytes it vouches for;
        raises if they cannot be read. Cached by (step, save id): a replaced step has a
        new save id, so the cache never answers for another save."""
        from shardstore.engine.load import load_common_state_dict
        from shardstore.opened import open_read

        key = (state.step, state.save_id)
        if key in self._metrics_cache:
            return self._metrics_cache[key]
        opened = open_read(self.steps.location(state.step))
        if opened.require_record().save_id != state.save_id:
            raise CheckpointingException(f"{opened.describe()} was replaced while its metrics were read")
        common = load_common_state_dict(opened)
        entry = common.get(MANAGER_STATE_KEY) if isinstance(common, dict) else None
        metrics = entry.get("metrics") if isinstance(entry, dict) else None
        if metrics is not None:
            metrics = checked_metrics(metrics, f"step {state.step} at {opened.describe()}")
        self._metrics_cache[key] = metrics
        return metrics

    def scores(self, committed: Mapping[int, StepState]) -> dict[int, float | None]:
        """``best_fn`` of each committed step's metrics (None: saved without metrics). A
        step whose metrics cannot be read or scored is left out (WARNING once): it may
        be among the best, so retention keeps it."""
        best_fn = self.options.best_fn
        assert best_fn is not None
        scores: dict[int, float | None] = {}
        for step, state in committed.items():
            try:
                metrics = self.read_metrics(state)
                scores[step] = None if metrics is None else score(best_fn, metrics)
            except Exception as exc:  # kept, never deleted for what could not be read
                key = (step, state.save_id)
                first = key not in self._unreadable_metrics_seen
                self._unreadable_metrics_seen.add(key)
                logger.log(
                    logging.WARNING if first else logging.DEBUG,
                    "Cannot rank checkpoint step %d at %s by its metrics (%s: %s); retention keeps it",
                    step,
                    self.steps.location(step).describe(),
                    type(exc).__name__,
                    exc,
                )
        return scores


def checked_metrics(metrics: Any, what: str) -> dict[str, float]:
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


def score(best_fn: Callable[[Metrics], float], metrics: Metrics) -> float:
    """``best_fn(metrics)`` as a float; raises if it fails or gives no number."""
    value = best_fn(metrics)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise TypeError(f"best_fn returned {type(value).__name__}, not a number")
    return float(value)
