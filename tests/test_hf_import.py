"""Issue 34.6: a safetensors model directory (Hugging Face's layout) is imported reading
only regular files inside it, through bounded readers: an index naming a FIFO fails
at once instead of hanging, one naming a path or link out of the directory is refused,
a malformed index is an error naming the index file and the key, and the Hugging Face
cache's own links (snapshots/<rev>/f -> ../../blobs/<hash>) still work."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from shardstore import CheckpointingException, load_plain_tensors
from shardstore.other_formats.model_files import SAFETENSORS_INDEX
from shardstore.tools.convert import from_safetensors
from tests.test_cli import run

WEIGHT, BIAS = torch.arange(12.0).reshape(3, 4), torch.ones(4)


def _model(directory: Path, weight_file: str = "model-00001-of-00002.safetensors") -> Path:
    """A two-shard model directory whose index maps ``w`` to ``weight_file``."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file({"w": WEIGHT}, directory / "model-00001-of-00002.safetensors")
    save_file({"b": BIAS}, directory / "model-00002-of-00002.safetensors")
    _index(directory, {"weight_map": {"w": weight_file, "b": "model-00002-of-00002.safetensors"}})
    return directory


def _index(directory: Path, value: object) -> None:
    (directory / SAFETENSORS_INDEX).write_text(json.dumps(value))


def _import_within(model: Path, out: Path, seconds: float = 60) -> BaseException | None:
    """Imports ``model`` in a thread; the failure it raised, None on success. A hang (a
    FIFO opened for reading blocks until a writer comes) fails the test."""
    outcome: list[BaseException | None] = []

    def work() -> None:
        try:
            from_safetensors(model, out)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001  (handed to the test)
            outcome.append(exc)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"importing {model} did not finish in {seconds} s (a FIFO opened blocking?)"
    return outcome[0]


def test_a_model_directory_imports(tmp_path: Path) -> None:
    assert _import_within(_model(tmp_path / "model"), tmp_path / "ckpt") is None
    loaded = load_plain_tensors(tmp_path / "ckpt")
    assert torch.equal(loaded["w"], WEIGHT) and torch.equal(loaded["b"], BIAS)


@pytest.mark.parametrize("which", ["shard", "index"])
def test_a_fifo_fails_at_once_instead_of_hanging(tmp_path: Path, which: str) -> None:
    model = _model(tmp_path / "model", "pipe.safetensors")
    if which == "index":
        (model / SAFETENSORS_INDEX).unlink()
        os.mkfifo(model / SAFETENSORS_INDEX)
    else:
        os.mkfifo(model / "pipe.safetensors")
    error = _import_within(model, tmp_path / "ckpt")
    assert isinstance(error, CheckpointingException), error
    assert "not a regular file" in str(error), error
    assert not (tmp_path / "ckpt").exists()


def test_the_cli_reports_a_fifo_and_exits(tmp_path: Path) -> None:
    model = _model(tmp_path / "model", "pipe.safetensors")
    os.mkfifo(model / "pipe.safetensors")
    code, _, err = run("convert", str(model), str(tmp_path / "ckpt"))
    assert code != 0 and "pipe.safetensors" in err and "not a regular file" in err, err


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "sub/x.safetensors", ".hidden"])
def test_an_index_naming_a_path_out_of_the_directory_is_refused(tmp_path: Path, name: str) -> None:
    save_file({"w": WEIGHT}, tmp_path / "outside.safetensors")
    error = _import_within(_model(tmp_path / "model", name), tmp_path / "ckpt")
    assert isinstance(error, CheckpointingException), error
    assert SAFETENSORS_INDEX in str(error) and "weight_map['w']" in str(error), error


@pytest.mark.parametrize("target", ["../outside.safetensors", "/dev/zero"])
def test_a_symbolic_link_out_of_the_directory_is_refused(tmp_path: Path, target: str) -> None:
    save_file({"w": WEIGHT}, tmp_path / "outside.safetensors")
    model = _model(tmp_path / "model", "linked.safetensors")
    (model / "linked.safetensors").symlink_to(target)
    error = _import_within(model, tmp_path / "ckpt")
    assert isinstance(error, CheckpointingException), error
    assert "linked.safetensors" in str(error) and "leads outside the model directory" in str(error), error


@pytest.mark.parametrize("index, words", [
    ("{not json", "not JSON"),
    ("[1, 2]", "a JSON object was expected"),
    ('{"metadata": {}}', "no 'weight_map'"),
    ('{"weight_map": {}}', "no 'weight_map'"),
    ('{"weight_map": ["model.safetensors"]}', "no 'weight_map'"),
    ('{"weight_map": {"w": 7}}', "weight_map['w'] is 7"),
    ('{"weight_map": {"w": ""}}', "weight_map['w'] is ''"),
])
def test_a_malformed_index_names_the_file_and_the_key(tmp_path: Path, index: str, words: str) -> None:
    model = _model(tmp_path / "model")
    (model / SAFETENSORS_INDEX).write_text(index)
    error = _import_within(model, tmp_path / "ckpt")
    assert isinstance(error, CheckpointingException), error
    assert SAFETENSORS_INDEX in str(error) and words in str(error), error


def test_an_index_naming_a_missing_file_says_which(tmp_path: Path) -> None:
    error = _import_within(_model(tmp_path / "model", "gone.safetensors"), tmp_path / "ckpt")
    assert isinstance(error, CheckpointingException) and "gone.safetensors" in str(error), error


def test_a_huge_index_is_refused_without_reading_it_whole(tmp_path: Path, monkeypatch) -> None:
    from shardstore.other_formats import model_files

    monkeypatch.setattr(model_files, "MAX_INDEX_BYTES", 64)
    error = _import_within(_model(tmp_path / "model"), tmp_path / "ckpt")
    assert isinstance(error, CheckpointingException) and "larger than 64 bytes" in str(error), error


