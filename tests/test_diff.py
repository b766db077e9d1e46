"""Issue 23.3: ``shardstore diff`` compares everything ``load`` returns, exactly.

Arrays bit for bit in their own dtype (no float64 detour: int64 above 2**53, -0.0,
NaN payloads), sharded object shards (on one side only, changed) and the common state
(recursively, types and tensor dtypes included); exit status 1 on any difference,
with a line that names the array, object shard or common-state path; 0 when
identical, NaNs included.
"""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shardstore import ShardedObject, ShardedTensor, save
from shardstore.tools.convert import from_other_format
from shardstore.tools.inspection import diff_checkpoints
from tests.fixtures.legacy.make import DCP, MEGATRON
from tests.scenarios import global_tensor
from tests.test_cli import run

FC1 = global_tensor("decoder/fc1", (8, 6), torch.float32)  # every bit pattern, NaNs included
EMB = global_tensor("embedding/word", (16, 4), torch.bfloat16)
STEPS = torch.tensor([2**53, 3, -(2**62)], dtype=torch.int64)


def checkpoint(path: Path, **changes: Any) -> Path:
    """Saves the reference state, with ``changes`` replacing (or, as None, removing)
    top-level entries; returns ``path``."""
    state: dict[str, Any] = {
        "fc1": FC1,
        "emb": EMB,
        "steps": STEPS,
        "rng": ShardedObject("rng_state", {"seed": torch.tensor([7, 8]), "pos": 3}, (1,), (0,)),
        "iteration": 1000,
        "args": argparse.Namespace(lr=0.1, layers=[4, 4], scale=torch.ones(2)),
        "loss_scale": float("nan"),
    }
    keys = {"fc1": "decoder/fc1", "emb": "embedding/word", "steps": "steps"}
    state.update(changes)
    sharded = {
        name: ShardedTensor.from_rank_offsets(keys.get(name, name), value) if isinstance(value, torch.Tensor) else value
        for name, value in state.items()
        if value is not None
    }
    save(sharded, path)
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return checkpoint(tmp_path_factory.mktemp("diff") / "reference")


def diff(reference: Path, other: Path) -> tuple[int, list[str]]:
    """Exit status and the output lines of ``shardstore diff``."""
    code, out, err = run("diff", str(reference), str(other))
    assert err == ""
    return code, out.splitlines()


def changed(value: torch.Tensor, index: tuple[int, ...], new: float | int) -> torch.Tensor:
    value = value.clone()
    value[index] = new
    return value


# ------------------------------------------------------------------ identical


def test_two_saves_of_the_same_state_are_identical(reference: Path, tmp_path: Path) -> None:
    """NaNs with equal bits (random float bits, a NaN in the common state) are equal."""
    assert diff(reference, checkpoint(tmp_path / "again")) == (0, ["identical"])
    assert diff_checkpoints(reference, tmp_path / "again").identical


def test_a_checkpoint_is_identical_to_itself(reference: Path) -> None:
    assert diff(reference, reference) == (0, ["identical"])


@pytest.mark.parametrize("source", [DCP, MEGATRON], ids=["dcp", "megatron-torch_dist"])
def test_another_tools_checkpoint_is_identical_to_its_conversion(tmp_path: Path, source: Path) -> None:
    """Its arrays, objects and common state, read as it is, equal the converted copy's."""
    from_other_format(source, tmp_path / "converted")
    assert diff(source, tmp_path / "converted") == (0, ["identical"])


# ------------------------------------------------------------------ arrays


def test_int64_values_that_differ_only_above_2_53_differ(reference: Path, tmp_path: Path) -> None:
    other = checkpoint(tmp_path / "other", steps=changed(STEPS, (0,), 2**53 + 1))  # equal in float64
    code, lines = diff(reference, other)
    assert code == 1
    assert "~ steps  max |difference| 1, 1 element(s) differ, first at [0]" in lines


def test_int64_differences_are_exact_in_full_range(tmp_path: Path) -> None:
    low = torch.tensor([-(2**63)], dtype=torch.int64)
    high = torch.tensor([2**63 - 1], dtype=torch.int64)
    save({"x": ShardedTensor.from_rank_offsets("x", low)}, tmp_path / "a")
    save({"x": ShardedTensor.from_rank_offsets("x", high)}, tmp_path / "b")
    (array,) = diff_checkpoints(tmp_path / "a", tmp_path / "b").arrays
    assert array.max_abs_diff == 2**64 - 1 and array.differing == 1


