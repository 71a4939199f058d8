"""The vision tower's fast paths (docs/spec.md, "Vision input")."""
