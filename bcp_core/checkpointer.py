"""The save pipeline: plan (cached) -> stage -> write -> commit, synchronous or in the background.

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
import json
import logging
import os
import secrets
import sys
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any
from datetime import timedelta

import torch

from . import metrics
from .comm import DEFAULT_TIMEOUT, Comm, CommTimeoutError
from .engine import WriteItem, write_items
from .errors import BCPError, SaveError
from .metadata import (CHECKSUM_BLOCK_BYTES, METADATA_FILE, TRACKER_FILE, CheckpointMetadata, ObjectPiece,
                       ObjectValue, PerRankMeta, Piece, ShardedObjectMeta, TensorMeta, dtype_from_name,
                       dtype_name)
from .planner import GlobalSavePlan, LocalSavePlan, digest, gc_paused, global_save_plan, local_save_plan
from .state import resolve_framework, save_leaves
from .storage import LocalStorage, Storage, storage_for

log = logging.getLogger("bcp")

STEP_DIR = "step_{:08d}"
PLAN_CACHE_SIZE = 4


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
    assignment: dict                      # this rank's {"write": [[ti, bi]], "shards": [i]}
    gplan: GlobalSavePlan | None = None   # coordinator only
    rank_keys: list[str] = field(default_factory=list)  # coordinator only: each rank's structure key


@dataclass
class _Job:
    """Everything a save's write + commit needs, detached from the live state."""

    ckpt: Storage
    root: Storage
    tracker_name: str
    plan: LocalSavePlan | None
    cached: CachedPlan | None
    items: list[WriteItem]
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


class StagingPool:
    """Host buffers reused across asynchronous saves: two slots (ping-pong) for the current plan.

    Save k+1 stages into one slot while save k still writes from the other. Buffers are pinned
    when the source lives on an accelerator, so device-to-host copies run asynchronously.
    """

    def __init__(self):
        self._key: tuple | None = None
        self._slots: list[list[torch.Tensor] | None] = [None, None]
        self._busy = [False, False]
        self._lock = threading.Lock()

    def acquire(self, key: tuple, sources: list[torch.Tensor]) -> tuple[int, list[torch.Tensor]] | None:
        with self._lock:
            if key != self._key:  # the layout changed: drop buffers of the old plan (none is busy then)
                self._key, self._slots, self._busy = key, [None, None], [False, False]
            for i in (0, 1):
                if not self._busy[i]:
                    if self._slots[i] is None:
                        self._slots[i] = [_host_buffer(s) for s in sources]
                    self._busy[i] = True
                    return i, self._slots[i]
            return None

    def release(self, key: tuple, slot: int) -> None:
        with self._lock:
            if key == self._key:
                self._busy[slot] = False

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for slot in self._slots if slot for b in slot)

    def warm(self, key: tuple) -> bool:
        with self._lock:
            return key == self._key and any(slot is not None for slot in self._slots)

    def warm_up(self, key: tuple, sources: list[torch.Tensor]) -> None:
        """Allocate and touch one slot's buffers for `key` before a save needs them."""
        buffers = [_host_buffer(s) for s in sources]
        with torch.no_grad():
            for b in buffers:
                b.zero_()  # fault the pages in here, not in the next save's copy
        with self._lock:
            if key != self._key:
                self._key, self._slots, self._busy = key, [None, None], [False, False]
            if self._slots[0] is None and not self._busy[0]:
                self._slots[0] = buffers


def _pool_key(plan: LocalSavePlan, boxes) -> tuple:
    """Staging buffers fit a structure and the boxes staged from it: a first save stages every box
    this rank holds, later ones only those assigned to it; without replicas they are the same."""
    return plan.key, tuple(tuple(tb) for tb in boxes)


def _sources(plan: LocalSavePlan, boxes) -> list[torch.Tensor]:
    return [plan.tensors[ti][1].boxes[bi].view for ti, bi in boxes]


def _host_buffer(src: torch.Tensor) -> torch.Tensor:
    pin = src.device.type == "cuda" and torch.cuda.is_available()
    return torch.empty(tuple(src.shape), dtype=src.dtype, pin_memory=pin)


