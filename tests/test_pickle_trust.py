"""Issue 23.1: no code runs from any file shardstore reads, whoever wrote it.

Hostile pickles are built opcode by opcode, for every opcode that can reach a callable
or change an existing object (GLOBAL and STACK_GLOBAL with exact and dotted names,
REDUCE, BUILD on a class and on a module, INST, OBJ, NEWOBJ, NEWOBJ_EX, EXT1/2/4), at
pickle protocols 0 to 5. Each also comes "stealthy": the attack runs, its result is
popped, and the genuine pickle follows, so a reader that let it through would return
correct data. Each is planted in every file shardstore unpickles (our common state and
object shards, PyTorch DCP ``.metadata``, chunks and byte items, Megatron torch_dist and
zarr ``common.pt`` and objects, ``.pt`` files to convert) and read through every entry
point of the API and the CLI: with ``SHARDSTORE_SLOW=1`` each pickle through each entry
point; by default each attack through each entry point and each pickle through one
(``_readers``), a sixth of the reads. Each read must end in a clear ``CheckpointingException``
(the CLI: exit 2 with one error line) or not touch the file, and nothing may happen: no
marker file, no attribute set on a module or class.
"""

from __future__ import annotations

import copyreg
import io
import json
import os
import pathlib
import pickle
import shutil
import struct
import sys
import threading
import zipfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import shardstore
from shardstore import CheckpointingException, ShardedObject, ShardedTensor
from shardstore.format.pickles import dcp_metadata_globals, load_restricted
from shardstore.format.records import COMMIT_RECORD, CommitRecord, file_digest, object_path
from shardstore.format.records.encoding import checksum
from shardstore.tools.cli import main
from shardstore.tools.convert import from_other_format, from_torch_file, to_torch_file
from shardstore.tools.inspection import describe_checkpoint, diff_checkpoints
from tests.fixtures.legacy.make import DCP, MEGATRON
from tests.fixtures.legacy.make_megatron014 import ZARR as MEGATRON_014_ZARR

PROTOCOLS = range(pickle.HIGHEST_PROTOCOL + 1)
EXT_CODES = {pickle.EXT1: 0x7A, pickle.EXT2: 0x7A7B, pickle.EXT4: 0x7A7B7C7D}
# what each code names in the process's copyreg registry: three ways to run a shell command
EXT_NAMES = {0x7A: ("posix", "system"), 0x7A7B: ("os", "system"), 0x7A7B7C7D: ("subprocess", "getoutput")}
PWNED = "shardstore_pwned"
# Every entry point reads every hostile pickle (else a covering set: ``_readers``).
FULL_MATRIX = os.environ.get("SHARDSTORE_SLOW") == "1"


# ------------------------------------------------------------------ pickle assembly


def _string(text: str, protocol: int) -> bytes:
    if protocol == 0:
        return pickle.UNICODE + text.encode("raw-unicode-escape") + b"\n"
    data = text.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(data)) + data


def _global(module: str, name: str, protocol: int) -> bytes:
    """The opcodes that push ``module.name``: STACK_GLOBAL from protocol 4, else GLOBAL."""
    if protocol >= 4:
        return _string(module, protocol) + _string(name, protocol) + pickle.STACK_GLOBAL
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def _tuple(items: list[bytes]) -> bytes:
    return pickle.MARK + b"".join(items) + pickle.TUPLE


def _int(value: int, protocol: int) -> bytes:
    return pickle.INT + f"{value}\n".encode() if protocol == 0 else pickle.BININT + struct.pack("<i", value)


def _dict_state(attribute: str, value: int, protocol: int) -> bytes:
    """BUILD's state ``{attribute: value}``: set in the object's ``__dict__``."""
    start = pickle.MARK + pickle.DICT if protocol == 0 else pickle.EMPTY_DICT
    return start + _string(attribute, protocol) + _int(value, protocol) + pickle.SETITEM


def _none_dict_state(attribute: str, protocol: int) -> bytes:
    """BUILD's state ``(None, {attribute: True})``: slot state, set with setattr."""
    slot = pickle.MARK + pickle.DICT if protocol == 0 else pickle.EMPTY_DICT
    slot += _string(attribute, protocol) + (pickle.NEWTRUE if protocol >= 2 else pickle.INT + b"01\n") + pickle.SETITEM
    return _tuple([pickle.NONE, slot])


@dataclass(frozen=True)
class Attack:
    """Opcodes that leave one object on the stack and, in an unsafe reader, run
    ``os.system`` (touching ``marker``) or set ``PWNED`` on a module or class."""

    name: str
    min_protocol: int
    build: Callable[[str, int], bytes]


def _shell(marker: str, protocol: int) -> bytes:
    return _tuple([_string(f"touch {marker}", protocol)])


