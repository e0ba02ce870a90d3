"""Bytes between the ranks of a job for the tiers: point to point over a gloo group of bcp's own.

Replicas and recovered pieces travel over the network, as they must on a cluster (no shared file
system is assumed between nodes). The group is made once per Comm, outside torch's group registry,
on a store prefix private to the Comm (the same name on every rank whatever groups the job made),
and never touches the training's groups. Every wait is bounded by a deadline and fails naming the
peer; a buffer whose transfer did not end is kept alive (gloo may still read or fill it).

A blob travels as its size (int64; -1: the sender failed, and a second blob with its error
follows) and then its bytes, in parts of `PART_BYTES`.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

from ..comm import Comm
from ..errors import CommTimeoutError

PART_BYTES = 16 << 20          # one message's bytes at most
WINDOW = 4                     # parts in flight per stream (sent and not yet received, or posted)
TAG_SPACE = 1 << 31

_GROUPS: dict[int, tuple[Comm, object]] = {}
_LOCK = threading.Lock()
# Buffers of transfers that did not end: gloo may still read or fill them, so they are never freed.
_ABANDONED: list = []


def tier_group(comm: Comm, timeout: timedelta):
    """The gloo group of `comm`'s ranks for tier transfers (made at the first call, collectively)."""
    with _LOCK:
        entry = _GROUPS.get(id(comm))
        if entry is None or entry[0] is not comm:
            group = dist.ProcessGroupGloo(comm.private_store("tiers"), comm.rank, comm.world_size, timeout)
            entry = _GROUPS[id(comm)] = (comm, group)
        return entry[1]


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) must not use its parent's groups, nor destroy them: a
    group's destructor joins threads that do not exist in the child (it crashed the worker), so
    they stay referenced, unused."""
    global _LOCK, _GROUPS
    _LOCK = threading.Lock()
    _INHERITED.append(_GROUPS)
    _GROUPS = {}
    _SCRATCH.clear()


_INHERITED: list = []


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


class Peer:
    """Messages with one other rank of the group, under one tag, within one deadline."""

    def __init__(self, group, me: int, peer: int, tag: int, deadline: float, op: str):
        self.group, self.me, self.peer, self.op = group, me, peer, op
        self.tag, self.deadline = tag % TAG_SPACE, deadline

    def _wait(self, work, buf: torch.Tensor, what: str) -> None:
        left = max(self.deadline - time.monotonic(), 0.001)  # a zero timeout would mean none at all
        try:
            work.wait(timedelta(seconds=left))
        except RuntimeError as e:  # gloo: timed out, or the peer's connection closed
            _ABANDONED.append((work, buf))
            raise CommTimeoutError(f"bcp {self.op}: rank {self.me} waited for rank {self.peer} to {what}, in vain "
                                   f"({str(e).splitlines()[0][:200]}); it may have crashed or be stuck elsewhere") \
                from None

    def post_send(self, buf: torch.Tensor):
        return self.group.send([buf], self.peer, self.tag)

    def post_recv(self, buf: torch.Tensor):
        return self.group.recv([buf], self.peer, self.tag)

    def send(self, buf: torch.Tensor, what: str) -> None:
        self._wait(self.post_send(buf), buf, f"receive {what}")

    def recv(self, buf: torch.Tensor, what: str) -> torch.Tensor:
        self._wait(self.post_recv(buf), buf, f"send {what}")
        return buf

    def wait_sent(self, work, buf: torch.Tensor, what: str) -> None:
        self._wait(work, buf, f"receive {what}")

    def wait_received(self, work, buf: torch.Tensor, what: str) -> None:
        self._wait(work, buf, f"send {what}")

    # -- blobs -------------------------------------------------------------------------------------

    def send_blob(self, data: bytes | None, what: str, error: str | None = None) -> None:
        """`data`, or (data None) the failure `error`, which the receiver raises."""
        if data is None:
            self.send(torch.tensor([-1], dtype=torch.int64), what)
            data = (error or "failed").encode()
        self.send(torch.tensor([len(data)], dtype=torch.int64), what)
        if data:
            self.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), what)

    def recv_blob(self, what: str, limit: int = 1 << 30) -> bytes:
        """The blob sent; `PeerFailed` with the sender's error if it sent one."""
        size = int(self.recv(torch.empty(1, dtype=torch.int64), what).item())
        failed = size == -1
        if failed:
            size = int(self.recv(torch.empty(1, dtype=torch.int64), what).item())
        if not 0 <= size <= limit:
            raise CommTimeoutError(f"bcp {self.op}: rank {self.peer} announced {size} bytes of {what}; expected at "
                                   f"most {limit}")
        data = self.recv(torch.empty(size, dtype=torch.uint8), what).numpy().tobytes() if size else b""
        if failed:
            raise PeerFailed(data.decode(errors="replace"))
        return data


    # -- runs of bytes, in parts -----------------------------------------------------------------------

    def send_parts(self, data: memoryview, what: str, pacer: Pacer | None = None) -> int:
        """`data` in parts of `PART_BYTES` (read where it lies: a map's pages go to the socket), up to
        `WINDOW` in flight; returns once every part was received. The bytes sent."""
        inflight: deque = deque()
        for lo in range(0, len(data), PART_BYTES):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # a read-only map: gloo only reads it
                part = torch.frombuffer(data[lo:lo + PART_BYTES], dtype=torch.uint8)
            inflight.append((self.post_send(part), part, lo))
            if len(inflight) >= WINDOW:
                self._done_sending(inflight.popleft(), what)
            if pacer is not None:
                pacer.sent_bytes(part.numel())
        while inflight:
            self._done_sending(inflight.popleft(), what)
        return len(data)

    def recv_parts(self, size: int, what: str, sink) -> int:
        """`size` bytes sent by `send_parts`, received into reused buffers, each part handed to
        `sink(part, offset)` in order once it arrived (the buffer is reused after `sink` returns)."""
        scratch = _scratch(min(PART_BYTES, size)) if size else []
        inflight: deque = deque()
        for i, lo in enumerate(range(0, size, PART_BYTES)):
            buf = scratch[i % WINDOW][:min(lo + PART_BYTES, size) - lo]
            inflight.append((self.post_recv(buf), buf, lo))
            if len(inflight) >= WINDOW:
                self._arrived(inflight.popleft(), what, sink)
        while inflight:
            self._arrived(inflight.popleft(), what, sink)
        with _LOCK:
            _SCRATCH.extend(scratch)  # not on an error: gloo may still fill them
        return size

    def _arrived(self, entry, what: str, sink) -> None:
        work, buf, at = entry
        self.wait_received(work, buf, f"{what} bytes {at}..")
        sink(memoryview(buf.numpy()), at)

    def _done_sending(self, entry, what: str) -> None:
        work, part, lo = entry
        self.wait_sent(work, part, f"{what} bytes [{lo}, {lo + part.numel()})")


