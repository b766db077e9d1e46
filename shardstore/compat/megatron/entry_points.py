"""shardstore behind Megatron-Core's own ``dist_checkpointing`` entry points, any version.

From Megatron-Core 0.17 on, ``dist_checkpointing.save`` replaces every sharded strategy
that is not its own torch_dist one, silently, and 0.19 removed the strategy base
classes, so a strategy plug-in (``shardstore.tools.megatron_strategy``) reaches only
Megatron-Core <= 0.16. Megatron-LM's training loop calls the module's functions by
attribute (``dist_checkpointing.save(...)``, ``dist_checkpointing.load(...)``, ...), so
one call before training makes every current Megatron-LM write and read shardstore
checkpoints:

```python
import shardstore.megatron
shardstore.megatron.install()       # e.g. at the top of pretrain_gpt.py
```

``install`` replaces these module attributes of ``megatron.core.dist_checkpointing`` (and
the same names in its ``serialization`` and ``core`` modules, where they exist):
``ENTRY_POINTS``. What they do then:

- ``save`` writes a shardstore checkpoint through ``shardstore.save``, staged and
  published atomically (a committed checkpoint at the same path is replaced, as
  Megatron's save overwrites); Megatron's strategy objects count as far as they mean
  something to shardstore (``strategy_for_save``), ``async_sharded_save=True`` returns
  the request of Megatron's queue, a save into ``.../iter_<N>`` reuses unchanged
  chunks of the newest older one, and from 32 ranks on arrays of small blocks are
  stored in shards of about 64 MiB (``install(shard_bytes=...)``; ``save`` says each).
- ``load`` and the queries read a shardstore checkpoint through shardstore (Megatron's
  load strategies become shardstore's; ``verify_integrity=True`` verifies every chunk
  and file of the checkpoint on the coordinator before loading), and anything else
  (Megatron's own torch_dist checkpoints, a missing directory) through the Megatron
  function that was installed before, unchanged.
- ``check_is_distributed_checkpoint`` is true for a committed shardstore checkpoint and
  for whatever Megatron's says.
- Megatron-Core's registry of default strategies names shardstore's load strategy for
  the ``shardstore`` backend: Megatron-LM asks ``get_default_load_sharded_strategy`` (a
  name bound by import, which ``install`` cannot replace) for the checkpoint's strategy
  before it loads.

``uninstall`` puts the original functions back. Code that bound a name before
``install`` (``from megatron.core.dist_checkpointing import save``) keeps Megatron's:
install first. The Megatron-Core versions this runs with, and how Megatron-LM's
training loop calls these functions: docs/guide/megatron.md, "Which versions".
"""

from __future__ import annotations

__all__ = [
    "ENTRY_POINTS",
    "check_is_distributed_checkpoint",
    "install",
    "is_installed",
    "load",
    "load_content_metadata_entry",
    "previous_checkpoint",
    "save",
    "strategy_for_save",
    "uninstall",
]

import functools
import importlib
import inspect
import logging
import re
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from shardstore.compat.megatron.strategies.forked_writes import for_another_process
from shardstore.engine.load import load as _shardstore_load
from shardstore.engine.load import (
    load_common_state_dict,
    load_content_metadata,
    load_plain_tensors,
    load_sharded_metadata,
    load_tensors_metadata,
    remove_sharded_tensors,
    verify_before_load,
)
from shardstore.engine.save import save as _shardstore_save
from shardstore.engine.zarr_strategies import (
    SHARDSTORE_BACKEND,
    ZARR_VERSION,
    ShardBytes,
    ZarrLoadShardedStrategy,
    ZarrSaveShardedStrategy,
)
from shardstore.errors import CheckpointingException
from shardstore.format import SaveOptions, StorageLayout, is_committed, read_commit_record
from shardstore.load_strictness import StrictHandling
from shardstore.opened import bare_location
from shardstore.progress import info_on_first_rank, log_once, operations_logged_at

logger = logging.getLogger(__name__)
T = TypeVar("T")

