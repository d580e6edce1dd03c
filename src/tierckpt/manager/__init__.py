"""The checkpoint manager: a run's steps under one root (``CheckpointManager``).

:mod:`.api` is :class:`~.api.CheckpointManager` (save every N steps, ``load_latest``, the context manager);
:mod:`.retention` keeps and deletes steps (``keep_last``, ``keep_every``, best-k) and writes ``LATEST``;
:mod:`.best` ranks steps by a metric; :mod:`.durable` checks that each waited step's own ``COMMIT`` is on the
remote; :mod:`.preemption` turns SIGTERM into one agreed last save.

May import: ``saving``, ``loading``, ``formats``, ``store``, ``cache_api``, ``node``, ``native``, ``io``,
``backends`` and the shared top-level modules. Only ``integrations`` and ``cli`` import it.
"""

from tierckpt.manager.api import CheckpointManager

__all__ = ["CheckpointManager"]
