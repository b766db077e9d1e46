"""When a manager's save is due (``SaveSchedule``): a multiple of
``save_interval_steps``, ``save_interval_secs`` passed since this manager's last save
(or its start), a preemption signal, or ``force``.

Time and signals differ between ranks, so with either option set every decision is a
collective (one all-reduce of two integers): the coordinator's clock decides the
interval, and a signal on *any* rank counts, so every rank takes the same branch. The
interval counts from this manager's start, not from the newest checkpoint's commit as
Orbax's ``ContinuousCheckpointingPolicy`` does: after a restart the work at risk is what
was trained since the restore.

Preemption (``save_on_preemption``): the schedule listens for ``preemption_signals``
through the process-wide handler of ``shardstore.tools.preemption`` (main thread only).
Its part of the handler only counts the signal (no I/O, no logging, no lock). Once a
decision found a signal, ``reached_preemption`` stays True on every rank. ``close``
stops listening and hands a signal that no save acted on to the default held back for
it (SIGTERM then ends the process), saying so first.
"""

from __future__ import annotations

__all__ = ["Decision", "RankAgreement", "SaveSchedule"]

import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from shardstore.stores import Location
from shardstore.tools.manager.options import CheckpointManagerOptions
from shardstore.tools.preemption import Listener, listen

logger = logging.getLogger(__name__)


class Decision(NamedTuple):
    """Whether a save is due, whether a preemption signal made it so, and how many
    signals had been heard when it was decided (``SaveSchedule.saved`` counts them)."""

    due: bool
    preempted: bool
    signals: int


class RankAgreement(Protocol):
    """What a decision needs of the manager's ranks (``protocol.Group``)."""

    @property
    def is_coordinator(self) -> bool: ...

    def reduce_over_ranks(self, values: Sequence[int], op: str, what: str) -> list[int]: ...


class SaveSchedule:
    """Decides, for the manager of ``root``, whether a step is due (module docstring).
    Listening for signals starts here: raises CheckpointingException off the main
    thread."""

    def __init__(
        self,
        root: Location,
        options: CheckpointManagerOptions,
        ranks: Callable[[], RankAgreement],
        clock: Callable[[], float],
        saving_async: bool,
    ) -> None:
        self.root = root
        self.options = options
        self._ranks = ranks  # the manager's process group, as it is when a decision is made
        self._clock = clock
        self._saving_async = saving_async
        self._last_save_time = clock()
        self._signals_heard: list[int] = []  # appended to by the signal handler only
        self._signals_acted_on = 0
        self._preempted = False
        self._preemption: Listener | None = None
        if options.save_on_preemption:  # every manager sees the signal, and the handler before them too
            self._preemption = listen(options.preemption_signals, self._signals_heard.append)

    def reached_preemption(self) -> bool:
        """True once a decision found that a preemption signal reached a rank."""
        return self._preempted

    def decide(self, step: int, force: bool) -> Decision:
        """Without time or signals: the step's number decides, on each rank alike. With
        them: one all-reduce, in which the coordinator says whether
        ``save_interval_secs`` have passed and every rank whether a signal arrived since
        the last save it counted."""
        options = self.options
        by_step = force or (options.save_interval_steps is not None and step % options.save_interval_steps == 0)
        if not options.decides_collectively:
            return Decision(by_step, False, 0)
        signals = len(self._signals_heard)  # read once: a signal from here on counts next time
        group = self._ranks()
        by_time = (
            group.is_coordinator
            and options.save_interval_secs is not None
            and self._clock() - self._last_save_time >= options.save_interval_secs
        )
        by_time, preempted = _any_rank(group, (by_time, signals > self._signals_acted_on))
        if preempted and not self._preempted:
            logger.warning(
                "A preemption signal reached a rank: saving step %d now under %s%s",
                step,
                self.root.describe(),
                " and waiting for its commit" if self._saving_async else "",
            )
        self._preempted = self._preempted or preempted
        return Decision(by_step or by_time or preempted, preempted, signals)

    def saved(self, decision: Decision) -> None:
        """A save was decided (written or found committed): the interval starts again,
        and the signals that made it due are acted on."""
        self._last_save_time = self._clock()
        if decision.preempted:
            self._signals_acted_on = decision.signals

    def close(self, failure: BaseException | None) -> None:
        """Stops listening for preemption signals, then hands the ones no save acted on
        to the default held back for them (``Listener.take_held_back_defaults``); says
        so first, with what ``close`` failed with, since SIGTERM's default ends the
        process at once."""
        if self._preemption is None:
            return
        self._preemption.close()
        unheeded = set(self._signals_heard[self._signals_acted_on :])  # all: it hears nothing more
        if not unheeded:
            return
        closing = "committed what was in flight" if failure is None else f"failed ({type(failure).__name__}: {failure})"
        logger.warning(
            "Preemption signal(s) %s reached this process after its last save under %s; closing the manager %s; "
            "passing the signal on",
            sorted(unheeded),
            self.root.describe(),
            closing,
        )
        self._preemption.take_held_back_defaults(unheeded)



def _any_rank(group: RankAgreement, flags: tuple[bool, bool]) -> tuple[bool, bool]:
    """Collective: each flag True on some rank (one all-reduce of the flags' maximum)."""
    first, second = group.reduce_over_ranks([int(f) for f in flags], "max", "save decision")
    return bool(first), bool(second)
