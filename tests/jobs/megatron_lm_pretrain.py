"""Megatron-LM's own `pretrain_gpt.py`, run as its users run it, on CPU with gloo (or on a GPU).

    BCP_MEGATRON_LM=../shared/megatron_lm torchrun --nproc_per_node 2 tests/jobs/megatron_lm_pretrain.py
        --release 0.19.0 --record DIR [--bcp] [--device cuda] [--pause-at ITERATION] -- <pretrain_gpt.py arguments>

--release: the Megatron-LM source tree $BCP_MEGATRON_LM/core_v<release> is imported instead of the
installed megatron-core; the CPU stand-ins of recipes/_megatron_lm_cpu.py are installed, then the
tree's pretrain_gpt.py runs as `__main__` with the given arguments (--device cuda: no stand-ins,
Megatron-LM as on GPUs, in the processes it spawns too). --record: each rank that logs
an iteration's loss (the last pipeline stage) appends it to DIR/losses_rank<r>.jsonl as
{"iteration": i, "lm loss": x}, x exactly as Megatron computed it (its own log prints 6 digits and,
on some iterations, an average over iterations). --pause-at: every rank waits in the log of that
iteration until the test releases it (tests/pause.py), printing "megatron_lm_pretrain: received
SIGTERM (rank <r>)" once Megatron's signal handler (`--exit-signal-handler`) has recorded one; the
iteration's own check of the handler then sees it. --bcp: calls
`bcp_integrations.megatron.enable_megatron_lm()` first, so that `--ckpt-format bcp` is understood.
BCP_TEST_NODE_LOCAL_DIRS=a,b,...: node k's `--non-persistent-local-ckpt-dir` is that directory's
subdirectory named by the k-th entry (simulated nodes, BCP_LOCAL_WORLD_SIZE ranks each).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/

import megatron_lm_cpu  # noqa: E402
from pause import release_file  # noqa: E402

# a process Megatron spawned, which imports this launcher as its main module (the launcher's --device
# reaches it through the environment)
if __name__ == "__mp_main__" and os.environ.get("BCP_TEST_MEGATRON_DEVICE", "cpu") == "cpu":
    megatron_lm_cpu.install_in_spawned_process()


def record_losses(directory: str, pause_at: int | None) -> None:
    """Wrap Megatron-LM's training_log (same leading arguments in 0.16 to 0.19) to record each
    logged iteration's losses, and to pause at `pause_at`."""
    import torch
    from megatron.training import training

    original = training.training_log

    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, *args, **kwargs):
        if loss_dict:
            entry = {"iteration": int(iteration), **{key: float(value) for key, value in loss_dict.items()}}
            with open(os.path.join(directory, f"losses_rank{torch.distributed.get_rank()}.jsonl"), "a") as f:
                f.write(json.dumps(entry) + "\n")
        if iteration == pause_at:
            _pause(directory, iteration)
        return original(loss_dict, total_loss_dict, learning_rate, iteration, *args, **kwargs)

    training.training_log = training_log


def _pause(directory: str, iteration: int) -> None:
    """Wait until the test releases `iteration`; say when Megatron's signal handler got a signal."""
    import torch
    from megatron.training.global_vars import get_signal_handler

    told = False
    deadline = time.monotonic() + 300
    while not os.path.exists(release_file(directory, iteration)) and time.monotonic() < deadline:
        handler = get_signal_handler()
        if not told and handler is not None and handler._signal_received:  # the flag signals_received() gathers
            print(f"megatron_lm_pretrain: received SIGTERM (rank {torch.distributed.get_rank()})", flush=True)
            told = True
        time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--release", required=True, help="Megatron-LM release: 0.16.1, 0.17.1, 0.19.0")
    parser.add_argument("--record", required=True, help="directory for losses_rank<r>.jsonl")
    parser.add_argument("--pause-at", type=int, default=None, help="iteration at which to wait for the test")
    parser.add_argument("--bcp", action="store_true", help="enable_megatron_lm() first (--ckpt-format bcp)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: as on GPUs, without the CPU stand-ins (the GPU check)")
    ours, megatron_argv = parser.parse_known_args()
    if megatron_argv[:1] == ["--"]:
        megatron_argv = megatron_argv[1:]

    # validate_args requires it for TP > 1 (it orders CUDA kernel launches; nothing on CPU)
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    os.environ["BCP_TEST_MEGATRON_DEVICE"] = ours.device
    tree = megatron_lm_cpu.use_release(ours.release)
    if ours.device == "cpu":
        megatron_lm_cpu.install()
    os.makedirs(ours.record, exist_ok=True)
    record_losses(ours.record, ours.pause_at)
    if ours.bcp:
        from bcp_integrations.megatron import enable_megatron_lm
        enable_megatron_lm()
    if os.environ.get("BCP_TEST_NODE_LOCAL_DIRS") and "--non-persistent-local-ckpt-dir" in megatron_argv:
        # simulated nodes on one host (BCP_LOCAL_WORLD_SIZE): each its own local checkpoint directory,
        # as each machine has its own RAM disk
        i = megatron_argv.index("--non-persistent-local-ckpt-dir") + 1
        node = int(os.environ["RANK"]) // int(os.environ["BCP_LOCAL_WORLD_SIZE"])
        megatron_argv[i] = os.path.join(megatron_argv[i], os.environ["BCP_TEST_NODE_LOCAL_DIRS"].split(",")[node])
    script = os.path.join(tree, "pretrain_gpt.py")
    sys.argv = [script, *megatron_argv]
    # pretrain_gpt.py runs as `__main__` in a namespace of its own while this launcher stays
    # sys.modules["__main__"]: the processes Megatron spawns (the result queue of its checkpoint
    # writers, the persistent async worker) re-import the main module, and only this one imports
    # cleanly (pretrain_gpt.py's imports need the stand-ins above). runpy.run_path would make
    # pretrain_gpt.py the main module for the duration.
    with open(script) as f:
        code = compile(f.read(), script, "exec")
    exec(code, {"__name__": "__main__", "__file__": script, "__builtins__": __builtins__})


if __name__ == "__main__":
    main()
