"""Each node's files copied to its replica nodes over the network, before the step may commit.

After writing its pieces into its node's memory, every rank sends its data files to one rank of
each of its replica nodes (placement.py), which writes them into that node's memory under the same
names: a replica is byte for byte the file, so any node's copy serves any load. Sending and
receiving overlap (a thread each); a file goes in parts of `transport.PART_BYTES` (a few in
flight), read from the memory file's map and received straight into the new file's map (no copy on
either side), at most `bandwidth` bytes per second. Each file travels with its XXH3 digest, which
the receiver checks before the copy takes the file's name (a temporary name until then): a copy
that exists is whole and right.

Every rank takes part even when its own write failed (it sends its error instead of files, so no
peer waits), and a failure on either side is reported with the rank's write report: the commit
round then fails the save on every rank.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import torch
import xxhash

from .. import metrics
from ..comm import Comm
from ..errors import StorageError
from ..storage import Storage
from .placement import Placement
from .transport import Pacer, Peer, PeerFailed, tier_group


def replicate(comm: Comm, placement: Placement, ckpt: Storage, files: list[str] | None, error: str | None,
              tag: int, timeout: float, bandwidth: float | None, op: str) -> tuple[str | None, dict]:
    """Send this rank's `files` (paths in `ckpt`; None with `error`: its write failed) to its replica
    ranks and receive its sources' files into `ckpt`. Returns the first error (None: every copy is
    in place) and counts (bytes sent, received)."""
    me = comm.rank
    group = tier_group(comm, timedelta(seconds=timeout))
    deadline = time.monotonic() + timeout
    errors: list[str] = []
    counts = {"sent_bytes": 0, "received_bytes": 0}
    lock = threading.Lock()

    def fail(message: str) -> None:
        with lock:
            errors.append(message)

    def send_all() -> None:
        pacer = Pacer(bandwidth)
        for dest in placement.destinations(me):
            peer = Peer(group, me, dest, tag, deadline, op)
            try:
                counts["sent_bytes"] += _send_files(peer, ckpt, files, error, pacer)
            except Exception as e:  # noqa: BLE001 - reported with this rank's write report
                fail(f"rank {me}: replicating to rank {dest}: {e}")

    sender = threading.Thread(target=metrics.bind(send_all), name="bcp-replicate")
    with metrics.phase("replicate"):
        sender.start()
        for source in placement.sources(me):
            peer = Peer(group, me, source, tag, deadline, op)
            try:
                counts["received_bytes"] += _receive_files(peer, ckpt)
            except PeerFailed:
                pass  # its own write failed: its report says so
            except Exception as e:  # noqa: BLE001 - reported with this rank's write report
                fail(f"rank {me}: receiving the replicas of rank {source}: {e}")
        sender.join(max(deadline - time.monotonic(), 0) + 5)  # its own waits end by the deadline
    if sender.is_alive():
        fail(f"rank {me}: replication did not end within {timeout:.0f} s")
    rec = metrics.current()
    if rec is not None:
        rec.add("replicated", time.time(), time.time(), counts["sent_bytes"])
    return (errors[0] if errors else None), counts


def _send_files(peer: Peer, ckpt: Storage, files: list[str] | None, error: str | None, pacer: Pacer) -> int:
    """The manifest (each file's name, size and digest), then each file's bytes; or the error."""
    if files is None:
        peer.send_blob(None, "the replica manifest", error or "its write failed")
        return 0
    maps = {}
    manifest = []
    for rel in files:
        data = ckpt.map(rel)
        if data is None:
            raise StorageError(f"{ckpt.join(rel)} cannot be mapped for replication")
        maps[rel] = data
        manifest.append([rel, len(data), xxhash.xxh3_64_hexdigest(data)])
    peer.send_blob(json.dumps(manifest).encode(), "the replica manifest")
    return sum(peer.send_parts(maps[rel], rel, pacer) for rel, _, _ in manifest)


def _receive_files(peer: Peer, ckpt: Storage) -> int:
    """The sender's manifest and files, each received straight into a new file's map under a
    temporary name, renamed into place once its digest matches. A file that cannot be made is still
    received (so that the sender is not left waiting) and the first such error raised at the end."""
    manifest = json.loads(peer.recv_blob("the replica manifest", limit=64 << 20))
    if manifest:
        ckpt.makedirs("data")
    received, failure = 0, None
    for rel, size, expected in manifest:
        _check_name(rel)
        if not (type(size) is int and 0 <= size and type(expected) is str):
            raise StorageError(f"the replica manifest of rank {peer.peer} is malformed at {rel!r}")
        target = None
        if failure is None:
            try:
                target = ckpt.create_mapped(rel, size)
            except Exception as e:  # noqa: BLE001 - raised once every file was received
                failure = e
        out = torch.frombuffer(target.view, dtype=torch.uint8) if target is not None and size else None
        try:
            received += peer.recv_parts(out, size, rel)
        except BaseException:
            if target is not None:
                target.abort(release=False)  # gloo may still write into the map: it stays
            raise
        if target is None:
            continue
        del out
        if xxhash.xxh3_64_hexdigest(target.view) != expected:
            target.abort()
            failure = failure or StorageError(f"the copy of {rel} from rank {peer.peer} does not match its "
                                              "digest: it was damaged on the way")
            continue
        try:
            target.commit()
        except Exception as e:  # noqa: BLE001 - see above
            failure = failure or e
    if failure is not None:
        raise failure
    return received


def _check_name(rel: str) -> None:
    """A replica is a data file of the step: `data/<name>`, nothing else (the sender is a peer, but a
    name is never trusted to stay inside the step)."""
    parts = rel.split("/") if isinstance(rel, str) else []
    if len(parts) != 2 or parts[0] != "data" or parts[1] in ("", ".", "..") or "\x00" in rel:
        raise StorageError(f"a replica named {rel!r}: not a data file of the step")
