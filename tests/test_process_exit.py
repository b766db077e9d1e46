"""After ``destroy_process_group``, shardstore leaves nothing of the process group running.

A save that failed (ENOSPC), a load, then ``destroy_process_group``: one rank of two died
at exit with "terminate called without an active exception" (SIGABRT) in a few runs. The
process group's gloo threads were still running at exit: shardstore imported
``torch.distributed.checkpoint`` at its first save (``format.pickles``,
``inputs.plain_tensors``), after ``init_process_group``, and that import makes
``torch.distributed.nn.functional`` keep the default process group in its functions'
defaults, so ``destroy_process_group`` could not end it. Each case runs in a fresh
interpreter, as a training script does: shardstore first used after the process group
exists.

A save or a load on 2 ranks, then ``destroy_process_group``: the group's gloo threads
ran on, because shardstore kept the group itself as a key of a table (each group's
message slot, ``protocol.collectives``; the writers' own group, ``tools.dcp_exchange``).
At exit, a gloo worker freeing a finished work's tensors took the GIL of the finalizing
interpreter, which ends the thread, and the unwinding through the work's destructor
called ``std::terminate``: a SIGABRT in about 1 process in 10 of a script that holds
the group (a rank of an S3 save, twice). Those tables hold groups weakly now.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dist import run_distributed

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """
import errno, os, sys
import torch, torch.distributed as dist

dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + "/pg", rank=0, world_size=1)
import shardstore
from shardstore import ShardedTensor
import shardstore.format.chunks as chunks

def state(value):
    return {"w": ShardedTensor.from_rank_offsets("w", torch.full((64, 64), value)), "step": 3}

shardstore.save(state(1.0), sys.argv[1] + "/old")
if sys.argv[2] == "failed save":
    def no_space(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    chunks.ChunkFile.write = no_space
    try:
        shardstore.save(state(2.0), sys.argv[1] + "/new")
        raise AssertionError("the save went through")
    except shardstore.CheckpointingException:
        pass
loaded = shardstore.load(state(0.0), sys.argv[1] + "/old")
assert float(loaded["w"][0, 0]) == 1.0
dist.destroy_process_group()
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
print("gloo threads:", sorted(n for n in names if "gloo" in n))
print("torch.distributed.nn imported:", "torch.distributed.nn" in sys.modules)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the thread names from /proc")
@pytest.mark.parametrize("case", ["failed save", "saved"])
def test_destroy_process_group_ends_the_groups_threads_after_shardstore_used_it(tmp_path: Path, case: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path), case], capture_output=True, text=True, env=env, timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "gloo threads: []" in done.stdout, done.stdout
    assert "torch.distributed.nn imported: False" in done.stdout, done.stdout


def _gloo_threads() -> list[str]:
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return sorted(n for n in names if "gloo" in n)


def save_load_then_destroy(rank: int, world: int, root: str, what: str) -> list[str]:
    import shardstore
    from shardstore import ShardedTensor
    from shardstore.compat.dcp import exchange as dcp_exchange

    if what == "save and load":
        state = {"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 4), float(rank)), (0, rank, world))}
        shardstore.save(state, root)
        shardstore.load(state, root)
    else:
        dcp_exchange.own_group()
    dist.destroy_process_group()
    return _gloo_threads()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the thread names from /proc")
@pytest.mark.parametrize("what", ["save and load", "the writers' own group"])
def test_destroy_process_group_ends_the_groups_threads_after_two_ranks_used_it(tmp_path: Path, what: str) -> None:
    left = run_distributed(save_load_then_destroy, 2, str(tmp_path / "ckpt"), what)
    assert left == [[], []], f"gloo threads still running after destroy_process_group, by rank: {left}"
