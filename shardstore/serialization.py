"""``save`` / ``load`` and the metadata queries: the API a trainer calls, under the names
and meaning of Megatron-Core's ``dist_checkpointing.serialization``.

Save, in stages (each named function below; "collective" = every rank calls it):

    all ranks    preprocess  Megatron-Core objects converted (shardstore.inputs.megatron_objects),
                             factories built, non-persistent values dropped, the state
                             dict split into sharded part and common part
    collective   plan        shard metadata and the directory each rank names go to the
                             coordinator, which validates the global layout and plans
                             the save; each rank receives only its part
                             (shardstore.planning.plans)
    coordinator  begin       shardstore.format.commit.begin_save: refuse what is not ours to
                             replace, clear dead saves' leftovers, create this save's
                             staging area and write metadata.json there, once the plan
                             is made; every rank learns the save id with its part of
                             the plan (the same scatter)
    all ranks    common      coordinator writes common.pt; each rank its ShardedObjects (a
                             failure is told to every rank by the staging stage)
    collective   sharded     the storage core (strategies.zarr, its stages in
                             execution.save): stage, write, gather the chunk
                             checksums to the coordinator, which commits (the root
                             zarr.json, written last) and publishes

A failure on any rank at any stage raises a CheckpointingException on every rank, the
coordinator deletes what the save wrote, and whatever was committed at the target
before stays.

Load, in stages:

    all ranks    record      the commit record is read first, so an incomplete checkpoint
                             is refused before anything else happens; every file is read
                             through it
    all ranks    preprocess  common state read, factories built, the request collected
    collective   plan        the requests go to the coordinator, which applies strict,
                             checks access integrity and plans who reads what
                             (load_strictness.plan_load); each rank receives only its part
    collective   read        each rank reads its part, agree, exchange of replicated
                             blocks (the sharded strategy's load_with_plan; ours:
                             execution.load.run_read_plan)
"""

from __future__ import annotations

__all__ = [
    "get_default_load_sharded_strategy", "get_default_save_common_strategy",
    "get_default_save_sharded_strategy", "load", "load_common_state_dict",
    "load_content_metadata", "load_plain_tensors", "load_preprocess", "load_sharded_metadata",
    "load_tensors_metadata", "remove_sharded_tensors", "save",
    "verify_before_load", "verify_checkpoint_and_load_strategy",
]

import functools
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Union

import torch
import torch.distributed as dist

from shardstore.dict_utils import Leaf, flatten, merge, nest, with_list_places
from shardstore.errors import CheckpointingException
from shardstore.execution.pipeline import SavePipeline
from shardstore.format.commit import SaveOptions
from shardstore.format.config import CheckpointingConfig
from shardstore.format.integrity import verify
from shardstore.format.pickles import serialize
from shardstore.format.records import CommitRecord
from shardstore.format.storage_layout import StorageLayout
from shardstore.gc_pause import gc_paused
from shardstore.inputs.dtensors import clashing_names
from shardstore.inputs.megatron_objects import convert_leaf
from shardstore.inputs.plain_tensors import whole_array_requests
from shardstore.load_strictness import (
    StrictHandling,
    parse_strict_flag,
    plan_load,
    reported_mismatches,
)
from shardstore.mapping import (
    CommonStateDict,
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
)
from shardstore.opened import OpenedCheckpoint, bare_location, open_read
from shardstore.planning.layout import GlobalLayout
from shardstore.planning.plans import RankLoadPlan
from shardstore.progress import StageTiming, operation, progress_shown, stage
from shardstore.protocol.collectives import Group, PeerLost
from shardstore.protocol.common_state import common_state_digests
from shardstore.protocol.plan_stage import gather_and_plan
from shardstore.protocol.stage import run_stage
from shardstore.stores.base import Location
from shardstore.strategies.async_utils import AsyncRequest
from shardstore.strategies.base import (
    AsyncSaveShardedStrategy,
    DelegatingLoadStrategy,
    LoadCommonStrategy,
    LoadShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    get_default_strategy,
    plan_load_with_record,
    strategy_by_name,
    validate_sharded_objects_handling,
)
from shardstore.strategies.common import TorchCommonLoadStrategy
from shardstore.strategies.other_formats import (
    OtherFormatLoadCommonStrategy,
    OtherFormatLoadShardedStrategy,
)
from shardstore.strategies.zarr import ZarrLoadShardedStrategy
from shardstore.utils import (
    _clean_metadata_for_serialization,
    holds_sharded_class,
    sharded_values_in_common,
)

logger = logging.getLogger(__name__)

CheckpointDir = Union[str, Path, Location]
# Where save(content_metadata=...) keeps it in the common state (Megatron-Core's key).
CONTENT_METADATA_KEY = "content_metadata"


# --------------------------------------------------------------------------- save


