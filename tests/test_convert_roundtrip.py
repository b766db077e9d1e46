"""Issue 33.6 and 33.7: conversions that lose nothing and fail cleanly.

A real FSDP2 + AdamW state (2 gloo ranks), saved by the checkpoint manager and by
PyTorch DCP, goes through every conversion path (shardstore, ``torch.save``, safetensors,
DCP, in chains) and comes back as the same checkpoint (``shardstore diff`` finds
nothing) that loads into the same model and optimizer and takes the same next step.
AdamW's 0-dim ``step`` stays a value of the common state, int keys stay ints, tuples
stay tuples. A full disk while writing a ``.pt`` says which file and why, and leaves
nothing there.
"""

from __future__ import annotations

import errno
import json
import os
import zipfile
from pathlib import Path

import pytest
import torch

import shardstore
from shardstore import (
    CheckpointingException,
    ShardedTensor,
    ShardstoreReader,
    load_common_state_dict,
    save,
)
from shardstore.other_formats import layout as convert_layout
from shardstore.tools.convert import from_torch_file, to_torch_file
from shardstore.tools.manager import CheckpointManager
from tests import fsdp_models as fm
from tests.dist import run_distributed
from tests.test_cli import run

# ------------------------------------------------------------------ a real FSDP2 + AdamW state


def save_sources(rank: int, world: int, root: str) -> bytes:
    """Two AdamW steps of FSDP2 at ``world`` ranks, saved by the manager and by DCP."""
    import torch.distributed.checkpoint as dcp

    model, optimizer = fm.build(world)
    fm.train_step(model, optimizer, 0)
    fm.train_step(model, optimizer, 1)
    state = fm.state_dict(model, optimizer)
    manager = CheckpointManager(f"{root}/run")
    assert manager.save(2, state, force=True)
    manager.close()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(f"{root}/dcp"))
    return fm.to_bytes(fm.full_values(state))


def load_and_step(rank: int, world: int, converted: str, original: str, saved: bytes, through_dcp: bool = True) -> None:
    """The converted checkpoint loads into a fresh model and optimizer bit-exact (by
    ``shardstore.load`` and by ``dcp.load``), and the next step from it is the next step
    from the original."""
    import torch.distributed.checkpoint as dcp

    states = []
    for path in (converted, original):
        model, optimizer = fm.build(world, seed=11)
        fm.train_step(model, optimizer, 99)  # other weights and optimizer state than the saved ones
        fm.apply(model, optimizer, shardstore.load(fm.state_dict(model, optimizer), path))
        states.append((model, optimizer))
    fm.assert_same(fm.full_values(fm.state_dict(*states[0])), fm.from_bytes(saved))
    if through_dcp:  # and through DCP's API on our format, where the issue saw it fail
        model, optimizer = fm.build(world, seed=12)
        dcp.load(state := fm.state_dict(model, optimizer), storage_reader=ShardstoreReader(converted))
        fm.apply(model, optimizer, state)
        fm.assert_same(fm.full_values(fm.state_dict(model, optimizer)), fm.from_bytes(saved))
    for model, optimizer in states:
        fm.train_step(model, optimizer, 2)
    fm.assert_same(fm.full_values(fm.state_dict(*states[0])), fm.full_values(fm.state_dict(*states[1])))


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, bytes]:
    root = tmp_path_factory.mktemp("sources")
    saved = run_distributed(save_sources, 2, str(root))[0]
    (step,) = [p for p in (root / "run").iterdir() if p.name.startswith("iter_")]
    return step, root / "dcp", saved


def _convert(source: Path, kind: str, out: Path) -> Path:
    """``source`` converted by the command (DCP: by ``torch_save_to_dcp`` of a ``.pt``)."""
    if kind == "dcp":
        from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

        torch_save_to_dcp(source, out)
        return out
    destination = out.with_suffix(".pt") if kind == "torch" else out
    code, _, err = run("convert", str(source), str(destination), *(["--to", kind] if kind != "torch" else []))
    assert code == 0, err
    assert "left out" not in err  # nothing of an FSDP2 + AdamW state is lost on the way
    return destination


