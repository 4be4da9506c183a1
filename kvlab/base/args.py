"""Argument checks and integer helpers shared by every public door of kvlab.

One set of rules, one wording: an integer argument is an ``int`` (or anything with
``__index__``, such as a NumPy integer or a 0-d integer tensor) that is **not** a ``bool``;
token ids are a sequence of such integers or a 1-D integer tensor. Every check raises
:class:`~kvlab.base.errors.InvalidArgument` naming the argument and the rule, and changes nothing.

The plain-Python oracles in :mod:`kvlab.course.reference` keep their own copies of the small
helpers on purpose: an oracle must never share a bug with the code it checks.
"""
from __future__ import annotations

import math

import torch

from .errors import InvalidArgument

__all__ = ["div_ceil", "next_pow2", "is_int", "check_int", "check_real", "check_page_size",
           "check_token_ids", "check_int_vector", "check_scale", "check_slots", "check_whole_pages",
           "check_device"]


def div_ceil(a, b):
    """``ceil(a / b)`` for non-negative integers (ints, or integer tensors elementwise).

    ``div_ceil(9, 4) == 3``: nine tokens need three pages of four.
    """
    return (a + b - 1) // b


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``): a Triton block size for ``n``."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def is_int(value) -> bool:
    """An integer that is not a bool: ``int``, a NumPy integer, a 0-d integer tensor."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and not (value.dtype.is_floating_point or value.dtype.is_complex
                                         or value.dtype == torch.bool)
    if type(value).__name__ == "bool_":  # numpy.bool_ has __index__ too
        return False
    return hasattr(type(value), "__index__")


def check_int(argument: str, value, *, minimum: int | None = None) -> int:
    """``value`` as a Python int, or :class:`InvalidArgument` (bools and floats are refused)."""
    if type(value) is int:   # the common case first: the serving loop checks every request each step
        if minimum is not None and value < minimum:
            raise InvalidArgument(argument, f"must be >= {minimum}", f"got {value}")
        return value
    if not is_int(value):
        raise InvalidArgument(argument, "must be an int (not a bool or a float)",
                              f"got {type(value).__name__} {value!r}")
    value = int(value.__index__()) if not isinstance(value, torch.Tensor) else int(value.item())
    if minimum is not None and value < minimum:
        raise InvalidArgument(argument, f"must be >= {minimum}", f"got {value}")
    return value


def check_empty_list(argument: str, value) -> list | None:
    """None, or an empty list that a call fills (an eviction's ``into``: what it holds afterwards
    is that call's work and nothing else, so a rollback puts back exactly that)."""
    if value is None or (isinstance(value, list) and not value):
        return value
    got = f"a list of {len(value)}" if isinstance(value, list) else type(value).__name__
    raise InvalidArgument(argument, "None or an empty list", f"got {got}")


def check_bool(argument: str, value) -> bool:
    """A plain ``True`` or ``False`` (not a tensor, whose truth may be ambiguous, nor 0/1)."""
    if not isinstance(value, bool):
        raise InvalidArgument(argument, "True or False", f"got {value!r:.60}")
    return value


def check_real(argument: str, value, *, minimum: float = 0.0, below: float = float("inf")):
    """A finite real number (an int or a float, not a bool) with ``minimum <= value < below``;
    NaN and infinities are refused."""
    import math

    if isinstance(value, bool) or not (is_int(value) or isinstance(value, float)):
        raise InvalidArgument(argument, "a number (int or float, not a bool)",
                              f"got {type(value).__name__} {value!r}")
    value = float(value) if isinstance(value, float) else int(value)
    if not math.isfinite(value) or not minimum <= value < below:
        rule = f"a finite number >= {minimum:g}" + (f" and < {below:g}" if math.isfinite(below) else "")
        raise InvalidArgument(argument, rule, f"got {value!r}")
    return value


def check_page_size(page_size, argument: str = "page_size") -> int:
    """A page size: an int >= 1 (not a bool)."""
    return check_int(argument, page_size, minimum=1)


def check_int_vector(argument: str, value) -> torch.Tensor:
    """``value`` must be a 1-D integer tensor (any integer dtype); returns it."""
    if not isinstance(value, torch.Tensor):
        raise InvalidArgument(argument, "must be a torch.Tensor", f"got {type(value).__name__}")
    if value.dim() != 1:
        raise InvalidArgument(argument, "must be 1-D", f"got shape {tuple(value.shape)}")
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise InvalidArgument(argument, "must have an integer dtype", f"got {value.dtype}")
    return value


def check_token_ids(argument: str, token_ids) -> list[int]:
    """Token ids as a list of Python ints.

    Accepted: a list or tuple of integers (not bools), or a 1-D integer tensor. Refused with
    the argument's name: strings (``"123"`` is not three tokens), floats, bools, nested lists.
    """
    if isinstance(token_ids, torch.Tensor):
        check_int_vector(argument, token_ids)
        return [int(t) for t in token_ids.tolist()]
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, (list, tuple)):
        raise InvalidArgument(argument, "must be a list or tuple of int token ids, or a 1-D "
                              "integer tensor", f"got {type(token_ids).__name__}")
    if list(map(type, token_ids)).count(int) == len(token_ids):
        return list(token_ids)  # plain ints (the type test runs in C)
    for i, t in enumerate(token_ids):
        if not is_int(t):
            raise InvalidArgument(f"{argument}[{i}]", "must be an int token id (not a bool or "
                                  "a float)", f"got {type(t).__name__} {t!r}")
    return [int(t.__index__()) if not isinstance(t, torch.Tensor) else int(t.item())
            for t in token_ids]


