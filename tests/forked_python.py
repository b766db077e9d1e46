"""Python processes for the tests, forked from one that has already imported torch,
tensorstore, zarr, shardstore and megatron-core (where installed).

A test that runs a script, a module or the ``shardstore`` command "in a process of its
own" pays about 3-5 s on 2 cores for the interpreter's start and those imports; forked
from this module's server it pays about 0.1 s. The process is still a process of its
own: its own pid (not a process group leader: ``os.setsid`` works), file descriptors
0-2 (pipes the test reads, as ``subprocess`` gives), environment, working directory,
``sys.argv`` and ``sys.path[0]``, and a fresh ``__main__``, so a name a script uses and
does not define still fails. It starts with fresh random seeds (Python's, numpy's,
torch's), torch's thread count from ``OMP_NUM_THREADS`` and the temporary directory from
``TMPDIR``, and ends as the interpreter would: non-daemon threads joined, ``atexit``
functions run, its globals finalized, the standard streams flushed (exit status 120 when
that fails, as Python's), an uncaught exception through ``sys.excepthook`` (exit status
1; ``KeyboardInterrupt``: ended by SIGINT).

What differs from ``subprocess``, so tests that depend on it keep a real interpreter:
modules imported by the server are already in ``sys.modules`` (a test that a module is
*not* imported needs a real one) and read their settings from the environment when the
server imported them; ``sys.path`` and the standard streams' buffering come from the
server's start (``PYTHONPATH`` and ``PYTHONUNBUFFERED`` in ``env`` are not re-read), and
so does the ``hash()`` seed (every forked process has the server's, as every rank of
``tests.dist`` has its forkserver's); interpreter options (``-X``, ``-W``) are not
supported. ``kill`` ends the program and every process it started in its group.

``run_ranks(command, ranks, ...)`` runs a script as ``torchrun --nproc-per-node=RANKS``
would: one process per rank, each with the environment torchrun gives its workers
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` on 127.0.0.1
and a free port, ...), without torchrun's launcher: no elastic agent, no restarts.

``run(command, ...)`` is ``subprocess.run(command, capture_output=True, ...)`` for the
commands ``[sys.executable, script | -m module | -c code, *args]`` and
``[<a console script of this environment>, *args]``; ``ForkedPython(command, ...)`` is
the ``Popen`` for a test that reads or closes the pipes itself.
"""

from __future__ import annotations

__all__ = ["ForkedPython", "run", "run_ranks"]

import atexit
import gc
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from importlib.metadata import entry_points
from pathlib import Path
from typing import IO, Any

# What the server imports before it forks (a module that is not installed is skipped).
PRELOAD = (
    "torch", "numpy", "tensorstore", "zarr", "click", "shardstore", "shardstore.core",
    "shardstore.strategies.zarr", "shardstore.tools.cli", "shardstore.tools.inspection",
    "shardstore.tools.manager", "shardstore.compat.dcp.writer", "torch.distributed.run",
    "megatron.core.dist_checkpointing", "shardstore.megatron",
)
_EXIT_FLUSH_FAILED = 120  # what Python exits with when flushing stdout at exit fails
# How long a request may wait for the server to fork the program (its first start
# imports torch, megatron-core and the rest: about 5-10 s on 2 cores).
_START_S = 120.0
# How long run_ranks lets the other ranks finish after one failed, before it kills them.
_PEERS_OF_A_FAILED_RANK_S = 10.0


# ------------------------------------------------------------------ the test's side


class _Server:
    """The forking server: started at first use, once per test process."""

    _lock = threading.Lock()
    _socket: socket.socket | None = None
    _process: subprocess.Popen | None = None

    @classmethod
    def request(cls, message: dict[str, Any], fds: list[int]) -> None:
        with cls._lock:
            if cls._process is None or cls._process.poll() is not None:
                cls._start()
            assert cls._socket is not None
            socket.send_fds(cls._socket, [json.dumps(message).encode()], fds)

    @classmethod
    def _start(cls) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # a request per message
        cls._process = subprocess.Popen(
            [sys.executable, "-c", f"import tests.forked_python as f; f._serve({theirs.fileno()})"],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            cwd=Path(__file__).resolve().parent.parent,
        )
        theirs.close()
        cls._socket = ours
        atexit.register(cls._stop)

    @classmethod
    def _stop(cls) -> None:
        if cls._socket is not None:
            cls._socket.close()  # the server's loop ends at end of file
        if cls._process is not None:
            cls._process.wait(timeout=10)


