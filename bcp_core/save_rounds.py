"""The rounds of one save between its ranks: agree on a plan, then commit.

    agree:  PlanRequest -> coordinator -> UseCachedPlan | PlanReply (| ResendStructure, plan again)
    commit: WriteReport -> coordinator -> metadata file, tracker -> Committed | SaveFailed

Each round sends every rank's request up to the coordinator, which decides, and its answer back
down (`SaveRounds.round`). Every rank takes part in every round of every save, even when the save
failed on this rank before anything was sent: its error travels with its request, so every rank
fails that save alike. The messages carry the save's `SaveId`, which the coordinator checks, so a
rank never pairs one save's report with another's.

Whether to reuse a cached plan is agreed, not decided by each rank alone: each rank names the
cached plan it would reuse (or sends its structure); the coordinator answers "use it" only if every
rank holds the same plan for its current structure, and otherwise plans again, within what each
rank staged. Multi-node jobs check at their first save to a root that every node sees the others'
files (`write_probe`, `check_probes`).
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
from collections import OrderedDict
from dataclasses import replace

from . import codec, layout, metrics
from .comm import Comm
from .errors import BCPError, CommitCallbackError, CommTimeoutError, MetadataError, SaveError
from .layout import write_tracker
from .metadata import FAILED_FILE, METADATA_FILE, CheckpointMetadata, read_metadata_file
from .plan_records import (Committed, GatheredRequests, PlanReply, PlanRequest, ResendStructure, SaveFailed, SaveId,
                           UseCachedPlan, WriteReport)
from .save_job import CachedPlan, SaveProgress, SaveRequest, rank_error
from .save_planner import (build_metadata, global_save_plan, merge_plan_messages, plan_message, plan_replies,
                           read_plan_messages)
from .storage import Storage
from .utils import gc_paused

log = logging.getLogger("bcp")

PLAN_CACHE_SIZE = 4
# Files the node leaders of a multi-node job write at its first save to a root, to check that
# every node sees what the others wrote.
PROBE_FILE = ".bcp-probe-n{}"


class SaveRounds:
    """The rounds of one role's saves, and the plans its ranks agreed on (a cache of the last few)."""

    def __init__(self):
        self._plans: OrderedDict[str, CachedPlan] = OrderedDict()
        self._lock = threading.Lock()  # the caller looks plans up while a save thread adds them
        # plans: the plans this rank learned (the coordinator: made), each counted once; cache_hits:
        # the calls that found a cached plan for their structure, so staged only its boxes. A call made
        # before the previous save's planning ended finds none, and its save may still reuse that plan.
        self.stats = {"plans": 0, "cache_hits": 0}
        # Data files are named <token>-<save number>-r<rank>_<k>: unique per job and save, so two
        # jobs writing one directory never overwrite each other's bytes. The coordinator's token
        # reaches the other ranks with the first plan.
        self.token = secrets.token_hex(4)
        self._plan_ids = 0     # plans made by this rank as coordinator

    def cached(self, key: str) -> CachedPlan | None:
        """The plan this rank would reuse for the structure `key` (the job agrees in `agree`)."""
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
                self.stats["cache_hits"] += 1
            return plan

    def forget_in_child(self) -> None:
        self._lock = threading.Lock()  # another thread of the parent may have held it at the fork

    # -- agree -------------------------------------------------------------------------------------

    def agree(self, comm: Comm, request: SaveRequest, progress: SaveProgress, op: str,
              resend: bool = False) -> CachedPlan:
        """The plan every rank uses for this save: the cached one if every rank holds it for its
        current structure, else a new one (module doc). Fails on every rank alike."""
        sid, plan = request.save, progress.plan
        if progress.error is not None or plan is None:
            ask = PlanRequest(sid, None, None, None, None, progress.error or f"rank {comm.rank}: nothing to save")
        elif progress.cached is not None and not resend:
            ask = PlanRequest(sid, plan.key, progress.cached.plan_id, None)
        else:
            ask = PlanRequest(sid, plan.key, None, plan.structure)
        answer = self.round(comm, request, f"{op}/plan", ask, self._decide)
        if isinstance(answer, ResendStructure):
            with self._lock:  # never reused again unless the new plan confirms it
                self._plans.pop(plan.key, None)
            writable = progress.snapshot.writable() if progress.snapshot is not None else None  # None: every box
            ask = PlanRequest(sid, plan.key, None, plan.structure,
                              None if writable is None else tuple(sorted(writable)))
            answer = self.round(comm, request, f"{op}/replan", ask, self._decide)
        if isinstance(answer, UseCachedPlan):
            return progress.cached
        self.token = answer.token
        if comm.is_coordinator:
            return self._plans[plan.key]
        agreed = CachedPlan(answer.assignment, answer.plan_id)
        self._remember(plan.key, agreed)
        return agreed

    def _decide(self, request: SaveRequest, gathered: GatheredRequests, world: int):
        """Coordinator: the answer to every rank's PlanRequest (one record, or one per rank)."""
        requests = gathered.requests
        _check_ids(requests, request.save)
        errors = [r.error for r in requests if r.error]
        if errors:
            raise SaveError("; ".join(errors))
        with self._lock:
            mine = self._plans.get(requests[0].key)
        if mine is not None and all(r.key == k for r, k in zip(requests, mine.rank_keys)):
            if all(r.plan == mine.plan_id for r in requests):
                answer: object = UseCachedPlan(request.save)
            elif all(r.plan is None or r.plan == mine.plan_id for r in requests):
                # some ranks do not hold the plan yet (an earlier save's planning ended after they
                # staged): they staged everything they hold, so the cached assignments fit them
                answer = [codec.to_wire(PlanReply(request.save, a, self.token, mine.plan_id))
                          for a in mine.gplan.assignments]
            else:
                answer = ResendStructure(request.save)
        elif all(r.structure is not None for r in requests):
            writable = [None if r.writable is None else {tuple(b) for b in r.writable} for r in requests]
            gplan = global_save_plan([r.structure for r in requests], writable, gathered.entries)
            self._plan_ids += 1
            plan_id = f"{self.token}.{self._plan_ids}"
            self._remember(requests[0].key, CachedPlan(gplan.assignments[0], plan_id, gplan,
                                                        tuple(r.key for r in requests)))
            answer = plan_replies(gplan, request.save, self.token, plan_id)
        else:
            answer = ResendStructure(request.save)
        if request.ckpt is not None and not isinstance(answer, ResendStructure):
            _begin(request.ckpt)
            request.ckpt.makedirs()
        return answer

    def _remember(self, key: str, plan: CachedPlan) -> None:
        with self._lock:
            known = self._plans.get(key)
            self._plans[key] = plan
            self._plans.move_to_end(key)
            while len(self._plans) > PLAN_CACHE_SIZE:
                self._plans.popitem(last=False)
            # a plan sent again (to a rank whose call came before the plan arrived) is not a new one
            if known is None or known.plan_id != plan.plan_id:
                self.stats["plans"] += 1

    # -- commit ------------------------------------------------------------------------------------

    def commit(self, comm: Comm, request: SaveRequest, progress: SaveProgress, report: WriteReport, op: str) -> None:
        """Gather every rank's report; the coordinator writes the metadata, then the tracker."""
        # this rank's phases so far travel with its report; intervals only while the job is small
        report = replace(report, metrics=tuple(metrics.records(intervals=comm.world_size <= 256)))
        commit = metrics.start("commit")

        def decide(request: SaveRequest, reports: list[WriteReport], world: int) -> Committed:
            _check_ids(reports, request.save)
            agreed = progress.agreed
            md = build_metadata(agreed.gplan, agreed.rank_keys, reports, request.framework, request.user_metadata)
            # from here on the save commits unless writing it fails, so no rank may give up on it now;
            # if one already has, it raised: none commits, every rank raises
            held = comm.settle(f"{op}/commit", _outcome(COMMIT, request.save))
            if held != _outcome(COMMIT, request.save):
                raise SaveError(held.removeprefix(_outcome(ABORT, request.save, "")))
            ckpt, root = request.ckpt, request.root
            if request.tiers is not None:  # recorded on every node after this round (tiers/memory_tier.py)
                progress.metadata = gc_paused(md.dumps)()
                commit.stop()
                return Committed(request.save)
            if progress.probe:
                for node in sorted(set(comm.nodes)):
                    ckpt.remove(PROBE_FILE.format(node))
            replaced = _committed_metadata(ckpt)  # a checkpoint already here stays until the rename below
            # the data files' directory entries, then the step directory's, are durable before the commit
            ckpt.sync_dir("data")
            ckpt.sync_dir()
            if request.tracker_name:
                root.sync_dir()
            else:
                ckpt.sync_entry()
            try:
                ckpt.write_atomic(METADATA_FILE, gc_paused(md.dumps)())
                if request.tracker_name:
                    write_tracker(root, request.tracker_name)
            except BaseException:
                _restore(ckpt, replaced)  # failed on every rank: the checkpoint it replaced is back
                raise
            _remove_replaced_files(ckpt, md, self.token, replaced)
            commit.stop()
            metrics.save_beside(ckpt, [metrics.records()] + [list(r.metrics) for r in reports[1:]])
            return Committed(request.save)

        self.round(comm, request, f"{op}/commit", report, decide)
        if request.tiers is not None:
            request.tiers.publish(comm, request, progress, op)
        commit.stop()
        progress.phase = "committed"
        if comm.is_coordinator and request.tracker_name and request.tiers is None:
            tidy_root(request)
        if request.on_commit is not None:
            try:
                request.on_commit(request.ckpt.root)
            except Exception as e:
                log.exception("bcp: rank %d: on_commit raised after %s was committed", comm.rank, request.ckpt.root)
                raise CommitCallbackError(f"{request.ckpt.root} was committed, but on_commit raised on rank "
                                          f"{comm.rank}: {type(e).__name__}: {e}") from e

    # -- one round -----------------------------------------------------------------------------------

    def round(self, comm: Comm, request: SaveRequest, op: str, ask, decide):
        """One exchange: every rank's request up to the coordinator, its answer back down (the same
        record for all, or one per rank). Raises SaveError on every rank if the answer is a failure."""
        planning = isinstance(ask, PlanRequest)  # its tensor entries merged on the way up
        committing = isinstance(ask, WriteReport)
        try:
            if planning:
                raw = comm.gather(plan_message(ask, comm.rank), op, request.timeout, merge=merge_plan_messages)
            else:
                raw = comm.gather(codec.to_wire(ask), op, request.timeout)
        except CommTimeoutError as e:  # tell the ranks that did arrive (leaders pass it on), then fail alike
            comm.broadcast(codec.to_wire(SaveFailed(request.save, str(e))), op, request.timeout)
            raise SaveError(f"{request.what} failed and was not committed: {e}") from None
        answer = None
        if comm.is_coordinator:
            try:
                records = read_plan_messages(raw, comm.world_size, request.save) if planning else \
                    _expect(raw, type(ask), request.save)
                answer = decide(request, records, comm.world_size)
            except Exception as e:  # noqa: BLE001 - sent to every rank so that every rank raises
                answer = SaveFailed(request.save, _message(e))
            if committing and isinstance(answer, SaveFailed):  # a rank giving up later finds it settled
                comm.settle(op, _outcome(ABORT, request.save, answer.error))
        if isinstance(answer, list):
            received = comm.scatter(answer, op, request.timeout)
        else:
            try:
                received = comm.broadcast(codec.to_wire(answer) if answer is not None else None, op,
                                          request.timeout)
            except CommTimeoutError as e:
                if not committing:
                    raise
                received = _answer_after_giving_up(comm, request, op, e)
        try:
            answer = codec.from_wire(received, (UseCachedPlan, ResendStructure, PlanReply, Committed, SaveFailed))
        except MetadataError as e:
            raise SaveError(f"{request.what}: unexpected answer from the coordinator: {e}") from None
        if isinstance(answer, SaveFailed):  # (its error names the identities when they differed)
            verb = "planned nothing" if op.endswith("plan") else "failed and was not committed"
            raise SaveError(f"{request.what} {verb}: {answer.error}")
        if answer.save != request.save:
            raise SaveError(f"{request.what}: this rank is at {request.save} but the coordinator answered for "
                            f"{answer.save}; the ranks' saves drifted apart")
        return answer


