"""Issue 34.7: several managers with ``save_on_preemption`` in one process. SIGTERM
reaches every one of them and the handler that was there before them; the handlers are
put back exactly when the last manager closes, in any order, and a handler someone
installed after them is not clobbered. The process ends as the previous handler (or the
default) says once no manager listens. Managers are created in the main thread only.

The tests whose SIGTERM could end the process (the default action) run in a child
process; the others install a Python handler of their own first, so that pytest's
process never gets SIGTERM's default."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from shardstore import CheckpointingException, ShardedTensor
from shardstore.tools.manager import CheckpointManager, CheckpointManagerOptions
from shardstore.tools.preemption import _Dispatcher

PREEMPTIBLE = CheckpointManagerOptions(save_interval_steps=1000, save_on_preemption=True)


def _state(step: int) -> dict:
    return {"w": ShardedTensor.from_rank_offsets("w", torch.full((4,), float(step))), "step": step}


@pytest.fixture
def user_handler():
    """A SIGTERM handler of the test's own (what a framework or a user installs), counting
    its calls; the handler before it is put back afterwards whatever the test did."""
    calls: list[int] = []

    def handler(signum: int, frame: object) -> None:
        calls.append(signum)

    before = signal.signal(signal.SIGTERM, handler)
    handler.calls = calls  # type: ignore[attr-defined]
    yield handler
    signal.signal(signal.SIGTERM, before)


def _sigterm() -> None:
    # never to a process whose SIGTERM would end it: pytest's, without a handler of ours
    assert callable(signal.getsignal(signal.SIGTERM))
    os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize("close_order", [(0, 1), (1, 0)], ids=["creation order", "reverse order"])
def test_sigterm_reaches_every_manager_and_the_handler_before_them(
    tmp_path: Path, user_handler, close_order: tuple[int, int]
) -> None:
    managers = [CheckpointManager(tmp_path / f"run{i}", PREEMPTIBLE) for i in range(2)]
    for manager in managers:
        assert not manager.save(1, _state(1))  # not due
    _sigterm()
    assert user_handler.calls == [signal.SIGTERM]  # the handler that was there is called too
    for manager in managers:
        assert manager.save(2, _state(2))  # the preemption save, on both
        assert manager.reached_preemption() and manager.all_steps() == [2]
    for i in close_order:
        managers[i].close()
    assert signal.getsignal(signal.SIGTERM) is user_handler  # put back exactly, in either order
    _sigterm()
    assert user_handler.calls == [signal.SIGTERM] * 2


def test_a_handler_installed_after_the_managers_is_left_in_place(
    tmp_path: Path, user_handler
) -> None:
    first = CheckpointManager(tmp_path / "run0", PREEMPTIBLE)
    ours = signal.getsignal(signal.SIGTERM)
    calls = []

    def theirs(signum: int, frame: object) -> None:  # chains to what it replaced, as it should
        calls.append(signum)
        ours(signum, frame)

    signal.signal(signal.SIGTERM, theirs)
    second = CheckpointManager(
        tmp_path / "run1", PREEMPTIBLE
    )  # installs over theirs, chaining to it
    _sigterm()
    assert calls == [signal.SIGTERM] and user_handler.calls == [signal.SIGTERM]  # each handler once
    assert first.save(2, _state(2)) and second.save(2, _state(2))
    second.close()
    assert signal.getsignal(signal.SIGTERM) is theirs  # the one second replaced
    first.close()
    assert signal.getsignal(signal.SIGTERM) is theirs  # not clobbered
    _sigterm()  # ours, with no manager left, passes it on as the handler before it
    assert calls == [signal.SIGTERM] * 2 and user_handler.calls == [signal.SIGTERM] * 2


def test_a_manager_is_created_in_the_main_thread_only(tmp_path: Path, user_handler) -> None:
    errors: list[BaseException] = []

    def create() -> None:
        try:
            CheckpointManager(
                tmp_path, CheckpointManagerOptions(save_on_preemption=True, async_save=True)
            )
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=create, name="trainer-thread")
    thread.start()
    thread.join()
    assert len(errors) == 1 and isinstance(errors[0], CheckpointingException), errors
    assert "main thread" in str(errors[0]) and "trainer-thread" in str(errors[0])
    assert signal.getsignal(signal.SIGTERM) is user_handler  # nothing installed


def test_closing_the_last_manager_in_another_thread_keeps_sigterm_working(
    tmp_path: Path, user_handler
) -> None:
    manager = CheckpointManager(tmp_path / "run0", PREEMPTIBLE)
    closer = threading.Thread(target=manager.close)
    closer.start()
    closer.join()
    installed = signal.getsignal(signal.SIGTERM)
    assert (
        isinstance(installed, _Dispatcher) and not installed.listeners
    )  # cannot be put back from there
    _sigterm()
    assert user_handler.calls == [signal.SIGTERM]  # it behaves as the handler it replaced
    with CheckpointManager(
        tmp_path / "run1", PREEMPTIBLE
    ) as again:  # joins it; closed here: put back
        assert signal.getsignal(signal.SIGTERM) is installed
    assert again.all_steps() == [] and signal.getsignal(signal.SIGTERM) is user_handler


def test_listeners_closed_from_many_threads_at_once_leave_one_consistent_handler(
    user_handler,
) -> None:
    from shardstore.tools.preemption import listen

    counts = [0] * 9

    def counter(i: int):
        def count(signum: int) -> None:
            counts[i] += 1

        return count

    listeners = [listen([signal.SIGTERM], counter(i)) for i in range(9)]
    threads = [threading.Thread(target=listener.close) for listener in listeners[1:]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    installed = signal.getsignal(signal.SIGTERM)
    assert isinstance(installed, _Dispatcher) and installed.listeners == (listeners[0],)
    _sigterm()
    assert counts == [1] + [0] * 8 and user_handler.calls == [signal.SIGTERM]
    listeners[0].close()
    listeners[0].close()  # idempotent
    assert signal.getsignal(signal.SIGTERM) is user_handler


# ------------------------------------------------ in a child process: SIGTERM's default

TWO_MANAGERS = """
import os, signal, sys, time
import torch
from shardstore import ShardedTensor
from shardstore.tools.manager import CheckpointManager, CheckpointManagerOptions

