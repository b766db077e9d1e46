"""Every shardstore module starts with its contract and its public names (issue 43, items
4 and 6): a module docstring of at most ``MAX_DOCSTRING_LINES`` lines, then (after
``from __future__`` only) a literal ``__all__`` whose every name the module has.

Every module, with no exception list.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import shardstore
import shardstore.stores.local  # noqa: F401  (at collection: its import runs ldconfig, a process)

PACKAGE = Path(shardstore.__file__).parent
REPO = PACKAGE.parent
MAX_DOCSTRING_LINES = 45


def _all_modules() -> list[str]:
    return sorted(p.relative_to(REPO).as_posix() for p in PACKAGE.rglob("*.py"))


def _module_name(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def head_problems(file: Path) -> list[str]:
    """What keeps the module in ``file`` from starting with its contract and its
    ``__all__``; empty when it does."""
    body = ast.parse(file.read_text()).body
    problems = []
    if not body or not _is_docstring(body[0]):
        problems.append("no module docstring")
        rest = body
    else:
        lines = len(body[0].value.value.splitlines())
        if lines > MAX_DOCSTRING_LINES:
            problems.append(f"module docstring of {lines} lines (at most {MAX_DOCSTRING_LINES}: "
                            "state the contract; incident stories go in commit bodies)")
        rest = body[1:]
    while rest and isinstance(rest[0], ast.ImportFrom) and rest[0].module == "__future__":
        rest = rest[1:]
    first = rest[0] if rest else None
    target = first.targets[0] if isinstance(first, ast.Assign) and len(first.targets) == 1 else (
        first.target if isinstance(first, ast.AnnAssign) else None)
    if not (isinstance(target, ast.Name) and target.id == "__all__"):
        problems.append("does not start with __all__ (after its docstring and `from __future__`)")
    elif not (isinstance(first.value, (ast.List, ast.Tuple))
              and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in first.value.elts)):
        problems.append("__all__ is not a literal list of strings")
    return problems


@pytest.mark.parametrize("path", _all_modules())
def test_module_starts_with_its_contract_and_all(path: str) -> None:
    problems = head_problems(REPO / path)
    assert not problems, f"{path}: {'; '.join(problems)}"


@pytest.mark.parametrize("path", _all_modules())
def test_every_name_in_all_exists(path: str) -> None:
    module = importlib.import_module(_module_name(path))
    names = getattr(module, "__all__", None)
    assert names is not None, f"{path} has no __all__"
    assert len(names) == len(set(names)), f"{path}: __all__ lists a name twice"
    missing = [name for name in names if not hasattr(module, name)]
    assert not missing, f"{path}: __all__ names {missing}, which the module does not have"


def test_the_package_root_lists_exactly_what_it_imports_on_demand() -> None:
    assert sorted(shardstore.__all__) == sorted(shardstore._EXPORTS)


def test_a_late_all_a_computed_all_and_a_long_docstring_are_caught(tmp_path: Path) -> None:
    late = tmp_path / "late.py"
    late.write_text('"""Doc."""\n\nfrom __future__ import annotations\n\nimport os\n\n__all__ = ["x"]\nx = os.sep\n')
    computed = tmp_path / "computed.py"
    computed.write_text('"""Doc."""\n\n__all__ = sorted({"x": 1})\nx = 1\n')
    long = tmp_path / "long.py"
    long.write_text('"""' + "line\n" * 50 + '"""\n\n__all__ = []\n')
    assert head_problems(late) == ["does not start with __all__ (after its docstring and `from __future__`)"]
    assert head_problems(computed) == ["__all__ is not a literal list of strings"]
    assert [p.split(" (")[0] for p in head_problems(long)] == ["module docstring of 50 lines"]
