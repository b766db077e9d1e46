"""One process-wide handler per preemption signal, shared by every listener (each
``CheckpointManager`` with ``save_on_preemption``).

A signal has one handler per process, so listeners never install their own: every
listener of a signal hears it, in any number and closed in any order, and whatever
handler was there before keeps working. Entry points: ``listen``, ``Listener.close`` and
``Listener.take_held_back_defaults``.

* ``listen(signals, callback)`` (main thread only: ``signal.signal`` works nowhere
  else; CheckpointingException otherwise): the first listener of a signal installs a
  dispatcher and remembers the handler it replaced (the *previous* handler); later
  listeners join that dispatcher while it is still the installed handler.
* The dispatcher calls every listener (each only counts: it runs between two bytecodes
  of whatever the main thread was doing), then the previous handler when it is one
  that someone installed (a Python callable: a framework's, the user's, or a
  dispatcher of ours that was replaced, see below). The previous handler's *default*
  behaviour (``SIG_DFL``, Python's ``default_int_handler`` for SIGINT) is held back
  while any listener of the signal listens, through this dispatcher or another one: it
  would end the process before the preemption save, which is what the listeners are
  there for. ``SIG_IGN`` does nothing either way.
* ``Listener.close()`` (in any order, idempotent): when the last listener of a
  dispatcher leaves, the previous handler is put back exactly, if the dispatcher is
  still the installed handler. If someone installed their own handler over it
  meanwhile, theirs stays: if it calls the handler it replaced, our dispatcher passes
  the signal on as the previous handler would have (its default included, once no
  listener of the signal listens: SIGTERM then ends the process). Closing off the main
  thread cannot restore a handler: the dispatcher then stays installed and, with no
  listener left, behaves as the previous handler (WARNING); the next listener in the
  main thread joins it again. ``Listener.take_held_back_defaults`` then takes the
  default held back for a signal the listener heard and never acted on (one during a
  manager's ``close``), once no listener of it is left.
* A listener created after our dispatcher was replaced gets a new dispatcher installed
  over the replacement, whose previous handler is that replacement: one chain, each
  handler called once.
* A process forked from one with listeners (a ``multiprocessing`` or DataLoader worker
  under the fork start method) inherits the installed dispatchers but none of their
  listeners (each listener belongs to the process that made it: ``_of_this_process``):
  the managers are the parent's, so the
  child's signals take the previous handler's course (SIGTERM's default ends it, as
  ``Process.terminate`` expects) until the child listens itself.

The registry is guarded by a lock; the dispatcher itself takes no lock (a signal can
arrive while the main thread holds it): it reads its listeners as one tuple, which
``listen`` and ``close`` replace whole.
"""

from __future__ import annotations

__all__ = ["Listener", "listen"]

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable
from typing import Any

from shardstore.errors import CheckpointingException

logger = logging.getLogger(__name__)

Handler = Any  # what signal.getsignal returns: a callable, SIG_DFL, SIG_IGN or None (set from C)


class Listener:
    """One ``listen`` call: its callback is called with the signal's number each time one
    of its signals arrives, until ``close``."""

    def __init__(self, callback: Callable[[int], None], signals: tuple[int, ...]) -> None:
        self.callback = callback
        self.signals = signals
        self.pid = os.getpid()  # a forked child inherits it but never hears for it
        self._dispatchers: list[_Dispatcher] = []
        self._left: list[_Dispatcher] = []  # those ``close`` left

    def close(self) -> None:
        """Stops listening; puts a previous handler back when this was its dispatcher's
        last listener (module docstring). Idempotent; any thread, any order."""
        with _lock:
            dispatchers, self._dispatchers = self._dispatchers, []
            for dispatcher in dispatchers:
                dispatcher.leave(self)
            self._left.extend(dispatchers)

    def take_held_back_defaults(self, unheeded: Iterable[int]) -> None:
        """After ``close``: ``unheeded`` are signals this listener heard and did not act
        on (complete, since a closed listener hears nothing more). Where such a signal's
        default was held back for the listeners and none is left, it is taken now
        (SIGTERM ends the process)."""
        wanted = set(unheeded)
        for dispatcher in self._left:
            if dispatcher.signum in wanted:
                dispatcher.take_held_back_default()


