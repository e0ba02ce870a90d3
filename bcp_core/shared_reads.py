"""Shared reads on load: ranks that need the same bytes split the work (paper §4.1).

From remote storage, or when the job spans hosts, each byte range is read once across the job,
by one of the ranks that need it (worst-fit on bytes), and passed to the others over a gloo
group, overlapped with reading. Receivers verify the checksums themselves, so the transfer is
covered end to end.

On one host reading local files, the page cache already holds each byte once for all ranks and
is faster than any transfer; what the ranks would repeat is the checksum verification (a
Shard(0) -> Shard(1) load on N ranks needs a part of every block, so each rank would hash the
whole checkpoint). There each block is verified by one of the ranks that read it (worst-fit
again), and the ranks agree at the end that no block failed.

Sharing makes the load collective. `load` turns it on by default for remote storage, multi-node
jobs and states holding DTensors over the whole group (which all its ranks load together); a
load of plain tensors on one host stays local, since a load by a subset of ranks is common there.
"""

from __future__ import annotations

import math
import os
from datetime import timedelta
import socket
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from . import metrics
from .comm import Comm
from .engine import copy_from_span, item_span, read_all, read_item, read_span
from .errors import BCPError, ChecksumError
from .load_planner import ReadItem
from .shards import is_dtensor
from .storage import Storage

_GROUPS: dict[tuple, object] = {}


def worth_sharing(storage: Storage, process_group, tensors: Iterable) -> bool:
    """Default policy: share for remote storage, for jobs spanning several nodes, and for states
    holding a DTensor laid out over every rank of the group (all its ranks load such a state
    together, so the collective costs nothing in flexibility)."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    world = dist.get_world_size(process_group)
    if world < 2:
        return False
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if storage.remote or local_world < world:
        return True
    group = set(dist.get_process_group_ranks(process_group)) if process_group is not None else set(range(world))
    meshes = {id(t.device_mesh): t.device_mesh for t in tensors if is_dtensor(t)}
    return any(set(m.mesh.flatten().tolist()) == group for m in meshes.values())


def _transfer_group(process_group):
    ranks = tuple(dist.get_process_group_ranks(process_group)) if process_group is not None else \
        tuple(range(dist.get_world_size()))
    if ranks not in _GROUPS:
        # created once, collectively (load is collective when sharing reads)
        _GROUPS[ranks] = dist.new_group(ranks=list(ranks), backend="gloo")
    return _GROUPS[ranks]


def _host() -> str:
    return socket.gethostname()


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


def _blocks(it: ReadItem, block: int) -> tuple[int, int, int, int, int]:
    """The checksum blocks an item's read covers: (file, piece byte offset, first block, end block,
    piece bytes)."""
    lo, hi = item_span(it, block, True)
    p = it.piece
    return p.file, p.byte_offset, lo // block, -(-hi // block), p.nbytes


def read_all_shared(storage: Storage, files: tuple[str, ...], block: int, items: list[ReadItem], verify: bool,
                    num_threads: int, process_group, comm: Comm, op: str, timeout: timedelta) -> dict:
    """Read `items` sharing the work with the group's other ranks (module docstring). Collective:
    `op` names this load's exchanges on `comm`. Returns counts."""
    items = [it for it in items if math.prod(it.lengths)]
    spans: dict[tuple[int, int, int], list[ReadItem]] = {}
    for it in items:
        lo, hi = item_span(it, block, verify)
        spans.setdefault((it.piece.file, it.piece.byte_offset + lo, it.piece.byte_offset + hi), []).append(it)
    blocks = sorted({_blocks(it, block) for it in items}) if verify else []
    wanted = comm.all_gather({"host": _host(), "spans": sorted(spans), "blocks": blocks}, f"{op}/plan", timeout)
    if not storage.remote and len({w["host"] for w in wanted}) == 1:
        return _verify_once(storage, files, block, items, verify, num_threads, comm, [w["blocks"] for w in wanted],
                            op, timeout)
    with metrics.phase("transfer"):  # the whole exchange; its own reads and copies are recorded too
        return _read_once(storage, files, block, spans, verify, num_threads, process_group, comm,
                          [w["spans"] for w in wanted])


