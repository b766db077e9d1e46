"""Issue 23.2, item 6: random histories of a training run's checkpoint events, and after
every event the manager still holds the last committed checkpoint.

A history mixes saves by two managers on one root (one sync, one async with a save in
flight), saves of older or already committed steps, rollbacks, crashes inside
retention (the process killed, or the storage failing, at the commit record's removal
or part way through the rest), damaged commit records, foreign directories named like
steps, and restarts that kill the save in flight. A model predicts what each call
returns; after every event the test reads the root itself (``read_commit_record`` on
each step directory) and checks:

* ``latest_step()`` of both managers names the newest committed step, and ``restore``
  returns the values saved at it;
* nothing committed appeared that no save of this event wrote, no committed step was
  silently replaced (same save id), and every step that vanished was one retention may
  delete (not the newest, not a ``keep_period`` multiple, ``max_to_keep`` newer steps
  remain) or one ``rollback`` had to delete;
* damaged and foreign directories are byte for byte as they were, and every directory
  named like a step is committed, one of those, or an interrupted deletion of ours;
* after a retention that ran to its end, no interrupted deletion is left;
* retention reported no error unless a crash was injected.

World 1, tensors of two floats, local directories without fsync, retention settings
drawn too: 25 histories of 6 to 20 events run in 7 to 20 seconds here (2 shared cores).
``--hypothesis-show-statistics`` shows how often retention deleted, crashes fired,
races were lost. The S3 variant (a fixed history) is in test_s3.py.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import event as statistic
from hypothesis import strategies as st

from shardstore import CheckpointingException, ShardedTensor
from shardstore.format.records import COMMIT_RECORD, read_commit_record
from shardstore.stores.local import LocalStore
from shardstore.stores.locations import open_location
from shardstore.tools.manager import DELETION_MARKER, CheckpointManager, CheckpointManagerOptions

# Retention settings a history runs under (max_to_keep 1 makes the step just saved the
# one at stake when another manager committed a newer step meanwhile).
SETTINGS = st.builds(CheckpointManagerOptions, max_to_keep=st.sampled_from([1, 2]), keep_period=st.sampled_from([None, 4]))
SYNC, ASYNC = 0, 1
JUNK_RECORDS = [
    b"{not json",
    b"",
    json.dumps({"attributes": []}).encode(),  # trips the record parser itself
    json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}).encode(),  # another tool's group
]
FOREIGN_DIRECTORIES = {
    "plain": {"notes.txt": b"a user's own folder"},
    "dcp": {".metadata": b"DCP metadata", "__0_0.distcp": b"DCP data"},
    "stale": {"metadata.json": b"{}", "w/c.0": b"chunk"},  # no record and no marker of ours
}


# ------------------------------------------------------------------ events


@dataclass(frozen=True)
class Crash:
    """A crash armed for one save: ``hard``: the process dies (the event ends there);
    otherwise the storage fails (OSError, which retention logs and survives). It fires
    at the commit record's removal (``at_record``) or from the ``after``+1-th removal of
    a step's contents on."""

    hard: bool
    at_record: bool
    after: int


@dataclass(frozen=True)
class Save:
    manager: int
    delta: int  # the step: the newest committed or in-flight step plus delta (<= 0: resume or rollback)
    crash: Crash | None = None


@dataclass(frozen=True)
class Rollback:
    manager: int
    pick: int  # which committed step to roll back to


@dataclass(frozen=True)
class Damage:
    pick: int  # which committed step's record to overwrite
    junk: bytes


@dataclass(frozen=True)
class Foreign:
    kind: str
    delta: int


@dataclass(frozen=True)
class Wait:
    """The async manager commits its save in flight."""


@dataclass(frozen=True)
class Restart:
    """Every process dies (the async save in flight is lost) and the run starts again."""


