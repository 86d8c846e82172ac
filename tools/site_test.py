"""The built site in a real browser (``make test-site``, after ``make site``).

    .venv/bin/python tools/site_test.py                 # every page of _build/site, and the screenshots
    .venv/bin/python tools/site_test.py --no-screenshot
    .venv/bin/python tools/site_test.py 03_block        # only the pages whose path contains "03_block"

Serves ``_build/site`` on 127.0.0.1 (a free port, this process's own thread) and drives Debian's chromium through
Playwright, as ``make test-browser`` does (no browser download). For every page it asserts:

* it loads with no console error, no uncaught page error, no failed request, no response >= 400, and no request
  leaving 127.0.0.1 (the site works without a network);
* every figure is drawn: the page has as many course figures (``snapshot.FIGURE_CLASS``) and widget snapshots
  (``snapshot.WIDGET_CLASS``) as the executed notebook's outputs hold, and each figure has a plotly SVG;
* every internal link resolves to a page of the site (and its ``#anchor``, when it names one, to an element);
* at a laptop's width (1366 px) and a phone's (390 px), nothing in the text column is wider than the column unless
  it scrolls inside its own box, and nothing is cut (content clipped by a box that does not scroll): a snapshot or
  a figure too wide for the column scrolls (``site/minipaged.css``);
* every text output longer than ``FOLD_LINES`` is folded, its first lines in view, and its "show all" button
  shows every line (``site/minipaged.js``).

Then the search page must find a term only chapter 05 teaches, and the sidebar must list the chapters in order.
Screenshots: chapter 02's player (the guide shows it), and each chapter at a laptop's width with its first snapshot
or figure in view (``assets/screenshots/site/``), for review.
The last line is ``N pages passed, M failed``; the exit status is 0 only when all passed.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import sys
import threading
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urldefrag, urljoin, urlparse

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO))

from browser_test import CHROMIUM_FLAGS, VIEWPORT, _shrink_png, ensure_chromium, ensure_playwright  # noqa: E402

from minipaged.classroom.viz.snapshot import FIGURE_CLASS, WIDGET_CLASS  # noqa: E402

SITE = REPO / "_build" / "site"
EXECUTED = REPO / "_build" / "jupyter_execute"  # myst-nb's executed copies of the notebooks
SEARCH_TERM, SEARCH_PAGE = "reshape_and_cache", "05_paged_kernels"
SCREENSHOT = REPO / "assets" / "screenshots" / "site_chapter_02.png"  # site/guide/commands.md shows it
SHOTS = REPO / "assets" / "screenshots" / "site"  # one per chapter at a laptop's width, for review
# A laptop and a phone. At each, nothing in the text column may be wider than it unless it scrolls inside its own
# box, and nothing may be cut (content clipped by a box that does not scroll).
WIDTHS = {"laptop": {"width": 1366, "height": 900}, "phone": {"width": 390, "height": 844}}
FOLD_LINES = 30  # an output longer than this is folded behind "show all" (site/minipaged.js), its first lines shown

# Every element of the article that sticks out of the text column or is cut, outermost only, as "how: what".
OVERFLOW_JS = r"""
(framed) => {
  const col = document.querySelector("article.bd-article");
  if (!col) return [];  // the search page: its results are the theme's, with no text column of ours
  const limit = col.getBoundingClientRect().right + 0.5;
  const scrolls = (el) => ["auto", "scroll"].includes(getComputedStyle(el).overflowX);
  const clips = (el) => ["hidden", "clip"].includes(getComputedStyle(el).overflowX);
  const name = (el) => {
    const cls = [...el.classList].slice(0, 2).join(".");
    const text = (el.innerText || el.getAttribute("aria-label") || "").trim().replace(/\s+/g, " ").slice(0, 60);
    const output = el.closest(".cell_output") ? "output " : el.closest(".cell_input") ? "code " : "";
    return `${output}<${el.tagName.toLowerCase()}${cls ? "." + cls : ""}> ${JSON.stringify(text)}`;
  };
  const found = [];
  const walk = (el) => {
    for (const child of el.children) {
      const r = child.getBoundingClientRect();
      if (r.width && r.height && r.right > limit) {
        found.push(`wider than the text column by ${Math.round(r.right - limit)} px: ${name(child)}`);
        continue;
      }
      // MathJax keeps a copy of each formula for screen readers outside the formula's box, clipped on purpose
      if (clips(child) && child.scrollWidth > child.clientWidth + 1 && !child.matches(".math, mjx-container")) {
        found.push(`cut at ${child.clientWidth} of ${child.scrollWidth} px: ${name(child)}`);
        continue;
      }
      if (!scrolls(child)) walk(child);  // what a box that fits scrolls past is the reader's to scroll to
    }
  };
  walk(col);
  // A snapshot or a figure keeps its content inside its own frame, or scrolls it there: one whose content spills
  // past its border is cut by whatever box holds it (chapter 03's 64-block grid ran past its snapshot's frame).
  for (const el of col.querySelectorAll(framed)) {
    if (!scrolls(el) && el.scrollWidth > el.clientWidth + 1) {
      found.push(`cut: its content is ${el.scrollWidth} px in a ${el.clientWidth} px frame: ${name(el)}`);
    }
  }
  return found;
}
"""
# Every text output longer than FOLD_LINES: folded, its first lines in view, and its button shows all of it.
FOLDS_JS = r"""
(limit) => [...document.querySelectorAll("article.bd-article div.cell_output pre")].map((pre) => {
  const lines = pre.textContent.replace(/\n$/, "").split("\n").length;
  if (lines <= limit) return null;
  const button = pre.parentElement.querySelector(":scope > button.minipaged-show-all");
  if (!button) return `an output of ${lines} lines is not folded`;
  const line = parseFloat(getComputedStyle(pre).lineHeight) || 16;
  const folded = pre.getBoundingClientRect().height / line;
  button.click();
  const open = pre.getBoundingClientRect().height / line;
  button.click();
  if (folded < 5 || folded > limit) return `a folded output of ${lines} lines shows ${Math.round(folded)} of them`;
  if (open < lines) return `an output of ${lines} lines shows ${Math.round(open)} after "show all"`;
  return null;
}).filter(Boolean)
"""


def expected_counts(page: Path) -> tuple[int, int] | None:
    """(figures, widget snapshots) in the executed notebook behind ``page``; None for a page with no notebook run."""
    nb = EXECUTED / page.relative_to(SITE).with_suffix(".ipynb")
    if not nb.exists():
        return None
    html = "".join(
        "".join(out.get("data", {}).get("text/html", ""))
        for cell in json.loads(nb.read_text())["cells"]
        for out in cell.get("outputs", [])
    )
    return html.count(f'class="{FIGURE_CLASS}"'), html.count(f'class="{WIDGET_CLASS}"')


class Server:
    def __init__(self) -> None:
        handler = functools.partial(_QuietHandler, directory=str(SITE))
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


MISSING: list[str] = []  # paths the server answered 404, whether or not the page was still there to see it


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        if code == 404:
            MISSING.append(self.path)
        try:
            super().send_error(code, message, explain)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the page was closed before the answer arrived; the 404 is recorded above


def check_page(ctx: Any, server: Server, page: Path) -> list[str]:  # ctx, tab: Playwright objects
    problems: list[str] = []
    tab = ctx.new_page()
    tab.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    tab.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    tab.on("requestfailed", lambda r: problems.append(f"request failed: {r.url} ({r.failure})"))
    tab.on("response", lambda r: problems.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None)
    tab.on("request", lambda r: None if r.url.startswith((server.url, "data:", "blob:", "about:"))
           else problems.append(f"a request off this machine: {r.url}"))  # fmt: skip
    url = urljoin(server.url, page.relative_to(SITE).as_posix())
    try:
        tab.goto(url, wait_until="load", timeout=60_000)
        tab.wait_for_timeout(300)
        figures = tab.locator(f".{FIGURE_CLASS}").count()
        snapshots = tab.locator(f".{WIDGET_CLASS}").count()
        undrawn = tab.evaluate(
            """(cls) => [...document.querySelectorAll('.' + cls)]
                 .filter(f => !f.querySelector('.js-plotly-plot svg.main-svg')).length""",
            FIGURE_CLASS,
        )
        want = expected_counts(page)
        if want is not None and (figures, snapshots) != want:
            problems.append(f"{figures} figures and {snapshots} widget snapshots drawn, the notebook has {want}")
        if undrawn:
            problems.append(f"{undrawn} of {figures} figures have no plotly SVG")
        problems += _links(tab, tab.url)  # after a redirect, the links are the landing page's
        problems += check_widths(tab)
    finally:
        tab.close()
    return problems


def check_widths(tab: Any) -> list[str]:
    """At a laptop's and a phone's width: nothing wider than the text column or cut, long outputs folded."""
    problems: list[str] = []
    for name, size in WIDTHS.items():
        tab.set_viewport_size(size)
        tab.wait_for_timeout(150)  # the theme's layout and plotly's responsive figures settle
        found = tab.evaluate(OVERFLOW_JS, f".{FIGURE_CLASS}, .{WIDGET_CLASS}")
        problems += [f"at {size['width']} px ({name}): {p}" for p in found]
    problems += tab.evaluate(FOLDS_JS, FOLD_LINES)
    tab.set_viewport_size(VIEWPORT)
    return problems


def _links(tab: Any, url: str) -> list[str]:
    problems = []
    for href in tab.evaluate("() => [...document.querySelectorAll('a[href]')].map(a => a.getAttribute('href'))"):
        target = urljoin(url, href)
        if urlparse(target).netloc != urlparse(url).netloc or href.startswith(("mailto:", "javascript:")):
            continue  # a link off the site (GitHub, a paper): not this site's to resolve
        path, anchor = urldefrag(target)
        file = SITE / unquote(urlparse(path).path).lstrip("/")
        if file.is_dir():
            file = file / "index.html"
        if not file.exists():
            problems.append(f"broken link {href!r}")
        elif anchor and file.suffix == ".html" and f'id="{anchor}"' not in file.read_text(errors="replace"):
            problems.append(f"link {href!r}: no element with id {anchor!r} there")
    return sorted(set(problems))


def check_search(ctx: Any, server: Server) -> list[str]:
    tab = ctx.new_page()
    try:
        tab.goto(urljoin(server.url, f"search.html?q={SEARCH_TERM}"), wait_until="load", timeout=60_000)
        tab.wait_for_selector("#search-results li", timeout=30_000)
        hits = tab.evaluate("() => [...document.querySelectorAll('#search-results li a')].map(a => a.href)")
    except Exception as exc:  # Playwright's timeout: no result list appeared
        return [f"search for {SEARCH_TERM!r}: no results ({type(exc).__name__})"]
    finally:
        tab.close()
    return (
        [] if any(SEARCH_PAGE in h for h in hits) else [f"search for {SEARCH_TERM!r} does not find chapter 05: {hits}"]
    )


def check_sidebar(ctx: Any, server: Server) -> list[str]:
    tab = ctx.new_page()
    try:
        tab.goto(server.url + "index.html", wait_until="load")  # the redirect to site/index.html
        tab.wait_for_url("**/site/index.html", timeout=10_000)
        hrefs = tab.evaluate("() => [...document.querySelectorAll('nav.bd-links a')].map(a => a.getAttribute('href'))")
    finally:
        tab.close()
    chapters = [h for h in hrefs if "notebooks/" in h and h.split("/")[-1][:2].isdigit()]
    numbers = [h.split("/")[-1].split("_")[0] for h in chapters]  # "09b": chapter 09's part 2
    want = sorted(p.name.split("_")[0] for p in (REPO / "notebooks").glob("[0-9][0-9]*_*.ipynb"))
    return [] if numbers == want else [f"the sidebar lists chapters {numbers}, not {want}"]


def chapter_shots(ctx: Any, server: Server, chapters: list[Path]) -> None:
    """Each chapter at a laptop's width, its first widget snapshot or figure in view, for a reviewer's eye."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    tab = ctx.new_page()
    tab.set_viewport_size(WIDTHS["laptop"])
    try:
        for page in chapters:
            tab.goto(urljoin(server.url, page.relative_to(SITE).as_posix()), wait_until="load")
            first = tab.locator(f".{WIDGET_CLASS}, .{FIGURE_CLASS}").first
            if first.count():
                first.scroll_into_view_if_needed()
            tab.wait_for_timeout(400)
            out = SHOTS / f"{page.stem}.png"
            tab.screenshot(path=str(out))
            print(f"screenshot: {out.relative_to(REPO)} ({_shrink_png(out) // 1024} KiB)")
    finally:
        tab.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("only", nargs="*", help="pages whose path contains one of these (default: every page)")
    ap.add_argument("--no-screenshot", action="store_true")
    args = ap.parse_args(argv)
    if not (SITE / "index.html").exists():
        sys.exit("no site to test: run `make site` first")
    chromium = ensure_chromium()
    ensure_playwright()
    from playwright.sync_api import sync_playwright

    pages = sorted(p for p in SITE.rglob("*.html") if "_static" not in p.parts)
    pages = [p for p in pages if not args.only or any(o in p.relative_to(SITE).as_posix() for o in args.only)]
    passed = failed = 0
    with Server() as server, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_FLAGS)
        ctx = browser.new_context(viewport=VIEWPORT)
        try:
            for page in pages:
                problems = check_page(ctx, server, page)
                name = page.relative_to(SITE).as_posix()
                print(f"{'ok  ' if not problems else 'FAIL'} {name}", flush=True)
                for p in problems[:20]:
                    print(f"       {p}")
                passed, failed = passed + (not problems), failed + bool(problems)
            for what, check in (("search", check_search), ("sidebar", check_sidebar)):
                problems = check(ctx, server)
                print(f"{'ok  ' if not problems else 'FAIL'} {what}")
                for p in problems:
                    print(f"       {p}")
                passed, failed = passed + (not problems), failed + bool(problems)
            if not args.no_screenshot:
                tab = ctx.new_page()
                tab.goto(server.url + "notebooks/02_fragmentation.html", wait_until="load")
                tab.locator(f".{WIDGET_CLASS}").first.scroll_into_view_if_needed()  # the player's snapshot
                tab.wait_for_timeout(500)
                SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
                tab.screenshot(path=str(SCREENSHOT))
                tab.close()
                print(f"screenshot: {SCREENSHOT.relative_to(REPO)} ({_shrink_png(SCREENSHOT) // 1024} KiB)")
                chapter_shots(ctx, server, [p for p in pages if p.parent.name == "notebooks"])
        finally:
            browser.close()
    if MISSING:
        print("FAIL files the pages asked for and the site lacks:")
        for path in sorted(set(MISSING)):
            print(f"       {path}")
        failed += 1
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
