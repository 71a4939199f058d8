"""What an op's calling contract admits, as the adversarial and metamorphic checks read it: the
``harness:`` section of its cell file.

The section lives outside the cell-file schema of ``certify.catalog.schema`` so that it enters the
harness's own hash (``harness_hash``), recorded in each receipt's ``harness`` record, and never the
content hash of the numerical receipt: a change here re-runs the checks without staling the numbers.

```yaml
harness:
  rows:                 # the rows of one launch, for the batch-invariance checks
    inputs: [x, slots]  # the inputs whose dim 0 is the row (default: those sized like the outputs' dim 0)
    outputs: [out]      # the outputs whose dim 0 is the row (default: every output, in place or not)
  no_rows: why          # instead of rows: the op has no row axis (its claim is checked nowhere)
  views: [x]            # inputs the contract admits as non-contiguous, offset views (default: none)
```
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from certify.files.problem import FileProblem
from certify.files.yamlfile import first_problem

SECTION = "harness"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Rows(_Strict):
    """Which tensors of a call carry the launch's rows in their dim 0."""

    inputs: tuple[str, ...] | None = Field(None, description=(
        "inputs whose dim 0 is the row; default: the tensors whose dim 0 equals the outputs'"))
    outputs: tuple[str, ...] | None = Field(None, description=(
        "outputs (in-place ones included) whose dim 0 is the row; default: those sized like the "
        "others' dim 0; the rest are shared (one buffer the rows write into)"))


class HarnessContract(_Strict):
    rows: Rows = Rows()
    no_rows: str | None = Field(None, min_length=10, description=(
        "why the op's launch has no row axis: its batch-invariance claim is not checked"))
    views: tuple[str, ...] = Field((), description=(
        "inputs whose non-contiguous, offset views the variants must take; default: none (the "
        "contract admits only contiguous tensors)"))

    @model_validator(mode="after")
    def _one_of(self) -> "HarnessContract":
        if self.no_rows and (self.rows.inputs is not None or self.rows.outputs is not None):
            raise ValueError("declare either rows or no_rows, not both")
        return self


DEFAULT = HarnessContract()
# OpFile id -> (the OpFile, its contract): the OpFile kept alive so that its id is never reused.
_CONTRACTS: dict[int, tuple[object, HarnessContract]] = {}


def parse(path: Path, data: object, lines: dict[tuple, int]) -> HarnessContract:
    """The ``harness:`` section of the cell file ``path``; ``FileProblem`` naming file, line and
    field otherwise."""
    if data is None:
        return DEFAULT
    try:
        return HarnessContract.model_validate(data)
    except ValidationError as e:
        shifted = {k[1:]: v for k, v in lines.items() if k[:1] == (SECTION,)}
        line, fld, msg = first_problem(e, shifted)
        raise FileProblem(path, line if fld != "(file)" else lines.get((SECTION,), 1),
                          f"{SECTION}.{fld}" if fld != "(file)" else SECTION, msg) from None


def register(op: object, contract: HarnessContract) -> None:
    _CONTRACTS[id(op)] = (op, contract)


def contract_of(op: object) -> HarnessContract:
    """The contract loaded with ``op``'s cell file (the default for an op built otherwise)."""
    entry = _CONTRACTS.get(id(op))
    return entry[1] if entry is not None and entry[0] is op else DEFAULT


def harness_hash(op: object) -> str:
    """The code of the checks (``certify.harness.checks`` and the project modules it imports) and
    the op's contract: what a receipt's harness verdicts depend on beside its numerical hash."""
    from certify.receipts.codehash import module_closure  # noqa: PLC0415 (avoids an import cycle)

    parts = {"code": module_closure("certify.harness.checks"),
             "contract": contract_of(op).model_dump(mode="json")}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]
