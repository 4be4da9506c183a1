"""What a newcomer meets before the first chapter: the wheel and its metadata (license text
included), ``make help``, clear words on macOS and on an old Python (with a faked platform),
the set-up's progress lines, and command-line help that reads as plain text."""
from __future__ import annotations

import ast
import email
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import preflight  # noqa: E402

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


# -- the wheel ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from this checkout, offline, in a copy (no build files in the tree)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ["pyproject.toml", "README.md", "LICENSE"]:
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "kvlab", src / "kvlab", ignore=shutil.ignore_patterns("__pycache__"))
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                          "--no-index", "-q", "-w", str(tmp / "dist"), str(src)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    (path,) = (tmp / "dist").glob("kvlab-*.whl")
    return path


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        return email.message_from_bytes(z.read(name))


def test_the_wheel_ships_the_license_text(wheel):
    with zipfile.ZipFile(wheel) as z:
        licenses = [n for n in z.namelist() if re.search(r"\.dist-info/licenses/LICENSE$", n)]
        assert licenses, f"no LICENSE in {wheel.name}: {z.namelist()[-8:]}"
        text = z.read(licenses[0]).decode()
    assert text.startswith("MIT License") and text == (ROOT / "LICENSE").read_text()
    meta = _metadata(wheel)
    assert meta["License-Expression"] == "MIT" and meta["License-File"] == "LICENSE"


def test_the_metadata_says_what_a_package_index_shows(wheel):
    meta = _metadata(wheel)
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL"))
    assert urls["Issues"] == "https://github.com/kvlab-course/kvlab/issues"
    assert urls["Repository"] == "https://github.com/kvlab-course/kvlab"
    from kvlab.course.colab import SITE_URL

    assert urls["Documentation"] == SITE_URL
    classifiers = meta.get_all("Classifier")
    for needed in ["Operating System :: POSIX :: Linux", "Intended Audience :: Education",
                   "Programming Language :: Python :: 3"]:
        assert needed in classifiers
    assert not [c for c in classifiers if c.startswith("License ::")], (
        "PEP 639: the license is License-Expression, not a classifier")
    assert set(meta.get_all("Provides-Extra")) == {"lab", "hf", "test", "site", "dev"}
    dev = [r for r in meta.get_all("Requires-Dist") if 'extra == "dev"' in r]
    assert [re.sub(r"\s+", "", r.split(";")[0]) for r in dev] == ["kvlab[hf,lab,site,test]"]


def test_the_readme_on_a_package_index_links_nothing_relative(wheel):
    """A package index shows the README without the repository: every link must be absolute."""
    body = _metadata(wheel).get_payload()
    links = re.findall(r"\]\(([^)\s]+)\)", body) + re.findall(r'(?:src|href)="([^"]+)"', body)
    assert links
    relative = [u for u in links if not re.match(r"https?://|#|mailto:", u)]
    assert not relative, f"relative links break on a package index: {relative}"


# -- make help ------------------------------------------------------------------------
def _make(*args, **kw):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "MFLAGS"))}
    return subprocess.run(["make", "-s", "-C", str(ROOT), *args], capture_output=True,
                          text=True, env=env, **kw)


def test_make_help_lists_every_target_with_one_line():
    run = _make("help")
    assert run.returncode == 0, run.stderr
    listed = dict(re.findall(r"^  ([a-z][\w-]*)\s+(\S.*)$", run.stdout, re.M))
    phony = set(re.search(r"^\.PHONY:(.*)$", (ROOT / "Makefile").read_text(), re.M)[1].split())
    assert phony - set(listed) == set(), f"targets without a line in `make help`: {phony - set(listed)}"
    assert set(listed) - phony == set()
    for name in ["lab", "test", "site", "fresh", "help"]:
        assert len(listed[name]) > 10, f"`make help` says too little about {name}"


# -- macOS, Windows, an old Python -----------------------------------------------------
def test_macos_gets_a_sentence_that_points_to_colab():
    (text,) = preflight.problems("darwin", (3, 12))
    assert "pip has no Triton for macOS" in text and "Colab" in text and "Linux" in text
    assert "https://colab.research.google.com/github/" in text


def test_windows_is_pointed_to_wsl():
    (text,) = preflight.problems("win32", (3, 12))
    assert "WSL2" in text


def test_an_old_python_gets_a_sentence():
    (text,) = preflight.problems("linux", (3, 9))
    assert "kvlab needs Python 3.10 or newer" in text and "3.9" in text and "PYTHON=" in text
    assert preflight.problems("linux", (3, 10)) == []
    assert "python3-venv" in preflight.problems("linux", (3, 11), has_venv=False)[0]


def test_the_preflight_colab_link_is_the_course_one():
    from kvlab.course.colab import colab_url

    assert preflight.COLAB_URL == colab_url("notebooks/00_tour.ipynb")


def test_the_preflight_parses_on_old_pythons():
    """It must speak to the very Pythons it turns away: no f-strings or newer syntax."""
    source = (ROOT / "tools" / "preflight.py").read_text()
    try:
        ast.parse(source, feature_version=(3, 5))
    except SyntaxError as exc:
        pytest.fail(f"tools/preflight.py needs a newer Python than 3.5: {exc}")
    assert "from __future__ import annotations" not in source


