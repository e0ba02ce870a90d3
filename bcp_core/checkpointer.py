"""The save driver: plan (cached) -> stage -> write -> commit, synchronous or in the background.

    plan = local_save_plan(flatten(state))          # every save: what this rank holds
    cached = plan cache [plan.key]                  # this rank's guess; the job agrees below
    stage(plan, cached)                             # async saves: copy into staging (the stall)
    ---- the caller returns here for async saves; the rest runs on the role's save thread ----
    agree: PlanRequest -> coordinator -> UseCachedPlan | PlanReply (| ResendStructure, re-plan)
    report = write(plan, assignment)                # engine: data files, checksums, fsync
    commit: gather WriteReports -> build_metadata -> metadata file, tracker -> Committed | SaveFailed

One `Checkpointer` per role (e.g. actor / critic / reference in RL post-training) owns its plan
cache, staging pool and save queue, so several can live in one process.

One save, one identity. Every call of `save` (and `prepare_save`) on every rank takes part in the
role's collective operations, even when it failed on this rank before anything was sent (its
error then travels with its messages, so every rank fails that save alike): so the k-th save of
a role is the k-th on every rank, and its messages are named after it (`s<k>/plan`,
`s<k>/commit`) and carry its `SaveId` (number, step, path), which the coordinator checks. A rank
never pairs one save's report with another's, whatever failed before.

Whether to reuse a cached plan is agreed, not decided by each rank alone: every save opens with
one exchange in which each rank names the cached plan it would reuse (or sends its structure);
the coordinator answers "use it" only if every rank holds the same plan for its current
structure, and otherwise plans again, within what each rank staged.

Ordering rule: the operations of a role run either on the caller's thread while nothing is in
flight (synchronous saves, `prepare_save`), or on the role's background save threads, which run
one at a time in submission order; so they run in the same order on every rank.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import secrets
import sys
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch

from . import codec, metrics
from .adapters import resolve_framework
from .comm import DEFAULT_TIMEOUT, Comm, comm_for
from .engine import write_items
from .errors import BCPError, CommitCallbackError, CommTimeoutError, MetadataError, PreviousSaveError, SaveError
from .flatten import save_leaves
from .layout import BCP_STEPS, write_tracker
from .metadata import CHECKSUM_BLOCK_BYTES, FAILED_FILE, METADATA_FILE, dtype_name
from .plan_records import (Assignment, Committed, GatheredRequests, GlobalSavePlan, LocalSavePlan, ObjectShardKey,
                           PlanReply, PlanRequest, RankValueKey, ResendStructure, SaveFailed, SaveId, TensorBoxKey,
                           UseCachedPlan, WriteItem, WriteReport)
from .save_planner import (build_metadata, global_save_plan, local_save_plan, merge_plan_messages, plan_message,
                           plan_replies, read_plan_messages)
from .snapshot import ForkSnapshot, can_fork
from .host_memory import ordered_after_callers
from .staging import LazyCopy, StagingPool, box_sources, contiguous_cpu, on_host_or_cuda, pool_key
from .storage import Storage, storage_for
from .utils import cores_per_rank, digest, gc_paused, this_rank

log = logging.getLogger("bcp")

PLAN_CACHE_SIZE = 4
# How an async save captures the state: "lazy" copies parameters and optimizer state after the call
# returns, until the next optimizer step (staging.py); "copy" copies everything before returning;
# "fork" snapshots a first save by forking (snapshot.py).
SNAPSHOTS = ("lazy", "copy", "fork")
# Files the node leaders of a multi-node job write at its first save to a root, to check that
# every node sees what the others wrote.
PROBE_FILE = ".bcp-probe-n{}"


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


@dataclass
class CachedPlan:
    """A plan every rank agreed on: this rank's assignment and the plan's id (the same on every rank)."""
    assignment: Assignment
    plan_id: str
    gplan: GlobalSavePlan | None = None   # coordinator only
    rank_keys: list[str] = field(default_factory=list)  # coordinator only: each rank's structure key


@dataclass
class SaveJob:
    """Everything a save's agreement, write and commit need, detached from the live state."""

    save: SaveId
    timeout: timedelta
    what: str                                    # how messages name this save ("save to PATH")
    ckpt: Storage | None = None
    root: Storage | None = None
    tracker_name: str = ""
    plan: LocalSavePlan | None = None
    cached: CachedPlan | None = None             # the cached plan this rank would reuse
    agreed: CachedPlan | None = None             # the plan every rank agreed on
    framework: str = ""
    user_metadata: dict = field(default_factory=dict)
    num_threads: int = 1
    on_commit: Callable[[str], None] | None = None
    keep: int | None = None                      # keep this many newest checkpoints of the root
    probe: bool = False                          # first save of a multi-node job to this root
    error: str | None = None                     # this rank's error before anything was sent
    recorder: metrics.Recorder | None = None     # this rank's phase timings
    slot: tuple | None = None                    # staging pool slot held until written
    snapshot: ForkSnapshot | None = None         # snapshot='fork': the process holding the state
    staged: dict | None = None                   # (ti, bi) -> staged copy (async saves)
    staged_per_rank: list | None = None
    writable: set | None = None                  # boxes this rank staged, if not all it holds
    lazy: LazyCopy | None = None                 # the staged copies still being made (lazy snapshot)
    step_phase: str = "queued"                   # where the job is, for messages at exit