# The outcome of a commit round, settled once in the store (`Comm.settle`) by whichever comes first:
# the coordinator about to commit, or a rank that gave up waiting for its answer.
COMMIT, ABORT = "commit", "abort"


def _outcome(verdict: str, save: SaveId, why: str | None = None) -> str:
    return f"{verdict}|{save}" if why is None else f"{verdict}|{save}|{why}"


def _answer_after_giving_up(comm: Comm, request: SaveRequest, op: str, waited: CommTimeoutError):
    """A rank that waited too long for the commit round's answer (the coordinator still writing, or
    gone): the save fails on every rank, unless the coordinator had already begun to commit it; then
    its answer is on the way, and this rank waits for it once more."""
    held = comm.settle(op, _outcome(ABORT, request.save, f"rank {comm.rank} gave up waiting for the commit: {waited}"))
    if held != _outcome(COMMIT, request.save):  # this rank's abort, or the coordinator's failure
        raise SaveError(f"{request.what} failed and was not committed: "
                        f"{held.removeprefix(_outcome(ABORT, request.save, ''))}") from None
    try:
        return comm.broadcast(None, op, request.timeout)
    except CommTimeoutError as e:
        raise CommTimeoutError(f"{request.what}: the coordinator began committing it, but its answer never "
                               f"came, so whether it was committed is not known here: {e}") from None


