"""Storage backends, chosen by the path's URL scheme.

A backend is one class implementing `Storage` and registered with
`register_storage`. Every method takes a path relative to the storage root
(`/`-separated); the engine never builds backend-specific paths itself.

Backends shipped here:

- `LocalStorage` (`/dir`, `file:///dir`): POSIX files; large writes and reads
  are split into chunks done by parallel `pwrite`/`pread` threads.
- `MemoryStorage` (`memory://name`): checkpoints kept in RAM (tmpfs under
  /dev/shm), shared by every process of the machine, so all ranks of a node
  see each other's files and a restarted job finds them.
- `FsspecStorage` (every other scheme: `s3://`, `gs://`, `hdfs://`, ...): any
  fsspec filesystem. Files are uploaded as parts in parallel (S3 multipart, or
  split-and-compose on stores with a `merge` operation such as GCS), large
  reads are split into parallel ranged reads, and every request is retried
  with backoff on transient errors.

docs/storage.md describes configuration and how to add a backend.
"""

from __future__ import annotations

import logging
import mmap
import os
import random
import shutil
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from .errors import StorageError

log = logging.getLogger("bcp")


class TransientStorageError(StorageError):
    """A failure that may succeed when tried again (a backend raises it to ask for a retry)."""


class StorageFileNotFoundError(StorageError, FileNotFoundError):
    """The file does not exist (never retried)."""


# ----------------------------------------------------------------------------- configuration

@dataclass
class StorageConfig:
    """Process-wide I/O settings; change them with `configure_storage`."""

    io_threads: int = min(16, max(4, os.cpu_count() or 4))  # threads per chunked read/write
    chunk_bytes: int = 16 << 20        # ranged reads and local pwrite/pread are split into chunks this big
    part_bytes: int = 16 << 20         # object-store upload part (S3 needs >= 5 MiB for all but the last)
    max_inflight_parts: int = 4        # parts buffered per file being uploaded (bounds memory)
    retry_attempts: int = 5            # attempts per request, the first one included
    retry_base_delay: float = 0.2      # seconds before the first retry; doubles each time, with jitter
    retry_max_delay: float = 10.0


CONFIG = StorageConfig()
_FS_OPTIONS: dict[str, dict[str, Any]] = {}


def configure_storage(**changes: Any) -> StorageConfig:
    """Change fields of `CONFIG` (e.g. `configure_storage(part_bytes=64 << 20, retry_attempts=8)`)."""
    known = {f.name for f in fields(StorageConfig)}
    for k, v in changes.items():
        if k not in known:
            raise ValueError(f"unknown storage setting {k!r}; known: {sorted(known)}")
        if v is None:
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
    _FS_OPTIONS[scheme.lower()] = dict(options)


# ----------------------------------------------------------------------------- I/O threads
#
# Threads live only as long as the operation that needs them (one call of _run_all, one file being
# uploaded). Idle threads left to the interpreter's shutdown were seen to make gloo's worker threads
# abort the process at exit (a collective's teardown then runs while Python is finalizing).

def _run_all(tasks: list[Callable[[], None]]) -> None:
    """Run tasks on up to CONFIG.io_threads threads and wait for all; re-raise the first error after
    every task ended."""
    if len(tasks) == 1:
        tasks[0]()
        return
    with ThreadPoolExecutor(min(len(tasks), CONFIG.io_threads), thread_name_prefix="bcp-io") as pool:
        futures = [pool.submit(t) for t in tasks]
        errors = [f.exception() for f in futures]
    for e in errors:
        if e is not None:
            raise e


# ----------------------------------------------------------------------------- retries

_TRANSIENT_CODES = {
    "SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling", "ThrottlingException",
    "RequestLimitExceeded", "TooManyRequests", "RequestTimeTooSkewed", "BadDigest", "XAmzContentSHA256Mismatch",
}
_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
# Exception class names (anywhere in the MRO) from optional HTTP/cloud libraries that mean "try again";
# matched by name so that none of those libraries has to be imported.
_TRANSIENT_NAMES = {
    "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
    "ClientPayloadError", "ServerDisconnectedError", "ClientConnectionError", "ClientOSError",
    "IncompleteRead", "ResponseParserError", "FSTimeoutError", "HTTPClientError", "ProtocolError",
    "RetryError", "TransportError", "ServiceUnavailable", "TooManyRequests", "InternalServerError",
    "BadGateway", "GatewayTimeout",
}
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError,
              ValueError, TypeError)


