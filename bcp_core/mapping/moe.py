"""The mixture-of-experts MLP of Mixtral, Qwen2-MoE and Qwen3-MoE between Megatron-core and Hugging Face
Transformers (the rest of the decoder is the Llama family's, llama.py).

Megatron-core MoELayer (sharded state dict keys, the default stacked layout: SequentialMLP, and
TEGroupedMLP which saves the same keys; docs/mapping.md lists the facts and their tests):

    decoder.layers.mlp.router.weight                             [L, E, H]
    decoder.layers.mlp.experts.experts.linear_fc1.weight         [L, E, 2F, H]   per expert [gate; up]
    decoder.layers.mlp.experts.experts.linear_fc2.weight         [L, E, H, F]
    decoder.layers.mlp.shared_experts.linear_fc1.weight          [L, 2S, H]      [gate; up] (Qwen2-MoE)
    decoder.layers.mlp.shared_experts.linear_fc2.weight          [L, H, S]
    decoder.layers.mlp.shared_experts.gate_weight                [L, 1, H]       sigmoid gate of the shared expert
    decoder.layers.mlp.linear_fc1.layer_norm_weight              [L, H]          pre-MLP RMSNorm (local spec; the
    decoder.layers.pre_mlp_layernorm.weight                      [L, H]           Transformer Engine spec's name)

Hugging Face, transformers 5 (`experts="fused"`): model.layers.<i>.mlp.gate.weight [E, H],
mlp.experts.gate_up_proj [E, 2F, H] ([gate; up] per expert), mlp.experts.down_proj [E, H, F].
Earlier releases and the files on the Hub (`experts="per_expert"`, what save_pretrained writes and
every release's from_pretrained reads): one nn.Linear per expert, mlp.experts.<e>.{gate,up,down}_proj
(Qwen), block_sparse_moe.experts.<e>.{w1,w3,w2} and block_sparse_moe.gate (Mixtral). Qwen2-MoE adds
mlp.shared_expert.{gate,up,down}_proj and mlp.shared_expert_gate [1, H].
"""

from __future__ import annotations

from typing import Any

from ..errors import MappingError
from .rules import Copy, Region, rows, whole

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")  # Hugging Face model_type values with experts in every layer
LAYOUTS = ("fused", "per_expert")

M_ROUTER = "decoder.layers.mlp.router.weight"
M_EXPERT_FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
M_EXPERT_FC2 = "decoder.layers.mlp.experts.experts.linear_fc2.weight"
M_SHARED_FC1 = "decoder.layers.mlp.shared_experts.linear_fc1.weight"
M_SHARED_FC2 = "decoder.layers.mlp.shared_experts.linear_fc2.weight"
M_SHARED_GATE = "decoder.layers.mlp.shared_experts.gate_weight"
M_PRE_MLP_NORM_TE = "decoder.layers.pre_mlp_layernorm.weight"


