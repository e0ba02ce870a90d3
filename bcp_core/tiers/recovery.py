"""Recovery: `bcp.load(tiers, state)` loads the newest whole step, wherever its pieces survive.

    holdings   each node's leader lists the steps in its memory: the data files it holds, and the
               metadata where it was recorded (with the files it names)
    choice     the coordinator takes the newest step whose metadata some node holds and whose every
               file some node holds; the durable root's latest step instead if it is newer (or if
               memory has no whole step). Steps are never mixed: every byte comes from one step
    memory     the metadata goes to every rank (a tree from a node holding it). Each node makes a
               view of the step in its memory: the files it holds linked into it, a sparse copy of
               each file it lacks. The ordinary load runs on the view: once it has planned its reads
               (resharded to this job's layout), each rank names the byte ranges they need, the
               coordinator has each range a node lacks sent by a rank of a node holding it (the
               least loaded) to one rank of the needing node, over the network (transport.py), and
               the ranks agree that all arrived (fetch.py); only then is anything read, every block
               verified, all or nothing. The sharded objects' pieces (read while the load is
               planned) are brought first. The view is removed after.
    durable    the ordinary load of the durable step

`locate` does the first two (and gives every rank the step's metadata), `Located.load` the rest.
Nothing of the caller's state changes before the final load, which itself changes nothing unless
every byte was read and verified on every rank; every exchange and transfer is bounded by the
load's timeout.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from dataclasses import dataclass
from datetime import timedelta

import xxhash

from .. import codec
from ..comm import DEFAULT_TIMEOUT, Comm
from ..engine.read import item_span
from ..errors import (BCPError, ChecksumError, CommTimeoutError, DamagedStepError, IncompleteCheckpointError,
                      NotACheckpointError)
from ..layout import BCP_STEPS, read_tracker
from ..loader import LoadResult, _load_op, load_checkpoint, read_metadata
from ..metadata import METADATA_FILE, CheckpointMetadata, file_pieces, read_metadata_file
from ..shared_reads import LoadFailure, raise_failures
from ..storage import storage_for
from ..storage.base import parse_temp_name
from .copy_check import CopyCheck
from .fetch import (VIEW_PREFIX, Choice, fetch, make_view, merged, remove_stale_views, schedule, tag_of, transfer,
                    view_name)
from .placement import nodes_of
from .policy import Tiers
from .transport import Peer, tier_group

log = logging.getLogger("bcp")


# ----------------------------------------------------------------------------- records

@codec.record
@dataclass(frozen=True)
class StepHeld:
    """One step in one node's memory: the digest of its metadata where recorded there (and the
    data files it names), and the data files the node holds with their sizes."""

    step: int
    metadata: str | None
    needs: tuple
    files: tuple
    sizes: tuple


@codec.record
@dataclass(frozen=True)
class NodeHoldings:
    """What a node's leader found in its memory tier, or why it could not look."""

    steps: tuple[StepHeld, ...]
    error: str | None


# ----------------------------------------------------------------------------- the load

def load_tiered(tiers: Tiers, state: dict, framework: str = "auto", strict: bool = True, *, process_group=None,
                allow_pickle: bool = False, verify_checksums: bool = True, num_threads: int = 4,
                share_reads: bool | None = None, timeout: timedelta = DEFAULT_TIMEOUT, mapping=None) -> LoadResult:
    """`bcp_core.load(tiers, state)` (module doc): `locate`, then `Located.load`; where damaged
    copies set aside leave the step incomplete in memory (`DamagedStepError`), the newest whole
    step then (an older one in memory, or the durable one). Collective."""
    if mapping is not None:
        raise ValueError("a mapped load reads one checkpoint: load the step of a tiered root by its path "
                         "(Tiers.durable's step directory) with mapping=")
    return load_newest(tiers, lambda _: state, process_group=process_group, timeout=timeout, framework=framework,
                       strict=strict, allow_pickle=allow_pickle, verify_checksums=verify_checksums,
                       num_threads=num_threads, share_reads=share_reads)[2]


def load_newest(tiers: Tiers, state_for, *, process_group=None, timeout: timedelta = DEFAULT_TIMEOUT,
                **load_args) -> tuple[Located, dict, LoadResult]:
    """`locate`, then `Located.load` of the state `state_for(located)` makes (a caller that asks the
    step's metadata what to load makes it there); where damaged copies set aside leave that step
    incomplete in memory (`DamagedStepError`), the same with the newest whole step then, at most
    `SET_ASIDE_ROUNDS` more times. The located step, the state loaded and the load's result.
    Collective."""
    for round_ in range(SET_ASIDE_ROUNDS + 1):
        located = locate(tiers, process_group=process_group, timeout=timeout)
        state = state_for(located)
        try:
            return located, state, located.load(state, **load_args)
        except DamagedStepError as e:
            if round_ == SET_ASIDE_ROUNDS:
                raise
            log.warning("bcp: %s; loading that step", e)
    raise AssertionError("unreachable")


