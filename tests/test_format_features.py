"""Features by name (docs/format.md "Features"): the commit record lists what a reader
must understand, ``attributes.shardstore.requires``; the format version is frozen at 9;
records of versions 1 to 8, which name no features, still load."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from shardstore import CheckpointingException, ShardedTensor, load, save, verify
from shardstore.format.commit import SaveOptions
from shardstore.format.features import FEATURES, FORMAT_VERSION, UnsupportedFeature
from shardstore.format.records import read_commit_record
from shardstore.stores.locations import open_location
from shardstore.strategies.zarr import ZarrSaveShardedStrategy
from shardstore.tools.cli import main
from shardstore.tools.inspection import describe_checkpoint
from tests.scenarios import rewrite_record

DOCS = Path(__file__).resolve().parent.parent / "docs" / "format.md"
SHARDED = {"strategy": ZarrSaveShardedStrategy(max_chunk_bytes=512, shard_bytes=1 << 20)}
# each layout but the default and "packed" leaves packs out: one feature at a time
UNPACKED = {"options": SaveOptions(pack_arrays_up_to=0)}
CONSOLIDATED = {"options": SaveOptions(zarr_metadata="consolidated_only", pack_arrays_up_to=0)}
PACKED = {"options": SaveOptions(pack_arrays_up_to=1024)}
# (how to save, the features its record requires, the first version that could hold it)
LAYOUTS = {
    "default": ({}, ("packs",), 8),
    "plain": (UNPACKED, (), 4),
    "sharded": ({**SHARDED, **UNPACKED}, ("sharding_indexed",), 5),
    "consolidated_only": (CONSOLIDATED, ("consolidated_only",), 6),
    "packed": (PACKED, ("packs",), 8),
    "sharded and consolidated_only": ({**SHARDED, **CONSOLIDATED}, ("sharding_indexed", "consolidated_only"), 6),
}


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(9)
    return {"big": torch.randn(16, 16, generator=generator), "small": torch.randn(8, generator=generator)}


def _state(empty: bool = False) -> dict[str, ShardedTensor]:
    return {k: ShardedTensor.from_rank_offsets(k, torch.empty_like(t) if empty else t, replica_id=0)
            for k, t in _tensors().items()}


def _save(path: Path, how: dict) -> Path:
    strategy = how.get("strategy")
    save(_state(), path, *([strategy] if strategy else []), **({"options": how["options"]} if "options" in how else {}))
    return path


def _loads_bit_exact(path: Path) -> None:
    loaded = load(_state(empty=True), path)
    assert all(torch.equal(loaded[k], t) for k, t in _tensors().items())
    assert verify(path).ok


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_save_writes_version_9_and_requires_what_it_uses(tmp_path: Path, layout: str) -> None:
    how, requires, _ = LAYOUTS[layout]
    path = _save(tmp_path / "ckpt", how)
    record = read_commit_record(open_location(path))
    assert (record.format_version, record.requires) == (FORMAT_VERSION, requires) == (9, requires)
    _loads_bit_exact(path)


def _as_version(version: int):
    def edit(root: dict) -> None:
        record = root["attributes"]["shardstore"]
        record["format_version"] = version
        del record["requires"]
    return edit


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_record_of_an_earlier_version_without_requires_still_loads(tmp_path: Path, layout: str) -> None:
    """Versions 5 to 8 named no features: each allows those introduced up to it."""
    how, _, first = LAYOUTS[layout]
    for version in sorted({first, 8}):
        path = _save(tmp_path / f"v{version}", how)
        rewrite_record(path, _as_version(version))
        assert read_commit_record(open_location(path)).format_version == version
        _loads_bit_exact(path)


def test_a_record_of_a_version_before_a_feature_it_uses_is_refused(tmp_path: Path) -> None:
    path = _save(tmp_path / "ckpt", PACKED)
    rewrite_record(path, _as_version(7))
    with pytest.raises(CheckpointingException, match=r"uses feature 'packs' \(format version 8 on\).*claims version 7"):
        load(_state(empty=True), path)


def test_a_record_before_version_9_is_read_by_its_version_whatever_it_requires(tmp_path: Path) -> None:
    path = _save(tmp_path / "ckpt", PACKED)
    rewrite_record(path, lambda root: root["attributes"]["shardstore"].update(format_version=8, requires=["x"]))
    _loads_bit_exact(path)
    rewrite_record(path, lambda root: root["attributes"]["shardstore"].update(format_version=7))
    with pytest.raises(CheckpointingException, match="uses feature 'packs'"):
        load(_state(empty=True), path)


@pytest.mark.parametrize("requires", ["packs", ["packs", 3], None])
def test_a_malformed_requires_is_refused(tmp_path: Path, requires: object) -> None:
    path = _save(tmp_path / "ckpt", {})
    rewrite_record(path, lambda root: root["attributes"]["shardstore"].update(requires=requires))
    with pytest.raises(CheckpointingException, match="'requires' must be a list of feature names"):
        load(_state(empty=True), path)


@pytest.fixture
def from_the_future(tmp_path: Path) -> Path:
    path = _save(tmp_path / "ckpt", PACKED)
    rewrite_record(path, lambda root: root["attributes"]["shardstore"]["requires"].append("from_the_future"))
    return path


def _names_it(message: str, path: Path) -> bool:
    return all(s in message for s in ("from_the_future", str(path), "upgrade shardstore"))


def test_a_record_requiring_an_unknown_feature_is_refused_by_load(from_the_future: Path) -> None:
    with pytest.raises(UnsupportedFeature) as refused:
        load(_state(empty=True), from_the_future)
    assert _names_it(str(refused.value), from_the_future), refused.value


def test_a_record_requiring_an_unknown_feature_is_refused_by_verify(from_the_future: Path) -> None:
    report = verify(from_the_future)
    assert not report.ok and _names_it(str(report), from_the_future), report
    result = CliRunner().invoke(main, ["--no-progress", "verify", str(from_the_future)])
    assert result.exit_code == 2 and _names_it(result.stderr, from_the_future), (result.exit_code, result.output)


def test_a_record_requiring_an_unknown_feature_is_refused_by_inspect(from_the_future: Path) -> None:
    with pytest.raises(UnsupportedFeature) as refused:
        describe_checkpoint(from_the_future)
    assert _names_it(str(refused.value), from_the_future), refused.value
    result = CliRunner().invoke(main, ["--no-progress", "inspect", str(from_the_future)])
    assert result.exit_code != 0 and _names_it(result.stderr, from_the_future), (result.exit_code, result.output)


def test_the_format_page_lists_every_feature_with_its_first_version() -> None:
    text = DOCS.read_text()
    for feature in FEATURES:
        assert re.search(rf"^\| `{feature.name}` \|.*\| {feature.since} \|$", text, re.M), feature.name
