"""Issue 16.1: the ``shardstore`` command: inspect, verify, convert, diff, with exit
status 0 (fine), 1 (a finding) and 2 (an error that says what to do)."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from shardstore import ShardedObject, ShardedTensor, StorageLayout, load, load_plain_tensors, save
from shardstore.format.features import FORMAT_VERSION
from shardstore.tools.cli import EXIT_CLOSED_OUTPUT, main, parse_size
from tests import forked_python
from tests.dist import run_distributed
from tests.scenarios import assert_bits_equal, global_tensor, grid_shard, rewrite_record

# inspect and verify are checked against each array's own chunk grid and chunk files
PER_ARRAY = StorageLayout(pack_arrays_up_to=0)
FC1 = global_tensor("decoder/fc1", (8, 6), torch.float32)
EMB = global_tensor("embedding/word", (16, 4), torch.bfloat16)


def _save_demo(rank: int, world: int, path: str) -> None:
    save({"model": {"fc1": grid_shard("decoder/fc1", FC1, rank, world, (0,)),
                    "emb": grid_shard("embedding/word", EMB, rank, world, (0,)),
                    "scale": ShardedTensor.from_rank_offsets("decoder/scale", torch.tensor(0.5), replica_id=rank)},
          "rng": ShardedObject("rng_state", torch.tensor([rank, 7]), (world,), (rank,)),
          "iteration": 1000, "args": {"lr": 0.1}}, path, layout=PER_ARRAY)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "iter_0001000"
    run_distributed(_save_demo, 2, str(path))
    return path


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["--no-progress", *args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize("as_json", [False, True])
def test_an_unexpected_error_is_an_error_not_a_finding(demo: Path, monkeypatch, as_json: bool) -> None:
    """A bug (an exception shardstore did not foresee) left the command to Python, which
    exits 1: for ``verify`` the status of damage found, which a cleanup script answers
    by deleting the checkpoint. It now exits 2 with the traceback on stderr."""
    import shardstore.format
    import shardstore.tools.root_verify  # noqa: F401  (imported now: it keeps the real verify)

    def broken(*args, **kwargs):
        raise RuntimeError("injected bug")

    monkeypatch.setattr(shardstore.format, "verify", broken)  # the package's name, which the command imports
    code, out, err = run("verify", *(["--json"] if as_json else []), str(demo))
    assert code == 2
    assert "RuntimeError: injected bug" in err and "not a finding" in err
    if as_json:
        assert json.loads(out) == {"error": "unexpected RuntimeError: injected bug", "exit_status": 2}


def test_restore_of_a_path_that_does_not_exist_is_an_error(demo: Path, tmp_path: Path) -> None:
    """``restore`` of a mistyped path said "nothing to put back" and exited 0, as for a
    checkpoint that needed nothing; it is now an error (2). An existing checkpoint with
    nothing set aside is still 0."""
    code, _, err = run("restore", str(tmp_path / "iter_typo"))
    assert code == 2 and "does not exist" in err
    code, out, _ = run("restore", str(demo))
    assert code == 0 and "nothing to put back" in out


def test_inspect_lists_arrays_objects_common_state_and_format(demo: Path) -> None:
    code, out, _ = run("inspect", str(demo))
    assert code == 0
    assert f"format {FORMAT_VERSION}" in out and "from 2 rank(s)" in out
    assert "decoder/fc1" in out and "[8, 6]" in out and "float32" in out and "chunks [4, 6] x2" in out
    assert "embedding/word" in out and "bfloat16" in out
    assert "rng_state  2 shard(s)" in out
    assert "common state: args, iteration" in out


def test_inspect_of_a_run_root_lists_its_checkpoints(tmp_path: Path) -> None:
    """Issue 77.3: ``inspect`` of a manager's root read as if ``iter_0000007`` were "a
    file a save writes". It lists the checkpoints under it, a damaged record named."""
    from shardstore import CheckpointManager

    with CheckpointManager(tmp_path) as manager:
        for step in (5, 7):
            manager.save(step, {"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}, force=True)
    (tmp_path / "iter_0000009").mkdir()
    (tmp_path / "iter_0000009" / "zarr.json").write_text("{not json")
    code, out, err = run("inspect", str(tmp_path))
    assert code == 0, err
    assert out.startswith(f"run root {tmp_path}: 3 checkpoint(s); `shardstore inspect {tmp_path}/iter_0000007`"), out
    assert re.search(r"iter_0000005  committed .*, 1 arrays, 16 B, 1 rank\(s\), format \d+", out), out
    assert "iter_0000009  commit record does not read" in out and "file a save writes" not in out + err
    code, out, _ = run("ls", "--json", str(tmp_path))
    listed = json.loads(out)
    assert code == 0 and [c["name"] for c in listed["checkpoints"]] == ["iter_0000005", "iter_0000007", "iter_0000009"]
    assert listed["checkpoints"][1]["arrays"] == 1 and listed["checkpoints"][2]["error"]
    code, out, _ = run("inspect", str(tmp_path / "iter_0000007"))  # one of them: its arrays, as before
    assert code == 0 and out.startswith(f"checkpoint {tmp_path}/iter_0000007") and "arrays: 1" in out


def test_inspect_json_is_complete(demo: Path) -> None:
    code, out, _ = run("ls", "--json", str(demo))
    summary = json.loads(out)
    assert code == 0 and summary["world_size"] == 2 and summary["format_version"] == FORMAT_VERSION
    arrays = {a["key"]: a for a in summary["arrays"]}
    assert arrays["decoder/fc1"]["shape"] == [8, 6] and arrays["decoder/fc1"]["nbytes"] == 8 * 6 * 4
    assert arrays["decoder/scale"]["shape"] == []
    assert summary["nbytes"] == 8 * 6 * 4 + 16 * 4 * 2 + 4
    assert summary["objects"] == {"rng_state": ["rng_state/shard_0_2", "rng_state/shard_1_2"]}


def test_inspect_lists_the_objects_megatrons_own_save_wrote(tmp_path: Path) -> None:
    """A checkpoint saved through the Megatron-Core plug-in holds the ShardedObject
    shards Megatron's own save wrote (the record's ``external_files``), which ``load``
    and ``diff`` read; ``inspect`` listed only the record's own objects and said
    "sharded objects: 0" (JSON: ``"objects": {}``)."""
    pytest.importorskip("megatron.core", reason="megatron-core not installed")
    from tests.test_megatron_objects import megatron_api_save

    ckpt = tmp_path / "ckpt"
    run_distributed(megatron_api_save, 2, str(ckpt))
    code, out, _ = run("inspect", str(ckpt))
    assert code == 0 and "sharded objects: 1\n  rng_state  2 shard(s)" in out, out
    code, out, _ = run("inspect", "--json", str(ckpt))
    assert json.loads(out)["objects"] == {"rng_state": ["rng_state/shard_0_2", "rng_state/shard_1_2"]}


def test_inspect_gives_the_chunk_shape_of_a_dcp_tensor_whose_chunks_have_one() -> None:
    """``CheckpointSummary`` (and ``OtherTensor.chunk_shape``) give an array's chunk
    shape, empty only where its saved chunks differ in shape; a DCP or torch_dist
    tensor's was always empty (``model.fc1``'s two [4, 6] chunks: "2 chunk(s)", JSON
    ``"chunk_shape": []``)."""
    from tests.fixtures.legacy.make import DCP, MEGATRON

    code, out, _ = run("inspect", "--json", str(DCP))
    arrays = {a["key"]: a for a in json.loads(out)["arrays"]}
    assert code == 0 and arrays["model.fc1"]["chunk_shape"] == [4, 6] and arrays["model.fc1"]["chunks"] == 2
    assert arrays["model.emb"]["chunk_shape"] == [5, 4]
    code, out, _ = run("inspect", "--json", str(MEGATRON))
    arrays = {a["key"]: a for a in json.loads(out)["arrays"]}
    assert arrays["decoder/fc1"]["chunk_shape"] == [4, 6]
    assert arrays["optimizer/exp_avg"]["chunk_shape"] == []  # cut 13 + 11: chunks differ in shape
    code, out, _ = run("inspect", str(DCP))
    assert "model.fc1  [8, 6]           float32        chunks [4, 6] x2  192 B" in out, out


@pytest.mark.parametrize("created", [1e20, -1e20])
def test_inspect_of_a_record_whose_time_is_no_date_says_so_not_a_traceback(
    demo: Path, tmp_path: Path, created: float
) -> None:
    """A record whose ``created`` is a finite number past any date (edited and
    resealed) made ``inspect`` exit with an OverflowError's traceback from
    ``time.gmtime``; the time is informational: it now says it is unknown."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(demo, ckpt)
    rewrite_record(ckpt, lambda root: root["attributes"]["shardstore"].__setitem__("created", created))
    code, out, err = run("inspect", str(ckpt))
    assert (code, err) == (0, "") and "committed at an unknown time," in out, out


def test_verify_passes_and_names_each_damaged_chunk(demo: Path, tmp_path: Path) -> None:
    code, out, _ = run("verify", str(demo))
    assert code == 0 and "no problems" in out and "5 chunks" in out
    damaged = tmp_path / "damaged"
    subprocess.run(["cp", "-r", str(demo), str(damaged)], check=True)
    chunk = damaged / "decoder/fc1/c.1.0"
    chunk.write_bytes(chunk.read_bytes()[:-1] + b"\0")
    code, out, _ = run("verify", str(damaged))
    assert code == 1
    assert "decoder/fc1 [c.1.0]" in out and "1 problem(s)" in out


def _guide_output(command: str) -> list[str]:
    """The lines docs/guide/cli.md's session shows after ``$ shardstore <command>``."""
    lines = (Path(__file__).resolve().parent.parent / "docs/guide/cli.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"$ shardstore {command}"))
    return list(itertools.takewhile(lambda line: not line.startswith("$"), lines[start + 1 :]))


def test_the_guides_session_shows_what_inspect_and_verify_print(demo: Path, tmp_path: Path) -> None:
    """docs/guide/cli.md's session shows ``inspect`` and ``verify`` of this checkpoint
    (its arrays, objects and common state), the latter with ``c.1.0`` of
    ``decoder/fc1`` damaged; it said ``4 files`` where verify checks 9 (the commit
    record's files and every node's ``zarr.json``)."""
    ckpt = tmp_path / "ckpt" / "iter_0001000"
    shutil.copytree(demo, ckpt)
    shown = str(ckpt.parent)
    _, out, _ = run("inspect", str(ckpt))
    expected = [line.replace("/tmp/ckpt", shown) for line in _guide_output("inspect /tmp/ckpt/iter_0001000")]
    assert out.splitlines()[2:] == expected[2:]  # after the time and the save id
    chunk = ckpt / "decoder/fc1/c.1.0"
    chunk.write_bytes(chunk.read_bytes()[:-1] + bytes([chunk.read_bytes()[-1] ^ 0xFF]))
    code, out, _ = run("verify", str(ckpt))
    expected = [line.replace("/tmp/ckpt", shown) for line in _guide_output("verify /tmp/ckpt/iter_0001000")]
    assert (code, out.splitlines()) == (1, expected)


@pytest.mark.parametrize("command", ["inspect", "verify", "diff"])
def test_an_array_directory_is_called_an_array_not_a_group(demo: Path, command: str) -> None:
    """``shardstore inspect CKPT/decoder/fc1`` (an array of a checkpoint) said
    "... is a Zarr group but not a shardstore checkpoint": its ``zarr.json`` is an
    array's. The error names it as such and says which directory to name."""
    array = str(demo / "decoder" / "fc1")
    code, _, err = run(command, *([array, array] if command == "diff" else [array]))
    assert code == 2 and "is a Zarr array's metadata" in err and "group" not in err, err
    assert "name the checkpoint directory that holds the array" in err


@pytest.mark.parametrize("case", ["missing", "incomplete", "foreign"])
def test_verify_refuses_what_is_not_a_committed_checkpoint(tmp_path: Path, case: str) -> None:
    path = tmp_path / "ckpt"
    if case != "missing":
        path.mkdir()
        (path / "metadata.json").write_text(json.dumps(
            {"sharded_backend": "torch_dist" if case == "foreign" else "shardstore"}))
        (path / "__0_0.distcp").write_bytes(b"x")
    code, _, err = run("verify", str(path))
    assert code == 2
    expected = {"missing": "does not exist", "incomplete": "incomplete", "foreign": "torch_dist"}[case]
    assert expected in err and err.startswith("shardstore: error:")


@pytest.mark.parametrize("removed", [["zarr.json"], ["zarr.json", "common.pt"]])
def test_verify_of_an_unfinished_save_says_it_is_incomplete(tmp_path: Path, removed: list[str]) -> None:
    """A save that stopped before its commit record (written last) has a ``zarr.json``
    in each array directory. Before, verify took each array directory for a checkpoint
    under a root and reported damage (exit 1), where inspect, convert and diff say
    "incomplete" (exit 2)."""
    save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0)), "it": 1}, tmp_path / "ckpt")
    for name in removed:
        os.remove(tmp_path / "ckpt" / name)
    code, out, err = run("verify", str(tmp_path / "ckpt"))
    assert (code, out) == (2, "") and "is incomplete" in err, err


