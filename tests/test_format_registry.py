"""One registry of other tools' formats, checkpoint directories and model files alike:
every registered format tells its own checkpoints or files from everything else,
cheaply; a checkpoint format registered from outside (one class here, one ``register``
call) is read by ``load``, named by the errors about a directory without a commit
record, and taken by the command's ``inspect`` and ``convert``; a model-file format
registered so is found by the lookup ``convert`` and the command use, and converted,
with no other change anywhere."""

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
from shardstore.other_formats.base import (
    ExportSource,
    FileFormat,
    Format,
    OtherCheckpoint,
    OtherFormat,
    OtherTensor,
    TensorSpec,
)
from shardstore.stores.base import Location
from shardstore.stores.locations import open_location
from shardstore.tools.cli import main
from tests.fixtures.legacy.make_megatron014 import TORCH_DIST as MEGATRON_014_TORCH_DIST
from tests.fixtures.legacy.make_megatron014 import ZARR as MEGATRON_014_ZARR

BUILT_IN = ("torch_dist", "zarr", "dcp", "safetensors", "torch")


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
        "safetensors": _safetensors_model(tmp_path / "hf"),
        "shardstore": _shardstore_checkpoint(tmp_path / "ours"),
        "empty directory": empty,
        "other directory": folder,
        "other file": folder / "notes.txt",
    }


def _safetensors_model(path: Path) -> Path:
    from safetensors.torch import save_file

    path.mkdir()
    (path / "config.json").write_text("{}")
    save_file({"w": torch.ones(2)}, path / "model.safetensors")
    return path


def _file_samples(tmp_path: Path) -> dict[str, list[Path]]:
    """Model files of each built-in file format (by its name), however they are named."""
    tmp_path.mkdir(exist_ok=True)
    torch.save({"w": torch.ones(2)}, tmp_path / "model.pt")
    torch.save({"w": torch.ones(2)}, tmp_path / "model.ckpt")  # no suffix of its own: its contents say
    torch.save({"w": torch.ones(2)}, tmp_path / "legacy", _use_new_zipfile_serialization=False)
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, tmp_path / "w.safetensors")
    return {
        "torch": [tmp_path / "model.pt", tmp_path / "model.ckpt", tmp_path / "legacy"],
        "safetensors": [tmp_path / "w.safetensors", _safetensors_model(tmp_path / "hf")],
    }


def test_every_registered_format_has_a_sample_here() -> None:
    # a new reader is added to this test too, with a checkpoint its tool wrote
    assert tuple(f.name for f in registry.FORMATS) == BUILT_IN


@pytest.mark.parametrize("name", BUILT_IN)
def test_each_format_detects_its_own_checkpoints_and_no_others(tmp_path: Path, name: str) -> None:
    found = registry.named(name)
    for sample, path in _samples(tmp_path).items():
        assert found.detect(open_location(path)) == (sample == name), (name, sample)
    for sample, paths in _file_samples(tmp_path / "files").items():
        for path in paths:
            assert found.detect(open_location(path)) == (sample == name), (name, path)


def test_the_lookup_names_each_kind_of_format_once(tmp_path: Path) -> None:
    """``load`` asks for checkpoint formats, ``convert`` for file formats first: a
    Hugging Face model is one of the latter, never a checkpoint ``load`` reads."""
    files = _file_samples(tmp_path)
    for name, paths in files.items():
        for path in paths:
            assert registry.detect(open_location(path), FileFormat) is registry.named(name), path
            assert registry.detect(open_location(path), OtherFormat) is None, path
    assert other_format_of(open_location(files["safetensors"][1])) is None
    dcp_path = _dcp_checkpoint(tmp_path / "dcp")
    assert registry.detect(open_location(dcp_path), Format) is registry.named("dcp")
    assert registry.detect(open_location(dcp_path), FileFormat) is None


