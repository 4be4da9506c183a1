"""Sphinx configuration of the course's website (``make site``; ``tools/build_site.py``).

The pages are not written here: ``tools/build_site.py`` assembles them into
``build/site/src`` (the executed chapters, the glossary, the index) and runs Sphinx on that
folder with this configuration. Everything comes from PyPI wheels (Sphinx, MyST-NB,
sphinx-book-theme, sphinx-design): the build downloads nothing, and the pages load nothing
from other sites.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from kvlab.colab import REPO_URL, SITE_URL  # noqa: E402

project = "kvlab"
author = "the kvlab authors"
copyright = "2026, the kvlab authors"
html_title = "kvlab: paged KV-cache management, built step by step"
html_baseurl = SITE_URL

extensions = ["myst_nb", "sphinx_design"]
exclude_patterns = ["downloads/**", "_build", "**.ipynb_checkpoints"]

# The chapters arrive executed (notebook test or nbclient): Sphinx never runs a kernel.
nb_execution_mode = "off"
nb_merge_streams = True
# A static page cannot run a widget: ch. 07's explorer also sends a PNG of its view, shown here.
nb_mime_priority_overrides = [("html", "application/vnd.jupyter.widget-view+json", None)]
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 4

html_theme = "sphinx_book_theme"
html_static_path = ["_static"]
html_css_files = ["kvlab.css"]
html_show_sourcelink = False
html_copy_source = False
html_last_updated_fmt = None
html_theme_options = {
    "repository_url": REPO_URL,
    "repository_branch": "main",
    "use_repository_button": True,
    "use_issues_button": True,
    # each chapter links its own notebooks (Colab badge, downloads) under its title
    "use_download_button": False,
    "home_page_in_toc": True,
    "show_toc_level": 2,
    "navigation_with_keys": False,
}
