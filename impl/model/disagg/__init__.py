"""Disaggregated serving: a context engine reads prompts and hands each request's state to a
generation engine, which continues it.

- ``roles``: the transfer roles and the side-plane packing, as data that is the same on every
  tensor-parallel / attention-DP layout.
- ``handoff``: what a hand-off carries (exactly the request's state), ``extract`` on the context
  engine, ``adopt`` (checked first: ``TransferRejected``) on the generation engine.
"""