class Checkpointer:
    """Saves for one role. Use `bcp_core.save(..., role=...)`, which keeps one per role."""

    def __init__(self, role: str = "default"):
        self.role = role
        self._plans: OrderedDict[str, CachedPlan] = OrderedDict()
        self._plans_lock = threading.Lock()  # the caller looks plans up while a save thread adds them
        self._pool = StagingPool()
        self._pending: deque[tuple[SaveHandle, SaveJob]] = deque()
        # plans: the plans this rank learned (the coordinator: made), each counted once; cache_hits:
        # the calls that found a cached plan for their structure, so staged only its boxes. A call made
        # before the previous save's planning ended finds none, and its save may still reuse that plan.
        self.stats = {"plans": 0, "cache_hits": 0}
        # Data files are named <token>-<save number>-r<rank>_<k>: unique per job and save, so two
        # jobs writing one directory never overwrite each other's bytes. The coordinator's token
        # reaches the other ranks with the first plan.
        self._token = secrets.token_hex(4)
        self._ops = 0          # collective operations of this role so far (saves and prepares)
        self._plan_ids = 0     # plans made by this rank as coordinator
        self._probed: set[str] = set()  # roots every node was seen to share
        self._warming: Future | None = None  # prepare_save's buffer warm-up

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
        earlier = self._earlier_failures()
        comm = comm_for(process_group, self.role)
        # From here on this save takes part in every exchange, whatever fails on this rank.
        self._ops += 1
        sid = SaveId(self._ops, step, os.fspath(path))
        rec = metrics.Recorder("save", comm.rank, sid.path)
        job = SaveJob(sid, timeout, f"save to {sid.path}", user_metadata=dict(user_metadata or {}),
                      num_threads=num_threads or min(4, cores_per_rank()), on_commit=on_commit, keep=keep,
                      recorder=rec)
        try:
            rec.run(self._open, comm, job, state, framework, allow_pickle, fsync, async_save, snapshot)
        except Exception as e:  # noqa: BLE001 - sent with this rank's request, so that every rank fails alike
            job.error = _rank_error(comm.rank, e)
            self._release(job)
        if async_save:
            handle = SaveHandle(job.what.removeprefix("save to ") if job.ckpt is None else job.ckpt.root,
                                self._start(rec.run, self._run, comm, job, finish=True), rec)
            self._pending.append((handle, job))
            _register_exit_flush()  # at every async save: a pool library imported since must not run first
        else:
            self._drain(job)  # its exchanges must not interleave with queued background commits
            future: Future = Future()
            try:
                future.set_result(rec.run(self._run, comm, job, finish=True))
            except BaseException as e:
                future.set_exception(e)
            handle = SaveHandle(job.ckpt.root if job.ckpt is not None else sid.path, future, rec)
            if future.exception() is not None:
                handle._error_seen = True
                for earlier_handle, exc in earlier:  # this save's own error is the one raised
                    log.error("bcp: an earlier asynchronous save to %s failed and was not committed: %s",
                              earlier_handle.path, exc)
                raise future.exception()
        if earlier:
            raise _previous_error(earlier, job, handle)
        return handle

    def prepare(self, state: dict, framework: str = "auto", async_save: bool = True, *, process_group=None,
                allow_pickle: bool = False, timeout: timedelta = DEFAULT_TIMEOUT) -> Future:
        """Plan the saves of `state`'s structure now and, for async saves, touch the staging
        buffers in a background thread (see `bcp_core.prepare_save`). Collective."""
        earlier = self._earlier_failures()
        comm = comm_for(process_group, self.role)
        self._ops += 1
        job = SaveJob(SaveId(self._ops, None, ""), timeout, f"prepare_save (role {self.role!r})")
        try:
            adapter = resolve_framework(state, framework)
            job.plan = local_save_plan(save_leaves(state, adapter), comm.rank, allow_pickle)
        except Exception as e:  # noqa: BLE001 - sent to the coordinator, so that every rank raises
            job.error = _rank_error(comm.rank, e)
        self._drain(job)
        agreed = self._agree(comm, job, f"p{job.save.number}", resend=True)
        ready: Future = Future()
        boxes = agreed.assignment.boxes
        key = pool_key(job.plan, boxes)
        if not async_save or self._pool.warm(key):
            ready.set_result(None)
        else:
            self._warming = ready

            def warm() -> None:
                try:
                    self._pool.warm_up(key, box_sources(job.plan, boxes))
                except Exception as e:  # noqa: BLE001 - the first save allocates its buffers itself then
                    log.warning("bcp: preparing the staging buffers of role %r failed: %s", self.role, e)
                ready.set_result(None)

            threading.Thread(target=warm, name=f"bcp-prepare-{self.role}").start()
        if earlier:
            raise _previous_error(earlier, job, None)
        return ready

    def wait_all(self, timeout: float | None = None) -> None:
        """Wait for every queued save (each at most `timeout` seconds, if given); errors are left on
        the handles (and raised by the next save). Raises CommTimeoutError when one is still running."""
        for handle, job in list(self._pending):
            try:
                handle._future.exception(timeout)  # blocks; the error stays for wait() / the next save
            except FutureTimeout:
                raise CommTimeoutError(f"bcp: rank {this_rank()} waited {timeout:.0f} s for the earlier save "
                                       f"{job.save} to finish; it is still {job.step_phase}") from None

    def _drain(self, job: SaveJob) -> None:
        """Before a save runs its exchanges on the caller's thread: the queued saves end first. A
        queue that does not drain within the timeout fails this save (on every rank, by its request)."""
        try:
            self.wait_all(3 * job.timeout.total_seconds())
        except CommTimeoutError as e:
            job.error = job.error or str(e)

    # -- the call: this rank's plan and its snapshot -------------------------------------------------

    def _open(self, comm: Comm, job: SaveJob, state: dict, framework: str, allow_pickle: bool, fsync: bool,
              async_save: bool, snapshot: str) -> None:
        sid = job.save
        job.root = storage_for(sid.path, fsync=fsync)
        job.tracker_name = BCP_STEPS.name(sid.step) if sid.step is not None else ""
        job.ckpt = job.root.child(job.tracker_name) if job.tracker_name else job.root
        job.what = f"save to {job.ckpt.root}"
        adapter = resolve_framework(state, framework)
        job.framework = adapter.name
        job.ckpt.makedirs()  # exists when save returns, even if async (callers write files beside it)
        with metrics.phase("plan"):
            job.plan = local_save_plan(save_leaves(state, adapter), comm.rank, allow_pickle)
        with self._plans_lock:
            job.cached = self._plans.get(job.plan.key)
            if job.cached is not None:
                self._plans.move_to_end(job.plan.key)
                self.stats["cache_hits"] += 1
        if async_save:
            if snapshot == "fork" and self._pool_is_cold(job) and can_fork(job.ckpt, _plan_tensors(job.plan)):
                self._fork(job)
            else:
                self._stage(job, lazy=snapshot == "lazy")

    # -- agreeing on the plan (on the save's thread) ----------------------------------------------------

    def _agree(self, comm: Comm, job: SaveJob, op: str, resend: bool = False) -> CachedPlan:
        """The plan every rank uses for this save: the cached one if every rank holds it for its
        current structure, else a new one (module doc). Fails on every rank alike."""
        sid = job.save
        if job.error is not None or job.plan is None:
            request = PlanRequest(sid, None, None, None, None, job.error or f"rank {comm.rank}: nothing to save")
        elif job.cached is not None and not resend:
            request = PlanRequest(sid, job.plan.key, job.cached.plan_id, None)
        else:
            request = PlanRequest(sid, job.plan.key, None, job.plan.structure)
        answer = self._round(comm, job, f"{op}/plan", request, self._decide)
        if isinstance(answer, ResendStructure):
            with self._plans_lock:  # never reused again unless the new plan confirms it
                self._plans.pop(job.plan.key, None)
            writable = tuple(sorted(job.writable)) if job.writable is not None else None
            request = PlanRequest(sid, job.plan.key, None, job.plan.structure, writable)
            answer = self._round(comm, job, f"{op}/replan", request, self._decide)
        if isinstance(answer, UseCachedPlan):
            return job.cached
        self._token = answer.token
        if comm.is_coordinator:
            return self._plans[job.plan.key]
        agreed = CachedPlan(answer.assignment, answer.plan_id)
        self._remember(job.plan.key, agreed)
        return agreed

    def _decide(self, job: SaveJob, gathered: GatheredRequests, world: int):
        """Coordinator: the answer to every rank's PlanRequest (one record, or one per rank)."""
        requests = gathered.requests
        _check_ids(requests, job.save)
        errors = [r.error for r in requests if r.error]
        if errors:
            raise SaveError("; ".join(errors))
        with self._plans_lock:
            mine = self._plans.get(requests[0].key)
        if mine is not None and all(r.key == k for r, k in zip(requests, mine.rank_keys)):
            if all(r.plan == mine.plan_id for r in requests):
                answer: object = UseCachedPlan(job.save)
            elif all(r.plan is None or r.plan == mine.plan_id for r in requests):
                # some ranks do not hold the plan yet (an earlier save's planning ended after they
                # staged): they staged everything they hold, so the cached assignments fit them
                answer = [codec.to_wire(PlanReply(job.save, a, self._token, mine.plan_id))
                          for a in mine.gplan.assignments]
            else:
                answer = ResendStructure(job.save)
        elif all(r.structure is not None for r in requests):
            writable = [None if r.writable is None else {tuple(b) for b in r.writable} for r in requests]
            gplan = global_save_plan([r.structure for r in requests], writable, gathered.entries)
            self._plan_ids += 1
            plan_id = f"{self._token}.{self._plan_ids}"
            self._remember(requests[0].key, CachedPlan(gplan.assignments[0], plan_id, gplan,
                                                        [r.key for r in requests]))
            answer = plan_replies(gplan, job.save, self._token, plan_id)
        else:
            answer = ResendStructure(job.save)
        if job.ckpt is not None and not isinstance(answer, ResendStructure):
            _invalidate(job.ckpt)  # an older checkpoint at this path must never pass for this one
            job.ckpt.makedirs()
        return answer

    def _remember(self, key: str, plan: CachedPlan) -> None:
        with self._plans_lock:
            known = self._plans.get(key)
            self._plans[key] = plan
            self._plans.move_to_end(key)
            while len(self._plans) > PLAN_CACHE_SIZE:
                self._plans.popitem(last=False)
            # a plan sent again (to a rank whose call came before the plan arrived) is not a new one
            if known is None or known.plan_id != plan.plan_id:
                self.stats["plans"] += 1

    def _round(self, comm: Comm, job: SaveJob, op: str, request, decide):
        """One exchange: every rank's request up to the coordinator, its answer back down (the same
        record for all, or one per rank). Raises SaveError on every rank if the answer is a failure."""
        planning = isinstance(request, PlanRequest)  # its tensor entries merged on the way up
        try:
            if planning:
                raw = comm.gather(plan_message(request, comm.rank), op, job.timeout, merge=merge_plan_messages)
            else:
                raw = comm.gather(codec.to_wire(request), op, job.timeout)
        except CommTimeoutError as e:  # tell the ranks that did arrive (leaders pass it on), then fail alike
            comm.broadcast(codec.to_wire(SaveFailed(job.save, str(e))), op, job.timeout)
            raise SaveError(f"{job.what} failed and was not committed: {e}") from None
        answer = None
        if comm.is_coordinator:
            try:
                records = read_plan_messages(raw, comm.world_size, job.save) if planning else \
                    _expect(raw, type(request), job.save)
                answer = decide(job, records, comm.world_size)
            except Exception as e:  # noqa: BLE001 - sent to every rank so that every rank raises
                answer = SaveFailed(job.save, _message(e))
        if isinstance(answer, list):
            received = comm.scatter(answer, op, job.timeout)
        else:
            received = comm.broadcast(codec.to_wire(answer) if answer is not None else None, op, job.timeout)
        try:
            answer = codec.from_wire(received, (UseCachedPlan, ResendStructure, PlanReply, Committed, SaveFailed))
        except MetadataError as e:
            raise SaveError(f"{job.what}: unexpected answer from the coordinator: {e}") from None
        if isinstance(answer, SaveFailed):  # (its error names the identities when they differed)
            verb = "planned nothing" if op.endswith("plan") else "failed and was not committed"
            raise SaveError(f"{job.what} {verb}: {answer.error}")
        if answer.save != job.save:
            raise SaveError(f"{job.what}: this rank is at {job.save} but the coordinator answered for "
                            f"{answer.save}; the ranks' saves drifted apart")
        return answer

    # -- stage -------------------------------------------------------------------------------------

    @metrics.timed("stage", nbytes=lambda _, self, job, lazy: sum(b.nbytes for b in job.staged.values()) -
                   (job.lazy.nbytes if job.lazy is not None else 0))
    def _stage(self, job: SaveJob, lazy: bool) -> None:
        """Copy what this rank may write into reused host buffers: the only part of an async save that
        stalls. With `lazy`, parameters and optimizer state are copied after the call instead, until
        the next optimizer step (staging.LazyCopy); the rest is copied now.

        With a cached plan only the boxes it assigns to this rank are staged (if the ranks then
        agree on another plan, it gives this rank no others: `job.writable`). Without one, every box
        this rank holds is copied (a copy of the local shard: the floor of any snapshot) and the
        plan picks from them later.
        """
        plan = job.plan
        if job.cached is not None:
            boxes = [tuple(tb) for tb in job.cached.assignment.boxes]
            job.writable = set(boxes)
        else:
            boxes = [(ti, bi) for ti, (_, lt) in enumerate(plan.tensors) for bi in range(len(lt.boxes))]
        sources = box_sources(plan, boxes)
        key = pool_key(plan, boxes)
        if self._warming is not None:  # prepare_save's buffers are still being touched: take them when ready
            self._warming.result()
            self._warming = None
        got = self._pool.acquire(key, sources)
        while got is None:  # both slots in flight: wait for the oldest save
            self._wait_oldest(job, "release its staging buffers")
            got = self._pool.acquire(key, sources)
        slot, buffers = got
        job.slot = (key, slot)
        later = [(buf, src) for (ti, _), buf, src in zip(boxes, buffers, sources) if lazy and plan.stepped[ti]]
        now = [(buf, src) for (ti, _), buf, src in zip(boxes, buffers, sources) if not (lazy and plan.stepped[ti])]
        cuda = False
        with torch.no_grad():
            for buf, src in now:
                cuda |= src.device.type == "cuda"
                buf.copy_(src.detach(), non_blocking=src.device.type == "cuda")
        if cuda:
            torch.cuda.current_stream().synchronize()
        job.staged = dict(zip(boxes, buffers))
        job.staged_per_rank = [(fqn, t.to("cpu", copy=True)) for fqn, t in plan.per_rank_tensors]
        if later:
            # local files are written fast enough to take live sources during forward and backward;
            # a remote upload could hold the next optimizer step back for as long as a part takes
            job.lazy = LazyCopy(later, name=f"bcp-snapshot-{self.role}", live=not job.ckpt.remote,
                                timeout=job.timeout.total_seconds())

    def _wait_oldest(self, job: SaveJob, why: str) -> None:
        """Wait (at most the save's timeout) for the oldest queued save of this role still running."""
        running = [(h, j) for h, j in self._pending if not h.done()]
        if not running:
            return
        handle, oldest = running[0]
        try:
            handle._future.exception(job.timeout.total_seconds())
        except FutureTimeout:
            raise CommTimeoutError(f"bcp staging: rank {this_rank()} waited {job.timeout} for {oldest.save} to "
                                   f"{why}; it is still {oldest.step_phase}") from None

    def _pool_is_cold(self, job: SaveJob) -> bool:
        """No warm staging buffers for this plan yet: a copy would fault in fresh memory."""
        return job.cached is None or not self._pool.warm(pool_key(job.plan, job.cached.assignment.boxes))

    @metrics.timed("snapshot")
    def _fork(self, job: SaveJob) -> None:
        """Snapshot by forking: the child process keeps the state as of now (copy-on-write) and
        writes this rank's pieces from it, so the stall is the fork, not a copy into fresh memory.

        Used for a save that would otherwise copy into cold buffers (the first of a structure);
        meanwhile the background thread warms the staging buffers, so later saves copy into
        touched memory. Needs CPU tensors and a POSIX or memory:// checkpoint path: the child
        uses no accelerator and no network client.
        """
        while sum(1 for _, j in self._pending if j.snapshot is not None and not j.snapshot.closed) >= 2:
            self._wait_oldest(job, "end its snapshot process")  # at most two snapshots held, as with staging

        def write_in_child(orders: dict) -> dict:
            rank = orders["rank"]
            rec = metrics.Recorder("save", rank)
            assignment = codec.from_wire(orders["assignment"], Assignment)
            # from the child's copy of the state, as of the fork; not in place: its pages are shared
            # with the parent, and pinning them for the device would make the kernel copy each one
            # (5-8x the child's CPU of a copy through the writer's buffers, measured)
            report = rec.run(lambda: _write(job, assignment, None, None, rank, orders["prefix"]))
            return {"report": codec.to_wire(report), "metrics": rec.records()}

        job.snapshot = ForkSnapshot.start(write_in_child, timeout=job.timeout.total_seconds())

    # -- agree, write and commit (on the role's save thread for async saves) ----------------------------

    def _start(self, fn, *args, **kwargs) -> Future:
        """Run fn in a background thread of its own, after the previous save of this role finished.

        A thread per save rather than a long-lived worker: no bcp thread stays idle into the
        interpreter's shutdown (see storage's note on I/O threads); a save still running at exit
        is committed by the exit hook (`_flush_at_exit`).
        """
        previous = self._pending[-1][0]._future if self._pending else None
        future: Future = Future()

        def run() -> None:
            if previous is not None:
                previous.exception()  # saves of a role run one after another, in order
            future.set_running_or_notify_cancel()
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - handed to wait() and the next save
                future.set_exception(e)

        threading.Thread(target=run, name=f"bcp-save-{self.role}").start()
        return future

    def _run(self, comm: Comm, job: SaveJob) -> str:
        """Agree on the plan, write this rank's pieces, commit; a save that failed is marked so."""
        try:
            return self._plan_write_commit(comm, job)
        except SaveError as e:  # raised by a round: this save failed on every rank
            if comm.is_coordinator and job.step_phase != "committed" and job.ckpt is not None:
                _mark_failed(job, e)
            raise

    def _plan_write_commit(self, comm: Comm, job: SaveJob) -> str:
        """Every rank reaches the commit exchange once the plan is agreed, whatever fails on it in
        between."""
        op = f"s{job.save.number}"
        try:
            job.step_phase = "planning"
            # decided here, not in the call: every earlier save of the role has ended on every rank
            # by now, so every rank sees the same roots checked
            job.probe = job.root is not None and len(set(comm.nodes)) > 1 and job.root.root not in self._probed
            if job.probe and job.error is None and comm.rank in comm.node_leaders:
                try:  # before the plan exchange, which tells every leader that every probe is written
                    job.ckpt.write_atomic(PROBE_FILE.format(comm.nodes[comm.rank]), str(job.save).encode())
                except Exception as e:  # noqa: BLE001 - reported with the request
                    job.error = _rank_error(comm.rank, e)
            job.agreed = self._agree(comm, job, op)
            if job.lazy is not None and job.staged is not None and job.cached is None:
                # a first save staged every box this rank holds; the others' copies are not needed
                mine = {tuple(tb) for tb in job.agreed.assignment.boxes}
                job.lazy.skip([buf for box, buf in job.staged.items() if box not in mine])
        except BaseException:
            self._release(job)
            raise
        job.step_phase = "writing"
        try:
            report = self._write_pieces(comm, job)
        except Exception as e:  # noqa: BLE001 - reported to the coordinator, so every rank fails alike
            report = WriteReport.failed(job.save, _rank_error(comm.rank, e))
        try:
            self._release(job)
        except Exception as e:  # noqa: BLE001 - as above
            if report.error is None:
                report = WriteReport.failed(job.save, _rank_error(comm.rank, e))
        job.step_phase = "committing"
        return self._commit(comm, job, report, op)

    def _write_pieces(self, comm: Comm, job: SaveJob) -> WriteReport:
        """Write this rank's assignment: from the forked snapshot, the staged copies or the live state."""
        rank = comm.rank
        if job.probe and rank in comm.node_leaders:
            _check_probes(job, comm)
        prefix = f"{self._token}-{job.save.number}-"  # the coordinator's token arrived with the first plan
        assignment = job.agreed.assignment
        if job.snapshot is None:
            staged = None if job.staged is None else [job.staged[tuple(tb)] for tb in assignment.boxes]
            # staged: an async save, beside training, so written in place (a synchronous one, which
            # the caller waits for, is faster through the writer's buffers)
            report = _write(job, assignment, staged, job.staged_per_rank, rank, prefix,
                            hold=job.lazy.hold if job.lazy is not None else None, in_place=staged is not None)
            if job.lazy is not None:
                job.lazy.retire()
                rec = metrics.current()
                if rec is not None and job.lazy.copied_bytes:  # copies beside training: not the stall
                    rec.add("snapshot", job.lazy.started, job.lazy.ended, job.lazy.copied_bytes)
            return report
        job.snapshot.send({"assignment": codec.to_wire(assignment), "prefix": prefix, "rank": rank})
        try:  # touch the staging buffers of the next save now, off the training thread
            self._pool.warm_up(pool_key(job.plan, assignment.boxes), box_sources(job.plan, assignment.boxes))
        except Exception as e:  # noqa: BLE001 - the next save allocates them itself then
            log.warning("bcp: warming the staging buffers of role %r failed: %s", self.role, e)
        return self._snapshot_report(job)

    def _snapshot_report(self, job: SaveJob) -> WriteReport:
        """The forked child's report; its phases join this save's metrics."""
        msg = job.snapshot.result()
        rec = metrics.current()
        for r in msg["metrics"] if rec is not None else []:
            for i, (t0, t1) in enumerate(r.get("intervals") or [[r["start"], r["end"]]]):
                rec.add(r["phase"], t0, t1, r["bytes"] if i == 0 else 0)
        return codec.from_wire(msg["report"], WriteReport)

    def _release(self, job: SaveJob) -> None:
        if job.lazy is not None:
            job.lazy.finish()  # the copy thread must be done with the slot before another save takes it
        if job.snapshot is not None:
            job.snapshot.close()
        if job.slot is not None:
            self._pool.release(*job.slot)
            job.slot = None

    def _commit(self, comm: Comm, job: SaveJob, report: WriteReport, op: str) -> str:
        """Gather every rank's report; the coordinator writes the metadata, then the tracker."""
        # this rank's phases so far travel with its report; intervals only while the job is small
        report = replace(report, metrics=tuple(metrics.records(intervals=comm.world_size <= 256)))
        commit = metrics.start("commit")

        def decide(job: SaveJob, reports: list[WriteReport], world: int) -> Committed:
            _check_ids(reports, job.save)
            md = build_metadata(job.agreed.gplan, job.agreed.rank_keys, reports, job.framework, job.user_metadata)
            ckpt, root = job.ckpt, job.root
            if job.probe:
                for node in sorted(set(comm.nodes)):
                    ckpt.remove(PROBE_FILE.format(node))
            _remove_stale_files(ckpt, md, self._token)
            # the data files' directory entries, then the step directory's, are durable before the commit
            ckpt.sync_dir("data")
            ckpt.sync_dir()
            if job.tracker_name:
                root.sync_dir()
            else:
                ckpt.sync_entry()
            ckpt.write_atomic(METADATA_FILE, gc_paused(md.dumps)())
            if job.tracker_name:
                try:
                    write_tracker(root, job.tracker_name)
                except BaseException:
                    _invalidate(ckpt)  # failed on every rank: must not be found complete either
                    raise
            commit.stop()
            metrics.save_beside(ckpt, [metrics.records()] + [list(r.metrics) for r in reports[1:]])
            return Committed(job.save)

        self._round(comm, job, f"{op}/commit", report, decide)
        commit.stop()
        job.step_phase = "committed"
        if job.probe:
            self._probed.add(job.root.root)
        if comm.is_coordinator and job.tracker_name:
            _tidy_root(job)
        if job.on_commit is not None:
            try:
                job.on_commit(job.ckpt.root)
            except Exception as e:
                log.exception("bcp: rank %d: on_commit raised after %s was committed", comm.rank, job.ckpt.root)
                raise CommitCallbackError(f"{job.ckpt.root} was committed, but on_commit raised on rank "
                                          f"{comm.rank}: {type(e).__name__}: {e}") from e
        return job.ckpt.root

    def _earlier_failures(self) -> list[tuple[SaveHandle, BaseException]]:
        """Failed asynchronous saves of this role that no `wait()` or later save has raised yet
        (the saves at the head of the queue that are done are dropped from it)."""
        failed = []
        while self._pending and self._pending[0][0].done():
            handle, _ = self._pending.popleft()
            exc = handle._future.exception()
            if exc is not None and not handle._error_seen and not isinstance(exc, CommitCallbackError):
                handle._error_seen = True
                failed.append((handle, exc))
        return failed


