"""ShardedObjects, the common state, LocalNonpersistentObject and ShardedTensorFactory
round-trip (issue 3, point 5)."""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import numpy as np
import pytest
import torch

from shardstore import (
    CheckpointingException,
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    load,
    load_common_state_dict,
    save,
)
from shardstore.format.records import read_commit_record
from shardstore.format.records.encoding import FILE_DIGESTS
from shardstore.stores.locations import open_location
from shardstore.strategies.common import TorchCommonLoadStrategy
from tests.dist import run_distributed
from tests.scenarios import assert_bits_equal, global_tensor, rewrite_record

QKV = global_tensor("attn/qkv", (12, 4), torch.float32)


def _qkv_factory(rank: int, world: int, data: torch.Tensor) -> ShardedTensorFactory:
    """Stores a fused QKV (split over ranks on axis 0) as separate q and kv tensors."""

    def build(key, t, replica_id, flattened_range):
        q, kv = t[: t.shape[0] // 3], t[t.shape[0] // 3 :]
        return {
            "q": ShardedTensor.from_rank_offsets(f"{key}/q", q, (0, rank, world), replica_id=replica_id),
            "kv": ShardedTensor.from_rank_offsets(f"{key}/kv", kv, (0, rank, world), replica_id=replica_id),
        }

    def merge(sub):
        return torch.cat([sub["q"], sub["kv"]])

    return ShardedTensorFactory("attn/qkv", data, build, merge)


def _local_qkv(rank: int, world: int) -> torch.Tensor:
    return QKV.chunk(world, 0)[rank].clone()


def save_objects(rank: int, world: int, ckpt: str) -> None:
    rng = np.random.RandomState(rank).get_state()
    sd = {
        "step": 1234,
        "args": argparse.Namespace(lr=0.1, layers=2),
        "rng": ShardedObject("rng_state", {"np": rng, "torch": torch.tensor([rank])}, (world,), (rank,)),
        "shared": ShardedObject("shared_object", {"epoch": 7}, (1,), (0,), replica_id=rank),
        "qkv": _qkv_factory(rank, world, _local_qkv(rank, world)),
        "cache": LocalNonpersistentObject("never saved"),
    }
    save(sd, ckpt)


def load_objects(rank: int, world: int, ckpt: str) -> None:
    sd = {
        "rng": ShardedObject("rng_state", None, (world,), (rank,)),
        "shared": ShardedObject("shared_object", None, (1,), (0,), replica_id=rank),
        "qkv": _qkv_factory(rank, world, torch.empty_like(_local_qkv(rank, world))),
        "cache": LocalNonpersistentObject(f"local {rank}"),
    }
    loaded = load(sd, ckpt)
    assert loaded["step"] == 1234
    assert loaded["args"] == argparse.Namespace(lr=0.1, layers=2)
    assert loaded["cache"] == f"local {rank}"
    assert loaded["shared"] == {"epoch": 7}
    expected_rng = np.random.RandomState(rank).get_state()
    assert loaded["rng"]["np"][0] == expected_rng[0] and np.array_equal(loaded["rng"]["np"][1], expected_rng[1])
    assert torch.equal(loaded["rng"]["torch"], torch.tensor([rank]))
    assert_bits_equal(loaded["qkv"], _local_qkv(rank, world), "merged qkv")


def test_objects_common_nonpersistent_and_factories_round_trip(ckpt_dir: Path) -> None:
    run_distributed(save_objects, 2, str(ckpt_dir))
    run_distributed(load_objects, 2, str(ckpt_dir))
    common = load_common_state_dict(ckpt_dir)
    assert common["step"] == 1234 and "cache" not in common
    # the factory stored two separate global arrays (small ones: packed, no directory of their own)
    arrays = read_commit_record(open_location(ckpt_dir)).arrays
    assert {"attn/qkv/q", "attn/qkv/kv"} <= arrays.keys() and "attn/qkv" not in arrays


def test_factory_result_reshards_to_one_rank(ckpt_dir: Path) -> None:
    run_distributed(save_objects, 2, str(ckpt_dir))
    q = ShardedTensor.from_rank_offsets("attn/qkv/q", torch.empty(4, 4))
    loaded = load({"q": q}, ckpt_dir, validate_access_integrity=False)
    assert_bits_equal(loaded["q"], torch.cat([c[: c.shape[0] // 3] for c in QKV.chunk(2, 0)]), "q")


class Gadget:
    """Not on the safe-load allow-list: unpickling it means running this module's code."""

    def __init__(self) -> None:
        self.armed = True


def test_common_state_with_arbitrary_objects_needs_explicit_opt_in(ckpt_dir: Path) -> None:
    save({"gadget": Gadget()}, ckpt_dir)
    with pytest.raises(CheckpointingException, match="allow_unsafe_pickle=True"):
        load({}, ckpt_dir)
    loaded = load({}, ckpt_dir, common_strategy=TorchCommonLoadStrategy(allow_unsafe_pickle=True))
    assert isinstance(loaded["gadget"], Gadget)


def test_a_sharded_object_holding_bytesio_loads_after_the_documented_opt_in(ckpt_dir: Path) -> None:
    """Megatron-Core's tests keep a ``torch.save``d state in a ShardedObject as an
    ``io.BytesIO``: refused by the safe default, naming the key and both ways to admit it;
    admitted by torch's own ``add_safe_globals``, or by ``allow_unsafe_pickle``."""
    payload = io.BytesIO()
    torch.save({"some": "dict"}, payload)
    save({"blob": ShardedObject("sh_obj_A", payload, (1,), (0,))}, ckpt_dir)

    def request() -> dict:
        return {"other": ShardedObject("sh_obj_A", io.BytesIO(), (1,), (0,))}

    # importing megatron.core (another test in this process may have) admits io.BytesIO
    # for the whole process: start from torch's own safe set
    before = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        with pytest.raises(CheckpointingException) as refused:
            load(request(), ckpt_dir)
        message = str(refused.value)
        assert "ShardedObject 'sh_obj_A'" in message, message
        assert "torch.serialization.add_safe_globals([io.BytesIO])" in message, message
        assert "TorchCommonLoadStrategy(allow_unsafe_pickle=True)" in message, message

        torch.serialization.add_safe_globals([io.BytesIO])
        loaded = load(request(), ckpt_dir)["other"]
        assert isinstance(loaded, io.BytesIO) and loaded.getvalue() == payload.getvalue()
        loaded.seek(0)
        assert torch.load(loaded, weights_only=True) == {"some": "dict"}

        torch.serialization.clear_safe_globals()
        trusted = load(request(), ckpt_dir, common_strategy=TorchCommonLoadStrategy(allow_unsafe_pickle=True))
        assert trusted["other"].getvalue() == payload.getvalue()
        with pytest.raises(CheckpointingException, match="io.BytesIO"):  # neither opt-in outlived its use
            load(request(), ckpt_dir)
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


def test_empty_containers_in_the_common_state_survive_a_round_trip(ckpt_dir: Path) -> None:
    """An optimizer's empty ``state``, an empty list, ``content_metadata={}``: kept, as
    Megatron-Core keeps them (they were dropped by the split of the state dict)."""
    from shardstore import load_common_state_dict, load_content_metadata

    state = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(2)),
             "optimizer": {"state": {}, "param_groups": [{"params": []}]}, "empty": []}
    save(state, ckpt_dir, content_metadata={})
    common = load_common_state_dict(ckpt_dir)
    assert common["optimizer"] == {"state": {}, "param_groups": [{"params": []}]} and common["empty"] == []
    assert load_content_metadata(ckpt_dir) == {}


def _save_with_dp_cp_group(rank: int, world: int, ckpt: str) -> tuple[dict, bool]:
    import torch.distributed as dist

    from shardstore import load_content_metadata

    metadata = {"dp_cp_group": dist.group.WORLD, "distrib_optim_sharding_type": "fully_sharded_model_space"}
    save({"a": ShardedTensor.from_rank_offsets("a", torch.arange(4.0))}, ckpt, content_metadata=metadata)
    return load_content_metadata(ckpt), "dp_cp_group" in metadata


def test_content_metadata_is_saved_without_its_process_group(ckpt_dir: Path) -> None:
    """As Megatron-Core 0.16's save_preprocess (``_clean_metadata_for_serialization``),
    the ``dp_cp_group`` of Megatron-LM's content metadata is left out of the common
    state; the caller's dict keeps it. Before, the save failed: "cannot pickle
    'torch._C._distributed_c10d.ProcessGroup' object"."""
    [(metadata, caller_kept_group)] = run_distributed(_save_with_dp_cp_group, 1, str(ckpt_dir))
    assert metadata == {"distrib_optim_sharding_type": "fully_sharded_model_space"} and caller_kept_group


def test_a_mixed_list_keeps_its_places_in_the_common_state(ckpt_dir: Path) -> None:
    """Documented in docs/differences.md: Megatron-Core's common state keeps ``[5]`` of
    this list; shardstore keeps ``[None, 5, None]`` so that a load puts each value back
    at its own index."""
    save({"a": [ShardedTensor.from_rank_offsets("t", torch.ones(2)), 5, LocalNonpersistentObject(1)]}, ckpt_dir)
    assert load_common_state_dict(ckpt_dir) == {"a": [None, 5, None]}
    loaded = load({"a": [ShardedTensor.from_rank_offsets("t", torch.zeros(2)), 5, LocalNonpersistentObject(7)]},
                  ckpt_dir)
    assert torch.equal(loaded["a"][0], torch.ones(2)) and loaded["a"][1:] == [5, 7]


def test_an_object_shard_stored_under_its_old_key_loads(ckpt_dir: Path) -> None:
    """A shard of an old Megatron-Core checkpoint is stored under a key without the
    shape's last axis (``ShardedObject.old_unique_key``); a load asking by today's key
    reads it there, as Megatron's loads do. Before, the load said the shard was missing.
    The record lists the shard by the key it is stored under, as a checkpoint converted
    from such a one does (a shard file the record does not list is refused)."""
    from shardstore.format.records import object_path

    obj = ShardedObject("optimizer/state", {"lr": 0.5}, (1, 1), (0, 0))
    save({"o": obj}, ckpt_dir)
    new, old = ckpt_dir / object_path(obj.unique_key), ckpt_dir / object_path(obj.old_unique_key)
    assert obj.old_unique_key == "optimizer/state/shard_0.0_1"
    old.parent.mkdir(parents=True, exist_ok=True)
    new.rename(old)

    def list_the_old_key(root: dict) -> None:
        record = root["attributes"]["shardstore"]
        record["objects"]["optimizer/state"] = [obj.old_unique_key]
        for field in ("files", FILE_DIGESTS):
            record[field][object_path(obj.old_unique_key)] = record[field].pop(object_path(obj.unique_key))

    rewrite_record(ckpt_dir, list_the_old_key)
    request = {"o": ShardedObject("optimizer/state", None, (1, 1), (0, 0))}
    assert TorchCommonLoadStrategy().load_sharded_objects(request, ckpt_dir) == {"o": {"lr": 0.5}}


def test_asking_for_an_object_as_a_tensor_says_it_is_an_object(ckpt_dir: Path) -> None:
    """A key saved as a ShardedObject and asked for as a ShardedTensor: the error says it
    is an object and how to ask for it. Before, it said the checkpoint had no such
    tensor and advised ``strict='log_unexpected'``, which would silently skip it."""
    save({"o": ShardedObject("rng", torch.arange(3), (1,), (0,))}, ckpt_dir)
    with pytest.raises(CheckpointingException, match=r"holds \['rng'\] as ShardedObject.*same key") as err:
        load({"o": ShardedTensor.from_rank_offsets("rng", torch.empty(3))}, ckpt_dir)
    assert "log_unexpected" not in str(err.value)


@pytest.mark.parametrize(("state", "named"), [
    ({"scheduler": {"lr_lambda": lambda step: 1.0}}, "common state entry ['scheduler']['lr_lambda']"),
    ({"loop": [1, {"lock": __import__("threading").Lock()}]}, "common state entry ['loop'][1]['lock']"),
    ({"rng": ShardedObject("rng", lambda: 0, (1,), (0,))}, "ShardedObject 'rng'"),
], ids=["lambda", "lock", "object"])
def test_a_value_that_cannot_be_pickled_is_named_in_the_error(tmp_path: Path, state: dict, named: str) -> None:
    """Before, the error said only "Saving the common state and sharded objects to ...:
    PicklingError: Can't pickle <function <lambda> ...>" (or "cannot pickle
    '_thread.lock' object"): which of a trainer's hundreds of values it was, it did not
    say."""
    ckpt = tmp_path / "c"
    with pytest.raises(CheckpointingException) as failure:
        save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2)), **state}, ckpt)
    message = str(failure.value)
    assert named in message and str(ckpt) in message, message
    assert not ckpt.exists() or not any(ckpt.iterdir())