ATTACKS = [
    Attack("GLOBAL os.system + REDUCE", 0,
           lambda m, p: _global("posix", "system", p) + _shell(m, p) + pickle.REDUCE),
    Attack("dotted walk from DCP's metadata module", 0,
           lambda m, p: _global("torch.distributed.checkpoint.metadata", "os.system", p) + _shell(m, p) + pickle.REDUCE),
    Attack("dotted walk from an allowed class", 0,
           lambda m, p: _global("torch", "Size.__init__.__globals__", p) + pickle.POP
           + _global("torch.serialization", "os.system", p) + _shell(m, p) + pickle.REDUCE),
    Attack("dotted walk from torch", 0,
           lambda m, p: _global("torch", "serialization.os.system", p) + _shell(m, p) + pickle.REDUCE),
    Attack("exact name an allowed module imported", 0,
           lambda m, p: _global("torch.distributed.checkpoint.planner", "reduce", p)
           + _tuple([_global("posix", "system", p), _tuple([_string(f"touch {m}", p)])]) + pickle.REDUCE),
    Attack("BUILD on a module reached by name", 0,
           lambda m, p: _global("torch.distributed.checkpoint.metadata", "os", p) + _none_dict_state(PWNED, p) + pickle.BUILD),
    Attack("BUILD on an allowed class", 0,
           lambda m, p: _global("pathlib", "PurePosixPath", p) + _none_dict_state(PWNED, p) + pickle.BUILD),
    Attack("BUILD on torch's allowed OrderedDict class", 0,
           lambda m, p: _global("collections", "OrderedDict", p) + _none_dict_state(PWNED, p) + pickle.BUILD),
    Attack("BUILD on a shared enum member a listed class returns (REDUCE)", 0,
           lambda m, p: _global("torch.distributed.checkpoint.planner", "WriteItemType", p) + _tuple([_int(1, p)])
           + pickle.REDUCE + _dict_state("_value_", 99, p) + pickle.BUILD),
    Attack("BUILD on a shared enum member a listed class returns (NEWOBJ)", 2,
           lambda m, p: _global("torch.distributed.checkpoint.planner", "WriteItemType", p) + _tuple([_int(1, p)])
           + pickle.NEWOBJ + _dict_state("_value_", 99, p) + pickle.BUILD),
    Attack("INST", 0,
           lambda m, p: pickle.MARK + _string(f"touch {m}", p) + pickle.INST + b"posix\nsystem\n"),
    Attack("OBJ", 1,
           lambda m, p: pickle.MARK + _global("posix", "system", p) + _string(f"touch {m}", p) + pickle.OBJ),
    Attack("NEWOBJ", 2,
           lambda m, p: _global("subprocess", "Popen", p) + _tuple([_string("true", p)]) + pickle.NEWOBJ),
    Attack("NEWOBJ_EX", 4,
           lambda m, p: _global("subprocess", "Popen", p) + _tuple([_string("true", p)]) + pickle.EMPTY_DICT
           + pickle.NEWOBJ_EX),
    *[Attack(f"{op!r} extension code", 2,
             lambda m, p, op=op, code=code: op + (struct.pack("<B", code) if op == pickle.EXT1 else
                                                  struct.pack("<H", code) if op == pickle.EXT2 else
                                                  struct.pack("<i", code)) + _shell(m, p) + pickle.REDUCE)
      for op, code in EXT_CODES.items()],
]


def _body(genuine: bytes) -> tuple[int, bytes]:
    """A pickle's protocol and its opcodes after PROTO."""
    if genuine[:1] == pickle.PROTO:
        return genuine[1], genuine[2:]
    return 0, genuine


def hostile(genuine: bytes, attack: Attack, marker: str, stealthy: bool) -> bytes:
    """``attack`` in ``genuine``'s protocol: alone, or run, popped and followed by
    ``genuine`` (so an unsafe reader would return the genuine object)."""
    protocol, body = _body(genuine)
    head = pickle.PROTO + bytes([protocol]) if protocol >= 2 else b""
    ops = attack.build(marker, protocol)
    return head + (ops + pickle.POP + body if stealthy else ops + pickle.STOP)


def variants(genuine_at: Callable[[int], bytes], marker: str) -> Iterator[tuple[str, bytes]]:
    for protocol in PROTOCOLS:
        genuine = genuine_at(protocol)
        for attack in ATTACKS:
            if protocol < attack.min_protocol:
                continue
            for stealthy in (False, True):
                yield f"{attack.name}, protocol {protocol}{', stealthy' if stealthy else ''}", hostile(
                    genuine, attack, marker, stealthy)


def _torch_archive_with_pickle(obj: object, data_pkl: Callable[[bytes], bytes], protocol: int) -> bytes:
    """A ``torch.save`` archive of ``obj`` whose ``data.pkl`` is replaced."""
    buffer = io.BytesIO()
    torch.save(obj, buffer, pickle_protocol=max(protocol, 2) if protocol >= 2 else protocol)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)
            dst.writestr(info.filename, data_pkl(data) if info.filename.endswith("/data.pkl") else data)
    return out.getvalue()


