"""DeepSeek-V3 (multi-latent attention, MoE with shared experts and the router's expert bias, dense first
layers, multi-token prediction) and HybridModel layouts between Megatron-core and Hugging Face, one process,
against Megatron layouts built by hand with plain torch ops from the layout facts (docs/mapping.md),
independently of the mapping code. tests/test_megatron_deepseek.py checks the same facts on real
Megatron-core models.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import pytest
import torch

import bcp_core as bcp
import hf_steps

transformers = pytest.importorskip("transformers")
# with the integration, checkpoints are recorded as Megatron's (what mapping="auto" goes by); imported only when
# saving: a rank of another test module that imports this one may still pick its megatron-core release
_megatron = importlib.util.find_spec("megatron") is not None


def saved_by() -> str:
    if not _megatron:
        return "plain"
    import bcp_integrations.megatron  # noqa: F401 - registers framework "megatron"
    return "megatron"

VOCAB, PADDED, HIDDEN, HEADS, LAYERS, EXPERTS = 100, 128, 32, 4, 3, 4
Q_LORA, KV_LORA, NOPE, ROPE, V_HEAD, EXPERT_FFN, DENSE_FFN = 16, 12, 8, 4, 6, 16, 48


def ds_config(**over):
    dims = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=DENSE_FFN, moe_intermediate_size=EXPERT_FFN,
                num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS, n_shared_experts=1,
                n_routed_experts=EXPERTS, routed_scaling_factor=2.5, kv_lora_rank=KV_LORA, q_lora_rank=Q_LORA,
                qk_rope_head_dim=ROPE, v_head_dim=V_HEAD, qk_nope_head_dim=NOPE, n_group=2, topk_group=1,
                num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=32, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, num_mtp_layers=0)
    return transformers.DeepseekV3Config(**{**dims, **over})


def ds_model(config, seed=0):
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, router biases away from 0: a misplaced one shows in the logits
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif n.endswith("gate.weight"):
                p.normal_(0, 0.5)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.uniform_(-0.1, 0.1)
    return model


def attention_part(sd: dict, i: int, p: str) -> dict:
    """Megatron's MLA tensors of Hugging Face layer i (state dict `sd`), under the key prefix `p`."""
    a = f"model.layers.{i}.self_attn."
    return {f"{p}input_layernorm.weight": sd[f"model.layers.{i}.input_layernorm.weight"],
            f"{p}self_attention.linear_q_down_proj.weight": sd[f"{a}q_a_proj.weight"],
            f"{p}self_attention.q_layernorm.weight": sd[f"{a}q_a_layernorm.weight"],
            f"{p}self_attention.linear_q_up_proj.weight": sd[f"{a}q_b_proj.weight"],
            f"{p}self_attention.linear_kv_down_proj.weight": sd[f"{a}kv_a_proj_with_mqa.weight"],
            f"{p}self_attention.kv_layernorm.weight": sd[f"{a}kv_a_layernorm.weight"],
            f"{p}self_attention.linear_kv_up_proj.weight": sd[f"{a}kv_b_proj.weight"],
            f"{p}self_attention.linear_proj.weight": sd[f"{a}o_proj.weight"]}


def mlp_part(sd: dict, i: int, p: str, norm: str) -> dict:
    """Megatron's MLP tensors of Hugging Face layer i: dense [gate; up], or the router (and its expert bias),
    the experts stacked on their own axis and the shared expert's [gate; up]; the pre-MLP norm named `norm`."""
    m = f"model.layers.{i}.mlp."
    out = {f"{p}{norm}": sd[f"model.layers.{i}.post_attention_layernorm.weight"]}
    if f"{m}gate_proj.weight" in sd:
        out[f"{p}mlp.linear_fc1.weight"] = torch.cat([sd[f"{m}gate_proj.weight"], sd[f"{m}up_proj.weight"]])
        out[f"{p}mlp.linear_fc2.weight"] = sd[f"{m}down_proj.weight"]
        return out
    out |= {f"{p}mlp.router.weight": sd[f"{m}gate.weight"],
            f"{p}mlp.experts.experts.linear_fc1.weight": sd[f"{m}experts.gate_up_proj"],
            f"{p}mlp.experts.experts.linear_fc2.weight": sd[f"{m}experts.down_proj"],
            f"{p}mlp.shared_experts.linear_fc1.weight": torch.cat([sd[f"{m}shared_experts.gate_proj.weight"],
                                                                   sd[f"{m}shared_experts.up_proj.weight"]]),
            f"{p}mlp.shared_experts.linear_fc2.weight": sd[f"{m}shared_experts.down_proj.weight"]}
    if f"{m}gate.e_score_correction_bias" in sd:
        out[f"{p}mlp.router.expert_bias"] = sd[f"{m}gate.e_score_correction_bias"]
    return out