CRASHES = st.none() | st.builds(Crash, st.booleans(), st.booleans(), st.integers(0, 2))
# Mostly onward (retention has work), sometimes the latest step again (a resume) or an
# older one (a rollback attempted without rollback).
DELTAS = st.sampled_from([1, 2, 1, 3, 1, 0, -1, -3])
SAVES = st.builds(Save, st.sampled_from([SYNC, ASYNC]), DELTAS, CRASHES)
# Weights: a history needs many saves to give retention something to delete.
EVENT_KINDS = {
    "save": (10, SAVES),
    "rollback": (2, st.builds(Rollback, st.sampled_from([SYNC, ASYNC]), st.integers(0, 5))),
    "damage": (2, st.builds(Damage, st.integers(0, 5), st.sampled_from(JUNK_RECORDS))),
    "foreign": (1, st.builds(Foreign, st.sampled_from(sorted(FOREIGN_DIRECTORIES)), st.integers(-3, 3))),
    "wait": (2, st.just(Wait())),
    "restart": (1, st.just(Restart())),
}
EVENTS = st.sampled_from([kind for kind, (weight, _) in EVENT_KINDS.items() for _ in range(weight)]).flatmap(
    lambda kind: EVENT_KINDS[kind][1]
)


# ------------------------------------------------------------------ faults


class Killed(BaseException):
    """The process died here: nothing after this line of the library runs."""


class StorageFailed(OSError):
    """The storage refused a removal."""


class Faults:
    """Crashes the manager's deletions: only retention and rollback remove a step's
    entries (``LocalStore.delete_prefix``) or a commit record (``LocalStore.delete``)
    on local directories; a save never does."""

    def __init__(self) -> None:
        self.crash: Crash | None = None
        self.calls = 0
        self.fired = False

    def install(self, patch: pytest.MonkeyPatch) -> None:
        remove_tree, remove = LocalStore.delete_prefix, LocalStore.delete

        def crashing_remove_tree(location: LocalStore, rel: str = "", keep=()) -> None:
            if self.crash is not None and not self.crash.at_record:
                self.calls += 1
                if self.calls > self.crash.after:
                    self._fire(rel)
            remove_tree(location, rel, keep)

        def crashing_remove(location: LocalStore, rel: str) -> None:
            if self.crash is not None and self.crash.at_record and rel == COMMIT_RECORD:
                self._fire(rel)
            remove(location, rel)

        patch.setattr(LocalStore, "delete_prefix", crashing_remove_tree)
        patch.setattr(LocalStore, "delete", crashing_remove)

    def arm(self, crash: Crash | None) -> None:
        self.crash, self.calls, self.fired = crash, 0, False

    def disarm(self) -> bool:
        """Ends the armed crash; returns whether it fired."""
        self.crash = None
        return self.fired

    def _fire(self, rel: str) -> None:
        assert self.crash is not None
        self.fired = True
        if self.crash.hard:
            raise Killed(f"killed while removing {rel}")
        raise StorageFailed(f"injected storage failure while removing {rel}")


# ------------------------------------------------------------------ the model


def _state(value: float) -> dict:
    return {"w": ShardedTensor.from_rank_offsets("w", torch.full((2,), value))}


