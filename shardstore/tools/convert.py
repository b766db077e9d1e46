"""Conversions between checkpoints and model files, with bounded memory.

Sources: a shardstore checkpoint, or anything of a format in
``shardstore.other_formats.registry``: another tool's checkpoint (PyTorch DCP,
Megatron-Core torch_dist or zarr, read without running its pickles) or model files (a
``torch.save`` file; Hugging Face style safetensors, one file or a model directory).
What a source is, the registry says once (``source_kind``). Targets: a shardstore
checkpoint (``import_checkpoint``), one ``torch.save`` file (``to_torch_file``) and a
safetensors model directory (``to_safetensors``), from any source of another format
(``open_export_source``).

Reading a checkpoint here means whole global arrays, a batch at a time
(``read_arrays``): at most ``memory_bytes`` of them are alive at once (an array larger
than that alone); another tool's checkpoint, one tensor at a time. Writing a shardstore
checkpoint means a save at world size 1 from tensors that are memory-mapped from the
source file, so neither direction holds the model in memory, except ``to_torch_file``,
whose single pickle needs every tensor at once.

Keys: a tensor at ``sd["model"]["fc1"]`` of a ``torch.save`` file is the array
``model/fc1`` and comes back to the same place; a sharded object's shard sits at its
unique key (``sd["rng_state/shard_0_2"]``); a plain DCP checkpoint's values go where
they were in the state dict DCP saved, and an imported file's arrays where the import
found them (``records.ArrayPlaces``: an int dict key stays an int, a list a list,
though the save dropped the dicts and lists that held only arrays); safetensors names
are array keys as they are
(each file format's module says how it reads its files). An export records which of
its tensors were arrays and which values of the common state
(``other_formats.layout``), so that an import gives the checkpoint back as it was.
Sharded objects and values JSON cannot hold are left out of safetensors, and named.

The converters take a path or URL and turn it into a Location once
(``opened.bare_location``); what they call (``source_kind``, ``read_arrays``, ...) takes
that Location, or the checkpoint opened at it.

Nothing is left behind by a conversion that fails: a checkpoint is staged and
published by its commit (``shardstore.format.commit``), a file is written under a temporary
name beside its destination and renamed at the end, a safetensors directory is filled
under a temporary name and renamed; files and directories get the modes ``open()`` and
``mkdir()`` give (the umask applies). Conversions run in one process (the ``shardstore
convert`` command); they refuse to run inside an initialized process group, where
``save`` would be collective.
"""

from __future__ import annotations

__all__ = [
    "DEFAULT_MEMORY_BYTES",
    "DEFAULT_SHARD_BYTES",
    "TORCH_SUFFIXES",
    "Export",
    "ExportSource",
    "TensorSpec",
    "array_batches",
    "from_other_format",
    "from_safetensors",
    "from_torch_file",
    "import_checkpoint",
    "open_export_source",
    "read_arrays",
    "read_non_tensor_state",
    "read_tensors",
    "refuse_destination_inside",
    "source_kind",
    "to_safetensors",
    "to_torch_file",
]

import functools
import json
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from operator import attrgetter, itemgetter
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from shardstore.dict_utils import nested_values
from shardstore.errors import CheckpointingException
from shardstore.format import ArrayPlaces, SaveOptions, StatePath, from_zarr_name
from shardstore.mapping import ShardedObject, ShardedTensor, StateDict
from shardstore.opened import OpenedCheckpoint, bare_location, open_read
from shardstore.other_formats import (
    SAFETENSORS_FORMAT,
    SAFETENSORS_INDEX,
    SAFETENSORS_SINGLE,
    TORCH_FILE_FORMAT,
    TORCH_SUFFIXES,
    ExportSource,
    ExportStructure,
    FileFormat,
    TensorSpec,
    detect,
    encode_common,
    formats,
    make_parents,
    place_of_key,
    place_value,
    safetensors_metadata,
    save_torch_file,
    sparse_list_index,
    write_safetensors,
)
from shardstore.stores import Location

DEFAULT_MEMORY_BYTES = 2**30
DEFAULT_SHARD_BYTES = 5 * 10**9  # Hugging Face's default max_shard_size, "5GB"

T = TypeVar("T")


# --------------------------------------------------------------------------- reading


