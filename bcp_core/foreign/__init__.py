"""Checkpoints of other systems, read by `bcp.load` (and `bcp export`, `inspect`) as they are on disk.

A foreign format is one registered `ForeignFormat`: how to recognise its directory, and how to
describe it as bcp metadata whose pieces are byte ranges of its own files. `open_foreign` gives a
read-only `ForeignCheckpoint` storage that serves that metadata as the checkpoint's
`bcp_metadata.json` and everything else from the files themselves, so the load path (planning,
resharding, shared reads, verification) is the one of bcp's own checkpoints. No conversion step,
no copy: a user switches to bcp in the middle of a run.

Built in: DeepSpeed ZeRO (`deepspeed.py`). Files are parsed without running their pickles
(`torch_archive.py`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import StorageError
from ..metadata import METADATA_FILE, CheckpointMetadata
from ..storage import FileWriter, Storage
from . import deepspeed


@dataclass(frozen=True)
class ForeignFormat:
    name: str
    locate: Callable[[Storage], str | None]                  # its checkpoint directory under a path ("": itself)
    metadata: Callable[[Storage], CheckpointMetadata]        # that directory as bcp metadata


FORMATS: list[ForeignFormat] = [ForeignFormat("deepspeed", deepspeed.step_directory, deepspeed.deepspeed_metadata)]


def register_format(fmt: ForeignFormat) -> ForeignFormat:
    FORMATS.append(fmt)
    return fmt


def open_foreign(st: Storage) -> ForeignCheckpoint | None:
    """The foreign checkpoint at `st` (or the one its own tracker names), or None."""
    for fmt in FORMATS:
        rel = fmt.locate(st)
        if rel is not None:
            return ForeignCheckpoint(st.child(rel) if rel else st, fmt)
    return None


def open_resolved(st: Storage, format_name: str) -> Storage:
    """The checkpoint directory `st` as another rank resolved it: of foreign format `format_name`
    ("" for bcp's own: `st` itself)."""
    if not format_name:
        return st
    for fmt in FORMATS:
        if fmt.name == format_name:
            return ForeignCheckpoint(st, fmt)
    raise StorageError(f"{st.root}: unknown checkpoint format {format_name!r}")


def foreign_format(st: Storage) -> str | None:
    """The format name of a foreign checkpoint's storage; None for bcp's own."""
    return st.format.name if isinstance(st, ForeignCheckpoint) else None


_CACHE: dict[tuple, bytes] = {}
_CACHE_LOCK = threading.Lock()


class ForeignCheckpoint(Storage):
    """A read-only view of a foreign checkpoint directory with bcp metadata (module doc)."""

    def __init__(self, inner: Storage, fmt: ForeignFormat):
        super().__init__(inner.root, fsync=False)
        self.inner, self.format = inner, fmt
        self.remote = getattr(inner, "remote", False)
        self._metadata: bytes | None = None

    def metadata_bytes(self) -> bytes:
        """The metadata, built once per process and state of the files (their names, sizes, times)."""
        if self._metadata is None:
            key = (self.root, self.format.name, tuple(
                (n, self.inner.size(n), self.inner.modified(n)) for n in sorted(self.inner.listdir(""))))
            with _CACHE_LOCK:
                if key not in _CACHE:
                    _CACHE[key] = self.format.metadata(self.inner).dumps()
                self._metadata = _CACHE[key]
        return self._metadata

    # -- reading: the metadata built, everything else from the files ----------------------------

    def read_bytes(self, relpath: str) -> bytes:
        return self.metadata_bytes() if relpath == METADATA_FILE else self.inner.read_bytes(relpath)

    def read_into(self, relpath: str, offset: int, out: memoryview) -> None:
        if relpath == METADATA_FILE:
            data = self.metadata_bytes()
            out[:] = data[offset: offset + len(out)]
        else:
            self.inner.read_into(relpath, offset, out)

    def size(self, relpath: str) -> int:
        return len(self.metadata_bytes()) if relpath == METADATA_FILE else self.inner.size(relpath)

    def exists(self, relpath: str) -> bool:
        return relpath == METADATA_FILE or self.inner.exists(relpath)

    def map(self, relpath: str) -> memoryview | None:
        return None if relpath == METADATA_FILE else self.inner.map(relpath)

    def listdir(self, relpath: str = "") -> list[str]:
        return self.inner.listdir(relpath)

    def is_link(self, relpath: str) -> bool:
        return self.inner.is_link(relpath)

    def modified(self, relpath: str) -> float | None:
        return self.inner.modified(relpath)

    def child(self, relpath: str) -> Storage:
        return self.inner.child(relpath)

    # -- writing: never -------------------------------------------------------------------------

    def _read_only(self, what: str):
        raise StorageError(f"{self.root} is a {self.format.name} checkpoint, read by bcp as it is: it cannot {what}")

    def open_writer(self, relpath: str) -> FileWriter:
        self._read_only(f"be written to ({relpath})")

    def write_atomic(self, relpath: str, data: bytes) -> None:
        self._read_only(f"be written to ({relpath})")

    def makedirs(self, relpath: str = "") -> None:
        self._read_only("hold new directories")

    def remove(self, relpath: str) -> None:
        self._read_only(f"have {relpath} removed")


__all__ = ["ForeignFormat", "ForeignCheckpoint", "FORMATS", "register_format", "open_foreign", "open_resolved",
           "foreign_format"]
