"""Megatron-LM's own training loop (`pretrain_gpt.py`) on CPU with gloo, for the tests that run it
(tests/jobs/megatron_lm_pretrain.py, tests/test_megatron_lm.py). On a GPU machine do not use it.

Megatron-LM assumes CUDA well beyond Megatron-core's DDP and DistributedOptimizer (whose stand-ins
are recipes/_megatron_cpu.py's `cuda_on_cpu()`, entered here for the whole run). Each stand-in
below names the place that needs it; all are test-environment stand-ins, none belongs in bcp.

`use_tree(tree)` comes first, before anything imports `megatron`: it puts a Megatron-LM source
tree (BCP_MEGATRON_LM/<release>) first on sys.path and makes its imports work on this Python;
`install()` then replaces the CUDA calls once `megatron.training` is importable.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import sys
import sysconfig
import typing

HERE = os.path.dirname(os.path.abspath(__file__))
RECIPES = os.path.join(HERE, "..", "recipes")

#: the environment variable naming the directory that holds core_v0.16.1/, core_v0.17.1/, ...
TREES_ENV = "BCP_MEGATRON_LM"
RELEASES = ("core_v0.16.1", "core_v0.17.1", "core_v0.19.0")


def trees_root() -> str | None:
    """The directory holding the Megatron-LM source trees, or None when this machine has none."""
    root = os.environ.get(TREES_ENV)
    return root if root and os.path.isdir(root) else None


def site_packages() -> str:
    return sysconfig.get_paths()["purelib"]


def _wheel_helpers_so() -> str:
    """The installed megatron-core wheel's compiled dataset helpers (helpers.cpp is the same source
    in 0.16.1, 0.17.1 and 0.19.0; the trees hold it uncompiled)."""
    found = sorted(glob.glob(os.path.join(site_packages(), "megatron", "core", "datasets", "helpers_cpp*.so")))
    if not found:
        raise RuntimeError("no megatron/core/datasets/helpers_cpp*.so in site-packages: install megatron-core")
    return found[0]


def use_tree(tree: str) -> None:
    """Import Megatron-LM from `tree` (before `megatron` is imported anywhere in this process)."""
    if "megatron" in sys.modules or "megatron.core" in sys.modules:
        raise RuntimeError("megatron was imported before use_tree(): the installed wheel would shadow the tree")
    sys.path.insert(0, os.path.abspath(tree))  # also pretrain_gpt.py's siblings (gpt_builders, model_provider)
    if RECIPES not in sys.path:
        sys.path.append(RECIPES)  # recipes/_megatron_cpu.py
    _importable_on_this_python()
    # Megatron compiles helpers.cpp with `make` into its own tree at start-up (read-only here): load
    # the installed wheel's build of the same source under the name the tree imports
    name = "megatron.core.datasets.helpers_cpp"
    spec = importlib.util.spec_from_file_location(name, _wheel_helpers_so())
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


def _importable_on_this_python() -> None:
    # megatron.training 0.18+ imports typing.override (new in Python 3.12)
    if not hasattr(typing, "override"):
        import typing_extensions
        typing.override = typing_extensions.override
    # Megatron's modules of triton kernels (triton is absent with CPU-only torch)
    from _triton_stub import install_triton_stub
    install_triton_stub()


def _patch(obj, name: str, new) -> None:
    if not hasattr(obj, name):
        raise AttributeError(f"{obj!r} has no {name}: this Megatron-LM release differs from what the stand-ins know")
    setattr(obj, name, new)


_installed = contextlib.ExitStack()  # held for the life of the process: a collected generator context would undo it


def install() -> None:
    """Replace the CUDA calls Megatron-LM's training loop makes by CPU ones, for the rest of the process."""
    import torch
    from megatron.training import arguments, initialize, training

    from _megatron_cpu import cuda_on_cpu  # recipes/_megatron_cpu.py: DDP, DistributedOptimizer, GPT forward

    _installed.enter_context(cuda_on_cpu())

    # initialize_megatron asserts CUDA unless told it may run without it
    original_initialize = training.initialize_megatron

    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original_initialize(*args, **kwargs)
    _patch(training, "initialize_megatron", initialize_megatron)

    _one_device()
    _patch(torch.cuda, "manual_seed", lambda *a, **k: None)
    # the RNG state saved with and restored from each checkpoint
    _patch(torch.cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state())
    _patch(torch.cuda, "set_rng_state", lambda *a, **k: None)
    # report_memory, after the first iterations
    for counter in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        _patch(torch.cuda, counter, lambda *a, **k: 0)
    # start-up: `make` of the dataset helpers (loaded by use_tree), fused CUDA kernels, and JIT
    # warm-up runs of the fused kernels (25 s of inductor compilation on CPU)
    from megatron.core.datasets import utils as dataset_utils
    _patch(dataset_utils, "compile_helpers", lambda: None)
    if hasattr(initialize, "fused_kernels"):  # 0.16 (0.17 stopped loading them)
        _patch(initialize.fused_kernels, "load", lambda *a, **k: None)
    _patch(training, "set_jit_fusion_options", lambda *a, **k: None)
    # validate_args asks the GPU's compute capability whenever TP > 1
    _patch(arguments, "get_device_arch_version", lambda: 9)
    _distributed_optimizer_with_torch_adam()


