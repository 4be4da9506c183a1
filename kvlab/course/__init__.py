"""The course around the engine: exercises and their checkers, solutions, references, pictures.

    check/             what a learner calls: kvlab.check.<exercise>, hint, choose, progress, recheck
    exercises/         each chapter's exercises: cases and checkers (chNN_*.py)
    checking/          the machinery that runs a check: cases, the sandbox, diagnoses, progress
    solutions          reference solutions, shown on request (kvlab.solutions.show)
    reference/         plain-Python oracles that tests, checkers and chapters compare against
    scenes/            each chapter's small scenarios and the figures drawn from them
    viz/               pictures: page-table heatmaps, trees, regions, timelines
    widgets            the timeline explorer (chapter 07)
    colab              the setup cell that opens every chapter

``kvlab.check`` and ``kvlab.solutions`` are the learner's names for ``check/`` and ``solutions``.
"""
from __future__ import annotations

from ..base.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {}, ("check", "exercises", "checking", "solutions",
                                                   "reference", "scenes", "viz", "widgets", "colab"))
