"""The save driver: plan (cached) -> stage -> write -> commit, synchronous or in the background.

    plan = local_save_plan(flatten(state))          # every save: what this rank holds
    cached = plan cache [plan.key] or _plan(...)    # PlanRequest -> coordinator -> PlanReply
    stage(plan, assignment)                         # async saves: copy into staging (the stall)
    ---- the caller returns here for async saves; the rest runs on the role's save thread ----
    report = write(plan, assignment)                # engine: data files, checksums, fsync
    commit: gather WriteReports -> build_metadata -> metadata file, tracker -> CommitStatus

One `Checkpointer` per role (e.g. actor / critic / reference in RL post-training) owns its plan
cache, staging pool, save queue and store-based comms, so several can live in one process.

Ordering rule that keeps ranks in lock-step without extra barriers: every collective of a role
runs either on the caller's thread while nothing is in flight (planning), or on the role's
background save threads, which run one at a time in submission order (commits). A cache hit
needs no planning collective, so an asynchronous save of an unchanged structure only copies into
a staging buffer and queues its commit; a cache miss first drains the queue.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import sys
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from . import codec, metrics
from .adapters import resolve_framework
from .comm import DEFAULT_TIMEOUT, Comm
from .engine import WriteItem, write_items
from .errors import BCPError, CommTimeoutError, MetadataError, SaveError
from .flatten import save_leaves
from .layout import BCP_STEPS, write_tracker
from .metadata import CHECKSUM_BLOCK_BYTES, METADATA_FILE, dtype_name
from .save_planner import (Assignment, CommitStatus, GlobalSavePlan, LocalSavePlan, ObjectShardKey, PlanReply,
                           PlanRequest, RankValueKey, TensorBoxKey, WriteReport, build_metadata, failed_report,
                           global_save_plan, local_save_plan, plan_replies)
from .snapshot import ForkSnapshot, can_fork
from .staging import LazyCopy, StagingPool, box_sources, contiguous_cpu, pool_key
from .storage import Storage, storage_for
from .utils import cores_per_rank, digest, gc_paused, this_rank

log = logging.getLogger("bcp")

PLAN_CACHE_SIZE = 4
# How an async save captures the state: "lazy" copies parameters and optimizer state after the call
# returns, until the next optimizer step (staging.py); "copy" copies everything before returning;
# "fork" snapshots a first save by forking (snapshot.py).
SNAPSHOTS = ("lazy", "copy", "fork")


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
        """Block until committed; re-raise the save's error if it failed. Returns the checkpoint path."""
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
    assignment: Assignment                # this rank's
    gplan: GlobalSavePlan | None = None   # coordinator only
    rank_keys: list[str] = field(default_factory=list)  # coordinator only: each rank's structure key


@dataclass
class SaveJob:
    """Everything a save's write + commit needs, detached from the live state."""

    ckpt: Storage
    root: Storage
    tracker_name: str
    plan: LocalSavePlan | None
    cached: CachedPlan | None
    framework: str
    user_metadata: dict
    num_threads: int
    on_commit: Callable[[str], None] | None
    number: int = 0                              # this checkpointer's save count (same on every rank)
    error: str | None = None                     # this rank's local planning error, sent to the coordinator
    recorder: metrics.Recorder | None = None     # this rank's phase timings
    slot: tuple | None = None                    # staging pool slot held until written
    snapshot: ForkSnapshot | None = None         # snapshot='fork': the process holding the state
    staged: dict | None = None                   # (ti, bi) -> staged copy (async saves)
    staged_per_rank: list | None = None
    lazy: LazyCopy | None = None                 # the staged copies still being made (lazy snapshot)


