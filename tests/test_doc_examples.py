"""Every Python example in README.md and docs/**/*.md runs as printed (issues 16.6, 43,
77): the quick start's ``save.py`` on 2 ranks under torchrun and ``load.py`` on 1 rank and
on 2 (so at another world size); the DCP page's ``fsdp.py`` at 2 ranks, then 1; every
other block alone, in a process of its own, at 2 ranks too where its page says torchrun,
with nothing before it: a block that needs a process group starts it itself, and what
else it needs (the quick start's checkpoint on disk, AWS settings naming a server) its
page says just before it. A name the block uses and does not define fails here, and a
block added to a page runs without anyone adding it to this file.

torch 2.13's gloo backend can abort a process at interpreter exit ("terminate called
without an active exception", pytorch/pytorch#190489: its worker threads outlive the
interpreter), seen here about 1 run in 3 without ``destroy_process_group`` and rarely,
under load, with it. The scripts print a marker as their last statement; a run whose
every process printed it and then died of exactly that abort passed (everything it
does, and every check it makes, ran); any other failure fails the test.

Issue 33.8: the checkpoint manager's loop, stopped in the middle (a crash, SIGTERM) and
run again, trains every step exactly once."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from shardstore.testing import free_port
from tests import forked_python

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# Every page whose examples run here: the README and the documentation site's pages.
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
GUIDE = ROOT / "docs" / "guide"


def _page_name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _python_blocks(page: Path, after: str = "") -> list[str]:
    text = page.read_text()
    return re.findall(r"```python\n(.*?)```", text[text.index(after):] if after else text, flags=re.S)


def _quick_start_blocks() -> tuple[str, str]:
    blocks = _python_blocks(README, "## Quick start")
    return blocks[0], blocks[1]  # save.py, load.py


def test_the_guide_shows_the_readmes_quick_start() -> None:
    """The guide's first checkpoint is the README's quick start, word for word (run once,
    below, at 2 ranks and 1)."""
    guide = _python_blocks(GUIDE / "saving-and-loading.md", "## A first checkpoint")
    assert tuple(guide[:2]) == _quick_start_blocks()


def _written_checkpoint(script: str) -> str:
    """The directory a quick start script uses when ``CKPT`` is not set."""
    match = re.search(r'os\.environ\.get\("CKPT", "([^"]+)"\)', script)
    assert match, script
    return match.group(1)


def _in_test_directory(text: str, tmp_path: Path) -> str:
    """``text`` with the README's checkpoint directories (``/tmp/ckpt/``, ``/ckpt/``) moved
    into ``tmp_path``."""
    return re.sub(r"(?<![\w/])(?:/tmp)?/ckpt/", f"{tmp_path}/ckpt/", text)


def _run(script: Path, ranks: int, ckpt: Path, env: dict[str, str] | None = None, what: str = "",
         launch: str = "auto") -> None:
    """``script`` on ``ranks`` processes in its directory, with ``CKPT`` set to ``ckpt``;
    every process must print the marker. ``launch``: ``"auto"``, plain Python at 1 rank and
    ``"workers"`` above; ``"workers"``, forked Pythons (``tests.forked_python``: torch and
    shardstore already imported) with the environment torchrun gives its workers;
    ``"torchrun"``, torchrun itself, each process a fresh interpreter (the quick start's
    save, once)."""
    env = {**(env or os.environ), "CKPT": str(ckpt)}
    if launch == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
                   "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(script)]
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180, cwd=script.parent)
    elif ranks == 1 and launch == "auto":
        result = forked_python.run([sys.executable, str(script)], env=env, timeout=180, cwd=script.parent)
    else:
        result = forked_python.run_ranks([sys.executable, str(script)], ranks, env=env, timeout=180,
                                         cwd=script.parent)
    _check_finished(result, ranks, f"{what or script.name} on {ranks} rank(s)")


DONE = "shardstore-readme-test: done"
EXIT_ABORT = "terminate called without an active exception"


def _finished(script: str) -> str:
    """The script with the marker as its last statement."""
    return f"{script}\nprint({DONE!r}, flush=True)\n"


def _check_finished(result: subprocess.CompletedProcess, processes: int, what: str) -> None:
    report = f"{what}:\n{result.stdout}\n{result.stderr}"
    all_done = result.stdout.count(DONE) == processes
    assert all_done, report
    assert result.returncode == 0 or EXIT_ABORT in result.stderr, report


def test_quick_start_runs_as_written(tmp_path: Path) -> None:
    save_py, load_py = _quick_start_blocks()
    (tmp_path / "save.py").write_text(_finished(save_py))
    (tmp_path / "load.py").write_text(_finished(load_py))
    ckpt = tmp_path / "ckpt" / "iter_0001000"
    _run(tmp_path / "save.py", 2, ckpt, launch="torchrun")
    _run(tmp_path / "load.py", 1, ckpt)
    _run(tmp_path / "load.py", 2, ckpt)
    # the shardstore command's block reads the same checkpoint (its output there is another's)
    for command in _cli_commands_on(_written_checkpoint(save_py)):
        args = shlex.split(_in_test_directory(command, tmp_path))
        assert args[0] == "shardstore", command
        result = forked_python.run([str(Path(sys.executable).parent / "shardstore"), *args[1:]], timeout=180)
        assert result.returncode == 0, f"{command}:\n{result.stdout}\n{result.stderr}"
        assert str(ckpt) in result.stdout, result.stdout


def _blocks() -> list[str]:
    """Every fenced block of every page."""
    return [block for page in PAGES for block in re.findall(r"```\w*\n(.*?)```", page.read_text(), flags=re.S)]


def _cli_commands_on(checkpoint: str) -> list[str]:
    """The pages' ``shardstore inspect`` and ``verify`` command lines on ``checkpoint``."""
    lines = (line for block in _blocks() for line in block.splitlines())
    commands = [line[2:].split("#")[0].strip() for line in lines if line.startswith("$ shardstore ")]
    return [c for c in commands if c.split()[1] in ("inspect", "verify") and c.split()[-1] == checkpoint]


