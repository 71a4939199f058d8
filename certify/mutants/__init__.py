"""``certify mutants``: how many plausible bugs an op's own tests catch.

Each op's cell file lists plausible bugs (``mutants:``, ``certify.catalog.mutants``): an exact edit of a
variant or spec module with a one-line description. ``plan`` turns each into a job (the mutated source,
the op's cells that read the module and its guard and property tests, cheapest first), ``generic``
adds operator mutations of the variants' code made by cosmic-ray (the ``mutants`` extra), ``hints``
puts first each mutant's killer in the last report, ``runner`` runs them on copies, never in the
working tree, each in a child (``worker``) forked from a warm process (``warm``, driven by ``pool``)
that imported torch, Triton and pytest once, and ``report`` writes the op's score and survivors
(``reports/mutants/<op>.json``, ``reports/mutants/summary.md``) that the op notes and the coverage
report show. ``cli`` is the command.
"""