# The functions ``install`` replaces, by their names in Megatron-Core.
ENTRY_POINTS = (
    "save",
    "load",
    "load_common_state_dict",
    "load_tensors_metadata",
    "load_sharded_metadata",
    "load_plain_tensors",
    "load_content_metadata",
    "remove_sharded_tensors",
    "check_is_distributed_checkpoint",
)
# Where Megatron-Core binds them: the package re-exports serialization's and core's.
_MODULES = (
    "megatron.core.dist_checkpointing",
    "megatron.core.dist_checkpointing.serialization",
    "megatron.core.dist_checkpointing.core",
)
# Megatron-Core's registry of default strategies, and where install() adds ours in it.
_MEGATRON_REGISTRY = "megatron.core.dist_checkpointing.strategies.base"
_REGISTERED_AS = ("load_sharded", (SHARDSTORE_BACKEND, ZARR_VERSION))
# A Megatron-LM checkpoint directory: ``<save>/iter_0001000``.
_ITERATION_DIR = re.compile(r"iter_(\d+)")


@dataclass(frozen=True)
class _Installation:
    """What ``install`` replaced (``(module, name) -> the function there before``) and
    registered (``registered``: the load strategy put in Megatron's registry, or None),
    and how the installed functions behave."""

    originals: dict[tuple[str, str], Any]
    reuse_previous: bool
    layout: StorageLayout = StorageLayout()  # the saves': the strategies built here carry its sizes
    registered: Any = None


_lock = threading.Lock()
_installation: _Installation | None = None
# The attribute of Megatron's strategy object that holds ours, kept as long as Megatron-LM
# keeps its object (it caches the save strategy across saves: a cached plan must survive
# between them).
_OURS = "_shardstore_strategy"


# ------------------------------------------------------------------ install / uninstall


def install(
    *, reuse_previous: bool = True, zarr_metadata: str | None = None, shard_bytes: ShardBytes = "auto",
    pack_arrays_up_to: int | None = None, layout: StorageLayout | None = None,
) -> None:
    """Makes ``megatron.core.dist_checkpointing``'s entry points (``ENTRY_POINTS``) save
    and load shardstore checkpoints (module docstring). Idempotent: a second call only
    changes ``reuse_previous`` and the layout.

    Args:
        reuse_previous: a save into a local ``.../iter_<N>`` directory that names no
            ``reuse_from`` shares unchanged chunks with the newest older committed
            ``iter_<M>`` beside it (an incremental save; each checkpoint stands alone).
        layout: where the saves put their bytes (``StorageLayout``; ``"auto"`` fields
            chosen per save); the three keywords below are spellings of its fields,
            folded in by ``StorageLayout.of``.
        zarr_metadata: where the saves put the arrays' Zarr metadata documents, as
            ``SaveOptions.zarr_metadata`` says (``"consolidated_only"``: only in the
            root's consolidated metadata, a file fewer per array).
        shard_bytes: the saves' ``ZarrSaveShardedStrategy(shard_bytes=...)``, for every
            strategy Megatron's code passes except shardstore's own (which keeps its
            own): ``"auto"`` shards arrays of small blocks (the layer x TP blocks, the
            distributed optimizer's fragments) into files of about 64 MiB from 32 ranks
            on, None never shards, a number of bytes always does (feature
            ``sharding_indexed`` when an array is sharded).
        pack_arrays_up_to: the saves pack each array of at most this many bytes that
            one rank writes whole (replicated ones, such as layer norms, by their one
            writer; column-parallel ones, gathered whole to one rank) into that rank's zip, ``packs/<rank>-<n>.zip``, as
            ``SaveOptions.pack_arrays_up_to`` says (feature ``packs``); 0: no packing. Packed arrays are never shared by the incremental saves
            (``reuse_previous``): they are written anew each time.

    Raises:
        ImportError: megatron-core is not installed.
        ValueError: a layout field out of range, or a keyword contradicting ``layout``,
            naming the field.
    """
    global _installation
    # unknown, out-of-range or contradicting values are refused here, not at the first save
    layout = StorageLayout.of(layout, shard_bytes=shard_bytes, zarr_metadata=zarr_metadata,
                              pack_arrays_up_to=pack_arrays_up_to)
    modules = _megatron_modules()
    with _lock:
        if _installation is not None:
            _installation = replace(_installation, reuse_previous=reuse_previous, layout=layout)
            return
        originals = {
            (module.__name__, name): getattr(module, name)
            for module in modules
            for name in ENTRY_POINTS
            if hasattr(module, name)
        }
        _installation = _Installation(originals, reuse_previous, layout, _register_load_strategy())
        for (module_name, name), _ in originals.items():
            setattr(importlib.import_module(module_name), name, _REPLACEMENTS[name])
    logger.log(info_on_first_rank(), "shardstore installed behind %s", ", ".join(m.__name__ for m in modules))


