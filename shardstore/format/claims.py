"""An in-place save's claim on its prefix (object stores and ``memory://``:
``format.commit.InPlace``).

The claim and the commit record are one object, the root ``zarr.json``: while the save
writes, it holds the save's claim (``records.claim_document``); the commit replaces the
claim with the record. Every change of it is a conditional write on the version read
last (``stores.conditional``), so of two saves that act on one version, one wins:

* **taken** where ``zarr.json`` holds nothing (``put_if_absent``), or a committed record
  that an ``overwrite=True`` save may replace (``put_if_version`` of that record: the
  record is gone from here until the new one commits), or the claim of a save that is
  over: one that gave it up (``ABANDONED``), one whose process provably no longer runs on
  this very machine (pid and start time), or one not renewed for its lease (by the
  store's clock). A claim that may still be renewed is waited on for as long as its
  lease can last, never longer; one renewed meanwhile is a running save's, which refuses
  the new one with nothing changed.
* **kept** by rewriting it every quarter of the lease, only while it is the version this
  save wrote last; a refused rewrite means another save took it over.
* **committed** by writing the record only where the claim is still the version this
  save wrote last. A save that lost its claim (paused past its lease, and taken over)
  can therefore never commit, whatever moment it resumes at.
* **given up** (``ABANDONED``) by a save that ends without a commit (an error, Ctrl-C):
  the next save takes it at once. The claim itself is never deleted by a save that
  wrote anything, so what a save wrote (or a write still in flight lands) stays proven
  a save's that is over, and the next save removes it before it writes.

Writers that lost the claim write nothing over the objects of the save that holds it:
on S3 every object of a save is written only where none is (``stores.s3_fenced``).
"""

from __future__ import annotations

__all__ = ["OtherSave", "PrefixClaim", "Taken"]

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardstore.errors import CheckpointingException
from shardstore.format.records import COMMIT_RECORD, MAX_RECORD_BYTES
from shardstore.format.records.claim_document import (
    ABANDONED,
    WRITING,
    ClaimDocument,
    is_claim,
    this_process,
)
from shardstore.stores.base import Location
from shardstore.stores.conditional import ConditionalWrites, VersionedObject

logger = logging.getLogger(__name__)

# How often ``take`` reads a claim it waits on, at most (seconds).
POLL_S = 1.0
# Rounds of ``take`` whose conditional write lost to another save's (each reads anew).
TAKE_ROUNDS = 8


@dataclass(frozen=True)
class OtherSave:
    """Another save's claim, found where a save wanted to claim the prefix.

    Attributes:
        claim: what it holds.
        age_s: seconds since it was last written, by the store's clock.
        version: the store's version of it.
    """

    claim: ClaimDocument
    age_s: float
    version: str

    def lease_s(self, store_lease_s: float) -> float:
        """The lease its save renews the claim within: the one its claim names (the
        store's, ``store_lease_s``, where it names none)."""
        return self.claim.lease_s or store_lease_s

    def over(self, store_lease_s: float) -> bool:
        """Whether its save is over: it gave the claim up, its process is provably gone,
        or it was not renewed within its lease."""
        return (self.claim.state == ABANDONED or self.claim.process.is_gone()
                or self.age_s >= self.lease_s(store_lease_s))

    def describe(self) -> str:
        if self.claim.state == ABANDONED:
            return f"{self.claim.describe()}, which ended without a commit"
        return f"{self.claim.describe()}, whose claim was last renewed {self.age_s:.0f} s ago"


@dataclass(frozen=True)
class Taken:
    """What the prefix held when a claim was taken.

    Attributes:
        over: the claim of a save that is over, taken over (its objects are leftovers).
        replaced: the committed record the claim replaced (``overwrite=True``).
        replaces: that record's save id.
    """

    over: OtherSave | None = None
    replaced: VersionedObject | None = None
    replaces: str | None = None


