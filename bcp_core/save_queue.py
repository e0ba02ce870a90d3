"""A role's saves in submission order, their handles, and the process's exit with saves in flight.

Each save that runs in the background runs on a thread of its own, after the previous save of its
role has ended (`SaveQueue.start`): so a role's saves run one at a time, in the same order on
every rank. A save that failed and whose error no `wait()` raised is raised by the next save of its
role (`earlier_failures`, `previous_error`). At interpreter exit the exit hook waits, bounded, for
every queued save of every role and ends the process with status 1 naming any save that could not
commit; forked children forget their parent's saves.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import timedelta

from . import metrics
from .errors import BCPError, CommitCallbackError, CommTimeoutError, PreviousSaveError
from .save_job import SaveProgress, SaveRequest
from .utils import this_rank

log = logging.getLogger("bcp")

EXIT_SAVE_FAILED = 1


class SaveHandle:
    """Result of `save`. `wait()` returns once the checkpoint is durable and committed."""

    def __init__(self, path: str, future: Future, recorder: metrics.Recorder | None = None):
        self.path = path
        self._future = future
        self._recorder = recorder
        self._error_seen = False  # the caller got the error from wait(): the next save need not raise it

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> str:
        """Block until committed; re-raise the save's error if it failed. Returns the checkpoint path.

        `CommitCallbackError`: the checkpoint was committed but `on_commit` raised on this rank."""
        try:
            self._future.result(timeout)
        except BCPError:
            self._error_seen = True
            raise
        return self.path

    @property
    def metrics(self) -> list[dict]:
        """This rank's phase records (docs/monitoring.md); complete once the save is done."""
        return self._recorder.records() if self._recorder is not None else []

    def _raise_once(self, exc: BaseException | None) -> bool:
        """Whether the save's error `exc` is still to be raised (no wait() or later save has, and it
        is no `on_commit` error: that save committed); it then counts as raised."""
        if exc is None or self._error_seen or isinstance(exc, CommitCallbackError):
            return False
        self._error_seen = True
        return True


@dataclass(frozen=True)
class Queued:
    """A save in a role's queue."""

    handle: SaveHandle
    request: SaveRequest
    progress: SaveProgress


class SaveQueue:
    """The saves of one role that run in the background, oldest first, until a later call drops them."""

    def __init__(self, role: str):
        self.role = role
        self.pending: deque[Queued] = deque()
        _QUEUES.append(self)

    def start(self, fn: Callable[[], str]) -> Future:
        """Run `fn` in a background thread of its own, after the previous save of this role ended.

        A thread per save rather than a long-lived worker: no bcp thread stays idle into the
        interpreter's shutdown (see storage's note on I/O threads); a save still running at exit
        is committed by the exit hook (`_flush_at_exit`).
        """
        previous = self.pending[-1].handle._future if self.pending else None
        future: Future = Future()

        def run() -> None:
            if previous is not None:
                previous.exception()  # saves of a role run one after another, in order
            future.set_running_or_notify_cancel()
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to wait() and the next save
                future.set_exception(e)

        threading.Thread(target=run, name=f"bcp-save-{self.role}").start()
        return future

    def add(self, handle: SaveHandle, request: SaveRequest, progress: SaveProgress) -> None:
        self.pending.append(Queued(handle, request, progress))
        _register_exit_flush()  # at every async save: a pool library imported since must not run first

    def wait_all(self, timeout: float | None = None) -> None:
        """Wait for every queued save (each at most `timeout` seconds, if given); errors are left on
        the handles (and raised by the next save). Raises CommTimeoutError when one is still running."""
        for q in list(self.pending):
            try:
                q.handle._future.exception(timeout)  # blocks; the error stays for wait() / the next save
            except FutureTimeout:
                raise CommTimeoutError(f"bcp: rank {this_rank()} waited {timeout:.0f} s for the earlier save "
                                       f"{q.request.save} to finish; it is still {q.progress.phase}") from None

    def wait_oldest(self, timeout: timedelta, why: str) -> None:
        """Wait (at most `timeout`) for the oldest queued save still running, which holds what the
        caller needs (it is to `why`)."""
        running = [q for q in self.pending if not q.handle.done()]
        if not running:
            return
        oldest = running[0]
        try:
            oldest.handle._future.exception(timeout.total_seconds())
        except FutureTimeout:
            raise CommTimeoutError(f"bcp staging: rank {this_rank()} waited {timeout} for {oldest.request.save} to "
                                   f"{why}; it is still {oldest.progress.phase}") from None

    def earlier_failures(self) -> list[tuple[SaveHandle, BaseException]]:
        """Failed saves of this role that no `wait()` or later save has raised yet (the saves at the
        head of the queue that are done are dropped from it)."""
        failed = []
        while self.pending and self.pending[0].handle.done():
            handle = self.pending.popleft().handle
            exc = handle._future.exception()
            if handle._raise_once(exc):
                failed.append((handle, exc))
        return failed


