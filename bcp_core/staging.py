"""Host buffers that asynchronous saves copy into (the only part of a save that stalls training).

Buffers are reused from save to save, so the copy writes into memory already faulted in; they are
pinned when the source lives on an accelerator, so device-to-host copies run asynchronously.
"""

from __future__ import annotations

import threading

import torch

from .save_planner import LocalSavePlan


class StagingPool:
    """Host buffers reused across asynchronous saves: two slots (ping-pong) for the current plan.

    Save k+1 stages into one slot while save k still writes from the other. The second slot is
    allocated only when a save finds the first still in use.
    """

    def __init__(self):
        self._key: tuple | None = None
        self._slots: list[list[torch.Tensor] | None] = [None, None]
        self._busy = [False, False]
        self._lock = threading.Lock()

    def acquire(self, key: tuple, sources: list[torch.Tensor]) -> tuple[int, list[torch.Tensor]] | None:
        with self._lock:
            if key != self._key:  # the layout changed: drop buffers of the old plan (none is busy then)
                self._key, self._slots, self._busy = key, [None, None], [False, False]
            for i in (0, 1):
                if not self._busy[i]:
                    if self._slots[i] is None:
                        self._slots[i] = [host_buffer(s) for s in sources]
                    self._busy[i] = True
                    return i, self._slots[i]
            return None

    def release(self, key: tuple, slot: int) -> None:
        with self._lock:
            if key == self._key:
                self._busy[slot] = False

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for slot in self._slots if slot for b in slot)

    def warm(self, key: tuple) -> bool:
        with self._lock:
            return key == self._key and any(slot is not None for slot in self._slots)

    def warm_up(self, key: tuple, sources: list[torch.Tensor]) -> None:
        """Allocate and touch one slot's buffers for `key` before a save needs them."""
        buffers = [host_buffer(s) for s in sources]
        with torch.no_grad():
            for b in buffers:
                b.zero_()  # fault the pages in here, not in the next save's copy
        with self._lock:
            if key != self._key:
                self._key, self._slots, self._busy = key, [None, None], [False, False]
            if self._slots[0] is None and not self._busy[0]:
                self._slots[0] = buffers


def pool_key(plan: LocalSavePlan, boxes) -> tuple:
    """Staging buffers fit a structure and the boxes staged from it: a first save stages every box
    this rank holds, later ones only those assigned to it; without replicas they are the same."""
    return plan.key, tuple(tuple(tb) for tb in boxes)


def box_sources(plan: LocalSavePlan, boxes) -> list[torch.Tensor]:
    """The live views of `boxes` ((tensor index, box index) pairs of `plan`)."""
    return [plan.tensors[ti][1].boxes[bi].view for ti, bi in boxes]


def host_buffer(src: torch.Tensor) -> torch.Tensor:
    pin = src.device.type == "cuda" and torch.cuda.is_available()
    return torch.empty(tuple(src.shape), dtype=src.dtype, pin_memory=pin)


def contiguous_cpu(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return (t.to("cpu") if t.device.type != "cpu" else t).contiguous()