def _factory_of_a_factory(data: torch.Tensor) -> ShardedTensorFactory:
    """A factory whose build returns another factory (beside a ShardedTensor)."""

    def inner_build(key, t, replica_id, flattened_range):
        return {"half": ShardedTensor.from_rank_offsets(f"{key}/half", t * 0.5)}

    def build(key, t, replica_id, flattened_range):
        return {"same": ShardedTensor.from_rank_offsets(f"{key}/same", t),
                "inner": ShardedTensorFactory(f"{key}/inner", t, inner_build, lambda sub: sub["half"] * 2)}

    return ShardedTensorFactory("outer", data, build, lambda sub: sub["same"])


@pytest.mark.parametrize("operation", ["save", "load"])
def test_a_factory_built_by_a_factory_is_refused_naming_both(ckpt_dir: Path, operation: str) -> None:
    """Factories are built once (as in Megatron-Core's ``apply_factories``). Before, the
    inner factory was neither built nor refused: the save wrote nothing for it (a
    committed checkpoint without ``outer/inner/half``), and a load returned the
    ShardedTensorFactory object itself as the loaded value."""
    if operation == "load":
        save({"f": ShardedTensor.from_rank_offsets("outer/same", torch.ones(2))}, ckpt_dir)
    with pytest.raises(CheckpointingException, match=r"'outer'.*'outer/inner'.*\['f'\]\['inner'\]"):
        if operation == "save":
            save({"f": _factory_of_a_factory(torch.ones(2))}, ckpt_dir)
        else:
            load({"f": _factory_of_a_factory(torch.zeros(2))}, ckpt_dir)
    if operation == "save":
        assert not ckpt_dir.exists() or not any(ckpt_dir.iterdir())


