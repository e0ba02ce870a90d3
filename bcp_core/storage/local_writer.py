"""The writer of local and memory:// files (`LocalWriter`): a file written at increasing offsets,
under a temporary name, renamed into place when complete.

Durable writes go around the page cache (O_DIRECT, where the OS and filesystem allow it): the
bytes pass through a few reused page-aligned buffers (`_ALIGNED`) straight to the device, or
straight from the caller's memory when it is aligned as the device needs. A buffered write must
first get, fill and later write back a page-cache page per 4 KiB; that kernel work runs on the
cores training uses, and a checkpoint read by no one fills memory that training needs.
`configure_storage(direct_io=False)` keeps every write buffered. Buffered writes (memory://, a
file system without direct I/O) are cut into chunks written by parallel `pwrite` threads, which
release the GIL.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from ..errors import StorageError
from ..utils import this_rank
from .base import CONFIG, IN_PLACE_BYTES, FileWriter, chunks, run_all, temp_name


def _pwrite_all(fd: int, data: memoryview, pos: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, pos)  # releases the GIL
        if n == 0:  # never for a regular file on Linux; elsewhere it would loop forever
            raise OSError(errno.EIO, f"write of {len(data)} bytes at offset {pos} wrote nothing")
        data, pos = data[n:], pos + n


# O_DIRECT needs the buffer address, the file offset and the length aligned to the device's
# logical block: 512 B or 4 KiB on the devices and filesystems in use.
ALIGN = 4096
# What a direct-I/O write call should bring (FileWriter.write_bytes): the engine hashes that much,
# then hands it over, so the copy into the aligned buffer reads bytes still in the core's cache.
DIRECT_WRITE_BYTES = 1 << 20
# Aligned buffers a direct-I/O writer has in flight at once, each on an I/O thread of its own: a
# few, so that the device always has the next request while the writer's thread hashes and copies
# (on the development VM, under other processes' load, one in flight let the device idle whenever
# that thread waited for a core; the raw device wrote alike at any depth).
IN_FLIGHT = 4


def _address(data: memoryview) -> int:
    return np.frombuffer(data, dtype=np.uint8).ctypes.data if len(data) else 0


# /proc/self/pagemap: 8 bytes per page; bit 56 set when the page is mapped by this process alone.
_EXCLUSIVE = np.uint64(1 << 56)


def _exclusively_mapped(data: memoryview) -> bool:
    """Whether every page of `data` is mapped by this process alone. A page that a forked process
    still shares copy-on-write (a DataLoader worker forked since the page was last written) would
    be copied by the kernel when pinned for a direct write from it; such bytes go through the
    buffers instead. Reading the page flags took 2 ms per 256 MiB on the development VM; False
    where they cannot be read (no /proc)."""
    page, at = mmap.PAGESIZE, _address(data)
    first, last = at // page, (at + len(data) - 1) // page
    try:
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)  # per call: a descriptor kept would name the parent in a fork
        try:
            flags = os.pread(fd, (last - first + 1) * 8, first * 8)
        finally:
            os.close(fd)
    except OSError:
        return False
    return len(flags) == (last - first + 1) * 8 and bool(np.all(np.frombuffer(flags, np.uint64) & _EXCLUSIVE))


class _AlignedBuffers:
    """Page-aligned buffers (anonymous maps) of `BYTES` (at most `chunk_bytes`), reused from one
    write to the next: their pages are faulted in once per process, not once per checkpoint. At
    most `KEEP` stay mapped between writes.

    Small enough that the buffers a writer cycles through stay in the core's cache: copying into
    them took 0.02-0.04 s of CPU per GiB with 2 MiB buffers against 0.13-0.15 s with 16 MiB ones, and
    a file was written sooner (bench/io_cpu.py, the development VM)."""

    BYTES = 2 << 20
    KEEP = 4 * (IN_FLIGHT + 1)  # the buffers of up to 4 writers (a rank's files written at once)

    def __init__(self):
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    @classmethod
    def size(cls) -> int:
        return -(-min(cls.BYTES, CONFIG.chunk_bytes) // ALIGN) * ALIGN

    def get(self) -> mmap.mmap:
        with self._lock:
            while self._free:
                buf = self._free.pop()
                if len(buf) == self.size():
                    return buf
        return mmap.mmap(-1, self.size())

    def put(self, buf: mmap.mmap) -> None:
        # A buffer not kept is dropped, not closed: a view of it may outlive its write (the traceback
        # of a failed write, the I/O thread's task until it is deleted), and close() would then raise.
        # Its pages are unmapped with its last reference.
        with self._lock:
            if len(self._free) < self.KEEP and len(buf) == self.size():
                self._free.append(buf)

    def forget(self) -> None:
        """In a forked child: the buffers are maps shared with the parent (which goes on filling
        them) and the lock may have been held by another of its threads; start afresh."""
        self._free = []
        self._lock = threading.Lock()


_ALIGNED = _AlignedBuffers()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_ALIGNED.forget)


def _copy(dst: np.ndarray, src) -> None:
    """memcpy that releases the GIL (numpy does for plain byte arrays), so training threads run on."""
    np.copyto(dst, np.frombuffer(src, dtype=np.uint8))


class LocalWriter(FileWriter):
    """A file written at increasing offsets: directly to the device if it can, else in parallel chunks.

    The bytes go to a new temporary file in the target's directory (`dir_fd`, owned by the writer
    from now on), or to one the caller made and opened (`adopt`: its temporary name and descriptor,
    an existing file to overwrite, cut to size at close; MemoryStorage's spares); `close` renames it
    into place, `abort` deletes it. Each descriptor is closed once.

    Direct I/O: the bytes are copied into a page-aligned buffer (`_ALIGNED`); full buffers are
    written by threads of the writer's own (up to `IN_FLIGHT` at once) while the next one fills, so
    copying and the device overlap and writes of any size cost one copy (`write_bytes`: the engine hands over 1 MiB at a
    time, just hashed). `write_in_place` of at least `IN_PLACE_BYTES` whose address agrees with the
    file position modulo `ALIGN` (the engine lays files out so) copies nothing: its aligned bulk
    goes to the device from the caller's memory before it returns, its ends through the buffers. The
    last, partial block goes out padded at `close`, and the file is cut to size. Buffered (no
    direct I/O here, or memory://): each write is cut into `chunk_bytes` chunks written by
    parallel threads, so the engine hands over whole pieces (`write_bytes` None).
    """

    def __init__(self, dir_fd: int, name: str, shown: str, fsync: bool, mode: int = 0o644,
                 adopt: tuple[str, int] | None = None):
        self.dir_fd, self.name, self.path, self.fsync = dir_fd, name, shown, fsync
        self.tmp, self.fd = adopt if adopt is not None else (temp_name(name), None)
        self.reused = adopt is not None  # an existing file: cut to size at close
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        # direct I/O for durable files only: memory:// (no fsync) lives in the page cache by design
        self.direct = fsync and CONFIG.direct_io and hasattr(os, "O_DIRECT") and not self.reused
        try:
            if self.direct:
                try:
                    self.fd = os.open(self.tmp, flags | os.O_DIRECT, mode, dir_fd=dir_fd)
                except OSError as e:
                    if e.errno != errno.EINVAL:  # EINVAL: this filesystem has no direct I/O
                        raise
                    self.direct = False
            if not self.direct and not self.reused:
                self.fd = os.open(self.tmp, flags, mode, dir_fd=dir_fd)
        except BaseException:
            self._close_dir()
            raise
        self.write_bytes = DIRECT_WRITE_BYTES if self.direct else None
        self.align = ALIGN if self.direct else 0
        self.pos = 0  # bytes taken so far
        # direct I/O: the buffer being filled (bytes [pos - fill, pos) of the file), and the full ones
        # whose writes are in flight, oldest first: (future, buffer, file offset, bytes)
        self.buf: mmap.mmap | None = None
        self.fill = 0
        self.inflight: list[tuple[Future, mmap.mmap, int, int]] = []
        self.pool: ThreadPoolExecutor | None = None

    def write(self, data: memoryview) -> None:
        self._write(data, in_place=False)

    def write_in_place(self, data: memoryview) -> None:
        self._write(data, in_place=True)

    def can_write_in_place(self, data: memoryview) -> bool:
        return self._aligned(data) and _exclusively_mapped(data)

    def _aligned(self, data: memoryview) -> bool:
        return bool(self.direct and len(data) >= IN_PLACE_BYTES and (_address(data) - self.pos) % ALIGN == 0)

    def _write(self, data: memoryview, in_place: bool) -> None:
        if self.fd is None:  # direct I/O would take the bytes into a buffer that is never written
            raise StorageError(f"rank {this_rank()}: write to {self.path} after it was closed or aborted")
        data = memoryview(data).cast("B")
        if self.direct:
            # the pages' sharing was checked by the caller's can_write_in_place (it costs a read of
            # their flags); the alignment direct I/O needs is checked here
            data = self._write_direct(data, in_place and self._aligned(data))
            if not len(data):
                return
        pos = self.pos
        run_all([lambda lo=lo, hi=hi: _pwrite_all(self.fd, data[lo:hi], pos + lo) for lo, hi in chunks(len(data))])
        self.pos += len(data)

    def _write_direct(self, data: memoryview, in_place: bool) -> memoryview:
        """Write `data` in place (its aligned bulk from the caller's memory), or through the aligned
        buffers. Returns what is left to write buffered if the device refused direct I/O (EINVAL:
        another alignment)."""
        if not in_place:
            return self._copy_in(data)
        head = -self.pos % ALIGN  # up to the next aligned offset: into the buffer being filled
        body = (len(data) - head) // ALIGN * ALIGN
        left = self._copy_in(data[:head])
        if len(left):
            return data[head - len(left):]
        try:
            if self.fill:  # the buffer now ends where the body starts, at an aligned offset
                self._submit()
            # releases the GIL; the buffer's write goes on beside it
            _pwrite_all(self.fd, data[head:head + body], self.pos)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._stop_direct()
            return data[head:]
        self.pos += body
        return self._copy_in(data[head + body:])

    def _copy_in(self, data: memoryview) -> memoryview:
        """Copy `data` into aligned buffers, handing each full one to the I/O thread. Returns what
        is left to write buffered if the device refused direct I/O."""
        while len(data):
            if self.buf is None:
                self.buf, self.fill = _ALIGNED.get(), 0
            take = min(len(data), len(self.buf) - self.fill)
            _copy(np.frombuffer(self.buf, dtype=np.uint8, count=take, offset=self.fill), data[:take])
            self.fill += take
            self.pos += take
            data = data[take:]
            if self.fill == len(self.buf):
                try:
                    self._submit()
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    self._stop_direct()
                    return data
        return data

    def _submit(self) -> None:
        """Hand the buffer being filled (it ends at an aligned offset) to the I/O threads, once
        fewer than `IN_FLIGHT` writes are in flight."""
        if len(self.inflight) >= IN_FLIGHT:
            self._wait_oldest()
        if self.pool is None:
            self.pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="bcp-io")
        buf, at, n = self.buf, self.pos - self.fill, self.fill
        self.buf, self.fill = None, 0
        self.inflight.append((self.pool.submit(_pwrite_all, self.fd, memoryview(buf)[:n], at), buf, at, n))

    def _wait_oldest(self) -> None:
        """Wait for the oldest write in flight; its buffer goes back to the pool once written."""
        future, buf, _, _ = self.inflight[0]
        future.result()  # raises its OSError, the buffer still held
        self.inflight.pop(0)
        _ALIGNED.put(buf)

    def _wait_inflight(self) -> None:
        """Wait for every write in flight."""
        while self.inflight:
            self._wait_oldest()

    def _stop_direct(self) -> None:
        """Go on buffered: rewrite through the page cache what direct I/O has not written."""
        self.write_bytes = None
        import fcntl  # POSIX only, as O_DIRECT is
        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        self.direct = False
        pending = []
        for future, buf, at, n in self.inflight:
            future.exception()  # ended (it failed, or a later write failed)
            pending.append((buf, at, n))
        self.inflight = []
        if self.buf is not None:
            pending.append((self.buf, self.pos - self.fill, self.fill))
            self.buf, self.fill = None, 0
        try:
            for buf, at, n in pending:
                _pwrite_all(self.fd, memoryview(buf)[:n], at)
        finally:
            for buf, _, _ in pending:
                _ALIGNED.put(buf)

    def _finish_direct(self) -> None:
        """Wait for the buffer in flight; the last partial block goes out padded to the alignment;
        the file is then cut to size."""
        try:
            self._wait_inflight()
            if self.fill:
                n = -(-self.fill // ALIGN) * ALIGN
                self.buf[self.fill:n] = bytes(n - self.fill)  # a reused buffer holds older bytes there
                _pwrite_all(self.fd, memoryview(self.buf)[:n], self.pos - self.fill)
                self.fill = 0
            if self.buf is not None:
                _ALIGNED.put(self.buf)
                self.buf = None
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._stop_direct()
        os.ftruncate(self.fd, self.pos)

    def close(self) -> None:
        """Finish, fsync and rename the file into place; on any error the file is discarded."""
        try:
            try:
                if self.direct:
                    self._finish_direct()
                elif self.reused:  # the spare may have been longer
                    os.ftruncate(self.fd, self.pos)
                if self.fsync:  # direct writes too: the file's size and the device's cache
                    os.fsync(self.fd)
            finally:
                self._end_io()
                self._close_fd()
            # rename() replaces a name, never writes through it: a link planted there is dropped, not followed
            os.replace(self.tmp, self.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
        except BaseException:
            self.abort()
            raise
        self._close_dir()

    def abort(self) -> None:
        self._end_io()
        with contextlib.suppress(OSError):
            self._close_fd()
        if self.dir_fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.tmp, dir_fd=self.dir_fd)
            self._close_dir()

    def _end_io(self) -> None:
        """The I/O thread ended (its write waited for, whatever its outcome), the buffers given back."""
        inflight, self.inflight = self.inflight, []
        for future, buf, _, _ in inflight:
            future.exception()
            _ALIGNED.put(buf)
        if self.buf is not None:
            _ALIGNED.put(self.buf)
            self.buf, self.fill = None, 0
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _close_fd(self) -> None:
        # Closed once: a second close could hit another component's file that got the same number.
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def _close_dir(self) -> None:
        fd, self.dir_fd = self.dir_fd, None
        if fd is not None:
            os.close(fd)