def _target(command: list[str]) -> list[str]:
    """``command`` as the server's argument vector: ``[mode, what, *argv]``."""
    first, rest = command[0], list(command[1:])
    if os.path.realpath(first) == os.path.realpath(sys.executable):
        if rest[:1] == ["-m"]:
            return ["module", rest[1], rest[1], *rest[2:]]
        if rest[:1] == ["-c"]:
            return ["code", rest[1], "-c", *rest[2:]]
        if rest and not rest[0].startswith("-"):
            return ["script", rest[0], *rest]
        raise ValueError(f"forked_python runs a script, -m or -c, not {command}")
    if Path(first).parent == Path(sys.executable).parent:
        (entry,) = entry_points(group="console_scripts", name=Path(first).name)
        return ["entry", entry.value, first, *rest]
    raise ValueError(f"forked_python runs Python and this environment's console scripts, not {command}")


class ForkedPython:
    """``subprocess.Popen(command, stdout=PIPE, stderr=PIPE)`` for a forked Python (the
    module's docstring says which commands, and what differs); ``input`` becomes its
    standard input (end of file after it)."""

    def __init__(self, command: list[str], *, env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None,
                 input: bytes = b"") -> None:
        self.args = command
        message = {"argv": _target(command), "env": dict(os.environ if env is None else env),
                   "cwd": os.fspath(cwd if cwd is not None else os.getcwd())}
        sys.audit("tests.forked_python", command)  # tests/conftest.py's watch of unmarked tests
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        stderr_r, stderr_w = os.pipe()
        status, status_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            try:
                _Server.request(message, [stdin_r, stdout_w, stderr_w, status_theirs.fileno()])
            finally:
                for fd in (stdin_r, stdout_w, stderr_w):
                    os.close(fd)
                status_theirs.close()
            self._status, self._received = status, b""
            status.settimeout(_START_S)
            while b"\n" not in self._received:
                data = status.recv(64)
                if not data:
                    raise RuntimeError(f"the forking server did not start {command}")
                self._received += data
        except BaseException:
            for fd in (stdin_w, stdout_r, stderr_r):
                os.close(fd)
            status.close()
            raise
        started, self._received = self._received.split(b"\n", 1)
        self.pid, self._group = map(int, started.split())
        self.returncode: int | None = None
        self.stdout: IO[bytes] = os.fdopen(stdout_r, "rb")
        self.stderr: IO[bytes] = os.fdopen(stderr_r, "rb")
        threading.Thread(target=_write_and_close, args=(stdin_w, input), daemon=True).start()

    def wait(self, timeout: float | None = None) -> int:
        """The exit status: the code, or minus the signal that ended it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._status.settimeout(left)
            try:
                data = self._status.recv(64)
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            if data:
                self._received += data
                continue
            self._status.close()  # the watcher sends the status, then ends
            self.returncode = int(self._received) if self._received else -signal.SIGKILL
        return self.returncode

    def kill(self) -> None:
        """SIGKILL to the program and every process it started in its group."""
        if self.returncode is None:
            try:
                os.killpg(self._group, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def communicate(self, timeout: float | None = None) -> tuple[bytes, bytes]:
        """Both pipes read to their end (those still open), after the exit status."""
        outputs: dict[str, bytes] = {}
        readers = [threading.Thread(target=_read_all, args=(pipe, name, outputs), daemon=True)
                   for name, pipe in (("stdout", self.stdout), ("stderr", self.stderr)) if not pipe.closed]
        for reader in readers:
            reader.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        self.wait(timeout)
        for reader in readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        return outputs.get("stdout", b""), outputs.get("stderr", b"")


def _write_and_close(fd: int, data: bytes) -> None:
    with os.fdopen(fd, "wb") as pipe:
        try:
            pipe.write(data)
        except BrokenPipeError:
            pass  # the process ended without reading it, as subprocess allows


def _read_all(pipe: IO[bytes], name: str, outputs: dict[str, bytes]) -> None:
    with pipe:
        outputs[name] = pipe.read()


def run(command: list[str], *, env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None,
        timeout: float | None = None, text: bool = True, input: str | bytes = b"") -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, ...)`` in a forked Python: killed,
    with ``subprocess.TimeoutExpired``, after ``timeout`` seconds."""
    process = ForkedPython(command, env=env, cwd=cwd, input=input.encode() if isinstance(input, str) else input)
    try:
        out, err = process.communicate(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    if text:
        return subprocess.CompletedProcess(command, process.returncode, out.decode(errors="replace"),
                                           err.decode(errors="replace"))
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def run_ranks(command: list[str], ranks: int, *, env: dict[str, str] | None = None,
              cwd: str | os.PathLike | None = None, timeout: float | None = None) -> subprocess.CompletedProcess:
    """``command`` on ``ranks`` forked processes with a torchrun worker's environment;
    their outputs in rank order, and the first failing rank's exit status (0 when none
    failed). Every rank is killed when ``timeout`` passes first."""
    from shardstore.testing import free_port

    base = dict(os.environ if env is None else env)
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(ranks),
                LOCAL_WORLD_SIZE=str(ranks), GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_NAME="default",
                ROLE_WORLD_SIZE=str(ranks), TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                TORCHELASTIC_RUN_ID="none")
    base.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it for more than one process
    processes = [ForkedPython(command, env={**base, "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)},
                              cwd=cwd) for r in range(ranks)]
    outputs: list[Any] = [None] * ranks  # each rank's pipes read at once: a full pipe would stall the group

    def communicate(rank: int) -> None:
        try:
            outputs[rank] = processes[rank].communicate(timeout)
        except subprocess.TimeoutExpired as expired:
            outputs[rank] = expired

    readers = [threading.Thread(target=communicate, args=(r,), daemon=True) for r in range(ranks)]
    for reader in readers:
        reader.start()
    failed_at = None
    while any(reader.is_alive() for reader in readers):
        time.sleep(0.1)
        if failed_at is None and any(p.returncode for p in processes):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > _PEERS_OF_A_FAILED_RANK_S:
            for process in processes:  # as torchrun ends the group when a worker fails
                process.kill()
    if any(isinstance(o, subprocess.TimeoutExpired) for o in outputs):
        for process in processes:
            process.kill()
        raise subprocess.TimeoutExpired(command, timeout)
    code = next((p.returncode for p in processes if p.returncode), 0)
    return subprocess.CompletedProcess(command, code, "".join(o.decode(errors="replace") for o, _ in outputs),
                                       "".join(e.decode(errors="replace") for _, e in outputs))


# ------------------------------------------------------------------ the server


def _serve(fd: int) -> None:
    """Imports ``PRELOAD``, then forks a process for each request until end of file."""
    with warnings.catch_warnings():  # a program importing them again would not see them either
        warnings.simplefilter("ignore")
        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except ImportError:
                pass
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the watchers it forks are reaped by the kernel
    with socket.socket(fileno=fd) as requests:
        while True:
            message, fds, _, _ = socket.recv_fds(requests, 1 << 20, 4)
            if not message:
                return
            sys.stdout.flush()
            sys.stderr.flush()
            if os.fork() == 0:
                requests.close()
                _watch(json.loads(message), fds)
            for received in fds:
                os.close(received)


def _watch(message: dict[str, Any], fds: list[int]) -> None:
    """In a forked watcher: forks the program, sends its pid, waits for it and sends its
    exit status (as ``subprocess`` reports it); never returns."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()  # a group the program and what it starts belong to (``kill``), the program not its leader
    status = socket.socket(fileno=fds[3])
    pid = os.fork()
    if pid == 0:
        status.close()
        _program(message, fds[:3])
    for stream in fds[:3]:
        os.close(stream)
    try:
        status.sendall(f"{pid} {os.getpgid(0)}\n".encode())
        _, wait_status = os.waitpid(pid, 0)
        status.sendall(str(os.waitstatus_to_exitcode(wait_status)).encode())
    finally:
        os._exit(0)


def _program(message: dict[str, Any], fds: list[int]) -> None:
    """In the forked program: its process group, streams, directory, environment and
    arguments, then the script, module, code or entry point, and the interpreter's exit."""
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(message["cwd"])
        os.environ.clear()
        os.environ.update(message["env"])
        _as_a_new_interpreter()
        namespaces: list[dict[str, Any]] = []
        code = _main(namespaces, *message["argv"])
        threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter: non-daemon threads first
        atexit._run_exitfuncs()
        for namespace in namespaces:  # its objects finalized (open files flushed), as at the interpreter's exit
            namespace.clear()
        gc.collect()
        code = _flushed(code)
    finally:
        os._exit(code)


def _as_a_new_interpreter() -> None:
    """What a new interpreter would have that the server's fork shares: fresh random
    seeds (Python's, numpy's, torch's), torch's thread count from ``OMP_NUM_THREADS``,
    the temporary directory from ``TMPDIR``. (The ``hash()`` seed stays the server's:
    it is fixed when an interpreter starts.)"""
    import random
    import tempfile

    random.seed()
    tempfile.tempdir = None
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))


