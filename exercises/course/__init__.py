"""How each exercise is checked: one module per exercise file, defining ``EXERCISE``
(an :class:`exercises.check.Exercise`), discovered by :func:`exercises.check.exercises`.
Modules whose name starts with ``_`` hold shared helpers and are not exercises."""