def is_transient(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) is a failure worth retrying: network, throttling, 5xx."""
    seen = 0
    e: BaseException | None = exc
    while e is not None and seen < 8:
        if isinstance(e, TransientStorageError):
            return True
        if isinstance(e, StorageError):
            return False
        response = getattr(e, "response", None)  # botocore ClientError and alike
        if isinstance(response, dict):
            err = response.get("Error") or {}
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            return err.get("Code") in _TRANSIENT_CODES or status in _TRANSIENT_STATUS
        if isinstance(e, (ConnectionError, TimeoutError)):
            return True
        if any(c.__name__ in _TRANSIENT_NAMES for c in type(e).__mro__):
            return True
        if isinstance(e, _PERMANENT) and e.__cause__ is None:
            return False
        e = e.__cause__ or e.__context__
        seen += 1
    return False


class _RetryStats:
    def __init__(self):
        self.lock = threading.Lock()
        self.retries = 0      # transient failures that were retried
        self.gave_up = 0      # operations that failed after all attempts or permanently

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return {"retries": self.retries, "gave_up": self.gave_up}


_STATS = _RetryStats()


def retry_stats(reset: bool = False) -> dict[str, int]:
    """Counts of retried transient failures and of failed operations in this process."""
    snap = _STATS.snapshot()
    if reset:
        with _STATS.lock:
            _STATS.retries = _STATS.gave_up = 0
    return snap


def current_rank() -> str:
    """This process's rank for error messages: the initialised process group's, else $RANK, else 0."""
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return str(dist.get_rank())
    except Exception:  # noqa: BLE001 - only for a message
        pass
    return os.environ.get("RANK", "0")


def with_retries(stage: str, where: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call fn, retrying transient failures with exponential backoff and jitter.

    A permanent failure (or the last transient one) becomes a StorageError naming the
    rank, the stage (e.g. "upload part 3") and the file.
    """
    attempts = max(1, CONFIG.retry_attempts)
    for attempt in range(1, attempts + 1):
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - classified below
            transient = is_transient(e)
            if isinstance(e, StorageError) and not transient:
                raise  # already says where and why
            if not transient or attempt == attempts:
                with _STATS.lock:
                    _STATS.gave_up += 1
                why = f"after {attempt} attempts" if transient else "(permanent error, not retried)"
                cls = StorageFileNotFoundError if isinstance(e, FileNotFoundError) else StorageError
                raise cls(f"rank {current_rank()}: {stage} {where} failed {why}: "
                          f"{type(e).__name__}: {e}") from e
            delay = min(CONFIG.retry_max_delay, CONFIG.retry_base_delay * 2 ** (attempt - 1))
            delay *= 0.5 + random.random() / 2
            with _STATS.lock:
                _STATS.retries += 1
            log.warning("bcp: rank %s: transient error during %s %s (attempt %d/%d): %s: %s; retrying in %.2fs",
                        current_rank(), stage, where, attempt, attempts, type(e).__name__, e, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


# ----------------------------------------------------------------------------- interface

class FileWriter(ABC):
    """A file being written sequentially. `close()` makes it durable and visible; nothing is visible before.

    `write` has consumed (written or copied) the buffer when it returns, so callers may reuse it.
    """

    @abstractmethod
    def write(self, data: memoryview) -> None: ...

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
        """Remove a file or a whole directory tree; missing is not an error."""


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
            raise StorageError(f"rank {current_rank()}: read {path}: file ends at byte {pos + got}, expected "
                               f"{len(out) - got} more bytes (truncated file?)")
        got += n


def _chunks(n: int) -> list[tuple[int, int]]:
    step = CONFIG.chunk_bytes
    return [(i, min(i + step, n)) for i in range(0, n, step)] or [(0, 0)]


class _LocalWriter(FileWriter):
    def __init__(self, path: str, fsync: bool):
        self.path, self.fsync = path, fsync
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.pos = 0

    def write(self, data: memoryview) -> None:
        data = memoryview(data).cast("B")
        pos = self.pos
        # Big buffers go out as parallel pwrites of chunks at their offsets.
        _run_all([lambda lo=lo, hi=hi: _pwrite_all(self.fd, data[lo:hi], pos + lo) for lo, hi in _chunks(len(data))])
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
            _run_all([lambda lo=lo, hi=hi: _pread_all(fd, out[lo:hi], offset + lo, self.join(relpath))
                      for lo, hi in _chunks(len(out))])
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


# ----------------------------------------------------------------------------- fsspec: writers

class _PartUploader(FileWriter):
    """Cuts the stream into parts of CONFIG.part_bytes and uploads them in parallel, on threads of its own.

    At most CONFIG.max_inflight_parts parts are buffered per file, so memory stays bounded.
    A file smaller than one part is sent in one request. Subclasses say how a part is sent,
    how the parts become the file, and how to clean up an aborted upload.
    """

    def __init__(self, st: FsspecStorage, relpath: str):
        self.st, self.path, self.url = st, st._p(relpath), st.join(relpath)
        self.part_bytes = CONFIG.part_bytes
        self.buf = bytearray()
        self.futures: list[Future] = []
        self.slots = threading.BoundedSemaphore(max(1, CONFIG.max_inflight_parts))
        self.failed: BaseException | None = None
        self.pool: ThreadPoolExecutor | None = None  # started with the first part, ended by close/abort

    # -- to implement
    def _begin(self) -> None: ...
    def _put_part(self, index: int, data: bytearray) -> Any: ...
    def _finish(self, results: list[Any]) -> None: ...
    def _discard(self) -> None: ...

    def _put_whole(self, data: bytes) -> None:
        with_retries("write", self.url, self.st.fs.pipe_file, self.path, data)

    # -- stream
    def write(self, data: memoryview) -> None:
        data = memoryview(data).cast("B")
        while len(data):
            if self.failed is not None:
                raise self.failed
            take = min(len(data), self.part_bytes - len(self.buf))
            self.buf += data[:take]
            data = data[take:]
            if len(self.buf) == self.part_bytes:
                self._submit()

    def _submit(self) -> None:
        if not self.futures:
            self._begin()
            self.pool = ThreadPoolExecutor(max(1, CONFIG.max_inflight_parts), thread_name_prefix="bcp-upload")
        self.slots.acquire()  # wait for a free slot: bounds buffered parts
        index, data = len(self.futures), self.buf
        self.buf = bytearray()
        try:
            self.futures.append(self.pool.submit(self._upload, index, data))
        except BaseException:
            self.slots.release()
            raise

    def _upload(self, index: int, data: bytearray) -> Any:
        try:
            return with_retries(f"upload part {index + 1} ({len(data)} bytes) of", self.url,
                                self._put_part, index, data)
        except BaseException as e:
            self.failed = e
            raise
        finally:
            self.slots.release()

    def close(self) -> None:
        if not self.futures:  # one request is enough
            self._put_whole(bytes(self.buf))
            self.st._invalidate(self.path)
            return
        try:
            if self.buf:
                self._submit()
            results = [f.result() for f in self.futures]  # raises the first failed part's error
        finally:
            self.pool.shutdown(wait=True)
        with_retries("complete upload of", self.url, self._finish, results)
        self.st._invalidate(self.path)

    def abort(self) -> None:
        for f in self.futures:
            f.cancel()
        for f in self.futures:
            if not f.cancelled():
                f.exception()  # wait for parts in flight before discarding them
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        if self.futures:
            try:
                self._discard()
            except Exception as e:  # noqa: BLE001 - best effort; the file was never made visible
                log.warning("bcp: rank %s: cleaning up the aborted upload of %s failed: %s",
                            current_rank(), self.url, e)


class _S3MultipartWriter(_PartUploader):
    """S3 multipart upload through s3fs's client: parts in parallel, the object appears at completion."""

    def _begin(self) -> None:
        self.bucket, self.key, _ = self.st.fs.split_path(self.path)
        resp = with_retries("start multipart upload of", self.url, self.st.fs.call_s3,
                            "create_multipart_upload", Bucket=self.bucket, Key=self.key)
        self.upload_id = resp["UploadId"]

    def _put_part(self, index: int, data: bytearray) -> Any:
        resp = self.st.fs.call_s3("upload_part", Bucket=self.bucket, Key=self.key, UploadId=self.upload_id,
                                  PartNumber=index + 1, Body=bytes(data))
        return {"PartNumber": index + 1, "ETag": resp["ETag"]}

    def _finish(self, results: list[Any]) -> None:
        self.st.fs.call_s3("complete_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=self.upload_id,
                           MultipartUpload={"Parts": results})

    def _discard(self) -> None:
        self.st.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=self.upload_id)