@pytest.mark.parametrize("damage", ["truncated", "edited"])
def test_verify_of_a_checkpoint_whose_commit_record_is_damaged_reports_damage(
    tmp_path: Path, damage: str
) -> None:
    """A commit record cut short or edited (its digest no longer matches) is damage:
    exit status 1 and a report naming ``zarr.json``, as the same checkpoint under a root
    gets. Before, verify of the checkpoint itself read the record first and stopped with
    an error (exit status 2, and under ``--json`` an error document with no report), the
    status the command keeps for no checkpoint, an unfinished one or a bad argument."""
    path = tmp_path / "root" / "ckpt"
    save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0)), "it": 1}, path)
    record = path / "zarr.json"
    text = record.read_text()
    record.write_text(text[: len(text) // 2] if damage == "truncated" else text.replace('"world_size":1,', '"world_size":2,'))
    assert record.read_text() != text
    code, out, err = run("verify", str(path))
    assert (code, err) == (1, ""), err
    assert out.startswith("zarr.json [file]: ") and "1 problem(s)" in out, out
    code, out, _ = run("verify", "--json", str(path))
    report = json.loads(out)
    assert code == 1 and report["ok"] is False and [p["key"] for p in report["problems"]] == ["zarr.json"]
    assert run("verify", str(tmp_path / "root"))[0] == 1  # the root's verify, as before


def test_verify_of_a_record_of_a_newer_format_is_an_error_not_damage(tmp_path: Path) -> None:
    """A record a newer shardstore wrote is not damage: exit status 2 saying to upgrade,
    never exit 1 (which a script may answer by deleting the checkpoint). Before, the
    damaged-record change above reported it as a ``zarr.json`` problem, exit 1."""
    path = tmp_path / "ckpt"
    save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0))}, path)
    record = path / "zarr.json"
    node = json.loads(record.read_text())
    node["attributes"]["shardstore"]["format_version"] = 99
    record.write_text(json.dumps(node))
    code, out, err = run("verify", str(path))
    assert (code, out) == (2, "") and "format version 99 is not supported" in err and "upgrade" in err, err


