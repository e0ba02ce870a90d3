"""A tiered load's bytes between nodes: the ranges a node's ranks read that it lacks, who sends
each (`schedule`: a rank of the least loaded node holding the file, to one rank of the needing
node), the view they land in (`make_view`: the node's files linked, a sparse file for each it
lacks) and the transfers (`transfer`, in one order on every rank, every wait bounded), with the
records they travel in.
recovery.py decides what to load and runs the load on the view.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

from .. import codec
from ..comm import Comm
from ..errors import BCPError
from ..metadata import METADATA_FILE
from ..shared_reads import LoadFailure, raise_failures
from ..storage import Storage
from ..storage.base import TempFile, temp_writer_gone, this_host
from ..utils import human_bytes
from .placement import nodes_of
from .transport import Peer, tier_group

log = logging.getLogger("bcp")


@codec.record
@dataclass(frozen=True)
class Choice:
    """The coordinator's choice, for every rank: the step and its tier ("memory", "durable"); for
    memory, the rank whose node holds its metadata, each file's size and holding nodes, and the
    load's name for its views (`VIEW_PREFIX`...: each node's view adds its maker, `view_name`).
    `error`: no step can be loaded."""

    tier: str
    step: int
    path: str
    metadata_from: int
    files: tuple
    sizes: tuple
    holders: tuple
    view: str
    error: str | None


@codec.record
@dataclass(frozen=True)
class Needs:
    """The byte ranges ([file index, start, end]) a rank's load reads, or why it cannot take part."""

    ranges: tuple
    failure: LoadFailure | None


@codec.record
@dataclass(frozen=True)
class Fetches:
    """A rank's part of the transfers ([peer rank, file index, start, end]: sent to, received from)."""

    sends: tuple
    receives: tuple
    failure: LoadFailure | None

def fetch(comm: Comm, op: str, choice: Choice, step: Storage, view: Storage, ranges, failure, deadline: float,
           timeout: timedelta) -> None:
    """The byte ranges this rank's load reads, into its node's view: the coordinator gathers every
    rank's, schedules the ranges each node lacks (`schedule`) and scatters each rank's part; the
    transfers run; the ranks agree. Raises on every rank if any failed (nothing read yet)."""
    mine = Needs(tuple(sorted(ranges)), None if failure is None else LoadFailure.of(comm.rank, failure))
    gathered = comm.gather(codec.to_wire(mine), f"{op}/needs", timeout)
    plans = None
    if comm.is_coordinator:
        needs = [codec.from_wire(n, Needs) for n in gathered]
        plans = plan_fetches(comm, choice, needs)
    fetches = codec.from_wire(comm.scatter([codec.to_wire(p) for p in plans] if plans is not None else None,
                                           f"{op}/fetches", timeout), Fetches)
    raise_failures([fetches.failure], failure)
    error = transfer(comm, step, view, choice, fetches, deadline, f"{op}/fetch", tag_of(op, 2), timeout)
    errors = comm.all_gather(None if error is None else codec.to_wire(LoadFailure.of(comm.rank, error)),
                             f"{op}/fetched", timeout)
    raise_failures([None if f is None else codec.from_wire(f, LoadFailure) for f in errors], error)

# ----------------------------------------------------------------------------- who sends what

def merged(ranges) -> set[tuple[int, int, int]]:
    """Overlapping or touching ranges of a file as one."""
    out: list[list[int]] = []
    for f, lo, hi in sorted(ranges):
        if out and out[-1][0] == f and lo <= out[-1][2]:
            out[-1][2] = max(out[-1][2], hi)
        else:
            out.append([f, lo, hi])
    return {tuple(r) for r in out}


def plan_fetches(comm: Comm, choice: Choice, needs: list[Needs]) -> list[Fetches]:
    """Coordinator: each rank's part of the transfers that bring every rank's needs into its node's
    view, or every rank's failure (the first rank's that failed, or a range the step has not)."""
    failures = [n.failure for n in needs if n.failure is not None]
    if failures:
        return [Fetches((), (), failures[0])] * comm.world_size
    node_ranks = nodes_of(comm.nodes)
    node_of = {r: x for x, ranks in enumerate(node_ranks) for r in ranks}
    wanted: dict[int, set] = {}
    for r, n in enumerate(needs):
        for f, lo, hi in n.ranges:
            if not (type(f) is int and type(lo) is int and type(hi) is int and 0 <= f < len(choice.files)
                    and 0 <= lo < hi <= choice.sizes[f]):
                failure = LoadFailure(r, "BCPError", f"asked for bytes [{lo}, {hi}) of file {f}, which step "
                                                     f"{choice.step} does not have")
                return [Fetches((), (), failure)] * comm.world_size
            wanted.setdefault(node_of[r], set()).add((f, lo, hi))
    return schedule(choice, node_ranks, wanted)


def schedule(choice: Choice, node_ranks: tuple, wanted: dict[int, set]) -> list[Fetches]:
    """Who sends which range to whom: each range a node wants in a file it lacks (merged) is sent
    once, by a rank of a node holding the file with the fewest bytes to send so far, to the rank of
    the wanting node with the fewest to receive; in one order every rank follows (file, start,
    node). The same on every rank given the same arguments."""
    world = sum(len(r) for r in node_ranks)
    sent, received, node_sent = [0] * world, [0] * world, [0] * len(node_ranks)
    transfers = []
    for x, ranges in sorted(wanted.items()):
        for f, lo, hi in sorted(merged(r for r in ranges if x not in choice.holders[r[0]])):
            y = min(choice.holders[f], key=lambda y: (node_sent[y], y))
            src = min(node_ranks[y], key=lambda r: (sent[r], r))
            dst = min(node_ranks[x], key=lambda r: (received[r], r))
            node_sent[y] += hi - lo
            sent[src] += hi - lo
            received[dst] += hi - lo
            transfers.append((f, lo, x, src, dst, hi))
    transfers.sort()
    if transfers:
        log.info("bcp: recovery moves %s between nodes in %d ranges", human_bytes(sum(t[5] - t[1] for t in transfers)),
                 len(transfers))
    return [Fetches(tuple((dst, f, lo, hi) for f, lo, _, src, dst, hi in transfers if src == r),
                    tuple((src, f, lo, hi) for f, lo, _, src, dst, hi in transfers if dst == r), None)
            for r in range(world)]