FAKE = {
    "darwin": 'sys.platform = "darwin"',
    "python38": ('import collections; sys.version_info = collections.namedtuple('
                 '"v", "major minor micro releaselevel serial")(3, 8, 18, "final", 0)'),
}


@pytest.mark.parametrize("fake, expected", [("darwin", "pip has no Triton for macOS"),
                                            ("python38", "is Python 3.8")])
def test_make_setup_stops_with_the_sentence_before_building_anything(tmp_path, fake, expected):
    """`make lab` on a faked platform: the message, no traceback, no environment made."""
    shim = tmp_path / "python3"
    shim.write_text(
        "#!/bin/sh\n"
        f"exec {sys.executable} -c 'import runpy, sys; {FAKE[fake]}; script = sys.argv[1]; "
        "sys.argv = sys.argv[1:]; runpy.run_path(script, run_name=\"__main__\")' \"$@\"\n")
    shim.chmod(0o755)
    venv = tmp_path / "venv"
    run = _make("setup", f"PYTHON={shim}", f"VENV={venv}", "--no-print-directory")
    assert run.returncode != 0
    assert expected in run.stderr and "Traceback" not in run.stderr + run.stdout
    assert not venv.exists(), "the set-up went on after the message"


def test_set_up_prints_a_line_per_step():
    dry = _make("-n", "setup", "VENV=/nonexistent/kvlab-venv").stdout
    steps = re.findall(r'echo "kvlab set-up (\d)/(\d): ', dry)
    assert [int(n) for n, _ in steps] == list(range(1, len(steps) + 1)) and len(steps) >= 4
    assert dry.splitlines()[0].endswith("tools/preflight.py"), "the preflight comes first"


def test_make_lab_passes_allow_root_exactly_for_root():
    dry = _make("-n", "lab", "VENV=.venv").stdout
    jupyter = [line for line in dry.splitlines() if "jupyter lab" in line]
    assert jupyter, dry
    assert ("--allow-root" in jupyter[0]) == (os.geteuid() == 0)
    assert "00_tour.ipynb" in jupyter[0] and "root_dir=\"work\"" in jupyter[0]


# -- command-line help ------------------------------------------------------------------
@pytest.mark.parametrize("module", ["kvlab.bench", "kvlab.course.scenes"])
def test_python_m_help_reads_as_plain_text(module, tmp_path):
    run = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True,
                         cwd=tmp_path, env={**os.environ, "MPLBACKEND": "Agg"}, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"usage: python -m {module}")
    assert "``" not in run.stdout, "reST markup in --help"
    assert list(tmp_path.iterdir()) == [], "--help wrote files"


# -- installing without make -------------------------------------------------------------
def test_readme_installs_from_the_repository_not_from_a_release_that_does_not_exist():
    from kvlab.course.colab import REPO_URL

    readme = (ROOT / "README.md").read_text()
    bare = r"pip install (?:-U )?(['\"]?)kvlab(\[[\w,]+\])?\1(?!\s*@)(?=\s|$|`)"
    assert not re.search(bare, readme), \
        "README offers `pip install kvlab`, a package-index release that does not exist"
    assert f'pip install "kvlab @ git+{REPO_URL}"' in readme
    assert "pip wheel --no-deps -w dist ." in readme and f"dist/kvlab-{PYPROJECT['version']}-" in readme
    assert "--index-url https://download.pytorch.org/whl/cpu" in readme  # the CPU-only torch


_TORCH_LINE = re.compile(r"^[#\s]*(pip install torch --index-url (\S+) .*)$", re.M)


@pytest.mark.parametrize("where", ["README.md", "environment.yml"])
def test_the_cpu_torch_line_has_a_way_out_where_pytorchs_index_is_blocked(where, tmp_path):
    """The install line without make, run as written but with PyTorch's index blocked (a port
    where nothing listens) and pip in this environment (torch is installed: the fallback
    finds it without a network): it gives up on the index at once and succeeds."""
    text = (ROOT / where).read_text()
    (line,) = [m for m in _TORCH_LINE.finditer(text)]
    command, index = line[1], line[2]
    assert index == "https://download.pytorch.org/whl/cpu"
    assert command.endswith("--timeout 10 --retries 0 || pip install torch")
    shim = tmp_path / "pip"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m pip "$@"\n')
    shim.chmod(0o755)
    blocked = command.replace(index, "http://127.0.0.1:9/whl/cpu")
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}",
           "PIP_DRY_RUN": "1", "PIP_FIND_LINKS": "", "PIP_EXTRA_INDEX_URL": "",
           "PIP_CONFIG_FILE": os.devnull}
    started = time.monotonic()
    run = subprocess.run(["sh", "-c", blocked], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert time.monotonic() - started < 120, "pip kept retrying the blocked index"
    assert "127.0.0.1" in run.stdout + run.stderr  # it did try the (blocked) index first