def megatron_ds_layout(sd: dict, L: int, layout: str = "gpt", prefix: str = "", padded: int = PADDED,
                       mtp: dict | None = None) -> dict:
    """The Megatron tensors of a Hugging Face DeepSeek-V3 state dict, by hand. layout "gpt": GPTModel,
    per layer (dense and MoE layers differ), the local spec's norm names; "hybrid": HybridModel "+-+E+E",
    layer i's attention at layer number 2i and its MLP at 2i + 1, Transformer Engine's norm names. `mtp`:
    the state dict of a multi-token prediction layer in the files' names (model.layers.<L>...)."""
    def pad(t):
        return torch.cat([t, torch.full((padded - t.shape[0], t.shape[1]), 7.0)])  # junk in the padding rows

    out = {"embedding.word_embeddings.weight": pad(sd["model.embed_tokens.weight"]),
           "output_layer.weight": pad(sd["lm_head.weight"])}
    for i in range(L):
        if layout == "gpt":
            out |= attention_part(sd, i, f"decoder.layers.{i}.") | mlp_part(sd, i, f"decoder.layers.{i}.",
                                                                             "pre_mlp_layernorm.weight")
        else:
            dense = f"model.layers.{i}.mlp.gate_proj.weight" in sd
            out |= attention_part(sd, i, f"decoder.layers.{2 * i}.") | mlp_part(
                sd, i, f"decoder.layers.{2 * i + 1}.",
                "mlp.linear_fc1.layer_norm_weight" if dense else "pre_mlp_layernorm.weight")
    out["decoder.final_layernorm.weight" if layout == "gpt" else "decoder.final_norm.weight"] = sd["model.norm.weight"]
    if mtp is not None:
        out |= mtp_part(mtp, L)
    return {prefix + k: v.clone() for k, v in out.items()}


def mtp_part(mtp: dict, L: int, prefix: str = "") -> dict:
    """GPTModel's mtp.layers.0 from the files' layer L."""
    p, f = "mtp.layers.0.", f"model.layers.{L}."
    out = {f"{p}enorm.weight": mtp[f"{f}enorm.weight"], f"{p}hnorm.weight": mtp[f"{f}hnorm.weight"],
           f"{p}eh_proj.weight": mtp[f"{f}eh_proj.weight"],
           f"{p}final_layernorm.weight": mtp[f"{f}shared_head.norm.weight"]}
    out |= attention_part(mtp, L, f"{p}transformer_layer.") | mlp_part(mtp, L, f"{p}transformer_layer.",
                                                                         "pre_mlp_layernorm.weight")
    return {prefix + k: v.clone() for k, v in out.items()}


trained = functools.partial(hf_steps.trained, vocab=VOCAB)
train_step = functools.partial(hf_steps.train_step, vocab=VOCAB)
logits = functools.partial(hf_steps.logits, vocab=VOCAB)
moments_by_name = hf_steps.moments_by_name


def mtp_state(config, seed=3) -> dict:
    """A multi-token prediction layer's tensors as DeepSeek-V3's files name them (layer L: enorm, hnorm,
    eh_proj, shared_head.norm and an MoE decoder layer), from transformers' own MTP module."""
    from transformers.modeling_layers import MtpModel
    torch.manual_seed(seed)
    main = transformers.DeepseekV3ForCausalLM(config)
    mtp = MtpModel(main, 1)
    L, out = config.num_hidden_layers, {}
    for n, t in mtp.state_dict().items():
        if not n.startswith("layers.0."):
            continue  # the embedding and head: the main model's
        n = n.removeprefix("layers.0.").removeprefix("mtp_block.").replace("post_norm.", "shared_head.norm.")
        out[f"model.layers.{L}.{n}"] = t.detach().clone().uniform_(-1, 1)
    return out