def test_convert_to_torch_file_and_back_is_exact(demo: Path, tmp_path: Path) -> None:
    code, _, _ = run("convert", str(demo), str(tmp_path / "model.pt"))
    assert code == 0
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert_bits_equal(state["decoder"]["fc1"], FC1)
    assert_bits_equal(state["embedding"]["word"], EMB)
    assert state["iteration"] == 1000 and state["args"] == {"lr": 0.1}
    assert state["rng_state/shard_1_2"].tolist() == [1, 7]

    code, out, _ = run("convert", str(tmp_path / "model.pt"), str(tmp_path / "back"))
    assert code == 0 and "verified" in out
    loaded = load_plain_tensors(tmp_path / "back")
    assert_bits_equal(loaded["decoder/fc1"], FC1)
    assert_bits_equal(loaded["embedding/word"], EMB)
    assert loaded["decoder/scale"].shape == () and loaded["decoder/scale"].item() == 0.5
    assert run("convert", str(demo), str(tmp_path / "model.pt"))[0] == 2  # never replaces a file


def test_convert_to_sharded_safetensors_that_the_library_reads(demo: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out = tmp_path / "hf"
    code, _, err = run("convert", str(demo), str(out), "--to", "safetensors", "--max-shard-size", "200B")
    assert code == 0
    assert "left out" in err and "rng_state" in err and "iteration" not in err  # objects out, values kept
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 8 * 6 * 4 + 16 * 4 * 2 + 4
    assert set(index["weight_map"]) == {"decoder/fc1", "decoder/scale", "embedding/word"}
    tensors = {}
    for name in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(out / name))
    assert_bits_equal(tensors["decoder/fc1"], FC1)
    assert_bits_equal(tensors["embedding/word"], EMB)

    code, _, _ = run("convert", str(out), str(tmp_path / "back"))
    assert code == 0
    assert_bits_equal(load_plain_tensors(tmp_path / "back")["embedding/word"], EMB)