# How many sources one `merge` call may compose (GCS allows 32; S3 far more).
COMPOSE_FAN_IN = 32


class _ComposeWriter(_PartUploader):
    """Split-and-concat (paper §4.3): parts written as separate objects in parallel, then one
    metadata-level `merge` (GCS compose, S3 part-copy, ...) makes the file; the parts are deleted."""

    def _begin(self) -> None:
        self.written: list[str] = []
        self.lock = threading.Lock()

    def _part_path(self, index: int, level: int = 0) -> str:
        return f"{self.path}.bcp-part{level}-{index:05d}"

    def _put_part(self, index: int, data: bytearray) -> Any:
        p = self._part_path(index)
        with self.lock:
            self.written.append(p)
        self.st.fs.pipe_file(p, bytes(data))
        return p

    def _finish(self, results: list[Any]) -> None:
        level = 0
        while len(results) > COMPOSE_FAN_IN:  # compose in a tree when there are more parts than one call takes
            level += 1
            groups = [results[i:i + COMPOSE_FAN_IN] for i in range(0, len(results), COMPOSE_FAN_IN)]
            results = [self._part_path(i, level) for i in range(len(groups))]
            with self.lock:
                self.written.extend(results)
            for dst, srcs in zip(results, groups):
                self.st.fs.merge(dst, srcs)
        self.st.fs.merge(self.path, results)
        self._discard()

    def _discard(self) -> None:
        with self.lock:
            paths, self.written = list(self.written), []
        if paths:
            self.st.fs.rm(paths)


