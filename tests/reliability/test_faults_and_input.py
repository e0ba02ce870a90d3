"""Storage faults and bad input: clear errors, nothing committed, the next save goes through."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch

import bcp_core as bcp
from bcp_core.storage import faults


def test_enospc_during_async_save_commits_nothing_and_training_goes_on(tmp_path):
    state = {"w": torch.ones(1000), "extra_state": {"step": 1}}
    bcp.save(str(tmp_path), state, step=1, role="faults").wait()
    state["w"].add_(1)
    with faults.inject(faults.Fault("write", error=OSError(errno.ENOSPC, "No space left on device"))):
        handle = bcp.save(str(tmp_path), state, step=2, async_save=True, role="faults")
        state["w"].add_(1)  # training continues meanwhile
        with pytest.raises(bcp.SaveError, match=r"No space left on device.*|.*No space left on device"):
            handle.wait()
    assert not os.path.exists(tmp_path / "step_00000002" / "bcp_metadata.json")
    assert (tmp_path / "latest").read_text() == "step_00000001"
    # the disk has room again
    bcp.save(str(tmp_path), state, step=3, role="faults").wait()
    out = {"w": torch.empty(1000), "extra_state": {}}
    assert bcp.load(str(tmp_path), out).path.endswith("step_00000003")
    assert torch.equal(out["w"], torch.full((1000,), 3.0))


def _one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg and len(msg) < 600, msg
    return msg


def test_bad_input_gets_one_line_errors(tmp_path):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(bcp.BCPError) as e:
        bcp.save(str(tmp_path / "a"), {"model": model}, framework="colossalai")
    assert "unknown framework 'colossalai'" in _one_line(e)
    with pytest.raises(bcp.BCPError) as e:  # a framework bcp knows, not the model's layout
        bcp.save(str(tmp_path / "a"), {"model": model}, framework="deepspeed")
    assert "framework='deepspeed' but the model's layout is 'plain'" in _one_line(e)
    with pytest.raises(bcp.BCPError) as e:
        bcp.save(str(tmp_path / "b"), {"extra_state": {"lock": __import__("threading").Lock()}})
    assert "extra_state.lock: cannot save a value of type _thread.lock" in _one_line(e)
    with pytest.raises(bcp.NotACheckpointError) as e:
        bcp.load(str(tmp_path), {"model": model})
    assert "is not a bcp checkpoint" in _one_line(e)
    bcp.save(str(tmp_path / "c"), {"model": model}).wait()
    meta = tmp_path / "c" / "bcp_metadata.json"
    raw = json.loads(meta.read_text())
    raw["version"] = 99
    meta.write_text(json.dumps(raw))
    with pytest.raises(bcp.FormatVersionError) as e:
        bcp.load(str(tmp_path / "c"), {"model": model})
    assert "format version 99, newer than" in _one_line(e)
    with pytest.raises(bcp.BCPError) as e:
        bcp.save(str(tmp_path / "d"), ["not", "a", "dict"])
    assert "state must be a dict" in _one_line(e)
