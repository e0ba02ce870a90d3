"""The Llama family (Llama, Mistral, Qwen2: GQA, RMSNorm, SwiGLU, RoPE) and its mixtures of experts
(Mixtral, Qwen2-MoE, Qwen3-MoE with its q/k norms: the experts are moe.py's) between Megatron-core and
Hugging Face Transformers, declared from the Hugging Face config (an object or a config.json dict).

Megatron-core GPTModel (sharded state dict keys; docs/mapping.md lists the facts and their tests):

    embedding.word_embeddings.weight                         [V', H]   V' >= V: padded vocabulary
    decoder.layers.self_attention.linear_qkv.weight          [L, (h + 2g) * d, H]   per group: [q heads; k; v]
    decoder.layers.self_attention.linear_qkv.bias            [L, (h + 2g) * d]      (Qwen2, attention_bias)
    decoder.layers.self_attention.linear_qkv.layer_norm_weight   [L, H]             input RMSNorm
    decoder.layers.self_attention.linear_proj.weight         [L, H, h * d]
    decoder.layers.self_attention.{q,k}_layernorm.weight     [L, d]                 (Qwen3-MoE: q_norm, k_norm)
    decoder.layers.mlp.linear_fc1.layer_norm_weight          [L, H]                 post-attention RMSNorm
    decoder.layers.mlp.linear_fc1.weight                     [L, 2F, H]             [gate; up]
    decoder.layers.mlp.linear_fc2.weight                     [L, H, F]
    decoder.final_layernorm.weight                           [H]
    output_layer.weight                                      [V', H]   absent when tied to the embedding

Hugging Face: model.embed_tokens.weight [V, H], model.layers.<i>.self_attn.{q,k,v,o}_proj,
model.layers.<i>.mlp.{gate,up,down}_proj, model.layers.<i>.{input,post_attention}_layernorm,
model.norm.weight, lm_head.weight (tied: the embedding's tensor); with experts, the MLP is moe.py's.
"""

from __future__ import annotations

from typing import Any

from ..errors import MappingError
from .moe import LAYOUTS, M_PRE_MLP_NORM_TE, moe_dims, moe_layer, moe_sources
from .rules import Mapping, megatron_scheme, qkv_split, rename, rows, torch_scheme


