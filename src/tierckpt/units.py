"""Byte sizes written by people: the one parser, for environment variables, ``CacheConfig`` and the CLI.

The rule (docs/cli.md, "Byte sizes"): a number, optionally with a fraction, then an optional unit,
case-insensitive, spaces allowed around them.

* no unit or ``B``: bytes;
* ``K``, ``M``, ``G``, ``T``, ``P`` and ``KiB``, ``MiB``, ``GiB``, ``TiB``, ``PiB``: binary
  (``10G`` = ``10GiB`` = 10 * 2**30), as cache budgets are usually meant;
* ``KB``, ``MB``, ``GB``, ``TB``, ``PB``: decimal (``5GB`` = 5 * 10**9), as storage vendors and
  safetensors shard sizes mean them.

A fraction is rounded down to whole bytes (``1.5K`` = 1536). Anything else raises
:class:`~tierckpt.errors.CheckpointError` naming the setting, the value and the accepted forms.
"""

from __future__ import annotations

import re
from decimal import Decimal

from tierckpt.errors import CheckpointError

_PREFIXES = "KMGTP"
UNITS: dict[str, int] = {
    "": 1,
    "B": 1,
    **{p: 1024 ** (i + 1) for i, p in enumerate(_PREFIXES)},
    **{f"{p}IB": 1024 ** (i + 1) for i, p in enumerate(_PREFIXES)},
    **{f"{p}B": 1000 ** (i + 1) for i, p in enumerate(_PREFIXES)},
}
"""Upper-case unit -> bytes it stands for."""

_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*")


def parse_bytes(value: str | int, what: str = "size", *, minimum: int = 0) -> int:
    """The number of bytes ``value`` stands for (``"10G"`` -> ``10 * 2**30``, ``"5GB"`` -> ``5 * 10**9``).

    ``value`` is a string in the form of the module docstring or a non-negative ``int`` (bytes).
    ``what`` names the setting in errors (``"TIERCKPT_CACHE_BYTES"``); a result below ``minimum``
    is an error too.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise CheckpointError(f"{what} must be a byte count or a string such as '512M', got {value!r}")
    if isinstance(value, int):
        nbytes = value
    else:
        match = _SIZE.fullmatch(value)
        unit = match.group(2).upper() if match else None
        if match is None or unit not in UNITS:
            raise CheckpointError(
                f"cannot read {what} {value!r} as a byte size: write a number with an optional unit, "
                "e.g. '1000000', '512M' or '10GiB' (binary: K, M, G, T, P, KiB ... PiB) or '5GB' "
                "(decimal: KB, MB, GB, TB, PB)"
            )
        nbytes = int(Decimal(match.group(1)) * UNITS[unit])
    if nbytes < minimum:
        floor = "must not be negative" if minimum == 0 else f"must be at least {minimum} byte(s)"
        raise CheckpointError(f"{what} {floor}, got {value!r}")
    return nbytes
