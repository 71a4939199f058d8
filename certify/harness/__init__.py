"""The harness: certifying one target (``target``: seeded inputs, the spec, the variant, the oracle),
the oracles (``oracles``), ``certify run`` over many (``runner``), the rollback replay oracle
(``replay``), the architectures (``archs``) and the peer packages a variant needs (``requirements``).
The package imports nothing: ``target`` and ``oracles`` are hashed into every receipt, and only what
they import joins them.
"""
