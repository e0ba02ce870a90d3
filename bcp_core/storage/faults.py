"""Storage that fails on demand: fault injection for tests of what bcp does when storage misbehaves.

    from bcp_core.storage.faults import Fault, inject

    full = Fault("write", error=OSError(errno.ENOSPC, "No space left on device"), path="*/step_00000002/*")
    with inject(full):
        bcp.save(root, state, step=2)          # fails on this rank, as a full disk would make it fail

While an injection is active, `storage_for` (hence every save, load and CLI command of this process)
gets each registered backend as a subclass of itself whose operations first pass the active faults:
a fault raises its `error`, or runs its `hook` (sleep, wait for an event, count, end the process),
on the calls of its operation whose path matches. Everything else is the real backend: a local path
stays a `LocalStorage`, with its direct I/O and memory maps. Processes forked while an injection is
active (a fork snapshot, DataLoader workers) inherit it. Storages made before `inject` are not
affected; storages made while it was active behave normally again once it is removed.

docs/reliability.md ("Injecting faults") shows how the tests use it.
"""

from __future__ import annotations

import copy
import fnmatch
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import base
from .base import FileWriter, Storage

# The operations a fault can hit. "write" is every write of a file being written (`FileWriter.write`
# and `write_in_place`), "close" its completion (made durable and visible), "abort" its discarding;
# the others are the `Storage` methods of that name.
OPS = ("open_writer", "write", "close", "abort", "read_into", "map", "size", "write_atomic", "read_bytes",
       "exists", "listdir", "makedirs", "remove", "retire", "sync_dir")


@dataclass(frozen=True)
class Call:
    """One storage operation about to run, as a fault's hook sees it."""

    op: str                    # one of OPS
    path: str                  # the file or directory, as its storage names it (`Storage.join(relpath)`)
    nbytes: int | None = None  # bytes written or read by this call (write, read_into, write_atomic)
    offset: int | None = None  # where in the file a read_into starts


@dataclass(frozen=True)
class Fault:
    """What happens to the calls of one operation (`op`, one of OPS) on paths matching `path`
    (an fnmatch pattern on the full path, `*` crossing `/`): `hook(call)` runs first, then `error`
    is raised (a copy of it, each time). A hook that returns lets the call go on."""

    op: str
    error: BaseException | None = None
    hook: Callable[[Call], Any] | None = None
    path: str = "*"

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"Fault: unknown storage operation {self.op!r}; known: {', '.join(OPS)}")
        if self.error is None and self.hook is None:
            raise ValueError(f"Fault({self.op!r}): give an error to raise, a hook to run, or both")
        if self.error is not None and not isinstance(self.error, BaseException):
            raise ValueError(f"Fault({self.op!r}): error must be an exception instance, got {self.error!r}")

    def matches(self, call: Call) -> bool:
        return call.op == self.op and fnmatch.fnmatchcase(call.path, self.path)


class Injection:
    """Faults active from `inject` until `remove()` (or the end of a `with` block)."""

    def __init__(self, faults: tuple[Fault, ...]):
        self.faults = faults
        self.active = False

    def remove(self) -> None:
        """Stop these faults; once no injection is active, `storage_for` returns the plain backends."""
        with _LOCK:
            if not self.active:
                return
            self.active = False
            _ACTIVE.remove(self)
            if not _ACTIVE:
                base._REGISTRY.update(_ORIGINAL)
                _ORIGINAL.clear()

    def __enter__(self) -> Injection:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def inject(*faults: Fault) -> Injection:
    """Make storage operations of this process fail on demand, from now until the injection is
    removed (`with inject(...):`, or `.remove()`). Injections may overlap; each fault applies to
    the calls made while it is active."""
    for f in faults:
        if not isinstance(f, Fault):
            raise TypeError(f"inject() takes Fault objects, got {f!r}")
    injection = Injection(tuple(faults))
    with _LOCK:
        if not _ACTIVE:
            for scheme, cls in base._REGISTRY.items():
                _ORIGINAL[scheme] = cls
                base._REGISTRY[scheme] = _faulty_class(cls)
        _ACTIVE.append(injection)
        injection.active = True
    return injection


# ----------------------------------------------------------------------------- the wrappers

_LOCK = threading.Lock()
_ACTIVE: list[Injection] = []
_ORIGINAL: dict[str, type[Storage]] = {}  # the registry as it was before the first active injection
_CLASSES: dict[type[Storage], type[Storage]] = {}


def _check(op: str, path: str, nbytes: int | None = None, offset: int | None = None) -> None:
    with _LOCK:
        faults = [f for injection in _ACTIVE for f in injection.faults]
    call = Call(op, path, nbytes, offset)
    for fault in faults:
        if fault.matches(call):
            if fault.hook is not None:
                fault.hook(call)
            if fault.error is not None:
                raise copy.copy(fault.error)


def _nbytes(data) -> int:
    return memoryview(data).nbytes


class _FaultyWriter(FileWriter):
    """A backend's writer whose calls pass the active faults first."""

    def __init__(self, inner: FileWriter, path: str):
        self.inner, self.path = inner, path
        self.write_bytes, self.align = inner.write_bytes, inner.align

    def write(self, data: memoryview) -> None:
        _check("write", self.path, _nbytes(data))
        self.inner.write(data)

    def can_write_in_place(self, data: memoryview) -> bool:
        return self.inner.can_write_in_place(data)

    def write_in_place(self, data: memoryview) -> None:
        _check("write", self.path, _nbytes(data))
        self.inner.write_in_place(data)

    def close(self) -> None:
        _check("close", self.path)
        self.inner.close()

    def abort(self) -> None:
        _check("abort", self.path)
        self.inner.abort()


def _faulty_class(cls: type[Storage]) -> type[Storage]:
    """`cls` with every operation of OPS passing the active faults first (one class per backend)."""
    if cls in _CLASSES.values():
        return cls
    if cls in _CLASSES:
        return _CLASSES[cls]

    class Faulty(cls):  # type: ignore[valid-type, misc]
        def open_writer(self, relpath):
            _check("open_writer", self.join(relpath))
            return _FaultyWriter(super().open_writer(relpath), self.join(relpath))

        def read_into(self, relpath, offset, out):
            _check("read_into", self.join(relpath), _nbytes(out), offset)
            return super().read_into(relpath, offset, out)

        def map(self, relpath):
            _check("map", self.join(relpath))
            return super().map(relpath)

        def size(self, relpath):
            _check("size", self.join(relpath))
            return super().size(relpath)

        def write_atomic(self, relpath, data):
            _check("write_atomic", self.join(relpath), len(data))
            return super().write_atomic(relpath, data)

        def read_bytes(self, relpath):
            _check("read_bytes", self.join(relpath))
            return super().read_bytes(relpath)

        def exists(self, relpath):
            _check("exists", self.join(relpath))
            return super().exists(relpath)

        def listdir(self, relpath=""):
            _check("listdir", self.join(relpath))
            return super().listdir(relpath)

        def makedirs(self, relpath=""):
            _check("makedirs", self.join(relpath))
            return super().makedirs(relpath)

        def remove(self, relpath):
            _check("remove", self.join(relpath))
            return super().remove(relpath)

        def retire(self, relpath):
            _check("retire", self.join(relpath))
            return super().retire(relpath)

        def sync_dir(self, relpath=""):
            _check("sync_dir", self.join(relpath))
            return super().sync_dir(relpath)

    Faulty.__name__ = Faulty.__qualname__ = f"Faulty{cls.__name__}"
    _CLASSES[cls] = Faulty
    return Faulty