CHAINS = {
    "shardstore > pt > shardstore": ("shardstore", ["torch", "shardstore"]),
    "shardstore > safetensors > shardstore": ("shardstore", ["safetensors", "shardstore"]),
    "shardstore > pt > safetensors > shardstore": ("shardstore", ["torch", "safetensors", "shardstore"]),
    "shardstore > safetensors > pt > shardstore": ("shardstore", ["safetensors", "torch", "shardstore"]),
    "shardstore > pt > dcp > shardstore": ("shardstore", ["torch", "dcp", "shardstore"]),
    "dcp > shardstore": ("dcp", ["shardstore"]),
    "dcp > pt > shardstore": ("dcp", ["torch", "shardstore"]),
    "dcp > safetensors > shardstore": ("dcp", ["safetensors", "shardstore"]),
}


@pytest.mark.parametrize("chain", CHAINS)
def test_an_fsdp2_adamw_checkpoint_converts_back_to_itself_and_loads(
    chain: str, sources: tuple[Path, Path, bytes], tmp_path: Path
) -> None:
    original, dcp_dir, saved = sources
    start, kinds = CHAINS[chain]
    current = original if start == "shardstore" else dcp_dir
    for i, kind in enumerate(kinds):
        current = _convert(current, kind, tmp_path / f"{i}-{kind}")
    assert run("diff", str(original), str(current)) == (0, "identical\n", "")
    common = load_common_state_dict(current)
    assert common["optim"]["state"]["0.weight"]["step"].item() == 2.0  # a value, not an array
    run_distributed(load_and_step, 2, str(current), str(original), saved)


def test_a_dcp_checkpoint_loads_directly_as_shardstore_keeps_the_state(sources: tuple[Path, Path, bytes]) -> None:
    """``shardstore.load`` of DCP's own save: ``step`` and the param groups where the
    request has them (they were flat keys and an array before)."""
    original, dcp_dir, saved = sources
    run_distributed(load_and_step, 2, str(dcp_dir), str(original), saved, False)


# ------------------------------------------------------------------ int keys, lists, tuples


def _nested_state() -> dict:
    """A plain optimizer state dict (int keys), arrays named by '/' paths that differ
    from their places, tensors and values in lists, tuples."""
    w = torch.arange(12.0).reshape(3, 4)
    return {
        "model": {"w": ShardedTensor.from_rank_offsets("model/w", w)},
        "optim": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": ShardedTensor.from_rank_offsets("optim/state/0/exp_avg", w * 2)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0], "foreach": None, "fused": False}],
        },
        "schedule": [torch.ones(2), 5, "cosine", None],
        "0": {"shadow": 1},  # a str key beside an int one
    }


@pytest.mark.parametrize("kind", ["torch", "safetensors"])
def test_int_keys_lists_and_tuples_come_back_as_they_were(kind: str, tmp_path: Path) -> None:
    save(_nested_state(), tmp_path / "ckpt")
    exported = _convert(tmp_path / "ckpt", kind, tmp_path / "exported")
    back = _convert(exported, "shardstore", tmp_path / "back")
    assert run("diff", str(tmp_path / "ckpt"), str(back)) == (0, "identical\n", "")
    common = load_common_state_dict(back)
    assert list(common["optim"]["state"]) == [0] and isinstance(common["optim"]["state"][0]["step"], torch.Tensor)
    assert common["optim"]["param_groups"][0]["betas"] == (0.9, 0.95)
    assert common["schedule"][1:] == [5, "cosine", None] and common["0"] == {"shadow": 1}
    assert sorted(shardstore.load_tensors_metadata(back)) == ["model/w", "optim/state/0/exp_avg"]


def test_a_torch_file_keeps_its_layout_where_torch_load_does_not_see_it(tmp_path: Path) -> None:
    save(_nested_state(), tmp_path / "ckpt")
    to_torch_file(tmp_path / "ckpt", tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=True)
    assert "shardstore_layout.json" not in loaded and loaded["optim"]["state"][0]["step"].item() == 3.0
    layout = convert_layout.read_torch_layout(tmp_path / "model.pt")
    assert layout is not None and layout.arrays["optim/state/0/exp_avg"] == ("optim", "state", "0", "exp_avg")


