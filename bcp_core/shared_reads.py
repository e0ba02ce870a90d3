"""Shared reads on load: ranks that need the same bytes split the work (paper §4.1).

From remote storage, or when the job spans hosts, each byte range is read once across the job,
by one of the ranks that need it (worst-fit on bytes), and passed to the others over a gloo
group, overlapped with reading. Receivers verify the checksums themselves, so the transfer is
covered end to end.

On one host reading local files, the page cache already holds each byte once for all ranks and
is faster than any transfer; what the ranks would repeat is the checksum verification (a
Shard(0) -> Shard(1) load on N ranks needs a part of every block, so each rank would hash the
whole checkpoint). There each block is verified by one of the ranks that read it (worst-fit
again). Storage whose files are each node's own (memory://, `Storage.node_local`) is read so on
every node, each block verified once per node: another node's copy is other bytes. A host is a
machine and node (`Comm.nodes`), so nodes simulated on one machine are hosts of their own.

Either way the reads land in each rank's verified reads (engine.VerifiedReads), and the ranks agree at the
end: if any rank failed (a read, a checksum, a wait), every rank raises naming it and none has
changed its state. Every wait is bounded by the load's timeout: the exchanges go through the Comm,
and each transfer waits at most until the deadline, then fails naming the rank it waited for. An
owner that cannot read a range still sends it, marked failed, so that no receiver waits for it.

Sharing makes the load collective. `load` turns it on by default for remote storage, multi-node
jobs and states holding DTensors over the whole group (which all its ranks load together); a
load of plain tensors on one host stays local, since a load by a subset of ranks is common there.
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import codec, errors, metrics
from .comm import Comm
from .engine.read import VerifiedReads, item_span, read_span
from .errors import BCPError, ChecksumError, CommTimeoutError
from .load_config import LOAD_CONFIG
from .plan_records import ReadItem
from .shards import is_dtensor, is_tensor_like
from .storage import Storage

_GROUPS: dict[tuple, object] = {}
_TAGS: dict[tuple, int] = {}  # point-to-point tags used so far on each transfer group

_TAG_SPACE = 1 << 31  # c10d tags are C ints

# A range's message: its bytes, then one status byte (1: read, 0: its owner failed to read it).
_READ, _FAILED = 1, 0


# ----------------------------------------------------------------------------- records

@codec.record
@dataclass(frozen=True)
class LoadFailure:
    """Why one rank's part of a collective load failed, for the other ranks to raise: the error's
    class name (one of bcp_core.errors, else reported as BCPError) and message."""

    rank: int
    error: str
    message: str

    @staticmethod
    def of(rank: int, e: BaseException) -> LoadFailure:
        return LoadFailure(rank, type(e).__name__, str(e))

    def exception(self) -> BCPError:
        """The error as another rank raises it, naming this rank."""
        cls = getattr(errors, self.error, None)
        if not (isinstance(cls, type) and issubclass(cls, BCPError)):
            return BCPError(f"rank {self.rank} failed its part of this load: {self.error}: {self.message}")
        what = "found a corrupted block in this load" if cls is ChecksumError else "failed its part of this load"
        return cls(f"rank {self.rank} {what}: {self.message}")


@codec.record
@dataclass(frozen=True)
class ReadRequest:
    """What one rank of a shared load reads: its host, its byte ranges (file, start, end) and the
    checksum blocks they cover (file, piece offset, first block, end block, piece bytes); or why it
    cannot take part (`failure`)."""

    host: str
    spans: tuple
    blocks: tuple
    failure: LoadFailure | None


def raise_failures(failures: list[LoadFailure | None], own: BaseException | None) -> None:
    """After an exchange of failures: this rank's own error, else the first failing rank's."""
    if own is not None:
        raise own
    for f in failures:
        if f is not None:
            raise f.exception()


# ----------------------------------------------------------------------------- policy

def worth_sharing(storage: Storage, process_group, state: dict) -> bool:
    """Default policy: share for remote storage, for jobs spanning several nodes, and for states
    holding a DTensor laid out over every rank of the group (all its ranks load such a state
    together, so the collective costs nothing in flexibility)."""
    if group_size(process_group) < 2:
        return False
    world = dist.get_world_size(process_group)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if storage.remote or local_world < world:
        return True
    group = set(dist.get_process_group_ranks(process_group)) if process_group is not None else set(range(world))
    meshes = {id(t.device_mesh): t.device_mesh for t in _tensors(state) if is_dtensor(t)}
    return any(set(m.mesh.flatten().tolist()) == group for m in meshes.values())


def group_size(process_group) -> int:
    """Ranks in the group; 1 without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(process_group)