@gc_paused
def save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: CheckpointDir,
    sharded_strategy: SaveShardedStrategy | tuple[str, int] | None = None,
    common_strategy: SaveCommonStrategy | tuple[str, int] | None = None,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
    preprocess_common_before_consistancy_check: Any = None,
    content_metadata: dict | None = None,
    *,
    overwrite: bool = False,
    process_group: dist.ProcessGroup | None = None,
    progress: bool = False,
    reuse_from: CheckpointDir | None = None,
    shared_directory: bool = False,
    options: SaveOptions | None = None,
    layout: StorageLayout | None = None,
) -> AsyncRequest | None:
    """Saves a sharded state dict; every rank of the group calls it with its own shards.

    Args:
        sharded_state_dict: nested dicts/lists of ShardedTensors, ShardedObjects,
            ShardedTensorFactories, LocalNonpersistentObjects and plain values (the
            plain values form the common state, saved from the coordinator).
        checkpoint_dir: where to save (created if missing).
        sharded_strategy: storage strategy, or the ``(backend, version)`` of a registered
            one; default: Zarr v3 (``("zarr", 1)``).
        common_strategy: strategy for the common state, or its ``(backend, version)``;
            default: torch.
        validate_access_integrity: accepted for compatibility; the global sharding is
            always validated, because the storage core relies on exactly one writer
            per chunk (the check costs one pass over the shard metadata).
        async_sharded_save: return an AsyncRequest whose I/O the caller schedules
            (``AsyncCallsQueue``) instead of writing now.
        preprocess_common_before_consistancy_check: applied to the common state before
            the ranks' common states are compared (a WARNING names the entries that
            differ from rank 0's, which is the one saved); e.g. to drop entries that
            legitimately differ, such as per-rank timers.
        content_metadata: what the checkpoint holds (e.g. the parallel layout), kept in
            the common state without its process groups (``dp_cp_group``: a copy made
            by ``utils._clean_metadata_for_serialization``, as in Megatron-Core); read
            back with ``load_content_metadata``.
        overwrite: replace a committed checkpoint at ``checkpoint_dir``.
        process_group: ranks that save together (default: the sharded strategy's
            ``process_group`` where it has one, else the whole world).
        progress: show a progress bar of the coordinator's writes on standard error
            (``shardstore.progress``; an async save's background writes show none).
        reuse_from: an earlier committed checkpoint (same kind of storage) whose
            chunks this save shares instead of writing them again where their bytes did
            not change (an incremental save, ``shardstore.format.reuse``): a hard link
            or clone locally, a server-side copy on S3. The new checkpoint stands alone.
            A checkpoint that cannot be reused from (missing, older, another tool's) is
            logged and ignored. Every rank passes the same.
        shared_directory: other programs may write their own files into
            ``checkpoint_dir`` while the save runs (an async save especially; e.g.
            Megatron-LM's ModelOpt state beside the model's checkpoint): their files are
            kept and the checkpoint is published beside them (``verify`` lists them, as
            the commit record does not vouch for them). By default such a write makes
            the save fail at its commit, as a concurrent save into the same place would.
        options: the three above and the layout as one ``SaveOptions`` (how doors
            built on ``save`` pass them); combined with the keywords where they do not
            contradict each other.
        layout: where the bytes go (``StorageLayout``: chunk and shard sizes, packs of
            small arrays, the Zarr documents); fields left ``"auto"`` (all, by default)
            are chosen by shardstore for this save (docs/guide/layout.md), combined
            with the sharded strategy's own (``shard_bytes=``, ``max_chunk_bytes=``).

    Returns:
        None, or the AsyncRequest when ``async_sharded_save``.

    Raises:
        CheckpointingException: on every rank, for invalid input or a failed write.
    """
    if content_metadata is not None:
        sharded_state_dict[CONTENT_METADATA_KEY] = content_metadata
    sharded_strategy = strategy_by_name(sharded_strategy, StrategyAction.SAVE_SHARDED)
    common_strategy = strategy_by_name(common_strategy, StrategyAction.SAVE_COMMON)
    if sharded_strategy is None:
        sharded_strategy = get_default_save_sharded_strategy()
    if common_strategy is None:
        common_strategy = get_default_save_common_strategy()
    group = _group_of(process_group, sharded_strategy)
    if async_sharded_save and not isinstance(sharded_strategy, AsyncSaveShardedStrategy):
        raise CheckpointingException(f"Cannot save asynchronously with {sharded_strategy}: not an async strategy")
    config = CheckpointingConfig(
        sharded_strategy.backend, sharded_strategy.version, common_strategy.backend, common_strategy.version
    )
    options = SaveOptions.resolve(options, SaveOptions(overwrite, reuse_from, shared_directory, layout))
    pipeline = SavePipeline.open(checkpoint_dir, group, _with_strategy_layout(options, sharded_strategy), config=config)

    where = pipeline.describe()
    with progress_shown(progress and group.is_coordinator), operation("save", where, coordinator=group.is_coordinator) as timing:
        with stage("save: plan", where):
            sharded_part, common_part, objects_part, plan = _preprocess_and_plan(
                sharded_state_dict, pipeline, sharded_strategy, preprocess_common_before_consistancy_check
            )
        timing.nbytes = getattr(plan, "checkpoint_nbytes", 0)
        try:
            if not sharded_strategy.can_handle_sharded_objects:
                validate_sharded_objects_handling(sharded_strategy, common_strategy)
            with stage("save: common", where):
                error = _save_common(pipeline.location, group, common_strategy, common_part, objects_part)
            if async_sharded_save:
                request = sharded_strategy.async_save_into(sharded_part, pipeline, plan, error)
                timing.defer()
                # a local step: runs only once the save committed (a partial: the request may be pickled)
                request.add_finalize_fn(functools.partial(_finish_timing, timing, pipeline))
                return request
            sharded_strategy.save_into(sharded_part, pipeline, plan, error)
            timing.shared = pipeline.shared_bytes()
        except PeerLost as exc:  # known to this rank only: a peer may still be writing
            pipeline.unwind(exc)
            raise
        except CheckpointingException:  # raised on every rank: no rank writes any more
            if group.is_coordinator:
                pipeline.abandon()
            else:
                pipeline.release()
            raise
        except BaseException as exc:  # a bug or an interrupt, maybe on this rank alone
            pipeline.unwind(exc)
            raise
    return None


def _with_strategy_layout(options: SaveOptions, strategy: Any) -> SaveOptions:
    """``options`` with the sharded strategy's own layout fields (a
    ``ZarrSaveShardedStrategy(shard_bytes=...)``) folded in.

    Raises:
        CheckpointingException: the two set one field to different values."""
    own = getattr(strategy, "layout", None)
    if not isinstance(own, StorageLayout):
        return options
    try:
        return replace(options, layout=options.layout.combined(own))
    except ValueError as exc:
        raise CheckpointingException(f"save() was given a layout that contradicts {strategy}'s: {exc}") from None


