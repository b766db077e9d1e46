"""Issue 27.3: conversions that do what they say. A DCP (or Megatron torch_dist / zarr)
checkpoint becomes a ``torch.save`` file in one command, ``.pt`` and safetensors convert
both ways, a destination named for another format than ``--to`` is refused, outputs
follow the umask, a failed conversion leaves nothing, and sharded objects keep their
type through a ``.pt`` file."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from shardstore import (
    CheckpointingException,
    SaveOptions,
    ShardedObject,
    ShardedTensor,
    StorageLayout,
    load_sharded_metadata,
    save,
)
from shardstore.tools.inspection import value_differences
from tests.scenarios import assert_bits_equal, global_tensor
from tests.test_cli import run

LEGACY = Path(__file__).resolve().parent / "fixtures" / "legacy"
FC1 = global_tensor("decoder/fc1", (8, 6), torch.float32)
EMB = global_tensor("embedding/word", (16, 4), torch.bfloat16)
RNG = torch.arange(200, 216, dtype=torch.uint8)  # what torch.get_rng_state() returns: uint8 bytes


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def _checkpoint(path: Path, options: SaveOptions | None = None) -> Path:
    """A small shardstore checkpoint with sharded objects of three types."""
    save({"model": {"fc1": ShardedTensor.from_rank_offsets("decoder/fc1", FC1),
                    "emb": ShardedTensor.from_rank_offsets("embedding/word", EMB)},
          "rng": ShardedObject("rng_state", RNG, (1,), (0,)),
          "config": ShardedObject("config", {"lr": 0.1, "layers": [1, 2]}, (1,), (0,)),
          "name": ShardedObject("run_name", "gpt-small", (1,), (0,)),
          "iteration": 1000}, path, **({"options": options} if options else {}))
    return path


def _dcp_checkpoint(path: Path) -> dict:
    """A PyTorch DCP save (in this process) of nested dicts, a list and plain values."""
    state = {"model": {"fc1.weight": FC1.clone(), "emb": EMB.clone()}, "step": torch.tensor(7),
             "epoch": 3, "config": {"lr": 0.1, "name": "x"}, "schedule": [torch.ones(2), 5], "rng": RNG.clone()}
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(state, checkpoint_id=path)
    return state


def _assert_same(actual: object, expected: object) -> None:
    differences = list(value_differences(actual, expected))
    assert not differences, differences


def _entries(directory: Path) -> set[str]:
    """Every path under ``directory``, hidden ones included."""
    return {str(p.relative_to(directory)) for p in directory.rglob("*")}


# ------------------------------------------------------------------ DCP and Megatron to .pt


def test_a_dcp_checkpoint_becomes_what_dcp_to_torch_save_writes_in_one_command(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    saved = _dcp_checkpoint(tmp_path / "dcp")
    code, out, err = run("convert", str(tmp_path / "dcp"), str(tmp_path / "model.pt"))
    assert code == 0, err
    assert "wrote 4 tensors" in out and (tmp_path / "model.pt").is_file()  # 0-dim step: a value, as in save
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "reference.pt")
    ours = _load(tmp_path / "model.pt")
    _assert_same(ours, _load(tmp_path / "reference.pt"))
    _assert_same(ours, saved)  # the state dict DCP was given, nesting and types included
    assert ours["epoch"] == 3 and ours["schedule"][1] == 5 and ours["rng"].dtype == torch.uint8


def test_a_dcp_checkpoint_imported_then_exported_is_the_torch_file_of_the_dcp_checkpoint(tmp_path: Path) -> None:
    """DCP -> shardstore -> .pt gives what DCP -> .pt gives. Before, the import kept no
    place of its arrays: the export put each at its flattened DCP name at the top
    (``sd["model.fc1.weight"]``, ``sd["schedule.0"]``) instead of where DCP's state dict
    had it, and a list slot or dict that held only tensors was lost."""
    saved = _dcp_checkpoint(tmp_path / "dcp")
    assert run("convert", str(tmp_path / "dcp"), str(tmp_path / "direct.pt"))[0] == 0
    code, _, err = run("convert", str(tmp_path / "dcp"), str(tmp_path / "ckpt"))
    assert code == 0, err
    code, _, err = run("convert", str(tmp_path / "ckpt"), str(tmp_path / "via.pt"))
    assert code == 0, err
    via = _load(tmp_path / "via.pt")
    _assert_same(via, _load(tmp_path / "direct.pt"))
    _assert_same(via, saved)
    code, _, err = run("convert", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--to", "safetensors")
    assert code == 0, err
    assert run("convert", str(tmp_path / "hf"), str(tmp_path / "via_hf.pt"))[0] == 0
    _assert_same(_load(tmp_path / "via_hf.pt"), saved)


@pytest.mark.parametrize("fixture", ["megatron-0.16.1-torch_dist", "megatron-0.14.0-zarr"])
def test_a_megatron_checkpoint_becomes_the_torch_file_of_its_conversion(tmp_path: Path, fixture: str) -> None:
    code, _, err = run("convert", str(LEGACY / fixture), str(tmp_path / "direct.pt"), "--to", "torch")
    assert code == 0, err
    assert run("convert", str(LEGACY / fixture), str(tmp_path / "ckpt"))[0] == 0
    assert run("convert", str(tmp_path / "ckpt"), str(tmp_path / "via.pt"))[0] == 0
    direct = _load(tmp_path / "direct.pt")
    _assert_same(direct, _load(tmp_path / "via.pt"))
    assert direct["rng_state/shard_1_2"] == {"seed": 1235, "rank": 1}  # an object, not bytes
    assert direct["decoder"]["fc1"].shape == (8, 6) and direct["iteration"] == 7


# ------------------------------------------------------------------ .pt <-> safetensors


def test_a_torch_file_becomes_sharded_safetensors_and_comes_back(tmp_path: Path) -> None:
    embedding = torch.randn(10, 4)
    torch.save({"model": {"embed.weight": embedding, "lm_head.weight": embedding,  # tied: one storage
                          "norm": {"weight": torch.ones(4, dtype=torch.bfloat16)}},
                "transposed": torch.arange(6.0).reshape(2, 3).t(),  # not contiguous
                "step": 12, "args": {"lr": 0.5}}, tmp_path / "model.pt")
    code, out, err = run("convert", str(tmp_path / "model.pt"), str(tmp_path / "hf"), "--to", "safetensors",
                         "--max-shard-size", "100B")
    assert code == 0, err
    assert "left out" not in err  # the values go into the first file's metadata
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {"model/embed.weight", "model/lm_head.weight", "model/norm/weight",
                                        "transposed"}
    assert len(set(index["weight_map"].values())) > 1
    assert index["metadata"]["total_size"] == 10 * 4 * 4 * 2 + 4 * 2 + 6 * 4
    tensors = {}
    for name in set(index["weight_map"].values()):
        tensors.update(load_file(tmp_path / "hf" / name))
    assert_bits_equal(tensors["model/lm_head.weight"], embedding)
    assert_bits_equal(tensors["transposed"], torch.arange(6.0).reshape(2, 3).t().contiguous())

    code, _, err = run("convert", str(tmp_path / "hf"), str(tmp_path / "back.pt"))
    assert code == 0, err
    back = _load(tmp_path / "back.pt")
    assert_bits_equal(back["model"]["embed.weight"], embedding)
    assert_bits_equal(back["model"]["norm"]["weight"], torch.ones(4, dtype=torch.bfloat16))
    assert back["step"] == 12 and back["args"] == {"lr": 0.5}


def test_a_hugging_face_safetensors_file_becomes_a_flat_torch_file(tmp_path: Path) -> None:
    weights = {"model.layers.0.mlp.weight": torch.randn(6, 3).bfloat16(), "lm_head.weight": torch.randn(5, 3)}
    save_file(weights, tmp_path / "model.safetensors")
    code, _, err = run("convert", str(tmp_path / "model.safetensors"), str(tmp_path / "model.pt"))
    assert code == 0, err
    back = _load(tmp_path / "model.pt")
    assert set(back) == set(weights)
    for name, tensor in weights.items():
        assert_bits_equal(back[name], tensor, name)


@pytest.mark.parametrize("shard_size", ["5GB", "100B"])
def test_safetensors_sharded_anew_keep_the_metadata_of_their_files(tmp_path: Path, shard_size: str) -> None:
    """safetensors -> safetensors (sharded anew) keeps the files' ``__metadata__``. Before,
    every entry but ``format`` was dropped without a word (a model's ``author``, a
    quantizer's settings)."""
    from safetensors import safe_open

    (tmp_path / "hf").mkdir()
    weights = {"model.embed": torch.randn(8, 4), "lm_head.weight": torch.randn(4, 4).bfloat16()}
    metadata = {"format": "pt", "author": "me", "quantization": "{\"bits\": 8}"}
    save_file(weights, tmp_path / "hf" / "model.safetensors", metadata=metadata)
    code, _, err = run("convert", str(tmp_path / "hf"), str(tmp_path / "out"), "--to", "safetensors",
                       "--max-shard-size", shard_size)
    assert code == 0, err
    files = sorted((tmp_path / "out").glob("*.safetensors"))
    assert len(files) == (1 if shard_size == "5GB" else 2)
    for file in files:
        with safe_open(file, "pt") as f:
            kept = {k: v for k, v in (f.metadata() or {}).items() if k != "shardstore_layout"}
        assert kept == metadata, file.name


def test_complex_and_fnuz_float8_safetensors_convert_both_ways(tmp_path: Path) -> None:
    """The safetensors library writes complex64 (``C64``) and the fnuz float8 dtypes
    (``F8_E4M3FNUZ``, ``F8_E5M2FNUZ``). Before, such a file was refused as one of a dtype
    "shardstore cannot read", and a torch.save file holding them as "safetensors cannot
    hold" them."""
    weights = {"c": torch.randn(3, dtype=torch.complex64),
               "e4": torch.randn(4).to(torch.float8_e4m3fnuz), "e5": torch.randn(4).to(torch.float8_e5m2fnuz)}
    save_file(weights, tmp_path / "model.safetensors")
    code, _, err = run("convert", str(tmp_path / "model.safetensors"), str(tmp_path / "model.pt"))
    assert code == 0, err
    code, _, err = run("convert", str(tmp_path / "model.pt"), str(tmp_path / "back"), "--to", "safetensors")
    assert code == 0, err
    for back in (_load(tmp_path / "model.pt"), load_file(tmp_path / "back" / "model.safetensors")):
        assert set(back) == set(weights)
        for name, tensor in weights.items():
            assert back[name].dtype == tensor.dtype, name
            assert_bits_equal(back[name], tensor, name)


def test_unsigned_integers_of_every_width_convert_both_ways(tmp_path: Path) -> None:
    """safetensors' U8 to U64 (quantization scales and packed weights use them): values
    above the signed range keep their bits through a torch file and back."""
    weights = {f"u{bits}": torch.tensor([0, 1, 2 ** (bits - 1) + 5, 2**bits - 1], dtype=torch.uint64).to(dtype)
               if bits < 64 else torch.tensor([0, 1, 2**63 + 5, 2**64 - 1], dtype=torch.uint64)
               for bits, dtype in ((8, torch.uint8), (16, torch.uint16), (32, torch.uint32), (64, torch.uint64))}
    save_file(weights, tmp_path / "model.safetensors")
    code, _, err = run("convert", str(tmp_path / "model.safetensors"), str(tmp_path / "model.pt"))
    assert code == 0, err
    code, _, err = run("convert", str(tmp_path / "model.pt"), str(tmp_path / "back"), "--to", "safetensors")
    assert code == 0, err
    (back_file,) = (tmp_path / "back").glob("*.safetensors")
    for back in (_load(tmp_path / "model.pt"), load_file(back_file)):
        assert set(back) == set(weights)
        for name, tensor in weights.items():
            assert back[name].dtype == tensor.dtype, name
            assert_bits_equal(back[name], tensor, name)


def test_one_element_and_empty_views_of_a_torch_file_become_safetensors(tmp_path: Path) -> None:
    """A torch file keeps a view's strides: an element sliced from a column, or an empty
    column, has a stride other than 1, which torch calls contiguous but cannot view as
    bytes (``format.dtypes.byte_view`` gives such tensors unit strides)."""
    grid = torch.arange(6.0).reshape(3, 2)
    weights = {"one": grid[:1, 1], "none": torch.empty(0, 4)[:, 1], "whole": grid}
    assert weights["one"].stride() == (2,) and weights["none"].stride() == (4,)
    torch.save(weights, tmp_path / "model.pt")
    code, _, err = run("convert", str(tmp_path / "model.pt"), str(tmp_path / "out"), "--to", "safetensors")
    assert code == 0, err
    (written,) = (tmp_path / "out").glob("*.safetensors")
    back = load_file(written)
    for name, tensor in weights.items():
        assert_bits_equal(back[name], tensor.contiguous(), name)


@pytest.mark.parametrize("view", ["column", "every_other", "expanded"])
def test_a_strided_1d_view_of_a_torch_file_becomes_safetensors(tmp_path: Path, view: str) -> None:
    """A 1-D view whose last stride is not 1 (a column, ``x[::2]``, an expanded tensor)
    is written by value. Before, ``byte_view`` relied on ``reshape(-1)`` to copy it,
    which returns a 1-D view unchanged: "self.stride(-1) must be 1"."""
    grid = torch.arange(24.0).reshape(4, 6)
    tensor = {"column": grid[:, 1], "every_other": torch.arange(10.0)[::2], "expanded": torch.ones(1).expand(4)}[view]
    torch.save({"w": tensor, "grid": grid}, tmp_path / "model.pt")
    code, _, err = run("convert", str(tmp_path / "model.pt"), str(tmp_path / "out"), "--to", "safetensors")
    assert code == 0, err
    back = load_file(tmp_path / "out" / "model.safetensors")
    assert_bits_equal(back["w"], tensor.contiguous(), "w")


def test_a_strided_1d_tensor_of_the_common_state_becomes_safetensors(tmp_path: Path) -> None:
    """The same through a shardstore checkpoint, whose ``common.pt`` keeps a view's
    strides (it failed as the torch file's did)."""
    save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(3)), "ema": torch.arange(10.0)[::2]}, tmp_path / "ckpt")
    code, _, err = run("convert", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--to", "safetensors")
    assert code == 0, err
    back = load_file(tmp_path / "out" / "model.safetensors")
    assert_bits_equal(back["ema"], torch.arange(10.0)[::2].contiguous(), "ema")


@pytest.mark.parametrize("source", ["torch", "common"])
def test_a_tensor_named_metadata_is_refused_not_written_as_an_unreadable_file(tmp_path: Path, source: str) -> None:
    """A tensor named ``__metadata__`` (a torch file's key, a common-state key) would
    take the header's metadata entry. Before, the file was written and the command
    succeeded, but every reader (the safetensors library's, shardstore's) refused it."""
    if source == "torch":
        torch.save({"__metadata__": torch.ones(2), "w": torch.zeros(2)}, tmp_path / "model.pt")
        src = tmp_path / "model.pt"
    else:
        src = tmp_path / "ckpt"
        save({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2)), "__metadata__": torch.ones(2)}, src)
    code, _, err = run("convert", str(src), str(tmp_path / "st"), "--to", "safetensors")
    assert code == 2 and "a tensor is named '__metadata__'" in err and "convert to a torch.save file" in err, err
    assert not (tmp_path / "st").exists()