def test_every_block_names_the_checkpoint_the_quick_start_writes() -> None:
    """The shardstore command's block and the plain readers' read what ``save.py`` wrote
    (they named ``/ckpt/iter_0001000``, ``save.py`` wrote ``/tmp/ckpt/iter_0001000``)."""
    save_py, load_py = _quick_start_blocks()
    written = _written_checkpoint(save_py)
    assert _written_checkpoint(load_py) == written
    named = {path for block in _blocks() for path in re.findall(r"[^\s\"'(]*iter_0001000\b", block)}
    # another tool's checkpoint and an S3 prefix, named as such; no other local copy
    assert named - {written} <= {"/megatron/iter_0001000", "s3://my-bucket/run7/iter_0001000",
                                 "s3://scratch/run1/iter_0001000"}, named
    plain = next(block for block in _blocks() if block.startswith("import zarr"))
    assert f'ckpt = "{written}"' in plain and '["packed_arrays"]["decoder/fc1"]' in plain
    assert {c.split()[1] for c in _cli_commands_on(written)} == {"inspect", "verify"}


# ------------------------------------------------ the pages' other Python blocks

# Each runs as printed, alone, in a process of its own: nothing is put before it, and a
# block that needs a process group starts it itself (under torchrun). What the test adds:
# ``/tmp/ckpt/`` and ``/ckpt/`` paths point into the test's directory; a block whose page
# says just before it that it reads the quick start's checkpoint runs after save.py, and
# one whose page says its endpoint comes from the AWS settings gets a local S3 server
# there, with the bucket it names; a fragment's ``check`` runs after the block (before
# its closing ``destroy_process_group``). A block no fragment names runs too, checked by
# its own asserts only: a new block is tested without anyone adding it here.


