"""A checkpoint manager for a training loop: save every N steps or every T seconds or
when the job is preempted (SIGTERM), keep the last K, every M-th and the best N by a
metric, restart from the latest *committed* step (Orbax's ``CheckpointManager`` is the
model). The rule above all others: it never loses the last good checkpoint.

Entry points: ``CheckpointManager`` and its ``CheckpointManagerOptions``. One module per
idea, each the one place to change it:

* ``options``: when to save and what to keep, and how a step's directory is named;
* ``steps``: what counts as a step, and reading one (``StepDirectories``);
* ``schedule``: when a save is due, preemption signals included (``SaveSchedule``);
* ``retention``: what is kept, metrics and keep-best (``Retention``);
* ``deletion``: crash-safe deletion, ``delete`` and ``rollback`` (``StepDeletion``);
* ``saving``: running saves, async ones, chunk reuse and a kept plan (``SaveRunner``);
* ``resume``: restoring a state into the caller's own objects (``Resumed``);
* ``checkpoint_manager``: ``CheckpointManager``, which holds one of each and decides
  on the coordinator what every rank does.

docs/guide/manager.md holds the contract, operation by operation.
"""

from __future__ import annotations

__all__ = [
    "CheckpointManager", "CheckpointManagerOptions", "MANAGER_STATE_KEY", "Resumed",
    "StepState", "ranked_steps", "steps_to_delete",
]

from shardstore.format import DELETION_MARKER  # noqa: F401  (importable from here, as it always was)
from shardstore.tools.manager.checkpoint_manager import CheckpointManager
from shardstore.tools.manager.options import MANAGER_STATE_KEY, CheckpointManagerOptions
from shardstore.tools.manager.resume import Resumed
from shardstore.tools.manager.retention import ranked_steps, steps_to_delete
from shardstore.tools.manager.steps import StepState
