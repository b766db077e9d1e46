"""Verified bytes (issue 7, point 3): every corruption is found by verify() and by load,
named by array key and chunk (or by file)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from shardstore import (
    CheckpointingException,
    ShardedObject,
    ShardedTensor,
    StorageLayout,
    load,
    load_common_state_dict,
    save,
    verify,
)
from shardstore.format.records import SAVE_MARKER, read_commit_record
from shardstore.stores.locations import open_location

# these tests corrupt and count per-array files: chunk files and each array's zarr.json
PER_ARRAY = StorageLayout(pack_arrays_up_to=0)


def _state(empty: bool = False) -> dict:
    w = torch.arange(48.0).reshape(8, 6)
    return {
        "w": ShardedTensor.from_rank_offsets("enc/w", torch.empty_like(w) if empty else w),
        "b": ShardedTensor.from_rank_offsets("enc/b", torch.ones(5, dtype=torch.bfloat16)),
        "rng": ShardedObject("rng", np.random.default_rng(3).bit_generator.state, (1,), (0,)),
        "step": 7,
    }


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


DAMAGE: dict[str, tuple[str, Callable[[Path], None], str]] = {
    # name: (relative path, damage, what the report and the load error must name)
    "chunk byte flipped": ("enc/w/c.0.0", _flip, "c.0.0"),
    "chunk truncated": ("enc/w/c.0.0", lambda p: p.write_bytes(p.read_bytes()[:-9]), "c.0.0"),
    "chunk deleted": ("enc/w/c.0.0", lambda p: p.unlink(), "c.0.0"),
    "common.pt corrupted": ("common.pt", _flip, "common.pt"),
    "sharded object corrupted": ("__objects__/rng/shard_0_1.pt", _flip, "__objects__/rng/shard_0_1.pt"),
}


def test_clean_checkpoint_verifies(ckpt_dir: Path) -> None:
    save(_state(), ckpt_dir, layout=PER_ARRAY)
    report = verify(ckpt_dir)
    assert report.ok, str(report)
    assert (report.arrays_checked, report.chunks_checked) == (2, 2)
    assert set(read_commit_record(open_location(ckpt_dir)).files) == {
        "metadata.json", "common.pt", "__objects__/rng/shard_0_1.pt"
    }
    # the three listed files, and the zarr.json of each array (2) and group (enc) that plain readers open
    assert report.files_checked == 3 + 3


@pytest.mark.parametrize("name", sorted(DAMAGE))
def test_damage_is_reported_and_refused(ckpt_dir: Path, name: str) -> None:
    rel, damage, named = DAMAGE[name]
    save(_state(), ckpt_dir, layout=PER_ARRAY)
    damage(ckpt_dir / rel)
    report = verify(ckpt_dir)
    assert not report.ok
    assert len(report.problems) == 1, str(report)
    problem = report.problems[0]
    assert named in (problem.part, problem.key), str(report)
    if "chunk" in name:
        assert problem.key == "enc/w"
    with pytest.raises(CheckpointingException, match=named.replace(".", r"\.")):
        load(_state(empty=True), ckpt_dir)


def test_own_marker_left_in_a_committed_checkpoint_is_no_verify_problem(ckpt_dir: Path) -> None:
    """A crash between the publishing and the removal of the save's marker left it in
    the committed checkpoint, which verify reported as a file its save did not write,
    though it names the record's own save."""
    save(_state(), ckpt_dir)
    location = open_location(ckpt_dir)
    location.write_bytes(SAVE_MARKER, json.dumps({"save_id": read_commit_record(location).save_id}).encode())
    report = verify(ckpt_dir)
    assert report.ok and not report.unlisted, str(report)


def test_verify_of_an_incomplete_checkpoint_reports_it(ckpt_dir: Path) -> None:
    save(_state(), ckpt_dir)
    (ckpt_dir / "zarr.json").unlink()
    report = verify(ckpt_dir)
    assert not report.ok and "incomplete" in str(report)
    with pytest.raises(CheckpointingException, match="incomplete"):
        report.raise_if_damaged()


@pytest.mark.parametrize(("codecs", "found"), [
    ([{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c", "configuration": {}}], False),
    ([{"name": "bytes", "configuration": {"endian": "big"}}, {"name": "crc32c"}], True),
])
def test_verify_reads_an_arrays_codecs_as_the_codec_they_name(ckpt_dir: Path, codecs: list, found: bool) -> None:
    """Another spelling of the same codecs is no finding; other codecs are, since plain
    readers would decode the chunks otherwise than load does."""
    save(_state(), ckpt_dir, layout=PER_ARRAY)
    path = ckpt_dir / "enc" / "w" / "zarr.json"
    document = json.loads(path.read_bytes())
    path.write_text(json.dumps({**document, "codecs": codecs}))
    report = verify(ckpt_dir)
    assert report.ok is not found, str(report)
    assert found == any(p.key == "enc/w/zarr.json" and "codecs" in p.message for p in report.problems), str(report)


def _forge_crc32c(data: bytes, at: int, target: int) -> bytes:
    """``data`` with its 4 bytes at ``at`` replaced so that its crc32c is ``target``
    (crc32c is affine in those 32 bits: solve over GF(2))."""
    import crc32c

    def crc_with(x: int) -> int:
        return crc32c.crc32c(data[:at] + x.to_bytes(4, "little") + data[at + 4:])

    base = crc_with(0)
    columns = [crc_with(1 << i) ^ base for i in range(32)]
    want = target ^ base
    # Gaussian elimination: rows are (column vector, input bit mask)
    rows = [(columns[i], 1 << i) for i in range(32)]
    basis: dict[int, tuple[int, int]] = {}
    for vec, mask in rows:
        for bit in reversed(range(32)):
            if not vec >> bit & 1:
                continue
            if bit in basis:
                vec, mask = vec ^ basis[bit][0], mask ^ basis[bit][1]
            else:
                basis[bit] = (vec, mask)
                break
    x = 0
    for bit in reversed(range(32)):
        if want >> bit & 1:
            vec, mask = basis[bit]
            want ^= vec
            x ^= mask
    assert want == 0
    forged = data[:at] + x.to_bytes(4, "little") + data[at + 4:]
    assert crc32c.crc32c(forged) == target
    return forged


def test_a_changed_common_pt_with_its_crc32c_restored_fails_verify_and_loads(ckpt_dir: Path) -> None:
    """Chunks carry a 128-bit digest in the record ("128 bits, unlike crc32c, are not forged by
    changing four bytes"); every other file (common.pt, the pickled object shards,
    metadata.json) carried only ``crc32c:xxxxxxxx``, so verify and every load
    (``ChecksummedLocation``) held a common.pt with four more bytes changed equal to the
    committed one. Now the record keeps each file's XXH3-128 too (``files_xxh3_128``)."""
    import crc32c

    save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4, 3)), "iteration": 100, "note": "A" * 64}, ckpt_dir)
    path = ckpt_dir / "common.pt"
    data = path.read_bytes()
    at = data.index(b"A" * 64)
    changed = bytearray(data)
    changed[at:at + 8] = b"EVILEVIL"
    path.write_bytes(_forge_crc32c(bytes(changed), at + 8, crc32c.crc32c(data)))
    assert path.read_bytes() != data
    with pytest.raises(CheckpointingException, match=r"common.pt: its XXH3-128 [0-9a-f]{32} differs .*crc32c matches"):
        load_common_state_dict(ckpt_dir)
    report = verify(ckpt_dir)
    assert not report.ok, "verify holds a changed common.pt equal to the committed one by its crc32c"