def check_scale(scale, argument: str = "scale") -> float | None:
    """An attention scale: None (the default, ``1/sqrt(head_dim)``) or a finite number > 0."""
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) \
            or scale <= 0:
        raise InvalidArgument(argument, "None or a finite number > 0", f"got {scale!r}")
    return float(scale)


def check_slots(argument: str, slots) -> torch.Tensor:
    """Token slots as a 1-D integer tensor: a tensor, or a list/tuple of ints (not bools or floats)."""
    if isinstance(slots, torch.Tensor):
        return check_int_vector(argument, slots)
    if isinstance(slots, (str, bytes)) or not isinstance(slots, (list, tuple)):
        raise InvalidArgument(argument, "must be a 1-D integer tensor or a list of int slots",
                              f"got {type(slots).__name__}")
    for i, s in enumerate(slots):
        if not is_int(s):
            raise InvalidArgument(f"{argument}[{i}]", "must be an int slot (not a bool or a float)",
                                  f"got {type(s).__name__} {s!r}")
    values = [int(s) for s in slots]
    if values and not (-(1 << 63) <= min(values) and max(values) < 1 << 63):
        raise InvalidArgument(argument, "slots fit in int64", f"got {max(values, key=abs)}")
    return torch.tensor(values, dtype=torch.int64)


def check_whole_pages(argument: str, slots: torch.Tensor, page_size: int) -> None:
    """Each run of ``page_size`` slots must be one physical page: p*P, p*P+1, ..., p*P+P-1."""
    P = page_size
    if slots.numel() and int(slots.min()) < 0:
        raise InvalidArgument(argument, "slots are >= 0", f"got {int(slots.min())}")
    if P == 1 or slots.numel() == 0:
        return
    pages = slots.view(-1, P).to(torch.int64)
    starts = pages[:, :1]
    ok = bool(((starts % P) == 0).all()) and bool(
        (pages == starts + torch.arange(P, device=pages.device)).all())
    if not ok:
        raise InvalidArgument(argument, "each page of slots must be one whole physical page "
                              f"(p*{P}, p*{P}+1, ..., p*{P}+{P - 1})",
                              f"got {slots.tolist()[:2 * P]}...")


def check_device(argument: str, device):
    """``None`` (the runtime's device), a ``torch.device``, or a name torch knows (``"cpu"``,
    ``"cuda:0"``); returned as given, a name as a ``torch.device``."""
    if device is None or isinstance(device, torch.device):
        return device
    if isinstance(device, str) or (is_int(device) and not isinstance(device, torch.Tensor)):
        try:
            return torch.device(device)
        except (RuntimeError, ValueError, TypeError):
            pass
    raise InvalidArgument(argument, 'a torch.device or a device name ("cpu", "cuda", "cuda:0")',
                          f"got {device!r}"[:80])
