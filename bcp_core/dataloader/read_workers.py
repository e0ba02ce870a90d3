"""The read workers of a packed-token loader (packed.py): one process per read unit packs batches
ahead of the training loop and reports its unit's state after any batch asked for, so that a
checkpoint never waits for them.

A worker needs from the loader a `Packer` (what it packs with) and its `Unit` (the state it starts
from), both pickled into the process. Messages: batches on a bounded queue per worker, state
requests on a control queue per worker, states (and errors) on one queue the pool receives in the
background. Every wait is bounded by the loader's timeout; a worker that died or went silent
raises `ReadWorkerError` naming it.

A worker holds the only copy of its unit's state, which the training process saves on preemption.
SIGTERM often reaches every process of a job (SLURM signals every process of a job step), so
workers ignore it: the pool stops them (a message, else SIGKILL), at interpreter exit too, and a
worker whose training process is gone (killed) ends by itself.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
import traceback
from multiprocessing import util as mp_util
from typing import Any, Protocol

from ..errors import ReadWorkerError


class Unit(Protocol):
    """A read unit's state, immutable (packed.py's `_Unit`)."""

    def compacted(self) -> Unit: ...


class Packer(Protocol):
    """What a worker packs with (packed.py's `_Packer`)."""

    def next_batch(self, unit: Unit, between_docs=None) -> tuple[Unit, Any, int] | None: ...


class _Stop(Exception):
    """The pool asked the worker to stop."""

    pass


def _read_worker(packer: Packer, unit: Unit, w: int, data_q, ctrl_q, state_q, keep: int) -> None:
    """Produce batches of one unit into data_q; answer ("state", n) with the state after batch n.

    Requests may come before batch n exists (prefetching: answered right after producing it) or
    after (answered from the last `keep` states, which covers every batch not yet consumed).
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # module doc: the training process may save this state
    # The training process, or the fork server that forked this worker for it and that ends with it:
    # when it is gone, this process has a new parent.
    parent = os.getppid()
    data_q.cancel_join_thread()  # on stop, batches nobody will read must not block the exit
    produced, ring, wanted = 0, {0: unit}, set()

    def take(msg) -> None:
        if msg[0] == "stop":
            raise _Stop
        wanted.add(msg[1])

    def poll() -> None:
        if os.getppid() != parent:  # the training process is gone (killed): nobody will stop this worker
            raise _Stop
        while True:
            try:
                take(ctrl_q.get_nowait())
            except queue.Empty:
                break
        for n in sorted(n for n in wanted if n <= produced):
            wanted.discard(n)
            unit = ring.get(n)
            # compacted here, off the training process's critical path
            state_q.put(("state", w, n, None if unit is None else unit.compacted()))

    def put(item) -> None:
        while True:
            try:
                data_q.put(item, timeout=0.005)
                return
            except queue.Full:
                poll()  # the consumer is behind: serve state requests while waiting

    try:
        while True:
            poll()
            step = packer.next_batch(unit, poll)
            if step is None:
                break
            unit, batch, real = step
            produced += 1
            ring[produced] = unit
            for n in [n for n in ring if n < produced - keep and n not in wanted]:
                del ring[n]
            poll()  # a prefetched state of this batch goes out before the batch itself
            put(("batch", produced, batch, real))
        put(("end", produced))
        while True:
            try:
                take(ctrl_q.get(timeout=1.0))
            except queue.Empty:
                pass
            poll()
    except _Stop:
        pass
    except BaseException:  # noqa: BLE001 - reported to the main process
        tb = traceback.format_exc()
        # state_q first: it is unbounded, while data_q may stay full for good when the training
        # process waits for a state rather than a batch (it would wait for its timeout, and then
        # report a silent worker instead of this error)
        state_q.put(("error", w, tb))
        try:
            put(("error", tb))  # while the queue is full, a stop request still ends the worker
        except _Stop:
            pass


class ReadWorkerPool:
    """The read workers of one rank and the bookkeeping of what the training loop consumed."""

    def __init__(self, packer: Packer, units: list[Unit], ctx, prefetch_factor: int, timeout: float):
        self.timeout = timeout
        self.consumed = [0] * len(units)
        self.ended = [False] * len(units)
        self.requested: set[tuple[int, int]] = set()
        self.state_q = ctx.Queue()
        self.data_qs = [ctx.Queue(prefetch_factor) for _ in units]
        self.ctrl_qs = [ctx.Queue() for _ in units]
        self.procs = [ctx.Process(target=_read_worker, name=f"bcp-read-worker-{w}", daemon=True,
                                  args=(packer, u, w, self.data_qs[w], self.ctrl_qs[w], self.state_q,
                                        prefetch_factor + 4))
                      for w, u in enumerate(units)]
        self._states: dict[tuple[int, int], Any] = {}
        self._error: str | None = None
        self._cond = threading.Condition()
        # States are received in the background so that a prefetched one is already unpickled when
        # the checkpoint step asks for it.
        self._receiver = threading.Thread(target=self._receive, name="bcp-loader-states", daemon=True)
        # The pool is shut down by close(), or else at multiprocessing's exit hook, before that hook
        # SIGTERMs daemonic children (ignored by workers) and joins them without a timeout, and before
        # interpreter finalization, when a queue can no longer start its thread (a close from the
        # loader's __del__ then would hang the exit).
        self._shutdown = mp_util.Finalize(self, _shutdown, exitpriority=0, args=(
            os.getpid(), self.procs, self._receiver, self.state_q, self.data_qs, self.ctrl_qs))
        try:
            for p in self.procs:
                p.start()
            self._receiver.start()
        except BaseException:
            self._shutdown()
            raise

    def _receive(self) -> None:
        while True:
            msg = self.state_q.get()
            if msg is None:
                return
            with self._cond:
                if msg[0] == "error":
                    self._error = f"read worker {msg[1]} failed:\n{msg[2]}"
                else:
                    self._states[(msg[1], msg[2])] = msg[3]
                self._cond.notify_all()

    def _check(self, w: int) -> None:
        if self._error:
            raise ReadWorkerError(self._error)
        if not self.procs[w].is_alive():
            raise ReadWorkerError(f"read worker {w} exited with code {self.procs[w].exitcode}")

    def get(self, w: int):
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                msg = self.data_qs[w].get(timeout=0.5)
            except queue.Empty:
                self._check(w)
                if time.monotonic() > deadline:
                    raise ReadWorkerError(f"read worker {w} produced nothing for {self.timeout}s") from None
                continue
            if msg[0] == "error":
                raise ReadWorkerError(f"read worker {w} failed:\n{msg[1]}")
            return msg

    def request(self, w: int, n: int) -> None:
        if (w, n) not in self.requested:
            self.requested.add((w, n))
            self.ctrl_qs[w].put(("state", n))

    def prune(self, w: int, below: int) -> None:
        """Forget prepared states of worker w before batch `below` (checkpoint steps that were skipped)."""
        with self._cond:
            for key in [k for k in self._states if k[0] == w and k[1] < below]:
                del self._states[key]
        self.requested -= {k for k in self.requested if k[0] == w and k[1] < below}

    def take_state(self, w: int, n: int) -> Unit:
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while (w, n) not in self._states:
                self._check(w)
                if time.monotonic() > deadline:
                    raise ReadWorkerError(f"read worker {w} did not report its state after batch {n} "
                                          f"within {self.timeout}s")
                self._cond.wait(0.5)
            unit = self._states.pop((w, n))
        self.requested.discard((w, n))
        if unit is None:
            raise ReadWorkerError(f"read worker {w} no longer holds its state after batch {n}")
        return unit

    def close(self) -> None:
        self._shutdown()  # once: later calls do nothing


def _shutdown(owner: int, procs: list, receiver: threading.Thread, state_q, data_qs: list, ctrl_qs: list) -> None:
    if os.getpid() != owner:  # a forked copy of the training process: the workers are not its own
        return
    for q in ctrl_qs:
        q.put(("stop",))
    for p in procs:
        if p.pid is None:  # never started
            continue
        p.join(timeout=5)
        if p.is_alive():
            p.kill()  # SIGTERM is ignored
            p.join(timeout=5)
    if receiver.ident is not None:
        state_q.put(None)
        receiver.join(timeout=5)
    for q in (*data_qs, *ctrl_qs, state_q):
        q.close()
        q.cancel_join_thread()
