"""ShardedTensor/ShardedObject semantics, dict helpers and prefix utilities (no I/O)."""

from __future__ import annotations

import pytest
import torch

from shardstore import CheckpointingException, ShardedObject, ShardedTensor
from shardstore.dict_utils import (
    dict_map,
    dict_map_with_key,
    diff,
    extract_matching_values,
    inspect_types,
    merge,
    nested_items_iter,
    nested_values,
)
from shardstore.mapping import fill_unknown_last_axes, is_main_replica
from shardstore.utils import (
    add_prefix_for_sharding,
    apply_prefix_mapping,
    replace_prefix_for_sharding,
    zip_strict,
)


def test_from_rank_offsets_computes_global_shape_and_offset() -> None:
    t = ShardedTensor.from_rank_offsets("k", torch.zeros(4, 6), (0, 1, 2), (1, 2, 3), replica_id=(0, 1))
    assert t.global_shape == (8, 18) and t.global_offset == (4, 12) and t.axis_fragmentations == (2, 3)
    assert t.global_slice() == (slice(4, 8), slice(12, 18))
    assert t.local_chunk_offset_in_global() == (1, 2) and t.max_allowed_chunks() == (4, 6)
    assert not is_main_replica(t.replica_id) and is_main_replica((0, 0)) and is_main_replica(0)


def test_prepended_axis_gives_integer_index() -> None:
    t = ShardedTensor.from_rank_offsets("k", torch.zeros(3), (0, 5, 8), prepend_axis_num=1)
    assert t.global_shape == (8, 3) and t.global_slice() == (5, slice(0, 3))


@pytest.mark.parametrize("offsets", [[(0, 2, 2)], [(3, 0, 1)], [(0, 0, 0)], [(0, 0, 2), (0, 1, 2)]])
def test_invalid_rank_offsets_are_rejected(offsets) -> None:
    """A CheckpointingException, as Megatron-Core raises; before, a ValueError that
    ``except CheckpointingException`` missed."""
    with pytest.raises(CheckpointingException, match="Invalid rank offsets"):
        ShardedTensor.from_rank_offsets("k", torch.zeros(2, 2), *offsets)


def test_flat_constructor_checks_range_against_data() -> None:
    t = ShardedTensor.from_rank_offsets_flat("k", torch.zeros(5), (3, 4), (0, 1, 2), flattened_range=slice(2, 7))
    assert t.local_shape == (3, 4) and t.global_shape == (6, 4) and t.flattened_range == slice(2, 7)
    with pytest.raises(CheckpointingException):
        ShardedTensor.from_rank_offsets_flat("k", torch.zeros(4), (3, 4), flattened_range=slice(2, 7))
    with pytest.raises(CheckpointingException):
        ShardedTensor.from_rank_offsets_flat("k", torch.zeros(5), (3, 4))


def test_dtype_and_shape_mismatch_with_data_is_rejected() -> None:
    with pytest.raises(CheckpointingException, match="dtype"):
        ShardedTensor("k", torch.zeros(2), torch.float64, (2,), (2,), (0,), None)
    with pytest.raises(CheckpointingException, match="shape"):
        ShardedTensor("k", torch.zeros(3), torch.float32, (2,), (2,), (0,), None)


def test_narrow_non_flat_and_flat() -> None:
    t = ShardedTensor.from_rank_offsets("k", torch.arange(12.0).reshape(4, 3), (0, 1, 2))
    (n,) = t.narrow(0, 1, 2)
    assert n.local_shape == (2, 3) and n.global_shape == (4, 3) and n.global_offset == (2, 0)
    assert torch.equal(n.data, torch.arange(3.0, 9.0).reshape(2, 3))
    flat = ShardedTensor.from_rank_offsets_flat("k", torch.arange(5.0), (3, 4), flattened_range=slice(5, 10))
    (f,) = flat.narrow(0, 1, 1)  # row 1 = flat [4, 8): overlap is [5, 8)
    assert f.flattened_range == slice(1, 4) and torch.equal(f.data, torch.arange(3.0))
    assert flat.narrow(0, 0, 1) == []  # row 0 = flat [0, 4): no overlap


