"""The read half of the engine: byte ranges of data files back into tensors, verified.

Reads run on a thread pool; file I/O, checksums and copies release the GIL. A load into the
caller's state reads every byte range and verifies it before anything goes into place
(`VerifiedReads`); the tools read straight into buffers of their own (`read_all`).
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from collections.abc import Container, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from .. import codec, memcopy, metrics
from ..errors import ChecksumError, KeyMismatchError, StorageError
from ..host_memory import bounce, byte_view, ordered_after_callers
from ..load_config import LOAD_CONFIG
from ..metadata import CheckpointMetadata, check_metadata_size, num_blocks, parse_json
from ..plan_records import ReadItem
from ..storage import Storage
from .framing import checksum, tensor_bytes

def _contiguous_strides(lengths: tuple[int, ...]) -> list[int]:
    strides, acc = [], 1
    for n in reversed(lengths):
        strides.append(acc)
        acc *= n
    return strides[::-1]

def verify_blocks(data: memoryview, start: int, nbytes: int, sums: tuple[int, ...], block: int,
                  file: str, byte_offset: int, what: str, skip: Container[tuple[str, int]] = ()) -> None:
    """Check the checksum of each whole block of a piece contained in `data`.

    `data` holds the piece's bytes from piece offset `start` on; the piece has `nbytes` bytes and
    starts at `byte_offset` in `file`. Blocks named in `skip` as (file, file offset of the block)
    are left to another rank that verifies them (shared_reads).
    """
    for b in range(start // block, num_blocks(nbytes, block)):
        lo, hi = b * block - start, min((b + 1) * block, nbytes) - start
        if hi > len(data):
            break
        if skip and (file, byte_offset + b * block) in skip:
            continue
        if checksum(data[lo:hi]) != sums[b]:
            raise ChecksumError(f"checksum mismatch in {file} bytes [{byte_offset + b * block}, "
                                f"{byte_offset + b * block + hi - lo}) of {what}: the data file is corrupted",
                                file=file)

@metrics.timed("checksum", nbytes=lambda _, data, *a: len(data))
def _verify(data: memoryview, start: int, item: ReadItem, file: str, block: int,
            skip: Container[tuple[str, int]] = ()) -> None:
    p = item.piece
    verify_blocks(data, start, p.nbytes, p.checksums, block, file, p.byte_offset,
                  f"tensor {item.fqn!r} (piece offsets {list(p.offsets)} lengths {list(p.lengths)})", skip)

def read_verified(storage: Storage, file: str, byte_offset: int, nbytes: int, sums: tuple[int, ...],
                  block: int, what: str, verify: bool = True) -> bytes:
    """The whole byte range of one piece, checked against its checksums."""
    buf = bytearray(nbytes)
    try:
        storage.read_into(file, byte_offset, memoryview(buf))
    except (OSError, StorageError) as e:
        raise StorageError(f"reading {file} bytes [{byte_offset}, {byte_offset + nbytes}) for {what} "
                           f"failed: {e}") from e
    if verify:
        verify_blocks(memoryview(buf), 0, nbytes, sums, block, file, byte_offset, what)
    return bytes(buf)

class ShardReader:
    """Reads the saved shards of one sharded object on demand: `reader[index]`, `reader.indices`."""

    def __init__(self, st: Storage, md: CheckpointMetadata, fqn: str, allow_pickle: bool, verify: bool):
        self._st, self._md, self.fqn = st, md, fqn
        self._meta = md.sharded_objects[fqn]
        self._allow_pickle, self._verify = allow_pickle, verify
        self.grid = self._meta.grid
        self.indices = [p.index for p in self._meta.shards]

    def __contains__(self, index) -> bool:
        return self._meta.shard(tuple(index)) is not None

    def __getitem__(self, index) -> Any:
        p = self._meta.shard(tuple(index))
        if p is None:
            raise KeyMismatchError(f"sharded object {self.fqn!r} has no shard at index {tuple(index)} "
                                   f"(grid {self.grid}, saved {len(self.indices)} shards)")
        what = f"shard {list(p.index)} of {self.fqn!r}"
        check_metadata_size(p.nbytes, f"{what} in {self._st.join(self._md.files[p.file])}")
        data = read_verified(self._st, self._md.files[p.file], p.byte_offset, p.nbytes, p.checksums,
                             self._md.checksum_block_bytes, what, self._verify)
        return codec.decode(parse_json(data, f"{what} in {self._st.join(self._md.files[p.file])}"), self.fqn,
                            self._allow_pickle)

def item_span(item: ReadItem, block: int, verify: bool) -> tuple[int, int]:
    """The byte range [lo, hi) of `item.piece` to read for this item: the bytes from the first to the
    last element needed, widened to whole checksum blocks when verifying."""
    p = item.piece
    esize = item.dest.element_size()
    strides = _contiguous_strides(p.lengths)
    rel = [o - po for o, po in zip(item.offsets, p.offsets)]
    first = sum(r * s for r, s in zip(rel, strides))
    last = sum((r + n - 1) * s for r, n, s in zip(rel, item.lengths, strides))
    lo, hi = first * esize, (last + 1) * esize
    if verify:
        return lo // block * block, min(-(-hi // block) * block, p.nbytes)
    return lo, hi

def _first_byte(item: ReadItem) -> int:
    """The piece offset of the item's first element."""
    p = item.piece
    rel = [o - po for o, po in zip(item.offsets, p.offsets)]
    return sum(r * s for r, s in zip(rel, _contiguous_strides(p.lengths))) * item.dest.element_size()