def torch_variants(obj: object, marker: str) -> Iterator[tuple[str, bytes]]:
    """The hostile pickles as ``data.pkl`` of a ``torch.save`` archive of ``obj``."""
    for protocol in PROTOCOLS:
        buffer = io.BytesIO()
        torch.save(obj, buffer, pickle_protocol=protocol)
        with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as archive:
            genuine = archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl")))
        for attack in ATTACKS:
            if protocol < attack.min_protocol:
                continue
            for stealthy in (False, True):
                payload = hostile(genuine, attack, marker, stealthy)
                name = f"{attack.name}, protocol {protocol}{', stealthy' if stealthy else ''}"
                yield name, _torch_archive_with_pickle(obj, lambda _d, p=payload: p, protocol)


# ------------------------------------------------------------------ side effects


@pytest.fixture(autouse=True)
def _extension_codes() -> Iterator[None]:
    """The process's copyreg maps the test's EXT codes to os.system (and primes the
    cache another unpickler would fill), as an attacker's earlier import might."""
    import subprocess

    for code, (module, name) in EXT_NAMES.items():
        copyreg.add_extension(module, name, code)
        copyreg._extension_cache[code] = subprocess.getoutput if name == "getoutput" else os.system
    yield
    for code, (module, name) in EXT_NAMES.items():
        copyreg._extension_cache.pop(code, None)
        copyreg.remove_extension(module, name, code)


def assert_nothing_happened(marker: Path, what: str) -> None:
    assert not marker.exists(), f"{what}: a shell command ran"
    import collections

    import torch.distributed.checkpoint.metadata as dcp_metadata
    from torch.distributed.checkpoint.planner import WriteItemType

    for target in (os, dcp_metadata.os, pathlib.PurePosixPath, collections.OrderedDict):
        assert not hasattr(target, PWNED), f"{what}: {target!r} was modified"
    assert [m.value for m in WriteItemType] == [1, 2, 3], f"{what}: an enum member was modified"


# ------------------------------------------------------------------ checkpoints and entry points


def _cli(*args: str) -> None:
    result = CliRunner().invoke(main, ["--no-progress", *args])
    if result.exit_code == 0:
        return
    if result.exit_code != 2 or result.exception and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"`shardstore {' '.join(args)}` failed badly: {result.exception!r} {result.output}")
    raise CheckpointingException(result.stderr.strip())


def _load_all(path: Path) -> None:
    shardstore.load(shardstore.load_sharded_metadata(path), path)


ENTRY_POINTS: dict[str, Callable[[Path, Path], None]] = {
    "load": lambda p, t: _load_all(p),
    "load_common_state_dict": lambda p, t: shardstore.load_common_state_dict(p),
    "load_tensors_metadata": lambda p, t: shardstore.load_tensors_metadata(p),
    "load_sharded_metadata": lambda p, t: shardstore.load_sharded_metadata(p),
    "load_content_metadata": lambda p, t: shardstore.load_content_metadata(p),
    "load_plain_tensors": lambda p, t: shardstore.load_plain_tensors(p),
    "verify": lambda p, t: shardstore.verify(p),
    "describe_checkpoint": lambda p, t: describe_checkpoint(p),
    "diff_checkpoints": lambda p, t: diff_checkpoints(p, p),
    "convert.to_torch_file": lambda p, t: to_torch_file(p, t / "out.pt"),
    "shardstore inspect": lambda p, t: _cli("inspect", str(p)),
    "shardstore verify": lambda p, t: _cli("verify", str(p)),
    "shardstore diff": lambda p, t: _cli("diff", str(p), str(p)),
    "shardstore convert --to torch": lambda p, t: _cli("convert", str(p), str(t / "out.pt"), "--to", "torch"),
    "shardstore convert --to safetensors": lambda p, t: _cli("convert", str(p), str(t / "st"), "--to", "safetensors"),
}
FOREIGN_ENTRY_POINTS = {
    **{k: v for k, v in ENTRY_POINTS.items() if "to_torch" not in k and "--to" not in k},
    "convert.from_other_format": lambda p, t: from_other_format(p, t / "converted"),
    "shardstore convert": lambda p, t: _cli("convert", str(p), str(t / "converted")),
    "shardstore convert --to torch": lambda p, t: _cli("convert", str(p), str(t / "out.pt"), "--to", "torch"),
}


def _our_checkpoint(path: Path) -> None:
    shardstore.save(
        {
            "w": ShardedTensor.from_rank_offsets("w", torch.arange(12.0).reshape(4, 3)),
            "rng": ShardedObject("rng", {"seed": 7}, (1,), (0,)),
            "step": 3,
        },
        path,
    )


