"""Resuming a state: what ``CheckpointManager.resume`` returns (``Resumed``)."""

from __future__ import annotations

__all__ = ["Resumed"]

from typing import NamedTuple

from shardstore.mapping import StateDict


class Resumed(NamedTuple):
    """What ``CheckpointManager.resume`` found (a tuple, so that
    ``start, restored = manager.resume(state)`` unpacks it).

    Attributes:
        next_step: the step to train next: the newest committed step + 1 (0: none).
        state: what ``restore`` returned for the newest committed step (None: nothing
            was committed, a fresh start). The request's tensors of the stored dtype and
            shape were loaded in place; plain values and ShardedObjects (an iteration
            count, RNG states) are here only.
    """

    next_step: int
    state: StateDict | None