# ------------------------------------------------------------------ destinations


@pytest.mark.parametrize(("destination", "to", "says"), [
    ("out.pt", "shardstore", "name a directory, e.g. out/ (or --to torch to write"),
    ("out", "torch", "name it out.pt"),
    ("out/", "torch", "name it out.pt"),
    ("x.pt", "safetensors", "name a directory, e.g. x/"),
    ("model.safetensors", None, "name a directory, e.g. model/"),
])
def test_a_destination_named_for_another_format_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, destination: str, to: str | None, says: str
) -> None:
    _dcp_checkpoint(tmp_path / "dcp")
    before = _entries(tmp_path)
    monkeypatch.chdir(tmp_path)
    code, _, err = run("convert", "dcp", destination, *(["--to", to] if to else []))
    assert code == 2 and err.startswith("shardstore: error:") and says in err, err
    assert err.count("\n") == 1
    assert _entries(tmp_path) == before


@pytest.mark.parametrize(("destination", "to"), [("inside.pt", None), ("hf", "safetensors"), (".", "safetensors"),
                                                  ("sub/ckpt", "shardstore")])
def test_a_destination_inside_the_source_checkpoint_is_refused(tmp_path: Path, destination: str, to: str | None) -> None:
    """Before, ``convert CKPT CKPT/inside.pt`` wrote the file into the checkpoint."""
    source = _checkpoint(tmp_path / "ckpt")
    before = _entries(source)
    code, _, err = run("convert", str(source), str(source / destination), *(["--to", to] if to else []))
    assert code == 2 and "is inside the source" in err and err.count("\n") == 1, err
    assert _entries(source) == before