def test_a_torch_file_list_mixing_tensors_and_values_keeps_its_indices_through_safetensors(tmp_path: Path) -> None:
    """``.pt`` -> safetensors -> shardstore keeps a list's indices as a direct import
    does (``[None, 5, 7]``). Before, the safetensors export dropped the list's tensor
    from the common state, shifting the other values: ``[5, 7]``."""
    torch.save({"sched": [torch.ones(2), 5, 7], "w": torch.zeros(3)}, tmp_path / "model.pt")
    _convert(tmp_path / "model.pt", "shardstore", tmp_path / "direct")
    _convert(_convert(tmp_path / "model.pt", "safetensors", tmp_path / "st"), "shardstore", tmp_path / "via_st")
    assert load_common_state_dict(tmp_path / "direct")["sched"] == [None, 5, 7]
    assert load_common_state_dict(tmp_path / "via_st")["sched"] == [None, 5, 7]


def test_a_torch_file_list_mixing_tensors_and_values_goes_through_safetensors_back_to_a_torch_file(
    tmp_path: Path,
) -> None:
    """Before, the shifted list put a value where the tensor goes back, and the export
    to a torch file failed: "another value is already at ['sched', 0]"."""
    torch.save({"sched": [torch.ones(2), 5, 7]}, tmp_path / "model.pt")
    exported = _convert(tmp_path / "model.pt", "safetensors", tmp_path / "st")
    to_torch_file(exported, tmp_path / "back.pt")
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert back["sched"][1:] == [5, 7] and torch.equal(back["sched"][0], torch.ones(2))


def test_a_checkpoint_with_an_array_in_a_list_beside_values_becomes_a_torch_file_and_back(tmp_path: Path) -> None:
    """The array ``layers/0`` of a common state holding ``layers: [None, 5]`` goes to
    the list's index 0. Before, its place was ``key.split('/')``, the str ``'0'``, and
    the export failed: "a list is where its path needs a dict"."""
    save({"layers": [ShardedTensor.from_rank_offsets("layers/0", torch.ones(2)), 5]}, tmp_path / "ckpt")
    to_torch_file(tmp_path / "ckpt", tmp_path / "model.pt")
    back = torch.load(tmp_path / "model.pt", weights_only=True)
    assert back["layers"][1] == 5 and torch.equal(back["layers"][0], torch.ones(2))
    converted_back = _convert(tmp_path / "model.pt", "shardstore", tmp_path / "back")
    assert run("diff", str(tmp_path / "ckpt"), str(converted_back)) == (0, "identical\n", "")


def _with_layout_entry(path: Path, text: str) -> None:
    with zipfile.ZipFile(path) as archive:
        entries = {name: archive.read(name) for name in archive.namelist()}
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in entries.items():
            archive.writestr(name, text if name.endswith(convert_layout.TORCH_ENTRY) else data)


@pytest.mark.parametrize("text, message", [
    ("{not json", "layout is malformed"),
    (json.dumps({"format": "shardstore-layout", "version": 1, "objects": [], "common": None,
                 "arrays": [["model/w", ["model", "nowhere"]]]}), "where the file holds nothing"),
    (json.dumps({"format": "shardstore-layout", "version": 1, "objects": [], "common": None,
                 "arrays": [["model/w", ["schedule", 1]]]}), "which holds a int"),
    (json.dumps({"format": "shardstore-layout", "version": 9, "objects": [], "arrays": []}), "version 9"),
])
def test_a_damaged_layout_is_refused_naming_the_file(tmp_path: Path, text: str, message: str) -> None:
    save(_nested_state(), tmp_path / "ckpt")
    to_torch_file(tmp_path / "ckpt", tmp_path / "model.pt")
    _with_layout_entry(tmp_path / "model.pt", text)
    with pytest.raises(CheckpointingException, match=message) as raised:
        from_torch_file(tmp_path / "model.pt", tmp_path / "back")
    assert str(tmp_path / "model.pt") in str(raised.value)
    assert not (tmp_path / "back").exists()


# ------------------------------------------------------------------ a full disk (33.7)


def _big_checkpoint(path: Path) -> Path:
    save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(1024, 1024))}, path)  # 4 MiB
    return path


def _assert_full_disk_reported(target: Path, code: int, err: str) -> None:
    assert code != 0
    assert str(target) in err and "No space left on device" in err, err
    assert "inline_container" not in err and "unexpected pos" not in err, err
    assert os.listdir(target.parent) == []  # no file, no temporary


def test_a_full_disk_while_writing_a_torch_file_names_the_file_and_leaves_nothing(
    tmp_path: Path, tiny_tmpfs: Path
) -> None:
    source = _big_checkpoint(tmp_path / "ckpt")
    target = tiny_tmpfs / "model.pt"
    code, _, err = run("convert", str(source), str(target))
    _assert_full_disk_reported(target, code, err)