def _get(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def _dims(config: Any) -> dict:
    need = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size")
    missing = [n for n in need if _get(config, n) is None]
    if missing:
        raise MappingError(f"the model config lacks {', '.join(missing)}: not a Llama-family config")
    h = _get(config, "num_attention_heads")
    hidden = _get(config, "hidden_size")
    g = _get(config, "num_key_value_heads") or h
    d = _get(config, "head_dim") or hidden // h
    if h % g:
        raise MappingError(f"the model config has {h} attention heads, not a multiple of its {g} key/value heads")
    model_type = _get(config, "model_type", "llama")
    attention_bias = bool(_get(config, "attention_bias", False))
    out = {"H": hidden, "h": h, "g": g, "d": d, "L": _get(config, "num_hidden_layers"),
           "F": _get(config, "intermediate_size"), "V": _get(config, "vocab_size"),
           "tied": bool(_get(config, "tie_word_embeddings", False)),
           "qkv_bias": model_type in ("qwen2", "qwen2_moe") or attention_bias, "o_bias": attention_bias,
           "mlp_bias": bool(_get(config, "mlp_bias", False)), "qk_norm": model_type == "qwen3_moe", "E": 0}
    experts = moe_dims(config)
    if experts:
        out.update(experts)
    return out


M_QKV = "decoder.layers.self_attention.linear_qkv"
M_PROJ = "decoder.layers.self_attention.linear_proj"
M_FC1 = "decoder.layers.mlp.linear_fc1"
M_FC2 = "decoder.layers.mlp.linear_fc2"
M_EMB = "embedding.word_embeddings.weight"
M_OUT = "output_layer.weight"
M_NORM = "decoder.final_layernorm.weight"
M_QNORM = "decoder.layers.self_attention.q_layernorm.weight"
M_KNORM = "decoder.layers.self_attention.k_layernorm.weight"


def megatron_to_hf(config: Any, *, padded_vocab_size: int | None = None, model: str = "model",
                   optimizer: str = "optimizer", step: int | None = None, experts: str = "fused"):
    """The mapping from a Megatron-core GPTModel checkpoint (with its DistributedOptimizer state in the
    `fully_reshardable` layout, if saved) to a Hugging Face Llama-family model saved/loaded by bcp as
    `{model: hf_model, optimizer: torch_optimizer}`. `padded_vocab_size`: the Megatron embedding's
    rows (default: whatever the checkpoint has, at least the config's vocab_size). `step`: the
    optimizer step to hand over if the checkpoint's common state does not say. `experts` (MoE
    families): "fused" for the 3-D expert parameters of transformers 5, "per_expert" for one
    nn.Linear per expert (earlier releases, and the layout of Hugging Face files)."""
    if experts not in LAYOUTS:
        raise MappingError(f"experts must be one of {', '.join(LAYOUTS)}, got {experts!r}")
    c = _dims(config)
    H, h, g, d, L, F, V = (c[k] for k in ("H", "h", "g", "d", "L", "F", "V"))
    if padded_vocab_size is not None and padded_vocab_size < V:
        raise MappingError(f"padded_vocab_size {padded_vocab_size} is smaller than the config's vocab_size {V}")
    Vp = padded_vocab_size
    qkv_rows = (h + 2 * g) * d
    sources: dict = {M_EMB: (Vp, H), M_NORM: (H,), f"{M_QKV}.weight": (L, qkv_rows, H),
                     f"{M_QKV}.layer_norm_weight": (L, H), f"{M_PROJ}.weight": (L, H, h * d),
                     f"{M_FC1}.layer_norm_weight": (L, H)}
    alternatives = {}
    if c["E"]:
        sources.update(moe_sources(c))
        # the pre-MLP norm: fused into linear_fc1's key by the local spec, its own module with Transformer Engine
        alternatives[f"{M_FC1}.layer_norm_weight"] = M_PRE_MLP_NORM_TE
    else:
        sources.update({f"{M_FC1}.weight": (L, 2 * F, H), f"{M_FC2}.weight": (L, H, F)})
    if c["qk_norm"]:
        sources.update({M_QNORM: (L, d), M_KNORM: (L, d)})
    targets: dict = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    copies = rows("model.embed_tokens.weight", [(M_EMB, 0, 0, V)], (H,))
    copies += rename(M_NORM, "model.norm.weight", (H,))
    if c["tied"]:
        copies += rows("lm_head.weight", [(M_EMB, 0, 0, V)], (H,))
    else:
        sources[M_OUT] = (Vp, H)
        copies += rows("lm_head.weight", [(M_OUT, 0, 0, V)], (H,))
    if c["qkv_bias"]:
        sources[f"{M_QKV}.bias"] = (L, qkv_rows)
    if c["o_bias"]:
        sources[f"{M_PROJ}.bias"] = (L, H)
    if c["mlp_bias"] and not c["E"]:
        sources[f"{M_FC1}.bias"] = (L, 2 * F)
        sources[f"{M_FC2}.bias"] = (L, H)
    for i in range(L):
        p = f"model.layers.{i}."
        q, k, v = (f"{p}self_attn.{x}_proj" for x in "qkv")
        targets.update({f"{q}.weight": (h * d, H), f"{k}.weight": (g * d, H), f"{v}.weight": (g * d, H),
                        f"{p}self_attn.o_proj.weight": (H, h * d),
                        f"{p}input_layernorm.weight": (H,), f"{p}post_attention_layernorm.weight": (H,)})
        copies += qkv_split(f"{M_QKV}.weight", f"{q}.weight", f"{k}.weight", f"{v}.weight", h, g, d, (H,), (i,))
        copies += rows(f"{p}self_attn.o_proj.weight", [(f"{M_PROJ}.weight", 0, 0, H)], (h * d,), source_index=(i,))
        if c["E"]:
            mlp_targets, mlp_copies = moe_layer(c, i, experts)
            targets.update(mlp_targets)
            copies += mlp_copies
        else:
            targets.update({f"{p}mlp.gate_proj.weight": (F, H), f"{p}mlp.up_proj.weight": (F, H),
                            f"{p}mlp.down_proj.weight": (H, F)})
            copies += rows(f"{p}mlp.gate_proj.weight", [(f"{M_FC1}.weight", 0, 0, F)], (H,), source_index=(i,))
            copies += rows(f"{p}mlp.up_proj.weight", [(f"{M_FC1}.weight", F, 0, F)], (H,), source_index=(i,))
            copies += rows(f"{p}mlp.down_proj.weight", [(f"{M_FC2}.weight", 0, 0, H)], (F,), source_index=(i,))
        if c["qk_norm"]:
            targets.update({f"{p}self_attn.q_norm.weight": (d,), f"{p}self_attn.k_norm.weight": (d,)})
            copies += rows(f"{p}self_attn.q_norm.weight", [(M_QNORM, 0, 0, d)], source_index=(i,))
            copies += rows(f"{p}self_attn.k_norm.weight", [(M_KNORM, 0, 0, d)], source_index=(i,))
        copies += rows(f"{p}input_layernorm.weight", [(f"{M_QKV}.layer_norm_weight", 0, 0, H)], source_index=(i,))
        copies += rows(f"{p}post_attention_layernorm.weight", [(f"{M_FC1}.layer_norm_weight", 0, 0, H)],
                       source_index=(i,))
        if c["qkv_bias"]:
            targets.update({f"{q}.bias": (h * d,), f"{k}.bias": (g * d,), f"{v}.bias": (g * d,)})
            copies += qkv_split(f"{M_QKV}.bias", f"{q}.bias", f"{k}.bias", f"{v}.bias", h, g, d, (), (i,))
        if c["o_bias"]:
            targets[f"{p}self_attn.o_proj.bias"] = (H,)
            copies += rows(f"{p}self_attn.o_proj.bias", [(f"{M_PROJ}.bias", 0, 0, H)], source_index=(i,))
        if c["mlp_bias"] and not c["E"]:
            targets.update({f"{p}mlp.gate_proj.bias": (F,), f"{p}mlp.up_proj.bias": (F,),
                            f"{p}mlp.down_proj.bias": (H,)})
            copies += rows(f"{p}mlp.gate_proj.bias", [(f"{M_FC1}.bias", 0, 0, F)], source_index=(i,))
            copies += rows(f"{p}mlp.up_proj.bias", [(f"{M_FC1}.bias", F, 0, F)], source_index=(i,))
            copies += rows(f"{p}mlp.down_proj.bias", [(f"{M_FC2}.bias", 0, 0, H)], source_index=(i,))
    return Mapping("megatron-to-hf", sources, targets, tuple(copies), megatron_scheme(),
                   torch_scheme(model, optimizer), frozenset({"lm_head.weight"}) if c["tied"] else frozenset(),
                   step=step, alternatives=alternatives)


def hf_to_megatron(config: Any, *, padded_vocab_size: int | None = None, model: str = "model",
                   optimizer: str = "optimizer", experts: str = "fused"):
    """The inverse of `megatron_to_hf`: a Hugging Face Llama-family checkpoint saved by bcp into a
    Megatron-core GPTModel's sharded state dict (and a DistributedOptimizer's `fully_reshardable`
    state: moments, and the fp32 master copy `param` from the weights). The embedding and output
    layer get the config's vocab_size rows, or `padded_vocab_size` with the extra rows zero
    (Megatron's own embedding allows a shape mismatch and zeroes them too). `experts`: the layout
    of the Hugging Face experts, as in `megatron_to_hf`; the pre-MLP norm of an MoE model is offered
    under both of Megatron's names (local and Transformer Engine specs)."""
    return megatron_to_hf(config, padded_vocab_size=padded_vocab_size, model=model, optimizer=optimizer,
                          experts=experts).inverse()
