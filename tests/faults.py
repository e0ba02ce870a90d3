"""Test-only fault injection: a job script installs it from the environment, production code never
sees it.

    BCP_TEST_FAULT="write:rank=1:save=3"          on rank 1, the data writes of the 3rd save raise
                                                  OSError(ENOSPC)
    BCP_TEST_FAULT="commit:rank=0:save=2"         on rank 0, the 2nd save's on_commit raises (after
                                                  the caller's own on_commit, if it has one)
    BCP_TEST_FAULT="slow:rank=0:save=2:seconds=3" on rank 0, each data file of the 2nd save is
                                                  written 3 s late (default 1 s)
    BCP_TEST_FAULT="slow-commit:rank=0:save=2"    on rank 0, the 2nd save's on_commit starts 1 s
                                                  late: that rank learns of the commit after the
                                                  others, which go on to their next save
    BCP_TEST_FAULT="stall:rank=1:save=11"         on rank 1, each data file of the 11th save waits
                                                  until the coordinator has given that save up
                                                  (its bcp_failed.json exists): a rank that stops
                                                  answering, held by an event, not by a time. Not
                                                  for rank 0, the coordinator; the job gives the
                                                  other ranks a short timeout for that save
                                                  (`waits_for_a_stalled_rank`), and the stalled
                                                  rank a long one

Several faults are joined by ","; leaving out `rank=` or `save=` means every rank or every save
("stall" needs both).
A job calls `install_from_env()` once RANK is set (torchrun sets it before the script starts); it
does nothing when BCP_TEST_FAULT is unset.

Saves are counted from 1 in each process by the calls of `Checkpointer.save`, which `bcp_core.save`
and every integration go through (`prepare_save` does not count); every rank makes the same calls,
so "the 3rd save" is the same save on every rank. A data write belongs to a save when it goes to
that save's checkpoint directory while the save is in flight. Writes are intercepted through
`bcp_core.storage.faults`, the core's fault injection: every backend.

`CommittedWatch` is the test's side: it checks, while a job runs, that checkpoint directories hold
a committed checkpoint at every moment.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from bcp_core import checkpointer
from bcp_core.layout import BCP_STEPS, latest_complete
from bcp_core.metadata import FAILED_FILE
from bcp_core.storage import faults as storage_faults
from bcp_core.storage import storage_for

ENV = "BCP_TEST_FAULT"
KINDS = ("write", "commit", "slow", "slow-commit", "stall")
STALL_SECONDS = 120  # a stalled rank goes on after this long even if its save was never given up


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None = None     # None: every rank
    save: int | None = None     # None: every save
    seconds: float = 1.0        # "slow" and "slow-commit"


def parse(text: str) -> list[Fault]:
    """The faults of a BCP_TEST_FAULT value ("" gives none)."""
    faults = []
    for spec in (s.strip() for s in text.split(",")):
        if not spec:
            continue
        kind, *fields = spec.split(":")
        if kind not in KINDS:
            raise ValueError(f"{ENV}: unknown fault {kind!r} in {spec!r}; known: {', '.join(KINDS)}")
        values: dict = {}
        for item in fields:
            key, sep, value = item.partition("=")
            if not sep or key not in ("rank", "save", "seconds"):
                raise ValueError(f"{ENV}: bad field {item!r} in {spec!r}; expected rank=R, save=N or seconds=S")
            values[key] = float(value) if key == "seconds" else int(value)
        if kind == "stall" and (values.get("rank") in (None, 0) or values.get("save") is None):
            raise ValueError(f"{ENV}: {spec!r}: a stall names one save and one rank other than 0 (the "
                             "coordinator gives the save up, which releases the stalled rank)")
        faults.append(Fault(kind, **values))
    return faults


def waits_for_a_stalled_rank(save: int) -> bool:
    """Whether another rank than this one stalls in this process's `save`-th save: the job gives
    that save a short timeout, which is then what the job tests."""
    rank = int(os.environ.get("RANK", "0"))
    return any(f.kind == "stall" and f.save == save and f.rank != rank
               for f in parse(os.environ.get(ENV, "")))


def install_from_env() -> list[Fault]:
    """Install the faults BCP_TEST_FAULT names for this process's rank; returns them."""
    faults = [f for f in parse(os.environ.get(ENV, "")) if f.rank in (None, int(os.environ.get("RANK", "0")))]
    if faults:
        _install(faults)
    return faults