class Checkpointer:
    """Saves for one role. Use `bcp_core.save(..., role=...)`, which keeps one per role."""

    def __init__(self, role: str = "default"):
        self.role = role
        self._plans: OrderedDict[str, CachedPlan] = OrderedDict()
        self._pool = StagingPool()
        self._pending: deque[tuple[SaveHandle, _Job]] = deque()
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
             num_threads: int = 4, user_metadata: dict | None = None,
             on_commit: Callable[[str], None] | None = None, snapshot: str = "copy",
             timeout: timedelta = DEFAULT_TIMEOUT) -> SaveHandle:
        if snapshot not in ("copy", "fork"):
            raise ValueError(f"snapshot must be 'copy' or 'fork', got {snapshot!r}")
        self._raise_background_errors()
        root = storage_for(path, fsync=fsync)
        name = STEP_DIR.format(step) if step is not None else ""
        ckpt = root.child(name) if name else root
        adapter = resolve_framework(state, framework)
        comm = self._comm(process_group, timeout)
        ckpt.makedirs()  # exists when save returns, even if async (callers write files beside it)
        rec = metrics.Recorder("save", comm.rank, ckpt.root)
        try:
            with rec.phase("plan"):
                plan = local_save_plan(save_leaves(state, adapter), comm.rank, allow_pickle)
            error = None
        except Exception as e:  # noqa: BLE001 - sent to the coordinator so every rank raises
            plan, error = None, f"rank {comm.rank}: {type(e).__name__}: {e}"
        cached = self._plans.get(plan.key) if plan is not None else None
        if cached is not None:
            self._plans.move_to_end(plan.key)
            self.stats["cache_hits"] += 1
            if comm.is_coordinator:
                _invalidate(ckpt)
        self._saves += 1
        job = _Job(ckpt, root, name, plan, cached, [], adapter.name if framework == "auto" else framework,
                   user_metadata or {}, num_threads, on_commit, number=self._saves, error=error,
                   recorder=rec)
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
            if snapshot == "fork" and self._pool_is_cold(job) and _can_fork(job):
                rec.run(self._fork, job)
            else:
                rec.run(self._stage, job)
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
        try:
            plan, error = local_save_plan(save_leaves(state, adapter), comm.rank, allow_pickle), None
        except Exception as e:  # noqa: BLE001 - sent to the coordinator so every rank raises
            plan, error = None, f"rank {comm.rank}: {type(e).__name__}: {e}"
        self.wait_all()  # its collectives must not interleave with queued background commits
        cached = self._plan(comm, None, plan, error)  # every rank plans: a cache hit on some only would hang
        ready: Future = Future()
        boxes = cached.assignment["write"]
        key = _pool_key(plan, boxes)
        if not async_save or self._pool.warm(key):
            ready.set_result(None)
            return ready
        self._warming = ready

        def warm() -> None:
            try:
                self._pool.warm_up(key, _sources(plan, boxes))
            except Exception as e:  # noqa: BLE001 - the first save allocates its buffers itself then
                log.warning("bcp: preparing the staging buffers of role %r failed: %s", self.role, e)
            ready.set_result(None)

        threading.Thread(target=warm, name=f"bcp-prepare-{self.role}").start()
        return ready

    def _start(self, fn, *args, **kwargs) -> Future:
        """Run fn in a background thread of its own, after the previous save of this role finished.

        A thread per save rather than a long-lived worker: no bcp thread stays idle into the
        interpreter's shutdown (see storage's note on I/O threads); a save still running at exit
        is a non-daemon thread, so Python waits for it.
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

    def wait_all(self) -> None:
        """Wait for every queued save; errors are left on the handles (and raised by the next save)."""
        for handle, _ in list(self._pending):
            handle._future.exception()  # blocks; the error stays for wait() / the next save

    # -- pipeline ----------------------------------------------------------------------------------

    def _comm(self, process_group, timeout) -> Comm:
        key = (id(process_group), timeout)
        if key not in self._comms:
            self._comms[key] = Comm(process_group, timeout, tag=self.role)
        return self._comms[key]

    def _plan(self, comm: Comm, ckpt: Storage | None, plan: LocalSavePlan | None, error: str | None) -> CachedPlan:
        """Plan collectively and cache the plan. `ckpt` is None when preparing (no checkpoint yet)."""
        what = f"save to {ckpt.root}" if ckpt is not None else f"prepare_save (role {self.role!r})"
        msg = {"kind": "plan", "error": error} if plan is None else \
            {"kind": "plan", "key": plan.key, "structure": plan.structure}
        try:
            msgs = comm.gather(msg, "plan")
        except CommTimeoutError as e:  # tell the ranks that did arrive, then fail everywhere alike
            comm.broadcast({"kind": "plan", "error": str(e)}, "plan")
            raise SaveError(f"{what} planned nothing: {e}") from None
        reply: dict = {}
        gplan = None
        if comm.is_coordinator:
            try:
                kinds = {m["kind"] for m in msgs}
                if kinds != {"plan"}:
                    late = [r for r, m in enumerate(msgs) if m["kind"] != "plan"]
                    raise SaveError(f"ranks {late} reused a cached plan while others re-planned: the state's "
                                    "structure changed on some ranks only")
                errors = [m["error"] for m in msgs if m.get("error")]
                if errors:
                    raise SaveError("; ".join(errors))
                gplan = global_save_plan([m["structure"] for m in msgs])
                if ckpt is not None:
                    _invalidate(ckpt)
                    ckpt.makedirs()
                reply = {"kind": "plan", "assignments": gplan.assignments, "token": self._token}
            except Exception as e:  # noqa: BLE001 - broadcast so that every rank raises
                reply = {"kind": "plan", "error": str(e) if isinstance(e, BCPError) else f"{type(e).__name__}: {e}"}
        # each rank receives only its own assignment; tree leaders pass on only their subtree's part
        reply = comm.scatter(_per_rank_replies(reply, comm.world_size) if comm.is_coordinator else None, "plan")
        if reply.get("kind") != "plan":
            raise SaveError(f"{what}: this rank re-planned while others reused a cached plan "
                            "(the state's structure changed on some ranks only)")
        if "error" in reply:
            raise SaveError(f"{what} planned nothing: {reply['error']}")
        self.stats["plans"] += 1
        self._token = reply["token"]
        cached = CachedPlan(reply["assignment"], gplan,
                            [m["key"] for m in msgs] if comm.is_coordinator else [])
        self._plans[plan.key] = cached
        while len(self._plans) > PLAN_CACHE_SIZE:
            self._plans.popitem(last=False)
        return cached

    @metrics.timed("stage", nbytes=lambda _, self, job: sum(b.nbytes for b in job.staged.values()))
    def _stage(self, job: _Job) -> None:
        """Copy what this rank may write into reused host buffers: the only part of an async save that stalls.

        With a cached plan that is exactly the boxes assigned to this rank. Without one, planning
        happens in the background, so every box this rank holds is copied (a copy of the local
        shard: the floor of any snapshot) and the plan picks from them later.
        """
        plan = job.plan
        if job.cached is not None:
            boxes = [tuple(tb) for tb in job.cached.assignment["write"]]
        else:
            boxes = [(ti, bi) for ti, (_, lt) in enumerate(plan.tensors) for bi in range(len(lt.boxes))]
        sources = _sources(plan, boxes)
        pool_key = _pool_key(plan, boxes)
        if self._warming is not None:  # prepare_save's buffers are still being touched: take them when ready
            self._warming.result()
            self._warming = None
        got = self._pool.acquire(pool_key, sources)
        while got is None:  # both slots in flight: wait for the oldest save
            self._pending[0][0]._future.exception()  # blocks until the oldest save is done
            self._raise_background_errors()
            got = self._pool.acquire(pool_key, sources)
        slot, buffers = got
        cuda = False
        with torch.no_grad():
            for buf, src in zip(buffers, sources):
                cuda |= src.device.type == "cuda"
                buf.copy_(src.detach(), non_blocking=src.device.type == "cuda")
        if cuda:
            torch.cuda.current_stream().synchronize()
        job.staged = dict(zip(boxes, buffers))
        job.staged_per_rank = [(fqn, t.to("cpu", copy=True)) for fqn, t in plan.per_rank_tensors]
        job.slot = (pool_key, slot)

    def _pool_is_cold(self, job: _Job) -> bool:
        """No warm staging buffers for this plan yet: a copy would fault in fresh memory."""
        return job.cached is None or not self._pool.warm(_pool_key(job.plan, job.cached.assignment["write"]))

    @metrics.timed("snapshot")
    def _fork(self, job: _Job) -> None:
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
        job.snapshot = ForkSnapshot.start(job)

    def _run(self, comm: Comm, job: _Job) -> str:
        """Plan if no cached plan fits, then write and commit."""
        try:
            if job.cached is None:
                job.cached = self._plan(comm, job.ckpt, job.plan, job.error)
            assignment = job.cached.assignment
            if job.snapshot is not None:  # the forked process builds the items from its copy of the state
                job.snapshot.send(assignment, f"{self._token}-{job.number}-", comm.rank)
                # touch the staging buffers of the next save now, off the training thread
                self._pool.warm_up(_pool_key(job.plan, assignment["write"]), _sources(job.plan, assignment["write"]))
            elif job.staged is None:  # synchronous save: write straight from the live tensors
                job.items = _items(job.plan, assignment, None)
            else:
                job.items = _items(job.plan, assignment, [job.staged[tuple(tb)] for tb in assignment["write"]],
                                   job.staged_per_rank)
        except BaseException:
            self._release(job)
            raise
        return self._finish(comm, job)

    def _release(self, job: _Job) -> None:
        if job.snapshot is not None:
            job.snapshot.close()
        if job.slot is not None:
            self._pool.release(*job.slot)
            job.slot = None

    def _finish(self, comm: Comm, job: _Job) -> str:
        """Write this rank's pieces, then commit on the coordinator once every rank reported."""
        try:
            if job.snapshot is not None:  # a forked process holds the snapshot and writes it
                report = job.snapshot.result()
            else:
                report = _write_report(job, comm.rank, f"{self._token}-{job.number}-")
        except Exception as e:  # noqa: BLE001 - reported to the coordinator
            report = {"kind": "report", "error": f"rank {comm.rank}: {type(e).__name__}: {e}"}
        finally:
            self._release(job)
        # this rank's phases so far travel with its report; intervals only while the job is small
        report["metrics"] = metrics.records(intervals=comm.world_size <= 256)
        commit = metrics.start("commit")
        try:
            reports = comm.gather(report, "commit")
        except CommTimeoutError as e:
            comm.broadcast({"kind": "report", "error": str(e)}, "commit")
            raise SaveError(f"save to {job.ckpt.root} failed and was not committed: {e}") from None
        status: dict = {}
        if comm.is_coordinator:
            try:
                md = _commit_metadata(job, reports, comm.world_size)
                _remove_stale_files(job.ckpt, md, self._token)
                job.ckpt.write_atomic(METADATA_FILE, gc_paused(md.dumps)())
                if job.tracker_name:
                    job.root.write_atomic(TRACKER_FILE, job.tracker_name.encode())
                commit.stop()
                metrics.save_beside(job.ckpt, [metrics.records()] + [r.get("metrics") for r in reports[1:]])
                status = {"kind": "report", "ok": True}
            except Exception as e:  # noqa: BLE001 - broadcast so that every rank raises
                status = {"kind": "report", "error": str(e) if isinstance(e, BCPError) else f"{type(e).__name__}: {e}"}
        status = comm.broadcast(status, "commit")
        commit.stop()
        if status.get("kind") != "report":
            raise SaveError(f"save to {job.ckpt.root}: this rank reused a cached plan while others re-planned "
                            "(the state's structure changed on some ranks only)")
        if "error" in status:
            raise SaveError(f"save to {job.ckpt.root} failed and was not committed: {status['error']}")
        if job.on_commit is not None:
            job.on_commit(job.ckpt.root)
        return job.ckpt.root

    def _raise_background_errors(self) -> None:
        while self._pending and self._pending[0][0].done():
            handle, _ = self._pending.popleft()
            exc = handle._future.exception()
            if exc is not None and not handle._error_seen:
                raise SaveError(f"an earlier asynchronous save to {handle.path} failed: {exc}") from exc


