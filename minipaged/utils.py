"""Two helpers every module needs: ceiling division and a checked integer argument."""

from __future__ import annotations

import numbers


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers, without floats: blocks needed for ``a`` tokens of ``b`` per block."""
    return -(-a // b)


def check_int(name: str, value: object, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` if it is an integer (not a bool) in ``[minimum, maximum]``; else a ValueError naming ``name``."""
    if type(value) is int:  # the common case, without the ABC check below (allocate_slots calls this per request)
        if (minimum is None or value >= minimum) and (maximum is None or value <= maximum):
            return value
    elif isinstance(value, numbers.Integral) and not isinstance(value, bool):
        number = int(value)
        if (minimum is None or number >= minimum) and (maximum is None or number <= maximum):
            return number
    if minimum == 1 and maximum is None:
        want = "a positive integer"
    elif minimum == 0 and maximum is None:
        want = "a non-negative integer"
    elif minimum is not None and maximum is not None:
        want = f"an integer from {minimum} to {maximum}"
    elif minimum is not None:
        want = f"an integer >= {minimum}"
    elif maximum is not None:
        want = f"an integer <= {maximum}"
    else:
        want = "an integer"
    raise ValueError(f"{name} must be {want}, got {value!r}")
