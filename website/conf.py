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
sys.path.insert(0, str(Path(__file__).resolve().parent))  # kvlab_site, the site's extension
from kvlab.course.colab import REPO_URL, SITE_URL  # noqa: E402

project = "kvlab"
author = "the kvlab authors"
copyright = "2026, the kvlab authors"
html_title = "kvlab: paged KV-cache management, built step by step"
html_baseurl = SITE_URL

# kvlab_site: figures' alt text, link-preview tags, the theme's unused files trimmed
extensions = ["myst_nb", "sphinx_design", "sphinx_copybutton", "kvlab_site"]
exclude_patterns = ["downloads/**", "_build", "**.ipynb_checkpoints", "_previews/**"]

# The chapters arrive executed (notebook test or nbclient): Sphinx never runs a kernel.
nb_execution_mode = "off"
nb_merge_streams = True
# A static page cannot run a widget: ch. 07's explorer also sends a PNG of its view, shown here.
nb_mime_priority_overrides = [("html", "application/vnd.jupyter.widget-view+json", None)]
# html_image: the home page's <img> pictures become images Sphinx copies (and links full size)
myst_enable_extensions = ["colon_fence", "html_image"]
myst_heading_anchors = 4

html_theme = "sphinx_book_theme"
html_static_path = ["_static"]
# theme-switcher.html: the colour mode as one light/dark button (the theme's is a dropdown)
templates_path = ["_templates"]
# no general index: the course defines no index entries, so genindex.html would be empty
html_use_index = False
html_css_files = ["kvlab.css"]
html_js_files = ["kvlab.js"]
html_favicon = "_static/favicon.svg"
# pydata-sphinx-theme reads the colour mode from here; unset, every page logs a console error
html_context = {"default_mode": "auto"}
# a copy button on code the reader may run (cell inputs, shell lines), not on outputs
copybutton_selector = "div.cell_input div.highlight pre, div.highlight-sh pre, div.highlight-python pre"
copybutton_exclude = ".linenos, .gp"
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
    # pydata-sphinx-theme 0.16+ adds a header bar with a second search field unless told not
    # to; the book theme's sidebar has the search field already
    "navbar_persistent": [],
}
