"""The common-state consistency check across ranks, with Megatron-Core's messages (issue 26.4).

Only rank 0's common state is saved. Megatron-Core (>= 0.14) sends rank 0's common
state to every rank, which diffs it with its own (``dict_utils.diff``) and warns
"Rank <r> common state dict differs from rank 0 common state dict. ..."; before 0.14 rank
0 gathered them all and warned "There is difference in the common state dict in
different ranks. The differences are {rank: (only_left, only_right, mismatch)}".
shardstore logs both, and compares in full only the ranks whose digests differ.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from shardstore import ShardedTensor, load, save
from shardstore.core import CheckpointingException
from tests.dist import run_distributed

MISMATCH = "[(('rank',), <class 'int'>, <class 'int'>)]"


def _collect_warnings() -> list[str]:
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("shardstore").addHandler(Keep(logging.WARNING))
    return records


def _state(rank: int, common: dict) -> dict:
    return {"w": ShardedTensor.from_rank_offsets("w", torch.ones(2), replica_id=rank), **common}


def save_with_common(rank: int, world: int, ckpt: str, commons: list[dict]) -> list[str]:
    records = _collect_warnings()
    save(_state(rank, commons[rank]), ckpt)
    return records


def test_a_rank_whose_common_state_differs_is_warned_about_in_megatrons_words(tmp_path: Path) -> None:
    commons = [{"iteration": 7, "rank": 0}, {"iteration": 7, "rank": 1, "only_here": "x"}]
    logs = run_distributed(save_with_common, 2, str(tmp_path / "c"), commons)
    assert logs[1] == [
        "Rank 1 common state dict differs from rank 0 common state dict. Keys only on rank 0: [], "
        f"Keys only on 1: [('only_here',)], Mismatched keys: {MISMATCH}"
    ]
    assert logs[0] == [
        "There is difference in the common state dict in different ranks. The differences are "
        f"{{1: ([], [('only_here',)], {MISMATCH})}}"
    ]


def test_entries_whose_keys_print_alike_are_compared_apart(tmp_path: Path) -> None:
    """The digests were keyed by ``str(key)``: the entries ``1`` and ``"1"`` shared a
    digest slot, the last one's digest won, and rank 1's different value at ``1`` went
    unreported (Megatron-Core's check, a full ``diff``, reports it)."""
    commons = [{1: "a", "1": "b"}, {1: "changed", "1": "b"}]
    logs = run_distributed(save_with_common, 2, str(tmp_path / "c"), commons)
    assert logs[1] == [
        "Rank 1 common state dict differs from rank 0 common state dict. Keys only on rank 0: [], "
        "Keys only on 1: [], Mismatched keys: [((1,), <class 'str'>, <class 'str'>)]"
    ]


def save_counting_full_comparisons(rank: int, world: int, ckpt: str, commons: list[dict]) -> tuple[list[str], int]:
    import shardstore.protocol.plan_stage as stages

    records = _collect_warnings()
    calls = []
    original = stages.check_common_state_consistency

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    stages.check_common_state_consistency = counted
    try:
        save(_state(rank, commons[rank]), ckpt)
    finally:
        stages.check_common_state_consistency = original
    return records, len(calls)


def test_equal_common_states_are_not_compared_in_full_and_log_nothing(tmp_path: Path) -> None:
    commons = [{"iteration": 7, "args": {"lr": 0.1}}] * 2
    results = run_distributed(save_counting_full_comparisons, 2, str(tmp_path / "c"), commons)
    assert results == [([], 0), ([], 0)]


def test_digests_that_differ_on_equal_values_log_nothing(tmp_path: Path) -> None:
    """Equal values of different dtypes serialize differently but ``diff`` calls them
    equal, as Megatron's check does: the full comparison runs and finds nothing."""
    commons = [{"scale": torch.tensor([1, 2])}, {"scale": torch.tensor([1.0, 2.0])}]
    results = run_distributed(save_counting_full_comparisons, 2, str(tmp_path / "c"), commons)
    assert results == [([], 1), ([], 1)]


def save_dropping_timer(rank: int, world: int, ckpt: str) -> list[str]:
    records = _collect_warnings()
    state = _state(rank, {"iteration": 7, "timer": rank * 1.5})
    save(state, ckpt, preprocess_common_before_consistancy_check=lambda c: {k: v for k, v in c.items() if k != "timer"})
    return records


def test_the_preprocess_function_is_applied_before_the_comparison(tmp_path: Path) -> None:
    assert run_distributed(save_dropping_timer, 2, str(tmp_path / "c")) == [[], []]


def validate_megatron_style(rank: int, world: int, common: list[dict], valid: bool) -> tuple[list[str], str]:
    from shardstore.validation import determine_global_metadata, validate_sharding_integrity

    records = _collect_warnings()
    length = 2 if valid or rank == 0 else 1  # rank 1 leaves a gap when invalid
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(length), (0, rank, world))}
    try:
        validate_sharding_integrity(determine_global_metadata(state)[1], common_state_dict=common[rank])
    except CheckpointingException as exc:
        return records, str(exc)
    return records, ""


