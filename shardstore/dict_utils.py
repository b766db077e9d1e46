"""Walking, splitting and merging nested state dicts (dicts and lists of any depth)."""

from __future__ import annotations

__all__ = [
    "Leaf", "diff", "dict_list_map_inplace", "dict_list_map_outplace", "dict_map",
    "dict_map_with_key", "extract_matching_values", "flatten", "inspect_types", "map_reduce",
    "merge", "nest", "nested_items_iter", "nested_values", "with_list_places",
]

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch

U, V = TypeVar("U"), TypeVar("V")


def extract_matching_values(
    x: dict | list, predicate: Callable[[Any], bool], return_lists_as_dicts: bool = False
) -> tuple[dict | list, dict | list]:
    """Splits ``x`` into the leaves that match ``predicate`` and the rest.

    Both results keep the nesting structure of ``x``. An empty container stays on the
    non-matching side (as in Megatron-Core): the common state keeps an optimizer's empty
    ``state`` dict or ``save(content_metadata={})``; a container emptied by the split is
    dropped.

    Args:
        x: a nested dict or list
        predicate: called on every leaf
        return_lists_as_dicts: represent lists as ``{index: value}`` dicts so that the
            positions of matching values are preserved

    Returns:
        ``(matching, nonmatching)``
    """

    def wrap(values: list[tuple[Any, Any]]) -> dict | list:
        return dict(values) if return_lists_as_dicts else [v for _, v in values]

    if isinstance(x, dict):
        matching, nonmatching = {}, {}
        for k, v in x.items():
            if isinstance(v, (list, dict)):
                m, n = extract_matching_values(v, predicate, return_lists_as_dicts)
                if m:
                    matching[k] = m
                if n or not v:
                    nonmatching[k] = n
            elif predicate(v):
                matching[k] = v
            else:
                nonmatching[k] = v
        return matching, nonmatching
    if isinstance(x, list):
        m_items, n_items = [], []
        for i, v in enumerate(x):
            if isinstance(v, (list, dict)) and v:
                m, n = extract_matching_values(v, predicate, return_lists_as_dicts)
                if m:
                    m_items.append((i, m))
                if n:
                    n_items.append((i, n))
            elif predicate(v):
                m_items.append((i, v))
            else:
                n_items.append((i, v))
        return wrap(m_items), wrap(n_items)
    raise ValueError(f"Unexpected top-level object type: {type(x).__name__}")


def diff(x1: Any, x2: Any, prefix: tuple = ()) -> tuple[list, list, list]:
    """Recursive comparison of two nested values, with Megatron-Core's semantics.

    Dicts by key; sequences (lists, tuples, numpy arrays of one or more dimensions) by
    index, an element missing on one side reported by its path, the highest index first
    (Megatron-Core's current main); a list beside a tuple is one mismatch at its path
    (Megatron asserts there); tensors by value (equal values of different dtypes are
    equal, as are tensors on different devices); sharded objects (anything with
    ``replica_id``) by their data.

    Returns:
        ``(only_left, only_right, mismatch)``: key paths present only in ``x1``, only in
        ``x2``, and ``(path, type(x1), type(x2))`` of values that differ.
    """
    if isinstance(x1, dict) and isinstance(x2, dict):
        return _diff_items(x1, x2, [k for k in x1 if k in x2], prefix,
                           [prefix + (k,) for k in x1.keys() - x2.keys()],
                           [prefix + (k,) for k in x2.keys() - x1.keys()])
    if _is_sequence(x1) and _is_sequence(x2):
        if type(x1) is not type(x2):
            return [], [], [(prefix, type(x1), type(x2))]
        if isinstance(x1, np.ndarray) and x1.shape == x2.shape and _equal_values(x1, x2):
            return [], [], []  # equal arrays: no walk over their elements
        shared = min(len(x1), len(x2))
        return _diff_items(x1, x2, range(shared), prefix,
                           [prefix + (i,) for i in reversed(range(shared, len(x1)))],
                           [prefix + (i,) for i in reversed(range(shared, len(x2)))])
    if hasattr(x1, "replica_id") and hasattr(x2, "replica_id") and type(x1) is type(x2):
        return diff(x1.data, x2.data, prefix + (type(x1),))
    return [], [], [] if _equal_values(x1, x2) else [(prefix, type(x1), type(x2))]


