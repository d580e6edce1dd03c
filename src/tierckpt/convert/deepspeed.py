"""``tierckpt convert --from deepspeed|ucp``: a DeepSpeed checkpoint saved as a tierckpt checkpoint.

The source is read in place (:mod:`tierckpt.formats.deepspeed`, :mod:`tierckpt.formats.ucp`) into full
CPU tensors and objects, in this process, and saved under the same keys (``model.<fqn>``,
``optim.state.<fqn>.<name>``, ``optim.param_groups.<fqn>.<setting>``), so the converted checkpoint
loads into ``{"model": model, "optim": optimizer}`` as the DeepSpeed folder does, with checksums.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tierckpt.convert.report import ConvertReport
from tierckpt.errors import CheckpointError
from tierckpt.loading.api import read_state
from tierckpt.formats.select import read_checkpoint
from tierckpt.saving.api import save
from tierckpt.store import open_store

SOURCES = {"deepspeed": "zero", "ucp": "universal"}
"""``--from`` name -> what the ``deepspeed`` header tag of such a source starts with."""


def from_deepspeed(
    src: str, uri: str, *, source: str = "deepspeed", storage_options: Mapping[str, Any] | None = None,
) -> ConvertReport:
    """Save the DeepSpeed ZeRO folder (``source="deepspeed"``) or universal checkpoint (``"ucp"``)
    at ``src`` as a tierckpt checkpoint at ``uri``."""
    ckpt = read_checkpoint(open_store(src, dict(storage_options or {})), accept_foreign=True)
    found = ckpt.meta.tags.get("deepspeed", "")
    if not found.startswith(SOURCES[source]):
        what = f"a DeepSpeed {found} checkpoint" if found else f"not a DeepSpeed checkpoint ({', '.join(ckpt.meta.frameworks) or 'tierckpt'})"
        right = next((name for name, tag in SOURCES.items() if found.startswith(tag)), None) if found else None
        fix = f"; use --from {right}" if right else ""
        raise CheckpointError(f"convert --from {source}: {src!r} is {what}{fix}")
    state = read_state(src, storage_options=storage_options)
    save(uri, state, storage_options=storage_options)
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
    report = ConvertReport(source=src, output=uri, to="tierckpt", files=[uri])
    report.tensors, report.tensor_bytes = len(tensors), sum(t.nbytes for t in tensors)
    report.objects = len(state) - len(tensors)
    return report
