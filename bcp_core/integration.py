"""What every framework integration shares (docs/architecture.md, "Adding an integration").

An integration knows where its framework keeps the model, optimizers, schedulers and loaders, and
when it saves and resumes. What a bcp state of a training run holds beside them, and what happens
around a save, is the same for all and lives here:

* `run_state`: the bcp state of a run: the objects under the wrappers that only forward to them
  (Accelerate's, the HF Trainer's, DeepSpeed's), what a model's framework keeps beside it (a
  DeepSpeed engine's counters: `ModuleAdapter.companions`), and each rank's RNG states;
* `restore_rng`: the RNG states back from a loaded state;
* `PendingSave`: the one save in flight, waited for before the next save or a load; a failure of
  what follows a commit on one rank is logged, not raised (raising on one rank alone would leave
  the others waiting in the next collective);
* `rotate`: keep the newest committed checkpoints of a root (and one to protect, the HF Trainer's
  best), after a commit only, so that a failed save never costs an older checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from torch import nn

from .adapters import resolve_framework
from .errors import CommitCallbackError
from .layout import BCP_STEPS, StepNaming, prune
from .rng import rng_state, set_rng_state

log = logging.getLogger("bcp")


def unwrapped(obj: Any) -> Any:
    """The optimizer or scheduler under wrappers that only forward to it (Accelerate's
    AcceleratedOptimizer / AcceleratedScheduler and their DeepSpeed variants): the object whose
    state bcp reads. Models stay as they are (their adapter reads DDP, FSDP, DeepSpeed engines)."""
    seen = set()
    while id(obj) not in seen:
        seen.add(id(obj))
        inner = getattr(obj, "optimizer", None) if _is_forwarding(obj) else None
        inner = inner if inner is not None else (getattr(obj, "scheduler", None) if _is_forwarding(obj) else None)
        if inner is None or not callable(getattr(inner, "state_dict", None)):
            return obj
        obj = inner
    return obj


def _is_forwarding(obj: Any) -> bool:
    """A wrapper class of Accelerate (the HF Trainer's come from it), whose state is its inner object's."""
    return type(obj).__module__.split(".", 1)[0] == "accelerate"


def _numbered(name: str, i: int) -> str:
    return name if i == 0 else f"{name}_{i}"


def run_state(models: Sequence[nn.Module], optimizers: Sequence[Any] = (), schedulers: Sequence[Any] = (),
              scaler: Any = None, rng: bool = True, framework: str = "auto") -> dict[str, Any]:
    """The bcp state of a training run: ``model`` (``model_1``...), ``optimizer`` (...),
    ``scheduler`` (...), ``scaler``, what each model's framework keeps beside it (``engine`` for a
    DeepSpeed engine) and, with `rng`, ``extra_state.rng`` (this rank's RNG states). The same call
    builds the state a save writes and the state a load fills."""
    state: dict[str, Any] = {}
    for i, m in enumerate(models):
        state[_numbered("model", i)] = m
    for i, o in enumerate(optimizers):
        state[_numbered("optimizer", i)] = unwrapped(o)
    for i, s in enumerate(schedulers):
        if s is not None:
            state[_numbered("scheduler", i)] = unwrapped(s)
    if scaler is not None:
        state["scaler"] = scaler
    state.update(companions(models, state, framework))
    if rng:
        state["extra_state"] = {"rng": rng_state()}
    return state


def companions(models: Sequence[nn.Module], state: dict[str, Any] | None = None,
               framework: str = "auto") -> dict[str, Any]:
    """What each model's framework keeps beside it, by state key (``engine``, ``engine_1``... for
    DeepSpeed engines: `ModuleAdapter.companions`); `state` is the rest of the state (the adapter is
    resolved from all of it)."""
    if not models:
        return {}
    full = {**(state or {}), **{f"_model_{i}": m for i, m in enumerate(models)}}
    adapter = resolve_framework(full, framework)
    return {_numbered(name, i): obj for i, m in enumerate(models) for name, obj in adapter.companions(m).items()}


def restore_rng(state: dict[str, Any]) -> None:
    """Set this rank's RNG states from a state `run_state` built and `bcp.load` filled (if it holds them)."""
    rng = state.get("extra_state", {}).get("rng")
    if isinstance(rng, dict):
        set_rng_state(rng)


class PendingSave:
    """The one save of an integration in flight (its `SaveHandle`)."""

    def __init__(self):
        self.handle = None

    def start(self, handle) -> None:
        self.handle = handle

    def wait(self) -> bool:
        """Block until the save in flight is committed; re-raise its failure. True if there was one.
        `CommitCallbackError` (committed on every rank; only this rank's `on_commit` failed) is
        logged, not raised: raising on one rank alone would leave the others waiting."""
        handle, self.handle = self.handle, None
        if handle is None:
            return False
        try:
            handle.wait()
        except CommitCallbackError as e:
            log.error("bcp: %s", e)
        return True


def rotate(root: str, keep_last: int, naming: StepNaming = BCP_STEPS, protect: str | None = None,
           why: str = "") -> None:
    """Keep the newest `keep_last` committed checkpoints of `root` (and the step directory `protect`,
    if given) and remove the others and what failed saves left (`bcp_core.layout.prune`). Call it once
    a save is committed (its ``on_commit``, or after ``wait()``), on one rank. Failures are logged,
    never raised: the checkpoint is committed, and rotation is housekeeping."""
    try:
        failed = prune(root, max(keep_last, 1), naming=naming, keep=(protect,) if protect else ()).failed
    except Exception as e:  # noqa: BLE001 - see above
        failed = (("", str(e)),)
    for name, reason in failed:
        log.warning("bcp: %s: could not remove %s under %s: %s", why or f"keeping {keep_last}",
                    name or "the old checkpoints", root, reason)