def test_one_changed_bfloat16_element_is_found(reference: Path, tmp_path: Path) -> None:
    other = checkpoint(tmp_path / "other", emb=changed(EMB, (5, 1), 1.0 if EMB[5, 1] != 1 else 2.0))
    code, lines = diff(reference, other)
    assert code == 1
    (line,) = [line for line in lines if line.startswith("~ embedding/word")]
    assert "1 element(s) differ, first at [5, 1]" in line


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_zero_whose_sign_changed_differs(tmp_path: Path, dtype: torch.dtype) -> None:
    """-0.0 == 0.0 in arithmetic, and float64 differences called it no difference."""
    zeros = torch.zeros(4, 4, dtype=dtype)
    save({"x": ShardedTensor.from_rank_offsets("x", zeros)}, tmp_path / "a")
    save({"x": ShardedTensor.from_rank_offsets("x", changed(zeros, (2, 3), -0.0))}, tmp_path / "b")
    code, lines = diff(tmp_path / "a", tmp_path / "b")
    assert code == 1
    assert "~ x  max |difference| 0, 1 element(s) differ, first at [2, 3]" in lines


def test_nans_with_other_bits_differ(tmp_path: Path) -> None:
    """Two NaNs of other payloads differ, and are no distance apart
    (``ArrayDifference.max_abs_diff`` 0.0, NaN only where a NaN meets a number): a NaN
    against a NaN of another payload gave NaN, as if a value had turned into NaN."""
    quiet = torch.full((3,), float("nan"))
    other = quiet.clone()
    other.view(torch.int32)[1] |= 1  # another NaN payload
    save({"x": ShardedTensor.from_rank_offsets("x", quiet)}, tmp_path / "a")
    save({"x": ShardedTensor.from_rank_offsets("x", other)}, tmp_path / "b")
    (array,) = diff_checkpoints(tmp_path / "a", tmp_path / "b").arrays
    assert array.differing == 1 and array.first_difference == (1,) and not array.identical
    assert array.max_abs_diff == 0.0


def test_values_of_an_exactly_wider_dtype_are_compared(reference: Path, tmp_path: Path) -> None:
    """bfloat16 -> float32 holds every value: equal values are only a dtype change."""
    other = checkpoint(tmp_path / "other", emb=EMB.float())
    code, lines = diff(reference, other)
    assert code == 1
    assert "~ embedding/word  dtype bfloat16 -> float32" in lines


def test_dtypes_that_hold_each_others_values_only_approximately_are_not_compared(
    reference: Path, tmp_path: Path
) -> None:
    other = checkpoint(tmp_path / "other", steps=STEPS.float())
    code, lines = diff(reference, other)
    assert code == 1
    assert (
        "~ steps  dtype int64 -> float32, values not compared (neither dtype holds the other's values exactly)"
        in lines
    )


def test_shape_and_key_differences_are_named(reference: Path, tmp_path: Path) -> None:
    other = checkpoint(tmp_path / "other", fc1=FC1[:4], emb=None, extra=torch.ones(2))
    code, lines = diff(reference, other)
    assert code == 1
    assert f"- embedding/word  (only in {reference})" in lines
    assert f"+ extra  (only in {other})" in lines
    assert "~ decoder/fc1  shape [8, 6] -> [4, 6]" in lines


# ------------------------------------------------------------------ sharded objects


def test_an_extra_object_differs(reference: Path, tmp_path: Path) -> None:
    other = checkpoint(tmp_path / "other", extra=ShardedObject("extra", [1, 2], (1,), (0,)))
    code, lines = diff(reference, other)
    assert code == 1
    assert f"+ object extra/shard_0_1  (only in {other})" in lines


def test_a_missing_object_differs(reference: Path, tmp_path: Path) -> None:
    other = checkpoint(tmp_path / "other", rng=None)
    code, lines = diff(reference, other)
    assert code == 1
    assert f"- object rng_state/shard_0_1  (only in {reference})" in lines


def test_a_changed_object_names_the_shard_and_the_path_inside(reference: Path, tmp_path: Path) -> None:
    rng = ShardedObject("rng_state", {"seed": torch.tensor([7, 9]), "pos": 3}, (1,), (0,))
    code, lines = diff(reference, checkpoint(tmp_path / "other", rng=rng))
    assert code == 1
    assert "~ object rng_state/shard_0_1/seed  max |difference| 1, 1 element(s) differ, first at [1]" in lines