class _FullAfter:
    """A file whose writes fail with ENOSPC after ``room`` bytes, as a full disk does."""

    def __init__(self, file, room: int) -> None:
        self.file, self.room = file, room

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()


def test_enospc_from_the_writer_names_the_file_and_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    """The same without a tmpfs: the file's writes fail as a full disk's do."""
    source = _big_checkpoint(tmp_path / "ckpt")
    (tmp_path / "out").mkdir()
    target = tmp_path / "out" / "model.pt"
    monkeypatch.setattr(convert_layout, "open", lambda path, mode: _FullAfter(open(path, mode), 4096), raising=False)
    code, _, err = run("convert", str(source), str(target))
    _assert_full_disk_reported(target, code, err)


def test_a_safetensors_layout_naming_a_missing_array_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    save(_nested_state(), tmp_path / "ckpt")
    _convert(tmp_path / "ckpt", "safetensors", tmp_path / "hf")
    file = tmp_path / "hf" / "model.safetensors"
    layout = convert_layout.read_safetensors_layout(file)
    tensors = load_file(file)
    del tensors["model/w"]
    file.unlink()
    save_file(tensors, file, metadata={"format": "pt", **convert_layout.safetensors_metadata(layout)})
    code, _, err = run("convert", str(tmp_path / "hf"), str(tmp_path / "back"))
    assert code != 0 and "'model/w'" in err and str(tmp_path / "hf") in err, err
    assert not (tmp_path / "back").exists()


