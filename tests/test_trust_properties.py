"""Issue 13's invariant as a property: whatever happens to a checkpoint directory,
``load`` returns the values of the last save that committed there, bit-exact, or
raises a CheckpointingException.

Hypothesis draws a random layout (keys, shapes, dtypes, chunk size) and a random
history of events on one directory: saves that commit, saves that fail at a random
phase (disk full), saves that die before publishing (leaving a staging directory),
two saves racing (an async save overtaken by a later one), and corruptions (a
flipped byte, two chunks swapped, a chunk from another checkpoint, a truncated
``common.pt``). A model tracks what was committed; after every event the checkpoint
is loaded and verified against it. One process (the multi-rank paths have their own
tests), so each example costs well under a second.
"""

from __future__ import annotations

import importlib
import os
import random
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardstore import CheckpointingException, ShardedTensor, load, save, verify
from shardstore.strategies.async_utils import AsyncCallsQueue
from shardstore.strategies.zarr import ZarrSaveShardedStrategy
from tests.scenarios import assert_bits_equal, global_tensor

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.float8_e5m2]
EXAMPLES = 60 if os.environ.get("SHARDSTORE_SLOW") == "1" else 12
FAIL_POINTS = [
    ("shardstore.execution.pipeline", "write_config"),  # the save pipeline begins the save
    ("shardstore.format.chunks", "ChunkFile.write"),
    ("shardstore.stores.local", "_syncfs"),
    ("shardstore.stores.local", "LocalStore.put_atomic"),
    ("shardstore.stores.local", "LocalStore.rename_to"),
]


@dataclass(frozen=True)
class Tensor:
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@st.composite
def layouts(draw) -> list[Tensor]:
    n = draw(st.integers(1, 3))
    return [
        Tensor(f"m{i}/w", tuple(draw(st.lists(st.sampled_from([1, 2, 3, 5]), min_size=0, max_size=2))),
               draw(st.sampled_from(DTYPES)))
        for i in range(n)
    ]


EVENTS = st.one_of(
    st.tuples(st.just("save")),
    st.tuples(st.just("fail"), st.integers(0, len(FAIL_POINTS) - 1)),
    st.tuples(st.just("crash")),
    st.tuples(st.just("race")),
    st.tuples(st.just("corrupt"), st.sampled_from(["flip", "swap", "foreign", "common"]), st.integers(0, 10**6)),
)


def _values(layout: list[Tensor], version: int) -> dict[str, torch.Tensor]:
    return {t.key: global_tensor(f"{t.key}@{version}", t.shape, t.dtype) for t in layout}


def _state(layout: list[Tensor], version: int) -> dict:
    sd = {t.key: ShardedTensor.from_rank_offsets(t.key, v.clone()) for t, v in zip(layout, _values(layout, version).values())}
    sd["version"] = version
    return sd


def _request(layout: list[Tensor]) -> dict:
    return {t.key: ShardedTensor.from_rank_offsets(t.key, torch.empty(t.shape, dtype=t.dtype)) for t in layout}


