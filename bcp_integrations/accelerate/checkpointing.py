"""register(accelerator): Accelerate's save_state / load_state through bcp on every rank."""

from __future__ import annotations

import functools
import logging
import os
import threading
from typing import Any

import accelerate.accelerator as _acc_module
from accelerate import Accelerator
from torch.optim.optimizer import register_optimizer_step_post_hook

import bcp_core as bcp
from bcp_core import integration
from bcp_core.dataloader import checkpointable
from bcp_core.integration import run_state
from bcp_core.layout import StepNaming, resolve
from bcp_core.rng import rng_state, set_rng_state

log = logging.getLogger("bcp")

# Accelerate's automatic checkpoint naming: <project_dir>/checkpoints/checkpoint_<iteration>
ACCELERATE_STEPS = StepNaming("checkpoint_{}", r"^checkpoint_(\d+)$")

# What Accelerate itself would write or read in save_state/load_state. While a registered
# accelerator's save_state/load_state runs, these look empty to Accelerate's own code, so that it
# writes nothing (its FSDP branches, custom-object files and their count check included); the
# pre-hooks do the work on the real objects.
_HIDDEN = ("_models", "_optimizers", "_schedulers", "_dataloaders", "_custom_objects")
_active = threading.local()  # .checkpointer during a registered save_state/load_state call