def locate(tiers: Tiers, *, process_group=None, timeout: timedelta = DEFAULT_TIMEOUT) -> Located:
    """The step a load of `tiers` would load, with its metadata on every rank, before anything is
    read into a state (an integration asks the metadata which keys to load). Collective."""
    comm, op = _load_op(process_group)
    held, found = None, {}
    if comm.rank in comm.node_leaders:
        held, found = _holdings(tiers)
    gathered = comm.gather(codec.to_wire(held) if held is not None else None, f"{op}/holdings", timeout)
    choice = None
    if comm.is_coordinator:
        try:
            choice = _choose(tiers, comm, [codec.from_wire(h, NodeHoldings) if h is not None else None
                                           for h in gathered])
        except Exception as e:  # noqa: BLE001 - every rank raises it
            choice = Choice("", -1, "", -1, (), (), (), "", f"{type(e).__name__}: {e}")
    choice = codec.from_wire(comm.broadcast(codec.to_wire(choice) if choice is not None else None,
                                            f"{op}/choice", timeout), Choice)
    if choice.error is not None:
        kind = NotACheckpointError if choice.error.startswith("NotACheckpointError") else IncompleteCheckpointError
        raise kind(choice.error.split(": ", 1)[-1])
    failure, md, md_bytes = None, None, None
    try:
        if choice.tier == "durable":
            md = read_metadata(storage_for(choice.path))
        else:
            md_bytes = found.get(choice.step) if comm.rank == choice.metadata_from else None
            md_bytes = _spread_metadata(comm, choice.metadata_from, md_bytes,
                                        time.monotonic() + timeout.total_seconds(), f"{op}/metadata", timeout,
                                        tag_of(op, 0))
            md = CheckpointMetadata.loads(md_bytes, source=f"{choice.path}/{METADATA_FILE}")
            if tuple(md.files) != tuple(choice.files):
                raise BCPError(f"the metadata of step {choice.step} names other files than the one chosen")
    except Exception as e:  # noqa: BLE001 - every rank must hear of it
        failure = e
    failures = comm.all_gather(None if failure is None else codec.to_wire(LoadFailure.of(comm.rank, failure)),
                               f"{op}/located", timeout)
    raise_failures([None if f is None else codec.from_wire(f, LoadFailure) for f in failures], failure)
    return Located(tiers, choice.step, choice.tier, choice.path, md, comm, op, choice, md_bytes, process_group,
                   timeout)


@dataclass
class Located:
    """A step of a tiered root found for loading (`locate`): its number, its tier ("memory",
    "durable"), its path and metadata. `load` loads it (once)."""

    tiers: Tiers
    step: int
    tier: str
    path: str
    metadata: CheckpointMetadata
    comm: Comm
    op: str
    choice: Choice
    md_bytes: bytes | None
    process_group: object
    timeout: timedelta

    def load(self, state: dict, framework: str = "auto", strict: bool = True, *, allow_pickle: bool = False,
             verify_checksums: bool = True, num_threads: int | None = 4,
             share_reads: bool | None = None, failure: Exception | None = None) -> LoadResult:
        """Load the step into `state`, resharded, as `bcp_core.load` does. Collective. `failure`: this
        rank's error in making `state`, raised on every rank (`loader.load_checkpoint`)."""
        num_threads = num_threads or 4
        if self.tier == "durable":
            log.info("bcp: loading step %d from durable storage %s", self.step, self.path)
            result = load_checkpoint(self.path, state, framework, strict, process_group=self.process_group,
                                     allow_pickle=allow_pickle, verify_checksums=verify_checksums,
                                     num_threads=num_threads, share_reads=share_reads, timeout=self.timeout,
                                     failure=failure)
        else:
            log.info("bcp: loading step %d from the nodes' memory (%s)", self.step, self.tiers.memory)
            result = self._from_copies(state, framework, strict, allow_pickle, verify_checksums, num_threads,
                                       failure)
        result.step, result.tier = self.step, self.tier
        return result

    def _from_copies(self, state: dict, framework: str, strict: bool, allow_pickle: bool, verify_checksums: bool,
                     num_threads: int, failure: Exception | None = None) -> LoadResult:
        """The step from the nodes' memory; where the load found damaged bytes (ChecksumError, the
        state untouched), the nodes holding the files it named check their copies, set aside those
        that are damaged (`_set_aside_damaged`), and the step is loaded again from the copies left,
        up to `SET_ASIDE_ROUNDS` times. If the step is no longer whole in memory, DamagedStepError
        says which step a new load finds (`bcp.load` of the tiers then loads it)."""
        at = self
        for round_ in range(SET_ASIDE_ROUNDS + 1):
            try:
                return _load_from_memory(at, state, framework, strict, allow_pickle, verify_checksums, num_threads,
                                         failure)
            except CommTimeoutError:
                raise  # a rank may be gone: no further exchange
            except Exception as e:  # every rank fails a load alike: they agree on what was damaged
                if round_ == SET_ASIDE_ROUNDS or not _set_aside_damaged(at, e):
                    raise
                again = locate(at.tiers, process_group=at.process_group, timeout=at.timeout)
                if (again.tier, again.step) != (at.tier, at.step):
                    raise DamagedStepError(f"{e}; the damaged copies were set aside, which leaves step {at.step} "
                                           f"incomplete in memory: a new load finds step {again.step} "
                                           f"({again.tier})", file=getattr(e, "file", None)) from e
                log.warning("bcp: loading step %d again, from the copies left", at.step)
                at = again
        raise AssertionError("unreachable")


