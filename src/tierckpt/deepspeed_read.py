"""Which DeepSpeed reader, if any, reads a folder without a ``COMMIT`` record (used by :mod:`tierckpt.meta_read`).

A ZeRO folder (:mod:`tierckpt.deepspeed_format`) and a universal checkpoint
(:mod:`tierckpt.ucp_format`) load in place when the caller accepts a foreign format, and are refused
with the ``convert`` command otherwise (``verify=True``: DeepSpeed writes no checksums).
"""

from __future__ import annotations

from .backends import Backend
from .errors import CheckpointError
from .io.scheduler import get_scheduler
from .store import without_node_cache
from . import deepspeed_format, ucp_format



def refusal(uri: str, kind: str) -> str:
    """The message for an operation that needs a tierckpt checkpoint but found a DeepSpeed folder."""
    source = "ucp" if kind == "universal" else "deepspeed"
    return (
        f"{uri!r} is a DeepSpeed {kind} checkpoint (no COMMIT record), not a tierckpt one. tierckpt.load reads it "
        "in place without verify=True (DeepSpeed records no checksums); for anything else convert it: "
        f"tierckpt convert --from {source} --to tierckpt {uri} OUT"
    )


def read_if_deepspeed(backend: Backend, accept: bool) -> deepspeed_format.DeepSpeedCheckpoint | None:
    """``(meta, tensors, pieces)`` of the DeepSpeed folder at the root of ``backend``, ``None`` when it is none.

    A universal tag folder (``zero/optimizer_state.pt``) is read as one; a folder with both ``latest`` and
    ``latest_universal`` (``ds_to_universal`` writes the latter beside the training folder's tags) is
    read through ``latest``, the engine's newest save, as DeepSpeed loads it by default: a universal
    checkpoint made earlier may be older. Its tag folder loads by itself."""
    plain = without_node_cache(backend)
    keys = get_scheduler().run(plain.list(""))
    if ucp_format.OPTIMIZER_STATE not in keys and deepspeed_format.is_deepspeed(plain, keys):
        if not accept:
            raise CheckpointError(refusal(backend.root_uri, "ZeRO"))
        return deepspeed_format.read_deepspeed(plain, keys)
    if ucp_format.is_ucp(plain, keys):
        if not accept:
            raise CheckpointError(refusal(backend.root_uri, "universal"))
        return ucp_format.read_ucp(plain, keys)
    return None