def test_objects_saved_as_more_shards_differ(reference: Path, tmp_path: Path) -> None:
    rng = [ShardedObject("rng_state", {"seed": torch.tensor([7, 8]), "pos": 3}, (2,), (i,)) for i in range(2)]
    result = diff_checkpoints(reference, checkpoint(tmp_path / "other", rng=rng))
    assert {(d.path, d.change) for d in result.object_differences} == {
        ("rng_state/shard_0_1", "only in first"), ("rng_state/shard_0_2", "only in second"),
        ("rng_state/shard_1_2", "only in second"),
    }


# ------------------------------------------------------------------ common state


def test_a_changed_common_value_names_its_path_and_values(reference: Path, tmp_path: Path) -> None:
    args = argparse.Namespace(lr=0.2, layers=[4, 4], scale=torch.ones(2))
    code, lines = diff(reference, checkpoint(tmp_path / "other", args=args))
    assert code == 1
    assert "~ common state args/lr  0.1 -> 0.2" in lines


def test_a_common_tensor_compares_by_dtype_and_bits(reference: Path, tmp_path: Path) -> None:
    """Equal values in another dtype are a change of the common state."""
    args = argparse.Namespace(lr=0.1, layers=[4, 4], scale=torch.ones(2, dtype=torch.bfloat16))
    code, lines = diff(reference, checkpoint(tmp_path / "other", args=args))
    assert code == 1
    assert "~ common state args/scale  tensor torch.float32[2] -> torch.bfloat16[2]" in lines


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"iteration": 1000.0}, "~ common state iteration  int -> float"),  # 1000 == 1000.0
        ({"iteration": True}, "~ common state iteration  int -> bool"),
        ({"loss_scale": -float("nan")}, "~ common state loss_scale  nan -> nan (bits 7ff8000000000000 -> fff8000000000000)"),
    ],
)
def test_common_values_equal_under_eq_but_not_the_same_differ(
    reference: Path, tmp_path: Path, changes: dict[str, Any], expected: str
) -> None:
    code, lines = diff(reference, checkpoint(tmp_path / "other", **changes))
    assert code == 1
    assert expected in lines


@pytest.mark.parametrize("value", [np.float32("nan"), np.float16("nan"), np.complex64(complex("nan")), complex("nan")],
                         ids=repr)
def test_a_nan_number_of_numpy_or_complex_is_identical_to_itself(tmp_path: Path, value: Any) -> None:
    """A numpy scalar or a complex number compares by its bits, as a float and a tensor
    do. Before, ``==`` compared them: a checkpoint holding a NaN of numpy (a metric kept
    as ``np.float32``) or a complex NaN was "checkpoints differ" from itself (exit 1)."""
    path = checkpoint(tmp_path / "a", best_loss=value)
    assert diff(path, path) == (0, ["identical"])


@pytest.mark.parametrize("make", [np.float32, np.float64, complex], ids=["float32", "float64", "complex"])
def test_a_numpy_or_complex_zero_whose_sign_changed_differs(tmp_path: Path, make: Any) -> None:
    """-0.0 differs from 0.0 in a numpy scalar and a complex number too; before, ``==``
    called them equal."""
    code, lines = diff(checkpoint(tmp_path / "a", best_loss=make(0.0)), checkpoint(tmp_path / "b", best_loss=make(-0.0)))
    assert code == 1 and len(lines) == 2 and lines[0].startswith("~ common state best_loss  "), lines
    assert "(bits " in lines[0] or "-0" in lines[0], lines


def test_common_keys_on_one_side_only_are_named(reference: Path, tmp_path: Path) -> None:
    args = argparse.Namespace(lr=0.1, layers=[4, 4, 4], scale=torch.ones(2))
    code, lines = diff(reference, checkpoint(tmp_path / "other", args=args, iteration=None))
    assert code == 1
    assert f"- common state iteration  (only in {reference})" in lines
    assert f"+ common state args/layers/2  (only in {tmp_path / 'other'})" in lines


def test_a_sparse_tensor_in_the_common_state_is_compared_not_a_traceback(tmp_path: Path) -> None:
    """A sparse tensor is compared by its indices and values. Before, comparing it
    called ``reshape`` on it: a RuntimeError traceback, and exit status 1, which says
    "the checkpoints differ", also for a checkpoint against itself."""
    dense = torch.tensor([[0.0, 1.5, 0.0], [2.0, 0.0, 0.0]])
    first = checkpoint(tmp_path / "a", grads={"emb": dense.to_sparse()})  # nested: a top-level tensor is an array
    assert diff(first, first) == (0, ["identical"])
    code, lines = diff(first, checkpoint(tmp_path / "b", grads={"emb": changed(dense, (1, 0), 3.0).to_sparse()}))
    assert code == 1 and len(lines) == 2, lines
    assert lines[0] == "~ common state grads/emb  values: max |difference| 1, 1 element(s) differ, first at [1]"
    code, lines = diff(first, checkpoint(tmp_path / "c", grads={"emb": dense}))
    assert code == 1
    assert lines[0] == "~ common state grads/emb  tensor torch.float32[2, 3] (torch.sparse_coo) -> torch.float32[2, 3]"