def _load_from_memory(at: Located, state: dict, framework: str, strict: bool, allow_pickle: bool,
                      verify_checksums: bool, num_threads: int, failure: Exception | None = None) -> LoadResult:
    """The step from the nodes' memory (module doc): each node's view of it, the sharded objects'
    pieces it lacks (every rank computes the same schedule from the metadata: no exchange), then the
    ordinary load of the view, which brings the byte ranges its items need before reading them
    (`prefetch`). Each rank loads its own node's view."""
    comm, op, choice, timeout, md = at.comm, at.op, at.choice, at.timeout, at.metadata
    root = at.tiers.memory_root()
    name = BCP_STEPS.name(choice.step)
    step = root.child(name)
    deadline = time.monotonic() + timeout.total_seconds()
    node_ranks = nodes_of(comm.nodes)
    error: BaseException | None = None
    made = view_name(choice.view) if comm.rank in comm.node_leaders else None  # the view this rank makes
    lacked = False  # whether this node's view has files the transfers fill
    try:
        if made is not None:
            lacked = make_view(root, root.child(made), name, choice, at.md_bytes)
    except Exception as e:  # noqa: BLE001 - the load below fails on every rank, reading what is not there
        error = e
    try:
        # every node's view exists before a byte is written into it; each rank learns its node's
        views = comm.all_gather(made, f"{op}/views", timeout)
        view = root.child(views[next(ranks[0] for ranks in node_ranks if comm.rank in ranks)])
        view.node_local = True  # this node's own: a range of it is never read for another node's ranks
        # a sharded object's pieces (a loader's state: small) are read while the load is planned
        objects = {(p.file, p.byte_offset, p.byte_offset + p.nbytes)
                   for so in md.sharded_objects.values() for p in so.shards if p.nbytes}
        wanted = {x: objects for x in range(len(node_ranks))}
        if error is None:
            error = transfer(comm, step, view, choice, schedule(choice, node_ranks, wanted)[comm.rank], deadline,
                              f"{op}/objects", tag_of(op, 1), timeout)

        def prefetch(items, failure: BaseException | None) -> None:
            failure = failure or error
            ranges = set()
            for it in items:
                lo, hi = item_span(it, md.checksum_block_bytes, True)
                if hi > lo:
                    ranges.add((it.piece.file, it.piece.byte_offset + lo, it.piece.byte_offset + hi))
            fetch(comm, op, choice, step, view, merged(ranges), failure, deadline, timeout)

        # each rank's own node's view (a node-local directory lies at another path on each node)
        result = load_checkpoint(view, state, framework, strict, process_group=at.process_group,
                                 allow_pickle=allow_pickle, verify_checksums=verify_checksums,
                                 num_threads=num_threads, share_reads=True, timeout=timeout, prefetch=prefetch,
                                 metadata=md, failure=failure)
        result.path = step.root
        return result
    finally:
        try:
            comm.barrier(f"{op}/done", timeout)
        except Exception as e:  # noqa: BLE001 - the view goes anyway: mapped files stay readable to whoever maps them
            log.warning("bcp: rank %d: waiting for the other ranks to finish recovering: %s", comm.rank, e)
        if made is not None:
            try:
                # with files received into it, retired rather than freed: they become the spares the
                # node's next save writes into (MemoryStorage.retire), and freeing them is not waited
                # for here; a view of links only is removed (the node's spares stay)
                (root.retire if lacked else root.remove)(made)
            except Exception as e:  # noqa: BLE001 - the load's own outcome is what the caller needs
                log.warning("bcp: could not remove the recovery view %s: %s", root.join(made), e)