class History:
    """Runs events against two managers on one root and checks each outcome."""

    def __init__(self, root: Path, faults: Faults, options: CheckpointManagerOptions) -> None:
        self.root, self.faults, self.options = root, faults, options
        self.committed: dict[int, tuple[str, float]] = {}  # step -> (save id, value saved)
        self.pending: tuple[int, float] | None = None  # the async manager's save in flight
        self.damaged: dict[str, bytes] = {}
        self.foreign: dict[str, dict[str, bytes]] = {}
        self.values = iter(range(1, 10**6))
        self.managers = self._start()

    def _start(self) -> list[CheckpointManager]:
        location = open_location(self.root, fsync=False)
        self.reported = 0  # retention errors the managers have reported so far
        return [CheckpointManager(location, self.options),
                CheckpointManager(location, replace(self.options, async_save=True))]

    def kill(self) -> None:
        """Every process dies: the async save in flight is dropped uncommitted."""
        queue = self.managers[ASYNC]._saves._queue
        assert queue is not None
        queue.close(abort=True)
        self.pending = None

    def run(self, event: object) -> None:
        handler = {Save: self.save, Rollback: self.rollback, Damage: self.damage, Foreign: self.add_foreign,
                   Wait: self.wait, Restart: self.restart}[type(event)]
        handler(event)
        statistic(type(event).__name__)

    # -------------------------------------------------------------- reading the root

    def on_disk(self) -> dict[int, str]:
        """Every committed step and its save id, read without the manager."""
        found = {}
        for path in self.root.iterdir():
            step = self.options.parse_step(path.name)
            if step is None:
                continue
            try:
                found[step] = read_commit_record(open_location(path, fsync=False)).save_id
            except Exception:  # damaged, foreign or half deleted: not a step (some junk trips the parser)
                continue
        return found

    def step_directories(self) -> set[str]:
        """Names of every entry named like a step."""
        return {p.name for p in self.root.iterdir() if self.options.parse_step(p.name) is not None}

    def leftovers(self) -> set[str]:
        """Step directories whose deletion began and did not finish."""
        return {
            p.name for p in self.root.iterdir()
            if self.options.parse_step(p.name) is not None and (p / DELETION_MARKER).exists()
            and not (p / COMMIT_RECORD).exists()
        }

    def occupied(self, step: int) -> bool:
        path = self.root / self.options.step_name(step)
        return path.is_dir() and any(path.iterdir())

    def base(self) -> int:
        steps = list(self.committed) + ([self.pending[0]] if self.pending else [])
        return max(steps, default=0)

    # -------------------------------------------------------------- events

    def save(self, event: Save) -> None:
        manager = self.managers[event.manager]
        step = max(0, self.base() + event.delta)
        name, value = self.options.step_name(step), float(next(self.values))
        leftover = name in self.leftovers()
        finalizing = self.pending if event.manager == ASYNC else None
        lost = finalizing is not None and self.occupied(finalizing[0])
        self.faults.arm(event.crash)
        try:
            outcome: object = manager.save(step, _state(value))
        except Killed:
            outcome = Killed
        except CheckpointingException as exc:
            outcome = exc
        finally:
            fired = self.faults.disarm()
        label = "killed" if outcome is Killed else outcome if isinstance(outcome, bool) else type(outcome).__name__
        statistic(f"save: {label}{', lost race' if lost else ''}{', onto an interrupted deletion' if leftover else ''}")
        saved_values = {step: value}
        if finalizing is not None:
            saved_values[finalizing[0]] = finalizing[1]
            self.pending = None
        if fired:
            statistic(f"crash fired ({'killed' if outcome is Killed else 'storage failure'})")
        if outcome is Killed:  # the event stopped somewhere: whatever committed must be one of its saves
            self.kill()
            self.managers = self._start()
            self.check(allowed=set(saved_values), required=set(), values=saved_values, crashed=True)
            return
        required: set[int] = set()
        if finalizing is not None:
            if lost:  # another save committed there, or something else lies there now
                assert isinstance(outcome, CheckpointingException), outcome
                self.check(allowed=set(), required=set(), values={}, crashed=fired)
                return
            required.add(finalizing[0])
        # what the save decides, against the steps committed once the previous save committed
        # (an async save commits its predecessor first, and its retention may delete)
        committed = set(self.on_disk()) if finalizing is not None else set(self.committed)
        if step in committed:
            expected: object = False  # resuming at a committed step
        elif name in self.damaged or name in self.foreign or (committed and step < max(committed)):
            expected = CheckpointingException
        else:
            expected = True
        if expected is CheckpointingException or (fired and leftover and isinstance(outcome, CheckpointingException)):
            assert isinstance(outcome, CheckpointingException), (step, outcome)
        else:
            assert outcome is expected, (step, outcome, expected)
        if outcome is True and event.manager == ASYNC:
            self.pending = (step, value)
        elif outcome is True:
            required.add(step)
        self.check(allowed=required, required=required, values=saved_values, crashed=fired)

    def wait(self, _: Wait | None = None) -> None:
        finalizing, self.pending = self.pending, None
        lost = finalizing is not None and self.occupied(finalizing[0])
        try:
            self.managers[ASYNC].wait_until_finished()
            raised = False
        except CheckpointingException:
            raised = True
        assert raised == lost
        required = {finalizing[0]} if finalizing is not None and not lost else set()
        self.check(allowed=required, required=required, values=dict([finalizing]) if finalizing else {})

    def rollback(self, event: Rollback) -> None:
        if event.manager == ASYNC and self.pending is not None:
            self.wait()  # rollback commits the save in flight first; checked as its own event
        if not self.committed:
            return
        target = sorted(self.committed)[event.pick % len(self.committed)]
        newer = sorted((s for s in self.committed if s > target), reverse=True)
        assert self.managers[event.manager].rollback(target) == newer
        self.check(allowed=set(), required=set(), values={}, rolled_back_to=target)

    def damage(self, event: Damage) -> None:
        if not self.committed:
            return
        step = sorted(self.committed)[event.pick % len(self.committed)]
        name = self.options.step_name(step)
        (self.root / name / COMMIT_RECORD).write_bytes(event.junk)
        del self.committed[step]
        self.damaged[name] = event.junk
        self.check(allowed=set(), required=set(), values={})

    def add_foreign(self, event: Foreign) -> None:
        name = self.options.step_name(max(0, self.base() + event.delta))
        if (self.root / name).exists():
            return
        files = FOREIGN_DIRECTORIES[event.kind]
        for rel, data in files.items():
            (self.root / name / rel).parent.mkdir(parents=True, exist_ok=True)
            (self.root / name / rel).write_bytes(data)
        self.foreign[name] = files
        self.check(allowed=set(), required=set(), values={})

    def restart(self, _: Restart) -> None:
        self.kill()
        self.managers = self._start()
        self.check(allowed=set(), required=set(), values={})

    # -------------------------------------------------------------- the invariants

    def check(
        self, allowed: set[int], required: set[int], values: dict[int, float], crashed: bool = False,
        rolled_back_to: int | None = None,
    ) -> None:
        before = {step: save_id for step, (save_id, _) in self.committed.items()}
        after = self.on_disk()
        new, deleted = set(after) - set(before), set(before) - set(after)
        assert required <= new <= allowed, (before, after, allowed, required)
        assert all(after[s] == before[s] for s in set(before) & set(after)), "a committed step was replaced"
        if rolled_back_to is not None:
            assert deleted == {s for s in before if s > rolled_back_to}
        else:
            newest = max(set(before) | new, default=None)
            assert newest is None or newest in after, f"the newest step {newest} was deleted"
            if deleted:
                statistic("retention deleted a step")
            for step in deleted:  # what retention may delete
                assert not self.options.is_kept_forever(step), step
                assert len([s for s in after if s > step]) >= self.options.max_to_keep, (step, after)
        # every directory named like a step is accounted for: committed, put there by the
        # history, or a deletion of ours that a later retention finishes
        known = {self.options.step_name(s) for s in after} | set(self.damaged) | set(self.foreign)
        assert self.step_directories() <= known | self.leftovers(), self.step_directories() - known
        if required and not crashed:  # a retention ran to its end: it finished every deletion
            assert not self.leftovers()
        elif self.leftovers():
            statistic("an interrupted deletion left behind")
        errors = [e for m in self.managers for e in m.retention_errors]
        assert crashed or len(errors) == self.reported, errors[self.reported :]
        self.reported = len(errors)
        self.committed = {s: (after[s], self.committed[s][1] if s in before else values[s]) for s in after}

        latest = max(after, default=None)
        assert [m.latest_step() for m in self.managers] == [latest, latest]
        if latest is not None:
            restored = self.managers[SYNC].restore({"w": ShardedTensor.from_rank_offsets("w", torch.empty(2))})
            assert restored["w"].tolist() == [self.committed[latest][1]] * 2
        for name, junk in self.damaged.items():
            assert (self.root / name / COMMIT_RECORD).read_bytes() == junk
        for name, files in self.foreign.items():
            found = {str(p.relative_to(self.root / name)): p.read_bytes()
                     for p in (self.root / name).rglob("*") if p.is_file()}
            assert found == files, name


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(SETTINGS, st.lists(EVENTS, min_size=6, max_size=20))
def test_the_last_committed_checkpoint_survives_every_history(options: CheckpointManagerOptions, events: list) -> None:
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as patch:
        faults = Faults()
        faults.install(patch)
        history = History(Path(tmp), faults, options)
        statistic(f"{len(events)} events")
        try:
            for event in events:
                history.run(event)
        finally:
            history.kill()
