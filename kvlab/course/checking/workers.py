"""The child processes that run learner code, seen from the notebook's side.

* :class:`ForkWorker` - a fork of the notebook (Linux, interpreter, CUDA never started): it
  inherits the learner's function and is cheap to start; one serves a checker run.
* :class:`SpawnWorker` - a new Python process, the only kind that is safe once CUDA has started
  in the notebook. It is sent functions by source (:mod:`kvlab.course.checking.shipping`), starts its own
  CUDA context, and a crash or an illegal address in it leaves the notebook's GPU working.
  Starting one costs a Python, torch and kvlab import and a CUDA init (``startup_s``), and each
  new kernel compiles in it once, so one is kept for the whole session.

A crash, or no answer within ``TIMEOUT_S``, becomes a :class:`CheckFailed` that says so.
"""
from __future__ import annotations

import contextlib
import io
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ...base import runtime
from .failures import CheckFailed
from .messages import crash_message, timeout_message
from .pipes import recv_msg, send_msg
from .runner import fork_main
from .shipping import file_names

#: Seconds a learner call may take in a child process before it is stopped.
TIMEOUT_S = float(os.environ.get("KVLAB_SANDBOX_TIMEOUT", "60"))
#: Seconds a spawned child may take to start (Python, torch, kvlab, CUDA).
STARTUP_TIMEOUT_S = float(os.environ.get("KVLAB_SANDBOX_STARTUP_TIMEOUT", "180"))


class Worker:
    """A child process serving calls over two pipes (see the module docstring)."""

    pid: int
    to_child: int
    from_child: int
    alive = False
    renames: dict[str, str] = {}

    def call(self, blob: bytes | None, timeout: float | None = None) -> dict:
        """Send a call (None: the first one, inherited at fork) and wait for the answer."""
        timeout = self.timeout = TIMEOUT_S if timeout is None else timeout
        try:
            if blob is not None:
                send_msg(self.to_child, blob)
            data, timed_out = recv_msg(self.from_child, timeout)
        except BrokenPipeError:
            data, timed_out = None, False
        except BaseException:  # e.g. KeyboardInterrupt in the notebook: do not leave the child
            self.kill()
            raise
        if data is None:
            return self.fail(timed_out)
        try:
            return pickle.loads(data)
        except Exception as e:  # noqa: BLE001 - e.g. a function of the child's own in the answer
            return {"status": "raised", "summary": f"TypeError: the return value could not be "
                    f"sent back from the child process ({type(e).__name__}: {e}); return tensors, "
                    "numbers or lists of them", "traceback": "", "exception": None,
                    "accesses": [], "stdout": "", "stderr": ""}

    def fail(self, timed_out: bool):
        if timed_out:
            self._signal(signal.SIGKILL)
        sig, code = self._wait()
        self.crash_log.seek(0)
        text = self.crash_text = self.crash_log.read().decode(errors="replace")
        self._close_fds()
        if timed_out:
            raise CheckFailed(timeout_message(self.timeout), label="timeout")
        raise CheckFailed(crash_message(sig, code, text, self.renames), label="crash")

    def kill(self) -> None:
        if self.alive:
            self._signal(signal.SIGKILL)
            self._wait()
            self._close_fds()

    def close(self) -> None:
        """Close the pipes: the child exits."""
        if self.alive:
            self._close_fds()
            self._reap_later()

    def _close_fds(self) -> None:
        self.alive = False
        for fd in (self.to_child, self.from_child):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.crash_log.close()


class ForkWorker(Worker):
    """A fork of this process running one learner function, call after call."""

    def __init__(self, fn, first_call: dict):
        self.fn = fn
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        self.crash_log = tempfile.TemporaryFile()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # ---- child: never returns ----
            code = 1
            try:
                os.close(to_child_w)
                os.close(from_child_r)
                code = fork_main(fn, first_call, to_child_r, from_child_w, self.crash_log)
            finally:
                os._exit(code)
        os.close(to_child_r)
        os.close(from_child_w)
        self.pid, self.to_child, self.from_child, self.alive = pid, to_child_w, from_child_r, True

    def _signal(self, sig) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def _wait(self) -> tuple[int | None, int | None]:
        _, status = os.waitpid(self.pid, 0)
        if os.WIFSIGNALED(status):
            return os.WTERMSIG(status), None
        return None, os.WEXITSTATUS(status)

    def _reap_later(self) -> None:
        _ZOMBIES.append(self.pid)
        for pid in list(_ZOMBIES):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                _ZOMBIES.remove(pid)


_ZOMBIES: list[int] = []  # forked children that were told to end, not yet reaped


class SpawnWorker(Worker):
    """A new Python process serving any function it is sent (:mod:`kvlab.course.checking.shipping`)."""

    def __init__(self, interpret: bool | None = None):
        self.interpret = interpret = runtime.INTERPRET if interpret is None else interpret
        self.sent: set[str] = set()
        self.workdir = Path(tempfile.mkdtemp(prefix="kvlab-child-"))
        self.renames = {}
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        self.crash_log = tempfile.TemporaryFile()
        env = dict(os.environ, KVLAB_INTERPRET="1" if interpret else "0",
                   PYTHONPATH=os.pathsep.join(p for p in sys.path if p and os.path.isdir(p)))
        if not interpret:
            env.pop("TRITON_INTERPRET", None)
        started = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from kvlab.course.checking.runner import spawned_main; spawned_main()",
             str(to_child_r), str(from_child_w), str(self.workdir)],
            pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL,
            stdout=self.crash_log, stderr=self.crash_log, env=env)
        os.close(to_child_r)
        os.close(from_child_w)
        self.pid, self.to_child, self.from_child, self.alive = (self.proc.pid, to_child_w,
                                                                 from_child_r, True)
        try:
            hello = self.call(None, STARTUP_TIMEOUT_S)
        except CheckFailed:
            tail = "\n    ".join(getattr(self, "crash_text", "").strip().splitlines()[-8:])
            raise CheckFailed("the safety net could not start its child process (set "
                              "KVLAB_SANDBOX=inprocess to check in this process instead):\n    "
                              + tail, label="crash") from None
        #: seconds to start: the Python process, imports, CUDA init (without compiling anything)
        self.startup_s = time.perf_counter() - started
        self.cuda_init_s = hello.get("cuda_init_s", 0.0)

    def call_fn(self, key: str, shipped, call_blob_parts: dict) -> dict:
        """Send a call of the function ``key`` (its source the first time)."""
        first = key not in self.sent
        if first and shipped is not None:
            self.renames.update(file_names(shipped, self.workdir))
        buf = io.BytesIO()
        torch.save({**call_blob_parts, "fn": (key, shipped if first else None)}, buf)
        answer = self.call(buf.getvalue())
        self.sent.add(key)
        return answer

    def _signal(self, sig) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)

    def _wait(self) -> tuple[int | None, int | None]:
        code = self.proc.wait()
        return (-code, None) if code < 0 else (None, code)

    def _reap_later(self) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _close_fds(self) -> None:
        super()._close_fds()
        shutil.rmtree(self.workdir, ignore_errors=True)