def _resign(path: Path, rel: str) -> None:
    """The attacker also fixes the record's checksum and digest of ``rel``."""
    where = str(path / COMMIT_RECORD)
    record = CommitRecord.from_json((path / COMMIT_RECORD).read_bytes(), where)
    data = (path / rel).read_bytes()
    files, digests = {**record.files, rel: checksum(data)}, {**record.file_digests, rel: file_digest(data)}
    (path / COMMIT_RECORD).write_bytes(replace(record, files=files, file_digests=digests).to_json())


def _dcp_with_chunk_file(path: Path, file_name: str) -> None:
    """Points one chunk of the DCP fixture's metadata at ``file_name`` (bytes 0..size)."""
    metadata = pickle.loads((path / ".metadata").read_bytes())  # the test's own fixture: trusted
    size = (path / file_name).stat().st_size
    index = next(i for i in metadata.storage_data if i.fqn == "model.fc1")
    info = metadata.storage_data[index]
    metadata.storage_data[index] = type(info)(relative_path=file_name, offset=0, length=size)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))


@dataclass(frozen=True)
class Target:
    """A file shardstore unpickles, how to plant a payload in it, and the entry
    points that read it (each must refuse it)."""

    name: str
    source: Callable[[Path], None]
    plant: Callable[[Path, bytes], None]
    payloads: Callable[[str], Iterator[tuple[str, bytes]]]
    entry_points: dict[str, Callable[[Path, Path], None]]
    must_refuse: frozenset[str]


def _copy(fixture: Path) -> Callable[[Path], None]:
    return lambda path: shutil.copytree(fixture, path)


def _plant_common(path: Path, data: bytes) -> None:
    (path / "common.pt").write_bytes(data)
    _resign(path, "common.pt")


def _plant_object(path: Path, data: bytes) -> None:
    rel = object_path("rng/shard_0_1")
    (path / rel).write_bytes(data)
    _resign(path, rel)


def _plant_dcp_chunk(path: Path, data: bytes) -> None:
    (path / "__evil.distcp").write_bytes(data)
    _dcp_with_chunk_file(path, "__evil.distcp")


def _dcp_metadata_pickles(marker: str) -> Iterator[tuple[str, bytes]]:
    metadata = pickle.loads((DCP / ".metadata").read_bytes())  # the test's own fixture: trusted
    return variants(lambda protocol: pickle.dumps(metadata, protocol=protocol), marker)


READS_COMMON = frozenset({"load", "load_common_state_dict", "diff_checkpoints", "shardstore diff",
                          "convert.to_torch_file", "shardstore convert --to torch",
                          "shardstore convert --to safetensors"})
READS_DCP_METADATA = frozenset(FOREIGN_ENTRY_POINTS) - {"verify", "shardstore verify"}
CONVERTS_OTHER_FORMATS = frozenset({"load", "convert.from_other_format", "shardstore convert", "shardstore convert --to torch"})

TARGETS = [
    Target("shardstore common.pt", _our_checkpoint, _plant_common,
           lambda m: torch_variants({"step": 3}, m), ENTRY_POINTS, READS_COMMON),
    Target("shardstore object shard", _our_checkpoint, _plant_object,
           lambda m: torch_variants({"seed": 7}, m), ENTRY_POINTS, READS_COMMON - {"load_common_state_dict"}),
    Target("DCP .metadata", _copy(DCP), lambda p, d: (p / ".metadata").write_bytes(d),
           _dcp_metadata_pickles, FOREIGN_ENTRY_POINTS, READS_DCP_METADATA),
    Target("DCP chunk", _copy(DCP), _plant_dcp_chunk,
           lambda m: torch_variants(torch.zeros(4, 6), m), FOREIGN_ENTRY_POINTS,
           CONVERTS_OTHER_FORMATS | {"load_plain_tensors"}),
    Target("Megatron torch_dist .metadata", _copy(MEGATRON), lambda p, d: (p / ".metadata").write_bytes(d),
           lambda m: variants(lambda protocol: pickle.dumps(pickle.loads((MEGATRON / ".metadata").read_bytes()),
                                                            protocol=protocol), m),
           FOREIGN_ENTRY_POINTS, READS_DCP_METADATA),
    Target("Megatron torch_dist common.pt", _copy(MEGATRON), lambda p, d: (p / "common.pt").write_bytes(d),
           lambda m: torch_variants({"iteration": 7}, m), FOREIGN_ENTRY_POINTS,
           CONVERTS_OTHER_FORMATS | {"load_common_state_dict"}),
    Target("Megatron zarr common.pt", _copy(MEGATRON_014_ZARR), lambda p, d: (p / "common.pt").write_bytes(d),
           lambda m: torch_variants({"iteration": 7}, m), FOREIGN_ENTRY_POINTS,
           CONVERTS_OTHER_FORMATS | {"load_common_state_dict"}),
    Target("Megatron zarr object shard", _copy(MEGATRON_014_ZARR),
           lambda p, d: (p / "rng_state" / "shard_0_2.pt").write_bytes(d),
           lambda m: torch_variants({"seed": 1234}, m), FOREIGN_ENTRY_POINTS,
           CONVERTS_OTHER_FORMATS),
]


