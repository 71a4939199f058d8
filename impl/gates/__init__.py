"""This target's side of the accuracy gates (``[tool.certify] gate_target``): the trained tiny
checkpoint run through the engine on the evaluation sets of impl/tasks."""
