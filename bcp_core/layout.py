"""A checkpoint root: one directory per saved step, a `latest` tracker, and finding what to load.

    root/
      step_00000100/        a checkpoint (complete once it holds bcp_metadata.json)
      step_00000200/
      latest                "step_00000200": the newest committed checkpoint

`StepNaming` says how step directories are named: bcp's own `step_<8 digits>` (`BCP_STEPS`) or
HF Trainer's `checkpoint-<step>` (`HF_STEPS`, no tracker: HF finds the newest itself). Every
place that names, lists or resolves checkpoints goes through this module.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

from .errors import IncompleteCheckpointError, NotACheckpointError
from .metadata import METADATA_FILE, TRACKER_FILE
from .storage import Storage, storage_for

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


def read_tracker(root: Storage) -> str | None:
    return root.read_bytes(TRACKER_FILE).decode(errors="replace").strip() if root.exists(TRACKER_FILE) else None


def write_tracker(root: Storage, name: str) -> None:
    """Point `latest` at `name`, atomically: the commit point of "latest" (docs/format.md)."""
    root.write_atomic(TRACKER_FILE, name.encode())


def list_checkpoints(root: str | os.PathLike, naming: StepNaming = BCP_STEPS) -> list[CheckpointEntry]:
    """The step directories under `root`, oldest first, complete or not, with the latest marked."""
    st = storage_for(root)
    tracker = read_tracker(st)
    found = []
    for name in st.listdir():
        step = naming.step_of(name)
        if step is not None:
            found.append((step, name, st.exists(f"{name}/{METADATA_FILE}")))
    found.sort()
    if not found and st.exists(METADATA_FILE):  # the root is itself one checkpoint
        return [CheckpointEntry("", None, st.root, True, False, True)]
    complete = [name for _, name, ok in found if ok]
    latest = tracker if tracker in complete else (complete[-1] if complete else None)
    return [CheckpointEntry(name, step, st.join(name), ok, name == tracker, ok and name == latest)
            for step, name, ok in found]


def resolve(path: str | os.PathLike, naming: StepNaming = BCP_STEPS) -> Storage:
    """The storage of the checkpoint at `path`: the directory itself or, for a root, the checkpoint
    its tracker names, else its newest complete one. Raises naming what is there instead."""
    st = storage_for(path)
    if st.exists(METADATA_FILE):
        return st
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
    if st.exists("data"):
        raise IncompleteCheckpointError(f"{st.root} holds data files but no {METADATA_FILE}: the save that "
                                        "wrote it never committed")
    raise NotACheckpointError(f"{st.root} is not a bcp checkpoint (no {METADATA_FILE}, no {TRACKER_FILE})")


def latest_complete(root: str | os.PathLike, naming: StepNaming = BCP_STEPS) -> str | None:
    """Path of the checkpoint `load(root)` would use, or None if `root` holds no complete one."""
    try:
        return resolve(root, naming).root
    except (NotACheckpointError, IncompleteCheckpointError):
        return None