@pytest.mark.parametrize("export", ["to_torch_file", "to_safetensors"])
def test_an_export_through_the_api_into_its_source_checkpoint_is_refused(tmp_path: Path, export: str) -> None:
    """``convert.to_torch_file(ckpt, ckpt / "model.pt")`` (and ``to_safetensors``) is
    refused as the command refuses it. Before, only the command checked: the API wrote
    the file into the committed checkpoint, which ``verify`` then reported damaged
    ("not listed by the commit record")."""
    from shardstore import verify
    from shardstore.tools import convert

    source = _checkpoint(tmp_path / "ckpt")
    before = _entries(source)
    with pytest.raises(CheckpointingException, match="is inside the source"):
        getattr(convert, export)(source, source / ("model.pt" if export == "to_torch_file" else "hf"))
    assert _entries(source) == before and verify(source).ok


def test_outputs_get_the_modes_open_and_mkdir_give(tmp_path: Path) -> None:
    source = _checkpoint(tmp_path / "ckpt")
    previous = os.umask(0o027)
    try:
        with open(tmp_path / "reference", "w"):
            pass
        (tmp_path / "reference_dir").mkdir()
        assert run("convert", str(source), str(tmp_path / "model.pt"))[0] == 0
        assert run("convert", str(source), str(tmp_path / "out" / "hf"), "--to", "safetensors",
                   "--max-shard-size", "100B")[0] == 0
    finally:
        os.umask(previous)
    file_mode = stat.S_IMODE((tmp_path / "reference").stat().st_mode)
    dir_mode = stat.S_IMODE((tmp_path / "reference_dir").stat().st_mode)
    written = [tmp_path / "model.pt", *(tmp_path / "out" / "hf").iterdir()]
    assert len(written) == 4  # the .pt, two shards, the index
    assert {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in written} == {p.name: oct(file_mode) for p in written}
    for directory in (tmp_path / "out", tmp_path / "out" / "hf"):
        assert oct(stat.S_IMODE(directory.stat().st_mode)) == oct(dir_mode), directory


