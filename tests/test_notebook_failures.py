"""A wrong answer in a notebook: its message at a glance, and Run All goes on.

In IPython a check's failure shows its message (and picture), never kvlab's frames; a crash in
the learner's code shows the learner's own lines. In a Jupyter kernel the failure does not stop
Run All: later cells use the package's version. The solutions build must still fail under
nbval (``make test-notebooks``), and no cell may echo what a kvlab call returned.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[0-9;]*m")

#: a wrong answer for chapter 01's exercise: the right number of slots, wrong values
WRONG_01 = '''def my_page_to_token(page_starts, page_size):
    return page_starts.repeat_interleave(page_size)  # every slot of a page is its start


kvlab.check.page_to_token(my_page_to_token);'''

CRASH = '''def helper(starts):
    return starts + undefined_name

def crash(page_starts, page_size):
    return helper(page_starts)

kvlab.check.page_to_token(crash)'''


def execute(nb: nbformat.NotebookNode, cwd: Path, allow_errors: bool = False):
    """Run ``nb`` in a kernel of this Python, as JupyterLab's Run All does (it stops at the first
    cell whose reply is an error, unless ``allow_errors``)."""
    import ipykernel.kernelspec
    from jupyter_client import KernelManager
    from jupyter_client.kernelspec import KernelSpecManager
    from nbclient import NotebookClient

    class ThisPython(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            return self.kernel_spec_class(resource_dir=ipykernel.kernelspec.RESOURCES,
                                          **ipykernel.kernelspec.get_kernel_dict())

    km = KernelManager(kernel_name="kvlab-test", kernel_spec_manager=ThisPython())
    client = NotebookClient(nb, km=km, timeout=600, allow_errors=allow_errors,
                            resources={"metadata": {"path": str(cwd)}})
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}  # inline figures, as in a lab
    # a progress file of this notebook's own: other tests in this process record failures too
    env["KVLAB_PROGRESS_FILE"] = str(cwd / "progress.json")
    client.execute(env=env)
    return nb


def notebook(*sources: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    return nb


def errors(cell) -> list[str]:
    return [ANSI.sub("", "\n".join(o.traceback)) for o in cell.outputs if o.output_type == "error"]


def text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def assert_no_kvlab_frames(shown: str) -> None:
    assert "kvlab/" not in shown and "Traceback" not in shown and "File " not in shown, shown


def test_in_a_kernel_failures_show_their_message_and_the_learners_lines_only(tmp_path):
    nb = notebook(
        "import os, kvlab, torch",
        "def wrong(page_starts, page_size):\n    return page_starts.repeat_interleave(page_size)\n"
        "kvlab.check.page_to_token(wrong)",
        CRASH,  # in a forked child (the interpreter on Linux)
        'os.environ["KVLAB_SANDBOX"] = "spawn"  # a spawned child, as on a GPU\n' + CRASH,
        'os.environ["KVLAB_SANDBOX"] = "inprocess"\n' + CRASH,
        'print(kvlab.check.status("page_to_token"))',
        "1 / 0",  # any other error still stops Run All
        "print('never runs')",
    )
    with pytest.raises(Exception, match="ZeroDivisionError"):
        execute(nb, tmp_path)
    cells = nb.cells
    (wrong,) = errors(cells[1])
    assert_no_kvlab_frames(wrong)
    assert wrong.startswith("✗ kvlab.check.page_to_token: [the example: pages [4, 8] with "
                            "page_size 4] slots: 6 of 8 positions differ")
    assert wrong.splitlines()[-1].startswith("(Run All goes on: later cells use the package's")
    # on a GPU the first check says once, in one line, that learner code runs in a child process
    shown = [o for o in cells[1].outputs if not (
        o.output_type == "stream" and o.text.startswith("kvlab.check: your code runs in a separate process"))]
    assert len(cells[1].outputs) - len(shown) <= 1
    assert [o.output_type for o in shown] == ["display_data", "error"] and "image/png" in shown[0].data
    for cell, below in zip(cells[2:5], (0, 1, 1)):  # fork, spawn, in process: the same report
        (crash,) = errors(cell)
        assert_no_kvlab_frames(crash)
        lines = crash.splitlines()
        assert "your code raised NameError: name 'undefined_name' is not defined" in lines[0]
        assert lines[1:3] == [f"  in crash, line {5 + below}: return helper(page_starts)",
                              f"  in helper, line {2 + below}: return starts + undefined_name"]
    assert text(cells[5]) == "failed\n"  # every check above counted, and the run went on
    assert cells[6].execution_count is not None and cells[7].execution_count is None


def test_a_check_that_fails_before_others_in_its_cell_says_they_did_not_run(tmp_path):
    # chapter 03's cell checks parts 1, 2 and 3 in a row: when part 1 fails, the failure and the
    # chapter's recheck say that part 2 was not run, rather than "run its cell above"
    nb = notebook(
        "import kvlab.check as check\n"
        "@check.exercise('_first_part', chapter='98')\n"
        "def first(fn):\n    if fn(1) != 2:\n        raise check.CheckFailed('part 1 is wrong')\n"
        "@check.exercise('_second_part', chapter='98', after='_first_part')\n"
        "def second(fn):\n    print('second checked')",
        "check._first_part(lambda x: x)\ncheck._second_part(lambda x: x)",
        "check.recheck('98')",
    )
    execute(nb, tmp_path)
    (failed,) = errors(nb.cells[1])
    assert failed.splitlines()[-1] == "(The check after it in this cell did not run: kvlab.check._second_part.)"
    assert "second checked" not in text(nb.cells[1])
    said = text(nb.cells[2])
    assert ("· _second_part: not checked in this session: kvlab.check._first_part failed before it "
            "in the same cell, and a failed check ends its cell, so this check did not run") in said
    assert "run its cell above" not in said


def test_in_terminal_ipython_only_a_failure_that_ends_the_cell_counts(tmp_path):
    script = '''
from IPython.core.interactiveshell import InteractiveShell
import kvlab, kvlab.check as check
shell = InteractiveShell.instance()
shell.run_cell("import kvlab\\nright = kvlab.solutions.get('page_to_token')")
shell.run_cell("kvlab.check.page_to_token(right)")
shell.run_cell("try:\\n    kvlab.check.page_to_token(lambda s, p: s)\\nexcept kvlab.check.CheckFailed:\\n    pass")
print("after a caught failure:", check.status("page_to_token"))
result = shell.run_cell("kvlab.check.page_to_token(lambda s, p: s)")
print("error kept outside a kernel:", type(result.error_in_exec).__name__)
print("after an uncaught failure:", check.status("page_to_token"))
'''
    env = dict(os.environ, MPLBACKEND="Agg")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=300)
    out = ANSI.sub("", run.stdout)
    assert run.returncode == 0, run.stderr
    assert "after a caught failure: passed" in out  # a demonstration is not the learner's answer
    assert "error kept outside a kernel: CheckFailed" in out
    assert "after an uncaught failure: failed" in out
    shown = out[out.index("✗ kvlab.check.page_to_token"):out.index("error kept")]
    assert_no_kvlab_frames(shown)
    assert "Run All" not in shown  # no notebook here: nothing goes on


# --- a wrong answer typed into chapter 01, in both builds ------------------------------------


def planted(build: str, folder: Path) -> Path:
    """A copy of chapter 01's ``build`` notebook in ``folder`` with WRONG_01 as its answer."""
    source = ROOT / "notebooks" / ("solutions" if build == "solutions" else "") / \
        "01_page_to_token.ipynb"
    nb = nbformat.read(source, as_version=4)
    (cell,) = [c for c in nb.cells if "def my_page_to_token" in c.source]
    cell.source = WRONG_01
    folder.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, folder / source.name)
    return folder / source.name


