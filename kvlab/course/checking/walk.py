"""One walker over the containers learner code is called with and returns.

Arguments and return values are plain data: tensors, numbers and strings inside lists, tuples,
dicts, NamedTuples and sets. The safety net needs to find the tensors in them (to guard them),
swap them (for guarded views, and back), and send them between processes (a returned view of
an argument travels as a reference). :func:`map_tensors` is the one walk all of these use::

    ("free_pages", [t0, {"row": t1}])  --map_tensors-->  visit("free_pages[0]", t0),
                                                          visit("free_pages[1]['row']", t1)

A container is rebuilt only when something inside it changed, so a list or dict without
tensors reaches the learner as the caller's own object (and the caller sees its changes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

#: Leaves that are plain data (anything else, e.g. an object with methods, is "not plain").
PLAIN_TYPES = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device)


@dataclass(frozen=True)
class ArgRef:
    """Stands for the ``index``-th guarded argument in a message between processes."""

    index: int


def map_tensors(obj: Any, visit: Callable[[str, Any], Any], name: str = "") -> Any:
    """``obj`` with every leaf ``x`` (anything but a container) replaced by ``visit(path, x)``.

    Containers: lists, tuples and dicts of exactly those types, NamedTuples, sets. ``path``
    names the leaf the way a message would (``out[0]``, ``store['row']``, ``plan.slots``).
    """
    kind = type(obj)
    if kind in (list, tuple):
        items = [map_tensors(x, visit, f"{name}[{i}]") for i, x in enumerate(obj)]
        return obj if all(a is b for a, b in zip(items, obj)) else kind(items)
    if kind is dict:
        items = {k: map_tensors(x, visit, f"{name}[{k!r}]") for k, x in obj.items()}
        return obj if all(items[k] is obj[k] for k in obj) else items
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # NamedTuples
        items = [map_tensors(x, visit, f"{name}.{f}") for f, x in zip(obj._fields, obj)]
        return obj if all(a is b for a, b in zip(items, obj)) else kind(*items)
    if kind in (set, frozenset):
        items = [map_tensors(x, visit, f"{name} element") for x in obj]
        return obj if all(a is b for a, b in zip(items, obj)) else kind(items)
    return visit(name, obj)


def tensors_in(obj: Any, name: str = "") -> list[tuple[str, torch.Tensor]]:
    """Every tensor inside ``obj`` with its path, in order."""
    found: list[tuple[str, torch.Tensor]] = []

    def visit(path, x):
        if isinstance(x, torch.Tensor):
            found.append((path, x))
        return x

    map_tensors(obj, visit, name)
    return found


def is_plain_data(obj: Any) -> bool:
    """Whether every leaf is a tensor, a number, a string, ... or a function (no other objects)."""
    plain = [True]

    def visit(_, x):
        if not (isinstance(x, (torch.Tensor, *PLAIN_TYPES)) or callable(x)):
            plain[0] = False
        return x

    map_tensors(obj, visit)
    return plain[0]


def has_tensor(obj: Any) -> bool:
    return bool(tensors_in(obj))


def replace_tensors(obj: Any, mapping: dict[int, torch.Tensor]) -> Any:
    """``obj`` with every tensor ``t`` replaced by ``mapping[id(t)]`` (when there is one)."""
    return map_tensors(obj, lambda _, x: mapping.get(id(x), x) if isinstance(x, torch.Tensor) else x)


def to_refs(obj: Any, views: list[torch.Tensor]) -> Any:
    """Returned tensors that are (the same view as) an argument become :class:`ArgRef`\\ s."""

    def visit(_, x):
        if isinstance(x, torch.Tensor):
            for i, v in enumerate(views):
                if x is v or (x.data_ptr() == v.data_ptr() and x.shape == v.shape
                              and x.stride() == v.stride() and x.dtype == v.dtype):
                    return ArgRef(i)
        return x

    return map_tensors(obj, visit)


def from_refs(obj: Any, views: list[torch.Tensor]) -> Any:
    """The inverse of :func:`to_refs`: every :class:`ArgRef` becomes its argument's view."""
    return map_tensors(obj, lambda _, x: views[x.index] if isinstance(x, ArgRef) else x)
