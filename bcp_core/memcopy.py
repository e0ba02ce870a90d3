"""Copies of large runs of bytes into memory that is not read again soon, with non-temporal stores.

An ordinary store reads each destination cache line from memory before writing it, so a copy
moves three times its size through memory; a non-temporal store writes whole lines without
reading them, twice its size. glibc's memcpy, and the kernel's copy into user memory, use
ordinary stores up to about 3/4 of the shared cache (190 MiB on a 480 MiB L3): every tensor of
a model. On the 2-core development VM copies of 64 MiB ran at 0.09-0.10 s per GiB with
non-temporal stores against 0.155-0.166 s with memcpy, two processes at once; out of the page
cache into a load's tensors, 0.71-0.73x the time of the kernel's copy (bench/io_cpu.py:
`map_stream`).

`copy` uses the compiled `_memcopy` (x86-64; built by `pip install` where a C compiler is, else
left out) for runs of at least `STREAM_MIN_BYTES`, numpy's copy otherwise.

A load copies with it, into the caller's tensors. A save's snapshot does not. Into fresh staging
buffers (a first save), bench/train_loop.py's ddp-transformer loop took 1.68x a normal step for
its first checkpoint step with streamed copies against 1.32x without (one run each). Into buffers
faulted in already (later saves), the snapshot's copies took 0.018-0.039 s of CPU per GiB
streamed against 0.021-0.052 s not (bench/io_cpu.py --train-steps 2, 6 and 4 saves): ~6 % of a
save's CPU, and no difference this VM's noise lets show in the loop.
"""

from __future__ import annotations

import numpy as np

try:
    from . import _memcopy
except ImportError:  # built without a C compiler: numpy's copies
    _memcopy = None

# Below this a copy's destination may well be read again from the cache (and the call dominates).
STREAM_MIN_BYTES = 1 << 20

NON_TEMPORAL = bool(_memcopy is not None and _memcopy.NON_TEMPORAL)


def copy(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy `src` into `dst`: contiguous uint8 arrays of the same length. The GIL is released."""
    if NON_TEMPORAL and dst.nbytes >= STREAM_MIN_BYTES:
        _memcopy.copy(dst, src)
    else:
        np.copyto(dst, src)
