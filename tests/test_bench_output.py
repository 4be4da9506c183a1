"""``python -m kvlab.bench --out``: a folder that cannot take the results is refused in one line,
before anything is measured; a finished run that cannot be written is kept elsewhere, never lost
(kvlab.bench.output)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import kvlab.bench.__main__ as cli
from kvlab.bench.output import BadOut, NotWritten, checked_out

ROOT = Path(__file__).resolve().parents[1]
PARTS = {"--memory": "memory_main", "--serve": "serve_main", "--attention": "attention_main"}


class Measured(Exception):
    """The command started measuring (it must not have, for a bad --out)."""


@pytest.fixture
def no_measuring(monkeypatch):
    def measure(*args, **kwargs):
        raise Measured
    for name in ("run", *PARTS.values()):
        monkeypatch.setattr(cli, name, measure)


def bad_outs(tmp_path: Path) -> dict[str, str]:
    """Folders that cannot take the results, by why."""
    a_file = tmp_path / "results.txt"
    a_file.write_text("not a folder")
    return {"an empty string": "", "blanks": "   ", "an existing file": str(a_file),
            "a folder under a file": str(a_file / "bench")}


@pytest.mark.parametrize("flag", ["", *PARTS])
def test_a_bad_out_is_refused_in_one_line_before_measuring(flag, tmp_path, no_measuring, capsys):
    for why, out in bad_outs(tmp_path).items():
        assert cli.main(([flag] if flag else []) + ["--smoke", "--out", out]) == 2, why
        err = capsys.readouterr().err.strip()
        assert err.startswith("python -m kvlab.bench: --out") and "\n" not in err, (why, err)


@pytest.mark.parametrize("flag", list(PARTS))
@pytest.mark.parametrize("damage", ["{not json", "[1, 2]", "\udcff"])
def test_a_part_run_refuses_a_damaged_bench_json_before_measuring(flag, damage, tmp_path, no_measuring,
                                                                  capsys):
    (tmp_path / "bench.json").write_bytes(damage.encode("utf-8", "surrogateescape"))
    assert cli.main([flag, "--smoke", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "its bench.json, which cannot be read" in err and "move it aside" in err and "\n" not in err
    assert (tmp_path / "bench.json").read_bytes() == damage.encode("utf-8", "surrogateescape")


def test_the_whole_suite_overwrites_bench_json_so_a_damaged_one_does_not_matter(tmp_path):
    (tmp_path / "bench.json").write_text("{not json")
    assert checked_out(str(tmp_path), adds_to_existing=False) == str(tmp_path)
    with pytest.raises(BadOut):
        checked_out(str(tmp_path), adds_to_existing=True)


def test_a_missing_folder_is_made_before_measuring(tmp_path):
    out = tmp_path / "new" / "results"
    assert checked_out(str(out), adds_to_existing=True) == str(out) and out.is_dir()


def test_a_finished_run_that_cannot_be_written_is_kept_elsewhere(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "run", lambda **kw: {"targets": [], "measured": 42})

    def disk_full(res, out):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cli, "write_outputs", disk_full)
    assert cli.main(["--smoke", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert "No space left on device" in err and "\n" not in err
    kept = Path(err.rsplit("kept in ", 1)[1])
    assert json.loads(kept.read_text())["measured"] == 42
    kept.unlink()


def test_a_finished_part_that_cannot_be_written_is_kept_elsewhere(tmp_path, monkeypatch):
    def gone(res, out, plots):
        raise FileNotFoundError(2, "No such file or directory", out)

    monkeypatch.setattr(cli, "write_outputs", gone)
    with pytest.raises(NotWritten) as info:
        cli._add_part(str(tmp_path), "memory", {"rows": [1, 2, 3]}, True, "12_bench_memory.png")
    kept = json.loads(Path(info.value.kept).read_text())
    assert kept["memory"]["rows"] == [1, 2, 3] and "meta" in kept["memory"]
    Path(info.value.kept).unlink()


def test_the_command_line_says_one_line_and_stops_at_once():
    run = subprocess.run([sys.executable, "-m", "kvlab.bench", "--memory", "--out", ""], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    assert run.stderr.strip() == "python -m kvlab.bench: --out: a folder to write the results in (got '')"
    assert "Traceback" not in run.stdout + run.stderr
