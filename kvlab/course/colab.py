"""The setup cell that opens every chapter, and the one place the course's URLs are set.

In Colab the cell clones :data:`REPO_URL` and installs kvlab from it (Colab already has
torch and triton); on a local checkout it only reports the runtime. Everywhere it ends with
one line of the learner's progress (:func:`kvlab.check.progress`). ``tools/build_notebooks.py``
puts :data:`SETUP_CELL` first in every notebook (after the "Open in Colab" link of
:func:`colab_link`), and a test checks they all match.
"""

#: Where Colab fetches the course from. Change it here (and in pyproject's [project.urls])
#: when you host a fork; ``KVLAB_REPO_URL`` in the environment overrides it at run time.
REPO_URL = "https://github.com/kvlab-course/kvlab"

#: The course's website (``make site`` builds it; GitHub Pages publishes it from ``main``).
SITE_URL = "https://kvlab-course.github.io/kvlab/"

#: The branch that Colab links open.
BRANCH = "main"

#: Colab's badge picture (an absolute URL: a notebook is read on GitHub, in Colab, on the site).
COLAB_BADGE_SVG = "https://colab.research.google.com/assets/colab-badge.svg"


def colab_url(notebook: str, repo_url: str = REPO_URL) -> str:
    """The link that opens ``notebook`` (a path in the repository, e.g.
    ``notebooks/00_tour.ipynb``) from GitHub in Colab."""
    repo = repo_url.rstrip("/").removeprefix("https://github.com/")
    return f"https://colab.research.google.com/github/{repo}/blob/{BRANCH}/{notebook}"


def colab_badge(notebook: str) -> str:
    """The Markdown of an "Open in Colab" badge for ``notebook`` (a path in the repository): for
    pages read online (the README); a notebook opens with :func:`colab_link` instead."""
    return f"[![Open in Colab]({COLAB_BADGE_SVG})]({colab_url(notebook)})"


def colab_link(notebook: str) -> str:
    """The Markdown line that opens every notebook: an "Open in Colab" text link. Text, not
    Colab's badge picture: JupyterLab without internet shows the picture as a broken image
    (and its Markdown keeps no ``onerror`` to fall back on), while text reads the same offline,
    on GitHub and in Colab."""
    return (f"**[Open in Colab]({colab_url(notebook)})** to run this chapter on a GPU in the "
            "browser (it needs internet; on your own machine just run the cells below).")


#: Where the setup cell clones the course in Colab (``KVLAB_COLAB_DIR`` overrides it).
COLAB_DIR = "/content/kvlab"

# In Colab the cell installs kvlab alone: the package requires only what `import kvlab` needs
# (torch, triton, numpy, matplotlib, ipywidgets), which Colab already has, so pip adds no
# second Jupyter stack (tests/test_colab_setup.py checks this offline).
SETUP_CELL = f'''\
# Setup: the same cell opens every chapter. In Colab it installs kvlab from the course
# repository; on your own checkout it installs nothing and only reports the runtime and
# your progress.
import os, subprocess, sys
if "google.colab" in sys.modules:
    try:
        import kvlab
    except ImportError:
        url = os.environ.get("KVLAB_REPO_URL", "{REPO_URL}")
        home = os.environ.get("KVLAB_COLAB_DIR", "{COLAB_DIR}")
        if not os.path.isdir(home):
            subprocess.run(["git", "clone", "-q", "--depth", "1", url, home],
                           check=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", home],
                       check=True)
        sys.path.insert(0, home)
    from google.colab import output
    output.enable_custom_widget_manager()  # lets ipywidgets 8 sliders render in Colab
import kvlab
kvlab.runtime_report()
kvlab.check.progress(brief=True)  # your exercises so far, kept between sessions'''