def copy_span(item: ReadItem, buf: torch.Tensor, span_lo: int) -> None:
    """Copy the item's elements out of `buf` (its piece's bytes from piece offset `span_lo`) into its destination."""
    p = item.piece
    strides = _contiguous_strides(p.lengths)
    flat = buf[_first_byte(item) - span_lo:].view(item.dest.dtype)
    src = torch.as_strided(flat, item.lengths, strides, flat.storage_offset())
    dest = item.dest.detach()
    with torch.no_grad(), metrics.phase("copy", dest.nbytes):
        if _one_run(dest, src) and dest.device.type == "cpu":
            # One run of bytes: one copy without the GIL, with non-temporal stores where it is large
            # (memcopy.py: ~0.6-0.7x the time of memcpy's or the kernel's copy here).
            memcopy.copy(byte_view(dest).numpy(), np.frombuffer(tensor_bytes(src), np.uint8))
        elif _one_run(dest, src) and dest.device.type == "cuda":  # pinned chunks: a pageable copy is slow
            with bounce(dest.device) as b:
                b.upload(dest, tensor_bytes(src))
        else:
            dest.copy_(src)


def _one_run(dest: torch.Tensor, src: torch.Tensor) -> bool:
    return dest.is_contiguous() and src.is_contiguous() and not (dest.is_conj() or dest.is_neg())


def _one_run_of_piece(item: ReadItem) -> bool:
    """Whether the item's box is one run of bytes of its piece (row-major): ones, then at most one
    partial dimension, then whole ones."""
    dims = list(zip(item.lengths, item.piece.lengths))
    k = next((i for i, (n, _) in enumerate(dims) if n != 1), len(dims))
    return all(n == whole for n, whole in dims[k + 1:])


# Bytes verified, then copied, at a time (`copy_verified`): small enough to stay in a core's L2
# cache between the two, so the copy reads them from there instead of from memory.
FUSED_BYTES = 1 << 20