# Receive buffers of `PART_BYTES`, reused from file to file and save to save: fresh memory costs a
# page fault per page, about as much as receiving the bytes.
_SCRATCH: list[torch.Tensor] = []


def _scratch(nbytes: int) -> list[torch.Tensor]:
    """`WINDOW` receive buffers of at least `nbytes` (taken from the reused ones where they fit)."""
    taken = []
    with _LOCK:
        while _SCRATCH and len(taken) < WINDOW:
            buf = _SCRATCH.pop()
            if buf.numel() >= nbytes:
                taken.append(buf)  # (one too small is dropped: PART_BYTES changed)
    return taken + [torch.empty(max(nbytes, PART_BYTES), dtype=torch.uint8) for _ in range(WINDOW - len(taken))]


class PeerFailed(Exception):
    """The peer sent its own failure instead of what was asked (its message is the error)."""


class Pacer:
    """Keeps what a thread sends under `rate` bytes per second (None: no bound), by sleeping."""

    def __init__(self, rate: float | None):
        self.rate, self.start, self.sent = rate, time.monotonic(), 0

    def sent_bytes(self, n: int) -> None:
        self.sent += n
        if self.rate:
            ahead = self.sent / self.rate - (time.monotonic() - self.start)
            if ahead > 0:
                time.sleep(ahead)
