"""An in-place save's claim on its prefix (object stores: ``format.commit.InPlace``).

The claim is the save marker (``SAVE_MARKER``), written with the store's conditional
writes (``stores.conditional``):

* **taken** only where no marker is (``put_if_absent``), before the save looks at the
  prefix or writes anything; where one is, it is another save's. That save is alive
  while its marker is younger than the store's lease (``lease_s``, by the store's
  clock): the new save is refused and changes nothing. An older marker is a dead save's:
  the new save takes it over (``put_if_version`` of the version it read, so of two saves
  that find one dead marker, one takes it), then removes what the dead save left.
* **kept** by rewriting the marker every quarter of the lease, only while it holds the
  version this save wrote last; a rewrite refused means another save took it over, and
  this one will not commit.
* **checked** before the commit (``ensure_held``): renewed within half a lease, and
  still this save's version. Then the commit record is written only where none is.

What this does not cover: a save's other ranks still writing after its coordinator died
and its lease ran out (a save that takes the prefix over meanwhile may have a chunk
overwritten: its loads then fail on that chunk's crc32c, naming it, never returning
other bytes); a store without conditional writes (``S3Options.conditional_writes``).
"""

from __future__ import annotations

__all__ = ["OtherSave", "PrefixClaim"]

import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from shardstore.errors import CheckpointingException
from shardstore.format.records import SAVE_MARKER
from shardstore.format.records.bounds import MAX_MARKER_BYTES
from shardstore.stores.base import Location
from shardstore.stores.conditional import ConditionalWrites, VersionedObject

logger = logging.getLogger(__name__)

# Attempts at taking a prefix whose marker vanished between the refused write and the read.
TAKE_ATTEMPTS = 3


@dataclass(frozen=True)
class OtherSave:
    """A save marker found where a save wanted to claim the prefix.

    Attributes:
        save_id: the save it names (None: not a marker of ours).
        host, pid: where that save ran, as its marker says (None where it does not).
        age_s: seconds since it was last written, by the store's clock.
        version: the store's version of it (``VersionedObject.version``).
        lease_s: the lease its save renews it within, as the marker says (0: unsaid).
    """

    save_id: str | None
    host: str | None
    pid: int | None
    age_s: float
    version: str
    lease_s: float = 0.0

    def alive(self, lease_s: float) -> bool:
        """Whether its save may still be running: renewed within ``lease_s`` or within the
        lease the marker names, whichever is longer (a save renews by its own lease)."""
        return self.age_s < max(lease_s, self.lease_s)

    @classmethod
    def of(cls, found: VersionedObject) -> OtherSave:
        try:
            fields = json.loads(found.data)
        except (ValueError, RecursionError):
            fields = None
        fields = fields if isinstance(fields, dict) else {}
        save_id, host, pid, lease = (fields.get(k) for k in ("save_id", "host", "pid", "lease_s"))
        return cls(save_id if isinstance(save_id, str) else None, host if isinstance(host, str) else None,
                   pid if isinstance(pid, int) else None, found.age_s, found.version,
                   float(lease) if isinstance(lease, (int, float)) and not isinstance(lease, bool) else 0.0)

    def describe(self) -> str:
        where = f" on {self.host}, pid {self.pid}" if self.host else ""
        return f"save {self.save_id or '(unnamed)'}{where}, whose claim was last renewed {self.age_s:.0f} s ago"


