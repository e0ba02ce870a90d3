"""Shared by the recipes: run a recipe again under torchrun with another number of processes."""

from __future__ import annotations

import os
import subprocess
import sys

_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                  "MASTER_ADDR", "MASTER_PORT")


def relaunch(script: str, nproc: int, *extra: str) -> None:
    """`torchrun --standalone --nproc_per_node nproc script *extra`, outside the current job's rendezvous."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith("TORCHELASTIC")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           script, *extra]
    print("+", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, env=env, check=True, timeout=300)