class Checkpointer:
    """Saves for one role. Use `bcp_core.save(..., role=...)`, which keeps one per role."""

    def __init__(self, role: str = "default"):
        self.role = role
        self._plans: OrderedDict[str, CachedPlan] = OrderedDict()
        self._pool = StagingPool()
        self._pending: deque[tuple[SaveHandle, SaveJob]] = deque()
        self._comms: dict = {}
        self.stats = {"plans": 0, "cache_hits": 0}
        # Data files are named <token>-<save number>-r<rank>_<k>: unique per job and save, so two
        # jobs writing one directory never overwrite each other's bytes. The coordinator's token
        # reaches the other ranks with the first plan.
        self._token = secrets.token_hex(4)
        self._saves = 0
        self._warming: Future | None = None  # prepare_save's buffer warm-up

    # -- public ------------------------------------------------------------------------------------

    def save(self, path, state: dict, framework: str = "auto", async_save: bool = False, *,
             step: int | None = None, process_group=None, allow_pickle: bool = False, fsync: bool = True,
             num_threads: int | None = None, user_metadata: dict | None = None,
             on_commit: Callable[[str], None] | None = None, snapshot: str = "lazy",
             timeout: timedelta = DEFAULT_TIMEOUT) -> SaveHandle:
        if snapshot not in SNAPSHOTS:
            raise ValueError(f"snapshot must be one of {', '.join(map(repr, SNAPSHOTS))}, got {snapshot!r}")
        self._raise_background_errors()
        root = storage_for(path, fsync=fsync)
        name = BCP_STEPS.name(step) if step is not None else ""
        ckpt = root.child(name) if name else root
        adapter = resolve_framework(state, framework)
        comm = self._comm(process_group, timeout)
        ckpt.makedirs()  # exists when save returns, even if async (callers write files beside it)
        rec = metrics.Recorder("save", comm.rank, ckpt.root)
        with rec.phase("plan"):
            plan, error = self._local_plan(state, adapter, comm.rank, allow_pickle)
        cached = self._plans.get(plan.key) if plan is not None else None
        if cached is not None:
            self._plans.move_to_end(plan.key)
            self.stats["cache_hits"] += 1
            if comm.is_coordinator:
                _invalidate(ckpt)
        self._saves += 1
        num_threads = num_threads or min(4, cores_per_rank())
        job = SaveJob(ckpt, root, name, plan, cached, adapter.name, user_metadata or {}, num_threads, on_commit,
                      number=self._saves, error=error, recorder=rec)
        if not async_save:
            self.wait_all()  # its collectives must not interleave with queued background commits
            future: Future = Future()
            try:
                future.set_result(rec.run(self._run, comm, job, finish=True))
            except BaseException as e:
                future.set_exception(e)
                raise
            return SaveHandle(ckpt.root, future, rec)
        if plan is not None:
            if snapshot == "fork" and self._pool_is_cold(job) and can_fork(job.ckpt, _plan_tensors(plan)):
                rec.run(self._fork, job)
            else:
                rec.run(self._stage, job, lazy=snapshot == "lazy")
        handle = SaveHandle(ckpt.root, self._start(rec.run, self._run, comm, job, finish=True), rec)
        self._pending.append((handle, job))
        _register_exit_flush()  # at every async save: a pool library imported since must not run first
        return handle

    def prepare(self, state: dict, framework: str = "auto", async_save: bool = True, *, process_group=None,
                allow_pickle: bool = False, timeout: timedelta = DEFAULT_TIMEOUT) -> Future:
        """Plan the saves of `state`'s structure now and, for async saves, touch the staging
        buffers in a background thread (see `bcp_core.prepare_save`). Collective."""
        self._raise_background_errors()
        adapter = resolve_framework(state, framework)
        comm = self._comm(process_group, timeout)
        plan, error = self._local_plan(state, adapter, comm.rank, allow_pickle)
        self.wait_all()  # its collectives must not interleave with queued background commits
        cached = self._plan(comm, None, plan, error)  # every rank plans: a cache hit on some only would hang
        ready: Future = Future()
        boxes = cached.assignment.boxes
        key = pool_key(plan, boxes)
        if not async_save or self._pool.warm(key):
            ready.set_result(None)
            return ready
        self._warming = ready

        def warm() -> None:
            try:
                self._pool.warm_up(key, box_sources(plan, boxes))
            except Exception as e:  # noqa: BLE001 - the first save allocates its buffers itself then
                log.warning("bcp: preparing the staging buffers of role %r failed: %s", self.role, e)
            ready.set_result(None)

        threading.Thread(target=warm, name=f"bcp-prepare-{self.role}").start()
        return ready

    def wait_all(self) -> None:
        """Wait for every queued save; errors are left on the handles (and raised by the next save)."""
        for handle, _ in list(self._pending):
            handle._future.exception()  # blocks; the error stays for wait() / the next save

    # -- plan --------------------------------------------------------------------------------------

    @staticmethod
    def _local_plan(state, adapter, rank: int, allow_pickle: bool) -> tuple[LocalSavePlan | None, str | None]:
        """This rank's plan, or its error: sent to the coordinator so that every rank raises."""
        try:
            return local_save_plan(save_leaves(state, adapter), rank, allow_pickle), None
        except Exception as e:  # noqa: BLE001 - reported through the plan exchange
            return None, f"rank {rank}: {type(e).__name__}: {e}"

    def _comm(self, process_group, timeout) -> Comm:
        key = (id(process_group), timeout)
        if key not in self._comms:
            self._comms[key] = Comm(process_group, timeout, tag=self.role)
        return self._comms[key]

    def _plan(self, comm: Comm, ckpt: Storage | None, plan: LocalSavePlan | None, error: str | None) -> CachedPlan:
        """Plan collectively and cache the plan. `ckpt` is None when preparing (no checkpoint yet)."""
        what = f"save to {ckpt.root}" if ckpt is not None else f"prepare_save (role {self.role!r})"
        request = PlanRequest(None, None, error) if plan is None else PlanRequest(plan.key, plan.structure)
        try:
            raw = comm.gather(codec.to_wire(request), "plan")
        except CommTimeoutError as e:  # tell the ranks that did arrive, then fail everywhere alike
            comm.broadcast(codec.to_wire(PlanReply(None, None, str(e))), "plan")
            raise SaveError(f"{what} planned nothing: {e}") from None
        gplan, requests, replies = None, [], None
        if comm.is_coordinator:
            try:
                requests = _expect(raw, PlanRequest, "reused a cached plan while others re-planned: the state's "
                                   "structure changed on some ranks only")
                errors = [r.error for r in requests if r.error]
                if errors:
                    raise SaveError("; ".join(errors))
                gplan = global_save_plan([r.structure for r in requests])
                if ckpt is not None:
                    _invalidate(ckpt)
                    ckpt.makedirs()
                replies = plan_replies(gplan, self._token)
            except Exception as e:  # noqa: BLE001 - sent to every rank so that every rank raises
                error_reply = codec.to_wire(PlanReply(None, None, _message(e)))
                replies = [error_reply] * comm.world_size
        # each rank receives only its own assignment; tree leaders pass on only their subtree's part
        reply = _received(comm.scatter(replies, "plan"), PlanReply,
                          f"{what}: this rank re-planned while others reused a cached plan (the state's structure "
                          "changed on some ranks only)")
        if reply.error is not None:
            raise SaveError(f"{what} planned nothing: {reply.error}")
        self.stats["plans"] += 1
        self._token = reply.token
        cached = CachedPlan(reply.assignment, gplan, [r.key for r in requests])
        self._plans[plan.key] = cached
        while len(self._plans) > PLAN_CACHE_SIZE:
            self._plans.popitem(last=False)
        return cached

    # -- stage -------------------------------------------------------------------------------------

    @metrics.timed("stage", nbytes=lambda _, self, job, lazy: sum(b.nbytes for b in job.staged.values()) -
                   (job.lazy.nbytes if job.lazy is not None else 0))
    def _stage(self, job: SaveJob, lazy: bool) -> None:
        """Copy what this rank may write into reused host buffers: the only part of an async save that
        stalls. With `lazy`, parameters and optimizer state are copied after the call instead, until
        the next optimizer step (staging.LazyCopy); the rest is copied now.

        With a cached plan the boxes are exactly those assigned to this rank. Without one, planning
        happens in the background, so every box this rank holds is copied (a copy of the local
        shard: the floor of any snapshot) and the plan picks from them later.
        """
        plan = job.plan
        if job.cached is not None:
            boxes = [tuple(tb) for tb in job.cached.assignment.boxes]
        else:
            boxes = [(ti, bi) for ti, (_, lt) in enumerate(plan.tensors) for bi in range(len(lt.boxes))]
        sources = box_sources(plan, boxes)
        key = pool_key(plan, boxes)
        if self._warming is not None:  # prepare_save's buffers are still being touched: take them when ready
            self._warming.result()
            self._warming = None
        got = self._pool.acquire(key, sources)
        while got is None:  # both slots in flight: wait for the oldest save
            self._pending[0][0]._future.exception()  # blocks until the oldest save is done
            self._raise_background_errors()
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
            job.lazy = LazyCopy(later, name=f"bcp-snapshot-{self.role}", live=not job.ckpt.remote)

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
            self._pending[0][0]._future.exception()  # at most two snapshots held, as with staging
            self._raise_background_errors()

        def write_in_child(orders: dict) -> dict:
            rank = orders["rank"]
            rec = metrics.Recorder("save", rank)
            assignment = codec.from_wire(orders["assignment"], Assignment)
            # from the child's copy of the state, as of the fork
            report = rec.run(lambda: _write(job, assignment, None, None, rank, orders["prefix"]))
            return {"report": codec.to_wire(report), "metrics": rec.records()}

        job.snapshot = ForkSnapshot.start(write_in_child)

    # -- write and commit (on the role's save thread for async saves) ------------------------------

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
        """Plan if no cached plan fits, write this rank's pieces, commit."""
        try:
            if job.cached is None:
                job.cached = self._plan(comm, job.ckpt, job.plan, job.error)  # fails on every rank alike
        except BaseException:
            self._release(job)
            raise
        try:
            report = self._write_pieces(comm.rank, job)
        except Exception as e:  # noqa: BLE001 - reported to the coordinator, so every rank fails alike
            report = failed_report(f"rank {comm.rank}: {type(e).__name__}: {e}")
        finally:
            self._release(job)
        return self._commit(comm, job, report)

    def _write_pieces(self, rank: int, job: SaveJob) -> WriteReport:
        """Write this rank's assignment: from the forked snapshot, the staged copies or the live state."""
        prefix = f"{self._token}-{job.number}-"  # the coordinator's token arrived with the first plan
        assignment = job.cached.assignment
        if job.snapshot is None:
            staged = None if job.staged is None else [job.staged[tuple(tb)] for tb in assignment.boxes]
            report = _write(job, assignment, staged, job.staged_per_rank, rank, prefix,
                            hold=job.lazy.hold if job.lazy is not None else None)
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

    def _commit(self, comm: Comm, job: SaveJob, report: WriteReport) -> str:
        """Gather every rank's report; the coordinator writes the metadata, then the tracker."""
        # this rank's phases so far travel with its report; intervals only while the job is small
        report = _with_metrics(report, metrics.records(intervals=comm.world_size <= 256))
        commit = metrics.start("commit")
        try:
            raw = comm.gather(codec.to_wire(report), "commit")
        except CommTimeoutError as e:
            comm.broadcast(codec.to_wire(CommitStatus(str(e))), "commit")
            raise SaveError(f"save to {job.ckpt.root} failed and was not committed: {e}") from None
        status = CommitStatus()
        if comm.is_coordinator:
            try:
                reports = _expect(raw, WriteReport, "re-planned while others reused a cached plan: the state's "
                                  "structure changed on some ranks only")
                md = build_metadata(job.cached.gplan, job.cached.rank_keys, reports, job.framework,
                                    job.user_metadata)
                _remove_stale_files(job.ckpt, md, self._token)
                job.ckpt.write_atomic(METADATA_FILE, gc_paused(md.dumps)())
                if job.tracker_name:
                    write_tracker(job.root, job.tracker_name)
                commit.stop()
                metrics.save_beside(job.ckpt, [metrics.records()] + [list(r.metrics) for r in reports[1:]])
            except Exception as e:  # noqa: BLE001 - broadcast so that every rank raises
                status = CommitStatus(_message(e))
        status = _received(comm.broadcast(codec.to_wire(status), "commit"), CommitStatus,
                           f"save to {job.ckpt.root}: this rank reused a cached plan while others re-planned "
                           "(the state's structure changed on some ranks only)")
        commit.stop()
        if status.error is not None:
            raise SaveError(f"save to {job.ckpt.root} failed and was not committed: {status.error}")
        if job.on_commit is not None:
            job.on_commit(job.ckpt.root)
        return job.ckpt.root

    def _raise_background_errors(self) -> None:
        while self._pending and self._pending[0][0].done():
            handle, _ = self._pending.popleft()
            exc = handle._future.exception()
            if exc is not None and not handle._error_seen:
                raise SaveError(f"an earlier asynchronous save to {handle.path} failed: {exc}") from exc


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
        data = staged[n] if staged is not None else contiguous_cpu(box.view)
        items.append(WriteItem(f"{fqn}@{','.join(map(str, box.offsets))}", data,
                               TensorBoxKey(fqn, tuple(box.offsets), tuple(box.lengths))))
    for i in assignment.shards:
        fqn, _, index = plan.structure.sharded_objects[i]
        raw = plan.shard_values[i]
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        items.append(WriteItem(f"{fqn}@{','.join(map(str, index))}", data, ObjectShardKey(fqn, tuple(index))))
    # Each rank writes its own per-rank tensors (RNG states: small); identical ones share one
    # piece in the metadata.
    for fqn, t in per_rank if per_rank is not None else plan.per_rank_tensors:
        items.append(WriteItem(f"{fqn}#r", contiguous_cpu(t), RankValueKey(fqn)))
    return items