class PrefixClaim:
    """The coordinator's claim on the prefix of an in-place save (module docstring).

    ``take`` returns it renewing in a thread of its own until ``stop``; a copy in
    another process (a pickled save) holds nothing and cannot commit.
    """

    def __init__(self, target: Location, writes: ConditionalWrites, save_id: str) -> None:
        self.target, self.writes, self.save_id = target, writes, save_id
        self._replaces: str | None = None
        self._renewals = 0
        self._version: str | None = None
        self._renewed_at = time.monotonic()
        self._lost: str | None = None
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_stopped", "_thread")}
        return {**state, "_lost": "it was handed to another process, which does not hold the claim"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock, self._stopped, self._thread = threading.Lock(), threading.Event(), None
        self._stopped.set()

    @classmethod
    def take(cls, target: Location, save_id: str) -> tuple[PrefixClaim, OtherSave | None]:
        """Claims ``target`` for ``save_id``: the claim, and the dead save whose marker it
        took over (None: there was none).

        Raises:
            CheckpointingException: a live save holds the prefix (nothing was changed).
        """
        writes = target.store.conditional_writes()
        if writes is None:
            raise CheckpointingException(
                f"Internal error: {target.describe()} publishes in place without conditional writes; please report it"
            )
        claim = cls(target, writes, save_id)
        for _ in range(TAKE_ATTEMPTS):
            version = writes.put_if_absent(SAVE_MARKER, claim._body())
            if version is not None:
                return claim._holding(version), None
            found = writes.get_versioned(SAVE_MARKER, MAX_MARKER_BYTES)
            if found is None:
                continue  # its save finished or gave up between the two requests
            other = OtherSave.of(found)
            if other.alive(writes.lease_s):
                raise claim._refused(other)
            version = writes.put_if_version(SAVE_MARKER, claim._body(), other.version)
            if version is None:
                raise claim._refused(None)
            return claim._holding(version), other
        raise claim._refused(None)

    def _holding(self, version: str) -> PrefixClaim:
        self._version, self._renewed_at = version, time.monotonic()
        if self.writes.lease_s > 0:
            self._thread = threading.Thread(target=self._keep, name=f"shardstore-claim-{self.save_id[:8]}",
                                            daemon=True)
            self._thread.start()
        return self

    def _body(self) -> bytes:
        fields: dict[str, Any] = {"save_id": self.save_id}
        if self._replaces is not None:
            fields["replaces"] = self._replaces
        fields.update(host=socket.gethostname(), pid=os.getpid(), lease_s=self.writes.lease_s,
                      renewal=self._renewals)
        return json.dumps(fields).encode()

    def _refused(self, other: OtherSave | None) -> CheckpointingException:
        where = self.target.describe()
        lease = max(self.writes.lease_s, other.lease_s) if other is not None else self.writes.lease_s
        if other is None:
            found = "another save took it over at the same moment"
        else:
            found = f"another save is writing there ({other.describe()}; a claim renewed within {lease:.0f} s is a running save's)"
        return CheckpointingException(
            f"Not saving into {where}: {found}. Nothing there was changed. Wait for that save to finish and save "
            "again (overwrite=True to replace what it commits), or save to another prefix. A save that died "
            f"leaves its claim, which the next save takes over {lease:.0f} s after its last renewal."
        )

    def mark_replacing(self, replaces: str) -> None:
        """Names in the marker the checkpoint this save is about to replace (so that the
        marker is that checkpoint's own: ``records.own_markers``)."""
        with self._lock:
            self._replaces = replaces
            self._renew_locked()

    def _renew_locked(self) -> None:
        if self._lost is not None or self._version is None:
            return
        self._renewals += 1
        version = self.writes.put_if_version(SAVE_MARKER, self._body(), self._version)
        if version is None:
            self._lost = _taken_by(self.writes.get_versioned(SAVE_MARKER, MAX_MARKER_BYTES))
            return
        self._version, self._renewed_at = version, time.monotonic()

    def _keep(self) -> None:
        while not self._stopped.wait(self.writes.lease_s / 4):
            with self._lock:
                try:
                    self._renew_locked()
                except Exception as exc:  # reported at the commit, if the claim lapsed by then
                    logger.warning("Could not renew the claim of save %s on %s (trying again): %s",
                                   self.save_id, self.target.describe(), exc)
                if self._lost is not None:
                    return

    def stop(self) -> None:
        """Renews no more (idempotent); the claim lapses a lease later unless released."""
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def ensure_held(self) -> None:
        """Stops renewing, then checks that the prefix is still this save's: renewed
        within half a lease, and the marker still the version written last.

        Raises:
            CheckpointingException: it is not (nothing may be committed), saying why.
        """
        self.stop()
        lapsed = time.monotonic() - self._renewed_at
        if self._lost is None and self.writes.lease_s > 0 and lapsed > self.writes.lease_s / 2:
            self._lost = f"its claim was last renewed {lapsed:.0f} s ago, past half of its {self.writes.lease_s:.0f} s"
        if self._lost is None:
            found = self.writes.get_versioned(SAVE_MARKER, MAX_MARKER_BYTES)
            if found is None or found.version != self._version:
                self._lost = _taken_by(found)
        if self._lost is not None:
            raise CheckpointingException(
                f"Not committing the save into {self.target.describe()}: {self._lost}. Nothing was committed; "
                "save again"
            )

    def owns_marker(self) -> bool:
        """Whether the marker at the prefix is still the version this save wrote last."""
        if self._version is None:
            return False
        found = self.writes.get_versioned(SAVE_MARKER, MAX_MARKER_BYTES)
        return found is not None and found.version == self._version


def _taken_by(found: VersionedObject | None) -> str:
    """Says who holds the prefix, as ``found`` (its marker now) shows, once a save lost it."""
    if found is None:
        return "its save marker was removed by another program"
    return f"another save took the prefix over ({OtherSave.of(found).describe()})"
