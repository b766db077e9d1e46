"""The house metrics of issue 43, read from the source alone (``ast``; nothing is run).

For the ``shardstore`` package of a tree: modules, lines, public names (top-level names
not starting with ``_``; imports not counted), modules with a module-level ``__all__``,
module docstring lines (of its text; total and longest), publisher dispatch sites (``is``/``==``
comparisons with a ``Publisher`` member or a ``publisher`` value, and ``isinstance``
tests against a ``Publisher`` class), fields set on a save object after construction
(attribute assignments to a variable named as in ``SAVE_VARIABLES``, outside ``self``),
the classes that hold a save's state (those of ``SAVE_STATE_CLASSES`` that exist),
whether ``PendingCheckpoint`` is a ``Location``, and the median function length
(``def`` to its last line, methods and nested functions included).

Usage, from anywhere:

    python scripts/house_metrics.py [--tree PATH]          # one column: PATH (default: this tree)
    python scripts/house_metrics.py --compare REV [--tree PATH]

``--compare`` checks REV out with ``git worktree add --detach`` into a temporary
directory, measures it, removes that worktree and prints REV's column beside the tree's.
The output is a Markdown table, then the names behind the counts that name things.
"""

from __future__ import annotations

__all__ = ["Metrics", "measure", "measure_revision", "table", "main"]

import argparse
import ast
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Classes a save's state has lived in (issue 43 item 1: one object is the goal).
SAVE_STATE_CLASSES = ("SavePipeline", "PendingCheckpoint", "PendingSave", "StagedSave", "RankSave", "SaveState")
# Names the code gives a pending or staged save where it sets a field on it from outside.
SAVE_VARIABLES = frozenset({"pending", "pending_save", "pending_checkpoint", "staged", "staged_save", "save"})
_COMPARISONS = (ast.Is, ast.IsNot, ast.Eq, ast.NotEq)


@dataclass(frozen=True)
class Metrics:
    """What ``measure`` found in one tree's ``shardstore`` package."""

    modules: int
    lines: int
    public_names: int
    modules_with_all: int
    docstring_lines: int
    longest_docstring: tuple[int, str]
    dispatch_sites: tuple[str, ...]
    fields_set_after_construction: tuple[str, ...]
    save_state_classes: tuple[str, ...]
    pending_is_location: bool | None
    median_function_lines: float


@dataclass(frozen=True)
class _Module:
    path: str
    tree: ast.Module
    lines: int


def _modules(tree: Path) -> list[_Module]:
    package = tree / "shardstore"
    if not package.is_dir():
        raise SystemExit(f"house_metrics: {tree} holds no shardstore package; pass the repository root as --tree")
    modules = []
    for file in sorted(package.rglob("*.py")):
        source = file.read_text()
        modules.append(_Module(file.relative_to(tree).as_posix(), ast.parse(source), len(source.splitlines())))
    return modules


def _top_level_names(module: ast.Module) -> Iterator[str]:
    for node in module.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                yield from (n.id for n in ast.walk(target) if isinstance(n, ast.Name))


def _docstring_lines(module: ast.Module) -> int:
    """Lines of the module docstring's text (as issue 43 counted them: 1,560 in all)."""
    return len((ast.get_docstring(module, clean=False) or "").splitlines())


def _classes(modules: list[_Module]) -> dict[str, ast.ClassDef]:
    return {n.name: n for m in modules for n in ast.walk(m.tree) if isinstance(n, ast.ClassDef)}


def _base_names(cls: ast.ClassDef) -> set[str]:
    return {b.id if isinstance(b, ast.Name) else b.attr for b in cls.bases if isinstance(b, (ast.Name, ast.Attribute))}


def _publisher_classes(classes: dict[str, ast.ClassDef]) -> set[str]:
    return {"Publisher"} | {name for name, cls in classes.items() if "Publisher" in _base_names(cls)}


def _names_publisher(node: ast.expr, publishers: set[str]) -> bool:
    """``Publisher.RENAME`` (a member of a publisher class), or a value named ``publisher``."""
    if isinstance(node, ast.Attribute):
        return node.attr == "publisher" or (isinstance(node.value, ast.Name) and node.value.id in publishers)
    return isinstance(node, ast.Name) and node.id == "publisher"


def _is_dispatch(node: ast.AST, publishers: set[str]) -> bool:
    if isinstance(node, ast.Compare) and all(isinstance(op, _COMPARISONS) for op in node.ops):
        return any(_names_publisher(side, publishers) for side in [node.left, *node.comparators])
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
        kinds = node.args[1:2]
        names = [k for arg in kinds for k in (arg.elts if isinstance(arg, ast.Tuple) else [arg])]
        return any(isinstance(n, ast.Name) and n.id in publishers for n in names)
    return False


def _assigned_attributes(node: ast.AST) -> Iterator[ast.Attribute]:
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    else:
        return
    for target in targets:
        yield from (n for n in ast.walk(target) if isinstance(n, ast.Attribute))


