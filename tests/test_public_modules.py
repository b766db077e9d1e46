"""The module names users import, and exactly the names each offers.

Megatron-Core's users import ``shardstore.mapping``, ``shardstore.serialization``,
``shardstore.strategies.zarr`` and the other module names of its ``dist_checkpointing``;
the README and guides add ``shardstore.megatron`` and ``shardstore.tools.megatron_strategy``.
Their names live in ``shardstore.compat.megatron`` (over ``shardstore.engine``); each such name is a
plain module that re-exports its home's names (the same objects), which type checkers and
IDEs read as they read any module. ``PUBLIC_NAMES`` freezes what each offers: a name added
to or dropped from one is a change of the public API, made here on purpose.
``SEED_API`` holds the classes and functions the seed API documents name
(``shared/seeds/*.txt``, beside the repository); each must be offered by its module.
"""

from __future__ import annotations

import ast
import importlib
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

import shardstore

PACKAGE = Path(shardstore.__file__).parent
REPO = PACKAGE.parent

# module users import -> its home, whose objects it re-exports (None: the module is its own home)
HOMES: dict[str, str | None] = {
    "shardstore.mapping": None,
    "shardstore.dict_utils": None,
    "shardstore.utils": None,
    "shardstore.serialization": "shardstore.compat.megatron.serialization",
    "shardstore.core": "shardstore.compat.megatron.core",
    "shardstore.validation": "shardstore.compat.megatron.validation",
    "shardstore.exchange_utils": "shardstore.compat.megatron.exchange_utils",
    "shardstore.megatron": "shardstore.compat.megatron.entry_points",
    "shardstore.tools.megatron_strategy": "shardstore.compat.megatron.strategy",
    # the engine's strategies under Megatron-Core's module names; the rest are Megatron-Core's alone
    "shardstore.strategies.async_utils": "shardstore.engine.async_requests",
    "shardstore.strategies.base": "shardstore.engine.strategies",
    "shardstore.strategies.common": "shardstore.engine.common_state",
    "shardstore.strategies.zarr": "shardstore.engine.zarr_strategies",
    **{f"shardstore.strategies.{m}": f"shardstore.compat.megatron.strategies.{m}" for m in (
        "checkpointable", "fully_parallel", "resharding", "torch")},
}

