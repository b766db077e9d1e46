"""Crash-safe deletion of a manager's steps (``StepDeletion``), and ``delete`` and
``rollback``'s work on the coordinator.

A step goes in an order that a crash at any point leaves recoverable: (1) a marker
``.shardstore-deleting.json`` naming the step and its record's save id, with a copy of
the record, is written into the step (durably), (2) the commit record goes (from here
on it is not a step), (3) the files the record vouches for
(``CommitRecord.vouched_paths``) and ``metadata.json``, (4) the marker, (5) the
directory, if nothing else is in it. Anything else stays, WARNING naming it (another
program's files published beside the step, a file added after its commit).

A directory with our marker and no commit record is an interrupted deletion, provably
ours: the next retention, ``rollback``, ``delete`` or save of that step finishes it (a
marker of a shardstore before the record was copied into it does not say what the save
wrote: there, everything in the directory goes). A directory with neither is never
deleted. A crash between (1) and (2) leaves the step committed with our marker in it:
where the manager keeps the step, it removes that marker (INFO). A symbolic link is
never deleted through.
"""

from __future__ import annotations

__all__ = ["StepDeletion"]

import contextlib
import json
import logging
from typing import NamedTuple

from shardstore.errors import CheckpointingException
from shardstore.format import (
    COMMIT_RECORD,
    CONFIG_FNAME,
    DELETION_MARKER,
    MAX_RECORD_BYTES,
    CommitRecord,
    is_committed,
    own_markers,
    remove_unfinished,
)
from shardstore.stores import Location, run_parallel
from shardstore.tools.manager.steps import StepDirectories, StepState, marker_json, marker_save_id

logger = logging.getLogger(__name__)