# ----------------------------------------------------------------------------- probes (multi-node jobs)

def write_probe(comm: Comm, request: SaveRequest, progress: SaveProgress) -> None:
    """A node leader, before the plan round of a first save to a root of a multi-node job (which
    tells every leader that every probe is written): this node's probe file."""
    if progress.probe and progress.error is None and comm.rank in comm.node_leaders:
        try:
            request.ckpt.write_atomic(PROBE_FILE.format(comm.nodes[comm.rank]), str(request.save).encode())
        except Exception as e:  # noqa: BLE001 - reported with the request
            progress.error = rank_error(comm.rank, e)


def check_probes(comm: Comm, request: SaveRequest, progress: SaveProgress) -> None:
    """A node leader, after the plan round of a first save to a root of a multi-node job: every other
    node's probe file must be visible here, else the nodes do not share this storage."""
    if not (progress.probe and comm.rank in comm.node_leaders):
        return
    for node, leader in zip(sorted(set(comm.nodes)), comm.node_leaders):
        name = PROBE_FILE.format(node)
        if not request.ckpt.exists(name):
            raise SaveError(
                f"{request.ckpt.root} is not shared by every node of the job: rank {comm.rank} (node "
                f"{comm.nodes[comm.rank]}) does not see {name}, which rank {leader} (node {node}) wrote there. "
                "A multi-node job needs storage every node reaches (a shared file system or an object "
                "store); memory:// and node-local disks are per node (bcp.Tiers keeps checkpoints in each "
                "node's own memory, replicated to other nodes: docs/tiers.md)")


