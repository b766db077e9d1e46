"""Resuming a state: the caller's own objects get back what was saved.

``CheckpointManager.restore`` (and ``resume``, which restores the newest committed step)
loads into the caller's state, which it then holds whole:

* tensors of the stored dtype and shape are loaded in place (``shardstore.load``);
* plain values (an iteration count, RNG states, a nested config) are put back into the
  caller's dicts and lists where they were saved, nested as saved (``put_back``);
  ShardedObjects and ``LocalNonpersistentObject`` stay as they are;
* a *Stateful* item (DCP's protocol: any object with ``state_dict()`` and
  ``load_state_dict()``, such as an LR scheduler or a data loader) is saved as an item
  of its own: its ``state_dict()`` at the time of the save, one per rank (a data
  loader's position differs between ranks), stored as a ShardedObject named by its
  place in the state under ``MANAGER_STATE_KEY`` (``item_key``). On restore its
  ``load_state_dict`` gets this rank's state back. At another number of ranks every
  rank reads every saved state of the item (``AnotherWorldSize``): states equal on
  every saving rank (an LR scheduler) restore on every rank; different ones (a data
  loader) as ``CheckpointManagerOptions.items_at_another_world_size`` says, and are
  refused where it says nothing.

What ``restore`` returns is what ``shardstore.load`` returned, with each item in
place of its loaded state.
"""

from __future__ import annotations

__all__ = [
    "AnotherWorldSize", "Resumed", "is_stateful", "item_key", "put_back", "requested_item", "saved_item",
    "saved_item_ranks", "with_items",
]

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import torch

from shardstore.errors import CheckpointingException
from shardstore.mapping import LocalNonpersistentObject, ShardedBase, ShardedObject, StateDict
from shardstore.tools.manager.options import ITEM_CHOICES, MANAGER_STATE_KEY

Path = tuple[Any, ...]


class Resumed(NamedTuple):
    """What ``CheckpointManager.resume`` found (a tuple, so that
    ``start, restored = manager.resume(state)`` unpacks it).

    Attributes:
        next_step: the step to train next: the newest committed step + 1 (0: none).
        state: what ``restore`` returned for the newest committed step (None: nothing
            was committed, a fresh start). The caller's state holds the same values:
            tensors loaded in place, plain values and Stateful items restored into it.
    """

    next_step: int
    state: StateDict | None


def is_stateful(value: Any) -> bool:
    """Whether ``value`` is an item the manager saves through its ``state_dict()`` and
    restores through its ``load_state_dict()`` (a class itself is not)."""
    return (
        not isinstance(value, (type, ShardedBase, torch.Tensor, LocalNonpersistentObject))
        and callable(getattr(value, "state_dict", None))
        and callable(getattr(value, "load_state_dict", None))
    )


def item_key(path: Path) -> str:
    """The ShardedObject key of the item at ``path`` in the state."""
    return ".".join((MANAGER_STATE_KEY, "items", *map(str, path)))


def with_items(state: Any, shard: Callable[[Path, Any], Any], path: Path = ()) -> Any:
    """``state`` with each Stateful item (in its dicts and lists) replaced by
    ``shard(path, item)``; the dicts and lists holding one are copies, everything else
    the same objects. ``state`` itself where it holds no item."""
    if is_stateful(state):
        return shard(path, state)
    if isinstance(state, dict):
        copied = {key: with_items(value, shard, (*path, key)) for key, value in state.items()}
        return state if all(copied[key] is state[key] for key in state) else copied
    if isinstance(state, list):
        copied_list = [with_items(value, shard, (*path, i)) for i, value in enumerate(state)]
        return state if all(a is b for a, b in zip(copied_list, state)) else copied_list
    return state


def saved_item(group_rank: int, group_size: int) -> Callable[[Path, Any], ShardedObject]:
    """``with_items``'s ``shard`` for a save: the item's ``state_dict()`` now, this rank's."""
    return lambda path, item: ShardedObject(item_key(path), item.state_dict(), (group_size,), (group_rank,))


def requested_item(group_rank: int, group_size: int) -> Callable[[Path, Any], ShardedObject]:
    """``with_items``'s ``shard`` for a restore: this rank's shard of the item's state."""
    return lambda path, item: ShardedObject(item_key(path), None, (group_size,), (group_rank,))


def saved_item_ranks(object_shard_keys: Iterable[str]) -> dict[str, int]:
    """How many ranks saved each item, from a commit record's ShardedObject shard keys
    (``<item key>/shard_<rank>_<ranks>``)."""
    prefix = re.escape(item_key(()))
    ranks = {}
    for key in object_shard_keys:
        match = re.fullmatch(rf"({prefix}\..+)/shard_\d+_(\d+)", key)
        if match:
            ranks[match.group(1)] = int(match.group(2))
    return ranks