def test_narrow_negative_dim_counts_from_last_local_axis() -> None:
    """``narrow(-1, ...)`` with a prepended axis used ``-1 + prepend_axis_num`` as the
    global axis (a prepended one) and built a garbage local shape: a confusing shape
    error with data, silently wrong metadata without data. Negative dims now count
    from the last local axis, as ``torch.narrow`` does; out-of-range dims are refused."""
    t = ShardedTensor.from_rank_offsets(
        "k", torch.arange(4.0).reshape(2, 2), (0, 0, 2), (2, 1, 2), prepend_axis_num=1
    )
    for st in (t, t.without_data()):
        (neg,) = st.narrow(-1, 0, 1)
        (pos,) = st.narrow(1, 0, 1)
        assert (neg.local_shape, neg.global_shape, neg.global_offset) == ((2, 1), (2, 2, 2), (0, 0, 1))
        assert (neg.local_shape, neg.global_shape, neg.global_offset) == (
            pos.local_shape, pos.global_shape, pos.global_offset
        )
    assert torch.equal(t.narrow(-1, 0, 1)[0].data, torch.tensor([[0.0], [2.0]]))
    with pytest.raises(CheckpointingException, match="cannot narrow axis 2"):
        t.narrow(2, 0, 1)


def test_init_data_allocates_flat_view() -> None:
    t = ShardedTensor.from_rank_offsets_flat("k", torch.zeros(5), (3, 4), flattened_range=slice(2, 7)).without_data()
    t.init_data("cpu")
    assert t.data.shape == (5,)


def test_sharded_object_unique_key_round_trips() -> None:
    o = ShardedObject("opt/state", 1, (2, 3), (1, 2))
    assert o.unique_key == "opt/state/shard_1.2_2.3"
    back = ShardedObject.empty_from_unique_key(o.unique_key)
    assert (back.key, back.global_shape, back.global_offset, back.data) == ("opt/state", (2, 3), (1, 2), None)
    with pytest.raises(CheckpointingException, match="Malformed"):
        ShardedObject.empty_from_unique_key("opt/state/piece_1_2")


def test_dict_helpers() -> None:
    x = {"a": [1, {"b": 2.0}], "c": "s"}
    match, rest = extract_matching_values(x, lambda v: isinstance(v, float))
    assert match == {"a": [{"b": 2.0}]} and rest == {"a": [1], "c": "s"}
    assert list(nested_values(x)) == [1, 2.0, "s"]
    assert merge({"a": {"b": 1}}, {"a": {"c": 2}}) == {"a": {"b": 1, "c": 2}}
    with pytest.raises(ValueError, match="Duplicate"):
        merge({"a": 1}, {"a": 2})
    only_left, only_right, mismatch = diff({"a": torch.ones(2), "b": 1}, {"a": torch.zeros(2), "c": 1})
    assert only_left == [("b",)] and only_right == [("c",)] and mismatch[0][0] == ("a",)


def test_old_object_key_lacks_the_last_axis_of_the_shape() -> None:
    """As in Megatron-Core, an old unique key (one shape axis fewer than the offset)
    lacks the LAST axis: -1 until ``fill_unknown_last_axes`` sets it to the largest last
    offset plus one. Before, shardstore prepended a leading 1, so ``shard_1.0_2`` was
    refused (offset (1, 0) outside shape (1, 2)) and other old keys got wrong shapes."""
    old = [ShardedObject.empty_from_unique_key(f"optimizer/shard_1.{i}_2") for i in range(3)]
    assert old[0].global_offset == (1, 0) and old[0].global_shape == (2, -1)
    new = ShardedObject.empty_from_unique_key("rng/shard_0_2")
    fill_unknown_last_axes([*old, new])
    assert [o.global_shape for o in old] == [(2, 3)] * 3 and new.global_shape == (2,)
    assert old[2].unique_key == "optimizer/shard_1.2_2.3"


def test_nested_items_iter_yields_container_key_value() -> None:
    """Megatron-Core's meaning: ``(container, key, leaf)``, so ``container[key] = ...``
    replaces the leaf. Before, shardstore yielded ``(key, leaf)`` only."""
    sd = {"a": {"b": 1}, "l": [2, 3]}
    assert list(nested_items_iter(sd)) == [(sd["a"], "b", 1), (sd["l"], 0, 2), (sd["l"], 1, 3)]


def test_dict_map_maps_every_element_of_nested_lists() -> None:
    """As Megatron-Core's (built on ``nested_items_iter``), ``dict_map`` maps each list
    element; before, a list was one leaf and ``f`` got the whole list."""
    sd = {"a": [1, 2], "b": {"c": [3]}}
    dict_map(lambda v: v * 10, sd)
    assert sd == {"a": [10, 20], "b": {"c": [30]}}