def _plain_adamw_file(path: Path) -> torch.nn.Module:
    """``torch.save`` of a model and its AdamW ``state_dict()`` after one step: the
    optimizer's state is keyed by int parameter ids and holds only tensors."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
    return model


def test_a_plain_optimizer_state_goes_through_safetensors_back_to_a_torch_file_that_loads(tmp_path: Path) -> None:
    """``.pt`` -> safetensors -> ``.pt`` keeps ``optimizer.state`` a dict keyed by int
    parameter ids. Before, the export dropped the dicts that held only tensors, the
    layout's int places could not say dict key from list index, and the state came
    back a list ``[{...}, {...}]``: ``load_state_dict`` failed on ``list.items``."""
    model = _plain_adamw_file(tmp_path / "model.pt")
    exported = _convert(tmp_path / "model.pt", "safetensors", tmp_path / "st")
    to_torch_file(exported, tmp_path / "back.pt")
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    original = torch.load(tmp_path / "model.pt", weights_only=True)
    assert list(back["optimizer"]["state"]) == [0, 1]
    optimizer = torch.optim.AdamW(model.parameters())
    optimizer.load_state_dict(back["optimizer"])
    for index, parameter in enumerate(model.parameters()):
        for name, value in original["optimizer"]["state"][index].items():
            assert torch.equal(optimizer.state[parameter][name], value)


def test_a_plain_optimizer_state_imports_through_safetensors_as_directly(tmp_path: Path) -> None:
    """The safetensors export keeps the emptied dicts of the optimizer state; its import
    puts every array back into them, so the save drops them again and the checkpoint
    is the direct import's (``shardstore diff``: identical). It held before the fix
    too; it pins that keeping those dicts changes nothing a checkpoint holds."""
    _plain_adamw_file(tmp_path / "model.pt")
    direct = _convert(tmp_path / "model.pt", "shardstore", tmp_path / "direct")
    via = _convert(_convert(tmp_path / "model.pt", "safetensors", tmp_path / "st"), "shardstore", tmp_path / "via")
    assert run("diff", str(direct), str(via)) == (0, "identical\n", "")


@pytest.mark.parametrize("index", [10**12, 1])
def test_a_safetensors_layout_placing_an_array_far_past_its_list_is_refused(tmp_path: Path, index: int) -> None:
    """A layout that puts an array at ``["l", 10**12]`` (a list of no values and one
    array) is refused naming the file. Before, the export to a ``.pt`` padded the list
    with None up to that index: a bare ``MemoryError``, or, for a smaller index, memory
    and a file as large as the hostile number said."""
    from safetensors.torch import save_file

    layout = convert_layout.ExportStructure({"w": ("l", index)})
    file = tmp_path / "hf" / "model.safetensors"
    file.parent.mkdir()
    save_file({"w": torch.ones(2)}, file, metadata={"format": "pt", **convert_layout.safetensors_metadata(layout)})
    with pytest.raises(CheckpointingException, match=rf"index {index} of the list at \['l'\]") as raised:
        to_torch_file(tmp_path / "hf", tmp_path / "back.pt")
    assert str(file) in str(raised.value)
    assert not (tmp_path / "back.pt").exists()


def test_a_torch_file_with_keys_json_cannot_hold_becomes_safetensors_that_read_back(tmp_path: Path) -> None:
    """Tensors under dict keys a layout cannot hold as they are (a float, a negative
    int, a bool) are placed by their keys' text, as an import without a layout places
    them. Before, the export wrote them into the layout as they were and succeeded, and
    every reader of the result refused it: "its shardstore layout is malformed"."""
    torch.save({"m": {1.5: torch.ones(2), -1: torch.zeros(2), True: torch.ones(1)}, "x": 1}, tmp_path / "model.pt")
    code, _, err = run("convert", str(tmp_path / "model.pt"), str(tmp_path / "st"), "--to", "safetensors")
    assert code == 0 and "left out" not in err, err
    to_torch_file(tmp_path / "st", tmp_path / "back.pt")
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert sorted(back["m"]) == ["-1", "1.5", "True"] and back["x"] == 1
    assert torch.equal(back["m"]["-1"], torch.zeros(2))
    direct = _convert(tmp_path / "model.pt", "shardstore", tmp_path / "direct")
    via = _convert(tmp_path / "st", "shardstore", tmp_path / "via")
    assert run("diff", str(direct), str(via)) == (0, "identical\n", "")


# ------------------------------------------------------------------ an import keeps each array's place


def _assert_same_state(got: object, expected: object, path: tuple = ()) -> None:
    """``got`` is ``expected``: the same containers (a state dict's OrderedDict comes
    back a dict), keys of the same types (in any order), tensors bit-exact with their
    dtypes, values equal."""
    assert isinstance(got, dict) if isinstance(expected, dict) else type(got) is type(expected), (path, type(got))
    if isinstance(expected, dict):
        assert sorted(map(repr, got)) == sorted(map(repr, expected)), (path, list(got), list(expected))  # type: ignore[arg-type]
        for key, value in expected.items():
            _assert_same_state(got[key], value, (*path, key))  # type: ignore[index]
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), path  # type: ignore[arg-type]
        for index, value in enumerate(expected):
            _assert_same_state(got[index], value, (*path, index))  # type: ignore[index]
    elif isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and torch.equal(got, expected), path  # type: ignore[union-attr]
    else:
        assert got == expected, path


def _through_checkpoint(source: Path, route: str, tmp_path: Path) -> Path:
    """``source`` imported as a checkpoint and exported to a ``.pt`` by ``route``:
    directly, or through safetensors."""
    from shardstore.tools.convert import import_checkpoint, to_safetensors

    import_checkpoint(source, tmp_path / "ckpt")
    exported = tmp_path / "ckpt"
    if route == "safetensors":
        to_safetensors(exported, tmp_path / "st")
        exported = tmp_path / "st"
    to_torch_file(exported, tmp_path / "back.pt")
    return tmp_path / "back.pt"


@pytest.mark.parametrize("route", ["torch", "safetensors"])
def test_a_plain_optimizer_state_goes_through_a_checkpoint_back_to_a_torch_file_that_loads(
    route: str, tmp_path: Path
) -> None:
    """``.pt`` -> checkpoint -> ``.pt`` (directly, or through safetensors) gives the
    file's state dict back, ``optimizer.state`` keyed by int parameter ids, and a real
    AdamW restores its moments bit-exact. Before, the save dropped the dicts that held
    only tensors, so the checkpoint no longer knew their keys were ints: the export keyed
    the state by '0' and '1', which ``AdamW.load_state_dict`` accepted without a word,
    restoring no moments at all."""
    model = _plain_adamw_file(tmp_path / "model.pt")
    back = torch.load(_through_checkpoint(tmp_path / "model.pt", route, tmp_path), weights_only=True)
    original = torch.load(tmp_path / "model.pt", weights_only=True)
    _assert_same_state(back, original)
    optimizer = torch.optim.AdamW(model.parameters())
    optimizer.load_state_dict(back["optimizer"])
    assert len(optimizer.state) == 2
    for index, parameter in enumerate(model.parameters()):
        for name, value in original["optimizer"]["state"][index].items():
            assert torch.equal(optimizer.state[parameter][name], value), (index, name)


@pytest.mark.parametrize("route", ["torch", "safetensors"])
def test_int_keys_and_lists_emptied_by_the_save_come_back_as_they_were(route: str, tmp_path: Path) -> None:
    """Dicts and lists that held only tensors (an int-keyed dict, a negative int key, a
    list, a list slot holding an int-keyed dict, a key with a '/') come back from the
    checkpoint as the file had them. Before: ``{"0": ...}`` dicts for the ints and for
    the lists, and ``{"a": {"b": ...}}`` for the key ``"a/b"``."""
    t = torch.arange(4.0)
    state = {
        "l": [t, t + 1],
        "m": [{0: t + 2, 3: {"x": t + 3}}, 5],
        "d": {-1: t + 4, 2: {"y": t + 5}, "z": t + 6},
        "s": {"a/b": t + 7},
        "v": 1,
    }
    torch.save(state, tmp_path / "model.pt")
    back = torch.load(_through_checkpoint(tmp_path / "model.pt", route, tmp_path), weights_only=True)
    if route == "safetensors":  # a safetensors layout writes a negative int key as its text
        state["d"] = {"-1": t + 4, 2: {"y": t + 5}, "z": t + 6}
    _assert_same_state(back, state)


def test_an_import_keeps_its_common_state_and_loads_as_before(tmp_path: Path) -> None:
    """Recording the places changes nothing a load sees: the common state has no
    emptied dicts (Megatron-Core's semantics), and the arrays load by their keys."""
    _plain_adamw_file(tmp_path / "model.pt")
    from_torch_file(tmp_path / "model.pt", tmp_path / "ckpt")
    common = load_common_state_dict(tmp_path / "ckpt")
    assert sorted(common) == ["optimizer"] and sorted(common["optimizer"]) == ["param_groups"]
    assert "optimizer/state/0/exp_avg" in shardstore.load_tensors_metadata(tmp_path / "ckpt")
    assert shardstore.verify(tmp_path / "ckpt").ok


def _rewrite_places(checkpoint: Path, places: object) -> None:
    """The checkpoint's commit record with ``places`` instead of its own (sealed again)."""
    from dataclasses import replace

    from shardstore.format.records import COMMIT_RECORD, CommitRecord

    file = checkpoint / COMMIT_RECORD
    record = CommitRecord.from_json(file.read_bytes(), str(file))
    file.write_bytes(replace(record, places=places).to_json())


def test_a_checkpoint_imported_before_places_were_recorded_exports_as_before(tmp_path: Path) -> None:
    """A record without ``places`` (an import by an earlier shardstore) still exports:
    each array at its key's place, as before (str keys where the save dropped the dict)."""
    _plain_adamw_file(tmp_path / "model.pt")
    from_torch_file(tmp_path / "model.pt", tmp_path / "ckpt")
    _rewrite_places(tmp_path / "ckpt", None)
    to_torch_file(tmp_path / "ckpt", tmp_path / "back.pt")
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert sorted(back["optimizer"]["state"]) == ["0", "1"]


@pytest.mark.parametrize("int_key", [False, True])
@pytest.mark.parametrize("index", [10**12, 3])
def test_a_record_placing_an_array_far_past_its_list_is_refused(tmp_path: Path, index: int, int_key: bool) -> None:
    """A record whose places put an array at ``["l", 10**12]`` is refused naming the
    checkpoint, before anything is allocated for the list or written; also where it
    calls the index an int dict key but the common state has a list there."""
    from shardstore.format.records import ArrayPlaces

    torch.save({"l": [torch.ones(2), 5]}, tmp_path / "model.pt")
    from_torch_file(tmp_path / "model.pt", tmp_path / "ckpt")
    _rewrite_places(tmp_path / "ckpt", ArrayPlaces({"l/0": ("l", index)}, frozenset({("l",)} if int_key else ())))
    with pytest.raises(CheckpointingException, match=rf"index {index} of the list at \['l'\]") as raised:
        to_torch_file(tmp_path / "ckpt", tmp_path / "back.pt")
    assert str(tmp_path / "ckpt") in str(raised.value)
    assert not (tmp_path / "back.pt").exists()
