"""The fault matrix on the plain API, in one torchrun job: each kind of fault, in a synchronous and
an asynchronous save, on one rank or on all, while training goes on (issue 22's contract).

Every committed step must load and hold exactly the values of that step; every save hit by a
fault must be committed by no rank and fail on every rank naming the cause; the saves after it
must commit; the job ends with status 0. SIGKILL at every point of a save is held by
test_crash.py; the integrations' entry points by tests/test_durability_*.py.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

import bcp_core as bcp
from dist import Job, bcp_verify

# save number -> (fault spec, how the save must end). Odd saves are asynchronous.
MATRIX = {
    2: ("write:rank=1:save=2", "failed: .*rank 1: .*No space left on device"),           # one rank, sync
    3: ("write:rank=1:save=3", "failed: .*rank 1: .*No space left on device"),           # one rank, async
    5: ("write:save=5", "failed: .*rank 0: .*No space left on device.*rank 1: .*No space"),  # all, async
    6: ("write:save=6", "failed: .*rank 0: .*No space left on device.*rank 1: .*No space"),  # all, sync
    8: ("commit:rank=1:save=8", None),                                                 # on_commit, sync
    9: ("commit:rank=1:save=9", None),                                                 # on_commit, async
    # rank 1 stops answering until rank 0 gives the save up after its 3 s timeout (the job gives the
    # other saves a long one: only these test it)
    11: ("stall:rank=1:save=11", "failed: .*waited 0:00:03 for rank\\(s\\) \\[1\\]"),  # async
    12: ("stall:rank=1:save=12", "failed: .*waited 0:00:03 for rank\\(s\\) \\[1\\]"),  # sync
}
STEPS = 13


def test_fault_matrix_plain_api(tmp_path):
    import re
    root = str(tmp_path)
    spec = ",".join(f for f, _ in MATRIX.values())
    job = Job("fault_matrix.py", 2, "--root", root, "--steps", str(STEPS), env={"BCP_TEST_FAULT": spec})
    assert job.finish(timeout=240) == 0, job.output[-6000:]
    outcomes = [json.load(open(os.path.join(root, f"outcomes_rank{r}.json"))) for r in (0, 1)]
    failed = {k for k, (_, expect) in MATRIX.items() if expect is not None}
    for rank, out in enumerate(outcomes):
        assert sorted(map(int, out)) == list(range(1, STEPS + 1)), out
        for step in range(1, STEPS + 1):
            text = out[str(step)]
            if step in failed:
                assert re.match(MATRIX[step][1], text, re.S), (rank, step, text)
            elif step in MATRIX and rank == 1:
                assert text.startswith("committed, on_commit failed:"), (rank, step, text)
            else:
                assert text == "committed", (rank, step, text)
    committed = sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step_")
                       and os.path.exists(os.path.join(root, n, "bcp_metadata.json")))
    assert committed == sorted(set(range(1, STEPS + 1)) - failed)
    assert open(os.path.join(root, "latest")).read() == f"step_{STEPS:08d}"
    for step in committed:  # each committed step holds that step's values, bit for bit
        path = os.path.join(root, f"step_{step:08d}")
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        state = {"model": model, "optimizer": optim, "extra_state": {"step": -1}}
        bcp.load(path, state)
        ref = torch.load(os.path.join(root, f"reference_{step}.pt"))
        for k, v in ref["model"].items():
            assert torch.equal(model.state_dict()[k], v), (step, k)
        got = optim.state_dict()["state"]
        for i, s in ref["optimizer"]["state"].items():
            assert all(torch.equal(got[i][n], s[n]) for n in ("exp_avg", "exp_avg_sq", "step")), (step, i)
        assert state["extra_state"]["step"] == step
    bcp_verify(os.path.join(root, f"step_{STEPS:08d}"))
