"""What an exercise's statement promises about its answer's type, checked before its values.

A checker compares values, and a value of another type can compare equal: a tuple of hashes
equals nothing in a list comparison but passes an element-by-element check, float positions
cast to int64 look right. The cell after the exercise then uses the answer as the statement
says it is, and fails. So each checker first checks what its statement fixes (the container,
the element type, a tensor's dtype and device) with these helpers, each failing with one line::

    [one request] slots should be a list of ints (page * P + i), got a Tensor
    [page_size 1] positions should be an int64 tensor, got torch.float32

Ints are Python ints that are not bools (``kvlab.base.args``' rule): ``True`` is not a page.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from .failures import CheckFailed


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor" if value.dim() else f"a 0-d {value.dtype} tensor"
    return _a(type(value).__name__)


def _a(word: str) -> str:
    return f"an {word}" if word[:1].lower() in "aeiou" else f"a {word}"


def fail(case: str, text: str, **kw) -> CheckFailed:
    return CheckFailed(f"[{case}] {text}", case=case, **kw)


def expect_parts(case: str, got: Any, names: Sequence[str]) -> Sequence[Any]:
    """A tuple (or list) of ``len(names)`` parts, e.g. ``(num_pages, slots)``."""
    if not isinstance(got, (tuple, list)) or len(got) != len(names):
        size = f" of {len(got)}" if isinstance(got, (tuple, list)) else ""
        raise fail(case, f"return ({', '.join(names)}), got {_kind(got)}{size}")
    return got


def expect_int(case: str, what: str, value: Any) -> int:
    if not is_int(value):
        raise fail(case, f"{what} should be an int, got {_kind(value)}: {value!r}"[:200])
    return value


def expect_ints(case: str, what: str, value: Any, containers: tuple = (list,),
                meaning: str = "") -> list[int]:
    """A list (or another of ``containers``) of Python ints; returned as a list."""
    shown = " or ".join(c.__name__ for c in containers)
    about = f" ({meaning})" if meaning else ""
    if not isinstance(value, containers):
        raise fail(case, f"{what} should be {_a(shown)} of ints{about}, got {_kind(value)}")
    bad = next((v for v in value if not is_int(v)), None)
    if bad is not None:
        raise fail(case, f"{what} should be {_a(shown)} of ints{about}, but it holds {_kind(bad)}: {bad!r}"[:200])
    return list(value)


def expect_tensor(case: str, what: str, value: Any, *, dtypes: Sequence[torch.dtype] = (),
                  floating: bool = False, device: torch.device | None = None,
                  shape: Sequence[int] | None = None, meaning: str = "") -> torch.Tensor:
    """A tensor of one of ``dtypes`` (or any floating dtype), on ``device``, of ``shape``."""
    about = f" ({meaning})" if meaning else ""
    names = " or ".join(str(d).removeprefix("torch.") for d in dtypes) or "floating-point"
    if not isinstance(value, torch.Tensor):
        raise fail(case, f"{what} should be {_a(names)} tensor{about}, got {_kind(value)}")
    if (dtypes and value.dtype not in dtypes) or (floating and not value.dtype.is_floating_point):
        raise fail(case, f"{what} should be {_a(names)} tensor{about}, got {value.dtype}")
    if device is not None and value.device != torch.device(device):
        raise fail(case, f"{what} should be on {torch.device(device)}, where the inputs are, got "
                         f"{value.device}")
    if shape is not None and tuple(value.shape) != tuple(shape):
        raise fail(case, f"{what} should have shape {tuple(shape)}{about}, got {tuple(value.shape)}")
    return value
