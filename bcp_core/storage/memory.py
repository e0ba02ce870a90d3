"""RAM (`memory://name`): a tmpfs directory shared by a machine's processes, private to this user.

The files are written and read as local files are (local.py), below `memory_dir()`; every
directory on the way is checked to be this user's and no link, and kept 0700 (files 0600).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

from ..errors import StorageError
from .base import Storage, register_storage
from .local import DIR_NOFOLLOW, LocalStorage


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