def test_the_hugging_face_cache_layout_with_its_links_imports(tmp_path: Path) -> None:
    """``models--org--name/snapshots/<rev>/<file>`` are links to ``../../blobs/<hash>``."""
    repo = tmp_path / "hub" / "models--org--tiny"
    built = _model(tmp_path / "built")
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(built.iterdir())):
        blob = repo / "blobs" / f"{i:040x}"
        blob.write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    assert _import_within(snapshot, tmp_path / "ckpt") is None
    assert torch.equal(load_plain_tensors(tmp_path / "ckpt")["w"], WEIGHT)
    # the same links reaching another cached repository are refused
    other = tmp_path / "hub" / "models--other--model" / "blobs"
    other.mkdir(parents=True)
    (other / "stolen").write_bytes((built / "model-00001-of-00002.safetensors").read_bytes())
    (snapshot / "model-00001-of-00002.safetensors").unlink()
    (snapshot / "model-00001-of-00002.safetensors").symlink_to(Path("../../../models--other--model/blobs/stolen"))
    error = _import_within(snapshot, tmp_path / "again")
    assert isinstance(error, CheckpointingException) and "leads outside" in str(error), error


def test_an_index_naming_a_tensor_no_file_holds_is_refused(tmp_path: Path) -> None:
    """Issue 41.5: the index promises ``lost``; converting without it would be a silent
    partial import."""
    model = _model(tmp_path / "model")
    _index(model, {"weight_map": {"w": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors",
                                  "lost": "model-00002-of-00002.safetensors"}})
    error = _import_within(model, tmp_path / "ckpt")
    assert isinstance(error, CheckpointingException), error
    assert "'lost'" in str(error) and SAFETENSORS_INDEX in str(error) and "no file" in str(error), error
    assert not (tmp_path / "ckpt").exists()


def test_an_index_naming_the_wrong_file_for_a_tensor_is_refused(tmp_path: Path) -> None:
    model = _model(tmp_path / "model")
    _index(model, {"weight_map": {"w": "model-00002-of-00002.safetensors", "b": "model-00001-of-00002.safetensors"}})
    error = _import_within(model, tmp_path / "ckpt")
    assert isinstance(error, CheckpointingException), error
    assert "'b'" in str(error) and "it is in model-00002-of-00002.safetensors" in str(error), error


def _raw_safetensors(path: Path, header: dict, data: bytes) -> Path:
    encoded = json.dumps(header).encode()
    path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + data)
    return path


def _f32(shape: list, offsets: list) -> dict:
    return {"dtype": "F32", "shape": shape, "data_offsets": offsets}


@pytest.mark.parametrize("header, data", [
    pytest.param({"a": _f32([-1, -2], [0, 8])}, bytes(8), id="negative-dimensions"),
    pytest.param({"a": _f32([2**40, 2**40, 0], [0, 0])}, b"", id="overflowing-dimensions"),
    pytest.param({"a": _f32([2**64], [0, 8])}, bytes(8), id="dimension-past-64-bits"),
    pytest.param({"a": _f32([True], [0, 4])}, bytes(4), id="boolean-dimension"),
    pytest.param({"a": _f32([2], [0, 8]), "b": _f32([2], [4, 12])}, bytes(12), id="overlapping-offsets"),
    pytest.param({"a": _f32([2], [0, 8]), "b": _f32([2], [0, 8])}, bytes(8), id="aliased-offsets"),
    pytest.param({"a": _f32([1], [0, 4]), "b": _f32([1], [8, 12])}, bytes(12), id="gap-between-tensors"),
    pytest.param({"a": _f32([4], [0, 16])}, bytes(8), id="offsets-past-the-end"),
    pytest.param({"a": _f32([3], [0, 8])}, bytes(12), id="size-not-dtype-times-shape"),
    pytest.param({"a": _f32([1], [0, 4, 5])}, bytes(4), id="three-offsets"),
    pytest.param({"__metadata__": {"x": 1}, "a": _f32([1], [0, 4])}, bytes(4), id="metadata-not-strings"),
    pytest.param({"a": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}, bytes(4), id="dtype-not-a-name"),
])
def test_a_header_the_safetensors_library_refuses_is_refused_naming_the_file(
    tmp_path: Path, header: dict, data: bytes
) -> None:
    """Issue 41.7d: the import's own memory-mapping reader checks what the library checks."""
    from safetensors import SafetensorError, safe_open

    path = _raw_safetensors(tmp_path / "forged.safetensors", header, data)
    with pytest.raises(SafetensorError), safe_open(str(path), "pt") as f:  # the library refuses it
        [f.get_tensor(name) for name in f.keys()]
    error = _import_within(path, tmp_path / "ckpt")
    assert isinstance(error, CheckpointingException), error
    assert "forged.safetensors" in str(error), error
    assert not (tmp_path / "ckpt").exists()


def test_a_header_the_library_accepts_imports(tmp_path: Path) -> None:
    """The checks refuse nothing the format allows: tensors in any order in the header,
    an unaligned offset, a zero-sized tensor, extra fields."""
    header = {"b": {"dtype": "F32", "shape": [1], "data_offsets": [1, 5], "note": "kept"},
              "a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "z": _f32([0, 3], [5, 5])}
    path = _raw_safetensors(tmp_path / "odd.safetensors", header, bytes([7]) + torch.tensor([2.5]).numpy().tobytes())
    assert _import_within(path, tmp_path / "ckpt") is None
    loaded = load_plain_tensors(tmp_path / "ckpt")
    assert loaded["a"].tolist() == [7] and loaded["b"].tolist() == [2.5] and loaded["z"].shape == (0, 3)