@pytest.fixture
def damaged(tmp_path: Path) -> Path:
    """A checkpoint whose second array (by key) has a corrupt chunk."""
    # per array: the chunk file to corrupt is the array's own (the default packs it)
    path = _checkpoint(tmp_path / "damaged", SaveOptions(layout=StorageLayout(pack_arrays_up_to=0)))
    chunk = next((path / "embedding" / "word").glob("c.*"))
    chunk.write_bytes(chunk.read_bytes()[:-1] + bytes([chunk.read_bytes()[-1] ^ 1]))
    return path


def test_a_failed_export_leaves_nothing_behind(tmp_path: Path, damaged: Path) -> None:
    before = _entries(tmp_path)
    for destination in (["new/hf", "--to", "safetensors", "--max-shard-size", "100B"], ["new/deeper/model.pt"],
                        ["new/ckpt.pt", "--to", "torch"]):
        code, _, err = run("convert", str(damaged), str(tmp_path / destination[0]), *destination[1:])
        assert code == 2 and "embedding/word" in err, err
        assert _entries(tmp_path) == before, destination


def test_a_failed_export_into_an_existing_empty_directory_leaves_it_empty(tmp_path: Path, damaged: Path) -> None:
    (tmp_path / "hf").mkdir()
    code, _, _ = run("convert", str(damaged), str(tmp_path / "hf"), "--to", "safetensors", "--max-shard-size", "100B")
    assert code == 2
    assert list((tmp_path / "hf").iterdir()) == [] and not [p for p in tmp_path.iterdir() if ".partial" in p.name]