PUBLIC_NAMES: dict[str, list[str]] = {
    "shardstore.mapping": [
        "CommonStateDict", "FactoryBuildFn", "FactoryMergeFn", "LocalNonpersistentObject", "MeshReplicaId",
        "ReplicaId", "ShardedBase", "ShardedObject", "ShardedStateDict", "ShardedTensor",
        "ShardedTensorFactory", "StateDict", "apply_factories", "apply_factory_merges", "as_integers",
        "fill_unknown_last_axes", "is_main_replica", "unstorable_reason",
    ],
    "shardstore.dict_utils": [
        "Leaf", "dict_list_map_inplace", "dict_list_map_outplace", "dict_map", "dict_map_with_key", "diff",
        "extract_matching_values", "flatten", "inspect_types", "map_reduce", "merge", "nest",
        "nested_items_iter", "nested_values", "with_list_places",
    ],
    "shardstore.utils": [
        "add_prefix_for_sharding", "apply_prefix_mapping", "debug_msg", "debug_time",
        "extract_nonpersistent", "extract_sharded_base", "extract_sharded_tensors",
        "extract_sharded_tensors_and_factories", "extract_sharded_tensors_or_nonpersistent",
        "fallback_logger", "force_all_tensors_to_non_fp8", "holds_sharded_class", "local_sharded_items",
        "logger_stack", "replace_prefix_for_sharding", "sharded_tensor_slots", "sharded_values_in_common",
        "zip_strict",
    ],
    "shardstore.serialization": [
        "get_default_load_sharded_strategy", "get_default_save_common_strategy",
        "get_default_save_sharded_strategy", "load", "load_common_state_dict", "load_content_metadata",
        "load_plain_tensors", "load_preprocess", "load_sharded_metadata", "load_tensors_metadata",
        "remove_sharded_tensors", "save", "verify_before_load", "verify_checkpoint_and_load_strategy",
    ],
    "shardstore.core": [
        "CONFIG_FNAME", "CheckpointingConfig", "CheckpointingException", "SaveOptions",
        "check_is_distributed_checkpoint", "gc_paused", "maybe_load_config", "save_config",
    ],
    "shardstore.validation": [
        "StrictHandling", "adjust_non_strict_load", "determine_global_metadata",
        "maybe_report_missing_and_unexpected_keys", "parse_strict_flag", "plan_load", "reported_mismatches",
        "validate_common_state_dict", "validate_sharded_objects_handling", "validate_sharding_integrity",
    ],
    "shardstore.exchange_utils": [
        "EXCHANGE_ALGOS", "ShardDistribution", "build_shard_distribution",
        "determine_main_replica_uniform_distribution", "distribute_shards_to_ranks",
        "exchange_by_distribution", "exchange_loaded_objects_gather_object",
        "prepare_exchange_by_distribution",
    ],
    "shardstore.megatron": [
        "ENTRY_POINTS", "check_is_distributed_checkpoint", "install", "is_installed", "load",
        "load_content_metadata_entry", "previous_checkpoint", "save", "strategy_for_save", "uninstall",
    ],
    "shardstore.tools.megatron_strategy": [
        "ShardstoreLoadShardedStrategy", "ShardstoreSaveShardedStrategy",
    ],
    "shardstore.strategies.async_utils": [
        "AsyncCallsQueue", "AsyncRequest", "Finalization", "IO_PRIORITIES",
    ],
    "shardstore.strategies.base": [
        "AsyncCallsQueue", "AsyncRequest", "AsyncSaveShardedStrategy", "CheckpointDir",
        "DelegatingLoadStrategy", "LoadCommonStrategy", "LoadShardedStrategy", "LoadStrategyBase",
        "SaveCommonStrategy", "SaveShardedStrategy", "SaveStrategyBase", "StrategyAction",
        "agree_before_save", "async_calls", "default_strategies", "get_default_strategy",
        "plan_load_with_record", "register_default_strategy", "require_committed", "strategy_by_name",
        "validate_sharded_objects_handling",
    ],
    "shardstore.strategies.checkpointable": [
        "CheckpointableShardedTensor", "LocalShardsContainer", "to_dcp_state_dict",
    ],
    "shardstore.strategies.common": [
        "COMMON_BACKEND", "COMMON_VERSION", "TorchCommonLoadStrategy", "TorchCommonSaveStrategy",
        "register_default_common_strategies",
    ],
    "shardstore.strategies.fully_parallel": [
        "FullyParallelLoadStrategyWrapper", "FullyParallelSaveStrategyWrapper", "_sharded_tensor_shard_id",
        "distribute_main_replicas_with_precomputed_distribution",
    ],
    "shardstore.strategies.resharding": [
        "ReformulationRestoreMetadata", "TensorReformulationMetadata",
        "apply_nd_flattened_tensors_reformulation", "get_reformulation_metadata", "is_nd_flattened_tensor",
        "nd_flattened_tensor_reformulated_global_shape", "reformulate_single_nd_flattened_tensor",
        "restore_nd_flattened_tensors_formulation",
    ],
    "shardstore.strategies.torch": [
        "TorchDistLoadShardedStrategy", "TorchDistSaveShardedStrategy", "get_reformulation_metadata",
        "register_default_torch_dist_save_strategy",
    ],
    "shardstore.strategies.zarr": [
        "AUTO_SHARD_MIN_RANKS", "DEFAULT_MAX_CHUNK_BYTES", "DEFAULT_SHARD_BYTES",
        "DEFAULT_SYNC_STAGING_BYTES", "SHARDSTORE_BACKEND", "ShardBytes", "ZARR_VERSION",
        "ZarrLoadShardedStrategy", "ZarrSaveShardedStrategy", "_create_or_open_zarr_arrays",
        "_create_zarr_array", "_load_from_array", "_open_zarr_array_verbose", "_save_to_existing_array",
        "_should_create_array", "flatten_range", "load_zarr_based_sharded_metadata", "logger",
        "numpy_to_torch_dtype_dict", "pad_to_expected_shape", "postprocess_numpy_array",
        "register_default_zarr_strategies", "torch_to_numpy_dtype_dict",
    ],
}

