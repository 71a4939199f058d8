"""Receipts: the record of one certification (``store``), the content hash that keeps it honest
(``codehash``), and ``certify verify``, which re-runs receipts (``verify``).
"""
