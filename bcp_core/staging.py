"""Host buffers that asynchronous saves copy into, and when the copy happens.

Buffers are reused from save to save, so the copy writes into memory already faulted in; they are
pinned when the source lives on an accelerator, so device-to-host copies run asynchronously.

Lazy snapshots. Parameters and optimizer state change in place only in an optimizer step, never
during forward and backward. So an asynchronous save copies them *after* the call returns, on a
thread of its own, while training runs forward and backward (`LazyCopy`); a guard holds the next
optimizer step back until every copy is made. The guard is a global optimizer step pre-hook
(`torch.optim.optimizer.register_optimizer_step_pre_hook`), so it sees every optimizer, those of
Lightning, Accelerate, HF and Megatron included; when the step is given a closure (Lightning), the
guard runs after the closure's forward and backward, before the update. Everything else in the
state (buffers, plain tensors, values, per-rank and dataloader state) is copied at the call. Code
that writes parameters or optimizer state in place outside an optimizer step (an EMA kept in a
module's parameters, weight surgery, `load_state_dict`) runs inside `with bcp.mutating(): ...`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .errors import SaveError
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


# ----------------------------------------------------------------------------- lazy snapshots

class LazyCopy:
    """Copies of one save's stepped tensors (parameters, optimizer state), made after the call.

    A thread of its own copies them while training goes on; `finish()` (the optimizer step guard,
    `mutating()`, the save's writer) joins in and returns once every copy is made. CUDA sources are
    copied on a side stream that first waits for the work queued before the save call; `finish()`
    then only orders the caller's stream after the copies (no CPU wait), and the writer waits for
    them with `wait_copied()`.
    """

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], name: str):
        self._pairs = pairs  # (staging buffer, live source)
        self._next = 0
        self._left = len(pairs)
        self._lock = threading.Lock()
        self._done = threading.Event()
        self.error: BaseException | None = None
        self.started = time.time()
        self.ended: float | None = None
        self.nbytes = sum(src.numel() * src.element_size() for _, src in pairs)
        cuda = [src.device for _, src in pairs if src.device.type == "cuda"]
        self._stream = torch.cuda.Stream(device=cuda[0]) if cuda else None
        if self._stream is not None:  # the copies read the values as of the call
            self._stream.wait_stream(torch.cuda.current_stream(cuda[0]))
        _track(self)
        threading.Thread(target=self._copy_all, name=name).start()

    def _copy_all(self) -> None:
        """Copy whatever no one has claimed yet (the copy thread and any finisher share the work)."""
        while True:
            with self._lock:
                if self._next >= len(self._pairs):
                    return
                i = self._next
                self._next += 1
            buf, src = self._pairs[i]
            try:
                with torch.no_grad(), (torch.cuda.stream(self._stream) if self._stream is not None
                                       else contextlib.nullcontext()):
                    buf.copy_(src.detach(), non_blocking=self._stream is not None)
            except BaseException as e:  # noqa: BLE001 - fails the save (wait_copied), never the training step
                self.error = e
            with self._lock:
                self._left -= 1
                if self._left == 0:
                    self.ended = time.time()
                    self._done.set()
                    _untrack(self)

    def finish(self) -> None:
        """Return once every copy is made, helping with those not begun (or, on CUDA, once the
        caller's stream is ordered after them)."""
        self._copy_all()
        self._done.wait()
        if self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)

    def wait_copied(self) -> None:
        """For the writer: the buffers hold the values of the call; raises SaveError if a copy failed."""
        self._copy_all()
        self._done.wait()
        if self._stream is not None:
            self._stream.synchronize()
        if self.error is not None:
            raise SaveError(f"copying the state for the save failed: {type(self.error).__name__}: {self.error}")


_IN_FLIGHT: set[LazyCopy] = set()
_IN_FLIGHT_LOCK = threading.Lock()
_GUARD = None  # the optimizer step pre-hook's handle, registered at the first lazy copy


def _track(lc: LazyCopy) -> None:
    global _GUARD
    with _IN_FLIGHT_LOCK:
        _IN_FLIGHT.add(lc)
        if _GUARD is None:
            _GUARD = register_optimizer_step_pre_hook(_before_step)


def _untrack(lc: LazyCopy) -> None:
    with _IN_FLIGHT_LOCK:
        _IN_FLIGHT.discard(lc)


def finish_lazy_copies() -> None:
    """Every lazy copy in flight made: state may now change in place."""
    with _IN_FLIGHT_LOCK:
        pending = list(_IN_FLIGHT)
    for lc in pending:
        lc.finish()


def _before_step(optimizer, args, kwargs):
    """Optimizer step pre-hook: no parameter changes before the copies of a save in flight are made.

    With a closure (forward + backward inside `step`, as Lightning does), the copies go on during
    the closure and are finished right after it, before the update."""
    with _IN_FLIGHT_LOCK:
        if not _IN_FLIGHT:
            return None
    closure = kwargs.get("closure", args[0] if args else None)
    if not callable(closure):
        finish_lazy_copies()
        return None

    def closure_then_finish():
        loss = closure()
        finish_lazy_copies()
        return loss
    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure_then_finish}
    return (closure_then_finish, *args[1:]), kwargs


@contextlib.contextmanager
def mutating() -> Iterator[None]:
    """Around code that writes parameters or optimizer state in place outside an optimizer step
    (an EMA update of a saved module, weight surgery, load_state_dict) while an asynchronous save
    may still be copying them: the copies are finished first."""
    finish_lazy_copies()
    yield