# The classes and functions each seed API document names (``shared/seeds/<module>.txt``
# documents Megatron-Core's ``dist_checkpointing.<module>``, offered as ``shardstore.<module>``).
SEED_API: dict[str, list[str]] = {
    "mapping": [
        "LocalNonpersistentObject", "ShardedBase", "ShardedObject", "ShardedTensor", "ShardedTensorFactory",
        "apply_factories", "apply_factory_merges", "is_main_replica",
    ],
    "strategies.base": [
        "AsyncSaveShardedStrategy", "LoadCommonStrategy", "LoadShardedStrategy", "LoadStrategyBase",
        "SaveCommonStrategy", "SaveShardedStrategy", "SaveStrategyBase", "StrategyAction",
        "get_default_strategy", "register_default_strategy",
    ],
    "strategies.checkpointable": ["CheckpointableShardedTensor", "LocalShardsContainer"],
    "strategies.zarr": [
        "ZarrLoadShardedStrategy", "ZarrSaveShardedStrategy", "_create_or_open_zarr_arrays",
        "_create_zarr_array", "_load_from_array", "_open_zarr_array_verbose", "_save_to_existing_array",
        "_should_create_array", "flatten_range", "load_zarr_based_sharded_metadata",
        "pad_to_expected_shape", "postprocess_numpy_array", "register_default_zarr_strategies",
    ],
    "utils": [
        "_clean_metadata_for_serialization", "_sharded_object_id", "_sharded_tensor_shard_id",
        "add_prefix_for_sharding", "apply_prefix_mapping", "debug_msg", "debug_time",
        "extract_nonpersistent", "extract_sharded_base", "extract_sharded_tensors",
        "extract_sharded_tensors_and_factories", "extract_sharded_tensors_or_nonpersistent",
        "force_all_tensors_to_non_fp8", "logger_stack", "replace_prefix_for_sharding", "zip_strict",
    ],
}
SEEDS = next((d for d in (REPO / "shared" / "seeds", REPO.parent / "shared" / "seeds") if d.is_dir()), None)


def test_every_kept_module_is_frozen_here() -> None:
    assert sorted(HOMES) == sorted(PUBLIC_NAMES)
    names = sorted(p.stem for p in (PACKAGE / "strategies").glob("*.py") if p.stem != "__init__")
    assert [f"shardstore.strategies.{m}" for m in names] == sorted(m for m in HOMES if ".strategies." in m)


@pytest.mark.parametrize("name", sorted(PUBLIC_NAMES))
def test_a_module_exports_exactly_its_frozen_names_its_homes_objects(name: str) -> None:
    module = importlib.import_module(name)
    home = importlib.import_module(HOMES[name] or name)
    assert sorted(module.__all__) == PUBLIC_NAMES[name]
    different = [n for n in module.__all__ if getattr(module, n) is not getattr(home, n)]
    assert different == []
    if HOMES[name] is not None:  # a re-export offers its __all__ and nothing else
        offered = {n for n in vars(module) if not n.startswith("__")} - {"annotations"}
        assert offered == set(module.__all__)


def _statements(name: str) -> list[ast.stmt]:
    path = PACKAGE.joinpath(*name.split(".")[1:]).with_suffix(".py")
    return ast.parse(path.read_text()).body


@pytest.mark.parametrize("name", sorted(n for n, home in HOMES.items() if home))
def test_a_reexport_is_a_plain_module(name: str) -> None:
    """A docstring, ``__all__`` and one import from its home: nothing a type checker
    cannot follow (no ``sys.modules`` replacement, no ``__getattr__``)."""
    docstring, future, all_names, imported, *rest = _statements(name)
    assert isinstance(docstring, ast.Expr) and isinstance(docstring.value, ast.Constant)
    assert isinstance(future, ast.ImportFrom) and future.module == "__future__"
    assert isinstance(all_names, ast.Assign) and ast.unparse(all_names.targets[0]) == "__all__"
    assert isinstance(imported, ast.ImportFrom) and imported.module == HOMES[name]
    assert sorted(a.name for a in imported.names) == PUBLIC_NAMES[name] and rest == []


