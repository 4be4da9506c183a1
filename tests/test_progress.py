"""The learner's progress: every exercise of the course with its state, kept in a small JSON file
between sessions (``kvlab.check.progress``), and each chapter's last cell checking its exercises
again (``kvlab.check.recheck``)."""
from __future__ import annotations

import json
import os

import pytest
import torch

import kvlab
import kvlab.check as check
from kvlab.course.checking import progress_file, registry


def right(page_starts, page_size):
    if page_size == 1:
        return page_starts
    offsets = torch.arange(page_size, dtype=page_starts.dtype, device=page_starts.device)
    return (page_starts.unsqueeze(1) + offsets).flatten()


def wrong(page_starts, page_size):
    return page_starts.repeat_interleave(page_size)  # every slot of a page is its start


def starter(page_starts, page_size):
    # YOUR CODE HERE: page_to_token
    raise NotImplementedError


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty progress file and a session in which nothing was checked yet."""
    target = tmp_path / "deep" / "progress.json"
    monkeypatch.setenv(progress_file.ENV, str(target))
    saved = dict(registry.STATUS), dict(registry.LAST_CALL)
    registry.STATUS.clear()
    registry.LAST_CALL.clear()
    yield target
    registry.STATUS.clear()
    registry.STATUS.update(saved[0])
    registry.LAST_CALL.clear()
    registry.LAST_CALL.update(saved[1])


def test_the_file_is_where_the_environment_says_and_tests_never_touch_the_home(fresh):
    assert progress_file.path() == fresh
    # tests/conftest.py points every test (and the kernels they start) away from ~/.cache
    home = os.path.expanduser("~")
    assert not os.environ[progress_file.ENV].startswith(os.path.join(home, ".cache"))


def test_default_file_is_beside_the_c_helper_in_kvlabs_cache(monkeypatch, tmp_path):
    from kvlab.alloc.native_counts import cache_dir

    monkeypatch.delenv(progress_file.ENV)
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path))
    assert progress_file.path() == tmp_path / "progress.json" == \
        progress_file.path().parent / "progress.json"
    assert str(progress_file.path().parent) == cache_dir()


def test_each_outcome_is_saved_with_its_chapter(fresh):
    check.page_to_token(starter)
    assert progress_file.load()["page_to_token"]["state"] == "not attempted"
    with pytest.raises(check.CheckFailed):
        check.page_to_token(wrong)  # plain Python: a failure counts at once
    assert progress_file.load()["page_to_token"]["state"] == "failed"
    check.page_to_token(right)
    entry = json.loads(fresh.read_text())["exercises"]["page_to_token"]
    assert entry["state"] == "passed" and entry["chapter"] == "01" and entry["at"]


def test_a_file_that_cannot_be_read_counts_as_empty_and_is_kept_aside(fresh, capsys):
    fresh.parent.mkdir(parents=True)
    fresh.write_text("{not json")
    assert progress_file.load() == {}
    assert "could not be read" in capsys.readouterr().err
    check.page_to_token(right)
    assert progress_file.load()["page_to_token"]["state"] == "passed"
    assert [p.read_text() for p in fresh.parent.glob("progress.unreadable-*.json")] == ["{not json"]


def test_a_file_that_cannot_be_written_never_breaks_a_check(monkeypatch, tmp_path, fresh):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(progress_file.ENV, str(blocker / "progress.json"))  # its folder is a file
    monkeypatch.setattr(progress_file, "_warned", False)
    with pytest.warns(RuntimeWarning, match="could not save your progress"):
        check.page_to_token(right)
    assert check.status("page_to_token") == "passed"
    check.page_to_token(right)  # warned once only: no second warning is raised here


def test_progress_lists_every_exercise_of_the_course(fresh, capsys):
    fresh.parent.mkdir(parents=True)
    fresh.write_text(json.dumps({"version": 1, "exercises": {
        "write_page_table": {"state": "failed", "chapter": "02", "at": "2025-01-02 03:04"},
        "alloc_decode": {"state": "passed", "chapter": "04", "at": "2025-01-02 03:05"},
        "gone_exercise": {"state": "passed", "chapter": "99", "at": "x"}}}))
    assert check.progress() is None
    out = capsys.readouterr().out.splitlines()
    total = len(check.exercises())
    assert out[0] == (f"Your progress: 1 of {total} exercises passed, 1 failing "
                      "(write_page_table); kvlab.check.progress() lists them all.")
    rows = out[1:-1]
    assert [r.split()[1] for r in rows] == check.exercises()  # all chapters, in chapter order
    assert {r.split()[1]: r.split()[2] for r in rows}["write_page_table"] == "failing"
    assert any(r.split()[:3] == ["04", "alloc_decode", "passed"] and "2025-01-02" in r for r in rows)
    assert str(fresh) in out[-1]
    check.progress(brief=True)
    assert capsys.readouterr().out == out[0] + "\n"


def test_a_new_chapter_appears_by_registering_its_exercise(fresh, capsys):
    calls = []

    @check.exercise("_demo_progress", chapter="99", hints=["one hint", "another hint"])
    def demo(fn):
        calls.append(fn)
        if fn(2) != 4:
            raise check.CheckFailed(f"expected 4, got {fn(2)}")
        print("✓ _demo_progress")

    try:
        check.progress()
        assert "99  _demo_progress" in capsys.readouterr().out
        check.recheck("99")
        assert "· _demo_progress: not checked in this session" in capsys.readouterr().out
        check._demo_progress(lambda x: x * 2)
        assert calls and check.status("_demo_progress") == "passed"
        check.recheck(99)  # "99", 99 and "099" name the same chapter
        assert len(calls) == 2 and "✓ _demo_progress" in capsys.readouterr().out
    finally:
        del check.EXERCISES["_demo_progress"]


def test_progress_lists_each_chapter_in_the_order_its_notebook_asks(fresh, capsys):
    # alphabetically chapter 10 would list pad_decode_batch first and chapter 05 insert_prefix
    names = check.exercises()
    for earlier, later in [("paged_attention_step", "pad_decode_batch"), ("match_prefix", "match_req"),
                           ("match_req", "insert_prefix"), ("page_hashes", "hash_match"),
                           ("hash_match", "allocate_pages"), ("allocate_pages", "free_pages"),
                           ("alloc_extend_part1", "alloc_extend_part2")]:
        assert names.index(earlier) < names.index(later)
    check.progress()
    rows = capsys.readouterr().out.splitlines()[1:-1]
    assert [r.split()[1] for r in rows] == names


def test_choose_names_what_a_learner_can_reach(fresh, capsys):
    from kvlab.prefix.hash_cache import HashPrefixCache

    check.choose("page_to_token", starter, kvlab.page_to_token)
    check.choose("free_pages", starter, HashPrefixCache.free)
    check.choose("hash_match", starter, kvlab.solutions.get("hash_match"))
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("using kvlab.page_to_token (your starter has not passed")
    assert out[1].startswith("using kvlab.HashPrefixCache.free (")
    assert out[2].startswith("using the reference solution of hash_match "
                             "(kvlab.solutions.show('hash_match') prints it) (")
    assert not any("kvlab.check.ch" in line for line in out)


def test_recheck_says_a_part_was_not_run_when_the_part_before_it_failed(fresh, capsys):
    import kvlab.solutions

    wrong = lambda *args, **kwargs: None  # noqa: E731 - writes nothing: part 1 fails
    with pytest.raises(check.CheckFailed):
        check.alloc_extend_part1(wrong, n_random=0)
    with pytest.raises(check.CheckFailed, match="1 of 3 exercises of chapter 03 fails"):
        check.recheck("03")
    out = capsys.readouterr().out
    assert ("· alloc_extend_part2: not checked in this session: kvlab.check.alloc_extend_part1 "
            "failed before it in the same cell") in out
    assert ("· alloc_extend_part3: not checked in this session (nor is alloc_extend_part2, checked "
            "before it in the same cell") in out
    assert kvlab.solutions.get("alloc_extend_part1") is not None


def test_recheck_runs_the_function_last_checked_again(fresh, capsys):
    check.page_to_token(right, n_random=1)
    capsys.readouterr()
    check.recheck("01")
    out = capsys.readouterr().out
    assert out.startswith("Chapter 01, each exercise checked again")
    assert "✓ page_to_token: all" in out and "1 random" in out  # the same arguments as before
    assert out.splitlines()[-1].startswith("Your progress: 1 of")


def test_recheck_fails_naming_each_failing_exercise_and_records_it(fresh, capsys):
    with pytest.raises(check.CheckFailed):
        check.page_to_token(wrong)
    with pytest.raises(check.CheckFailed) as caught:
        check.recheck("1")
    err = caught.value
    assert err.checked_by == "kvlab.check.recheck('01')"
    assert err.message.startswith("1 of 1 exercise of chapter 01 fails:\npage_to_token: [")
    assert "failing (page_to_token)" in capsys.readouterr().out
    assert progress_file.load()["page_to_token"]["state"] == "failed"


def test_recheck_of_a_starter_says_not_attempted_without_the_notebook_line(fresh, capsys):
    check.page_to_token(starter)
    capsys.readouterr()
    check.recheck("01")
    out = capsys.readouterr().out
    assert "· page_to_token: not attempted yet (the line '# YOUR CODE HERE" in out
    assert "not attempted yet: " not in out  # notebooks/conftest.py counts those lines once each


def test_recheck_of_an_unknown_chapter_names_the_known_ones(fresh):
    with pytest.raises(KeyError, match="chapter '42' has no exercises; chapters with exercises: 00, 01"):
        check.recheck("42")


def test_check_hint_and_show_return_nothing_for_a_notebook_to_echo(fresh, capsys):
    assert check.page_to_token(right) is None
    assert check.hint("page_to_token", 1) is None
    assert kvlab.solutions.show("page_to_token") is None
    out = capsys.readouterr().out
    assert out.count("Hint 1/") == 1 and out.count("# Reference solution") == 1
