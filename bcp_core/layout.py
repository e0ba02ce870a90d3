"""A checkpoint root: one directory per saved step, a `latest` tracker, and finding what to load.

    root/
      step_00000100/        a checkpoint (complete once it holds bcp_metadata.json)
      step_00000200/
      latest                "step_00000200": the newest committed checkpoint

`StepNaming` says how step directories are named: bcp's own `step_<8 digits>` (`BCP_STEPS`) or
HF Trainer's `checkpoint-<step>` (`HF_STEPS`, no tracker: HF finds the newest itself). Every
place that names, lists, resolves or removes checkpoints goes through this module.

Removing never leaves the root: a step entry that is a symbolic link is removed as a link, never
its target, and nothing is followed through one.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .errors import BCPError, IncompleteCheckpointError, NotACheckpointError
from .foreign import open_foreign
from .metadata import FAILED_FILE, METADATA_FILE, TRACKER_FILE, parse_json, read_capped, read_prefix
from .storage import Storage, storage_for
from .storage.base import REMOTE_THREADS, parse_temp_name, temp_writer_gone, this_host

log = logging.getLogger("bcp")


@dataclass(frozen=True)
class StepNaming:
    """How a root names the directory of each step."""

    template: str   # str.format template of the name of `step`
    pattern: str    # regular expression whose group 1 is the step

    def name(self, step: int) -> str:
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        return self.template.format(step)

    def step_of(self, name: str) -> int | None:
        m = re.match(self.pattern, name)
        return int(m.group(1)) if m else None


BCP_STEPS = StepNaming("step_{:08d}", r"^step_(\d+)$")
HF_STEPS = StepNaming("checkpoint-{}", r"^checkpoint-(\d+)$")


@dataclass(frozen=True)
class CheckpointEntry:
    """One step directory of a root."""

    name: str            # "" when the root is itself a checkpoint
    step: int | None
    path: str
    complete: bool       # holds committed metadata
    tracker: bool        # the tracker names it
    latest: bool         # what `load(root)` uses


# The tracker holds a step directory's name; bcp reads no more of it than this (a file of any size,
# sparse gigabytes included, costs one small read). Its name is the text before the first space,
# line end or NUL (docs/format.md).
TRACKER_READ_BYTES = 4096


def read_tracker(root: Storage) -> str | None:
    """The name the root's tracker holds, or None without a tracker."""
    if not root.exists(TRACKER_FILE):
        return None
    text = read_prefix(root, TRACKER_FILE, TRACKER_READ_BYTES).decode(errors="replace")
    return re.match(r"[^\s\x00]*", text.lstrip()).group()


def write_tracker(root: Storage, name: str) -> None:
    """Point `latest` at `name`, atomically: the commit point of "latest" (docs/format.md)."""
    root.write_atomic(TRACKER_FILE, name.encode())


def _storage(root: str | os.PathLike | Storage) -> Storage:
    return root if isinstance(root, Storage) else storage_for(root)


def list_checkpoints(root: str | os.PathLike | Storage, naming: StepNaming = BCP_STEPS) -> list[CheckpointEntry]:
    """The step directories under `root`, oldest first, complete or not, with the latest marked."""
    st = _storage(root)
    tracker = read_tracker(st)
    names = [name for name in st.listdir() if naming.step_of(name) is not None]
    found = sorted(zip((naming.step_of(n) for n in names), names, _have_metadata(st, names)))
    if not found and st.exists(METADATA_FILE):  # the root is itself one checkpoint
        return [CheckpointEntry("", None, st.root, True, False, True)]
    complete = [name for _, name, ok in found if ok]
    latest = tracker if tracker in complete else (complete[-1] if complete else None)
    return [CheckpointEntry(name, step, st.join(name), ok, name == tracker, ok and name == latest)
            for step, name, ok in found]


