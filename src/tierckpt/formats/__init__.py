"""Checkpoints read in place, behind one protocol: native, torch DCP, DeepSpeed (ZeRO, UCP), safetensors.

:mod:`.reader` is the :class:`~.reader.CheckpointReader` protocol every reader gives the loader;
:mod:`.select` chooses the reader once, from what the directory holds; :mod:`.native` reads tierckpt's own
metadata; :mod:`.objects` encodes and decodes saved objects; :mod:`.verify` checks a checkpoint offline.
Every byte read here is untrusted (a name is a key, never a path; a foreign pickle is hostile).

May import: errors and the other shared low-level modules, ``store``, ``native``, ``state`` (optimizer
naming), ``io``, ``backends``. Never ``saving``, ``loading``, ``cli``, ``convert``, ``node``.
"""
