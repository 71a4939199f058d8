"""A generic certification framework: cells, oracles, receipts, reports. It names no model."""
