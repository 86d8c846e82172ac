"""Build the course's static site: ``make site`` (``python tools/build_site.py``).

Sphinx reads the repository with ``site/conf.py`` and writes ``_build/site/index.html``: every chapter and appendix
executed now, the exercises' task text, the guides the README links to (``site/guide/*.md``), a sidebar in chapter
order and a search page. It needs no network: the
`site` extra is installed from the project's pins, and plotly.js comes from the plotly package.

    python tools/build_site.py                 # the whole site (about four minutes on 2 cores)
    python tools/build_site.py --only notebooks/01_kv_cache_math.ipynb   # one page and the index, to try a change
    python tools/build_site.py --only site/guide/*.md     # the guides and the index (seconds: nothing executes)
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "_build" / "site"


def ensure_site_packages() -> None:
    """The `site` extra, as pyproject.toml pins it, installed into this environment when it is missing."""
    try:
        import importlib

        for module in ("myst_nb", "sphinx_book_theme", "sphinx-mathjax-offline"):
            importlib.import_module(module)
    except ImportError:
        import tomllib

        pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["site"]
        print(f"installing {' '.join(pins)} into {sys.prefix}", flush=True)
        pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *pins]
        subprocess.run(pip, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="build these pages (and the index) only")
    parser.add_argument("--jobs", default="2", help="Sphinx's parallel jobs (default 2: one per core of CI)")
    args = parser.parse_args(argv)
    ensure_site_packages()
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-c", str(ROOT / "site"), "-j", args.jobs, "-E",
           "--keep-going", str(ROOT), str(OUT)]  # fmt: skip
    if args.only:  # the index's links to the pages left out are warnings then: not errors
        cmd[3:3] = ["-D", "include_patterns=" + ",".join(["site/index.md", *args.only])]
    else:
        cmd[3:3] = ["-W"]  # a broken link, a missing page, a notebook Sphinx cannot read: the build fails, naming it
        shutil.rmtree(OUT, ignore_errors=True)  # no page of a renamed or removed chapter is left behind
    started = time.perf_counter()
    rc = subprocess.call(cmd, cwd=ROOT)
    # The home page is site/index.html (Sphinx reads the whole repository); _build/site/index.html sends readers there.
    # Its icon is inline: a request for the icon file was cut short by the redirect (a failed request in the browser).
    icon = "data:image/svg+xml," + urllib.parse.quote((ROOT / "site" / "favicon.svg").read_text().strip())
    (OUT / "index.html").write_text(
        '<!DOCTYPE html><html><head><meta charset="utf-8"><title>minipaged</title>'
        f'<meta http-equiv="refresh" content="0; url=site/index.html"><link rel="icon" href="{icon}">'
        "</head>"
        '<body><a href="site/index.html">minipaged: the course</a></body></html>\n'
    )
    pages = sorted(p.relative_to(OUT) for p in OUT.rglob("*.html") if "_static" not in p.parts)
    print(f"site: {len(pages)} pages in {time.perf_counter() - started:.0f} s -> {OUT / 'index.html'} (rc {rc})")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
