"""The write-back engine of the node tiers: one way to move committed files from a faster link to the one below.

A checkpoint written through the chain lands in its top link first and is written down behind::

    save ──► MemoryLink (tmpfs, tierckpt.tiers)  ── write-down ──►  TieredBackend (node disk, tierckpt.cache)
                 │ journal: tiers.downlog (append log)                 │ journal: cache.catalog (LMDB)
                 │                                                     └── upload ──► the URI's backend
                 └── replicas ──► peer nodes' tmpfs

Each link is configured on the engine's shared parts, which live here:

* :mod:`.levels`: :class:`~.levels.Level`, the one level type (``staged``, ``memory``, ``replicated``,
  ``local``, ``remote``) that every status, the saver's ``wait_for`` and the CLI speak.
* :mod:`.journal`: the journal protocol (:class:`~.journal.Journal`) both links' journals answer, and
  :func:`~.journal.pid_alive` (a key whose owner is gone is nobody's).
* :mod:`.durability`: the one durability answer (:class:`~.durability.Durable`, :func:`~.durability.durability_of`).
* :mod:`.status`: :class:`~.status.StoreStatus` and :class:`~.status.LinkStatus`, what a link reports.
* :mod:`.drain`: the one exit drain; each link kind registers its write-behind.
* :mod:`.written`: size and CRC-32C of the bytes a link lands on the node (:class:`~.written.CrcWriter`).
* :mod:`.copy`: the one checked copy of a file down a link (:func:`~.copy.copy_checked`), kernel-side into
  a :class:`~.copy.FileSink`; both links' copies down go through it.
* :mod:`.retry`: the one retry rule (:class:`~.retry.RetryPolicy`) pacing both links' attempts.
* :mod:`.runner`: the one task runner (:class:`~.runner.TaskRunner`): both links' write-behind tasks,
  one per key, each link plugging in its journal and its op's action as a :class:`~.runner.Job`.

The engine imports neither link package; they import it (``cache`` and ``tiers`` never import each other).
"""
