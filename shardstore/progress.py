"""What a long save, load, verify or conversion tells its user: timed stages on the
``shardstore`` logger, and a progress bar on the coordinator when asked for.

Logging (``logging.getLogger("shardstore")``): each whole operation logs one INFO line
on the coordinator (DEBUG on the other ranks) with its duration, bytes and rate (a save:
the checkpoint's bytes; a load: the bytes that rank loaded; a verify: the bytes it
read); an async save's when it commits, timed from the call to ``save``, whose return
logs a DEBUG line. Each of its stages (plan, begin, common, stage,
write, durable, commit; record, read) logs a DEBUG line with the same fields, like
Megatron-Core's debug timers. Nothing is printed unless the application configures
logging.

Progress: off in the library (pass ``progress=True`` to ``save``, ``load`` or
``verify``; only the coordinator shows it), on in the command line. The bar counts the
bytes of this process's chunk reads and writes, on standard error (tqdm). An async
save's background I/O shows none: it runs after ``save`` returned.
"""

from __future__ import annotations

__all__ = [
    "StageTiming", "Tick", "current_operation", "format_bytes", "info_on_first_rank", "log_once", "operation",
    "operations_logged_at", "progress_shown", "stage", "tracked",
]

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

logger = logging.getLogger("shardstore")

_SHOWN: ContextVar[bool] = ContextVar("shardstore_progress_shown", default=False)
# The innermost stage this thread is in ("save: commit", "load"), for errors that must
# say which operation failed (``current_operation``).
_CURRENT_STAGE: ContextVar[str | None] = ContextVar("shardstore_current_stage", default=None)

Tick = Callable[[int], None]
# Below this, an operation is over before a bar would say anything.
MIN_PROGRESS_BYTES = 16 * 2**20


@contextmanager
def progress_shown(enabled: bool) -> Iterator[None]:
    """Shows progress bars for the chunk I/O started by this thread inside the block
    when ``enabled`` (or when an enclosing block already shows them)."""
    token = _SHOWN.set(_SHOWN.get() or enabled)
    try:
        yield
    finally:
        _SHOWN.reset(token)


@contextmanager
def tracked(label: str, sizes: Iterable[int]) -> Iterator[Tick | None]:
    """A tick function that advances a byte progress bar over ``sizes`` (thread-safe),
    or None when progress is not shown here; ``sizes`` is only iterated when it is, so
    the I/O paths pay nothing for a bar nobody asked for."""
    if not _SHOWN.get():
        yield None
        return
    total_bytes = sum(sizes)
    if total_bytes < MIN_PROGRESS_BYTES:
        yield None
        return
    from tqdm import tqdm

    lock = threading.Lock()
    with tqdm(
        total=total_bytes, desc=label, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
        leave=False, mininterval=0.5,
    ) as bar:

        def tick(nbytes: int) -> None:
            with lock:
                bar.update(nbytes)

        yield tick


@dataclass
class StageTiming:
    """What a stage reports: set ``nbytes`` inside the block when it moves data, and
    ``shared`` when part of those bytes was shared with an earlier checkpoint instead of
    moved (an incremental save: its rate counts the bytes written); call ``defer``
    inside it when the operation goes on after the block (an async save); ``detail``
    ends the line (a save's chosen layout)."""

    name: str
    where: str
    nbytes: int = 0
    shared: int = 0
    seconds: float = 0.0
    level: int = logging.DEBUG
    started: float = field(default_factory=time.perf_counter)
    deferred: bool = False
    detail: str = ""

    def line(self) -> str:
        text = f"{self.name} {self.where}: {self.seconds:.3f} s"
        if self.nbytes:
            moved = max(self.nbytes - self.shared, 0)  # ``shared`` counts stored bytes (with checksums)
            rate = moved / self.seconds / 2**20 if self.seconds > 0 else float("inf")
            text += f", {format_bytes(self.nbytes)}"
            if self.shared:
                text += f" ({format_bytes(self.shared)} of it shared with an earlier checkpoint, not written)"
            text += f", {rate:.0f} MiB/s" + (" written" if self.shared else "")
        if self.detail:
            text += f"; {self.detail}"
        return text

    def defer(self) -> None:
        """The operation goes on after its block (an async save's writes and commit):
        the block's end logs a DEBUG line saying so, and ``finish``, called when the
        operation is done, logs its line, timed from the start of the block."""
        self.deferred = True

    def finish(self, shared: int = 0) -> None:
        """Logs the line of a deferred operation that is done (at its level); ``shared``:
        as the attribute, known only now."""
        self.shared = shared or self.shared
        self.seconds = time.perf_counter() - self.started
        logger.log(self.level, "%s", self.line())