def resolve(path: str | os.PathLike, naming: StepNaming = BCP_STEPS) -> Storage:
    """The storage of the checkpoint at `path`: the directory itself or, for a root, the checkpoint
    its tracker names, else its newest complete one; or a checkpoint of another system that bcp reads
    as it is (`bcp_core.foreign`: DeepSpeed's `global_stepN/` or its parent). Raises naming what is
    there instead."""
    st = storage_for(path)
    if st.exists(METADATA_FILE):
        return st
    foreign = open_foreign(st)
    if foreign is not None:
        return foreign
    name = read_tracker(st)
    if name is not None:
        if naming.step_of(name) is not None and st.exists(f"{name}/{METADATA_FILE}"):
            return st.child(name)
        log.warning("bcp: tracker %s/%s names %r, which is not a complete checkpoint; scanning",
                    st.root, TRACKER_FILE, name)
    entries = list_checkpoints(path, naming)
    incomplete = [e.name for e in entries if not e.complete]
    complete = [e for e in entries if e.complete]
    if complete:
        newer = [n for n in incomplete if naming.step_of(n) > complete[-1].step]
        if newer:
            log.warning("bcp: skipping incomplete checkpoints %s under %s", newer, st.root)
        return st.child(complete[-1].name)
    if incomplete:
        raise IncompleteCheckpointError(f"{st.root}: no complete checkpoint; incomplete (never committed): "
                                        f"{', '.join(reversed(incomplete))}")
    if st.exists(FAILED_FILE):
        raise IncompleteCheckpointError(f"{st.root} holds no {METADATA_FILE}: its save failed and was not "
                                        f"committed ({_failure(st)})")
    if st.exists("data"):
        raise IncompleteCheckpointError(f"{st.root} holds data files but no {METADATA_FILE}: the save that "
                                        "wrote it never committed")
    if naming.step_of(st.root.rstrip("/").rsplit("/", 1)[-1]) is not None and st.exists(""):
        # a save creates its step directory first: one without anything in it never got further
        raise IncompleteCheckpointError(f"{st.root} holds no {METADATA_FILE}: the save of this step never "
                                        "committed")
    raise NotACheckpointError(f"{st.root} is not a bcp checkpoint (no {METADATA_FILE}, no {TRACKER_FILE})")


def _failure(st: Storage) -> str:
    """What FAILED_FILE says of the failed save (its text is not trusted: only shown, shortened)."""
    try:
        mark = parse_json(read_capped(st, FAILED_FILE), st.join(FAILED_FILE))
    except (BCPError, OSError) as e:  # a damaged mark still says the save failed
        return f"{FAILED_FILE} unreadable: {e}"
    if type(mark) is dict and type(mark.get("save")) is str and type(mark.get("error")) is str:
        return f"{mark['save']}: {mark['error']}"[:2000]
    return f"{FAILED_FILE} unreadable: not an object with the strings \"save\" and \"error\""


def latest_complete(root: str | os.PathLike, naming: StepNaming = BCP_STEPS) -> str | None:
    """Path of the checkpoint `load(root)` would use, or None if `root` holds no complete one."""
    try:
        return resolve(root, naming).root
    except (NotACheckpointError, IncompleteCheckpointError):
        return None


def _have_metadata(st: Storage, names: list[str]) -> list[bool]:
    """Whether each step directory holds committed metadata; asked in parallel where each question
    is a network request (a root of many steps on an object store)."""
    def has(name: str) -> bool:
        return st.exists(f"{name}/{METADATA_FILE}")
    if not st.remote or len(names) < 2:
        return [has(n) for n in names]
    with ThreadPoolExecutor(min(len(names), REMOTE_THREADS), thread_name_prefix="bcp-list") as pool:
        return list(pool.map(has, names))


# ----------------------------------------------------------------------------- removing checkpoints

# A temporary file (storage.base.temp_name) whose writer is on another host is stale once it has not
# been written to for this long; one whose writer ran on this host is stale once that process ended.
STALE_TEMP_SECONDS = 3600