@pytest.mark.parametrize("dtype", [torch.complex32, torch.float8_e4m3fnuz])
def test_a_common_tensor_of_a_dtype_arrays_do_not_hold_is_compared_by_its_bits(tmp_path: Path, dtype: torch.dtype) -> None:
    """A common-state tensor of a dtype no array holds (``complex32``, the ``fnuz``
    float8 types) is compared bit for bit, as any tensor. Before, it went to
    ``torch.equal``, which has no ``complex32`` kernel: a ``NotImplementedError``
    traceback, also for a checkpoint against itself."""
    values = torch.tensor([1.0, 2.0, 0.5])
    first = checkpoint(tmp_path / "a", extra={"t": values.to(dtype)})
    assert diff(first, first) == (0, ["identical"])
    code, lines = diff(first, checkpoint(tmp_path / "b", extra={"t": changed(values, (1,), 4.0).to(dtype)}))
    assert code == 1
    assert lines[0] == "~ common state extra/t  max |difference| 2, 1 element(s) differ, first at [1]", lines


# ------------------------------------------------------------------ --json


def test_json_names_every_difference_and_is_strict_json(reference: Path, tmp_path: Path) -> None:
    """NaN and infinite differences come as strings: the document parses as strict JSON."""
    other = checkpoint(
        tmp_path / "other",
        fc1=changed(FC1, (0, 0), float("inf") if not torch.isinf(FC1[0, 0]) else 0.0),
        rng=ShardedObject("rng_state", {"seed": torch.tensor([7, 8]), "pos": 4}, (1,), (0,)),
        iteration=1001,
    )
    code, out, _ = run("diff", "--json", str(reference), str(other))

    def refuse(constant: str) -> None:
        raise ValueError(f"not strict JSON: {constant}")

    report = json.loads(out, parse_constant=refuse)
    assert code == 1 and report["identical"] is False
    fc1 = {a["key"]: a for a in report["arrays"]}["decoder/fc1"]
    assert fc1["differing"] == 1 and fc1["first_difference"] == [0, 0]
    assert fc1["max_abs_diff"] in ("inf", "nan")  # inf - finite, or inf - NaN
    assert report["object_differences"] == [{"path": "rng_state/shard_0_1/pos", "change": "3 -> 4"}]
    assert report["common_differences"] == [{"path": "iteration", "change": "1000 -> 1001"}]


@pytest.mark.parametrize("value", [{float("nan"), 1.0}, {(float("nan"), 2), "a"}], ids=["set", "set-of-tuples"])
def test_a_set_holding_a_nan_is_identical_to_itself(tmp_path: Path, value: Any) -> None:
    """A set compared by ``==``: the NaN loaded on each side is another object, and
    NaN != NaN, so a set holding one was "checkpoints differ" from itself (exit 1). Its
    members are matched by their bits, as numbers are."""
    path = checkpoint(tmp_path / "a", tags=value)
    assert diff(path, path) == (0, ["identical"])


def test_sets_that_differ_in_a_nan_s_bits_or_a_member_differ(tmp_path: Path) -> None:
    other_nan = struct.unpack(">d", bytes.fromhex("7ff8000000000001"))[0]
    first = checkpoint(tmp_path / "a", tags={float("nan"), 1.0})
    assert diff(first, checkpoint(tmp_path / "b", tags={other_nan, 1.0}))[0] == 1
    assert diff(first, checkpoint(tmp_path / "c", tags={float("nan"), 2.0}))[0] == 1
    lookalike = ("float", struct.pack(">d", float("nan")).hex())  # a tuple shaped as a NaN's own key
    assert diff(first, checkpoint(tmp_path / "d", tags={lookalike, 1.0}))[0] == 1


def test_sets_of_frozensets_holding_a_nan_compare_by_their_members_bits() -> None:
    """``value_differences`` takes any values (an unsafe load's common state may hold
    frozensets): a frozenset member was compared by ``==``, so a NaN inside one made a
    set differ from its own copy."""
    from shardstore.tools.inspection import value_differences

    def value(member: int) -> set:  # a new NaN object each time, as each side's load makes
        return {frozenset({float("nan"), member}), "b"}

    assert list(value_differences(value(3), value(3))) == []
    assert len(list(value_differences(value(3), value(4)))) == 1