def _attempt(entry: Callable[[Path, Path], None], path: Path, scratch: Path) -> bool:
    """Runs one entry point; True if it refused with a CheckpointingException."""
    try:
        entry(path, scratch)
    except CheckpointingException as exc:
        assert str(exc).strip(), "an error must say something"
        return True
    return False


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
def test_hostile_pickles_are_refused_by_every_entry_point(tmp_path: Path, target: Target) -> None:
    marker = tmp_path / "pwned"
    pristine = tmp_path / "pristine"
    target.source(pristine)
    payloads = list(target.payloads(str(marker)))
    assert len(payloads) >= 5 * len(ATTACKS)
    tried = 0
    for index, ((variant, payload), readers) in enumerate(zip(payloads, _readers(payloads, target), strict=True)):
        checkpoint = tmp_path / f"c{index}"
        shutil.copytree(pristine, checkpoint)
        target.plant(checkpoint, payload)
        # every entry point that reads the file refuses; the rest must not run it either
        for name in readers:
            scratch = tmp_path / f"s{index}-{name.replace(' ', '_')}"
            scratch.mkdir()
            refused = _attempt(target.entry_points[name], checkpoint, scratch)
            assert_nothing_happened(marker, f"{target.name} / {name} / {variant}")
            if name in target.must_refuse:
                assert refused, f"{name} accepted {target.name} with {variant}"
            tried += 1
            shutil.rmtree(scratch)
        shutil.rmtree(checkpoint)
    print(f"{target.name}: {len(payloads)} payloads, {len(target.entry_points)} entry points, {tried} reads")


def _attack_of(variant: str) -> str:
    return variant.rsplit(", protocol ", 1)[0]


def _readers(payloads: list[tuple[str, bytes]], target: Target) -> list[list[str]]:
    """The entry points that read each payload. With ``SHARDSTORE_SLOW=1``, every entry
    point reads every payload (about 2,000 reads a target). By default, a covering set
    (about a sixth): one entry point that must refuse reads every payload (every attack at
    every protocol, plain and stealthy), and every entry point reads every attack once, in
    a protocol and stealth that rotate over the entry points; so an entry point that lets
    one attack through, or falls back to an unrestricted reader after a refusal, is found."""
    names = sorted(target.entry_points)
    if FULL_MATRIX:
        return [names] * len(payloads)
    anchor = min(target.must_refuse)
    forms = Counter(_attack_of(variant) for variant, _ in payloads)  # each attack's protocols x stealth
    number = {attack: i for i, attack in enumerate(forms)}  # shifts each attack's rotation: entry point
    seen: Counter[str] = Counter()  # ``i`` reads a plain pickle of one attack and a stealthy one of the next
    readers = []
    for variant, _ in payloads:
        attack = _attack_of(variant)
        form = seen[attack]
        seen[attack] += 1
        readers.append([n for i, n in enumerate(names)
                        if n == anchor or (i + number[attack]) % forms[attack] == form])
    return readers


def test_the_default_readers_cover_every_attack_at_every_entry_point_and_every_payload() -> None:
    for target in TARGETS:
        payloads = list(target.payloads("/nonexistent/marker"))
        readers = _readers(payloads, target)
        assert all(set(r) & target.must_refuse for r in readers), target.name
        read = {(name, _attack_of(variant)) for (variant, _), names in zip(payloads, readers, strict=True)
                for name in names}
        attacks = {_attack_of(variant) for variant, _ in payloads}
        assert read == {(name, attack) for name in target.entry_points for attack in attacks}, target.name
        assert len(attacks) == len(ATTACKS)
        if not FULL_MATRIX:
            assert sum(map(len, readers)) < len(payloads) * len(target.entry_points) / 3, target.name
            for name in target.entry_points:  # each entry point reads plain and stealthy pickles
                variants = [v for (v, _), names in zip(payloads, readers, strict=True) if name in names]
                assert {v.endswith("stealthy") for v in variants} == {True, False}, (target.name, name)


