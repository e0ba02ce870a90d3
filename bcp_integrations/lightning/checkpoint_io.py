"""BCPCheckpointIO and the strategy mixin that makes it run on every rank."""

from __future__ import annotations

import functools
import json
import logging
import os
import posixpath
import signal
import threading
from abc import ABC
from collections.abc import Mapping
from typing import Any

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.strategies import (DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy,
                                          SingleDeviceStrategy, Strategy)
from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

import bcp_core as bcp
from bcp_core import codec, metrics
from bcp_core.integration import companions
from bcp_core.layout import list_checkpoints, remove_checkpoint, remove_superseded
from bcp_core.metadata import parse_json
from bcp_core.rng import rng_state, set_rng_state
from bcp_core.tiers import load_newest

from .loader_states import LOADER_KEY, check_loader_states, move_loader_states, restore_loader_states, saved_value

log = logging.getLogger("bcp")

# Keys of Lightning's checkpoint dict that bcp replaces with the live model and optimizers.
_TENSOR_KEYS = ("state_dict", "optimizer_states")
# Strategies whose `model` / `optimizers` bcp knows how to read on every rank.
SUPPORTED_STRATEGIES = (DDPStrategy, ModelParallelStrategy, FSDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy)


class BCPCheckpointIO(CheckpointIO):
    """Checkpoints written and read by bcp on every rank, sharded, asynchronous by default.

    Each checkpoint path (``step=4.ckpt``, ``last.ckpt``) is a directory holding one bcp checkpoint
    per save in a step directory, with bcp's ``latest`` tracker: a new save to a path (``last.ckpt``
    at every ``ModelCheckpoint`` save) replaces the previous one only once it is committed.
    Removals Lightning asks for while a save is in flight (``save_top_k``) wait for that save's
    commit too; if it fails they are not made, and its directory is removed if it holds nothing
    committed. Nothing loadable is deleted before a newer checkpoint is committed.

    Args:
        async_save: return from a save once the state is staged; the write continues in the
            background. The next save, a load and teardown wait for it.
        allow_pickle: let values bcp's safe codec cannot represent (unusual ``hparams``) be
            pickled; loading such a checkpoint then needs ``allow_pickle=True`` too.
        save_rng: also save each rank's RNG states (torch, CUDA, ``random``, numpy) and restore
            them on load, which Lightning's own checkpoints do not do.
        num_threads: I/O threads per rank.
        preemption: on SIGTERM, take a last checkpoint at a step every rank agrees on (Lightning's
            HPC path ``hpc_ckpt_<n>.ckpt`` in ``default_root_dir``, which ``fit(ckpt_path="hpc")``
            and SLURM's auto-resume pick up), commit it and every save in flight, and exit with
            status 143 (see `bcp.handle_preemption`). Installs the handler now, so construct the
            plugin on every rank from the main thread, before ``fit``.
        tiers: a ``bcp.Tiers``: every checkpoint Lightning saves (to whatever path) goes to the tiers
            as its global step instead (each node's memory, replicas on other nodes, durable storage
            every ``persist_every``-th step; one save per step), and ``fit(ckpt_path=tiers)`` resumes
            from the newest step that survives anywhere, at any world size (docs/tiers.md).

    A save still in flight when the script ends (after ``fit``, ``sys.exit``, an exception) is
    committed before the process exits, or the process exits 1 naming it.
    """

    def __init__(self, async_save: bool = True, allow_pickle: bool = False, save_rng: bool = True,
                 num_threads: int | None = None, preemption: bool = False, tiers: bcp.Tiers | None = None):
        self.tiers = tiers
        # the step last saved to (or loaded from) the tiers, and what that save held (`_held`)
        self._tier_saved: tuple[int, frozenset[str]] | None = None
        self.async_save = async_save
        self.allow_pickle = allow_pickle
        self.save_rng = save_rng
        self.num_threads = num_threads
        # Installed before fit: the SIGTERM handler Lightning composes when fit starts calls the one
        # it finds (the mixin takes Lightning's own notifier out of it).
        self.preemption: bcp.Preemption | None = bcp.handle_preemption() if preemption else None
        self._pending: bcp.SaveHandle | None = None
        self._pending_path: str | None = None
        self._after_commit: _AfterCommit | None = None  # rank 0: the removals the save in flight holds back
        self._metrics: metrics.LatestScalars | None = None  # created on first use (it holds a lock)
        # Lightning's spawn launcher moves rank 0's results to the main process through the
        # CheckpointIO as a single file; those direct calls stay plain torch files.
        self._files = TorchCheckpointIO()

    def __getstate__(self) -> dict:
        # spawn launchers pickle the plugin into new processes: the handler belongs to this one
        return {**self.__dict__, "preemption": self.preemption is not None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.preemption = bcp.handle_preemption() if state["preemption"] else None

    # -- the CheckpointIO interface, for calls that do not come through a bound strategy --------

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        self._files.save_checkpoint(checkpoint, path, storage_options)

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None) -> dict:
        if _is_bcp_checkpoint(path):
            raise RuntimeError(f"{path} is a bcp checkpoint: load it through a Trainer whose strategy has "
                               "BCPCheckpointIO (fit(ckpt_path=...)), or with bcp_core.load")
        return self._files.load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path) -> None:
        path = os.fspath(path)
        if path == self._pending_path:
            self.wait()
        elif self._after_commit is not None and self._after_commit.defer(path):
            return  # removed once the save in flight is committed
        remove_checkpoint(path)

    def teardown(self) -> None:
        self.wait()

    # -- bcp on every rank (called by BCPStrategyMixin) -----------------------------------------

    def wait(self) -> None:
        """Block until the save in flight, if any, is durable and committed; re-raise its error."""
        handle, self._pending = self._pending, None
        self._settle(handle.wait if handle is not None else None)

    def _settle(self, finish) -> None:
        """Run `finish` (the save in flight, up to its commit) and forget that save. A failed save
        leaves in place what it was to supersede."""
        path, after = self._pending_path, self._after_commit
        self._pending_path, self._after_commit = None, None
        if finish is None:
            return
        try:
            finish()
        except bcp.CommitCallbackError as e:
            # Committed on every rank; only what followed the commit on this rank failed. Raising here,
            # on this rank alone, would leave the other ranks waiting for it in the next collective.
            log.error("bcp: %s", e)
        except bcp.BCPError:
            if after is not None:  # rank 0
                after.abandon()
                if not after.held:  # a path that held a committed checkpoint keeps it, whatever it holds now
                    _discard_failed(path)
            raise

    def save_all_ranks(self, strategy: Strategy, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError("BCPCheckpointIO does not take storage_options: pass a URL that fsspec "
                            "understands (s3://, gs://, ...) as the checkpoint path instead")
        self.wait()  # one save in flight at a time; also makes re-saving to the same path safe
        self.log_metrics(strategy)
        state, rest = _bcp_state(strategy, checkpoint)
        try:
            encoded = codec.encode(_plain(rest), "Lightning checkpoint", self.allow_pickle)
        except bcp.UnsupportedValueError as e:
            raise bcp.UnsupportedValueError(f"{e}. Values outside bcp's safe codec (often in hparams) need "
                                            "BCPCheckpointIO(allow_pickle=True)") from e
        # One opaque value: Lightning's keys (callback names) contain dots, which bcp uses as separators.
        state["lightning"] = json.dumps(encoded)
        if self.save_rng:
            state["extra_state"] = {"rng": rng_state()}
        step = int(checkpoint.get("global_step", 0))
        if self.tiers is not None:
            # ModelCheckpoint saves a step to several paths: the tiers hold one save per step. A
            # save holding no more than the step's earlier one is that one; a save holding more
            # (the full checkpoint after a `save_weights_only` one) replaces it.
            held = _held(state, rest)
            if self._tier_saved is not None and self._tier_saved[0] == step and held <= self._tier_saved[1]:
                return
            self._tier_saved = (step, held)
            self._pending = bcp.save(self.tiers, state, async_save=self.async_save, step=step,
                                     allow_pickle=self.allow_pickle, num_threads=self.num_threads)
            if not self.async_save:
                self.wait()
            return
        # Each save goes to a step directory inside `path`, so a new save to a path that holds a
        # checkpoint (last.ckpt) leaves that one in place until the new one is committed: bcp's
        # tracker moves at the commit, and `_AfterCommit` removes the old one after it (rank 0).
        path = os.fspath(path)
        held, step_dir = _save_target(strategy, path, step)
        self._pending_path = path
        self._after_commit = _AfterCommit(path, held) if strategy.is_global_zero else None
        save = functools.partial(bcp.save, path, state, async_save=self.async_save,
                                 step=step_dir, allow_pickle=self.allow_pickle,
                                 num_threads=self.num_threads, on_commit=self._after_commit)
        if not self.async_save:
            self._settle(save)
            return
        try:
            self._pending = save()  # the save's own errors come from wait()
        except BaseException:
            self._settle(None)
            raise

    def prepare_all_ranks(self, trainer) -> None:
        """Get the first save ready (`bcp.prepare_save`, collective): called by `StagingPreparation`
        after the first optimizer step, with the state a save of this run holds (the optimizers
        unless every checkpoint callback saves weights only)."""
        strategy = trainer.strategy
        weights_only = bool(trainer.checkpoint_callbacks) and all(
            getattr(c, "save_weights_only", False) for c in trainer.checkpoint_callbacks)
        checkpoint: dict[str, Any] = {"loops": {"fit_loop": {"state_dict": trainer.fit_loop.on_save_checkpoint()}}}
        if not weights_only:
            checkpoint["optimizer_states"] = []
        state, _ = _bcp_state(strategy, checkpoint)
        state["lightning"] = ""  # a value: its structure, not its text, is what a save is planned for
        if self.save_rng:
            state["extra_state"] = {"rng": rng_state()}
        bcp.prepare_save(state)

    def log_metrics(self, strategy: Strategy) -> None:
        """Hand the phase timings of the last committed save (and load) to the trainer's loggers,
        from the training thread (bcp_core.metrics.scalars names them)."""
        if self._metrics is None:
            self._metrics = metrics.LatestScalars()
        values = self._metrics.pop()
        trainer = getattr(strategy.lightning_module, "_trainer", None) if strategy.lightning_module else None
        if values and trainer is not None:
            for logger in trainer.loggers:
                logger.log_metrics(values, step=trainer.global_step)

    def _state_for(self, strategy: Strategy, md, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """What to load from a checkpoint of metadata `md`, and Lightning's part of it, decoded.

        Everything that can make the load fail short of reading the data (Lightning's value, which
        may hold pickled values, and the train loaders' states, which may be of another DP degree)
        is checked here, from the metadata, before anything is read into the model and optimizers:
        a load that fails leaves them as they were."""
        keys = md.keys()
        checkpoint = _lightning_value(md, where, self.allow_pickle)
        state: dict[str, Any] = {"model": strategy.model}
        if any(k.startswith("optimizer_0.") for k in keys):
            for i, opt in enumerate(strategy.optimizers):
                state[f"optimizer_{i}"] = opt
            state.update({k: v for k, v in companions([strategy.model], state).items()
                          if any(key.startswith(k + ".") for key in keys)})
        if "extra_state.rng.torch" in keys:
            state["extra_state"] = {}
        for name in {k.split(".", 1)[0] for k in keys if LOADER_KEY.match(k.split(".", 1)[0])}:
            state[name] = {}  # the live loaders do not exist yet: Lightning restores them later
        check_loader_states(strategy, checkpoint, md, self.allow_pickle)
        return state, checkpoint

    def load_all_ranks(self, strategy: Strategy, path) -> dict[str, Any]:
        self.wait()
        self.log_metrics(strategy)  # also starts collecting, so this load's timings are logged later
        if isinstance(path, bcp.Tiers):  # the newest step that survives (also after damaged copies)
            prepared: dict[str, Any] = {}

            def state_for(at) -> dict[str, Any]:
                prepared["state"], prepared["checkpoint"] = self._state_for(
                    strategy, at.metadata, f"step {at.step} of {path.memory}")
                return prepared["state"]

            located, state, _ = load_newest(path, state_for, allow_pickle=self.allow_pickle,
                                            num_threads=self.num_threads)
            checkpoint = prepared["checkpoint"]
            entries = {k.split(".", 1)[0] for k in located.metadata.keys()}
            self._tier_saved = (located.step, _held(entries, checkpoint))  # saving no more of it again: skipped
        else:
            state, checkpoint = self._state_for(strategy, bcp.inspect(path), os.fspath(path))
            bcp.load(path, state, allow_pickle=self.allow_pickle, num_threads=self.num_threads)
        has_optimizers = "optimizer_0" in state
        restore_loader_states(strategy, checkpoint, state)
        # The model and optimizers are already in place; Lightning's own restore of them is disabled
        # by the mixin, but user hooks (on_load_checkpoint) may look for the keys.
        checkpoint["state_dict"] = {}
        if has_optimizers:
            checkpoint["optimizer_states"] = []
        if self.save_rng and "extra_state" in state:
            set_rng_state(state["extra_state"]["rng"])
        return checkpoint


# Deriving from ABC (as Lightning's strategies do) keeps the mixed class's object layout equal to the
# strategy's, which `bcp_strategy` needs to switch the class of an existing strategy object.
class BCPStrategyMixin(ABC):  # noqa: B024 - ABC for the object layout, not for abstract methods
    """Put in front of a Lightning strategy class: checkpoints go through bcp on every rank.

    The strategy's ``checkpoint_io`` must be a ``BCPCheckpointIO`` (a default one is created if
    not). Model and optimizer state never pass through Lightning's checkpoint dict: bcp reads the
    live (DDP / FSDP2 / TP / FSDP1) modules and optimizers and writes each rank's shards, so nothing
    is gathered. Restoring happens after the strategy's setup, into the live objects, at any world
    size or strategy.
    """

    @property
    def bcp_io(self) -> BCPCheckpointIO:
        io = self.checkpoint_io
        if not isinstance(io, BCPCheckpointIO):
            io = BCPCheckpointIO()
            self.checkpoint_io = io
        return io

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # load into wrapped/sharded modules and existing optimizers

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # bcp restored the optimizers in load_checkpoint

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # nothing to gather: bcp reads the live module in save_checkpoint

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        return {}

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:  # noqa: B027
        pass  # done by bcp in load_checkpoint

    def load_optimizer_state_dict(self, checkpoint) -> None:  # noqa: B027
        pass

    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        self.bcp_io.save_all_ranks(self, checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict[str, Any]:
        return self.bcp_io.load_all_ranks(self, checkpoint_path)

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            self.bcp_io.remove_checkpoint(filepath)

    def setup(self, trainer) -> None:
        super().setup(trainer)
        if self.bcp_io.async_save and not any(isinstance(c, StagingPreparation) for c in trainer.callbacks):
            trainer.callbacks.append(StagingPreparation())
        if self.bcp_io.preemption is not None:
            _drop_lightning_sigterm_notifier(trainer._signal_connector)
            if not any(isinstance(c, PreemptionCheckpoint) for c in trainer.callbacks):
                trainer.callbacks.append(PreemptionCheckpoint(self.bcp_io.preemption))

    def teardown(self) -> None:
        # FSDPStrategy and ModelParallelStrategy do not call checkpoint_io.teardown themselves.
        self.bcp_io.wait()
        self.bcp_io.log_metrics(self)
        super().teardown()


class StagingPreparation(Callback):
    """Added by the mixin for asynchronous saves: after the first optimizer step of a fit (the
    optimizers' state exists then) every rank calls `BCPCheckpointIO.prepare_all_ranks`, which
    plans the saves and allocates their staging buffers in the background (`bcp.prepare_save`), so
    the first checkpoint stalls training no longer than later ones. Only where the run saves
    checkpoints (a checkpoint callback, or preemption); a save before it makes its own buffers."""

    def __init__(self):
        self._done = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._done or trainer.global_step < 1:
            return
        self._done = True
        io = trainer.strategy.bcp_io
        if trainer.checkpoint_callbacks or io.preemption is not None:
            io.prepare_all_ranks(trainer)


class PreemptionCheckpoint(Callback):
    """Added by the mixin for ``BCPCheckpointIO(preemption=True)``: the step-boundary check and the
    final checkpoint.

    After each optimizer step every rank asks ``preemption.stop_requested()``; the ranks stop at
    the boundary after the first one that saw SIGTERM, save ``trainer.save_checkpoint`` to
    Lightning's HPC path, then ``preemption.exit()`` (commits every save, exits 143). Lightning's
    own SIGTERM notifier is left out of the handler (`_drop_lightning_sigterm_notifier`); should it
    still run (a signal between its installation and the mixin's change, a Lightning version that
    installs it otherwise), the loop raises ``SIGTERMException`` after the step in progress and
    the final checkpoint is taken in ``on_exception`` instead.
    """

    def __init__(self, preemption: bcp.Preemption):
        self.preemption = preemption
        self._checked_step: int | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self._checked_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self._checked_step:
            return  # no optimizer step since the last check (gradient accumulation): not a boundary
        self._checked_step = trainer.global_step
        if self.preemption.stop_requested():
            self._save_and_exit(trainer, "the step boundary the ranks agreed on")

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException) and trainer.state.fn == TrainerFn.FITTING:
            self._save_and_exit(trainer, "Lightning's SIGTERMException")

    def _save_and_exit(self, trainer, reason: str) -> None:
        # hpc_save_path numbers after the checkpoints present; rank 0's save could create one under
        # another rank's listing, so rank 0's answer holds for all
        path = trainer.strategy.broadcast(trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir))
        log.warning("bcp: rank %d: preempted at step %d (%s): final checkpoint %s", trainer.global_rank,
                    trainer.global_step, reason, path)
        trainer.save_checkpoint(path)
        self.preemption.exit()


class _AfterCommit:
    """Rank 0's removals that wait for one save's commit: the previous checkpoint at its path, and
    the checkpoints Lightning asked to remove meanwhile (``save_top_k``). Called as the save's
    ``on_commit`` (on bcp's save thread); removal errors are logged, never raised: the checkpoint
    is committed, and an error on rank 0 alone must not set the ranks apart."""

    def __init__(self, path: str, held: bool):
        self.path = path
        self.held = held  # `path` held a committed checkpoint when the save started
        self.removals: list[str] = []
        self.committed = False
        self._lock = threading.Lock()  # Lightning's thread defers, the save thread commits

    def defer(self, path: str) -> bool:
        """Hold `path`'s removal back until the commit; False if the save is committed already."""
        with self._lock:
            if not self.committed:
                self.removals.append(path)
            return not self.committed

    def abandon(self) -> None:
        """The save failed: what it was to replace stays."""
        with self._lock:
            kept, self.removals, self.committed = self.removals, [], True
        if kept:
            log.warning("bcp: kept %s: the save to %s that was to supersede them failed", ", ".join(kept), self.path)

    def __call__(self, checkpoint_dir: str) -> None:
        with self._lock:
            removals, self.removals, self.committed = self.removals, [], True
        try:  # the previous save to this path: what the committed one replaces
            failed = remove_superseded(self.path, posixpath.basename(checkpoint_dir.rstrip("/"))).failed
        except Exception as e:  # noqa: BLE001 - see the class doc
            failed = (("", f"{type(e).__name__}: {e}"),)
        for name, error in failed:
            log.warning("bcp: could not remove the previous checkpoint %s in %s after %s was committed: %s",
                        name, self.path, checkpoint_dir, error)
        for path in removals:
            try:
                remove_checkpoint(path)
            except Exception as e:  # noqa: BLE001 - see the class doc
                log.warning("bcp: could not remove %s after %s was committed: %s", path, checkpoint_dir, e)


def _save_target(strategy: Strategy, path: str, step: int) -> tuple[bool, int]:
    """Where a save of global step `step` to `path` goes, as rank 0 sees it (broadcast: every rank
    saves to the same step directory): whether `path` holds a committed checkpoint now, and the
    step directory's number. That is `step`, unless `path` holds a committed step directory of
    `step` or later (the same step saved again: `trainer.save_checkpoint` twice, a resumed run
    saving an earlier step): then the number after the newest of them. A save never writes into a
    committed step directory (the new checkpoint would replace that one in place) and the new one
    orders after every committed one, so once it is committed `_AfterCommit` removes them all.
    Lightning's global step is in the checkpoint itself."""
    answer: tuple[bool, int] | str
    if strategy.is_global_zero:
        try:
            committed = [e.step for e in list_checkpoints(path) if e.complete and e.step is not None]
            answer = (_is_bcp_checkpoint(path), max(committed) + 1 if committed and max(committed) >= step else step)
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            answer = f"{type(e).__name__}: {e}"
    else:
        answer = ""
    answer = strategy.broadcast(answer)
    if isinstance(answer, str):
        raise bcp.SaveError(f"save to {path}: could not read what it holds on rank 0: {answer}")
    return answer


def _discard_failed(path: str | None) -> None:
    """Remove the directory of a failed save that holds no committed checkpoint: Lightning saves to
    that path again only by chance, and would otherwise pick another name (``-v1``) next to it."""
    if path is None or _is_bcp_checkpoint(path):
        return  # a previous checkpoint stays; its failed step directory is cleared by the next commit there
    try:
        remove_checkpoint(path)
    except Exception as e:  # noqa: BLE001 - the save's own error is the one raised
        log.warning("bcp: could not remove %s after its save failed: %s", path, e)


def _drop_lightning_sigterm_notifier(connector) -> None:
    """Make the SIGTERM handler that Lightning installs at the start of each fit call every
    handler it composes (bcp's, those installed before) except its own notifier.

    The notifier runs ``dist.broadcast`` inside the signal handler, at whatever point the main
    thread is; a rank blocked in a collective at that moment (the barrier of ``save_checkpoint``,
    a step's all-reduce) runs it later, so the ranks' collectives no longer pair and the job hangs
    until killed (2 CPU ranks, 3 ms steps: 4 of 12 SIGTERMs to torchrun; 3 of 12 with Lightning
    alone). It also ends the loop on each rank by that rank's own flag. bcp's handler only records
    the signal; the ranks agree through the store on a step boundary, whichever ranks got it.
    """
    if getattr(connector.register_signal_handlers, "_bcp_wrapped", False):
        return
    register = connector.register_signal_handlers

    def register_without_notifier() -> None:
        register()
        handler = signal.getsignal(signal.SIGTERM)
        if isinstance(handler, _HandlersCompose) and threading.current_thread() is threading.main_thread():
            kept = [h for h in handler.signal_handlers if h != connector._sigterm_notifier_fn]
            signal.signal(signal.SIGTERM, _HandlersCompose(kept))  # Lightning's teardown restores bcp's

    register_without_notifier._bcp_wrapped = True
    connector.register_signal_handlers = register_without_notifier


_MIXED: dict[type, type] = {}


def bcp_strategy(strategy: Strategy) -> Strategy:
    """Switch `strategy` (an instance) to save and load through bcp on every rank; returns it."""
    if isinstance(strategy, BCPStrategyMixin):
        return strategy
    if not isinstance(strategy, SUPPORTED_STRATEGIES):
        names = ", ".join(c.__name__ for c in SUPPORTED_STRATEGIES)
        raise TypeError(f"BCPCheckpointIO supports the strategies {names} (and their subclasses), "
                        f"not {type(strategy).__name__}")
    cls = type(strategy)
    if cls not in _MIXED:
        _MIXED[cls] = type(f"BCP{cls.__name__}", (BCPStrategyMixin, cls),
                           {"__module__": __name__})
    strategy.__class__ = _MIXED[cls]
    return strategy


def _install_binding() -> None:
    """Make assigning a BCPCheckpointIO to a strategy switch that strategy to bcp (see package doc)."""
    prop = Strategy.__dict__["checkpoint_io"]
    if getattr(prop.fset, "_bcp_binding", False):
        return

    def fset(self, io):
        prop.fset(self, io)
        if isinstance(io, BCPCheckpointIO):
            bcp_strategy(self)

    fset._bcp_binding = True
    Strategy.checkpoint_io = property(prop.fget, fset, prop.fdel, prop.__doc__)


_install_binding()


# ----------------------------------------------------------------------------- helpers

def _bcp_state(strategy: Strategy, checkpoint: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A save's bcp state for Lightning's checkpoint dict: the live model, the optimizers (unless
    the checkpoint is weights only), the train loaders' states; and the rest of the dict, which
    goes in as one value."""
    state: dict[str, Any] = {"model": strategy.model}
    if "optimizer_states" in checkpoint:  # absent for save_weights_only
        for i, opt in enumerate(strategy.optimizers):
            state[f"optimizer_{i}"] = opt
        state.update(companions([strategy.model], state))  # a DeepSpeed engine's counters
    rest = {k: v for k, v in checkpoint.items() if k not in _TENSOR_KEYS}
    return state, move_loader_states(strategy, rest, state)


def _lightning_value(md, where: str, allow_pickle: bool) -> dict[str, Any]:
    """Lightning's part of the checkpoint (everything but the model and optimizers), from its metadata."""
    text = saved_value(md, "lightning", False)
    if not isinstance(text, str):
        raise bcp.KeyMismatchError(f"{where} holds no Lightning checkpoint value ('lightning'): not a checkpoint "
                                   "BCPCheckpointIO saved")
    checkpoint = codec.decode(parse_json(text, f"the Lightning checkpoint value of {where}"),
                              "Lightning checkpoint", allow_pickle)
    if not isinstance(checkpoint, dict):
        raise bcp.MetadataError(f"the Lightning checkpoint value of {where} is a {type(checkpoint).__name__}, "
                                "not a dict")
    return checkpoint


def _held(entries, lightning: dict[str, Any]) -> frozenset[str]:
    """What a checkpoint holds, to compare two saves of one step: bcp's entries (the model, the
    optimizers, ...) and the keys of Lightning's part (``callbacks``, ``lr_schedulers``, ...)."""
    return frozenset(entries) | frozenset(f"lightning.{k}" for k in lightning if k not in _TENSOR_KEYS)


def _is_bcp_checkpoint(path) -> bool:
    try:
        bcp.resolve(path)
        return True
    except bcp.BCPError:
        return False


def _plain(value: Any) -> Any:
    """Mapping subclasses (AttributeDict, OrderedDict) as dicts, so the safe codec takes them."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if type(value) is tuple:
        return tuple(_plain(v) for v in value)
    return value