class StepDeletion:
    """Deletes committed steps of ``steps`` in the crash-safe order (module docstring).
    Coordinator only. A failure to tidy a kept step is appended to ``errors`` (the
    manager's ``retention_errors``) and logged, never raised: the step itself is whole."""

    def __init__(self, steps: StepDirectories, errors: list[str]) -> None:
        self.steps = steps
        self.errors = errors
        self._markers_checked: set[tuple[int, str]] = set()  # committed steps seen without our marker

    def failed(self, message: str) -> None:
        """Logs ``message`` (WARNING) and keeps it in ``errors``."""
        logger.warning("%s", message)
        self.errors.append(message)

    def forget(self) -> None:
        """Look again for markers in the committed steps met from here on."""
        self._markers_checked.clear()

    def keep_with_its_marker_removed(self, state: StepState) -> None:
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
        location = self.steps.location(state.step)
        try:
            if marker_save_id(location, state.step) != state.save_id:
                self._markers_checked.add(key)
                return
            location.remove(DELETION_MARKER)
        except (CheckpointingException, OSError) as exc:
            self.failed(
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

    def delete(self, state: StepState) -> None:
        """Deletes the committed step ``state`` (read just before) in the order the
        module docstring gives."""
        location = self.steps.location(state.step)
        _refuse_links(location)
        writes = location.store.conditional_writes()  # an object store: the record's version read too
        found = writes.get_versioned(COMMIT_RECORD, MAX_RECORD_BYTES) if writes is not None else None
        record = found.data if found is not None else location.read_bytes_or_none(COMMIT_RECORD, MAX_RECORD_BYTES)
        if record is None or CommitRecord.from_json(record, where=location.describe(COMMIT_RECORD)).save_id != state.save_id:
            raise CheckpointingException(
                f"{location.describe()} changed while retention read it (save {state.save_id} replaced or removed); "
                "left as it is"
            )
        marker = {"step": state.step, "save_id": state.save_id, "record": record.decode()}
        self._markers_checked.discard((state.step, state.save_id))  # if this is cut short and the step kept
        location.write_atomic(DELETION_MARKER, json.dumps(marker).encode())  # durable before the record goes
        current = self.steps.step_state(state.step)
        if current.kind != "committed" or current.save_id != state.save_id:  # replaced meanwhile: not ours to delete
            location.remove(DELETION_MARKER)
            raise CheckpointingException(
                f"{location.describe()} changed while retention read it (save {state.save_id} -> "
                f"{current.save_id or current.kind}); left as it is"
            )
        if writes is None or found is None:
            location.remove(COMMIT_RECORD)  # from here on it is no longer a step
        elif not writes.delete_if_version(COMMIT_RECORD, found.version):  # only the record read, never a newer one
            location.remove(DELETION_MARKER)
            raise CheckpointingException(
                f"{location.describe()} changed while retention deleted it (save {state.save_id} replaced); left as it is"
            )
        self.finish(state.step)
        logger.info("Deleted checkpoint step %d at %s", state.step, location.describe())

    def finish(self, step: int) -> None:
        """Removes a step whose deletion began (our marker, no commit record): what the
        record copied into the marker vouches for (and ``metadata.json``), then the
        marker (last, so a crash here leaves it provably ours still), then the directory
        if nothing else is in it. Anything else (another program's files saved beside
        the step, a file added after its commit) stays, WARNING."""
        location = self.steps.location(step)
        _refuse_links(location)
        marker = None if is_committed(location) else _read_marker(location, step)
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

    def rollback_to(self, step: int) -> list[int]:
        """``CheckpointManager.rollback``'s work: deletes the committed steps after
        ``step``, newest first, and returns them."""
        named = self.steps.named()
        target = self.steps.step_state(step) if step in named else StepState(step, "other")
        if target.kind != "committed":
            reason = target.reason or "no commit record"
            raise CheckpointingException(
                f"Cannot roll back to step {step} under {self.steps.root.describe()}: it is not a committed checkpoint "
                f"({reason}). Committed steps: {sorted(self.steps.committed())}. Nothing was deleted."
            )
        self.keep_with_its_marker_removed(target)
        deleted = []
        for newer in reversed([s for s in named if s > step]):
            state = self.steps.step_state(newer)
            try:
                if state.kind == "committed":
                    self.delete(state)
                    deleted.append(newer)
                elif state.kind == "deleting":
                    self.finish(newer)
                elif state.kind == "damaged":
                    self.steps.warn_if_damaged(state)
                elif state.kind == "unfinished" and remove_unfinished(self.steps.location(newer)):
                    pass  # what an interrupted save left: removed (left where that save may still run)
                else:
                    logger.warning(
                        "Rollback to step %d leaves %s alone: it holds no shardstore checkpoint",
                        step,
                        self.steps.location(newer).describe(),
                    )
            except (CheckpointingException, OSError) as exc:
                raise CheckpointingException(
                    f"Rollback to step {step} under {self.steps.root.describe()} is incomplete: could not delete step "
                    f"{newer} ({exc}); deleted so far: {deleted}. Call rollback({step}) again."
                ) from exc
        logger.info("Rolled back %s to step %d: deleted steps %s", self.steps.root.describe(), step, deleted)
        return deleted


    def delete_step(self, step: int, force: bool) -> None:
        """``CheckpointManager.delete``'s work: refuses the newest committed step unless
        ``force``; finishes an interrupted deletion of ours."""
        named = self.steps.named()
        state = self.steps.step_state(step) if step in named else StepState(step, "other")
        where = f"step {step} under {self.steps.root.describe()}"
        if state.kind not in ("committed", "deleting"):
            raise CheckpointingException(
                f"Cannot delete {where}: it is not a committed checkpoint ({state.reason or 'no commit record'}); "
                f"committed steps: {sorted(self.steps.committed())}. Nothing was deleted."
            )
        newest = self.steps.newest_committed(named) == step
        if newest and not force:
            only = " and the only one" if self.steps.newest_committed([s for s in named if s < step]) is None else ""
            raise CheckpointingException(
                f"Not deleting {where}: it is the newest committed checkpoint{only}, the one a restart resumes "
                "from. Pass force=True to delete it anyway, or call rollback(<older step>) to go back to an older "
                "one. Nothing was deleted."
            )
        try:
            if state.kind == "deleting":
                self.finish(step)  # an interrupted deletion of ours: finished
            else:
                self.delete(state)
        except OSError as exc:
            raise CheckpointingException(
                f"Deleting {where} failed ({exc}); it is no longer a committed step. Call delete({step}) again "
                "to finish it."
            ) from exc
        if newest:
            logger.warning("Deleted the newest committed checkpoint, %s (force=True)", where)


class _DeletionMarker(NamedTuple):
    """Our deletion marker: the save id of the step being deleted and its commit record
    (None: a marker written before the record was copied into it)."""

    save_id: str
    record: CommitRecord | None


def _read_marker(location: Location, step: int) -> _DeletionMarker | None:
    """Our deletion marker for ``step`` at ``location`` with the commit record it holds
    (checked, and of the marker's save), or None as ``_marker_save_id`` says.

    Raises:
        CheckpointingException: the marker's record does not read or is another save's.
    """
    marker = marker_json(location, step)
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