def test_hostile_torch_files_are_refused_by_convert(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    for index, (variant, payload) in enumerate(torch_variants({"w": torch.ones(2)}, str(marker))):
        source = tmp_path / f"model{index}.pt"
        source.write_bytes(payload)
        with pytest.raises(CheckpointingException):
            from_torch_file(source, tmp_path / f"a{index}")
        assert_nothing_happened(marker, f"from_torch_file / {variant}")
        with pytest.raises(CheckpointingException):
            _cli("convert", str(source), str(tmp_path / f"b{index}"))
        assert_nothing_happened(marker, f"shardstore convert .pt / {variant}")


def test_genuine_dcp_metadata_loads_at_every_protocol_that_dcp_can_write() -> None:
    """The restricted reader is not refusing everything: DCP's own metadata, pickled at
    protocols 2-5, comes back equal."""
    for fixture in (DCP, MEGATRON):
        metadata = pickle.loads((fixture / ".metadata").read_bytes())  # the test's own fixture
        for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
            loaded = load_restricted(pickle.dumps(metadata, protocol=protocol), dcp_metadata_globals(), "x", "y")
            assert loaded.state_dict_metadata == metadata.state_dict_metadata


def test_genuine_torch_archives_with_replaced_pickles_still_load(tmp_path: Path) -> None:
    """The test's own archive rewriting keeps a genuine pickle loadable, so refusals
    above come from the attacks."""
    for protocol in (2, 3):
        data = _torch_archive_with_pickle({"step": 3}, lambda d: d, protocol)
        assert torch.load(io.BytesIO(data), weights_only=True) == {"step": 3}


def test_the_record_still_vouches_for_an_untouched_checkpoint(tmp_path: Path) -> None:
    _our_checkpoint(tmp_path / "c")
    assert shardstore.verify(tmp_path / "c").ok
    assert json.loads((tmp_path / "c" / COMMIT_RECORD).read_bytes())["attributes"]["shardstore"]["objects"]


class _TrainerConfig:
    """A user's own class in the common state: outside every allow-list."""

    def __init__(self, lr: float) -> None:
        self.lr = lr


def test_a_users_class_is_refused_by_name_and_admitted_by_torchs_add_safe_globals(tmp_path: Path) -> None:
    shardstore.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2)), "config": _TrainerConfig(0.5)},
                     tmp_path / "c")
    with pytest.raises(CheckpointingException, match="_TrainerConfig.*allow_unsafe_pickle=True"):
        shardstore.load_common_state_dict(tmp_path / "c")
    torch.serialization.add_safe_globals([_TrainerConfig])
    try:
        assert shardstore.load_common_state_dict(tmp_path / "c")["config"].lr == 0.5
    finally:
        torch.serialization.clear_safe_globals()
    with pytest.raises(CheckpointingException, match="_TrainerConfig"):
        shardstore.load_common_state_dict(tmp_path / "c")


def test_a_numpy_object_array_is_refused_naming_its_dtype_class_not_damage(tmp_path: Path) -> None:
    """torch refuses a numpy object array with "Can only build ... but got <class
    'numpy.dtypes.ObjectDType'>", naming no GLOBAL. Before, the error said the intact
    file "is damaged, or holds objects a safe load refuses", with torch's generic
    paragraph as the reason and no class named; now it names the class and the
    ``add_safe_globals`` call that admits it."""
    import numpy as np

    shardstore.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2)),
                     "names": np.array(["a", 1], dtype=object)}, tmp_path / "c")
    before = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        with pytest.raises(CheckpointingException) as refused:
            shardstore.load_common_state_dict(tmp_path / "c")
        message = str(refused.value)
        assert "damaged" not in message, message
        assert "add_safe_globals([numpy.dtypes.ObjectDType])" in message and "Can only build" in message, message
        torch.serialization.add_safe_globals([np.dtypes.ObjectDType])
        assert list(shardstore.load_common_state_dict(tmp_path / "c")["names"]) == ["a", 1]
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


def test_a_load_keeps_the_safe_globals_the_process_added_itself(tmp_path: Path) -> None:
    """shardstore admits numpy's and ``argparse.Namespace`` for its own loads only. Before,
    leaving that admission removed them from the process's set even where the process
    had added them itself (Megatron-Core's ``register_safe_globals`` does at import):
    after any shardstore load, the trainer's own ``torch.load(weights_only=True)`` of
    its args failed with "Unsupported global: GLOBAL argparse.Namespace"."""
    import argparse

    shardstore.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2)), "step": 1}, tmp_path / "c")
    before = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        assert shardstore.load_common_state_dict(tmp_path / "c") == {"step": 1}
        assert torch.serialization.get_safe_globals() == []  # shardstore's admission ends with its load
        torch.serialization.add_safe_globals([argparse.Namespace])
        assert shardstore.load_common_state_dict(tmp_path / "c") == {"step": 1}
        assert torch.serialization.get_safe_globals() == [argparse.Namespace]
        buffer = io.BytesIO()
        torch.save({"args": argparse.Namespace(lr=0.5)}, buffer)
        buffer.seek(0)
        assert torch.load(buffer, weights_only=True)["args"].lr == 0.5
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


# Damaged ``data.pkl`` bodies that torch's own weights_only machine fails on with errors
# other than the ones it usually raises (both found by flipping bytes of a ``common.pt``).
DAMAGED_PICKLES = {
    # ``_codecs.encode`` (on torch's allow-list, for numpy's bytes) with an encoding
    # that does not exist: LookupError
    "unknown encoding": pickle.PROTO + b"\x02" + _global("_codecs", "encode", 2)
    + _tuple([_string("x", 2), _string("latint", 2)]) + pickle.REDUCE + pickle.STOP,
    # a persistent id that is no tuple: torch's AssertionError
    "persistent id": pickle.PROTO + b"\x02" + _int(5, 2) + pickle.BINPERSID + pickle.STOP,
}


