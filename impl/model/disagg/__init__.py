"""Disaggregated serving: a context engine reads prompts and hands each request's state to a
generation engine, which continues it.

- ``roles``: the transfer roles and the side-plane packing, as data that is the same on every
  tensor-parallel / attention-DP layout.
"""
