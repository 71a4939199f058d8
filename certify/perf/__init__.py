"""Performance records and the check that dispatch picks a fast certified variant.

``records``: one measured time per (op, variant, arch, axes), written by the GPU's benchmark scripts
into ``<reports>/perf/<arch>.jsonl`` beside the receipts. ``dispatch``: at every shape the forward
reaches (the reach file), the variant the dispatch rules choose within a numerics tier is no more
than ``SLACK`` slower than the fastest variant certified for that tier there.
"""

from certify.perf.dispatch import SLACK, DispatchCheck, check_dispatch
from certify.perf.records import PerfRecord, load_perf, perf_dir, write_perf

__all__ = ["SLACK", "DispatchCheck", "PerfRecord", "check_dispatch", "load_perf", "perf_dir",
           "write_perf"]
