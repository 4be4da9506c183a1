"""Naming a learner's slip only when sure: the one known slip that gives exactly their answer.

A checker that recognises a mistake says so ("looks like it writes at slot positions[b]"). A
wrong name costs more than none: the learner fixes what was right. So a diagnosis is a
prediction, tested against the whole answer on this very input::

    for each known slip:  make() -> the whole answer that slip gives here
    exactly one slip gives the learner's answer      -> "looks like <that slip>"
    none does, or two or more do (the input cannot  -> nothing: the message says what
    tell them apart), or an answer that many slips      differs, not why
    give does (``also``: a walk that stopped early)

A slip that raises on this input gives no answer and fits nothing.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

SAY = "\n  looks like "


def recognised(got: Any, slips: dict[str, Callable[[], Any]],
               same: Callable[[Any, Any], bool], also: Sequence[Callable[[], Any]] = ()) -> str:
    """``"\\n  looks like <slip>"`` when exactly one of ``slips`` gives ``got``, else ``""``.

    ``also``: answers that slips without a name give (any mistake that ends a walk at page j):
    one of them fitting too makes the named slip only one explanation among many."""
    fits = []
    for message, make in [*slips.items(), *((None, m) for m in also)]:
        try:
            answer = make()
        except Exception:  # noqa: BLE001 - a wrong variant may not even run on this input
            continue
        try:
            if same(answer, got):
                fits.append(message)
        except Exception:  # noqa: BLE001 - an answer of another shape fits nothing
            continue
    return SAY + fits[0] if len(fits) == 1 and fits[0] is not None else ""


def close(atol: float) -> Callable[[Any, Any], bool]:
    """Tensors of one shape, equal within ``atol``."""
    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape == b.shape and bool(torch.allclose(a.float(), b.float(), atol=atol))
    return same


def equal_tensors(a, b) -> bool:
    """Sequences of tensors (or one tensor) with the same values, compared as int64 / float."""
    if isinstance(a, torch.Tensor):
        a, b = (a,), (b,)
    return len(a) == len(b) and all(
        x.shape == y.shape and bool(torch.equal(x.cpu().to(y.dtype), y.cpu())) for x, y in zip(a, b))
