"""Preemption: on SIGTERM, one last checkpoint at a step boundary every rank agrees on, then exit.

SLURM, Kubernetes and spot instances announce the end of a job with SIGTERM and kill it a grace
period later (torchrun forwards the signal to its workers and waits `TORCH_ELASTIC_SHUTDOWN_TIMEOUT`,
30 s by default; Kubernetes' `terminationGracePeriodSeconds` is 30 s by default; SLURM's `KillWait`
30 s). The handler only records the signal; the training loop asks at each step boundary:

    preemption = bcp.handle_preemption()
    for step in range(start, steps):
        train_step()
        if preemption.stop_requested():        # True on every rank at the same boundary
            bcp.save(root, state, step=step + 1)
            preemption.exit()                  # commits every save in flight, exits 128 + SIGTERM

Ranks may receive the signal at different boundaries (or only some ranks may receive it). The
first rank that sees its signal proposes the *next* boundary through the job's key-value store;
every rank checks the store at each boundary (one round trip, ~0.1 ms), so all of them stop at
that boundary. This relies on the ranks being in lockstep, at most one boundary apart, which every
step holding a collective across the ranks (gradient all-reduce, FSDP, TP) guarantees; a rank
found past the agreed boundary raises instead of saving a checkpoint mixed from two steps.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from datetime import timedelta
from typing import NoReturn

from .save_queue import finish_pending_saves
from .comm import DEFAULT_TIMEOUT, Comm, comm_for
from .errors import BCPError

log = logging.getLogger("bcp")


class Preemption:
    """The state of `handle_preemption`: whether a stop was asked for, and how to leave."""

    def __init__(self, signals: tuple[int, ...], exit_code: int | None, process_group, timeout: timedelta):
        self.signals = tuple(signals)
        self._exit_code = exit_code
        self._group, self._timeout = process_group, timeout
        self._comm: Comm | None = None  # created at the first check: the process group may come later
        self.signum: int | None = None   # the signal this process received, if any
        self._boundary = 0               # stop_requested() calls so far
        self._stop_at: int | None = None
        self._stopped = False            # stop_requested() answered True
        self._logged = False             # the signal was logged (by the loop's side, not the handler)
        self._previous: dict[int, object] = {}
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._on_signal)

    # -- the handler ---------------------------------------------------------------------------

    def _on_signal(self, signum, frame) -> None:
        # The handler runs between two bytecodes of whatever the main thread was doing, maybe inside
        # a lock it holds (a logging handler's, a queue's, sys.stderr's): logging here could wait on
        # that lock for ever. So the signal is recorded, told on the standard error's descriptor (a
        # system call, no lock), and logged by stop_requested().
        if self.signum is None:
            self.signum = signum
            try:
                os.write(2, f"bcp: received {signal.Signals(signum).name}: a final checkpoint will be taken at "
                            "the next step boundary\n".encode())
            except OSError:
                pass
        previous = self._previous.get(signum)
        if callable(previous):  # chain: another library's handler (Lightning's) still runs
            previous(signum, frame)

    # -- the loop's side -----------------------------------------------------------------------

    def stop_requested(self) -> bool:
        """Call once per step boundary on every rank; True on all ranks at the same boundary once
        any rank received the signal, and True from then on."""
        if self._stopped:
            return True
        self._boundary += 1
        if self._comm is None:
            self._comm = comm_for(self._group, "preemption")
        comm = self._comm
        if self._stop_at is None:
            if comm.world_size == 1:
                if self.signum is not None:
                    self._stop_at = self._boundary
            elif self.signum is not None:
                # a rank may already be one boundary further on, past its check of this one
                self._stop_at = int(comm.propose("stop_at", str(self._boundary + 1)))
            else:
                agreed = comm.peek("stop_at")
                self._stop_at = int(agreed) if agreed is not None else None
        if self._stop_at is not None and not self._logged:
            self._logged = True
            log.warning("bcp: %s: the ranks stop at step boundary %d for a final checkpoint",
                        f"this rank received {signal.Signals(self.signum).name}" if self.signum is not None
                        else "another rank was signalled", self._stop_at)
        if self._stop_at is not None and self._boundary > self._stop_at:
            raise BCPError(f"preemption: rank {comm.rank} is at step boundary {self._boundary}, past boundary "
                           f"{self._stop_at} where the ranks agreed to stop: the ranks are not in lockstep "
                           "(every step needs a collective across them)")
        self._stopped = self._stop_at == self._boundary
        return self._stopped

    @property
    def exit_code(self) -> int:
        """The status `exit()` leaves with: 128 + the signal number (143 for SIGTERM) unless given."""
        if self._exit_code is not None:
            return self._exit_code
        return 128 + (self.signum or signal.SIGTERM)

    def exit(self) -> NoReturn:
        """Commit every asynchronous save in flight, then raise SystemExit with `exit_code` (1 if a
        save failed: the message names its path and rank)."""
        failed = finish_pending_saves()
        if failed:
            rank = self._comm.rank if self._comm is not None else 0
            for path, exc in failed:
                log.error("bcp: rank %d: the save to %s was not committed before the preempted exit: %s",
                          rank, path, exc)
            sys.exit(1)
        log.warning("bcp: every save committed; exiting with status %d after %s", self.exit_code,
                    signal.Signals(self.signum).name if self.signum else "the preemption request")
        sys.exit(self.exit_code)

    def close(self) -> None:
        """Put the previous handlers back."""
        global _ACTIVE
        for s, previous in self._previous.items():
            if signal.getsignal(s) == self._on_signal:
                signal.signal(s, previous)
        self._previous = {}
        if _ACTIVE is self:
            _ACTIVE = None


_ACTIVE: Preemption | None = None


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker, a multiprocessing.Process) is not the training loop: it
    gets the handlers that were there before bcp's back, so SIGTERM ends it as it would have."""
    global _ACTIVE
    if _ACTIVE is not None:
        for s, previous in _ACTIVE._previous.items():
            if signal.getsignal(s) == _ACTIVE._on_signal:
                signal.signal(s, previous if previous is not None else signal.SIG_DFL)
        _ACTIVE = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def handle_preemption(signals: tuple[int, ...] = (signal.SIGTERM,), *, exit_code: int | None = None,
                      process_group=None, timeout: timedelta = DEFAULT_TIMEOUT) -> Preemption:
    """Catch `signals` (SIGTERM) instead of dying at once; returns the `Preemption` the loop asks.

    Call on every rank, from the main thread, before training. Handlers installed before are
    kept and called after bcp's (Lightning installs its own). Calling again returns the handler
    already installed. See the module doc for the loop and docs/reliability.md for grace periods.
    """
    global _ACTIVE
    if _ACTIVE is not None:
        return _ACTIVE
    if threading.current_thread() is not threading.main_thread():
        raise BCPError("handle_preemption must be called from the main thread (Python delivers signals there)")
    _ACTIVE = Preemption(signals, exit_code, process_group, timeout)
    return _ACTIVE
