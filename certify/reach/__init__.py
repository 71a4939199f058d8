"""Reach: what the forward really calls, and what the catalog promises about it.

``tracing`` runs the target's tracer over the scenarios (``scenarios`` loads them) and reads and
writes the reach file; ``claims`` checks the catalog's cells against it. The names most callers need
are re-exported here.
"""

from certify.reach.tracing import (AxisReach, CallRecord, Mode, ModeRecord, ModeTrace, ReachFile,
                                   ScenarioRecord, Tracer, TraceRun, VariantReach, build_reach,
                                   load_reach, load_tracer, reach_text, run_trace, summarise,
                                   trace_modes)

__all__ = ["AxisReach", "CallRecord", "Mode", "ModeRecord", "ModeTrace", "ReachFile",
           "ScenarioRecord", "TraceRun", "Tracer", "VariantReach", "build_reach", "load_reach",
           "load_tracer", "reach_text", "run_trace", "summarise", "trace_modes"]
