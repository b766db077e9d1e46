"""The suite's shared fixtures, and the ``integration`` marker (tests/README.md).

A test is an integration test when it starts processes (``tests.dist.run_distributed``,
``subprocess``, ``multiprocessing``) or servers (the session's ``moto_server``, a
``LocalS3Server``), directly or through a fixture or a helper in ``tests/``. Collection
marks such tests itself, from the names their code uses (``integration_reason``), so no
test file has to say it; a module that needs it anyway declares
``pytestmark = pytest.mark.integration``. ``pytest -m "not integration"`` is then the
quick loop of fast in-process tests; the default suite runs both.

The marker is kept true at run time: an unmarked test that starts a process or the S3
server fails, naming what it started (``_in_process_only``).
"""

from __future__ import annotations

import inspect
import multiprocessing.process
import os
import subprocess
import sys
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
# Spawned workers (forkserver) import tests.* by name.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="session")
def moto_server():
    """The test run's one S3 server (moto on 127.0.0.1, a free port, the tests'
    credentials: ``tests.s3_support``), stopped when the run ends. Each module makes a
    bucket of its own on it (``create_bucket``), so modules never see each other's
    objects. Nothing else in tests/ starts an S3 server."""
    pytest.importorskip("moto")
    from tests.s3_support import MotoServer

    _WATCH.note("the S3 server (moto_server)")
    server = MotoServer().start()
    yield server
    server.stop()


@pytest.fixture
def ckpt_dir(tmp_path: Path) -> Path:
    """A fresh directory path for one checkpoint (not created)."""
    return tmp_path / "ckpt"


@pytest.fixture
def tiny_tmpfs(tmp_path: Path):
    """A 1 MiB tmpfs: a real full disk (ENOSPC); skipped where mounting is not allowed,
    where each test's fault-injected twin covers ENOSPC."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip()}); the fault-injected test covers ENOSPC")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


# ------------------------------------------------------------------ the integration marker

# Fixtures that are servers.
SERVER_FIXTURES = {"moto_server"}
# Names whose use starts a process or a server, and what it starts.
STARTERS = {
    "run_distributed": "processes (tests.dist)",
    "Process": "a multiprocessing process",
    "LocalS3Server": "an S3 server",
    "MotoServer": "an S3 server",
    "ThreadedMotoServer": "an S3 server",
    "FaultyProxy": "an HTTP proxy server",
    "forked_python": "a forked Python process (tests.forked_python)",
    "ForkedPython": "a forked Python process (tests.forked_python)",
}
# subprocess's functions that start a process (``subprocess.run``: both names are used).
SUBPROCESS_CALLS = {"run", "Popen", "call", "check_call", "check_output"}


def _starter_in(code: types.CodeType) -> str | None:
    """What the names ``code`` uses start, or None."""
    names = set(code.co_names)
    starters = sorted(names & STARTERS.keys())
    if starters:
        return f"{STARTERS[starters[0]]} ({starters[0]})"
    if "subprocess" in names and names & SUBPROCESS_CALLS:
        return f"a process (subprocess.{min(names & SUBPROCESS_CALLS)})"
    return None


def _helpers(code: types.CodeType, namespace: dict[str, Any]) -> Iterator[tuple[types.CodeType, dict[str, Any]]]:
    """The code that ``code`` calls within tests/: nested functions, and the functions,
    classes' methods and modules' functions of tests/ that its names refer to."""
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield const, namespace
    for name in code.co_names:
        target = namespace.get(name)
        if isinstance(target, types.ModuleType) and target.__name__.split(".")[0] == "tests":
            candidates = [getattr(target, n, None) for n in code.co_names]
        elif isinstance(target, type):
            candidates = list(vars(target).values())
        else:
            candidates = [target]
        for candidate in candidates:
            function = _undecorated(candidate) if callable(candidate) else None
            if isinstance(function, types.FunctionType) and function.__module__.split(".")[0] == "tests":
                yield function.__code__, function.__globals__


def _undecorated(function: Any) -> Any:
    """The function a test method, ``functools.wraps`` or Hypothesis's ``@given`` wraps."""
    function = inspect.unwrap(getattr(function, "__func__", function))
    return getattr(getattr(function, "hypothesis", None), "inner_test", function)


def _reason_in(function: Any) -> str | None:
    """What ``function`` (or code it reaches in tests/) starts, or None."""
    function = _undecorated(function)
    if not isinstance(function, types.FunctionType):
        return None
    pending, seen = [(function.__code__, function.__globals__)], set()
    while pending:
        code, namespace = pending.pop()
        if code in seen:
            continue
        seen.add(code)
        reason = _starter_in(code)
        if reason:
            return reason
        pending.extend(_helpers(code, namespace))
    return None


def integration_reason(item: pytest.Item) -> str | None:
    """Why ``item`` is an integration test (what it starts, through which fixture), or None."""
    if not isinstance(item, pytest.Function):
        return None
    servers = SERVER_FIXTURES & set(item.fixturenames)
    if servers:
        return f"uses the server fixture {min(servers)}"
    reason = _reason_in(item.obj)
    if reason:
        return f"starts {reason}"
    for name, definitions in item._fixtureinfo.name2fixturedefs.items():
        reason = _reason_in(definitions[-1].func)
        if reason:
            return f"starts {reason} in fixture {name}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("integration") is None and integration_reason(item):
            item.add_marker(pytest.mark.integration)


# ------------------------------------------------------------------ the marker kept true


class _ProcessWatch:
    """Records the processes and servers started while an unmarked test runs (its
    setup included), by its own thread: a thread an earlier test left running is not
    this test's doing."""

    # Audit events that start a process (``sys.addaudithook``).
    EVENTS = ("subprocess.Popen", "os.system", "os.posix_spawn", "os.spawn", "os.fork", "tests.forked_python")

    def __init__(self) -> None:
        self.watching = False
        self.started: list[str] = []

    def note(self, what: str) -> None:
        if self.watching and threading.current_thread() is threading.main_thread():
            self.started.append(what)

    def audit(self, event: str, args: tuple) -> None:
        if event in self.EVENTS:
            self.note(f"{event} {args[:2]!r}"[:200])

    def wrap_start(self, start: Any) -> Any:
        """``BaseProcess.start``, noting the process first: a forkserver's children
        raise no audit event in this process."""

        def watched_start(process: multiprocessing.process.BaseProcess) -> None:
            self.note(f"multiprocessing process {process.name}")
            start(process)

        return watched_start


_WATCH = _ProcessWatch()
sys.addaudithook(_WATCH.audit)  # subprocess, os.fork and os.system raise audit events
multiprocessing.process.BaseProcess.start = _WATCH.wrap_start(multiprocessing.process.BaseProcess.start)


@contextmanager
def _in_process_only(item: pytest.Item) -> Iterator[None]:
    if item.get_closest_marker("integration") is not None:
        yield
        return
    _WATCH.started.clear()
    _WATCH.watching = True
    try:
        yield
    finally:
        _WATCH.watching = False
    if _WATCH.started:
        started, more = "; ".join(_WATCH.started[:3]), len(_WATCH.started) - 3
        pytest.fail(
            f"{item.nodeid} is not marked integration but started {started}{f' and {more} more' if more > 0 else ''}. "
            "Start processes through tests.dist.run_distributed or subprocess (collection then marks "
            "the test), or mark it with @pytest.mark.integration (tests/README.md).", pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with _in_process_only(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _in_process_only(item):
        return (yield)