_NOT_RESTORED = object()  # put_back leaves the item whose loaded state is this as it is


class AnotherWorldSize:
    """Restoring items saved by another number of ranks (``saved``: item key to the
    ranks that saved it): ``requested`` asks every rank for every saved state of such an
    item, ``resolve`` then puts one state in their place, or refuses. Every rank
    compares the same states, so every rank decides alike, without a collective."""

    def __init__(self, saved: Mapping[str, int], group_rank: int, group_size: int,
                 choices: Mapping[str, str]) -> None:
        self.saved, self.group_rank, self.group_size, self.choices = saved, group_rank, group_size, choices
        self._own = requested_item(group_rank, group_size)
        self.paths: list[Path] = []

    def requested(self, path: Path, item: Any) -> Any:
        """``with_items``'s ``shard``: this rank's shard, or every saved one where the
        item was saved by another number of ranks."""
        ranks = self.saved.get(item_key(path), self.group_size)
        if ranks == self.group_size:
            return self._own(path, item)
        self.paths.append(path)
        # every rank reads them all: the main replica of each is the first rank's
        return {rank: ShardedObject(item_key(path), None, (ranks,), (rank,), replica_id=self.group_rank)
                for rank in range(ranks)}

    def resolve(self, loaded: Any) -> None:
        """Puts in ``loaded`` one state of each item ``requested`` asked all states of."""
        for path in self.paths:
            node = loaded
            for part in path[:-1]:
                node = node[part]
            node[path[-1]] = self._chosen(path, node[path[-1]])

    def _chosen(self, path: Path, states: dict[int, Any]) -> Any:
        first = states[0]
        if all(_same(first, states[rank]) for rank in states):
            return first
        name = ".".join(map(str, path))
        choice = self.choices.get(name)
        if choice == "rank_0":
            return first
        if choice == "fresh":
            return _NOT_RESTORED
        options = "; ".join(f"{value!r}: {meaning}" for value, meaning in ITEM_CHOICES.items())
        raise CheckpointingException(
            f"The Stateful item {name!r} was saved by {len(states)} ranks, each with its own state (they differ), "
            f"and this job has {self.group_size}: no rank's state is this rank's. Say what each rank gets with "
            f"CheckpointManagerOptions(items_at_another_world_size={{{name!r}: ...}}): {options}"
        )


def _same(a: Any, b: Any) -> bool:
    """Whether two saved states are equal, tensors by value and dtype."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and bool(torch.equal(a, b)))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001  (an object without a plain ==: not the same)
        return False


def put_back(target: Any, loaded: Any) -> Any:
    """Puts what ``loaded`` (what ``shardstore.load`` returned for ``target``) holds back
    into ``target``'s dicts and lists, nested as saved: a Stateful item gets its state
    through ``load_state_dict`` (and stands in ``loaded`` in place of it); a
    ShardedObject gets the loaded value as its ``data``; a ShardedTensor or factory
    (loaded by its own rules) and a ``LocalNonpersistentObject`` are left; any other
    value is replaced by the loaded one, and a saved key the target lacks is added.
    Returns ``loaded``."""
    if isinstance(target, dict) and isinstance(loaded, dict):
        for key, value in loaded.items():
            if key not in target:
                target[key] = value
            else:
                loaded[key] = _put_back_one(target, key, value)
    elif isinstance(target, list) and isinstance(loaded, list) and len(target) == len(loaded):
        for i, value in enumerate(loaded):
            loaded[i] = _put_back_one(target, i, value)
    return loaded


def _put_back_one(container: dict | list, key: Any, loaded: Any) -> Any:
    """``put_back`` of one entry of ``container``; returns what ``loaded`` holds there."""
    current = container[key]
    if is_stateful(current):
        if loaded is not _NOT_RESTORED:
            current.load_state_dict(loaded)
        return current
    if isinstance(current, dict) and isinstance(loaded, dict):
        return put_back(current, loaded)
    if isinstance(current, list) and isinstance(loaded, list) and len(current) == len(loaded):
        return put_back(current, loaded)
    if isinstance(current, ShardedObject):
        current.data = loaded  # the next save saves what was restored
    elif not _holds_sharded(current):
        container[key] = loaded
    return loaded


def _holds_sharded(value: Any) -> bool:
    """Whether ``value`` is or holds what loading fills by its own rules, an item or a
    ``LocalNonpersistentObject``: such a value is never replaced whole."""
    if isinstance(value, (ShardedBase, LocalNonpersistentObject)) or is_stateful(value):
        return True
    if isinstance(value, dict):
        return any(_holds_sharded(v) for v in value.values())
    return isinstance(value, (list, tuple, set, frozenset)) and any(_holds_sharded(v) for v in value)
