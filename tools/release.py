"""A copy of the course to hand out: everything a learner uses, no solution (``make release DEST=../course``).

    .venv/bin/python tools/release.py DEST          # DEST must not exist, or be an empty folder

What it copies: the files git tracks, as committed in HEAD (``git archive``: nothing uncommitted, nothing
ignored), less what holds or proves the answers:

* ``exercises/solutions/``, the solution notebooks;
* ``tests/``, whose mutant proofs and grader tests hold right and near-right answers;
* ``.ci/`` and the course's own development tools that read the solutions (``tools/nbtool.py`` refreshes
  starters from them, ``tools/gpu_check.py`` runs them).

Then it makes sure no answer got out another way: every line that a solution notebook's code has and its
starter's does not (the answer, less blank lines, comments and short lines) is looked for in every notebook and
text file of the copy. The package itself is not searched: it is the course's reference implementation, which the
exercises are to write again, and the grader refuses answers that run it (``grading/ownership.py``).

The copy grades on its own: ``make grade DIR=submissions/alice`` there (``minipaged grade``) needs only the package.
It gets a ``RELEASE.md`` saying what was left out, from which commit.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEFT_OUT = ("exercises/solutions/", "tests/", ".ci/", "tools/nbtool.py", "tools/gpu_check.py")
TEXT_SUFFIXES = {".ipynb", ".md", ".txt", ".py", ".html", ".json", ".yml", ".yaml", ".toml", ".cfg", ".rst"}
MIN_LINE = 24  # shorter lines (``return x``) are too common to say anything
# (file in the copy, solution) pairs that share lines on purpose, and why.
SHARED_ON_PURPOSE = {
    ("notebooks/10_capstone.ipynb", "ex05_paged_decode.ipynb"): "chapter 10 shows the grader catching a paged "
    "decode with the wrong head mapping; its prerequisites are exercises 03-09, ex05 among them",
}


def _left_out(path: str) -> bool:
    return any(path == p or path.startswith(p) for p in LEFT_OUT)


def _code_lines(path: Path) -> set[str]:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    lines = set()
    for cell in cells:
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        for line in source.splitlines():
            line = line.strip()
            if len(line) >= MIN_LINE and not line.startswith("#"):
                lines.add(line)
    return lines


def answer_lines(root: Path) -> dict[str, set[str]]:
    """For each solution notebook: the lines of its code that a learner does not already have (in a starter or in
    the package: ``except Exception as exc:`` says nothing), imports left aside."""
    known = set().union(*(_code_lines(p) for p in (root / "exercises").glob("ex*.ipynb")))
    for path in (root / "minipaged").rglob("*.py"):
        known |= {ln.strip() for ln in path.read_text(encoding="utf-8").splitlines()}
    found = {}
    for solution in sorted((root / "exercises" / "solutions").glob("ex*.ipynb")):
        extra = {ln for ln in _code_lines(solution) - known if not ln.startswith(("import ", "from "))}
        if extra:
            found[solution.name] = extra
    return found


def leaks(dest: Path, answers: dict[str, set[str]]) -> list[str]:
    """``file: a line of <solution>`` for every answer line found in a notebook or text file outside the package."""
    found = []
    for path in sorted(dest.rglob("*")):
        rel = path.relative_to(dest).as_posix()
        if not path.is_file() or path.suffix not in TEXT_SUFFIXES or rel.startswith("minipaged/"):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if path.suffix == ".ipynb":  # as source lines, not JSON strings with their escapes
            try:
                cells = json.loads(text)["cells"]
                text = "\n".join("".join(c["source"]) if isinstance(c["source"], list) else c["source"] for c in cells)
            except (ValueError, KeyError, TypeError):
                pass
        lines = {ln.strip() for ln in text.splitlines()}
        for solution, extra in answers.items():
            if (rel, solution) in SHARED_ON_PURPOSE:
                continue
            hit = next((ln for ln in sorted(extra) if ln in lines), None)
            if hit is not None:
                found.append(f"{rel}: a line of the solution {solution}: {hit[:100]!r}")
    return found


def release(dest: Path, root: Path = ROOT) -> list[str]:
    """Write the copy into ``dest``; return the paths it left out. Raises if an answer is found in the copy."""
    if dest.exists() and any(dest.iterdir()):
        raise SystemExit(f"{dest} exists and is not empty: give a new folder")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout
    archive = subprocess.run(["git", "archive", "--format=tar", "HEAD"], cwd=root, capture_output=True, check=True)
    dest.mkdir(parents=True, exist_ok=True)
    omitted = []
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        keep = []
        for member in tar.getmembers():
            if _left_out(member.name) or _left_out(member.name + "/"):
                omitted.append(member.name)
            else:
                keep.append(member)
        tar.extractall(dest, members=keep, filter="data")
    found = leaks(dest, answer_lines(root))
    if found:
        raise SystemExit("an answer is in the copy:\n  " + "\n  ".join(found))
    (dest / "RELEASE.md").write_text(
        f"# This copy of the course\n\nMade by `make release` from commit {head.strip()}. Left out: "
        + ", ".join(f"`{p}`" for p in LEFT_OUT)
        + " (the solutions, and what holds or reads them). Grade a folder of notebooks here with "
        "`make grade DIR=<folder>`; the grader needs only the package.\n",
        encoding="utf-8",
    )
    return sorted(p for p in omitted if not p.endswith("/"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dest", type=Path, help="a new (or empty) folder")
    args = parser.parse_args(argv)
    omitted = release(args.dest)
    print(f"wrote {args.dest}: the course without {len(omitted)} files ({', '.join(LEFT_OUT)}); no answer found in it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
