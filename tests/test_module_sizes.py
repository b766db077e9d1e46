"""No module of shardstore is over ``MAX_MODULE_LINES`` lines (issue 66.2), nor offers
more than ``MAX_ALL_NAMES`` names in its ``__all__`` (issue 65.6): one module, one job,
small enough to read whole.

``KNOWN_LONGER`` and ``KNOWN_WIDER`` name the modules that were over when each rule
came; the lists can only shrink. A module that is split below the limit must leave its
list (the test says so), and no module joins one: put new code in a new, well-named
module instead.
"""

from __future__ import annotations

import ast
from pathlib import Path

import shardstore

PACKAGE = Path(shardstore.__file__).parent
MAX_MODULE_LINES = 800
MAX_ALL_NAMES = 30

KNOWN_LONGER: frozenset[str] = frozenset()  # none left: every module is within the limit

KNOWN_WIDER = frozenset({
    "format/__init__.py",
})


def _lines() -> dict[str, int]:
    return {p.relative_to(PACKAGE).as_posix(): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}


def test_no_module_is_over_the_limit_but_the_known_ones() -> None:
    over = {path: n for path, n in sorted(_lines().items()) if n > MAX_MODULE_LINES and path not in KNOWN_LONGER}
    assert over == {}, (
        f"modules over {MAX_MODULE_LINES} lines: {over}; split each by idea into modules of their own"
    )


def test_the_list_of_known_longer_modules_only_shrinks() -> None:
    lines = _lines()
    back_under = sorted(path for path in KNOWN_LONGER if lines.get(path, 0) <= MAX_MODULE_LINES)
    assert back_under == [], f"{back_under} are {MAX_MODULE_LINES} lines or fewer now (or gone): remove them from KNOWN_LONGER"


def test_the_manager_is_not_among_them() -> None:
    assert not {path for path in KNOWN_LONGER if path.startswith("tools/manager")}
    assert all(n <= MAX_MODULE_LINES for path, n in _lines().items() if path.startswith("tools/manager/"))


def _all_sizes() -> dict[str, int]:
    """``{module: names in its __all__}`` (a literal list: tests/test_module_heads.py)."""
    sizes = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else (
                node.target if isinstance(node, ast.AnnAssign) else None)
            if isinstance(target, ast.Name) and target.id == "__all__" and isinstance(node.value, (ast.List, ast.Tuple)):
                sizes[path.relative_to(PACKAGE).as_posix()] = len(node.value.elts)
    return sizes


def test_no_all_is_over_the_limit_but_the_known_ones() -> None:
    sizes = _all_sizes()
    assert "format/commit/__init__.py" in sizes  # the rule has teeth
    over = {path: n for path, n in sorted(sizes.items()) if n > MAX_ALL_NAMES and path not in KNOWN_WIDER}
    assert over == {}, (
        f"modules whose __all__ has over {MAX_ALL_NAMES} names: {over}; split each by idea into modules of their own"
    )


def test_the_list_of_known_wider_modules_only_shrinks() -> None:
    sizes = _all_sizes()
    back_under = sorted(path for path in KNOWN_WIDER if sizes.get(path, 0) <= MAX_ALL_NAMES)
    assert back_under == [], (
        f"{back_under} offer {MAX_ALL_NAMES} names or fewer now (or are gone): remove them from KNOWN_WIDER"
    )
