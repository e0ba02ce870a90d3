"""bcp for DeepSpeed: ZeRO stage 1, 2 and 3 engines saved as boxes, loaded at any stage and world size.

    import bcp_core as bcp
    from bcp_integrations.deepspeed import engine_state

    bcp.save(path, engine_state(engine), async_save=True)   # model, ZeRO optimizer, scheduler, counters
    bcp.load(path, engine_state(engine))                    # any stage, any world size, or from FSDP/plain

`framework="auto"` recognises the engine (or the module a ZeRO-3 engine trains; ZeRO-1/2's module
alone is refused: its parameters are only the working copies); the checkpoint is keyed by parameter
FQN like every other layout's (docs/integrations.md, DeepSpeed).
"""

from bcp_core.extras import require_extra

# Before the imports below: a missing framework is one line naming the extra, not a traceback.
require_extra("deepspeed", "the DeepSpeed integration (bcp_integrations.deepspeed)")

from .adapter import DeepSpeedAdapter, module_of  # noqa: E402
from .engine import EngineCounters, engine_state, is_engine, zero_optimizer_of  # noqa: E402

__all__ = ["DeepSpeedAdapter", "EngineCounters", "engine_state", "is_engine", "module_of", "zero_optimizer_of"]
