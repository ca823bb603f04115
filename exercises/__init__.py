"""The course: one exercise per derivation with a backward (see README.md).

``exercises/NAME.py`` is the file you edit; ``exercises/course/NAME.py`` says how
``exercises/check.py`` checks it.
"""
