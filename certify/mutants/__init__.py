"""``certify mutants``: how many plausible bugs an op's own tests catch.

Each op's cell file lists plausible bugs (``mutants:``, ``certify.catalog.mutants``): an exact edit of a
variant or spec module with a one-line description. ``plan`` turns each into a job (the mutated source,
the op's cells that read the module and its guard and property tests, cheapest first), ``generic``
adds operator mutations of the variants' code made by cosmic-ray (the ``mutants`` extra), ``runner``
runs them in worker processes (``worker``) on copies, never in the working tree, and ``report``
writes the op's score and survivors (``reports/mutants/<op>.json``, ``reports/mutants/summary.md``)
that the op notes and the coverage report show. ``cli`` is the command.
"""
