"""The figures of a chapter's page: the alt text each cell declares for them.

A cell that shows figures says what each one shows on its ``# %%`` line, ``alt="..."`` (or
``alt=["...", "..."]`` for a cell that shows several, in order): a sentence a reader who cannot
see the picture can use (:func:`alt_problem`). ``tools/site_pages.py`` matches them with the
figures among the executed cell's outputs (:func:`figure_outputs`), keyed the way MyST-NB names
a figure's file (:func:`figure_key`, its SHA-256).
"""
from __future__ import annotations

import base64
import hashlib
import os
import re

import nbformat

FIGURE_TYPES = ("image/png", "image/jpeg", "image/svg+xml")
#: an output figure's alt text: a sentence of at least this many words
MIN_ALT_WORDS = 6


class FigureError(ValueError):
    """An alt text that is not a list of sentences (names the cell)."""


def declared_alt(value, where: str) -> tuple[str, ...]:
    """The alt texts a cell declares (``alt="..."`` or ``alt=["...", ...]`` on its ``# %%``
    line), each checked to be a sentence (:func:`alt_problem`)."""
    if value is None:
        return ()
    texts = (value,) if isinstance(value, str) else value
    if not isinstance(texts, (list, tuple)) or not all(isinstance(t, str) for t in texts):
        raise FigureError(f"{where}: alt must be a string or a list of strings, got {value!r}")
    for text in texts:
        problem = alt_problem(text)
        if problem:
            raise FigureError(f"{where}: alt text {text!r} {problem}")
    return tuple(t.strip() for t in texts)


def alt_problem(text: str, min_words: int = MIN_ALT_WORDS) -> str | None:
    """Why ``text`` is not a meaningful alt text for a figure (None when it is): a sentence of
    at least ``min_words`` words that says what the picture shows, not a file name."""
    words = re.findall(r"[A-Za-z][\w'-]*", text)
    if re.search(r"\.(png|svg|jpe?g|gif)\b|\b[0-9a-f]{16,}\b", text, re.I):
        return "looks like a file name: say what the picture shows"
    if len(words) < min_words:
        return f"has {len(words)} words: write a sentence of at least {min_words}"
    return None


def figure_outputs(cell: nbformat.NotebookNode) -> list[tuple[str, bytes]]:
    """(MIME type, bytes) of each figure among a code cell's outputs, in order."""
    found = []
    for out in cell.get("outputs", []):
        data = out.get("data") or {}
        kind = next((k for k in FIGURE_TYPES if k in data), None)
        if kind is None:
            continue
        value = data[kind]
        value = "".join(value) if isinstance(value, list) else value
        raw = value.encode() if kind == "image/svg+xml" else base64.b64decode(value)
        found.append((kind, raw))
    return found


def figure_key(kind: str, raw: bytes) -> str:
    """The name MyST-NB gives a figure's file (its SHA-256; an SVG as MyST-NB writes it)."""
    if kind == "image/svg+xml":
        raw = os.linesep.join(raw.decode().splitlines()).encode()
    return hashlib.sha256(raw).hexdigest()