@pytest.mark.parametrize("damage", sorted(DAMAGED_PICKLES))
def test_a_damaged_torch_archive_is_a_clear_error_naming_the_file(tmp_path: Path, damage: str) -> None:
    """A damaged ``torch.save`` archive (here one that still carries its record's
    checksum, as a file copied in from a damaged checkpoint would) is refused with a
    ``CheckpointingException`` naming the file. Before, torch's ``LookupError`` and
    ``AssertionError`` escaped as bare tracebacks from ``load_common_state_dict`` and
    ``shardstore convert``."""
    data = _torch_archive_with_pickle({"step": 3}, lambda _d: DAMAGED_PICKLES[damage], 2)
    ckpt, source = tmp_path / "ckpt", tmp_path / "model.pt"
    _our_checkpoint(ckpt)
    _plant_common(ckpt, data)
    with pytest.raises(CheckpointingException, match=r"common\.pt is corrupt"):
        shardstore.load_common_state_dict(ckpt)
    source.write_bytes(data)
    with pytest.raises(CheckpointingException, match=r"model\.pt .*is corrupt"):
        from_torch_file(source, tmp_path / "converted")


def test_a_refused_opcode_says_damage_first_not_trust(tmp_path: Path) -> None:
    """An opcode torch's weights_only machine refuses, with no class named (as a flipped
    byte in ``data.pkl`` makes), may be damage: the error says to check the file before
    trusting it. Before, it read "holds objects that a safe load refuses ... If you trust
    this checkpoint, admit it with load with ...allow_unsafe_pickle=True": advice to
    unpickle damaged bytes, ungrammatical too."""
    data = _torch_archive_with_pickle({"step": 3}, lambda _d: pickle.PROTO + b"\x02" + b"\xc1" + pickle.STOP, 2)
    ckpt = tmp_path / "ckpt"
    _our_checkpoint(ckpt)
    _plant_common(ckpt, data)
    with pytest.raises(CheckpointingException, match=r"common\.pt is damaged, or holds objects .*Check it first") as err:
        shardstore.load_common_state_dict(ckpt)
    assert "admit it with load" not in str(err.value)


def _numpy_dtype_rebuilt_after_use(pointer: int) -> bytes:
    """``data.pkl`` of a common state ``{"rng": (dtype, array, dtype)}``: a numpy dtype, an
    array of 8 bytes made with it, then the dtype BUILT again with an object field, which
    makes the array's bytes (``pointer``) a PyObject pointer. Protocol 2, in the opcodes
    torch's weights_only machine reads (bytes as ``_codecs.encode``, as torch.save writes
    them)."""
    numpy_module = _numpy_core_module()

    def data(raw: bytes) -> bytes:
        return _global("_codecs", "encode", 2) + _tuple([_string(raw.decode("latin1"), 2), _string("latin1", 2)]) \
            + pickle.REDUCE

    def dtype(spec: bytes) -> bytes:
        return _global("numpy", "dtype", 2) + spec + pickle.REDUCE

    field = pickle.EMPTY_LIST + pickle.MARK + _tuple([_string("a", 2), _string("V8", 2)]) + pickle.APPENDS
    object_fields = pickle.EMPTY_DICT + _string("a", 2) + _tuple(
        [dtype(_tuple([_string("O8", 2), pickle.NEWFALSE, pickle.NEWTRUE])), _int(0, 2)]) + pickle.SETITEM
    return (
        pickle.PROTO + b"\x02" + pickle.EMPTY_DICT + _string("rng", 2) + pickle.MARK
        + dtype(_tuple([field])) + pickle.BINPUT + b"\x00"
        + _global(numpy_module, "_reconstruct", 2) + _tuple([_global("numpy", "ndarray", 2), _tuple([_int(0, 2)]),
                                                            data(b"b")]) + pickle.REDUCE
        + _tuple([_int(1, 2), _tuple([_int(1, 2)]), pickle.BINGET + b"\x00", pickle.NEWFALSE,
                  data(struct.pack("<Q", pointer))]) + pickle.BUILD
        + pickle.BINGET + b"\x00"
        + _tuple([_int(3, 2), _string("|", 2), pickle.NONE, _tuple([_string("a", 2)]), object_fields,
                  _int(8, 2), _int(1, 2), _int(27, 2)]) + pickle.BUILD
        + pickle.TUPLE + pickle.SETITEM + pickle.STOP
    )


def _numpy_core_module() -> str:
    """The module numpy pickles its arrays' ``_reconstruct`` under (numpy 2 renamed it)."""
    import numpy as np

    return np.zeros(1).__reduce__()[0].__module__


