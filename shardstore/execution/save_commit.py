"""The end of a rank's part of a save: the ranks agree (``finalize_save``), and the
coordinator binds every rank's report of its chunks into the commit record
(``bind_chunks``: the ONLY place chunk checksums enter it) and commits it
(``commit_save``), or the save is abandoned (``end_save``). ``execution.save`` stages
and writes; ``execution.pipeline.SavePipeline`` runs both in order.
"""

from __future__ import annotations

__all__ = ["bind_chunks", "commit_save", "end_save", "finalize_save", "reused_from"]

import logging
import time
from dataclasses import replace

from shardstore.errors import CheckpointingException
from shardstore.format.chunks import (
    WrittenChunk,
)
from shardstore.format.commit import PendingCheckpoint
from shardstore.format.integrity import caller_file_checksums, callers_objects, file_checksums
from shardstore.format.records import (
    ArrayRecord,
    CommitRecord,
    ReusedChunks,
)
from shardstore.protocol.collectives import Group
from shardstore.protocol.stage import every_rank_stopped, raise_stage_failure, run_stage

logger = logging.getLogger(__name__)


def finalize_save(
    pending: PendingCheckpoint, group: Group, record: CommitRecord | None, written: list[WrittenChunk],
    error: BaseException | None,
) -> None:
    """Collective (one stage, ``protocol.stage.run_stage``): every rank's outcome (its
    error, or the chunks it ``written``, with the id of the save they are of) goes to
    the coordinator, which binds the chunks into its commit ``record`` and commits
    (``shardstore.format.commit``: a save that lost a race with another save fails
    here, as does one whose ranks report for another save: ``_check_same_save``); the
    outcome is broadcast.

    On any failure every rank raises the same error, no commit record is written, and
    the coordinator deletes what the save wrote.
    """
    try:
        run_stage(
            group, f"Writing checkpoint {pending.describe()}", lambda: (_agreed_id(pending), written),
            reduce=lambda reports: _commit_stage(pending, group, record, reports), local_error=error,
        )
    except BaseException as exc:  # a rank lost, or still at work: let go, delete nothing
        end_save(pending, abandon=group.is_coordinator and every_rank_stopped(group, exc))
        raise
    end_save(pending, abandon=False)


def _commit_stage(
    pending: PendingCheckpoint, group: Group, record: CommitRecord | None,
    reports: list[tuple[str | None, list[WrittenChunk]]],
) -> None:
    """Coordinator, the reduce of the commit stage: every rank's report checked to be of
    this save (``_check_same_save``), then ``commit_save``; a failure told to every rank."""
    try:
        if record is None:
            raise CheckpointingException(f"Internal error: committing {pending.describe()} off the coordinator")
        _check_same_save(pending, [save_id for save_id, _ in reports])
        commit_save(pending, record, [written for _, written in reports])
    except Exception as exc:  # told to every rank by the stage
        raise_stage_failure(group, f"Committing checkpoint {pending.describe()}", exc)


def _agreed_id(pending: PendingCheckpoint) -> str | None:
    """The save's id as every rank knows it (``SaveIntent.agreed``), or None where each
    rank made its own (a caller's directory)."""
    return pending.intent.save_id if pending.intent.agreed else None


def _check_same_save(pending: PendingCheckpoint, save_ids: list[str | None]) -> None:
    """Coordinator: every rank reported the chunks of ``pending``'s save (``save_ids``,
    by rank: ``_agreed_id``), not of another one it finalized meanwhile (async saves
    scheduled or finalized in another order on some rank): those chunks' checksums
    would be bound into this save's commit record, committing a checkpoint that does not
    verify. Not checked where the ranks have no id in common (a caller's directory).

    Raises:
        CheckpointingException: naming the checkpoint and the ranks that differ.
    """
    own = _agreed_id(pending)
    others = [rank for rank, save_id in enumerate(save_ids) if save_id != own]
    if own is not None and others:
        raise CheckpointingException(
            f"Not committing {pending.describe()}: rank(s) {', '.join(map(str, others))} finalized another save "
            "in its place (the ranks scheduled or finalized their async saves in different orders). Schedule "
            "the same saves in the same order on every rank, and save this checkpoint again."
        )