def _finish_timing(timing: StageTiming, pipeline: SavePipeline) -> None:
    """An async save's last local step: logs its line with the bytes it shared."""
    timing.finish(shared=pipeline.shared_bytes())


def save_preprocess(
    sharded_state_dict: ShardedStateDict,
) -> tuple[ShardedStateDict, StateDict]:
    """Converts other libraries' objects, builds factories, drops non-persistent values,
    splits off the common state (one walk of the state dict, ``_SaveSplit``).

    Returns:
        ``(sharded part, common state)``
    """
    split = _SaveSplit(sharded_state_dict, separate_objects=False)
    return split.sharded_part, split.common_part


class _SaveSplit:
    """A state dict to save, walked once (``dict_utils.flatten``): DTensors and
    Megatron-Core's objects converted (``inputs``), factories built, non-persistent
    values dropped, and each leaf sorted into the sharded part (without flat ranges of
    length 0), the ShardedObjects (``separate_objects``: for a common strategy that
    saves them) and the common state, each rebuilt from the flat list (``dict_utils.nest``,
    with ``extract_matching_values``' meaning: an empty container stays in the common
    state, one emptied by the split is dropped). The common state's ``content_metadata``
    is replaced by a copy without process groups, as in Megatron-Core's save_preprocess.

    Attributes:
        sharded_part, objects_part, common_part: the nested parts.
        tensors, objects: the ShardedTensors and ShardedObjects in the sharded part's
            traversal order (``utils.local_sharded_items``'s, which plans index).

    Raises:
        CheckpointingException: a state dict that is not a dict; a sharded object of
            another library (or one inside a tuple) in the common state; a DTensor's
            name held by another value too (``inputs.dtensors.clashing_names``).
    """

    def __init__(self, sharded_state_dict: ShardedStateDict, separate_objects: bool) -> None:
        if not isinstance(sharded_state_dict, dict):
            raise CheckpointingException(
                f"The state dict to save is a {type(sharded_state_dict).__name__}, not a dict: a load reads the "
                "common state back as a dict (Megatron-Core's state dicts are dicts). Put the values under keys "
                "({'model': [...]})"
            )
        if (clash := clashing_names(sharded_state_dict)) is not None:
            raise clash
        foreign: list[tuple] = []
        leaves = flatten(sharded_state_dict, _request_visitor(foreign_in_common=foreign))
        sharded: list[Leaf] = []
        object_leaves: list[Leaf] = []
        common: list[Leaf] = []
        self.tensors: list[ShardedTensor] = []
        self.objects: list[ShardedObject] = []
        for leaf in leaves:
            value = leaf.value
            if leaf.empty or not isinstance(value, (ShardedBase, LocalNonpersistentObject)):
                common.append(leaf)
            elif isinstance(value, ShardedTensor):
                if not _is_empty_flat_tensor(value):
                    self.tensors.append(value)
                    sharded.append(leaf)
            elif isinstance(value, ShardedObject):
                self.objects.append(value)
                (object_leaves if separate_objects else sharded).append(leaf)
            elif isinstance(value, ShardedBase):
                sharded.append(leaf)
        self.common_part, _ = nest(with_list_places(common, leaves), root=sharded_state_dict)
        if isinstance(self.common_part, dict) and isinstance(self.common_part.get(CONTENT_METADATA_KEY), dict):
            # as Megatron-Core's save_preprocess: its process groups cannot be pickled
            self.common_part[CONTENT_METADATA_KEY] = _clean_metadata_for_serialization(
                self.common_part[CONTENT_METADATA_KEY]
            )
        if foreign:
            in_tuples = any(leaf.path in foreign and isinstance(leaf.value, tuple) for leaf in leaves)
            raise _sharded_in_common(sharded_values_in_common(self.common_part), in_tuples)
        self.sharded_part, _ = nest(sharded, root=sharded_state_dict)
        self.objects_part = nest(object_leaves, root=sharded_state_dict)[0] if object_leaves else {}


def _sharded_in_common(found: list[str], in_tuples: bool) -> CheckpointingException:
    """The refusal of sharded objects found among the common state's plain values (at
    the paths ``found``); ``in_tuples``: some are inside a tuple, a plain value whole."""
    if in_tuples:
        return CheckpointingException(
            f"The state dict holds sharded objects inside a tuple, at {found[:5]}: a tuple is a plain value, "
            "pickled whole into common.pt (Megatron-Core's walks do not enter tuples either), so nothing in it "
            "would be stored as an array or loaded back. Hold sharded objects in a list or a dict."
        )
    return CheckpointingException(
        f"The state dict holds sharded objects that shardstore does not handle, at {found[:5]}: they "
        "would be pickled whole into common.pt. Use shardstore's ShardedTensor/ShardedObject (or convert "
        "Megatron-Core's objects first); plain values belong in the common state."
    )


def _is_empty_flat_tensor(x: Any) -> bool:
    """A flat range of length 0: this rank holds none of that tensor."""
    return isinstance(x, ShardedTensor) and x.flattened_range is not None and x.data is not None and x.data.numel() == 0


def _request_visitor(
    foreign_in_common: list[tuple] | None = None, factories: list[tuple[tuple, ShardedTensorFactory]] | None = None,
    plain: Callable[[tuple, Any], Any] | None = None,
) -> Callable[[tuple, Any, bool], Any]:
    """``flatten``'s visit for a save's or a load's state dict: each leaf converted
    (``inputs.megatron_objects.convert_leaf``, then ``plain``: a load's requests for
    plain tensors stored as arrays, ``inputs.plain_tensors.whole_array_requests``), each
    factory built (and, with ``factories``, remembered with its path for the load's
    merges); with ``foreign_in_common``, the paths of plain values that are (or hold, in
    a tuple) another library's sharded objects (``utils.holds_sharded_class``).

    Factories are built once, as Megatron-Core's ``apply_factories`` builds them: a
    factory in a factory's build is refused (it would be neither stored nor merged)."""
    building: list[ShardedTensorFactory] = []  # the factory whose build is being walked

    def visit(path: tuple, value: Any, expandable: bool) -> Any:
        if expandable:
            value = convert_leaf(path, value)
            if plain is not None:
                value = plain(path, value)
            if isinstance(value, ShardedTensorFactory):
                if factories is not None:
                    factories.append((path, value))
                building[:] = [value]
                return value.build()
        elif isinstance(value, ShardedTensorFactory):
            raise _factory_in_a_build(building[0], value, path)
        if (foreign_in_common is not None and not isinstance(value, (ShardedBase, LocalNonpersistentObject))
                and holds_sharded_class(value)):
            foreign_in_common.append(path)
        return value

    return visit


