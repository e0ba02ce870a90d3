"""Small helpers every layer shares: pausing the garbage collector, content digests, this rank, sizes."""

from __future__ import annotations

import functools
import gc
import hashlib
import os


def gc_paused(fn):
    """Run `fn` with the cyclic garbage collector paused.

    Planning a large job builds millions of small lists and dicts (decoded plans, boxes, pieces);
    each allocation burst triggers a collection that walks the whole growing heap, which made
    decoding 8,960 plans 18x slower (bench/plan_scale.py). None of these objects form cycles, so
    collection is only deferred, never skipped: it runs as usual once `fn` returns.
    """
    @functools.wraps(fn)
    def inner(*args, **kwargs):
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was_enabled:
                gc.enable()
    return inner


def digest(data) -> str:
    """A 128-bit content digest (plan cache keys, comparing values across ranks)."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def cores_per_rank() -> int:
    """The CPU cores this process may use, shared among the ranks of its host (LOCAL_WORLD_SIZE, as
    torchrun sets it): how many threads a rank's background work may keep busy without taking
    cores from training."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    return max(1, cores // max(1, local))


def load_threads() -> int:
    """Threads a load reads, verifies and copies with by default: this rank's share of the host's
    cores, at least 4 (a load waits for itself: I/O and copies overlap on as many threads as cores
    allow) and at most 8. A load's host work (hashing, copying out of the page cache, into pinned
    chunks for CUDA tensors) is bound by memory bandwidth, which 8 threads fill: on a 16-core H100
    host a warm 4 GiB load into CUDA tensors ran at 10.6 GiB/s with 8 threads, 8.0 with 16 and 6.8
    with 4 (docs/gpu.md, 2026-11-28)."""
    return max(4, min(8, cores_per_rank()))


def this_rank(group=None) -> int:
    """This process's rank in `group` (the default group if None); 0 outside torch.distributed."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group)
    return 0


def human_bytes(n: float) -> str:
    """`1536` -> `1.50 KiB`: sizes in messages, tool output and reports."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"
