"""The errors kvlab raises. Every message names the argument and the rule it broke."""
from __future__ import annotations


class KvlabError(Exception):
    """Base class of every kvlab error."""


class InvalidArgument(KvlabError, ValueError):
    """An argument broke a rule. Raised before any kernel launch; no state has changed."""

    def __init__(self, argument: str, rule: str, detail: str = ""):
        self.argument = argument
        self.rule = rule
        self.detail = detail
        msg = f"{argument}: {rule}"
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)

    def __reduce__(self):  # pickled with its own arguments (a checker's child process sends it back)
        return type(self), (self.argument, self.rule, self.detail)


class OutOfPages(KvlabError, RuntimeError):
    """Not enough free pages. Decided before any kernel reads the free list; no state has changed."""

    def __init__(self, needed: int, free: int, what: str = "allocation"):
        self.needed = needed
        self.free = free
        self.what = what
        super().__init__(
            f"out of pages: this {what} needs {needed} new page(s) but only {free} are free"
        )

    def __reduce__(self):
        return type(self), (self.needed, self.free, self.what)


class CacheMisuse(KvlabError, RuntimeError):
    """A prefix-cache or cache-manager call that breaks its protocol (e.g. unlocking twice)."""


class IntegrityError(KvlabError, AssertionError):
    """A memory-manager invariant is broken (a page lost, leaked or owned twice).

    ``row`` is the page-table row the broken invariant is about (``None`` when it is about no
    single row, e.g. a lost page), so a caller can say which request broke it without reading
    the message.
    """

    def __init__(self, message: str, *, row: int | None = None):
        self.row = row
        super().__init__(message)

    def __reduce__(self):  # (``row`` is keyword-only: it travels as state)
        return type(self), (self.args[0],), {"row": self.row}