# ----------------------------------------------------------------------------- the view and the transfers

def tag_of(op: str, kind: int) -> int:
    """The point-to-point tag of one kind of message of load `op` ("l<n>/..."): never one an earlier
    load used, so a message an earlier failed load left unreceived is never taken for this one's."""
    return int(op.split("/")[0][1:]) * 4 + kind


VIEW_PREFIX = ".bcp-recover-"  # a load's view of a step in a node's memory (not a step: no layout lists it)
# `view_name`: the load's name, then the host and process of the node leader that made the view
_VIEW_NAME = re.compile(r"^" + re.escape(VIEW_PREFIX) + r"\d+-[0-9a-f]+\.([A-Za-z0-9-]+)\.(\d+)$")


def view_name(load: str) -> str:
    """The name of this node's view for load `load` (`Choice.view`), made by this process: it names
    the process, so that a view whose load was killed before removing it is found
    (`remove_stale_views`)."""
    return f"{load}.{this_host()}.{os.getpid()}"


def remove_stale_views(root: Storage) -> None:
    """A node leader: remove the views in this node's memory whose maker has ended (a load killed
    before its own removal; its links would hold a step's memory for good). A view of a process
    that runs (a load in progress), or of another host, stays. Failures are logged."""
    try:
        for name in root.listdir():
            m = _VIEW_NAME.match(name)
            if m is None or not temp_writer_gone(TempFile(name, m.group(1), int(m.group(2)))):
                continue
            try:
                root.remove(name)
                log.info("bcp: removed %s, left by a load that ended before removing it", root.join(name))
            except Exception as e:  # noqa: BLE001 - it stays; the next look tries again
                log.warning("bcp: could not remove %s, left by a load that ended: %s", root.join(name), e)
    except Exception as e:  # noqa: BLE001 - nothing depends on it
        log.warning("bcp: could not look for views left by ended loads in %s: %s", root.root, e)


def make_view(root: Storage, view: Storage, name: str, choice: Choice, md: bytes | None) -> bool:
    """A node leader: the step as this node's ranks will load it. The metadata; each file the node
    holds, linked; each file it lacks, a sparse file of its size (holes read as zeros; the ranges the
    node needs are written into it by the transfers, and a load reads nothing else, every block
    verified). Whether it lacked any."""
    view.makedirs("data")
    if md is None:  # not relayed to the leader (it is, to every rank): cannot happen
        raise BCPError("the step's metadata did not reach this node")
    view.write_atomic(METADATA_FILE, md)
    step = root.child(name)
    lacked = False
    for f, size in zip(choice.files, choice.sizes):
        target = view._path(f)
        if step.exists(f) and step.size(f) == size:
            os.link(step._path(f), target, follow_symlinks=False)
            continue
        lacked = True
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
    return lacked


def transfer(comm: Comm, step: Storage, view: Storage, choice: Choice, fetches: Fetches, deadline: float, op: str,
              tag: int, timeout: timedelta) -> BaseException | None:
    """This rank's sends (from this node's copy of the step) and receives (into the view), in the
    global order every rank follows, so they never deadlock; the first error, or None."""
    if not fetches.sends and not fetches.receives:
        return None
    group = tier_group(comm, timeout)
    errors: list[BaseException] = []

    def send_all() -> None:
        maps: dict[int, memoryview] = {}
        for dst, f, lo, hi in fetches.sends:
            try:
                if f not in maps:
                    maps[f] = step.map(choice.files[f])
                Peer(group, comm.rank, dst, tag, deadline, op).send_parts(maps[f][lo:hi], choice.files[f])
            except Exception as e:  # noqa: BLE001 - reported at the agreement
                errors.append(e)
                return

    sender = threading.Thread(target=send_all, name="bcp-recover-send")
    sender.start()
    fds: dict[int, int] = {}  # file -> a descriptor of the view's file, where its bytes land

    def sink(fd: int, lo: int, name: str):
        def land(part: memoryview, at: int) -> None:
            if errors:
                return  # the rest is still received (no peer is left waiting), and dropped
            try:
                done = 0
                while done < len(part):
                    done += os.pwrite(fd, part[done:], lo + at + done)
            except OSError as e:
                errors.append(OSError(e.errno, f"writing {name} bytes [{lo + at}, {lo + at + len(part)}) of the "
                                               f"recovery view: {e.strerror}"))
        return land

    try:
        for src, f, lo, hi in fetches.receives:
            if f not in fds:
                fds[f] = os.open(view._path(choice.files[f]), os.O_WRONLY | os.O_NOFOLLOW)
            Peer(group, comm.rank, src, tag, deadline, op).recv_parts(hi - lo, choice.files[f],
                                                                      sink(fds[f], lo, choice.files[f]))
    except Exception as e:  # noqa: BLE001 - reported at the agreement
        errors.append(e)
    finally:
        sender.join(max(deadline - time.monotonic(), 0) + 5)
        for fd in fds.values():
            os.close(fd)
    return errors[0] if errors else None
