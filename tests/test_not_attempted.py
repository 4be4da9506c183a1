"""An unattempted exercise never breaks a notebook: one 'not attempted yet:' line, no exception,
and later cells use the package's code until the learner's passes."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import kvlab
import kvlab.check as check
from kvlab.course.checking import core


def starter_page_to_token(page_starts, page_size):
    """Every slot of the given pages, in order."""
    # YOUR CODE HERE: page_to_token
    raise NotImplementedError("write page_to_token")


def raising_page_to_token(page_starts, page_size):
    raise NotImplementedError  # no marker: the run itself says it is not written yet


def wrong_page_to_token(page_starts, page_size):
    return page_starts


def right_page_to_token(page_starts, page_size):
    if page_size == 1:
        return page_starts
    offsets = torch.arange(page_size, dtype=page_starts.dtype, device=page_starts.device)
    return (page_starts.unsqueeze(1) + offsets).flatten()


@triton.jit
def starter_decode_kernel(seq_lens_ptr, last_loc_ptr, free_pages_ptr, out_ptr, ret_ptr,
                          bs_upper: tl.constexpr, page_size: tl.constexpr):
    pid = tl.program_id(0)
    # YOUR CODE HERE: alloc_decode
    pass


def _one_line(out: str, name: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith("not attempted yet:")]
    assert len(lines) == 1, out
    assert name in lines[0] and f'kvlab.check.hint({name!r}, 1)' in lines[0]
    return lines[0]


@pytest.mark.parametrize("starter", [starter_page_to_token, raising_page_to_token])
def test_a_function_starter_prints_one_line_and_returns(starter, capsys):
    assert check.page_to_token(starter) is None  # nothing for a notebook to echo
    _one_line(capsys.readouterr().out, "page_to_token")
    assert check.status("page_to_token") == "not attempted"


def test_a_kernel_starter_is_recognised_by_its_marker_without_running(capsys, monkeypatch):
    ran = []
    monkeypatch.setattr(core, "call_learner", lambda *a, **k: ran.append(1))
    assert check.alloc_decode(starter_decode_kernel) is None
    line = _one_line(capsys.readouterr().out, "alloc_decode")
    assert "# YOUR CODE HERE: alloc_decode" in line and not ran


def test_a_marker_of_another_exercise_does_not_count():
    assert check.not_attempted(starter_decode_kernel, "alloc_decode") is not None
    assert check.not_attempted(starter_decode_kernel, "alloc_decod") is None
    assert check.not_attempted(starter_decode_kernel, "alloc_extend_part1") is None
    assert check.not_attempted(right_page_to_token, "page_to_token") is None


def test_a_wrong_answer_still_fails_and_a_right_one_passes(capsys):
    with pytest.raises(check.CheckFailed):
        check.page_to_token(wrong_page_to_token)
    assert check.status("page_to_token") == "failed"
    assert check.page_to_token(right_page_to_token) is None
    assert check.status("page_to_token") == "passed"
    assert "not attempted yet" not in capsys.readouterr().out


def test_choose_uses_the_package_until_the_learner_passes(capsys):
    check.page_to_token(starter_page_to_token)
    capsys.readouterr()
    assert check.choose("page_to_token", right_page_to_token, kvlab.page_to_token) is kvlab.page_to_token
    out = capsys.readouterr().out
    assert "using kvlab.page_to_token" in out and "not attempted" in out
    check.page_to_token(right_page_to_token)
    assert check.choose("page_to_token", right_page_to_token, kvlab.page_to_token) is right_page_to_token
    assert "using your right_page_to_token" in capsys.readouterr().out


def test_status_of_an_unchecked_and_an_unknown_exercise():
    assert check.status("extend_scan") in ("not checked", "passed", "failed", "not attempted")
    with pytest.raises(KeyError, match="no exercise named"):
        check.status("no_such_exercise")
