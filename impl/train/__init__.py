"""Training of the tiny checkpoint: a batched, differentiable form of spec/model.py (``model``), the
task mixture (``data``) and the resumable two-phase loop (``train_tiny``). docs/training.md explains
the choices."""
