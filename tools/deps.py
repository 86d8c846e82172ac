"""Print the project's dependencies (``pyproject.toml``, the single source), one per line, leaving out the names
given: ``make setup TORCH=system`` installs the rest beside the machine's own torch and Triton.

    python tools/deps.py [--extra dev] [--except torch,triton]
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def requirements(extras: list[str], leave_out: set[str]) -> list[str]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    reqs = list(project["dependencies"])
    todo = list(extras)
    while todo:  # an extra may name another of this project's ("minipaged[course]")
        for req in project["optional-dependencies"][todo.pop(0)]:
            own = re.fullmatch(rf"{project['name']}\[([a-z0-9_,-]+)\]", req)
            if own:
                todo += own.group(1).split(",")
            elif req not in reqs:
                reqs.append(req)
    name = re.compile(r"^[A-Za-z0-9_.-]+")
    return [r for r in reqs if (m := name.match(r)) and m.group(0).lower() not in leave_out]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--extra", action="append", default=[])
    ap.add_argument("--except", dest="leave_out", default="")
    args = ap.parse_args()
    print("\n".join(requirements(args.extra, {n.strip().lower() for n in args.leave_out.split(",") if n.strip()})))


if __name__ == "__main__":
    main()
