"""A stage's point-to-point exchange (``protocol.stage.run_stage(transfers=...)``): what
a rank sends is packed and what it receives allocated before the stage's agreement, so
a rank that cannot (out of memory) fails every rank at once instead of leaving its
peers waiting in the exchange until the process group's timeout."""

from __future__ import annotations

import time

import torch

from shardstore.protocol.collectives import Group, StageFailed
from shardstore.protocol.stage import Transfers, run_stage
from tests.dist import run_distributed


def exchange_with_rank_1_out_of_memory(rank: int, world: int) -> tuple[str, float]:
    group = Group(None)
    if rank == 1:
        def out_of_memory(*_: object) -> None:
            raise MemoryError("cannot allocate the receive buffer")

        group.prepare_exchange = out_of_memory  # type: ignore[method-assign]
    peer = 1 - rank
    sends, receives = {peer: [torch.full((1024,), float(rank))]}, {peer: [torch.empty(1024)]}
    start = time.monotonic()
    try:
        run_stage(group, "Exchanging test blocks", lambda: None, transfers=lambda _: Transfers(sends, receives))
    except StageFailed as exc:
        return str(exc), time.monotonic() - start
    return "no error", time.monotonic() - start


def exchange_both_ways(rank: int, world: int) -> list[float]:
    peer = 1 - rank
    received = torch.empty(4)
    run_stage(Group(None), "Exchanging test blocks", lambda: None,
              transfers=lambda _: Transfers({peer: [torch.full((4,), float(rank))]}, {peer: [received]}))
    return received.tolist()


def test_a_rank_that_cannot_allocate_its_exchange_fails_every_rank_at_once() -> None:
    results = run_distributed(exchange_with_rank_1_out_of_memory, 2, pg_timeout=60)
    for message, seconds in results:
        assert "cannot allocate the receive buffer" in message, message
        assert seconds < 20, seconds  # the agreement, not the group's 60 s timeout


def test_the_exchange_delivers_each_ranks_tensors_to_its_peer() -> None:
    assert run_distributed(exchange_both_ways, 2) == [[1.0] * 4, [0.0] * 4]


def _mixed(rank: int) -> list[torch.Tensor]:
    """Small and large (``OWN_MESSAGE_BYTES`` and over) tensors, contiguous or not."""
    big = 1 << 18  # float32 elements: 1 MiB
    return [
        torch.full((3,), 10.0 + rank),
        torch.arange(big, dtype=torch.float32) + rank,  # large, contiguous
        torch.full((5,), 20.0 + rank, dtype=torch.bfloat16),
        (torch.arange(2 * big, dtype=torch.float32).reshape(2, big) - rank).t(),  # large, strided
        (torch.arange(big + 7, dtype=torch.float64) * (rank + 1))[::2],  # large, strided, 1-D
        (torch.arange(9.0) + rank)[::3],  # small, strided, 1-D
    ]


def exchange_mixed(rank: int, world: int) -> tuple[bool, int]:
    """Every kind of tensor lands whole and in order; the large contiguous target is
    received into directly (no buffer of its own), the others through buffers."""
    peer = 1 - rank
    expected = _mixed(peer)
    targets = [torch.empty(3), torch.empty(1 << 18), torch.empty(5, dtype=torch.bfloat16),
               torch.empty(2, 1 << 18).t(), torch.empty((1 << 17) + 4, 2, dtype=torch.float64)[:, 0], torch.empty(3)]
    group = Group(None)
    prepared = group.prepare_exchange({peer: _mixed(rank)}, {peer: targets})
    group.run_exchange(prepared)
    ok = all(torch.equal(t, e) for t, e in zip(targets, expected))
    return ok, len(prepared.landed)


def test_large_tensors_travel_on_their_own_and_land_in_place() -> None:
    # landed: the small ones' packed message, and the two strided large ones
    assert run_distributed(exchange_mixed, 2) == [(True, 3), (True, 3)]
