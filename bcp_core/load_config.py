"""Process-wide settings of loads; change them with `configure_load`.

They bound the memory a load holds beyond the caller's state: verified bytes waiting to go into
place (engine.read.VerifiedReads) and, with shared reads, byte ranges in flight between ranks
(shared_reads.py). docs/storage.md, "Settings", says when each applies.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass
class LoadConfig:
    # a load from storage without memory maps keeps up to this many verified bytes per rank in
    # buffers; beyond, it verifies in a first pass and reads again when it writes into place
    buffer_bytes: int = 1 << 30
    transfer_window_bytes: int = 256 << 20  # shared reads: bytes in flight per rank (received or read, not done)


LOAD_CONFIG = LoadConfig()
_LOWEST = {"buffer_bytes": 0, "transfer_window_bytes": 1}


def configure_load(**changes: Any) -> LoadConfig:
    """Change fields of `LOAD_CONFIG` (e.g. `configure_load(buffer_bytes=4 << 30)`); None leaves one as it is."""
    known = {f.name for f in fields(LoadConfig)}
    for k, v in changes.items():
        if k not in known:
            raise ValueError(f"unknown load setting {k!r}; known: {sorted(known)}")
        if v is None:
            continue
        if not isinstance(v, (int, float)) or v < _LOWEST[k]:
            raise ValueError(f"load setting {k}={v!r} must be a number >= {_LOWEST[k]}")
        setattr(LOAD_CONFIG, k, v)
    return LOAD_CONFIG
