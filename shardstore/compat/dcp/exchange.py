"""Where ``ShardstoreWriter``'s ranks exchange blocks, and the layout a DCP save uses.

A DCP save whose layout shards or packs split arrays (``StorageLayout``) sends blocks
between its ranks in ``write_data``. Those collectives run on:

* the writer's ``process_group`` where one is named, or the default group on the
  thread that made the writer (a synchronous ``dcp.save``);
* the writers' own gloo group (``own_group``) where the save runs on another thread
  (``dcp.async_save``), whose default group is the training loop's: collectives of the
  two threads on one group would interleave in another order on each rank. The own
  group spans every rank of the default group and is made once per process, in
  ``write_data``, where every rank of the save has its part: a save of some ranks alone
  (``no_dist=True``) exchanges nothing and makes none. It is made with a name hashed
  from its ranks and local synchronization, so it touches neither the default group
  nor the counter that names the groups the training loop makes: making it on the
  save's thread cannot shift another group's name. A writer sent to a save process
  (``AsyncCheckpointerType.PROCESS``) carries no group: that process's default group
  is the save's own.

The ranks exchange only where DCP's plan ``r`` is rank ``r`` of that group
(``exchange_members_match``); elsewhere an ``"auto"`` layout is chosen without an
exchange (``LayoutSite.can_exchange``) and an explicit ``shard_bytes`` is refused.
"""

from __future__ import annotations

__all__ = ["default_group", "exchange_members_match", "on_another_thread", "own_group", "refuse_other_group"]

import threading
import weakref
from typing import Any

import torch.distributed as dist

from shardstore.errors import CheckpointingException

# The writers' own group by default group, held weakly (as ``protocol.collectives`` holds
# groups): each goes with its default group at ``destroy_process_group``, threads included.
_OWN_GROUPS: weakref.WeakKeyDictionary[Any, dist.ProcessGroup] = weakref.WeakKeyDictionary()
_OWN_GROUPS_LOCK = threading.Lock()


def default_group() -> dist.ProcessGroup | None:
    """The default process group, None where there is none."""
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def on_another_thread(process_group: dist.ProcessGroup | None, caller_thread: int | None) -> bool:
    """Whether a writer on ``process_group`` (None: the default group) made on thread
    ``caller_thread`` (None: unknown, a save process's copy) runs on another thread
    with the default group: then it exchanges on ``own_group``."""
    default = process_group is None or process_group is default_group()
    return default and caller_thread is not None and threading.get_ident() != caller_thread


def own_group() -> dist.ProcessGroup:
    """Collective on every rank of the default group, the first time in a process: the
    writers' own gloo group over those ranks (module docstring); later calls return
    it. Call it where every rank is in the same save (``write_data``)."""
    world = default_group()
    with _OWN_GROUPS_LOCK:
        if world not in _OWN_GROUPS:
            ranks = list(range(dist.get_world_size()))
            _OWN_GROUPS[world] = dist.new_group(ranks, backend="gloo", use_local_synchronization=True,
                                                group_desc="shardstore_dcp_writer")
        return _OWN_GROUPS[world]


def _members(plans: list[Any]) -> list[tuple[int, int] | None]:
    return [getattr(plan.storage_data, "member", None) for plan in plans]


def exchange_members_match(plans: list[Any]) -> bool:
    """Whether each DCP plan ``r`` (its ``HeldPlainTensors.member``) is rank ``r`` of the
    group the writer exchanges on, of as many ranks as DCP's."""
    return _members(plans) == [(rank, len(plans)) for rank in range(len(plans))]


def refuse_other_group(plans: list[Any], where: str) -> None:
    """Refuses a save whose ranks would exchange blocks on a group whose ranks are not
    DCP's (``ShardstoreWriter(process_group=...)`` another than ``dcp.save``'s): the
    exchange's messages would go to the wrong ranks or wait for ranks that never join."""
    if not exchange_members_match(plans):
        expected = [(rank, len(plans)) for rank in range(len(plans))]
        raise CheckpointingException(
            f"Saving {where}: ShardstoreWriter(shard_bytes=...) exchanges blocks on a process group whose "
            f"(rank, size) per DCP rank are {_members(plans)}, not DCP's {expected}. Pass the group given to "
            "dcp.save(process_group=...) as ShardstoreWriter(process_group=...)"
        )
