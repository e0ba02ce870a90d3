"""RNG states (bcp_core.rng): restored for every generator saved, refused whole when malformed."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import bcp_core as bcp
from bcp_core.rng import rng_state, set_rng_state


def _draws() -> tuple:
    return torch.rand(4).tolist(), random.random(), np.random.rand(2).tolist()


def _reseed(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def test_rng_states_loaded_from_a_checkpoint_give_the_same_draws(tmp_path):
    _reseed(1)
    bcp.save(str(tmp_path / "ck"), {"extra_state": {"rng": rng_state()}}).wait()
    expected = _draws()
    _reseed(2)
    state: dict = {"extra_state": {}}
    bcp.load(str(tmp_path / "ck"), state)
    set_rng_state(state["extra_state"]["rng"])
    assert _draws() == expected


@pytest.mark.parametrize("part, bad, message", [
    ("torch", torch.zeros(3, dtype=torch.uint8), "'torch' part is malformed"),
    ("python", [1, [2, 3], None], "'python' part is malformed"),
    ("numpy", ["MT19937", [1, 2], 0, 0, 0.0], "'numpy' part is malformed"),
    ("cuda", [torch.zeros(4)], "'cuda' part is not a list of uint8 tensors"),
    ("torch", None, "needs the parts 'torch' and 'python'"),
])
def test_a_malformed_rng_state_is_refused_naming_the_part_and_sets_no_generator(part, bad, message):
    """Before, the parts were set one after the other: a malformed python or numpy part raised a raw
    ValueError/IndexError with torch's (and python's) generator already changed."""
    _reseed(3)
    state = rng_state()
    if bad is None:
        del state[part]
    else:
        state[part] = bad
    _reseed(4)
    expected = _draws()
    _reseed(4)
    with pytest.raises(bcp.BCPError, match=message):
        set_rng_state(state)
    assert _draws() == expected