def _field_set_on_save(node: ast.AST) -> Iterator[str]:
    """``pending.reuse_source = ...`` and ``setattr(staged, ...)``: a field of a save object
    set by code outside its class."""
    for attribute in _assigned_attributes(node):
        if isinstance(attribute.value, ast.Name) and attribute.value.id in SAVE_VARIABLES:
            yield f"{attribute.value.id}.{attribute.attr}"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" and node.args:
        if isinstance(node.args[0], ast.Name) and node.args[0].id in SAVE_VARIABLES:
            yield f"setattr({node.args[0].id}, ...)"


def _sites(modules: list[_Module], found: Callable[[ast.AST], Iterator[str]]) -> tuple[str, ...]:
    return tuple(f"{m.path}:{node.lineno} {what}" for m in modules for node in ast.walk(m.tree) for what in found(node))


def _function_lengths(modules: list[_Module]) -> list[int]:
    return [n.end_lineno - n.lineno + 1 for m in modules for n in ast.walk(m.tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def measure(tree: Path) -> Metrics:
    """The metrics of the ``shardstore`` package under ``tree`` (a repository root)."""
    modules = _modules(tree)
    classes = _classes(modules)
    publishers = _publisher_classes(classes)
    docstrings = [(_docstring_lines(m.tree), m.path) for m in modules]
    pending = classes.get("PendingCheckpoint")
    return Metrics(
        modules=len(modules),
        lines=sum(m.lines for m in modules),
        public_names=sum(1 for m in modules for name in _top_level_names(m.tree) if not name.startswith("_")),
        modules_with_all=sum(1 for m in modules if "__all__" in set(_top_level_names(m.tree))),
        docstring_lines=sum(lines for lines, _ in docstrings),
        longest_docstring=max(docstrings),
        dispatch_sites=_sites(modules, lambda n: iter(["dispatch"] if _is_dispatch(n, publishers) else [])),
        fields_set_after_construction=_sites(modules, _field_set_on_save),
        save_state_classes=tuple(name for name in SAVE_STATE_CLASSES if name in classes),
        pending_is_location=None if pending is None else "Location" in _base_names(pending),
        median_function_lines=statistics.median(_function_lengths(modules)),
    )


def measure_revision(rev: str, repo: Path = REPO) -> Metrics:
    """``measure`` of ``rev`` of ``repo``, checked out into a temporary worktree that is
    removed again, whatever happens."""
    with tempfile.TemporaryDirectory(prefix="house-metrics-") as scratch:
        checkout = Path(scratch) / "tree"
        _git(repo, "worktree", "add", "--detach", "--quiet", str(checkout), rev)
        try:
            return measure(checkout)
        finally:
            _git(repo, "worktree", "remove", "--force", str(checkout))


def _git(repo: Path, *args: str) -> None:
    result = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"house_metrics: git {' '.join(args)} failed in {repo}: {result.stderr.strip()}")


def _distinct(sites: tuple[str, ...]) -> str:
    fields = {site.split(" ", 1)[1] for site in sites}
    return f"{len(fields)} ({len(sites)} sites)"


ROWS: tuple[tuple[str, Callable[[Metrics], object]], ...] = (
    ("modules", lambda m: m.modules),
    ("lines", lambda m: f"{m.lines:,}"),
    ("public names", lambda m: m.public_names),
    ("modules with `__all__`", lambda m: f"{m.modules_with_all} of {m.modules}"),
    ("module docstring lines, total", lambda m: f"{m.docstring_lines:,}"),
    ("longest module docstring", lambda m: f"{m.longest_docstring[0]} ({m.longest_docstring[1]})"),
    ("publisher dispatch sites", lambda m: len(m.dispatch_sites)),
    ("fields set on a save after construction", lambda m: _distinct(m.fields_set_after_construction)),
    ("classes holding a save's state", lambda m: f"{len(m.save_state_classes)} ({', '.join(m.save_state_classes)})"),
    ("`PendingCheckpoint` is a `Location`", lambda m: {True: "yes", False: "no", None: "(no such class)"}[
        m.pending_is_location]),
    ("median function, lines", lambda m: f"{m.median_function_lines:g}"),
)


def table(columns: list[tuple[str, Metrics]]) -> str:
    """A Markdown table: one row per metric, one column per measured tree."""
    lines = ["| metric | " + " | ".join(name for name, _ in columns) + " |",
             "|---|" + "---|" * len(columns)]
    lines += [f"| {label} | " + " | ".join(str(value(m)) for _, m in columns) + " |" for label, value in ROWS]
    return "\n".join(lines)


def _details(columns: list[tuple[str, Metrics]]) -> str:
    out = []
    for name, m in columns:
        out.append(f"\n{name}:")
        out += [f"  dispatch: {site}" for site in m.dispatch_sites]
        out += [f"  field set after construction: {site}" for site in m.fields_set_after_construction]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, default=REPO, help="repository root to measure (default: this one)")
    parser.add_argument("--compare", metavar="REV", help="also measure this git revision, in a column before the tree's")
    parser.add_argument("--details", action="store_true", help="list every dispatch site and field set after construction")
    args = parser.parse_args(argv)
    columns = [(str(args.tree), measure(args.tree))]
    if args.compare:
        columns.insert(0, (args.compare, measure_revision(args.compare, args.tree)))
    print(table(columns))
    if args.details:
        print(_details(columns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
