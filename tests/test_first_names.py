"""Issue 66.1: the Megatron dialect lives in ``shardstore.compat.megatron``; every module
that moved there keeps its first name, and importing the first name gives the very same
module object (one registry, one set of classes), whichever name is imported first.
Pickles and Megatron-Core's own imports by the first names keep working."""

from __future__ import annotations

import importlib
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import shardstore

PACKAGE = Path(shardstore.__file__).parent
STRATEGIES = sorted(p.stem for p in (PACKAGE / "compat" / "megatron" / "strategies").glob("*.py")
                    if p.stem != "__init__")
SERIALIZATION = ("serialization", "serialization_load", "serialization_common")
FIRST_NAMES = {
    **{f"shardstore.strategies.{m}": f"shardstore.compat.megatron.strategies.{m}" for m in STRATEGIES},
    **{f"shardstore.{m}": f"shardstore.compat.megatron.{m}" for m in SERIALIZATION},
}


def test_every_strategy_module_has_its_first_name() -> None:
    first = sorted(p.stem for p in (PACKAGE / "strategies").glob("*.py") if p.stem != "__init__")
    assert first == STRATEGIES and "zarr" in first


@pytest.mark.parametrize(("first", "home"), sorted(FIRST_NAMES.items()))
def test_a_first_name_gives_the_very_module_of_its_home(first: str, home: str) -> None:
    assert importlib.import_module(first) is importlib.import_module(home)


@pytest.mark.parametrize("first_imported", ["shardstore.strategies.zarr", "shardstore.compat.megatron.strategies.zarr"])
def test_either_name_imported_first_gives_one_module(first_imported: str) -> None:
    """In a fresh interpreter: one module object, one registry of default strategies."""
    code = (f"import {first_imported}, importlib, sys\n"
            "a = importlib.import_module('shardstore.strategies.zarr')\n"
            "b = importlib.import_module('shardstore.compat.megatron.strategies.zarr')\n"
            "import shardstore.strategies as package\n"
            "assert a is b is package.zarr is sys.modules['shardstore.strategies.zarr']\n"
            "assert a.ZarrSaveShardedStrategy.__module__ == 'shardstore.compat.megatron.strategies.zarr'\n"
            "assert importlib.import_module('shardstore.strategies.base').default_strategies['save_sharded']\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)


def test_a_pickle_naming_a_class_by_its_first_name_loads() -> None:
    from shardstore.compat.megatron.strategies.zarr import ZarrSaveShardedStrategy

    by_first_name = b"cshardstore.strategies.zarr\nZarrSaveShardedStrategy\n."
    assert pickle.loads(by_first_name) is ZarrSaveShardedStrategy  # noqa: S301  (our own bytes)
    assert pickle.loads(pickle.dumps(ZarrSaveShardedStrategy)) is ZarrSaveShardedStrategy  # noqa: S301


def test_the_top_level_names_are_the_seed_apis_own() -> None:
    from shardstore.compat.megatron import serialization

    for name in ("save", "load", "load_common_state_dict", "load_tensors_metadata", "remove_sharded_tensors"):
        assert getattr(shardstore, name) is getattr(serialization, name)
