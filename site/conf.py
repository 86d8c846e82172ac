"""Sphinx configuration of the course's static site (``make site``; ``tools/build_site.py`` runs Sphinx with it).

Sphinx with myst-nb and the Sphinx Book Theme: a maintained, pip-installed toolchain made for notebooks that
builds with no network (Jupyter Book 2 needs Node.js and fetches its theme at build time). The source folder is
the repository itself, so the notebooks are read where they live; only the chapters, the two appendices, the
exercise starters and the guides (``site/guide/*.md``, the reference pages the README links to) are pages. The
chapters and appendices are executed at build time, in a kernel that draws plotly figures with the site's own
plotly.js and widgets as snapshots (``minipaged/classroom/viz/snapshot.py``); the exercises are shown as their task
text, not executed (their check cells fail until a learner writes the code); the guides are MyST markdown.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from nbclient.client import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
project = "minipaged"
author = "the minipaged authors"
copyright = "the minipaged authors"
root_doc = "site/index"

extensions = ["myst_nb"]
include_patterns = ["site/index.md", "site/guide/*.md", "notebooks/*.ipynb", "exercises/ex*.ipynb"]
exclude_patterns = ["_build", ".venv", "**/.ipynb_checkpoints"]

# ---- execution -------------------------------------------------------------------------------------------------
nb_execution_mode = "force"  # every build runs every chapter: the page shows what the package computes today
nb_execution_excludepatterns = ["exercises/*"]
nb_execution_timeout = 600  # seconds per cell; a chapter runs in under 90 s on 2 cores
nb_execution_raise_on_error = True  # a chapter that fails fails the build, never a page with a traceback
nb_execution_show_tb = True
nb_merge_streams = True
# The widgets are shown as snapshots, so their live state is not kept: nbclient would store every widget model in
# the notebook, and myst-nb would embed it in the page (the figures' widgets name one model of 4.8 MB: plotly.js).
NotebookClient.set_widgets_metadata = lambda self: None  # type: ignore[method-assign]
# The kernel inherits this environment: its IPython startup file installs the site's renderers.
os.environ["IPYTHONDIR"] = str(ROOT / "_build" / "site-ipython")

# ---- pages -----------------------------------------------------------------------------------------------------
myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 3
suppress_warnings = ["myst.header", "mystnb.unknown_mime_type"]
html_theme = "sphinx_book_theme"
html_title = "minipaged — a paged KV cache, built chapter by chapter"
html_theme_options = {
    "show_toc_level": 2,
    "use_download_button": False,
    "use_fullscreen_button": False,
    "home_page_in_toc": True,
}
html_context = {"default_mode": "light"}  # without it the theme logs "invalid theme mode" on a reader's first visit
html_favicon = "favicon.svg"  # four blocks of a pool; without an icon the browser asks for /favicon.ico
html_static_path = [str(ROOT / "_build" / "site-static")]
html_js_files = ["plotly.min.js", "minipaged.js"]  # plotly before the figures' own scripts: in <head>, not deferred
html_css_files = ["minipaged.css"]  # and minipaged.js: the pages at a reader's width (tools/site_test.py checks them)
# The widgets are snapshots (no widget manager needed), so no page loads require.js or the widget manager from a CDN.
nb_ipywidgets_js: dict[str, dict[str, str]] = {}
html_show_sourcelink = False
# MathJax 3 served from _static, not a CDN (chapters 08 and 09 have math). The files come from the pinned
# sphinx-mathjax-offline package; it is copied here rather than loaded as an extension, which Sphinx would treat as
# unsafe for parallel reading (and so run the chapters one at a time).
mathjax_path = "mathjax/tex-chtml.js"


def _prepare(app: object) -> None:
    """The kernel's startup file and the page's plotly.js, written where the config above points."""
    import plotly

    startup = Path(os.environ["IPYTHONDIR"]) / "profile_default" / "startup"
    startup.mkdir(parents=True, exist_ok=True)
    (startup / "00-minipaged-site.py").write_text("from minipaged.classroom.viz.snapshot import install\ninstall()\n")
    static = ROOT / "_build" / "site-static"
    static.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(plotly.__file__).parent / "package_data" / "plotly.min.js", static / "plotly.min.js")
    for name in ("minipaged.css", "minipaged.js"):
        shutil.copy(ROOT / "site" / name, static / name)


def _copy_mathjax(app: object, exception: Exception | None) -> None:
    import importlib.util

    if exception is not None:
        return
    spec = importlib.util.find_spec("sphinx-mathjax-offline")
    if spec is None or spec.origin is None:
        raise RuntimeError("sphinx-mathjax-offline is missing: install the `site` extra (make site does)")
    source = Path(spec.origin).parent / "static" / "mathjax"
    shutil.copytree(source, Path(app.outdir) / "_static" / "mathjax", dirs_exist_ok=True)  # type: ignore[attr-defined]


def setup(app: object) -> None:
    _prepare(app)
    app.connect("build-finished", _copy_mathjax)  # type: ignore[attr-defined]
