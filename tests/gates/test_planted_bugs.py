"""The must-show on the trained checkpoint: each planted bug fails at least one gate (the gate named
here), while the unmodified model passes every gate (the gate items themselves). Skipped, with the
reason, until the trained checkpoint exists."""

from __future__ import annotations

import pytest

from certify.gating.judge import tier_families
from certify.gating.run import run_gate
from certify.gating.files import ReferenceStore, gate_settings, load_gates
from impl.gates.target import TARGET
from tests.gates.planted_bugs import BUGS

# bug -> the gate expected to catch it, and why
CATCHES = {
    "sink_block_dropped": "identity",        # a fifth of retrieval_512 asks for the sink block's record
    "gdn_state_reset_at_chunks": "identity",  # every prompt is read in 64-token chunks
    "verify_drops_bonus": "mtp3",            # the acceptance-length floor
}

pytestmark = [pytest.mark.postmerge,
              pytest.mark.skipif(TARGET.unavailable() is not None,
                                 reason=TARGET.unavailable() or "")]


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_each_planted_bug_fails_its_gate(bug):
    settings = gate_settings()
    gates = load_gates(settings.gates, TARGET).gates
    gate = gates[CATCHES[bug]]
    family = tier_families(gates.values())[gate.tier]     # the level the gate item runs at
    with BUGS[bug]():
        result = run_gate(gate, TARGET, ReferenceStore(settings.references), family=family)
    assert result.status == "failed", result.summary()
