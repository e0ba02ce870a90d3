"""bcp for Hugging Face Accelerate: ``bcp_integrations.accelerate.register(accelerator)``.

After ``register``, ``accelerator.save_state(dir)`` and ``load_state(dir)`` persist the whole
training state through bcp on every rank (sharded, asynchronous, loadable at another number of
processes) via Accelerate's ``register_save_state_pre_hook`` / ``register_load_state_pre_hook``.
See docs/integrations.md for what is saved and how Accelerate's own writer is kept out.
"""

from bcp_core.extras import require_extra

# Before the imports below: a missing framework is one line naming the extra, not a traceback.
require_extra("accelerate", "the Accelerate integration (bcp_integrations.accelerate)")

from .checkpointing import BCPAccelerateCheckpointer, register  # noqa: E402

__all__ = ["BCPAccelerateCheckpointer", "register"]
