"""The storage interface: `Storage` and `FileWriter`, the scheme registry, process-wide I/O settings.

A backend is one class implementing `Storage`, registered with `register_storage` for the URL
schemes it serves; `storage_for(path)` picks it by the path's scheme. Every method takes a path
relative to the storage root (`/`-separated): the engine never builds backend-specific paths.
docs/storage.md describes configuration and how to add a backend.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from ..errors import StorageError
from ..load_config import configure_load
from ..utils import cores_per_rank


# ----------------------------------------------------------------------------- configuration

@dataclass
class StorageConfig:
    """Process-wide I/O settings; change them with `configure_storage`."""

    # threads per chunked read/write; None: this rank's share of the host's cores, at most 16, read when
    # used (more would only take cores from training); remote requests use at least REMOTE_THREADS
    io_threads: int | None = None
    chunk_bytes: int = 16 << 20        # ranged reads and local pwrite/pread are split into chunks this big
    direct_io: bool = True             # durable local files are written around the page cache (O_DIRECT)
    part_bytes: int = 16 << 20         # object-store upload part (S3 needs >= 5 MiB for all but the last)
    max_inflight_parts: int = 4        # parts buffered per file being uploaded (bounds memory)
    retry_attempts: int = 5            # attempts per request, the first one included
    retry_base_delay: float = 0.2      # seconds before the first retry; doubles each time, with jitter
    retry_max_delay: float = 10.0


CONFIG = StorageConfig()
FS_OPTIONS: dict[str, dict[str, Any]] = {}


# Load settings that `configure_storage` took before they moved to `load_config`, and their names there.
_LOAD_SETTINGS = {"load_staging_bytes": "buffer_bytes", "transfer_window_bytes": "transfer_window_bytes"}


def configure_storage(**changes: Any) -> StorageConfig:
    """Change fields of `CONFIG` (e.g. `configure_storage(part_bytes=64 << 20, retry_attempts=8)`).
    `load_staging_bytes` and `transfer_window_bytes` go on to `load_config.configure_load`."""
    known = {f.name for f in fields(StorageConfig)}
    configure_load(**{_LOAD_SETTINGS[k]: changes.pop(k) for k in list(changes) if k in _LOAD_SETTINGS})
    for k, v in changes.items():
        if k not in known:
            raise ValueError(f"unknown storage setting {k!r}; known: {sorted(known | set(_LOAD_SETTINGS))}")
        if v is None:
            continue
        if k == "direct_io":
            if not isinstance(v, bool):
                raise ValueError(f"storage setting direct_io={v!r} must be True or False")
            setattr(CONFIG, k, v)
            continue
        lowest = 0 if k in ("retry_base_delay", "retry_max_delay") else 1
        if not isinstance(v, (int, float)) or v < lowest:
            raise ValueError(f"storage setting {k}={v!r} must be a number >= {lowest}")
        setattr(CONFIG, k, v)
    return CONFIG


def set_storage_options(scheme: str, **options: Any) -> None:
    """Keyword arguments for the fsspec filesystem of `scheme` (e.g. `endpoint_url` for s3).

    The special option `upload` forces the upload strategy: "multipart" (S3), "compose"
    (parts + the filesystem's `merge`), or "stream" (one sequential stream per file).
    Options from fsspec's own config (`FSSPEC_S3_ENDPOINT_URL=...`, `FSSPEC_S3='{json}'`)
    apply too; these take precedence.
    """
    FS_OPTIONS[scheme.lower()] = dict(options)


# ----------------------------------------------------------------------------- I/O threads
#
# Threads live only as long as the operation that needs them (one call of run_all, one file being
# uploaded). Idle threads left to the interpreter's shutdown were seen to make gloo's worker threads
# abort the process at exit (a collective's teardown then runs while Python is finalizing).

REMOTE_THREADS = 4


def io_threads() -> int:
    return CONFIG.io_threads or min(16, cores_per_rank())


def run_all(tasks: list[Callable[[], None]], threads: int | None = None) -> None:
    """Run tasks on up to `threads` (io_threads()) threads and wait for all; re-raise the first
    error after every task ended."""
    if len(tasks) == 1:
        tasks[0]()
        return
    with ThreadPoolExecutor(min(len(tasks), threads or io_threads()), thread_name_prefix="bcp-io") as pool:
        futures = [pool.submit(t) for t in tasks]
        errors = [f.exception() for f in futures]
    for e in errors:
        if e is not None:
            raise e


def chunks(n: int) -> list[tuple[int, int]]:
    step = CONFIG.chunk_bytes
    return [(i, min(i + step, n)) for i in range(0, n, step)] or [(0, 0)]


# ----------------------------------------------------------------------------- interface

# The smallest write a writer with `FileWriter.align` takes in place (from the caller's memory).
IN_PLACE_BYTES = 1 << 20


class FileWriter(ABC):
    """A file being written sequentially. `close()` makes it durable and visible; nothing is visible before.

    `write` has consumed (written or copied) the buffer when it returns, so callers may reuse it.
    `write_bytes`: how much a `write` call should bring at most, where small calls cost the writer
    nothing (it copies into buffers of its own); None: large calls are better (a writer that cuts
    them into parallel chunks).

    `align`: nonzero for a writer that can send a buffer of at least `IN_PLACE_BYTES` to storage
    from the caller's memory, without a copy (`write_in_place`), when its address and the file
    position agree modulo `align` (direct I/O); callers lay files out so that large pieces land so.
    """

    write_bytes: int | None = None
    align: int = 0

    @abstractmethod
    def write(self, data: memoryview) -> None: ...

    def can_write_in_place(self, data: memoryview) -> bool:
        """Whether `write_in_place(data)`, called next, would take the bulk of `data` from the
        caller's memory (no copy)."""
        return False

    def write_in_place(self, data: memoryview) -> None:
        """`write`, taking the bulk of `data` from the caller's memory: for `data` that
        `can_write_in_place` has just accepted, and which must not change until this returns."""
        self.write(data)

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def abort(self) -> None:
        """Give up on the file (best effort); called on errors. A partly uploaded file is discarded."""


class Storage(ABC):
    """A directory tree in some store, rooted at `root`."""

    schemes: ClassVar[tuple[str, ...]] = ()
    # Whether the bytes live across a network (object stores, HDFS): reading once and sharing
    # between ranks pays off there, not for local disk or RAM.
    remote: ClassVar[bool] = True
    # Whether each machine has files of its own under the same path (RAM): ranks of different nodes
    # never read the same bytes, so a load shares work between the ranks of a node only.
    node_local: ClassVar[bool] = False

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

    def map(self, relpath: str) -> memoryview | None:
        """A read-only view of the whole file without copying it (a memory map), or None if the
        backend cannot offer one. Readers that need scattered parts of a file use it."""
        return None

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
        """Remove a file or a whole directory tree; missing is not an error. A symbolic link is removed
        as a link (its target is never touched), and a path is never followed through one. What could
        not be removed raises a StorageError naming it."""

    def retire(self, relpath: str) -> None:
        """Remove the checkpoint directory `relpath` that a newer checkpoint of the same job replaced
        (a tiered save's retention). As `remove` here; a storage may keep its files for the writes of
        the job's next checkpoints (MemoryStorage)."""
        self.remove(relpath)

    def sync_dir(self, relpath: str = "") -> None:
        """Make a directory's entries (files created, renamed or removed in it) durable: an fsync of
        the POSIX directory when this storage fsyncs; nothing on stores without directories."""
        return None

    def sync_entry(self) -> None:
        """Make this root's own entry in its parent directory durable (the parent's `sync_dir`)."""
        return None

    def is_link(self, relpath: str) -> bool:
        """Whether relpath is a symbolic link (never, on stores without links)."""
        return False

    def modified(self, relpath: str) -> float | None:
        """When the file was last written, in seconds since the epoch; None if missing or unknown."""
        return None


_REGISTRY: dict[str, type[Storage]] = {}


def register_storage(cls: type[Storage]) -> type[Storage]:
    """Class decorator: route every scheme in `cls.schemes` to `cls` (`"*"`: every unclaimed scheme)."""
    for scheme in cls.schemes:
        _REGISTRY[scheme.lower()] = cls
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
        cls = _REGISTRY.get("*")  # the catch-all backend (fsspec)
    if cls is None:
        raise StorageError(f"no storage backend for scheme {scheme!r} in path {path!r}; "
                           f"known schemes: {sorted(_REGISTRY)}")
    return cls(path, fsync=fsync)


# ----------------------------------------------------------------------------- temporary files
#
# Files that must appear whole (the metadata, the tracker, local data files) are written under a
# temporary name in their own directory and renamed into place. The name says which process wrote
# it, so that a later save can tell a leftover of a writer that died from a file being written now
# (layout.remove_leftovers).

TEMP_PATTERN = re.compile(r"^(.+)\.bcp-tmp\.([A-Za-z0-9-]+)\.(\d+)\.[0-9a-f]{8}$")


@dataclass(frozen=True)
class TempFile:
    """What the name of a temporary file says."""

    target: str   # the name it becomes once complete
    host: str     # this_host() of its writer
    pid: int      # its writer's process id


def this_host() -> str:
    """This machine's name as it appears in temporary file names (letters, digits and '-')."""
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:63] or "host"


def temp_name(name: str) -> str:
    """`<name>.bcp-tmp.<host>.<pid>.<8 hex>`: unique to this call, and names its writer."""
    return f"{name}.bcp-tmp.{this_host()}.{os.getpid()}.{secrets.token_hex(4)}"


def parse_temp_name(name: str) -> TempFile | None:
    """The writer of a temporary file named by `temp_name`; None for any other name."""
    m = TEMP_PATTERN.match(name)
    return TempFile(m.group(1), m.group(2), int(m.group(3))) if m else None


def temp_writer_gone(temp: TempFile) -> bool:
    """Whether the writer of a temporary file is known to have ended: a process of this host that no
    longer runs. A writer on another host cannot be asked (its file's age tells instead)."""
    if temp.host != this_host():
        return False
    try:
        os.kill(temp.pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    except PermissionError:  # it runs, as another user
        pass
    return False


def write_all(writer: FileWriter, chunks: Iterable[memoryview]) -> None:
    try:
        for c in chunks:
            writer.write(c)
        writer.close()
    except BaseException:
        writer.abort()
        raise