def _factory_in_a_build(outer: ShardedTensorFactory, inner: ShardedTensorFactory, path: tuple) -> CheckpointingException:
    where = "".join(f"[{k!r}]" for k in path)
    return CheckpointingException(
        f"The build of ShardedTensorFactory {outer.key!r} returned another ShardedTensorFactory {inner.key!r} (at "
        f"{where}): factories are built once, so it would be neither stored nor merged. Have the build return "
        "ShardedTensors (build the inner factory there and merge it in the outer merge_fn)"
    )


def _preprocess_and_plan(
    sharded_state_dict: ShardedStateDict, pipeline: SavePipeline, sharded_strategy: SaveShardedStrategy,
    preprocess_common: Callable[[StateDict], StateDict] | None,
) -> tuple[ShardedStateDict, StateDict, ShardedStateDict, Any]:
    """Stages preprocess + plan + begin, in one round trip (``SavePipeline.plan``): a
    local failure becomes an error on every rank, and so do ranks that name different
    checkpoint directories, keys the target cannot store (its ``name_limits``) and an
    invalid global sharding. The ranks' common states are compared in the same gather
    (digests only). Once the plan is made, the coordinator begins the save and every
    rank joins it with its part of the plan. A strategy with a ``plan_cache`` reuses its
    last plan while every rank's structure is unchanged (``protocol.plan_cache``).
    Returns the parts of the state dict and this rank's part of the strategy's plan."""
    error, sharded_part, common_part, objects_part, digests, compared = None, {}, {}, {}, None, None
    tensors: list[ShardedTensor] = []
    objects: list[ShardedObject] = []
    try:
        split = _SaveSplit(sharded_state_dict, separate_objects=not sharded_strategy.can_handle_sharded_objects)
        sharded_part, common_part, objects_part = split.sharded_part, split.common_part, split.objects_part
        tensors, objects = split.tensors, split.objects
        if pipeline.group.world_size > 1:
            compared = preprocess_common(common_part) if preprocess_common else common_part
            digests = common_state_digests(compared)
    except Exception as exc:  # reported on every rank by the plan stage
        error = exc
    plan = pipeline.plan(
        tensors, objects, sharded_strategy.plan_save, plan_cache=sharded_strategy.plan_cache, local_error=error,
        common_digests=digests, common_state=compared,
    )
    return sharded_part, common_part, objects_part, plan


def _save_common(
    location: Location,
    group: Group,
    common_strategy: SaveCommonStrategy,
    common_part: StateDict,
    objects_part: ShardedStateDict,
) -> CheckpointingException | None:
    """Stage common: coordinator writes the common state; every rank its objects.
    Returns this rank's failure, which the sharded save's first stage (its staging)
    reports on every rank: no collective of its own."""
    saving: StateDict | ShardedStateDict = {}
    try:
        if group.is_coordinator:
            saving = common_part
            common_strategy.save_common(common_part, location)
        saving = objects_part
        if objects_part:
            common_strategy.save_sharded_objects(objects_part, location)
    except Exception as exc:  # reported on every rank by the sharded save's staging
        error = CheckpointingException(
            f"Saving the common state and sharded objects to {location.describe()}: {_unpicklable(saving)}"
            f"{type(exc).__name__}: {exc}"
        )
        error.__cause__ = exc
        return error
    return None


def _unpicklable(state: Any) -> str:
    """After pickling ``state`` failed: which of its values cannot be pickled on its own
    (``_first_unpicklable``) and what to do, for the error; "" where none can be named
    (values that fail only together: two views of one storage in two dtypes)."""
    found = _first_unpicklable(state, ())
    if found is None:
        return ""
    path, value = found
    if isinstance(value, ShardedObject):
        what = f"ShardedObject {value.key!r} holds data ({type(value.data).__qualname__}) that"
    else:
        what = f"the common state entry {''.join(f'[{k!r}]' for k in path)} ({type(value).__qualname__})"
    return (f"{what} cannot be pickled: make it a plain value (or a state dict of its own), or wrap it in "
            "LocalNonpersistentObject to leave it out of the checkpoint. ")


def _first_unpicklable(value: Any, path: tuple) -> tuple[tuple, Any] | None:
    """The path of the first leaf of ``value`` (dicts, lists and tuples walked; a
    ShardedObject by its data) that ``torch.save`` refuses on its own, and that leaf."""
    if isinstance(value, dict):
        children: Any = value.items()
    elif isinstance(value, (list, tuple)):
        children = enumerate(value)
    else:
        try:
            serialize(value.data if isinstance(value, ShardedObject) else value)
        except Exception:  # noqa: BLE001  (what is looked for: the error itself is reported by the caller)
            return path, value
        return None
    return next(filter(None, (_first_unpicklable(v, (*path, k)) for k, v in children)), None)


def get_default_save_sharded_strategy(backend: str = "zarr", version: int = 1) -> SaveShardedStrategy:
    """The registered default save strategy for sharded tensors."""
    return get_default_strategy(StrategyAction.SAVE_SHARDED, backend, version)


def get_default_save_common_strategy(backend: str = "torch", version: int = 1) -> SaveCommonStrategy:
    """The registered default save strategy for the common state."""
    return get_default_strategy(StrategyAction.SAVE_COMMON, backend, version)


