"""Megatron-LM's own pretrain_gpt.py (or any pretrain_*.py of a Megatron-LM checkout), unchanged,
saving and loading with bcp: `--ckpt-format bcp`.

    torchrun --nproc_per_node 8 recipes/megatron_lm_pretrain.py /path/to/Megatron-LM/pretrain_gpt.py \\
        --ckpt-format bcp --save ckpt --load ckpt --save-interval 1000 ...   # the script's own arguments

What it does is the one call a user would otherwise add to the script itself:
`bcp_integrations.megatron.enable_megatron_lm()` before Megatron-LM parses its arguments, then the
script runs as `__main__` with the arguments given after it. Every option of the script works as
documented (`--async-save`, `--use-distributed-optimizer`, `--dist-ckpt-optim-fully-reshardable`,
`--ckpt-fully-parallel-save/load`, `--exit-signal-handler`...); a checkpoint saved in another
layout (TP, PP, DP) resumes as Megatron's optimizer layout allows (docs/megatron.md).
Megatron-LM core_v0.16 to core_v0.19; 0.17 and later need Python 3.12.

Where torch sees no GPU, it runs on CPU with gloo: the CUDA calls Megatron-LM makes are replaced by
the stand-ins of recipes/_megatron_lm_cpu.py (pass `--distributed-backend gloo --transformer-impl
local --use-cpu-initialization` and the `--no-*-fusion` flags; recipes/megatron_lm_pretrain.sh runs a
tiny GPT so, resuming at another tensor-parallel size).
"""

from __future__ import annotations

import os
import sys

import torch

import _megatron_lm_cpu  # recipes/_megatron_lm_cpu.py: CPU stand-ins, used only without a GPU

if __name__ == "__mp_main__" and not torch.cuda.is_available():
    # a process Megatron started (its checkpoint writers' result queue, the persistent async worker)
    # re-imports this main module: it needs the stand-ins of a writer
    _megatron_lm_cpu.install_in_spawned_process()


def main() -> None:
    if len(sys.argv) < 2 or not sys.argv[1].endswith(".py"):
        sys.exit(f"usage: torchrun ... {sys.argv[0]} /path/to/Megatron-LM/pretrain_gpt.py [its arguments]")
    script = os.path.abspath(sys.argv[1])
    if not os.path.isfile(script):
        sys.exit(f"{script}: no such Megatron-LM script")
    # the checkout first on the path, for this process and the processes Megatron starts
    checkout = os.path.dirname(script)
    sys.path.insert(0, checkout)
    os.environ["PYTHONPATH"] = os.pathsep.join([checkout, *filter(None, [os.environ.get("PYTHONPATH")])])

    if not torch.cuda.is_available():
        _megatron_lm_cpu.use_wheel_helpers()  # else Megatron-LM compiles its dataset helpers at start-up
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # asked for at TP > 1; nothing on CPU
        _megatron_lm_cpu.install()

    from bcp_integrations.megatron import enable_megatron_lm
    enable_megatron_lm()

    sys.argv = [script, *sys.argv[2:]]
    # the script runs as `__main__` in a namespace of its own while this launcher stays the main
    # module, which the processes Megatron starts re-import (above)
    with open(script) as f:
        code = compile(f.read(), script, "exec")
    exec(code, {"__name__": "__main__", "__file__": script, "__builtins__": __builtins__})


if __name__ == "__main__":
    main()