def _is_sequence(x: Any) -> bool:
    return isinstance(x, (list, tuple)) or (isinstance(x, np.ndarray) and x.ndim > 0)


def _diff_items(x1: Any, x2: Any, keys: Iterable, prefix: tuple, only_left: list, only_right: list):
    mismatch: list = []
    for k in keys:
        left, right, mis = diff(x1[k], x2[k], prefix + (k,))
        only_left += left
        only_right += right
        mismatch += mis
    return only_left, only_right, mismatch


def _equal_values(x1: Any, x2: Any) -> bool:
    if isinstance(x1, torch.Tensor) and isinstance(x2, torch.Tensor):
        if x1.shape != x2.shape:
            return False
        try:
            return bool(torch.all(x1.cpu() == x2.cpu()))
        except (RuntimeError, TypeError):
            return False
    if isinstance(x1, np.ndarray) or isinstance(x2, np.ndarray):
        try:
            return bool(np.array_equal(np.asarray(x1), np.asarray(x2)))
        except (TypeError, ValueError):
            return False
    if isinstance(x1, torch.Tensor) or isinstance(x2, torch.Tensor):
        return False
    try:
        return bool(x1 == x2)
    except (RuntimeError, TypeError, ValueError):
        return False


def inspect_types(x: Any, prefix: tuple = (), indent: int = 4) -> str:
    """Prints a tree of the value types of a nested dict or list, as Megatron-Core's
    ``inspect_types`` does, one line per key or list index (indented by ``indent``
    spaces a level, ``prefix`` giving the starting level). Also returns the printed
    text (Megatron returns None), so a caller can log it instead."""
    text = _types_tree(x, len(prefix), indent)
    print(text)
    return text


def _types_tree(x: Any, level: int, indent: int) -> str:
    """``inspect_types``'s text for ``x``, its first line at ``level``."""
    if isinstance(x, dict):
        items = [(str(k), v) for k, v in x.items()]
    elif isinstance(x, list):
        items = [(f"[{i}]", v) for i, v in enumerate(x)]
    else:
        return f"{' ' * indent * level}{_type_summary(x)}"
    lines = []
    pad = " " * indent * level
    for name, v in items:
        if isinstance(v, (dict, list)):
            lines.append(f"{pad}{name}:")
            lines.append(_types_tree(v, level + 1, indent))
        else:
            lines.append(f"{pad}{name}: {_type_summary(v)}")
    return "\n".join(line for line in lines if line)