def _write(job: SaveJob, assignment: Assignment, staged, staged_per_rank, rank: int, prefix: str,
           hold=None) -> WriteReport:
    """Write this rank's pieces; the report the coordinator commits from (an error is reported too)."""
    plan = job.plan
    try:
        items = _write_items(plan, assignment, staged, staged_per_rank)
        written = write_items(job.ckpt, rank, items, job.num_threads, CHECKSUM_BLOCK_BYTES, prefix=prefix,
                              hold=hold)
        per_rank = dict(plan.per_rank)
        for it in items:
            if isinstance(it.key, RankValueKey):
                per_rank[it.key.fqn] = [dtype_name(it.tensor.dtype), list(it.tensor.shape), _tensor_digest(it.tensor)]
        return WriteReport(plan.key, plan.objects, per_rank, plan.shard_digests, plan.object_digests,
                           tuple(written))
    except Exception as e:  # noqa: BLE001 - reported to the coordinator
        return failed_report(f"rank {rank}: {type(e).__name__}: {e}")


def _with_metrics(report: WriteReport, records: list[dict]) -> WriteReport:
    from dataclasses import replace
    return replace(report, metrics=tuple(records))


@gc_paused  # one record per rank, each holding large lists: see utils.gc_paused
def _expect(raw: list, cls: type, mismatch: str) -> list:
    """The coordinator's view of a gather: every rank's record, all of type `cls`, or SaveError."""
    records = [codec.from_wire(m) for m in raw]
    other = [r for r, rec in enumerate(records) if not isinstance(rec, cls)]
    if other:
        raise SaveError(f"ranks {other} {mismatch}")
    return records


