"""The state of a save as of its call, and this rank's pieces written from it.

A synchronous save writes from the live state: the caller waits, nothing changes meanwhile
(`write_live`). An asynchronous save returns at once, so it first captures the state
(`Snapshots.take`, after the `snapshot` argument):

- "copy": every box this rank may write is copied into reused staging buffers now (staging.py);
- "lazy": the same, but parameters and optimizer state are copied after the call returns, until
  the next optimizer step (staging.LazyCopy); a CPU tensor may be written straight from the live
  state meanwhile;
- "fork": a save that would copy into staging buffers not yet allocated (the first of a
  structure) forks a process that keeps the state as of the call and writes it
  (fork_snapshot.py), while the buffers are allocated for the next save.

With a cached plan only the boxes it assigns to this rank are staged; without one, every box this
rank holds (the plan picks from them later). A role holds at most two snapshots at once (the
staging pool's two slots, or two forked processes): a third save waits for the oldest.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

import torch

from . import codec, metrics
from .engine import write_items
from .fork_snapshot import ForkSnapshot, can_fork
from .host_memory import ordered_after_callers
from .metadata import CHECKSUM_BLOCK_BYTES, dtype_name
from .plan_records import (Assignment, LocalSavePlan, ObjectShardKey, RankValueKey, TensorBoxKey, WriteItem,
                           WriteReport)
from .save_job import SaveProgress, SaveRequest, rank_error
from .save_queue import SaveQueue
from .staging import LazyCopy, StagingPool, box_sources, contiguous_cpu, on_host_or_cuda, pool_key
from .utils import digest

log = logging.getLogger("bcp")


class Snapshots:
    """How one role's asynchronous saves capture the state: its staging buffers (two slots, reused
    from save to save), and `prepare_save`'s warm-up of them."""

    def __init__(self, role: str, queue: SaveQueue):
        self.role, self.queue = role, queue
        self.pool = StagingPool()
        self._warming: Future | None = None  # prepare_save's buffer warm-up

    def take(self, request: SaveRequest, progress: SaveProgress, kind: str) -> None:
        """Capture the state of `progress.plan` for an asynchronous save, as `kind` ("lazy", "copy",
        "fork") asks (module doc)."""
        if kind == "fork" and self._pool_is_cold(progress) and \
                can_fork(request.ckpt, _plan_tensors(progress.plan)):
            progress.snapshot = self._fork(request, progress)
        else:
            self._stage(request, progress, lazy=kind == "lazy")

    def prepare(self, plan: LocalSavePlan, assignment: Assignment) -> Future:
        """Allocate and touch the staging buffers of `assignment` in a background thread, unless they
        are warm already; done once they are ready (or could not be: the first save then does it)."""
        ready: Future = Future()
        key = pool_key(plan, assignment.boxes)
        if self.pool.warm(key):
            ready.set_result(None)
            return ready
        self._warming = ready

        def warm() -> None:
            try:
                self.pool.warm_up(key, box_sources(plan, assignment.boxes))
            except Exception as e:  # noqa: BLE001 - the first save allocates its buffers itself then
                log.warning("bcp: preparing the staging buffers of role %r failed: %s", self.role, e)
            ready.set_result(None)

        threading.Thread(target=warm, name=f"bcp-prepare-{self.role}").start()
        return ready

    def _pool_is_cold(self, progress: SaveProgress) -> bool:
        """No warm staging buffers for this plan yet: a copy would fault in fresh memory."""
        cached = progress.cached
        return cached is None or not self.pool.warm(pool_key(progress.plan, cached.assignment.boxes))

    @metrics.timed("stage", nbytes=lambda snap, *_, **__: snap.bytes_at_call())
    def _stage(self, request: SaveRequest, progress: SaveProgress, lazy: bool) -> StagedSnapshot:
        """Copy what this rank may write into reused host buffers (`progress.snapshot` from the moment
        it holds a slot, so that the driver releases it whatever fails): the only part of an async save that
        stalls. With `lazy`, parameters and optimizer state are copied after the call instead, until
        the next optimizer step (staging.LazyCopy); the rest is copied now.

        With a cached plan only the boxes it assigns to this rank are staged (if the ranks then
        agree on another plan, it gives this rank no others: `writable`). Without one, every box
        this rank holds is copied (a copy of the local shard: the floor of any snapshot) and the
        plan picks from them later.
        """
        plan = progress.plan
        if progress.cached is not None:
            boxes = [tuple(tb) for tb in progress.cached.assignment.boxes]
            writable = set(boxes)
        else:
            boxes = [(ti, bi) for ti, (_, lt) in enumerate(plan.tensors) for bi in range(len(lt.boxes))]
            writable = None
        sources = box_sources(plan, boxes)
        key = pool_key(plan, boxes)
        if self._warming is not None:  # prepare_save's buffers are still being touched: take them when ready
            self._warming.result()
            self._warming = None
        got = self.pool.acquire(key, sources)
        while got is None:  # both slots in flight: wait for the oldest save
            self.queue.wait_oldest(request.timeout, "release its staging buffers")
            got = self.pool.acquire(key, sources)
        slot, buffers = got
        snap = progress.snapshot = StagedSnapshot(self.pool, (key, slot), dict(zip(boxes, buffers)), writable)
        later = [(buf, src) for (ti, _), buf, src in zip(boxes, buffers, sources) if lazy and plan.stepped[ti]]
        now = [(buf, src) for (ti, _), buf, src in zip(boxes, buffers, sources) if not (lazy and plan.stepped[ti])]
        cuda = False
        with torch.no_grad():
            for buf, src in now:
                cuda |= src.device.type == "cuda"
                buf.copy_(src.detach(), non_blocking=src.device.type == "cuda")
        if cuda:
            torch.cuda.current_stream().synchronize()
        snap.per_rank = [(fqn, t.to("cpu", copy=True)) for fqn, t in plan.per_rank_tensors]
        if later:
            # local files are written fast enough to take live sources during forward and backward;
            # a remote upload could hold the next optimizer step back for as long as a part takes
            snap.lazy = LazyCopy(later, name=f"bcp-snapshot-{self.role}", live=not request.ckpt.remote,
                                 timeout=request.timeout.total_seconds())
        return snap

    @metrics.timed("snapshot")
    def _fork(self, request: SaveRequest, progress: SaveProgress) -> ForkedSnapshot:
        """Snapshot by forking: the child process keeps the state as of now (copy-on-write) and
        writes this rank's pieces from it, so the stall is the fork, not a copy into fresh memory.

        Used for a save that would otherwise copy into cold buffers (the first of a structure);
        meanwhile the background thread warms the staging buffers, so later saves copy into
        touched memory. Needs CPU tensors and a POSIX or memory:// checkpoint path: the child
        uses no accelerator and no network client.
        """
        def held() -> int:
            return sum(1 for q in self.queue.pending
                       if isinstance(q.progress.snapshot, ForkedSnapshot) and not q.progress.snapshot.closed)
        while held() >= 2:  # at most two snapshots held, as with staging
            self.queue.wait_oldest(request.timeout, "end its snapshot process")
        plan = progress.plan

        def write_in_child(orders: dict) -> dict:
            rank = orders["rank"]
            rec = metrics.Recorder("save", rank)
            assignment = codec.from_wire(orders["assignment"], Assignment)
            # from the child's copy of the state, as of the fork; not in place: its pages are shared
            # with the parent, and pinning them for the device would make the kernel copy each one
            # (5-8x the child's CPU of a copy through the writer's buffers, measured)
            report = rec.run(lambda: write_live(request, plan, assignment, rank, orders["prefix"]))
            return {"report": codec.to_wire(report), "metrics": rec.records()}

        return ForkedSnapshot(ForkSnapshot.start(write_in_child, timeout=request.timeout.total_seconds()), self)

    def forget_in_child(self) -> None:
        """In a forked child: pinned staging buffers are not mapped there (host_memory)."""
        self.pool = StagingPool()
        self._warming = None