class BCPAccelerateCheckpointer:
    """Created by `register`. `wait()` blocks until the last asynchronous save is committed.

    With automatic checkpoint naming, ``ProjectConfiguration(total_limit=N)`` is applied once a new
    checkpoint is committed (Accelerate itself deletes the old folders before saving, which would
    leave no checkpoint if the save then failed), and ``load_state()`` loads the newest committed
    checkpoint.

    With ``preemption=True``, ``preemption`` is bcp's `Preemption` (SIGTERM handler) and
    ``stop_requested()`` is the check the training loop makes once per step (Accelerate has no
    step hooks of its own).

    With ``async_save``, once every prepared optimizer has taken its first step (their state
    exists then) the checkpointer calls ``bcp.prepare_save`` with the state its saves will hold,
    from a step post-hook of those optimizers: the plan is made and the staging buffers are
    allocated in the background, so the first ``save_state`` stalls training no longer than later
    ones. A ``save_state`` before that first step makes its own.
    """

    def __init__(self, accelerator: Accelerator, async_save: bool = True, num_threads: int | None = None,
                 preemption: bool = False, tiers: bcp.Tiers | None = None):
        self.accelerator = accelerator
        self.async_save = async_save
        self.num_threads = num_threads
        self.tiers = tiers
        self.pending = integration.PendingSave()
        self.preemption: bcp.Preemption | None = bcp.handle_preemption() if preemption else None
        self._real: dict[str, Any] | None = None
        self._total_limit: int | None = None  # the project's, hidden from Accelerate during a call
        self._loaded_step: int | None = None
        self.loaded_path: str | None = None  # where the last load_state read from
        # The tiers' step of the last save_state() or load_state(): the save_state() calls, continued
        # from the step loaded. Not `accelerator.step`, which Accelerate sets back to 0 at the end of
        # each pass over a prepared dataloader: a step saved twice would clear the newer ones.
        self.step = 0
        self.handles = [accelerator.register_save_state_pre_hook(self._save_hook),
                        accelerator.register_load_state_pre_hook(self._load_hook)]
        self._stepped: set[int] = set()  # ids of the optimizers that have stepped, until prepared
        self._prepare_hook = register_optimizer_step_post_hook(self._after_step) if async_save else None
        accelerator.save_state = self._wrap(self._tiers_folder(accelerator.save_state))
        accelerator.load_state = self._wrap(self._newest_committed(accelerator.load_state), wait_first=True)
        accelerator.end_training = self._wrap_end(accelerator.end_training)

    def wait(self) -> None:
        """Block until the last save is committed (its failure re-raised; a failure of this process's
        rotation after the commit only logged: see `bcp_core.integration.PendingSave`)."""
        self.pending.wait()

    def stop_requested(self) -> bool:
        """Call once per step on every process: True on all of them at the same step once any
        received SIGTERM. Then ``accelerator.save_state(dir)`` and ``self.preemption.exit()``
        (commits the save, exits 143)."""
        if self.preemption is None:
            raise RuntimeError("stop_requested() needs register(accelerator, preemption=True)")
        return self.preemption.stop_requested()

    # -- wrapping ---------------------------------------------------------------------------

    def _wrap(self, method, wait_first: bool = False):
        @functools.wraps(method)
        def call(*args, **kwargs):
            if wait_first:
                self.wait()
            acc = self.accelerator
            config = acc.project_configuration
            self._real = {name: getattr(acc, name) for name in _HIDDEN}
            self._real["scaler"] = acc.scaler
            for name in _HIDDEN:
                setattr(acc, name, [])
            acc.scaler = None
            self._total_limit, config.total_limit = config.total_limit, None  # rotated after the commit
            _active.checkpointer = self
            try:
                return method(*args, **kwargs)
            finally:
                _active.checkpointer = None
                for name, value in self._real.items():
                    setattr(acc, name, value)
                self._real = None
                config.total_limit = self._total_limit
        return call

    def _tiers_folder(self, save_state):
        """``save_state()`` with tiers: Accelerate wants a folder (it creates it and writes nothing
        there once bcp's hook ran); the project's, or the working directory, serves."""
        @functools.wraps(save_state)
        def call(output_dir=None, **kwargs):
            acc = self.accelerator
            automatic = acc.project_configuration.automatic_checkpoint_naming
            if output_dir is None and self.tiers is not None and not automatic:
                output_dir = acc.project_dir or os.getcwd()
            return save_state(output_dir, **kwargs)
        return call

    def _newest_committed(self, load_state):
        """``load_state()`` with automatic checkpoint naming: the newest *committed* checkpoint, not
        the highest-numbered folder (Accelerate's pick), which may be a save that failed."""
        @functools.wraps(load_state)
        def call(input_dir=None, **kwargs):
            acc = self.accelerator
            if input_dir is None and self.tiers is not None:  # the hook loads the tiers; Accelerate wants a folder
                input_dir = acc.project_dir or os.getcwd()
            elif input_dir is None and acc.project_configuration.automatic_checkpoint_naming:
                input_dir = resolve(os.path.join(acc.project_dir, "checkpoints"), ACCELERATE_STEPS).root
            return load_state(input_dir, **kwargs)
        return call

    def _wrap_end(self, method):
        @functools.wraps(method)
        def call(*args, **kwargs):
            self.wait()  # before Accelerate tears the process group down
            return method(*args, **kwargs)
        return call

    # -- hooks ------------------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        real = self._real
        if real is None:
            raise RuntimeError("bcp hooks run only inside the save_state/load_state of the accelerator they "
                               "were registered on")
        return _objects_state(real)

    def _stateful_loaders(self, dataloaders: list | None = None) -> dict[str, Any]:
        """Prepared dataloaders with a state of their own (``use_stateful_dataloader=True``), through
        bcp's loader support: one part per process, restored with the same number of processes."""
        acc = self.accelerator
        loaders = self._real["_dataloaders"] if dataloaders is None else dataloaders
        return {("dataloader" if i == 0 else f"dataloader_{i}"): checkpointable(dl, acc.process_index,
                                                                                acc.num_processes)
                for i, dl in enumerate(loaders) if getattr(dl, "use_stateful_dataloader", False)}

    def _save_state(self, real: dict[str, Any]) -> dict[str, Any]:
        """What a save holds, from the accelerator's objects `real` (as `_HIDDEN` names them)."""
        state = _objects_state(real)
        state["extra_state"] = {"rng": rng_state(), "step": self.accelerator.step,
                                "data_position": [_loader_position(dl) for dl in real["_dataloaders"]]}
        state.update(self._stateful_loaders(real["_dataloaders"]))
        return state

    def _after_step(self, optimizer, args, kwargs) -> None:
        """Step post-hook: once every prepared optimizer has stepped, prepare the first save."""
        acc = self.accelerator
        if self._real is not None:  # inside a save_state/load_state call: nothing steps there
            return
        mine = [integration.unwrapped(o) for o in acc._optimizers]
        if not any(optimizer is o for o in mine):
            return
        self._stepped.add(id(optimizer))
        if not all(id(o) in self._stepped for o in mine):
            return
        self._stop_preparing()
        real = {name: getattr(acc, name) for name in _HIDDEN} | {"scaler": acc.scaler}
        bcp.prepare_save(self._save_state(real))

    def _stop_preparing(self) -> None:
        hook, self._prepare_hook = self._prepare_hook, None
        if hook is not None:
            hook.remove()
            self._stepped.clear()

    def _save_hook(self, models, weights, output_dir) -> None:
        self.wait()
        self._stop_preparing()  # this save allocates its buffers itself
        state = self._save_state(self._real)
        rotate = None
        acc = self.accelerator
        if self.tiers is not None:  # every node's memory, its replicas, durable every N-th step (docs/tiers.md)
            self.step += 1
            self.pending.start(bcp.save(self.tiers, state, step=self.step, async_save=self.async_save,
                                        num_threads=self.num_threads))
            weights.clear()
            return
        if acc.project_configuration.automatic_checkpoint_naming and self._total_limit is not None \
                and acc.is_main_process:
            root, limit = os.path.dirname(output_dir), self._total_limit

            def rotate(committed: str) -> None:  # the save's on_commit, once it is committed
                integration.rotate(root, limit, ACCELERATE_STEPS, why=f"total_limit={limit}: after {committed}")
        self.pending.start(bcp.save(output_dir, state, async_save=self.async_save, num_threads=self.num_threads,
                                    on_commit=rotate))
        weights.clear()  # Accelerate's own model files

    def _load_hook(self, models, input_dir) -> None:
        state = self._state()
        state["extra_state"] = {}
        state.update(self._stateful_loaders())
        result = bcp.load(self.tiers if self.tiers is not None else input_dir, state, num_threads=self.num_threads)
        self.loaded_path = result.path
        if self.tiers is not None:
            self.step = result.step
        extra = state["extra_state"]
        set_rng_state(extra["rng"])
        self._loaded_step = extra["step"]
        for dl, pos in zip(self._real["_dataloaders"], extra["data_position"]):
            _set_loader_position(dl, pos)
        models.clear()