def test_convert_a_hugging_face_safetensors_file(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    weights = {"model.layers.0.mlp.weight": torch.randn(6, 3).bfloat16(), "lm_head.weight": torch.randn(5, 3),
               "model.norm.bias": torch.zeros(0), "flags": torch.tensor([True, False])}
    save_file(weights, tmp_path / "model.safetensors")
    code, _, _ = run("convert", str(tmp_path / "model.safetensors"), str(tmp_path / "ckpt"))
    assert code == 0
    loaded = load_plain_tensors(tmp_path / "ckpt")
    for name, tensor in weights.items():
        assert_bits_equal(loaded[name], tensor, name)


def test_conversions_hold_a_bounded_number_of_bytes(demo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shardstore.opened import bare_location
    from shardstore.strategies.zarr import ZarrLoadShardedStrategy
    from shardstore.tools.convert import read_arrays

    requested: list[int] = []
    original = ZarrLoadShardedStrategy.load_with_record

    def spy(self, sharded_state_dict, *args, **kwargs):
        requested.append(sum(t.data.nbytes for t in sharded_state_dict.values()))
        return original(self, sharded_state_dict, *args, **kwargs)

    monkeypatch.setattr(ZarrLoadShardedStrategy, "load_with_record", spy)
    keys = [key for key, _ in read_arrays(bare_location(demo), memory_bytes=200)]
    assert keys == ["decoder/fc1", "decoder/scale", "embedding/word"]
    assert requested == [192 + 4, 128]  # fc1 and scale, then emb: never more than 200 bytes


def test_diff_reports_keys_shapes_dtypes_and_the_largest_difference(demo: Path, tmp_path: Path) -> None:
    assert run("diff", str(demo), str(demo)) == (0, "identical\n", "")
    changed = FC1.clone()
    changed[3, 2] += 0.25
    save({"fc1": ShardedTensor.from_rank_offsets("decoder/fc1", changed),
          "emb": ShardedTensor.from_rank_offsets("embedding/word", EMB.float()),
          "extra": ShardedTensor.from_rank_offsets("extra", torch.ones(2)),
          "iteration": 1001, "args": {"lr": 0.1}}, tmp_path / "other")
    code, out, _ = run("diff", str(demo), str(tmp_path / "other"))
    assert code == 1
    assert "- decoder/scale" in out and "+ extra" in out
    assert "~ decoder/fc1  max |difference| 0.25" in out
    assert "~ embedding/word  dtype bfloat16 -> float32" in out and "max |difference|" not in out.split("embedding")[1]
    assert "~ common state iteration" in out
    report = json.loads(run("diff", "--json", str(demo), str(tmp_path / "other"))[1])
    assert report["identical"] is False
    assert {a["key"]: a["max_abs_diff"] for a in report["arrays"]}["decoder/fc1"] == pytest.approx(0.25, abs=1e-6)


def test_convert_refuses_what_it_cannot_read_clearly(tmp_path: Path) -> None:
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"\x80")  # a damaged DCP checkpoint
    code, _, err = run("convert", str(tmp_path / "dcp"), str(tmp_path / "out"))
    assert code == 2 and "is not valid PyTorch DCP metadata" in err
    zarr2 = tmp_path / "megatron_zarr"  # Megatron-Core's old zarr backend (Zarr v2 arrays)
    (zarr2 / "decoder.fc1").mkdir(parents=True)
    (zarr2 / "decoder.fc1" / ".zarray").write_text("{}")
    (zarr2 / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    code, _, err = run("convert", str(zarr2), str(tmp_path / "out"))
    assert code == 2 and "decoder.fc1/.zarray is not a Zarr v2 array" in err  # read now, and refused clearly
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("text", "expected"), [("5GB", 5 * 10**9), ("1GiB", 2**30), ("200B", 200), ("4096", 4096),
                                                ("1.5 MiB", 3 * 2**19)])
def test_sizes(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("size", ["1ib", "2i", "3bb", "GB", "4 KiBs"])
def test_a_malformed_size_is_a_usage_error(demo: Path, tmp_path: Path, size: str) -> None:
    """Before, the size pattern admitted ``i`` without a unit letter ("1ib", "2i"),
    and looking up its unit was a KeyError: a traceback."""
    code, _, err = run("convert", str(demo), str(tmp_path / "out"), "--to", "safetensors", "--max-shard-size", size)
    assert code == 2 and f"{size!r} is not a size" in err, err
    assert not (tmp_path / "out").exists()


def test_the_console_script_is_installed(demo: Path) -> None:
    script = Path(sys.executable).with_name("shardstore")
    result = subprocess.run([str(script), "inspect", str(demo)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "decoder/fc1" in result.stdout
    assert load({"w": ShardedTensor.from_rank_offsets("decoder/fc1", torch.empty(8, 6))}, demo)["w"].shape == (8, 6)


def test_help_and_version_answer_without_importing_torch() -> None:
    """The command module imports torch (about 2 s) only in the commands that read a
    checkpoint: ``--help``, ``--version`` and usage errors answer at once."""
    code = "import sys, shardstore.tools.cli; print(sorted(m for m in ('torch', 'tensorstore') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result


# ------------------------------------------------------------------ issue 27.4: the command's own words


def test_version_is_the_installed_package_version() -> None:
    from importlib.metadata import version

    assert run("--version") == (0, f"shardstore {version('shardstore')}\n", "")


def test_verify_json_lists_every_problem(demo: Path, tmp_path: Path) -> None:
    code, out, _ = run("verify", "--json", str(demo))
    report = json.loads(out)
    assert code == 0 and report["ok"] is True and report["problems"] == []
    assert (report["arrays_checked"], report["chunks_checked"], report["checkpoint"]) == (3, 5, str(demo))
    damaged = tmp_path / "damaged"
    subprocess.run(["cp", "-r", str(demo), str(damaged)], check=True)
    chunk = damaged / "decoder/fc1/c.1.0"
    chunk.write_bytes(chunk.read_bytes()[:-1] + b"\0")
    code, out, _ = run("verify", "--json", str(damaged))
    report = json.loads(out)
    assert code == 1 and report["ok"] is False
    assert [(p["key"], p["part"]) for p in report["problems"]] == [("decoder/fc1", "c.1.0")]


def test_convert_json_says_what_it_wrote(demo: Path, tmp_path: Path) -> None:
    code, out, _ = run("convert", "--json", str(demo), str(tmp_path / "hf"), "--to", "safetensors")
    export = json.loads(out)
    assert code == 0 and (export["source_format"], export["format"]) == ("shardstore", "safetensors")
    assert export["files"] == ["model.safetensors"] and export["tensors"] == 3 and export["total_bytes"] == 324
    assert "iteration" not in export["left_out"] and all("rng_state" in k for k in export["left_out"])
    code, out, _ = run("convert", "--json", str(tmp_path / "hf"), str(tmp_path / "back"))
    imported = json.loads(out)
    assert code == 0 and imported["source_format"] == "safetensors" and imported["verify"]["ok"] is True


def _not_a_checkpoint(tmp_path: Path, case: str) -> tuple[Path, str]:
    """A path that is no checkpoint, and what the error must call it."""
    if case == "file":
        torch.save({"w": torch.ones(2)}, tmp_path / "model.pt")
        return tmp_path / "model.pt", "is a file, not a checkpoint directory"
    path = tmp_path / case
    path.mkdir()
    if case == "hugging_face":
        (path / "config.json").write_text("{}")
        from safetensors.torch import save_file

        save_file({"w": torch.ones(2)}, path / "model.safetensors")
        return path, "is a Hugging Face model directory (config.json, model.safetensors), not a shardstore checkpoint"
    (path / "notes.txt").write_text("hello")
    (path / "runs").mkdir()
    return path, "is not a shardstore checkpoint: it holds no commit record (zarr.json) nor any file a save writes"


@pytest.mark.parametrize("case", ["plain", "hugging_face", "file"])
@pytest.mark.parametrize("command", ["inspect", "verify", "diff"])
def test_what_is_not_a_checkpoint_is_called_what_it_is_once(
    demo: Path, tmp_path: Path, command: str, case: str
) -> None:
    path, called = _not_a_checkpoint(tmp_path, case)
    code, out, err = run(command, str(path), *([str(demo)] if command == "diff" else []))
    assert code == 2 and out == ""
    assert err.startswith("shardstore: error:") and err.count("\n") == 1, err
    assert err.count(called) == 1, err
    assert "incomplete" not in err and "save again" not in err and "Cannot read" not in err, err


def test_convert_from_a_plain_folder_says_it_is_none_of_the_sources(tmp_path: Path) -> None:
    path, called = _not_a_checkpoint(tmp_path, "plain")
    code, _, err = run("convert", str(path), str(tmp_path / "out"))
    assert code == 2 and called in err and "incomplete" not in err
    assert not (tmp_path / "out").exists()


def test_errors_name_the_commands_flags_not_the_librarys_arguments(demo: Path, tmp_path: Path) -> None:
    assert run("convert", str(demo), str(tmp_path / "model.pt"))[0] == 0
    assert run("convert", str(tmp_path / "model.pt"), str(tmp_path / "ckpt"))[0] == 0
    code, _, err = run("convert", str(tmp_path / "model.pt"), str(tmp_path / "ckpt"))
    assert code == 2 and err.count("\n") == 1, err
    assert "pass --overwrite to replace it" in err and "overwrite=True" not in err and "rank 0" not in err, err
    assert run("convert", str(tmp_path / "model.pt"), str(tmp_path / "ckpt"), "--overwrite")[0] == 0


class _TrainerConfig:
    """A user's class in the common state: no allow-list admits it."""

    def __init__(self, lr: float) -> None:
        self.lr = lr


def test_a_refused_pickle_says_what_to_do_in_python_since_the_command_runs_no_code(tmp_path: Path) -> None:
    save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2)), "config": _TrainerConfig(0.5)}, tmp_path / "c")
    code, _, err = run("inspect", str(tmp_path / "c"))
    assert code == 2 and err.count("\n") == 1 and "_TrainerConfig" in err, err
    assert "in Python admit it with torch.serialization.add_safe_globals" in err, err
    assert "shardstore.load(..., common_strategy=TorchCommonLoadStrategy(allow_unsafe_pickle=True))" in err, err
    assert err.rstrip().endswith("the shardstore command runs no code from a file."), err


