"""Persistence: every `persist_every`-th step drained from memory to durable storage, in the background.

Once a step is committed in memory, each rank copies the data files it wrote there to the durable
root's `step_<n>/data/` (from the memory file's map: the training state is not touched again), and a
commit round like a save's follows: the coordinator syncs the directories, writes the step's
metadata (the very bytes recorded in memory: the file names are the same) and then the root's
`latest` tracker, so the durable step is an ordinary bcp checkpoint that loads anywhere; then it
removes what failed drains left and, with `keep_durable`, the oldest steps. A drain that fails on any
rank commits nothing there and is marked failed; the step stays in memory.

Drains run one at a time, in step order, on threads of their own beside the saves (a `SaveQueue` of
their own, with a Comm of its own, so their exchanges never interleave with the saves'): the exit
flush waits for them, and a failure no one waited for is raised by the role's next save. A step
stays in each node's memory until its drain ended. When drains fall behind (two in flight), the
save that starts the next one waits, so memory stays bounded.
"""

from __future__ import annotations

import logging

from .. import metrics
from ..comm import comm_for
from ..errors import CommTimeoutError, SaveError, StorageError
from ..layout import write_tracker
from ..metadata import CHECKSUM_BLOCK_BYTES, FAILED_FILE, METADATA_FILE, CheckpointMetadata
from ..plan_records import Committed, SaveId, WriteReport
from ..save_job import SaveProgress, SaveRequest, rank_error
from ..save_queue import SaveHandle, SaveQueue
from ..save_rounds import PROBE_FILE, SaveRounds, check_probes, mark_failed, tidy_root, write_probe
from ..storage import Storage
from ..storage.base import parse_temp_name, run_all
from .copy_check import CopyCheck
from .transport import PART_BYTES

log = logging.getLogger("bcp")


