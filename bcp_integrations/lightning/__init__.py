"""bcp for PyTorch Lightning: ``Trainer(plugins=[BCPCheckpointIO()])``.

Lightning hands a ``CheckpointIO`` the checkpoint dict on rank 0 only, and its sharded strategies
(FSDPStrategy, ModelParallelStrategy) do not call it at all. A checkpointer that writes every
rank's shards needs the strategy's live model and optimizers on every rank, so the plugin binds
itself to the strategy it is given to: importing this package wraps the setter of
``Strategy.checkpoint_io`` (the single place where Lightning attaches a CheckpointIO to its
strategy, on every rank, during ``Trainer.__init__``). When the value is a ``BCPCheckpointIO``,
the strategy instance is switched to a subclass of its own class with ``BCPStrategyMixin`` in
front. The mixin then saves, loads and removes checkpoints through bcp on all ranks.

``BCPStrategyMixin`` can also be used directly (``class MyDDP(BCPStrategyMixin, DDPStrategy)``);
``bcp_strategy(strategy)`` does the same switch on a strategy object. See docs/integrations.md.
"""

from bcp_core.extras import require_extra

# Before the imports below: a missing framework is one line naming the extra, not a traceback.
require_extra("lightning", "the Lightning integration (bcp_integrations.lightning)")

from .checkpoint_io import BCPCheckpointIO, BCPStrategyMixin, bcp_strategy  # noqa: E402

__all__ = ["BCPCheckpointIO", "BCPStrategyMixin", "bcp_strategy"]
