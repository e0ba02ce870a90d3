"""Redundant-read elimination on load (paper §4.1).

When several ranks need the same bytes (data-parallel replicas), each byte range is read from
storage once, by one of the ranks that need it (worst-fit on bytes), and passed to the others
over a gloo group, overlapped with reading. Receivers verify the checksums themselves, so the
transfer is covered end to end.

It pays off when storage bandwidth is the bottleneck (remote or shared storage, many nodes); on
one node reading from the page cache is faster than any transfer, which is why `load` turns it
on by default only for remote storage or multi-node jobs.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from .comm import Comm
from .engine import copy_from_span, item_span, read_item, read_span
from .planner import ReadItem
from .storage import Storage

_GROUPS: dict[tuple, object] = {}


def worth_sharing(storage: Storage, process_group) -> bool:
    """Default policy: share reads for remote storage or when the job spans several nodes."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    if dist.get_world_size(process_group) < 2:
        return False
    remote = storage.remote
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size(process_group)))
    return remote or local_world < dist.get_world_size(process_group)


def _transfer_group(process_group):
    ranks = tuple(dist.get_process_group_ranks(process_group)) if process_group is not None else \
        tuple(range(dist.get_world_size()))
    if ranks not in _GROUPS:
        # created once, collectively (load is collective when sharing reads)
        _GROUPS[ranks] = dist.new_group(ranks=list(ranks), backend="gloo")
    return _GROUPS[ranks]


def read_all_shared(storage: Storage, files: tuple[str, ...], block: int, items: list[ReadItem], verify: bool,
                    num_threads: int, process_group, comm: Comm) -> dict:
    """Read `items` with each byte range read once across the group. Collective. Returns counts."""
    items = [it for it in items if math.prod(it.lengths)]
    spans: dict[tuple[int, int, int], list[ReadItem]] = {}
    direct: list[ReadItem] = []
    for it in items:
        lo, hi = item_span(it, block, verify)
        spans.setdefault((it.piece.file, it.piece.byte_offset + lo, it.piece.byte_offset + hi), []).append(it)
    wanted = comm.all_gather(sorted(spans), "load-plan")
    requesters: dict[tuple, list[int]] = {}
    for r, keys in enumerate(wanted):
        for k in keys:
            requesters.setdefault(tuple(k), []).append(r)
    # Worst-fit: ranges only one rank wants count first; shared ones go, largest first, to the
    # requester with the fewest bytes to read so far.
    load = [0] * comm.world_size
    for k, rs in requesters.items():
        if len(rs) == 1:
            load[rs[0]] += k[2] - k[1]
    shared = sorted((k for k, rs in requesters.items() if len(rs) > 1), key=lambda k: (k[1] - k[2], k))
    owner = {}
    for k in shared:
        r = min(requesters[k], key=lambda x: (load[x], x))
        owner[k] = r
        load[r] += k[2] - k[1]
    tag = {k: i for i, k in enumerate(sorted(shared))}
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
