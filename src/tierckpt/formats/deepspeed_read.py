"""The two DeepSpeed readers' parts, registered in :data:`tierckpt.formats.select.FOREIGN`: a ZeRO folder
(:mod:`tierckpt.formats.deepspeed`) and a universal checkpoint (:mod:`tierckpt.formats.ucp`), each
recognised from the root's listing, read in place when the caller accepts a foreign format, and
refused with the ``convert`` command otherwise (``verify=True``: DeepSpeed writes no checksums).

A universal tag folder (``zero/optimizer_state.pt``) is read as one; a folder with both ``latest`` and
``latest_universal`` (``ds_to_universal`` writes the latter beside the training folder's tags) is read
through ``latest``, the engine's newest save, as DeepSpeed loads it by default: a universal checkpoint
made earlier may be older. Its tag folder loads by itself.
"""

from __future__ import annotations

from tierckpt.formats import deepspeed as deepspeed_format
from tierckpt.formats import ucp as ucp_format
from tierckpt.backends import Backend
from tierckpt.formats.reader import Root
from tierckpt.io.scheduler import get_scheduler

ZERO_FORMAT = "DeepSpeed ZeRO"
UNIVERSAL_FORMAT = "DeepSpeed universal"


def holds_zero(root: Root) -> bool:
    """A ZeRO checkpoint folder (or one of its tag folders), not a universal one."""
    keys = root.keys
    return ucp_format.OPTIMIZER_STATE not in keys and deepspeed_format.is_deepspeed(root.backend, keys)


def holds_universal(root: Root) -> bool:
    """A universal checkpoint folder, or the folder whose ``latest_universal`` names one."""
    return ucp_format.is_ucp(root.backend, list(root.keys))


def read_zero(backend: Backend) -> deepspeed_format.DeepSpeedCheckpoint:
    return deepspeed_format.read_deepspeed(backend)


def read_universal(backend: Backend) -> ucp_format.UcpCheckpoint:
    return ucp_format.read_ucp(backend, list(get_scheduler().run(backend.list(""))))


def zero_refusal(uri: str) -> str:
    return _refusal(uri, "ZeRO", "deepspeed")


def universal_refusal(uri: str) -> str:
    return _refusal(uri, "universal", "ucp")


def _refusal(uri: str, kind: str, source: str) -> str:
    """The message for an operation that needs a tierckpt checkpoint but found a DeepSpeed folder."""
    return (
        f"{uri!r} is a DeepSpeed {kind} checkpoint (no COMMIT record), not a tierckpt one. tierckpt.load reads it "
        "in place without verify=True (DeepSpeed records no checksums); for anything else convert it: "
        f"tierckpt convert --from {source} --to tierckpt {uri} OUT"
    )
