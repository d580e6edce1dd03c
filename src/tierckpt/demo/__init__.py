"""The ``tierckpt demo`` job and the small model it trains.

May import: ``tierckpt``'s public names, ``monitor``, ``backends``; only ``cli`` imports it.
"""