@dataclass(frozen=True)
class Fragment:
    """How the test runs the block that holds ``marker``: as printed, then ``check`` (what
    it must leave behind) in the same process."""

    marker: str
    check: str = ""
    # run after the quick start's save.py (at 2 ranks), whose checkpoint it reads: its page says so
    reads_the_quick_start: bool = False
    # a run at each; > 1: as torchrun's workers. A block its page runs under torchrun runs at 2 too.
    ranks: tuple[int, ...] = (1,)
    # "workers": every run as torchrun's workers, 1 rank included (its page says torchrun only)
    launch: str = "auto"
    needs_megatron: bool = False  # skipped where megatron-core is not installed


FRAGMENTS = (
    # before "import zarr", which its block holds too (the first fragment named in a block is its own)
    Fragment("pack_arrays_up_to=65536))", check=(
        "import os\n"  # the array in its pack only: no directory of its own
        "assert pack == 'packs/0-0.zip' and not os.path.exists(f'{ckpt}/decoder/norm')\n"
        "assert (from_zarr == norm.numpy()).all() and (from_tensorstore == norm.numpy()).all()\n"
    )),
    Fragment("layout=StorageLayout(pack_arrays_up_to=0))", check=(
        "import os\n"  # the chosen layout recorded, then the caller's field kept
        "assert not os.path.exists(f'{ckpt}/packs') and os.path.exists(f'{ckpt}/norm/zarr.json')\n"
        "layout = json.load(open(f'{ckpt}/zarr.json'))['attributes']['shardstore']['layout']\n"
        "assert layout['pack_arrays_up_to'] == 0 and layout['zarr_metadata'] == 'per_node'\n"
    )),
    Fragment('zarr_metadata="consolidated_only"', check=(
        "import os\n"  # no array document: only the root's
        "assert sorted(os.listdir(f'{ckpt}/decoder/fc1')) == ['c.0.0'] and not os.path.exists(f'{ckpt}/decoder/zarr.json')\n"
        "assert (from_zarr == weight.numpy()).all() and (from_tensorstore == weight.numpy()).all()\n"
    )),
    Fragment("shardstore.tools.megatron_strategy import", needs_megatron=True, launch="workers", check=(
        "assert torch.equal(state['fc1'], fc1.chunk(world)[rank])\n"
        "from shardstore import verify\nassert verify(ckpt_dir).ok\n"
    )),
    Fragment("shardstore.megatron.install()", needs_megatron=True, check=(
        # the calls went through shardstore; Megatron-LM's 0.19 keywords too
        "from shardstore import verify\n"
        "assert torch.equal(state['fc1'], fc1.chunk(world)[rank])\n"
        "assert verify(ckpt).ok and dist_checkpointing.load_content_metadata(ckpt) == {'layout': 'tp'}\n"
        "dist_checkpointing.save(sharded_state_dict, ckpt, None, verify_integrity=True, content_metadata={'n': 2})\n"
        "state = dist_checkpointing.load(sharded_state_dict, ckpt, None, verify_integrity=True)\n"
        "assert torch.equal(state['fc1'], fc1.chunk(world)[rank])\n"
        "assert dist_checkpointing.load_content_metadata(ckpt) == {'n': 2}\n"
        "shardstore.megatron.uninstall()\n"
    )),
    # before "CheckpointManager(", which its block holds too: FSDP2 through the manager, torchrun only
    Fragment('CheckpointManager("/tmp/ckpt/fsdp-run"', launch="workers", check=(
        "assert manager.latest_step() == total_steps - 1 and scheduler.last_epoch == total_steps\n"
    )),
    # before "CheckpointManager(", which its block holds too: a Stateful item, restored by a restart
    Fragment("def load_state_dict(self", check=(
        "assert state['data']['loader'] is loader and manager.all_steps() == [0, 1, 2]\n"
    )),
    Fragment("CheckpointManager(", check=(
        "assert manager.latest_step() == 2000, manager.latest_step()\n"
        "assert torch.equal(weight, torch.full((4,), float(total_steps))) and state['steps_trained'] == total_steps\n"
        "assert scheduler.last_epoch == total_steps and scheduler.get_last_lr() == [0.1 * 0.5 ** 2]\n"
    )),
    Fragment("AsyncCallsQueue", check=(
        "state = dist_checkpointing.load({'fc1': ShardedTensor.from_rank_offsets('decoder/fc1', torch.empty(8, 4))},\n"
        "                                f'{root}/iter_0000003')\n"
        "assert torch.equal(state['fc1'], torch.full((8, 4), 3.0)), state  # step 3's snapshot\n"
    )),
    Fragment("s3://my-bucket", check=(
        "meta = dist_checkpointing.load_tensors_metadata('s3://my-bucket/run7/iter_0001000')\n"
        "assert meta['decoder/fc1'].global_shape == (8, 4)\n"
    )),
    Fragment("LocalS3Server", check="import os\nassert os.environ['AWS_ENDPOINT_URL'] == server.endpoint\n"),
    Fragment("import zarr", reads_the_quick_start=True, check=(
        "import torch\ntorch.manual_seed(0)\n"
        "assert (weight == torch.randn(8, 4).numpy()).all() and (arr.read().result() == weight).all()\n"
    )),
    # before "reuse_from=", which its block holds too
    Fragment("max_chunk_bytes=64 * 2**10", check=(
        # 15 of the 16 chunks shared; at the default chunk size the changed row rewrites all
        "from shardstore.format.records import read_commit_record\n"
        "from shardstore.stores.locations import open_location\n"
        "shared = read_commit_record(open_location(f'{root}/step2')).reused_from\n"
        "assert shared is not None and shared.chunks == 15, shared\n"
        "save(state(), f'{root}/default1')\n"
        "embedding[3] += 0.1\n"
        "save(state(), f'{root}/default2', reuse_from=f'{root}/default1')\n"
        "assert read_commit_record(open_location(f'{root}/default2')).reused_from is None\n"
    )),
    Fragment("reuse_from=", check=(
        "from shardstore.format.records import read_commit_record\n"
        "from shardstore.stores.locations import open_location\n"
        "shared = read_commit_record(open_location(f'{root}/step2')).reused_from\n"
        "assert shared is not None and shared.chunks == 1, shared  # the base, not written again\n"
        "loaded = load(state(), f'{root}/step2')\n"
        "assert torch.equal(loaded['adapter'], torch.ones(8, 64)) and torch.equal(loaded['base'], base)\n"
    )),
    Fragment('storage_writer=ShardstoreWriter(f"{root}/dcp")', check=(
        "arrays = shardstore.load_tensors_metadata(f'{root}/dcp')\n"
        "assert {'model.0.weight', 'optim.state.0.weight.exp_avg'} <= set(arrays), sorted(arrays)\n"
        "assert torch.equal(new_model[0].weight, model[0].weight)  # loaded by the second way too\n"
    )),
    Fragment("DefaultSavePlanner(enable_plan_caching=True)", check=(
        # the later saves went through DCP's cache; each is a checkpoint of its own, with its values
        "import os\nimport shardstore\nfrom torch.distributed.checkpoint.planner import SavePlanner\n"
        "from shardstore import ShardstoreReader\n"
        "assert SavePlanner._cached_all_plans\n"
        "root = os.path.dirname(os.environ['CKPT'])\n"
        "for step in range(3):\n"
        "    back = {'weight': torch.zeros(256, 64), 'step': -1}\n"
        "    dcp.load(back, storage_reader=ShardstoreReader(f'{root}/step-{step}'))\n"
        "    assert torch.equal(back['weight'], torch.full((256, 64), step + 1.0)) and back['step'] == step, back\n"
        "    assert shardstore.verify(f'{root}/step-{step}').ok\n"
    )),
    Fragment("ZarrSaveShardedStrategy(cache_plan=True)", check=(
        # the reused plans wrote complete checkpoints, each with its own values
        "for step in (100, 200, 300):\n"
        "    back = shardstore.load({'w': ShardedTensor.from_rank_offsets('w', torch.zeros(8, 4))}, f'{root}/step{step}')\n"
        "    assert torch.equal(back['w'], torch.full((8, 4), float(step))) and shardstore.verify(f'{root}/step{step}').ok\n"
    )),
    Fragment("ZarrSaveShardedStrategy(shard_bytes=", ranks=(1, 2), check=(
        "import os\n"  # each array's 8 chunks of 16 KiB are one shard file
        "assert all(sorted(os.listdir(f'{ckpt}/{k}')) == ['c.0.0', 'zarr.json'] for k in state), os.listdir(ckpt)\n"
    )),
    Fragment("from_rank_offsets_flat(key", ranks=(1, 2), check=(
        # one array of the global shape, whatever the ranks' cuts
        "assert shardstore.load_tensors_metadata(ckpt)[key].global_shape == (5, 4)\n"
        "assert shardstore.verify(ckpt).ok\n"
    )),
    Fragment('"/tmp/ckpt/guarantees/step-1"', check=(
        # the damaged chunk named, by verify and by load
        "assert [(p.key, p.part) for p in report.problems] == [('weight', 'c.0')], report.problems\n"
        "try:\n"
        "    shardstore.load(state(), ckpt)\n"
        "    raise AssertionError('a damaged chunk loaded')\n"
        "except CheckpointingException as error:\n"
        "    assert 'c.0' in str(error) and 'weight' in str(error), error\n"
    )),
    Fragment("rows = torch.empty(8 // world, 4)", reads_the_quick_start=True, ranks=(2, 4), check=(
        # the request's own tensor, filled with this rank's rows of save.py's fc1
        "torch.manual_seed(0)\n"
        "assert state['fc1'] is rows and torch.equal(rows, torch.randn(8, 4).chunk(world)[rank])\n"
    )),
)