def _main(namespaces: list[dict[str, Any]], mode: str, what: str, *argv: str) -> int:
    """Runs ``what`` as ``__main__`` (or its entry point) with ``sys.argv = argv``; its
    exit status as the interpreter would give it. ``namespaces`` receives its globals."""
    import runpy
    import types

    sys.argv = list(argv)
    try:
        if mode == "script":
            sys.path[0] = os.path.dirname(os.path.abspath(what))
            namespaces.append(runpy.run_path(what, run_name="__main__"))
        elif mode == "module":
            sys.path[0] = os.getcwd()
            sys.modules.pop(what, None)  # run afresh as __main__, as ``python -m`` (no "found in sys.modules")
            runpy.run_module(what, run_name="__main__", alter_sys=True)
        elif mode == "code":
            sys.path[0] = ""
            main = types.ModuleType("__main__")  # the real ``__main__``: what it defines pickles by name
            sys.modules["__main__"] = main
            namespaces.append(main.__dict__)
            exec(compile(what, "<string>", "exec"), main.__dict__)
        else:
            sys.path[0] = os.path.dirname(argv[0])  # the console script's directory
            module, _, function = what.partition(":")
            target: Any = importlib.import_module(module)
            for part in function.split("."):
                target = getattr(target, part)
            sys.exit(target())
    except SystemExit as exit_:
        if exit_.code is None:
            return 0
        if isinstance(exit_.code, int):
            return exit_.code & 0xFF
        print(exit_.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt as error:  # the interpreter prints it, then ends by SIGINT
        sys.excepthook(type(error), error, _programs_frames(error))
        _flushed(0)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 1
    except BaseException as error:  # what the interpreter prints for an uncaught exception
        sys.excepthook(type(error), error, _programs_frames(error))
        return 1
    return 0


def _programs_frames(error: BaseException) -> Any:
    """``error``'s traceback without this module's and runpy's frames, as the
    interpreter prints a program's (set on ``error`` too: the hook prints its own)."""
    frames = error.__traceback__
    while frames is not None and (frames.tb_frame.f_code.co_filename == __file__
                                  or "runpy" in frames.tb_frame.f_code.co_filename):
        frames = frames.tb_next
    error.__traceback__ = frames
    return frames


def _flushed(code: int) -> int:
    """``code`` after flushing the standard streams, or 120 where stdout's flush fails."""
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        code = _EXIT_FLUSH_FAILED
    try:
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    return code