@dataclass(frozen=True)
class Removal:
    """What `prune` or `remove_leftovers` did under a root (names relative to the root)."""

    removed: tuple[str, ...]              # removed (with dry_run: would be removed)
    kept: tuple[str, ...]                 # step directories left in place
    failed: tuple[tuple[str, str], ...]   # (name, why) of each that could not be removed, or only in part


def prune(root: str | os.PathLike | Storage, keep_last: int, keep_every: int | None = None,
          naming: StepNaming = BCP_STEPS, dry_run: bool = False, keep: Iterable[str] = ()) -> Removal:
    """Remove complete checkpoints except the newest `keep_last`, those whose step is a multiple of
    `keep_every`, those named in `keep` (step directory names or paths), the one the tracker names
    and the one `load(root)` uses; and incomplete ones older
    than the latest that no save is writing any more (`_abandoned`: failed saves; newer ones, and
    older ones still being written, may be saves in progress). Works on every storage.

    A checkpoint's metadata goes first, so an interrupted removal leaves an incomplete checkpoint,
    never one that looks complete. A failure to remove one is reported in `failed`, and the others
    are still removed.
    """
    if type(keep_last) is not int or keep_last < 1:
        raise ValueError(f"keep_last={keep_last!r}: keep at least 1 checkpoint")
    if keep_every is not None and (type(keep_every) is not int or keep_every < 1):
        raise ValueError(f"keep_every={keep_every!r}: must be an integer >= 1, or None")
    st = _storage(root)
    entries = [e for e in list_checkpoints(st, naming) if e.name]
    complete = [e for e in entries if e.complete]
    latest = next((e for e in entries if e.latest), None)
    protected = {posixpath.basename(os.fspath(k).rstrip("/")) for k in keep}
    keep = {e.name for e in complete[-keep_last:]} | {e.name for e in entries if e.tracker or e.latest} | protected
    if keep_every:
        keep |= {e.name for e in complete if e.step % keep_every == 0}
    now = time.time()
    doomed = [e for e in entries if e.name not in keep
              and (e.complete or (latest is not None and e.step < latest.step and _abandoned(st, e.name, now)))]
    kept = tuple(e.name for e in entries if e not in doomed)
    if dry_run:
        return Removal(tuple(e.name for e in doomed), kept, ())
    removed, failed = _remove_each(st, [(e.name, e.complete) for e in doomed])
    return Removal(removed, kept, failed)


def remove_leftovers(root: str | os.PathLike | Storage, committed: str, naming: StepNaming = BCP_STEPS) -> Removal:
    """After `committed` (a step directory's name) was committed under `root`: remove what failed or
    crashed saves left behind. That is step directories without metadata whose step is older than
    the committed one (never a newer one: it may be a save in progress) and that no save writes any
    more (`_abandoned`: another job may be saving an older step to the same root right now); and
    stale temporary files (`storage.base.temp_name`) in the root, the committed directory and its
    `data/`: written by a process of this host that has ended, or not written to for
    STALE_TEMP_SECONDS.
    """
    step = naming.step_of(committed)
    if step is None:
        raise ValueError(f"{committed!r} is not a step directory name ({naming.template})")
    st = _storage(root)
    tracker = read_tracker(st)
    now = time.time()
    entries = [e for e in list_checkpoints(st, naming) if e.name]
    failed_saves = [e.name for e in entries if not e.complete and e.step < step and e.name != tracker
                    and _abandoned(st, e.name, now)]
    temps = []
    for where in ("", committed, f"{committed}/data"):
        for name in st.listdir(where):
            rel = f"{where}/{name}" if where else name
            if _stale_temp(st, rel, name, now):
                temps.append(rel)
    removed, failed = _remove_each(st, [(name, False) for name in failed_saves + temps])
    return Removal(removed, tuple(e.name for e in entries if e.name not in failed_saves), failed)