def uninstall() -> None:
    """Puts Megatron-Core's own functions back where ``install`` replaced them (an
    attribute someone else replaced since is left as it is, with a warning). Does
    nothing when not installed."""
    global _installation
    with _lock:
        if _installation is None:
            return
        for (module_name, name), original in _installation.originals.items():
            module = importlib.import_module(module_name)
            if getattr(module, name) is _REPLACEMENTS[name]:
                setattr(module, name, original)
            else:
                logger.warning(
                    "%s.%s was replaced by someone else since install(); left as it is",
                    module_name,
                    name,
                )
        _unregister_load_strategy(_installation.registered)
        _installation = None


def is_installed() -> bool:
    """Whether ``install`` is in effect."""
    return _installation is not None


def _megatrons_registry() -> dict[tuple[str, int], Any] | None:
    """Megatron-Core's default strategies of the kind ``_REGISTERED_AS`` names, by
    ``(backend, version)``; None where this version keeps no registry."""
    try:
        registry = getattr(importlib.import_module(_MEGATRON_REGISTRY), "default_strategies", None)
    except ImportError:
        return None
    return None if registry is None else registry[_REGISTERED_AS[0]]


def _register_load_strategy() -> ZarrLoadShardedStrategy | None:
    """Makes shardstore's load strategy Megatron-Core's default for checkpoints of the
    ``shardstore`` backend, where none is registered: Megatron-LM gets a checkpoint's
    strategy from ``get_default_load_sharded_strategy(checkpoint)`` before loading (a
    name bound by import: ``install`` cannot replace it) and hands it, maybe wrapped,
    to ``load``, which finds it (``_strategy_for_load``). Returns what it registered."""
    registry = _megatrons_registry()
    if registry is None or _REGISTERED_AS[1] in registry:
        return None
    registry[_REGISTERED_AS[1]] = ours = ZarrLoadShardedStrategy()
    return ours


def _unregister_load_strategy(registered: ZarrLoadShardedStrategy | None) -> None:
    """Takes ``_register_load_strategy``'s entry back out of Megatron's registry, where
    it is still the one registered."""
    registry = _megatrons_registry()
    if registered is not None and registry is not None and registry.get(_REGISTERED_AS[1]) is registered:
        del registry[_REGISTERED_AS[1]]


def _megatron_modules() -> list[Any]:
    try:
        return [importlib.import_module(name) for name in _MODULES if _importable(name)]
    except ImportError as exc:
        raise ImportError(
            "shardstore.megatron.install() puts shardstore behind megatron.core.dist_checkpointing and needs "
            "megatron-core (pip install megatron-core); shardstore.save/load work without it"
        ) from exc


def _importable(name: str) -> bool:
    """Whether module ``name`` exists; the package itself must (ImportError otherwise)."""
    if name == _MODULES[0]:
        return True
    try:
        importlib.import_module(name)
    except ModuleNotFoundError:
        return False
    return True


def _original(name: str) -> Any:
    """Megatron's own ``name`` as ``install`` found it (on the package, or where the
    package does not re-export it, in ``serialization`` or ``core``)."""
    installation = _installation
    if installation is None:
        raise CheckpointingException(
            f"shardstore.megatron.{name} was called while not installed; call shardstore.megatron.install() first"
        )
    for module_name in _MODULES:
        if (module_name, name) in installation.originals:
            return installation.originals[(module_name, name)]
    raise CheckpointingException(f"This megatron-core has no dist_checkpointing.{name} to fall back on")


# ------------------------------------------------------------------ strategies


def strategy_for_save(strategy: Any) -> ZarrSaveShardedStrategy:
    """shardstore's save strategy for what Megatron's code passed as ``sharded_strategy``:
    ours as it is (also inside the plug-in, a fully-parallel wrapper, or both: found by
    following ``base_strategy``), Megatron's
    fully-parallel wrapper as our fully-parallel plan (its ``do_cache_distribution`` as
    our cached plan), anything else (Megatron's torch_dist strategy, a ``(backend,
    version)`` tuple, None) as our default; one object per Megatron strategy object, so
    that a cached plan carries over between saves. A strategy built here leaves its
    layout to the save's options (``_save_layout``); ours keeps its own."""
    inner = _wrapped(strategy, ZarrSaveShardedStrategy)
    if inner is not None:  # ours, or the plug-in's as its caller made it, however wrapped
        return inner
    return _built_for(strategy)