def _received(raw, cls: type, mismatch: str):
    """What this rank received from the coordinator, which must be a `cls` record."""
    try:
        return codec.from_wire(raw, cls)
    except MetadataError:
        raise SaveError(mismatch) from None


def _message(e: Exception) -> str:
    return str(e) if isinstance(e, BCPError) else f"{type(e).__name__}: {e}"


def _tensor_digest(t: torch.Tensor) -> str:
    return digest(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def _invalidate(ckpt: Storage) -> None:
    """An older checkpoint at this path must never pass for this one: drop its metadata first."""
    if ckpt.exists(METADATA_FILE):
        ckpt.remove(METADATA_FILE)


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
    `wait()` or a later `save` is not repeated.
    """
    failed = []
    for cp in list(_CHECKPOINTERS.values()):
        for handle, _ in list(cp._pending):
            if not handle.done():
                log.info("bcp: waiting for the asynchronous save to %s to commit", handle.path)
            exc = handle._future.exception()
            if exc is not None and not handle._error_seen:
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


def _register_exit_flush() -> None:
    """Make `_flush_at_exit` the newest threading exit hook (it then runs first)."""
    hooks = getattr(threading, "_threading_atexits", None)
    if hooks and hooks[-1] is _flush_at_exit:
        return
    try:
        threading._register_atexit(_flush_at_exit)
    except (AttributeError, RuntimeError):  # no such hook, or the interpreter is already shutting down
        atexit.register(_flush_at_exit)