# ----------------------------------------------------------------------------- damaged copies

# Loads again after damaged copies were set aside (each round sets aside at least one copy).
SET_ASIDE_ROUNDS = 2
# How long the ranks wait for each other to agree on what was damaged. They fail a load together,
# within moments; a rank whose error came after the load's agreement (its own, while the others
# succeeded) never comes, and each rank then raises its own error.
AGREE_TIMEOUT = timedelta(seconds=60)
DAMAGED_SUFFIX = ".damaged"  # a copy set aside: data/<file>.damaged (no load names it; it goes with the step)


def _set_aside_damaged(at: Located, error: BaseException) -> bool:
    """After a load of step `at` failed: the ranks agree on the data files whose bytes failed their
    checksums (ChecksumError.file, on the ranks that found them); each node leader holding one
    checks its copy against the metadata (the checksums of every piece it lists) and renames a
    damaged one out of the step
    (`DAMAGED_SUFFIX`). Whether any copy was set aside (then a new `locate` sees the step without
    it). Collective; every exchange bounded by the load's timeout."""
    comm, op, choice = at.comm, f"{at.op}/damaged", at.choice
    file = getattr(error, "file", None) if isinstance(error, ChecksumError) else None
    try:
        named = sorted({f for f in comm.all_gather(file, f"{op}/named", min(at.timeout, AGREE_TIMEOUT))
                        if f in choice.files})
    except CommTimeoutError as e:
        log.warning("bcp: rank %d: the ranks did not agree on damaged copies (%s); raising the load's error",
                    comm.rank, str(e).splitlines()[0])
        return False
    if not named:
        return False
    found: list[str] = []
    if comm.rank in comm.node_leaders:
        pieces = file_pieces(at.metadata)
        step = at.tiers.memory_root().child(BCP_STEPS.name(at.step))
        for rel in named:
            try:
                if not step.exists(rel):
                    continue
                data = step.map(rel)
                # only the pieces the metadata lists: a file may hold more (a per-rank value several
                # ranks saved alike is listed once), and no load reads those
                check = CopyCheck.for_file(data, pieces.get(choice.files.index(rel), ()),
                                           at.metadata.checksum_block_bytes, only_pieces=True)
                check.feed(data, 0)
                wrong = check.wrong()
                del data, check
                if wrong:
                    os.rename(step._path(rel), step._path(rel + DAMAGED_SUFFIX))
                    found.append(f"{step.join(rel)} {wrong}")
            except Exception as e:  # noqa: BLE001 - this copy stays; the load's own error is raised
                log.warning("bcp: rank %d: could not check or set aside %s: %s", comm.rank, step.join(rel), e)
    gathered = comm.all_gather(found, f"{op}/set-aside", at.timeout)
    damaged = [d for g in gathered for d in (g or [])]
    if damaged:
        log.warning("bcp: damaged copies of step %d set aside (renamed *%s): %s", at.step, DAMAGED_SUFFIX,
                    "; ".join(damaged))
    return bool(damaged)


# ----------------------------------------------------------------------------- holdings and the choice

def _holdings(tiers: Tiers) -> tuple[NodeHoldings, dict[int, bytes]]:
    """A node leader: the steps in this node's memory (and the metadata bytes of each, by step)."""
    found: dict[int, bytes] = {}
    try:
        root = tiers.memory_root()
        remove_stale_views(root)
        steps = []
        for entry in root.listdir():
            step = BCP_STEPS.step_of(entry)
            if step is None:
                continue
            files = [f"data/{f}" for f in root.listdir(f"{entry}/data") if parse_temp_name(f) is None]
            sizes = [root.size(f"{entry}/{f}") for f in files]
            digest, needs = None, ()
            if root.exists(f"{entry}/{METADATA_FILE}"):
                try:
                    data = read_metadata_file(root.child(entry))
                    needs = CheckpointMetadata.loads(data, source=root.join(f"{entry}/{METADATA_FILE}")).files
                    digest, found[step] = xxhash.xxh3_64_hexdigest(data), data
                except (BCPError, OSError) as e:
                    log.warning("bcp: step %d in %s: its metadata is unreadable (%s); not a candidate", step,
                                root.root, e)
            steps.append(StepHeld(step, digest, tuple(needs), tuple(files), tuple(sizes)))
        return NodeHoldings(tuple(steps), None), found
    except Exception as e:  # noqa: BLE001 - the coordinator treats this node as holding nothing, and says why
        return NodeHoldings((), f"{type(e).__name__}: {e}"), found


