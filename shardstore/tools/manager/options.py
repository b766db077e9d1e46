"""The manager's options: when to save and what to keep (``CheckpointManagerOptions``),
and how a step's directory is named. Frozen: checked once, where they are made."""

from __future__ import annotations

__all__ = ["ITEM_CHOICES", "MANAGER_STATE_KEY", "CheckpointManagerOptions", "Metrics"]

import numbers
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from shardstore.format import StorageLayout

Metrics = Mapping[str, float]

# The common state's key under which the manager keeps what it stores in a step (its
# metrics, its items); reserved: a state dict that holds it is refused.
MANAGER_STATE_KEY = "shardstore_manager"
# What a restore at another world size gives each rank of a Stateful item whose saving
# ranks saved different states (``items_at_another_world_size``).
ITEM_CHOICES = {
    "rank_0": "every rank gets the state rank 0 saved",
    "fresh": "the item is not restored and keeps its state",
}


@dataclass(frozen=True)
class CheckpointManagerOptions:
    """When to save and what to keep (docs/guide/manager.md says more of each).

    Attributes:
        save_interval_steps: ``save`` writes steps divisible by it (None: none by number).
        max_to_keep: keep the newest K committed steps (None: keep all).
        keep_period: also keep every step divisible by it, forever (None: none).
        step_prefix: a step's directory is ``step_prefix`` + the step in ``step_digits``
            digits, zero-padded (no separator is added).
        step_digits: see ``step_prefix``; None: the step's digits, not padded.
        async_save: ``save`` returns once the state is staged in host memory; the
            writes commit at a later call (once finished on every rank).
        save_interval_secs: also save when this many seconds (of the coordinator's
            clock) have passed since this manager's last save or its start (None: off).
        save_on_preemption: the next ``save`` after a ``preemption_signals`` saves.
        preemption_signals: the signals that mean preemption (SIGTERM by default).
        best_fn: scores a step's metrics (those given to ``save``); None: no ranking.
        best_mode: ``"max"``: a higher score is better; ``"min"``: lower (a loss).
        keep_best: also keep the N best committed steps by ``best_fn`` (needs
            ``max_to_keep``: the newest steps are kept besides the best).
        reuse_unchanged: each step shares the chunks whose bytes did not change with
            the newest committed step before it (every step still stands alone).
        cache_plan: each save after the first reuses the last one's plan while every
            rank's structure is unchanged (a ``sharded_strategy`` given to ``save`` is
            used as it is).
        layout: where each save puts its bytes (``StorageLayout``; with ``options=``).
        items_at_another_world_size: for a Stateful item (``"data.loader"``) whose
            saving ranks saved different states, what a restore at another number of
            ranks gives each rank: ``"rank_0"`` (rank 0's state) or ``"fresh"`` (its
            own state, not restored). Items saved alike restore at any number of ranks.
    """

    save_interval_steps: int | None = 1
    max_to_keep: int | None = None
    keep_period: int | None = None
    step_prefix: str = "iter_"
    step_digits: int | None = 7
    async_save: bool = False
    save_interval_secs: float | None = None
    save_on_preemption: bool = False
    preemption_signals: tuple[int, ...] = (signal.SIGTERM,)
    best_fn: Callable[[Metrics], float] | None = None
    best_mode: Literal["max", "min"] = "max"
    keep_best: int | None = None
    reuse_unchanged: bool = True
    cache_plan: bool = True
    layout: StorageLayout = StorageLayout()
    items_at_another_world_size: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for item, choice in self.items_at_another_world_size.items():
            if choice not in ITEM_CHOICES:
                raise ValueError(f"items_at_another_world_size[{item!r}] must be one of {sorted(ITEM_CHOICES)}, "
                                 f"got {choice!r}")
        for name in ("save_interval_steps", "max_to_keep", "keep_period", "step_digits", "keep_best"):
            _require_int_or_none(name, getattr(self, name))
        if self.save_interval_steps is not None and self.save_interval_steps < 1:
            raise ValueError(f"save_interval_steps must be >= 1 or None, got {self.save_interval_steps}")
        if self.max_to_keep is not None and self.max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None, got {self.max_to_keep}")
        if self.keep_period is not None and self.keep_period < 1:
            raise ValueError(f"keep_period must be >= 1 or None, got {self.keep_period}")
        if "/" in self.step_prefix or self.step_prefix.startswith("."):
            raise ValueError(f"step_prefix must be a plain name, got {self.step_prefix!r}")
        if self.step_digits is not None and self.step_digits < 1:
            raise ValueError(f"step_digits must be >= 1 or None, got {self.step_digits}")
        if self.save_interval_secs is not None and not self.save_interval_secs > 0:
            raise ValueError(f"save_interval_secs must be > 0 or None, got {self.save_interval_secs}")
        if self.save_on_preemption and not self.preemption_signals:
            raise ValueError("save_on_preemption needs at least one signal in preemption_signals")
        if not isinstance(self.layout, StorageLayout):
            raise ValueError(f"layout must be a StorageLayout, got {self.layout!r}")
        if self.best_mode not in ("max", "min"):
            raise ValueError(f"best_mode must be 'max' or 'min', got {self.best_mode!r}")
        if self.keep_best is not None:
            if self.keep_best < 1:
                raise ValueError(f"keep_best must be >= 1 or None, got {self.keep_best}")
            if self.best_fn is None:
                raise ValueError("keep_best needs best_fn, which scores a step's metrics")
            if self.max_to_keep is None:
                raise ValueError(
                    "keep_best needs max_to_keep (the newest steps kept besides the best): without it every "
                    "step is kept and keep_best changes nothing"
                )

    def step_name(self, step: int) -> str:
        digits = f"{step}" if self.step_digits is None else f"{step:0{self.step_digits}d}"
        return f"{self.step_prefix}{digits}"

    def parse_step(self, name: str) -> int | None:
        """The step a directory name stands for, or None for any other name. Only the
        name ``step_name`` gives (``iter_00000100`` is not step 100 when ``step_digits``
        is 7): the manager reads and deletes a step at ``step_name(step)``, so a name it
        would not write is not one of its steps."""
        digits = name[len(self.step_prefix) :] if name.startswith(self.step_prefix) else ""
        if not (digits.isdigit() and digits.isascii()):
            return None
        step = int(digits)
        return step if self.step_name(step) == name else None

    def is_kept_forever(self, step: int) -> bool:
        """Whether ``keep_period`` keeps ``step`` whatever is newer."""
        return self.keep_period is not None and step % self.keep_period == 0

    @property
    def decides_collectively(self) -> bool:
        """Whether a save's due-ness depends on something that differs between ranks
        (a clock, a signal), so that ranks must agree on it at every call."""
        return self.save_interval_secs is not None or self.save_on_preemption


def _require_int_or_none(name: str, value: Any) -> None:
    """Refuses a count of steps or digits that is not an int (a float from a config file,
    a bool): it would fail every save later, after the commit, or save other steps."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
        raise ValueError(f"CheckpointManagerOptions.{name} must be an int or None, got {value!r}")