@pytest.fixture
def dcp_with_a_dtype_shardstore_lacks(tmp_path: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"fnuz": torch.randn(4).to(torch.float8_e4m3fnuz), "ok": torch.ones(2)}, checkpoint_id=tmp_path / "dcp")
    return tmp_path / "dcp"


@pytest.mark.parametrize("command", ["inspect", "diff", "convert"])
def test_a_dcp_tensor_of_a_dtype_shardstore_lacks_is_an_error_naming_it(
    dcp_with_a_dtype_shardstore_lacks: Path, tmp_path: Path, command: str
) -> None:
    """An error naming the checkpoint and the tensor, and the way out (a torch.save
    file holds it). Before, ``from_torch``'s TypeError was a traceback and exit status
    1, a "finding", naming neither."""
    source = str(dcp_with_a_dtype_shardstore_lacks)
    args = {"inspect": [source], "diff": [source, source], "convert": [source, str(tmp_path / "out")]}[command]
    code, _, err = run(command, *args)
    assert code == 2 and err.count("\n") == 1, err
    assert f"{source}: tensor 'fnuz' is torch.float8_e4m3fnuz" in err and f"convert {source} model.pt" in err, err
    assert not (tmp_path / "out").exists()
    assert run("convert", source, str(tmp_path / "model.pt"))[0] == 0  # the way out


