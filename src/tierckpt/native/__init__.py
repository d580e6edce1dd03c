"""The format tierckpt writes: metadata records and codecs, the layout of names and keys, regions.

Pure data and codecs: :mod:`.metadata` (records and their codecs, never pickled), :mod:`.records`,
:mod:`.layout` (names under a checkpoint root, the commit record), :mod:`.keys` (the one rule for a storage
key), :mod:`.regions` (which elements of a global tensor a piece holds).

May import: ``errors`` only (and itself). Everything else may import it.
"""
