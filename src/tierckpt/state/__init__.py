"""Torch objects <-> entries: adapters, entries, optimizer naming, training state.

:mod:`.adapters` flattens what the user passes (modules, optimizers, DTensors, flat shards) into
:mod:`.entries`; :mod:`.optim` and :mod:`.optim_groups` name optimizer state in both torch DCP conventions;
:mod:`.training` holds RNG streams, the resumable sampler and the multi-source reader.

May import: ``errors``, ``native``. No I/O, no storage.
"""