# ------------------------------------------------------------------ issue 41.7e: --json failures, closed output


SCRIPT = str(Path(sys.executable).with_name("shardstore"))


@pytest.mark.parametrize("command", ["inspect", "verify", "diff", "convert"])
def test_a_failure_under_json_prints_a_json_error_object(tmp_path: Path, command: str) -> None:
    missing = str(tmp_path / "missing")
    second = [str(tmp_path / "out")] if command in ("diff", "convert") else []
    result = forked_python.run([SCRIPT, command, "--json", missing, *second], timeout=120)
    document = json.loads(result.stdout)
    assert result.returncode == 2 and document["exit_status"] == 2, result
    assert missing in document["error"] and "Traceback" not in result.stderr, result


def test_a_usage_error_under_json_prints_a_json_error_object() -> None:
    result = forked_python.run([SCRIPT, "verify", "--json"], timeout=120)
    assert result.returncode == 2, result
    assert json.loads(result.stdout) == {"error": "Missing argument 'CHECKPOINT'.", "exit_status": 2}


def test_help_under_json_is_help_not_an_error() -> None:
    result = forked_python.run([SCRIPT, "inspect", "--help", "--json"], timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("Usage: shardstore inspect"), result


@pytest.mark.parametrize("args", [
    ["--help"], ["--version"], ["inspect", "--help"], ["inspect", "{demo}"], ["ls", "--json", "{demo}"],
    ["verify", "{demo}"], ["verify", "--json", "{demo}"], ["diff", "{demo}", "{demo}"],
    ["diff", "--json", "{demo}", "{demo}"], ["convert", "--json", "{demo}", "{out}"],
])
def test_every_command_exits_quietly_and_not_zero_when_its_output_is_closed(
    demo: Path, tmp_path: Path, args: list[str]
) -> None:
    command = [SCRIPT, "--no-progress", *(a.format(demo=demo, out=tmp_path / "out.pt") for a in args)]
    process = forked_python.ForkedPython(command)
    process.stdout.close()  # no reader left: the command's first write fails
    _, err = process.communicate(timeout=120)
    assert process.returncode == EXIT_CLOSED_OUTPUT and err == b"", (process.returncode, err.decode())


@pytest.fixture(scope="module")
def many_arrays(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint whose ``inspect --json`` is far larger than a pipe's 64 KiB."""
    path = tmp_path_factory.mktemp("cli") / "many"
    save({f"layer{i}/w": ShardedTensor.from_rank_offsets(f"layer{i}/w", torch.zeros(1)) for i in range(1500)}, path)
    return path


@pytest.mark.parametrize("unbuffered", ["1", ""])
def test_output_cut_short_by_its_reader_is_not_reported_as_success(many_arrays: Path, unbuffered: str) -> None:
    """``shardstore inspect --json CKPT | head -1``: under PYTHONUNBUFFERED Python's text
    layer dropped the rest of a short write and the command exited 0."""
    process = subprocess.Popen([SCRIPT, "inspect", "--json", str(many_arrays)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": unbuffered})
    first = process.stdout.readline()
    process.stdout.close()
    _, err = process.communicate(timeout=120)
    assert first == b"{\n" and process.returncode == EXIT_CLOSED_OUTPUT and err == b"", (process.returncode, err)


@pytest.mark.parametrize("case", ["a damaged checkpoint", "a missing path", "an empty directory"])
def test_verify_root_of_no_root_of_checkpoints_is_an_error_not_ok(tmp_path: Path, case: str) -> None:
    """``verify_root`` of a place with no checkpoint under it (the checkpoint itself,
    damaged; a mistyped path; an empty directory) raises naming the place, as the
    ``verify`` command exits 2. Before, it returned a report with ``ok`` True: "0
    checkpoint(s) checked; no problems", for a checkpoint with a flipped chunk too."""
    from shardstore.errors import CheckpointingException
    from shardstore.tools.root_verify import verify_root

    place = tmp_path / "ckpt"
    if case == "a damaged checkpoint":
        save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0))}, place, layout=PER_ARRAY)
        chunk = place / "w" / "c.0"
        chunk.write_bytes(bytes([chunk.read_bytes()[0] ^ 1]) + chunk.read_bytes()[1:])
    elif case == "an empty directory":
        place.mkdir()
    with pytest.raises(CheckpointingException, match="holds no checkpoint") as raised:
        verify_root(place)
    assert str(place) in str(raised.value)


