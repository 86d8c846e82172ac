"""``make test-hosted``: a hosted notebook (Colab, Kaggle), rehearsed on this machine's CPU.

A hosted runtime is not this repository's ``.venv``: it has its own Python with torch (and Jupyter) already
installed, no ``make``, and a working folder that is not the course (Colab's ``/content``). This builds one:

1. a fresh venv with only what a runtime brings: torch (the pinned release, as the runtime's own build would be),
   ipykernel and nbclient; nothing of the course;
2. the course committed to a scratch git repository, standing for where the learner fetches it from;
3. chapter 00 run by nbclient in an empty working folder, with ``MINIPAGED_COURSE_URL`` pointing at that
   repository and a fresh model cache: its set-up cell must fetch the course, install the rest, keep torch as it
   was, convert the model and report the device; then the whole chapter runs;
4. the set-up run a second time: it must install nothing;
5. chapters 00, 01, 03 and 09b (the engine on the runtime's device) of the fetched copy under nbval (installed by step 3) in that venv.

Every step is bounded in time; the scratch folder is removed at the end (``--keep`` keeps it). Exits 1 on the
first failure, naming the step. About 10 minutes on 2 cores, most of it pip and the model's conversion.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHAPTERS = ["00_welcome", "01_kv_cache_math", "03_block_pool", "09b_mini_engine_serving"]
RUNTIME = ["ipykernel>=6.29", "nbclient>=0.10", "nbformat>=5.10"]  # what a hosted runtime has besides torch


def torch_pin() -> str:
    """The torch this project pins (pyproject.toml): the rehearsal's stand-in for the runtime's own build."""
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(d for d in deps if d.startswith("torch=="))


def run(step: str, cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    t0 = time.perf_counter()
    print(f"[{step}] {' '.join(cmd)[:160]}", flush=True)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired:
        sys.exit(f"[{step}] FAILED: still running after {timeout:.0f} s")
    if done.returncode:
        print(done.stdout[-6000:], done.stderr[-6000:], sep="\n", file=sys.stderr)
        sys.exit(f"[{step}] FAILED (exit {done.returncode})")
    print(f"[{step}] ok in {time.perf_counter() - t0:.0f} s", flush=True)
    return done


def course_files() -> list[str]:
    """The course as the learner would fetch it: the files git tracks or would track (not ignored), as they are in
    this working tree."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout
    return [f for f in out.decode().split("\0") if f and (REPO / f).is_file()]


# Runs inside the rehearsal's venv: chapter 00 executed by nbclient in the empty working folder.
EXECUTE = """
import sys, nbformat
from nbclient import NotebookClient
nb = nbformat.read(sys.argv[1], as_version=4)
NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": sys.argv[2]}}).execute()
setup = next(c for c in nb.cells if c.cell_type == "code" and "setup_course.py" in c.source)
print("".join(o.get("text", "") for o in setup.outputs if o.output_type == "stream"))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder (its path is printed)")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="minipaged-hosted-"))
    print("scratch folder:", scratch)
    try:
        rehearse(scratch)
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)


def rehearse(scratch: Path) -> None:
    venv, remote, content, cache = (scratch / n for n in ("runtime", "remote", "content", "cache"))
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    run("runtime", [sys.executable, "-m", "venv", str(venv)], 120)
    run("runtime", [*pip, torch_pin(), *RUNTIME], 900)
    torch_before = run("runtime", [py, "-c", "import torch; print(torch.__version__)"], 120).stdout.strip()

    for f in course_files():  # the course's home, as a git repository (a hosted runtime clones it)
        (remote / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, remote / f)
    git = ["git", "-c", "user.name=rehearsal", "-c", "user.email=rehearsal@localhost"]
    run("remote", ["git", "init", "--quiet", str(remote)], 60)
    run("remote", [*git, "-C", str(remote), "add", "--all"], 120)
    run("remote", [*git, "-C", str(remote), "commit", "--quiet", "-m", "the course"], 120)

    content.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MINIPAGED_", "VIRTUAL_ENV", "PYTHONPATH"))}
    env |= {
        "MINIPAGED_COURSE_URL": remote.as_uri(),
        "MINIPAGED_CACHE_DIR": str(cache),
        "PATH": f"{venv / 'bin'}:{env['PATH']}",
    }
    script = scratch / "execute.py"
    script.write_text(EXECUTE)
    chapter00 = REPO / "notebooks" / "00_welcome.ipynb"  # as a hosted notebook opens it: one file, not the folder
    first = run("setup", [py, str(script), str(chapter00), str(content)], 1800, env=env, cwd=content).stdout
    print(first)
    course = content / "minipaged"
    for want in ("fetched the course from", "packages: installing", "installed from", "converted once into",
                 "device: CPU", "dtype the engine picks: float32", "KV pool:"):  # fmt: skip
        if want not in first:
            sys.exit(f"[setup] FAILED: the set-up cell's output does not say {want!r}")
    torch_after = run("setup", [py, "-c", "import torch; print(torch.__version__)"], 120).stdout.strip()
    if torch_after != torch_before:
        sys.exit(f"[setup] FAILED: torch was {torch_before} and is now {torch_after}: the runtime's torch was replaced")

    again = run("again", [py, str(script), str(chapter00), str(content)], 900, env=env, cwd=content).stdout
    for want in ("packages: all", "already installed from", "already converted at"):
        if want not in again:
            print(again, file=sys.stderr)
            sys.exit(f"[again] FAILED: a second run should find everything done; it does not say {want!r}")

    nbval = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax", "--nbval-current-env",
             "--nbval-sanitize-with", "tests/nbval_sanitize.cfg", "-o", "addopts=",
             *[f"notebooks/{c}.ipynb" for c in CHAPTERS]]  # fmt: skip
    out = run("chapters", nbval, 1200, env=env, cwd=course).stdout
    print(out.strip().splitlines()[-1])
    summary = {"torch": torch_after, "chapters": CHAPTERS, "course": str(course)}
    print("hosted rehearsal passed:", json.dumps(summary))


if __name__ == "__main__":
    main()
