"""The save driver: plan (cached) -> snapshot -> agree -> write -> commit, synchronous or in the background.

    plan = local_save_plan(flatten(state))          # every save: what this rank holds
    cached = plan cache [plan.key]                  # this rank's guess; the job agrees below
    snapshot = take(plan, cached)                   # async saves: the state as of the call (the stall)
    ---- the caller returns here for async saves; the rest runs on the role's save thread ----
    agreed = rounds.agree(...)                      # PlanRequest -> UseCachedPlan | PlanReply
    report = snapshot.write(agreed.assignment)      # engine: data files, checksums, fsync
    rounds.commit(report)                           # WriteReports -> metadata file, tracker -> Committed

One `Checkpointer` per role (e.g. actor / critic / reference in RL post-training) owns its plan
cache and rounds (save_rounds.py), its staging buffers (save_snapshot.py) and its queue
(save_queue.py), so several can live in one process.

One save, one identity. Every call of `save` (and `prepare_save`) on every rank takes part in the
role's collective operations, even when it failed on this rank before anything was sent (its
error then travels with its messages, so every rank fails that save alike): so the k-th save of
a role is the k-th on every rank, and its messages are named after it (`s<k>/plan`,
`s<k>/commit`) and carry its `SaveId` (number, step, path).

Ordering rule: the operations of a role run either on the caller's thread while nothing is in
flight (synchronous saves, `prepare_save`), or on the role's background save threads, which run
one at a time in submission order; so they run in the same order on every rank.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from datetime import timedelta

from . import metrics
from .adapters import resolve_framework
from .comm import DEFAULT_TIMEOUT, Comm, comm_for, save_tag
from .errors import BCPError, CommTimeoutError, SaveError, UnsupportedValueError
from .flatten import save_leaves
from .layout import BCP_STEPS
from .plan_records import SaveId, WriteReport
from .save_job import SaveProgress, SaveRequest, rank_error
from .save_planner import local_save_plan
from .save_queue import SaveHandle, SaveQueue, previous_error
from .save_rounds import SaveRounds, check_probes, mark_failed, write_probe
from .save_snapshot import Snapshots, write_live
from .storage import storage_for
from .tiers.memory_tier import TierRuntime, TierSave
from .tiers.policy import Tiers
from .utils import cores_per_rank

log = logging.getLogger("bcp")

# How an async save captures the state (save_snapshot.py): "lazy" copies parameters and optimizer
# state after the call returns, until the next optimizer step; "copy" copies everything before
# returning; "fork" snapshots a first save by forking.
SNAPSHOTS = ("lazy", "copy", "fork")

class Checkpointer:
    """Saves for one role. Use `bcp_core.save(..., role=...)`, which keeps one per role."""

    def __init__(self, role: str = "default"):
        self.role = role
        self.rounds = SaveRounds()
        self.queue = SaveQueue(role)
        self.snapshots = Snapshots(role, self.queue)
        self._ops = 0          # collective operations of this role so far (saves and prepares)
        self._probed: set[str] = set()  # roots every node was seen to share
        self._tiers: TierRuntime | None = None  # tiered saves' placements and drains, from the first one

    @property
    def stats(self) -> dict:
        """plans: the plans this rank learned; cache_hits: the calls that found a cached plan."""
        return self.rounds.stats

    # -- public ------------------------------------------------------------------------------------

    def save(self, path, state: dict, framework: str = "auto", async_save: bool = False, *,
             step: int | None = None, process_group=None, allow_pickle: bool = False, fsync: bool = True,
             num_threads: int | None = None, user_metadata: dict | None = None,
             on_commit: Callable[[str], None] | None = None, snapshot: str = "lazy", keep: int | None = None,
             timeout: timedelta = DEFAULT_TIMEOUT) -> SaveHandle:
        if snapshot not in SNAPSHOTS:
            raise ValueError(f"snapshot must be one of {', '.join(map(repr, SNAPSHOTS))}, got {snapshot!r}")
        if keep is not None and (step is None or type(keep) is not int or keep < 1):
            raise ValueError(f"keep={keep!r}: keep needs a step (path is then a root) and must be an integer >= 1")
        tiered = isinstance(path, Tiers)
        if tiered and (step is None or keep is not None):
            raise ValueError("a save to Tiers needs a step, and keeps steps by Tiers.keep_in_memory and "
                             f"keep_durable, not keep= (got step={step!r}, keep={keep!r})")
        earlier = self.queue.earlier_failures() + (self._tiers.drains.queue.earlier_failures() if self._tiers else [])
        comm = comm_for(process_group, save_tag(self.role))
        # From here on this save takes part in every exchange, whatever fails on this rank.
        self._ops += 1
        sid = SaveId(self._ops, step, path.label if tiered else os.fspath(path))
        rec = metrics.Recorder("save", comm.rank, sid.path)
        progress = SaveProgress()
        request = SaveRequest(sid, timeout, f"save to {sid.path}",
                              num_threads=num_threads or min(4, cores_per_rank()), on_commit=on_commit, keep=keep,
                              recorder=rec)
        if tiered:  # before anything can fail: a tiered save's exchanges are taken part in whatever happens
            if self._tiers is None:
                self._tiers = TierRuntime(self.role)
            request = replace(request, tiers=TierSave(path, self._tiers, process_group))
        try:
            request = replace(request, user_metadata=_committed_form(user_metadata))
            request = self._locate(request, fsync)
            adapter = resolve_framework(state, framework)
            request = replace(request, framework=adapter.name)
            rec.run(self._open, comm, request, progress, state, adapter, allow_pickle,
                    snapshot if async_save else None)
        except Exception as e:  # noqa: BLE001 - sent with this rank's request, so that every rank fails alike
            progress.error = rank_error(comm.rank, e)
            self._release(progress)
        path_shown = request.ckpt.root if request.ckpt is not None else sid.path
        if async_save:
            run = self.queue.start(lambda: rec.run(self._run, comm, request, progress, finish=True))
            handle = SaveHandle(path_shown, run, rec)
            self.queue.add(handle, request, progress)
        else:
            self._drain(request, progress)  # its exchanges must not interleave with queued background commits
            future: Future = Future()
            try:
                future.set_result(rec.run(self._run, comm, request, progress, finish=True))
            except BaseException as e:
                future.set_exception(e)
            handle = SaveHandle(path_shown, future, rec)
            if future.exception() is not None:
                handle._error_seen = True
                for earlier_handle, exc in earlier:  # this save's own error is the one raised
                    log.error("bcp: an earlier asynchronous save to %s failed and was not committed: %s",
                              earlier_handle.path, exc)
                raise future.exception()
        if earlier:
            raise previous_error(earlier, request.what, handle)
        return handle

    def prepare(self, state: dict, framework: str = "auto", async_save: bool = True, *, process_group=None,
                allow_pickle: bool = False, timeout: timedelta = DEFAULT_TIMEOUT) -> Future:
        """Plan the saves of `state`'s structure now and, for async saves, touch the staging
        buffers in a background thread (see `bcp_core.prepare_save`). Collective."""
        earlier = self.queue.earlier_failures()
        comm = comm_for(process_group, save_tag(self.role))
        self._ops += 1
        request = SaveRequest(SaveId(self._ops, None, ""), timeout, f"prepare_save (role {self.role!r})")
        progress = SaveProgress()
        try:
            adapter = resolve_framework(state, framework)
            progress.plan = local_save_plan(save_leaves(state, adapter), comm.rank, allow_pickle)
        except Exception as e:  # noqa: BLE001 - sent to the coordinator, so that every rank raises
            progress.error = rank_error(comm.rank, e)
        self._drain(request, progress)
        agreed = self.rounds.agree(comm, request, progress, f"p{request.save.number}", resend=True)
        if async_save:
            ready = self.snapshots.prepare(progress.plan, agreed.assignment)
        else:
            ready = Future()
            ready.set_result(None)
        if earlier:
            raise previous_error(earlier, request.what, None)
        return ready

    def wait_all(self, timeout: float | None = None) -> None:
        """Wait for every queued save (each at most `timeout` seconds, if given); errors are left on
        the handles (and raised by the next save). Raises CommTimeoutError when one is still running."""
        self.queue.wait_all(timeout)

    def _drain(self, request: SaveRequest, progress: SaveProgress) -> None:
        """Before a save runs its exchanges on the caller's thread: the queued saves end first. A
        queue that does not drain within the timeout fails this save (on every rank, by its request)."""
        try:
            self.wait_all(3 * request.timeout.total_seconds())
        except CommTimeoutError as e:
            progress.error = progress.error or str(e)

    # -- the call: this rank's plan and its snapshot -------------------------------------------------

    @staticmethod
    def _locate(request: SaveRequest, fsync: bool) -> SaveRequest:
        """The request with its storage: the root its path names, and the checkpoint's directory in it
        (a tiered save: this node's memory tier, tiers/)."""
        sid = request.save
        root = request.tiers.tiers.memory_root() if request.tiers is not None else storage_for(sid.path, fsync=fsync)
        tracker_name = BCP_STEPS.name(sid.step) if sid.step is not None else ""
        ckpt = root.child(tracker_name) if tracker_name else root
        return replace(request, root=root, tracker_name=tracker_name, ckpt=ckpt, what=f"save to {ckpt.root}")

    def _open(self, comm: Comm, request: SaveRequest, progress: SaveProgress, state: dict, adapter,
              allow_pickle: bool, snapshot: str | None) -> None:
        """This rank's plan, the cached plan it would reuse, and (`snapshot`: an async save) its snapshot."""
        request.ckpt.makedirs()  # exists when save returns, even if async (callers write files beside it)
        with metrics.phase("plan"):
            progress.plan = local_save_plan(save_leaves(state, adapter), comm.rank, allow_pickle)
        progress.cached = self.rounds.cached(progress.plan.key)
        if snapshot is not None:
            self.snapshots.take(request, progress, snapshot)

    # -- agree, write and commit (on the role's save thread for async saves) ----------------------------

    def _run(self, comm: Comm, request: SaveRequest, progress: SaveProgress) -> str:
        """Agree on the plan, write this rank's pieces, commit; a save that failed is marked so."""
        try:
            return self._agree_write_commit(comm, request, progress)
        except SaveError as e:  # raised by a round: this save failed on every rank
            # (a tiered save's step directory is on every node: each node's leader marks its own)
            marks = comm.node_leaders if request.tiers is not None else [0]
            if comm.rank in marks and progress.phase != "committed" and request.ckpt is not None:
                mark_failed(request, e)
            raise

    def _agree_write_commit(self, comm: Comm, request: SaveRequest, progress: SaveProgress) -> str:
        """Every rank reaches the commit round once the plan is agreed, whatever fails on it in between."""
        op = f"s{request.save.number}"
        try:
            progress.phase = "planning"
            # decided here, not in the call: every earlier save of the role has ended on every rank by
            # now, so every rank sees the same roots checked
            progress.probe = request.root is not None and request.tiers is None and len(set(comm.nodes)) > 1 \
                and request.root.root not in self._probed
            if request.tiers is not None:  # each node's own memory (tiers/memory_tier.py)
                request.tiers.before_plan(comm, request, progress, op)
            write_probe(comm, request, progress)
            progress.agreed = self.rounds.agree(comm, request, progress, op)
            if progress.snapshot is not None:
                progress.snapshot.keep_only(progress.agreed.assignment)
        except BaseException:
            self._release(progress)
            raise
        progress.phase = "writing"
        report = self._write(comm, request, progress)
        if request.tiers is not None:  # every piece gets its copies on other nodes before the commit
            report = request.tiers.replicate(comm, request, report)
        try:
            self._release(progress)
        except Exception as e:  # noqa: BLE001 - reported to the coordinator, so every rank fails alike
            if report.error is None:
                report = WriteReport.failed(request.save, rank_error(comm.rank, e))
        progress.phase = "committing"
        try:
            self.rounds.commit(comm, request, progress, report, op)
        finally:  # committed, even if on_commit then raised: every node was seen to share the root
            if progress.probe and progress.phase == "committed":
                self._probed.add(request.root.root)
        return request.ckpt.root

    def _write(self, comm: Comm, request: SaveRequest, progress: SaveProgress) -> WriteReport:
        """This rank's assignment written: from its snapshot, or from the live state (a synchronous
        save); a failure is reported, so that every rank fails alike."""
        try:
            check_probes(comm, request, progress)
            prefix = f"{self.rounds.token}-{request.save.number}-"  # the coordinator's token came with the plan
            assignment = progress.agreed.assignment
            if progress.snapshot is None:
                return write_live(request, progress.plan, assignment, comm.rank, prefix)
            return progress.snapshot.write(request, progress.plan, assignment, comm.rank, prefix)
        except Exception as e:  # noqa: BLE001 - reported to the coordinator, so every rank fails alike
            return WriteReport.failed(request.save, rank_error(comm.rank, e))

    @staticmethod
    def _release(progress: SaveProgress) -> None:
        if progress.snapshot is not None:
            progress.snapshot.release()


def _committed_form(user_metadata: dict | None) -> dict:
    """`user_metadata` as the metadata file will hold it (its JSON form), taken at the call: an
    async save writes it at its commit, after the caller may have changed the values it passed. A
    value JSON cannot hold is refused here, naming its key, rather than failing the commit."""
    if user_metadata is None:
        return {}
    if not isinstance(user_metadata, dict):
        raise UnsupportedValueError(f"user_metadata must be a dict, got {type(user_metadata).__name__}")
    committed = {}
    for key, value in user_metadata.items():
        try:  # the same encoding as the metadata file (metadata.CheckpointMetadata.dumps)
            ((name, copy),) = json.loads(json.dumps({key: value}, allow_nan=False)).items()
        except (TypeError, ValueError, RecursionError) as e:
            raise UnsupportedValueError(f"user_metadata[{key!r}] cannot be saved in the metadata (JSON): "
                                        f"{type(e).__name__}: {e}") from None
        committed[name] = copy
    return committed


# ----------------------------------------------------------------------------- registry

_CHECKPOINTERS: dict[str, Checkpointer] = {}
_LOCK = threading.Lock()


def get_checkpointer(role: str = "default") -> Checkpointer:
    if not isinstance(role, str) or not role:
        raise BCPError(f"role must be a non-empty string, got {role!r}")
    with _LOCK:
        if role not in _CHECKPOINTERS:
            _CHECKPOINTERS[role] = Checkpointer(role)
        return _CHECKPOINTERS[role]


def _forget_in_child() -> None:
    """In a forked child: the parent's staging buffers are not mapped here, and another thread of the
    parent may have held a lock at the fork (save_queue forgets the parent's saves)."""
    global _LOCK
    _LOCK = threading.Lock()
    for cp in _CHECKPOINTERS.values():
        cp.snapshots.forget_in_child()
        cp.rounds.forget_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
