"""Generated test lists: which items run before a merge, after it, and on demand.

Inputs (all committed, so generation is deterministic and needs no test run):

- the item universe, ``<lists>/items.json``: every pytest item id with its declared tier, arch, the ops
  its guard / property markers name, its cell (op, variant, cell, arch) or gate (engine, tasks); written
  by ``pytest --collect-only -q --certify-items <lists>/items.json`` (``certify lists --collect``);
- the durations, ``<lists>/durations.json``: measured seconds per item (``pytest --record-durations``);
  an item without one gets an estimate from the budgets file and is flagged;
- the budgets file (``[tool.certify] budgets``): tier budgets, shard counts, estimates, risk weights;
- the reach file (``[tool.certify] reach``): which (op, variant) the forward reaches, on which arch.

Selection, per tier in order:

1. Mandatory pre-merge: every op's guard, and the cheapest cell item (on an arch of the pre-merge
   machine) of every reached (op, variant). Mandatory post-merge: the cheapest cell item of a reached
   (op, variant) on each reached arch the pre-merge machine lacks (e.g. ``sm_90``): a condition.
2. The other items the tier's machine can run (arch, GPUs; unmeasured items never pre-merge unless the
   budgets file says otherwise) are packed by an exact 0/1 knapsack (``scipy.optimize.milp``, HiGHS
   branch and bound, relative gap 0): the most risk within the budget left after the mandatory items.
   The solver's proven gap is reported.
3. What does not fit goes to the next tier; on-demand takes the rest. Inside each tier, LPT sharding.

Risk: each item exercises features (its op, its (op, variant), the variant on its arch, its cell, a
guard, a gate's engine settings and eval sets, a test's folder and file, keywords of its id); a
feature's weight is shared equally among the items that exercise it (see ``certify.lists.budgets``).

Modules: ``records`` (the lists' files read and written), ``risk`` (items with cost and risk),
``selection`` (mandatory items, the knapsack, LPT shards, the generator), ``render`` (the generated
lists, their report and the budget sweep), ``explain`` (why an item sits where it does).
"""

from __future__ import annotations

from certify.lists.explain import explain
from certify.lists.records import (DURATIONS_FORMAT, HEADER, ITEMS_FORMAT, LIST_FORMAT, TIERS,
                                   durations_text, item_record, items_text, list_ids, list_tiers,
                                   load_durations, load_items, record_durations, write_items)
from certify.lists.render import (consolidation, list_text, render_all, render_lists, report_svg,
                                  report_text, sweep)
from certify.lists.risk import Item, build_items, feature_weight_total
from certify.lists.selection import (Inputs, Selection, TierResult, generate, knapsack, load_inputs,
                                     lpt, select)

__all__ = ["DURATIONS_FORMAT", "HEADER", "ITEMS_FORMAT", "LIST_FORMAT", "TIERS", "Inputs", "Item",
           "Selection", "TierResult", "build_items", "consolidation", "durations_text", "explain",
           "feature_weight_total", "generate", "item_record", "items_text", "knapsack", "list_ids",
           "list_text", "list_tiers", "load_durations", "load_inputs", "load_items", "lpt",
           "record_durations", "render_all", "render_lists", "report_svg", "report_text", "select",
           "sweep", "write_items"]