# ----------------------------------------------------------------------------- helpers

def _plan_tensors(plan: LocalSavePlan) -> list[torch.Tensor]:
    return [lt.boxes[0].view for _, lt in plan.tensors if lt.boxes] + [t for _, t in plan.per_rank_tensors]


@metrics.timed("serialise", nbytes=lambda items, *_: sum(it.tensor.nbytes for it in items))
def _write_items(plan: LocalSavePlan, assignment: Assignment, staged: list[torch.Tensor] | None,
                 per_rank: list[tuple[str, torch.Tensor]] | None) -> list[WriteItem]:
    """The pieces this rank writes: its assigned boxes (from `staged` copies if any), object shards,
    per-rank tensors."""
    items = []
    for n, (ti, bi) in enumerate(assignment.boxes):
        fqn, lt = plan.tensors[ti]
        box = lt.boxes[bi]
        # unstaged device tensors (a synchronous save) go to the writers as they are: they move
        # through pinned chunks there (host_memory.Bounce)
        data = staged[n] if staged is not None else on_host_or_cuda(box.view)
        items.append(WriteItem(f"{fqn}@{','.join(map(str, box.offsets))}", data,
                               TensorBoxKey(fqn, tuple(box.offsets), tuple(box.lengths))))
    for i in assignment.shards:
        shard = plan.structure.sharded_objects[i]
        raw = plan.shard_values[i]
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        items.append(WriteItem(f"{shard.fqn}@{','.join(map(str, shard.index))}", data,
                               ObjectShardKey(shard.fqn, shard.index)))
    # Each rank writes its own per-rank tensors (RNG states: small); identical ones share one
    # piece in the metadata.
    for fqn, t in per_rank if per_rank is not None else plan.per_rank_tensors:
        items.append(WriteItem(f"{fqn}#r", contiguous_cpu(t), RankValueKey(fqn)))
    ordered_after_callers(it.tensor for it in items)
    return items


