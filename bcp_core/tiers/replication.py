"""Each node's files copied to its replica nodes over the network, before the step may commit.

After writing its pieces into its node's memory, every rank sends its data files to one rank of
each of its replica nodes (placement.py), which writes them into that node's memory under the same
names: a replica is byte for byte the file, so any node's copy serves any load. Sending and
receiving overlap (a thread each); a file goes in parts of `transport.PART_BYTES` (a few in
flight), sent from the memory file's map (no copy), at most `bandwidth` bytes per second. Each file
travels with its pieces' checksums (those the write computed, which the metadata records) and its
header's digest. The receiver takes each part into a reused buffer, checks it there while it is in
the CPU's cache (`CopyCheck`) and writes it into a new file (on tmpfs, writing a new file's pages
costs about half of faulting them in through a map); the copy takes the file's name (a temporary
name until then) only once every check passed: a copy that exists is whole and right, and the
sender hashes nothing again.

Every rank takes part even when its own write failed (it sends its error instead of files, so no
peer waits), and a failure on either side is reported with the rank's write report: the commit
round then fails the save on every rank.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import xxhash

from .. import metrics
from ..comm import Comm
from ..errors import StorageError
from ..metadata import CHECKSUM_BLOCK_BYTES, MAX_BYTES, parse_json
from ..storage import Storage
from .copy_check import CopyCheck
from .placement import Placement
from .transport import Pacer, Peer, PeerFailed, tier_group


def replicate(comm: Comm, placement: Placement, ckpt: Storage, files: dict[str, list] | None, error: str | None,
              tag: int, timeout: float, bandwidth: float | None, op: str) -> tuple[str | None, dict]:
    """Send this rank's `files` (paths in `ckpt`, each with its pieces: (byte offset, size,
    checksums); None with `error`: its write failed) to its replica ranks and receive its sources'
    files into `ckpt`. Returns the first error (None: every copy is
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


def _send_files(peer: Peer, ckpt: Storage, files: dict[str, list] | None, error: str | None, pacer: Pacer) -> int:
    """The manifest, then each file's bytes; or the error. The manifest names each file, its size, the
    digest of its safetensors header and its pieces (byte offset, size, the checksum of each block,
    as the write computed them): the receiver checks a copy against those, so the sender hashes
    nothing again."""
    if files is None:
        peer.send_blob(None, "the replica manifest", error or "its write failed")
        return 0
    maps, entries = {}, []
    for rel, pieces in files.items():
        data = ckpt.map(rel)
        if data is None or len(data) < 8:
            raise StorageError(f"{ckpt.join(rel)} cannot be mapped for replication, or is no data file")
        maps[rel] = data
        header = 8 + int.from_bytes(data[:8], "little")
        entries.append([rel, len(data), header, xxhash.xxh3_64_hexdigest(data[:header]),
                        [[off, n, list(sums)] for off, n, sums in pieces]])
    peer.send_blob(json.dumps({"block": CHECKSUM_BLOCK_BYTES, "files": entries}).encode(), "the replica manifest")
    return sum(peer.send_parts(maps[e[0]], e[0], pacer) for e in entries)


def _receive_files(peer: Peer, ckpt: Storage) -> int:
    """The sender's manifest and files, each received into reused buffers, checked against the
    manifest there (`CopyCheck`) and written into a new file under a temporary name, which gets the
    file's name once every check passed. A file that cannot be made or written is still received
    (so that the sender is not left waiting) and the first such error raised at the end."""
    manifest = parse_json(peer.recv_blob("the replica manifest", limit=64 << 20), f"rank {peer.peer}'s manifest")
    if not (type(manifest) is dict and type(manifest.get("block")) is int and manifest["block"] > 0
            and type(manifest.get("files")) is list):
        raise StorageError(f"the replica manifest of rank {peer.peer} is malformed")
    if manifest["files"]:
        ckpt.makedirs("data")
    received, failure = 0, None
    for entry in manifest["files"]:
        rel, size = _check_entry(entry, peer.peer)
        check = CopyCheck(entry, manifest["block"])
        writer = None
        if failure is None:
            try:
                writer = ckpt.open_writer(rel)
            except Exception as e:  # noqa: BLE001 - raised once every file was received
                failure = e

        def sink(part: memoryview, at: int) -> None:
            nonlocal writer, failure
            check.feed(part, at)
            if writer is not None:
                try:
                    writer.write(part)
                except Exception as e:  # noqa: BLE001 - the rest is still received, then raised
                    writer.abort()
                    writer, failure = None, failure or e

        try:
            received += peer.recv_parts(size, rel, sink)
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        if writer is None:
            continue
        wrong = check.wrong()
        if wrong:
            writer.abort()
            failure = failure or StorageError(f"the copy of {rel} from rank {peer.peer} {wrong}: it was damaged on "
                                              "the way")
            continue
        try:
            writer.close()
        except Exception as e:  # noqa: BLE001 - see above
            failure = failure or e
    if failure is not None:
        raise failure
    return received


def _check_entry(entry, sender: int) -> tuple[str, int]:
    """A manifest entry's name and size, its fields checked (a peer's message is not trusted)."""
    ok = type(entry) is list and len(entry) == 5 and type(entry[1]) is int and type(entry[2]) is int \
        and type(entry[3]) is str and type(entry[4]) is list and 8 <= entry[2] <= entry[1] <= MAX_BYTES
    if ok:
        _check_name(entry[0])
    if ok:
        for piece in entry[4]:
            ok = ok and type(piece) is list and len(piece) == 3 and all(type(x) is int for x in piece[:2]) \
                and 0 <= piece[0] and 0 <= piece[1] and piece[0] + piece[1] <= entry[1] and type(piece[2]) is list
    if not ok:
        raise StorageError(f"the replica manifest of rank {sender} is malformed at {str(entry)[:200]!r}")
    return entry[0], entry[1]


def _check_name(rel: str) -> None:
    """A replica is a data file of the step: `data/<name>`, nothing else (the sender is a peer, but a
    name is never trusted to stay inside the step)."""
    parts = rel.split("/") if isinstance(rel, str) else []
    if len(parts) != 2 or parts[0] != "data" or parts[1] in ("", ".", "..") or "\x00" in rel:
        raise StorageError(f"a replica named {rel!r}: not a data file of the step")
