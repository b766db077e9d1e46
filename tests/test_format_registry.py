"""One registry of other tools' checkpoint formats (issue 24.3): every registered
format tells its own checkpoints from everything else, cheaply, and a format registered
from outside (one class here, one ``register`` call) is read by ``load``, named by the
errors about a directory without a commit record, and taken by the command's
``inspect`` and ``convert``, with no other change anywhere."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner

from shardstore import ShardedTensor, load, load_tensors_metadata, save
from shardstore.errors import CheckpointingException
from shardstore.opened import other_format_of
from shardstore.other_formats import registry
from shardstore.other_formats.base import OtherCheckpoint, OtherFormat, OtherTensor
from shardstore.stores.base import Location
from shardstore.stores.locations import open_location
from shardstore.tools.cli import main
from tests.fixtures.legacy.make_megatron014 import TORCH_DIST as MEGATRON_014_TORCH_DIST
from tests.fixtures.legacy.make_megatron014 import ZARR as MEGATRON_014_ZARR

BUILT_IN = ("torch_dist", "zarr", "dcp")


def _dcp_checkpoint(path: Path) -> Path:
    """A plain DCP checkpoint, written by torch.distributed.checkpoint in this process."""
    dcp.save({"model": {"w": torch.arange(6.0)}, "step": 3}, checkpoint_id=str(path))
    return path


def _shardstore_checkpoint(path: Path) -> Path:
    save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(4.0))}, path)
    return path


def _samples(tmp_path: Path) -> dict[str, Path]:
    """A checkpoint of each built-in format (by its name), and what is none of them."""
    empty = tmp_path / "empty"
    empty.mkdir()
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "notes.txt").write_text("a user's own files")
    (folder / "metadata.json").write_text("{not json")
    return {
        "torch_dist": MEGATRON_014_TORCH_DIST,
        "zarr": MEGATRON_014_ZARR,
        "dcp": _dcp_checkpoint(tmp_path / "dcp"),
        "shardstore": _shardstore_checkpoint(tmp_path / "ours"),
        "empty directory": empty,
        "other directory": folder,
    }


def test_every_registered_format_has_a_sample_here() -> None:
    # a new reader is added to this test too, with a checkpoint its tool wrote
    assert tuple(f.name for f in registry.FORMATS) == BUILT_IN


@pytest.mark.parametrize("name", BUILT_IN)
def test_each_format_detects_its_own_checkpoints_and_no_others(tmp_path: Path, name: str) -> None:
    other_format = registry.named(name)
    for sample, path in _samples(tmp_path).items():
        assert other_format.detect(open_location(path)) == (sample == name), (name, sample)


def test_detection_reads_no_pickle(tmp_path: Path) -> None:
    """A ``.metadata`` that is no pickle at all is still DCP's by its name; what it holds
    is the reader's to refuse, when it is opened."""
    (tmp_path / ".metadata").write_bytes(b"\x80\x05 not a pickle")
    assert registry.detect(open_location(tmp_path)) is registry.named("dcp")
    with pytest.raises(CheckpointingException, match="not valid PyTorch DCP metadata"):
        load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(2))}, tmp_path)


def test_a_name_is_registered_once() -> None:
    with pytest.raises(CheckpointingException, match="'dcp' is registered already"):
        registry.register(registry.named("dcp"))
    with pytest.raises(CheckpointingException, match="No reader of the format 'nope'"):
        registry.named("nope")


# --------------------------------------------------------------- a new reader is one module


class ToyCheckpoint(OtherCheckpoint):
    """A format of another tool, all of it: ``toy.json`` holds each tensor's values."""

    FILE = "toy.json"

    def __init__(self, path: Path) -> None:
        self.path, self.kind, self.items = path, "toy", {}
        self.values = json.loads(self.read_bounded(self.FILE, 2**20, "the toy metadata"))
        self.tensors = {k: OtherTensor(k, (len(v),), torch.float32) for k, v in self.values.items()}

    @staticmethod
    def holds(location: Location) -> bool:
        return location.exists(ToyCheckpoint.FILE)

    def read_region(self, key: str, region: tuple[slice, ...]) -> torch.Tensor:
        return torch.tensor(self.values[key], dtype=torch.float32)[region]

    def read_item(self, key: str) -> Any:
        raise KeyError(key)


@pytest.fixture
def toy(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "toy"
    path.mkdir()
    (path / ToyCheckpoint.FILE).write_text(json.dumps({"layer/w": [1.5, 2.5, 3.5, 4.5]}))
    assert other_format_of(open_location(path)) is None  # unknown until registered
    entry = registry.register(OtherFormat("toy", "a toy checkpoint", ToyCheckpoint.holds, ToyCheckpoint,
                                          ToyCheckpoint.FILE))
    yield path
    registry.FORMATS.remove(entry)


def _run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["--no-progress", *args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def test_a_registered_format_loads(toy: Path) -> None:
    request = {"w": ShardedTensor.from_rank_offsets("layer/w", torch.empty(4))}
    assert load(request, toy)["w"].tolist() == [1.5, 2.5, 3.5, 4.5]
    assert list(load_tensors_metadata(toy)) == ["layer/w"]


def test_a_registered_format_is_named_where_a_save_refuses_it(toy: Path) -> None:
    with pytest.raises(CheckpointingException, match="a toy checkpoint"):
        save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}, toy, overwrite=True)
    assert (toy / ToyCheckpoint.FILE).exists()


def test_the_command_inspects_a_registered_format(toy: Path) -> None:
    code, out, _ = _run("inspect", str(toy))
    assert code == 0 and "written by another tool: a toy checkpoint" in out and "layer/w" in out
    code, out, _ = _run("inspect", "--json", str(toy))
    assert code == 0 and json.loads(out)["kind"] == "toy"


def test_the_command_converts_a_registered_format(toy: Path, tmp_path: Path) -> None:
    code, out, err = _run("convert", "--json", str(toy), str(tmp_path / "converted"))
    assert code == 0, err
    report = json.loads(out)
    assert report["source_format"] == "toy" and report["verify"]["ok"] is True
    loaded = load({"w": ShardedTensor.from_rank_offsets("layer/w", torch.empty(4))}, tmp_path / "converted")
    assert loaded["w"].tolist() == [1.5, 2.5, 3.5, 4.5]
    code, _, err = _run("convert", str(toy), str(tmp_path / "model.pt"))
    assert code == 0, err
    assert torch.load(tmp_path / "model.pt", weights_only=True)["layer"]["w"].tolist() == [1.5, 2.5, 3.5, 4.5]