@contextmanager
def stage(name: str, where: str, level: int = logging.DEBUG) -> Iterator[StageTiming]:
    """Times a stage and logs it (DEBUG; INFO for a whole operation); a failed stage
    logs at DEBUG only, since its error reaches the caller anyway. A deferred one
    (``StageTiming.defer``) logs at DEBUG that it returned, and its line when it
    ``finish``es."""
    timing = StageTiming(name, where, level=level)
    token = _CURRENT_STAGE.set(name)
    try:
        yield timing
    except BaseException:
        timing.seconds = time.perf_counter() - timing.started
        logger.debug("%s (failed)", timing.line())
        raise
    finally:
        _CURRENT_STAGE.reset(token)
    if timing.deferred:
        logger.debug("%s %s: returned after %.3f s; its writes and commit go on in the background", name, where,
                     time.perf_counter() - timing.started)
        return
    timing.seconds = time.perf_counter() - timing.started
    logger.log(level, "%s", timing.line())


def current_operation() -> str | None:
    """The operation ("save", "load", "verify", ...) whose stage this thread is in, from
    the stage's name ("save: commit" -> "save"); None outside any stage."""
    name = _CURRENT_STAGE.get()
    return None if name is None else name.split(":", 1)[0].strip()


_OPERATION_LEVEL: ContextVar[int] = ContextVar("shardstore_operation_level", default=logging.INFO)


@contextmanager
def operations_logged_at(level: int) -> Iterator[None]:
    """Whole operations started by this thread inside the block log at ``level`` on the
    coordinator: the Megatron door logs them at DEBUG, as Megatron-Core's own strategies
    log their timings (Megatron-LM prints its own line per checkpoint)."""
    token = _OPERATION_LEVEL.set(level)
    try:
        yield
    finally:
        _OPERATION_LEVEL.reset(token)


def operation(name: str, where: str, *, coordinator: bool = True) -> AbstractContextManager[StageTiming]:
    """A whole save, load or verify: logged at INFO by the group's coordinator
    (``operations_logged_at`` changes that), at DEBUG by every other rank (a job of
    thousands of ranks logs one line per save, not one per rank)."""
    return stage(name, where, _OPERATION_LEVEL.get() if coordinator else logging.DEBUG)


_LOGGED_ONCE: set[tuple[str, str]] = set()


def log_once(log: logging.Logger, message: str) -> None:
    """Logs ``message`` the first time this process sees it: at INFO on rank 0 of the
    default process group (or a process outside any group), at DEBUG on the others, so
    that a notice about a choice made the same way on every rank (Megatron's strategy
    options that do not apply) appears once per job."""
    if (log.name, message) in _LOGGED_ONCE:
        return
    _LOGGED_ONCE.add((log.name, message))
    log.log(info_on_first_rank(), "%s", message)


def info_on_first_rank() -> int:
    """INFO on rank 0 of the default process group (or a process outside any group),
    DEBUG on the others: the level of a line every rank would log alike, which a job
    of 1,000 ranks should show once, not 1,000 times."""
    import torch.distributed as dist

    first_rank = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    return logging.INFO if first_rank else logging.DEBUG


def format_bytes(nbytes: int) -> str:
    """``1.5 GiB``-style text for a byte count."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