def _fsdp_block() -> str:
    return _python_blocks(GUIDE / "dcp-fsdp2.md", "## A complete script")[0]


def _fragments() -> list[tuple[str, Fragment, str]]:
    """(page, fragment, block) for every Python block of every page but the scripts the
    tests above and below run whole (the quick start's and ``fsdp.py``): the first
    fragment whose marker the block holds, or a bare one (its block's own asserts)."""
    scripts = {*_quick_start_blocks(), _fsdp_block()}
    found = []
    for page in PAGES:
        for block in _python_blocks(page):
            if block in scripts:
                continue
            fragment = next((f for f in FRAGMENTS if f.marker in block), None)
            found.append((_page_name(page), fragment or Fragment(marker=block.splitlines()[0]), block))
    return found


def test_every_fragment_names_one_block() -> None:
    """A fragment whose block was changed or removed is not left behind checking nothing,
    and no two blocks share one."""
    markers = [fragment.marker for _, fragment, _ in _fragments() if fragment in FRAGMENTS]
    assert sorted(markers) == sorted(f.marker for f in FRAGMENTS), markers


def test_a_block_that_reads_the_quick_starts_checkpoint_says_so() -> None:
    """What a block needs beyond itself, its page says just before it."""
    for page, fragment, block in _fragments():
        if fragment.reads_the_quick_start:
            assert re.search(r"quick\sstart", _said_before(page, block, 600)), f"{page}: {fragment.marker}"


