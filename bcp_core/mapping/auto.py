"""`mapping="auto"`: the declared mapping a load uses, from the framework that saved the checkpoint, the
model family of the target's Hugging Face config (the registry, families.py) and the layout the
checkpoint's names show (docs/mapping.md).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import MappingError
from ..metadata import CheckpointMetadata
from .decoder import layout_of, megatron_to_hf
from .declaration import Mapping
from .families import declared, family_of


def resolve_mapping(mapping: Any, md: CheckpointMetadata, state: dict, adapter: Any) -> Mapping | None:
    """`mapping` itself, or for "auto" the declared mapping from the framework that saved `md` to the
    target's: none when both are Megatron or both are not; Megatron -> a Hugging Face model of a
    declared family in `state` (its config says which family, the checkpoint's names which Megatron
    layout, its parameters how it holds its experts); anything else is refused."""
    if isinstance(mapping, Mapping):
        return mapping
    if mapping != "auto":
        raise MappingError(f"mapping must be a bcp_core.mapping.Mapping or 'auto', got {mapping!r}")
    saved_megatron, into_megatron = md.framework == "megatron", adapter.name == "megatron"
    if saved_megatron == into_megatron:
        return None
    if into_megatron:
        raise MappingError(f"mapping='auto': the checkpoint was saved by {md.framework!r}, the target is Megatron; "
                           "a Megatron state does not say which model family it is: pass "
                           "mapping=bcp.mapping.hf_to_megatron(hf_config)")
    models = [(k, v) for k, v in state.items() if isinstance(v, torch.nn.Module)]
    found = [(k, getattr(adapter.root(v), "config", None)) for k, v in models]
    found = [(k, cfg) for k, cfg in found if cfg is not None]
    if len(found) != 1:
        raise MappingError(f"mapping='auto': the checkpoint was saved by Megatron; the target needs exactly one "
                           f"Hugging Face model (with a .config) in the state, found {len(found)}")
    key, cfg = found[0]
    try:
        family_of(cfg)
    except MappingError:
        model_type = getattr(cfg, "model_type", None)
        raise MappingError(f"mapping='auto': no declared mapping from Megatron to a {model_type!r} model (declared: "
                           f"{', '.join(declared())})") from None
    optimizers = [k for k, v in state.items() if adapter.is_optimizer(v)]
    layout, _ = layout_of(md.tensors)  # a transformers model holds no multi-token prediction layers
    return megatron_to_hf(cfg, layout=layout, model=key,
                          optimizer=optimizers[0] if len(optimizers) == 1 else "optimizer",
                          experts=_expert_layout(adapter.root(dict(models)[key])))


def _expert_layout(model: torch.nn.Module) -> str:
    """How the model holds its experts: one 3-D parameter for all (transformers 5), or a module each."""
    names = (n for n, _ in model.named_parameters())
    return "per_expert" if any(".experts.0." in n for n in names) else "fused"