def test_detection_reads_no_pickle(tmp_path: Path) -> None:
    """A ``.metadata`` that is no pickle at all is still DCP's by its name; what it holds
    is the reader's to refuse, when it is opened."""
    (tmp_path / ".metadata").write_bytes(b"\x80\x05 not a pickle")
    assert registry.detect(open_location(tmp_path), OtherFormat) is registry.named("dcp")
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


def _command_converts(source: Path, tmp_path: Path, name: str, values: list[float]) -> None:
    """The command converts ``source``, of the format ``name``, into a verified
    checkpoint and into a ``.pt`` file, both holding ``values`` as ``layer/w``."""
    code, out, err = _run("convert", "--json", str(source), str(tmp_path / "converted"))
    assert code == 0, err
    report = json.loads(out)
    assert report["source_format"] == name and report["verify"]["ok"] is True
    request = {"w": ShardedTensor.from_rank_offsets("layer/w", torch.empty(len(values)))}
    assert load(request, tmp_path / "converted")["w"].tolist() == values
    code, _, err = _run("convert", str(source), str(tmp_path / "model.pt"))
    assert code == 0, err
    assert torch.load(tmp_path / "model.pt", weights_only=True)["layer"]["w"].tolist() == values


def test_the_command_converts_a_registered_format(toy: Path, tmp_path: Path) -> None:
    _command_converts(toy, tmp_path, "toy", [1.5, 2.5, 3.5, 4.5])


# --------------------------------------------------------------- a new file format is one module


TOY_SUFFIX = ".toyw"


def _toy_holds(location: Location) -> bool:
    local = location.local_path()
    return local is not None and local.is_file() and local.name.endswith(TOY_SUFFIX)


def _toy_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A model-file format of another tool, all of it: JSON of each tensor's values."""
    return {k: torch.tensor(v, dtype=torch.float32) for k, v in json.loads(path.read_text()).items()}


def _toy_open(path: Path) -> ExportSource:
    tensors = _toy_tensors(path)
    return ExportSource(
        {k: TensorSpec.of(t) for k, t in sorted(tensors.items())},
        lambda keys, _: ((k, tensors[k]) for k in keys), dict, lambda key: tuple(key.split("/")),
    )


def _toy_state(path: Path) -> dict[str, Any]:
    return {k: ShardedTensor.from_rank_offsets(k, t) for k, t in _toy_tensors(path).items()}


@pytest.fixture
def toy_file(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / f"weights{TOY_SUFFIX}"
    path.write_text(json.dumps({"layer/w": [1.5, 2.5], "layer/b": [0.5]}))
    assert registry.detect(open_location(path), FileFormat) is None  # unknown until registered
    entry = registry.register(FileFormat("toyw", "a toy weights file", _toy_holds, _toy_open, _toy_state, (TOY_SUFFIX,)))
    yield path
    registry.FORMATS.remove(entry)


def test_a_registered_file_format_is_found_by_the_lookup_convert_uses(toy_file: Path) -> None:
    from shardstore.opened import bare_location
    from shardstore.tools.convert import source_kind

    assert registry.detect(open_location(toy_file), FileFormat) is registry.named("toyw")
    assert registry.detect(open_location(toy_file), OtherFormat) is None  # load does not read it
    assert source_kind(bare_location(toy_file)) == "toyw"


def test_the_command_converts_a_registered_file_format(toy_file: Path, tmp_path: Path) -> None:
    _command_converts(toy_file, tmp_path, "toyw", [1.5, 2.5])


def test_a_file_of_no_registered_format_is_named_as_such(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("a user's own notes")
    code, _, err = _run("convert", str(tmp_path / "notes.txt"), str(tmp_path / "out"))
    assert code == 2 and "is a file of no format shardstore converts" in err, err
    assert "a torch.save file (*.pt, *.pth, *.bin)" in err and "a safetensors model (*.safetensors)" in err, err
    assert not (tmp_path / "out").exists()
