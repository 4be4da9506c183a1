"""The machinery that runs a check, below every chapter's exercises (floors in
:mod:`kvlab.course.check`'s docstring): failure types, the registry and saved progress, the
argument walker, guard bands and the load/store audit, the child processes and the sandbox,
read-only inputs, the GPU compile check, diagnoses of known slips, and ``core`` (``run_cases``,
``call_learner``, ``compare_flat``) on top.
"""
