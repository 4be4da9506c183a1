"""The learner's progress file keeps everything they earned: notebooks saving at once in separate
processes lose nothing, a file with a UTF-8 BOM is read, and a file that cannot be read (of every
kind) is moved aside with one line saying so (never overwritten, never a crash), its readable
entries carried over; a file that cannot be written loses nothing either."""
from __future__ import annotations

import json
import multiprocessing
import os

import pytest

import kvlab.check as check
from kvlab.course.checking import progress_file, registry


@pytest.fixture
def target(tmp_path, monkeypatch):
    """An empty progress file of this test's own, and a session in which nothing was checked."""
    target = tmp_path / "progress.json"
    monkeypatch.setenv(progress_file.ENV, str(target))
    monkeypatch.setattr(progress_file, "_warned", False)
    monkeypatch.setattr(progress_file, "_pending", {}, raising=False)
    saved = dict(registry.STATUS)
    registry.STATUS.clear()
    yield target
    registry.STATUS.clear()
    registry.STATUS.update(saved)


def entry(state="passed", chapter="01", at="2025-01-02 03:04"):
    return {"state": state, "chapter": chapter, "at": at}


# --- several notebooks at once -----------------------------------------------------------------


def _writer(path: str, who: int, count: int, start) -> None:
    os.environ[progress_file.ENV] = path
    start.wait()
    for i in range(count):
        progress_file.save(f"w{who}_{i}", "01", "passed" if i % 2 else "failed")


