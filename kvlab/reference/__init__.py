"""Plain-Python oracles: the slow, obviously-right versions of every kernel and data structure.

Tests, exercise checkers and notebooks all compare against these. They use Python lists
and loops on purpose: nothing clever, so that a reader can check them by eye.
"""