def _wrapped(strategy: Any, kind: type[T]) -> T | None:
    """The strategy of ``kind`` that ``strategy`` is or wraps, following ``base_strategy``
    down any number of wrappers (Megatron's fully-parallel wrapper around the plug-in,
    which wraps ours), or None. A cycle of wrappers ends the search."""
    seen: set[int] = set()
    while strategy is not None and id(strategy) not in seen:
        if isinstance(strategy, kind):
            return strategy
        seen.add(id(strategy))
        strategy = getattr(strategy, "base_strategy", None)
    return None


def _built_for(strategy: Any) -> ZarrSaveShardedStrategy:
    """Our strategy for Megatron's ``strategy`` (not ours): a new default for None or a
    tuple, else the one kept on that object (made on first sight)."""
    if strategy is None or isinstance(strategy, tuple):
        return ZarrSaveShardedStrategy()
    kept = getattr(strategy, _OURS, None)
    if isinstance(kept, ZarrSaveShardedStrategy):
        return kept
    ours = ZarrSaveShardedStrategy()
    if hasattr(strategy, "parallelization_group"):  # FullyParallelSaveStrategyWrapper
        ours.cache_plan = bool(getattr(strategy, "do_cache_distribution", False))
    log_once(
        logger,
        f"Megatron's {type(strategy).__name__} is saved with shardstore's strategy (fully parallel over the "
        "save group; its own options do not apply)",
    )
    try:
        setattr(strategy, _OURS, ours)
    except (AttributeError, TypeError):  # takes no attributes (slots): a new one each time
        pass
    return ours


def _strategy_for_load(strategy: Any) -> ZarrLoadShardedStrategy | None:
    """shardstore's load strategy for Megatron's ``sharded_strategy``: ours as it is
    (however wrapped: ``_wrapped``), or None (shardstore's default from the checkpoint's
    config: fully parallel)."""
    ours = _wrapped(strategy, ZarrLoadShardedStrategy)
    if ours is not None:
        return ours
    if strategy is not None and not isinstance(strategy, tuple):
        log_once(logger, f"Megatron's {type(strategy).__name__} loads with shardstore's strategy (fully parallel)")
    return None


# ------------------------------------------------------------------ errors in Megatron's terms


_MEGATRONS_EXCEPTION = "MegatronCheckpointingException"


@functools.lru_cache(maxsize=1)
def _megatrons_exception() -> type[Exception] | None:
    """shardstore's CheckpointingException that is also Megatron-Core's own (Megatron-LM
    code catches ``megatron.core.dist_checkpointing.core.CheckpointingException``; a
    class's bases cannot be changed to it, as the layouts differ); None without
    megatron-core. It is this module's ``MegatronCheckpointingException``, by that name:
    ``pickle`` finds a class by module and qualified name, so an error raised through
    the installed functions crosses a process boundary (``__getattr__`` makes it in a
    process that has not made it yet)."""
    try:
        theirs = importlib.import_module("megatron.core.dist_checkpointing.core").CheckpointingException
    except ImportError:
        return None
    made = type(_MEGATRONS_EXCEPTION, (CheckpointingException, theirs),
                {"__module__": __name__, "__qualname__": _MEGATRONS_EXCEPTION, "__doc__": (
                    "A shardstore error raised through Megatron-Core's entry points: shardstore's "
                    "CheckpointingException and Megatron-Core's at once.")})
    globals()[_MEGATRONS_EXCEPTION] = made
    return made


def __getattr__(name: str) -> Any:
    """``MegatronCheckpointingException``, made on first use (megatron-core imported then,
    not when this module is)."""
    if name == _MEGATRONS_EXCEPTION:
        made = _megatrons_exception()
        if made is not None:
            return made
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _in_megatrons_terms(entry_point: Any) -> Any:
    """``entry_point``, whose shardstore errors are raised as ``_megatrons_exception()``
    (the same message; the original chained): caught by either library's ``except``; and
    whose save and load lines are logged at DEBUG, as Megatron's own strategies log
    theirs (Megatron-LM prints its own line per checkpoint)."""

    @functools.wraps(entry_point)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with operations_logged_at(logging.DEBUG):
                return entry_point(*args, **kwargs)
        except CheckpointingException as exc:
            megatrons = _megatrons_exception()
            if megatrons is None or isinstance(exc, megatrons):
                raise
            raise megatrons(*exc.args) from exc

    return wrapper