# ------------------------------------------------------------------ objects keep their type


def test_sharded_objects_stay_python_objects_in_a_torch_file_and_come_back_as_objects(tmp_path: Path) -> None:
    source = _checkpoint(tmp_path / "ckpt")
    assert run("convert", str(source), str(tmp_path / "model.pt"))[0] == 0
    exported = _load(tmp_path / "model.pt")
    assert exported["config/shard_0_1"] == {"lr": 0.1, "layers": [1, 2]}
    assert exported["run_name/shard_0_1"] == "gpt-small"
    assert_bits_equal(exported["rng_state/shard_0_1"], RNG)

    code, _, err = run("convert", str(tmp_path / "model.pt"), str(tmp_path / "back"))
    assert code == 0, err
    metadata = load_sharded_metadata(tmp_path / "back")
    assert isinstance(metadata["rng_state/shard_0_1"], ShardedObject)  # not a uint8 array
    assert isinstance(metadata["config/shard_0_1"], ShardedObject)
    assert run("diff", str(source), str(tmp_path / "back")) == (0, "identical\n", "")


def test_object_shards_of_a_torch_file_are_left_out_of_safetensors(tmp_path: Path) -> None:
    source = _checkpoint(tmp_path / "ckpt")
    assert run("convert", str(source), str(tmp_path / "model.pt"))[0] == 0
    code, _, err = run("convert", str(tmp_path / "model.pt"), str(tmp_path / "hf"), "--to", "safetensors")
    assert code == 0 and "rng_state/shard_0_1" in err
    assert set(load_file(tmp_path / "hf" / "model.safetensors")) == {"decoder/fc1", "embedding/word"}