@pytest.mark.integration
def test_a_numpy_dtype_built_again_after_an_array_used_it_is_refused(tmp_path: Path) -> None:
    """numpy's dtype takes a BUILD at any time: a crafted ``common.pt`` that rebuilt a
    dtype with an object field after an array of its bytes used it turned those bytes
    into a PyObject pointer the file chose. Before, the safe load returned that array
    and the process died of a segmentation fault reading it (or freeing it): memory
    corruption from a file, on the default, "safe" path. Now the dtype is made once, at
    its first use, and the second BUILD is refused, naming the file. (Run in a fresh
    process, whose safe globals are cleared: the test server imports Megatron-Core,
    which admits numpy's own classes for every load of the process.)"""
    from tests.forked_python import run

    ckpt = tmp_path / "ckpt"
    _our_checkpoint(ckpt)
    _plant_common(ckpt, _torch_archive_with_pickle({"step": 3}, lambda _d: _numpy_dtype_rebuilt_after_use(
        0x4141414141414141), 2))
    script = (
        "import sys, torch, shardstore\n"
        "torch.serialization.clear_safe_globals()\n"
        "try:\n"
        "    state = shardstore.load_common_state_dict(sys.argv[1])\n"
        "except shardstore.CheckpointingException as exc:\n"
        "    print('refused:', exc)\n"
        "else:\n"
        "    print('loaded', repr(state['rng'][1]['a'][0]))\n"
    )
    done = run([sys.executable, "-c", script, str(ckpt)], timeout=120)
    assert done.returncode == 0, f"the load crashed the process (exit {done.returncode}): {done.stderr[-2000:]}"
    assert "refused:" in done.stdout and "common.pt" in done.stdout, done.stdout
    assert "refusing to BUILD a numpy dtype twice, or after an array used it" in done.stdout, done.stdout


class _Pause:
    """Admitted by the test: unpickling one waits for the test's go-ahead, so two loads
    overlap in the order the test sets."""

    reached: threading.Event
    go: threading.Event

    def __init__(self) -> None:
        self.state = "pickled"  # a state: its unpickling runs BUILD

    def __setstate__(self, state: dict) -> None:
        type(self).reached.set()
        assert type(self).go.wait(20), "the test never let the load go on"


class _PauseFirst(_Pause):
    pass


class _PauseSecond(_Pause):
    pass


def test_two_overlapping_safe_loads_each_keep_numpy_admitted() -> None:
    """Two threads of one process loading numpy values at once: shardstore admitted numpy's
    names for each load through torch's ``safe_globals``, which takes away, when it ends,
    what it added. Before, a load that began while another held them added nothing; when
    the first ended, the second's next numpy value was refused as "damaged, or holds
    objects a safe load refuses". Now numpy's names stay admitted while any load runs."""
    import numpy as np

    from shardstore.format.pickles import load_torch, serialize

    for pause in (_PauseFirst, _PauseSecond):
        pause.reached, pause.go = threading.Event(), threading.Event()
    results: dict[str, object] = {}

    def load(name: str, pause: type[_Pause]) -> None:
        try:
            results[name] = load_torch(serialize([np.float64(1.0), pause(), np.arange(3)]), name)
        except Exception as exc:  # noqa: BLE001  (what the test looks at)
            results[name] = exc

    with torch.serialization.safe_globals([_PauseFirst, _PauseSecond]):
        first = threading.Thread(target=load, args=("first", _PauseFirst))
        second = threading.Thread(target=load, args=("second", _PauseSecond))
        first.start()
        assert _PauseFirst.reached.wait(20)
        second.start()
        assert _PauseSecond.reached.wait(20)
        _PauseFirst.go.set()
        first.join(20)
        _PauseSecond.go.set()
        second.join(20)
    for name in ("first", "second"):
        value = results[name]
        assert isinstance(value, list) and value[0] == 1.0 and list(value[2]) == [0, 1, 2], f"{name}: {value!r}"


def test_numpy_values_load_where_the_process_admitted_some_of_numpys_own_names(tmp_path: Path) -> None:
    """Megatron-Core's ``register_safe_globals`` (run when ``megatron.core`` is imported)
    admits numpy's own ``dtype``, ``ndarray``, ``_reconstruct`` and ``UInt32DType``.
    torch would then take either numpy's object or shardstore's stand-in for those
    names, so numpy's own are admitted, all of them: values of every dtype still load."""
    import numpy as np

    ckpt = tmp_path / "ckpt"
    shardstore.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2)), "x": np.float64(1.5),
                     "a": np.arange(3.0), "s": np.array(["ab"]), "u": np.arange(2, dtype=np.uint32)}, ckpt)
    before = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        torch.serialization.add_safe_globals([np.dtype, np.ndarray, np.zeros(1).__reduce__()[0], np.dtypes.UInt32DType])
        loaded = shardstore.load_common_state_dict(ckpt)
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)
    assert loaded["x"] == 1.5 and type(loaded["x"]) is np.float64
    assert list(loaded["a"]) == [0.0, 1.0, 2.0] and list(loaded["s"]) == ["ab"] and loaded["u"].dtype == np.uint32