@metrics.timed("serialise", nbytes=lambda items, *_: sum(it.tensor.nbytes for it in items))
def _items(plan: LocalSavePlan, assignment: dict, buffers: list[torch.Tensor] | None,
           per_rank: list[tuple[str, torch.Tensor]] | None = None) -> list[WriteItem]:
    """The pieces this rank writes: its assigned boxes (from `buffers` if staged), shards, per-rank tensors."""
    items = []
    for n, (ti, bi) in enumerate(assignment["write"]):
        fqn, lt = plan.tensors[ti]
        box = lt.boxes[bi]
        data = buffers[n] if buffers is not None else _contiguous_cpu(box.view)
        items.append(WriteItem(f"{fqn}@{','.join(map(str, box.offsets))}", data,
                               ["t", fqn, list(box.offsets), list(box.lengths)]))
    for i in assignment["shards"]:
        fqn, _, index = plan.structure["sharded_objects"][i]
        raw = plan.object_shards[i]
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        items.append(WriteItem(f"{fqn}@{','.join(map(str, index))}", data, ["o", fqn, index]))
    # Each rank writes its own per-rank tensors (RNG states: small); identical ones share one
    # piece in the metadata.
    for fqn, t in per_rank if per_rank is not None else plan.per_rank_tensors:
        items.append(WriteItem(f"{fqn}#r", _contiguous_cpu(t), ["v", fqn]))
    return items


