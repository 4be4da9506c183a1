"""Each chapter's scenes: the small scenarios it builds on, and the figures drawn from them.

One module per chapter, ``kvlab/course/scenes/chNN_*.py``. A module holds the chapter's seeded
scenarios (small managers, batches and step histories that its notebook, its checker and its
figures share) and the functions that draw them. A function decorated with
``@figure("NN_name.png")`` (:mod:`kvlab.course.scenes.figure_registry`) builds one of the pictures in
``figures/`` (what README shows). ``make figures``, that is ``python -m kvlab.course.scenes figures/``
(:mod:`kvlab.course.scenes.render`), renders them all, deterministically.
"""