def _said_before(page: str, block: str, chars: int = 400) -> str:
    """The ``chars`` characters of ``page`` just before ``block``."""
    text = (ROOT / page).read_text()
    return text[:text.index(block)][-chars:]


def _says_torchrun(page: str, block: str) -> bool:
    """Whether the block, or the paragraph just before it, says it runs under torchrun."""
    return "torchrun" in block or "torchrun" in _said_before(page, block)


def _s3_bucket(page: str, block: str) -> str | None:
    """The bucket a block saves to when its page says, just before it, that the endpoint
    comes from the AWS settings (the test then makes them name a local S3 server)."""
    match = re.search(r"s3://([a-z0-9.-]+)/", block)
    return match.group(1) if match and "AWS settings" in _said_before(page, block) else None


def _with_check(block: str, check: str) -> str:
    """The block, then ``check``: before its closing ``destroy_process_group`` if it has
    one, so that the check runs while the block's process group is up."""
    closing = re.search(r"^if dist\.is_initialized\(\):\n    dist\.destroy_process_group\(\).*\n\Z|"
                        r"^dist\.destroy_process_group\(\).*\n\Z", block, flags=re.M)
    if closing is None:
        return block + check
    return block[:closing.start()] + check + block[closing.start():]


def _fragment_script(tmp_path: Path, block: str, check: str, before: str = "") -> str:
    """A page's block as a script: ``before`` (the manager test's interruptions), the block
    with its checkpoint directories in ``tmp_path`` and ``check``, then the marker."""
    return _finished(before + _with_check(_in_test_directory(block, tmp_path), check))