# --------------------------------------------------------------------------- load


def verify_before_load(checkpoint_dir: CheckpointDir, process_group: dist.ProcessGroup | None = None) -> None:
    """Collective: the coordinator verifies everything a load of ``checkpoint_dir`` reads
    (``format.integrity.verify``) and every rank raises its failure (Megatron-Core's
    ``load(verify_integrity=True)``). Files the commit record does not list (Megatron-LM
    writes ModelOpt's state into the iteration after a synchronous save) are logged,
    not refused: the load never reads them.

    Raises:
        CheckpointingException: on every rank, naming the damage.
    """
    group = Group(process_group)

    def on_coordinator() -> None:
        if not group.is_coordinator:
            return
        report = verify(checkpoint_dir)
        if report.unlisted:
            logger.warning(
                "%s holds %d file(s) its save did not write (%s); the load does not read them. `shardstore verify` "
                "lists them", checkpoint_dir, len(report.unlisted), ", ".join(report.unlisted[:3]),
            )
        report.raise_if_damaged(for_a_load=True)

    run_stage(group, f"Verifying checkpoint {checkpoint_dir}", on_coordinator)


@gc_paused
def load(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: CheckpointDir,
    sharded_strategy: LoadShardedStrategy | tuple[str, int] | None = None,
    common_strategy: LoadCommonStrategy | tuple[str, int] | None = None,
    validate_access_integrity: bool = True,
    strict: str | StrictHandling = StrictHandling.ASSUME_OK_UNEXPECTED,
    *,
    process_group: dist.ProcessGroup | None = None,
    progress: bool = False,
) -> StateDict | tuple[StateDict, set[str], set[str]]:
    """Loads the parts of a checkpoint that ``sharded_state_dict`` asks for.

    Each rank describes what it wants with ShardedTensors (any layout: the saved one or
    another) and gets tensors back in the same structure, merged with the common state.

    Args:
        sharded_state_dict: the request; its ShardedTensors say which region of each
            global tensor this rank needs.
        checkpoint_dir: a committed checkpoint.
        sharded_strategy: default: chosen from the checkpoint's config; a
            ``(backend, version)`` tuple names a registered one.
        common_strategy: default: chosen from the checkpoint's config; or a
            ``(backend, version)`` tuple.
        validate_access_integrity: check (collectively) that the requests of all ranks'
            main replicas cover every requested tensor exactly once.
        strict: how to handle keys that do not match the checkpoint: a StrictHandling
            (shardstore's or Megatron-Core's) or its string value.
        process_group: ranks that load together (default: the sharded strategy's
            ``process_group`` where it has one, else the whole world).
        progress: show a progress bar of the coordinator's reads on standard error.

    Returns:
        The loaded state dict, or ``(state dict, missing keys, unexpected keys)`` for
        ``StrictHandling.RETURN_*``.

    Raises:
        CheckpointingException: incomplete or invalid checkpoint, or mismatches that
            ``strict`` says to raise on.
    """
    group = _group_of(process_group, sharded_strategy)
    target = checkpoint_dir if isinstance(checkpoint_dir, OpenedCheckpoint) else bare_location(checkpoint_dir)
    with progress_shown(progress and group.is_coordinator):
        return _load(
            sharded_state_dict, target, sharded_strategy, common_strategy, validate_access_integrity, strict,
            group,
        )


def _group_of(process_group: dist.ProcessGroup | None, sharded_strategy: Any) -> Group:
    """The ranks a save or load runs on: ``process_group``, else the one the sharded
    strategy was made for (``ZarrSaveShardedStrategy(process_group=...)``, the seed's
    way to name it), else the whole world."""
    if process_group is None:
        process_group = getattr(sharded_strategy, "process_group", None)
    return Group(process_group)


def _load(
    sharded_state_dict: ShardedStateDict,
    target: Location | OpenedCheckpoint,
    sharded_strategy: LoadShardedStrategy | None,
    common_strategy: LoadCommonStrategy | None,
    validate_access_integrity: bool,
    strict: str | StrictHandling,
    group: Group,
) -> StateDict | tuple[StateDict, set[str], set[str]]:
    """``load`` of ``target`` on ``group`` (``Group.local()``: this process alone, no collectives)."""
    with operation("load", target.describe(), coordinator=group.is_coordinator) as timing:
        with stage("load: record", target.describe()):
            opened = open_read(target)
        result, timing.nbytes = _load_opened(
            sharded_state_dict, opened, sharded_strategy, common_strategy, validate_access_integrity, strict, group
        )
    return result


