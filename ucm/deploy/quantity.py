"""Kubernetes resource quantities ("16Gi", "500M", 1024) as byte counts."""

from __future__ import annotations

import re

_SUFFIX = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "Ki": 1 << 10,
    "Mi": 1 << 20,
    "Gi": 1 << 30,
    "Ti": 1 << 40,
    "Pi": 1 << 50,
}
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([kMGTP]i?|Ki)?$")


def quantity_bytes(value: int | str, where: str) -> int:
    """Bytes in a quantity; ``where`` names the field in the error."""
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{where}: must not be negative, got {value}")
        return value
    m = _QUANTITY.match(value.strip())
    if m is None or (m.group(2) or "") not in _SUFFIX:
        raise ValueError(f"{where}: {value!r} is not a byte quantity; write e.g. 16Gi, 512Mi, 2T or a number")
    return int(float(m.group(1)) * _SUFFIX[m.group(2) or ""])
