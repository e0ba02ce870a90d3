"""Host buffers that asynchronous saves copy into, and when the copy happens.

Buffers are reused from save to save, so the copy writes into memory already faulted in; they are
pinned when the source lives on an accelerator, so device-to-host copies run asynchronously.

Lazy snapshots. Parameters and optimizer state change in place only in an optimizer step, never
during forward and backward. So an asynchronous save takes them *after* the call returns, while
training runs forward and backward (`LazyCopy`): the writer reads CPU tensors straight from the
state, a thread copies the others; a guard holds the next optimizer step back until every tensor
is copied or written. The guard is a global optimizer step pre-hook
(`torch.optim.optimizer.register_optimizer_step_pre_hook`), so it sees every optimizer, those of
Lightning, Accelerate, HF and Megatron included; when the step is given a closure (Lightning), the
guard runs after the closure's forward and backward, before the update. Everything else in the
state (buffers, plain tensors, values, per-rank and dataloader state) is copied at the call. Code
that writes parameters or optimizer state in place outside an optimizer step (an EMA kept in a
module's parameters, weight surgery, `load_state_dict`) runs inside `with bcp.mutating(): ...`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .errors import BCPError, CommTimeoutError, SaveError
from .host_memory import host_buffer
from .plan_records import LocalSavePlan
from .utils import this_rank

log = logging.getLogger("bcp")


class StagingLease:
    """One acquisition of a staging slot: releasing it frees that slot only if this acquisition
    still holds it, so a late release can never free a slot another save has taken since."""

    __slots__ = ("slot",)

    def __init__(self, slot: _Slot):
        self.slot = slot


class _Slot:
    """One set of staging buffers, for the pool key it was made for."""

    __slots__ = ("key", "buffers", "holder")

    def __init__(self, key: tuple, buffers: list[torch.Tensor]):
        self.key, self.buffers = key, buffers
        self.holder: StagingLease | None = None  # the acquisition writing from it, if any

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.buffers)

    def __len__(self) -> int:
        return len(self.buffers)


class StagingPool:
    """Host buffers reused across asynchronous saves: at most two slots (ping-pong), whatever the keys.

    Save k+1 stages into one slot while save k still writes from the other. The second slot is
    allocated only when a save finds the first still in use. Slots in use are never dropped, even
    when the key changes (a save of another structure): they count against the two, so a role never
    holds more than two sets of buffers, and a third save waits for the oldest.
    """

    def __init__(self):
        self._key: tuple | None = None  # the key of the latest acquire or warm-up
        self._slots: list[_Slot] = []
        self._lock = threading.Lock()

    def acquire(self, key: tuple, sources: list[torch.Tensor]) -> tuple[StagingLease, list[torch.Tensor]] | None:
        """A slot for `key`: this acquisition's lease (for `release`) and its buffers; None while two
        slots are in use."""
        with self._lock:
            self._key = key
            slot = next((s for s in self._slots if s.key == key and s.holder is None), None)
            if slot is None:
                adopted = self._adopt(key)
                self._drop_free_of_other_keys()
                if len(self._slots) >= 2:
                    return None
                slot = _Slot(key, adopted or [host_buffer(s) for s in sources])
                self._slots.append(slot)
            lease = slot.holder = StagingLease(slot)
            return lease, slot.buffers

    def _adopt(self, key: tuple) -> list[torch.Tensor] | None:
        """Buffers of a free slot of another key of the same structure that has every box of `key`:
        the first save of a structure stages every box a rank holds, later ones the boxes the plan
        gave it, so their buffers are already faulted in. The caller holds the lock."""
        for s in self._slots:
            if s.holder is None and s.key[0] == key[0]:
                by_box = dict(zip(s.key[1], s.buffers))
                if all(box in by_box for box in key[1]):
                    self._slots.remove(s)  # each buffer serves one slot; the boxes not taken are freed
                    return [by_box[box] for box in key[1]]
        return None

    def _drop_free_of_other_keys(self) -> None:
        """Free slots of other keys will not be used again: their memory goes. The caller holds the lock."""
        self._slots = [s for s in self._slots if s.key == self._key or s.holder is not None]

    def release(self, key: tuple, lease: StagingLease) -> None:
        """End `lease`'s use of its slot (acquired for `key`); no effect if it was released already.
        The lease, not the key, says which slot: the key may have a newer slot in use by now."""
        with self._lock:
            slot = lease.slot
            if slot.holder is not lease:
                return
            slot.holder = None
            # a slot of another structure is not used again; one of the same structure may be
            # adopted by the next save (`_adopt`)
            if self._key is not None and slot.key[0] != self._key[0]:
                self._slots.remove(slot)

    def nbytes(self) -> int:
        with self._lock:
            return sum(b.numel() * b.element_size() for s in self._slots for b in s.buffers)

    def warm(self, key: tuple) -> bool:
        with self._lock:
            return any(s.key == key for s in self._slots)

    def warm_up(self, key: tuple, sources: list[torch.Tensor]) -> None:
        """Allocate and touch one slot's buffers for `key` before a save needs them (kept only if the
        pool has room: slots in use stay theirs)."""
        buffers = [host_buffer(s) for s in sources]
        with torch.no_grad():
            for b in buffers:
                b.zero_()  # fault the pages in here, not in the next save's copy
        with self._lock:
            self._key = key
            self._drop_free_of_other_keys()
            if len(self._slots) < 2 and not any(s.key == key for s in self._slots):
                self._slots.append(_Slot(key, buffers))
                for b in buffers:
                    _mark_filled(b)


def pool_key(plan: LocalSavePlan, boxes) -> tuple:
    """Staging buffers fit a structure and the boxes staged from it: a first save stages every box
    this rank holds, later ones only those assigned to it; without replicas they are the same."""
    return plan.key, tuple(tuple(tb) for tb in boxes)


def box_sources(plan: LocalSavePlan, boxes) -> list[torch.Tensor]:
    """The live views of `boxes` ((tensor index, box index) pairs of `plan`)."""
    return [plan.tensors[ti][1].boxes[bi].view for ti, bi in boxes]


def contiguous_cpu(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return (t.to("cpu") if t.device.type != "cpu" else t).contiguous()


def on_host_or_cuda(t: torch.Tensor) -> torch.Tensor:
    """`t` as a writer takes it: a CUDA tensor as it is (the writer moves it through pinned chunks),
    anything else contiguous on the host."""
    return t.detach() if t.device.type == "cuda" else contiguous_cpu(t)


# ----------------------------------------------------------------------------- lazy snapshots

# The states of one (buffer, source) pair of a lazy snapshot.
PENDING, COPYING, COPIED, LIVE, DONE = range(5)

# Buffers a copy has filled at least once (by id, forgotten when the buffer is freed): their pages
# are faulted in, so copying into them again is cheap. A buffer not filled yet is better left
# untouched while its source can be written directly.
_FILLED: set[int] = set()


def _mark_filled(buf: torch.Tensor) -> None:
    if id(buf) not in _FILLED:
        _FILLED.add(id(buf))
        weakref.finalize(buf, _FILLED.discard, id(buf))


def _filled(buf: torch.Tensor) -> bool:
    return id(buf) in _FILLED


def writable_live(buf: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether the writer can take the bytes of `src` itself instead of its copy in `buf`."""
    return (src.device.type == "cpu" and src.is_contiguous() and src.dtype == buf.dtype
            and tuple(src.shape) == tuple(buf.shape))