def test_dcp_saved_paths_are_taken_only_when_well_formed() -> None:
    from shardstore.other_formats.dcp import _saved_paths

    assert _saved_paths({"a.b": ("a", "b"), "l.0": ("l", 0)}, 2) == {"a.b": ("a", "b"), "l.0": ("l", 0)}
    assert _saved_paths({"l.9": ("l", 10**12)}, 2) == {}  # a list index no checkpoint of 2 entries has
    assert _saved_paths({"a": "a"}, 1) == {} and _saved_paths(None, 1) == {}
    # each of N keys the last of its own N-slot list: N**2 slots from a metadata of N entries
    n = 2000
    assert _saved_paths({f"k{i}": (f"p{i}", n - 1) for i in range(n)}, n) == {}
    dense = {"l.0.x": ("l", 0, "x"), "l.1.0": ("l", 1, 0), "l.1.1": ("l", 1, 1)}
    assert _saved_paths(dense, 3) == dense


def test_a_checkpoint_with_an_array_named_like_a_safetensors_file_converts_as_a_checkpoint(tmp_path: Path) -> None:
    """A committed checkpoint whose array key is ``model.safetensors`` (a directory of
    that name at its top) is a shardstore checkpoint to ``convert``. Before, it was
    taken for a safetensors model directory and refused: "model.safetensors is not a
    regular file"."""
    save({"a": ShardedTensor.from_rank_offsets("model.safetensors", FC1)}, tmp_path / "ckpt")
    code, out, err = run("convert", str(tmp_path / "ckpt"), str(tmp_path / "model.pt"), "--json")
    assert code == 0, err
    assert json.loads(out)["source_format"] == "shardstore"
    assert_bits_equal(_load(tmp_path / "model.pt")["model.safetensors"], FC1)