def _tensors(state: Any) -> Iterator:
    """The tensors of a state: its modules' parameters and buffers, and tensors in nested dicts."""
    if isinstance(state, nn.Module):
        yield from state.parameters()
        yield from state.buffers()
    elif isinstance(state, dict):
        for v in state.values():
            yield from _tensors(v)
    elif is_tensor_like(state):
        yield state


# ----------------------------------------------------------------------------- the shared load

def _blocks(it: ReadItem, block: int) -> tuple[int, int, int, int, int]:
    """The checksum blocks an item's read covers: (file, piece byte offset, first block, end block,
    piece bytes)."""
    lo, hi = item_span(it, block, True)
    p = it.piece
    return p.file, p.byte_offset, lo // block, -(-hi // block), p.nbytes


def read_all_shared(reads: VerifiedReads, items: list[ReadItem], num_threads: int, process_group, comm: Comm,
                    op: str, timeout: timedelta, failure: BaseException | None = None,
                    check: Callable[[], None] | None = None) -> dict:
    """Read and verify `items` into `reads`, sharing the work with the group's other ranks (module
    doc); then `check()`, if given. Collective: `op` names this load's exchanges on `comm`. A rank
    that could not prepare its part passes its error as `failure` and still takes part, so that every
    rank raises it. Returns counts; raises, on every rank, if any rank failed."""
    block, verify = reads.block, reads.verify
    items = [it for it in items if math.prod(it.lengths)]
    spans: dict[tuple[int, int, int], list[ReadItem]] = {}
    for it in items:
        lo, hi = item_span(it, block, verify)
        spans.setdefault((it.piece.file, it.piece.byte_offset + lo, it.piece.byte_offset + hi), []).append(it)
    blocks = sorted({_blocks(it, block) for it in items}) if verify else []
    mine = ReadRequest(_host(comm), tuple(sorted(spans)), tuple(blocks),
                       None if failure is None else LoadFailure.of(comm.rank, failure))
    wanted = [codec.from_wire(w, ReadRequest)
              for w in comm.all_gather(codec.to_wire(mine), f"{op}/plan", timeout)]
    raise_failures([w.failure for w in wanted], failure)
    hosts = [w.host for w in wanted]
    if not reads.storage.remote and (len(set(hosts)) == 1 or reads.storage.node_local):
        error, counts = _verify_once(reads, items, num_threads, comm, [w.blocks for w in wanted], hosts)
    else:
        with metrics.phase("transfer"):  # the whole exchange; its own reads and copies are recorded too
            transfer = _Transfer(reads, spans, [w.spans for w in wanted], process_group, comm, op, timeout)
            error, counts = transfer.run(num_threads)
    if error is None and check is not None:
        try:
            check()
        except Exception as e:  # noqa: BLE001 - reported at the agreement
            error = e
    own = None if error is None else codec.to_wire(LoadFailure.of(comm.rank, error))
    try:
        failures = comm.all_gather(own, f"{op}/verify", timeout)
    except CommTimeoutError:
        if error is not None:  # this rank's own error says more (e.g. which transfer it waited for)
            raise error from None
        raise
    raise_failures([None if f is None else codec.from_wire(f, LoadFailure) for f in failures], error)
    return counts


def _host(comm: Comm) -> str:
    """The machine this rank reads on: its host name and its node (`Comm.nodes`: nodes simulated on
    one machine, `BCP_LOCAL_WORLD_SIZE`, each read memory:// files of their own)."""
    return f"{socket.gethostname()}#{comm.nodes[comm.rank]}"


