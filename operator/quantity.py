"""Kubernetes resource quantities ("2", "500m", "1.5", "1e3", "4Ki") as floats.

An autoscaling target is an int-or-string quantity, as an HPA's averageValue is. The
`kubernetes` package has a parser (kubernetes.utils.parse_quantity; the tests check this one
against it), but importing it loads the whole API client, which the slim operator image
does not install.
"""

from __future__ import annotations

import re

_SUFFIX = {
    "n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1.0, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
    "P": 1e15, "E": 1e18,
    "Ki": 2.0 ** 10, "Mi": 2.0 ** 20, "Gi": 2.0 ** 30, "Ti": 2.0 ** 40, "Pi": 2.0 ** 50,
    "Ei": 2.0 ** 60,
}
_QUANTITY = re.compile(
    r"^(?P<number>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
    r"(?:(?P<exp>[eE][+-]?[0-9]+)|(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?)$")


def parse_quantity(value: int | float | str) -> float:
    """Raises ValueError for anything that is not a Kubernetes quantity."""
    if isinstance(value, bool):
        raise ValueError(f"not a quantity: {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    m = _QUANTITY.match(str(value).strip())
    if m is None:
        raise ValueError(f"not a quantity: {value!r}")
    number = float(m.group("number") + (m.group("exp") or ""))
    return number * _SUFFIX[m.group("suffix") or ""]