@dataclass
class _Flight:
    """A save with faults, from its call until it has committed or failed."""
    root: str               # its checkpoint directory, as the core names it (Storage.root)
    faults: list[Fault]
    handle: checkpointer.SaveHandle | None = None
    ended: bool = False     # the call raised and started nothing
    started: set = field(default_factory=set)  # the data files written to so far

    def over(self) -> bool:
        return self.ended or (self.handle is not None and self.handle.done())


_lock = threading.Lock()
_flights: list[_Flight] = []
_saves = 0


def _install(faults: list[Fault]) -> None:
    save = checkpointer.Checkpointer.save

    def faulty_save(self, path, state, *args, step=None, on_commit=None, **kwargs):
        global _saves
        with _lock:
            _saves += 1
            number = _saves
        mine = [f for f in faults if f.save in (None, number)]
        if any(f.kind in ("commit", "slow-commit") for f in mine):
            on_commit = _faulty_on_commit(on_commit, number, mine)
        flight = _Flight(_checkpoint_root(path, step), [f for f in mine if f.kind in ("write", "slow", "stall")])
        if flight.faults:
            with _lock:
                _flights.append(flight)
        try:
            flight.handle = save(self, path, state, *args, step=step, on_commit=on_commit, **kwargs)
        except BaseException as e:
            flight.handle = getattr(e, "handle", None)  # PreviousSaveError: this save goes on
            flight.ended = flight.handle is None
            raise
        return flight.handle

    checkpointer.Checkpointer.save = faulty_save
    storage_faults.inject(storage_faults.Fault("write", hook=_data_write))


def _data_write(call: storage_faults.Call) -> None:
    """A write of a data file of a save with faults: the file's first write sleeps ("slow") or
    waits for the save to be given up ("stall"); every write raises ENOSPC ("write")."""
    with _lock:
        _flights[:] = [f for f in _flights if not f.over()]
        mine = [f for f in _flights if call.path.startswith(f.root + "/data/")]
        first = [f for f in mine if call.path not in f.started]
        for f in first:
            f.started.add(call.path)
    for flight in first:
        for fault in flight.faults:
            if fault.kind == "slow":
                time.sleep(fault.seconds)
            elif fault.kind == "stall":
                _wait_until_given_up(flight.root)
    if any(fault.kind == "write" for f in mine for fault in f.faults):
        raise OSError(errno.ENOSPC, f"No space left on device (fault injected by {ENV})")


def _wait_until_given_up(root: str) -> None:
    ckpt, deadline = storage_for(root), time.monotonic() + STALL_SECONDS
    while not ckpt.exists(FAILED_FILE) and time.monotonic() < deadline:
        time.sleep(0.01)


def _checkpoint_root(path, step: int | None) -> str:
    root = storage_for(os.fspath(path))
    return (root.child(BCP_STEPS.name(step)) if step is not None else root).root


def _faulty_on_commit(on_commit: Callable[[str], None] | None, number: int,
                      faults: list[Fault]) -> Callable[[str], None]:
    def faulty(path: str) -> None:
        for fault in faults:
            if fault.kind == "slow-commit":
                time.sleep(fault.seconds)
        if on_commit is not None:
            on_commit(path)
        if any(f.kind == "commit" for f in faults):
            raise RuntimeError(f"fault injected by {ENV}: on_commit of save {number} on rank "
                               f"{os.environ.get('RANK', '0')}")
    return faulty


# ----------------------------------------------------------------------------- watching a job's checkpoints

class CommittedWatch:
    """Watches checkpoint paths from the test process while a job runs: once a group has held a
    committed checkpoint, it must hold one at every moment (the contract of rotation: nothing is
    removed before a newer checkpoint is committed).

    `groups` maps a name to a function listing that group's paths, oldest first. They are checked
    oldest first, so that a removal the job makes between the listing and the check is seen only
    after the newer checkpoint's commit; a violation is recorded only when a second look at once
    confirms it. Use as a context manager around the job; `violations` lists what was seen.
    """

    def __init__(self, groups: dict[str, Callable[[], list[str]]], interval: float = 0.02):
        self.groups, self.interval = groups, interval
        self.violations: list[str] = []
        self._seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="committed-watch", daemon=True)

    def __enter__(self) -> CommittedWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _holds_committed(self, name: str) -> bool:
        return any(_committed(path) for path in self.groups[name]())

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for name in self.groups:
                if self._holds_committed(name):
                    self._seen.add(name)
                elif name in self._seen and not self._holds_committed(name):
                    self.violations.append(f"{name}: no committed checkpoint among {self.groups[name]()}")


def _committed(path: str) -> bool:
    try:
        return latest_complete(path) is not None
    except Exception:  # noqa: BLE001 - a path being removed right now
        return False
