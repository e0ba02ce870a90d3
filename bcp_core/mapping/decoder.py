"""Megatron-core's decoder-only transformers (GPTModel, HybridModel) <-> Hugging Face, for every family
of the registry (families.py): `megatron_to_hf(config)` and its inverse `hf_to_megatron(config)`.

A Hugging Face layer i is an attention block and an MLP. Megatron keeps them in one of three layouts
(`MegatronLayout`), each tensor named by its sharded state dict key:

    stacked    GPTModel with alike layers: decoder.layers.<name>, a leading layer axis [L, ...]
    per_layer  GPTModel whose layers differ (dense and MoE MLPs, DeepSeek-V3's first layers):
               decoder.layers.<i>.<name>
    hybrid     HybridModel: one sub-layer per layer number, in the order of its pattern ("*-*-":
               attention, MLP, ...); layer i is decoder.layers.<2i> (attention) and <2i+1> (MLP);
               its final norm is decoder.final_norm

Megatron names (per layer; the experts stacked on an axis of their own; `alt`: the name Transformer
Engine's or the local spec gives it; docs/mapping.md lists the facts and their tests):

    embedding.word_embeddings.weight                 [V', H]    V' >= V: padded vocabulary
    output_layer.weight                              [V', H]    absent when tied to the embedding
    decoder.final_layernorm.weight                   [H]        (hybrid: decoder.final_norm.weight)
    grouped-query attention ("gqa", HybridModel '*'):
      self_attention.linear_qkv.weight               [(h + 2g) d, H]   per group: [q heads; k; v]
      self_attention.linear_qkv.bias                 [(h + 2g) d]      (q/k/v biases)
      self_attention.linear_qkv.layer_norm_weight    [H]        input norm (alt input_layernorm.weight)
      self_attention.linear_proj.weight / .bias      [H, h d] / [H]
      self_attention.{q,k}_layernorm.weight          [d]        (Qwen3)
    multi-latent attention ("mla", HybridModel '+'):
      input_layernorm.weight                         [H]
      self_attention.linear_q_down_proj.weight       [q_lora, H]
      self_attention.q_layernorm.weight              [q_lora]   (alt linear_q_up_proj.layer_norm_weight)
      self_attention.linear_q_up_proj.weight         [h (nope + rope), q_lora]   per head [nope; rope]
      self_attention.linear_q_proj.weight            [h (nope + rope), H]        (without q_lora)
      self_attention.linear_kv_down_proj.weight      [kv_lora + rope, H]         [latent; shared rope key]
      self_attention.kv_layernorm.weight             [kv_lora]  (alt linear_kv_up_proj.layer_norm_weight)
      self_attention.linear_kv_up_proj.weight        [h (nope + v), kv_lora]     per head [k nope; v]
      self_attention.linear_proj.weight              [H, h v]
    dense MLP ('-'):
      mlp.linear_fc1.layer_norm_weight               [H]        pre-MLP norm (alt pre_mlp_layernorm.weight)
      mlp.linear_fc1.weight / .bias                  [2F, H]    [gate; up]
      mlp.linear_fc2.weight / .bias                  [H, F]
    MoE MLP ('E'): the same norm, and
      mlp.router.weight                              [E, H]
      mlp.router.expert_bias                         [E]        a buffer (DeepSeek-V3)
      mlp.experts.experts.linear_fc1.weight          [E, 2F, H] per expert [gate; up]
      mlp.experts.experts.linear_fc2.weight          [E, H, F]
      mlp.shared_experts.linear_fc1.weight           [2S, H]    [gate; up]
      mlp.shared_experts.linear_fc2.weight           [H, S]
      mlp.shared_experts.gate_weight                 [1, H]     sigmoid gate of the shared expert (Qwen2-MoE)
    multi-token prediction layer k (GPTModel): mtp.layers.<k>.{enorm,hnorm,final_layernorm}.weight [H],
      mtp.layers.<k>.eh_proj.weight [H, 2H], and a decoder layer under mtp.layers.<k>.transformer_layer.

Hugging Face: model.embed_tokens.weight, lm_head.weight (tied: the embedding's tensor), model.norm.weight;
layer i under model.layers.<i>.: input_layernorm, post_attention_layernorm, self_attn.{q,k,v,o}_proj or
the latent projections (q_a_proj, q_a_layernorm, q_b_proj or q_proj, kv_a_proj_with_mqa, kv_a_layernorm,
kv_b_proj, o_proj), mlp.{gate,up,down}_proj, or the MoE block: mlp.gate.weight (and its
e_score_correction_bias), the experts fused (transformers 5: mlp.experts.gate_up_proj [E, 2F, H],
mlp.experts.down_proj [E, H, F]) or one linear each (files: <moe>.experts.<e>.<gate, up, down>.weight),
the shared expert. The multi-token prediction layers are not part of a transformers model; its files
keep them as layers L + k (enorm, hnorm, eh_proj, shared_head.norm and a decoder layer), which
`MtpModel.from_pretrained` reads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..errors import MappingError
from .declaration import Mapping
from .families import Dims, ModelFamily, family_of, get
from .rules import Copy, Region, megatron_scheme, qkv_split, rename, rows, torch_scheme, whole

EXPERT_LAYOUTS = ("fused", "per_expert")
ATTENTION_SYMBOLS = {"gqa": "*", "mla": "+"}
DENSE, MOE = "-", "E"


@dataclass(frozen=True)
class MegatronLayout:
    """How a Megatron model lays out its layers in its sharded state dict: `kind` "stacked", "per_layer"
    or "hybrid" (module docstring); `pattern`: a HybridModel's layer symbols ('|' stage separators
    dropped)."""

    kind: str
    pattern: str = ""

    @classmethod
    def of(cls, layout: str | None, family: ModelFamily, d: Dims) -> MegatronLayout:
        """`layout` ("stacked", "per_layer", a HybridModel pattern, or None: GPTModel's own for the config)
        checked against the family and the config."""
        if layout is None:
            return cls("per_layer" if d.E and d.dense_layers else "stacked")
        if layout in ("stacked", "per_layer"):
            if layout == "stacked" and d.E and d.dense_layers:
                raise MappingError(f"the {family.name} config has dense MLP layers {list(d.dense_layers)} among its "
                                   "MoE layers: Megatron's GPTModel saves such a model per layer, not stacked")
            return cls(layout)
        if "/" in layout:
            raise MappingError(f"hybrid pattern {layout!r}: the multi-token prediction layers of a HybridModel "
                               "(after '/') are not declared")
        pattern = layout.replace("|", "")
        attention = ATTENTION_SYMBOLS[family.attention]
        want = "".join(attention + (MOE if d.moe(i) else DENSE) for i in range(d.L))
        if pattern != want:
            bad = next((i for i, (a, b) in enumerate(zip(pattern, want)) if a != b), min(len(pattern), len(want)))
            raise MappingError(
                f"hybrid pattern {layout!r} does not describe this {family.name} config: it needs {want!r} (each "
                f"Hugging Face layer an attention '{attention}', then a dense '-' or MoE 'E' MLP as the config "
                f"says; {d.L} layers), and differs at layer number {bad}")
        return cls("hybrid", pattern)

    def prefix(self, layer: int, part: str) -> tuple[str, bool]:
        """The key prefix of Hugging Face layer `layer`'s `part` ("attention" or "mlp"), and whether its
        tensors are stacked (a leading layer axis, index `layer`)."""
        if self.kind == "stacked":
            return "decoder.layers.", True
        if self.kind == "hybrid":
            return f"decoder.layers.{2 * layer + (part == 'mlp')}.", False
        return f"decoder.layers.{layer}.", False

    @property
    def final_norm(self) -> str:
        return "decoder.final_norm.weight" if self.kind == "hybrid" else "decoder.final_layernorm.weight"


def layout_of(keys) -> tuple[str, int]:
    """The layout (`megatron_to_hf`'s `layout`) and the number of multi-token prediction layers of a
    Megatron checkpoint, from its tensor names."""
    model = [k for k in keys if not k.startswith(("optimizer.", "chained_"))]
    mtp = {int(m[1]) for m in (re.match(r"mtp\.layers\.(\d+)\.enorm\.weight$", k) for k in model) if m}
    layers: dict[int, set] = {}
    for k in model:
        found = re.match(r"decoder\.layers\.(\d+)\.(.*)$", k)
        if found:
            layers.setdefault(int(found[1]), set()).add(found[2])
    if "decoder.final_norm.weight" not in model:
        return ("per_layer" if layers else "stacked"), len(mtp)
    symbols = []
    marks = (("self_attention.linear_qkv.weight", "*"), ("self_attention.linear_kv_down_proj.weight", "+"),
             ("mlp.router.weight", MOE), ("mlp.linear_fc1.weight", DENSE))
    for i in range(max(layers, default=-1) + 1):
        names = layers.get(i, set())
        symbol = next((s for name, s in marks if name in names), None)
        if symbol is None:
            raise MappingError(f"layer {i} of the HybridModel checkpoint is no attention ('*', '+') or MLP ('-', 'E') "
                               f"layer (it holds {sorted(names)[:4]}): only those are declared")
        symbols.append(symbol)
    return "".join(symbols), len(mtp)


class _Builder:
    """The copies of one mapping, declared as they are added (module docstring: the names)."""

    def __init__(self, family: ModelFamily, d: Dims, layout: MegatronLayout, experts: str):
        self.f, self.d, self.layout, self.experts = family, d, layout, experts
        self.sources: dict = {}
        self.targets: dict = {}
        self.copies: list[Copy] = []
        self.alternatives: dict[str, str] = {}
        self.no_state: set[str] = set()

    # -- declaring one tensor of each side

    def mg(self, prefix: str, stacked: bool, name: str, shape: tuple, alt: str | None = None) -> tuple[str, tuple]:
        """Megatron tensor `name` of the layer at `prefix` (stacked: its leading index is added by the
        caller), declared; returns its key and the shape of one layer's part."""
        key = prefix + name
        self.sources[key] = (self.d.L, *shape) if stacked else tuple(shape)
        if alt is not None:
            self.alternatives[key] = prefix + alt
        return key, tuple(shape)

    def hf(self, name: str, shape: tuple) -> str:
        self.targets[name] = tuple(shape)
        return name

    def same(self, hf_name: str, prefix: str, stacked: bool, index: tuple, name: str, shape: tuple,
             alt: str | None = None, no_state: bool = False) -> None:
        """Hugging Face `hf_name` := Megatron `name` of one layer, element for element."""
        key, shape = self.mg(prefix, stacked, name, shape, alt)
        self.hf(hf_name, shape)
        self.copies.append(Copy(whole(hf_name, shape), _at(key, index, shape)))
        if no_state:
            self.no_state |= {hf_name, key}

    def halves(self, gate: str, up: str, prefix: str, stacked: bool, index: tuple, name: str, F: int, H: int) -> None:
        """Hugging Face `gate` and `up` [F, H] := the two row halves of Megatron's [gate; up] `name` [2F, H]."""
        key, _ = self.mg(prefix, stacked, name, (2 * F, H))
        self.hf(gate, (F, H))
        self.hf(up, (F, H))
        self.copies += rows(gate, [(key, 0, 0, F)], (H,), source_index=index)
        self.copies += rows(up, [(key, F, 0, F)], (H,), source_index=index)

    # -- the parts of a decoder

    def layer(self, hf: str, attention: tuple[str, bool], mlp: tuple[str, bool], index: tuple, moe: bool) -> None:
        """One Hugging Face layer (prefix `hf`) from Megatron's attention and MLP parts ((prefix, stacked))."""
        (self.mla if self.f.attention == "mla" else self.gqa)(hf, *attention, index)
        self.same(f"{hf}post_attention_layernorm.weight", *mlp, index, "mlp.linear_fc1.layer_norm_weight",
                  (self.d.H,), alt="pre_mlp_layernorm.weight")
        (self.moe if moe else self.dense)(hf, *mlp, index)

    def gqa(self, hf: str, prefix: str, stacked: bool, index: tuple) -> None:
        d, H = self.d, self.d.H
        h, g, hd = d.heads, d.groups, d.head_dim
        a = f"{hf}self_attn."
        q, k, v = (self.hf(f"{a}{x}_proj.weight", (n * hd, H)) for x, n in (("q", h), ("k", g), ("v", g)))
        qkv, _ = self.mg(prefix, stacked, "self_attention.linear_qkv.weight", ((h + 2 * g) * hd, H))
        self.copies += qkv_split(qkv, q, k, v, h, g, hd, (H,), index)
        self.same(f"{hf}input_layernorm.weight", prefix, stacked, index, "self_attention.linear_qkv.layer_norm_weight",
                  (H,), alt="input_layernorm.weight")
        self.same(f"{a}o_proj.weight", prefix, stacked, index, "self_attention.linear_proj.weight", (H, h * hd))
        if d.qkv_bias:
            qb, kb, vb = (self.hf(f"{a}{x}_proj.bias", (n * hd,)) for x, n in (("q", h), ("k", g), ("v", g)))
            bias, _ = self.mg(prefix, stacked, "self_attention.linear_qkv.bias", ((h + 2 * g) * hd,))
            self.copies += qkv_split(bias, qb, kb, vb, h, g, hd, (), index)
        if d.attention_bias:
            self.same(f"{a}o_proj.bias", prefix, stacked, index, "self_attention.linear_proj.bias", (H,))
        if self.f.qk_norm:
            self.same(f"{a}q_norm.weight", prefix, stacked, index, "self_attention.q_layernorm.weight", (hd,))
            self.same(f"{a}k_norm.weight", prefix, stacked, index, "self_attention.k_layernorm.weight", (hd,))

    def mla(self, hf: str, prefix: str, stacked: bool, index: tuple) -> None:
        d, H = self.d, self.d.H
        a, s = f"{hf}self_attn.", "self_attention."
        q_rows = d.heads * (d.qk_nope + d.qk_rope)
        self.same(f"{hf}input_layernorm.weight", prefix, stacked, index, "input_layernorm.weight", (H,))
        if d.q_lora:
            self.same(f"{a}q_a_proj.weight", prefix, stacked, index, f"{s}linear_q_down_proj.weight", (d.q_lora, H))
            self.same(f"{a}q_a_layernorm.weight", prefix, stacked, index, f"{s}q_layernorm.weight", (d.q_lora,),
                      alt=f"{s}linear_q_up_proj.layer_norm_weight")
            self.same(f"{a}q_b_proj.weight", prefix, stacked, index, f"{s}linear_q_up_proj.weight", (q_rows, d.q_lora))
        else:
            self.same(f"{a}q_proj.weight", prefix, stacked, index, f"{s}linear_q_proj.weight", (q_rows, H))
        self.same(f"{a}kv_a_proj_with_mqa.weight", prefix, stacked, index, f"{s}linear_kv_down_proj.weight",
                  (d.kv_lora + d.qk_rope, H))
        self.same(f"{a}kv_a_layernorm.weight", prefix, stacked, index, f"{s}kv_layernorm.weight", (d.kv_lora,),
                  alt=f"{s}linear_kv_up_proj.layer_norm_weight")
        self.same(f"{a}kv_b_proj.weight", prefix, stacked, index, f"{s}linear_kv_up_proj.weight",
                  (d.heads * (d.qk_nope + d.v_head), d.kv_lora))
        self.same(f"{a}o_proj.weight", prefix, stacked, index, f"{s}linear_proj.weight", (H, d.heads * d.v_head))

    def dense(self, hf: str, prefix: str, stacked: bool, index: tuple) -> None:
        d, H, F = self.d, self.d.H, self.d.F
        m = f"{hf}mlp."
        self.halves(f"{m}gate_proj.weight", f"{m}up_proj.weight", prefix, stacked, index, "mlp.linear_fc1.weight", F, H)
        self.same(f"{m}down_proj.weight", prefix, stacked, index, "mlp.linear_fc2.weight", (H, F))
        if d.mlp_bias:
            key, _ = self.mg(prefix, stacked, "mlp.linear_fc1.bias", (2 * F,))
            for name, row in (("gate_proj", 0), ("up_proj", F)):
                self.copies += rows(self.hf(f"{m}{name}.bias", (F,)), [(key, row, 0, F)], source_index=index)
            self.same(f"{m}down_proj.bias", prefix, stacked, index, "mlp.linear_fc2.bias", (H,))

    def moe(self, hf: str, prefix: str, stacked: bool, index: tuple) -> None:
        d, f, H, E, F = self.d, self.f, self.d.H, self.d.E, self.d.expert_ffn
        files = self.experts == "per_expert"
        m = f"{hf}{f.moe_module if files else 'mlp'}."
        self.same(f"{m}gate.weight", prefix, stacked, index, "mlp.router.weight", (E, H))
        if f.router_bias:
            self.same(f"{m}gate.{f.router_bias}", prefix, stacked, index, "mlp.router.expert_bias", (E,), no_state=True)
        fc1, _ = self.mg(prefix, stacked, "mlp.experts.experts.linear_fc1.weight", (E, 2 * F, H))
        fc2, _ = self.mg(prefix, stacked, "mlp.experts.experts.linear_fc2.weight", (E, H, F))
        if files:
            gate, up, down = f.expert_names
            for e in range(E):
                x, at = f"{m}experts.{e}.", (*index, e)
                self.copies += rows(self.hf(f"{x}{gate}.weight", (F, H)), [(fc1, 0, 0, F)], (H,), source_index=at)
                self.copies += rows(self.hf(f"{x}{up}.weight", (F, H)), [(fc1, F, 0, F)], (H,), source_index=at)
                self.copies += rows(self.hf(f"{x}{down}.weight", (H, F)), [(fc2, 0, 0, H)], (F,), source_index=at)
        else:
            up, down = self.hf(f"{m}experts.gate_up_proj", (E, 2 * F, H)), self.hf(f"{m}experts.down_proj", (E, H, F))
            self.copies += [Copy(whole(up, (E, 2 * F, H)), _at(fc1, index, (E, 2 * F, H))),
                            Copy(whole(down, (E, H, F)), _at(fc2, index, (E, H, F)))]
        if d.shared_ffn:
            S, x = d.shared_ffn, f"{m}{f.shared_expert}."
            self.halves(f"{x}gate_proj.weight", f"{x}up_proj.weight", prefix, stacked, index,
                        "mlp.shared_experts.linear_fc1.weight", S, H)
            self.same(f"{x}down_proj.weight", prefix, stacked, index, "mlp.shared_experts.linear_fc2.weight", (H, S))
            if f.shared_expert_gate:
                self.same(f"{m}{f.shared_expert_gate}.weight", prefix, stacked, index,
                          "mlp.shared_experts.gate_weight", (1, H))

    def mtp(self, k: int) -> None:
        """Multi-token prediction layer k of a GPTModel: its norms and projection, and a decoder layer."""
        H, p, hf = self.d.H, f"mtp.layers.{k}.", f"model.layers.{self.d.L + k}."
        for name, theirs, shape in (("enorm.weight", "enorm.weight", (H,)), ("hnorm.weight", "hnorm.weight", (H,)),
                                    ("eh_proj.weight", "eh_proj.weight", (H, 2 * H)),
                                    ("final_layernorm.weight", "shared_head.norm.weight", (H,))):
            self.same(f"{hf}{theirs}", p, False, (), name, shape)
        inner = (f"{p}transformer_layer.", False)
        self.layer(hf, inner, inner, (), self.d.moe(self.d.L + k))


def _at(name: str, index: tuple[int, ...], shape: tuple[int, ...]) -> Region:
    """The box of `name` at leading `index` (stacked tensors; () for a tensor of one layer) holding `shape`."""
    return Region(name, tuple(index) + (0,) * len(shape), (1,) * len(index) + tuple(shape))


def megatron_to_hf(config: Any, *, layout: str | None = None, padded_vocab_size: int | None = None,
                   model: str = "model", optimizer: str = "optimizer", step: int | None = None,
                   experts: str = "fused", mtp_layers: int = 0) -> Mapping:
    """The mapping from a Megatron-core checkpoint (GPTModel or HybridModel, with its DistributedOptimizer
    state in the `fully_reshardable` layout, if saved) to the Hugging Face model of a declared family
    (families.py) that `config` (an object or a config.json dict) describes, saved/loaded by bcp as
    `{model: hf_model, optimizer: torch_optimizer}`.

    `layout`: how the Megatron model lays out its layers (module docstring): "stacked", "per_layer", or
    a HybridModel's pattern ("*-*-", "+-+E"); default: what GPTModel saves for the config (stacked,
    per layer where dense and MoE layers mix). `padded_vocab_size`: the Megatron embedding's rows
    (default: whatever the checkpoint has, at least the config's vocab_size). `step`: the optimizer
    step to hand over if the checkpoint's common state does not say. `experts` (MoE families): "fused"
    for transformers 5's 3-D expert parameters, "per_expert" for one linear per expert (earlier
    releases, and the layout of Hugging Face files). `mtp_layers`: how many multi-token prediction
    layers to map (GPTModel's `mtp.layers.<k>`, the files' layers L + k); a transformers model holds
    none."""
    if experts not in EXPERT_LAYOUTS:
        raise MappingError(f"experts must be one of {', '.join(EXPERT_LAYOUTS)}, got {experts!r}")
    family = family_of(config)
    d = family.dims(config)
    lay = MegatronLayout.of(layout, family, d)
    if mtp_layers and lay.kind == "hybrid":
        raise MappingError("the multi-token prediction layers of a HybridModel are not declared")
    if padded_vocab_size is not None and padded_vocab_size < d.V:
        raise MappingError(f"padded_vocab_size {padded_vocab_size} is smaller than the config's vocab_size {d.V}")
    b = _Builder(family, d, lay, experts)
    H, V, Vp = d.H, d.V, padded_vocab_size
    emb = "embedding.word_embeddings.weight"
    b.sources[emb] = (Vp, H)
    b.copies += rows(b.hf("model.embed_tokens.weight", (V, H)), [(emb, 0, 0, V)], (H,))
    b.sources[lay.final_norm] = (H,)
    b.copies += rename(lay.final_norm, b.hf("model.norm.weight", (H,)), (H,))
    if d.tied:
        b.copies += rows(b.hf("lm_head.weight", (V, H)), [(emb, 0, 0, V)], (H,))
    else:
        b.sources["output_layer.weight"] = (Vp, H)
        b.copies += rows(b.hf("lm_head.weight", (V, H)), [("output_layer.weight", 0, 0, V)], (H,))
    for i in range(d.L):
        (pa, sa), (pm, sm) = lay.prefix(i, "attention"), lay.prefix(i, "mlp")
        if sa != sm:
            raise AssertionError("attention and MLP of one layer are both stacked or neither")
        b.layer(f"model.layers.{i}.", (pa, sa), (pm, sm), (i,) if sa else (), d.moe(i))
    for k in range(mtp_layers):
        b.mtp(k)
    return Mapping(f"megatron-to-hf ({family.name})", b.sources, b.targets, tuple(b.copies), megatron_scheme(),
                   torch_scheme(model, optimizer), frozenset({"lm_head.weight"}) if d.tied else frozenset(),
                   step=step, alternatives=b.alternatives, no_state=frozenset(b.no_state), complete=True,
                   leaves=_leaves(family, d, lay, mtp_layers))


def _leaves(family: ModelFamily, d: Dims, lay: MegatronLayout, mtp_layers: int) -> tuple:
    """The Megatron tensors `megatron_to_hf` does not read (`Mapping.leaves`): by design, the multi-token
    prediction layers where none are mapped (a transformers model holds none); else, for the error, what
    of the config disagrees with a checkpoint holding them."""
    def beyond(prefix: str, n: int) -> str:  # a layer number >= n (n >= 1)
        return rf"{re.escape(prefix)}(?!(?:{'|'.join(map(str, range(n)))})\.)\d+\."

    out: list[tuple[str, str | None]] = [] if mtp_layers else [(r"mtp\.", None)]
    if d.tied:
        out.append((r"output_layer\.weight$", "the config's tie_word_embeddings=true makes lm_head the embedding, "
                                              "and this checkpoint's output layer is its own: set "
                                              "tie_word_embeddings=false"))
    if family.attention == "gqa" and not d.qkv_bias:
        out.append((r".*self_attention\.linear_qkv\.bias$", "the config declares no q/k/v biases (attention_bias="
                                                            "false), which this checkpoint has"))
    if not d.attention_bias:
        out.append((r".*self_attention\.linear_proj\.bias$", "the config declares no o_proj bias (attention_bias="
                                                             "false), which this checkpoint has"))
    if not d.mlp_bias:
        out.append((r".*mlp\.linear_fc[12]\.bias$", "the config declares no MLP biases (mlp_bias=false), which this "
                                                     "checkpoint has"))
    if family.attention == "gqa" and not family.qk_norm:
        out.append((r".*self_attention\.[qk]_layernorm\.weight$", f"a {family.name} config declares no per-head q/k "
                    "norms (Qwen3's do): is the checkpoint of another family?"))
    if not family.router_bias:
        out.append((r".*mlp\.router\.expert_bias$", f"a {family.name} config declares no router expert bias"))
    if not d.shared_ffn:
        out.append((r".*mlp\.shared_experts\.", "the config declares no shared expert"))
    if lay.kind != "stacked":
        out.append((beyond("decoder.layers.", d.L * (2 if lay.kind == "hybrid" else 1)),
                    f"the config declares num_hidden_layers={d.L}"))
    if mtp_layers:
        out.append((beyond("mtp.layers.", mtp_layers), f"{mtp_layers} multi-token prediction layer(s) are mapped "
                                                       "(num_nextn_predict_layers)"))
    return tuple(out)


def hf_to_megatron(config: Any, *, layout: str | None = None, padded_vocab_size: int | None = None,
                   model: str = "model", optimizer: str = "optimizer", experts: str = "fused",
                   mtp_layers: int = 0) -> Mapping:
    """The inverse of `megatron_to_hf`: a Hugging Face checkpoint saved by bcp into a Megatron-core
    GPTModel's or HybridModel's sharded state dict (and a DistributedOptimizer's `fully_reshardable`
    state: moments, and the fp32 master copy `param` from the weights). The embedding and output
    layer get the config's vocab_size rows, or `padded_vocab_size` with the extra rows zero
    (Megatron's own embedding allows a shape mismatch and zeroes them too). A tensor Megatron's
    layer specs name two ways (the local spec's and Transformer Engine's) is offered under both."""
    return megatron_to_hf(config, layout=layout, padded_vocab_size=padded_vocab_size, model=model,
                          optimizer=optimizer, experts=experts, mtp_layers=mtp_layers).inverse()


def megatron_to_hf_files(config: Any, keys) -> Mapping:
    """`megatron_to_hf` as `bcp export --mapping` writes a Megatron checkpoint (tensor names `keys`) to
    Hugging Face files: in the layout the names show, with its multi-token prediction layers (the config
    must declare as many: `num_nextn_predict_layers`, which `MtpModel.from_pretrained` reads), the
    experts one tensor each (the layout of Hugging Face files, which every transformers release reads),
    weights only."""
    layout, mtp = layout_of(keys)
    declared_mtp = get(config, "num_nextn_predict_layers", get(config, "num_mtp_layers", 0))
    if mtp != declared_mtp and (mtp or family_of(config).attention == "mla"):
        raise MappingError(f"the config declares {declared_mtp} multi-token prediction layer(s) "
                           f"(num_nextn_predict_layers), the checkpoint holds {mtp}: set it to {mtp}")
    return megatron_to_hf(config, layout=layout, experts="per_expert", mtp_layers=mtp)
