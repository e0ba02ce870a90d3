"""bcp for Megatron-core / Megatron-LM, megatron-core 0.16 to 0.19 (docs/megatron.md).

Importing this package routes `megatron.core.dist_checkpointing`'s save and loads through bcp where
asked (routing.py): `dist_checkpointing.save(..., sharded_strategy=("bcp", 1))` writes bcp, and
`dist_checkpointing.load` reads a checkpoint whose `metadata.json` names bcp with bcp. A
megatron-core without the interfaces this relies on fails here, at import.
"""

from bcp_core.extras import require_extra

# Before the imports below: a missing framework is one line naming the extra, not a traceback.
require_extra("megatron", "the Megatron-core integration (bcp_integrations.megatron)")

from .adapter import (build_factories, flat_range_sharded_tensors, load, load_state, merge_factories,  # noqa: E402
                      save, save_state)
from .optimizer import chained_optimizer_state, fully_reshardable_param_state  # noqa: E402
from .megatron_lm import add_ckpt_format_choice, bcp_selected, enable_megatron_lm  # noqa: E402
from .preemption import exit_after_preemption  # noqa: E402
from .routing import register_strategies  # noqa: E402
from .strategy import (BACKEND, VERSION, BcpCheckpointingException, BcpLoadShardedStrategy,  # noqa: E402
                       BcpSaveShardedStrategy)

register_strategies()

__all__ = [
    "BACKEND", "VERSION", "BcpSaveShardedStrategy", "BcpLoadShardedStrategy", "BcpCheckpointingException",
    "register_strategies",
    "save", "load", "save_state", "load_state", "build_factories", "merge_factories", "flat_range_sharded_tensors",
    "fully_reshardable_param_state", "enable_megatron_lm", "add_ckpt_format_choice", "bcp_selected",
    "exit_after_preemption", "chained_optimizer_state",
]