def _verify_once(storage: Storage, files: tuple[str, ...], block: int, items: list[ReadItem], verify: bool,
                 num_threads: int, comm: Comm, wanted: list[list], op: str, timeout: timedelta) -> dict:
    """One host, local files: every rank reads its own bytes; each block is verified once."""
    requesters: dict[tuple[int, int, int], list[int]] = {}  # (file, piece offset, block) -> ranks
    sizes: dict[tuple[int, int, int], int] = {}
    for r, ranges in enumerate(wanted):
        for f, off, b0, b1, nbytes in ranges:
            for b in range(b0, b1):
                requesters.setdefault((f, off, b), []).append(r)
                sizes[(f, off, b)] = min(block, nbytes - b * block)
    owner = _worst_fit(requesters, sizes.__getitem__, comm.world_size)
    me = comm.rank
    skip = {(files[f], off + b * block) for (f, off, b), r in owner.items() if r != me}
    error: Exception | None = None
    try:
        read_all(storage, files, block, items, verify, num_threads, skip)
    except Exception as e:  # noqa: BLE001 - every rank must reach the exchange below, or the others wait
        error = e
    failures = comm.all_gather(None if error is None else [type(error).__name__, str(error)], f"{op}/verify",
                               timeout)
    if error is not None:
        raise error
    for r, failure in enumerate(failures):
        if failure is not None:
            kind, msg = failure
            if kind == ChecksumError.__name__:
                raise ChecksumError(f"rank {r} found a corrupted block in this shared load: {msg}")
            raise BCPError(f"rank {r} failed its part of this shared load: {kind}: {msg}")
    return {"verified_blocks": sum(1 for r in owner.values() if r == me)}


def _read_once(storage: Storage, files: tuple[str, ...], block: int, spans: dict, verify: bool, num_threads: int,
               process_group, comm: Comm, wanted: list[list]) -> dict:
    """Each byte range read once across the group and sent to the other ranks that need it."""
    requesters: dict[tuple, list[int]] = {}
    for r, keys in enumerate(wanted):
        for k in keys:
            requesters.setdefault(tuple(k), []).append(r)
    owner = _worst_fit(requesters, lambda k: k[2] - k[1], comm.world_size)
    shared = sorted(owner)
    tag = {k: i for i, k in enumerate(shared)}
    direct: list[ReadItem] = []
    group = _transfer_group(process_group)
    me = comm.rank

    def global_rank(r: int) -> int:
        return dist.get_global_rank(group, r)

    # Post every receive first, so owners can send as soon as they have read.
    recvs = []
    for k in spans:
        if k in owner and owner[k] != me:
            buf = torch.empty(k[2] - k[1], dtype=torch.uint8)
            recvs.append((k, buf, dist.irecv(buf, src=global_rank(owner[k]), group=group, tag=tag[k])))
    mine = [k for k in spans if owner.get(k, me) == me]
    to_send = [k for k in shared if owner[k] == me]
    sends = []
    for k in mine:
        if k not in owner:
            direct.extend(spans[k])

    def read_owned(k):  # owners are requesters, so the range is one of this rank's spans
        it = spans[k][0]
        return k, read_span(storage, files, it, k[1] - it.piece.byte_offset, k[2] - it.piece.byte_offset)

    with ThreadPoolExecutor(max(1, num_threads), thread_name_prefix="bcp-read") as pool:
        direct_futs = [pool.submit(read_item, storage, files, block, it, verify) for it in direct]
        for fut in [pool.submit(read_owned, k) for k in to_send]:
            k, buf = fut.result()
            for r in requesters[k]:
                if r != me:
                    sends.append(dist.isend(buf, dst=global_rank(r), group=group, tag=tag[k]))
            for it in spans[k]:
                copy_from_span(it, buf, k[1] - it.piece.byte_offset, files, block, verify)
        for f in direct_futs:
            f.result()
    for k, buf, work in recvs:
        work.wait()
        for it in spans[k]:
            copy_from_span(it, buf, k[1] - it.piece.byte_offset, files, block, verify)
    for work in sends:
        work.wait()
    read_bytes = sum(k[2] - k[1] for k in mine)
    return {"read_bytes": read_bytes, "received_bytes": sum(b.numel() for _, b, _ in recvs),
            "sent_ranges": len(to_send)}