def _choose(tiers: Tiers, comm: Comm, holdings: list[NodeHoldings | None]) -> Choice:
    """The newest whole step in memory, or the durable latest if newer (module doc)."""
    node_ranks = nodes_of(comm.nodes)
    by_node = [h for h in holdings if h is not None]  # the leaders', in node order
    for x, h in enumerate(by_node):
        if h.error is not None:
            log.warning("bcp: node %d (rank %d) could not list its memory tier: %s", x, node_ranks[x][0], h.error)
    durable_step, durable_path = _durable_latest(tiers)
    lacking: list[str] = []
    steps = sorted({s.step for h in by_node for s in h.steps}, reverse=True)
    for step in steps:
        if durable_step is not None and step < durable_step:
            break
        held = [(x, s) for x, h in enumerate(by_node) for s in h.steps if s.step == step]
        recorded = [(x, s) for x, s in held if s.metadata is not None]
        if not recorded:
            lacking.append(f"step {step}: no node holds its metadata (never committed)")
            continue
        if len({s.metadata for _, s in recorded}) > 1:
            lacking.append(f"step {step}: nodes hold different metadata for it")
            continue
        files = recorded[0][1].needs
        sizes, holders, missing = [], [], []
        for f in files:
            have = [(x, s.sizes[s.files.index(f)]) for x, s in held if f in s.files]
            size = max((sz for _, sz in have), key=[sz for _, sz in have].count, default=None)
            nodes = [x for x, sz in have if sz == size]
            if not nodes:
                missing.append(f)
            sizes.append(size or 0)
            holders.append(nodes)
        if missing:
            lacking.append(f"step {step}: {len(missing)} of its {len(files)} files survive on no node "
                           f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})")
            continue
        if lacking:
            log.warning("bcp: newer steps in memory are not whole: %s", "; ".join(lacking))
        return Choice("memory", step, f"{tiers.memory}/{BCP_STEPS.name(step)}",
                      node_ranks[recorded[0][0]][0], tuple(files), tuple(sizes), tuple(map(tuple, holders)),
                      f"{VIEW_PREFIX}{step}-{secrets.token_hex(4)}", None)
    if durable_step is not None:
        if lacking:
            log.warning("bcp: no whole step in memory newer than step %d in durable storage: %s", durable_step,
                        "; ".join(lacking))
        return Choice("durable", durable_step, durable_path, -1, (), (), (), "", None)
    where = f"{tiers.memory} on {len(by_node)} node(s)" + (f" and {tiers.durable}" if tiers.durable else "")
    if not steps:
        raise NotACheckpointError(f"no checkpoint in {where}")
    raise IncompleteCheckpointError(f"no whole step in {where}: {'; '.join(lacking)}")


def _durable_latest(tiers: Tiers) -> tuple[int | None, str | None]:
    """The step the durable root's tracker names, if complete: drains write it, and a job that left a
    timeline moves it back (memory_tier.rewind_durable), so no newer step of another timeline is
    taken (a scan for the newest complete one would)."""
    if tiers.durable is None:
        return None, None
    durable = tiers.durable_root()
    name = read_tracker(durable)
    step = BCP_STEPS.step_of(name) if name else None
    if step is None or not durable.exists(f"{name}/{METADATA_FILE}"):
        return None, None
    return step, durable.join(name)


# ----------------------------------------------------------------------------- the metadata, the needs

def _spread_metadata(comm: Comm, holder: int, data: bytes | None, deadline: float, op: str,
                     timeout: timedelta, tag: int) -> bytes:
    """The metadata from rank `holder` to every rank, down a binary tree rooted at it."""
    if comm.world_size == 1:
        return data
    order = [holder] + [r for r in range(comm.world_size) if r != holder]
    i = order.index(comm.rank)
    group = tier_group(comm, timeout)
    failure = None
    if i > 0:
        try:
            data = Peer(group, comm.rank, order[(i - 1) // 2], tag, deadline, op).recv_blob("the metadata")
        except Exception as e:  # noqa: BLE001 - passed on to the children, then raised
            failure, data = e, None
    for c in (2 * i + 1, 2 * i + 2):
        if c < len(order):
            Peer(group, comm.rank, order[c], tag, deadline, op).send_blob(data, "the metadata", str(failure))
    if failure is not None:
        raise failure
    return data
