"""Host memory for accelerator tensors: pinned buffers, and bytes moved through them in chunks.

Pinned buffers. torch's pinned allocator rounds every request up to a power of two (a 86 MiB
tensor pins 128 MiB) and faults the pages in on one thread inside `cudaHostAlloc`. `pinned_empty`
maps the exact size (huge pages where the kernel gives them, never inherited by a forked child),
faults it in with torch's parallel fill, then page-locks it with `cudaHostRegister` (on a thread
of its own, `_Pinner`); where that fails it falls back to torch's allocator.

Chunked transfers. A synchronous save of device tensors and a load into them move their bytes
through two pinned chunks per thread (`Bounce`): the device copy of one chunk runs while the host
hashes and writes, or fills, the other. A pageable copy would be synchronous and slower, and
copying whole tensors would hold the state twice in host memory.
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import threading
import weakref
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

# Bytes per chunk of a transfer through a `Bounce`; two per thread (16 MiB: the per-copy overhead
# is ~1 % at 50 GiB/s, and a writer's hash and write of one chunk outlast the copy of the next).
CHUNK_BYTES = 16 << 20

log = logging.getLogger("bcp")


def _cudart():
    try:
        return torch.cuda.cudart() if torch.cuda.is_available() else None
    except (AttributeError, RuntimeError, AssertionError):
        return None


class _Pinner:
    """Registers and unregisters host memory with CUDA on a thread of its own ("bcp-pin").

    On that thread each call first makes the tensor's device current (the current device is per
    thread: elsewhere a call could create a context on GPU 0), and a failed registration leaves
    its error (CUDA's per-thread last error) where no kernel is launched to report it later.
    Unregistering is queued, never waited for (it runs from finalizers, on any thread), and the
    memory stays mapped until it has run: unmapped first, its addresses could go to another
    allocation that CUDA would then refuse to pin ("resource already mapped")."""

    def __init__(self):
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="bcp-pin")
            return self._pool

    def register(self, ptr: int, nbytes: int, index: int) -> bool:
        rt = _cudart()
        if rt is None or not hasattr(rt, "cudaHostRegister"):
            return False

        def call() -> bool:
            with torch.cuda.device(index):
                return int(rt.cudaHostRegister(ptr, nbytes, 0)) == 0
        try:
            return self._executor().submit(call).result()
        except Exception as e:  # noqa: BLE001 - torch's allocator pins instead
            log.warning("bcp: registering %d bytes of host memory with CUDA device %d failed (%s: %s); "
                        "using torch's pinned allocator", nbytes, index, type(e).__name__, e)
            return False

    def unregister(self, ptr: int, index: int, pid: int, area: mmap.mmap) -> None:
        """Queue the unregistering of `ptr`, then the unmapping of `area`, the memory it is in."""
        if os.getpid() != pid:  # a forked child: the registration is the parent's
            return
        rt = _cudart()

        def call(area: mmap.mmap = area) -> None:  # holds the map until this has run
            with torch.cuda.device(index):
                rt.cudaHostUnregister(ptr)
        try:
            self._executor().submit(call)
        except RuntimeError:  # the interpreter is shutting down: the process's end unpins
            pass

    def forget(self) -> None:
        """In a forked child: no thread of the parent's runs here."""
        self._pool, self._lock = None, threading.Lock()


_PINNER = _Pinner()


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised host tensor, page-locked for asynchronous copies with CUDA `device`, of
    exactly its size (module doc); its pages are faulted in already."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes >= 1 << 20:  # small ones: the caching allocator's rounding wastes little
        # A private anonymous map, page-aligned. Huge pages: faulting in and registering 2 MiB
        # pages is ~5x as fast as 4 KiB ones, and device copies into them ~1.3x (an H100, 4 GiB).
        # Not inherited by a fork: Linux copies pinned private pages into a child at the fork
        # (2 s per 4 GiB measured, for every DataLoader worker), and no child has a use for them;
        # a shared map (no copy) takes 4 KiB pages only. The tensor holds the array, the array
        # the map; the array's finalizer queues the unregistering, and the unmapping after it.
        area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        for advice in ("MADV_HUGEPAGE", "MADV_DONTFORK"):
            if hasattr(mmap, advice):
                area.madvise(getattr(mmap, advice))
        arr = np.frombuffer(area, np.uint8)
        base = torch.from_numpy(arr)
        base.zero_()  # fault every page in, on torch's intra-op threads
        index = device.index if device.index is not None else torch.cuda.current_device()
        if _PINNER.register(arr.ctypes.data, nbytes, index):
            weakref.finalize(arr, _PINNER.unregister, arr.ctypes.data, index, os.getpid(), area).atexit = False
            return base.view(dtype).view(shape)
    return torch.empty(shape, dtype=dtype, pin_memory=True)


# Host copies of host tensors at least this large sit at the source's address modulo a page: the
# smallest write a direct-I/O writer takes in place (storage.base.IN_PLACE_BYTES).
SAME_PAGE_OFFSET_BYTES = 1 << 20


def host_buffer(src: torch.Tensor) -> torch.Tensor:
    """A host tensor shaped as `src`, to copy it into: pinned when `src` lives on a CUDA device.

    A large copy of a host tensor starts at the same offset within a page as `src`: a save writes
    either (the live source or the copy) and lays its files out for direct writes from the
    caller's memory (engine.write._arrange), which need the address and file offset to agree in a page."""
    if src.device.type == "cuda" and torch.cuda.is_available():
        return pinned_empty(tuple(src.shape), src.dtype, src.device)
    nbytes = src.numel() * src.element_size()
    if src.device.type != "cpu" or nbytes < SAME_PAGE_OFFSET_BYTES:
        return torch.empty(tuple(src.shape), dtype=src.dtype)
    page = mmap.PAGESIZE
    raw = torch.empty(nbytes + page, dtype=torch.uint8)
    shift = (src.data_ptr() - raw.data_ptr()) % page
    if shift % src.element_size():  # a source not aligned to its own element size
        return torch.empty(tuple(src.shape), dtype=src.dtype)
    return raw[shift:shift + nbytes].view(src.dtype).view(src.shape)


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a 1-D uint8 tensor. A tensor of one element or none counts as
    contiguous whatever its strides, and reshape keeps them; a byte view needs stride 1."""
    flat = t.reshape(-1) if t.numel() > 1 else t.as_strided((t.numel(),), (1,))
    return flat.view(torch.uint8)


class Bounce:
    """Two host chunks (pinned for a CUDA device) and a stream of its own: one thread's transfers
    of device tensors in chunks. Not thread-safe: a thread takes one with `bounce(device)`."""

    def __init__(self, device: torch.device, chunk: int = CHUNK_BYTES):
        self.device = device
        cuda = device.type == "cuda"
        self._bufs = [pinned_empty((chunk,), torch.uint8, device) if cuda else torch.empty(chunk, dtype=torch.uint8)
                      for _ in range(2)]
        self._stream = torch.cuda.Stream(device=device) if cuda else None
        self._events = [torch.cuda.Event() for _ in range(2)] if cuda else []
        self._queued = [False, False]  # whether a copy of chunk k % 2 may still be in flight

    def _on_stream(self):
        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    def _queue(self, k: int, fn) -> None:
        with torch.no_grad(), self._on_stream():
            fn()
            if self._stream is not None:
                self._events[k % 2].record(self._stream)
                self._queued[k % 2] = True

    def _wait(self, k: int) -> None:
        if self._queued[k % 2]:
            self._events[k % 2].synchronize()
            self._queued[k % 2] = False

    def download(self, src: torch.Tensor) -> Iterator[memoryview]:
        """The bytes of `src` (on the device), a chunk at a time; each chunk is valid until the next
        is asked for. The device work queued on the caller's stream before the save must be done
        (a synchronous save synchronises first, `ordered_after_callers`). Close the generator
        (`contextlib.closing`) when giving up early: closing drains the copies in flight."""
        src = src.detach()
        if not src.is_contiguous():
            with self._on_stream():  # ordered before the chunks' copies on the same stream
                src = src.contiguous()
        flat = byte_view(src)
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
        flat = byte_view(dest.detach())
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
            b.drain()  # nothing of this use may land in the next one's chunks
            with self._lock:
                self._free[device].append(b)

    def forget(self) -> None:
        """In a forked child: the parent's buffers and streams are not the child's to use. They stay
        referenced, so that nothing of CUDA runs here to free them."""
        self._orphans = getattr(self, "_orphans", []) + [self._free]
        self._lock = threading.Lock()
        self._free = {}


_BOUNCES = _Bounces()
bounce = _BOUNCES.take

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_BOUNCES.forget)
    os.register_at_fork(after_in_child=_PINNER.forget)


def ordered_after_callers(tensors: Iterable[torch.Tensor]) -> None:
    """Wait, on the caller's thread, for the device work queued on its current streams of the CUDA
    devices holding `tensors`: transfers on other threads and streams then see its results."""
    for dev in {t.device for t in tensors if t.device.type == "cuda"}:
        torch.cuda.current_stream(dev).synchronize()
