"""The learner's own copies (``make lab`` / ``make fresh``): made once, never overwritten, a
course update reported, a fresh copy on request with the old one kept when it was edited."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import workspace  # noqa: E402


@pytest.fixture
def course(tmp_path, monkeypatch):
    """A small course: two chapters, both builds."""
    course = tmp_path / "notebooks"
    (course / "solutions").mkdir(parents=True)
    for name in ["00_tour.ipynb", "01_pages.ipynb"]:
        (course / name).write_text(f"learner {name}")
        (course / "solutions" / name).write_text(f"solutions {name}")
    (course / "conftest.py").write_text("")  # not a notebook
    (course / "glossary.md").write_text("# glossary")
    monkeypatch.setattr(workspace, "COURSE", course)
    return course


def test_the_first_prepare_copies_both_builds(course, tmp_path, capsys):
    work = tmp_path / "work"
    assert workspace.prepare(work) == []
    assert sorted(p.relative_to(work).as_posix() for p in work.rglob("*.ipynb")) == [
        "00_tour.ipynb", "01_pages.ipynb", "solutions/00_tour.ipynb", "solutions/01_pages.ipynb"]
    assert (work / "00_tour.ipynb").read_text() == "learner 00_tour.ipynb"
    assert "copied 4 course notebooks" in capsys.readouterr().out


def test_your_edits_survive_a_course_update(course, tmp_path, capsys):
    work = tmp_path / "work"
    workspace.prepare(work)
    (work / "00_tour.ipynb").write_text("my answers")
    (course / "00_tour.ipynb").write_text("learner 00_tour.ipynb, improved")  # a git pull
    (course / "02_new.ipynb").write_text("learner 02")  # a new chapter
    capsys.readouterr()
    assert workspace.prepare(work) == ["00_tour.ipynb"]
    assert (work / "00_tour.ipynb").read_text() == "my answers"
    assert (work / "02_new.ipynb").read_text() == "learner 02"
    out = capsys.readouterr().out
    assert "the course updated 00_tour.ipynb" in out and "make fresh CHAPTER=00" in out
    assert "01_pages" not in out  # unchanged in the course: nothing to say


def test_the_glossary_the_notebooks_link_is_there_and_kept_current(course, tmp_path):
    work = tmp_path / "work"
    workspace.prepare(work)
    assert (work / "glossary.md").read_text() == "# glossary"
    (course / "glossary.md").write_text("# glossary, with a new term")  # a git pull
    assert workspace.prepare(work) == []  # not the learner's work: nothing to report
    assert (work / "glossary.md").read_text() == "# glossary, with a new term"
    assert not (work / "conftest.py").exists()


def test_every_relative_link_of_the_real_notebooks_resolves_in_the_workspace(tmp_path):
    """What JupyterLab opens from a learner's copies: each link to a chapter or the glossary
    (and the heading it names) is there."""
    import re

    import nbformat

    work = tmp_path / "work"
    workspace.prepare(work)
    glossary = (work / "glossary.md").read_text()
    headings = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                for h in re.findall(r"^#+ (.+)$", glossary, flags=re.M)}
    checked = 0
    for path in sorted(work.rglob("[0-9][0-9]_*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type != "markdown":
                continue
            for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", cell.source)):
                if re.match(r"[a-z][a-z0-9+.-]*:|#", target):
                    continue
                file, _, anchor = target.partition("#")
                assert (path.parent / file).is_file(), f"{path.relative_to(work)} links {target}"
                if file.endswith("glossary.md") and anchor:
                    assert anchor in headings, f"{path.relative_to(work)} links {target}"
                checked += 1
    assert checked > 100


def test_fresh_replaces_one_chapter_and_keeps_yours(course, tmp_path):
    work = tmp_path / "work"
    workspace.prepare(work)
    (work / "00_tour.ipynb").write_text("my answers")
    (course / "00_tour.ipynb").write_text("learner 00_tour.ipynb, improved")
    kept = workspace.fresh(work, "00")
    assert (work / "00_tour.ipynb").read_text() == "learner 00_tour.ipynb, improved"
    assert [p.read_text() for p in kept] == ["my answers"]  # the untouched solutions: not kept
    assert not list((work / "solutions").glob("00_tour.*.ipynb"))
    assert (work / "01_pages.ipynb").read_text() == "learner 01_pages.ipynb"  # untouched
    record = json.loads((work / workspace.RECORD).read_text())
    assert workspace.prepare(work) == []  # the fresh copy is current
    assert set(record) >= {"00_tour.ipynb", "solutions/00_tour.ipynb"}


def test_fresh_names_a_chapter_by_its_number(course, tmp_path):
    with pytest.raises(SystemExit, match="CHAPTER is its two-digit number"):
        workspace.fresh(tmp_path / "work", "7")


def test_the_lab_overrides_turn_the_news_popup_off(tmp_path):
    path = workspace.write_lab_overrides(tmp_path)
    settings = json.loads(path.read_text())["@jupyterlab/apputils-extension:notification"]
    assert settings == {"fetchNews": "false", "checkForUpdates": False}
    assert path == tmp_path / "share" / "jupyter" / "lab" / "settings" / "overrides.json"


def test_the_workspace_is_ignored_by_git():
    assert "work/" in (ROOT / ".gitignore").read_text().split()


# --- nothing of the learner's is lost, and nothing stops `make lab` with a traceback ----------


def test_fresh_twice_in_the_same_second_keeps_both_copies(course, tmp_path, monkeypatch):
    work = tmp_path / "work"
    workspace.prepare(work)
    monkeypatch.setattr(workspace.time, "strftime", lambda fmt, *a: "20250102-030405")
    (work / "00_tour.ipynb").write_text("my first answers")
    first = workspace.fresh(work, "00")
    (work / "00_tour.ipynb").write_text("my second answers")  # edited the fresh copy at once
    second = workspace.fresh(work, "00")
    kept = sorted(p.read_text() for p in work.glob("00_tour.*.ipynb"))
    assert kept == ["my first answers", "my second answers"]
    assert {p.name for p in first} | {p.name for p in second} == {
        "00_tour.20250102-030405.ipynb", "00_tour.20250102-030405-2.ipynb"}
    assert not list((work / "solutions").glob("00_tour.*.ipynb"))  # never edited: not kept


def test_fresh_keeps_no_copy_you_never_edited(course, tmp_path, capsys):
    """A copy whose cells are those it was made with is replaced, even after a course update
    (its old version is in the course's history, not the learner's work); running its cells
    (outputs, kernel metadata) is no edit."""
    import nbformat

    for build in ("", "solutions/"):
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1"),
                                             nbformat.v4.new_markdown_cell("# 00")])
        nbformat.write(nb, course / f"{build}00_tour.ipynb")
    work = tmp_path / "work"
    workspace.prepare(work)
    ran = nbformat.read(work / "00_tour.ipynb", as_version=4)
    ran.cells[0].outputs = [nbformat.v4.new_output("stream", text="ran\n")]
    ran.cells[0].execution_count = 1
    ran.metadata["language_info"] = {"name": "python", "version": "3.99"}
    nbformat.write(ran, work / "00_tour.ipynb")
    updated = nbformat.read(course / "00_tour.ipynb", as_version=4)
    updated.cells[0].source = "x = 2  # the course's new version"
    nbformat.write(updated, course / "00_tour.ipynb")  # a git pull
    capsys.readouterr()
    assert workspace.fresh(work, "00") == []
    assert sorted(p.relative_to(work).as_posix() for p in work.rglob("*.ipynb")) == [
        "00_tour.ipynb", "01_pages.ipynb", "solutions/00_tour.ipynb", "solutions/01_pages.ipynb"]
    assert "x = 2" in (work / "00_tour.ipynb").read_text()
    out = capsys.readouterr().out
    assert out.count("nothing to keep") == 2 and "kept your" not in out
    # an edit, however small, is kept
    edited = nbformat.read(work / "00_tour.ipynb", as_version=4)
    edited.cells[1].source += "!"
    nbformat.write(edited, work / "00_tour.ipynb")
    (kept,) = workspace.fresh(work, "00")
    assert nbformat.read(kept, as_version=4).cells[1].source == "# 00!"


DAMAGED_RECORDS = {"a list": b"[]", "null": b"null", "a number": b"5", "not JSON": b"{",
                   "not UTF-8": b"\xff\xfe{", "nested too deep": b"[" * 100_000 + b"]" * 100_000}


@pytest.fixture
def lab(course, tmp_path, monkeypatch):
    """`make lab`'s first step, with JupyterLab's settings written into the test's folder."""
    monkeypatch.setattr(workspace, "write_lab_overrides", lambda: workspace.LAB_OVERRIDES)
    monkeypatch.setattr(workspace, "write_server_config", lambda: workspace.server_config())
    monkeypatch.setattr(workspace, "_trust", lambda path: None)  # not into the real home
    return lambda work: workspace.main(["prepare", str(work)])