class _Dispatcher:
    """The installed handler of one signal: calls its listeners, then passes the signal on."""

    def __init__(self, signum: int, previous: Handler) -> None:
        self.signum = signum
        self.previous = previous
        self.listeners: tuple[Listener, ...] = ()

    def __call__(self, signum: int, frame: Any) -> None:
        listeners = _of_this_process(self.listeners)  # one read: listen and close replace the tuple whole
        for listener in listeners:
            listener.callback(signum)
        if _is_default(self.previous) and (listeners or _listened(signum)):
            return  # held back: the listeners' saves come first (module docstring)
        _pass_on(self.previous, signum, frame)

    def take_held_back_default(self) -> None:
        """The signal's default action, which ``__call__`` held back for the listeners'
        saves, taken now that no listener of the signal is left to save for it (a
        listener closing with a signal it never acted on)."""
        if not _is_default(self.previous) or _listened(self.signum):
            return  # a handler of someone's was called when it came; or a listener still saves for it
        if threading.current_thread() is threading.main_thread():
            _pass_on(self.previous, self.signum, None)
        else:  # no handler can be set here: the dispatcher, left installed without listeners, passes it on
            signal.raise_signal(self.signum)

    def is_installed(self) -> bool:
        return signal.getsignal(self.signum) is self

    def leave(self, listener: Listener) -> None:
        """Under the lock: removes ``listener``; the last one out restores the previous handler."""
        self.listeners = tuple(entry for entry in _of_this_process(self.listeners) if entry is not listener)
        if self.listeners:
            return
        if not self.is_installed():
            if _installed.get(self.signum) is self:
                del _installed[self.signum]
            logger.info(
                "Signal %d's handler was replaced after shardstore installed its preemption handler; leaving "
                "the replacement (%r) installed",
                self.signum,
                signal.getsignal(self.signum),
            )
            return
        if threading.current_thread() is not threading.main_thread():
            logger.warning(
                "Cannot put back the handler of signal %d from a thread other than the main thread; shardstore's "
                "handler stays installed and passes the signal on as that handler would (%r)",
                self.signum,
                self.previous,
            )
            return  # stays in _installed: the next listener joins it
        signal.signal(self.signum, signal.SIG_DFL if self.previous is None else self.previous)
        del _installed[self.signum]


_lock = threading.Lock()
_installed: dict[int, _Dispatcher] = {}  # per signal: the dispatcher new listeners join


def listen(signals: Iterable[int], callback: Callable[[int], None]) -> Listener:
    """Calls ``callback(signum)`` whenever one of ``signals`` arrives, besides the handler
    that was there (module docstring), until the returned listener is closed.

    Raises:
        CheckpointingException: not called from the main thread, or a signal that takes
            no handler (nothing is installed then).
    """
    wanted = tuple(dict.fromkeys(signals))
    listener = Listener(callback, wanted)
    if threading.current_thread() is not threading.main_thread():
        raise CheckpointingException(
            f"Cannot handle signals {_names(wanted)} from thread {threading.current_thread().name!r}: Python "
            "installs signal handlers in the main thread only. Create the CheckpointManager with "
            "save_on_preemption=True in the main thread."
        )
    with _lock:
        try:
            for signum in wanted:
                dispatcher = _dispatcher_for(signum)
                dispatcher.listeners = (*_of_this_process(dispatcher.listeners), listener)
                listener._dispatchers.append(dispatcher)
        except (ValueError, OSError, TypeError) as exc:
            for dispatcher in listener._dispatchers:
                dispatcher.leave(listener)
            listener._dispatchers.clear()
            raise CheckpointingException(
                f"Cannot install a handler for signals {_names(wanted)}: {exc}"
            ) from exc
    return listener


def _dispatcher_for(signum: int) -> _Dispatcher:
    """Under the lock: the installed dispatcher of ``signum``, or a new one installed over
    whatever handler is there (ours replaced by someone's included)."""
    dispatcher = _installed.get(signum)
    if dispatcher is not None and dispatcher.is_installed():
        return dispatcher
    if dispatcher is not None and _of_this_process(dispatcher.listeners):
        logger.warning(
            "Signal %d's handler was replaced (by %r) after shardstore installed its preemption handler: the "
            "checkpoint managers created before see the signal only if that handler calls the one it replaced",
            signum,
            signal.getsignal(signum),
        )
    dispatcher = _Dispatcher(signum, signal.getsignal(signum))
    signal.signal(signum, dispatcher)
    _installed[signum] = dispatcher
    return dispatcher


def _listened(signum: int) -> bool:
    """Whether a listener of ``signum`` listens through the dispatcher new listeners
    join: a dispatcher left in someone's chain, with no listener of its own, may run
    after it (a lock-free read: it runs in a signal handler)."""
    current = _installed.get(signum)
    return current is not None and bool(_of_this_process(current.listeners))


def _is_default(handler: Handler) -> bool:
    """Whether ``handler`` is the signal's default behaviour (or nothing), not one that
    someone installed."""
    return (
        handler in (signal.SIG_DFL, signal.SIG_IGN, None) or handler is signal.default_int_handler
    )


def _pass_on(handler: Handler, signum: int, frame: Any) -> None:
    """Does what ``handler`` would have done with the signal. ``SIG_DFL`` (and None: a
    handler set from C, which cannot be called from here) is the default action, taken by
    raising the signal again with the default in place; if the process survives it (a
    signal whose default ignores or stops), the handler installed now is put back."""
    if handler is signal.SIG_IGN:
        return
    if callable(handler):
        handler(signum, frame)
        return
    current = signal.getsignal(signum)
    signal.signal(signum, signal.SIG_DFL)
    try:
        signal.raise_signal(signum)
    finally:
        signal.signal(signum, current)


def _of_this_process(listeners: tuple[Listener, ...]) -> tuple[Listener, ...]:
    """The ``listeners`` made in this process: a forked child inherits its parent's
    dispatchers with their listeners, whose managers never save in the child (module
    docstring). Takes no lock: it runs in a signal handler."""
    pid = os.getpid()
    return tuple(listener for listener in listeners if listener.pid == pid)


def _names(signals: tuple[int, ...]) -> str:
    return ", ".join(_name(s) for s in signals)


def _name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)
