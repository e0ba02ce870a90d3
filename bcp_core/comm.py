"""Planning communication between ranks, through the job's c10d key-value store.

Plans and commit reports are small JSON messages. They travel through the store every
`torch.distributed` job already has (the TCPStore behind the default group), under keys private
to bcp, so planning never touches the training (NCCL or gloo) groups, needs no process group of
its own, never pickles, and may run on a background thread. Every wait has a timeout; a rank that
does not arrive produces an error naming the missing ranks and the phase instead of a hang.

Each `Comm` (one per checkpointer role) numbers its operations; all ranks perform the same
operations in the same order, so operation k of every rank meets under the same keys.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .errors import BCPError

DEFAULT_TIMEOUT = timedelta(minutes=10)


class CommTimeoutError(BCPError):
    """Ranks did not arrive at a bcp synchronisation point in time."""


def _default_store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError) as e:  # pragma: no cover - torch internals moved
        raise BCPError(f"cannot reach the process group's key-value store on torch {dist.__name__}: {e}") from None


class Comm:
    """Message exchange for planning; rank 0 of the group is the coordinator."""

    def __init__(self, group=None, timeout: timedelta = DEFAULT_TIMEOUT, tag: str = "default"):
        self.distributed = dist.is_available() and dist.is_initialized()
        self.collectives = 0  # operations performed, for tests and metrics
        self.timeout = timeout
        self._seq = 0
        self._stale: list[str] = []  # keys every rank has finished with, deleted by the coordinator
        if self.distributed:
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            members = dist.get_process_group_ranks(group) if group is not None else range(self.world_size)
            # keys are private to bcp, this role and this set of ranks
            self._prefix = f"bcp/{tag}/{_members_id(members)}/"
            self._store = _default_store()
        else:
            self.rank, self.world_size = 0, 1

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def _next(self) -> str:
        # The phase is not part of the key: ranks that disagree on what they are doing (one
        # re-plans while another commits) meet anyway, and the coordinator reports it.
        self.collectives += 1
        self._seq += 1
        return f"{self._prefix}{self._seq}"

    def _wait(self, keys: list[str], phase: str, ranks: list[int]) -> None:
        try:
            self._store.wait(keys, self.timeout)
        except Exception as e:  # noqa: BLE001 - the store raises a bare RuntimeError/DistStoreError on timeout
            missing = [r for r, k in zip(ranks, keys) if not self._store.check([k])]
            raise CommTimeoutError(
                f"bcp {phase}: rank {self.rank} waited {self.timeout} for rank(s) {missing or ranks} "
                f"that never arrived ({type(e).__name__}); they may have crashed or be stuck elsewhere") from None

    def gather(self, obj: Any, phase: str = "gather") -> list[Any] | None:
        """Every rank's `obj` on the coordinator (in rank order); None elsewhere."""
        if not self.distributed:
            self.collectives += 1
            return [obj]
        base = self._next()
        self._store.set(f"{base}/{self.rank}", _encode(obj))
        if not self.is_coordinator:
            return None
        keys = [f"{base}/{r}" for r in range(self.world_size)]
        self._wait(keys, phase, list(range(self.world_size)))
        values = self._store.multi_get(keys)
        # Every rank has sent operation k, so all have finished operations before it.
        for k in self._stale:
            self._store.delete_key(k)
        self._stale = keys
        return [_decode(v) for v in values]

    def broadcast(self, obj: Any = None, phase: str = "broadcast") -> Any:
        """The coordinator's `obj` on every rank."""
        if not self.distributed:
            self.collectives += 1
            return obj
        key = f"{self._next()}/b"
        if self.is_coordinator:
            self._store.set(key, _encode(obj))
            self._stale.append(key)
            return obj
        self._wait([key], phase, [0])
        return _decode(self._store.get(key))

    def all_gather(self, obj: Any, phase: str = "all_gather") -> list[Any]:
        if not self.distributed:
            self.collectives += 1
            return [obj]
        base = self._next()
        self._store.set(f"{base}/{self.rank}", _encode(obj))
        keys = [f"{base}/{r}" for r in range(self.world_size)]
        self._wait(keys, phase, list(range(self.world_size)))
        if self.is_coordinator:
            self._stale.extend(keys)
        return [_decode(v) for v in self._store.multi_get(keys)]

    def barrier(self, phase: str = "barrier") -> None:
        self.all_gather(None, phase)


def _members_id(members) -> str:
    members = list(members)
    if members == list(range(len(members))):
        return f"w{len(members)}"
    import hashlib
    return hashlib.blake2b(",".join(map(str, members)).encode(), digest_size=8).hexdigest()


def _encode(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _decode(data: bytes) -> Any:
    return json.loads(data)
