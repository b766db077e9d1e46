"""The save every door runs: ``save`` of a sharded state dict, under the name and meaning
of Megatron-Core's ``dist_checkpointing.serialization.save`` (``compat.megatron.
serialization`` offers it by that name, ``shardstore.save`` too). ``engine.load`` is the
load.

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
    collective   sharded     sharded_writes, by the sharded strategy's SaveSettings, read
                             once when the save starts (its stages in execution.save):
                             stage, write, gather the chunk checksums to the
                             coordinator, which commits (the root zarr.json, written
                             last) and publishes; a strategy of another library (no
                             settings) writes through its own save_into

A failure on any rank at any stage raises a CheckpointingException on every rank, the
coordinator deletes what the save wrote, and whatever was committed at the target
before stays.
"""

from __future__ import annotations

__all__ = [
    "SaveSettings", "get_default_save_common_strategy", "get_default_save_sharded_strategy", "save",
    "save_preprocess", "sharded_writes",
]

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch.distributed as dist

from shardstore.dict_utils import Leaf, flatten, nest, with_list_places
from shardstore.engine.async_requests import AsyncRequest
from shardstore.engine.strategies import (
    AsyncSaveShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    get_default_strategy,
    strategy_by_name,
    validate_sharded_objects_handling,
)
from shardstore.engine.walk import (
    CONTENT_METADATA_KEY,
    CheckpointDir,
    group_of,
    request_visitor,
)
from shardstore.errors import CheckpointingException
from shardstore.execution.pipeline import SaveFinalization, SavePipeline
from shardstore.execution.save import Staging
from shardstore.execution.staging import HostBufferPool
from shardstore.format.commit import SaveOptions
from shardstore.format.config import CheckpointingConfig
from shardstore.format.pickles import serialize
from shardstore.format.storage_layout import StorageLayout
from shardstore.gc_pause import gc_paused
from shardstore.inputs.dtensors import clashing_names
from shardstore.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    StateDict,
)
from shardstore.opened import bare_location
from shardstore.planning.plans import RankSavePlan
from shardstore.progress import StageTiming, operation, progress_shown, stage
from shardstore.protocol.collectives import Group, PeerLost
from shardstore.protocol.common_state import common_state_digests
from shardstore.stores.base import Location
from shardstore.utils import (
    _clean_metadata_for_serialization,
    sharded_values_in_common,
)

logger = logging.getLogger(__name__)


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
    group = group_of(process_group, sharded_strategy)
    if async_sharded_save and not isinstance(sharded_strategy, AsyncSaveShardedStrategy):
        raise CheckpointingException(f"Cannot save asynchronously with {sharded_strategy}: not an async strategy")
    config = CheckpointingConfig(
        sharded_strategy.backend, sharded_strategy.version, common_strategy.backend, common_strategy.version
    )
    settings = sharded_strategy.save_settings  # read once: None for another library's strategy
    options = SaveOptions.resolve(options, SaveOptions(overwrite, reuse_from, shared_directory, layout))
    pipeline = SavePipeline.open(
        bare_location(checkpoint_dir), group, _with_strategy_layout(options, sharded_strategy), config=config
    )

    where = pipeline.describe()
    with progress_shown(progress and group.is_coordinator), operation("save", where, coordinator=group.is_coordinator) as timing:
        with stage("save: plan", where):
            sharded_part, common_part, objects_part, plan = _preprocess_and_plan(
                sharded_state_dict, pipeline, sharded_strategy, preprocess_common_before_consistancy_check
            )
        timing.nbytes = getattr(plan, "checkpoint_nbytes", 0)
        timing.detail = f"layout: {pipeline.pending.intent.layout.describe()}"
        try:
            if not sharded_strategy.can_handle_sharded_objects:
                validate_sharded_objects_handling(sharded_strategy, common_strategy)
            with stage("save: common", where):
                error = _save_common(pipeline.location, group, common_strategy, common_part, objects_part)
            request = _sharded(sharded_strategy, settings, sharded_part, pipeline, plan, error, async_sharded_save)
            if async_sharded_save:
                timing.defer()
                # a local step: runs only once the save committed (a partial: the request may be pickled)
                request.add_finalize_fn(functools.partial(_finish_timing, timing, pipeline))
                return request
            timing.shared = _shared_bytes(pipeline)
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