class _StreamWriter(FileWriter):
    """One sequential stream per file (stores without parts or compose, e.g. HDFS via pyarrow).

    Opening is retried. A failure in the middle of the stream is not: replaying it would mean
    keeping every byte written so far, so the file (and the save) fails cleanly instead.
    """

    def __init__(self, st: FsspecStorage, relpath: str):
        self.st, self.path, self.url = st, st._p(relpath), st.join(relpath)
        self.f = with_retries("open for writing", self.url, st.fs.open, self.path, "wb")
        self.written = 0

    def write(self, data: memoryview) -> None:
        data = memoryview(data).cast("B")
        try:
            self.f.write(data)
        except Exception as e:
            raise StorageError(f"rank {current_rank()}: write {self.url} failed at byte {self.written}: "
                               f"{type(e).__name__}: {e}") from e
        self.written += len(data)

    def close(self) -> None:
        try:
            self.f.close()
        except Exception as e:
            raise StorageError(f"rank {current_rank()}: closing {self.url} after {self.written} bytes failed: "
                               f"{type(e).__name__}: {e}") from e
        self.st._invalidate(self.path)

    def abort(self) -> None:
        # discard() (fsspec buffered files) drops the upload instead of committing what was buffered
        for cleanup in (getattr(self.f, "discard", self.f.close), lambda: self.st.fs.rm(self.path)):
            try:
                cleanup()
            except Exception:  # noqa: BLE001 - best effort; the save already failed
                pass


_WRITERS: dict[str, type[FileWriter]] = {
    "multipart": _S3MultipartWriter, "compose": _ComposeWriter, "stream": _StreamWriter,
}


# ----------------------------------------------------------------------------- fsspec: storage

