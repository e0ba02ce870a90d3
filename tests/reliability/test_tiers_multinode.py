"""Tiered checkpoints under torchrun: 3 simulated nodes x 2 ranks on this host, a node killed at each
moment issue 43 names, the job restarted on fewer (or replaced) nodes.

`BCP_LOCAL_WORLD_SIZE=2` splits the 6 ranks into 3 nodes, and each node keeps its memory tier in a
directory of its own (tests/jobs/tiered_train.py), as each machine has its own RAM. The job saves
every step to `Tiers(replicas=1, persist_every=4, keep_in_memory=2)`. A node dies with SIGKILL (both
of its processes, at the moment named) and its memory directory is removed, as a lost machine's
RAM is; torchrun then ends the job. The restart names the surviving memory directories (and an
empty one for a replaced node): it must resume from the newest step whose every piece survives,
resharded to its world size, bit for bit the state of an uninterrupted run at that step
(tests/tiered_state.py knows it exactly), and train on to the end.

One case runs in the default tier (a node lost during replication); the others are `slow`.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import bcp_core as bcp
from dist import Job, bcp_verify
from tiered_state import COLS, ROWS, expected

STEPS = 10


def _run(base, memory: str, nproc: int, out, *args: str, expect_ok: bool = True) -> Job:
    os.makedirs(out, exist_ok=True)
    job = Job("tiered_train.py", nproc, "--base", str(base), "--memory", memory, "--steps", str(STEPS),
              "--out", str(out), *args, env={"BCP_LOCAL_WORLD_SIZE": "2"})
    status = job.finish(timeout=240)
    if expect_ok:
        assert status == 0, job.output[-6000:]
    else:  # a node killed itself: torchrun ends the job, failed
        assert status != 0, job.output[-6000:]
    return job


def _killed(base, spec: str, lost: list[int]) -> None:
    """The first run, in which node `spec`'s last field dies at the moment named; then the lost
    nodes' memory directories are removed (their RAM is gone)."""
    _run(base, "0,1,2", 6, base / "out_killed", "--kill", spec, expect_ok=False)
    for node in lost:
        shutil.rmtree(base / f"mem{node}")


def _check_resumed(out, nproc: int, step: int, tier: str) -> None:
    """Every rank resumed from `step` of `tier`, each holding exactly that step's rows; and ended with
    the uninterrupted run's state at the last step."""
    want, last = expected(step), expected(STEPS)
    for r in range(nproc):
        with open(out / f"rank{r}.json") as f:
            report = json.load(f)
        assert (report["resumed"], report["tier"]) == (step, tier), report
        for got, ref in ((report["loaded"], want), (report["final"], last)):
            assert got["step"] == ref["step"]
            assert torch.equal(torch.tensor(got["bias"]), ref["bias"])
            for key in ("w", "exp_avg"):
                assert got[key], f"rank {r} holds no rows of {key}"
                for row, values in got[key].items():
                    assert torch.equal(torch.tensor(values), ref[key][int(row)]), (key, row, r)


def _check_durable(base, step: int) -> None:
    """The durable root's latest is an ordinary bcp checkpoint of `step`, loadable without tiers."""
    root = str(base / "durable")
    assert bcp.resolve(root).root.endswith(f"step_{step:08d}")
    bcp_verify(root)
    target = {"w": torch.zeros(ROWS, COLS), "exp_avg": torch.zeros(ROWS, COLS), "bias": torch.zeros(4), "step": 0}
    bcp.load(root, target)
    want = expected(step)
    for key in ("w", "exp_avg", "bias"):
        assert torch.equal(target[key], want[key]), key
    assert target["step"] == step


@pytest.mark.slow  # the default tier's lost node: tests/test_tiers.py
def test_node_lost_during_replication_resumes_on_two_nodes(tmp_path):
    """Node 1 dies while step 6's replicas travel: step 6 never committed, so the restart on 2 nodes
    (4 ranks) resumes step 5 from the survivors' memory (node 1's pieces from their replicas)."""
    _killed(tmp_path, "replicate:6:1", lost=[1])
    _run(tmp_path, "0,2", 4, tmp_path / "out", "--resume")
    _check_resumed(tmp_path / "out", 4, 5, "memory")
    _check_durable(tmp_path, 8)


@pytest.mark.slow
def test_node_lost_between_saves_two_nodes_lost_and_a_replaced_node(tmp_path):
    """Node 1 dies once step 6 is committed. One node lost: step 6 from memory, on 2 nodes. Two nodes
    lost: no step is whole in memory, so the newest durable step (4). A replaced, empty node beside
    the two survivors (3 nodes again): step 6, its pieces sent to it by the peers."""
    _killed(tmp_path, "between:6:1", lost=[1])
    for restart in ("two_lost", "replaced"):  # each restart from the same survivors
        for name in ("mem0", "mem2", "durable"):
            shutil.copytree(tmp_path / name, tmp_path / restart / name, symlinks=True)
    _run(tmp_path, "0,2", 4, tmp_path / "out", "--resume")
    _check_resumed(tmp_path / "out", 4, 6, "memory")

    two = tmp_path / "two_lost"
    shutil.rmtree(two / "mem2")
    _run(two, "0,new", 4, two / "out", "--resume")
    _check_resumed(two / "out", 4, 4, "durable")

    replaced = tmp_path / "replaced"  # node 1 comes back on a machine with empty memory
    _run(replaced, "0,new,2", 6, replaced / "out", "--resume")
    _check_resumed(replaced / "out", 6, 6, "memory")


@pytest.mark.slow
@pytest.mark.parametrize("spec, step", [("write:7:1", 6), ("drain:8:2", 8)])
def test_node_lost_during_the_memory_write_and_during_the_drain(tmp_path, spec, step):
    """During step 7's memory write: step 6. During step 8's drain (step 8 committed in memory, its
    drain not: the durable root's latest is still step 4): step 8, from memory."""
    victim = int(spec.rsplit(":", 1)[1])
    steps = ["--steps", "8"] if spec.startswith("drain") else []
    _run(tmp_path, "0,1,2", 6, tmp_path / "out_killed", "--kill", spec, *steps, expect_ok=False)
    shutil.rmtree(tmp_path / f"mem{victim}")
    if spec.startswith("drain"):
        assert bcp.resolve(str(tmp_path / "durable")).root.endswith("step_00000004")
    survivors = ",".join(str(n) for n in (0, 1, 2) if n != victim)
    _run(tmp_path, survivors, 4, tmp_path / "out", "--resume")
    _check_resumed(tmp_path / "out", 4, step, "memory")
