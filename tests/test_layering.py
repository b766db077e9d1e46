"""Issue 14: the code's layering stays as the README's "Layout of the code" describes it.
No module imports one that imports it back (also not inside a function), and the pure
and executing layers never import the API or the strategies above them."""

from __future__ import annotations

import ast
from pathlib import Path

import shardstore

ROOT = Path(shardstore.__file__).parent
# Layers that must not reach up: (modules, prefixes they may not import).
LOWER_LAYERS = [
    (
        ["format", "layout", "planner", "validation", "protocol", "chunk_io", "storage", "staging",
         "save_execution", "load_execution", "pickles", "foreign_checkpoint", "dcp_reader", "megatron_zarr_reader"],
        ["shardstore.strategies", "shardstore.serialization", "shardstore.megatron"],
    ),
    (["format", "layout", "planner"], ["shardstore.validation", "shardstore.distributed"]),
]


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
    assert len(graph) > 40 and "shardstore.save_execution" in graph
    cycles = [c for m in sorted(graph) if (c := _cycle_from(graph, m))]
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_lower_layers_do_not_import_the_layers_above() -> None:
    graph = _imports()
    wrong = [
        f"shardstore.{m} imports {dep}"
        for modules, forbidden in LOWER_LAYERS
        for m in modules
        for dep in sorted(graph[f"shardstore.{m}"])
        if any(dep == f or dep.startswith(f + ".") for f in forbidden)
    ]
    assert not wrong, wrong
