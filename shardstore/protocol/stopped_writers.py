"""Which ranks of a save have stopped writing into it, known without a collective.

A save interrupted on some ranks (Ctrl-C, a bug) cannot agree on its failure through a
collective: the peers may be inside another collective, or still writing, and never
join. Its coordinator may delete the staged files only once no rank can still write
into them. ``StoppedWriters`` counts the ranks that said so in the process group's
key-value store (``Group.key_value_store``: the c10d store ``init_process_group``
created), which answers at once whatever collective a peer is waiting in:

    every rank    mark()        once its own writes into the save ended (written, failed
                                or interrupted: no thread of it writes any more)
    coordinator   everyone(s)   whether every rank of the group marked, waiting at most
                                s seconds
    coordinator   forget()      drops the save's counter once the save is over

A rank that cannot reach the store (a writer process the save was handed to, a store
that is gone: logged) does not mark; ``everyone`` is then False and the staging directory is
left for the next save into the same place, as after a crash. One counter per save
(keyed by its ``save_id``), one store request per rank per save on the normal path. A
save whose ranks each made their own id (``shared_id`` False: a caller's directory,
where nothing is ever deleted) counts nothing: its ranks' counters could never meet,
and only the coordinator's would be dropped from the store.
"""

from __future__ import annotations

__all__ = ["StoppedWriters"]

import logging
import time
from dataclasses import dataclass, field

import torch.distributed as dist

from shardstore.protocol.collectives import Group

logger = logging.getLogger(__name__)

# How often the coordinator looks at the counter while it waits (seconds).
_POLL_S = 0.05


@dataclass
class StoppedWriters:
    """The counter of the save ``save_id`` among the ranks of ``group`` (``shared_id``:
    every rank knows the save by that id; else nothing is counted)."""

    group: Group
    save_id: str
    shared_id: bool = True
    _marked: bool = field(default=False, init=False)

    def _store(self) -> dist.Store | None:
        """The store the counter lives in; None where nothing is counted (one rank, a
        save without a shared id, a process without the group's store)."""
        if self.group.world_size == 1 or not self.shared_id:
            return None
        return self.group.key_value_store()

    @property
    def key(self) -> str:
        return f"shardstore/save/{self.save_id}/stopped-writers"

    def mark(self) -> None:
        """This rank no longer writes into the save (counted once per rank)."""
        store = None if self._marked else self._store()
        if store is None:
            return
        self._marked = True
        try:
            store.add(self.key, 1)
        except dist.DistError as exc:  # only the clean-up after an interrupt depends on it
            logger.warning("Rank %d could not tell the store it stopped writing (%s): an interrupted save "
                           "leaves its staging directory for the next save", self.group.rank, exc)

    def everyone(self, seconds: float) -> bool:
        """Coordinator: whether every rank of the group marked within ``seconds``.
        Trivially True for one rank; False for a save without a shared id."""
        if self.group.world_size == 1:
            return True
        store = self._store()
        if store is None:
            return False
        deadline = time.monotonic() + seconds
        try:
            while store.add(self.key, 0) < self.group.world_size:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(_POLL_S)
        except dist.DistError as exc:  # not known: the staging directory is left
            logger.warning("Cannot count the ranks that stopped writing (%s)", exc)
            return False
        return True

    def forget(self) -> None:
        """Coordinator, once the save is over: drops its counter from the store."""
        store = self._store()
        if store is None:
            return
        try:
            store.delete_key(self.key)
        except dist.DistError as exc:  # a counter left in the store costs a few bytes
            logger.warning("Cannot drop the counter %s from the store (%s)", self.key, exc)

