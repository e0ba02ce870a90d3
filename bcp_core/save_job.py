"""One save as the save's modules see it: what the call asked for (`SaveRequest`, fixed at the call)
and how far the save has got (`SaveProgress`, its one mutable part).

    checkpointer.py    the driver: makes both, runs the save's steps in order
    save_rounds.py     the rounds between ranks: agree on the plan, commit
    save_snapshot.py   the state as of the call, and this rank's pieces written from it
    save_queue.py      a role's saves in order; their handles; the process's exit
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol

from . import metrics
from .plan_records import Assignment, GlobalSavePlan, LocalSavePlan, SaveId, WriteReport
from .storage import Storage


@dataclass(frozen=True)
class SaveRequest:
    """What a call of `save` (or `prepare_save`) asked for, its path resolved."""

    save: SaveId
    timeout: timedelta
    what: str                                    # how messages name this save ("save to PATH")
    root: Storage | None = None                  # None: the path could not be resolved (the progress's error)
    ckpt: Storage | None = None                  # the checkpoint's directory: a step directory of `root`, or `root`
    tracker_name: str = ""                       # the step directory's name under the root; "" without a step
    framework: str = ""                          # the adapter's name, recorded in the metadata
    user_metadata: dict = field(default_factory=dict)
    num_threads: int = 1                         # files this rank writes at once
    on_commit: Callable[[str], None] | None = None
    keep: int | None = None                      # keep this many newest checkpoints of the root
    recorder: metrics.Recorder | None = None     # this rank's phase timings


@dataclass(frozen=True)
class CachedPlan:
    """A plan every rank agreed on: this rank's assignment and the plan's id (the same on every rank)."""

    assignment: Assignment
    plan_id: str
    gplan: GlobalSavePlan | None = None             # coordinator only
    rank_keys: tuple[str, ...] = ()                 # coordinator only: each rank's structure key


class Snapshot(Protocol):
    """The state of a save as of its call, until this rank's pieces are written from it (save_snapshot.py)."""

    def writable(self) -> set[tuple[int, int]] | None:
        """The boxes ((tensor, box) indices) it can write, if not every box this rank holds."""

    def keep_only(self, assignment: Assignment) -> None:
        """The agreed plan gives this rank `assignment`: the rest need not be captured."""

    def write(self, request: SaveRequest, plan: LocalSavePlan, assignment: Assignment, rank: int,
              prefix: str) -> WriteReport:
        """Write this rank's pieces of `assignment` (data files named `prefix`...); the report, or
        one with the error."""

    def release(self) -> None:
        """Give back what it holds (staging buffers, a process); it can no longer write."""


@dataclass
class SaveProgress:
    """How far a save has got on this rank; read by the exit hook's messages (`phase`)."""

    phase: str = "queued"                        # queued, planning, writing, committing, committed
    error: str | None = None                     # this rank's error before anything was sent
    plan: LocalSavePlan | None = None            # this rank's plan
    cached: CachedPlan | None = None             # the cached plan this rank would reuse
    agreed: CachedPlan | None = None             # the plan every rank agreed on
    snapshot: Snapshot | None = None             # async saves: the state as of the call
    probe: bool = False                          # first save of a multi-node job to this root


def rank_error(rank: int, e: BaseException) -> str:
    """An error of this rank as it travels to the others."""
    return f"rank {rank}: {type(e).__name__}: {e}"
