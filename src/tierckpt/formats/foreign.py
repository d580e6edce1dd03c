"""What a URI without a ``COMMIT`` record holds, for the error that says so (:func:`missing_commit_error`).

A root with uncommitted tierckpt generations (``g-*/...``) is a save that was interrupted or is still
running. Anything else is not a tierckpt checkpoint, and the error says what it looks like and what to do:
a CheckpointManager root (load one of its steps), a folder of checkpoints, a Hugging Face
``save_pretrained`` folder or a safetensors export (convert it), a DeepSpeed folder, ``torch.save`` files,
or any other folder. Load, verify, inspect and the CLI all come here through
:func:`tierckpt.formats.native.read_commit`.
"""

from __future__ import annotations

from collections.abc import Sequence

from tierckpt.native import layout
from tierckpt.errors import CheckpointError, CheckpointNotFoundError, IncompleteCheckpointError, NotACheckpointError

EXAMPLES = 3
"""How many names an error lists as examples."""


def missing_commit_error(uri: str, keys: Sequence[str]) -> CheckpointError:
    """The error for ``uri``, which has no ``COMMIT`` record, given every key under it (``keys``)."""
    if not keys:
        return CheckpointNotFoundError(f"no checkpoint at {uri!r} (no COMMIT record, and nothing is stored under it): check the path")
    if layout.generations_in(keys):
        return IncompleteCheckpointError(
            f"{uri!r} holds checkpoint data but no COMMIT record: a save was interrupted or is still running. "
            "Load an earlier checkpoint, or wait for the save to finish"
        )
    what, fix = _describe(uri.rstrip("/"), keys)
    return NotACheckpointError(f"{uri!r} is not a tierckpt checkpoint (it has no COMMIT record): it {what}. {fix}")


def _describe(uri: str, keys: Sequence[str]) -> tuple[str, str]:
    """``(what the folder looks like, what to do)``."""
    top = {k.split("/", 1)[0] for k in keys}
    names = [k.rsplit("/", 1)[-1] for k in keys]
    committed = sorted(p for p, found in layout.find_checkpoints(keys).items() if found.committed and p)
    steps = layout.by_step(p for p in committed if "/" not in p)
    if steps:
        latest = steps[max(steps)]
        return (f"is a CheckpointManager root holding {len(steps)} step checkpoint(s), {steps[min(steps)]} to {latest}",
                f"Load one of its steps, e.g. tierckpt.load('{uri}/{latest}', state), or use "
                f"CheckpointManager('{uri}').load_latest(state)")
    if committed:
        return (f"holds tierckpt checkpoints below it ({_examples(committed)})",
                f"Load one of them, e.g. tierckpt.load('{uri}/{committed[-1]}', state)")
    if "latest" in top and any(t.startswith("global_step") for t in top) and any(n.endswith("_model_states.pt") for n in names):
        return ("looks like a DeepSpeed checkpoint folder ('latest' and global_step*/ with *_model_states.pt)",
                "tierckpt.load reads a ZeRO folder in place (without verify=True); or convert it: "
                f"tierckpt convert --from deepspeed --to tierckpt {uri} OUT")
    safetensors = [k for k in keys if k.endswith(".safetensors")]
    convert = f"Convert it with: tierckpt convert --from safetensors --to tierckpt {uri} OUT"
    if safetensors and "config.json" in top:
        return f"looks like a Hugging Face save_pretrained folder (config.json and {_examples(safetensors)})", convert
    if safetensors:
        return f"holds safetensors files ({_examples(safetensors)})", convert
    pickles = [k for k in keys if k.endswith((".pt", ".pth", ".bin", ".ckpt"))]
    if pickles:
        return (f"holds torch.save files ({_examples(pickles)})",
                "Load them with torch.load, or save their state with tierckpt.save to make a tierckpt checkpoint")
    return (f"holds other files ({_examples(sorted(keys))})",
            "Check the path: a tierckpt checkpoint holds a COMMIT record and g-* generation directories")


def _examples(names: Sequence[str]) -> str:
    """Up to :data:`EXAMPLES` of ``names``, and how many more."""
    shown = ", ".join(names[:EXAMPLES])
    return shown if len(names) <= EXAMPLES else f"{shown} and {len(names) - EXAMPLES} more"
