"""Megatron-LM's own training loop (`pretrain_gpt.py`) on CPU with gloo, for the tests that run it
(tests/jobs/megatron_lm_pretrain.py, tests/test_megatron_lm.py). On a GPU machine do not use it.

`use_release(release)` comes first, before anything imports `megatron`: Megatron-LM's source tree of
that release goes first on the path (tests/megatron_releases.py: $BCP_MEGATRON_LM/core_v<release>,
with tests/megatron_py311's import stand-ins, in this process and in every process it starts), with
its compiled dataset helpers. `install()` then replaces the CUDA calls Megatron-LM makes beyond
Megatron-core's DDP and DistributedOptimizer (whose stand-ins are recipes/_megatron_cpu.py's
`cuda_on_cpu()`, entered here for the whole run). Each stand-in names the place that needs it; all
are test-environment stand-ins, none belongs in bcp.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import sys
import sysconfig

import megatron_releases

HERE = os.path.dirname(os.path.abspath(__file__))
RECIPES = os.path.join(HERE, "..", "recipes")


def site_packages() -> str:
    return sysconfig.get_paths()["purelib"]


def _wheel_helpers_so() -> str:
    """The installed megatron-core wheel's compiled dataset helpers (helpers.cpp is the same source
    in 0.16.1, 0.17.1 and 0.19.0; the trees hold it uncompiled)."""
    found = sorted(glob.glob(os.path.join(site_packages(), "megatron", "core", "datasets", "helpers_cpp*.so")))
    if not found:
        raise RuntimeError("no megatron/core/datasets/helpers_cpp*.so in site-packages: install megatron-core")
    return found[0]


def use_release(release: str) -> str:
    """Import Megatron-LM `release` ("0.19.0") from its source tree in this process and in the
    processes it starts (before `megatron` is imported anywhere here); the tree's path."""
    tree = megatron_releases.tree(release)
    if tree is None:
        raise RuntimeError(megatron_releases.skip_reason(release, need_tree=True))
    # the processes Megatron spawns (its checkpoint writers' result queue, the persistent async
    # worker) start a new interpreter: PYTHONPATH gives them the tree and the import stand-ins
    os.environ.update(megatron_releases.env(release, need_tree=True))
    megatron_releases.activate(release, need_tree=True)  # also pretrain_gpt.py's siblings (gpt_builders...)
    if RECIPES not in sys.path:
        sys.path.append(RECIPES)  # recipes/_megatron_cpu.py
    # Megatron compiles helpers.cpp with `make` into its own tree at start-up (read-only here): load
    # the installed wheel's build of the same source under the name the tree imports
    name = "megatron.core.datasets.helpers_cpp"
    spec = importlib.util.spec_from_file_location(name, _wheel_helpers_so())
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return tree


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
    # start-up: `make` of the dataset helpers (loaded by use_release), fused CUDA kernels, and JIT
    # warm-up runs of the fused kernels (25 s of inductor compilation on CPU)
    from megatron.core.datasets import utils as dataset_utils
    _patch(dataset_utils, "compile_helpers", lambda: None)
    if hasattr(initialize, "fused_kernels"):  # 0.16 (0.17 stopped loading them)
        _patch(initialize.fused_kernels, "load", lambda *a, **k: None)
    _patch(training, "set_jit_fusion_options", lambda *a, **k: None)
    # validate_args asks the GPU's compute capability whenever TP > 1
    _patch(arguments, "get_device_arch_version", lambda: 9)
    _distributed_optimizer_with_torch_adam()
    # torch_dist's async save: the persistent worker's copy of what it writes
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    _preloads.append(FileSystemWriterAsync.preload_tensors)
    _patch(FileSystemWriterAsync, "preload_tensors", staticmethod(preload_tensors_copying))


_preloads = []  # Megatron's FileSystemWriterAsync.preload_tensors, where install() replaced it


def preload_tensors_copying(write_buckets, non_blocking=True):
    """Megatron's preload of what a torch_dist async save writes, with the copy it makes on a GPU.

    Before the trainer goes on, the writer copies the tensors it will write to the host
    (`tensor.to("cpu")`; the trainer waits for that). For a CPU tensor that returns the tensor
    itself: the persistent worker (another process, which got the trainer's tensors in shared
    memory) would then write them while training goes on changing them, and the checkpoint would
    hold parts of later iterations. Here each is copied. The worker finds this function by its name
    (it is pickled with the save request), so it runs Megatron's own preload, unreplaced there.
    """
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    preload = _preloads[0] if _preloads else FileSystemWriterAsync.preload_tensors
    return [(file_name, storage_key, (bytes_data, [(item, tensor.clone()) for item, tensor in tensor_data]))
            for file_name, storage_key, (bytes_data, tensor_data) in preload(write_buckets, non_blocking)]


def _one_device() -> None:
    """One CUDA device to count and select: _initialize_distributed builds the model-parallel groups
    and seeds the model-parallel RNG tracker only when it sees a device; the persistent checkpoint
    worker selects `rank % device_count()` first thing."""
    import torch
    _patch(torch.cuda, "device_count", lambda: 1)
    _patch(torch.cuda, "set_device", lambda *a, **k: None)


def install_in_spawned_process() -> None:
    """What a process Megatron spawns needs of `install()`: it only writes checkpoints (the
    persistent async worker; the writers' result-queue manager) and imports no megatron.training.
    The worker selects its device, then waits for the copies to the host it made (preload_tensors)."""
    import torch
    _one_device()
    _patch(torch.cuda, "synchronize", lambda *a, **k: None)


def _distributed_optimizer_with_torch_adam() -> None:
    """Megatron's DistributedOptimizer around torch's Adam (no Apex or Transformer Engine on CPU):
    without them it keeps Adam's step in each parameter's state (TE's FusedAdam keeps it in the
    param groups) and its `state_dict()` asserts that every state holds one. Megatron-LM builds a
    load's sharded state dict before the first step, when no state does: Adam's step is 0 then.
    (The load itself, its step and its fp32 copies into views of the parameters, is mended by
    recipes/_megatron_cpu.py.)"""
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

    _patch(DistributedOptimizer, "state_dict", state_dict)
