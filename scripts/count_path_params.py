"""Counts the parameters that take "a path or a Location" (issue 66.1: at most 10
outside the seed API's signatures: ``shardstore/compat/``, the dialects' mappings from a
path to a save, and ``shardstore/engine/``, whose save, load and strategies keep
Megatron-Core's signatures, which take a checkpoint directory).

A parameter counts when its annotation's union (``a | b``, ``Union``, ``Optional``)
admits both a path and a ``Location``: it names ``CheckpointDir`` (``serialization.CheckpointDir``, ``Union[str, Path, Location]``, and
``strategies.base.CheckpointDir``, the seed's ``Union[str, Path]``, which the core hands
a ``Location``), or it names ``Location`` together with a path type (``str``, ``bytes``,
``os.PathLike``, ``Path``). A parameter that takes only a ``Location`` (the core's
vocabulary) or only a path does not count; nor does a ``Location`` inside a
``Callable`` or a container, nor a parameter without an annotation. 99 when first
counted (tests/test_path_params.py holds the ceiling).

Run from the repository root: ``python scripts/count_path_params.py`` prints the count
outside ``shardstore/compat/`` and ``shardstore/engine/``, inside them, and the modules
outside them by count;
``--verbose`` lists every parameter (``module:line function(parameter: annotation)``).
"""

from __future__ import annotations

__all__ = ["PathParam", "path_params"]

import argparse
import ast
from collections import Counter
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent / "shardstore"
FENCE = ("compat/", "engine/")
PATH_TYPES = {"str", "bytes", "PathLike", "Path"}


class PathParam(NamedTuple):
    """One parameter that takes a path or a Location."""

    module: str  # relative to shardstore/, e.g. "serialization.py"
    line: int
    function: str
    name: str
    annotation: str


def _members(annotation: ast.expr) -> set[str]:
    """The names an annotation's top-level union admits (``a | b``, ``Union[a, b]``,
    ``Optional[a]``); what a ``Callable`` or a container holds is not admitted."""
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        return _members(annotation.left) | _members(annotation.right)
    if isinstance(annotation, ast.Subscript) and _name(annotation.value) in {"Union", "Optional"}:
        inner = annotation.slice
        return set().union(*(_members(e) for e in (inner.elts if isinstance(inner, ast.Tuple) else [inner])))
    return {_name(annotation)}


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr  # os.PathLike, pathlib.Path
    return node.id if isinstance(node, ast.Name) else ""


def takes_path_or_location(annotation: ast.expr, aliases: frozenset[str] = frozenset()) -> bool:
    """Whether an annotation admits both a path and a ``Location`` (``aliases``: the
    names of module-level aliases that do)."""
    members = _members(annotation)
    return bool(members & ({"CheckpointDir"} | aliases)) or ("Location" in members and bool(members & PATH_TYPES))


def path_aliases(trees: list[ast.Module]) -> frozenset[str]:
    """The names that module-level assignments in ``trees`` bind to a union admitting a
    path and a ``Location`` (``Target = str | os.PathLike | Location``)."""
    found = set()
    for tree in trees:
        for node in tree.body:
            target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else (
                node.target if isinstance(node, ast.AnnAssign) else None)
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            if isinstance(target, ast.Name) and value is not None and takes_path_or_location(value):
                found.add(target.id)
    return frozenset(found)


def path_params(root: Path = ROOT) -> list[PathParam]:
    """Every parameter under ``root`` that takes a path or a Location, in file order."""
    found = []
    trees = {path.relative_to(root).as_posix(): ast.parse(path.read_text(encoding="utf-8"))
             for path in sorted(root.rglob("*.py"))}
    aliases = path_aliases(list(trees.values()))
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            args = node.args
            for arg in (*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg):
                if arg is not None and arg.annotation is not None and takes_path_or_location(arg.annotation, aliases):
                    found.append(PathParam(module, arg.lineno, node.name, arg.arg, ast.unparse(arg.annotation)))
    return sorted(found, key=lambda p: (p.module, p.line))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="list every parameter")
    args = parser.parse_args()
    params = path_params()
    outside = [p for p in params if not p.module.startswith(FENCE)]
    print(f"outside {', '.join(FENCE)}: {len(outside)} in {len({p.module for p in outside})} modules; "
          f"inside: {len(params) - len(outside)}")
    for module, count in Counter(p.module for p in outside).most_common():
        print(f"  {count:4d}  {module}")
    if args.verbose:
        for p in params:
            print(f"  {p.module}:{p.line} {p.function}({p.name}: {p.annotation})")


if __name__ == "__main__":
    main()