root, close_order = sys.argv[1], [int(i) for i in sys.argv[2].split(",")]
options = CheckpointManagerOptions(save_interval_steps=1000, save_on_preemption=True, async_save=True)
managers = [CheckpointManager(f"{root}/run{i}", options) for i in range(2)]
state = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4))}
print("ready", flush=True)
for step in range(1, 3000):  # the training loop; SIGTERM comes from the parent
    for manager in managers:
        manager.save(step, state)
    if any(manager.reached_preemption() for manager in managers):
        break
    time.sleep(0.01)
print("steps", [manager.all_steps() for manager in managers], flush=True)
for i in close_order:
    managers[i].close()
print("closed", flush=True)
time.sleep(20)  # SIGTERM from the parent ends it here, as the default says
print("still running", flush=True)
"""


@pytest.mark.parametrize("close_order", ["0,1", "1,0"], ids=["creation order", "reverse order"])
def test_two_managers_both_save_on_sigterm_and_then_sigterm_ends_the_process(
    tmp_path: Path, close_order: str
) -> None:
    script = tmp_path / "two_managers.py"
    script.write_text(textwrap.dedent(TWO_MANAGERS))
    child = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), close_order],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        child.send_signal(signal.SIGTERM)  # preemption
        steps = child.stdout.readline().strip()
        closed = child.stdout.readline().strip()
        child.send_signal(signal.SIGTERM)  # no manager listens: the default ends it
        out, err = child.communicate(timeout=60)
    finally:
        child.kill()
    report = f"{steps}\n{closed}\n{out}\n{err}"
    assert steps.startswith("steps") and closed == "closed", report
    found = eval(steps.removeprefix("steps"))  # both saved the step the signal arrived at
    assert len(found[0]) == 1 and found[0] == found[1], report
    assert child.returncode == -signal.SIGTERM, report


STALE_IN_A_CHAIN = """
import os, signal, sys, time
from shardstore.tools.manager import CheckpointManager, CheckpointManagerOptions

manager = CheckpointManager(sys.argv[1], CheckpointManagerOptions(save_on_preemption=True))
ours = signal.getsignal(signal.SIGTERM)

def theirs(signum, frame):  # a handler installed later, calling the one it replaced
    print("theirs", flush=True)
    ours(signum, frame)

signal.signal(signal.SIGTERM, theirs)
manager.close()  # theirs stays; ours, left in their chain, passes SIGTERM on to the default
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(20)
print("still running", flush=True)
"""


def test_a_closed_managers_handler_left_in_a_chain_lets_the_default_end_the_process(
    tmp_path: Path,
) -> None:
    script = tmp_path / "stale.py"
    script.write_text(textwrap.dedent(STALE_IN_A_CHAIN))
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.stdout.split() == ["theirs"], result
    assert result.returncode == -signal.SIGTERM, result


STALE_UNDER_A_LISTENER = """
import os, signal
from shardstore.tools.preemption import listen

first = listen([signal.SIGTERM], lambda signum: print("first", flush=True))
ours = signal.getsignal(signal.SIGTERM)

def theirs(signum, frame):  # installed over the first listener's handler, calling it
    print("theirs", flush=True)
    ours(signum, frame)