class StagedSnapshot:
    """Copies of the boxes this rank may write in a staging slot ("copy"), some made after the call
    ("lazy": `lazy`); per-rank tensors copied at the call."""

    def __init__(self, pool: StagingPool, slot: tuple, staged: dict, writable: set | None):
        self._pool, self._slot = pool, slot
        self.staged = staged                  # (tensor index, box index) -> its staging buffer
        self.per_rank: list[tuple[str, torch.Tensor]] = []  # (fqn, its copy)
        self._writable = writable
        self.lazy: LazyCopy | None = None     # the copies made after the call

    def bytes_at_call(self) -> int:
        """The bytes copied at the call (the stall)."""
        return sum(b.nbytes for b in self.staged.values()) - (self.lazy.nbytes if self.lazy is not None else 0)

    def writable(self) -> set[tuple[int, int]] | None:
        return self._writable

    def keep_only(self, assignment: Assignment) -> None:
        """A first save staged every box this rank holds; the others' copies are not needed."""
        if self.lazy is not None and self._writable is None:
            mine = {tuple(tb) for tb in assignment.boxes}
            self.lazy.skip([buf for box, buf in self.staged.items() if box not in mine])

    def write(self, request: SaveRequest, plan: LocalSavePlan, assignment: Assignment, rank: int,
              prefix: str) -> WriteReport:
        staged = [self.staged[tuple(tb)] for tb in assignment.boxes]
        # beside training, so written in place (a synchronous save, which the caller waits for, is
        # faster through the writer's buffers)
        report = _write(request, plan, assignment, staged, self.per_rank, rank, prefix,
                        hold=self.lazy.hold if self.lazy is not None else None, in_place=True)
        if self.lazy is not None:
            self.lazy.retire()
            rec = metrics.current()
            if rec is not None and self.lazy.copied_bytes:  # copies beside training: not the stall
                rec.add("snapshot", self.lazy.started, self.lazy.ended, self.lazy.copied_bytes)
        return report

    def release(self) -> None:
        if self.lazy is not None:
            self.lazy.finish()  # the copy thread must be done with the slot before another save takes it
        if self._slot is not None:
            self._pool.release(*self._slot)
            self._slot = None