def array_batches(
    arrays: Sequence[T], memory_bytes: int, nbytes: Callable[[T], int] = attrgetter("nbytes")
) -> list[list[T]]:
    """The arrays (records, tensors, anything ``nbytes`` sizes in bytes) in order, cut
    into batches of at most ``memory_bytes`` (an array larger than that is a batch of
    its own)."""
    batches: list[list[T]] = []
    size = 0
    for array in arrays:
        if not batches or size + nbytes(array) > memory_bytes:
            batches.append([])
            size = 0
        batches[-1].append(array)
        size += nbytes(array)
    return batches


def read_arrays(
    checkpoint: Location | OpenedCheckpoint,
    keys: list[str] | None = None,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields ``(key, whole global tensor)`` for the checkpoint's arrays (or ``keys``),
    sorted by key, reading a batch of at most ``memory_bytes`` at a time.

    Not collective; the tensors of a batch are freed when the caller drops them.
    """
    from shardstore.engine.zarr_strategies import ZarrLoadShardedStrategy

    opened = open_read(checkpoint)
    location, record = opened.location, opened.require_record()
    wanted = sorted(record.arrays) if keys is None else sorted(keys)
    unknown = [k for k in wanted if k not in record.arrays]
    if unknown:
        raise CheckpointingException(f"Checkpoint {location.describe()} has no array {unknown[0]!r}")
    strategy = ZarrLoadShardedStrategy()
    for batch in array_batches([record.arrays[k] for k in wanted], memory_bytes):
        request = {
            a.key: ShardedTensor.from_rank_offsets(
                a.key, torch.empty(a.shape, dtype=from_zarr_name(a.dtype).torch_dtype)
            )
            for a in batch
        }
        loaded = strategy.load_alone(request, location, record)
        for array in batch:
            yield array.key, loaded.pop(array.key)


def read_tensors(
    checkpoint: Location | OpenedCheckpoint,
    keys: list[str] | None = None,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``read_arrays`` of any checkpoint ``load`` reads: a shardstore checkpoint's
    arrays a batch at a time, another tool's tensors (a registered other format) one at
    a time; sorted by key. Not collective."""
    from shardstore.engine.other_formats import open_other_format

    opened = open_read(checkpoint)
    if opened.other_format is None:
        yield from read_arrays(opened, keys, memory_bytes)
        return
    source = open_other_format(opened.location)
    for key in sorted(source.tensors if keys is None else keys):
        if key not in source.tensors:
            raise CheckpointingException(f"{source.path} has no tensor {key!r}")
        yield key, source.read_tensor(key)


def read_non_tensor_state(checkpoint: Location | OpenedCheckpoint) -> StateDict:
    """The common state, with every sharded object's shards added at their unique keys
    (``rng_state/shard_0_2``), each the Python object it holds; of a shardstore
    checkpoint or of another tool's (a plain DCP checkpoint's values nested where they
    were in the state dict it saved)."""
    from shardstore.engine.load import load, load_sharded_metadata

    _refuse_process_group("reading a checkpoint's common state for conversion")
    opened = open_read(checkpoint)
    objects = {k: v for k, v in load_sharded_metadata(opened).items() if not isinstance(v, ShardedTensor)}
    state = load(objects, opened)
    return state


# --------------------------------------------------------------------------- what an export reads


def source_kind(location: Location) -> str:
    """What a conversion's source is: the name of its format in
    ``shardstore.other_formats.registry`` (model files: ``"torch"``, ``"safetensors"``;
    another tool's checkpoint: ``"dcp"``, ``"torch_dist"``, ``"zarr"``) or
    ``"shardstore"``; anything else is refused, saying what it is (nothing, an
    unfinished save, a file or directory of something else)."""
    files = _file_format(location)
    if files is not None:
        return files.name
    opened = open_read(location)
    return opened.other_format.name if opened.other_format is not None else "shardstore"


def open_export_source(location: Location) -> ExportSource:
    """The source of an export at ``location``, opened (see ``source_kind``)."""
    files = _file_format(location)
    if files is not None:
        return files.open(_local_path(location, files))
    return _checkpoint_source(location)


def _file_format(location: Location) -> FileFormat | None:
    """The registered format of the model files at ``location``, or None (a checkpoint,
    or nothing). A local file of no registered format is refused here: naming a file, the
    caller meant model files, not a checkpoint directory."""
    found = detect(location, FileFormat)
    local = location.local_path()
    if found is None and local is not None and local.is_file():
        known = "; ".join(
            f"{f.title} ({', '.join('*' + suffix for suffix in f.suffixes) or 'by its contents'})"
            for f in formats(FileFormat)
        )
        raise CheckpointingException(
            f"{location.describe()} is a file of no format shardstore converts (it converts {known}), "
            "nor a checkpoint directory"
        )
    return found


def _local_path(location: Location, files: FileFormat) -> Path:
    """The local path of model files at ``location``; they are read from local paths only."""
    local = location.local_path()
    if local is None:
        raise CheckpointingException(
            f"{location.describe()} is {files.title}, which shardstore reads from local paths only; "
            "copy it to a local disk first"
        )
    return local


def _checkpoint_source(checkpoint: Location) -> ExportSource:
    """A shardstore checkpoint, or another tool's: arrays by key (``model/fc1`` goes to
    ``sd["model"]["fc1"]``), except the values of a save through DCP's API (a plain DCP
    save, or one through ``ShardstoreWriter`` whose record keeps DCP's planner paths),
    which go where they were in the state dict DCP saved, as ``dcp_to_torch_save`` puts
    them, and the arrays an import of model files recorded the places of
    (``records.ArrayPlaces``), which go back there."""
    from shardstore.engine.other_formats import open_other_format

    opened = open_read(checkpoint)
    saved_paths: Mapping[str, tuple[str | int, ...]] = {}
    places = ArrayPlaces({})
    if opened.record is not None:
        specs = {
            key: TensorSpec(from_zarr_name(a.dtype).torch_dtype, a.shape) for key, a in opened.record.arrays.items()
        }
        if opened.record.dcp is not None and opened.record.dcp.paths is not None:
            saved_paths = opened.record.dcp.paths
        places = opened.record.places or places
    else:
        other = open_other_format(opened.location)
        specs = {key: TensorSpec(t.dtype, t.shape) for key, t in other.tensors.items()}
        saved_paths = other.saved_paths

    def other_values() -> dict[Any, Any]:
        state: dict[Any, Any] = {}
        for key, value in read_non_tensor_state(opened).items():
            place_value(state, saved_paths.get(key, (key,)), value, key)
        return _with_array_containers(state, places, opened.location.describe())

    def objects() -> tuple[str, ...]:
        from shardstore.engine.load import load_sharded_metadata

        return tuple(k for k, v in load_sharded_metadata(opened).items() if isinstance(v, ShardedObject))

    structure = functools.cache(other_values)  # read, never changed: where the arrays go

    return ExportSource(
        dict(sorted(specs.items())),
        lambda keys, memory_bytes: read_tensors(opened, keys, memory_bytes), other_values,
        lambda key: places.paths.get(key) or saved_paths.get(key) or place_of_key(key, structure()), objects,
    )


def _with_array_containers(state: dict[Any, Any], places: ArrayPlaces, where: str) -> dict[Any, Any]:
    """``state``, a checkpoint's common state, with the dicts and lists on the way to
    the arrays an import recorded the places of (``records.ArrayPlaces``) made again,
    of their kinds, emptied: the save dropped them, and an export puts the arrays there
    (safetensors keeps them in its layout's common state, so that int keys stay ints).
    A place past the end of its list is refused, before anything is allocated for it."""
    found = sparse_list_index(state, places.paths.values(), places.int_keyed)
    if found is not None:
        prefix, index, length, arrays = found
        raise CheckpointingException(
            f"Checkpoint {where}: its commit record places an array at index {index} of the list at {list(prefix)}, "
            f"which holds {length} values and {arrays} array(s); the record is damaged or was edited"
        )
    for key, path in places.paths.items():
        make_parents(state, path, key, places.int_keyed)
    return state


# --------------------------------------------------------------------------- torch.save


def to_torch_file(
    source: str | os.PathLike, path: str | os.PathLike, memory_bytes: int = DEFAULT_MEMORY_BYTES
) -> Export:
    """Writes a checkpoint (shardstore, PyTorch DCP, Megatron-Core torch_dist or zarr)
    or a safetensors model as one new ``torch.save`` file: every value at its place
    (``ExportSource.place``), each sharded object shard at its unique key as the Python
    object it holds; a plain DCP checkpoint gives what ``dcp_to_torch_save`` gives.
    Needs memory for the whole model (one pickle); nothing is written if it fails."""
    location = bare_location(source)
    if source_kind(location) == "torch":
        raise CheckpointingException(f"{source} is a torch.save file already")
    refuse_destination_inside(location, bare_location(path))
    opened = open_export_source(location)
    state = opened.other_values()
    for key, tensor in opened.read(list(opened.tensor_bytes), memory_bytes):
        place_value(state, opened.place(key), tensor, key)
    out = Path(path)
    layout = ExportStructure(opened.places(), opened.objects())
    _write_new_file(out, lambda p: save_torch_file(state, p, out, layout))
    return Export((out.name,), len(opened.tensor_bytes), sum(opened.tensor_bytes.values()), ())


def from_torch_file(
    path: str | os.PathLike, checkpoint: str | os.PathLike, overwrite: bool = False
) -> int:
    """Saves a ``torch.save`` file (loaded with ``weights_only=True``, memory-mapped) as a
    shardstore checkpoint (``other_formats.torch_file.state_to_save``); returns the
    number of arrays written."""
    return _import_files(TORCH_FILE_FORMAT, Path(path), bare_location(checkpoint), overwrite)


# --------------------------------------------------------------------------- safetensors


@dataclass(frozen=True)
class Export:
    """What ``to_torch_file`` or ``to_safetensors`` wrote: its files (names in the
    output directory, or the file's name), its tensors and their bytes, and the keys of
    the values it could not write (safetensors holds tensors only)."""

    files: tuple[str, ...]
    tensors: int
    total_bytes: int
    left_out: tuple[str, ...]


def to_safetensors(
    source: str | os.PathLike,
    out_dir: str | os.PathLike,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
) -> Export:
    """Writes the tensors of a checkpoint (shardstore, PyTorch DCP, Megatron-Core
    torch_dist or zarr) or ``torch.save`` file as a new Hugging Face style safetensors
    directory ``out_dir`` (or into an empty one): ``model.safetensors``, or
    ``model-00001-of-0000N.safetensors`` shards of at most ``max_shard_bytes`` with
    ``model.safetensors.index.json``. At most one shard is in memory at once. The
    common state goes into the first file's metadata with the checkpoint's layout
    (``convert_layout``), its tensors into the files by their paths; a safetensors
    source's own metadata goes into every file; sharded objects and
    values that JSON cannot hold are left out, and named. The directory is filled under
    a temporary name and renamed at the end: a failure leaves nothing."""
    location = bare_location(source)
    refuse_destination_inside(location, bare_location(out_dir))
    opened = open_export_source(location)
    # read first: a source whose other values cannot be read fails before anything is written
    other = opened.other_values()
    objects = opened.objects()
    common, common_tensors, left = encode_common({k: v for k, v in other.items() if k not in objects})
    left_out = tuple(sorted([*objects, *left]))
    clash = sorted(set(common_tensors) & set(opened.tensor_bytes))
    if clash:
        raise CheckpointingException(
            f"{source}: the common state's tensor {clash[0]!r} has the name of an array; safetensors needs one name each"
        )
    specs = {**opened.tensors, **{name: TensorSpec.of(t) for name, t in common_tensors.items()}}
    sizes = {key: spec.nbytes for key, spec in specs.items()}
    shards = array_batches(list(sizes.items()), max_shard_bytes, itemgetter(1)) or [[]]
    names = (
        [SAFETENSORS_SINGLE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    out = Path(out_dir)
    kept = {"format": "pt", **opened.metadata()}  # a safetensors source's own, in every file
    metadata = {**kept, **safetensors_metadata(ExportStructure(opened.places(), common=common))}
    with _new_directory(out) as staging:
        for name, shard in zip(names, shards):
            keys = [key for key, _ in shard]

            def tensors(keys: list[str] = keys) -> Iterator[tuple[str, torch.Tensor]]:
                yield from ((key, common_tensors[key]) for key in keys if key in common_tensors)
                yield from opened.read([key for key in keys if key not in common_tensors], memory_bytes)

            _write_new_file(
                staging / name,
                lambda p, k=keys, t=tensors, n=name, m=metadata: write_safetensors(
                    p, out / n, {key: specs[key] for key in k}, t(), m
                ),
            )
            metadata = kept  # the layout is in the first file
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(sizes.values())},
                     "weight_map": {key: name for name, shard in zip(names, shards) for key, _ in shard}}
            _write_new_file(staging / SAFETENSORS_INDEX, lambda p: p.write_text(json.dumps(index, indent=2)))
    return Export(tuple(names), len(sizes), sum(sizes.values()), left_out)


def from_safetensors(
    path: str | os.PathLike, checkpoint: str | os.PathLike, overwrite: bool = False
) -> int:
    """Saves a safetensors file or model directory as a shardstore checkpoint (one array
    per tensor name; where a shardstore export wrote its layout, the common state and
    the arrays as they were); returns the number of arrays written."""
    return _import_files(SAFETENSORS_FORMAT, Path(path), bare_location(checkpoint), overwrite)


# --------------------------------------------------------------------------- into a checkpoint


def import_checkpoint(
    source: str | os.PathLike, checkpoint: str | os.PathLike, overwrite: bool = False
) -> int:
    """Saves ``source``, of any format in ``shardstore.other_formats.registry`` (model
    files, or another tool's checkpoint), as a shardstore checkpoint; returns the number
    of arrays written."""
    location, destination = bare_location(source), bare_location(checkpoint)
    refuse_destination_inside(location, destination)
    files = _file_format(location)
    if files is not None:
        return _import_files(files, _local_path(location, files), destination, overwrite)
    return _from_other_format(location, destination, overwrite)


def _import_files(files: FileFormat, path: Path, checkpoint: Location, overwrite: bool) -> int:
    """Saves the model files at ``path``, of the format ``files``, as a checkpoint;
    returns the number of arrays written."""
    from shardstore.engine.save import save

    _refuse_process_group(f"converting {files.title}")
    state = files.state_to_save(path)
    save(state, checkpoint, options=SaveOptions(overwrite=overwrite, array_places=_array_places(state)))
    return sum(isinstance(value, ShardedTensor) for value in nested_values(state))


def _array_places(state: StateDict) -> ArrayPlaces | None:
    """Where ``state``, an import's, holds the arrays whose keys do not spell their
    places (``records.ArrayPlaces``); None where every key does (a Hugging Face model's)."""
    int_keyed: set[StatePath] = set()
    paths = {
        tensor.key: place for place, tensor in _sharded_tensors_at(state, (), int_keyed)
        if place != tuple(tensor.key.split("/"))
    }
    if not paths:
        return None
    on_the_way = {path[:depth] for path in paths.values() for depth in range(len(path))}
    return ArrayPlaces(paths, frozenset(int_keyed & on_the_way))


def _sharded_tensors_at(
    node: dict | list, path: StatePath, int_keyed: set[StatePath]
) -> Iterator[tuple[StatePath, ShardedTensor]]:
    """Each ShardedTensor in the dicts and lists of ``node`` with its place (a dict key
    of another type than str and int as its text, as its array's key spells it); the
    places of the dicts with int keys added to ``int_keyed``. Module-level, not a
    closure calling itself: that would be a reference cycle holding the tensors."""
    for k, v in node.items() if isinstance(node, dict) else enumerate(node):
        if isinstance(node, dict) and type(k) is int:
            int_keyed.add(path)
        place = (*path, k if isinstance(k, str) or type(k) is int else str(k))
        if isinstance(v, ShardedTensor):
            yield place, v
        elif isinstance(v, (dict, list)):
            yield from _sharded_tensors_at(v, place, int_keyed)


# --------------------------------------------------------------------------- other tools' formats


def from_other_format(
    path: str | os.PathLike, checkpoint: str | os.PathLike, overwrite: bool = False
) -> int:
    """Imports another tool's checkpoint, of any format in
    ``shardstore.other_formats.registry`` (PyTorch DCP, Megatron-Core torch_dist or zarr;
    read without running its pickles): every tensor becomes the array of its key, whole,
    written one at a time; Megatron's ShardedObjects (``<key>/shard_<offset>_<shape>``)
    stay sharded objects; Megatron's ``common.pt`` and a plain DCP's other values form
    the common state. A plain DCP's arrays keep their places in the state dict DCP saved
    (``records.ArrayPlaces``), so an export puts them back there, as from the DCP
    checkpoint itself. Returns the number of arrays."""
    return _from_other_format(bare_location(path), bare_location(checkpoint), overwrite)


def _from_other_format(source_location: Location, checkpoint: Location, overwrite: bool) -> int:
    """``from_other_format`` from and into Locations."""
    from shardstore.engine.other_formats import (
        OtherFormatLoadCommonStrategy,
        open_other_format,
    )
    from shardstore.tools.array_writer import CheckpointWriter

    source = open_other_format(source_location)
    object_keys = list(OtherFormatLoadCommonStrategy().load_sharded_metadata(source.path))
    planned = {
        key: torch.empty(t.shape, dtype=source.stored_dtype(key).torch_dtype, device="meta")
        for key, t in source.tensors.items()
    }
    places = _saved_array_places(source.saved_paths, source.tensors)
    with CheckpointWriter(
        checkpoint, overwrite, planned_arrays=planned, planned_objects=object_keys, array_places=places
    ) as writer:
        for key, tensor in source.iter_tensors():
            writer.write_array(key, tensor)
        common = OtherFormatLoadCommonStrategy().load_common(source.path)
        writer.commit(common, {key: source.read_object_shard(key) for key in object_keys})
    return len(source.tensors)


def _saved_array_places(
    saved_paths: Mapping[str, StatePath], arrays: Collection[str]
) -> ArrayPlaces | None:
    """Where another tool's checkpoint had the ``arrays`` whose keys do not spell their
    places (``OtherCheckpoint.saved_paths``: a plain DCP's ``model.fc1.weight`` at
    ``("model", "fc1.weight")``), or None where none is recorded. Its int parts are list
    indices: DCP names every dict key by its text."""
    paths = {
        key: path for key, path in saved_paths.items()
        if key in arrays and path != tuple(key.split("/"))
    }
    return ArrayPlaces(paths) if paths else None


# --------------------------------------------------------------------------- helpers


def refuse_destination_inside(source: Location, destination: Location) -> None:
    """Refuses a destination in the source directory (or the source itself): the
    conversion would write into the checkpoint it reads, a file its commit record does
    not list (damage ``verify`` reports)."""
    src, dst = source.local_path(), destination.local_path()
    if src is not None and dst is not None and src.is_dir() and dst.resolve().is_relative_to(src.resolve()):
        raise CheckpointingException(
            f"{destination.describe()} is inside the source {source.describe()}: a conversion never writes into "
            "the checkpoint it reads; choose a destination outside it"
        )


def _refuse_process_group(what: str) -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise CheckpointingException(
            f"{what} runs in one process, but a process group of {dist.get_world_size()} ranks is initialized; "
            "run it in a separate process (the `shardstore convert` command)"
        )


def _write_new_file(path: Path, write: Callable[[Path], Any]) -> None:
    """Has ``write`` write a temporary file beside ``path`` that is then renamed to
    ``path``, so a failed conversion leaves no file (nor the directories made for it);
    refuses to replace a file. The file gets the mode ``open()`` gives a new file (0666
    less the umask), whatever ``write`` does: safetensors' writer makes 0600 files."""
    if path.exists():
        raise CheckpointingException(f"{path} exists; choose a new output path")
    made = _make_directories(path.parent)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.partial")
    try:
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies
        mode = stat.S_IMODE(os.fstat(descriptor).st_mode)
        os.close(descriptor)
        write(temporary)
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        _remove_directories(made)
        raise


@contextmanager
def _new_directory(path: Path) -> Iterator[Path]:
    """A directory filled under a temporary name beside ``path`` (the one yielded) and
    renamed to ``path`` at the end, replacing an empty directory there; if anything
    fails, removed, with the directories made for it."""
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise CheckpointingException(f"{path} exists and is not an empty directory; convert into a new directory")
    made = _make_directories(path.parent)
    staging = path.with_name(f".{path.name}.{secrets.token_hex(4)}.partial")
    try:
        staging.mkdir()  # the umask applies, as to any mkdir
        yield staging
        os.rename(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        _remove_directories(made)
        raise


def _make_directories(directory: Path) -> list[Path]:
    """Makes ``directory`` and its missing parents; returns those it made, deepest first."""
    missing = []
    for candidate in (directory, *directory.parents):
        if candidate.exists():
            break
        missing.append(candidate)
    for candidate in reversed(missing):
        candidate.mkdir(exist_ok=True)
    return missing


def _remove_directories(made: list[Path]) -> None:
    for directory in made:
        with suppress(OSError):  # not empty: someone else's files arrived meanwhile
            directory.rmdir()