def register(accelerator: Accelerator, async_save: bool = True, num_threads: int | None = None,
             preemption: bool = False, tiers: bcp.Tiers | None = None) -> BCPAccelerateCheckpointer:
    """Make ``accelerator.save_state(dir)`` / ``load_state(dir)`` go through bcp on every rank.

    Models (DDP or FSDP), optimizers, LR schedulers, the GradScaler, ``register_for_checkpointing``
    objects, each rank's RNG states, ``accelerator.step`` and each prepared dataloader's position
    (epoch; sampler seed and epoch; a stateful dataloader's state) are saved as one bcp checkpoint
    in ``dir``; Accelerate writes none of its own files. ``load_state`` works at any number of
    processes. Saves are asynchronous by default: the next save_state/load_state, ``end_training``
    and the returned object's ``wait()`` wait for them, and one still in flight when the script
    ends is committed before the process exits.

    ``preemption=True`` installs `bcp.handle_preemption()` (call ``register`` from the main thread
    of every process); the loop then asks ``ckpt.stop_requested()`` after each step and, when it
    is True, calls ``accelerator.save_state(dir)`` and ``ckpt.preemption.exit()``.

    ``tiers=bcp.Tiers(...)``: every ``save_state()`` goes to the tiers (each node's memory, its
    replicas on other nodes, durable storage every ``persist_every``-th step; the folder Accelerate
    names is left empty) as the next step: ``ckpt.step``, the save_state() calls so far, continued
    from the step ``load_state()`` loaded (the newest that survives anywhere, at any number of
    processes; docs/tiers.md).
    """
    if getattr(accelerator, "_bcp_checkpointer", None) is not None:
        ckpt = accelerator._bcp_checkpointer
        if preemption and ckpt.preemption is None:
            ckpt.preemption = bcp.handle_preemption()
        return ckpt
    _install_skips()
    ckpt = BCPAccelerateCheckpointer(accelerator, async_save, num_threads, preemption, tiers)
    accelerator._bcp_checkpointer = ckpt
    return ckpt


def _install_skips() -> None:
    """Accelerate's own state writer/reader (RNG files, sampler) does nothing inside a bcp call."""
    if getattr(_acc_module.save_accelerator_state, "_bcp_skip", False):
        return
    save_orig, load_orig = _acc_module.save_accelerator_state, _acc_module.load_accelerator_state

    @functools.wraps(save_orig)
    def save_accelerator_state(output_dir, *args, **kwargs):
        if getattr(_active, "checkpointer", None) is not None:
            return output_dir
        return save_orig(output_dir, *args, **kwargs)

    @functools.wraps(load_orig)
    def load_accelerator_state(input_dir, *args, **kwargs):
        ckpt = getattr(_active, "checkpointer", None)
        if ckpt is not None:
            return {"step": ckpt._loaded_step}
        return load_orig(input_dir, *args, **kwargs)

    save_accelerator_state._bcp_skip = True
    _acc_module.save_accelerator_state = save_accelerator_state
    _acc_module.load_accelerator_state = load_accelerator_state


# ----------------------------------------------------------------------------- helpers

def _objects_state(real: dict[str, Any]) -> dict[str, Any]:
    """Models as prepared (DDP, FSDP, a DeepSpeed engine with its counters), optimizers and
    schedulers unwrapped, custom objects and the scaler, as bcp state keys."""
    state = run_state(real["_models"], real["_optimizers"], real["_schedulers"], real["scaler"], rng=False)
    for i, obj in enumerate(real["_custom_objects"]):
        state["custom" if i == 0 else f"custom_{i}"] = obj
    return state


def _loader_position(dl) -> dict[str, Any]:
    # The values Accelerate tracks itself: the epoch counter and a seedable sampler's seed/epoch
    # (a stateful loader's own state goes through bcp's loader support: _stateful_loaders).
    pos: dict[str, Any] = {"iteration": int(getattr(dl, "iteration", 0))}
    sampler = _seedable_sampler(dl)
    if sampler is not None:
        pos["sampler"] = {"epoch": int(sampler.epoch), "initial_seed": int(sampler.initial_seed)}
    return pos


def _set_loader_position(dl, pos: dict[str, Any]) -> None:
    if hasattr(dl, "iteration"):
        dl.iteration = pos["iteration"]
    sampler = _seedable_sampler(dl)
    if sampler is not None and "sampler" in pos:
        sampler.epoch = pos["sampler"]["epoch"]
        sampler.initial_seed = pos["sampler"]["initial_seed"]


def _seedable_sampler(dl):
    from accelerate.data_loader import SeedableRandomSampler
    get = getattr(dl, "get_sampler", None)
    sampler = get() if callable(get) else None
    return sampler if isinstance(sampler, SeedableRandomSampler) else None





