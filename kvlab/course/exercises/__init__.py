"""Each chapter's exercises: their cases, checkers, hints and solutions (``chNN_<exercise>.py``).

A module registers its exercises with :func:`kvlab.course.checking.registry.exercise`; the
catalog (:mod:`kvlab.course.check.catalog`) loads every ``chNN_*`` module here by name, which
is all it takes for an exercise to appear in ``kvlab.check.progress()``.
"""
