"""POSIX directories (`/dir`, `file:///dir`) and RAM (`memory://name`, tmpfs shared by a machine's processes).

Large writes and reads are split into chunks done by parallel `pwrite`/`pread` threads, which
release the GIL.
"""

from __future__ import annotations

import mmap
import os
import shutil

from ..errors import StorageError
from ..utils import this_rank
from .base import FileWriter, Storage, chunks, register_storage, run_all


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


class _LocalWriter(FileWriter):
    def __init__(self, path: str, fsync: bool):
        self.path, self.fsync = path, fsync
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.pos = 0

    def write(self, data: memoryview) -> None:
        data = memoryview(data).cast("B")
        pos = self.pos
        # Big buffers go out as parallel pwrites of chunks at their offsets.
        run_all([lambda lo=lo, hi=hi: _pwrite_all(self.fd, data[lo:hi], pos + lo) for lo, hi in chunks(len(data))])
        self.pos += len(data)

    def close(self) -> None:
        try:
            if self.fsync:
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


