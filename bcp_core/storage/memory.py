"""RAM (`memory://name`): a tmpfs directory shared by a machine's processes, private to this user.

The files are written and read as local files are (local.py), below `memory_dir()`; every
directory on the way is checked to be this user's and no link, and kept 0700 (files 0600).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import stat

from ..errors import StorageError
from .base import FileWriter, Storage, parse_temp_name, register_storage, temp_name, temp_writer_gone
from .local import DIR_NOFOLLOW, LocalStorage, _remove_tree
from .local_writer import LocalWriter

log = logging.getLogger("bcp")

# memory://NAME/.spare: the data files of the checkpoint retired last under NAME (MemoryStorage.retire)
SPARES = ".spare"


def spare_key(name: str) -> str:
    """What a data file's name says of its kind, less the save it belongs to: bcp names them
    `<token>-<save number>-r<rank>_<k>.safetensors` (engine/write.py), so rank 3's first file of any
    save of the job is `r3_0.safetensors`, and is about as large from save to save."""
    return name.rsplit("-", 1)[-1]


def _by_key(parent: int, spares: str) -> None:
    """Each spare named by its `spare_key`; a temporary file (an unfinished write) goes."""
    fd = os.open(spares, DIR_NOFOLLOW, dir_fd=parent)
    try:
        for name in os.listdir(fd):
            try:
                if parse_temp_name(name) is not None:
                    os.unlink(name, dir_fd=fd)
                elif spare_key(name) != name:
                    os.rename(name, spare_key(name), src_dir_fd=fd, dst_dir_fd=fd)
            except OSError:
                pass  # left as it is: never taken, removed with these spares
    finally:
        os.close(fd)


def memory_dir() -> str:
    """Where `memory://` checkpoints live: `bcp-memory` in $BCP_MEMORY_DIR, else in /dev/shm (tmpfs:
    RAM, shared by processes). It is made if missing; it must be this user's directory (not a link)
    and is kept private (mode 0700)."""
    parent = os.environ.get("BCP_MEMORY_DIR") or "/dev/shm"
    if not os.path.isdir(parent):
        raise StorageError(f"memory:// storage needs a tmpfs directory; {parent} does not exist "
                           "(set BCP_MEMORY_DIR to a RAM-backed directory)")
    base = os.path.join(parent, "bcp-memory")
    with contextlib.suppress(FileExistsError):
        os.mkdir(base, 0o700)
    os.close(_private_dir(base, base))
    return base


def _private_dir(path: str, shown: str, dir_fd: int | None = None) -> int:
    """A descriptor of a directory that must be this user's and no link; group and others lose access."""
    try:
        fd = os.open(path, DIR_NOFOLLOW, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise StorageError(f"memory:// storage: {shown} is a symbolic link or not a directory; refusing "
                               "to keep checkpoints through it (remove it, or set BCP_MEMORY_DIR)") from e
        raise
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise StorageError(f"memory:// storage: {shown} belongs to {_user(st.st_uid)}, not to this user "
                               f"({_user(os.geteuid())}); its owner could read or replace the checkpoints in it. "
                               "Set BCP_MEMORY_DIR to a RAM-backed directory of your own")
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _user(uid: int) -> str:
    import pwd
    try:
        return f"user {pwd.getpwuid(uid).pw_name!r} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


@register_storage
class MemoryStorage(LocalStorage):
    """`memory://NAME/...`: files in RAM (tmpfs), visible to every process of this machine.

    For fast in-memory checkpoints: no fsync, no network; it survives the training process
    (a restarted job on the same machine loads from it) but not a reboot. Files stay in RAM
    until removed (`bcp prune`, or `storage_for(url).remove("")`). Directories are private to
    this user (0700) and files 0600.
    """

    schemes = ("memory",)
    node_local = True
    FILE_MODE = 0o600

    def __init__(self, root: str, fsync: bool = True):
        rest = root.split("://", 1)[1] if "://" in root else root
        parts = [p for p in rest.split("/") if p]
        if not parts or any(p in (".", "..") for p in parts):
            raise StorageError(f"bad memory:// path {root!r}: expected memory://NAME[/SUBDIR...] without '..'")
        Storage.__init__(self, "memory://" + "/".join(parts), fsync=False)  # tmpfs has nothing to sync
        self.base = memory_dir()
        self.parts = parts
        self.local_root = os.path.join(self.base, *parts)

    def join(self, relpath: str) -> str:
        return Storage.join(self, relpath)

    def _path(self, relpath: str) -> str:
        return os.path.join(self.local_root, *relpath.split("/")) if relpath else self.local_root

    def open_writer(self, relpath: str) -> FileWriter:
        """As a local file's, but a spare of the same kind (`retire`) is overwritten if there is one."""
        dir_fd, name = self._parent(relpath)
        try:
            adopt = self._take_spare(dir_fd, name)
        except BaseException:
            os.close(dir_fd)
            raise
        return LocalWriter(dir_fd, name, self.join(relpath), self.fsync, self.FILE_MODE, adopt=adopt)

    def map(self, relpath: str) -> memoryview | None:
        """As a local file's, under a shared lock on the file held as long as the map is: the map is
        read after it was verified (a load checks, then copies), so a retired file (`retire`) is
        overwritten only where no map of it is left (`_take_spare`). A file being overwritten is
        refused (a newer save took its retired checkpoint's files), never waited for."""
        with open(self._path(relpath), "rb") as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                raise StorageError(f"{self.join(relpath)} is being overwritten by a newer save: its checkpoint "
                                   "was retired") from None
            if os.fstat(f.fileno()).st_size == 0:
                return memoryview(b"")
            # the map holds a duplicate of the descriptor, and with it the lock, until it is closed
            return memoryview(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ))

    def _take_spare(self, dir_fd: int, name: str) -> tuple[str, int] | None:
        """The spare of `name`'s kind renamed to a temporary name in `dir_fd` and opened for writing:
        (that name, its descriptor, locked for the writer until it closes it). None if there is none
        (or another writer took it), or it is not a plain file or has another link (a recovery view
        a crash left: its bytes must not change), or a map of it is still read (`map`): then the
        writer makes a new file."""
        spares = self._spares()
        if spares is None:
            return None
        tmp = temp_name(name)
        try:
            os.rename(spare_key(name), tmp, src_dir_fd=spares, dst_dir_fd=dir_fd)
        except OSError:
            return None
        finally:
            os.close(spares)
        try:
            st = os.stat(tmp, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
                fd = os.open(tmp, os.O_WRONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return tmp, fd
                except OSError:  # a load still reads a map of it
                    os.close(fd)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        return None

    def retire(self, relpath: str) -> None:
        """Remove the checkpoint directory `relpath`, keeping its data files as spares that the next
        writes of files of the same kind (`spare_key`: a newer checkpoint's, `open_writer`)
        overwrite: a write into a tmpfs file's existing pages costs about half of one that
        allocates and zeroes new pages (a tiered save every step writes and receives the same files
        step after step). The spares of an earlier call go first, so memory holds one retired
        checkpoint's files at most; removing the NAME (`storage_for("memory://NAME").remove("")`)
        frees them with the rest."""
        top = os.open(os.path.join(self.base, self.parts[0]), DIR_NOFOLLOW)  # memory://NAME
        try:
            failed: list[str] = []
            old = temp_name(SPARES)  # renamed away first: a writer taking one meanwhile makes a new file
            with contextlib.suppress(FileNotFoundError):
                os.rename(SPARES, old, src_dir_fd=top, dst_dir_fd=top)
            # and what a process that ended between that rename and the removal left
            stale = [n for n in os.listdir(top) if n.startswith(f"{SPARES}.") and n != old
                     and (t := parse_temp_name(n)) is not None and temp_writer_gone(t)]
            for name in [old, *stale]:
                _remove_tree(top, name, f"memory://{self.parts[0]}/{name}", failed)
            if failed:  # they stay in RAM: say so (the checkpoint's removal goes on)
                log.warning("bcp: could not remove the spare files of an earlier checkpoint: %s", "; ".join(failed[:3]))
            try:
                data, name = self._parent(f"{relpath}/data")
            except (OSError, StorageError):
                data = None
            if data is not None:
                try:
                    os.rename(name, SPARES, src_dir_fd=data, dst_dir_fd=top)
                    _by_key(top, SPARES)
                except OSError:
                    pass  # no data directory, or not one: removed below with the rest
                finally:
                    os.close(data)
        finally:
            os.close(top)
        self.remove(relpath)

    def _spares(self) -> int | None:
        """A descriptor of memory://NAME/.spare, or None if there is none."""
        try:
            return os.open(os.path.join(self.base, self.parts[0], SPARES), DIR_NOFOLLOW)
        except OSError:
            return None

    def makedirs(self, relpath: str = "") -> None:
        """Every directory from the memory base down is made 0700, or checked to be this user's and tightened."""
        names = self.parts + (relpath.split("/") if relpath else [])
        if any(p in ("", ".", "..") for p in names):
            raise StorageError(f"bad path {relpath!r} below {self.root}: empty, '.' or '..' parts")
        fd = os.open(self.base, DIR_NOFOLLOW)
        try:
            for i, name in enumerate(names):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o700, dir_fd=fd)
                below = _private_dir(name, "memory://" + "/".join(names[:i + 1]), dir_fd=fd)
                os.close(fd)
                fd = below
        finally:
            os.close(fd)