def _worst_fit(requesters: dict[tuple, list[int]], size, world_size: int) -> dict[tuple, int]:
    """An owner for each key several ranks want: keys one rank wants count first; shared ones go,
    largest first, to the requester with the fewest bytes so far. Same result on every rank."""
    load = [0] * world_size
    for k, rs in requesters.items():
        if len(rs) == 1:
            load[rs[0]] += size(k)
    owner = {}
    for k in sorted((k for k, rs in requesters.items() if len(rs) > 1), key=lambda k: (-size(k), k)):
        r = min(requesters[k], key=lambda x: (load[x], x))
        owner[k] = r
        load[r] += size(k)
    return owner


def _verify_once(reads: VerifiedReads, items: list[ReadItem], num_threads: int, comm: Comm,
                 wanted: list, hosts: list[str]) -> tuple[BaseException | None, dict]:
    """Local files: every rank reads its own bytes; each block is verified once on each host
    (`block_owners`)."""
    owner = block_owners(wanted, hosts, comm.rank, reads.block)
    me = comm.rank
    skip = {(reads.files[f], off + b * reads.block) for (f, off, b), r in owner.items() if r != me}
    try:
        reads.read_each(items, num_threads, skip)
    except Exception as e:  # noqa: BLE001 - every rank must reach the agreement, or the others wait
        return e, {}
    return None, {"verified_blocks": sum(1 for r in owner.values() if r == me)}


def block_owners(wanted: list, hosts: list[str], me: int, block: int) -> dict[tuple[int, int, int], int]:
    """The rank that verifies each checksum block ((file, piece offset, block index)) that rank `me`
    reads: one of the ranks of its host that read it (a block's copy on one host says nothing of
    another host's: a node's own RAM, `Storage.node_local`). `wanted[r]`: rank r's blocks as
    (file, piece offset, first block, end block, piece bytes). Same result on every rank of a host."""
    requesters: dict[tuple[int, int, int], list[int]] = {}  # (file, piece offset, block) -> ranks of this host
    sizes: dict[tuple[int, int, int], int] = {}
    for r, ranges in enumerate(wanted):
        if hosts[r] != hosts[me]:
            continue
        for f, off, b0, b1, nbytes in ranges:
            for b in range(b0, b1):
                requesters.setdefault((f, off, b), []).append(r)
                sizes[(f, off, b)] = min(block, nbytes - b * block)
    return _worst_fit(requesters, sizes.__getitem__, len(wanted))


# ----------------------------------------------------------------------------- transfers

def _transfer_group(process_group, timeout: timedelta):
    ranks = tuple(dist.get_process_group_ranks(process_group)) if process_group is not None else \
        tuple(range(dist.get_world_size()))
    if ranks not in _GROUPS:
        # created once, collectively (load is collective when sharing reads)
        _GROUPS[ranks] = dist.new_group(ranks=list(ranks), backend="gloo", timeout=timeout)
    return ranks, _GROUPS[ranks]


def _first_tag(ranks: tuple, count: int) -> int:
    """Tags no earlier transfer on this group used (same on every rank: they run the same transfers),
    so that a range a failed load never received cannot be taken for one of this load."""
    first = _TAGS.get(ranks, 0)
    _TAGS[ranks] = (first + count) % _TAG_SPACE
    return first


# Works of failed transfers: gloo keeps their buffers registered and may still fill or read them, so
# they are never freed (a failed load leaves a few buffers behind, rather than memory gloo writes into).
_ABANDONED: list = []


@dataclass
class _Range:
    """One shared byte range (file, start, end) in flight: its message buffer (the bytes, then a
    status byte) and its gloo works with the rank at the other end of each."""

    key: tuple[int, int, int]
    buf: torch.Tensor
    works: list[tuple[Any, int]]