def test_dict_map_with_key_passes_the_list_index_as_key() -> None:
    """A list element's key is its index (Megatron-Core's meaning); before, ``f`` got
    the dict key and the whole list."""
    sd = {"a": [1, 2], "b": {"c": 3}}
    dict_map_with_key(lambda k, v: (k, v), sd)
    assert sd == {"a": [(0, 1), (1, 2)], "b": {"c": ("c", 3)}}


def test_inspect_types_prints_the_tree(capsys: pytest.CaptureFixture[str]) -> None:
    """Megatron-Core's ``inspect_types`` prints the tree; before, shardstore's only
    returned it, so ``inspect_types(sd)`` showed nothing. It still returns the text."""
    text = inspect_types({"a": torch.zeros(2), "b": [1]})
    assert capsys.readouterr().out == text + "\n"
    assert text.splitlines() == ["a: Tensor of shape (2,) and dtype torch.float32", "b:", "    [0]: int"]


def test_prefix_helpers() -> None:
    sd = {"x": ShardedTensor.from_rank_offsets("layer.w", torch.zeros(1)), "y": ShardedObject("layer.o", 1, (1,), (0,))}
    add_prefix_for_sharding(sd, "model.")
    assert sd["x"].key == "model.layer.w" and sd["y"].key == "model.layer.o"
    replace_prefix_for_sharding(sd, "model.", "m/")
    assert sd["x"].key == "m/layer.w"
    with pytest.raises(ValueError, match="prefix"):
        replace_prefix_for_sharding(sd, "nope", "")
    apply_prefix_mapping(sd, {"m/layer.o": "obj", "m/": "t/"})
    assert (sd["x"].key, sd["y"].key) == ("t/layer.w", "obj")


def test_zip_strict_names_the_lengths() -> None:
    assert list(zip_strict([1, 2], "ab")) == [(1, "a"), (2, "b")]
    with pytest.raises(ValueError, match=r"\[2, 3\]"):
        zip_strict([1, 2], [1, 2, 3])


def test_replica_ids_computed_with_numpy_or_torch_integers_are_replica_ids(tmp_path) -> None:
    """A replica id computed with numpy (``np.int64(rank // tp)``) or torch (``rank %
    torch.tensor(2)``) is an integer, not an iterable of them: ``is_main_replica``
    iterated it, and a save failed with "Checking the state dict failed: TypeError:
    'numpy.int64' object is not iterable", naming no key."""
    import numpy as np

    from shardstore import load, save

    assert is_main_replica(np.int64(0)) and not is_main_replica(np.int32(1))
    assert is_main_replica(torch.tensor(0)) and not is_main_replica(torch.tensor(3))
    assert is_main_replica((np.int64(0), 0)) and not is_main_replica((0, torch.tensor(1)))
    data = torch.arange(4.0)
    save({"main": ShardedTensor.from_rank_offsets("w", data, replica_id=np.int64(0)),
          "copy": ShardedTensor.from_rank_offsets("w", data.clone(), replica_id=torch.tensor(1))}, tmp_path / "c")
    loaded = load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4))}, tmp_path / "c")
    assert torch.equal(loaded["w"], data)


def test_object_offsets_computed_with_numpy_or_torch_integers_name_the_shard_as_integers() -> None:
    """A shard's file is named after its offset and shape (``unique_key``). Before, a
    torch integer made ``rng/shard_tensor(1)_tensor(2)``, which the save then failed to
    read back ("Malformed sharded object key"); a bool made ``shard_True_...``; a float
    offset made ``rng/shard_1.0_2``, read back as a 2-D shard, so a load asking for
    offset (1,) did not find it."""
    import numpy as np

    for offset, shape in [((torch.tensor(1),), (torch.tensor(2),)), ((np.int64(1),), (np.int32(2),)),
                          ((True,), (2,))]:
        obj = ShardedObject("rng", None, shape, offset)
        assert obj.unique_key == "rng/shard_1_2" and type(obj.global_offset[0]) is int
    with pytest.raises(CheckpointingException, match=r"ShardedObject 'rng'.*offset \(1\.0,\).*not an integer"):
        ShardedObject("rng", None, (2,), (1.0,))
