"""What a DeepSpeed engine holds beyond its model and optimizer: counters and the loss scaler."""

from __future__ import annotations

from typing import Any

from bcp_core.errors import BCPError

from .adapter import is_engine, zero_optimizer_of

# The loss scaler's attributes that change while training (DeepSpeed's DynamicLossScaler); the rest
# comes from the configuration.
_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


class EngineCounters:
    """A DeepSpeed engine's step counters (`global_steps`, `global_samples`, `skipped_steps`: what
    DeepSpeed's own checkpoints keep) and its optimizer's loss-scaler state, as a stateful object for
    `bcp.save` / `bcp.load`."""

    def __init__(self, engine):
        if not is_engine(engine):
            raise BCPError(f"EngineCounters needs a DeepSpeed engine, got {type(engine).__name__}")
        self.engine = engine

    def _scaler(self):
        """The object holding the loss-scale state: ZeRO's `loss_scaler`, or DeepSpeed's fp16 optimizer
        without ZeRO itself (it keeps `cur_scale`... as attributes)."""
        opt = zero_optimizer_of(self.engine) or getattr(self.engine, "optimizer", None)
        scaler = getattr(opt, "loss_scaler", None)
        return scaler if scaler is not None else (opt if hasattr(opt, "cur_scale") else None)

    def bcp_load_template(self) -> dict[str, Any]:
        """What a load needs (the counters); the loss scaler's state is taken where the checkpoint has it
        (a run without loss scaling, or with another optimizer, saved other fields)."""
        sd = self.state_dict()
        sd.pop("loss_scaler", None)
        return sd

    def state_dict(self) -> dict[str, Any]:
        e = self.engine
        out: dict[str, Any] = {"global_steps": int(e.global_steps), "global_samples": int(e.global_samples),
                               "skipped_steps": int(e.skipped_steps)}
        scaler = self._scaler()
        if scaler is not None:
            out["loss_scaler"] = {f: _plain(getattr(scaler, f)) for f in _SCALER_FIELDS if hasattr(scaler, f)}
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        e = self.engine
        e.global_steps = sd["global_steps"]
        e.global_samples = sd["global_samples"]
        e.skipped_steps = sd["skipped_steps"]
        scaler = self._scaler()
        if scaler is not None:
            for f, v in sd.get("loss_scaler", {}).items():
                if hasattr(scaler, f):
                    setattr(scaler, f, v)


def _plain(v: Any) -> Any:
    return v.item() if hasattr(v, "item") else v


def engine_state(engine) -> dict[str, Any]:
    """The state of a DeepSpeed engine for `bcp.save` / `bcp.load`: ``{"model": engine, "optimizer":
    its ZeRO (or torch) optimizer, "scheduler": its LR scheduler if it has one, "engine": EngineCounters}``.
    Add what else the run keeps (``"extra_state": {"rng": bcp.rng.rng_state()}``, a dataloader)."""
    if not is_engine(engine):
        raise BCPError(f"engine_state needs a DeepSpeed engine, got {type(engine).__name__}")
    state: dict[str, Any] = {"model": engine}
    if engine.optimizer is not None:
        state["optimizer"] = engine.optimizer
    if engine.lr_scheduler is not None:
        state["scheduler"] = engine.lr_scheduler
    state["engine"] = EngineCounters(engine)
    return state
