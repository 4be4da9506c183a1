"""Every internal link of a built site leads somewhere: the file exists, and so does the anchor.

    python tools/check_site_links.py build/site/html    # prints the broken ones, exit 1 if any

An internal link is an ``href`` or ``src`` without a scheme (``https:``, ``mailto:``...) on
any page (the theme's template fragments under ``_static/`` are not pages): it must name a file of the site (a folder means its ``index.html``), and a
``#fragment`` on an HTML page must be an ``id`` (or an ``<a name>``) on that page.
"""
from __future__ import annotations

import argparse
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

_LINK_ATTRS = {"a": "href", "link": "href", "img": "src", "script": "src", "iframe": "src",
               "source": "src"}


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for key in ("id", "name") if tag == "a" else ("id",):
            if attrs.get(key):
                self.ids.add(attrs[key])
        url = attrs.get(_LINK_ATTRS.get(tag, ""))
        if url:
            self.links.append(url)


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(errors="replace"))
    return page


def pages(html_root: Path) -> list[Path]:
    """The site's pages (not the theme's template fragments under ``_static/``)."""
    return [p for p in sorted(Path(html_root).rglob("*.html"))
            if p.relative_to(html_root).parts[0] not in ("_static", "_sources")]


def internal_links(html_root: Path) -> dict[Path, list[str]]:
    """Page → the internal links it holds."""
    found = {}
    for path in pages(html_root):
        found[path] = [u for u in _parse(path).links
                       if not (urlsplit(u).scheme or u.startswith("//"))]
    return found


def check(html_root: Path) -> list[str]:
    """One line per broken internal link: ``page: link (why)``."""
    html_root = Path(html_root).resolve()
    ids: dict[Path, set[str]] = {}
    broken = []
    for page, links in internal_links(html_root).items():
        for url in links:
            parts = urlsplit(url)
            target = page if not parts.path else (page.parent / unquote(parts.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            where = page.relative_to(html_root)
            if not target.is_relative_to(html_root):
                broken.append(f"{where}: {url} (outside the site)")
            elif not target.is_file():
                broken.append(f"{where}: {url} (no such file)")
            elif parts.fragment and target.suffix == ".html":
                if target not in ids:
                    ids[target] = _parse(target).ids
                if unquote(parts.fragment) not in ids[target]:
                    broken.append(f"{where}: {url} (no anchor #{parts.fragment})")
    return broken


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("html_root", nargs="?", default="build/site/html", type=Path)
    root = ap.parse_args(argv).html_root
    if not (root / "index.html").is_file():
        print(f"{root}/index.html is missing: build the site first (make site)", file=sys.stderr)
        return 2
    broken = check(root)
    for line in broken:
        print(line)
    n_links = sum(len(v) for v in internal_links(root).values())
    print(f"{n_links} internal links checked, {len(broken)} broken")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