def megatron_checkpoint(path, model, opt=None, layout="gpt", mtp=None, mtp_moments=None):
    """A bcp checkpoint keyed as Megatron saves the model and its fully_reshardable DistOpt state, the step in
    common.pt (megatron-core up to 0.18)."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    L = model.config.num_hidden_layers
    state = megatron_ds_layout(sd, L, layout, mtp=mtp)
    if opt is not None:
        for name, by_param in moments_by_name(model, opt).items():
            moments = by_param | {k: v for k, v in sd.items() if k.endswith("e_score_correction_bias")}
            state |= {k: v for k, v in megatron_ds_layout(moments, L, layout, f"optimizer.state.{name}.",
                                                          mtp=(mtp_moments or {}).get(name)).items()
                      if not k.endswith("expert_bias")}  # a buffer: no optimizer state
        state |= {k: v for k, v in megatron_ds_layout(sd, L, layout, "optimizer.state.param.", mtp=mtp).items()
                  if not k.endswith("expert_bias")}
    bcp.save(str(path), state, framework=saved_by()).wait()
    if opt is not None:
        step = int(next(iter(opt.state.values()))["step"])
        torch.save({"optimizer": {"optimizer": {"param_groups": [{"lr": 1e-2, "step": step}]}}},
                   os.path.join(path, "common.pt"))


def assert_same_training_state(src, opt, dst, dst_opt) -> None:
    for (n, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
        assert torch.equal(a, b), n
    assert torch.equal(logits(src), logits(dst))
    want, got = moments_by_name(src, opt), moments_by_name(dst, dst_opt)
    for k in want:
        assert want[k].keys() == got[k].keys()
        for n in want[k]:
            assert torch.equal(want[k][n], got[k][n]), (k, n)
    assert {float(s["step"]) for s in dst_opt.state.values()} == {2.0}
    assert len(dst_opt.state) == len(opt.state) == len(list(src.parameters()))


# ----------------------------------------------------------------------------- Megatron -> Hugging Face

@pytest.mark.parametrize("layout", ["gpt", "hybrid"])
def test_megatron_deepseek_layout_loads_into_hf_with_optimizer_state(tmp_path, layout):
    """GPTModel per layer (the first layer dense) and HybridModel "+-+E+E": MLA projections and their norms,
    router and expert bias, experts, shared experts: weights, logits, Adam moments per expert, step; one
    more AdamW step goes the same way."""
    src = ds_model(ds_config())
    opt = trained(src)
    megatron_checkpoint(tmp_path, src, opt, layout)
    dst = ds_model(ds_config(), seed=1)
    dst_opt = torch.optim.AdamW(dst.parameters(), lr=1e-2)
    m = bcp.mapping.megatron_to_hf(dst.config, layout="+-+E+E" if layout == "hybrid" else None)
    bcp.load(str(tmp_path), {"model": dst, "optimizer": dst_opt}, mapping=m)
    assert_same_training_state(src, opt, dst, dst_opt)
    if not _megatron:
        return
    # mapping="auto" reads the layout from the checkpoint's names
    auto = ds_model(ds_config(), seed=2)
    bcp.load(str(tmp_path), {"model": auto}, mapping="auto")
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), auto.state_dict().values()))
    train_step(src, opt, 1000)
    train_step(dst, dst_opt, 1000)
    assert torch.equal(logits(src), logits(dst))


def test_multi_token_prediction_layers_both_ways_with_optimizer_state(tmp_path):
    """GPTModel's mtp.layers.0 <-> the files' layer L (enorm, hnorm, eh_proj, shared_head.norm and an MoE
    decoder layer), weights and Adam moments, Megatron -> Hugging Face names -> Megatron."""
    cfg = ds_config(num_mtp_layers=1)
    src = ds_model(cfg)
    opt = trained(src)
    mtp = mtp_state(cfg)
    mtp_moments = {"exp_avg": {k: v * 0.5 for k, v in mtp.items()}, "exp_avg_sq": {k: v.abs() for k, v in mtp.items()}}
    megatron_checkpoint(tmp_path / "mg", src, opt, mtp=mtp, mtp_moments=mtp_moments)
    m = bcp.mapping.megatron_to_hf(cfg, mtp_layers=1, step=2)
    hf = {"model": {k: torch.zeros(s) for k, s in m.targets.items()},
          "optimizer": {"state": {k: {"exp_avg": torch.zeros(s), "exp_avg_sq": torch.zeros(s)}
                                  for k, s in m.targets.items() if not k.endswith(("lm_head.weight", "bias"))}}}
    bcp.load(str(tmp_path / "mg"), hf, mapping=m, strict=False)
    for k, v in mtp.items():
        assert torch.equal(hf["model"][k], v), k
        if not k.endswith("e_score_correction_bias"):
            assert torch.equal(hf["optimizer"]["state"][k]["exp_avg"], mtp_moments["exp_avg"][k]), k
            assert torch.equal(hf["optimizer"]["state"][k]["exp_avg_sq"], mtp_moments["exp_avg_sq"][k]), k
    # and back: the Hugging Face names into Megatron's
    bcp.save(str(tmp_path / "hf"), {"model": hf["model"], "optimizer": {"state": {
        k: {**s, "step": torch.tensor(2.0)} for k, s in hf["optimizer"]["state"].items()}}}).wait()
    inverse = bcp.mapping.hf_to_megatron(cfg, mtp_layers=1, padded_vocab_size=PADDED)
    want = mtp_part(mtp, LAYERS) | {k: v for k, v in mtp_part(mtp_moments["exp_avg"], LAYERS,
                                                               "optimizer.state.exp_avg.").items()
                                    if not k.endswith("expert_bias")}
    target = {k: torch.full_like(v, -3.0) for k, v in want.items()}
    bcp.load(str(tmp_path / "hf"), target, mapping=inverse)
    for k, v in target.items():
        assert torch.equal(v, want[k]), k


# ----------------------------------------------------------------------------- errors

@pytest.mark.parametrize("change, layout, match", [
    ({"n_routed_experts": 8}, None, r"'decoder.layers.1.mlp.router.weight' has shape \(4, 32\).*declares \(8, 32\)"),
    ({"kv_lora_rank": 10}, None, r"linear_kv_down_proj.weight' has shape \(16, 32\).*declares \(14, 32\)"),
    ({"q_lora_rank": 8}, None, r"linear_q_down_proj.weight' has shape \(16, 32\).*declares \(8, 32\)"),
    ({"first_k_dense_replace": 2}, None, r"'decoder.layers.1.mlp.linear_fc1.weight' is not in the checkpoint"),
    ({}, "+E+E+E", r"hybrid pattern '\+E\+E\+E' does not describe.*needs '\+-\+E\+E'"),
    ({}, "+-+E+E", r"'decoder.layers.0.input_layernorm.weight'.*not in the checkpoint|final_norm"),
    ({}, "stacked", r"not in the checkpoint|dense MLP layers \[0\]"),
])
def test_wrong_declarations_fail_loudly_and_load_nothing(tmp_path, change, layout, match):
    """A wrong expert count, latent rank, dense-layer count or pattern is a MappingError naming the key and
    the shapes (or the pattern wanted), before anything of the target changes."""
    src = ds_model(ds_config())
    megatron_checkpoint(tmp_path, src, trained(src))
    dst = ds_model(ds_config(), seed=1)
    opt = torch.optim.AdamW(dst.parameters(), lr=1e-2)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(bcp.MappingError, match=match):
        bcp.load(str(tmp_path), {"model": dst, "optimizer": opt},
                 mapping=bcp.mapping.megatron_to_hf(ds_config(**change), layout=layout))
    assert all(torch.equal(before[k], v) for k, v in dst.state_dict().items()) and not opt.state


def test_configs_the_mapping_does_not_declare_are_refused():
    with pytest.raises(bcp.MappingError, match="rope_interleave=False"):
        bcp.mapping.megatron_to_hf(ds_config(rope_interleave=False))
    with pytest.raises(bcp.MappingError, match="multi-token prediction layers of a HybridModel"):
        bcp.mapping.megatron_to_hf(ds_config(), layout="+-+E+E/+E")
    with pytest.raises(bcp.MappingError, match="multi-token prediction layers of a HybridModel"):
        bcp.mapping.megatron_to_hf(ds_config(), layout="+-+E+E", mtp_layers=1)
    with pytest.raises(bcp.MappingError, match=r"needs '\+-\+E\+E'"):  # Mamba layers
        bcp.mapping.megatron_to_hf(ds_config(), layout="+-M+E+E")
    with pytest.raises(bcp.MappingError, match=r"no declared mapping for a 'gpt2' model"):
        bcp.mapping.megatron_to_hf({"model_type": "gpt2", "hidden_size": 8})


def test_inverse_of_the_inverse_is_the_mapping():
    for layout in (None, "+-+E+E"):
        for experts in ("fused", "per_expert"):
            m = bcp.mapping.megatron_to_hf(ds_config(), layout=layout, experts=experts)
            assert m.inverse().inverse() == m


# ----------------------------------------------------------------------------- HybridModel "*-": the Llama family

def hybrid_llama_layout(sd: dict, cfg, padded: int = PADDED) -> dict:
    """HybridModel "*-*-" (Transformer Engine's names) of a Hugging Face Llama state dict, by hand: layer i's
    attention at layer number 2i ([q; k; v] rows per query group, the input norm fused into linear_qkv), its
    MLP at 2i + 1 (the pre-MLP norm fused into linear_fc1)."""
    H, h, g = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    d, per = H // h, h // g

    def pad(t):
        return torch.cat([t, torch.full((padded - t.shape[0], H), 7.0)])

    out = {"embedding.word_embeddings.weight": pad(sd["model.embed_tokens.weight"]),
           "output_layer.weight": pad(sd["lm_head.weight"]), "decoder.final_norm.weight": sd["model.norm.weight"]}
    for i in range(cfg.num_hidden_layers):
        x, a, m = f"model.layers.{i}.", f"decoder.layers.{2 * i}.", f"decoder.layers.{2 * i + 1}."
        q, k, v = (sd[f"{x}self_attn.{n}_proj.weight"] for n in "qkv")
        out |= {f"{a}self_attention.linear_qkv.weight": torch.cat(
                    [q.reshape(g, per * d, H), k.reshape(g, d, H), v.reshape(g, d, H)], 1).reshape(-1, H),
                f"{a}self_attention.linear_qkv.layer_norm_weight": sd[f"{x}input_layernorm.weight"],
                f"{a}self_attention.linear_proj.weight": sd[f"{x}self_attn.o_proj.weight"],
                f"{m}mlp.linear_fc1.layer_norm_weight": sd[f"{x}post_attention_layernorm.weight"],
                f"{m}mlp.linear_fc1.weight": torch.cat([sd[f"{x}mlp.gate_proj.weight"], sd[f"{x}mlp.up_proj.weight"]]),
                f"{m}mlp.linear_fc2.weight": sd[f"{x}mlp.down_proj.weight"]}
    return {k: t.clone() for k, t in out.items()}


def test_hybrid_attention_and_mlp_layers_load_into_llama_and_back(tmp_path):
    """HybridModel "*-*-" <-> LlamaForCausalLM: weights and logits both ways; mapping="auto" finds the
    pattern in the checkpoint's names."""
    cfg = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                                   intermediate_size=48, vocab_size=VOCAB, max_position_embeddings=32)
    torch.manual_seed(0)
    src = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in src.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    want = hybrid_llama_layout({k: v.detach() for k, v in src.state_dict().items()}, cfg)
    bcp.save(str(tmp_path / "mg"), want, framework=saved_by()).wait()
    dst = transformers.LlamaForCausalLM(cfg).eval()
    bcp.load(str(tmp_path / "mg"), {"model": dst}, mapping=bcp.mapping.megatron_to_hf(cfg, layout="*-*-"))
    assert torch.equal(logits(src), logits(dst))
    if _megatron:
        auto = transformers.LlamaForCausalLM(cfg).eval()
        bcp.load(str(tmp_path / "mg"), {"model": auto}, mapping="auto")
        assert torch.equal(logits(src), logits(auto))
    bcp.save(str(tmp_path / "hf"), {"model": src}).wait()
    back = {k: torch.zeros_like(v) for k, v in want.items()}
    bcp.load(str(tmp_path / "hf"), back, mapping=bcp.mapping.hf_to_megatron(cfg, layout="*-|*-",  # a stage boundary
                                                                         padded_vocab_size=PADDED))
    for k, v in want.items():
        if k.endswith(("word_embeddings.weight", "output_layer.weight")):  # padding rows come back zero
            assert torch.equal(back[k][:VOCAB], v[:VOCAB]) and not back[k][VOCAB:].any(), k
        else:
            assert torch.equal(back[k], v), k