# ----------------------------------------------------------------------------- the coordinator's files

def mark_failed(request: SaveRequest, error: SaveError) -> None:
    """Coordinator, once a save failed on every rank: FAILED_FILE in its directory says so, with the
    error, so that `bcp ls`, a load and the next save's clean-up know it for a failed save rather than
    one in progress. Failures are logged: the save's own error is what the caller needs."""
    text = json.dumps({"save": str(request.save), "error": str(error)}, indent=1)
    try:
        if not request.ckpt.exists(METADATA_FILE):
            request.ckpt.write_atomic(FAILED_FILE, text.encode())
    except Exception as e:  # noqa: BLE001 - see above
        log.warning("bcp: could not mark the failed %s as failed: %s", request.what, e)


def _begin(ckpt: Storage) -> None:
    """A save into `ckpt` starts: an earlier failed save's mark goes (this one is in progress). A
    checkpoint committed there stays whole and loadable until this save's metadata replaces it, in
    one rename: data file names are unique per save, so this save writes none of its files."""
    if ckpt.exists(FAILED_FILE):
        ckpt.remove(FAILED_FILE)


def _committed_metadata(ckpt: Storage) -> bytes | None:
    """Coordinator, before its commit: the metadata of the checkpoint committed at this path, which
    the commit replaces (None if there is none, or if it cannot be read: a damaged one is replaced
    all the same)."""
    try:
        return read_metadata_file(ckpt) if ckpt.exists(METADATA_FILE) else None
    except Exception as e:  # noqa: BLE001 - this save commits whatever the one it replaces holds
        log.warning("bcp: the metadata this save replaces at %s cannot be read (%s)", ckpt.root, e)
        return None


