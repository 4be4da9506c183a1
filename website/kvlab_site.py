"""The course website's own Sphinx extension (``website/conf.py`` loads it).

``tools/build_site.py`` writes ``_kvlab_site.json`` beside the pages it assembles:
``{"figure_alt": {sha256: text}, "pages": {docname: {"description": ..., "image": ...}}}``.
This extension

* puts each output figure's alt text on its image (MyST-NB names a figure's file by its
  SHA-256 and would leave that name as the alt text); a figure without one is a warning,
  which ``-W`` turns into a failed build;
* writes a description and link-preview tags (Open Graph, Twitter card) into every page's
  head, with the page's picture (copied to ``_static/previews/``) as the preview image;
* gives the search page the chapters that introduce each term of the glossary (``### term``
  headings, each entry's "(chapter NN)"), so that ``kvlab.js`` ranks that chapter first when
  a query names the term;
* trims what the theme ships but the site does not use: pydata-sphinx-theme's Font Awesome
  script (1.5 MB, which only turns the icon font's ``<i>`` tags into inline SVG; the theme's
  stylesheet already draws the same icons from its web fonts), the glyphs of those web fonts
  that no page uses (about 2,000 icons for the dozen the site shows: fontTools, with brotli
  for WOFF2; without brotli the fonts stay whole) and the source maps (``*.map``).
"""
from __future__ import annotations

import html
import json
import re
import shutil
from pathlib import Path

from docutils import nodes
from search_terms import teaching_chapters
from sphinx.util import logging

LOG = logging.getLogger(__name__)

DATA = "_kvlab_site.json"
PREVIEWS = "_static/previews"
#: what is removed from the built site: (the file(s), the tag that loads them)
TRIMMED = [("_static/scripts/fontawesome.js*",
            re.compile(r'[ \t]*<script defer src="[^"]*_static/scripts/fontawesome\.js[^"]*"></script>\n?'))]


def _load(app) -> None:
    path = Path(app.srcdir) / DATA
    app.kvlab_site = json.loads(path.read_text()) if path.exists() else {}


def _data(app) -> dict:
    return getattr(app, "kvlab_site", {})


def _alt_for_figures(app, doctree) -> None:
    """MyST-NB writes an output figure as ``<sha256>.png``: give it the alt text its cell declared."""
    alts = _data(app).get("figure_alt", {})
    docname = app.env.docname
    for image in doctree.findall(nodes.image):
        stem = Path(image["uri"]).stem
        if not re.fullmatch(r"[0-9a-f]{64}", stem):
            continue  # not a notebook output (a badge, a picture of the repository)
        if stem in alts:
            image["alt"] = alts[stem]
        else:
            LOG.warning(f"a figure of {docname} has no alt text: declare it on its cell's `# %%` "
                        "line (tools/site_figures.py)", location=image)


def _meta_tags(app, pagename, templatename, context, doctree) -> None:
    """A description and the link-preview tags of the page, in its head."""
    page = _data(app).get("pages", {}).get(pagename, {})
    site = app.config.html_baseurl.rstrip("/") + "/"
    title = re.sub(r"<[^>]+>", "", context.get("title") or app.config.project)
    description = page.get("description") or app.config.html_title
    tags = {
        "description": description,
        "og:type": "website",
        "og:site_name": app.config.project,
        "og:title": html.unescape(title),
        "og:description": description,
        "og:url": f"{site}{pagename}.html",
        "twitter:card": "summary_large_image" if page.get("image") else "summary",
    }
    if page.get("image"):
        tags["og:image"] = f"{site}{PREVIEWS}/{Path(page['image']).name}"
        tags["og:image:alt"] = page.get("image_alt") or description
    lines = []
    for key, value in tags.items():
        attr = "property" if key.startswith("og:") else "name"
        lines.append(f'<meta {attr}="{key}" content="{html.escape(value, quote=True)}" />')
    context["metatags"] = context.get("metatags", "") + "\n".join(lines) + "\n"


def _search_terms(app, pagename, templatename, context, doctree) -> None:
    if pagename != "search":
        return
    path = Path(app.srcdir) / "glossary.md"
    terms = teaching_chapters(path.read_text(), app.env.found_docs) if path.exists() else {}
    app.add_js_file(None, body=f"const KVLAB_TERMS = {json.dumps(terms, sort_keys=True)};")


def _finish(app, exception) -> None:
    if exception is not None or app.builder.name != "html":
        return
    out = Path(app.outdir)
    previews = out / PREVIEWS
    for page in _data(app).get("pages", {}).values():
        if page.get("image"):
            previews.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(app.srcdir) / page["image"], previews / Path(page["image"]).name)
    for pattern, tag in TRIMMED:
        for path in out.glob(pattern):
            path.unlink()
        for page in out.rglob("*.html"):
            text = page.read_text()
            trimmed = tag.sub("", text)
            if trimmed != text:
                page.write_text(trimmed)
    for path in (out / "_static").rglob("*.map"):
        path.unlink()
    subset_icon_fonts(out)


_ICON_CLASS = re.compile(r"\bfa-[a-z0-9-]+")
_ICON_RULE = re.compile(r'((?:\.fa-[a-z0-9-]+,?)+)\{--fa:"\\([0-9a-f]+)"')


def subset_icon_fonts(out: Path) -> dict[str, tuple[int, int]]:
    """Keep only the icons the site uses in the theme's Font Awesome web fonts; returns
    ``{font file: (bytes before, bytes after)}`` (empty when fontTools or brotli is missing)."""
    try:
        import brotli  # noqa: F401  (WOFF2 is brotli-compressed)
        from fontTools import subset
    except ImportError:
        return {}
    css = "\n".join(p.read_text() for p in (out / "_static").rglob("*.css"))
    codepoints = {}
    for selectors, hexcode in _ICON_RULE.findall(css):
        for name in selectors.replace(",", " ").replace(".", " ").split():
            codepoints[name] = int(hexcode, 16)
    used = set()
    for path in [*out.rglob("*.html"), *(out / "_static").rglob("*.js")]:
        used |= set(_ICON_CLASS.findall(path.read_text(errors="replace")))
    unicodes = {codepoints[n] for n in used if n in codepoints}
    # icons the stylesheets draw themselves (a download link's arrow, an admonition's sign):
    # private-use characters, or their escapes, outside the class-to-icon table
    rest = _ICON_RULE.sub("", css)
    unicodes |= {ord(c) for c in rest if 0xE000 <= ord(c) <= 0xF8FF}
    unicodes |= {int(h, 16) for h in re.findall(r'"\\([ef][0-9a-f]{3})"', rest)}
    unicodes = sorted(unicodes)
    sizes = {}
    for font in (out / "_static").rglob("fa-*.woff2"):
        before = font.stat().st_size
        options = subset.Options()
        options.flavor = "woff2"
        options.layout_features = ["*"]
        subsetter = subset.Subsetter(options)
        loaded = subset.load_font(str(font), options)
        subsetter.populate(unicodes=unicodes)
        subsetter.subset(loaded)
        subset.save_font(loaded, str(font), options)
        sizes[font.name] = (before, font.stat().st_size)
    return sizes


def setup(app):
    app.connect("builder-inited", _load)
    app.connect("doctree-read", _alt_for_figures)
    app.connect("html-page-context", _meta_tags)
    app.connect("html-page-context", _search_terms)
    app.connect("build-finished", _finish)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
