"""Per-rank timing of every checkpoint phase, with byte counts (paper §5.3).

A `Recorder` belongs to one save or load on one rank. Code marks its phases with
`metrics.phase(name, nbytes)` (a context manager), `@metrics.timed(name)` (a decorator) or
`metrics.start(name) ... .stop()`; these record into the recorder active on the current thread
and cost nothing when none is. `Recorder.run(fn)` activates a recorder around a call;
`metrics.bind(fn)` carries it into a thread pool.

Intervals of one phase are merged on the fly, so a rank that reads ten thousand pieces still
produces one record per phase: its first start, last end, busy time (the union of its intervals,
so parallel threads do not count twice), bytes, count and up to `MAX_INTERVALS` intervals for
the timeline. Records are plain dicts (JSON lines in `bcp_metrics.jsonl`, docs/monitoring.md):

    {"op": "save", "path": ..., "rank": 3, "phase": "write", "start": 1732250000.12,
     "end": 1732250001.40, "busy": 1.21, "bytes": 536870912, "count": 4, "intervals": [[s, e], ...]}

Finished records also go to the sinks: callables added with `add_sink` (integrations hand them
to their loggers) and the file named by `BCP_METRICS_FILE` (`{rank}` in it is replaced).
"""

from __future__ import annotations

import contextvars
import copy
import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from .metadata import parse_json

log = logging.getLogger("bcp")

METRICS_FILE = "bcp_metrics.jsonl"
MAX_INTERVALS = 64

SAVE_PHASES = ("plan", "stage", "serialise", "checksum", "write", "fsync", "wait", "commit")
LOAD_PHASES = ("metadata", "plan", "read", "checksum", "copy", "transfer", "wait")

_current: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar("bcp_metrics", default=None)
_sinks: list[Callable[[list[dict]], None]] = []


class _Phase:
    __slots__ = ("start", "end", "busy", "bytes", "count", "intervals")

    def __init__(self):
        self.start = self.end = None
        self.busy = 0.0
        self.bytes = self.count = 0
        self.intervals: list[list[float]] = []

    def add(self, t0: float, t1: float, nbytes: int) -> None:
        self.count += 1
        self.bytes += nbytes
        self.start = t0 if self.start is None else min(self.start, t0)
        self.end = t1 if self.end is None else max(self.end, t1)
        # merge into the sorted, disjoint interval list; busy time is their total length
        merged = [t0, t1]
        keep = []
        for iv in self.intervals:
            if iv[1] < merged[0] or iv[0] > merged[1]:
                keep.append(iv)
            else:
                merged = [min(iv[0], merged[0]), max(iv[1], merged[1])]
        keep.append(merged)
        keep.sort()
        if len(keep) > MAX_INTERVALS:  # close the smallest gap: the timeline stays readable and bounded
            gaps = [keep[i + 1][0] - keep[i][1] for i in range(len(keep) - 1)]
            i = gaps.index(min(gaps))
            keep[i:i + 2] = [[keep[i][0], keep[i + 1][1]]]
        self.intervals = keep
        self.busy = sum(e - s for s, e in keep)


class Recorder:
    """The phases of one operation (`op`: "save" or "load") on one rank."""

    def __init__(self, op: str, rank: int, path: str = ""):
        self.op, self.rank, self.path = op, rank, path
        self._phases: dict[str, _Phase] = {}
        self._lock = threading.Lock()
        self._emitted = False

    def add(self, name: str, t0: float, t1: float, nbytes: int = 0) -> None:
        with self._lock:
            self._phases.setdefault(name, _Phase()).add(t0, t1, int(nbytes))

    def phase(self, name: str, nbytes: int = 0) -> _Timer:
        return _Timer(self, name, nbytes)

    def records(self, intervals: bool = True) -> list[dict]:
        """One record per phase; without `intervals`, the timeline detail is left out (a few hundred
        bytes per rank and phase, for large jobs' commit reports)."""
        with self._lock:
            return [{"op": self.op, "path": self.path, "rank": self.rank, "phase": name,
                     "start": p.start, "end": p.end, "busy": p.busy, "bytes": p.bytes, "count": p.count,
                     **({"intervals": [list(iv) for iv in p.intervals]} if intervals else {})}
                    for name, p in self._phases.items()]

    def run(self, fn: Callable, *args, finish: bool = False, **kwargs):
        """`fn(*args, **kwargs)` with this recorder active on the current thread; with `finish`,
        hand the records to the sinks afterwards (whether `fn` succeeded or not)."""
        token = _current.set(self)
        try:
            return fn(*args, **kwargs)
        finally:
            _current.reset(token)
            if finish:
                self.emit()

    def emit(self) -> None:
        """Give the records to every sink, once. A failing sink is logged, never raised: metrics
        must not fail a checkpoint."""
        if self._emitted:
            return
        self._emitted = True
        records = self.records()
        for sink in list(_sinks) + _env_sinks():
            try:
                sink(records)
            except Exception as e:  # noqa: BLE001 - see above
                log.warning("bcp: metrics sink %r failed: %s", sink, e)


