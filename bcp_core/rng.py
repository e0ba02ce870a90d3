"""Random number generator state of this process, as a value bcp saves per rank (under extra_state).

Covers torch's CPU generator, every initialised CUDA device, Python's `random` and numpy's global
generator. Restoring it makes a resumed run draw the same numbers (dropout masks, sampling) as an
uninterrupted one.
"""

from __future__ import annotations

import random
from typing import Any

import torch


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np
        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuples(state["python"]))
    if "numpy" in state:
        import numpy as np
        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuples(v):
    """random.setstate wants tuples all the way down."""
    return tuple(_as_tuples(x) for x in v) if isinstance(v, (list, tuple)) else v
