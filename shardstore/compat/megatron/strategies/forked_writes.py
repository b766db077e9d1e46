"""An async save whose writes run in another process: Megatron-Core's ``AsyncCallsQueue``.

shardstore's own ``AsyncCallsQueue`` runs a request's ``async_fn`` in a thread, so the
chunks it wrote (their crc32c and digests, which the commit record binds) come back in
memory. Megatron's queue forks a writer process (or hands the request, pickled, to a
persistent spawned one: ``SavePipeline``, ``PendingCheckpoint`` and ``LocalStore`` pickle what such a
process needs; or to nvidia-resiliency-ext's), so they cannot: here each rank's background writer
leaves its outcome in a small file, ``.shardstore-written-<rank>.json`` in the pending
checkpoint, which the finalization (in the training process, on every rank) reads,
removes and commits with. A report names its save (the rank's save id): one left by
another save into the same directory (Megatron-Core saves into the directory of an
earlier save that crashed before its finalization) is no report of this one. A
background write that failed, or left no report, fails the finalization on every rank,
with no commit record.

Used by both ways into Megatron: ``shardstore.megatron.install()`` (the module-level
entry points) and the strategy plug-in (``tools.megatron_strategy``). Needs no
megatron-core: the request class is the caller's.
"""

from __future__ import annotations

__all__ = [
    "WRITE_REPORT_PREFIX", "finalize_from_report", "for_another_process", "write_and_report",
    "write_staged",
]

import json
import logging
from collections.abc import Callable
from functools import partial
from typing import Any

from shardstore.engine.async_requests import AsyncRequest, Finalization
from shardstore.errors import CheckpointingException
from shardstore.execution.pipeline import SaveFinalization, SavePipeline
from shardstore.format.chunks import WrittenChunk

logger = logging.getLogger(__name__)

# Where a background writer leaves its outcome for the finalization (one file per rank).
WRITE_REPORT_PREFIX = ".shardstore-written-"
# The I/O of a staged save, as our ``AsyncRequest`` names it (a module name, so a test
# can make the forked writer's fail).
write_staged = SavePipeline.write_staged


def _same(fn: Callable[[], None]) -> Callable[[], None]:
    return fn


def for_another_process(
    request: AsyncRequest, request_cls: Any, finalize_wrapper: Callable[[Callable[[], None]], Callable[[], None]] = _same
) -> Any:
    """Our async save ``request`` (``ZarrSaveShardedStrategy.async_save_into``'s) as a
    ``request_cls`` (Megatron's or nvidia-resiliency-ext's ``AsyncRequest``) whose
    ``async_fn`` may run in another process; its finalization wrapped in
    ``finalize_wrapper`` (the Megatron door raises its errors in Megatron's terms),
    followed by ``request``'s local steps (plain callables: the logging of the save's
    line once it committed), which run only after the commit succeeded."""
    if request.async_fn is not write_staged:
        raise CheckpointingException(
            f"Internal error: cannot hand the async request {request.async_fn!r} to another process; please report it"
        )
    pipeline, io_concurrency, io_threads = request.async_fn_args
    return request_cls(
        async_fn=write_and_report,
        async_fn_args=(pipeline, io_concurrency, io_threads),
        finalize_fns=[
            finalize_wrapper(partial(finalize_from_report, pipeline)),
            *(fn for fn in request.finalize_fns if not isinstance(fn, Finalization)),
        ],
    )


def _report_file(rank: int) -> str:
    return f"{WRITE_REPORT_PREFIX}{rank}.json"


def _save_id(pipeline: SavePipeline) -> str:
    """The id this rank knows its save by, which its report carries."""
    return pipeline.pending.intent.save_id


def write_and_report(pipeline: SavePipeline, io_concurrency: int, io_threads: int) -> None:
    """The ``async_fn`` (run in another process): this rank's writes, then its outcome,
    the chunks' checksums or the error, in the rank's report file.

    A failed write is logged here and raised by the finalization on every rank (from
    the report), not raised here: Megatron's persistent worker runs every request in
    one loop that an exception would end, and its queue would then wait forever for
    this request and every later one; its forked writer ignores the exit status
    anyway. Nor is a report that cannot be written (``_leave_report``)."""
    outcome: dict[str, Any] = {"save_id": _save_id(pipeline)}
    try:
        write_staged(pipeline, io_concurrency, io_threads)
        outcome["written"] = [[c.key, list(c.index), *c[2:]] for c in pipeline.written]
    except Exception as exc:  # the finalization raises it, on every rank
        logger.error("The background write into %s failed", pipeline.describe(), exc_info=True)
        outcome["error"] = f"{type(exc).__name__}: {exc}"
        pipeline.location.end_writes()
    _leave_report(pipeline, outcome)


def _leave_report(pipeline: SavePipeline, outcome: dict[str, Any]) -> None:
    """Writes this rank's report; where that fails too (the disk that failed the writes
    is full), logs it instead of raising (``write_and_report``): the finalization then
    finds no report and fails on every rank, nothing committed."""
    rel = _report_file(pipeline.group.rank)
    try:
        pipeline.location.write_atomic(rel, json.dumps(outcome).encode())
    except Exception:  # the finalization fails for the missing report, on every rank
        logger.error("The background writer of %s could not leave its report %s", pipeline.describe(), rel,
                     exc_info=True)


def finalize_from_report(pipeline: SavePipeline) -> None:
    """The finalization (collective, in the training process): this rank's report, then
    shardstore's commit (``SavePipeline.finalize``)."""
    location, rank = pipeline.location, pipeline.group.rank
    rel = _report_file(rank)
    error: BaseException | None = None
    written: list[WrittenChunk] | None = None
    try:
        data = location.read_bytes_or_none(rel)
        if data is None:
            raise CheckpointingException(
                f"The background write of rank {rank} into {location.describe()} left no report "
                f"({rel}): it did not finish, or could not write its report (the writer's log says why)"
            )
        location.remove(rel)
        outcome = json.loads(data)
        if outcome.get("save_id") != _save_id(pipeline):
            raise CheckpointingException(
                f"The background write of rank {rank} into {location.describe()} left no report: {rel} there "
                f"is another save's ({outcome.get('save_id')!r}, one that did not finish), removed now; the "
                "background write did not finish, or could not write its report (the writer's log says why)"
            )
        if "error" in outcome:
            raise CheckpointingException(
                f"The background write of rank {rank} into {location.describe()} failed: "
                f"{outcome['error']}; nothing was committed"
            )
        written = [WrittenChunk(key, tuple(index), *rest) for key, index, *rest in outcome["written"]]
    except Exception as exc:  # reported on every rank by the finalization
        error = exc
    SaveFinalization(pipeline).finalize(error, written)