# ------------------------------------------------------------------ -v and -vv log shardstore's lines only


def test_verbose_logs_shardstores_lines_not_other_libraries_debug(moto_server, monkeypatch, tmp_path: Path) -> None:
    """``-vv`` turned on DEBUG for every library (``logging.basicConfig`` on the root
    logger): ``shardstore -vv verify s3://...`` of a one-array checkpoint printed some 700
    lines of botocore's request logging, among them every request's headers with the AWS
    session token, around shardstore's one line. ``-v``/``-vv`` now set shardstore's
    logger alone."""
    moto_server.create_bucket("cli-verbose")
    environment = {"AWS_ENDPOINT_URL": moto_server.endpoint, "AWS_ACCESS_KEY_ID": moto_server.key,
                   "AWS_SECRET_ACCESS_KEY": moto_server.secret, "AWS_REGION": moto_server.region,
                   "AWS_SESSION_TOKEN": "the-session-token-of-the-test"}
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    url = "s3://cli-verbose/ckpt"
    save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4, 4))}, url)
    for flag in ("-v", "-vv"):
        result = forked_python.run([SCRIPT, "--no-progress", flag, "verify", url], env=dict(os.environ), timeout=120)
        assert result.returncode == 0, result
        assert "the-session-token-of-the-test" not in result.stderr
        lines = result.stderr.splitlines()
        assert lines and all(line.startswith("shardstore") for line in lines), lines[:5]
        assert any(line.startswith(f"shardstore: verify {url}: ") for line in lines), lines