def test_a_shard_of_a_zero_dimensional_object_is_listed_by_the_metadata_query(ckpt_dir: Path) -> None:
    """A ShardedObject of global shape ``()`` is stored as ``<key>/shard__``: save and load
    accepted it, but ``load_sharded_metadata`` (and every tool listing a checkpoint's
    objects) failed with "Malformed sharded object key 'scalar/shard__': invalid
    literal for int() with base 10: ''"."""
    from shardstore import load_sharded_metadata

    save({"o": ShardedObject("scalar", {"v": 1}, (), ())}, ckpt_dir)
    listed = load_sharded_metadata(ckpt_dir)["scalar/shard__"]
    assert (listed.key, listed.global_shape, listed.global_offset) == ("scalar", (), ())
    assert load({"o": ShardedObject("scalar", None, (), ())}, ckpt_dir) == {"o": {"v": 1}}


def test_a_sharded_tensor_inside_a_tuple_is_refused_saying_to_use_a_list(ckpt_dir: Path) -> None:
    """Tuples are plain values (Megatron-Core's walks do not enter them either), so a
    ShardedTensor inside one would be pickled whole. Before, the refusal said "sharded
    objects that shardstore does not handle ... Use shardstore's ShardedTensor", of
    shardstore's own ShardedTensor: advice the caller had already followed."""
    layers = (ShardedTensor.from_rank_offsets("l0", torch.ones(2)), ShardedTensor.from_rank_offsets("l1", torch.ones(2)))
    with pytest.raises(CheckpointingException, match=r"/layers\[0\].*tuple.*list") as refused:
        save({"layers": layers}, ckpt_dir)
    assert "does not handle" not in str(refused.value)