@pytest.mark.parametrize("writers, count", [(2, 150), (4, 60)])
def test_notebooks_saving_at_once_in_separate_processes_lose_nothing(target, writers, count):
    progress_file.save("earlier", "00", "passed")
    ctx = multiprocessing.get_context("fork")
    start = ctx.Event()
    procs = [ctx.Process(target=_writer, args=(str(target), w, count, start)) for w in range(writers)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    saved = progress_file.load()
    missing = [f"w{w}_{i}" for w in range(writers) for i in range(count) if f"w{w}_{i}" not in saved]
    assert not missing, f"{len(missing)} of {writers * count} records lost, e.g. {missing[:3]}"
    assert saved["earlier"]["state"] == "passed" and saved["w0_1"]["state"] == "passed"
    assert json.loads(target.read_text())["version"] == 1
    assert [p.name for p in target.parent.iterdir() if p.name.startswith(".progress-")] == []  # no leftovers


def test_a_save_that_cannot_take_the_lock_keeps_its_entry_for_the_next_save(target, monkeypatch):
    import fcntl

    progress_file.save("first", "01", "passed")
    monkeypatch.setattr(progress_file, "LOCK_WAIT_S", 0.05)
    holder = os.open(target.with_name(f".{target.name}.lock"), os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another notebook, stuck in the middle of its save
    try:
        with pytest.warns(RuntimeWarning, match="could not save your progress.*held its lock"):
            progress_file.save("second", "02", "failed")
        assert "second" not in json.loads(target.read_text())["exercises"]
        assert progress_file.load()["second"]["state"] == "failed"  # this session still knows
    finally:
        os.close(holder)
    progress_file.save("third", "03", "passed")
    assert set(json.loads(target.read_text())["exercises"]) == {"first", "second", "third"}


# --- files as a learner's machine may hold them ---------------------------------------------------


def test_a_file_saved_with_a_utf8_bom_is_read_and_kept(target):
    target.write_bytes(b"\xef\xbb\xbf" + json.dumps({"version": 1, "exercises": {"alloc_decode": entry()}}).encode())
    assert progress_file.load()["alloc_decode"]["state"] == "passed"
    progress_file.save("page_to_token", "01", "failed")
    assert set(progress_file.load()) == {"alloc_decode", "page_to_token"}
    assert list(target.parent.glob("progress.unreadable-*")) == []


UNREADABLE = {
    "not JSON": b"{not json",
    "a list": b"[]",
    "null": b"null",
    "a number": b"5",
    "a string": b'"progress"',
    "not UTF-8": b'{"exercises": {"\xff": 1}}',
    "nested too deep": b"[" * 200_000 + b"]" * 200_000,
    "exercises is a list": b'{"version": 1, "exercises": []}',
    "a state that is a list": json.dumps({"exercises": {"alloc_decode": entry(), "page_to_token":
                                                        {"state": ["passed"], "chapter": "01"}}}).encode(),
    "an entry that is a number": json.dumps({"exercises": {"alloc_decode": entry(), "page_to_token": 5}}).encode(),
    "a state nobody writes": json.dumps({"exercises": {"alloc_decode": entry(), "x": entry(state="won")}}).encode(),
    "a chapter that is a dict": json.dumps({"exercises": {"alloc_decode": entry(), "x": entry(chapter={})}}).encode(),
    "deep JSON in an entry (nothing parses)": (b'{"exercises": {"alloc_decode": ' + json.dumps(entry()).encode()
                                               + b', "x": {"state": ' + b"[" * 200_000 + b"]" * 200_000 + b"}}}"),
}


@pytest.mark.parametrize("kind", UNREADABLE)
def test_a_file_it_cannot_read_is_moved_aside_with_one_line_and_never_overwritten(target, kind, capsys):
    raw = UNREADABLE[kind]
    target.write_bytes(raw)
    assert check.progress() is None  # no crash, whatever the file holds
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"kvlab: your progress file {target} could not be read"), err
    aside = list(target.parent.glob("progress.unreadable-*.json"))
    assert len(aside) == 1 and aside[0].read_bytes() == raw, "the learner's file is kept as it was"
    assert aside[0].name in err[0]
    readable = progress_file.load()
    carried = kind.startswith(("a ", "an ")) and kind not in ("a list", "a number", "a string")
    assert readable == ({"alloc_decode": entry()} if carried else {}), "the readable entries are carried over"
    check.page_to_token(lambda starts, P: (starts.unsqueeze(1) + __import__("torch").arange(P, dtype=starts.dtype,
                                           device=starts.device)).flatten())
    assert progress_file.load()["page_to_token"]["state"] == "passed"
    assert capsys.readouterr().err == ""  # said once
    assert list(target.parent.glob("progress.unreadable-*.json")) == aside


def test_two_unreadable_files_in_the_same_second_get_two_names(target, monkeypatch, capsys):
    monkeypatch.setattr(progress_file.time, "strftime", lambda fmt, *a: "20250102-030405" if "%S" in fmt else "x")
    for raw in (b"[1]", b"[2]", b"[3]"):
        target.write_bytes(raw)
        progress_file.load()
    kept = sorted(p.read_bytes() for p in target.parent.glob("progress.unreadable-*.json"))
    assert kept == [b"[1]", b"[2]", b"[3]"]
    assert len(capsys.readouterr().err.splitlines()) == 3


def test_an_unreadable_file_in_a_folder_it_cannot_write_is_left_alone(target, monkeypatch, capsys):
    """A read-only folder (as root a chmod stops nothing, so the writes that need the folder fail
    here on purpose): nothing can be moved or written; the file stays, the session keeps its
    entries, and they are saved once the folder is writable again."""
    target.write_bytes(b"[]")

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    with monkeypatch.context() as m:
        m.setattr(progress_file.os, "rename", refused)
        m.setattr(progress_file.tempfile, "mkstemp", refused)
        with pytest.warns(RuntimeWarning, match="Permission denied"):
            assert check.progress() is None
        progress_file.save("page_to_token", "01", "passed")  # (warned once already)
        assert target.read_bytes() == b"[]", "never wiped"
        assert progress_file.load()["page_to_token"]["state"] == "passed"  # kept in this session
    progress_file.save("alloc_decode", "04", "failed")  # writable again: both saved, the old file aside
    assert set(json.loads(target.read_text())["exercises"]) == {"page_to_token", "alloc_decode"}
    assert [p.read_bytes() for p in target.parent.glob("progress.unreadable-*.json")] == [b"[]"]
    capsys.readouterr()


def test_a_save_merges_into_the_file_as_it_is_now(target):
    progress_file.save("a", "01", "passed")
    # another notebook wrote meanwhile, and a newer kvlab added a field
    data = json.loads(target.read_text())
    data["exercises"]["b"] = entry(state="failed")
    data["exercises"]["a"]["seconds"] = 12
    data["theme"] = "dark"
    target.write_text(json.dumps(data))
    progress_file.save("c", "03", "not attempted")
    data = json.loads(target.read_text())
    assert set(data["exercises"]) == {"a", "b", "c"} and data["theme"] == "dark"
    assert data["exercises"]["a"]["seconds"] == 12
