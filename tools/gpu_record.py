"""The record of the last ``make gpu-check`` on a GPU: ``figures/gpu-check.md``.

    python tools/gpu_record.py --out figures/gpu-check.md \\
        --step "unit tests=/tmp/x/unit.xml" --step "notebooks=/tmp/x/notebooks.xml" \\
        --check "checkers' safety net cost=0"

``tools/gpu_check.sh`` runs each pytest step with ``--junitxml`` and calls this at its end,
whatever the steps gave: the record says when the run was, on which commit and GPU, with which
torch and Triton, and per step how many tests passed, failed, errored and were skipped (with
each skip's reason: a test that needs another machine says which). Only a run on a GPU writes
it: a dry run in the interpreter leaves the GPU's record as it is. CONTRIBUTING says when to
run it and commit the record.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
#: how many failing tests the record names per step (the log has them all)
NAMED_FAILURES = 20


class Step(NamedTuple):
    """One pytest run of the check, as its JUnit XML report counts it."""

    name: str
    passed: int
    failed: int
    errors: int
    skipped: int
    seconds: float
    skips: Counter           # reason -> tests skipped for it
    failures: list[str]      # the failed or erroring tests' ids

    @property
    def green(self) -> bool:
        return self.failed == 0 and self.errors == 0 and self.passed > 0


def read_junit(name: str, path: str) -> Step:
    """The counts of one step from pytest's ``--junitxml`` file (a missing or unreadable file:
    the step did not run to its end, counted as one error)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        return Step(name, 0, 0, 1, 0, 0.0, Counter(), [f"no report ({type(e).__name__})"])
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = Counter()
    seconds = 0.0
    for suite in suites:
        for key in ("tests", "failures", "errors", "skipped"):
            counts[key] += int(suite.get(key, 0))
        seconds += float(suite.get("time", 0.0))
    skips: Counter = Counter()
    failures = []
    for case in root.iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}".strip(":")
        for child in case:
            if child.tag == "skipped":
                skips[_skip_reason(child.get("message", ""))] += 1
            elif child.tag in ("failure", "error"):
                failures.append(test_id)
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return Step(name, passed, counts["failures"], counts["errors"], counts["skipped"], seconds, skips,
                list(dict.fromkeys(failures)))


def _skip_reason(message: str) -> str:
    """pytest's skip message without its location prefix (``Skipped: ...``)."""
    message = message.strip()
    return message[len("Skipped: "):] if message.startswith("Skipped: ") else message or "(no reason given)"


class Machine(NamedTuple):
    gpu: str        # "NVIDIA H200 (sm_90), 1 GPU, CUDA 13.0"
    versions: str   # "Python 3.12.3, torch 2.11.0+cu130, triton 3.6.0, transformers 5.17.0"


def this_machine() -> Machine | None:
    """The GPU and the versions the run used, or None without a CUDA GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(0)
    count = torch.cuda.device_count()
    gpu = (f"{torch.cuda.get_device_name(0)} (sm_{major}{minor}), {count} GPU{'s' if count > 1 else ''}, "
           f"CUDA {torch.version.cuda}")
    versions = [f"Python {platform.python_version()}", f"torch {torch.__version__}"]
    for module in ("triton", "transformers"):
        try:
            versions.append(f"{module} {__import__(module).__version__}")
        except ImportError:
            versions.append(f"{module} (not installed)")
    return Machine(gpu, ", ".join(versions))


def this_commit() -> str:
    """The checkout's commit, and whether files differ from it (the record itself aside)."""
    def git(*args: str) -> str:
        run = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
        return run.stdout.strip() if run.returncode == 0 else ""

    head = git("rev-parse", "--short=12", "HEAD")
    if not head:
        return "not a git checkout"
    changed = [line for line in git("status", "--porcelain").splitlines()
               if not line.endswith("figures/gpu-check.md")]
    return head + (f" with {len(changed)} files changed" if changed else "")


def render(steps: list[Step], checks: dict[str, bool], machine: Machine, commit: str, date: str,
           settings: dict[str, str]) -> str:
    """The record's Markdown."""
    green = all(s.green for s in steps) and all(checks.values())
    lines = ["# The last `make gpu-check` on a GPU", "",
             "Written by `tools/gpu_check.sh` (`tools/gpu_record.py`) at the end of every run on a GPU: "
             "commit it with the change it validated (CONTRIBUTING.md, \"Validated on a GPU\").", "",
             f"**{'green' if green else 'RED'}**: "
             + ", ".join(f"{s.name} {s.passed} passed, {s.failed} failed, {s.errors} errors, "
                         f"{s.skipped} skipped" for s in steps), "",
             "| | |", "|---|---|",
             f"| date | {date} |", f"| commit | {commit} |", f"| GPU | {machine.gpu} |",
             f"| versions | {machine.versions} |"]
    lines += [f"| {key} | `{value}` |" for key, value in settings.items() if value]
    lines += ["", "| step | passed | failed | errors | skipped | minutes |", "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {s.name} | {s.passed} | {s.failed} | {s.errors} | {s.skipped} | {s.seconds / 60:.1f} |"
              for s in steps]
    lines += [f"| {name} | {'passed' if ok else 'FAILED'} | | | | |" for name, ok in checks.items()]
    for s in steps:
        if s.failures:
            shown = s.failures[:NAMED_FAILURES]
            more = len(s.failures) - len(shown)
            lines += ["", f"Failed in {s.name}:", ""] + [f"- `{f}`" for f in shown]
            lines += [f"- ... and {more} more (the run's log has them all)"] if more else []
    for s in steps:
        if s.skips:
            lines += ["", f"Skipped in {s.name} (each needs another machine, or a package this one lacks):", ""]
            lines += [f"- {n} x {reason}" for reason, n in s.skips.most_common()]
    return "\n".join(lines) + "\n"


def _named(pairs: list[str], flag: str) -> list[tuple[str, str]]:
    out = []
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.strip():
            raise SystemExit(f"gpu_record.py: {flag} takes NAME=VALUE, got {pair!r}")
        out.append((name.strip(), value.strip()))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/gpu_record.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "figures" / "gpu-check.md"), help="the record to write")
    ap.add_argument("--step", action="append", default=[], help="NAME=JUNIT_XML of a pytest step")
    ap.add_argument("--check", action="append", default=[], help="NAME=EXIT_CODE of another step")
    args = ap.parse_args(argv)
    machine = this_machine()
    if machine is None:
        print(f"gpu_record.py: no CUDA GPU here: the GPU's record {args.out} is left as it is")
        return 0
    steps = [read_junit(name, path) for name, path in _named(args.step, "--step")]
    checks = {name: code == "0" for name, code in _named(args.check, "--check")}
    settings = {key: os.environ.get(key, "") for key in ("GPU_TESTS", "GPU_NOTEBOOKS")}
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = render(steps, checks, machine, this_commit(), date, settings)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(f"gpu_record.py: wrote {args.out}: " + text.split("\n")[4])
    return 0


if __name__ == "__main__":
    sys.exit(main())
