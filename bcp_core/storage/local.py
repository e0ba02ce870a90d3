"""POSIX directories (`/dir`, `file:///dir`); memory.py serves RAM (`memory://`) with this class's code.

Files are created under a temporary name (`base.temp_name`, opened O_CREAT|O_EXCL|O_NOFOLLOW) and
renamed into place when complete (local_writer.py: around the page cache where it can), in a
directory reached from the storage root without following any symbolic link: a link planted
below the root never redirects a write or a removal. Large reads are split into chunks read by
parallel `pread` threads, which release the GIL.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import stat

from ..errors import StorageError
from ..utils import this_rank
from .base import FileWriter, Storage, chunks, register_storage, run_all, temp_name
from .local_writer import LocalWriter


def _pread_all(fd: int, out: memoryview, pos: int, path: str) -> None:
    got = 0
    while got < len(out):
        n = os.preadv(fd, [out[got:]], pos + got)  # releases the GIL, no extra copy
        if n == 0:
            raise StorageError(f"rank {this_rank()}: read {path}: file ends at byte {pos + got}, expected "
                               f"{len(out) - got} more bytes (truncated file?)")
        got += n


DIR_NOFOLLOW = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


def local_path(url: str) -> str:
    """The OS path of a local path or `file://` URL (RFC 8089): `file:///x` and `file://localhost/x`
    are `/x`; a URL naming another host is refused."""
    if url[:7].lower() != "file://":
        return url
    host, _, path = url[7:].partition("/")
    if host.lower() not in ("", "localhost"):
        raise StorageError(f"{url}: a file:// URL names a file of this machine (file:///PATH or "
                           f"file://localhost/PATH), not of host {host!r}; mount that directory and give its path")
    return "/" + path


@register_storage
class LocalStorage(Storage):
    """A POSIX directory (local disk, NFS, Lustre...)."""

    schemes = ("file",)
    remote = False  # POSIX paths count as local; a loader spots a multi-node job by its node count
    FILE_MODE = 0o644  # of the files it creates, less the umask

    def __init__(self, root: str, fsync: bool = True):
        super().__init__(local_path(root), fsync)

    def join(self, relpath: str) -> str:
        return os.path.join(self.root, *relpath.split("/")) if relpath else self.root

    def _path(self, relpath: str) -> str:
        """The OS path of relpath (join() is what messages show; they differ for MemoryStorage)."""
        return LocalStorage.join(self, relpath)

    def _open_dir(self, parts: list[str]) -> int:
        """A descriptor of the directory `parts` below the root, reached without following a link
        (the root itself is the caller's path, which may pass through links)."""
        fd = os.open(self._path(""), os.O_RDONLY | os.O_DIRECTORY)
        for i, part in enumerate(parts):
            try:
                below = os.open(part, DIR_NOFOLLOW, dir_fd=fd)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise StorageError(f"{self.join('/'.join(parts[:i + 1]))} is a symbolic link or not a "
                                       "directory: bcp follows no link below a storage root") from e
                raise
            os.close(fd)
            fd = below
        return fd

    def _parent(self, relpath: str) -> tuple[int, str]:
        """A descriptor of relpath's directory (as `_open_dir`) and relpath's last name."""
        parts = relpath.split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise StorageError(f"bad path {relpath!r} below {self.root}: empty, '.' or '..' parts")
        return self._open_dir(parts[:-1]), parts[-1]

    def open_writer(self, relpath: str) -> FileWriter:
        dir_fd, name = self._parent(relpath)
        return LocalWriter(dir_fd, name, self.join(relpath), self.fsync, self.FILE_MODE)

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
        dir_fd, name = self._parent(relpath)
        try:
            tmp = temp_name(name)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, self.FILE_MODE, dir_fd=dir_fd)
            try:
                with open(fd, "wb") as f:
                    f.write(data)
                    if self.fsync:
                        f.flush()
                        os.fsync(f.fileno())
                os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dir_fd)
                raise
            if self.fsync:
                try:
                    _fsync_dir(dir_fd, self.join(relpath.rpartition("/")[0]))
                except BaseException:
                    # the write fails, so nothing of it stays: a commit record in place after its
                    # save raised would be loaded as a checkpoint that was never committed
                    with contextlib.suppress(OSError):
                        os.unlink(name, dir_fd=dir_fd)
                    raise
        finally:
            os.close(dir_fd)

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
        try:
            if relpath:
                dir_fd, name = self._parent(relpath)
            else:  # the root itself, through whatever links its path holds
                parent, name = os.path.split(os.path.abspath(self._path("")))
                if not name:
                    raise StorageError(f"refusing to remove {parent}")
                dir_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            return
        failed: list[str] = []
        try:
            try:
                is_dir = stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
            except FileNotFoundError:
                return
            if is_dir:
                _remove_tree(dir_fd, name, self.join(relpath), failed)
            else:  # a file, or a link: the link goes, its target stays
                try:
                    os.unlink(name, dir_fd=dir_fd)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    failed.append(f"{self.join(relpath)}: {e.strerror}")
        finally:
            os.close(dir_fd)
        if failed:
            more = f" and {len(failed) - 5} more" if len(failed) > 5 else ""
            raise StorageError(f"could not remove {self.join(relpath)}: {'; '.join(failed[:5])}{more}")

    def sync_dir(self, relpath: str = "") -> None:
        if not self.fsync:
            return
        try:
            fd = self._open_dir(relpath.split("/") if relpath else [])
        except FileNotFoundError:
            return  # nothing was written there
        try:
            _fsync_dir(fd, self.join(relpath))
        finally:
            os.close(fd)

    def sync_entry(self) -> None:
        if self.fsync:
            LocalStorage(os.path.dirname(os.path.abspath(self._path(""))), fsync=True).sync_dir()

    def is_link(self, relpath: str) -> bool:
        return os.path.islink(self._path(relpath))

    def modified(self, relpath: str) -> float | None:
        try:
            return os.stat(self._path(relpath), follow_symlinks=False).st_mtime
        except FileNotFoundError:
            return None


def _fsync_dir(fd: int, shown: str) -> None:
    """fsync a directory: the names created, renamed or removed in it survive a crash."""
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.ENOTSUP):  # a filesystem that cannot sync directories has nothing to sync
            return
        raise StorageError(f"rank {this_rank()}: fsync of directory {shown} failed: {e.strerror}") from e


def _remove_tree(parent_fd: int, name: str, shown: str, failed: list[str]) -> None:
    """Remove the directory `name` of `parent_fd` and everything in it, following no link (a link is
    removed as a link); what could not be removed is added to `failed`."""
    before = len(failed)
    try:
        fd = os.open(name, DIR_NOFOLLOW, dir_fd=parent_fd)
    except FileNotFoundError:
        return
    except OSError as e:
        failed.append(f"{shown}: {e.strerror}")
        return
    try:
        with os.scandir(fd) as listing:
            entries = list(listing)
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                _remove_tree(fd, entry.name, f"{shown}/{entry.name}", failed)
                continue
            try:
                os.unlink(entry.name, dir_fd=fd)
            except FileNotFoundError:
                pass
            except OSError as e:
                failed.append(f"{shown}/{entry.name}: {e.strerror}")
    except OSError as e:
        failed.append(f"{shown}: {e.strerror}")
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=parent_fd)
    except FileNotFoundError:
        pass
    except OSError as e:
        if len(failed) == before:  # not merely what is left of a failure reported above
            failed.append(f"{shown}: {e.strerror}")
