"""What a DeepSpeed engine is, which optimizer it trains with, and what it holds beyond its model and
optimizer: counters and the loss scaler."""

from __future__ import annotations

from typing import Any

from torch import nn

from bcp_core.errors import BCPError


def _engine_class():
    from deepspeed.runtime.engine import DeepSpeedEngine
    return DeepSpeedEngine


def is_engine(obj: Any) -> bool:
    return isinstance(obj, _engine_class())


def zero_optimizer_of(obj: Any):
    """The ZeRO optimizer an engine, a module trained by one, or an optimizer wrapper refers to; None
    if there is none (DeepSpeed without ZeRO: the optimizer is a torch one, handled as for a plain model)."""
    if is_engine(obj):
        obj = obj.optimizer
    if isinstance(obj, nn.Module):
        for p in obj.parameters():
            for attr in ("_z3_optimizer", "_zero_optimizer"):
                if getattr(p, attr, None) is not None:
                    return getattr(p, attr)
        return None
    while obj is not None and not is_zero(obj) and hasattr(obj, "optimizer") and obj.optimizer is not obj:
        obj = obj.optimizer
    return obj if is_zero(obj) else None


# What tells DeepSpeed's optimizers apart: ZeRO-3, ZeRO-1/2, the bf16 optimizer, the fp16 optimizers
# (fused: flat master copies per group; unfused: one per parameter)
_MASTER_COPIES = ("fp32_partitioned_groups_flat", "bit16_groups", "fp32_groups_flat_partition", "fp32_groups_flat",
                  "fp32_groups")


def is_zero(obj: Any) -> bool:
    """A DeepSpeed optimizer that keeps fp32 master copies of the parameters (ZeRO, bf16, fp16)."""
    return obj is not None and type(obj).__module__.startswith("deepspeed.") and \
        any(hasattr(obj, a) for a in _MASTER_COPIES)


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