class _Timer:
    """A phase being timed: a context manager, or `start(...)` / `.stop()` around code that cannot
    be indented (`stop` is idempotent)."""

    __slots__ = ("rec", "name", "nbytes", "t0")

    def __init__(self, rec: Recorder | None, name: str, nbytes: int = 0):
        self.rec, self.name, self.nbytes, self.t0 = rec, name, nbytes, None

    def begin(self) -> _Timer:
        self.t0 = time.time()
        return self

    def stop(self, nbytes: int | None = None) -> None:
        if self.rec is not None and self.t0 is not None:
            self.rec.add(self.name, self.t0, time.time(), self.nbytes if nbytes is None else nbytes)
            self.t0 = None

    def __enter__(self) -> _Timer:
        return self.begin()

    def __exit__(self, *exc) -> None:
        self.stop()


def current() -> Recorder | None:
    return _current.get()


def phase(name: str, nbytes: int = 0) -> _Timer:
    """Time a block as phase `name` of the active recorder (a no-op without one)."""
    return _Timer(_current.get(), name, nbytes)


def start(name: str, nbytes: int = 0) -> _Timer:
    return phase(name, nbytes).begin()


def timed(name: str, nbytes: Callable[..., int] | None = None):
    """Decorator: time each call as phase `name`. `nbytes(result, *args, **kwargs)` counts its bytes."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            rec = _current.get()
            if rec is None:
                return fn(*args, **kwargs)
            t0 = time.time()
            result = fn(*args, **kwargs)
            rec.add(name, t0, time.time(), nbytes(result, *args, **kwargs) if nbytes else 0)
            return result
        return inner
    return wrap


def bind(fn: Callable) -> Callable:
    """`fn` with the current recorder made active wherever it runs (thread pools do not inherit it)."""
    rec = _current.get()
    if rec is None:
        return fn

    @functools.wraps(fn)
    def inner(*args, **kwargs):
        return rec.run(fn, *args, **kwargs)
    return inner


def records(intervals: bool = True) -> list[dict]:
    """The active recorder's records so far (empty without one)."""
    rec = _current.get()
    return rec.records(intervals) if rec is not None else []


# ----------------------------------------------------------------------------- sinks

def add_sink(sink: Callable[[list[dict]], None]) -> Callable[[list[dict]], None]:
    """Call `sink(records)` on each rank after each of its saves (once committed or failed) and loads."""
    _sinks.append(sink)
    return sink


def remove_sink(sink: Callable[[list[dict]], None]) -> None:
    if sink in _sinks:
        _sinks.remove(sink)


def _env_sinks() -> list[Callable[[list[dict]], None]]:
    template = os.environ.get("BCP_METRICS_FILE")
    return [functools.partial(append_jsonl, template)] if template else []


def append_jsonl(template: str, records: list[dict]) -> None:
    """Append records as JSON lines to `template` (with `{rank}` replaced by each record's rank)."""
    by_path: dict[str, list[str]] = {}
    for r in records:
        by_path.setdefault(template.replace("{rank}", str(r["rank"])), []).append(json.dumps(r) + "\n")
    for path, lines in by_path.items():
        with open(path, "a") as f:
            f.write("".join(lines))


