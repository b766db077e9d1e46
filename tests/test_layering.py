"""The code's layers are packages, and each imports only what shardstore/DESIGN.md allows (issue 24).

The drawing, top to bottom (a layer may import the layers below it, never above):

    tools           CLI, manager, inspection, conversion, testing (the store conformance
                    suite, which saves and loads)
    compat          other libraries' dialects: compat.dcp, PyTorch DCP's StorageWriter and
                    StorageReader; compat.megatron, Megatron-Core's names (its
                    strategies and module functions, re-exported under the names users
                    import: shardstore.strategies.*, shardstore.serialization) and its
                    doors (re-exported as shardstore.megatron, shardstore.core,
                    shardstore.validation, shardstore.exchange_utils; the tools layer's
                    shardstore.tools.megatron_strategy)
    engine          the one save and the one load every door stands on, and the
                    strategies they run (shardstore's storage core, common.pt, other
                    tools' checkpoints)
    api             the top-level modules (opened, load_strictness, cross_rank_checks,
                    utils), inputs (Megatron objects, DTensors -> our records)
    other_formats   readers of other tools' checkpoints
    execution       a rank runs its plan: staging, chunk writes and reads, placement
    protocol        the collective stages; the only code that calls torch.distributed
    planning        pure: layout and plans
    format          records, chunks, commit, integrity, dtypes, pickles (and the zarr
                    start-up hook _zarr_autoload, top-level because a .pth file names it)
    stores          where bytes go: the Location interface and one module per backend
    base            errors, progress, mapping, dict_utils, lazy_exports, gc_pause: importable by all

The core (stores, format, planning, protocol, execution) never imports compat: the
dialects translate into the core, never the other way. No module imports one that
imports it back (also not inside a function).
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import shardstore

ROOT = Path(shardstore.__file__).parent
API_MODULES = {"opened", "load_strictness", "cross_rank_checks", "utils", "__init__"}
BASE_MODULES = {"errors", "progress", "mapping", "dict_utils", "lazy_exports", "gc_pause"}
# Top-level modules that belong to another layer: the zarr start-up hook must be importable as
# shardstore._zarr_autoload (a .pth file names it) but is the format's; shardstore.megatron,
# shardstore.core, shardstore.validation, shardstore.exchange_utils, shardstore.serialization
# and the package shardstore.strategies (plain re-exports of compat.megatron's modules under
# the names users import; tests/test_public_modules.py checks they are nothing more) are the
# compat package's; testing saves and loads through them, as a user does.
TOP_LEVEL_ELSEWHERE = {"serialization": "compat",
                       "_zarr_autoload": "format", "megatron": "compat", "core": "compat", "compat": "compat",
                       "validation": "compat", "exchange_utils": "compat", "strategies": "compat",
                       "testing": "tools"}
ORDER = ["base", "stores", "format", "planning", "protocol", "execution", "other_formats", "api", "engine",
         "compat", "tools"]
CORE = ("stores", "format", "planning", "protocol", "execution")
# What is known to break the drawing today, each with its reason; the test fails when one is
# mended (so the list shrinks) or a new one appears.
KNOWN_EXCEPTIONS: set[tuple[str, str]] = set()


def layer_of(module: str) -> str:
    """The layer a ``shardstore.*`` module belongs to."""
    parts = module.split(".")
    if len(parts) == 1:
        return "api"
    top = parts[1]
    if top in TOP_LEVEL_ELSEWHERE:
        return TOP_LEVEL_ELSEWHERE[top]
    if top in BASE_MODULES:
        return "base"
    if top in API_MODULES or top == "inputs":
        return "api"
    if top in ORDER:
        return top
    raise AssertionError(f"{module} is in no layer: add its package to tests/test_layering.py and DESIGN.md")


def _imports() -> dict[str, set[str]]:
    """Every shardstore module and the shardstore modules it imports, anywhere in it."""
    graph = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(("shardstore", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shardstore"):
                deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("shardstore"))
        graph[name] = deps
    return graph


def _cycle_from(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """A chain of imports from ``start`` back to it, or None."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for dep in sorted(graph.get(node, ())):
            if dep == start:
                return path + [start]
            if dep not in seen:
                seen.add(dep)
                stack.append((dep, path + [dep]))
    return None