class ForkedSnapshot:
    """A forked process holding the state as of the call; it writes this rank's pieces."""

    def __init__(self, process: ForkSnapshot, snapshots: Snapshots):
        self.process, self._snapshots = process, snapshots

    @property
    def closed(self) -> bool:
        return self.process.closed

    def writable(self) -> set[tuple[int, int]] | None:
        return None

    def keep_only(self, assignment: Assignment) -> None:
        pass

    def write(self, request: SaveRequest, plan: LocalSavePlan, assignment: Assignment, rank: int,
              prefix: str) -> WriteReport:
        self.process.send({"assignment": codec.to_wire(assignment), "prefix": prefix, "rank": rank})
        try:  # touch the staging buffers of the next save now, off the training thread
            self._snapshots.pool.warm_up(pool_key(plan, assignment.boxes), box_sources(plan, assignment.boxes))
        except Exception as e:  # noqa: BLE001 - the next save allocates them itself then
            log.warning("bcp: warming the staging buffers of role %r failed: %s", self._snapshots.role, e)
        msg = self.process.result()
        rec = metrics.current()  # the child's phases join this save's metrics
        for r in msg["metrics"] if rec is not None else []:
            for i, (t0, t1) in enumerate(r.get("intervals") or [[r["start"], r["end"]]]):
                rec.add(r["phase"], t0, t1, r["bytes"] if i == 0 else 0)
        return codec.from_wire(msg["report"], WriteReport)

    def release(self) -> None:
        self.process.close()


# ----------------------------------------------------------------------------- writing this rank's pieces

def write_live(request: SaveRequest, plan: LocalSavePlan, assignment: Assignment, rank: int,
               prefix: str) -> WriteReport:
    """Write this rank's pieces from the live state (a synchronous save, or a forked child's copy)."""
    return _write(request, plan, assignment, None, None, rank, prefix)


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


def _write(request: SaveRequest, plan: LocalSavePlan, assignment: Assignment, staged, staged_per_rank, rank: int,
           prefix: str, hold=None, in_place: bool = False) -> WriteReport:
    """Write this rank's pieces; the report the coordinator commits from (an error is reported too).
    `in_place`: for a save beside training (engine.write.write_items)."""
    try:
        items = _write_items(plan, assignment, staged, staged_per_rank)
        written = write_items(request.ckpt, rank, items, request.num_threads, CHECKSUM_BLOCK_BYTES, prefix=prefix,
                              hold=hold, in_place=in_place)
        per_rank = dict(plan.per_rank)
        for it in items:
            if isinstance(it.key, RankValueKey):
                per_rank[it.key.fqn] = [dtype_name(it.tensor.dtype), list(it.tensor.shape), _tensor_digest(it.tensor)]
        return WriteReport(request.save, plan.key, plan.objects, per_rank, plan.shard_digests, plan.object_digests,
                           tuple(written))
    except Exception as e:  # noqa: BLE001 - reported to the coordinator
        return WriteReport.failed(request.save, rank_error(rank, e))


def _tensor_digest(t: torch.Tensor) -> str:
    return digest(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
