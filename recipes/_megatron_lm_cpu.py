"""Megatron-LM's training loop (`pretrain_gpt.py` and its siblings) on CPU with gloo: the stand-ins
for the CUDA calls it makes. recipes/megatron_lm_pretrain.py installs them when torch sees no GPU;
the tests that run Megatron-LM (tests/test_megatron_lm.py) do too. On a GPU machine none is used.

`install()` replaces the CUDA calls Megatron-LM makes beyond Megatron-core's DDP and
DistributedOptimizer (whose stand-ins, and the mends of the DistributedOptimizer around torch's Adam,
are recipes/_megatron_cpu.py's `cuda_on_cpu()`, entered here for the whole run);
`install_in_spawned_process()` is what the processes Megatron starts need. `use_wheel_helpers()`
loads the installed megatron-core wheel's compiled dataset helpers, for a Megatron-LM checkout that
is read-only or has no compiler. Each stand-in names the place that needs
it; none belongs in bcp.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import sys
import sysconfig

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.append(HERE)  # recipes/_megatron_cpu.py, also when imported from elsewhere


def site_packages() -> str:
    return sysconfig.get_paths()["purelib"]


def wheel_helpers_so() -> str | None:
    """The installed megatron-core wheel's compiled dataset helpers (helpers.cpp is the same source
    in 0.16.1, 0.17.1 and 0.19.0; the trees hold it uncompiled): in site-packages, or in a directory
    on the path that the wheel was installed into (`pip install --target`, as on the GPU machine)."""
    for where in [site_packages(), *sys.path]:
        if os.path.exists(os.path.join(where or ".", "pretrain_gpt.py")):
            # a Megatron-LM tree: on a GPU its first run `make`s its own build there, against whatever
            # pybind11 the machine has; loaded by the next run, that build crashed torch's import on an
            # H200 (2026-11-28)
            continue
        found = sorted(glob.glob(os.path.join(where or ".", "megatron", "core", "datasets", "helpers_cpp*.so")))
        if found:
            return found[0]
    return None


def use_wheel_helpers() -> bool:
    """Import the installed megatron-core wheel's build of the dataset helpers under the name
    Megatron-LM's checkout imports (it would otherwise `make` helpers.cpp into its own tree at
    start-up). False where no wheel build is installed (Megatron then compiles its own)."""
    so = wheel_helpers_so()
    if so is None:
        return False
    import torch  # noqa: F401 - torch's pybind11 extension first, as in a Megatron process that imports it
    name = "megatron.core.datasets.helpers_cpp"
    spec = importlib.util.spec_from_file_location(name, so)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return True


# Megatron modules that import triton at module level on the import paths of megatron.core and
# megatron.training (0.16-0.19: the batch-invariant kernels; 0.19: the MoE paged-stash kernels)
TRITON_KERNEL_MODULES = ("megatron.core.transformer.moe.ops.paged_stash",
                         "megatron.core.transformer.custom_layers.batch_invariant_kernels")


def without_triton() -> None:
    """Where triton is not installed (torch's CPU wheels lack it), stand in for the modules of
    TRITON_KERNEL_MODULES before megatron imports them: their functions raise if called, and a CPU
    run never calls them. triton itself is not faked: torch would then take it for installed."""
    if importlib.util.find_spec("triton") is not None:
        return
    for name in TRITON_KERNEL_MODULES:
        sys.modules.setdefault(name, _kernel_stand_in(name))


def _kernel_stand_in(name: str):
    import types
    module = types.ModuleType(name)

    def __getattr__(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)

        def unavailable(*args, **kwargs):
            raise RuntimeError(f"{name}.{attr} needs triton, which is not installed here")
        return unavailable
    module.__getattr__ = __getattr__
    return module


def _patch(obj, name: str, new) -> None:
    if not hasattr(obj, name):
        raise AttributeError(f"{obj!r} has no {name}: this Megatron-LM release differs from what the stand-ins know")
    setattr(obj, name, new)


_installed = contextlib.ExitStack()  # held for the life of the process: a collected generator context would undo it


def install() -> None:
    """Replace the CUDA calls Megatron-LM's training loop makes by CPU ones, for the rest of the process."""
    import torch
    without_triton()
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
    # start-up: `make` of the dataset helpers (use_wheel_helpers loads a build), fused CUDA kernels, and JIT
    # warm-up runs of the fused kernels (25 s of inductor compilation on CPU)
    from megatron.core.datasets import utils as dataset_utils
    _patch(dataset_utils, "compile_helpers", lambda: None)
    if hasattr(initialize, "fused_kernels"):  # 0.16 (0.17 stopped loading them)
        _patch(initialize.fused_kernels, "load", lambda *a, **k: None)
    _patch(training, "set_jit_fusion_options", lambda *a, **k: None)
    # validate_args asks the GPU's compute capability whenever TP > 1
    _patch(arguments, "get_device_arch_version", lambda: 9)
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
    worker selects `rank % device_count()` first thing. And none available, whichever torch build
    runs: torch pins memory where `is_available()` says so (the DataLoader Megatron-LM builds with
    pin_memory=True), which initialises CUDA; with a CUDA build on a machine without a GPU that fails
    ("Found no NVIDIA driver"), and with PYTORCH_NVML_BASED_CUDA_CHECK=1 torch's own is_available()
    would take the device count above for a device."""
    import torch
    _patch(torch.cuda, "device_count", lambda: 1)
    _patch(torch.cuda, "set_device", lambda *a, **k: None)
    _patch(torch.cuda, "is_available", lambda: False)


def install_in_spawned_process() -> None:
    """What a process Megatron spawns needs of `install()`: it only writes checkpoints (the
    persistent async worker; the writers' result-queue manager) and imports no megatron.training.
    The worker selects its device, then waits for the copies to the host it made (preload_tensors)."""
    import torch
    without_triton()
    _one_device()
    _patch(torch.cuda, "synchronize", lambda *a, **k: None)