def test_no_module_imports_one_that_imports_it_back() -> None:
    graph = _imports()
    assert len(graph) > 40 and "shardstore.execution.save" in graph
    cycles = [c for m in sorted(graph) if (c := _cycle_from(graph, m))]
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def upward_imports() -> set[tuple[str, str]]:
    """Every import of a module in a higher layer (base modules may import only base modules)."""
    graph = _imports()
    found = set()
    for module, deps in graph.items():
        rank = ORDER.index(layer_of(module))
        for dep in deps:
            dep_rank = ORDER.index(layer_of(dep))
            if dep_rank > rank or (rank == 0 and dep_rank != 0 and module != "shardstore"):
                found.add((module, dep))
    return found


def test_the_core_never_imports_compat() -> None:
    """Issue 66.1: the dialects translate into the core; no module of the core imports
    ``compat`` or a module that re-exports its names (also not inside a function)."""
    graph = _imports()
    reaching = sorted(f"{m} imports {d}" for m, deps in graph.items() if layer_of(m) in CORE
                      for d in deps if layer_of(d) == "compat")
    assert reaching == []
    assert {layer_of(m) for m in graph} >= set(CORE)


def _first_name(module: str) -> bool:
    """A module whose one job is to offer a dialect's names under the name users import
    (``shardstore.serialization``, ``shardstore.strategies.zarr``, ``shardstore.megatron``,
    ...): the one place outside a dialect that imports it."""
    top = module.split(".")[1] if module.count(".") else ""
    return (TOP_LEVEL_ELSEWHERE.get(top) == "compat" and top != "compat") or module.startswith(
        "shardstore.tools.megatron_strategy")


def _importers_of(prefix: str) -> list[str]:
    """Every import of ``prefix`` (a package) by a module outside it that is not a first
    name, as ``"module imports dep"``."""
    return sorted(f"{m} imports {d}" for m, deps in _imports().items()
                  if not m.startswith(prefix) and not _first_name(m) for d in deps if d.startswith(prefix))


def test_no_dialect_imports_another() -> None:
    """A dialect (``compat.dcp``, ``compat.megatron``) translates into the engine, never
    into another dialect, under any of its names."""
    assert _importers_of("shardstore.compat.dcp") == []
    reaching = [r for r in _importers_of("shardstore.compat.megatron") if r.startswith("shardstore.compat.dcp")]
    assert reaching == []


def test_nothing_outside_the_megatron_dialect_imports_it() -> None:
    """The engine (``shardstore.engine``) holds the save and load every door runs; only
    Megatron-Core's own names (the first names) and the dialect itself import
    ``compat.megatron``. Tools, the DCP dialect and the engine never do."""
    assert _importers_of("shardstore.compat.megatron") == []


def test_the_tools_import_no_dialect() -> None:
    """The tools (manager, CLI, conversion, inspection, testing) stand on the engine."""
    graph = _imports()
    reaching = sorted(f"{m} imports {d}" for m, deps in graph.items() if layer_of(m) == "tools" and not _first_name(m)
                      for d in deps if layer_of(d) == "compat" and not _first_name(d))
    assert reaching == []
    assert any(d.startswith("shardstore.engine") for d in graph["shardstore.tools.manager.saving"])


def test_every_module_belongs_to_a_layer() -> None:
    layers = {layer_of(m) for m in _imports()}
    assert layers == set(ORDER), layers


def test_no_layer_imports_a_layer_above_it() -> None:
    found = upward_imports()
    new = sorted(found - KNOWN_EXCEPTIONS)
    assert not new, "imports that climb a layer:\n" + "\n".join(f"{m} imports {d}" for m, d in new)
    mended = sorted(KNOWN_EXCEPTIONS - found)
    assert not mended, f"no longer broken, remove from KNOWN_EXCEPTIONS: {mended}"


COLLECTIVES = {"all_gather_object", "gather_object", "scatter_object_list", "broadcast_object_list", "all_reduce",
               "barrier", "batch_isend_irecv", "broadcast", "all_gather", "scatter", "gather", "isend", "irecv",
               "P2POp", "send", "recv", "reduce"}