# ------------------------------------------------------------------ the entry points


def _is_ours(checkpoint_dir: Any) -> bool:
    """Whether ``checkpoint_dir`` holds a committed shardstore checkpoint (None, which
    Megatron's functions refuse in their own words, holds none)."""
    if checkpoint_dir is None:
        return False
    try:
        return is_committed(bare_location(checkpoint_dir))
    except CheckpointingException:
        return False


def _refuse_shifted_arguments(entry_point: str, common_strategy: Any) -> None:
    """Megatron-Core 0.19 dropped ``common_strategy`` from ``save``/``load``, so a bool in
    its place is ``validate_access_integrity`` passed by position for another version."""
    if isinstance(common_strategy, bool):
        raise TypeError(
            f"shardstore.megatron.{entry_point}: pass validate_access_integrity and the arguments after "
            "sharded_strategy by keyword (Megatron-Core 0.19 dropped common_strategy, which shifted them)"
        )


@_in_megatrons_terms
def save(
    sharded_state_dict: Any,
    checkpoint_dir: Any,
    sharded_strategy: Any = None,
    common_strategy: Any = None,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
    preprocess_common_before_consistancy_check: Any = None,
    content_metadata: dict | None = None,
    async_strategy: str | None = "nvrx",
    verify_integrity: bool = False,
    *,
    reuse_from: Any = None,
    process_group: Any = None,
) -> Any:
    """Megatron-Core's ``dist_checkpointing.save`` (0.14 to 0.19 keywords), writing a
    shardstore checkpoint through ``shardstore.save`` (staged and published atomically;
    a committed checkpoint at the same path is replaced, as Megatron's save overwrites).
    Megatron 0.19 dropped ``common_strategy``: its callers pass everything after
    ``sharded_strategy`` by keyword, as Megatron-LM does.

    Megatron's ``TorchDistSaveShardedStrategy`` becomes shardstore's default strategy, a
    ``FullyParallelSaveStrategyWrapper`` shardstore's fully-parallel plan (over the whole
    save group) and, with ``do_cache_distribution``, its cached plan
    (``strategy_for_save``). ``async_sharded_save=True`` returns the ``AsyncRequest``
    class of Megatron's (or nvidia-resiliency-ext's, by ``async_strategy``) queue, whose
    writer may run in another process (``strategies.forked_writes``).
    ``verify_integrity`` needs nothing more: every chunk's crc32c and XXH3-128 digest are
    recorded at write time (stronger than Megatron's file-level SHA-256 manifest, which
    is not written). ``reuse_from`` (not Megatron's) makes the save incremental; by
    default the newest older committed ``iter_*`` sibling of a local checkpoint
    directory is reused from (``previous_checkpoint``; ``install(reuse_previous=False)``
    turns it off).

    Returns:
        None, or with ``async_sharded_save`` the request for Megatron's queue.
    """
    _refuse_shifted_arguments("save", common_strategy)
    if verify_integrity:
        log_once(
            logger,
            "verify_integrity: shardstore records every chunk's crc32c and XXH3-128 digest at write time; "
            "load(verify_integrity=True) and `shardstore verify` check them",
        )
    if reuse_from is None and _installation is not None and _installation.reuse_previous:
        reuse_from = previous_checkpoint(checkpoint_dir)
    strategy = strategy_for_save(sharded_strategy)
    request = _shardstore_save(
        sharded_state_dict,
        checkpoint_dir,
        strategy,
        None,
        validate_access_integrity,
        async_sharded_save,
        preprocess_common_before_consistancy_check,
        content_metadata,
        process_group=process_group,
        # Megatron-LM's iteration directory is shared: ModelOpt writes its state there too
        options=SaveOptions(overwrite=True, reuse_from=reuse_from, shared_directory=True,
                            layout=_save_layout(sharded_strategy)),
    )
    if request is None:
        return None
    return for_another_process(request, _megatron_request_class(async_strategy), finalize_wrapper=_in_megatrons_terms)


