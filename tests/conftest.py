import glob
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))


def pytest_sessionstart(session):
    _drop_stale_extension_locks()


def _drop_stale_extension_locks(older_than_s: float = 600) -> None:
    """torch's JIT-built extensions (DeepSpeed's CPU communication op, built at a job's first start)
    are loaded under a lock file, taken on every load; a process killed while holding it (a hung
    test's timeout, the OOM killer) leaves it behind, and every later load waits for it forever.
    One older than any build takes is stale."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.expanduser("~/.cache/torch_extensions")
    for lock in glob.glob(os.path.join(root, "*", "*", "lock")):
        try:
            if time.time() - os.path.getmtime(lock) > older_than_s:
                os.remove(lock)
        except OSError:
            pass