class PrefixClaim:
    """The coordinator's claim on the prefix of an in-place save (module docstring).

    ``take`` returns it renewing in a thread of its own until ``stop``; a copy in
    another process (a pickled save) holds nothing and cannot commit.
    """

    def __init__(self, target: Location, writes: ConditionalWrites, save_id: str, replaces: str | None) -> None:
        self.target, self.writes = target, writes
        self._doc = ClaimDocument(save_id, WRITING, this_process(), writes.lease_s, replaces=replaces)
        self._version: str | None = None
        self._attempted: bytes | None = None  # the claim's last write (unique to this save)
        self._renewed_at = time.monotonic()
        self._lost: str | None = None
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def save_id(self) -> str:
        return self._doc.save_id

    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_stopped", "_thread")}
        return {**state, "_lost": "it was handed to another process, which does not hold the claim"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock, self._stopped, self._thread = threading.Lock(), threading.Event(), None
        self._stopped.set()

    # ------------------------------------------------------------------ taking

    @classmethod
    def take(
        cls, target: Location, save_id: str, *, when_empty: Callable[[], None],
        when_committed: Callable[[VersionedObject], str | None], wait: bool = True,
    ) -> tuple[PrefixClaim, Taken]:
        """Claims ``target`` for ``save_id``.

        ``when_empty`` is called where ``zarr.json`` holds nothing, before the claim is
        written (it raises where the prefix holds other objects); ``when_committed``
        where it holds a commit record: it raises unless the save may replace it, and
        returns its save id. ``wait``: False refuses a claim that may still be renewed
        at once, instead of waiting for it to be renewed or to lapse.

        Raises:
            CheckpointingException: a running save holds the prefix, or the prefix is
                refused; nothing was changed.
        """
        writes = _writes_of(target)
        waited: OtherSave | None = None
        deadline: float | None = None
        rounds = 0
        while rounds < TAKE_ROUNDS:
            found = writes.get_versioned(COMMIT_RECORD, MAX_RECORD_BYTES)
            if found is None:
                when_empty()
                claim = cls(target, writes, save_id, None)
                if (version := writes.put_if_absent(COMMIT_RECORD, claim._doc.to_json())) is not None:
                    return claim._holding(version), Taken()
            elif not is_claim(found.data):
                replaces = when_committed(found)
                claim = cls(target, writes, save_id, replaces)
                if (version := writes.put_if_version(COMMIT_RECORD, claim._doc.to_json(), found.version)) is not None:
                    return claim._holding(version), Taken(replaced=found, replaces=replaces)
            else:
                other = _other_save(target, found)
                if not other.over(writes.lease_s):
                    if not wait:
                        raise _refused(target, other, writes.lease_s)
                    if waited is not None and (waited.version != other.version or time.monotonic() > deadline):
                        raise _refused(target, other, writes.lease_s, renewed=waited.version != other.version)
                    if waited is None:
                        waited = other
                        deadline = time.monotonic() + other.lease_s(writes.lease_s) - other.age_s + POLL_S
                        logger.warning("Saving %s: waiting up to %.0f s for %s to be renewed or to lapse",
                                       target.describe(), deadline - time.monotonic(), other.describe())
                    time.sleep(min(POLL_S, max(0.05, writes.lease_s / 20)))
                    continue
                claim = cls(target, writes, save_id, None)
                if (version := writes.put_if_version(COMMIT_RECORD, claim._doc.to_json(), found.version)) is not None:
                    return claim._holding(version), Taken(over=other)
            rounds += 1
        raise CheckpointingException(
            f"Not saving into {target.describe()}: other saves changed its claim {TAKE_ROUNDS} times while this one "
            "tried to take it. Nothing there was changed; save again once they are done, or to another prefix"
        )

    def _holding(self, version: str) -> PrefixClaim:
        self._version, self._renewed_at = version, time.monotonic()
        if self.writes.lease_s > 0:
            self._thread = threading.Thread(target=self._keep, name=f"shardstore-claim-{self.save_id[:8]}",
                                            daemon=True)
            self._thread.start()
        return self

    # ------------------------------------------------------------------ keeping

    def _write_locked(self, data: bytes) -> str | None:
        """Writes ``data`` where the claim is still this save's version; None (and the
        claim lost, saying who holds it) where it is not."""
        if self._lost is not None or self._version is None:
            return None
        previous, self._attempted = self._attempted, data
        version = self.writes.put_if_version(COMMIT_RECORD, data, self._version)
        if version is None:
            found = self.writes.get_versioned(COMMIT_RECORD, MAX_RECORD_BYTES)
            if found is not None and previous is not None and found.data == previous:
                # the write before landed, its answer lost (bytes unique to this save): its version is ours
                version = self.writes.put_if_version(COMMIT_RECORD, data, found.version)
                found = self.writes.get_versioned(COMMIT_RECORD, MAX_RECORD_BYTES) if version is None else found
        if version is None:
            self._lost = _held_by(self.target, found)
            return None
        self._version, self._renewed_at = version, time.monotonic()
        return version

    def _keep(self) -> None:
        while not self._stopped.wait(self.writes.lease_s / 4):
            with self._lock:
                try:
                    self._doc = self._doc.renewed()
                    self._write_locked(self._doc.to_json())
                except Exception as exc:  # reported at the commit, which needs the claim
                    logger.warning("Could not renew the claim of save %s on %s (trying again): %s",
                                   self.save_id, self.target.describe(), exc)
                if self._lost is not None:
                    return

    def stop(self) -> None:
        """Renews no more (idempotent)."""
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def check(self) -> None:
        """Raises unless the claim is still this save's by what this process knows:
        not lost, and renewed within half a lease (a save paused past that may have been
        taken over). Checked before each batch of deletions.

        Raises:
            CheckpointingException: naming why; nothing more may be changed."""
        lapsed = time.monotonic() - self._renewed_at
        if self._lost is None and self.writes.lease_s > 0 and lapsed > self.writes.lease_s / 2:
            self._lost = f"its claim was last renewed {lapsed:.0f} s ago, past half of its {self.writes.lease_s:.0f} s"
        if self._lost is not None:
            raise CheckpointingException(f"The save into {self.target.describe()} no longer holds it: {self._lost}")

    # ------------------------------------------------------------------ ending

    def commit(self, record: bytes) -> None:
        """Replaces the claim with the commit ``record``, only where the claim is still
        the version this save wrote last.

        Raises:
            CheckpointingException: it is not (nothing was committed), saying who holds it."""
        self.stop()
        with self._lock:
            if self._write_locked(record) is None:
                raise CheckpointingException(
                    f"Not committing the save into {self.target.describe()}: {self._lost}. Nothing was committed, and "
                    "nothing of the save that holds the prefix now was changed by this one; save again"
                )

    def abandon(self) -> bool:
        """Gives the claim up (``ABANDONED``): the next save takes it at once and removes
        what this one wrote. False where it was no longer this save's (logged)."""
        self.stop()
        with self._lock:
            written = self._write_locked(self._doc.renewed(ABANDONED).to_json()) is not None
        if not written:
            logger.warning("The save into %s ended without a commit, and its claim was no longer its own (%s): "
                           "left everything as it is", self.target.describe(), self._lost)
        return written

    def restore(self, replaced: VersionedObject) -> None:
        """Puts back the record the claim replaced (a save that failed before it removed
        anything), only where the claim is still this save's."""
        self.stop()
        with self._lock:
            if self._write_locked(replaced.data) is None:
                logger.warning("Could not put back the commit record of %s: %s", self.target.describe(), self._lost)

    def release_unused(self) -> None:
        """Removes the claim of a save that wrote nothing into an empty prefix, or that
        removed everything else there, only where it is still this save's version (a
        conditional delete); a failure is logged (the claim then lapses a lease later)."""
        self.stop()
        try:
            if self._version is not None:
                self.writes.delete_if_version(COMMIT_RECORD, self._version)
        except OSError as exc:
            logger.warning("Could not remove the claim of the save into %s (the next save takes it over a lease "
                           "later): %s", self.target.describe(), exc)


def _writes_of(target: Location) -> ConditionalWrites:
    writes = target.store.conditional_writes()
    if writes is None:
        raise CheckpointingException(
            f"Internal error: {target.describe()} publishes in place without conditional writes; please report it"
        )
    return writes


def _other_save(target: Location, found: VersionedObject) -> OtherSave:
    """The claim ``found`` holds, or a refusal where it is no claim this format writes."""
    claim = ClaimDocument.parse(found.data)
    if claim is None:
        raise CheckpointingException(
            f"Not saving into {target.describe()}: its {COMMIT_RECORD} is neither a commit record nor a claim that "
            "shardstore writes, so nothing there is provably a save's. Nothing there was changed. Find out what wrote "
            "it; save to another prefix"
        )
    return OtherSave(claim, found.age_s, found.version)


def _refused(target: Location, other: OtherSave, lease_s: float, renewed: bool = False) -> CheckpointingException:
    lease = other.lease_s(lease_s)
    why = ("it renewed its claim while this save waited" if renewed else
           "its claim did not lapse while this save waited, by the server's clock")
    return CheckpointingException(
        f"Not saving into {target.describe()}: another save is writing there ({other.describe()}; {why}). "
        f"Nothing there was changed. Wait for that save to finish and save again "
        f"(overwrite=True to replace what it commits), or save to another prefix. A save that dies leaves its claim, "
        f"which the next save takes over at once on the same machine, else {lease:.0f} s after its last renewal."
    )


def _held_by(target: Location, found: VersionedObject | None) -> str:
    """Who holds the prefix now, as ``found`` (its ``zarr.json`` now) shows, once a save
    lost it."""
    if found is None:
        return "its claim was removed by another program"
    if not is_claim(found.data):
        return "another save took the prefix over and committed there"
    claim = ClaimDocument.parse(found.data)
    return f"another save took the prefix over ({claim.describe() if claim else 'an unknown writer'})"
