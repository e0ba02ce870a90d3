"""Every other scheme (`s3://`, `gs://`, `hdfs://`, ...) through an fsspec filesystem.

Files are uploaded as parts in parallel (S3 multipart, or split-and-compose on stores with a
`merge` operation such as GCS; one sequential stream otherwise), large reads are split into
parallel ranged reads, and every request goes through `with_retries`.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..errors import StorageError, StorageFileNotFoundError
from ..extras import require
from ..utils import this_rank
from .base import (CONFIG, FS_OPTIONS, REMOTE_THREADS, FileWriter, Storage, chunks, io_threads, register_storage,
                   run_all, scheme_of, temp_name)
from .retry import with_retries

log = logging.getLogger("bcp")


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
                # retried as every request is: an upload never discarded keeps its parts stored for good
                with_retries("discard the upload of", self.url, self._discard)
            except Exception as e:  # noqa: BLE001 - best effort; the file was never made visible
                log.warning("bcp: rank %s: cleaning up the aborted upload of %s failed: %s",
                            this_rank(), self.url, e)


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
            raise StorageError(f"rank {this_rank()}: write {self.url} failed at byte {self.written}: "
                               f"{type(e).__name__}: {e}") from e
        self.written += len(data)

    def close(self) -> None:
        try:
            self.f.close()
        except Exception as e:
            raise StorageError(f"rank {this_rank()}: closing {self.url} after {self.written} bytes failed: "
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

        options = dict(FS_OPTIONS.get(scheme_of(root), {}))
        upload = upload or options.pop("upload", None)
        if fs is None:
            s3 = scheme_of(root) in ("s3", "s3a")
            if s3:
                require("s3fs", "s3", "s3:// paths")  # one line naming the extra, not fsspec's ImportError
                options = _without_botocore_retries(options)
            try:
                fs, path = fsspec.core.url_to_fs(root, **options)
            except (ImportError, ValueError) as e:
                raise StorageError(f"cannot open {root!r} with fsspec: {e} (install the fsspec driver for "
                                   f"{scheme_of(root)}://, e.g. `pip install s3fs` for s3://)") from e
            if s3:
                fs.retries = 1  # s3fs's own retry loop (SlowDown...): with_retries is the one retry layer
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
                raise StorageError(f"rank {this_rank()}: read {url}: got {len(data)} bytes at offset "
                                   f"{offset + lo}, expected {hi - lo} (truncated file?)")
            out[lo:hi] = data

        # One ranged request per chunk, in parallel: a single stream is far below an object store's bandwidth.
        run_all([lambda lo=lo, hi=hi: fetch(lo, hi) for lo, hi in chunks(len(out))],
                max(REMOTE_THREADS, io_threads()))

    def size(self, relpath: str) -> int:
        self._invalidate(self._p(relpath))
        return int(with_retries("stat", self.join(relpath), self.fs.size, self._p(relpath)))

    def write_atomic(self, relpath: str, data: bytes) -> None:
        path, url = self._p(relpath), self.join(relpath)
        if self.protocols & self.ATOMIC_PUT_PROTOCOLS:
            with_retries("commit (write)", url, self.fs.pipe_file, path, data)
        else:
            parent, _, name = path.rpartition("/")
            tmp = f"{parent}/{temp_name(name)}" if parent else temp_name(name)
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

    def is_link(self, relpath: str) -> bool:
        islink = getattr(self.fs, "islink", None)  # filesystems with links (local) have it
        return bool(islink(self._p(relpath))) if callable(islink) else False

    def modified(self, relpath: str) -> float | None:
        try:
            when = self.fs.modified(self._p(relpath))
        except Exception:  # noqa: BLE001 - not every filesystem knows; unknown keeps a file rather than drop it
            return None
        # a time without a zone could be local or UTC: unknown, rather than hours off
        return when.timestamp() if getattr(when, "tzinfo", None) is not None else None

    def remove(self, relpath: str) -> None:
        path = self._p(relpath)
        self._invalidate(path)
        try:
            with_retries("remove", self.join(relpath), self.fs.rm, path, recursive=True)
        except StorageFileNotFoundError:
            pass
        self._invalidate(path)
        self._made = {d for d in self._made if not (relpath == "" or d == relpath or d.startswith(relpath + "/"))}


def _without_botocore_retries(options: dict[str, Any]) -> dict[str, Any]:
    """s3fs options with botocore's retries off: `with_retries` is the one retry layer, so attempts and
    delays do not multiply (botocore's attempts x s3fs's x bcp's). A `retries` given in the options'
    `config_kwargs` (here or in fsspec's config) is kept: whoever sets it chose to retry there too."""
    import fsspec.config

    config: dict[str, Any] = {}
    for protocol in ("s3", "s3a"):  # explicit options would replace fsspec's config_kwargs whole: merge them
        config.update(fsspec.config.conf.get(protocol, {}).get("config_kwargs") or {})
    config.update(options.get("config_kwargs") or {})
    config.setdefault("retries", {"total_max_attempts": 1})
    return {**options, "config_kwargs": config}
