"""POSIX directories (`/dir`, `file:///dir`) and RAM (`memory://name`, tmpfs shared by a machine's processes).

Large writes and reads are split into chunks done by parallel `pwrite`/`pread` threads, which
release the GIL.

Durable writes go around the page cache (O_DIRECT, where the OS and filesystem allow it): the
bytes pass through a few reused page-aligned buffers straight to the device. A buffered write
must first get, fill and later write back a page-cache page per 4 KiB; that kernel work runs on
the cores training uses, and a checkpoint read by no one fills memory that training needs.
`configure_storage(direct_io=False)` keeps every write buffered.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import threading

import numpy as np

from ..errors import StorageError
from ..utils import this_rank
from .base import CONFIG, FileWriter, Storage, chunks, register_storage, run_all


# ----------------------------------------------------------------------------- local / POSIX

def _pwrite_all(fd: int, data: memoryview, pos: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, pos)  # releases the GIL
        data, pos = data[n:], pos + n


def _pread_all(fd: int, out: memoryview, pos: int, path: str) -> None:
    got = 0
    while got < len(out):
        n = os.preadv(fd, [out[got:]], pos + got)  # releases the GIL, no extra copy
        if n == 0:
            raise StorageError(f"rank {this_rank()}: read {path}: file ends at byte {pos + got}, expected "
                               f"{len(out) - got} more bytes (truncated file?)")
        got += n


# O_DIRECT needs the buffer address, the file offset and the length aligned to the device's
# logical block: 512 B or 4 KiB on the devices and filesystems in use.
ALIGN = 4096


class _AlignedBuffers:
    """Page-aligned buffers (anonymous maps) of `chunk_bytes`, reused from one write to the next:
    their pages are faulted in once per process, not once per checkpoint. At most `KEEP` stay
    mapped between writes (64 MiB with the default chunk)."""

    KEEP = 4

    def __init__(self):
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    @staticmethod
    def size() -> int:
        return -(-CONFIG.chunk_bytes // ALIGN) * ALIGN

    def get(self) -> mmap.mmap:
        with self._lock:
            while self._free:
                buf = self._free.pop()
                if len(buf) == self.size():
                    return buf
                buf.close()
        return mmap.mmap(-1, self.size())

    def put(self, buf: mmap.mmap) -> None:
        with self._lock:
            if len(self._free) < self.KEEP and len(buf) == self.size():
                self._free.append(buf)
                return
        buf.close()


_ALIGNED = _AlignedBuffers()


def _copy(dst: np.ndarray, src) -> None:
    """memcpy that releases the GIL (numpy does for plain byte arrays), so training threads run on."""
    np.copyto(dst, np.frombuffer(src, dtype=np.uint8))


class _LocalWriter(FileWriter):
    """A file written at increasing offsets: in parallel chunks, directly to the device if it can."""

    def __init__(self, path: str, fsync: bool):
        self.path, self.fsync = path, fsync
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        # direct I/O for durable files only: memory:// (no fsync) lives in the page cache by design
        self.direct = fsync and CONFIG.direct_io and hasattr(os, "O_DIRECT")
        if self.direct:
            try:
                self.fd = os.open(path, flags | os.O_DIRECT, 0o644)
            except OSError as e:
                if e.errno != errno.EINVAL:  # EINVAL: this filesystem has no direct I/O
                    raise
                self.direct = False
        if not self.direct:
            self.fd = os.open(path, flags, 0o644)
        self.pos = 0
        self.tail = b""  # direct I/O: the bytes after the last aligned offset, not written yet

    def write(self, data: memoryview) -> None:
        data = memoryview(data).cast("B")
        if self.direct:
            try:
                self._write_direct(data)
                return
            except OSError as e:
                if e.errno != errno.EINVAL:  # EINVAL: the device wants another alignment
                    raise
                self._stop_direct()
        pos = self.pos
        run_all([lambda lo=lo, hi=hi: _pwrite_all(self.fd, data[lo:hi], pos + lo) for lo, hi in chunks(len(data))])
        self.pos += len(data)

    def _write_direct(self, data: memoryview) -> None:
        """Write the aligned part of (tail + data) through aligned buffers; keep the rest as tail.
        State changes only once every chunk is written, so a failed call can be redone buffered."""
        tail, start = self.tail, self.pos - len(self.tail)  # start is aligned
        whole = (len(tail) + len(data)) // ALIGN * ALIGN
        step = _ALIGNED.size()

        def put(lo: int, hi: int) -> None:  # bytes [lo, hi) of tail + data
            buf = _ALIGNED.get()
            try:
                out = np.frombuffer(buf, dtype=np.uint8, count=hi - lo)
                split = max(0, min(len(tail), hi) - lo)
                if split:
                    _copy(out[:split], tail[lo:lo + split])
                _copy(out[split:], data[max(0, lo - len(tail)):hi - len(tail)])
                _pwrite_all(self.fd, memoryview(buf)[:hi - lo], start + lo)
            finally:
                _ALIGNED.put(buf)
        if whole:
            run_all([lambda lo=lo: put(lo, min(lo + step, whole)) for lo in range(0, whole, step)])
        rest = data[max(0, whole - len(tail)):]
        self.tail = bytes(tail[whole:]) + bytes(rest) if whole < len(tail) else bytes(rest)
        self.pos += len(data)

    def _stop_direct(self) -> None:
        """Go on buffered: rewrite the unwritten tail through the page cache."""
        import fcntl  # POSIX only, as O_DIRECT is
        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        self.direct = False
        _pwrite_all(self.fd, memoryview(self.tail), self.pos - len(self.tail))
        self.tail = b""

    def _finish_direct(self) -> None:
        """The last partial block goes out padded to the alignment; the file is then cut to size."""
        if not self.tail:
            return
        buf = _ALIGNED.get()
        try:
            n = -(-len(self.tail) // ALIGN) * ALIGN
            buf[:len(self.tail)] = self.tail
            buf[len(self.tail):n] = bytes(n - len(self.tail))
            try:
                _pwrite_all(self.fd, memoryview(buf)[:n], self.pos - len(self.tail))
                self.tail = b""
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._stop_direct()
        finally:
            _ALIGNED.put(buf)
        os.ftruncate(self.fd, self.pos)

    def close(self) -> None:
        try:
            if self.direct:
                self._finish_direct()
            if self.fsync:  # direct writes too: the file's size and the device's cache
                os.fsync(self.fd)
        finally:
            os.close(self.fd)

    def abort(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


@register_storage
class LocalStorage(Storage):
    """A POSIX directory (local disk, NFS, Lustre...)."""

    schemes = ("file",)
    remote = False  # POSIX paths count as local; a loader spots a multi-node job by its node count

    def __init__(self, root: str, fsync: bool = True):
        super().__init__(root.removeprefix("file://"), fsync)

    def join(self, relpath: str) -> str:
        return os.path.join(self.root, *relpath.split("/")) if relpath else self.root

    def _path(self, relpath: str) -> str:
        """The OS path of relpath (join() is what messages show; they differ for MemoryStorage)."""
        return LocalStorage.join(self, relpath)

    def open_writer(self, relpath: str) -> FileWriter:
        return _LocalWriter(self._path(relpath), self.fsync)

    def read_into(self, relpath: str, offset: int, out: memoryview) -> None:
        out = memoryview(out).cast("B")
        path = self._path(relpath)
        fd = os.open(path, os.O_RDONLY)
        try:
            run_all([lambda lo=lo, hi=hi: _pread_all(fd, out[lo:hi], offset + lo, self.join(relpath))
                      for lo, hi in chunks(len(out))])
        finally:
            os.close(fd)

    def size(self, relpath: str) -> int:
        return os.path.getsize(self._path(relpath))

    def map(self, relpath: str) -> memoryview | None:
        with open(self._path(relpath), "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return memoryview(b"")
            return memoryview(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ))

    def write_atomic(self, relpath: str, data: bytes) -> None:
        path = self._path(relpath)
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if self.fsync:
            _fsync_dir(os.path.dirname(path) or ".")

    def read_bytes(self, relpath: str) -> bytes:
        with open(self._path(relpath), "rb") as f:
            return f.read()

    def exists(self, relpath: str) -> bool:
        return os.path.exists(self._path(relpath))

    def listdir(self, relpath: str = "") -> list[str]:
        try:
            return sorted(os.listdir(self._path(relpath)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def makedirs(self, relpath: str = "") -> None:
        os.makedirs(self._path(relpath), exist_ok=True)

    def remove(self, relpath: str) -> None:
        path = self._path(relpath)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- in memory

def memory_dir() -> str:
    """Where `memory://` checkpoints live: $BCP_MEMORY_DIR, else /dev/shm (tmpfs: RAM, shared by processes)."""
    base = os.environ.get("BCP_MEMORY_DIR") or "/dev/shm"
    if not os.path.isdir(base):
        raise StorageError(f"memory:// storage needs a tmpfs directory; {base} does not exist "
                           "(set BCP_MEMORY_DIR to a RAM-backed directory)")
    return os.path.join(base, "bcp-memory")


@register_storage
class MemoryStorage(LocalStorage):
    """`memory://NAME/...`: files in RAM (tmpfs), visible to every process of this machine.

    For fast in-memory checkpoints: no fsync, no network; it survives the training process
    (a restarted job on the same machine loads from it) but not a reboot. Files stay in RAM
    until removed (`bcp prune`, or `storage_for(url).remove("")`).
    """

    schemes = ("memory",)

    def __init__(self, root: str, fsync: bool = True):
        rest = root.split("://", 1)[1] if "://" in root else root
        parts = [p for p in rest.split("/") if p]
        if not parts or any(p in (".", "..") for p in parts):
            raise StorageError(f"bad memory:// path {root!r}: expected memory://NAME[/SUBDIR...] without '..'")
        Storage.__init__(self, "memory://" + "/".join(parts), fsync=False)  # tmpfs has nothing to sync
        self.local_root = os.path.join(memory_dir(), *parts)

    def join(self, relpath: str) -> str:
        return Storage.join(self, relpath)

    def _path(self, relpath: str) -> str:
        return os.path.join(self.local_root, *relpath.split("/")) if relpath else self.local_root