def _load_opened(
    sharded_state_dict: ShardedStateDict,
    opened: OpenedCheckpoint,
    sharded_strategy: LoadShardedStrategy | None,
    common_strategy: LoadCommonStrategy | None,
    validate_access_integrity: bool,
    strict: str | StrictHandling,
    group: Group,
) -> tuple[StateDict | tuple[StateDict, set[str], set[str]], int]:
    """``_load`` on an opened checkpoint (``opened.open_read``); also returns the bytes of
    the tensors the sharded strategy loaded.

    The request is walked once (``_LoadRequest``); the parts handed to the strategies
    and the result (the common state with the loaded values put in, then the factories'
    merges) are built from its flat list of leaves."""
    location, record = opened.location, opened.record  # record None: another tool's checkpoint
    sharded_strategy, common_strategy = verify_checkpoint_and_load_strategy(
        opened, sharded_strategy, common_strategy
    )
    strict = parse_strict_flag(strict)
    where = location.describe()
    # A failure on one rank must reach every rank (never leave them waiting in the
    # next collective): the plan stage and the read stage each carry local failures.
    error, common_state_dict, request = None, {}, None
    tensors: list[ShardedTensor] = []
    objects: list[ShardedObject] = []
    try:
        common_state_dict = common_strategy.load_common(location)
        # a plain tensor saved as an array (by the DCP writer; any tensor of another
        # tool's checkpoint, as DCP's own writer saves one) is read into the tensor itself
        arrays = record.arrays if record is not None else sharded_strategy.load_tensors_metadata(location)
        request = _LoadRequest(sharded_state_dict, whole_array_requests(arrays, group.is_coordinator))
        tensors, objects = request.tensors(), request.objects()
    except Exception as exc:  # reported on every rank by gather_and_plan
        error = exc

    def planner(layout: GlobalLayout) -> list[RankLoadPlan]:  # on the coordinator
        saved_keys = _saved_keys(location, record, sharded_strategy, common_strategy)
        return plan_load(layout, saved_keys, strict, validate_access_integrity,
                         functools.partial(plan_load_with_record, sharded_strategy, record=record), where)

    with stage("load: plan", where):
        plan = gather_and_plan(tensors, objects, group, planner, local_error=error, place=where)
    missing_keys, unexpected_keys = set(), set()
    sharded_part: ShardedStateDict = {}
    try:  # a failure here is raised on every rank by the read stage's agreement
        request.drop_keys(plan.unexpected)
        missing_keys, unexpected_keys = reported_mismatches(strict, plan, where)
        if not sharded_strategy.can_handle_sharded_objects:
            validate_sharded_objects_handling(sharded_strategy, common_strategy)
            request.load_objects_apart(lambda part: common_strategy.load_sharded_objects(part, location))
        sharded_part = request.sharded_part()
    except Exception as exc:
        error = exc
    with stage("load: read", where):
        loaded = sharded_strategy.load_with_plan(sharded_part, location, record, plan.reads, group, error)
    try:
        result, nbytes = request.result(common_state_dict, loaded)
    except ValueError as exc:  # dict_utils.nest/merge: a loaded value where the common state holds another
        raise CheckpointingException(
            f"Loading {where}: the state dict's containers do not match the checkpoint's common state ({exc}). "
            "A list of another length than the saved one, or a value where the checkpoint holds a container? "
            f"shardstore.load_common_state_dict({where!r}) shows what was saved"
        ) from exc
    if StrictHandling.requires_returning_mismatch_keys(strict):
        return (result, missing_keys, unexpected_keys), nbytes
    return result, nbytes


class _LoadRequest:
    """A load's request, walked once (``dict_utils.flatten``): DTensors and Megatron-Core's
    objects converted, factories built (remembered with their paths for their merges),
    non-persistent values unwrapped; the request's plain values are dropped (the
    common state comes from the checkpoint).

    Its sharded leaves go to the strategies as nested parts (``dict_utils.nest``, as
    ``extract_matching_values`` builds them); ``result`` puts what they loaded into the
    common state in one loop over the leaves (``nest(into=...)``, with ``merge``'s
    meaning) and applies the factories' merges, each at its path
    (``mapping.apply_factory_merges``' meaning). ``plain``: the converter of plain
    tensors stored as arrays (``inputs.plain_tensors.whole_array_requests``)."""

    def __init__(self, sharded_state_dict: ShardedStateDict, plain: Callable[[tuple, Any], Any] | None = None) -> None:
        self.factories: list[tuple[tuple, ShardedTensorFactory]] = []
        self.root = sharded_state_dict
        # the leaves the result holds, in request order: non-persistent and sharded ones
        self.leaves = [
            leaf for leaf in flatten(sharded_state_dict, _request_visitor(factories=self.factories, plain=plain))
            if not leaf.empty and isinstance(leaf.value, (ShardedBase, LocalNonpersistentObject))
        ]
        self.loaded: dict[int, Any] = {}  # by leaf index: what a strategy loaded
        self.returned: list[StateDict] = []  # what a strategy returned that is not the part it was given
        self._apart: set[int] = set()  # leaves loaded by the common strategy

    def tensors(self) -> list[ShardedTensor]:
        return [leaf.value for leaf in self.leaves if isinstance(leaf.value, ShardedTensor)]

    def objects(self) -> list[ShardedObject]:
        return [leaf.value for leaf in self.leaves if isinstance(leaf.value, ShardedObject)]

    def drop_keys(self, keys: set[str] | frozenset[str]) -> None:
        """Drops the sharded leaves whose key the checkpoint lacks (non-strict loads,
        ``compat.megatron.validation.adjust_non_strict_load``'s meaning), and with them the factories
        that built nothing else: there is nothing to merge, and their place stays as a
        dropped ShardedTensor's does (absent from a dict, None in a list)."""
        if not keys:
            return
        kept = [leaf for leaf in self.leaves if not (isinstance(leaf.value, ShardedBase) and leaf.value.key in keys)]
        if len(kept) == len(self.leaves):
            return
        self.leaves = kept
        held = {leaf.path[:depth] for leaf in kept for depth in range(len(leaf.path) + 1)}
        self.factories = [(path, factory) for path, factory in self.factories if path in held]

    def load_objects_apart(self, load_objects: Callable[[ShardedStateDict], StateDict]) -> None:
        """The ShardedObjects, loaded by the common strategy (``load_objects``)."""
        indices = [i for i, leaf in enumerate(self.leaves) if isinstance(leaf.value, ShardedObject)]
        if indices:
            self._apart = set(indices)
            self._load_part(indices, load_objects)

    def sharded_part(self) -> ShardedStateDict:
        """What the sharded strategy loads (every sharded leaf not loaded apart); what
        it returns is handed to ``read``."""
        indices = [
            i for i, leaf in enumerate(self.leaves) if isinstance(leaf.value, ShardedBase) and i not in self._apart
        ]
        part, slots = nest([self.leaves[i] for i in indices], root=self.root)
        self._pending = (part, indices, slots)
        return part

    def _load_part(self, indices: list[int], load: Callable[[ShardedStateDict], StateDict]) -> None:
        part, slots = nest([self.leaves[i] for i in indices], root=self.root)
        self._collect(load(part), part, indices, slots)

    def _collect(self, loaded: StateDict, part: ShardedStateDict, indices: list[int], slots: list) -> None:
        if loaded is part:  # filled in place (as ours are): each value is in its slot
            for i, (container, key) in zip(indices, slots):
                self.loaded[i] = container[key]
        else:  # merged as Megatron-Core merges it
            self.returned.append(loaded)
            for i in indices:
                self.loaded[i] = None

    def result(self, common_state_dict: StateDict, loaded: StateDict) -> tuple[StateDict, int]:
        """The common state with every loaded value in place and the factories merged;
        and the bytes of the loaded tensors."""
        part, indices, slots = self._pending
        self._collect(loaded, part, indices, slots)
        placed, values = [], []
        for i, leaf in enumerate(self.leaves):
            if isinstance(leaf.value, LocalNonpersistentObject):
                placed.append(leaf)
                values.append(leaf.value.unwrap())
            elif i in self.loaded and (self.loaded[i] is not None or not self.returned):
                placed.append(leaf)
                values.append(self.loaded[i])
        nest(placed, values, into=common_state_dict)
        for returned in self.returned:
            merge(common_state_dict, returned)
        nbytes = sum(v.nbytes for v in values if isinstance(v, torch.Tensor))
        for path, factory in self.factories:
            _merge_factory_at(common_state_dict, path, factory)
        return common_state_dict, nbytes


