"""The executable specification of the Flash-Next target.

Every function here is plain PyTorch, readable first and fast never. docs/spec.md is the prose
definition; where it is silent or ambiguous, the function's docstring says what this package decided
and a property test pins the choice.

Numerics convention (one rule for every op, see spec/numerics.py):
- A spec function computes in ``acc_dtype(*inputs)``: float64 when any floating input is float64,
  otherwise float32 (docs/spec.md, "Notation and numerics": fp32 accumulation unless stated).
- The rounding points of docs/spec.md (a cast to bf16, the storage of a state in bf16, a quantiser)
  are written out with ``round_to(x, dtype)``. In float64 mode the *activation* rounding points
  become identities, so the same function gives the ideal result a tolerance oracle compares against;
  quantisers (fp8, nvfp4) always round, because their rounding is the op.
- Inputs are never modified; every function returns new tensors.
"""