# Collectives called outside the protocol package: none (issue 24.4 moved them in).
KNOWN_COLLECTIVE_CALLERS: set[str] = set()


def _is_torch_distributed(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id == "dist") or (
        isinstance(node, ast.Attribute) and node.attr == "distributed")


def test_only_the_protocol_calls_torch_distributed_collectives() -> None:
    """``torch.distributed`` collectives are called in ``shardstore.protocol`` only (DESIGN.md)."""
    callers: dict[str, list[str]] = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "protocol":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES and _is_torch_distributed(node.value):
                callers.setdefault(rel.as_posix(), []).append(f"{node.attr} at line {node.lineno}")
    assert set(callers) == KNOWN_COLLECTIVE_CALLERS, callers


# The modules of one storage backend each; the format layer reaches storage only through
# the store interface (``stores.base``) and the factory that opens a location by its URL.
BACKEND_MODULES = {"local", "s3", "memory", "fsspec_base", "kv_chunks"}


def test_the_format_imports_no_backend_module() -> None:
    """Issue 43.3: ``format`` knows the store interface, never a backend (an empty
    exception list)."""
    graph = _imports()
    assert {f"shardstore.stores.{m}" for m in BACKEND_MODULES} <= set(graph)
    reaching = sorted(
        f"{module} -> {dep}" for module, deps in graph.items() if layer_of(module) == "format"
        for dep in deps if dep.startswith("shardstore.stores.") and dep.rsplit(".", 1)[1] in BACKEND_MODULES
    )
    assert reaching == []


# The packages below the api whose ``__init__`` is their entry for the doors.
ENTRY_PACKAGES = ("stores", "format", "planning", "protocol", "execution", "other_formats")


# The seed API: Megatron-Core's strategy classes and module functions, the api's engine
# moved into compat (re-exported under the names users import), and where their checkpoint directories lead
# (issue 66.1); they reach below as the api does.
SEED_API = ("shardstore.compat.megatron.strategies", "shardstore.compat.megatron.serialization",
            "shardstore.strategies", "shardstore.serialization")


def is_door(module: str) -> bool:
    """The doors: the ``tools`` package, and the compat modules other than the seed API
    (``install``, the strategy plug-in, Megatron-Core's module names)."""
    return module.startswith("shardstore.tools") or (layer_of(module) == "compat" and not module.startswith(SEED_API))


