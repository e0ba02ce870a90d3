"""Storage backends, chosen by the path's URL scheme.

A backend is one class implementing `Storage` and registered with
`register_storage`. Every method takes a path relative to the storage root
(`/`-separated); the engine never builds backend-specific paths itself.
"""

from __future__ import annotations

import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import ClassVar

from .errors import StorageError


class FileWriter(ABC):
    """A file being written sequentially. `close()` makes it durable if the storage was asked to."""

    @abstractmethod
    def write(self, data: memoryview) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def abort(self) -> None:
        """Give up on the file (best effort); called on errors."""


class Storage(ABC):
    """A directory tree in some store, rooted at `root`."""

    schemes: ClassVar[tuple[str, ...]] = ()

    def __init__(self, root: str, fsync: bool = True):
        self.root = root
        self.fsync = fsync

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.root!r})"

    def child(self, relpath: str) -> Storage:
        """A storage of the same kind rooted at a subdirectory."""
        return type(self)(self.join(relpath), fsync=self.fsync)

    def join(self, relpath: str) -> str:
        return self.root.rstrip("/") + "/" + relpath if relpath else self.root

    @abstractmethod
    def open_writer(self, relpath: str) -> FileWriter: ...

    @abstractmethod
    def read_into(self, relpath: str, offset: int, out: memoryview) -> None:
        """Fill `out` with the bytes at [offset, offset+len(out)); short files are an error."""

    @abstractmethod
    def size(self, relpath: str) -> int: ...

    @abstractmethod
    def write_atomic(self, relpath: str, data: bytes) -> None:
        """Replace the file with `data` so readers see either the old or the new content, durably."""

    @abstractmethod
    def read_bytes(self, relpath: str) -> bytes: ...

    @abstractmethod
    def exists(self, relpath: str) -> bool: ...

    @abstractmethod
    def listdir(self, relpath: str = "") -> list[str]:
        """Names directly under relpath; empty if it does not exist."""

    @abstractmethod
    def makedirs(self, relpath: str = "") -> None: ...

    @abstractmethod
    def remove(self, relpath: str) -> None:
        """Remove a file or a whole directory tree; missing is not an error."""


_REGISTRY: dict[str, type[Storage]] = {}


def register_storage(cls: type[Storage]) -> type[Storage]:
    """Class decorator: route every scheme in `cls.schemes` to `cls`."""
    for scheme in cls.schemes:
        _REGISTRY[scheme] = cls
    return cls


def scheme_of(path: str) -> str:
    head, sep, _ = str(path).partition("://")
    return head.lower() if sep else "file"


def storage_for(path: str | os.PathLike, fsync: bool = True) -> Storage:
    """The registered storage for `path` (`/dir`, `file:///dir`, `s3://bucket/key`, ...)."""
    path = os.fspath(path)
    scheme = scheme_of(path)
    cls = _REGISTRY.get(scheme)
    if cls is None:
        cls = _REGISTRY.get("*")  # a catch-all backend (fsspec) if one is registered
    if cls is None:
        raise StorageError(f"no storage backend for scheme {scheme!r} in path {path!r}; "
                           f"known schemes: {sorted(_REGISTRY)}")
    return cls(path, fsync=fsync)


# ----------------------------------------------------------------------------- local / POSIX

class _LocalWriter(FileWriter):
    def __init__(self, path: str, fsync: bool):
        self.path, self.fsync = path, fsync
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def write(self, data: memoryview) -> None:
        data = memoryview(data).cast("B")
        while len(data):
            n = os.write(self.fd, data)  # releases the GIL
            data = data[n:]

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

    def __init__(self, root: str, fsync: bool = True):
        super().__init__(root.removeprefix("file://"), fsync)

    def join(self, relpath: str) -> str:
        return os.path.join(self.root, *relpath.split("/")) if relpath else self.root

    def open_writer(self, relpath: str) -> FileWriter:
        return _LocalWriter(self.join(relpath), self.fsync)

    def read_into(self, relpath: str, offset: int, out: memoryview) -> None:
        out = memoryview(out).cast("B")
        fd = os.open(self.join(relpath), os.O_RDONLY)
        try:
            got = 0
            while got < len(out):
                n = os.preadv(fd, [out[got:]], offset + got)  # releases the GIL, no extra copy
                if n == 0:
                    raise StorageError(f"{self.join(relpath)}: file ends at byte {offset + got}, "
                                       f"expected {len(out) - got} more bytes (truncated file?)")
                got += n
        finally:
            os.close(fd)

    def size(self, relpath: str) -> int:
        return os.path.getsize(self.join(relpath))

    def write_atomic(self, relpath: str, data: bytes) -> None:
        path = self.join(relpath)
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
        with open(self.join(relpath), "rb") as f:
            return f.read()

    def exists(self, relpath: str) -> bool:
        return os.path.exists(self.join(relpath))

    def listdir(self, relpath: str = "") -> list[str]:
        try:
            return sorted(os.listdir(self.join(relpath)))
        except FileNotFoundError:
            return []

    def makedirs(self, relpath: str = "") -> None:
        os.makedirs(self.join(relpath), exist_ok=True)

    def remove(self, relpath: str) -> None:
        path = self.join(relpath)
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


def write_all(writer: FileWriter, chunks: Iterable[memoryview]) -> None:
    try:
        for c in chunks:
            writer.write(c)
        writer.close()
    except BaseException:
        writer.abort()
        raise