def test_inspect_names_the_features_a_reader_must_understand(tmp_path: Path) -> None:
    """``requires`` (``format.features``): none for a save of one directory per array,
    the feature for a packed one (the default for small arrays), in the text and in
    the JSON; a packed array names its pack."""
    from shardstore import ShardedTensor, save
    from shardstore.format import SaveOptions

    save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}, tmp_path / "plain", layout=PER_ARRAY)
    save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}, tmp_path / "packed",
         options=SaveOptions(pack_arrays_up_to=1 << 16))
    code, out, _ = run("inspect", str(tmp_path / "plain"))
    assert code == 0 and "requires no feature beyond the base format" in out
    code, out, _ = run("inspect", str(tmp_path / "packed"))
    assert code == 0 and "requires packs" in out
    assert re.search(r"^  w .* in packs/\S+\.zip$", out, re.MULTILINE), out  # where a plain reader finds it
    code, out, _ = run("inspect", str(tmp_path / "plain"))
    assert " in packs/" not in out
    code, out, _ = run("ls", "--json", str(tmp_path / "packed"))
    summary = json.loads(out)
    assert summary["requires"] == ["packs"]
    assert summary["arrays"][0]["pack"].startswith("packs/") and summary["arrays"][0]["pack"].endswith(".zip")
