"""The scrub of shared chunks: which chunks an incremental save on a local file system
proves by reading them back, though their file identity matches (``format.reuse``).

A shared chunk whose recorded identity matches (``stores.file_identity``) is proven
without reading its bytes; bit rot and writes whose author set ``mtime`` back change no
identity field. So each reusing save also re-reads a bounded share of the chunks the
base's record proves by identity, those unread longest first (the count each chunk's
identity keeps; ties in key and grid order), and compares them with the bytes being
saved: a chunk that no longer holds them is written, not shared, and the save warns
(``format.reuse``: "run `shardstore verify`").

Each rank plans over every chunk of the arrays it writes chunks of, from the base's
record alone (ranks that write chunks of the same arrays make the same plan), and reads
the planned chunks it shares: at most ``ScrubPolicy.budget`` of the bytes the record
proves by identity in those arrays, at least ``min_bytes``; a single chunk larger than
the budget is read alone when it is the oldest. As each save moves on past more than
``budget - largest chunk`` bytes, every shared chunk is re-read at least once every
``ceil(S / (budget - largest chunk))`` saves (S: those bytes), about ``rotation_saves``
with the default budget. The order is one over all chunks, so the oldest chunk of the
checkpoint is read at every save by the rank that writes it, whatever the layout.
"""

from __future__ import annotations

__all__ = ["SCRUB", "ScrubPolicy", "scrub_plan"]

import math
from collections.abc import Mapping
from dataclasses import dataclass

from shardstore.format.records import ArrayRecord
from shardstore.stores.file_identity import FileIdentity


@dataclass(frozen=True)
class ScrubPolicy:
    """How much a reusing save re-reads of the chunks it could prove by identity.

    Attributes:
        rotation_saves: the budget is this fraction (1 / rotation_saves) of those
            chunks' bytes: each is re-read about once every ``rotation_saves`` saves.
        min_bytes: the budget's floor, bytes per save (small checkpoints rotate faster).
    """

    rotation_saves: int = 16
    min_bytes: int = 64 << 20

    def budget(self, nbytes: int) -> int:
        """Bytes to re-read in one save, of ``nbytes`` proven by identity."""
        return max(self.min_bytes, math.ceil(nbytes / self.rotation_saves))


SCRUB = ScrubPolicy()


def scrub_plan(arrays: Mapping[str, ArrayRecord], policy: ScrubPolicy = SCRUB) -> frozenset[tuple[str, int]]:
    """The ``(array key, chunk ordinal)`` of the base's chunks (``arrays``: its records
    of the arrays that may be shared) to re-read in this save; the same on every rank."""
    tagged = []
    for key in sorted(arrays):
        for ordinal, tag in enumerate(arrays[key].chunk_etags or ()):
            if (identity := FileIdentity.parse(tag)) is not None:
                tagged.append((-identity.unread, key, ordinal, identity.size))
    tagged.sort()
    budget = policy.budget(sum(t[3] for t in tagged))
    chosen: list[tuple[str, int]] = []
    total = 0
    for _, key, ordinal, size in tagged:
        if chosen and total + size > budget:
            break
        chosen.append((key, ordinal))
        total += size
    return frozenset(chosen)