def _per_rank_replies(reply: dict, world_size: int) -> list[dict]:
    """The plan reply cut per rank: each rank's own assignment (an error goes to every rank)."""
    if "assignments" not in reply:
        return [reply] * world_size
    rest = {k: v for k, v in reply.items() if k != "assignments"}
    return [{**rest, "assignment": a} for a in reply["assignments"]]


def _contiguous_cpu(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return (t.to("cpu") if t.device.type != "cpu" else t).contiguous()


def _write_report(job: _Job, rank: int, prefix: str) -> dict:
    """Write this rank's items; the report the coordinator commits from (errors included)."""
    plan = job.plan
    try:
        written = write_items(job.ckpt, rank, job.items, job.num_threads, CHECKSUM_BLOCK_BYTES, prefix=prefix)
        per_rank = dict(plan.values["per_rank"])
        for it in job.items:
            if it.key[0] == "v":
                per_rank[it.key[1]] = [dtype_name(it.tensor.dtype), list(it.tensor.shape), _tensor_digest(it.tensor)]
        return {"kind": "report", "key": plan.key, "objects": plan.values["objects"], "per_rank": per_rank,
                "shard_digests": plan.values["shard_digests"], "object_digests": plan.values["object_digests"],
                "pieces": [[w.key, w.file, w.byte_offset, w.nbytes, w.checksums] for w in written]}
    except Exception as e:  # noqa: BLE001 - reported to the coordinator
        return {"kind": "report", "error": f"rank {rank}: {type(e).__name__}: {e}"}


# ----------------------------------------------------------------------------- fork snapshots

class ForkSnapshot:
    """A forked process that holds this rank's state as of the save call and writes it.

    Fork gives the child the parent's memory copy-on-write: the state is frozen for the child at
    the cost of the fork, and pages the training process modifies afterwards are copied by the
    kernel, one at a time, while the child lives (so a step that follows before the write ends
    pays for them). The child gets the plan's assignment as JSON on one pipe, writes its pieces
    with the ordinary engine and answers the report as JSON on another; it touches no accelerator,
    lock or network client of the parent and leaves with os._exit.
    """

    def __init__(self, pid: int, to_child: int, from_child: int):
        self.pid: int | None = pid
        self._to: int | None = to_child
        self._from: int | None = from_child
        self.closed = False

    @classmethod
    def start(cls, job: _Job) -> ForkSnapshot:
        r_in, w_in = os.pipe()
        r_out, w_out = os.pipe()
        with _SNAPSHOT_FDS_LOCK:
            pid = os.fork()
            if pid == 0:  # the child: never returns
                code = 1
                try:
                    # pipes of other snapshots in flight: this process must not hold them open
                    for fd in [w_in, r_out, *_SNAPSHOT_FDS]:
                        os.close(fd)
                    _snapshot_child(job, r_in, w_out)
                    code = 0
                finally:
                    os._exit(code)
            _SNAPSHOT_FDS.update((w_in, r_out))
        os.close(r_in)
        os.close(w_out)
        return cls(pid, w_in, r_out)

    def send(self, assignment: dict, prefix: str, rank: int) -> None:
        try:
            _send_msg(self._to, {"assignment": assignment, "prefix": prefix, "rank": rank})
        except BrokenPipeError:
            pass  # the child is gone: result() reports how it ended, through the commit like any error

    def result(self) -> dict:
        """The child's report, once it has written everything; its phases join this save's metrics."""
        msg = _recv_msg(self._from)
        status = self._reap()
        if msg is None:
            raise SaveError(f"the snapshot process ended without writing its pieces ({_exit_reason(status)})")
        records, rec = msg.pop("metrics", []), metrics.current()
        for r in records if rec is not None else []:
            for i, (t0, t1) in enumerate(r.get("intervals") or [[r["start"], r["end"]]]):
                rec.add(r["phase"], t0, t1, r["bytes"] if i == 0 else 0)
        return msg

    def close(self) -> None:
        """Release the child: a child not told what to write reads end-of-file and leaves."""
        if self.closed:
            return
        self.closed = True
        with _SNAPSHOT_FDS_LOCK:
            for fd in (self._to, self._from):
                _SNAPSHOT_FDS.discard(fd)
                os.close(fd)
        self._reap()

    def _reap(self) -> int:
        pid, self.pid = self.pid, None
        return os.waitpid(pid, 0)[1] if pid is not None else 0


def _snapshot_child(job: _Job, r_in: int, w_out: int) -> None:
    torch.set_num_threads(1)  # an OpenMP team does not survive fork: keep torch from starting one
    msg = _recv_msg(r_in)
    if msg is None:
        return  # the save ended before planning succeeded: nothing to write
    rec = metrics.Recorder("save", msg["rank"])

    def write() -> dict:
        job.items = _items(job.plan, msg["assignment"], None)  # from this process's copy of the state
        return _write_report(job, msg["rank"], msg["prefix"])

    report = rec.run(write)
    report["metrics"] = rec.records()
    _send_msg(w_out, report)


def _can_fork(job: _Job) -> bool:
    """Whether this save can be snapshot by fork; if not, say why (the save copies instead)."""
    tensors = [lt.boxes[0].view for _, lt in job.plan.tensors if lt.boxes] + [t for _, t in job.plan.per_rank_tensors]
    if not hasattr(os, "fork"):
        reason = "no os.fork on this platform"
    elif not isinstance(job.ckpt, LocalStorage):
        reason = f"{job.ckpt.root} is not a local or memory:// path (network clients do not survive a fork)"
    elif any(t.device.type != "cpu" for t in tensors):
        reason = "the state holds accelerator tensors"
    else:
        return True
    log.info("bcp: snapshot='fork' not possible here (%s); copying instead", reason)
    return False


# Both ends of every snapshot pipe the parent holds: a child forked later closes them, so that each
# pipe has exactly one writer and one reader.
_SNAPSHOT_FDS: set[int] = set()
_SNAPSHOT_FDS_LOCK = threading.Lock()


def _send_msg(fd: int, obj: Any) -> None:
    """A JSON message, 8-byte length first (readers never wait for an end-of-file)."""
    data = json.dumps(obj).encode()
    view = memoryview(len(data).to_bytes(8, "little") + data)
    while view:
        view = view[os.write(fd, view):]


def _recv_msg(fd: int) -> Any:
    """The next message, or None when the other side closed first (or died)."""
    head = _read_exactly(fd, 8)
    if head is None:
        return None
    body = _read_exactly(fd, int.from_bytes(head, "little"))
    return None if body is None else json.loads(body)


def _read_exactly(fd: int, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _exit_reason(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit status {os.WEXITSTATUS(status)}"


def _tensor_digest(t: torch.Tensor) -> str:
    return digest(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def _invalidate(ckpt: Storage) -> None:
    """An older checkpoint at this path must never pass for this one: drop its metadata first."""
    if ckpt.exists(METADATA_FILE):
        ckpt.remove(METADATA_FILE)


def _warn_differing_values(reports: list[dict]) -> None:
    """Replicated values are saved from rank 0; say so loudly when another rank's value differs."""
    differ: dict[str, list[int]] = {}
    ref = reports[0]["object_digests"]
    for r, rep in enumerate(reports[1:], start=1):
        for k, d in rep["object_digests"].items():
            if ref.get(k) != d:
                differ.setdefault(k, []).append(r)
    if differ:
        log.warning("bcp: non-tensor values differ between ranks and only rank 0's is saved: %s. Values "
                    "that differ per rank belong under 'extra_state' (or in a sharded object).",
                    ", ".join(f"{k} (ranks {v})" for k, v in sorted(differ.items())[:8]))


def _remove_stale_files(ckpt: Storage, md: CheckpointMetadata, token: str) -> None:
    """This job's data files from an earlier save to the same path. Other jobs' files are left alone:
    one may be writing here right now (`bcp prune` cleans up after crashed jobs)."""
    keep = {f.split("/", 1)[1] for f in md.files}
    for name in ckpt.listdir("data"):
        if name.startswith(f"{token}-") and name not in keep:
            ckpt.remove(f"data/{name}")


@gc_paused  # builds an object per saved piece: see planner.gc_paused
def _commit_metadata(job: _Job, reports: list[dict], world_size: int) -> CheckpointMetadata:
    errors = [r["error"] for r in reports if r.get("error")]
    if errors:
        raise SaveError("; ".join(errors))
    cached = job.cached
    gplan = cached.gplan
    replanned = [r for r, rep in enumerate(reports) if rep["kind"] != "report"]
    if replanned:
        raise SaveError(f"ranks {replanned} re-planned while others reused a cached plan: the state's structure "
                        "changed on some ranks only")
    changed = [r for r, rep in enumerate(reports) if rep["key"] != cached.rank_keys[r]]
    if changed:
        raise SaveError(f"ranks {changed} saved a state whose structure differs from the plan")

    files: list[str] = []
    file_index: dict[str, int] = {}
    pieces: dict[str, list[Piece]] = {fqn: [] for fqn in gplan.tensor_info}
    shards: dict[str, list[ObjectPiece]] = {fqn: [] for fqn in gplan.sharded_grids}
    rank_tensor: dict[tuple[str, int], Piece] = {}
    for rank, rep in enumerate(reports):
        for key, file, byte_offset, nbytes, crc in rep["pieces"]:
            fi = file_index.setdefault(file, len(file_index))
            if fi == len(files):
                files.append(file)
            if key[0] == "t":
                _, fqn, offs, lens = key
                pieces[fqn].append(Piece(tuple(offs), tuple(lens), fi, byte_offset, nbytes, tuple(crc), rank))
            elif key[0] == "o":
                _, fqn, index = key
                shards[fqn].append(ObjectPiece(tuple(index), fi, byte_offset, nbytes, tuple(crc), rank))
            else:
                rank_tensor[(key[1], rank)] = Piece((), (), fi, byte_offset, nbytes, tuple(crc), rank)

    for (fqn, index), holders in gplan.shard_holders.items():
        digests = {reports[r]["shard_digests"][i] for r, i in holders}
        if len(digests) > 1:
            raise SaveError(f"sharded object {fqn!r} index {list(index)}: ranks {[r for r, _ in holders]} hold "
                            "different values for the same shard")

    per_rank: dict[str, PerRankMeta] = {}
    for fqn, kind in sorted(gplan.per_rank.items()):
        variants: list = []
        ids: dict[str, int] = {}
        ranks: list[int | None] = []
        for rank, rep in enumerate(reports):
            v = rep["per_rank"].get(fqn)
            if v is None:
                ranks.append(None)
                continue
            ident = f"{v[0]}{v[1]}{v[2]}" if kind == "tensor" else repr(v)
            if ident not in ids:
                ids[ident] = len(variants)
                if kind == "tensor":
                    p = rank_tensor[(fqn, rank)]
                    shape = tuple(v[1])
                    variants.append(TensorMeta(dtype_from_name(v[0]), shape, (Piece(
                        (0,) * len(shape), shape, p.file, p.byte_offset, p.nbytes, p.checksums, rank),)))
                else:
                    variants.append(ObjectValue(v))
            ranks.append(ids[ident])
        first = next(r for r in ranks if r is not None)  # ranks without the value load rank 0's
        per_rank[fqn] = PerRankMeta(tuple(first if r is None else r for r in ranks), tuple(variants))

    tensors = {fqn: TensorMeta(dtype_from_name(dt), tuple(shape), tuple(sorted(pieces[fqn], key=lambda p: p.offsets)))
               for fqn, (dt, shape) in sorted(gplan.tensor_info.items())}
    sharded = {fqn: ShardedObjectMeta(tuple(grid), tuple(sorted(shards[fqn], key=lambda p: p.index)))
               for fqn, grid in sorted(gplan.sharded_grids.items())}
    objects = {k: ObjectValue(reports[0]["objects"][k]) for k in sorted(gplan.object_keys)}
    _warn_differing_values(reports)
    return CheckpointMetadata(world_size=world_size, framework=job.framework, files=tuple(files), tensors=tensors,
                              objects=objects, per_rank=per_rank, sharded_objects=sharded,
                              user=job.user_metadata)


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
    rank = _global_rank()
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


def _global_rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
