"""What a restricted unpickler hands a foreign pickle: stand-ins the pickle cannot turn against the process.

A restricted unpickler admits a few globals (DCP's metadata classes, ``pathlib`` paths, tensor rebuild
functions), but a pickle can do more with a global than call it: ``BUILD`` sets attributes on whatever
is on its stack, the admitted class or function included. Handed the real ``pathlib.PurePosixPath``,
a crafted ``.metadata`` could rebind its methods for the whole process. So an unpickler hands out
:func:`sealed` stand-ins, made per unpickler:

* a class tierckpt defines or imports (a heap type) becomes a fresh subclass whose metaclass refuses
  attribute assignment: ``NEWOBJ`` still builds instances, which pass ``isinstance`` checks;
* a function (or a class that is only called, ``REDUCE``) becomes a :class:`Constructor`, a slotted
  object that calls it and refuses every assignment;
* what the interpreter already keeps immutable (``int``, ``tuple``, ``torch.Size``, dtypes) is handed
  out as itself.

Any attempt to assign raises :class:`~tierckpt.errors.CorruptCheckpointError`: no admitted global is
changed, and the file is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tierckpt.errors import CorruptCheckpointError

_IMMUTABLE_TYPE = 1 << 8
"""``Py_TPFLAGS_IMMUTABLETYPE``: a type whose attributes cannot be assigned (builtins, ``torch.Size``)."""


def _refuse(target: Any, name: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"the pickle sets {name!r} on {target!r}, a global it may only call or instantiate (a crafted file?)"
    )


class _SealedType(type):
    """Metaclass of sealed subclasses: their attributes cannot be assigned or deleted."""

    def __setattr__(cls, name: str, value: Any) -> None:
        raise _refuse(cls, name)

    def __delattr__(cls, name: str) -> None:
        raise _refuse(cls, name)


class Constructor:
    """Calls one admitted function or class on the pickle's arguments; it holds nothing that can be reassigned."""

    __slots__ = ("_build",)

    def __init__(self, build: Callable[..., Any]) -> None:
        object.__setattr__(self, "_build", build)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._build(*args, **kwargs)

    def __setattr__(self, name: str, value: Any) -> None:
        raise _refuse(self._build, name)

    def __delattr__(self, name: str) -> None:
        raise _refuse(self._build, name)

    def __repr__(self) -> str:
        return f"<{getattr(self._build, '__qualname__', self._build)!r} as read from a pickle>"


def sealed_class(cls: type, name: str | None = None, **namespace: Any) -> type:
    """A fresh subclass of ``cls`` named ``name`` (``cls``'s by default) whose attributes cannot be
    assigned; ``namespace`` may override methods (e.g. a ``__setstate__`` that builds from values
    tierckpt checks)."""
    namespace.setdefault("__module__", cls.__module__)
    namespace.setdefault("__qualname__", name or cls.__qualname__)
    return _SealedType(name or cls.__name__, (cls,), namespace)


def sealed(value: Any) -> Any:
    """The stand-in an unpickler hands out for the admitted global ``value`` (see the module docstring)."""
    if isinstance(value, type):
        return value if value.__flags__ & _IMMUTABLE_TYPE else sealed_class(value)
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format, Constructor)) or (
            isinstance(value, tuple) and not hasattr(value, "__dict__")):
        return value  # no attribute of these can be assigned (a named tuple declaring no slots included)
    if callable(value):
        return Constructor(value)
    raise TypeError(f"{value!r} cannot be handed to a pickle: it is neither a class, a function nor immutable")


class SealedGlobals:
    """One unpickler's stand-ins: each admitted global sealed once, on first use (``admitted`` maps
    ``(module, name)`` to the real global)."""

    def __init__(self, admitted: dict[tuple[str, str], Any]) -> None:
        self._admitted = admitted
        self._handed: dict[tuple[str, str], Any] = {}

    def get(self, module: str, name: str) -> Any | None:
        """The stand-in for ``module.name``; ``None`` when it is not admitted."""
        key = (module, name)
        if key not in self._handed:
            if key not in self._admitted:
                return None
            self._handed[key] = sealed(self._admitted[key])
        return self._handed[key]