def _save_layout(strategy: Any) -> StorageLayout:
    """The layout the options of a save with Megatron's ``strategy`` carry: ``install``'s
    at the time of the call (all ``"auto"`` when not installed), but where ``strategy`` is
    or wraps shardstore's own, without the chunk and shard sizes, which that strategy
    carries (``ZarrSaveShardedStrategy(shard_bytes=...)``; the save combines the two)."""
    installed = _installation.layout if _installation is not None else StorageLayout()
    if _wrapped(strategy, ZarrSaveShardedStrategy) is None:
        return installed
    return replace(installed, max_chunk_bytes="auto", shard_bytes="auto")


def _megatron_request_class(async_strategy: str | None) -> Any:
    """The ``AsyncRequest`` class of the queue Megatron schedules the save on: by
    ``async_strategy`` where Megatron has ``get_async_strategy`` (0.17 on), else the one
    of ``strategies.async_utils``."""
    torch_strategies = importlib.import_module("megatron.core.dist_checkpointing.strategies.torch")
    get_async_strategy = getattr(torch_strategies, "get_async_strategy", None)
    if get_async_strategy is not None:
        return get_async_strategy(async_strategy or "nvrx")[1]["AsyncRequest"]
    return importlib.import_module(
        "megatron.core.dist_checkpointing.strategies.async_utils"
    ).AsyncRequest


def previous_checkpoint(checkpoint_dir: Any) -> Path | None:
    """The newest committed shardstore checkpoint ``<parent>/iter_<M>`` older than a
    local ``<parent>/iter_<N>`` (Megatron-LM's layout) among the three newest older
    ``iter_*`` directories, or None: a bounded look (one record read each), and a
    base further back shares little. Committed means a commit record that reads and
    checks: a damaged one cannot serve (the save would write every chunk), so the
    good iteration before it is taken. Each rank looks for itself: ranks that disagree
    (a file system in flux) only lose the reuse (``format.reuse``), never data."""
    if not isinstance(checkpoint_dir, (str, Path)) or "://" in str(checkpoint_dir):
        return None
    path = Path(checkpoint_dir)
    match = _ITERATION_DIR.fullmatch(path.name)
    if match is None or not path.parent.is_dir():
        return None
    current = int(match.group(1))
    older = []
    for sibling in path.parent.iterdir():
        found = _ITERATION_DIR.fullmatch(sibling.name)
        if found is not None and int(found.group(1)) < current:
            older.append((int(found.group(1)), sibling))
    for _, sibling in sorted(older, reverse=True)[:3]:  # a few: retention may have removed the rest
        if _has_readable_record(sibling):
            return sibling
    return None


def _has_readable_record(checkpoint_dir: Path) -> bool:
    """Whether ``checkpoint_dir`` holds a shardstore commit record that reads and checks
    (``_is_ours`` only looks for the file)."""
    try:
        read_commit_record(bare_location(checkpoint_dir))
    except CheckpointingException:  # damaged, unreadable, a newer format, another tool's: not a base
        return False
    return True


@_in_megatrons_terms
def load(
    sharded_state_dict: Any,
    checkpoint_dir: Any,
    sharded_strategy: Any = None,
    common_strategy: Any = None,
    validate_access_integrity: bool = True,
    strict: Any = None,
    verify_integrity: bool = False,
    *,
    process_group: Any = None,
) -> Any:
    """Megatron-Core's ``dist_checkpointing.load`` (0.14 to 0.19 keywords): a shardstore
    checkpoint through shardstore, anything else through Megatron's own ``load``.
    ``strict``: a ``StrictHandling`` of either library or its string value (default:
    assume_ok_unexpected, as Megatron's)."""
    _refuse_shifted_arguments("load", common_strategy)
    if not _is_ours(checkpoint_dir):
        return _call_original(
            "load",
            sharded_state_dict,
            checkpoint_dir,
            sharded_strategy,
            common_strategy=common_strategy,
            validate_access_integrity=validate_access_integrity,
            strict=strict,
            verify_integrity=verify_integrity,
            process_group=process_group,
        )
    if verify_integrity:
        verify_before_load(checkpoint_dir, process_group)
    return _shardstore_load(
        sharded_state_dict,
        checkpoint_dir,
        _strategy_for_load(sharded_strategy),
        None,
        validate_access_integrity,
        StrictHandling.ASSUME_OK_UNEXPECTED if strict is None else strict,
        process_group=process_group,
    )