def test_validate_sharding_integrity_takes_megatrons_global_metadata_and_common_state() -> None:
    commons = [{"rank": 0}, {"rank": 1}]
    (logs0, error0), (logs1, error1) = run_distributed(validate_megatron_style, 2, commons, True)
    assert (error0, error1) == ("", "")
    assert logs1 == [
        "Rank 1 common state dict differs from rank 0 common state dict. Keys only on rank 0: [], "
        f"Keys only on 1: [], Mismatched keys: {MISMATCH}"
    ]
    assert logs0 == [f"There is difference in the common state dict in different ranks. The differences are "
                     f"{{1: ([], [], {MISMATCH})}}"]
    # an invalid sharding raises on rank 0, which alone checks it (as in Megatron-Core)
    (_, error0), (_, error1) = run_distributed(validate_megatron_style, 2, [{}, {}], False)
    assert "'w'" in error0 and "Invalid global sharding" in error0 and error1 == ""


def test_validate_sharding_integrity_takes_the_common_state_second() -> None:
    """Megatron-Core's positional signature ``(global_metadata, common_state_dict)``;
    before, the second parameter was shardstore's ``storage`` (now keyword-only), and
    the call failed with "'dict' object has no attribute 'max_path_bytes'"."""
    from shardstore.validation import validate_sharding_integrity

    shard = ShardedTensor.from_rank_offsets("a", torch.zeros(4)).without_data()
    validate_sharding_integrity([[shard]], {"iteration": 1})  # one rank: nothing to compare
    with pytest.raises(CheckpointingException, match="Invalid global sharding"):
        validate_sharding_integrity([[shard, shard]], None)


@pytest.mark.parametrize("unpicklable", [False, True])
def test_the_comparison_survives_values_that_cannot_travel(tmp_path: Path, unpicklable: bool) -> None:
    # a lambda cannot be pickled: compared by its repr, which differs between processes anyway
    commons = [{"rank": 0}, {"rank": 1}]
    logs = run_distributed(save_with_unpicklable, 2, str(tmp_path / "c"), commons, unpicklable)
    assert any("Rank 1 common state dict differs" in m for m in logs[1])
    assert any("There is difference in the common state dict" in m for m in logs[0])


def save_with_unpicklable(rank: int, world: int, ckpt: str, commons: list[dict], unpicklable: bool) -> list[str]:
    records = _collect_warnings()
    common = dict(commons[rank])
    preprocess = None
    if unpicklable:
        # only the compared state holds it (common.pt must stay loadable)
        def preprocess(c: dict) -> dict:
            return {**c, "hook": lambda: None}
    save(_state(rank, common), ckpt, preprocess_common_before_consistancy_check=preprocess)
    return records


def test_a_list_shorter_than_the_saved_one_is_an_error_naming_the_checkpoint(ckpt_dir: Path) -> None:
    """A request whose list is shorter than the saved one (a tensor in slot 0, values
    after it) failed with dict_utils' bare ValueError ("Duplicate non-dict and non-list
    values"), naming neither the checkpoint nor what to look at."""
    save({"a": [ShardedTensor.from_rank_offsets("a0", torch.ones(2)), 5, 7]}, ckpt_dir)
    with pytest.raises(CheckpointingException, match=r"containers do not match .*load_common_state_dict"):
        load({"a": [ShardedTensor.from_rank_offsets("a0", torch.zeros(2))]}, ckpt_dir)
