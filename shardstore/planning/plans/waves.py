"""The exchange waves of a save: a rank's assembled chunks cut into waves of a bounded
size (``exchange_waves``), the same on every rank.
"""

from __future__ import annotations

__all__ = ["exchange_waves"]



from shardstore.planning.layout import (
    FlatChunk,
)
from shardstore.planning.plans.rank_plans import RankSavePlan


def exchange_waves(plan: RankSavePlan, wave_bytes: int | None) -> list[tuple[tuple[int, FlatChunk], ...]]:
    """``plan.straddling`` cut into the exchange waves of a save that assembles at most
    about ``wave_bytes`` per rank at once (None: one wave): chunk ``c`` is in wave
    ``c.at // window``, so a rank's wave holds the chunks that start in its window (at
    most ``window`` plus the last one's size). The window is ``wave_bytes``, or the
    largest chunk where that is larger, so that the waves are never more than a
    rank's chunks. A pure function of the plan's global part and ``wave_bytes``: every
    rank gets as many waves, and each chunk's writer and contributors put it in the
    same one, as long as they pass the same ``wave_bytes`` (``execution.save.stage_save``
    has the ranks agree on it)."""
    if not wave_bytes or plan.assembled_bytes <= wave_bytes:
        return [plan.straddling]
    window = max(wave_bytes, plan.largest_assembled)
    waves: list[list[tuple[int, FlatChunk]]] = [[] for _ in range(-(-plan.assembled_bytes // window))]
    for tagged in plan.straddling:
        waves[tagged[1].at // window].append(tagged)
    return [tuple(w) for w in waves]