def test_a_wrong_answer_fails_the_solutions_build_under_nbval(tmp_path):
    # the same layout as the repository, so notebooks/conftest.py applies as in make test-notebooks
    path = planted("solutions", tmp_path / "notebooks" / "solutions")
    shutil.copy(ROOT / "notebooks" / "conftest.py", tmp_path / "notebooks" / "conftest.py")
    env = dict(os.environ, MPLBACKEND="Agg")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "--nbval-lax",
                          "--nbval-current-env", "-p", "no:cacheprovider", "-p", "no:xdist",
                          str(path)], capture_output=True, text=True, cwd=tmp_path, env=env,
                         timeout=600)
    out = ANSI.sub("", run.stdout)
    assert run.returncode == 1, out[-3000:]
    assert "2 failed" in out, out[-3000:]  # the exercise cell and the chapter's recheck
    assert "✗ kvlab.check.page_to_token" in out and "✗ kvlab.check.recheck('01')" in out


def test_a_wrong_answer_in_a_learner_notebook_runs_to_its_last_cell(tmp_path):
    path = planted("learner", tmp_path)
    nb = execute(nbformat.read(path, as_version=4), tmp_path)  # raises if Run All would stop
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code)
    shown = [(i, e) for i, c in enumerate(code) for e in errors(c)]
    assert [e.splitlines()[0].split(":")[0] for _, e in shown] == [
        "✗ kvlab.check.page_to_token", "✗ kvlab.check.recheck('01')"]
    exercise_at = shown[0][0]
    later = "".join(text(c) for c in code[exercise_at + 1:])
    assert ("using kvlab.page_to_token (your my_page_to_token has not passed "
            "kvlab.check.page_to_token yet: failed)") in later
    assert "1 failing (page_to_token)" in text(code[-1])


# --- notebooks/conftest.py: no stray echoes --------------------------------------------------


def _notebook_conftest():
    spec = importlib.util.spec_from_file_location("notebooks_conftest",
                                                  ROOT / "notebooks" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("source, echoed, stray", [
    ('kvlab.check.hint("page_to_token", 1)', "'Hint 1/4 for page_to_token: ...'", True),
    ("kvlab.check.paged_attention_step(my_step)", "0", True),
    ('kvlab.solutions.show("decode_step")', "'# Reference solution ...'", True),
    ('kvlab.check.page_to_token(fn);', None, False),
    ('kvlab.check.choose("a", f, g)', "<function f>", True),
    ('kvlab.base.runtime.pick(cpu=1, gpu=2)', "1", False),  # not a check, hint or solution
    ('x = kvlab.check.hint("a")\nx', "'...'", False),
    ('%matplotlib inline', None, False),
])
def test_the_notebook_checks_catch_a_stray_echo(source, echoed, stray):
    outputs = [{"output_type": "stream", "name": "stdout", "text": "printed\n"}]
    if echoed is not None:
        outputs.append({"output_type": "execute_result", "data": {"text/plain": echoed}})
    found = _notebook_conftest().stray_echo(source, outputs)
    assert (found is not None) == stray, found