class LazyCopy:
    """One save's stepped tensors (parameters, optimizer state), captured after the call.

    Each pair (staging buffer, live source) is either copied into its buffer or, for a CPU source
    when `live` allows it, written by the save's writer straight from the source while it still
    holds the values of the call (`hold`). A thread of its own copies, while training goes on, the
    pairs whose buffers are already faulted in (or that cannot be written live); copying into fresh
    memory beside training would cost more than writing the source directly. `finish()` (the
    optimizer step guard, `mutating()`) copies every pair not yet taken and waits for the writes
    from live sources in progress, so it returns once the state may change. CUDA sources are copied
    on a side stream that first waits for the work queued before the save call; `finish()` then
    only orders the caller's stream after the copies (no CPU wait), and the writer waits for them.
    A CUDA copy is only queued when its pair is settled, so such a snapshot stays in flight (the
    guard still calls `finish()`) until a stream is ordered after its copies or they have landed.
    """

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], name: str, live: bool = False,
                 timeout: float | None = None):
        self._pairs = pairs  # (staging buffer, live source)
        self._timeout = timeout  # how long the step guard waits for writes from live sources
        self._index = {id(buf): i for i, (buf, _) in enumerate(pairs)}
        self._live = [live and writable_live(buf, src) for buf, src in pairs]
        self._state = [PENDING] * len(pairs)
        self._left = len(pairs)  # pairs not yet COPIED or DONE
        self._closing = False  # a step is coming: no new writes from live sources
        self._cond = threading.Condition()
        self._done = threading.Event()
        self.error: BaseException | None = None
        self.started = time.time()
        self.ended: float | None = None
        self.nbytes = sum(src.numel() * src.element_size() for _, src in pairs)
        self.copied_bytes = 0
        cuda = [src.device for _, src in pairs if src.device.type == "cuda"]
        self._stream = torch.cuda.Stream(device=cuda[0]) if cuda else None
        if self._stream is not None:  # the copies read the values as of the call
            self._stream.wait_stream(torch.cuda.current_stream(cuda[0]))
        _track(self)
        if any(not lv or _filled(buf) for lv, (buf, _) in zip(self._live, pairs)):
            threading.Thread(target=self._copy_all, args=(True,), name=name).start()

    def _settle(self, i: int, state: int) -> None:
        """Pair i reached a final state (COPIED or DONE); the caller holds the condition."""
        self._state[i] = state
        self._left -= 1
        self._cond.notify_all()
        if self._left == 0:
            self.ended = time.time()
            self._done.set()
            if self._stream is None:  # CUDA copies are only queued: tracked until a stream is ordered after them
                _untrack(self)

    def _copy(self, i: int) -> None:
        """Copy pair i (claimed as COPYING by the caller) into its buffer."""
        buf, src = self._pairs[i]
        try:
            with torch.no_grad(), (torch.cuda.stream(self._stream) if self._stream is not None
                                   else contextlib.nullcontext()):
                buf.copy_(src.detach(), non_blocking=self._stream is not None)
            _mark_filled(buf)
        except BaseException as e:  # noqa: BLE001 - fails the save (the writer), never the training step
            self.error = e
        with self._cond:
            self.copied_bytes += src.numel() * src.element_size()
            self._settle(i, COPIED)

    def _copy_all(self, background: bool = False) -> None:
        """Copy every pair no one has taken yet; in the background, only those whose buffers are
        warm or whose sources cannot be written live (the writer takes the others)."""
        for i, (buf, _) in enumerate(self._pairs):
            with self._cond:
                if self._state[i] != PENDING or (background and self._live[i] and not _filled(buf)
                                                 and not self._closing):
                    continue
                self._state[i] = COPYING
            self._copy(i)

    def finish(self) -> None:
        """Return once the state may change in place: every pair copied or written (or, on CUDA,
        the caller's stream ordered after the copies).

        A write from a live source that does not end within the timeout (a stalled network file
        system) is given up on: the save fails (its writer raises this error once it returns) and
        the step goes on, rather than training waiting for the storage without end."""
        with self._cond:
            self._closing = True
        self._copy_all()
        if not self._done.wait(self._timeout):
            with self._cond:
                stuck = [i for i, st in enumerate(self._state) if st == LIVE]
            self.error = self.error or CommTimeoutError(
                f"bcp step pre-hook: rank {this_rank()} waited {self._timeout:.0f} s for the save's write of "
                f"{len(stuck)} piece(s) straight from the live state; the optimizer step went on and this "
                "save fails (the storage stalled)")
            log.error("%s", self.error)
            return
        if self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
            _untrack(self)

    @contextlib.contextmanager
    def hold(self, buf: torch.Tensor) -> Iterator[torch.Tensor]:
        """For the writer: the tensor holding the values of the call that `buf` stands for. That is
        the live source while no step is coming (the guard waits until the block ends), else the
        copy in `buf`."""
        i = self._index.get(id(buf))
        if i is None:  # copied at the call
            yield buf
            return
        with self._cond:
            taken = self._state[i] == PENDING
            if taken:
                self._state[i] = LIVE if self._live[i] and not self._closing else COPYING
            live = taken and self._state[i] == LIVE
        if live:
            try:
                yield self._pairs[i][1].detach()
            finally:
                with self._cond:
                    self._settle(i, DONE)
            return
        if taken:
            self._copy(i)
        with self._cond:
            self._cond.wait_for(lambda: self._state[i] in (COPIED, DONE))
            if self._state[i] == DONE:  # each piece is asked for once; fail rather than wait forever
                raise SaveError(f"the staged copy of piece {i} was asked for after it was written")
        self._raise_copy_error()
        if self._stream is not None:
            self._stream.synchronize()
        yield buf

    def skip(self, buffers: list[torch.Tensor]) -> None:
        """The writer will not ask for these buffers (the plan gave their boxes to other ranks):
        the ones not taken yet need no copy, not even before the next optimizer step."""
        with self._cond:
            for buf in buffers:
                i = self._index.get(id(buf))
                if i is not None and self._state[i] == PENDING:
                    self._settle(i, DONE)

    def retire(self) -> None:
        """The writer is done: pairs it never asked for (boxes another rank writes) need no copy."""
        with self._cond:
            for i, st in enumerate(self._state):
                if st == PENDING:
                    self._settle(i, DONE)
        self._done.wait()
        if self._stream is not None:
            self._stream.synchronize()  # every queued copy has landed: the state may change from here on
            _untrack(self)
        self._raise_copy_error()

    def _raise_copy_error(self) -> None:
        if isinstance(self.error, BCPError):
            raise self.error
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


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker...) has none of the parent's copy threads or writers:
    its optimizer steps must not wait for the parent's lazy copies."""
    global _IN_FLIGHT_LOCK
    _IN_FLIGHT_LOCK = threading.Lock()
    _IN_FLIGHT.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


@contextlib.contextmanager
def mutating() -> Iterator[None]:
    """Around code that writes parameters or optimizer state in place outside an optimizer step
    (an EMA update of a saved module, weight surgery, load_state_dict) while an asynchronous save
    may still be copying them: the copies are finished first."""
    finish_lazy_copies()
    yield
