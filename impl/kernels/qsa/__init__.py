"""Fast paths of the QSA sparse-attention ops (spec/ops/qsa.py)."""
