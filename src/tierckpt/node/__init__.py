"""The node tiers end to end: the write-back engine here, the node disk cache (:mod:`.disk`) and the
node memory tier with its peer replicas (:mod:`.memory`) below it. :mod:`.host` says which node this is.

A checkpoint written through the chain lands in its top link first and is written down behind::

    save ──► MemoryLink (tmpfs, .memory)  ── write-down ──►  TieredBackend (node disk, .disk)
                 │ journal: memory.downlog (append log)         │ journal: disk.catalog (LMDB)
                 │                                              └── upload ──► the URI's backend
                 └── replicas ──► peer nodes' tmpfs

The engine's shared parts live at this package's top:

* :mod:`.levels`: :class:`~.levels.Level`, the one level type (``staged``, ``memory``, ``replicated``,
  ``local``, ``remote``) that every status, the saver's ``wait_for`` and the CLI speak.
* :mod:`.journal`: the journal protocol both links' journals answer, and :func:`~.journal.pid_alive`.
* :mod:`.durability`: the one durability answer (:class:`~.durability.Durable`, :func:`~.durability.durability_of`)
  and the one durability wait (:func:`~.durability.wait_owed`) each link's ``wait_durable`` runs over its journal.
* :mod:`.status`: :class:`~.status.StoreStatus` and :class:`~.status.LinkStatus`, what a link reports.
* :mod:`.drain`: the one exit drain; each link kind registers its write-behind.
* :mod:`.lifecycle`: the one place the node package registers with a fork's child, the process's exit
  and the default group's destruction; its modules register their handlers there.
* :mod:`.nodeview`: a write-back commit's check of ``expected`` against the node's view (:func:`~.nodeview.check_node_view`).
* :mod:`.written`: size and CRC-32C of the bytes a link lands on the node (:class:`~.written.CrcWriter`).
* :mod:`.copy`: the one checked copy of a file down a link (:func:`~.copy.copy_checked`).
* :mod:`tierckpt.backends.retry`: the one retry rule (:class:`~tierckpt.backends.retry.RetryPolicy`) pacing both
  links' attempts, and every request's retries below them.
* :mod:`.runner`: the one task runner (:class:`~.runner.TaskRunner`), one write-behind task per key.
* :mod:`.link`: the write-back link core (:class:`~.link.WriteBackLink`): ``sync``, ``wait_durable``,
  ``withdraw`` and the delete below after a pending ``COMMIT``, written once; both links subclass it.

May import: ``errors``, the shared low-level modules (comm, deadline, units, monitor, progress),
``native``, ``io``, ``backends``. The engine modules here import neither ``disk`` nor ``memory``; those two
never import each other. Only ``store`` (which assembles the chain), ``cache_api``, ``saving``, ``loading``,
``manager`` and ``cli`` import the node package from above.
"""
