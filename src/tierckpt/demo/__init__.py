"""The ``tierckpt demo`` job and the small model it trains."""