@pytest.mark.parametrize("kind", DAMAGED_RECORDS)
def test_a_damaged_record_costs_one_line_and_make_lab_carries_on(lab, course, tmp_path, capsys, kind):
    work = tmp_path / "work"
    assert lab(work) == 0
    (work / "00_tour.ipynb").write_text("my answers")
    (course / "02_new.ipynb").write_text("learner 02")
    (work / workspace.RECORD).write_bytes(DAMAGED_RECORDS[kind])
    capsys.readouterr()
    assert lab(work) == 0
    out, err = capsys.readouterr()
    said = [line for line in out.splitlines() if workspace.RECORD in line]
    assert len(said) == 1 and "carrying on" in said[0] and err == ""
    assert (work / "00_tour.ipynb").read_text() == "my answers"  # the learner's work untouched
    assert (work / "02_new.ipynb").read_text() == "learner 02"  # and the new chapter arrived
    record = json.loads((work / workspace.RECORD).read_text())
    assert record["02_new.ipynb"] and isinstance(record, dict)  # a sound record again
    assert lab(work) == 0 and workspace.RECORD not in capsys.readouterr().out  # said once


def test_a_record_with_entries_it_cannot_use_keeps_the_others(course, tmp_path):
    work = tmp_path / "work"
    workspace.prepare(work)
    record = json.loads((work / workspace.RECORD).read_text())
    record["01_pages.ipynb"] = ["not", "a", "digest"]
    (work / workspace.RECORD).write_text(json.dumps(record))
    (course / "00_tour.ipynb").write_text("learner 00, improved")
    assert workspace.prepare(work) == ["00_tour.ipynb"]  # still reported from the sound entry


