"""Best-k retention of a :class:`~tierckpt.CheckpointManager`: keep the ``keep_best`` steps whose metrics
score best by ``best_fn`` (Orbax's ``best_fn``/``best_mode``/``max_to_keep``).

The metrics of a save (``manager.save(step, state, metrics={...})``) are stored in the checkpoint's header
as the tag :data:`METRICS_TAG` (JSON), so a restarted job ranks the steps its previous self saved too;
this process remembers the scores of its own saves and reads the others' headers once. A step whose
metrics are unknown (saved without them, or a header that cannot be read) is never deleted by this rule.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

from tierckpt.errors import CheckpointError
from tierckpt.formats.select import read_checkpoint
from tierckpt.store import open_store

METRICS_TAG = "metrics"
"""The header tag holding a save's metrics (a JSON object)."""
BEST_MODES = ("max", "min")
log = logging.getLogger(__name__)


class BestSteps:
    """Scores steps by ``best_fn(metrics)`` and picks the ``keep_best`` best (``best_mode``: ``"max"`` or
    ``"min"``: whether a higher or a lower score is better)."""

    def __init__(self, best_fn: Callable[[Mapping[str, Any]], float], best_mode: str, keep_best: int) -> None:
        if best_mode not in BEST_MODES:
            raise CheckpointError(f"CheckpointManager(best_mode={best_mode!r}): use 'max' (a higher best_fn score "
                                  "is better, e.g. accuracy) or 'min' (lower is better, e.g. loss)")
        self.best_fn, self.best_mode, self.keep_best = best_fn, best_mode, keep_best
        self._scores: dict[str, float | None] = {}
        """Checkpoint URI -> its score (``None``: no metrics, or unreadable); a URI, so a step saved again
        under the same name is read again only if this process did not save it."""

    def tags_of(self, uri: str, metrics: Mapping[str, Any] | None) -> dict[str, str]:
        """The header tags that record ``metrics`` for the save to ``uri`` (none without metrics), after
        checking that ``best_fn`` scores them; the score is remembered for retention."""
        if metrics is None:
            self._scores[uri] = None
            return {}
        try:
            encoded = json.dumps(dict(metrics), sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"save of {uri!r}: metrics must be a JSON object of plain numbers and strings "
                                  f"(they are stored in the checkpoint's header): {exc}") from exc
        self._scores[uri] = self._score(uri, metrics)
        return {METRICS_TAG: encoded}

    def _score(self, uri: str, metrics: Mapping[str, Any]) -> float:
        try:
            score = float(self.best_fn(metrics))
        except Exception as exc:  # noqa: BLE001 - the caller's function: its error, named
            raise CheckpointError(f"save of {uri!r}: best_fn failed on the metrics {dict(metrics)!r}: {exc!r}") from exc
        if math.isnan(score):
            raise CheckpointError(f"save of {uri!r}: best_fn returned NaN for the metrics {dict(metrics)!r}; "
                                  "return a number that ranks the step")
        return score

    def kept(self, uris: Mapping[str, str], storage_options: Mapping[str, Any]) -> set[str]:
        """Of ``uris`` (name -> checkpoint URI), the names of the ``keep_best`` best scored steps and of every
        step without a score."""
        scores = {name: self._score_of(uri, storage_options) for name, uri in uris.items()}
        unscored = {name for name, score in scores.items() if score is None}
        scored = sorted(((score, name) for name, score in scores.items() if score is not None),
                        reverse=self.best_mode == "max")
        return unscored | {name for _, name in scored[:self.keep_best]}

    def _score_of(self, uri: str, storage_options: Mapping[str, Any]) -> float | None:
        """The remembered score of ``uri``, else the one its header's metrics give (``None``: none there)."""
        if uri not in self._scores:
            try:
                tags = read_checkpoint(open_store(uri, dict(storage_options))).meta.tags
                metrics = json.loads(tags[METRICS_TAG]) if METRICS_TAG in tags else None
                self._scores[uri] = None if metrics is None else self._score(uri, metrics)
            except (CheckpointError, ValueError, OSError) as exc:
                log.warning("%s: its metrics cannot be read (%s); best-k retention keeps it", uri, exc)
                return None  # not remembered: read again next time (the store may answer then)
        return self._scores[uri]
