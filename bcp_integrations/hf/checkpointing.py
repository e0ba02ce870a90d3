"""BCPCallback, BCPTrainerMixin and export_pretrained for HF Transformers' Trainer.

Importing this module also guards ``Trainer._load_from_checkpoint`` (see
``_guard_plain_trainer_resume``): a Trainer without the mixin, asked to resume a bcp checkpoint,
fails at once with one line naming BCPTrainer instead of HF's "Can't find a valid checkpoint" (and
DeepSpeed's resume the same way, `_guard_deepspeed_resume`), and lets a BCPCallback know the
Trainer's CallbackHandler that holds it (`_track_callback_handler`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shutil
import tempfile
import threading
from typing import Any

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import SaveStrategy
from transformers.utils import (ADAPTER_SAFE_WEIGHTS_NAME, ADAPTER_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME,
                                SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME)

import bcp_core as bcp
from bcp_core import codec, metrics
from bcp_core.dataloader import checkpointable
from bcp_core.integration import restore_rng, run_state
from bcp_core.foreign import foreign_format
from bcp_core.layout import HF_STEPS, latest_complete, list_checkpoints, resolve
from bcp_core.rng import set_rng_state
from bcp_core.tiers import locate
from bcp_core.tiers.recovery import SET_ASIDE_ROUNDS
from bcp_core.utils import this_rank

log = logging.getLogger("bcp")

TRAINER_STATE_NAME = "trainer_state.json"  # HF reads this file itself in train() before any hook


class BCPCallback(TrainerCallback):
    """Checkpoints of the Trainer written by bcp on every rank, asynchronously.

    Alone, the callback takes over the saves that ``save_strategy="steps"`` and ``"epoch"`` trigger:
    when the Trainer is about to save, it writes ``checkpoint-<step>/`` with bcp (model, optimizer,
    LR scheduler, each rank's RNG states, the trainer state) and clears ``control.should_save`` so
    the Trainer writes nothing itself. The trainer state saved holds the stateful callbacks' state
    (EarlyStoppingCallback's counter, ...) as of the save, as the Trainer's own checkpoints do; the
    save comes at the end of the step, before that step's evaluation. ``save_total_limit`` is
    applied once the new checkpoint is committed. With ``BCPTrainerMixin`` (or ``BCPTrainer``) the
    Trainer also resumes from these checkpoints and ``save_strategy="best"`` /
    ``load_best_model_at_end`` work (alone, the callback raises for either): the Trainer has no
    public hook for them, so the mixin overrides its checkpoint methods (see docs/integrations.md).
    A plain Trainer asked to resume a bcp checkpoint raises a one-line ValueError naming them.

    Args:
        async_save: return once the state is staged; the write finishes in the background. The
            next save, a load and the end of training wait for it. After the first optimizer
            step (the optimizer's state exists then) the callback calls ``bcp.prepare_save``, so
            the first checkpoint stalls training no longer than later ones.
        num_threads: I/O threads per rank.
        preemption: on SIGTERM, take a last ``checkpoint-<step>`` at the end of a step every rank
            agrees on, commit it and every save in flight, and exit with status 143 (see
            `bcp.handle_preemption`); ``BCPTrainer.train(resume_from_checkpoint=True)`` resumes
            from it. Installs the handler now, so construct the callback on every rank from the
            main thread, before ``train``.
        tiers: a ``bcp.Tiers``: every save goes to the tiers as its global step instead of
            ``checkpoint-<step>/`` (each node's memory, replicas on other nodes, durable storage
            every ``persist_every``-th step), and ``BCPTrainer.train(resume_from_checkpoint=tiers)``
            resumes from the newest step that survives anywhere, at any world size (docs/tiers.md).

    A save still in flight when the script ends (``sys.exit``, an exception) is committed before the
    process exits, or the process exits 1 naming it; ``train()`` itself returns once the last one
    is committed.
    """

    def __init__(self, async_save: bool = True, num_threads: int | None = None, preemption: bool = False,
                 tiers: bcp.Tiers | None = None):
        self.tiers = tiers
        self.async_save = async_save
        self.num_threads = num_threads
        self.preemption: bcp.Preemption | None = bcp.handle_preemption() if preemption else None
        self.trainer: Trainer | None = None  # set by BCPTrainerMixin
        self._handler = None  # the Trainer's CallbackHandler holding this callback (_track_callback_handler)
        self._pending: bcp.SaveHandle | None = None
        self._pending_rotation: tuple[str, int | None, str | None] | None = None
        self._prepared = False
        self._metrics = metrics.LatestScalars()  # timings of this rank's saves and loads, for on_log

    # -- callback events ------------------------------------------------------------------------

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Add the phase timings of the last committed save or load (`bcp/save/write_s`, ...) to the
        logs: reporting callbacks placed after this one (BCPTrainer puts it first) see them, and
        they are kept in `state.log_history`.

        The final metrics of ``train()`` (logged once, after the last step) first wait for the save
        in flight: right after them the Trainer touches the checkpoints (``load_best_model_at_end``
        loads the best; ``save_total_limit=1`` with a best checkpoint removes every other
        ``checkpoint-*``, the last one included), and ``on_train_end`` comes only after that. This
        log is the last callback event before, and a public one: no override of the Trainer's
        private end-of-training code, which moves between versions, is needed."""
        if logs is not None and _FINAL_TRAIN_METRICS <= logs.keys():
            self.wait()
        values = self._metrics.pop()
        if values and logs is not None:
            logs.update(values)
            if state.log_history:
                state.log_history[-1].update(values)

    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer is None and args.save_strategy == SaveStrategy.BEST:
            raise ValueError("BCPCallback: save_strategy='best' is decided inside the Trainer, after the "
                             "callbacks run; use BCPTrainer (or BCPTrainerMixin) for it")
        if self.trainer is None and args.load_best_model_at_end:
            raise ValueError("BCPCallback: load_best_model_at_end needs the Trainer to track and load bcp's "
                             "best checkpoint, which a callback cannot do; use BCPTrainer (or BCPTrainerMixin) "
                             "for it")

    def on_step_end(self, args, state, control, **kwargs):
        if self.async_save and not self._prepared:
            self._prepared = True
            bcp.prepare_save(self._state_to_save(state, *self._objects(kwargs)))
        if self.preemption is not None and self.preemption.stop_requested():
            self._save_and_exit(args, state, control, kwargs)
        self._take_over_save(args, state, control, kwargs)

    def _save_and_exit(self, args, state, control, kwargs) -> None:
        """The final checkpoint of a preempted run, saved here rather than by the Trainer after the
        callbacks: its evaluation and "best" decision there could skip the save."""
        log.warning("bcp: rank %d: preempted at step %d: final checkpoint %s", args.process_index, state.global_step,
                    os.path.join(args.output_dir, HF_STEPS.name(state.global_step)))
        if self.trainer is not None:
            self.trainer._save_checkpoint(self.trainer.model_wrapped, None)  # the mixin's, as the Trainer's saves
        else:
            control.should_save = True
            self._take_over_save(args, state, control, kwargs)
        # save_total_limit is applied once the resumed run's next checkpoint has committed
        self.preemption.exit()

    def on_epoch_end(self, args, state, control, **kwargs):
        self._take_over_save(args, state, control, kwargs)

    def on_train_end(self, args, state, control, **kwargs):
        self.wait()

    def _take_over_save(self, args, state, control, kwargs) -> None:
        # With the mixin, the Trainer's own _save_checkpoint routes here, for every save strategy.
        if self.trainer is not None or not control.should_save:
            return
        output_dir = os.path.join(args.output_dir, HF_STEPS.name(state.global_step))
        if self._handler is not None:  # as the Trainer's own save does (the mixin's: _save_checkpoint)
            _refresh_stateful_callbacks(state, self._handler.callbacks, control)
        self.save(output_dir, args, state, *self._objects(kwargs))
        control.should_save = False

    def _objects(self, kwargs) -> tuple:
        """What a save of this run holds: model, optimizer, scheduler, scaler, dataloader (from the
        Trainer with BCPTrainerMixin, else from the callback event's kwargs)."""
        t = self.trainer
        if t is None:
            return kwargs["model"], kwargs["optimizer"], kwargs["lr_scheduler"], None, None
        return t.model_wrapped, t.optimizer, t.lr_scheduler, getattr(t.accelerator, "scaler", None), \
            t.bcp_train_dataloader

    # -- save -----------------------------------------------------------------------------------

    def save(self, output_dir: str, args, state, model, optimizer, lr_scheduler, scaler=None,
             dataloader=None) -> bcp.SaveHandle:
        """Write checkpoint `output_dir` from every rank (collective). `dataloader`: a train loader
        in bcp's loader protocol (see bcp_core.dataloader.checkpointable), saved per DP rank."""
        self.wait()  # one save in flight; applies the previous save's rotation once it is committed
        bstate = self._state_to_save(state, model, optimizer, lr_scheduler, scaler, dataloader)
        if self.tiers is not None:  # HF's files are in the state: nothing is written beside it
            self._pending = bcp.save(self.tiers, bstate, step=state.global_step, async_save=self.async_save,
                                     num_threads=self.num_threads)
            if not self.async_save:
                self.wait()
            return self._pending
        handle = bcp.save(output_dir, bstate, async_save=self.async_save, num_threads=self.num_threads)
        if args.should_save:
            # Small files HF needs to see: trainer_state.json (read by train() to find the step and
            # data position) and config.json (for export_pretrained). An async save may not have
            # created the directory yet.
            os.makedirs(output_dir, exist_ok=True)
            state.save_to_json(os.path.join(output_dir, TRAINER_STATE_NAME))
            config = getattr(_unwrap_model(model), "config", None)
            if config is not None:
                config.save_pretrained(output_dir)
        self._pending = handle
        self._pending_rotation = (os.path.dirname(output_dir), args.save_total_limit, state.best_model_checkpoint)
        if not self.async_save:
            self.wait()
        return handle

    @staticmethod
    def _state_to_save(state, model, optimizer, lr_scheduler, scaler, dataloader) -> dict[str, Any]:
        bstate = run_state([model], [optimizer], [lr_scheduler], scaler)
        if dataloader is not None:
            bstate["dataloader"] = dataloader
        # the same on every rank: the timings `on_log` adds to the history are each rank's own
        fields = dataclasses.asdict(state)
        fields["log_history"] = [{k: v for k, v in entry.items() if not k.startswith(metrics.SCALAR_PREFIX)}
                                 for entry in fields["log_history"]]
        bstate["trainer_state"] = json.dumps(fields, sort_keys=True)
        return bstate

    def wait(self) -> None:
        """Block until the save in flight is committed (re-raising its error), then rotate."""
        handle, self._pending = self._pending, None
        rotation, self._pending_rotation = self._pending_rotation, None
        if handle is None:
            return
        handle.wait()
        if rotation is None:  # a tiered save: the tiers keep what they keep
            return
        run_dir, limit, best = rotation
        if limit is not None and _is_main_process():
            # only after the commit: a failed save must never cost the older checkpoints
            _rotate(run_dir, limit, best)


# The keys of the metrics train() logs once, after its last step (speed_metrics("train"), the loss of
# the whole run, the FLOPs); a periodic log holds "loss", and at most "train_runtime" among them.
_FINAL_TRAIN_METRICS = frozenset({"train_runtime", "train_loss", "total_flos"})


def _refresh_stateful_callbacks(state, callbacks, control) -> None:
    """Put the current state of each `ExportableState` callback (EarlyStoppingCallback's patience
    counter, ...) and of `control` into ``state.stateful_callbacks``, as the Trainer's own
    ``_save_checkpoint`` does before it writes the trainer state (and, as it does, appending to the
    list kept for several callbacks of one class)."""
    from transformers.trainer_callback import ExportableState
    for cb in [c for c in list(callbacks) + [control] if isinstance(c, ExportableState)]:
        name = cb.__class__.__name__
        if isinstance(state.stateful_callbacks.get(name), list):
            state.stateful_callbacks[name].append(cb.state())
        else:
            state.stateful_callbacks[name] = cb.state()


def _track_callback_handler() -> None:
    """Let a ``BCPCallback`` used without the mixin know the Trainer's ``CallbackHandler`` that holds
    it: no callback event passes the other callbacks, whose state the callback's saves write into
    the trainer state as the Trainer's own saves do. ``CallbackHandler.add_callback`` (through which
    the Trainer adds every callback, from its constructor or ``Trainer.add_callback``) is wrapped
    once, in the class; it does what it did, and records the handler on a BCPCallback."""
    from transformers.trainer_callback import CallbackHandler
    original = getattr(CallbackHandler, "add_callback", None)
    if original is None or getattr(original, "_bcp_guard", False):
        return

    @functools.wraps(original)
    def add_callback(self, callback, *args, **kwargs):
        result = original(self, callback, *args, **kwargs)
        for cb in self.callbacks:
            if isinstance(cb, BCPCallback):
                cb._handler = self
        return result

    add_callback._bcp_guard = True
    CallbackHandler.add_callback = add_callback


_track_callback_handler()


class BCPTrainerMixin:
    """Mix in front of ``transformers.Trainer`` (or a subclass) to save and resume through bcp.

    Overrides the Trainer's private checkpoint methods, because it calls them directly:
    ``_save_checkpoint`` (every save strategy, including ``"best"``), ``_load_from_checkpoint``,
    ``_load_optimizer_and_scheduler``, ``_load_scaler``, ``_load_rng_state`` and
    ``_load_best_model``; and ``train(resume_from_checkpoint=True)`` picks the newest *committed*
    checkpoint. A ``BCPCallback`` is added if the callbacks have none.

    ``train_dataloader``: a loader that keeps its own position, used instead of the one the Trainer
    builds from ``train_dataset``. Its state is saved with every checkpoint through bcp's loader
    support (a ``bcp_core.dataloader.ReshardableLoader`` such as ``PackedTokenLoader``, wrapped in
    a ``MappedLoader`` to yield the model's inputs, is split and merged when the world size changes;
    another stateful loader is restored at the same world size only), and on resume it continues
    from there: the Trainer's skipping of the epoch's first batches is turned off
    (``args.ignore_data_skip = True``).
    """

    def __init__(self, *args, train_dataloader=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.bcp_train_dataloader = None
        if train_dataloader is not None:
            self.bcp_train_dataloader = checkpointable(train_dataloader, self.args.process_index,
                                                       self.args.world_size)
            self.args.ignore_data_skip = True  # the loader restores its position itself
        cbs = [c for c in self.callback_handler.callbacks if isinstance(c, BCPCallback)]
        if not cbs:
            self.add_callback(BCPCallback())
            cbs = [c for c in self.callback_handler.callbacks if isinstance(c, BCPCallback)]
        self.bcp = cbs[0]
        self.bcp.trainer = self
        # right after DefaultFlowCallback, before the reporting callbacks, so that they log the
        # timings on_log adds
        self.callback_handler.callbacks.remove(self.bcp)
        self.callback_handler.callbacks.insert(1, self.bcp)

    def get_train_dataloader(self):
        if self.bcp_train_dataloader is not None:
            return self.bcp_train_dataloader
        return super().get_train_dataloader()

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if isinstance(resume_from_checkpoint, bcp.Tiers):
            return self._train_from_tiers(resume_from_checkpoint, *args, **kwargs)
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"no committed bcp checkpoint in {self.args.output_dir}")
        _resuming.trainer = self
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            _resuming.trainer = None

    def _train_from_tiers(self, tiers: bcp.Tiers, *args, **kwargs):
        """Resume from the newest step of `tiers` that survives (collective). The Trainer reads the
        trainer state from a folder before any hook runs: each process gets one of its own, holding
        the step's trainer_state.json (from the step's metadata: no data file is read); the state
        itself is loaded from the tiers by the overridden loads below.

        Where that load sets damaged copies aside and leaves the step incomplete in memory
        (`DamagedStepError`: nothing was loaded, no step trained), the Trainer already read that
        step's trainer state: training starts again from the step a new `locate` finds, with that
        step's trainer state, at most `SET_ASIDE_ROUNDS` more times (under DeepSpeed, whose engine
        is not built twice, the error is raised and the job's restart resumes from that step)."""
        self.bcp.wait()
        for round_ in range(SET_ASIDE_ROUNDS + 1):
            self._bcp_located = locate(tiers)
            md = self._bcp_located.metadata
            if "trainer_state" not in md.objects:
                raise bcp.KeyMismatchError(f"step {self._bcp_located.step} of {tiers.memory} holds no trainer state: "
                                           "it was not saved by BCPTrainer")
            folder = tempfile.mkdtemp(prefix=f"bcp-resume-{self._bcp_located.step}-")
            with open(os.path.join(folder, TRAINER_STATE_NAME), "w") as f:
                f.write(codec.decode(md.objects["trainer_state"].encoded, "trainer_state", False))
            self._bcp_resume_folder, self._bcp_damaged = folder, None
            _resuming.trainer = self  # under DeepSpeed the Trainer hands `folder` to deepspeed_load_checkpoint
            try:
                return super().train(folder, *args, **kwargs)
            except bcp.DamagedStepError as e:
                # a DeepSpeed engine is built once per process: there the restart resumes
                if e is not self._bcp_damaged or round_ == SET_ASIDE_ROUNDS or self.is_deepspeed_enabled:
                    raise
                log.warning("%s; training starts again from that step", e)
            finally:
                _resuming.trainer = None
                self._bcp_located = self._bcp_resume_folder = None
                shutil.rmtree(folder, ignore_errors=True)
        raise AssertionError("unreachable")

    def _resuming_tiers(self, checkpoint) -> bool:
        return checkpoint is not None and checkpoint == getattr(self, "_bcp_resume_folder", None)

    def _save_checkpoint(self, model, trial) -> None:
        run_dir = self._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, HF_STEPS.name(self.state.global_step))
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        if self.state.best_global_step:
            # the best checkpoint is the step directory of the best metric, once it exists
            best = os.path.join(run_dir, HF_STEPS.name(self.state.best_global_step))
            if self.state.best_global_step == self.state.global_step or os.path.isdir(best):
                self.state.best_model_checkpoint = best
        self._update_exportable_callbacks()
        self.bcp.save(output_dir, self.args, self.state, *self.bcp._objects({}))

    def _update_exportable_callbacks(self) -> None:
        _refresh_stateful_callbacks(self.state, self.callback_handler.callbacks, self.control)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        # Weights are loaded together with the optimizer in _load_optimizer_and_scheduler, after
        # prepare(), which runs for every strategy; here only check that the checkpoint is usable.
        self.bcp.wait()
        if not self._resuming_tiers(resume_from_checkpoint):
            bcp.inspect(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        if checkpoint is None:
            return
        self.bcp.wait()
        located = self._bcp_located if self._resuming_tiers(checkpoint) else None
        keys = located.metadata.keys() if located is not None else bcp.inspect(checkpoint).keys()
        full = run_state([self.model_wrapped], [self.optimizer], [self.lr_scheduler],
                         getattr(self.accelerator, "scaler", None), rng=False)
        # what the checkpoint holds (a checkpoint saved without optimizer leaves it as it is)
        state = {name: obj for name, obj in full.items()
                 if name == "model" or any(k.startswith(name + ".") for k in keys)}
        if self.bcp_train_dataloader is not None:
            if "dataloader.format" not in keys:
                raise bcp.KeyMismatchError(f"{checkpoint} holds no dataloader state: it was saved without a "
                                           "train_dataloader, so the position in the data cannot be restored")
            state["dataloader"] = self.bcp_train_dataloader
        if located is None:
            bcp.load(checkpoint, state)
            return
        state["extra_state"] = {}  # a tiered step loads once: its RNG states now, set when the Trainer asks
        try:
            located.load(state, strict=False)
        except bcp.DamagedStepError as e:
            self._bcp_damaged = e  # the state is untouched: _train_from_tiers starts again from another step
            raise
        self._bcp_rng = state["extra_state"].get("rng")

    def _load_scaler(self, checkpoint) -> None:
        pass  # loaded with the optimizer

    def _load_rng_state(self, checkpoint) -> None:
        if checkpoint is None:
            return
        if self._resuming_tiers(checkpoint):
            if getattr(self, "_bcp_rng", None) is not None:
                set_rng_state(self._bcp_rng)
            return
        state: dict[str, Any] = {"extra_state": {}}
        bcp.load(checkpoint, state, strict=False)
        restore_rng(state)

    def _load_best_model(self) -> None:
        self.bcp.wait()
        best = self.state.best_model_checkpoint
        bcp.load(best, {"model": self.model_wrapped})


class BCPTrainer(BCPTrainerMixin, Trainer):
    """``transformers.Trainer`` that saves and resumes through bcp."""


# The files by which HF's Trainer._load_from_checkpoint recognises a checkpoint of its own.
_HF_WEIGHT_FILES = (WEIGHTS_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_INDEX_NAME, ADAPTER_WEIGHTS_NAME,
                    ADAPTER_SAFE_WEIGHTS_NAME)


def _checkpoint_kind(path) -> str | None:
    """What reads checkpoint directory `path`, when it holds none of HF's own weight files: "bcp"
    (bcp's own checkpoint, committed or not), "foreign" (another system's that bcp reads as it is:
    DeepSpeed's own ``global_step*`` folders, see bcp_core.foreign), else None (HF's own, or no
    checkpoint). Reads no metadata."""
    if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
        return None
    if any(os.path.isfile(os.path.join(path, name)) for name in _HF_WEIGHT_FILES):
        return None
    try:
        st = resolve(path)
    except bcp.NotACheckpointError:
        return None
    except bcp.BCPError:
        return "bcp"  # bcp's, but not committed
    return "foreign" if foreign_format(st) is not None else "bcp"


def _is_bcp_checkpoint_only(path) -> bool:
    """`path` is bcp's own checkpoint (committed or not; not another system's that bcp reads) holding
    none of HF's own weight files: what only the mixin resumes."""
    return _checkpoint_kind(path) == "bcp"


def _resume_needs_mixin_message(path) -> str:
    return (f"bcp: {path} is a bcp checkpoint; a plain transformers.Trainer cannot resume from it (BCPCallback "
            "alone only saves): use bcp_integrations.hf.BCPTrainer, or put BCPTrainerMixin in front of your "
            "Trainer class")


def _guard_plain_trainer_resume() -> None:
    """Make ``train(resume_from_checkpoint=<a bcp checkpoint>)`` on a Trainer without the mixin fail
    with one line naming BCPTrainer / BCPTrainerMixin.

    No callback event runs before the Trainer reads the checkpoint (``train()`` calls
    ``_load_from_checkpoint`` before ``on_train_begin``), so a callback can neither resume nor
    detect this; HF's own error is ``Can't find a valid checkpoint at <path>``. The Trainer's
    ``_load_from_checkpoint`` is wrapped once, in the class: for a bcp checkpoint that holds none of
    HF's weight files (where HF raises that ValueError anyway) it raises a ValueError that says what
    to use instead; in every other case it calls the original. The mixin overrides the method and
    is not affected. Skipped if this Trainer has no such method.
    """
    original = getattr(Trainer, "_load_from_checkpoint", None)
    if original is None or getattr(original, "_bcp_guard", False):
        return

    @functools.wraps(original)
    def _load_from_checkpoint(self, resume_from_checkpoint, *args, **kwargs):
        if not isinstance(self, BCPTrainerMixin) and _is_bcp_checkpoint_only(resume_from_checkpoint):
            raise ValueError(_resume_needs_mixin_message(resume_from_checkpoint))
        return original(self, resume_from_checkpoint, *args, **kwargs)

    _load_from_checkpoint._bcp_guard = True
    Trainer._load_from_checkpoint = _load_from_checkpoint


_guard_plain_trainer_resume()

_resuming = threading.local()  # .trainer: the BCPTrainerMixin whose train() is running in this thread


def _guard_deepspeed_resume() -> None:
    """Under DeepSpeed the Trainer resumes through ``transformers.integrations.deepspeed
    .deepspeed_load_checkpoint`` (DeepSpeed's own ``global_step*`` folders) instead of
    ``_load_from_checkpoint``. Wrapped once, in the module the Trainer calls it from. Inside a
    BCPTrainerMixin's ``train()`` it does nothing for a checkpoint bcp reads (bcp's own, or
    DeepSpeed's own without HF weight files) and for the folder ``train(resume_from_checkpoint=
    tiers)`` hands the Trainer (only the trainer state): the mixin's
    ``_load_optimizer_and_scheduler``, which the Trainer calls next, loads the engine's model,
    ZeRO optimizer, scheduler and counters together. For a plain Trainer it raises the one-line
    "use BCPTrainer" error for bcp's own checkpoint only: DeepSpeed's own checkpoints (which bcp
    also reads) go to DeepSpeed's load, as without bcp. Any other checkpoint goes to DeepSpeed's
    load."""
    import transformers.trainer as trainer_module
    original = getattr(trainer_module, "deepspeed_load_checkpoint", None)
    if original is None or getattr(original, "_bcp_guard", False):
        return

    @functools.wraps(original)
    def deepspeed_load_checkpoint(engine, checkpoint_path, *args, **kwargs):
        trainer = getattr(_resuming, "trainer", None)
        if trainer is not None:
            # the mixin loads its tiers' step (the Trainer was given a folder holding only the
            # trainer state) and any checkpoint bcp reads, DeepSpeed's own included, itself
            if trainer._resuming_tiers(checkpoint_path) or _checkpoint_kind(checkpoint_path) is not None:
                return None
        elif _is_bcp_checkpoint_only(checkpoint_path):
            raise ValueError(_resume_needs_mixin_message(checkpoint_path))
        return original(engine, checkpoint_path, *args, **kwargs)

    deepspeed_load_checkpoint._bcp_guard = True
    trainer_module.deepspeed_load_checkpoint = deepspeed_load_checkpoint


_guard_deepspeed_resume()


def last_checkpoint(output_dir: str) -> str | None:
    """The newest ``checkpoint-<step>`` under `output_dir` that bcp committed (None if none)."""
    return latest_complete(output_dir, HF_STEPS)


def export_pretrained(checkpoint: str, output_dir: str, model=None, model_class=None) -> str:
    """Write the model of bcp `checkpoint` as a Hugging Face directory (config.json + safetensors).

    Runs in one process, at any world size the checkpoint was saved with. `model` is the model to
    fill (built from the checkpoint's config.json with `model_class`, default
    ``AutoModelForCausalLM``, when omitted). Returns `output_dir`.
    """
    if model is None:
        from transformers import AutoConfig
        if model_class is None:
            from transformers import AutoModelForCausalLM as model_class
        config = AutoConfig.from_pretrained(checkpoint)
        model = model_class.from_config(config)
    bcp.load(checkpoint, {"model": model})
    model.save_pretrained(output_dir, safe_serialization=True)
    return output_dir


# ----------------------------------------------------------------------------- helpers

def _unwrap_model(model):
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def _is_main_process() -> bool:
    return this_rank() == 0


def _rotate(run_dir: str, save_total_limit: int, best_model_checkpoint: str | None) -> None:
    """`save_total_limit` by HF's rule (the newest and the best checkpoint stay, the oldest others go
    until the limit is met), counting committed checkpoints only: the other ranks may already have
    created the next save's directory, which HF's own `rotate_checkpoints` would keep as the newest
    in place of the one just committed. Incomplete directories older than the newest committed one
    (saves that failed) go too."""
    entries = list_checkpoints(run_dir, HF_STEPS)
    committed = [e for e in entries if e.complete]
    if save_total_limit <= 0 or not committed:
        return  # HF: no limit
    best = os.path.normpath(best_model_checkpoint) if best_model_checkpoint else None
    others = [e for e in committed[:-1] if os.path.normpath(e.path) != best]
    keep = max(save_total_limit, len(committed) - len(others))
    doomed = others[:max(0, len(committed) - keep)]
    doomed += [e for e in entries if not e.complete and e.step < committed[-1].step]
    for entry in doomed:
        try:
            shutil.rmtree(entry.path)
        except OSError as e:  # the checkpoint is committed; rotation is housekeeping
            log.warning("bcp: save_total_limit=%d: could not remove %s: %s", save_total_limit, entry.path, e)
