"""A job paused at a step until the test releases it, so that a signal the test sends arrives while
the job waits there, however fast or slow the job and the test run (a job that outran the test would
finish before the signal, or stop at another step).

Job side: `pause_at(root, step)` right after writing its progress for `step` (jobs take
`--pause-at STEP`). Test side: `Job.signal_paused` (tests/dist.py) sends the signal, waits until
every process meant to receive it has logged bcp's "received" line, and then `release(root, step)`.
"""

from __future__ import annotations

import os
import time

WAIT_SECONDS = 300  # a job never released goes on after this long (the test has failed by then)


def release_file(root: str, step: int) -> str:
    return os.path.join(root, f"release_step_{step}")


def pause_at(root: str, step: int) -> None:
    """Job side: wait until the test releases `step`."""
    deadline = time.monotonic() + WAIT_SECONDS
    while not os.path.exists(release_file(root, step)) and time.monotonic() < deadline:
        time.sleep(0.01)


def release(root: str, step: int) -> None:
    """Test side: let the job go on from `step`."""
    with open(release_file(root, step), "w"):
        pass
