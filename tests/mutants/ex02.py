"""Exercise 02 — free holes and fragmentation of a contiguous arena: wrong solutions a learner writes."""

from __future__ import annotations

from . import mutant

CHECKS = {"free_extents": ["check_free_extents"], "fragmentation": ["check_fragmentation"]}


def free_extents(num_slots: int, reservations: dict[str, tuple[int, int]]) -> list[tuple[int, int]]:
    """Correct (the solution's): part 2's mutants use it."""
    holes, position = [], 0
    for start, length in sorted(reservations.values()):
        if start > position:
            holes.append((position, start - position))
        position = start + length
    if position < num_slots:
        holes.append((position, num_slots - position))
    return holes


HELPERS = {"free_extents": free_extents}


# ---- part 1: free_extents ---------------------------------------------------------------------
@mutant("free_extents", "forgets the free run after the last reservation (the end of the arena)")
def no_trailing_hole(num_slots: int, reservations: dict[str, tuple[int, int]]) -> list[tuple[int, int]]:
    holes, position = [], 0
    for start, length in sorted(reservations.values()):
        if start > position:
            holes.append((position, start - position))
        position = start + length
    return holes  # MISTAKE: the gap between the last reservation and num_slots is a hole too


@mutant("free_extents", "walks the reservations in dict order, not sorted by start")
def unsorted(num_slots: int, reservations: dict[str, tuple[int, int]]) -> list[tuple[int, int]]:
    holes, position = [], 0
    for start, length in reservations.values():  # MISTAKE
        if start > position:
            holes.append((position, start - position))
        position = start + length
    if position < num_slots:
        holes.append((position, num_slots - position))
    return holes


@mutant("free_extents", "starts at the first reservation: misses a hole at the very start of the arena")
def no_leading_hole(num_slots: int, reservations: dict[str, tuple[int, int]]) -> list[tuple[int, int]]:
    spans = sorted(reservations.values())
    holes, position = [], spans[0][0] if spans else 0  # MISTAKE
    for start, length in spans:
        if start > position:
            holes.append((position, start - position))
        position = start + length
    if position < num_slots:
        holes.append((position, num_slots - position))
    return holes


@mutant("free_extents", "off by one: takes the last reserved slot (start + length - 1) for the first free one")
def off_by_one_end(num_slots: int, reservations: dict[str, tuple[int, int]]) -> list[tuple[int, int]]:
    holes, position = [], 0
    for start, length in sorted(reservations.values()):
        if start > position:
            holes.append((position, start - position))
        position = start + length - 1  # MISTAKE: start + length is already the first slot after it
    if position < num_slots:
        holes.append((position, num_slots - position))
    return holes


# ---- part 2: fragmentation --------------------------------------------------------------------
@mutant("fragmentation", "inclusive boundary: counts a hole exactly the next request's size as wasted")
def inclusive_boundary(
    num_slots: int, reservations: dict[str, tuple[int, int]], live_tokens: dict[str, int], next_request_size: int
) -> dict[str, float]:
    live = sum(live_tokens.values())
    reserved = sum(length for _, length in reservations.values())
    holes = free_extents(num_slots, reservations)
    return {
        "live": live,
        "internal": reserved - live,
        "external": sum(length for _, length in holes if length <= next_request_size),  # MISTAKE
        "free": num_slots - reserved,
        "utilisation": live / num_slots,
    }


@mutant("fragmentation", "utilisation over the reserved slots instead of the whole arena")
def utilisation_of_reserved(
    num_slots: int, reservations: dict[str, tuple[int, int]], live_tokens: dict[str, int], next_request_size: int
) -> dict[str, float]:
    live = sum(live_tokens.values())
    reserved = sum(length for _, length in reservations.values())
    holes = free_extents(num_slots, reservations)
    return {
        "live": live,
        "internal": reserved - live,
        "external": sum(length for _, length in holes if length < next_request_size),
        "free": num_slots - reserved,
        "utilisation": live / reserved if reserved else 0.0,
    }  # MISTAKE


@mutant("fragmentation", "external = every free slot outside the largest hole, whatever the next request needs")
def external_outside_largest(
    num_slots: int, reservations: dict[str, tuple[int, int]], live_tokens: dict[str, int], next_request_size: int
) -> dict[str, float]:
    live = sum(live_tokens.values())
    reserved = sum(length for _, length in reservations.values())
    holes = free_extents(num_slots, reservations)
    free = num_slots - reserved
    return {
        "live": live,
        "internal": reserved - live,
        "external": free - max((length for _, length in holes), default=0),  # MISTAKE
        "free": free,
        "utilisation": live / num_slots,
    }


@mutant("fragmentation", "free = slots not holding a live token (reserved-but-empty slots counted as free)")
def free_counts_empty_reserved(
    num_slots: int, reservations: dict[str, tuple[int, int]], live_tokens: dict[str, int], next_request_size: int
) -> dict[str, float]:
    live = sum(live_tokens.values())
    reserved = sum(length for _, length in reservations.values())
    holes = free_extents(num_slots, reservations)
    return {
        "live": live,
        "internal": reserved - live,
        "external": sum(length for _, length in holes if length < next_request_size),
        "free": num_slots - live,
        "utilisation": live / num_slots,
    }  # MISTAKE: free means not reserved
