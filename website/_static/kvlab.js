// The course site's one script.
document.addEventListener("DOMContentLoaded", () => {
  // A tap (or click) on a figure opens it at full size, so that a phone reader can zoom into
  // a picture the page shows shrunk to the screen's width.
  for (const img of document.querySelectorAll("article .cell_output img")) {
    if (img.closest("a")) continue;
    const link = document.createElement("a");
    link.href = img.getAttribute("src");
    link.className = "kvlab-figure-link";
    link.title = "Open the figure at full size";
    img.replaceWith(link);
    link.appendChild(img);
  }
  // A long identifier in running text may break after each underscore (kvlab.css lets it
  // break anywhere only when even that does not fit).
  for (const pre of document.querySelectorAll("article code.literal span.pre")) {
    const text = pre.textContent;
    if (!text.includes("_") || pre.children.length) continue;
    pre.textContent = "";
    text.split(/(?<=_)/).forEach((part, i) => {
      if (i) pre.appendChild(document.createElement("wbr"));
      pre.appendChild(document.createTextNode(part));
    });
  }
  colourModeToggle();
  betterSearch();
});

// The colour-mode button (website/_templates/theme-switcher.html) switches between light and
// dark: one click always changes what the reader sees. It clicks the theme's own (hidden) mode
// button, so the theme stores the choice and applies it as it does for its dropdown.
function colourModeToggle() {
  const shown = () => document.documentElement.dataset.theme === "dark" ? "dark" : "light";
  for (const toggle of document.querySelectorAll(".kvlab-mode-toggle")) {
    const label = () => {
      const text = shown() === "dark" ? "Light mode" : "Dark mode";
      toggle.title = text;
      toggle.setAttribute("aria-label", text);
    };
    toggle.addEventListener("click", () => {
      const next = shown() === "dark" ? "light" : "dark";
      toggle.parentElement.querySelector(`.theme-change-button[data-mode="${next}"]`).click();
      label();
    });
    label();
  }
}

// The search page (Sphinx's searchtools.js, which loads after this script and starts its
// search on DOMContentLoaded, after this listener):
// * a result's snippet is taken from the article alone (Sphinx takes the whole main column,
//   whose first words are the header's buttons and the page's table of contents), in one line;
// * the chapter that introduces a term ranks first when the query names the term
//   (KVLAB_TERMS, written into the search page from the glossary by website/kvlab_site.py).
function betterSearch() {
  if (typeof Search === "undefined") return;
  const original = Search.htmlToText;
  Search.htmlToText = (htmlString, anchor) => {
    const doc = new DOMParser().parseFromString(htmlString, "text/html");
    const article = doc.querySelector("article.bd-article");
    if (!article) return original(htmlString, anchor);
    for (const el of article.querySelectorAll(".headerlink, script, style, .copybtn")) el.remove();
    let part = article;
    try {
      part = (anchor && article.querySelector(anchor)) || article;
    } catch (error) {}  // an anchor that is no CSS selector (an id that starts with a digit)
    return part.textContent.replace(/\s+/g, " ").trim();
  };
  if (typeof Scorer === "undefined" || typeof KVLAB_TERMS === "undefined") return;
  const query = new URLSearchParams(window.location.search).get("q") || "";
  const teaching = KVLAB_TERMS[query.toLowerCase().replace(/[\s_-]+/g, " ").trim()] || [];
  const score = Scorer.score;
  // more than a match in a title (Scorer.title) is worth anywhere else
  const boost = 2 * (Scorer.title || 15);
  Scorer.score = (result) => {
    const base = score ? score(result) : result[4];
    return teaching.includes(result[0]) ? base + boost : base;
  };
}
