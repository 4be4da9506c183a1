"""Which chapter introduces each term of the glossary, for the site's search (``kvlab_site``
writes it into the search page; ``_static/kvlab.js`` ranks that chapter first when a query
names the term). No Sphinx needed."""
from __future__ import annotations

import re

_TERM = re.compile(r"^### (?P<heading>.+)\n\*\*(?P<name>[^*]+)\*\* \(chapters? "
                   r"(?P<chapters>\d\d(?:(?:, | and )\d\d)*)\)", re.M)


def term_key(text: str) -> str:
    """A term as a query names it: lower case, ``_``, ``-`` and spaces alike (kvlab.js too)."""
    return " ".join(re.split(r"[\s_-]+", text.lower())).strip()


def teaching_chapters(glossary: str, docnames) -> dict[str, list[str]]:
    """Term (:func:`term_key`) -> the pages of the chapters the glossary says introduce it."""
    by_number = {}
    for doc in sorted(docnames):
        if re.match(r"\d\d_", doc):
            by_number.setdefault(doc[:2], doc)
    terms = {}
    for m in _TERM.finditer(glossary):
        pages = [by_number[n] for n in re.findall(r"\d\d", m["chapters"]) if n in by_number]
        for name in (m["heading"], m["name"]):
            if pages:
                terms.setdefault(term_key(name), pages)
    return terms
