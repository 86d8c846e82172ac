"""Each test file's seconds, from pytest's ``--durations=0`` report on standard input, as ``tests/durations.json``.

``make durations`` runs the suite once and writes the table; ``tests/conftest.py`` orders files longest first
with it, so that the two processes of ``make test`` finish together. A stale table only makes the run less even.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^\s*([\d.]+)s (?:setup|call|teardown)\s+([^:\s]+)::")


def per_file(lines: list[str]) -> dict[str, float]:
    seconds: dict[str, float] = defaultdict(float)
    for line in lines:
        match = LINE.match(line)
        if match:
            seconds[match.group(2)] += float(match.group(1))
    return {name: round(s, 1) for name, s in sorted(seconds.items(), key=lambda kv: -kv[1])}


def main() -> None:
    table = per_file(sys.stdin.read().splitlines())
    if not table:
        sys.exit("no --durations=0 lines on standard input: run pytest with --durations=0")
    out = Path(__file__).resolve().parent.parent / "tests" / "durations.json"
    out.write_text(json.dumps(table, indent=1) + "\n")
    print(f"{out}: {len(table)} files, {sum(table.values()):.0f} s in all")


if __name__ == "__main__":
    main()
