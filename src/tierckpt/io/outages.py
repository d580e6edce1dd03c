"""Services that answered nothing through a whole retry sequence: later calls to them try once.

A store that is down (every request 503, refused or timed out) costs each scheduled call a full retry
sequence — five attempts and their backoff, about a second. Callers that make several calls in a row
(``tierckpt ls`` and ``status``, the manager's ``load_latest``, a write-back save reading the remote's
``COMMIT`` before falling back to the node's view) then took five to ten seconds to learn what the
first call already knew. :class:`Outages` remembers it per *service* (what answers a store's requests:
an S3 endpoint and bucket, a file system; :attr:`tierckpt.backends.base.Backend.service`): once a call
has failed through all its attempts with transient errors, later calls to that service make one
attempt, until any call gets an answer — a success, or a definite error such as "not found", which only
a reachable service gives — or until the mark is :data:`HOLD_S` old: then the next call retries in full
again (and marks the service anew if it fails), so a long outage costs one retry sequence per
:data:`HOLD_S`, and a mark never outlives what the process knows.

This is the retry quota of botocore's standard mode at its simplest: retries are spent where they can
help. Throttling (S3's ``SlowDown``) lets some requests through, and each one that passes lifts the
mark; background write-downs retry through outages on their own schedule in any case.

Used on the I/O scheduler's loop only (one thread), so it holds no lock.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)

HOLD_S = 30.0
"""How long a mark limits calls to one attempt without being renewed by a full retry sequence."""


class Outages:
    """The services marked down, with when each was marked (see the module docstring)."""

    def __init__(self, hold_s: float = HOLD_S) -> None:
        self.hold_s = hold_s
        self._down: dict[str, float] = {}
        """Service -> when it was marked (monotonic seconds)."""

    def is_down(self, service: str) -> bool:
        """Whether calls to ``service`` make one attempt now."""
        marked = self._down.get(service)
        return marked is not None and time.monotonic() - marked < self.hold_s

    def attempts(self, service: str | None, retries: int) -> int:
        """How many attempts a call to ``service`` may make: ``retries``, or one while it is marked down."""
        return 1 if service is not None and self.is_down(service) else retries

    def exhausted(self, service: str | None, attempts: int, why: str) -> None:
        """A call to ``service`` failed with transient errors on each of its ``attempts``: mark it down
        (a single attempt does not: it was already down, or its caller asked for no retries)."""
        if service is None or attempts < 2:
            return
        if service not in self._down:
            log.warning("%s answered nothing through %d attempts (%s); its next calls try once until one is "
                        "answered", service, attempts, why)
        self._down[service] = time.monotonic()

    def answered(self, service: str | None) -> None:
        """``service`` answered a call (with a result or a definite error): retry in full again."""
        if service is not None and self._down.pop(service, None) is not None:
            log.info("%s answers again", service)