def _merge_factory_at(state_dict: StateDict, path: tuple, factory: ShardedTensorFactory) -> None:
    """Replaces the value at ``path`` (the factory's place in the request, list indices
    included) by the factory's merge of it, as ``mapping.apply_factory_merges`` does."""
    node = state_dict
    for depth, key in enumerate(path):
        where = "/".join(map(str, path[:depth])) or "<root>"
        if isinstance(node, dict):
            if key not in node:
                raise ValueError(f"Factory merge at {where}: key {key!r} missing from the loaded state dict")
        elif isinstance(node, list):
            if not isinstance(key, int) or not 0 <= key < len(node):
                raise ValueError(f"Factory merge at {where}: invalid list index {key!r}")
        else:
            raise ValueError(f"Factory merge at {where}: cannot merge {type(node).__name__} with dict")
        if depth == len(path) - 1:
            node[key] = factory.merge_fn(node[key])
        else:
            node = node[key]


def load_preprocess(
    sharded_state_dict: ShardedStateDict,
) -> tuple[ShardedStateDict, StateDict, ShardedStateDict]:
    """Converts other libraries' objects, builds factories (remembering them for the
    merge) and unwraps non-persistent values, in one walk of the state dict.

    Returns:
        ``(sharded state dict, non-persistent values, factories)``: the factories as
        ``mapping.apply_factory_merges`` takes them (lists as ``{index: factory}``).
    """
    factories: list[tuple[tuple, ShardedTensorFactory]] = []
    leaves = flatten(sharded_state_dict, _request_visitor(factories=factories))
    kept = [leaf for leaf in leaves if not isinstance(leaf.value, LocalNonpersistentObject)]
    nonpersistent = [leaf for leaf in leaves if isinstance(leaf.value, LocalNonpersistentObject)]
    sharded, _ = nest(kept, root=sharded_state_dict)
    unwrapped, _ = nest(nonpersistent, [leaf.value.unwrap() for leaf in nonpersistent], root=sharded_state_dict)
    by_path: dict = {}
    for path, factory in factories:  # lists as dicts: each factory at its index
        node = by_path
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = factory
    return sharded, unwrapped, by_path


def _saved_keys(
    location: Location, record: CommitRecord | None, sharded_strategy: LoadShardedStrategy,
    common_strategy: LoadCommonStrategy,
) -> set[str]:
    """Every tensor and object key the checkpoint holds."""
    if record is not None:
        return set(record.arrays) | record.object_keys
    found = {**sharded_strategy.load_sharded_metadata(location), **common_strategy.load_sharded_metadata(location)}
    return {item.key for item in found.values()}


def open_checkpoint(checkpoint_dir: CheckpointDir) -> Location:
    """The location to read a checkpoint through (``opened.open_read(...).location``): a
    committed shardstore checkpoint's reads checked against its commit record; another
    tool's read as it is. Prefer ``open_read``, which keeps the record in hand."""
    return open_read(checkpoint_dir).location


def verify_checkpoint_and_load_strategy(
    checkpoint_dir: CheckpointDir | OpenedCheckpoint,
    sharded_strategy: LoadShardedStrategy | tuple[str, int] | None = None,
    common_strategy: LoadCommonStrategy | tuple[str, int] | None = None,
) -> tuple[LoadShardedStrategy, LoadCommonStrategy]:
    """The load strategies for a checkpoint: defaults from its config, or the given ones
    (objects, or ``(backend, version)`` tuples naming registered ones, as Megatron-Core
    takes them) after checking they can read it."""
    sharded_strategy = strategy_by_name(sharded_strategy, StrategyAction.LOAD_SHARDED)
    common_strategy = strategy_by_name(common_strategy, StrategyAction.LOAD_COMMON)
    opened = open_read(checkpoint_dir)
    if opened.other_format is not None:
        return _other_format_sharded_strategy(sharded_strategy), _other_format_common_strategy(common_strategy)
    config = opened.config()
    if config is None:
        raise CheckpointingException(f"{opened.describe()} is not a distributed checkpoint (no metadata.json)")
    sharded_strategy = _resolve_load_strategy(
        sharded_strategy, StrategyAction.LOAD_SHARDED, config.sharded_backend, config.sharded_backend_version
    )
    common_strategy = _resolve_load_strategy(
        common_strategy, StrategyAction.LOAD_COMMON, config.common_backend, config.common_backend_version
    )
    return sharded_strategy, common_strategy


