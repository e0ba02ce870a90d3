"""Two jobs writing one checkpoint root (and one checkpoint directory) at the same time.

Neither corrupts the other: every save either commits a complete checkpoint of its own or
fails clearly, and whatever the directory holds afterwards loads to exactly one job's state.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import torch

import bcp_core as bcp


def _job(root, value, rounds, queue):
    state = {"w": torch.full((256, 256), float(value)), "tag": {"job": value}}
    outcomes = []
    for k in range(rounds):
        try:
            bcp.save(os.path.join(root, "same"), state).wait()        # the same directory
            bcp.save(root, state, step=value * 100 + k).wait()         # the same root, own steps
            outcomes.append("ok")
        except bcp.BCPError as e:
            outcomes.append(f"error: {e}")
    queue.put((value, outcomes))


def test_two_jobs_never_corrupt_each_other(tmp_path):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    jobs = [ctx.Process(target=_job, args=(str(tmp_path), v, 6, queue)) for v in (1, 2)]
    for j in jobs:
        j.start()
    results = dict(queue.get(timeout=180) for _ in jobs)
    for j in jobs:
        j.join(timeout=30)
    for outcomes in results.values():
        assert outcomes == ["ok"] * 6, outcomes  # each job's saves all committed
    out = {"w": torch.empty(256, 256), "tag": {}}
    bcp.load(str(tmp_path / "same"), out)  # one job's complete checkpoint, never a mix
    job = out["tag"]["job"]
    assert job in (1, 2) and torch.equal(out["w"], torch.full((256, 256), float(job)))
    for step_dir in sorted(os.listdir(tmp_path)):
        if step_dir.startswith("step_"):
            value = int(step_dir.removeprefix("step_")) // 100
            bcp.load(str(tmp_path / step_dir), out)
            assert torch.equal(out["w"], torch.full((256, 256), float(value))) and out["tag"]["job"] == value
    bcp.load(str(tmp_path), out)  # the tracker names a complete checkpoint of one of the jobs
    assert out["tag"]["job"] in (1, 2)