def _write(job: SaveJob, assignment: Assignment, staged, staged_per_rank, rank: int, prefix: str,
           hold=None, in_place: bool = False) -> WriteReport:
    """Write this rank's pieces; the report the coordinator commits from (an error is reported too).
    `in_place`: for a save beside training (engine.write_items)."""
    plan = job.plan
    try:
        items = _write_items(plan, assignment, staged, staged_per_rank)
        written = write_items(job.ckpt, rank, items, job.num_threads, CHECKSUM_BLOCK_BYTES, prefix=prefix,
                              hold=hold, in_place=in_place)
        per_rank = dict(plan.per_rank)
        for it in items:
            if isinstance(it.key, RankValueKey):
                per_rank[it.key.fqn] = [dtype_name(it.tensor.dtype), list(it.tensor.shape), _tensor_digest(it.tensor)]
        return WriteReport(job.save, plan.key, plan.objects, per_rank, plan.shard_digests, plan.object_digests,
                           tuple(written))
    except Exception as e:  # noqa: BLE001 - reported to the coordinator
        return WriteReport.failed(job.save, _rank_error(rank, e))


@gc_paused  # one record per rank, each holding large lists: see utils.gc_paused
def _expect(raw: list, cls: type, save: SaveId) -> list:
    """The coordinator's view of a gather: every rank's record, all of type `cls`, or SaveError."""
    records = []
    for r, m in enumerate(raw):
        try:
            records.append(codec.from_wire(m, cls))
        except MetadataError as e:
            raise SaveError(f"rank {r} sent an unexpected message for {save}: {e}") from None
    return records


