"""Messages between the notebook and a child process: 8 bytes of length, then the data."""
from __future__ import annotations

import os
import select
import time


def send_msg(fd: int, data: bytes) -> None:
    view = memoryview(len(data).to_bytes(8, "little") + data)
    while view:
        view = view[os.write(fd, view):]


def _recv_exact(fd: int, n: int, deadline: float | None) -> tuple[bytes | None, bool]:
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return None, True
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            return None, False  # the other side is gone
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks), False


def recv_msg(fd: int, timeout: float | None) -> tuple[bytes | None, bool]:
    """One message: (data, timed_out); data is None when the other side is gone."""
    deadline = None if timeout is None else time.monotonic() + timeout
    head, timed_out = _recv_exact(fd, 8, deadline)
    if head is None:
        return None, timed_out
    return _recv_exact(fd, int.from_bytes(head, "little"), deadline)
