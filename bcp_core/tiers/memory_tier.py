"""A tiered save, as the save driver runs it: the memory tier's step, its replicas, its commit.

    before the plan round   placement (first save: the nodes' failure domains); each node's leader
                            clears what a step >= this one left from a timeline the job has left
    after the write         replicate (replication.py): every file gets its copies on other nodes
    commit round            the coordinator builds the metadata but writes nothing (save_rounds.py)
    publish                 the metadata goes down a tree of the node leaders; each records it in
                            its memory (the step is committed there); a round confirms every node
                            did (if one could not, the others take theirs back and the save fails
                            on every rank); then each node keeps its newest `keep_in_memory` steps
                            and, every `persist_every`-th step, the drain to durable storage starts
                            (drain.py)

A step is committed in memory once its metadata is recorded on the nodes, which happens only after
every piece has its k + 1 copies: so a step whose metadata survives on any node is whole wherever
k or fewer nodes were lost, and recovery (recovery.py) finds it. A step leaves a node's memory only
after a newer one is committed there, and not while it is being drained.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from .. import layout
from ..comm import Comm
from ..errors import SaveError
from ..metadata import FAILED_FILE, METADATA_FILE, TRACKER_FILE
from ..plan_records import WriteReport
from ..save_job import SaveProgress, SaveRequest, rank_error
from .fetch import remove_stale_views
from .placement import Placement, PlacementError, nodes_of, place
from .policy import Tiers
from .replication import replicate
from .transport import Peer, PeerFailed, tier_group

log = logging.getLogger("bcp")

# Tags of a save's point-to-point messages on the tier group: its number times this, plus the kind.
_TAGS_PER_SAVE, _REPLICATE, _PUBLISH = 4, 0, 1


class TierRuntime:
    """What one role's tiered saves keep from save to save: placements, the steps being drained
    (kept in memory until drained), and the drain lane (drain.py)."""

    def __init__(self, role: str):
        from .drain import DrainLane  # drain imports this module's records
        self.role = role
        self.placements: dict[tuple, Placement] = {}
        self.pinned: set[str] = set()
        self.drains = DrainLane(role, self)
        # one retention at a time (a save's, or a drain's once it ended), and none while a step is
        # recorded on this node but not yet confirmed on every node (`TierSave.publish`)
        self.lock = threading.Lock()
        self.rewound: set[str] = set()  # durable roots whose tracker this job has checked (rewind_durable)

    def keep_newest(self, root, keep: int, committed: str | None = None, pinned: set[str] = frozenset()) -> None:
        """A node leader: what failed saves left older than `committed` (a step just committed), then
        the steps beyond the newest `keep`, but not those being drained (`pinned` adds to them).
        Failures are logged: the steps are committed."""
        with self.lock:
            try:
                if committed is not None:
                    for name, error in layout.remove_leftovers(root, committed).failed:
                        log.warning("bcp: could not remove %s, left by a failed save under %s: %s", name, root.root,
                                    error)
                # the steps that go are retired: their files are overwritten by the next steps' (MemoryStorage.retire)
                for name in layout.prune(root, keep, keep=self.pinned | set(pinned), dry_run=True).removed:
                    try:
                        root.remove(f"{name}/{METADATA_FILE}")  # first: never a step that looks whole
                        root.retire(name)
                    except Exception as e:  # noqa: BLE001 - logged, and the others still go
                        log.warning("bcp: could not remove %s from %s: %s", name, root.root, e)
            except Exception as e:  # noqa: BLE001 - see above
                log.warning("bcp: keeping the newest %d steps in %s failed: %s", keep, root.root, e)


@dataclass
class TierSave:
    """The tiers of one save (`SaveRequest.tiers`), and what this rank learns on the way."""

    tiers: Tiers
    runtime: TierRuntime
    process_group: object = None
    placement: Placement | None = None
    pieces: dict[str, list] | None = None        # the data files this rank wrote: their pieces (byte offset,
                                                 # bytes, checksums); None if its write failed
    counts: dict = field(default_factory=dict)   # bytes replicated

    # -- before the plan round ------------------------------------------------------------------------

    def before_plan(self, comm: Comm, request: SaveRequest, progress: SaveProgress, op: str) -> None:
        """The placement (collective at the first tiered save of this comm and replica count), and on
        each node's leader a clean step directory. Errors go with this rank's plan request."""
        try:
            self.placement = self._placement(comm, request, op)
        except PlacementError as e:
            progress.error = progress.error or rank_error(comm.rank, e)
            return
        if progress.error is None and comm.rank in comm.node_leaders:
            try:
                self._wait_for_drains_from(request)
                clear_newer(request.root, request.tracker_name)
                remove_stale_views(request.root)
                request.ckpt.makedirs("data")
                if comm.is_coordinator and self.tiers.durable is not None and \
                        self.tiers.durable not in self.runtime.rewound:
                    rewind_durable(self.tiers.durable_root(), request.save.step)
                    self.runtime.rewound.add(self.tiers.durable)
            except Exception as e:  # noqa: BLE001 - sent with the plan request
                progress.error = rank_error(comm.rank, e)

    def _wait_for_drains_from(self, request: SaveRequest) -> None:
        """A save of a step the job saved before (a framework's second, fuller save of a step) clears
        that step and later ones from memory: a drain still copying one of them would lose its
        files. Wait for those drains first (each wait bounded by the save's timeout). A drain of a
        step ends on the node leader only after every rank copied its files (its commit round)."""
        step = layout.BCP_STEPS.step_of(request.tracker_name)
        queue = self.runtime.drains.queue
        while any((s := layout.BCP_STEPS.step_of(p)) is not None and s >= step for p in self.runtime.pinned) and \
                any(not q.handle.done() for q in queue.pending):
            queue.wait_oldest(request.timeout, f"finish persisting before step {step} is saved again")

    def _placement(self, comm: Comm, request: SaveRequest, op: str) -> Placement:
        key = (id(comm), self.tiers.replicas)
        placement = self.runtime.placements.get(key)
        if placement is not None:
            return placement
        node_ranks = nodes_of(comm.nodes)
        labels = comm.all_gather(self.tiers.domain(), f"{op}/domains", request.timeout)
        domains = []
        for x, ranks in enumerate(node_ranks):
            seen = {labels[r] for r in ranks}
            if len(seen) > 1:
                raise PlacementError(f"the ranks of node {x} (ranks {ranks[0]}-{ranks[-1]}) name different failure "
                                     f"domains: {sorted(map(str, seen))}; a node is in one")
            domains.append(labels[ranks[0]])
        placement = self.runtime.placements[key] = place(node_ranks, domains, self.tiers.replicas)
        return placement

    # -- after the write ---------------------------------------------------------------------------------

    def replicate(self, comm: Comm, request: SaveRequest, report: WriteReport) -> WriteReport:
        """This rank's files to its replica nodes, its sources' files into this node's memory; a
        failure becomes this rank's report."""
        if report.error is None:
            self.pieces = {}
            for p in report.pieces:
                self.pieces.setdefault(p.file, []).append((p.byte_offset, p.nbytes, p.checksums))
        if self.placement is None or not self.tiers.replicas:
            return report
        error, self.counts = replicate(comm, self.placement, request.ckpt, self.pieces, report.error,
                                       request.save.number * _TAGS_PER_SAVE + _REPLICATE,
                                       request.timeout.total_seconds(), self.tiers.bandwidth,
                                       f"s{request.save.number}/replicate")
        if error is not None and report.error is None:
            return WriteReport.failed(request.save, error)
        return report

    # -- after the commit round -------------------------------------------------------------------------

    def publish(self, comm: Comm, request: SaveRequest, progress: SaveProgress, op: str) -> None:
        """The metadata (the coordinator's `progress.metadata`) recorded in every node's memory, or
        the save fails on every rank with no node keeping it (module doc)."""
        error, recorded, md = None, False, None
        leader = comm.rank in comm.node_leaders
        if len(comm.node_leaders) > 1:  # made by every rank (replication made it already, unless k = 0)
            tier_group(comm, request.timeout)
        if leader:
            try:
                md = self._relay_metadata(comm, request, progress.metadata, op)
            except PeerFailed as e:
                error = f"rank {comm.rank}: the metadata did not reach this node: {e}"
            except Exception as e:  # noqa: BLE001 - every rank hears of it below
                error = rank_error(comm.rank, e)
        # Recorded here, the step looks committed to a drain's retention (keep_newest, on the drain's
        # thread), which would let an older committed step go for it; until every node confirmed, it
        # is not: the lock keeps retention out from the write to the confirmation or the take-back.
        # The drain's thread waits at most the confirmation's timeout; it holds the lock only for
        # local removals, never a wait on another rank.
        if leader:
            self.runtime.lock.acquire()
        try:
            if leader and error is None:
                try:
                    request.ckpt.write_atomic(METADATA_FILE, md)
                    recorded = True
                except Exception as e:  # noqa: BLE001 - every rank hears of it below
                    error = rank_error(comm.rank, e)
            try:
                errors = [e for e in comm.all_gather(error, f"{op}/recorded", request.timeout) if e]
            except BaseException:
                if recorded:  # not confirmed on every node: not committed
                    _take_back(request)
                raise
            if errors:
                if recorded:
                    _take_back(request)
                raise SaveError(f"{request.what} failed and was not committed: the step could not be recorded on "
                                f"every node: {'; '.join(errors)}")
        finally:
            if leader:
                self.runtime.lock.release()
        if leader:
            self.runtime.keep_newest(request.root, self.tiers.keep_in_memory, request.tracker_name,
                                     {request.tracker_name} if self.tiers.persists(request.save.step) else set())
        if self.tiers.persists(request.save.step):
            self.runtime.drains.start(self, comm, request, progress)

    def _relay_metadata(self, comm: Comm, request: SaveRequest, md: bytes | None, op: str) -> bytes:
        """Down a binary tree of the node leaders (the coordinator, rank 0, at its root): receive the
        metadata from the parent, pass it to the children. A leader that got nothing tells its
        children so, rather than leave them waiting."""
        leaders = comm.node_leaders
        i = leaders.index(comm.rank)
        children = [leaders[c] for c in (2 * i + 1, 2 * i + 2) if c < len(leaders)]
        if len(leaders) == 1:
            return md
        group = tier_group(comm, request.timeout)
        deadline = time.monotonic() + request.timeout.total_seconds()
        tag = request.save.number * _TAGS_PER_SAVE + _PUBLISH
        failure: Exception | None = None
        if i > 0:
            try:
                md = Peer(group, comm.rank, leaders[(i - 1) // 2], tag, deadline, f"{op}/publish").recv_blob(
                    "the metadata")
            except Exception as e:  # noqa: BLE001 - passed on to the children, then raised
                failure, md = e, None
        for child in children:
            Peer(group, comm.rank, child, tag, deadline, f"{op}/publish").send_blob(md, "the metadata", str(failure))
        if failure is not None:
            raise failure
        return md


def clear_newer(root, name: str) -> None:
    """Before a save of step directory `name`: steps of this root at or after it belong to a timeline the
    job has left (it resumed from an earlier step), and must never pass for the job's. The step's own
    directory loses its metadata and data files; a later one goes whole if it holds anything (an
    empty one may be the directory the next save's call just made)."""
    step = layout.BCP_STEPS.step_of(name)
    for entry in root.listdir():
        other = layout.BCP_STEPS.step_of(entry)
        if other is None or other < step:
            continue
        if other == step:
            for stale in (METADATA_FILE, FAILED_FILE):
                if root.exists(f"{entry}/{stale}"):
                    root.remove(f"{entry}/{stale}")
            for f in root.listdir(f"{entry}/data"):
                root.remove(f"{entry}/data/{f}")
        elif root.exists(f"{entry}/{METADATA_FILE}") or root.listdir(f"{entry}/data"):
            root.remove(f"{entry}/{METADATA_FILE}")
            root.remove(entry)


def rewind_durable(durable, step: int) -> None:
    """The coordinator, at a job's first tiered save (of `step`): if the durable root's `latest` names
    a step at or after it, that step is of a timeline the job has left (it resumed from an earlier
    step, or started over), and recovery must not take it for the job's. `latest` goes back to the
    newest complete step before `step`, or away if there is none; nothing is deleted (the old steps
    stay loadable by their paths until a drain of the same step replaces them)."""
    name = layout.read_tracker(durable)
    current = layout.BCP_STEPS.step_of(name) if name else None
    if current is None or current < step:
        return
    older = [e for e in layout.list_checkpoints(durable) if e.complete and e.step is not None and e.step < step]
    if older:
        layout.write_tracker(durable, older[-1].name)
    else:
        durable.remove(TRACKER_FILE)
    log.warning("bcp: %s named %s, at or after step %d that this job saves now: it is of a timeline the job has "
                "left; it now names %s", durable.join(TRACKER_FILE), name, step,
                older[-1].name if older else "nothing")


def _take_back(request: SaveRequest) -> None:
    """A node leader whose node recorded a step that not every node could: it is not committed."""
    try:
        request.ckpt.remove(METADATA_FILE)
    except Exception as e:  # noqa: BLE001 - the save's own error is what the caller needs
        log.error("bcp: could not take back the metadata of the failed %s: %s", request.what, e)