class History:
    """The directory under test and the model of what it must hold."""

    def __init__(self, root: Path, layout: list[Tensor], chunk_bytes: int) -> None:
        self.root, self.ckpt, self.layout = root, root / "ckpt", layout
        self.strategy = ZarrSaveShardedStrategy(max_chunk_bytes=chunk_bytes)
        self.committed: int | None = None  # version of the last committed save
        self.snapshot: dict[str, bytes] = {}  # its files as committed
        self.next_version = 0

    def _tree(self) -> dict[str, bytes]:
        return {str(p.relative_to(self.ckpt)): p.read_bytes() for p in self.ckpt.rglob("*") if p.is_file()}

    def _committed(self, version: int) -> None:
        self.committed, self.snapshot = version, self._tree()

    @property
    def damaged(self) -> bool:
        """Bytes changed since the commit (two flips of one bit are no damage)."""
        return self.committed is not None and self._tree() != self.snapshot

    def _save(self) -> int:
        version, self.next_version = self.next_version, self.next_version + 1
        save(_state(self.layout, version), self.ckpt, self.strategy, overwrite=True)
        return version

    def _start_async_save(self):
        version, self.next_version = self.next_version, self.next_version + 1
        return save(_state(self.layout, version), self.ckpt, self.strategy, overwrite=True, async_sharded_save=True)

    def run(self, event: tuple) -> None:
        kind = event[0]
        if kind == "save":
            self._committed(self._save())
        elif kind == "fail":
            module, attribute = FAIL_POINTS[event[1]]
            owner = importlib.import_module(module)
            *path, name = attribute.split(".")
            for part in path:
                owner = getattr(owner, part)
            with mock.patch.object(owner, name, side_effect=OSError(28, "No space left on device")):
                with pytest.raises(CheckpointingException):
                    self._save()
        elif kind == "crash":
            import shardstore.format.commit as commit

            def die(pending, record):  # the process is gone: its lock is released, nothing cleaned
                pending.release()
                raise CheckpointingException("simulated crash before publishing")

            with ExitStack() as stack:
                stack.enter_context(mock.patch.object(commit.PendingCheckpoint, "commit", die))
                stack.enter_context(mock.patch.object(commit.PendingCheckpoint, "abandon", lambda self: None))
                with pytest.raises(CheckpointingException):
                    self._save()
        elif kind == "race":
            queue = AsyncCallsQueue(io_priority="normal")
            queue.schedule_async_request(self._start_async_save())
            self._committed(self._save())  # overtakes the async save
            with pytest.raises(CheckpointingException, match="another save committed"):
                queue.maybe_finalize_async_calls(blocking=True)
            queue.close(abort=True)
        elif kind == "corrupt" and self.committed is not None:
            self._corrupt(event[1], random.Random(event[2]))

    def _corrupt(self, how: str, rng: random.Random) -> None:
        chunks = sorted(p for p in self.ckpt.rglob("c*") if p.is_file() and (p.name == "c" or p.name.startswith("c.")))
        if how == "common" or not chunks:
            common = self.ckpt / "common.pt"
            common.write_bytes(common.read_bytes()[:-1])
            return
        a = rng.choice(chunks)
        before = a.read_bytes()
        if how == "flip":
            data = bytearray(before)
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            a.write_bytes(bytes(data))
        elif how == "swap":
            b = rng.choice(chunks)
            a.write_bytes(b.read_bytes())
            b.write_bytes(before)
        else:  # a chunk of the same name from another checkpoint of the same layout
            other = self.root / "other"
            if not other.exists():
                save(_state(self.layout, 10**6), other, self.strategy)
            foreign = other / a.relative_to(self.ckpt)
            a.write_bytes(foreign.read_bytes())

    def check(self) -> None:
        """The invariant, after every event."""
        try:
            loaded = load(_request(self.layout), self.ckpt)
        except CheckpointingException:
            assert self.committed is None or self.damaged, "a committed, undamaged checkpoint failed to load"
            return
        assert self.committed is not None, "loaded a checkpoint that never committed"
        expected = _values(self.layout, self.committed)
        for key, value in expected.items():
            assert_bits_equal(loaded[key], value, key)  # damage, if any, must not pass silently
        assert loaded["version"] == self.committed
        assert verify(self.ckpt).ok == (not self.damaged)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(layout=layouts(), chunk_items=st.sampled_from([1, 2, 1000]), events=st.lists(EVENTS, min_size=1, max_size=8))
def test_load_returns_the_committed_values_or_raises(layout: list[Tensor], chunk_items: int, events: list) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        history = History(Path(tmp), layout, chunk_bytes=chunk_items * 8)
        for event in events:
            history.run(event)
            history.check()
        leftovers = [p.name for p in Path(tmp).iterdir() if p.name not in ("ckpt", "other")]
        assert all(".shardstore-save-" in name for name in leftovers), leftovers  # only a dead save's staging