def _imported_names() -> dict[str, list[tuple[str, str, int]]]:
    """``{door module: [(imported module, name or "", line)]}`` over the doors, every
    import (inside functions too)."""
    found: dict[str, list[tuple[str, str, int]]] = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(("shardstore", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")
        if not is_door(name):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shardstore"):
                found.setdefault(name, []).extend((node.module, a.name, node.lineno) for a in node.names)
            elif isinstance(node, ast.Import):
                found.setdefault(name, []).extend(
                    (a.name, "", node.lineno) for a in node.names if a.name.startswith("shardstore"))
    return found


def test_the_doors_reach_lower_layers_only_through_their_packages() -> None:
    """Issue 43.3: a door (``is_door``) imports from a layer below the api only that
    layer's package (``from shardstore.format import CommitRecord``), a name its
    ``__all__`` offers, never one of its modules (``shardstore.format.records``); or it
    imports from an api or base module. An empty exception list."""
    found = _imported_names()
    assert {"shardstore.megatron", "shardstore.compat.dcp.writer"} <= set(found)
    reaching = []
    for door, imports in sorted(found.items()):
        for module, name, line in imports:
            layer = layer_of(module)
            if layer in {"api", "engine", "compat", "tools", "base"}:
                continue
            package = importlib.import_module(f"shardstore.{layer}")
            if module != package.__name__ or name not in package.__all__:
                reaching.append(f"{door}:{line} imports {name or module} from {module}")
    assert reaching == []
    used = {module for imports in found.values() for module, _, _ in imports}
    assert {f"shardstore.{p}" for p in ENTRY_PACKAGES if p != "planning"} <= used  # the rule has teeth


# The save and load machinery below the api: the doors call the api for it (DESIGN.md).
MACHINERY_PACKAGES = ("planning", "protocol", "execution")
# Issue 64.4: the import statements by which the doors (the tools, and the dialects' doors
# in compat) still reach the machinery (the DCP writer composes a save: ``execution`` and ``protocol``, and its parts carry a rank's
# ``RankSave``; the DCP reader reads on the load's ``Group``; the array writer opens a
# save pipeline; the manager agrees on its save decision across ranks). The DCP door is
# three modules since it was split by idea (writer, reader, the parts between its stages):
# the same reach as one module's two statements, in four.
MAX_DOOR_MACHINERY_IMPORTS = 6


def test_the_doors_reach_the_machinery_in_few_imports() -> None:
    """Every import statement of a door (``is_door``) from ``planning``,
    ``protocol`` or ``execution`` counts once, whatever it names; what a door needs of
    them belongs behind the api."""
    found = _imported_names()
    statements = sorted({(door, line) for door, imports in found.items() for module, _, line in imports
                         if layer_of(module) in MACHINERY_PACKAGES})
    assert len(statements) <= MAX_DOOR_MACHINERY_IMPORTS, statements


@pytest.mark.parametrize("package", ENTRY_PACKAGES)
def test_an_entry_package_offers_exactly_its_all(package: str) -> None:
    """An entry package offers the names of its ``__all__`` and nothing else (resolving
    each is tests/test_module_heads.py's); none is one of its modules, which importing
    would put in the name's place."""
    module = importlib.import_module(f"shardstore.{package}")
    modules = {p.stem for p in (ROOT / package).glob("*.py")}
    assert not set(module.__all__) & modules
    assert set(dir(module)) - set(vars(module)) == set(module.__all__)
    with pytest.raises(AttributeError, match=f"'shardstore.{package}' has no attribute 'not_offered'"):
        module.not_offered  # noqa: B018


def test_an_offered_name_is_its_modules_object() -> None:
    import shardstore.stores
    import shardstore.stores.base

    assert shardstore.stores.Location is shardstore.stores.base.Location
    assert "Location" not in vars(shardstore.stores)  # looked up in its module at each use


def test_importing_an_entry_package_imports_none_of_its_modules() -> None:
    """The packages import their names lazily: the zarr start-up hook imports
    ``shardstore.format``, and must not pull torch in with it."""
    packages = [f"shardstore.{p}" for p in ENTRY_PACKAGES]
    code = f"import sys, {', '.join(packages)}; print(sorted(sys.modules))"
    loaded = ast.literal_eval(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                             check=True).stdout)
    assert set(packages) <= set(loaded)
    assert [m for m in loaded if m == "torch" or m.startswith(tuple(f"{p}." for p in packages))] == []


def test_no_code_asks_which_publisher_a_save_has() -> None:
    """Issue 43.2: each way of publishing is a ``format.commit.Publisher`` subclass that
    owns its rules; no module compares a publisher with ``is``/``==`` or probes its
    class with ``isinstance`` (an empty exception list)."""
    asking: list[str] = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(_names_a_publisher(n) for n in (node.left, *node.comparators)):
                asking.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"
                  and any(_names_a_publisher(a) for a in node.args)):
                asking.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert asking == []


def _names_a_publisher(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "publisher") or (
        isinstance(node, ast.Name) and node.id in {"publisher", "Publisher", "ByRename", "InPlace", "IntoCallersDirectory"})


def test_the_code_layout_page_names_every_package() -> None:
    layout = (ROOT.parent / "docs" / "code-layout.md").read_text()
    design = (ROOT / "DESIGN.md").read_text()
    packages = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").exists())
    for package in packages:
        assert f"`{package}/`" in layout, f"docs/code-layout.md lacks {package}/"
        assert f"`{package}`" in design, f"shardstore/DESIGN.md does not describe {package}"


def test_chunk_io_leaves_the_stored_layout_to_the_codecs() -> None:
    """Issue 43.3: ``format/chunks.py`` moves chunks; how one is laid out and checked
    (the crc32c trailer) is its codec's (``format/codecs.py``): chunks.py imports no
    crc32c and packs or unpacks no integer into bytes."""
    tree = ast.parse((ROOT / "format" / "chunks.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    packing = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in {"to_bytes", "from_bytes"}]
    assert "crc32c" not in imported and packing == []