def _fragment_id(page: str, fragment: Fragment) -> str:
    if fragment not in FRAGMENTS:
        return f"{Path(page).stem}:{fragment.marker[:24]}"
    return f"{Path(page).stem}:{fragment.marker.split('(')[0].split()[-1]}"


@pytest.fixture(scope="module")
def quick_start_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the quick start's ``save.py`` writes at 2 ranks, once for the blocks that read it."""
    directory = tmp_path_factory.mktemp("quick-start")
    (directory / "save.py").write_text(_finished(_quick_start_blocks()[0]))
    _run(directory / "save.py", 2, directory / "ckpt" / "iter_0001000")
    return directory / "ckpt" / "iter_0001000"


def _runs() -> list[tuple[str, Fragment, str, int]]:
    """Each block at each of its rank counts: its fragment's, and 2 where its page says torchrun."""
    runs = []
    for page, fragment, block in _fragments():
        ranks = sorted({*fragment.ranks, *((2,) if _says_torchrun(page, block) else ())})
        runs += [(page, fragment, block, n) for n in ranks]
    return runs


@pytest.mark.parametrize("page, fragment, block, ranks", _runs(),
                         ids=[f"{_fragment_id(p, f)}@{n}" for p, f, _, n in _runs()])
def test_page_blocks_run_as_written(
    tmp_path: Path, page: str, fragment: Fragment, block: str, ranks: int, request: pytest.FixtureRequest
) -> None:
    if fragment.needs_megatron and importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core not installed (it needs torch>=2.6: scripts/oldest_torch.sh below that)")
    ckpt = tmp_path / "ckpt" / "iter_0001000"
    if fragment.reads_the_quick_start:  # a copy: the block may write beside it
        shutil.copytree(request.getfixturevalue("quick_start_checkpoint"), ckpt)
    (tmp_path / "block.py").write_text(_fragment_script(tmp_path, block, fragment.check))
    env = {**os.environ, "CKPT": str(ckpt)}
    bucket = _s3_bucket(page, block)
    if bucket is not None:
        server = request.getfixturevalue("moto_server")  # the run's one
        server.create_bucket(bucket)
        env.update(AWS_ENDPOINT_URL=server.endpoint, AWS_ACCESS_KEY_ID=server.key,
                   AWS_SECRET_ACCESS_KEY=server.secret, AWS_REGION=server.region)
    _run(tmp_path / "block.py", ranks, ckpt, env=env, what=f"{page}: {fragment.marker}", launch=fragment.launch)


def test_every_block_its_page_runs_under_torchrun_runs_at_2_ranks() -> None:
    """A block whose page (the block, or the paragraph just before it) says it runs
    under torchrun runs here at 2 ranks: a path made on each rank
    (``tempfile.mkdtemp()``) fails there, not at 1; a block that starts no process
    group saves as two 1-rank jobs there, and fails."""
    at_2 = {(page, block) for page, _, block, ranks in _runs() if ranks == 2}
    for page, fragment, block in _fragments():
        if _says_torchrun(page, block):
            assert (page, block) in at_2, f"{page}: {fragment.marker}"
    assert any("megatron" in page for page, _ in at_2), "the Megatron page's blocks say torchrun"


# ------------------------------------------------ the DCP page's script


