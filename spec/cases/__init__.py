"""Input builders: what each op's inputs look like at a cell's axis values.

A builder ``build(axes, gen, device) -> certify.harness.target.Case`` draws every tensor from ``gen`` (seeded
from the op and the cell by the framework), with realistic magnitudes and never all zeros.
"""