def copy_verified(item: ReadItem, buf: torch.Tensor, span_lo: int, files: tuple[str, ...], block: int,
                  skip: Container[tuple[str, int]] = ()) -> bool:
    """Verify the item's bytes in `buf` (its piece's bytes from piece offset `span_lo`, whole
    checksum blocks) and copy them into its destination in one pass: each `FUSED_BYTES` of a block
    is hashed, then copied while still in the core's cache, and each block's checksum is checked
    once its last part is hashed, before the next block is touched. A block that fails leaves its
    bytes and those before it in the destination: only for destinations that are not the caller's
    state (`ReadItem.fresh`, the tools' buffers). False (nothing done) where the item is not one
    contiguous run into host memory; `copy_from_span` then verifies first and copies after."""
    dest = item.dest.detach()
    if dest.device.type != "cpu" or not dest.is_contiguous() or dest.is_conj() or dest.is_neg() \
            or not _one_run_of_piece(item):
        return False
    p = item.piece
    first = _first_byte(item)
    dst = np.frombuffer(tensor_bytes(dest), np.uint8) if dest.numel() else np.empty(0, np.uint8)
    src = np.frombuffer(tensor_bytes(buf), np.uint8) if buf.numel() else np.empty(0, np.uint8)
    end = first + len(dst)  # piece offsets [first, end) go to dst
    file = files[p.file]
    hashing, t_start = 0.0, time.time()
    with torch.no_grad(), metrics.phase("copy", len(dst)):
        for b in range(first // block, num_blocks(end, block) if end else 0):
            lo, hi = b * block, min((b + 1) * block, p.nbytes)
            check = (file, p.byte_offset + lo) not in skip if skip else True
            h = xxhash.xxh3_64() if check else None
            for s in range(lo, hi, FUSED_BYTES):
                e = min(s + FUSED_BYTES, hi)
                if h is not None:
                    t0 = time.perf_counter()
                    h.update(src[s - span_lo:e - span_lo])
                    hashing += time.perf_counter() - t0
                c_lo, c_hi = max(s, first), min(e, end)
                if c_lo < c_hi:
                    memcopy.copy(dst[c_lo - first:c_hi - first], src[c_lo - span_lo:c_hi - span_lo])
            if h is not None and h.intdigest() != p.checksums[b]:
                raise ChecksumError(f"checksum mismatch in {file} bytes [{p.byte_offset + lo}, {p.byte_offset + hi}) "
                                    f"of tensor {item.fqn!r} (piece offsets {list(p.offsets)} lengths "
                                    f"{list(p.lengths)}): the data file is corrupted", file=file)
    rec = metrics.current()
    if rec is not None:  # hashing is spread over the copy: its total, from the copy's start
        rec.add("checksum", t_start, t_start + hashing, len(dst))
    return True


def copy_from_span(item: ReadItem, buf: torch.Tensor, span_lo: int, files: tuple[str, ...], block: int,
                   verify: bool, skip: Container[tuple[str, int]] = ()) -> None:
    """Verify `buf` (piece bytes from `span_lo`) and copy the item's elements into its destination
    (not the caller's state: a failed check may leave part of them there)."""
    if verify and copy_verified(item, buf, span_lo, files, block, skip):
        return
    if verify:
        _verify(tensor_bytes(buf), span_lo, item, files[item.piece.file], block, skip)
    copy_span(item, buf, span_lo)

class FileMaps:
    """Memory maps of the data files one load reads, opened once per file.

    A resharded read needs a strided part of a saved piece (half of every row, say). From a map
    the copy reads those bytes straight from the page cache, instead of first copying the whole
    span into a temporary buffer. A map also holds a load's verified bytes for free: they are
    verified where they lie and copied into place later (`VerifiedReads`).
    """

    def __init__(self, storage: Storage):
        self._storage = storage
        self._maps: dict[str, memoryview | None] = {}
        self._lock = threading.Lock()

    def get(self, file: str) -> memoryview | None:
        with self._lock:
            if file not in self._maps:
                try:
                    self._maps[file] = self._storage.map(file)
                except OSError:
                    self._maps[file] = None  # fall back to reads, which report the problem
            return self._maps[file]

    def view(self, file: str, offset: int, nbytes: int) -> torch.Tensor | None:
        """Bytes [offset, offset + nbytes) of `file` as a read-only tensor over its map; None if the
        file has no map or is shorter (a read then reports it)."""
        mapped = self.get(file)
        if mapped is None or offset + nbytes > len(mapped):
            return None
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer": only ever read from
            return torch.frombuffer(mapped[offset:offset + nbytes], dtype=torch.uint8)


@metrics.timed("read", nbytes=lambda buf, *_, **__: buf.numel())
def read_span(storage: Storage, files: tuple[str, ...], item: ReadItem, lo: int, hi: int,
              maps: FileMaps | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Bytes [lo, hi) of the item's piece: a view of its file's map if there is one, else read into
    `out` (or a new buffer)."""
    p = item.piece
    mapped = maps.view(files[p.file], p.byte_offset + lo, hi - lo) if maps is not None else None
    if mapped is not None:
        return mapped
    buf = out if out is not None else torch.empty(hi - lo, dtype=torch.uint8)
    try:
        storage.read_into(files[p.file], p.byte_offset + lo, tensor_bytes(buf))
    except (OSError, StorageError) as e:
        raise StorageError(f"reading {files[p.file]} bytes [{p.byte_offset + lo}, {p.byte_offset + hi}) for "
                           f"tensor {item.fqn!r} failed: {e}") from e
    return buf

def read_item(storage: Storage, files: tuple[str, ...], block: int, item: ReadItem, verify: bool,
              maps: FileMaps | None = None, skip: Container[tuple[str, int]] = ()) -> None:
    """Fill `item.dest` from storage, verifying every block read except those in `skip`. A failed
    read or check may leave part of the bytes in the destination: loads into the caller's state go
    through `VerifiedReads` instead."""
    p = item.piece
    if math.prod(item.lengths) == 0:
        return
    lo, hi = item_span(item, block, verify)
    dest = item.dest.detach()
    mapped = maps.view(files[p.file], p.byte_offset + lo, hi - lo) if maps is not None else None
    if mapped is None and (tuple(item.lengths) == tuple(p.lengths) and dest.is_contiguous()
                           and dest.device.type == "cpu" and (lo, hi) == (0, p.nbytes)):
        out = tensor_bytes(dest)  # zero-copy: read straight into the destination
        try:
            with metrics.phase("read", p.nbytes):
                storage.read_into(files[p.file], p.byte_offset, out)
        except (OSError, StorageError) as e:
            raise StorageError(f"reading {files[p.file]} bytes [{p.byte_offset}, {p.byte_offset + p.nbytes}) "
                               f"for tensor {item.fqn!r} failed: {e}") from e
        if verify:
            _verify(out, 0, item, files[p.file], block, skip)
        return
    # from a map: verified and copied in one pass (copy_verified) where the bytes lie in one run
    copy_from_span(item, mapped if mapped is not None else read_span(storage, files, item, lo, hi), lo, files,
                   block, verify, skip)

def read_all(storage: Storage, files: tuple[str, ...], block: int, items: Iterable[ReadItem],
             verify: bool, num_threads: int, skip: Container[tuple[str, int]] = ()) -> None:
    """Read `items` straight into their destinations (buffers of the tools' own, never the caller's
    state: a load verifies every read first, `VerifiedReads`)."""
    items = list(items)
    if not items:
        return
    maps = FileMaps(storage)
    ordered_after_callers(it.dest for it in items)
    _run_each(lambda it: read_item(storage, files, block, it, verify, maps, skip), items, num_threads)

def _run_each(fn, items: list, num_threads: int) -> None:
    """fn(item) for every item on up to `num_threads` threads; the first error is raised once all ended."""
    if num_threads <= 1 or len(items) <= 1:
        for it in items:
            fn(it)
        return
    with ThreadPoolExecutor(min(num_threads, len(items)), thread_name_prefix="bcp-read") as pool:
        futures = [pool.submit(metrics.bind(fn), it) for it in items]
        errors = [f.exception() for f in futures]
    for e in errors:
        if e is not None:
            raise e

# ----------------------------------------------------------------------------- a load's verified reads
#
# A load changes none of the caller's state until every byte it needs has been read and verified.
# The bytes are held in between (`VerifiedReads`). Where the storage offers a memory map (local
# files, memory://) the map holds them, for free: checksums are computed on the mapped page cache
# and the bytes are copied from there into place afterwards, the same work as reading then
# verifying. Elsewhere (fsspec, S3) verified bytes are kept in buffers up to
# `LOAD_CONFIG.buffer_bytes` per rank (load_config.configure_load, 1 GiB by default); beyond that
# budget an item is verified in a first pass, in chunks, and read again into place in a second: its
# bytes cross the network twice, and a file changed between the two passes fails its checksum in the
# second (ChecksumError, saying that part of the state was loaded by then). Destinations made for the
# load itself (ReadItem.fresh) are not the caller's yet and are read into directly.

VERIFY_CHUNK_BYTES = 16 << 20  # bytes per read of a first-pass verification beyond the budget


@dataclass(frozen=True)
class Verified:
    """A read item whose bytes are verified: `span` holds its piece's bytes from piece offset `lo` on
    (a view of a memory map, or a buffer); None when they are read again into place (beyond the budget)."""

    item: ReadItem
    span: torch.Tensor | None
    lo: int


class VerifiedReads:
    """One rank's load between reading and writing into place: `read` reads and verifies, `commit`
    copies into the destinations. Thread-safe."""

    def __init__(self, storage: Storage, files: tuple[str, ...], block: int, verify: bool):
        self.storage, self.files, self.block, self.verify = storage, files, block, verify
        self.budget = LOAD_CONFIG.buffer_bytes
        self.buffered = 0  # bytes of buffers kept, at most `budget`
        self.maps = FileMaps(storage)
        self._verified: list[Verified] = []
        self._lock = threading.Lock()

    def _reserve(self, nbytes: int) -> bool:
        with self._lock:
            if self.buffered + nbytes > self.budget:
                return False
            self.buffered += nbytes
            return True

    def _keep(self, verified: Verified) -> None:
        with self._lock:
            self._verified.append(verified)

    def read(self, item: ReadItem, skip: Container[tuple[str, int]] = ()) -> None:
        """Read and verify one item (blocks in `skip` are verified by another rank)."""
        if math.prod(item.lengths) == 0:
            return
        if item.fresh:
            read_item(self.storage, self.files, self.block, item, self.verify, self.maps, skip)
            return
        lo, hi = item_span(item, self.block, self.verify)
        p = item.piece
        mapped = self.maps.view(self.files[p.file], p.byte_offset + lo, hi - lo) is not None
        span = read_span(self.storage, self.files, item, lo, hi, self.maps) \
            if mapped or self._reserve(hi - lo) else None
        if span is not None:
            if self.verify:
                _verify(tensor_bytes(span), lo, item, self.files[p.file], self.block, skip)
        elif self.verify:
            self._verify_in_chunks(item, lo, hi, skip)
        self._keep(Verified(item, span, lo))

    def read_each(self, items: list[ReadItem], num_threads: int, skip: Container[tuple[str, int]] = ()) -> None:
        """`read` every item, on up to `num_threads` threads."""
        _run_each(lambda it: self.read(it, skip), items, num_threads)

    def take(self, items: list[ReadItem], span: torch.Tensor, lo: int) -> None:
        """Bytes read or received elsewhere (`span`: piece bytes from `lo`) for `items`: verified here,
        then kept (within the budget; else read again at commit), or copied at once into a fresh destination."""
        p = items[0].piece
        if self.verify:  # the items share the range, so its blocks are checked once
            _verify(tensor_bytes(span), lo, items[0], self.files[p.file], self.block)
        keep = any(not it.fresh for it in items) and self._reserve(span.numel())
        for it in items:
            if it.fresh:
                copy_span(it, span, lo)
            else:
                self._keep(Verified(it, span if keep else None, lo))

    def _verify_in_chunks(self, item: ReadItem, lo: int, hi: int, skip: Container[tuple[str, int]]) -> None:
        """The first pass beyond the budget: read [lo, hi) a chunk at a time and check its blocks."""
        p = item.piece
        chunk = max(1, VERIFY_CHUNK_BYTES // self.block) * self.block
        buf = torch.empty(min(chunk, hi - lo), dtype=torch.uint8)
        for start in range(lo, hi, chunk):
            end = min(start + chunk, hi)
            data = read_span(self.storage, self.files, item, start, end, out=buf[:end - start])
            _verify(tensor_bytes(data), start, item, self.files[p.file], self.block, skip)

    def commit(self, num_threads: int) -> None:
        """Copy every verified item into its destination: the caller's state changes from here on."""
        def put(v: Verified) -> None:
            if v.span is not None:
                copy_span(v.item, v.span, v.lo)
                return
            try:
                read_item(self.storage, self.files, self.block, v.item, self.verify, self.maps)
            except ChecksumError as e:
                raise ChecksumError(f"{e}; the file changed after this load had verified it, and part of the "
                                    "state was loaded by then", file=e.file) from None
        with self._lock:
            verified, self._verified = self._verified, []
        _run_each(put, verified, num_threads)