class DrainLane:
    """The drains of one role (module doc)."""

    def __init__(self, role: str, runtime):
        self.role, self.runtime = role, runtime
        self.queue = SaveQueue(f"{role}/drain")
        self.rounds = SaveRounds()
        self.count = 0                 # drains so far: the same on every rank
        self.probed: set[str] = set()  # durable roots every node was seen to share

    def start(self, tier, comm, request: SaveRequest, progress: SaveProgress) -> SaveHandle:
        """Queue the drain of the step `request` just committed in memory (on the save's thread)."""
        while sum(not q.handle.done() for q in self.queue.pending) >= 2:
            try:
                self.queue.wait_oldest(request.timeout, "finish persisting its step")
            except CommTimeoutError as e:  # the save is committed: its drain queues up behind
                log.error("bcp: %s", e)
                break
        self.count += 1
        durable = tier.tiers.durable_root()
        name = request.tracker_name
        dckpt = durable.child(name)
        sid = SaveId(self.count, request.save.step, durable.root)
        drequest = SaveRequest(sid, request.timeout, f"persisting step {request.save.step} to {dckpt.root}",
                               root=durable, ckpt=dckpt, tracker_name=name, num_threads=request.num_threads,
                               keep=tier.tiers.keep_durable)
        dprogress = SaveProgress()
        dcomm = comm_for(tier.process_group, f"drain/{self.role}")
        rec = metrics.Recorder("save", dcomm.rank, dckpt.root)
        self.runtime.pinned.add(name)
        run = self.queue.start(lambda: rec.run(self._drain, dcomm, drequest, dprogress, request.ckpt,
                                               tier.pieces, progress.metadata, request.root,
                                               tier.tiers.keep_in_memory, finish=True))
        handle = SaveHandle(dckpt.root, run, rec)
        self.queue.add(handle, drequest, dprogress)
        return handle

    def _drain(self, comm, request: SaveRequest, progress: SaveProgress, memory: Storage,
               pieces: dict[str, list] | None, md: bytes | None, memory_root: Storage, keep: int) -> str:
        op = f"d{request.save.number}"
        try:
            progress.phase = "writing"
            request.ckpt.makedirs()
            progress.probe = len(set(comm.nodes)) > 1 and request.root.root not in self.probed
            if progress.probe:
                write_probe(comm, request, progress)
                comm.barrier(f"{op}/probe", request.timeout)
            report = self._copy(comm, request, progress, memory, pieces)
            progress.phase = "committing"
            self.rounds.round(comm, request, f"{op}/commit", report, self._decide(request, progress, md))
            progress.phase = "committed"
        except SaveError as e:
            if comm.is_coordinator:
                mark_failed(request, e)
            raise
        finally:
            self.runtime.pinned.discard(request.tracker_name)
            if comm.rank in comm.node_leaders:  # the step may leave memory now, if newer ones are kept
                self.runtime.keep_newest(memory_root, keep)
        if progress.probe:
            self.probed.add(request.root.root)
        if comm.is_coordinator:
            tidy_root(request, "drain", "keep_durable")
        return request.ckpt.root

    @staticmethod
    def _copy(comm, request: SaveRequest, progress: SaveProgress, memory: Storage,
              pieces: dict[str, list] | None) -> WriteReport:
        """This rank's files (by name, with their pieces as its write reported them) from memory to
        the durable step, each checked as it goes; a failure is this rank's report."""
        try:
            if progress.error is not None:
                raise SaveError(progress.error)
            if pieces is None:
                raise SaveError(f"rank {comm.rank} wrote no files of this step")
            check_probes(comm, request, progress)
            with metrics.phase("drain", sum(memory.size(f) for f in pieces)):
                copy_files(memory, request.ckpt, pieces, request.num_threads, CHECKSUM_BLOCK_BYTES)
            return WriteReport(request.save, None, {}, {}, (), {}, ())
        except Exception as e:  # noqa: BLE001 - reported to the coordinator, so every rank fails alike
            return WriteReport.failed(request.save, rank_error(comm.rank, e))

    @staticmethod
    def _decide(request: SaveRequest, progress: SaveProgress, md: bytes | None):
        def decide(_request, reports: list[WriteReport], world: int) -> Committed:
            errors = [r.error for r in reports if r.error]
            if errors:
                raise SaveError("; ".join(errors))
            stray = [r for r, rep in enumerate(reports) if rep.save != request.save]
            if stray:
                raise SaveError(f"rank {stray[0]} reported for {reports[stray[0]].save}, not {request.save}")
            ckpt, root = request.ckpt, request.root
            if progress.probe:
                for name in ckpt.listdir():
                    if name.startswith(PROBE_FILE.split("{")[0]):
                        ckpt.remove(name)
            ckpt.sync_dir("data")
            ckpt.sync_dir()
            root.sync_dir()
            if ckpt.exists(FAILED_FILE):
                ckpt.remove(FAILED_FILE)
            ckpt.write_atomic(METADATA_FILE, md)  # the commit point of the durable step (replacing any other)
            ours = {f.split("/", 1)[1] for f in CheckpointMetadata.loads(md).files}
            for name in ckpt.listdir("data"):  # an earlier save of this step's files, which nothing names now
                if name not in ours and parse_temp_name(name) is None:
                    ckpt.remove(f"data/{name}")
            write_tracker(root, request.tracker_name)
            return Committed(request.save)
        return decide


def copy_files(src: Storage, dst: Storage, pieces: dict[str, list], threads: int, block: int) -> None:
    """Each file of `src` (a node's memory) named in `pieces` to the same path in `dst`, in parts read
    from its map, each part checked against the file's pieces (byte offset, bytes, the checksum of
    each `block`, as the write computed them) just before it is written: a copy damaged in memory
    (a flipped bit in RAM) fails the drain, and never becomes a durable checkpoint. Each file
    appears whole (the storage's writers), and `data/` is synced after."""
    dst.makedirs("data")

    def copy(rel: str) -> None:
        data = src.map(rel)
        check = CopyCheck.for_file(data, pieces[rel], block)
        writer = dst.open_writer(rel)
        try:
            for lo in range(0, len(data), PART_BYTES):
                part = data[lo:lo + PART_BYTES]
                check.feed(part, lo)
                if writer.can_write_in_place(part):  # direct I/O straight from the memory file
                    writer.write_in_place(part)
                else:
                    writer.write(part)
            wrong = check.wrong()
            if wrong:
                raise StorageError(f"{src.join(rel)} {wrong}: this node's copy of the step is damaged, and is not "
                                   "persisted")
            writer.close()
        except BaseException:
            writer.abort()
            raise
    run_all([lambda rel=rel: copy(rel) for rel in pieces], max(1, threads))
    dst.sync_dir("data")

