"""README tells the truth: every notebook is on the course map, every picture and file it
links exists, each chapter with figures shows one, its `make` commands exist, its Colab link
matches kvlab.course.colab.REPO_URL, and the kvlab names and environment variables it cites are real.
Its links are absolute (a package index shows it without the repository), the website's
address stands next to the two commands, and each chapter has its page and Colab badge."""
from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlparse

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _repo_prefixes() -> list[str]:
    from kvlab.course.colab import BRANCH, REPO_URL

    repo = urlparse(REPO_URL).path.strip("/")
    return [f"{REPO_URL}/blob/{BRANCH}/", f"{REPO_URL}/tree/{BRANCH}/",
            f"https://raw.githubusercontent.com/{repo}/{BRANCH}/"]


def _all_links() -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", README) + re.findall(r'src="([^"]+)"', README)


def _local_links() -> list[str]:
    """Files of this repository that README links, by their absolute GitHub URLs."""
    found = []
    for url in _all_links():
        for prefix in _repo_prefixes():
            if url.startswith(prefix):
                found.append(url[len(prefix):])
    return found


def _figures_referenced() -> set[str]:
    return {u for u in _local_links() if u.startswith("figures/")} | set(
        re.findall(r"figures/[\w.-]+\.png", README))


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w-]*)\s*:(?!=)", text, flags=re.M))


def test_readme_names_every_notebook():
    assert NOTEBOOKS, "no notebooks to list"
    missing = [nb.name for nb in NOTEBOOKS if f"notebooks/{nb.name}" not in README]
    assert not missing, f"README's course map does not link {missing}"


def test_every_link_is_absolute():
    relative = [u for u in _all_links() if not re.match(r"[a-z]+://|#|mailto:", u)]
    assert not relative, f"relative links break on a package index: {relative}"


def test_the_website_stands_next_to_the_two_commands():
    from kvlab.course.colab import SITE_URL

    section = README.split("\n## ")[1]
    assert "make lab" in section and "make test" in section and SITE_URL in section, (
        "the first section after the introduction gives the website and the two commands")


def test_each_chapter_has_its_page_and_colab_badge_in_the_course_table():
    from kvlab.course.colab import SITE_URL, colab_url

    for nb in NOTEBOOKS:
        row = [line for line in README.splitlines()
               if line.startswith(f"| {nb.name[:2]} |") and colab_url(f"notebooks/{nb.name}") in line]
        assert row, f"the course table has no Colab badge for {nb.name}"
        assert f"]({SITE_URL}{nb.stem}.html)" in row[0], f"the course table does not link {nb.stem}'s page"
        assert "colab-badge.svg" in row[0]


def test_every_local_link_and_figure_exists():
    links = _local_links()
    assert links, "README links no files"
    missing = sorted({u for u in links + sorted(_figures_referenced())
                      if not (ROOT / u.split("#")[0]).exists()})
    assert not missing, f"README links files that do not exist: {missing}"


def test_each_chapter_with_figures_shows_one():
    shown = _figures_referenced()
    for nb in NOTEBOOKS:
        number = nb.name[:2]
        available = sorted(p.name for p in (ROOT / "figures").glob(f"{number}_*.png"))
        if available:
            assert any(f.startswith(f"figures/{number}_") for f in shown), (
                f"chapter {number} has figures {available} but README shows none of them")


def test_make_commands_exist():
    targets = _make_targets()
    cited = set(re.findall(r"\bmake ([a-z][\w-]*)", README))
    assert {"lab", "test"} <= cited, "README must give the two commands: make lab, make test"
    missing = sorted(cited - targets)
    assert not missing, f"README cites make targets the Makefile lacks: {missing}"


def test_colab_link_matches_the_repository_url():
    from kvlab.course.colab import REPO_URL

    links = re.findall(r"https://colab\.research\.google\.com/github/[^\s>)]+", README)
    assert links, "README has no Colab link"
    repo = urlparse(REPO_URL).path.strip("/")
    assert urlparse(REPO_URL).netloc == "github.com"
    for link in links:
        m = re.fullmatch(r"https://colab\.research\.google\.com/github/([^/]+/[^/]+)/blob/"
                         r"main/(notebooks/[\w.-]+\.ipynb)", link)
        assert m, f"unexpected Colab link {link}"
        assert m.group(1) == repo, f"Colab link points at {m.group(1)}, REPO_URL at {repo}"
        assert (ROOT / m.group(2)).exists(), f"Colab link opens a missing {m.group(2)}"


def test_kvlab_names_in_readme_exist():
    import kvlab

    cited = set(re.findall(r"\bkvlab\.([A-Za-z_]\w*)", README))
    assert cited, "README cites no kvlab names"
    missing = sorted(n for n in cited if n not in dir(kvlab))
    assert not missing, f"README cites kvlab names that do not exist: {missing}"


@pytest.mark.parametrize("module", ["kvlab.bench", "kvlab.course.scenes"])
def test_readme_modules_run_with_python_m(module):
    assert f"python -m {module}" in README
    assert (ROOT / module.replace(".", "/") / "__main__.py").exists()


def test_environment_variables_in_readme_are_read_by_kvlab():
    cited = set(re.findall(r"\bKVLAB_[A-Z_]+\b", README)) - {"KVLAB_REQUIRE_GPU"}
    source = "\n".join(p.read_text() for p in (ROOT / "kvlab").rglob("*.py"))
    missing = sorted(v for v in cited if v not in source)
    assert not missing, f"README cites environment variables kvlab never reads: {missing}"
