"""No process-global registry reconnects the pieces of one save (issue 66.1).

A save's pieces find each other through the objects handed down (a ``SaveLocation``
knows its ``PendingCheckpoint``, which holds what every pipeline of the save shares),
never through a module-level table keyed by object identity: such a table outlives the
objects it names, confuses reused ids, and hides who owns the state.
"""

from __future__ import annotations

import ast
import gc
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardstore
from shardstore.format.storage_layout import LayoutSite, StorageLayout
from shardstore.mapping import ShardedTensor
from shardstore.stores.locations import open_location
from shardstore.strategies.zarr import ZarrSaveShardedStrategy

ROOT = Path(shardstore.__file__).parent
WEAK_TABLES = {"WeakValueDictionary", "WeakKeyDictionary", "WeakSet"}
LOOKUPS = {"get", "pop", "setdefault", "__getitem__", "__setitem__", "__contains__"}


def _called(node: ast.AST) -> str | None:
    """The name a call calls (``weakref.WeakSet()`` -> ``WeakSet``), else None."""
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def _module_names(tree: ast.Module) -> dict[str, ast.AST | None]:
    """The module-level names assigned, with their values."""
    names: dict[str, ast.AST | None] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node.value
    return names


def identity_registries(source: str) -> list[str]:
    """Module-level weak tables, and module-level names looked up by ``id(...)``."""
    tree = ast.parse(source)
    names = _module_names(tree)
    found = [f"{name} = {_called(value)}()" for name, value in names.items() if _called(value) in WEAK_TABLES]
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in names:
            if _called(node.slice) == "id":
                found.append(f"{node.value.id}[id(...)]")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            owner = node.func.value
            if isinstance(owner, ast.Name) and owner.id in names and node.func.attr in LOOKUPS:
                if _called(node.args[0]) == "id":
                    found.append(f"{owner.id}.{node.func.attr}(id(...))")
    return found


def test_the_check_sees_identity_registries() -> None:
    source = (
        "import weakref\n_A = weakref.WeakSet()\n_B: dict = {}\n"
        "def f(x):\n    _B[id(x)] = x\n    return _B.get(id(x))\n"
    )
    assert identity_registries(source) == ["_A = WeakSet()", "_B[id(...)]", "_B.get(id(...))"]


# State of a process group itself, not of a save: kept by the group object, weakly, so
# that it ends with the group. torch's ProcessGroup takes no attribute of ours, and a
# table holding groups strongly kept gloo's threads alive past destroy_process_group
# (an abort at exit: "terminate called without an active exception").
PROCESS_GROUP_TABLES = {
    "protocol/collectives.py": ["_SLOTS = WeakKeyDictionary()", "_LOST = WeakKeyDictionary()"],
    "compat/dcp/exchange.py": ["_OWN_GROUPS = WeakKeyDictionary()"],
}


def test_no_module_keeps_an_identity_registry() -> None:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        relative = str(path.relative_to(ROOT))
        hits = [hit for hit in identity_registries(path.read_text()) if hit not in PROCESS_GROUP_TABLES.get(relative, ())]
        if hits:
            found[str(path.relative_to(ROOT))] = hits
    assert not found, f"process-global registries keyed by identity (hand the object down instead): {found}"
    for relative, tables in PROCESS_GROUP_TABLES.items():  # the allowance names what is there, no more
        assert identity_registries((ROOT / relative).read_text()) == tables, relative


# ------------------------------------------------------------------ the save handed down


def test_a_location_knows_its_save_while_the_save_lives(tmp_path: Path) -> None:
    from shardstore.format.commit import SaveLocation, SaveOptions, adopt_save, begin_save

    pending = begin_save(open_location(tmp_path / "ckpt"), SaveOptions().chosen_for(LayoutSite()))
    try:
        assert isinstance(pending.location, SaveLocation) and adopt_save(pending.location) is pending
        again = pickle.loads(pickle.dumps(pending))  # a writer process's copy knows its own
        assert again.location.save is again and again.location.describe() == pending.describe()
        alone = pickle.loads(pickle.dumps(pending.location))
        callers = StorageLayout().chosen_for(LayoutSite(callers_directory=True))
        assert alone.save is None and adopt_save(alone, callers) is not pending
        with pytest.raises(ValueError, match="no chosen layout"):
            adopt_save(alone)  # a caller's directory is adopted by the layout its save chose
    finally:
        pending.abandon()
    location = pending.location
    del pending, again
    gc.collect()
    assert location.save is None  # the location does not keep its save alive


def test_a_wrapping_strategy_handed_the_location_commits_the_same_save(tmp_path: Path) -> None:
    """A strategy of the seed's API that wraps shardstore's own (as Megatron's wrappers
    do) is handed the save's location as its checkpoint directory: shardstore's strategy
    adopts that very save, and its commit is the caller's (``require_committed``)."""
    from shardstore.strategies.base import SaveShardedStrategy

    class Wrapper(SaveShardedStrategy):
        def __init__(self) -> None:
            super().__init__("zarr", 1)
            self.base_strategy = ZarrSaveShardedStrategy()
            self.handed: list[object] = []

        def save(self, sharded_state_dict: dict, checkpoint_dir: object) -> None:
            raise AssertionError("save_with_plan is called")

        def save_with_plan(self, sharded_state_dict, checkpoint_dir, plan, process_group=None, local_error=None):
            self.handed.append(checkpoint_dir)
            self.base_strategy.save_with_plan(sharded_state_dict, checkpoint_dir, plan, process_group, local_error)

        def plan_save(self, layout, storage=None):
            return self.base_strategy.plan_save(layout, storage)

    wrapper = Wrapper()
    shardstore.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}, tmp_path / "ckpt", wrapper)
    assert [type(d).__name__ for d in wrapper.handed] == ["SaveLocation"]
    loaded = shardstore.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4))}, tmp_path / "ckpt")
    assert torch.equal(loaded["w"], torch.ones(4))


def test_megatrons_torch_dist_save_strategy_is_found_by_name_in_a_fresh_interpreter(tmp_path: Path) -> None:
    """``shardstore.save(sharded_strategy=("torch_dist", 1))`` finds Megatron-Core's name for
    shardstore's save strategy, with nothing imported before but ``shardstore`` (the
    engine's registry holds it once the Megatron names are imported, which ``save``'s
    module does)."""
    code = ("import sys, torch, shardstore\n"
            "from shardstore import ShardedTensor\n"
            "shardstore.save({'a': ShardedTensor.from_rank_offsets('a', torch.ones(3))}, sys.argv[1],\n"
            "                sharded_strategy=('torch_dist', 1))\n"
            "print(tuple(shardstore.load_tensors_metadata(sys.argv[1])['a'].global_shape))\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ckpt")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "(3,)"
