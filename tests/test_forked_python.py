"""tests/forked_python.py behaves as ``subprocess`` running a new interpreter would, where
the tests rely on it (its docstring says what differs)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import forked_python

PYTHON = sys.executable


def test_exit_statuses_are_the_interpreters() -> None:
    cases = {
        "pass": 0, "import sys; sys.exit(3)": 3, "import sys; sys.exit(None)": 0, "import sys; sys.exit(256)": 0,
        "import sys; sys.exit('why')": 1, "raise ValueError('x')": 1, "import os; os._exit(7)": 7,
        "raise KeyboardInterrupt": -signal.SIGINT, "import os, signal; os.kill(os.getpid(), signal.SIGTERM)": -15,
    }
    for code, status in cases.items():
        result = forked_python.run([PYTHON, "-c", code], timeout=60)
        assert result.returncode == status, (code, result)
    failed = forked_python.run([PYTHON, "-c", "raise ValueError('x')"], timeout=60)
    assert failed.stderr.startswith("Traceback") and "forked_python" not in failed.stderr, failed.stderr
    assert failed.stderr.rstrip().endswith("ValueError: x"), failed.stderr


def test_a_script_runs_alone_with_its_arguments_directory_and_environment(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text("import os, sys\nprint(__name__, sys.argv[1:], sys.path[0], os.getcwd(), os.environ['ONLY_HERE'])\n"
                      "print(input().upper())\nprint(undefined)\n")
    result = forked_python.run([PYTHON, str(script), "a", "b"], cwd=tmp_path.parent, input="line\n",
                               env={**os.environ, "ONLY_HERE": "yes"}, timeout=60)
    assert result.stdout.splitlines() == [f"__main__ ['a', 'b'] {tmp_path} {tmp_path.parent} yes", "LINE"], result
    assert result.returncode == 1 and "NameError: name 'undefined' is not defined" in result.stderr, result
    assert "ONLY_HERE" not in os.environ


def test_each_program_starts_with_fresh_seeds_and_the_environments_threads() -> None:
    code = "import random, numpy, torch; print(random.random(), numpy.random.rand(), torch.initial_seed(), " \
           "torch.get_num_threads())"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first, second = (forked_python.run([PYTHON, "-c", code], env=env, timeout=60).stdout.split() for _ in range(2))
    assert first[3] == second[3] == "1"
    assert all(a != b for a, b in zip(first[:3], second[:3], strict=True)), (first, second)


def test_the_end_is_the_interpreters_threads_atexit_and_open_files(tmp_path: Path) -> None:
    out = tmp_path / "left-open.txt"
    code = ("import atexit, threading, time\natexit.register(lambda: print('atexit'))\n"
            "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()\n"
            f"f = open({str(out)!r}, 'w'); f.write('at exit')\n")
    result = forked_python.run([PYTHON, "-c", code], timeout=60)
    assert (result.returncode, result.stdout) == (0, "thread\natexit\n"), result
    assert out.read_text() == "at exit"


def test_a_closed_output_and_a_timeout_end_as_with_subprocess() -> None:
    process = forked_python.ForkedPython([PYTHON, "-c", "import os, sys\nprint('x' * 100000)\nsys.stdout.flush()"])
    process.stdout.close()
    _, err = process.communicate(timeout=60)
    assert process.returncode == 1 and b"BrokenPipeError" in err, (process.returncode, err)
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        forked_python.run([PYTHON, "-c", "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"],
                          timeout=1)
    assert time.monotonic() - start < 10


def test_a_console_script_and_a_module_run_as_their_commands() -> None:
    script = str(Path(PYTHON).with_name("shardstore"))
    version = forked_python.run([script, "--version"], timeout=60)
    module = forked_python.run([PYTHON, "-m", "shardstore.tools.cli", "--version"], timeout=60)
    assert version.returncode == module.returncode == 0 and version.stdout == module.stdout != "", (version, module)
    assert module.stderr == "", module.stderr  # no "found in sys.modules" warning
    with pytest.raises(ValueError, match="console scripts"):
        forked_python.run(["ls"], timeout=60)


def test_run_ranks_gives_each_rank_torchruns_environment(tmp_path: Path) -> None:
    script = tmp_path / "ranks.py"
    script.write_text("import torch.distributed as dist\ndist.init_process_group('gloo')\n"
                      "print(dist.get_rank(), dist.get_world_size(), flush=True)\ndist.destroy_process_group()\n")
    result = forked_python.run_ranks([PYTHON, str(script)], 3, timeout=120)
    assert result.returncode == 0 and sorted(result.stdout.split("\n")[:3]) == ["0 3", "1 3", "2 3"], result
