"""The load every door runs (Megatron-Core's ``dist_checkpointing.serialization`` names,
which ``compat.megatron.serialization`` offers): ``load`` and its checks (``verify_before_load``), the strategy a checkpoint is read with
(``verify_checkpoint_and_load_strategy``), and what can be read without loading tensors
(``load_common_state_dict``, ``load_tensors_metadata``, ``load_sharded_metadata``,
``load_plain_tensors``, ``load_content_metadata``), and ``remove_sharded_tensors``.
Load, in stages:

    collective   record      the commit record is read first (the coordinator reads it and
                             the common files, every rank receives them: opened.
                             open_read_together), so an incomplete checkpoint
                             is refused before anything else happens; every file is read
                             through it
    all ranks    preprocess  common state read, factories built, the request collected
    collective   plan        the requests go to the coordinator, which applies strict,
                             checks access integrity and plans who reads what
                             (load_strictness.plan_load); each rank receives only its part
    collective   read        each rank reads its part, agree, exchange of replicated
                             blocks (read_planned, by the sharded strategy's
                             LoadSettings, read once when the load starts:
                             execution.load.run_read_plan; a strategy of another
                             library, with no settings, reads through its
                             load_with_plan)
"""

from __future__ import annotations

__all__ = [
    "LoadSettings", "get_default_load_sharded_strategy", "load", "load_common_state_dict", "load_content_metadata",
    "load_plain_tensors", "load_preprocess", "load_sharded_metadata", "load_tensors_metadata", "read_planned",
    "remove_sharded_tensors", "verify_before_load", "verify_checkpoint_and_load_strategy",
]

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from shardstore.dict_utils import flatten, merge, nest
from shardstore.engine.common_state import TorchCommonLoadStrategy
from shardstore.engine.other_formats import (
    OtherFormatLoadCommonStrategy,
    OtherFormatLoadShardedStrategy,
)
from shardstore.engine.strategies import (
    DelegatingLoadStrategy,
    LoadCommonStrategy,
    LoadShardedStrategy,
    StrategyAction,
    get_default_strategy,
    plan_load_with_record,
    strategy_by_name,
    validate_sharded_objects_handling,
)
from shardstore.engine.walk import (
    CONTENT_METADATA_KEY,
    CheckpointDir,
    group_of,
    open_dir,
    request_visitor,
)
from shardstore.errors import CheckpointingException
from shardstore.execution.load import run_read_plan
from shardstore.execution.staging import DeviceUploader
from shardstore.format.integrity import verify
from shardstore.format.records import CommitRecord
from shardstore.gc_pause import gc_paused
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
from shardstore.opened import OpenedCheckpoint, bare_location, open_read_together
from shardstore.planning.layout import GatheredShards
from shardstore.planning.plans import RankLoadPlan, RankReadPlan
from shardstore.progress import operation, progress_shown, stage
from shardstore.protocol.collectives import Group
from shardstore.protocol.plan_stage import gather_and_plan
from shardstore.protocol.stage import run_stage
from shardstore.stores.base import Location
from shardstore.utils import sharded_tensor_slots

logger = logging.getLogger(__name__)


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
    group = group_of(process_group, sharded_strategy)
    target = checkpoint_dir if isinstance(checkpoint_dir, OpenedCheckpoint) else bare_location(checkpoint_dir)
    with progress_shown(progress and group.is_coordinator):
        return _load(
            sharded_state_dict, target, sharded_strategy, common_strategy, validate_access_integrity, strict,
            group,
        )


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
            opened = open_read_together(target, group)
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
    settings = _load_settings(sharded_strategy)  # read once
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

    def planner(layout: GatheredShards) -> list[RankLoadPlan]:  # on the coordinator
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
        if settings is not None:  # shardstore's own, alone or wrapped: read by the settings read at the start
            loaded = read_planned(sharded_part, location, record, plan.reads, group, settings, error)
        else:
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


@dataclass(frozen=True)
class LoadSettings:
    """How shardstore's storage strategy reads a load, read once when the load starts
    (``ZarrLoadShardedStrategy.load_settings``; each option at length there).

    Attributes:
        io_concurrency: TensorStore I/O operations in flight at once.
        allow_lossy_casts: convert to the requested dtype even where that can change values.
        uploader: the pinned host memory a load into CUDA tensors goes through (the
            strategy's, shared by its loads).
    """

    io_concurrency: int
    allow_lossy_casts: bool
    uploader: DeviceUploader = field(compare=False)


def read_planned(
    sharded_state_dict: ShardedStateDict, location: Location, record: CommitRecord, plan: RankReadPlan,
    group: Group, settings: LoadSettings, local_error: BaseException | None = None,
) -> StateDict:
    """Collective: reads this rank's part of a load's ``plan`` by ``settings``
    (``execution.load.run_read_plan``) and puts the tensors in place of the request's
    ShardedTensors. A read that fails on one rank raises the same error, naming the
    checkpoint, key and chunk, on every rank; so does ``local_error``, this rank's
    failure before."""
    tensors, slots = sharded_tensor_slots(sharded_state_dict)
    results = run_read_plan(tensors, location, record, plan, group, settings.io_concurrency,
                            settings.allow_lossy_casts, local_error, settings.uploader)
    for (container, key), tensor in zip(slots, results):
        container[key] = tensor
    return sharded_state_dict


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
            leaf for leaf in flatten(sharded_state_dict, request_visitor(factories=self.factories, plain=plain))
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
    leaves = flatten(sharded_state_dict, request_visitor(factories=factories))
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
    opened = open_dir(checkpoint_dir)
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


def _load_settings(strategy: Any) -> LoadSettings | None:
    """``strategy``'s ``load_settings``: shardstore's own, alone or wrapped, has them;
    None for a strategy that reads its own way (another library's, or one without our
    interface)."""
    if isinstance(strategy, (LoadShardedStrategy, DelegatingLoadStrategy)):
        return strategy.load_settings
    return None


def _other_format_sharded_strategy(strategy: LoadShardedStrategy | None) -> LoadShardedStrategy:
    """The sharded strategy for another tool's checkpoint: ``strategy``, except that
    shardstore's own (``ZarrLoadShardedStrategy``; ``TorchDistLoadShardedStrategy``, the
    name code written for Megatron-Core gives it), alone or in a wrapper, reads
    committed checkpoints only, and becomes ``OtherFormatLoadShardedStrategy`` with its
    ``allow_lossy_casts``."""
    if strategy is None:
        return OtherFormatLoadShardedStrategy()
    settings = _load_settings(strategy)
    if settings is not None:  # shardstore's own, alone or wrapped
        return OtherFormatLoadShardedStrategy(settings.allow_lossy_casts)
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
    opened = open_dir(checkpoint_dir)
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
    opened = open_dir(checkpoint_dir)
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
    opened = open_dir(checkpoint_dir)
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
    opened = open_dir(checkpoint_dir)
    sharded_state_dict = {
        key: replace(t, flattened_range=None) if t.flattened_range is not None else t
        for key, t in load_tensors_metadata(opened).items()
    }
    return _load(sharded_state_dict, opened, None, None, False, StrictHandling.ASSUME_OK_UNEXPECTED, Group.local())


def remove_sharded_tensors(checkpoint_dir: CheckpointDir, key_prefix: str) -> None:
    """Removes every tensor whose key starts with ``key_prefix``, and every ShardedObject
    shard whose unique key does, as Megatron-Core's torch_dist does (call on one process)."""
    opened = open_dir(checkpoint_dir)
    sharded_strategy = get_default_load_sharded_strategy(opened)
    sharded_strategy.remove_sharded_tensors(opened.location, key_prefix)
