"""What a conversion wrote and what it left out (:class:`ConvertReport`), shared by every ``tierckpt convert`` direction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

@dataclass(slots=True, kw_only=True)
class ConvertReport:
    """What a conversion wrote and what it left out."""

    source: str
    output: str
    to: str
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    tensor_bytes: int = 0
    objects: int = 0
    skipped_objects: list[str] = field(default_factory=list)
    skipped_tensors: int = 0
    """Tensors outside the prefix."""
    tied: dict[str, str] = field(default_factory=dict)
    """Tied copy -> its source: dropped by an export, restored by an import."""
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}

    def render(self) -> str:
        lines = [
            f"converted {self.source} -> {self.output} ({self.to}): {self.tensors} tensors ({self.tensor_bytes} bytes), "
            f"{self.objects} objects, {len(self.files)} file(s)"
        ]
        if self.skipped_tensors:
            lines.append(f"  skipped {self.skipped_tensors} tensor(s) outside the prefix")
        if self.skipped_objects:
            lines.append(f"  skipped {len(self.skipped_objects)} object(s): {', '.join(self.skipped_objects)}")
        verb = "dropped" if self.to == "safetensors" else "restored"
        lines += [f"  tied: {verb} {copy} (the same tensor as {source})" for copy, source in self.tied.items()]
        return "\n".join(lines)


# -- tierckpt -> safetensors (streaming) ----------------------------------------------------------------