class _Transfer:
    """Each byte range read once across the group and sent to the other ranks that need it.

    Shared ranges go in one order on every rank: owners read and send them in it, receivers post and
    take their receives in it, each with at most `LOAD_CONFIG.transfer_window_bytes` in flight (and at
    least one range). The first range not yet delivered can always move: its owner has sent every
    range before it and waits for a delivery only once it has sent all it read, and its receivers have
    taken every range before it, so its receive is posted. So the windows never deadlock. Every wait on
    a send or receive is bounded by one deadline; the first error met is kept (`error`) and reported
    at the load's agreement, while the transfer goes on so that no other rank waits for this one.
    """

    def __init__(self, reads: VerifiedReads, spans: dict[tuple[int, int, int], list[ReadItem]], wanted: list,
                 process_group, comm: Comm, op: str, timeout: timedelta):
        self.reads, self.spans = reads, spans
        self.me, self.op, self.timeout, self.files = comm.rank, op, timeout, reads.files
        self.deadline = time.monotonic() + timeout.total_seconds()
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self.requesters: dict[tuple, list[int]] = {}
        for r, keys in enumerate(wanted):
            for k in keys:
                self.requesters.setdefault(tuple(k), []).append(r)
        self.owner = _worst_fit(self.requesters, lambda k: k[2] - k[1], comm.world_size)
        shared = sorted(self.owner)
        ranks, self.group = _transfer_group(process_group, timeout)
        first = _first_tag(ranks, len(shared))
        self.tag = {k: (first + i) % _TAG_SPACE for i, k in enumerate(shared)}
        self.to_send = [k for k in shared if self.owner[k] == self.me]
        self.to_receive = [k for k in shared if self.owner[k] != self.me and k in spans]
        self.sent: deque[_Range] = deque()    # sent, delivery not yet waited for
        self.posted: deque[_Range] = deque()  # receives posted, not yet taken

    def run(self, num_threads: int) -> tuple[BaseException | None, dict]:
        """Read the ranges this rank alone needs, send those it owns, receive the others; the first
        error (None if all went well) and counts."""
        direct = [it for k, its in self.spans.items() if k not in self.owner for it in its]
        with ThreadPoolExecutor(max(1, num_threads), thread_name_prefix="bcp-read") as pool:
            direct_done = [pool.submit(metrics.bind(self._read_direct), it) for it in direct]
            sender = threading.Thread(target=metrics.bind(self._send_owned), args=(pool,), name="bcp-send")
            sender.start()
            self._receive_all()
            sender.join()
            for f in direct_done:
                f.result()
        if self.error is not None:
            _ABANDONED.extend([*self.sent, *self.posted])  # gloo may still read from or fill their buffers
        counts = {"read_bytes": sum(k[2] - k[1] for k in self.to_send) +
                  sum(k[2] - k[1] for k in self.spans if k not in self.owner),
                  "received_bytes": sum(k[2] - k[1] for k in self.to_receive), "sent_ranges": len(self.to_send)}
        return self.error, counts

    def fail(self, e: BaseException) -> None:
        with self._lock:
            self.error = self.error or e

    # -- this rank's own reads ---------------------------------------------------------------------

    def _read_direct(self, it: ReadItem) -> None:
        try:
            self.reads.read(it)
        except Exception as e:  # noqa: BLE001 - reported at the agreement
            self.fail(e)

    def _read(self, k: tuple[int, int, int]) -> torch.Tensor:
        """The range's message: its bytes and the status byte (an owner that failed still sends)."""
        buf = torch.empty(k[2] - k[1] + 1, dtype=torch.uint8)
        it = self.spans[k][0]  # owners are requesters, so the range is one of this rank's spans
        try:
            read_span(self.reads.storage, self.files, it, k[1] - it.piece.byte_offset, k[2] - it.piece.byte_offset,
                      out=buf[:-1])
            buf[-1] = _READ
        except Exception as e:  # noqa: BLE001 - the receivers are told by the status byte, the agreement reports it
            self.fail(e)
            buf[-1] = _FAILED
        return buf

    def _take(self, r: _Range) -> None:
        if int(r.buf[-1]) != _READ:
            return  # its owner failed to read it, and reports that itself at the agreement
        its = self.spans[r.key]
        try:
            self.reads.take(its, r.buf[:-1], r.key[1] - its[0].piece.byte_offset)
        except Exception as e:  # noqa: BLE001 - reported at the agreement; the transfer goes on so no one waits
            self.fail(e)

    # -- gloo ----------------------------------------------------------------------------------------

    def _post(self, k: tuple[int, int, int], buf: torch.Tensor, post, r: int, what: str):
        try:
            return post(buf, dist.get_global_rank(self.group, r), group=self.group, tag=self.tag[k]), r
        except RuntimeError as e:  # gloo: the peer's connection closed
            raise self.peer_error(r, what, k, e) from None

    def _send(self, k: tuple[int, int, int], buf: torch.Tensor) -> _Range:
        receivers = [r for r in self.requesters[k] if r != self.me]
        return _Range(k, buf, [self._post(k, buf, dist.isend, r, "receive") for r in receivers])

    def _receive(self, k: tuple[int, int, int]) -> _Range:
        buf = torch.empty(k[2] - k[1] + 1, dtype=torch.uint8)
        return _Range(k, buf, [self._post(k, buf, dist.irecv, self.owner[k], "send")])

    def done(self, r: _Range, what: str) -> bool:
        """Wait for the range's works until the deadline; False (the error recorded) if one did not end."""
        for work, peer in r.works:
            left = max(self.deadline - time.monotonic(), 0.001)  # a zero timeout would mean none at all
            try:
                work.wait(timedelta(seconds=left))
            except RuntimeError as e:  # gloo: timed out, or the peer's connection closed
                self.fail(self.peer_error(peer, what, r.key, e))
                _ABANDONED.append(r)
                return False
        return True

    def peer_error(self, peer: int, what: str, key: tuple[int, int, int], cause: Exception) -> CommTimeoutError:
        f, lo, hi = key
        return CommTimeoutError(
            f"bcp {self.op}/transfer: rank {self.me} waited {self.timeout} for rank {peer} to {what} bytes "
            f"[{lo}, {hi}) of {self.files[f]}, in vain ({str(cause).splitlines()[0][:200]}); it may have crashed "
            "or be stuck elsewhere")

    # -- the two directions ----------------------------------------------------------------------------

    def _send_owned(self, pool: ThreadPoolExecutor) -> None:
        """Read the owned ranges in order on the pool (a window ahead), send each, take this rank's part."""
        todo, reading = deque(self.to_send), deque()
        window = 0  # bytes of ranges being read, or sent and not yet received
        try:
            while todo or reading:
                while todo and (window < LOAD_CONFIG.transfer_window_bytes or not (reading or self.sent)):
                    k = todo.popleft()
                    reading.append((k, pool.submit(metrics.bind(self._read), k)))
                    window += k[2] - k[1]
                if not reading:  # the window is full of ranges sent: wait for the oldest to be received
                    r = self.sent.popleft()
                    window -= r.key[2] - r.key[1]
                    if not self.done(r, "receive"):
                        return
                    continue
                k, fut = reading.popleft()
                r = self._send(k, fut.result())
                self.sent.append(r)
                self._take(r)
            while self.sent:
                if not self.done(self.sent.popleft(), "receive"):
                    return
        except Exception as e:  # noqa: BLE001 - gloo refusing a send (a peer gone): reported at the agreement
            self.fail(e)

    def _receive_all(self) -> None:
        """Post receives in order, a window ahead; take each as it arrives."""
        todo = deque(self.to_receive)
        window = 0
        try:
            while todo or self.posted:
                while todo and (window < LOAD_CONFIG.transfer_window_bytes or not self.posted):
                    k = todo.popleft()
                    self.posted.append(self._receive(k))
                    window += k[2] - k[1]
                r = self.posted.popleft()
                window -= r.key[2] - r.key[1]
                if not self.done(r, "send"):
                    return
                self._take(r)
        except Exception as e:  # noqa: BLE001 - gloo refusing a receive (a peer gone): reported at the agreement
            self.fail(e)