def _other_format_sharded_strategy(strategy: LoadShardedStrategy | None) -> LoadShardedStrategy:
    """The sharded strategy for another tool's checkpoint: ``strategy``, except that
    shardstore's own (``ZarrLoadShardedStrategy``; ``TorchDistLoadShardedStrategy``, the
    name code written for Megatron-Core gives it), alone or in a wrapper, reads
    committed checkpoints only, and becomes ``OtherFormatLoadShardedStrategy`` with its
    ``allow_lossy_casts``."""
    own = strategy.base_strategy if isinstance(strategy, DelegatingLoadStrategy) else strategy
    if strategy is None:
        return OtherFormatLoadShardedStrategy()
    if isinstance(own, ZarrLoadShardedStrategy):
        return OtherFormatLoadShardedStrategy(own.allow_lossy_casts)
    return strategy


def _other_format_common_strategy(strategy: LoadCommonStrategy | None) -> LoadCommonStrategy:
    """The common strategy for another tool's checkpoint: ``strategy``, except that
    shardstore's own ``TorchCommonLoadStrategy`` (which reads a commit record's files),
    the opt-in that a refused pickle names, becomes ``OtherFormatLoadCommonStrategy``
    with the same ``allow_unsafe_pickle``."""
    if strategy is None:
        return OtherFormatLoadCommonStrategy()
    if type(strategy) is TorchCommonLoadStrategy:
        return OtherFormatLoadCommonStrategy(strategy.allow_unsafe_pickle)
    return strategy


def _resolve_load_strategy(strategy: Any, action: StrategyAction, backend: str, version: int) -> Any:
    """The registered default for the checkpoint's backend, or ``strategy`` once it has
    confirmed it can read that backend and version."""
    if strategy is None:
        return get_default_strategy(action, backend, version)
    strategy.check_backend_compatibility(backend)
    strategy.check_version_compatibility(version)
    return strategy


def get_default_load_sharded_strategy(checkpoint_dir: CheckpointDir) -> LoadShardedStrategy:
    """The default load strategy for the checkpoint's sharded backend."""
    return verify_checkpoint_and_load_strategy(checkpoint_dir)[0]


def load_common_state_dict(
    checkpoint_dir: CheckpointDir, common_strategy: LoadCommonStrategy | None = None
) -> StateDict:
    """The common (non-sharded) state of a committed checkpoint."""
    opened = open_read(checkpoint_dir)
    _, common_strategy = verify_checkpoint_and_load_strategy(opened, None, common_strategy)
    return common_strategy.load_common(opened.location)


def load_content_metadata(
    checkpoint_dir: CheckpointDir | None = None, *, preloaded_state_dict: StateDict | None = None
) -> dict | None:
    """The ``content_metadata`` given to ``save``, or None if it had none.

    Args:
        checkpoint_dir: the checkpoint to read it from, or
        preloaded_state_dict: an already loaded state dict (no storage access).
    """
    if preloaded_state_dict is None:
        if checkpoint_dir is None:
            raise ValueError("Pass checkpoint_dir or preloaded_state_dict")
        preloaded_state_dict = load_common_state_dict(checkpoint_dir)
    return preloaded_state_dict.get(CONTENT_METADATA_KEY)


def load_tensors_metadata(
    checkpoint_dir: CheckpointDir, sharded_strategy: LoadShardedStrategy | None = None
) -> CommonStateDict:
    """Every tensor's global shape and dtype, from the commit record alone.

    A tensor saved from flattened ranges (the distributed optimizer's) is described as
    Megatron-Core describes it: a flattened ShardedTensor whose range is all of its
    elements (``local_shape`` and ``global_shape`` the N-D shape), which loads as the
    1-D tensor.

    Returns:
        ``{key: ShardedTensor without data covering the whole tensor}``
    """
    opened = open_read(checkpoint_dir)
    sharded_strategy, _ = verify_checkpoint_and_load_strategy(opened, sharded_strategy)
    return sharded_strategy.load_tensors_metadata(opened.location)


def load_sharded_metadata(
    checkpoint_dir: CheckpointDir,
    sharded_strategy: LoadShardedStrategy | None = None,
    common_strategy: LoadCommonStrategy | None = None,
) -> CommonStateDict:
    """Data-less ShardedTensors and ShardedObjects of the checkpoint.

    Returns:
        ``{sharded key: ShardedTensor or ShardedObject}`` (tensors by key, object shards
        by their unique key).
    """
    opened = open_read(checkpoint_dir)
    sharded_strategy, common_strategy = verify_checkpoint_and_load_strategy(opened, sharded_strategy, common_strategy)
    metadata = sharded_strategy.load_sharded_metadata(opened.location)
    if not sharded_strategy.can_handle_sharded_objects:
        metadata.update(common_strategy.load_sharded_metadata(opened.location))
    return metadata


def load_plain_tensors(checkpoint_dir: CheckpointDir) -> StateDict:
    """Every tensor of the checkpoint, whole, as plain tensors, each in its N-D global
    shape (also one saved from flattened ranges, which Megatron-Core returns 1-D).

    Not collective: any one process may call it, also one rank of a running job.
    """
    opened = open_read(checkpoint_dir)
    sharded_state_dict = {
        key: replace(t, flattened_range=None) if t.flattened_range is not None else t
        for key, t in load_tensors_metadata(opened).items()
    }
    return _load(sharded_state_dict, opened, None, None, False, StrictHandling.ASSUME_OK_UNEXPECTED, Group.local())


def remove_sharded_tensors(checkpoint_dir: CheckpointDir, key_prefix: str) -> None:
    """Removes every tensor whose key starts with ``key_prefix``, and every ShardedObject
    shard whose unique key does, as Megatron-Core's torch_dist does (call on one process)."""
    opened = open_read(checkpoint_dir)
    sharded_strategy = get_default_load_sharded_strategy(opened)
    sharded_strategy.remove_sharded_tensors(opened.location, key_prefix)