def test_fsdp_section_saves_at_2_ranks_and_loads_at_1(tmp_path: Path) -> None:
    """As docs/guide/dcp-fsdp2.md says: ``torchrun --nproc-per-node 2 fsdp.py`` trains a step and
    saves it (here with torchrun's environment, ``_run``); run again at 1 rank, the script
    loads it resharded and checks it."""
    from shardstore import verify

    (tmp_path / "fsdp.py").write_text(_finished(_fsdp_block()))
    for ranks in (2, 1):
        _run(tmp_path / "fsdp.py", ranks, tmp_path / "ckpt", launch="workers")
    assert verify(tmp_path / "ckpt" / "step-1").ok


# ------------------------------------------------ the manager's loop, killed and restarted

# Issue 33.8: run as written (docs/guide/manager.md), the loop trains every step once however it is stopped. The
# first run stops at step 2200 (2000's async save still in flight: lost, 1000 is the newest
# committed step) by a crash (the process exits at once after that step's save) or at step
# 1500 by SIGTERM (its preemption save commits, the loop ends); the second run finishes.
_INTERRUPTIONS = """
import os
import signal
from shardstore.tools.manager import CheckpointManager
_save = CheckpointManager.save
def _save_then_interrupt(self, step, *args, **kwargs):
    if step == STOP_AT and HOW == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    saved = _save(self, step, *args, **kwargs)
    if step == STOP_AT and HOW == "crash":
        os._exit(3)
    return saved
CheckpointManager.save = _save_then_interrupt
"""


def _manager_block() -> str:
    return _python_blocks(GUIDE / "manager.md", "## The loop")[0]


def _total_steps(block: str) -> int:
    """The run's length the manager's block sets."""
    match = re.search(r"^total_steps = (\d+)", block, flags=re.M)
    assert match, block
    return int(match.group(1))


# A crash at 2200: step 2000's async save commits at the first step after its writes
# finished (a save that is not due finalizes it), so the run resumes from 2000, or from
# 1000 where those writes were still going at 2200 (a busy machine).
@pytest.mark.parametrize(("how", "stop_at", "resumed_from"), [("crash", 2200, (1000, 2000)), ("sigterm", 1500, (1500,))])
def test_the_manager_loop_trains_each_step_once_across_a_restart(
    tmp_path: Path, how: str, stop_at: int, resumed_from: tuple[int, ...]
) -> None:
    from shardstore import CheckpointManager

    total_steps = _total_steps(_manager_block())
    assert stop_at < total_steps
    check = (
        "print('steps trained', int(weight[0]), state['steps_trained'], flush=True)\n"
        f"assert torch.equal(weight, torch.full((4,), {total_steps}.0)), weight\n"
        f"assert state['steps_trained'] == {total_steps}, state\n"
        f"assert scheduler.last_epoch == {total_steps}, scheduler.last_epoch  # the items, restored\n"
        f"assert scheduler.get_last_lr() == [0.1 * 0.5 ** {total_steps // 1000}], scheduler.get_last_lr()\n"
    )
    env = {**os.environ, "CKPT": str(tmp_path / "ckpt" / "iter_0001000")}
    results = []
    for run, interruption in enumerate((f"HOW, STOP_AT = {how!r}, {stop_at}\n", "HOW, STOP_AT = None, None\n")):
        script = tmp_path / f"run{run}.py"
        script.write_text(_fragment_script(tmp_path, _manager_block(), check if run else "",
                                           before=interruption + _INTERRUPTIONS))
        results.append(forked_python.run([sys.executable, str(script)], env=env, timeout=300, cwd=tmp_path))
        if run == 0:
            first = results[0]
            report = f"{first.stdout}\n{first.stderr}"
            if how == "crash":
                assert first.returncode == 3 and DONE not in first.stdout, report
            else:
                _check_finished(first, 1, "the run stopped by SIGTERM")
            assert CheckpointManager(tmp_path / "ckpt" / "run1").latest_step() in resumed_from, report
    _check_finished(results[1], 1, "the restarted run")
