"""Host memory for accelerator tensors: pinned buffers, and bytes moved through them in chunks.

Pinned buffers. torch's pinned allocator rounds every request up to a power of two (a 86 MiB
tensor pins 128 MiB) and faults the pages in on one thread inside `cudaHostAlloc`. `pinned_empty`
takes the exact size from the ordinary allocator, faults it in with torch's parallel fill, then
page-locks it with `cudaHostRegister`; where that fails it falls back to torch's allocator.

Chunked transfers. A synchronous save of device tensors and a load into them move their bytes
through two pinned chunks per thread (`Bounce`): the device copy of one chunk runs while the host
hashes and writes, or fills, the other. A pageable copy would be synchronous and slower, and
copying whole tensors would hold the state twice in host memory.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import weakref
from collections.abc import Iterable, Iterator

import numpy as np
import torch

# Bytes per chunk of a transfer through a `Bounce`; two per thread (16 MiB: the per-copy overhead
# is ~1 % at 50 GiB/s, and a writer's hash and write of one chunk outlast the copy of the next).
CHUNK_BYTES = 16 << 20


def _cudart():
    try:
        return torch.cuda.cudart() if torch.cuda.is_available() else None
    except (AttributeError, RuntimeError, AssertionError):
        return None


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor, page-locked for asynchronous device copies, of exactly its size
    (module doc); its pages are faulted in already."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    rt = _cudart() if nbytes >= 1 << 20 else None  # small ones: the caching allocator's waste is small
    if rt is not None and hasattr(rt, "cudaHostRegister"):
        # numpy owns the memory and the tensor keeps the array alive: the array's finalizer
        # unregisters the range before its memory is freed, whichever tensor goes last
        arr = np.empty(nbytes, np.uint8)
        base = torch.from_numpy(arr)
        base.zero_()  # fault every page in, on torch's intra-op threads
        if int(rt.cudaHostRegister(arr.ctypes.data, nbytes, 0)) == 0:
            weakref.finalize(arr, rt.cudaHostUnregister, arr.ctypes.data).atexit = False  # the process ends anyway
            return base.view(dtype).view(shape)
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def host_buffer(src: torch.Tensor) -> torch.Tensor:
    """A host tensor shaped as `src`, to copy it into: pinned when `src` lives on a CUDA device."""
    if src.device.type == "cuda" and torch.cuda.is_available():
        return pinned_empty(tuple(src.shape), src.dtype)
    return torch.empty(tuple(src.shape), dtype=src.dtype)


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a 1-D uint8 tensor (of stride 1 even for one element)."""
    flat = t.reshape(-1) if t.numel() > 1 else t.as_strided((t.numel(),), (1,))
    return flat.view(torch.uint8)


class Bounce:
    """Two host chunks (pinned for a CUDA device) and a stream of its own: one thread's transfers
    of device tensors in chunks. Not thread-safe: a thread takes one with `bounce(device)`."""

    def __init__(self, device: torch.device, chunk: int = CHUNK_BYTES):
        self.device = device
        cuda = device.type == "cuda"
        self._bufs = [pinned_empty((chunk,), torch.uint8) if cuda else torch.empty(chunk, dtype=torch.uint8)
                      for _ in range(2)]
        self._stream = torch.cuda.Stream(device=device) if cuda else None
        self._events: list = [None, None]  # the copy last queued on each chunk

    def _on_stream(self):
        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    def _queue(self, k: int, fn) -> None:
        with torch.no_grad(), self._on_stream():
            fn()
            if self._stream is not None:
                ev = torch.cuda.Event()
                ev.record(self._stream)
                self._events[k % 2] = ev

    def _wait(self, k: int) -> None:
        ev, self._events[k % 2] = self._events[k % 2], None
        if ev is not None:
            ev.synchronize()

    def download(self, src: torch.Tensor) -> Iterator[memoryview]:
        """The bytes of `src` (on the device), a chunk at a time; each chunk is valid until the next
        is asked for. The device work queued on the caller's stream before the save must be done
        (a synchronous save synchronises first, `ordered_after_callers`)."""
        src = src.detach()
        if not src.is_contiguous():
            with self._on_stream():  # ordered before the chunks' copies on the same stream
                src = src.contiguous()
        flat = _flat_bytes(src)
        n, chunk = flat.numel(), self._bufs[0].numel()
        spans = [(lo, min(lo + chunk, n)) for lo in range(0, n, chunk)]

        def issue(k: int) -> None:
            lo, hi = spans[k]
            self._queue(k, lambda: self._bufs[k % 2][:hi - lo].copy_(flat[lo:hi], non_blocking=True))
        try:
            if spans:
                issue(0)
            for k, (lo, hi) in enumerate(spans):
                self._wait(k)
                if k + 1 < len(spans):  # into the other chunk: its bytes were consumed before this resumed
                    issue(k + 1)
                yield memoryview(self._bufs[k % 2][:hi - lo].numpy())
        finally:
            self.drain()

    def upload(self, dest: torch.Tensor, data: memoryview) -> None:
        """Copy the bytes `data` into contiguous `dest` (on the device); every byte has landed when
        this returns."""
        flat = _flat_bytes(dest.detach())
        n, chunk = flat.numel(), self._bufs[0].numel()
        if len(data) != n:
            raise ValueError(f"upload of {len(data)} bytes into a tensor of {n} bytes")
        src = np.frombuffer(data, np.uint8)
        try:
            for k, lo in enumerate(range(0, n, chunk)):
                hi = min(lo + chunk, n)
                self._wait(k)  # the copy that last read this chunk has landed
                buf = self._bufs[k % 2][:hi - lo]
                np.copyto(buf.numpy(), src[lo:hi])  # without the GIL
                self._queue(k, lambda: flat[lo:hi].copy_(buf, non_blocking=True))
        finally:
            self.drain()

    def drain(self) -> None:
        """Wait for every copy queued."""
        for k in (0, 1):
            self._wait(k)


class _Bounces:
    """`Bounce`s kept for reuse, per device: pinned memory is slow to allocate."""

    def __init__(self):
        self._free: dict[torch.device, list[Bounce]] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def take(self, device: torch.device) -> Iterator[Bounce]:
        with self._lock:
            free = self._free.setdefault(device, [])
            b = free.pop() if free else None
        b = b or Bounce(device)
        try:
            yield b
        finally:
            with self._lock:
                self._free[device].append(b)

    def forget(self) -> None:
        """In a forked child: the parent's buffers and streams are not the child's to use."""
        self._lock = threading.Lock()
        self._free = {}


_BOUNCES = _Bounces()
bounce = _BOUNCES.take

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_BOUNCES.forget)


def ordered_after_callers(tensors: Iterable[torch.Tensor]) -> None:
    """Wait, on the caller's thread, for the device work queued on its current streams of the CUDA
    devices holding `tensors`: transfers on other threads and streams then see its results."""
    for dev in {t.device for t in tensors if t.device.type == "cuda"}:
        torch.cuda.current_stream(dev).synchronize()
