"""The model families bcp declares mappings for: one `ModelFamily` entry each, in one registry, used by
`megatron_to_hf` / `hf_to_megatron` (decoder.py), `mapping="auto"` (auto.py) and `bcp export --mapping`.

An entry says what the family is called (the Hugging Face `model_type` values it serves), how to read
its dimensions from a Hugging Face config (`dims`), and its layout rules: which attention (grouped-query
`q/k/v/o_proj`, or DeepSeek's multi-latent attention), which biases and norms, whether its MLPs hold
experts and how Hugging Face names them. decoder.py turns an entry and a config into the copies of a
decoder-only transformer; a family that only recombines these rules needs nothing but its entry
(docs/mapping.md, "Adding a model family").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import MappingError


def get(config: Any, name: str, default: Any = None) -> Any:
    """A field of a Hugging Face config: an object or a config.json dict."""
    if isinstance(config, dict):
        value = config.get(name, default)
    else:
        value = getattr(config, name, default)
    return default if value is None else value


@dataclass(frozen=True)
class Dims:
    """The dimensions a mapping is declared from. H hidden size, heads, groups (key/value heads),
    head_dim, L layers, F the dense MLPs' FFN size, V vocabulary; `tied` embedding and output layer;
    `attention_bias` (q/k/v and o biases), `qkv_bias` (q/k/v only), `mlp_bias`. Mixtures of experts: E
    experts, `expert_ffn`, `shared_ffn` (0: no shared expert), `dense_layers` (layers whose MLP is dense
    in a model with experts). Multi-latent attention: `q_lora` (0: a plain q_proj), `kv_lora`, `qk_nope`,
    `qk_rope`, `v_head`."""

    H: int
    heads: int
    groups: int
    head_dim: int
    L: int
    F: int
    V: int
    tied: bool = False
    attention_bias: bool = False
    qkv_bias: bool = False
    mlp_bias: bool = False
    E: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    dense_layers: tuple[int, ...] = ()
    q_lora: int = 0
    kv_lora: int = 0
    qk_nope: int = 0
    qk_rope: int = 0
    v_head: int = 0

    def moe(self, layer: int) -> bool:
        """Whether `layer`'s MLP holds experts."""
        return self.E > 0 and layer not in self.dense_layers


@dataclass(frozen=True)
class ModelFamily:
    """One declared family. `name`: what docs and errors call it; `model_types`: the Hugging Face
    `model_type` values it serves; `dims(config) -> Dims`.

    Layout rules: `attention` "gqa" (`self_attn.{q,k,v,o}_proj`, Megatron's fused `linear_qkv`) or "mla"
    (DeepSeek's `q_a_proj`/`q_b_proj`, `kv_a_proj_with_mqa`/`kv_b_proj` and their norms); `qk_norm`:
    per-head q/k RMSNorms (Qwen3); `experts`: MoE MLPs. For those: `moe_module` / `expert_names`, how
    Hugging Face files (one tensor per expert) name the MoE block and one expert's gate, up and down
    linears (Mixtral: `block_sparse_moe`, w1/w3/w2; transformers 5's fused experts are always
    `mlp.experts.gate_up_proj` / `down_proj`); `shared_expert`: the shared expert's module name, or None;
    `shared_expert_gate`: its sigmoid gate's (Qwen2-MoE), or None; `router_bias`: the router's
    expert bias, a buffer (DeepSeek-V3's `gate.e_score_correction_bias`), or None."""

    name: str
    model_types: tuple[str, ...]
    dims: Callable[[Any], Dims]
    attention: str = "gqa"
    qk_norm: bool = False
    experts: bool = False
    moe_module: str = "mlp"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    shared_expert: str | None = None
    shared_expert_gate: str | None = None
    router_bias: str | None = None

    def __post_init__(self):
        if self.attention not in ("gqa", "mla"):
            raise ValueError(f"family {self.name!r}: attention must be 'gqa' or 'mla', not {self.attention!r}")


_FAMILIES: dict[str, ModelFamily] = {}  # model_type -> family


def register_family(family: ModelFamily) -> ModelFamily:
    """Declare `family` for its `model_types` (a later entry for a model_type replaces an earlier one)."""
    for model_type in family.model_types:
        _FAMILIES[model_type] = family
    return family


def family_of(config: Any) -> ModelFamily:
    """The family a Hugging Face config (object or dict) belongs to, by its `model_type`."""
    model_type = get(config, "model_type")
    if model_type is None and get(config, "hidden_size") is not None:
        model_type = "llama"  # a config dict without model_type: read as the plain decoder
    found = _FAMILIES.get(model_type)
    if found is None:
        raise MappingError(f"no declared mapping for a {model_type!r} model (declared: {', '.join(declared())}); "
                           "docs/mapping.md says how to add a family")
    return found


def declared() -> tuple[str, ...]:
    """The Hugging Face model_type values with a declared family."""
    return tuple(sorted(_FAMILIES))


# ----------------------------------------------------------------------------- reading dimensions

def _require(config: Any, names: tuple[str, ...], what: str) -> None:
    missing = [n for n in names if get(config, n) is None]
    if missing:
        raise MappingError(f"the model config lacks {', '.join(missing)}: not a {what} config")