@register_storage
class FsspecStorage(Storage):
    """Any fsspec filesystem: `s3://bucket/dir`, `gs://...`, `hdfs://host/dir`, `abfs://...`, chained URLs.

    fsspec options come from `set_storage_options(scheme, ...)` and fsspec's own config
    (environment variables `FSSPEC_<PROTOCOL>_<OPTION>`).
    """

    schemes = ("*",)
    # Stores where one PUT replaces an object atomically, so write_atomic needs no rename.
    ATOMIC_PUT_PROTOCOLS = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "memory"}

    def __init__(self, root: str, fsync: bool = True, *, fs=None, upload: str | None = None):
        super().__init__(root.rstrip("/") if root.rstrip("/") else root, fsync)
        import fsspec  # a core dependency; imported here so local-only users never pay for it

        options = dict(_FS_OPTIONS.get(scheme_of(root), {}))
        upload = upload or options.pop("upload", None)
        if fs is None:
            try:
                fs, path = fsspec.core.url_to_fs(root, **options)
            except (ImportError, ValueError) as e:
                raise StorageError(f"cannot open {root!r} with fsspec: {e} (install the fsspec driver for "
                                   f"{scheme_of(root)}://, e.g. `pip install s3fs` for s3://)") from e
        else:  # a given filesystem: the URL's scheme may be one it does not know (a custom backend's)
            path = fs._strip_protocol(root.split("://", 1)[1] if "://" in root else root)
        self.fs, self.path = fs, path.rstrip("/")
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        self.protocols = set(protocols)
        self.remote = not self.protocols & {"memory", "file", "local"}
        if upload is None:
            if self.protocols & {"s3", "s3a"} and hasattr(fs, "call_s3"):
                upload = "multipart"
            elif callable(getattr(fs, "merge", None)):
                upload = "compose"
            else:
                upload = "stream"
        if upload not in _WRITERS:
            raise ValueError(f"unknown upload strategy {upload!r}; choose from {sorted(_WRITERS)}")
        self.upload = upload
        self._made: set[str] = set()  # directories made by this instance: each is made once, not per file

    def child(self, relpath: str) -> Storage:
        return type(self)(self.join(relpath), self.fsync, fs=self.fs, upload=self.upload)

    def _p(self, relpath: str) -> str:
        return f"{self.path}/{relpath}" if relpath else self.path

    def _invalidate(self, path: str) -> None:
        # Listing caches (s3fs) would hide files written by other processes.
        try:
            self.fs.invalidate_cache(path)
        except Exception:  # noqa: BLE001 - a cache, not correctness of the store
            pass

    def open_writer(self, relpath: str) -> FileWriter:
        return _WRITERS[self.upload](self, relpath)

    def read_into(self, relpath: str, offset: int, out: memoryview) -> None:
        out = memoryview(out).cast("B")
        path, url = self._p(relpath), self.join(relpath)

        def fetch(lo: int, hi: int) -> None:
            if hi == lo:
                return
            data = with_retries(f"read bytes [{offset + lo}, {offset + hi}) of", url, self.fs.cat_file, path,
                                start=offset + lo, end=offset + hi)
            if len(data) != hi - lo:
                raise StorageError(f"rank {current_rank()}: read {url}: got {len(data)} bytes at offset "
                                   f"{offset + lo}, expected {hi - lo} (truncated file?)")
            out[lo:hi] = data

        # One ranged request per chunk, in parallel: a single stream is far below an object store's bandwidth.
        _run_all([lambda lo=lo, hi=hi: fetch(lo, hi) for lo, hi in _chunks(len(out))])

    def size(self, relpath: str) -> int:
        self._invalidate(self._p(relpath))
        return int(with_retries("stat", self.join(relpath), self.fs.size, self._p(relpath)))

    def write_atomic(self, relpath: str, data: bytes) -> None:
        path, url = self._p(relpath), self.join(relpath)
        if self.protocols & self.ATOMIC_PUT_PROTOCOLS:
            with_retries("commit (write)", url, self.fs.pipe_file, path, data)
        else:
            tmp = f"{path}.tmp.{os.getpid()}"
            with_retries("commit (write temporary)", url, self.fs.pipe_file, tmp, data)

            def replace() -> None:
                try:
                    self.fs.mv(tmp, path)
                except (FileExistsError, OSError):
                    # Stores whose rename refuses to overwrite (HDFS): drop the old file, then rename.
                    if self.fs.exists(path):
                        self.fs.rm(path)
                    self.fs.mv(tmp, path)

            with_retries("commit (rename)", url, replace)
        self._invalidate(path)

    def read_bytes(self, relpath: str) -> bytes:
        self._invalidate(self._p(relpath))
        return with_retries("read", self.join(relpath), self.fs.cat_file, self._p(relpath))

    def exists(self, relpath: str) -> bool:
        self._invalidate(self._p(relpath))
        return bool(with_retries("check existence of", self.join(relpath), self.fs.exists, self._p(relpath)))

    def listdir(self, relpath: str = "") -> list[str]:
        path = self._p(relpath)
        self._invalidate(path)
        try:
            entries = with_retries("list", self.join(relpath), self.fs.ls, path, detail=False)
        except StorageFileNotFoundError:
            return []
        here = path.rstrip("/")
        # ls of a file lists the file itself; some stores list the directory among its entries
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != here} - {""})

    def makedirs(self, relpath: str = "") -> None:
        if relpath in self._made:
            return
        with_retries("make directory", self.join(relpath), self.fs.makedirs, self._p(relpath), exist_ok=True)
        self._made.add(relpath)

    def remove(self, relpath: str) -> None:
        path = self._p(relpath)
        self._invalidate(path)
        try:
            with_retries("remove", self.join(relpath), self.fs.rm, path, recursive=True)
        except StorageFileNotFoundError:
            pass
        self._invalidate(path)
        self._made = {d for d in self._made if not (relpath == "" or d == relpath or d.startswith(relpath + "/"))}


def write_all(writer: FileWriter, chunks: Iterable[memoryview]) -> None:
    try:
        for c in chunks:
            writer.write(c)
        writer.close()
    except BaseException:
        writer.abort()
        raise
