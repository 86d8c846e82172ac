// minipaged's pages at a reader's width (tools/site_test.py checks them at 1366 and 390 px). Without JavaScript a
// page shows every output whole, and a figure too wide for its frame scrolls inside it.
//
// A text output longer than FOLD_LINES shows its first SHOWN_LINES, and a button shows the rest.
(() => {
  const FOLD_LINES = 30; // tools/site_test.py's FOLD_LINES
  const SHOWN_LINES = 20;

  const fold = () => {
    for (const pre of document.querySelectorAll("article.bd-article div.cell_output pre")) {
      const lines = pre.textContent.replace(/\n$/, "").split("\n").length;
      if (lines <= FOLD_LINES || pre.classList.contains("minipaged-foldable")) continue;
      pre.classList.add("minipaged-foldable", "minipaged-folded");
      pre.style.setProperty("--minipaged-shown-lines", String(SHOWN_LINES));
      const button = document.createElement("button");
      button.type = "button";
      button.className = "minipaged-show-all";
      const show = (open) => {
        pre.classList.toggle("minipaged-folded", !open);
        button.setAttribute("aria-expanded", String(open));
        button.textContent = open ? `show the first ${SHOWN_LINES} lines only` : `show all ${lines} lines`;
      };
      button.addEventListener("click", () => show(pre.classList.contains("minipaged-folded")));
      show(false);
      pre.after(button);
    }
  };

  // A plotly figure drawn at a fixed width (a block grid: its squares are so many pixels) wider than its frame is
  // scaled to fit, down to MIN_SCALE; on a narrower screen it keeps that scale and scrolls inside its frame
  // (minipaged.css). A CSS transform, not `zoom`: plotly.js maps the mouse through transforms, so hovering still
  // finds the right block.
  const MIN_SCALE = 0.6;
  const FRAMES = ".minipaged-widget-snapshot, .minipaged-figure";
  const fit = () => {
    for (const plot of document.querySelectorAll(`article.bd-article :is(${FRAMES}) .js-plotly-plot`)) {
      plot.style.transform = plot.style.marginRight = plot.style.marginBottom = "";
      const frame = plot.closest(FRAMES);
      const room = frame.getBoundingClientRect().right - parseFloat(getComputedStyle(frame).paddingRight);
      const box = plot.getBoundingClientRect();
      const scale = Math.max(MIN_SCALE, (room - box.left) / box.width);
      if (scale >= 1) continue;
      plot.style.transformOrigin = "0 0";
      plot.style.transform = `scale(${scale})`;
      plot.style.marginRight = `${-box.width * (1 - scale)}px`; // the page lays it out at its drawn size
      plot.style.marginBottom = `${-box.height * (1 - scale)}px`;
    }
  };
  let pending = 0;
  window.addEventListener("resize", () => {
    pending ||= requestAnimationFrame(() => {
      pending = 0;
      fit();
    });
  });

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", fold);
  else fold();
  window.addEventListener("load", fit); // after the figures' scripts have drawn them
})();