def _call_original(name: str, *args: Any, **kwargs: Any) -> Any:
    """Megatron's own ``name`` with the keywords the caller gave: one left at our
    default is not passed (Megatron's own default applies: ``strict=None`` means
    Megatron's default, which its ``load`` would refuse as a value); one given that
    this version lacks is refused, naming it."""
    original = _original(name)
    accepted = inspect.signature(original).parameters
    defaults = inspect.signature(globals()[name]).parameters
    given = {key: value for key, value in kwargs.items() if value is not defaults[key].default}
    refused = [key for key in given if key not in accepted]
    if refused:
        raise TypeError(
            f"{args[1]!r} is not a shardstore checkpoint, so Megatron-Core's own {name} reads it, and this "
            f"version's takes no {', '.join(refused)}: leave it out or upgrade megatron-core"
        )
    return original(*args, **given)


def _dispatching(name: str, ours: Any) -> Any:
    """The entry point ``name``: ``ours`` for a shardstore checkpoint (Megatron's load
    strategies, which name no shardstore option, left out), Megatron's own for anything
    else; the checkpoint is the first argument."""

    def entry_point(checkpoint_dir: Any, *args: Any, **kwargs: Any) -> Any:
        if not _is_ours(checkpoint_dir):
            return _original(name)(checkpoint_dir, *args, **kwargs)
        args = tuple(_strategy_for_load(a) if _is_strategy(a) else a for a in args)
        kwargs = {k: _strategy_for_load(v) if _is_strategy(v) else v for k, v in kwargs.items()}
        return ours(checkpoint_dir, *args, **kwargs)

    entry_point = _in_megatrons_terms(entry_point)
    entry_point.__name__ = entry_point.__qualname__ = name
    entry_point.__doc__ = (
        f"Megatron-Core's ``dist_checkpointing.{name}``: a shardstore checkpoint through "
        f"``shardstore.{name}``, anything else through Megatron's own."
    )
    return entry_point


_STRATEGY_MODULES = ("megatron.core.dist_checkpointing.strategies", "shardstore.compat.megatron", "shardstore.tools")


def _is_strategy(value: Any) -> bool:
    """Whether ``value`` is a strategy of Megatron's (or ours): a ``(backend, version)``
    tuple, which names Megatron's, or an object: a class of theirs or ours is among its
    bases (Megatron's load strategies name no backend, and 0.19 has no common base
    class), or it names a backend or wraps a strategy."""
    return (
        isinstance(value, tuple)
        or any(cls.__module__.startswith(_STRATEGY_MODULES) for cls in type(value).__mro__)
        or hasattr(value, "backend")
        or hasattr(value, "base_strategy")
    )


@_in_megatrons_terms
def load_content_metadata_entry(
    checkpoint_dir: Any = None, *, preloaded_state_dict: Any = None
) -> dict | None:
    """Megatron-Core's ``load_content_metadata``: from a loaded common state (either
    tool's), or from a shardstore checkpoint, else through Megatron's own."""
    if preloaded_state_dict is not None or _is_ours(checkpoint_dir):
        return load_content_metadata(checkpoint_dir, preloaded_state_dict=preloaded_state_dict)
    return _original("load_content_metadata")(
        checkpoint_dir, preloaded_state_dict=preloaded_state_dict
    )


@_in_megatrons_terms
def check_is_distributed_checkpoint(checkpoint_dir: Any) -> bool:
    """Megatron-Core's ``check_is_distributed_checkpoint``: a committed shardstore
    checkpoint, or what Megatron's own says."""
    return _is_ours(checkpoint_dir) or bool(
        _original("check_is_distributed_checkpoint")(checkpoint_dir)
    )


_REPLACEMENTS: dict[str, Any] = {
    "save": save,
    "load": load,
    "load_common_state_dict": _dispatching("load_common_state_dict", load_common_state_dict),
    "load_tensors_metadata": _dispatching("load_tensors_metadata", load_tensors_metadata),
    "load_sharded_metadata": _dispatching("load_sharded_metadata", load_sharded_metadata),
    "load_plain_tensors": _dispatching("load_plain_tensors", load_plain_tensors),
    "load_content_metadata": load_content_metadata_entry,
    "remove_sharded_tensors": _dispatching("remove_sharded_tensors", remove_sharded_tensors),
    "check_is_distributed_checkpoint": check_is_distributed_checkpoint,
}
