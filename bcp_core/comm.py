"""Planning communication between ranks.

Messages are JSON, carried as uint8 tensors on a dedicated gloo group, so
planning never touches the training (NCCL) group, never pickles, and has its
own timeout. Without an initialised process group everything degenerates to a
single rank.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = timedelta(minutes=10)

_GLOO_GROUPS: dict[tuple, Any] = {}


def _gloo_group_for(group, timeout: timedelta, tag: str):
    """A gloo group with the same members as `group`, created once per tag and reused.

    Each tag (checkpointer role) gets its own group so that two roles saving at once never
    interleave their collectives.
    """
    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else \
        tuple(range(dist.get_world_size()))
    key = (ranks, timeout, tag)
    if key not in _GLOO_GROUPS:
        # new_group is collective over the default group: every rank reaches here in the same order
        # because save/load are collective.
        _GLOO_GROUPS[key] = dist.new_group(ranks=list(ranks), backend="gloo", timeout=timeout)
    return _GLOO_GROUPS[key]


class Comm:
    """Object exchange for planning; rank 0 of the group is the coordinator."""

    def __init__(self, group=None, timeout: timedelta = DEFAULT_TIMEOUT, tag: str = "default"):
        self.distributed = dist.is_available() and dist.is_initialized()
        self.collectives = 0  # number of collective calls made, for tests and metrics
        if self.distributed:
            self.group = _gloo_group_for(group, timeout, tag)
            self.rank = dist.get_rank(self.group)
            self.world_size = dist.get_world_size(self.group)
        else:
            self.group, self.rank, self.world_size = None, 0, 1

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    # -- byte transport ------------------------------------------------------------------------

    def _lengths(self, n: int) -> list[int]:
        t = torch.tensor([n], dtype=torch.int64)
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(out, t, group=self.group)
        return [int(x) for x in out]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` on the coordinator (in rank order); None elsewhere."""
        self.collectives += 1
        if not self.distributed:
            return [obj]
        data = _encode(obj)
        lengths = self._lengths(len(data))
        size = max(lengths)
        buf = torch.zeros(size, dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[:0]
        outs = [torch.empty(size, dtype=torch.uint8) for _ in range(self.world_size)] \
            if self.is_coordinator else None
        dist.gather(buf, outs, dst=dist.get_global_rank(self.group, 0), group=self.group)
        if not self.is_coordinator:
            return None
        return [_decode(o[:n].numpy().tobytes()) for o, n in zip(outs, lengths)]

    def broadcast(self, obj: Any = None) -> Any:
        """The coordinator's `obj` on every rank."""
        self.collectives += 1
        if not self.distributed:
            return obj
        src = dist.get_global_rank(self.group, 0)
        n = torch.tensor([len(data := _encode(obj)) if self.is_coordinator else 0], dtype=torch.int64)
        dist.broadcast(n, src=src, group=self.group)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.is_coordinator \
            else torch.empty(int(n), dtype=torch.uint8)
        if int(n):
            dist.broadcast(buf, src=src, group=self.group)
        return obj if self.is_coordinator else _decode(buf.numpy().tobytes())

    def all_gather(self, obj: Any) -> list[Any]:
        self.collectives += 1
        if not self.distributed:
            return [obj]
        data = _encode(obj)
        lengths = self._lengths(len(data))
        size = max(lengths)
        buf = torch.zeros(size, dtype=torch.uint8)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        outs = [torch.empty(size, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(outs, buf, group=self.group)
        return [_decode(o[:n].numpy().tobytes()) for o, n in zip(outs, lengths)]

    def barrier(self) -> None:
        self.collectives += 1
        if self.distributed:
            dist.barrier(group=self.group)


def _encode(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _decode(data: bytes) -> Any:
    return json.loads(data)
