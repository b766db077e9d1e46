"""What the root ``zarr.json`` of a prefix holds while an in-place save writes there
(object stores, ``memory://``): the save's claim (``ClaimDocument``), in place of the
commit record that replaces it at the commit.

One object is both the claim and the commit, so every change of it is a conditional
write on the version read last (``format.claims``): a save that lost its claim cannot
commit, and no commit record is ever written where a claim of another save stands.

A claim document is no Zarr metadata (a plain Zarr reader refuses the prefix, as it
refuses one without ``zarr.json``); it begins with ``CLAIM_PREFIX``, which tells it from
a commit record in a few bytes (``is_claim``). It is proven ours by its form alone:
``{"shardstore_claim": 1, ...}`` with a save id of 32 hex digits and a known state.
Anything else proves nothing, and nothing is deleted on its strength.
"""

from __future__ import annotations

__all__ = [
    "ABANDONED",
    "CLAIM_PREFIX",
    "MAX_CLAIM_BYTES",
    "WRITING",
    "ClaimDocument",
    "is_claim",
    "no_checkpoint_yet",
    "this_process",
]

import json
import os
import re
import socket
from dataclasses import asdict, dataclass, replace
from functools import cache
from pathlib import Path

CLAIM_PREFIX = b'{"shardstore_claim"'
_ROOT = "zarr.json"
# The most bytes a claim document holds (a few hundred in practice).
MAX_CLAIM_BYTES = 4096
# Its save is running (renewing the claim) or died without giving it up.
WRITING = "writing"
# Its save ended without a commit and gave the claim up: the next save takes it at once.
ABANDONED = "abandoned"
_SAVE_ID = re.compile(r"[0-9a-f]{32}")


def is_claim(data: bytes) -> bool:
    """Whether the first bytes of a root ``zarr.json`` are a claim's, not a record's."""
    return data.lstrip()[: len(CLAIM_PREFIX)] == CLAIM_PREFIX


@dataclass(frozen=True)
class ProcessIdentity:
    """A process as another process on the same machine can check it: the host's name,
    the kernel's boot id, its pid namespace (containers sharing a host name and a
    kernel see other pids), its pid and its start time (clock ticks since boot), so
    that a pid reused by another process is never taken for it."""

    host: str
    boot_id: str | None
    pid: int
    start: int | None
    pid_ns: int | None = None

    def is_gone(self) -> bool:
        """Whether this process provably no longer runs: it ran on this machine, since
        its last boot, in this pid namespace, and its pid now names no process or one
        started at another time. False wherever that cannot be proven (another host,
        boot or namespace, no /proc)."""
        here = this_process()
        same_place = (self.host, self.boot_id, self.pid_ns) == (here.host, here.boot_id, here.pid_ns)
        if not same_place or None in (self.boot_id, self.pid_ns, self.start):
            return False
        return _start_ticks(self.pid) != self.start


@cache
def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (start time in clock ticks since boot); None
    where there is no such process (or no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()  # the command name may hold spaces and parentheses
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def this_process() -> ProcessIdentity:
    """The calling process's identity (its pid read each time: a forked child is
    another process)."""
    pid = os.getpid()
    try:
        pid_ns: int | None = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pid_ns = None
    return ProcessIdentity(socket.gethostname(), _boot_id(), pid, _start_ticks(pid), pid_ns)


@dataclass(frozen=True)
class ClaimDocument:
    """An in-place save's claim on its prefix, as the root ``zarr.json`` holds it.

    Attributes:
        save_id: the save that holds (or held) the prefix.
        state: ``WRITING`` or ``ABANDONED``.
        process: the save's coordinating process.
        lease_s: the lease the save renews the claim within (0: the store keeps saves
            apart itself).
        renewal: how often it was written (every write of it is unique: ``ConditionalWrites``).
        replaces: the save id of the committed checkpoint this save replaces, if any.
    """

    save_id: str
    state: str
    process: ProcessIdentity
    lease_s: float
    renewal: int = 0
    replaces: str | None = None

    def to_json(self) -> bytes:
        fields = {"shardstore_claim": 1, "save_id": self.save_id, "state": self.state,
                  **asdict(self.process), "lease_s": self.lease_s, "renewal": self.renewal,
                  "replaces": self.replaces}
        return json.dumps(fields).encode()

    def renewed(self, state: str = WRITING) -> ClaimDocument:
        return replace(self, state=state, renewal=self.renewal + 1)

    @classmethod
    def parse(cls, data: bytes) -> ClaimDocument | None:
        """The claim ``data`` holds; None where it is not one this format writes (nothing
        is proven by it)."""
        if not is_claim(data):
            return None
        try:
            f = json.loads(data)
        except (ValueError, RecursionError):
            return None
        if not isinstance(f, dict) or f.get("shardstore_claim") != 1 or type(f.get("shardstore_claim")) is not int:
            return None
        save_id, state, replaces = f.get("save_id"), f.get("state"), f.get("replaces")
        if not (isinstance(save_id, str) and _SAVE_ID.fullmatch(save_id)) or state not in (WRITING, ABANDONED):
            return None
        if replaces is not None and not (isinstance(replaces, str) and _SAVE_ID.fullmatch(replaces)):
            return None
        host, boot_id, pid, start, pid_ns = (f.get(k) for k in ("host", "boot_id", "pid", "start", "pid_ns"))
        lease, renewal = f.get("lease_s"), f.get("renewal")
        if not isinstance(host, str) or not _is_int(pid) or not _is_int(renewal) or not _is_number(lease):
            return None
        process = ProcessIdentity(host, boot_id if isinstance(boot_id, str) else None, pid,
                                  start if _is_int(start) else None, pid_ns if _is_int(pid_ns) else None)
        return cls(save_id, state, process, float(lease), renewal, replaces)

    def describe(self) -> str:
        return f"save {self.save_id} on {self.process.host}, pid {self.process.pid}"


def _is_int(value: object) -> bool:
    return type(value) is int


def _is_number(value: object) -> bool:
    return type(value) in (int, float) and value >= 0  # type: ignore[operator]


def no_checkpoint_yet(data: bytes, where: str) -> str:
    """Why the prefix ``where``, whose root ``zarr.json`` holds ``data`` (a claim, or
    something that begins as one), holds no committed checkpoint, and what to do."""
    claim = ClaimDocument.parse(data)
    if claim is None:
        return (f"No committed checkpoint at {where}: its {_ROOT} begins as a save's claim but is none that "
                "shardstore writes; find out what wrote it, or load another checkpoint")
    if claim.state == ABANDONED:
        return (f"No committed checkpoint at {where}: {claim.describe()} ended without a commit; what it wrote is "
                "removed by the next save into this prefix (`shardstore verify` lists it). Load an earlier "
                "checkpoint, or save again")
    return (f"No committed checkpoint at {where}: a save is in flight there ({claim.describe()}), or was stopped "
            "before its commit. Load it once that save commits, or load an earlier checkpoint; the next save into "
            "this prefix takes a stopped save's claim over")