def _get(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def moe_dims(config: Any) -> dict | None:
    """The experts of a config of a declared MoE family: E (experts), F (an expert's FFN size), S
    (the shared expert's, 0 without one), Mixtral's names; None for a dense model_type."""
    family = _get(config, "model_type")
    if family not in FAMILIES:
        return None
    # transformers 5 keeps every family's expert count as num_local_experts (num_experts an alias of it)
    E = _get(config, "num_local_experts") or _get(config, "num_experts")
    if family == "mixtral":
        F, S = _get(config, "intermediate_size"), 0
    else:
        F = _get(config, "moe_intermediate_size")
        S = _get(config, "shared_expert_intermediate_size", 0) or 0 if family == "qwen2_moe" else 0
        L = _get(config, "num_hidden_layers")
        dense = sorted(set(_get(config, "mlp_only_layers", None) or ()))
        step = _get(config, "decoder_sparse_step", 1) or 1
        dense += [i for i in range(L or 0) if (i + 1) % step and i not in dense]
        if dense:  # Megatron saves such a model per layer (moe_layer_freq), a layout not declared here
            raise MappingError(f"the {family} config has dense MLP layers {sorted(dense)} (mlp_only_layers, "
                               "decoder_sparse_step): only models with experts in every layer are declared")
    if not E or not F:
        names = "num_local_experts, intermediate_size" if family == "mixtral" else \
            "num_experts or num_local_experts, moe_intermediate_size"
        raise MappingError(f"the {family} config lacks its expert count or expert FFN size ({names})")
    return {"family": family, "E": E, "F": F, "S": S}


def moe_sources(c: dict) -> dict:
    """The Megatron tensors of the MoE MLPs: {key: global shape}."""
    L, H, E, F, S = c["L"], c["H"], c["E"], c["F"], c["S"]
    sources = {M_ROUTER: (L, E, H), M_EXPERT_FC1: (L, E, 2 * F, H), M_EXPERT_FC2: (L, E, H, F)}
    if S:
        sources.update({M_SHARED_FC1: (L, 2 * S, H), M_SHARED_FC2: (L, H, S), M_SHARED_GATE: (L, 1, H)})
    return sources


def moe_layer(c: dict, i: int, layout: str) -> tuple[dict, list[Copy]]:
    """Layer i's MoE MLP: its Hugging Face targets ({name: shape}) and their copies from Megatron."""
    H, E, F, S = c["H"], c["E"], c["F"], c["S"]
    mixtral_hub = c["family"] == "mixtral" and layout == "per_expert"
    p = f"model.layers.{i}.{'block_sparse_moe' if mixtral_hub else 'mlp'}."
    targets = {f"{p}gate.weight": (E, H)}
    copies = rows(f"{p}gate.weight", [(M_ROUTER, 0, 0, E)], (H,), source_index=(i,))
    if layout == "fused":
        up, down = f"{p}experts.gate_up_proj", f"{p}experts.down_proj"
        targets.update({up: (E, 2 * F, H), down: (E, H, F)})
        copies += [Copy(whole(up, (E, 2 * F, H)), _at(M_EXPERT_FC1, (i,), (E, 2 * F, H))),
                   Copy(whole(down, (E, H, F)), _at(M_EXPERT_FC2, (i,), (E, H, F)))]
    else:
        names = ("w1", "w3", "w2") if mixtral_hub else ("gate_proj", "up_proj", "down_proj")
        for e in range(E):
            gate, up, down = (f"{p}experts.{e}.{n}.weight" for n in names)
            targets.update({gate: (F, H), up: (F, H), down: (H, F)})
            copies += rows(gate, [(M_EXPERT_FC1, 0, 0, F)], (H,), source_index=(i, e))
            copies += rows(up, [(M_EXPERT_FC1, F, 0, F)], (H,), source_index=(i, e))
            copies += rows(down, [(M_EXPERT_FC2, 0, 0, H)], (F,), source_index=(i, e))
    if S:
        q = f"{p}shared_expert."
        targets.update({f"{q}gate_proj.weight": (S, H), f"{q}up_proj.weight": (S, H),
                        f"{q}down_proj.weight": (H, S), f"{p}shared_expert_gate.weight": (1, H)})
        copies += rows(f"{q}gate_proj.weight", [(M_SHARED_FC1, 0, 0, S)], (H,), source_index=(i,))
        copies += rows(f"{q}up_proj.weight", [(M_SHARED_FC1, S, 0, S)], (H,), source_index=(i,))
        copies += rows(f"{q}down_proj.weight", [(M_SHARED_FC2, 0, 0, H)], (S,), source_index=(i,))
        copies += rows(f"{p}shared_expert_gate.weight", [(M_SHARED_GATE, 0, 0, 1)], (H,), source_index=(i,))
    return targets, copies


def _at(name: str, index: tuple[int, ...], shape: tuple[int, ...]) -> Region:
    """The box of stacked tensor `name` at leading `index`, holding one element of `shape`."""
    return Region(name, index + (0,) * len(shape), (1,) * len(index) + tuple(shape))