def previous_error(earlier: list[tuple[SaveHandle, BaseException]], what: str,
                   handle: SaveHandle | None) -> PreviousSaveError:
    """The error a call raises for the earlier saves of its role that failed unseen; `handle`: the
    call's own save, which goes on."""
    first, exc = earlier[0]
    more = f" ({len(earlier) - 1} more failed before this one)" if len(earlier) > 1 else ""
    goes_on = f"; this {what} was started and goes on (its handle is error.handle)" if handle is not None \
        and not handle.done() else ""
    error = PreviousSaveError(f"an earlier asynchronous save to {first.path} failed and was not committed: "
                              f"{exc}{more}{goes_on}", handle)
    error.__cause__ = exc
    return error


# ----------------------------------------------------------------------------- the process's exit

_QUEUES: list[SaveQueue] = []  # every role's, in the order the roles were made


def finish_pending_saves() -> list[tuple[str, BaseException]]:
    """Block until every queued asynchronous save of every role is committed or has failed.

    Returns the failures the caller has not seen yet (path, error); a failure already raised by
    `wait()` or a later `save` is not repeated, nor an `on_commit` error (that save committed).
    Each save is waited for at most three times its timeout (its plan, write and commit
    exchanges each end within it); one still running then is reported as a CommTimeoutError.
    """
    failed: list[tuple[str, BaseException]] = []
    for queue in list(_QUEUES):
        for q in list(queue.pending):
            if not q.handle.done():
                log.info("bcp: waiting for the asynchronous save to %s to commit", q.handle.path)
            waited = 3 * q.request.timeout
            try:
                exc = q.handle._future.exception(waited.total_seconds())
            except FutureTimeout:
                exc = CommTimeoutError(f"bcp exit: rank {this_rank()} waited {waited} for {q.request.save} to "
                                       f"commit; it is still {q.progress.phase}")
            if q.handle._raise_once(exc):
                failed.append((q.handle.path, exc))
    return failed


def _flush_at_exit() -> None:
    """At interpreter exit: commit every asynchronous save still in flight, or exit non-zero.

    Runs as a `threading` exit hook, registered after concurrent.futures' own: those hooks run
    newest first, before non-daemon threads are joined and before `atexit` handlers. So the
    saves finish while thread pools (bcp's I/O threads, fsspec's event loop executors) still
    accept work; after concurrent.futures' hook, any new pool refuses it.
    """
    failed = finish_pending_saves()
    if not failed:
        return
    rank = this_rank()
    for path, exc in failed:
        log.error("bcp: rank %d exits with status %d: the asynchronous save to %s was not committed: %s",
                  rank, EXIT_SAVE_FAILED, path, exc)
    # The exit status is fixed before exit hooks run; the only way to report the loss is to end
    # the process here, after the atexit handlers and a flush of the standard streams.
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(EXIT_SAVE_FAILED)


def _register_exit_flush() -> None:
    """Make `_flush_at_exit` the newest threading exit hook (it then runs first)."""
    hooks = getattr(threading, "_threading_atexits", None)
    if hooks and hooks[-1] is _flush_at_exit:
        return
    try:
        threading._register_atexit(_flush_at_exit)
    except (AttributeError, RuntimeError):  # no such hook, or the interpreter is already shutting down
        atexit.register(_flush_at_exit)


def _forget_in_child() -> None:
    """In a process forked from this one (a DataLoader worker, a multiprocessing.Process, bcp's own
    fork snapshot): the saves in flight are the parent's, and the threads that run them do not
    exist here. The child neither waits for them at its exit nor sees them queued."""
    for queue in list(_QUEUES):
        queue.pending = deque()
    hooks = getattr(threading, "_threading_atexits", None)
    if hooks is not None:
        hooks[:] = [h for h in hooks if h is not _flush_at_exit]
    atexit.unregister(_flush_at_exit)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
