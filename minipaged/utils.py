"""Helpers every module needs: ceiling division, a checked integer argument, and the machine's RAM."""

from __future__ import annotations

import numbers
import os


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


def host_memory_bytes() -> int | None:
    """This machine's RAM in bytes (all of it, not what is free now); None where neither the OS (``sysconf``) nor
    psutil says. For checking a host-memory size asked for before anything of it is allocated."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name on this OS
        pass
    try:
        import psutil  # type: ignore[import-untyped]  # optional
    except ImportError:
        return None
    return int(psutil.virtual_memory().total)
