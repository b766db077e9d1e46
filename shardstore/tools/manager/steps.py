"""What counts as a step under a manager's root, and reading it (``StepDirectories``).

A step is a directory named ``options.step_name(step)`` whose commit record reads and
checks (``StepState.kind == "committed"``). A save that died midway, a damaged record
and a foreign directory are not steps: never restarted from, never counted by
retention, never deleted. A directory with our deletion marker and no record is a
deletion to finish (``deletion.py``). Every listing reads storage afresh, so steps that
another process saved or deleted are always seen.
"""

from __future__ import annotations

__all__ = ["StepDirectories", "StepState", "marker_json", "marker_save_id"]

import logging
from dataclasses import dataclass
from typing import Any, Literal

from shardstore.errors import CheckpointingException
from shardstore.format import (
    COMMIT_RECORD,
    DELETION_MARKER,
    MAX_RECORD_BYTES,
    CommitRecord,
    UnsupportedFormatVersion,
    is_claim,
    read_marker,
)
from shardstore.stores import Location
from shardstore.tools.manager.options import CheckpointManagerOptions

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepState:
    """What a directory named like a step holds.

    Attributes:
        step: the step its name stands for.
        kind: ``committed`` (its commit record reads and checks: a step),
            ``deleting`` (no commit record, our deletion marker: a deletion to finish),
            ``damaged`` (a commit record that does not read or check: not a step, left
            alone), ``unfinished`` (an in-place save's claim: a save in flight, or one
            that ended without a commit, which retention removes once it is over) or
            ``other`` (no commit record and no marker of ours: a save in progress, a
            foreign directory; left alone).
        save_id: committed: its record's save id; deleting: the marker's.
        reason: damaged: why the record does not count.
    """

    step: int
    kind: Literal["committed", "deleting", "damaged", "unfinished", "other"]
    save_id: str = ""
    reason: str = ""


class StepDirectories:
    """The step directories under ``root``, read as ``options`` names them. Remembers
    only which damaged records it warned about (``forget``)."""

    def __init__(self, root: Location, options: CheckpointManagerOptions) -> None:
        self.root = root
        self.options = options
        self._damaged_seen: set[tuple[int, str]] = set()

    def location(self, step: int) -> Location:
        """Where ``step`` is (or would be) saved."""
        return self.root.child(self.options.step_name(step))

    def named(self) -> list[int]:
        """Steps that have a directory named for them (committed or not), ascending."""
        steps = (self.options.parse_step(name) for name in self.root.list_top(limit=None))
        return sorted(s for s in steps if s is not None)

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
                marker = marker_save_id(location, step)
                return StepState(step, "other") if marker is None else StepState(step, "deleting", save_id=marker)
            if is_claim(data):
                return StepState(step, "unfinished")
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


    def committed(self) -> dict[int, StepState]:
        """The committed steps by step, ascending; damaged records WARNING once."""
        states = [self.step_state(step) for step in self.named()]
        for state in states:
            self.warn_if_damaged(state)
        return {s.step: s for s in states if s.kind == "committed"}

    def newest_committed(self, named: list[int], above: int | None = None) -> int | None:
        """The newest committed step of ``named`` (ascending), None if none (or none
        above ``above``); reads the newest records until one checks."""
        for step in reversed(named):
            if above is not None and step <= above:
                return None
            state = self.step_state(step)
            if state.kind == "committed":
                return step
            self.warn_if_damaged(state)
        return None

    def warn_if_damaged(self, state: StepState) -> None:
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


    def forget(self) -> None:
        """Warn again about the damaged records met from here on."""
        self._damaged_seen.clear()


def marker_save_id(location: Location, step: int) -> str | None:
    """The save id in our deletion marker for ``step`` at ``location``; None when there
    is no marker, or one that is not ours (a file of that name we did not write)."""
    marker = marker_json(location, step)
    return None if marker is None else marker["save_id"]


def marker_json(location: Location, step: int) -> dict[str, Any] | None:
    """Our deletion marker for ``step`` as JSON, or None (no marker, or not ours)."""
    marker = read_marker(location, DELETION_MARKER)
    if marker is None or marker.get("step") != step or not isinstance(marker.get("save_id"), str):
        return None
    return marker