def test_no_module_replaces_itself_in_sys_modules() -> None:
    replacing = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                 if re.search(r"sys\.modules\[[^]]*\]\s*=", p.read_text())]
    assert replacing == []


@pytest.mark.parametrize("seed", sorted(SEED_API))
def test_every_class_and_function_of_a_seed_document_is_offered(seed: str) -> None:
    module = importlib.import_module(f"shardstore.{seed}")
    missing = [name for name in SEED_API[seed] if not callable(getattr(module, name, None))]
    assert missing == [], f"shardstore.{seed} lacks {missing}"


def _documented(text: str, seed: str) -> list[str]:
    """The classes and functions a seed document's API part names: ``class
    core.dist_checkpointing.<seed>.<Name>`` and ``core.dist_checkpointing.<seed>.<name>(``
    at a line's start (data, ``...<name>#``, and methods, ``...<Class>.<name>``, are not)."""
    pattern = re.compile(
        r"^(?:- )?(class )?(?:abstractmethod )?core\.dist_checkpointing\." + re.escape(seed) + r"\.(\w+)\s*([(#:])",
        re.M)
    return sorted({m.group(2) for m in pattern.finditer(text) if m.group(1) or m.group(3) == "("})


@pytest.mark.skipif(SEEDS is None, reason="no shared/seeds beside the repository")
def test_the_seed_names_are_those_the_documents_name() -> None:
    assert SEEDS is not None
    found = {p.stem: _documented(p.read_text(encoding="utf-8"), p.stem) for p in sorted(SEEDS.glob("*.txt"))}
    assert found == SEED_API


def test_a_pickle_naming_a_class_by_the_name_users_import_loads() -> None:
    from shardstore.engine.zarr_strategies import ZarrSaveShardedStrategy

    by_public_name = b"cshardstore.strategies.zarr\nZarrSaveShardedStrategy\n."
    assert pickle.loads(by_public_name) is ZarrSaveShardedStrategy  # noqa: S301  (our own bytes)
    assert pickle.loads(pickle.dumps(ZarrSaveShardedStrategy)) is ZarrSaveShardedStrategy  # noqa: S301


@pytest.mark.parametrize("first_imported", ["shardstore.strategies.zarr", "shardstore.engine.zarr_strategies"])
def test_either_name_imported_first_gives_one_registry(first_imported: str) -> None:
    """In a fresh interpreter: one set of classes, one registry of default strategies,
    holding shardstore's own, whichever name is imported first."""
    code = (f"import importlib, {first_imported}\n"
            "import shardstore.strategies.base as public, shardstore.engine.strategies as home\n"
            "import shardstore.strategies.zarr as zarr, shardstore.engine.zarr_strategies as zarr_home\n"
            "assert public.default_strategies is home.default_strategies\n"
            "assert zarr.ZarrSaveShardedStrategy is zarr_home.ZarrSaveShardedStrategy\n"
            "saving = public.get_default_strategy(public.StrategyAction.SAVE_SHARDED, 'zarr', 1)\n"
            "assert type(saving) is zarr.ZarrSaveShardedStrategy, saving\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_the_top_level_names_are_the_seed_apis_own() -> None:
    from shardstore.compat.megatron import serialization

    for name in ("save", "load", "load_common_state_dict", "load_tensors_metadata", "remove_sharded_tensors"):
        assert getattr(shardstore, name) is getattr(serialization, name)


def test_the_top_level_dcp_names_are_the_dialects_own() -> None:
    from shardstore.compat.dcp import reader, writer

    assert shardstore.ShardstoreWriter is writer.ShardstoreWriter
    assert shardstore.ShardstoreReader is reader.ShardstoreReader is writer.ShardstoreReader
