"""recipes/tiers_node_loss.py as a user runs it: a node of 3 is killed after step 6, the job resumes on
the other 2 from their memory, every parameter and Adam moment as at step 6, and trains on."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dist import RECIPES


@pytest.mark.slow
def test_recipe_kills_a_node_and_resumes(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, os.path.join(RECIPES, "tiers_node_loss.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "resumed from step 6 (memory: memory://recipe/step_00000006) on 4 ranks; every parameter and moment " \
           "as at step 6: True" in proc.stdout, proc.stdout[-4000:]
    assert "step 8: loss" in proc.stdout
    assert proc.stdout.strip().endswith(str(tmp_path / "durable" / "step_00000008"))