def decoder_dims(config: Any, **more) -> Dims:
    """The dense decoder's dimensions (Llama, Mistral, Qwen2, Qwen3 and the attention of the others)."""
    _require(config, ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size"),
             "decoder-only transformer")
    H, h = get(config, "hidden_size"), get(config, "num_attention_heads")
    g = get(config, "num_key_value_heads", h)
    if h % g:
        raise MappingError(f"the model config has {h} attention heads, not a multiple of its {g} key/value heads")
    attention_bias = bool(get(config, "attention_bias", False))
    fields = dict(H=H, heads=h, groups=g, head_dim=get(config, "head_dim", H // h), L=get(config, "num_hidden_layers"),
                  F=get(config, "intermediate_size"), V=get(config, "vocab_size"),
                  tied=bool(get(config, "tie_word_embeddings", False)), attention_bias=attention_bias,
                  qkv_bias=attention_bias, mlp_bias=bool(get(config, "mlp_bias", False)))
    return Dims(**{**fields, **more})


def qwen2_dims(config: Any) -> Dims:
    """Qwen2: q/k/v biases always."""
    return decoder_dims(config, qkv_bias=True)


def mixtral_dims(config: Any) -> Dims:
    """Mixtral: experts in every layer, `intermediate_size` is an expert's FFN size."""
    E = get(config, "num_local_experts")
    if not E:
        raise MappingError("the mixtral config lacks its expert count (num_local_experts)")
    d = decoder_dims(config)
    return Dims(**{**d.__dict__, "E": E, "expert_ffn": d.F})


def qwen_moe_dims(config: Any) -> Dims:
    """Qwen2-MoE and Qwen3-MoE: `moe_intermediate_size` per expert, dense MLPs (`intermediate_size`) in
    the layers of `mlp_only_layers` and those `decoder_sparse_step` skips; Qwen2-MoE's shared expert."""
    family = get(config, "model_type")
    # transformers 5 keeps every family's expert count as num_local_experts (num_experts an alias of it)
    E, F = get(config, "num_local_experts") or get(config, "num_experts"), get(config, "moe_intermediate_size")
    if not E or not F:
        raise MappingError(f"the {family} config lacks its expert count or expert FFN size (num_experts or "
                           "num_local_experts, moe_intermediate_size)")
    d = decoder_dims(config, qkv_bias=family == "qwen2_moe" or bool(get(config, "attention_bias", False)))
    step = get(config, "decoder_sparse_step", 1)
    dense = set(get(config, "mlp_only_layers", ()) or ()) | {i for i in range(d.L) if (i + 1) % step}
    shared = get(config, "shared_expert_intermediate_size", 0) if family == "qwen2_moe" else 0
    return Dims(**{**d.__dict__, "E": E, "expert_ffn": F, "shared_ffn": shared, "dense_layers": tuple(sorted(dense))})


def deepseek_v3_dims(config: Any) -> Dims:
    """DeepSeek-V3: multi-latent attention, the first `first_k_dense_replace` layers dense, then experts
    with `n_shared_experts` shared ones of `moe_intermediate_size` each."""
    _require(config, ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"), "DeepSeek-V3")
    if not get(config, "rope_interleave", True):
        raise MappingError("the deepseek_v3 config has rope_interleave=False: Megatron's multi-latent attention "
                           "rotates interleaved pairs (rope_interleave=True), the other order is not declared")
    E = get(config, "n_routed_experts") or get(config, "num_local_experts")
    F = get(config, "moe_intermediate_size")
    if not E or not F:
        raise MappingError("the deepseek_v3 config lacks its expert count or expert FFN size (n_routed_experts, "
                           "moe_intermediate_size)")
    d = decoder_dims(config)
    if d.attention_bias:
        raise MappingError("the deepseek_v3 config has attention_bias=True: biases of the latent projections are not "
                           "declared")
    return Dims(**{**d.__dict__, "E": E, "expert_ffn": F, "shared_ffn": F * get(config, "n_shared_experts", 0),
                   "dense_layers": tuple(range(min(get(config, "first_k_dense_replace", 0), d.L))),
                   "q_lora": get(config, "q_lora_rank", 0), "kv_lora": get(config, "kv_lora_rank"),
                   "qk_nope": get(config, "qk_nope_head_dim"), "qk_rope": get(config, "qk_rope_head_dim"),
                   "v_head": get(config, "v_head_dim")})


# ----------------------------------------------------------------------------- the declared families

LLAMA = register_family(ModelFamily("Llama", ("llama",), decoder_dims))
MISTRAL = register_family(ModelFamily("Mistral", ("mistral",), decoder_dims))
QWEN2 = register_family(ModelFamily("Qwen2", ("qwen2",), qwen2_dims))
QWEN3 = register_family(ModelFamily("Qwen3", ("qwen3",), decoder_dims, qk_norm=True))
MIXTRAL = register_family(ModelFamily("Mixtral", ("mixtral",), mixtral_dims, experts=True,
                                      moe_module="block_sparse_moe", expert_names=("w1", "w3", "w2")))
QWEN2_MOE = register_family(ModelFamily("Qwen2-MoE", ("qwen2_moe",), qwen_moe_dims, experts=True,
                                        shared_expert="shared_expert", shared_expert_gate="shared_expert_gate"))
QWEN3_MOE = register_family(ModelFamily("Qwen3-MoE", ("qwen3_moe",), qwen_moe_dims, qk_norm=True, experts=True))
DEEPSEEK_V3 = register_family(ModelFamily("DeepSeek-V3", ("deepseek_v3",), deepseek_v3_dims, attention="mla",
                                          experts=True, shared_expert="shared_experts",
                                          router_bias="e_score_correction_bias"))