def test_a_record_it_cannot_write_costs_one_line_and_make_lab_carries_on(lab, tmp_path, capsys, monkeypatch):
    work = tmp_path / "work"

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(workspace.tempfile, "mkstemp", read_only)
    assert lab(work) == 0
    out, err = capsys.readouterr()
    assert (work / "00_tour.ipynb").exists() and err == ""
    said = [line for line in out.splitlines() if workspace.RECORD in line]
    assert len(said) == 1 and "Permission denied" in said[0]
    assert not list(work.glob(".course-copies-*"))  # no half-written leftovers


def test_a_workspace_it_cannot_write_is_one_line_and_an_exit_code(lab, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert lab(blocker / "work") == 1
    out, err = capsys.readouterr()
    assert out.startswith("kvlab: could not prepare") and len(out.splitlines()) == 1 and err == ""


@pytest.mark.parametrize("raw", ["[]", "null", "{", "5"])
def test_damaged_lab_settings_are_replaced(tmp_path, raw):
    path = tmp_path / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
    path.parent.mkdir(parents=True)
    path.write_text(raw)
    assert workspace.write_lab_overrides(tmp_path) == path
    assert json.loads(path.read_text()) == workspace.LAB_OVERRIDES


def test_the_server_settings_silence_what_a_learner_cannot_act_on(tmp_path):
    path = tmp_path / "etc" / "jupyter" / "jupyter_server_config.json"
    path.parent.mkdir(parents=True)
    path.write_text('{"ServerApp": {"open_browser": false}, "Other": {"x": 1}}')  # yours, kept
    assert workspace.write_server_config(tmp_path) == path
    config = json.loads(path.read_text())
    assert config["ServerApp"] == {"open_browser": False,
                                   "tornado_settings": {"ws_ping_timeout": 30_000}}
    assert config["Other"] == {"x": 1}
    import zmq

    if zmq.has("curve"):  # pyzmq's wheels have it: the kernels' traffic is encrypted
        assert config["KernelManager"] == {"transport_encryption": "auto"}


def test_make_lab_signs_its_copies_as_trusted(course, tmp_path, monkeypatch):
    import nbformat
    from nbformat.sign import NotebookNotary

    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "jupyter-data"))
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")]),
                   course / "00_tour.ipynb")
    work = tmp_path / "work"
    workspace.prepare(work, trust=True)
    notary = NotebookNotary()
    assert notary.check_signature(nbformat.read(work / "00_tour.ipynb", as_version=4))
    assert (work / "01_pages.ipynb").read_text() == "learner 01_pages.ipynb"  # no notebook: as is
