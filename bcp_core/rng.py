"""Random number generator state of this process, as a value bcp saves per rank (under extra_state).

Covers torch's CPU generator, every initialised CUDA device, Python's `random` and numpy's global
generator. Restoring it makes a resumed run draw the same numbers (dropout masks, sampling) as an
uninterrupted one.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import torch

from .errors import BCPError


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
    """Set the generators from a state `rng_state` gave. Every part is checked first, on a generator
    of its own: a malformed state raises BCPError naming the part and sets none of them."""
    if not isinstance(state, Mapping) or "torch" not in state or "python" not in state:
        raise BCPError(f"an RNG state needs the parts 'torch' and 'python'; got "
                       f"{sorted(state) if isinstance(state, Mapping) else type(state).__name__}")
    python = _as_tuples(state["python"])
    _check("torch", lambda: torch.Generator().set_state(state["torch"]))
    _check("python", lambda: random.Random().setstate(python))
    if "numpy" in state:
        import numpy as np
        _check("numpy", lambda: np.random.RandomState().set_state(state["numpy"]))
    cuda = state.get("cuda")
    if cuda is not None and not (isinstance(cuda, (list, tuple)) and all(
            isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1 for t in cuda)):
        raise BCPError("the RNG state's 'cuda' part is not a list of uint8 tensors (one per device)")
    torch.set_rng_state(state["torch"])
    random.setstate(python)
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def _check(part: str, set_on_a_copy) -> None:
    try:
        set_on_a_copy()
    except Exception as e:  # noqa: BLE001 - each library raises its own kind (TypeError, ValueError, ...)
        raise BCPError(f"the RNG state's {part!r} part is malformed: {type(e).__name__}: {e}") from None


def _as_tuples(v):
    """random.setstate wants tuples all the way down."""
    return tuple(_as_tuples(x) for x in v) if isinstance(v, (list, tuple)) else v
