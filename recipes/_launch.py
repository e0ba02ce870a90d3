"""Shared by the recipes: run a recipe again under torchrun with another number of processes, and
end a recipe process."""

from __future__ import annotations

import atexit
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


def exit_without_teardown() -> None:
    """End a recipe process that trained with gloo: exit handlers run, interpreter teardown does not.

    With torch 2.13 on gloo, a process can abort at interpreter exit ("terminate called without an
    active exception"): a collective launched during backward keeps a Python object in its thread-
    local state, and when gloo's worker thread releases it while Python is finalizing, that thread
    is killed inside a destructor. It happened in about 1 of 20 CPU runs of these recipes, with bcp
    and with the frameworks' own checkpoints alike. Every save has been waited for when this runs;
    the atexit handlers (bcp's included) still run.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    os._exit(0)
