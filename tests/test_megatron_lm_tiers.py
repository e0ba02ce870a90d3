"""Megatron-LM's local checkpoints served by bcp's tiers (`--ckpt-format bcp --non-persistent-ckpt-type
local`, bcp_integrations/megatron/local_checkpoints.py), through its own pretrain_gpt.py on CPU.

Two ranks, each a simulated node (`BCP_LOCAL_WORLD_SIZE=1`) with a local checkpoint directory of
its own. The run saves a local checkpoint every 2 iterations, replicated to the other node
(`--replication --replication-factor 2`), and exits at iteration 4 (`--exit-interval 4`). Then
node 1's local directory and the persistent checkpoints are removed (a node lost; only the local
tier is left): the restart loads iteration 4 from node 0's memory and replica, node 1's pieces
sent to it over the network, and logs iterations 5 and 6 with the losses of the uninterrupted run,
bit for bit. Megatron-LM does all of this through its own local-checkpoint code; no nvidia
resiliency extension is installed.
"""

from __future__ import annotations

import os
import shutil

import pytest

import megatron_releases
from test_megatron_lm import ITERATIONS, pretrain, resumed_at, uninterrupted  # noqa: F401 (a fixture)

megatron_releases.skip_without_megatron_core()

RELEASE = megatron_releases.RELEASES[-1]
LOCAL = ["--non-persistent-ckpt-type", "local", "--non-persistent-save-interval", "2",
         "--replication", "--replication-factor", "2", "--replication-jump", "1"]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_local_checkpoints_resume_after_a_lost_node(uninterrupted, tmp_path, monkeypatch):  # noqa: F811
    reason = megatron_releases.skip_reason(RELEASE, need_tree=True)
    if reason:
        pytest.skip(reason)
    reference, _ = uninterrupted(RELEASE, "bcp")
    local = str(tmp_path / "local")
    monkeypatch.setenv("BCP_LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("BCP_TEST_NODE_LOCAL_DIRS", "node0,node1")
    first = pretrain(RELEASE, str(tmp_path), *LOCAL, "--non-persistent-local-ckpt-dir", local, "--exit-interval", "4",
                     fmt="bcp")
    assert sorted(first.losses) == [1, 2, 3, 4], first.output[-3000:]
    steps = sorted(os.listdir(os.path.join(local, "node0")))
    assert "step_00000004" in steps, steps
    shutil.rmtree(os.path.join(local, "node1"))
    shutil.rmtree(tmp_path / "ckpt")  # no persistent checkpoint: only the tiers can resume the run
    monkeypatch.setenv("BCP_TEST_NODE_LOCAL_DIRS", "node0,replaced")
    resumed = pretrain(RELEASE, str(tmp_path), *LOCAL, "--non-persistent-local-ckpt-dir", local, fmt="bcp")
    resumed_at(resumed, 4)
    assert resumed.losses == {i: reference.losses[i] for i in range(5, ITERATIONS + 1)}
