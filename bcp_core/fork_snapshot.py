"""Fork snapshots: a child process that keeps this rank's state as of the save call and writes it.

Used by `save(..., snapshot="fork")` for a save that would otherwise copy into staging buffers not
allocated yet (README, "Speed"; save_snapshot.py chooses). The parent and the child talk over two
pipes in length-prefixed JSON messages; the child touches no accelerator, lock or network client of
the parent.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from .errors import CommTimeoutError, SaveError
from .storage import LocalStorage, Storage
from .utils import this_rank

log = logging.getLogger("bcp")


class ForkSnapshot:
    """A forked process that holds this rank's state as of the save call and writes it.

    Fork gives the child the parent's memory copy-on-write: the state is frozen for the child at
    the cost of the fork, and pages the training process modifies afterwards are copied by the
    kernel, one at a time, while the child lives (so a step that follows before the write ends
    pays for them). The child gets the plan's assignment as JSON on one pipe, writes its pieces
    with the ordinary engine and answers the report as JSON on another; it touches no accelerator,
    lock or network client of the parent and leaves with os._exit.
    """

    def __init__(self, pid: int, to_child: int, from_child: int, timeout: float):
        self.pid: int | None = pid
        self._to: int | None = to_child
        self._from: int | None = from_child
        self._timeout = timeout
        self.closed = False

    @classmethod
    def start(cls, write: Callable[[dict], dict], timeout: float) -> ForkSnapshot:
        """Fork now. The child waits for its orders (a JSON dict), calls `write(orders)` on its copy of
        the memory and answers the JSON report `write` returns. The parent waits at most `timeout`
        seconds for the report, and as long for the child to leave; a child that overstays is killed."""
        r_in, w_in = os.pipe()
        r_out, w_out = os.pipe()
        with _SNAPSHOT_FDS_LOCK:
            pid = os.fork()
            if pid == 0:  # the child: never returns
                code = 1
                try:
                    # pipes of other snapshots in flight: this process must not hold them open
                    for fd in [w_in, r_out, *_SNAPSHOT_FDS]:
                        os.close(fd)
                    _snapshot_child(write, r_in, w_out)
                    code = 0
                finally:
                    os._exit(code)
            _SNAPSHOT_FDS.update((w_in, r_out))
        os.close(r_in)
        os.close(w_out)
        return cls(pid, w_in, r_out, timeout)

    def send(self, orders: dict) -> None:
        try:
            _send_msg(self._to, orders)
        except BrokenPipeError:
            pass  # the child is gone: result() reports how it ended, through the commit like any error

    def result(self) -> dict:
        """The child's report, once it has written everything; its phases join this save's metrics."""
        try:
            msg = _recv_msg(self._from, time.monotonic() + self._timeout)
        except TimeoutError:
            pid = self.pid
            self._kill()
            raise CommTimeoutError(f"bcp fork snapshot: rank {this_rank()} waited {self._timeout:.0f} s for the "
                                   f"snapshot process {pid} to write its pieces; killed it") from None
        status = self._reap()
        if msg is None:
            raise SaveError(f"the snapshot process ended without writing its pieces ({_exit_reason(status)})")
        return msg

    def close(self) -> None:
        """Release the child: a child not told what to write reads end-of-file and leaves."""
        if self.closed:
            return
        self.closed = True
        with _SNAPSHOT_FDS_LOCK:
            for fd in (self._to, self._from):
                _SNAPSHOT_FDS.discard(fd)
                os.close(fd)
        self._reap()

    def _reap(self) -> int:
        """The child's exit status, once it left; killed if it does not within the timeout."""
        pid, self.pid = self.pid, None
        if pid is None:
            return 0
        deadline = time.monotonic() + self._timeout
        delay = 0.001
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return status
            if time.monotonic() > deadline:
                log.error("bcp: the snapshot process %d did not leave within %.0f s; killing it", pid, self._timeout)
                os.kill(pid, signal.SIGKILL)
                return os.waitpid(pid, 0)[1]
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _kill(self) -> None:
        if self.pid is not None:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self.pid = None


def _snapshot_child(write: Callable[[dict], dict], r_in: int, w_out: int) -> None:
    torch.set_num_threads(1)  # an OpenMP team does not survive fork: keep torch from starting one
    orders = _recv_msg(r_in)
    if orders is None:
        return  # the save ended before planning succeeded: nothing to write
    _send_msg(w_out, write(orders))


def can_fork(storage: Storage, tensors: list[torch.Tensor]) -> bool:
    """Whether a save of `tensors` to `storage` can be snapshot by fork; if not, say why (the save
    copies instead)."""
    if not hasattr(os, "fork"):
        reason = "no os.fork on this platform"
    elif not isinstance(storage, LocalStorage):
        reason = f"{storage.root} is not a local or memory:// path (network clients do not survive a fork)"
    elif any(t.device.type != "cpu" for t in tensors):
        reason = "the state holds accelerator tensors"
    else:
        return True
    log.info("bcp: snapshot='fork' not possible here (%s); copying instead", reason)
    return False


# Both ends of every snapshot pipe the parent holds: a child forked later closes them, so that each
# pipe has exactly one writer and one reader.
_SNAPSHOT_FDS: set[int] = set()
_SNAPSHOT_FDS_LOCK = threading.Lock()


def _forget_in_child() -> None:
    """Any forked child (a DataLoader worker...) closes the snapshot pipes it inherited: a snapshot
    process must see end-of-file when the parent closes its end, whoever else forked meanwhile."""
    global _SNAPSHOT_FDS_LOCK
    _SNAPSHOT_FDS_LOCK = threading.Lock()
    for fd in _SNAPSHOT_FDS:
        try:
            os.close(fd)
        except OSError:
            pass
    _SNAPSHOT_FDS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _send_msg(fd: int, obj: Any) -> None:
    """A JSON message, 8-byte length first (readers never wait for an end-of-file)."""
    data = json.dumps(obj).encode()
    view = memoryview(len(data).to_bytes(8, "little") + data)
    while view:
        view = view[os.write(fd, view):]


def _recv_msg(fd: int, deadline: float | None = None) -> Any:
    """The next message, or None when the other side closed first (or died). TimeoutError once
    `deadline` (a time.monotonic() value) passes."""
    head = _read_exactly(fd, 8, deadline)
    if head is None:
        return None
    body = _read_exactly(fd, int.from_bytes(head, "little"), deadline)
    return None if body is None else json.loads(body)


def _read_exactly(fd: int, n: int, deadline: float | None = None) -> bytes | None:
    chunks, left = [], n
    while left:
        if deadline is not None:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _exit_reason(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit status {os.WEXITSTATUS(status)}"