def test_a_list_as_the_whole_state_dict_is_refused_before_anything_is_written(ckpt_dir: Path) -> None:
    """A load reads the common state as a dict (Megatron-Core's state dicts are dicts).
    Before, ``save([ShardedTensor, 5], ...)`` committed a checkpoint whose every load
    failed with "common.pt holds a list, expected a dict"."""
    with pytest.raises(CheckpointingException, match=r"state dict.*is a list.*dict"):
        save([ShardedTensor.from_rank_offsets("x", torch.ones(2)), 5], ckpt_dir)
    assert not ckpt_dir.exists() or not any(ckpt_dir.iterdir())


def test_objects_saved_in_megatrons_order_through_the_seeds_strategies_load(tmp_path: Path) -> None:
    """Megatron-Core's ``save`` order through the seed's strategies: the common state and
    the ShardedObjects (``TorchCommonSaveStrategy.save_sharded_objects``, under
    ``__objects__``) into the caller's directory, then the sharded save, committed in
    place. Before, the commit left the object files out of its record (their
    ``__objects__`` path is no key a caller may use): the checkpoint verified as damaged,
    ``load_sharded_metadata`` did not list the objects and ``load`` refused to read them,
    "not vouched for by the commit record"."""
    from shardstore import load_sharded_metadata, verify
    from shardstore.core import CheckpointingConfig, save_config
    from shardstore.strategies.common import TorchCommonSaveStrategy
    from shardstore.strategies.zarr import SHARDSTORE_BACKEND, ZARR_VERSION, ZarrSaveShardedStrategy

    ckpt = tmp_path / "megatron_order"
    ckpt.mkdir()
    common = TorchCommonSaveStrategy()
    common.save_common({"step": 7}, ckpt)
    common.save_sharded_objects({"rng": [ShardedObject("rng_state", {"seed": r}, (2,), (r,)) for r in range(2)]}, ckpt)
    ZarrSaveShardedStrategy().save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2, 3))}, ckpt)
    save_config(CheckpointingConfig(SHARDSTORE_BACKEND, ZARR_VERSION, "torch", 1), ckpt)

    report = verify(ckpt)
    assert report.ok, [p.message for p in report.problems]
    assert {"rng_state/shard_0_2", "rng_state/shard_1_2"} <= set(load_sharded_metadata(ckpt))
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(2, 3)),
               "rng": [ShardedObject("rng_state", None, (2,), (r,)) for r in range(2)]}
    loaded = load(request, ckpt)
    assert loaded["rng"] == [{"seed": 0}, {"seed": 1}] and loaded["step"] == 7
    assert_bits_equal(loaded["w"], torch.ones(2, 3))