def _type_summary(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"Tensor of shape {tuple(v.shape)} and dtype {v.dtype}"
    return type(v).__name__


def nested_values(x: dict | list) -> Iterator[Any]:
    """Yields every leaf of a nested dict or list."""
    for v in x.values() if isinstance(x, dict) else x:
        if isinstance(v, (dict, list)):
            yield from nested_values(v)
        else:
            yield v


def nested_items_iter(x: dict | list) -> Iterator[tuple[dict | list, Any, Any]]:
    """Yields ``(container, key, leaf)`` for every leaf of nested dicts and lists, as
    Megatron-Core does: ``container[key]`` is the leaf (``key`` a list index inside a
    list), so a caller can replace it in place."""
    for k, v in x.items() if isinstance(x, dict) else enumerate(x):
        if isinstance(v, (dict, list)):
            yield from nested_items_iter(v)
        else:
            yield x, k, v


def dict_map(f: Callable, d: dict) -> None:
    """Replaces every leaf ``v`` of nested dicts and lists (the elements of lists too)
    by ``f(v)``, in place."""
    for container, k, v in nested_items_iter(d):
        container[k] = f(v)


def dict_map_with_key(f: Callable, d: dict) -> None:
    """Like ``dict_map`` with ``f(key, v)``: ``key`` is the leaf's own dict key, or its
    index in the list that holds it."""
    for container, k, v in nested_items_iter(d):
        container[k] = f(k, v)


def dict_list_map_inplace(f: Callable[[U], V], x: dict | list | U) -> dict | list | V:
    """Applies ``f`` to every leaf of nested dicts and lists, in place. Returns ``x``."""
    if isinstance(x, dict):
        for k, v in x.items():
            x[k] = dict_list_map_inplace(f, v)
    elif isinstance(x, list):
        x[:] = (dict_list_map_inplace(f, v) for v in x)
    else:
        return f(x)
    return x


def dict_list_map_outplace(f: Callable[[U], V], x: dict | list | U) -> dict | list | V:
    """Applies ``f`` to every leaf of nested dicts and lists; returns a new structure."""
    if isinstance(x, dict):
        return {k: dict_list_map_outplace(f, v) for k, v in x.items()}
    if isinstance(x, list):
        return [dict_list_map_outplace(f, v) for v in x]
    return f(x)


def merge(x1: dict | list, x2: dict | list, key: tuple = ()) -> dict | list:
    """Merges ``x2`` into ``x1`` in place and returns ``x1``.

    Dicts merge by key, lists of equal length element-wise; a leaf present in both
    is an error (the two parts of a state dict must be disjoint).
    """
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            x1[k] = v2 if k not in x1 else merge(x1[k], v2, key=key + (k,))
    elif isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise ValueError(
                f"Cannot merge two lists with different lengths ({len(x1)} and {len(x2)}, "
                f"encountered at key {key})"
            )
        for i, v2 in enumerate(x2):
            x1[i] = merge(x1[i], v2, key=key + (i,))
    else:
        raise ValueError(
            f"Duplicate non-dict and non-list values encountered: `{x1}` and `{x2}` (at key {key})"
        )
    return x1


def map_reduce(
    xs: Iterable,
    key_fn: Callable = lambda x: x,
    value_fn: Callable = lambda x: x,
    reduce_fn: Callable = lambda x: x,
) -> dict:
    """Groups ``xs`` by ``key_fn``, maps values with ``value_fn``, reduces each group."""
    groups: dict = defaultdict(list)
    for x in xs:
        groups[key_fn(x)].append(value_fn(x))
    return {k: reduce_fn(v) for k, v in groups.items()}


class Leaf(NamedTuple):
    """One leaf of a nested state dict, as ``flatten`` finds it.

    Attributes:
        path: the dict keys and list indices from the root to the leaf.
        value: the leaf (after ``flatten``'s ``visit``), or the container itself for an
            empty container (``empty``).
        containers: the containers on the way, the root first (``len(path)`` of them):
            ``nest`` rebuilds the same kinds of container from them.
        empty: True for an empty dict or list of the state dict (a leaf of its own: it
            stays in the common state, as ``extract_matching_values`` keeps it).
    """

    path: tuple
    value: Any
    containers: tuple
    empty: bool = False


def flatten(x: dict | list, visit: Callable[[tuple, Any, bool], Any] | None = None) -> list[Leaf]:
    """Every leaf of ``x`` (and every empty dict or list in it), in traversal order, in
    one walk: the flat list that the stages of a save or load share instead of walking
    the state dict again.

    Args:
        x: a nested dict or list (not modified).
        visit: ``visit(path, leaf, expandable)`` returns the leaf's value: the leaf, or
            its replacement. Where ``expandable`` (a leaf of ``x`` itself) and the
            replacement is a dict or list (a factory's build), that container is walked
            in the leaf's place, its leaves visited with ``expandable`` False.
    """
    if not isinstance(x, (dict, list)):
        raise ValueError(f"Unexpected top-level object type: {type(x).__name__}")
    leaves: list[Leaf] = []
    _walk(x, (), (), True, visit, leaves)
    return leaves


def _walk(
    node: dict | list, path: tuple, containers: tuple, expandable: bool,
    visit: Callable[[tuple, Any, bool], Any] | None, leaves: list[Leaf],
) -> None:
    """``flatten``'s walk, appending to ``leaves``. A module-level function, not a closure
    that calls itself: such a closure is a reference cycle (function -> cell -> function)
    that keeps ``leaves``, hence every tensor of the state dict, alive until the cyclic
    collector runs, which a load pauses (issue 33.2: memory bounds did not hold)."""
    containers = (*containers, node)
    for k, v in node.items() if isinstance(node, dict) else enumerate(node):
        here = (*path, k)
        if visit is not None and not isinstance(v, (dict, list)):
            replaced = visit(here, v, expandable)
            if expandable and replaced is not v and isinstance(replaced, (dict, list)):
                if replaced:
                    _walk(replaced, here, containers, False, visit, leaves)
                else:
                    leaves.append(Leaf(here, replaced, containers, True))
                continue
            v = replaced
        if not isinstance(v, (dict, list)):
            leaves.append(Leaf(here, v, containers))
        elif v:
            _walk(v, here, containers, expandable, visit, leaves)
        else:
            leaves.append(Leaf(here, v, containers, True))


def with_list_places(kept: list[Leaf], leaves: list[Leaf]) -> list[Leaf]:
    """``kept`` (a selection of ``leaves``, in their order) with a ``None`` leaf for every
    element of a list that holds something kept but nothing kept under that element:
    ``nest`` of the result keeps each list's length and every element at its index.

    Without it a list mixing sharded and plain values (``[DTensor, 3, "x"]``) keeps
    ``[3, "x"]`` in the common state, and a load cannot tell where the loaded tensor
    goes back; with it the common state holds ``[None, 3, "x"]`` (as DCP's does) and
    ``nest(..., into=common)`` fills the ``None`` at the tensor's own index."""
    holding: set[tuple[int, Any]] = set()  # (id of a list, index) with a kept leaf under it
    for leaf in kept:
        for level, container in enumerate(leaf.containers):
            if isinstance(container, list):
                holding.add((id(container), leaf.path[level]))
    lists = {list_id for list_id, _ in holding}
    kept_ids = {id(leaf) for leaf in kept}
    if not any(id(c) in lists for leaf in leaves if id(leaf) not in kept_ids for c in leaf.containers):
        return kept
    result: list[Leaf] = []
    held: set[tuple[int, Any]] = set()
    for leaf in leaves:
        if id(leaf) in kept_ids:
            result.append(leaf)
            continue
        for level, container in enumerate(leaf.containers):
            if not isinstance(container, list) or (id(container), leaf.path[level]) in holding:
                continue
            place = (id(container), leaf.path[level])
            if id(container) in lists and place not in held:
                held.add(place)
                result.append(Leaf(leaf.path[:level + 1], None, leaf.containers[:level + 1]))
            break
    return result


def nest(
    leaves: Iterable[Leaf], values: Iterable[Any] | None = None, into: dict | list | None = None,
    root: dict | list | None = None,
) -> tuple[dict | list, list[tuple[dict | list, Any]]]:
    """Builds the nested structure that holds ``leaves`` (a loop over them, not a walk).

    The result is what ``extract_matching_values`` returns for those leaves: the same
    kinds of container on the way to each, lists holding only the selected elements
    (in order), a container only where a leaf or an empty container lies under it.

    Args:
        leaves: from ``flatten``, in traversal order.
        values: the value to place for each leaf (default: ``leaf.value``; an empty
            container's leaf gets a new empty container of its kind).
        into: merge into this state dict instead of a new one, as ``merge(into, built)``
            would: dicts by key, a list element-wise when the lists are of equal length,
            a value already present is an error. A list of ``into`` as long as the
            leaves' own list holds every element in its place (a common state that keeps
            ``None`` where a sharded value was, as DCP's does): a leaf goes to its own
            index, filling a ``None`` there.
        root: the flattened state dict (its kind is the result's when ``into`` is None
            and there are no leaves); default: a dict.

    Returns:
        ``(structure, slots)``: each leaf's place as ``(container, key or index)``.
    """
    if into is None:
        into = [] if isinstance(root, list) else {}
    children: dict[tuple[int, Any], Any] = {}
    placed: dict[int, tuple[list, int, tuple]] = {}  # lists of ``into``: (list, elements placed, path)
    slots: list[tuple[dict | list, Any]] = []
    values = iter(values) if values is not None else None
    for leaf in leaves:
        value = next(values) if values is not None else leaf.value
        if values is None and leaf.empty:
            value = {} if isinstance(value, dict) else []
        parent, depth = into, len(leaf.path)
        for level in range(depth):
            key = leaf.path[level]
            if level == depth - 1:
                slots.append(_place(parent, key, value, children, placed, leaf.path, source=leaf.containers[level]))
                break
            node = children.get((id(parent), key))
            if node is None:
                kind = dict if isinstance(leaf.containers[level + 1], dict) else list
                parent, _ = _place(
                    parent, key, kind(), children, placed, leaf.path[:level + 1], container=True,
                    source=leaf.containers[level],
                )
            else:
                parent = node
    for target, count, path in placed.values():
        if count is not None and count != len(target):
            raise ValueError(
                f"Cannot merge two lists with different lengths ({len(target)} and {count}, "
                f"encountered at key {path})"
            )
    return into, slots


def _holds_list_of_length(container: dict | list, key: Any, length: int) -> bool:
    """Whether ``container[key]`` is a list of ``length`` elements."""
    try:
        value = container[key]
    except (KeyError, IndexError, TypeError):
        return False
    return isinstance(value, list) and len(value) == length


def _place(
    parent: dict | list, key: Any, value: Any, children: dict, placed: dict, path: tuple, container: bool = False,
    source: Any = None,
) -> tuple[Any, Any]:
    """Puts ``value`` under ``key`` of ``parent`` (a new container when ``container``),
    merging with what ``parent`` already holds there as ``merge`` does. Returns the
    container now under ``key`` when ``container``, else the slot ``(parent, key)``.
    ``source``: the container of the flattened state dict that holds ``key``."""
    if isinstance(parent, list) and id(parent) in placed and placed[id(parent)][1] is None:  # in place
        index, existing, present = key, parent[key], parent[key] is not None
        if not present:
            parent[index] = value
    elif isinstance(parent, list) and id(parent) in placed:  # a list already in ``into``: element-wise
        target, count, at = placed[id(parent)]
        placed[id(parent)] = (target, count + 1, at)
        index = count
        if index >= len(parent):
            raise ValueError(
                f"Cannot merge two lists with different lengths ({len(parent)} and more, encountered at key {at})"
            )
        existing, present = parent[index], True
    elif isinstance(parent, list):
        parent.append(value)
        index = len(parent) - 1
        existing, present = None, False
    else:
        index = key
        present = key in parent
        existing = parent.get(key) if present else None
    if not present:
        if not isinstance(parent, list):
            parent[index] = value
        if container:
            children[(id(parent), key)] = value
            return value, None
        return parent, index
    if container and isinstance(existing, type(value)) and isinstance(existing, (dict, list)):
        children[(id(parent), key)] = existing
        if isinstance(existing, list):
            positional = isinstance(source, (dict, list)) and _holds_list_of_length(source, key, len(existing))
            placed[id(existing)] = (existing, None if positional else 0, path)
        return existing, None
    raise ValueError(
        f"Duplicate non-dict and non-list values encountered: `{existing}` and `{value}` (at key {path})"
    )