def commit_save(pending: PendingCheckpoint, record: CommitRecord, reports: list[list[WrittenChunk]]) -> CommitRecord:
    """Coordinator: THE commit of a save, whoever composed it (``execution.pipeline``).

    The one place that binds what the writers reported into the commit record (every
    chunk's crc32c and XXH3-128 digest, ``bind_chunks``; the chunks shared with the
    checkpoint reused from, ``reused_from``), adds every file's checksum (and, into a
    caller's directory, the caller's own files as external ones) and the arrays' places
    an import gave (``SaveOptions.array_places``), and publishes
    (``pending.commit``, by its ``Publisher``). Returns the record committed.

    Raises:
        CheckpointingException: a chunk nobody wrote or one written twice, a file that
            cannot be read back, or a lost race with another save (nothing is published).
    """
    record = replace(record, layout=pending.intent.layout.to_json())
    record = record.with_zarr_metadata(pending.options.zarr_metadata).with_places(
        pending.options.array_places, pending.describe()
    )
    record = bind_chunks(record, reports, pending.describe())
    if pending.publisher.binds_callers_files:
        record = callers_objects(pending.location, record)
    files = file_checksums(pending.location, record)
    record = replace(record, files=files.checksums, file_digests=files.digests,
                     reused_from=reused_from(pending, reports))
    if pending.publisher.binds_callers_files:
        external = caller_file_checksums(pending.location, record)
        record = replace(record, external_files=external.checksums,
                         file_digests={**record.file_digests, **external.digests})
    record = replace(record, save_id=pending.intent.save_id, created=time.time())
    record = pending.commit(record)
    if record.reused_from is not None:
        logger.info(
            "save %s: %d chunk(s), %d bytes, unchanged since %s: shared, not written again",
            pending.describe(), record.reused_from.chunks, record.reused_from.nbytes, record.reused_from.checkpoint,
        )
    return record


def end_save(location: PendingCheckpoint, abandon: bool) -> None:
    """Lets go of what a save holds (its descriptors and staging lock); ``abandon``
    (coordinator, after a failure every rank knows of) also deletes what it wrote."""
    if abandon:
        location.abandon()
    else:
        location.release()


def bind_chunks(record: CommitRecord, reports: list[list[WrittenChunk]], where: str) -> CommitRecord:
    """The commit record with every chunk's crc32c and content digest as its writer
    reported it (and its ETag, where the store gave one).

    Raises:
        CheckpointingException: a chunk nobody wrote, or one written twice.
    """
    by_key: dict[str, dict[tuple[int, ...], WrittenChunk]] = {key: {} for key in record.arrays}
    packs: dict[str, int] = {}
    for rank, chunks in enumerate(reports):
        for chunk in chunks:
            found = by_key[chunk.key]
            if chunk.index in found:
                raise CheckpointingException(
                    f"{where}: chunk {record.arrays[chunk.key].chunk_key(chunk.index)} of array {chunk.key!r} was "
                    f"written twice (rank {rank} and another)"
                )
            found[chunk.index] = chunk
            if chunk.packed is not None:
                packs[chunk.packed[0]] = chunk.packed[2]
    arrays = {key: _bound_array(a, by_key[key], where) for key, a in record.arrays.items()}
    return replace(record, arrays=arrays).with_packs(packs)


def _bound_array(array: ArrayRecord, reports: dict[tuple[int, ...], WrittenChunk], where: str) -> ArrayRecord:
    """``array`` bound to its chunks' reports (``ArrayRecord.with_reports``), and to its
    pack and chunk offsets where its writer packed it: all of its chunks or none.

    Raises:
        CheckpointingException: some chunks packed and others not, or in several packs."""
    bound = array.with_reports(reports, where)
    if all(r.packed is None for r in reports.values()):
        return bound
    packs = {r.packed[0] if r.packed is not None else None for r in reports.values()}
    if len(packs) != 1 or None in packs:
        raise CheckpointingException(
            f"Internal error: {where}: the chunks of array {array.key!r} were written into {sorted(map(str, packs))}: "
            "a packed array is packed whole, into one pack; please report it"
        )
    offsets = tuple(reports[index].packed[1] for index in array.chunk_indices())  # type: ignore[index]
    return bound.with_pack(packs.pop(), offsets)


def reused_from(location: PendingCheckpoint, reports: list[list[WrittenChunk]]) -> ReusedChunks | None:
    """What the save shared with the checkpoint it reused from, for the commit record
    (None when it shared nothing)."""
    shared = [chunk.shared for chunks in reports for chunk in chunks if chunk.shared]
    source = location.options.reuse_from
    if not shared or source is None:
        return None
    assert location.intent.reuses is not None
    return ReusedChunks(source.describe(), location.intent.reuses, len(shared), sum(shared))