signal.signal(signal.SIGTERM, theirs)
second = listen([signal.SIGTERM], lambda signum: print("second", flush=True))
first.close()  # ours stays in their chain, with no listener of its own
os.kill(os.getpid(), signal.SIGTERM)
print("survived", flush=True)  # the second listener still listens: its save comes first
second.close()
"""


def test_a_stale_handler_in_a_chain_holds_the_default_back_while_another_listens(tmp_path: Path) -> None:
    """A listener, a handler installed over it (calling ours), a second listener, the
    first closed: SIGTERM reaches the second listener, then, through their handler,
    the first listener's dispatcher. Before, that dispatcher saw no listener of its own
    and took SIGTERM's default, ending the process before the second listener's
    preemption save; the default is held back while any listener of the signal listens."""
    script = tmp_path / "stale_under_a_listener.py"
    script.write_text(textwrap.dedent(STALE_UNDER_A_LISTENER))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == ["second", "theirs", "survived"], result
    assert result.returncode == 0, result


FORKED_CHILDREN = """
import multiprocessing as mp, os, signal, sys, time
import torch
from shardstore import ShardedTensor
from shardstore.tools.manager import CheckpointManager, CheckpointManagerOptions

OPTIONS = CheckpointManagerOptions(save_interval_steps=1000, save_on_preemption=True)

def idle():
    time.sleep(30)

def own_manager():  # a child that listens for itself
    manager = CheckpointManager(sys.argv[1] + "/child", OPTIONS)
    os.kill(os.getpid(), signal.SIGTERM)
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4))}
    sys.exit(0 if manager.save(1, state) and manager.reached_preemption() else 3)

manager = CheckpointManager(sys.argv[1] + "/parent", OPTIONS)
context = mp.get_context("fork")
for target in (idle, own_manager):
    process = context.Process(target=target)
    process.start()
    if target is idle:
        time.sleep(0.5)
        process.terminate()
    process.join(20)
    print(process.exitcode, flush=True)
    if process.is_alive():
        process.kill()
os.kill(os.getpid(), signal.SIGTERM)  # the parent's manager still holds SIGTERM back
print("parent saved", manager.save(1, {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4))}), flush=True)
manager.close()
"""


def test_a_child_forked_after_a_manager_listens_is_ended_by_sigterm(tmp_path: Path) -> None:
    """A process forked after a manager started listening (a ``multiprocessing`` pool or
    DataLoader worker under the fork start method) inherits the handler, not the
    manager's job: SIGTERM's default must end it. Before, the child's copy of the
    dispatcher still had the parent's listeners and held the default back, so
    ``Process.terminate()`` did nothing and ``Pool.terminate()`` followed by ``join()``
    hung for ever; a manager the child creates itself still hears SIGTERM."""
    script = tmp_path / "forked_children.py"
    script.write_text(textwrap.dedent(FORKED_CHILDREN))
    result = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.stdout.split("\n")[:3] == [str(-signal.SIGTERM), "0", "parent saved True"], result
    assert result.returncode == 0, result


SIGTERM_DURING_CLOSE = """
import os, signal, sys, time
import torch
from shardstore import ShardedTensor
from shardstore.tools.manager import CheckpointManager, CheckpointManagerOptions

options = CheckpointManagerOptions(save_interval_steps=1, save_on_preemption=True, async_save=True)
manager = CheckpointManager(sys.argv[1], options)
manager.save(1, {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4))})
queue_close = manager._saves._queue.close

def close_hit_by_sigterm(*args, **kwargs):  # SIGTERM arrives while close commits the save in flight
    os.kill(os.getpid(), signal.SIGTERM)
    return queue_close(*args, **kwargs)

manager._saves._queue.close = close_hit_by_sigterm
manager.close()
print("closed", flush=True)
time.sleep(20)
print("still running", flush=True)
"""


def test_a_sigterm_during_close_ends_the_process_once_the_save_in_flight_is_committed(tmp_path: Path) -> None:
    """SIGTERM's default is held back while a manager listens, for the save it makes the
    next ``save`` do. A SIGTERM that arrived while ``close`` committed the save in
    flight (or after the last ``save``) was lost: no save acted on it, and ``close`` put
    the old handler back without passing it on, so the job went on running (until the
    scheduler's SIGKILL). Now ``close`` commits, then SIGTERM's default ends the process."""
    script = tmp_path / "sigterm_during_close.py"
    script.write_text(textwrap.dedent(SIGTERM_DURING_CLOSE))
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "run")], capture_output=True, text=True, timeout=120
    )
    assert (tmp_path / "run" / "iter_0000001" / "zarr.json").exists(), result  # committed first
    assert "still running" not in result.stdout, result
    assert result.returncode == -signal.SIGTERM, result