@dataclass(frozen=True)
class SaveSettings:
    """How shardstore's storage strategy stages and writes a save, read once when the
    save starts (``ZarrSaveShardedStrategy.save_settings``; each option at length there).

    Attributes:
        io_concurrency: I/O operations in flight at once per rank.
        max_staging_bytes: async saves: the most host memory a rank's snapshot holds.
        sync_staging_bytes: sync saves: the most host memory copies of CUDA tensors hold.
        background_io_threads: async saves: threads writing local chunks.
        snapshot_buffers, copy_buffers: the pinned host buffers kept for the next
            save's snapshots and sync copies (the strategy's, shared by its saves).
    """

    io_concurrency: int
    max_staging_bytes: int | None
    sync_staging_bytes: int
    background_io_threads: int
    snapshot_buffers: HostBufferPool = field(compare=False)
    copy_buffers: HostBufferPool = field(compare=False)

    def staging(self, snapshot: bool) -> Staging:
        """The host copies of an async save (``snapshot``: every tensor copied, within
        ``max_staging_bytes``) or of a sync one (CUDA tensors only, within
        ``sync_staging_bytes``)."""
        if snapshot:
            return Staging(True, self.max_staging_bytes, self.snapshot_buffers, self.io_concurrency,
                           self.background_io_threads)
        return Staging(False, self.sync_staging_bytes, self.copy_buffers, self.io_concurrency)


def sharded_writes(
    pipeline: SavePipeline, tensors: list[ShardedTensor], plan: RankSavePlan, settings: SaveSettings,
    local_error: BaseException | None = None, snapshot: bool = False,
) -> AsyncRequest:
    """Collective: this rank's part of ``plan`` staged (``SavePipeline.stage``: host copies,
    the exchange of gathered blocks; ``local_error``, this rank's failure before, fails
    every rank), and the request whose ``async_fn`` writes it into ``pipeline``'s save and
    whose finalization commits (``SaveFinalization``). ``snapshot``: an async save, whose
    caller may change its tensors once this returns."""
    staging = settings.staging(snapshot)
    pipeline.stage(tensors, plan, staging, local_error)
    return AsyncRequest(
        async_fn=SavePipeline.write_staged,
        async_fn_args=(pipeline, settings.io_concurrency, staging.io_threads),
        finalize_fns=[SaveFinalization(pipeline)],
    )


def _sharded(
    strategy: SaveShardedStrategy, settings: SaveSettings | None, sharded_part: ShardedStateDict,
    pipeline: SavePipeline, plan: Any, error: BaseException | None, snapshot: bool,
) -> AsyncRequest | None:
    """The sharded part's stage, write and commit: by ``settings`` (shardstore's
    strategy, alone or wrapped: ``sharded_writes`` of the tensors the plan numbers), a
    sync save written and committed before this returns; else through ``strategy``'s
    ``save_into``/``async_save_into``. Returns the async save's request."""
    if settings is not None:
        tensors = pipeline.planned_tensors
        if tensors is None:
            raise CheckpointingException(f"Internal error: the save into {pipeline.describe()} was not planned")
        request = sharded_writes(pipeline, tensors, plan, settings, error, snapshot)
        if snapshot:
            return request
        request.execute_sync()
        return None
    if snapshot:
        return strategy.async_save_into(sharded_part, pipeline, plan, error)  # type: ignore[attr-defined]
    strategy.save_into(sharded_part, pipeline, plan, error)
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
    timing.finish(shared=_shared_bytes(pipeline))


def _shared_bytes(pipeline: SavePipeline) -> int:
    """Coordinator, once the save committed: the stored bytes it shared with its reuse
    base instead of writing them (``CommitRecord.reused_from``); 0 on the other ranks and
    for a save that shared nothing."""
    committed = pipeline.pending.committed
    return committed.reused_from.nbytes if committed is not None and committed.reused_from is not None else 0


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
        leaves = flatten(sharded_state_dict, request_visitor(foreign_in_common=foreign))
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
        tensors, objects, sharded_strategy.plan_save, plan_cache=sharded_strategy.plan_cache,
        plan_settings=sharded_strategy.plan_settings, local_error=error,
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
