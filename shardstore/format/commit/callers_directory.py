"""``IntoCallersDirectory``: a save written into a directory the caller made and already
wrote into (Megatron-Core's ``save``), adopted (``adopt_save``), never begun or joined;
nothing there is ever deleted.
"""

from __future__ import annotations

__all__ = ["IntoCallersDirectory"]

from shardstore.format.commit.pending import PendingCheckpoint, Publisher
from shardstore.format.records import CommitRecord, write_commit_record


class IntoCallersDirectory(Publisher):
    """A directory the caller created and already wrote into (Megatron-Core's ``save``):
    written in place, the commit record last, the caller's files bound as external ones.
    Nothing there is provably ours, so an abandoned save deletes nothing, and nothing is
    held open there (a background writer forked by the caller drops its copy
    unreleased). Such a save is adopted (``adopt_save``), never begun or joined."""

    holds_resources = False
    binds_callers_files = True

    def commit(self, save: PendingCheckpoint, record: CommitRecord) -> CommitRecord:
        write_commit_record(save.target, record)
        return record

    def abandon(self, save: PendingCheckpoint) -> None:
        return None  # the caller's directory: nothing in it is provably ours
