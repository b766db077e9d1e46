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


@pytest.mark.parametrize("first_imported", ["shardstore.strategies.zarr", "shardstore.engine.zarr_strategies"])
def test_either_name_imported_first_gives_one_module(first_imported: str) -> None:
    """In a fresh interpreter: one module object, one registry of default strategies."""
    _one_module_in_a_fresh_interpreter(
        first_imported, "shardstore.strategies.zarr", "shardstore.engine.zarr_strategies",
        "import shardstore.strategies as package\n"
        "assert a is package.zarr and a.ZarrSaveShardedStrategy.__module__ == b.__name__\n"
        "assert importlib.import_module('shardstore.strategies.base').default_strategies['save_sharded']\n")


def _one_module_in_a_fresh_interpreter(first_imported: str, first: str, home: str, checks: str) -> None:
    """Imports ``first_imported``, then both names, in a fresh interpreter: ``a`` (the
    first name) and ``b`` (the home) are one module; ``checks`` runs after."""
    code = (f"import {first_imported}, importlib, sys\n"
            f"a = importlib.import_module({first!r})\n"
            f"b = importlib.import_module({home!r})\n"
            f"assert a is b is sys.modules[{first!r}]\n" + checks)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)


def test_a_pickle_naming_a_class_by_its_first_name_loads() -> None:
    from shardstore.engine.zarr_strategies import ZarrSaveShardedStrategy

    by_first_name = b"cshardstore.strategies.zarr\nZarrSaveShardedStrategy\n."
    assert pickle.loads(by_first_name) is ZarrSaveShardedStrategy  # noqa: S301  (our own bytes)
    assert pickle.loads(pickle.dumps(ZarrSaveShardedStrategy)) is ZarrSaveShardedStrategy  # noqa: S301


def test_the_top_level_names_are_the_seed_apis_own() -> None:
    from shardstore.compat.megatron import serialization

    for name in ("save", "load", "load_common_state_dict", "load_tensors_metadata", "remove_sharded_tensors"):
        assert getattr(shardstore, name) is getattr(serialization, name)


DCP_FIRST_NAMES = {f"shardstore.tools.dcp_{old}": f"shardstore.compat.dcp.{new}" for old, new in (
    ("storage", "writer"), ("reader", "reader"), ("parts", "parts"), ("common_state", "common_state"),
    ("exchange", "exchange"))}


@pytest.mark.parametrize(("first", "home"), sorted(DCP_FIRST_NAMES.items()))
def test_a_dcp_first_name_gives_the_very_module_of_its_home(first: str, home: str) -> None:
    """PyTorch DCP's dialect lives in ``shardstore.compat.dcp``; its first names under
    ``shardstore.tools`` give the very same modules."""
    assert importlib.import_module(first) is importlib.import_module(home)


def test_every_dcp_module_has_its_first_name() -> None:
    homes = sorted(p.stem for p in (PACKAGE / "compat" / "dcp").glob("*.py") if p.stem != "__init__")
    assert sorted(home.rsplit(".", 1)[1] for home in DCP_FIRST_NAMES.values()) == homes


@pytest.mark.parametrize("first_imported", ["shardstore.tools.dcp_parts", "shardstore.compat.dcp.parts"])
def test_either_dcp_name_imported_first_gives_one_module(first_imported: str) -> None:
    """In a fresh interpreter: one module object, one set of the plan cache's records."""
    _one_module_in_a_fresh_interpreter(
        first_imported, "shardstore.tools.dcp_parts", "shardstore.compat.dcp.parts",
        "assert a.RECENT_PLANS is b.RECENT_PLANS and a.RankPart.__module__ == b.__name__\n")


def test_a_plan_part_pickled_under_its_first_name_loads() -> None:
    """DCP pickles its plans, which hold the writer's parts, across ranks: a part whose
    pickle names the first module loads as the same class."""
    from shardstore.compat.dcp.parts import Refused

    part = Refused(part_id="p1", message="a reason", ranks=2)
    by_first_name = pickle.dumps(part, protocol=0).replace(b"shardstore.compat.dcp.parts", b"shardstore.tools.dcp_parts")
    assert b"shardstore.tools.dcp_parts" in by_first_name
    loaded = pickle.loads(by_first_name)  # noqa: S301  (our own bytes)
    assert type(loaded) is Refused and loaded == part


def test_the_top_level_dcp_names_are_the_dialects_own() -> None:
    from shardstore.compat.dcp import reader, writer

    assert shardstore.ShardstoreWriter is writer.ShardstoreWriter
    assert shardstore.ShardstoreReader is reader.ShardstoreReader is writer.ShardstoreReader
