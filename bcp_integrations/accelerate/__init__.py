"""bcp for Hugging Face Accelerate: ``bcp_integrations.accelerate.register(accelerator)``.

After ``register``, ``accelerator.save_state(dir)`` and ``load_state(dir)`` persist the whole
training state through bcp on every rank (sharded, asynchronous, loadable at another number of
processes) via Accelerate's ``register_save_state_pre_hook`` / ``register_load_state_pre_hook``.
See docs/integrations.md for what is saved and how Accelerate's own writer is kept out.
"""

from .checkpointing import BCPAccelerateCheckpointer, register

__all__ = ["BCPAccelerateCheckpointer", "register"]