def remove_superseded(root: str | os.PathLike | Storage, committed: str, naming: StepNaming = BCP_STEPS) -> Removal:
    """After `committed` (a step directory's name) was committed under `root`, for a root that holds
    one checkpoint at a time (a framework's checkpoint path saved to again, Lightning's
    `last.ckpt`): remove what it replaces. That is every older step directory, complete or not, and
    whatever else the root holds but its tracker, such as the files of a checkpoint written into the
    root itself by bcp before step directories (their metadata first, so that the tracker takes over
    at once). Newer step directories (the next save to the root, begun on other ranks) stay."""
    step = naming.step_of(committed)
    if step is None:
        raise ValueError(f"{committed!r} is not a step directory name ({naming.template})")
    st = _storage(root)
    names = st.listdir()

    def older(name: str) -> bool:
        own = naming.step_of(name)
        return name != TRACKER_FILE and (own is None or own < step)
    doomed = sorted(filter(older, names), key=lambda name: name != METADATA_FILE)
    removed, failed = _remove_each(st, [(name, naming.step_of(name) is not None) for name in doomed])
    return Removal(removed, tuple(name for name in names if name not in doomed), failed)


def remove_checkpoint(path: str | os.PathLike) -> None:
    """Remove whatever is at `path`, whole: a checkpoint, a root of checkpoints, or a file; missing is
    no error. A root's tracker and a checkpoint's metadata go first, so that an interrupted removal
    leaves nothing that looks complete in their place."""
    st = storage_for(path)
    for name in (TRACKER_FILE, METADATA_FILE):
        if st.exists(name):
            st.remove(name)
    st.remove("")


def _abandoned(st: Storage, name: str, now: float) -> bool:
    """Whether no save writes the incomplete step directory `name` any more: its save failed on every
    rank (FAILED_FILE), or one of its temporary files belongs to a process of this host that has
    ended (a writer died: its save cannot commit), or, with no writer of this host still running,
    none of its files (or, holding none, the directory) was written for STALE_TEMP_SECONDS (a save
    in progress writes its files under temporary names and they are fresh until it commits; this
    also finds a checkpoint whose removal stopped after its metadata). A time the storage cannot
    tell keeps the directory. A symbolic link is no save's (saves create directories): it goes, as
    a link."""
    if st.is_link(name) or st.exists(f"{name}/{FAILED_FILE}"):
        return True
    files, dirs, dead_writer = [], [name], False
    for where in (name, f"{name}/data"):
        for entry in st.listdir(where):
            rel = f"{where}/{entry}"
            temp = parse_temp_name(entry)
            if temp is not None and temp_writer_gone(temp):
                dead_writer = True
            elif temp is not None and temp.host == this_host():
                return False  # its writer still runs
            else:
                (dirs if rel == f"{name}/data" else files).append(rel)
    if dead_writer:
        return True
    times = [st.modified(rel) for rel in (files or dirs)]
    return None not in times and now - max(times) > STALE_TEMP_SECONDS


def _stale_temp(st: Storage, relpath: str, name: str, now: float) -> bool:
    temp = parse_temp_name(name)
    if temp is None:
        return False
    if temp_writer_gone(temp):
        return True
    modified = st.modified(relpath)
    return modified is not None and now - modified > STALE_TEMP_SECONDS


def _remove_each(st: Storage, doomed: list[tuple[str, bool]]) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """Remove each (name, complete) entry; a link as a link, a complete checkpoint's metadata first."""
    removed, failed = [], []
    for name, complete in doomed:
        try:
            if complete and not st.is_link(name):
                st.remove(f"{name}/{METADATA_FILE}")
            st.remove(name)
        except (BCPError, OSError) as e:
            failed.append((name, str(e) if isinstance(e, BCPError) else f"{type(e).__name__}: {e}"))
            continue
        removed.append(name)
    return tuple(removed), tuple(failed)