def _check_ids(records: list, save: SaveId) -> None:
    """Every rank's message belongs to this save (the same number, step and path)."""
    other = [(r, rec.save) for r, rec in enumerate(records) if rec.save != save]
    if other:
        r, theirs = other[0]
        raise SaveError(f"rank {r} is at {theirs} while rank 0 is at {save} ({len(other)} rank(s) differ): "
                        "every rank must save the same step to the same path")


def _check_probes(job: SaveJob, comm: Comm) -> None:
    """A node leader of a multi-node job, at its first save to a root: every other node's probe file
    must be visible here, else the nodes do not share this storage."""
    for node, leader in zip(sorted(set(comm.nodes)), comm.node_leaders):
        name = PROBE_FILE.format(node)
        if not job.ckpt.exists(name):
            raise SaveError(
                f"{job.ckpt.root} is not shared by every node of the job: rank {comm.rank} (node "
                f"{comm.nodes[comm.rank]}) does not see {name}, which rank {leader} (node {node}) wrote there. "
                "A multi-node job needs storage every node reaches (a shared file system or an object "
                "store); memory:// and node-local disks are per node")


def _tidy_root(job: SaveJob) -> None:
    """Coordinator, after a commit to a step of a root: leftovers of failed saves go, then, with
    `keep`, the oldest checkpoints beyond it. Failures are logged: the checkpoint is committed."""
    from . import layout
    try:
        for name, error in layout.remove_leftovers(job.root, job.tracker_name).failed:
            log.warning("bcp: could not remove %s, left by a failed save under %s: %s", name, job.root.root, error)
        if job.keep is not None:
            for name, error in layout.prune(job.root, job.keep).failed:
                log.warning("bcp: keep=%d: could not remove %s under %s: %s", job.keep, name, job.root.root, error)
    except Exception as e:  # noqa: BLE001 - see above
        log.warning("bcp: tidying %s after committing %s failed: %s", job.root.root, job.tracker_name, e)


