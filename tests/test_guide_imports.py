"""The import lines the README and the guides print pass a type checker.

Every ``import shardstore...`` and ``from shardstore... import ...`` line of a fenced code
block in README.md and docs/**/*.md goes, each in a function of its own (two guides may
bind one name to different objects), into a temporary module that mypy checks. mypy reads
shardstore's modules (``follow_imports = silent``: their own errors are not this test's)
and skips every other library, so what it reports is an import whose module or name a
type checker cannot find in shardstore, as a user's IDE or mypy run would. The same
lines are imported at run time too: ``shardstore``'s own names are looked up on first use
(``__getattr__``), which a type checker takes on trust.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", re.S | re.M)
IMPORT = re.compile(r"^\s*(?:import shardstore\b|from shardstore(?:\.[\w.]+)? import )")
MYPY_CONFIG = """\
[mypy]
follow_imports = skip
ignore_missing_imports = True
warn_unused_configs = False

[mypy-shardstore.*]
follow_imports = silent
ignore_missing_imports = False
"""


def guide_imports() -> list[tuple[str, str]]:
    """``[(where, statement)]``: each shardstore import statement of a code block, with
    its page and line (a statement in parentheses over several lines is joined)."""
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = page.read_text(encoding="utf-8")
        for block in FENCE.finditer(text):
            lines = block.group(1).splitlines()
            first_line = text[:block.start(1)].count("\n") + 1
            i = 0
            while i < len(lines):
                start = i
                if IMPORT.match(lines[i]):
                    statement = lines[i].strip()
                    while "(" in statement and ")" not in statement and i + 1 < len(lines):
                        i += 1
                        statement += " " + lines[i].strip()
                    found.append((f"{page.relative_to(ROOT)}:{first_line + start}", statement))
                i += 1
    return found


def _module_of(statements: list[tuple[str, str]]) -> tuple[str, dict[int, str]]:
    """The statements as a module, each in a function of its own, and ``{line: where}``
    for each statement's line in it."""
    lines: list[str] = []
    where_at = {}
    for i, (where, statement) in enumerate(statements):
        lines += [f"def _statement_{i}() -> None:", f"    {statement}", ""]
        where_at[len(lines) - 1] = where
    return "\n".join(lines), where_at


def mypy_errors(statements: list[tuple[str, str]], tmp_path: Path) -> str:
    """mypy's report on ``statements``, each error named by the statement's page and
    line ('' when it passes)."""
    module, where_at = _module_of(statements)
    (tmp_path / "guide_imports.py").write_text(module)
    (tmp_path / "mypy.ini").write_text(MYPY_CONFIG)
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(tmp_path / "mypy.ini"), "--cache-dir",
         str(tmp_path / "cache"), "--no-error-summary", "--hide-error-context", str(tmp_path / "guide_imports.py")],
        capture_output=True, text=True, cwd=ROOT, timeout=280,
    )
    if result.returncode == 0:
        return ""
    report = result.stdout + result.stderr
    return re.sub(r"\S*guide_imports\.py:(\d+):", lambda m: where_at.get(int(m.group(1)), m.group(0)) + ":", report)


def test_the_guides_import_shardstore() -> None:
    statements = guide_imports()
    assert len(statements) > 20
    assert any("shardstore.strategies.zarr import ZarrSaveShardedStrategy" in s for _, s in statements)
    assert any(s == "import shardstore.megatron" for _, s in statements)


def test_mypy_finds_every_name_the_guides_import(tmp_path: Path) -> None:
    errors = mypy_errors(guide_imports(), tmp_path)
    assert errors == "", errors


def test_mypy_tells_a_missing_name(tmp_path: Path) -> None:
    """The check has teeth: a name no module offers, or a module that is not there."""
    errors = mypy_errors([("a", "from shardstore.strategies.zarr import NoSuchStrategy"),
                          ("b", "import shardstore.strategies.no_such_module")], tmp_path)
    assert "NoSuchStrategy" in errors and "no_such_module" in errors, errors


def test_every_name_the_guides_import_is_there_at_run_time() -> None:
    missing = []
    for where, statement in guide_imports():
        node = ast.parse(statement).body[0]
        if isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module or "")
            missing += [f"{where}: {node.module}.{a.name}" for a in node.names if not hasattr(module, a.name)]
        else:
            assert isinstance(node, ast.Import)
            for alias in node.names:
                importlib.import_module(alias.name)
    assert missing == []