def save_beside(ckpt, per_rank: list[list[dict] | None]) -> None:
    """Write every rank's save records as `bcp_metrics.jsonl` in the checkpoint (coordinator, after
    the metadata: the file is informational and never part of completeness). Not synced: every
    rank waits for this before its save returns, and the file's and its directory's fsync took
    3-7 ms there (a sync save of 1 GiB to the development VM's disk takes ~0.35 s); a crash may
    lose it, never the checkpoint."""
    try:
        lines = [json.dumps(r, separators=(",", ":")) for recs in per_rank for r in recs or ()]
        unsynced = copy.copy(ckpt)
        unsynced.fsync = False
        unsynced.write_atomic(METRICS_FILE, ("\n".join(lines) + "\n").encode())
    except Exception as e:  # noqa: BLE001 - the checkpoint is committed; metrics must not fail it
        log.warning("bcp: could not write %s beside %s: %s", METRICS_FILE, ckpt.root, e)


def load_jsonl(data: bytes | str, source: str) -> list[dict]:
    """The records of a JSON-lines text; MetadataError naming `source` and the line if one is not JSON."""
    lines = data.splitlines() if isinstance(data, str) else data.decode(errors="replace").splitlines()
    return [parse_json(line, f"{source} line {i + 1}") for i, line in enumerate(lines) if line.strip()]


def summarise(records: list[dict]) -> dict[str, Any]:
    """Totals per phase over ranks: busy seconds (max and mean), bytes, and the slowest rank."""
    out: dict[str, Any] = {}
    for r in records:
        s = out.setdefault(r["phase"], {"ranks": 0, "busy_max": 0.0, "busy_sum": 0.0, "bytes": 0,
                                        "slowest_rank": r["rank"]})
        s["ranks"] += 1
        s["busy_sum"] += r["busy"]
        s["bytes"] += r["bytes"]
        if r["busy"] >= s["busy_max"]:
            s["busy_max"], s["slowest_rank"] = r["busy"], r["rank"]
    for s in out.values():
        s["busy_mean"] = s.pop("busy_sum") / s["ranks"]
    return out


def _shown(path: Any) -> str:
    """A path as records name it: a Storage (a load of a tiered step's view) by its root."""
    return os.fspath(path) if isinstance(path, (str, os.PathLike)) else str(getattr(path, "root", path))


def recorded(op: str, rank: Callable[..., int]):
    """Decorator for an operation returning a result object: record its phases under a new
    recorder (`rank(*args, **kwargs)` names the rank), attach them as `result.metrics` and hand
    them to the sinks."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            rec = Recorder(op, rank(*args, **kwargs), _shown(args[0]) if args else "")
            result = rec.run(fn, *args, finish=True, **kwargs)
            result.metrics = rec.records()
            return result
        return inner
    return wrap


SCALAR_PREFIX = "bcp/"  # the names `scalars` gives begin with it


def scalars(records: list[dict]) -> dict[str, float]:
    """Flat numbers for a training logger from one rank's records: `bcp/<op>/<phase>_s` (busy
    seconds), `bcp/<op>/<phase>_bytes` where bytes moved, and `bcp/<op>/total_s`."""
    out: dict[str, float] = {}
    for op in sorted({r["op"] for r in records}):
        mine = [r for r in records if r["op"] == op]
        for r in mine:
            out[f"{SCALAR_PREFIX}{op}/{r['phase']}_s"] = r["busy"]
            if r["bytes"]:
                out[f"{SCALAR_PREFIX}{op}/{r['phase']}_bytes"] = float(r["bytes"])
        out[f"{SCALAR_PREFIX}{op}/total_s"] = max(r["end"] for r in mine) - min(r["start"] for r in mine)
    return out


class LatestScalars:
    """A sink that keeps the `scalars` of this rank's latest save and load until an integration
    hands them to its logger (sinks may run on bcp's background thread; loggers want the training
    thread)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._latest: dict[str, float] = {}
        add_sink(self)

    def __call__(self, records: list[dict]) -> None:
        if records:
            with self._lock:
                self._latest.update(scalars(records))

    def pop(self) -> dict[str, float]:
        with self._lock:
            out, self._latest = self._latest, {}
        return out

    def close(self) -> None:
        remove_sink(self)
