"""The setup cell that opens every chapter, and the one place the course's URL is set.

In Colab the cell clones :data:`REPO_URL` and installs kvlab from it (Colab already has
torch and triton); on a local checkout it only reports the runtime. Everywhere it ends with
one line of the learner's progress (:func:`kvlab.check.progress`). ``tools/build_notebooks.py``
puts :data:`SETUP_CELL` first in every notebook, and a test checks they all match.
"""

#: Where Colab fetches the course from. Change it here (and in pyproject's [project.urls])
#: when you host a fork; ``KVLAB_REPO_URL`` in the environment overrides it at run time.
REPO_URL = "https://github.com/kvlab-course/kvlab"

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
            subprocess.run(["git", "clone", "-q", "--depth", "1", url, home], check=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", home], check=True)
        sys.path.insert(0, home)
    from google.colab import output
    output.enable_custom_widget_manager()  # lets ipywidgets 8 sliders render in Colab
import kvlab
kvlab.runtime_report()
kvlab.check.progress(brief=True)  # your exercises so far, kept between sessions'''