def _one_device() -> None:
    """One CUDA device to count and select: _initialize_distributed builds the model-parallel groups
    and seeds the model-parallel RNG tracker only when it sees a device; the persistent checkpoint
    worker selects `rank % device_count()` first thing."""
    import torch
    _patch(torch.cuda, "device_count", lambda: 1)
    _patch(torch.cuda, "set_device", lambda *a, **k: None)


def install_in_spawned_process() -> None:
    """What a process Megatron spawns needs of `use_tree()` and `install()`: it only writes
    checkpoints (the persistent async worker; the writers' result-queue manager), with the parent's
    sys.path. It imports megatron.core (0.18+: triton kernel modules), selects its device, then waits
    for the copies to the host it made (preload_tensors)."""
    import torch
    _importable_on_this_python()
    _one_device()
    _patch(torch.cuda, "synchronize", lambda *a, **k: None)


def _distributed_optimizer_with_torch_adam() -> None:
    """Megatron's DistributedOptimizer around torch's Adam (no Apex or Transformer Engine on CPU).

    Without Apex/TE it keeps Adam's step in each parameter's state (TE's FusedAdam keeps it in the
    param groups) and asserts that every state holds one; the paths of a checkpoint load break that:
    - `state_dict()` before any step (Megatron-LM builds the load's sharded state dict before the
      first step): no state holds a step yet; Adam's is 0 then.
    - `load_state_dict()` gives every parameter the same step tensor, which torch's Adam then
      increments once per parameter per step: each gets its own copy.
    - in fp32 the main parameters the load copies into are views of the model's parameters, leaves
      that require grad: the load runs under no_grad.
    - the dp_reshardable load copies each parameter's pre-load state back over the loaded one,
      the step included (a LocalNonpersistentObject: the value before the load, not the
      checkpoint's): the step `load_state_dict()` set from the checkpoint is kept.
    """
    import torch
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    original_state_dict = DistributedOptimizer.state_dict

    def state_dict(self):
        if self.optimizer.state:
            return original_state_dict(self)
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                self.optimizer.state[param] = {"step": torch.tensor(0.0)}
        try:
            return original_state_dict(self)
        finally:
            self.optimizer.state.clear()

    original_load_state_dict = DistributedOptimizer.load_state_dict

    def load_state_dict(self, state_dict):
        with torch.no_grad():
            original_load_state_dict(self, state_dict)
        for state in self.optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].clone()

    set_states = DistributedOptimizer._set_main_param_and_optimizer_states  # recipes/_megatron_cpu.py's

    def set_main_param_and_optimizer_states(self, model_param, tensors):
        return set_states(self, model_param, {k: v for k, v in tensors.items() if k != "step"})

    _patch(DistributedOptimizer, "state_dict", state_dict)
    _patch(DistributedOptimizer, "load_state_dict", load_state_dict)
    _patch(DistributedOptimizer, "_set_main_param_and_optimizer_states", set_main_param_and_optimizer_states)