def _rank_error(rank: int, e: BaseException) -> str:
    return f"rank {rank}: {type(e).__name__}: {e}"


def _previous_error(earlier: list, job: SaveJob, handle: SaveHandle | None) -> PreviousSaveError:
    first, exc = earlier[0]
    more = f" ({len(earlier) - 1} more failed before this one)" if len(earlier) > 1 else ""
    goes_on = f"; this {job.what} was started and goes on (its handle is error.handle)" if handle is not None \
        and not handle.done() else ""
    error = PreviousSaveError(f"an earlier asynchronous save to {first.path} failed and was not committed: "
                              f"{exc}{more}{goes_on}", handle)
    error.__cause__ = exc
    return error


def _message(e: Exception) -> str:
    return str(e) if isinstance(e, BCPError) else f"{type(e).__name__}: {e}"


def _tensor_digest(t: torch.Tensor) -> str:
    return digest(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def _invalidate(ckpt: Storage) -> None:
    """An older checkpoint at this path must never pass for this one: drop its metadata first (and
    an earlier failed save's mark: this save is in progress)."""
    for name in (METADATA_FILE, FAILED_FILE):
        if ckpt.exists(name):
            ckpt.remove(name)


def _mark_failed(job: SaveJob, error: SaveError) -> None:
    """Coordinator, once a save failed on every rank: FAILED_FILE in its directory says so, with the
    error, so that `bcp ls`, a load and the next save's clean-up know it for a failed save rather than
    one in progress. Failures are logged: the save's own error is what the caller needs."""
    text = json.dumps({"save": str(job.save), "error": str(error)}, indent=1)
    try:
        if not job.ckpt.exists(METADATA_FILE):
            job.ckpt.write_atomic(FAILED_FILE, text.encode())
    except Exception as e:  # noqa: BLE001 - see above
        log.warning("bcp: could not mark the failed %s as failed: %s", job.what, e)


def _remove_stale_files(ckpt: Storage, md, token: str) -> None:
    """This job's data files from an earlier save to the same path. Other jobs' files are left alone:
    one may be writing here right now (`bcp prune` cleans up after crashed jobs)."""
    keep = {f.split("/", 1)[1] for f in md.files}
    for name in ckpt.listdir("data"):
        if name.startswith(f"{token}-") and name not in keep:
            ckpt.remove(f"data/{name}")


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


def finish_pending_saves() -> list[tuple[str, BaseException]]:
    """Block until every queued asynchronous save of every role is committed or has failed.

    Returns the failures the caller has not seen yet (path, error); a failure already raised by
    `wait()` or a later `save` is not repeated, nor an `on_commit` error (that save committed).
    Each save is waited for at most three times its timeout (its plan, write and commit
    exchanges each end within it); one still running then is reported as a CommTimeoutError.
    """
    failed: list[tuple[str, BaseException]] = []
    for cp in list(_CHECKPOINTERS.values()):
        for handle, job in list(cp._pending):
            if not handle.done():
                log.info("bcp: waiting for the asynchronous save to %s to commit", handle.path)
            waited = 3 * job.timeout
            try:
                exc = handle._future.exception(waited.total_seconds())
            except FutureTimeout:
                exc = CommTimeoutError(f"bcp exit: rank {this_rank()} waited {waited} for {job.save} to commit; "
                                       f"it is still {job.step_phase}")
            if exc is not None and not handle._error_seen and not isinstance(exc, CommitCallbackError):
                handle._error_seen = True
                failed.append((handle.path, exc))
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


EXIT_SAVE_FAILED = 1


def _forget_in_child() -> None:
    """In a process forked from this one (a DataLoader worker, a multiprocessing.Process, bcp's own
    fork snapshot): the saves in flight are the parent's, and the threads that run them do not
    exist here. The child neither waits for them at its exit nor sees them queued."""
    global _LOCK
    _LOCK = threading.Lock()  # another thread of the parent may have held it at the fork
    for cp in _CHECKPOINTERS.values():
        cp._pending = deque()
        cp._pool = StagingPool()  # pinned staging buffers are not mapped in a child (host_memory)
        cp._warming = None
        cp._plans_lock = threading.Lock()
    hooks = getattr(threading, "_threading_atexits", None)
    if hooks is not None:
        hooks[:] = [h for h in hooks if h is not _flush_at_exit]
    atexit.unregister(_flush_at_exit)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _register_exit_flush() -> None:
    """Make `_flush_at_exit` the newest threading exit hook (it then runs first)."""
    hooks = getattr(threading, "_threading_atexits", None)
    if hooks and hooks[-1] is _flush_at_exit:
        return
    try:
        threading._register_atexit(_flush_at_exit)
    except (AttributeError, RuntimeError):  # no such hook, or the interpreter is already shutting down
        atexit.register(_flush_at_exit)


