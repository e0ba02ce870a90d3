"""bcp for HF Transformers: ``Trainer(..., callbacks=[BCPCallback()])``.

``BCPCallback`` alone writes the checkpoints that ``save_strategy="steps"``/``"epoch"`` trigger
with bcp, on every rank, asynchronously, honouring ``save_total_limit``. Resuming from them
(``train(resume_from_checkpoint=True|path)``, also at another world size) and
``save_strategy="best"`` need ``BCPTrainer`` / ``BCPTrainerMixin``: the Trainer reads checkpoints
and decides "best" saves in private methods that no callback event reaches (a plain Trainer asked to
resume a bcp checkpoint fails at once with one line saying so). ``export_pretrained``
turns a bcp checkpoint into a normal Hugging Face directory. See docs/integrations.md.
"""

from bcp_core.extras import require_extra

# Before the imports below: a missing framework is one line naming the extra, not a traceback.
require_extra("hf", "the HF Transformers integration (bcp_integrations.hf)")

from .checkpointing import BCPCallback, BCPTrainer, BCPTrainerMixin, export_pretrained, last_checkpoint  # noqa: E402

__all__ = ["BCPCallback", "BCPTrainer", "BCPTrainerMixin", "export_pretrained", "last_checkpoint"]