def _restore(ckpt: Storage, replaced: bytes | None) -> None:
    """The commit failed while or after its metadata was written: the checkpoint it replaced comes
    back (its files were not touched), or, if there was none, the directory holds no checkpoint.
    The commit's own error is the one raised; a failure here is logged."""
    try:
        if replaced is not None:
            ckpt.write_atomic(METADATA_FILE, replaced)
        elif ckpt.exists(METADATA_FILE):
            ckpt.remove(METADATA_FILE)
    except Exception as e:  # noqa: BLE001 - see above
        log.error("bcp: the failed commit at %s could not be undone (%s): check it with `bcp verify`", ckpt.root, e)


def _remove_replaced_files(ckpt: Storage, md, token: str, replaced: bytes | None) -> None:
    """After a commit: the data files of the checkpoint it replaced, and this job's files of earlier
    saves to the same path (failed ones included). Other jobs' files are left alone: one may be
    writing here right now (`bcp prune` cleans up after crashed jobs). The checkpoint is committed:
    a failure here is logged."""
    keep = {f.split("/", 1)[1] for f in md.files}
    try:
        old = set()
        if replaced is not None:
            try:
                files = CheckpointMetadata.loads(replaced, ckpt.join(METADATA_FILE)).files
                # an imported checkpoint's files may lie outside data/: those are left alone
                old = {f.removeprefix("data/") for f in files if f.startswith("data/")}
            except MetadataError as e:  # a damaged checkpoint was replaced: its files are unknown
                log.warning("bcp: the checkpoint replaced at %s had unreadable metadata (%s): its data files "
                            "stay (bcp prune)", ckpt.root, e)
        for name in ckpt.listdir("data"):
            if name not in keep and (name in old or name.startswith(f"{token}-")):
                ckpt.remove(f"data/{name}")
    except Exception as e:  # noqa: BLE001 - see above
        log.warning("bcp: could not remove the files %s no longer uses: %s", ckpt.root, e)


def tidy_root(request: SaveRequest, what: str = "save", keep_name: str = "keep") -> None:
    """Coordinator, after a commit to a step of a root: leftovers of failed saves (`what`: "save",
    or a tiered step's "drain") go, then, with `request.keep` (the user's `keep_name`), the oldest
    checkpoints beyond it. Failures are logged: the checkpoint is committed."""
    root = request.root
    try:
        for name, error in layout.remove_leftovers(root, request.tracker_name).failed:
            log.warning("bcp: could not remove %s, left by a failed %s under %s: %s", name, what, root.root, error)
        if request.keep is not None:
            for name, error in layout.prune(root, request.keep).failed:
                log.warning("bcp: %s=%d: could not remove %s under %s: %s", keep_name, request.keep, name,
                            root.root, error)
    except Exception as e:  # noqa: BLE001 - see above
        log.warning("bcp: tidying %s after the %s of %s failed: %s", root.root, what, request.tracker_name, e)


# ----------------------------------------------------------------------------- the coordinator's checks

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


def _check_ids(records, save: SaveId) -> None:
    """Every rank's message belongs to this save (the same number, step and path)."""
    other = [(r, rec.save) for r, rec in enumerate(records) if rec.save != save]
    if other:
        r, theirs = other[0]
        raise SaveError(f"rank {r} is at {theirs} while rank 0 is at {save} ({len(other)} rank(s) differ): "
                        "every rank must save the same step to the same path")


def _message(e: Exception) -> str:
    return str(e) if isinstance(e, BCPError) else f"{type(e).__name__}: {e}"
