"""``remove_sharded_tensors`` killed (SIGKILL) at each point of its work, on packed
arrays (``SaveOptions(pack_arrays_up_to=...)``), arrays of their own and a group.

Every time: the commit record never names a missing file, the arrays that stay load
bit-exact, and the removal called again (or the next removal, of another prefix, or
a save replacing the checkpoint) finishes what the killed one began, after which
``verify`` passes. Before, a kill after
the record was rewritten left the pack and the arrays' files behind for good: ``verify``
reported them as another program's, and the same removal again found nothing to do.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardstore import SaveOptions, ShardedTensor, load, remove_sharded_tensors, save, verify
from shardstore.format.records import COMMIT_RECORD, read_commit_record
from shardstore.stores.local import LocalStore
from shardstore.stores.locations import open_location
from tests.dist import run_distributed
from tests.test_crash import _die, _die_at_the_atomic_rename_of

pytest.importorskip("tensorstore")

PACK = SaveOptions(pack_arrays_up_to=64 * 1024)


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    tensors = {f"emb/t{i}": torch.randn(40 + i, generator=gen) for i in range(4)}  # one pack
    tensors["emb/table"] = torch.randn(64, 512, generator=gen)  # an array of its own in the group
    tensors["head"] = torch.randn(64, 512, generator=gen)
    tensors["tail"] = torch.randn(64, 512, generator=gen)
    return tensors


def _sd(tensors: dict[str, torch.Tensor], empty: bool = False) -> dict[str, ShardedTensor]:
    return {k: ShardedTensor.from_rank_offsets(k, torch.empty_like(t) if empty else t, replica_id=0)
            for k, t in tensors.items()}


def _die_at_deletion(number: int) -> None:
    """Dies at the ``number``-th removal of a file or tree (1: before any)."""
    calls = []
    for method in ("delete", "delete_prefix"):
        original = getattr(LocalStore, method)

        def counted(self, *args, _original=original, **kwargs):
            calls.append(args)
            if len(calls) >= number:
                _die()
            return _original(self, *args, **kwargs)

        setattr(LocalStore, method, counted)


def remove_then_die(rank: int, world: int, ckpt: str, point: str) -> None:
    from shardstore.format.removal_marker import REMOVAL_MARKER

    if point == "writing the marker":
        _die_at_the_atomic_rename_of(REMOVAL_MARKER)
    elif point == "writing the record":
        _die_at_the_atomic_rename_of(COMMIT_RECORD)
    else:
        _die_at_deletion(int(point.removeprefix("deletion ")))
    remove_sharded_tensors(ckpt, "emb")
    raise AssertionError("the removal went through")


POINTS = ["writing the marker", "writing the record", "deletion 1", "deletion 2", "deletion 3"]


def _assert_record_names_no_missing_file(ckpt: Path) -> None:
    location = open_location(str(ckpt))
    present = set(location.list_files())
    missing = sorted(read_commit_record(location).vouched_paths() - present)
    assert missing == [], missing


@pytest.mark.parametrize("finish", ["same removal", "another removal", "replacing save"])
@pytest.mark.parametrize("point", POINTS)
def test_a_removal_killed_at_any_point_is_finished_by_the_next_one(tmp_path: Path, point: str, finish: str) -> None:
    tensors = _tensors()
    ckpt = tmp_path / "ckpt"
    save(_sd(tensors), ckpt, options=PACK)
    assert any(p.suffix == ".zip" for p in ckpt.rglob("*")), "the small arrays are packed"
    run_distributed(remove_then_die, 1, str(ckpt), point, killed=(0,))

    _assert_record_names_no_missing_file(ckpt)
    kept = {k: t for k, t in tensors.items() if not k.startswith("emb")}
    loaded = load(_sd(kept, empty=True), ckpt)
    assert all(torch.equal(loaded[k], t) for k, t in kept.items())
    report = verify(ckpt)
    if not report.ok:  # only the files the killed removal still had to delete, said so
        assert all("remove_sharded_tensors" in p.message and "interrupted" in p.message for p in report.problems), report

    if finish == "same removal":
        remove_sharded_tensors(ckpt, "emb")
    elif finish == "replacing save":  # the removal's leftovers are the old checkpoint's own: they go with it
        save(_sd(kept), ckpt, options=SaveOptions(pack_arrays_up_to=64 * 1024, overwrite=True))
    else:  # a kill before the record was rewritten removed nothing: "emb" stays
        remove_sharded_tensors(ckpt, "tail")
        kept = {k: t for k, t in tensors.items() if k != "tail" and (k in kept or not point.startswith("deletion"))}
    report = verify(ckpt)
    assert report.ok, report
    assert sorted(read_commit_record(open_location(str(ckpt))).arrays) == sorted(kept)
    emb_left = any(k.startswith("emb") for k in kept)
    assert (ckpt / "emb").exists() == emb_left and any(p.suffix == ".zip" for p in ckpt.rglob("*")) == emb_left
    loaded = load(_sd(kept, empty=True), ckpt)
    assert all(torch.equal(loaded[k], t) for k, t in kept.items())


def test_the_manager_deletes_a_step_whose_removal_was_killed_whole(tmp_path: Path) -> None:
    from shardstore.tools.manager import CheckpointManager, CheckpointManagerOptions

    manager = CheckpointManager(tmp_path, CheckpointManagerOptions(max_to_keep=5))
    tensors = _tensors()
    for step in (1, 2):
        manager.save(step, _sd(tensors), options=PACK)
    step_dir = Path(manager.location(1).describe())
    run_distributed(remove_then_die, 1, str(step_dir), "deletion 2", killed=(0,))
    manager.delete(1)
    assert not step_dir.exists(), sorted(str(p.relative_to(step_dir)) for p in step_dir.rglob("*"))
