"""``StorageLayout``: one value for where a save puts its bytes, its fields chosen by
shardstore where left ``"auto"`` (issue 65.1-2)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from shardstore import CheckpointingException, SaveOptions, ShardedTensor, StorageLayout, load, save
from shardstore.format.features import ZarrMetadata
from shardstore.format.storage_layout import (
    AUTO_SHARD_MIN_RANKS,
    DEFAULT_OBJECT_STORE_PACK_BYTES,
    DEFAULT_PACK_BYTES,
    DEFAULT_SHARD_BYTES,
    LayoutSite,
)
from shardstore.strategies.zarr import ZarrSaveShardedStrategy


def test_every_auto_field_is_chosen_by_the_site() -> None:
    disk = StorageLayout().chosen_for(LayoutSite(world_size=2))
    assert disk.chosen and disk.shard_bytes is None and disk.pack_arrays_up_to == DEFAULT_PACK_BYTES
    assert disk.zarr_metadata is ZarrMetadata.PER_NODE
    s3 = StorageLayout().chosen_for(LayoutSite(world_size=2, object_store=True))
    assert s3.zarr_metadata is ZarrMetadata.CONSOLIDATED_ONLY and s3.pack_arrays_up_to == DEFAULT_OBJECT_STORE_PACK_BYTES == 1 << 20
    many = StorageLayout().chosen_for(LayoutSite(world_size=AUTO_SHARD_MIN_RANKS))
    assert many.shard_bytes == DEFAULT_SHARD_BYTES
    alone = StorageLayout().chosen_for(LayoutSite(world_size=AUTO_SHARD_MIN_RANKS, can_exchange=False))
    assert alone.shard_bytes is None


def test_fields_set_are_kept_and_the_rest_chosen() -> None:
    given = StorageLayout(pack_arrays_up_to=0, zarr_metadata="per_node")
    chosen = given.chosen_for(LayoutSite(world_size=64, object_store=True))
    assert (chosen.pack_arrays_up_to, chosen.zarr_metadata, chosen.shard_bytes) == (0, "per_node", DEFAULT_SHARD_BYTES)


def test_keywords_are_spellings_and_combine_unless_they_contradict() -> None:
    assert StorageLayout.of(None, shard_bytes=1 << 20) == StorageLayout(shard_bytes=1 << 20)
    assert StorageLayout.of(StorageLayout(pack_arrays_up_to=0), shard_bytes=None) == StorageLayout(
        pack_arrays_up_to=0, shard_bytes=None)
    with pytest.raises(ValueError, match="shard_bytes=1 MiB and shard_bytes=2 MiB"):
        StorageLayout.of(StorageLayout(shard_bytes=1 << 20), shard_bytes=2 << 20)


@pytest.mark.parametrize("field, value", [
    ("max_chunk_bytes", 0), ("shard_bytes", "64MiB"), ("pack_arrays_up_to", -1), ("zarr_metadata", "nowhere"),
    ("max_chunk_bytes", 2**40),
])
def test_a_field_out_of_range_is_refused_naming_it(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        StorageLayout(**{field: value})


def test_the_json_form_round_trips() -> None:
    chosen = StorageLayout(shard_bytes=8 << 20).chosen_for(LayoutSite(world_size=4, object_store=True))
    assert StorageLayout.from_json(json.loads(json.dumps(chosen.to_json()))) == chosen


def test_overwrite_and_options_combine(tmp_path: Path) -> None:
    """The first option a user adds does not break a working call."""
    path = str(tmp_path / "ckpt")
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0))}
    save(state, path)
    save(state, path, overwrite=True, options=SaveOptions(pack_arrays_up_to=0))
    assert torch.equal(load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(8))}, path)["w"], torch.arange(8.0))
    with pytest.raises(CheckpointingException, match="pack_arrays_up_to"):
        save(state, path, overwrite=True, options=SaveOptions(pack_arrays_up_to=0),
             layout=StorageLayout(pack_arrays_up_to=1024))


def test_the_strategys_keywords_join_the_saves_layout(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(4096.0))}
    save(state, str(path), sharded_strategy=ZarrSaveShardedStrategy(max_chunk_bytes=4096),
         layout=StorageLayout(pack_arrays_up_to=0))
    layout = json.loads((path / "zarr.json").read_text())["attributes"]["shardstore"]["layout"]
    assert layout == {"max_chunk_bytes": 4096, "shard_bytes": None, "pack_arrays_up_to": 0, "zarr_metadata": "per_node",
                      "read_grain": 1 << 20}
    with pytest.raises(CheckpointingException, match="max_chunk_bytes"):
        save(state, str(path), overwrite=True, sharded_strategy=ZarrSaveShardedStrategy(max_chunk_bytes=4096),
             layout=StorageLayout(max_chunk_bytes=8192))


def test_the_save_says_its_layout_on_its_info_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0))}
    with caplog.at_level(logging.INFO, logger="shardstore"):
        save(state, str(tmp_path / "ckpt"))
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "layout:" in r.getMessage()]
    assert lines and "packs <= 256 KiB" in lines[-1] and "metadata per_node" in lines[-1], lines
    assert "read in 1 MiB pieces" in lines[-1], lines


def test_inspect_says_the_layout(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from shardstore.tools.cli import main

    state = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0))}
    save(state, str(tmp_path / "ckpt"), layout=StorageLayout(pack_arrays_up_to=0))
    result = CliRunner().invoke(main, ["inspect", str(tmp_path / "ckpt")])
    assert result.exit_code == 0, result.output
    assert "layout chunks <= 64 MiB read in 1 MiB pieces, no shards, no packs, metadata per_node" in result.output
