"""Mixtures of experts: Mixtral, Qwen3-MoE and Qwen2-MoE between Megatron-core and Hugging Face, and a
real Megatron-core MoE GPTModel resharded across expert parallelism (docs/mapping.md, docs/megatron.md).

The first part runs in one process against Megatron layouts built by hand with plain torch ops from the
layout facts (independently of the mapping code). The second part is one 2-rank job (gloo, Megatron's
DDP and DistributedOptimizer under recipes/_megatron_cpu.py) whose cases the tests below share.
"""

from __future__ import annotations

import functools
import os
import sys

import pytest
import torch

import bcp_core as bcp

transformers = pytest.importorskip("transformers")

import hf_steps  # noqa: E402
from dist import RECIPES, run_ranks  # noqa: E402
from megatron_pass import megatron_distributed, megatron_pass  # noqa: E402
from sharded_hf import hf_logits, load_into_hf_alone, load_into_wrapped_hf  # noqa: E402

if RECIPES not in sys.path:
    sys.path.insert(0, RECIPES)  # recipes/_megatron_cpu.py

VOCAB, PADDED, HIDDEN, HEADS, GROUPS, HEAD_DIM, LAYERS, EXPERTS, EXPERT_FFN, SHARED_FFN = \
    100, 128, 32, 4, 2, 8, 2, 4, 16, 24
FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe")


def hf_config(family: str, **over):
    dims = dict(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=GROUPS, num_hidden_layers=LAYERS,
                vocab_size=VOCAB, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=32,
                tie_word_embeddings=False, num_experts_per_tok=2)
    if family == "mixtral":
        return transformers.MixtralConfig(**{**dims, "num_local_experts": EXPERTS, "intermediate_size": EXPERT_FFN,
                                             **over})
    common = {**dims, "num_experts": EXPERTS, "moe_intermediate_size": EXPERT_FFN, "intermediate_size": 48,
              "norm_topk_prob": True}
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**{**common, "head_dim": HEAD_DIM, **over})
    return transformers.Qwen2MoeConfig(**{**common, "shared_expert_intermediate_size": SHARED_FFN, **over})


def hf_model(config, seed=0):
    torch.manual_seed(seed)
    cls = {"mixtral": transformers.MixtralForCausalLM, "qwen3_moe": transformers.Qwen3MoeForCausalLM,
           "qwen2_moe": transformers.Qwen2MoeForCausalLM}[config.model_type]
    model = cls(config).eval()
    with torch.no_grad():  # norms away from 1 and biases away from 0: a misplaced one shows in the logits
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif n.endswith("bias"):
                p.normal_()
    return model


def megatron_moe_layout(sd: dict, cfg, padded: int = PADDED, prefix: str = "") -> dict:
    """The Megatron-core MoE GPTModel tensors of a Hugging Face state dict (transformers 5's fused experts),
    by hand: stacked layers, [q; k; v] rows per query group, experts stacked on the axis after the layer's."""
    L, H, h, g = cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or H // h
    per = h // g

    def layer(name):
        return torch.stack([sd[f"model.layers.{i}.{name}"] for i in range(L)])

    def pad(t):
        return torch.cat([t, torch.full((padded - t.shape[0], H), 7.0)])  # junk in the padding rows

    qkv = torch.stack([torch.cat([sd[f"model.layers.{i}.self_attn.q_proj.weight"].reshape(g, per * d, H),
                                  sd[f"model.layers.{i}.self_attn.k_proj.weight"].reshape(g, d, H),
                                  sd[f"model.layers.{i}.self_attn.v_proj.weight"].reshape(g, d, H)], 1).reshape(-1, H)
                       for i in range(L)])
    out = {"embedding.word_embeddings.weight": pad(sd["model.embed_tokens.weight"]),
           "output_layer.weight": pad(sd["lm_head.weight"]),
           "decoder.final_layernorm.weight": sd["model.norm.weight"],
           "decoder.layers.self_attention.linear_qkv.weight": qkv,
           "decoder.layers.self_attention.linear_qkv.layer_norm_weight": layer("input_layernorm.weight"),
           "decoder.layers.self_attention.linear_proj.weight": layer("self_attn.o_proj.weight"),
           "decoder.layers.mlp.linear_fc1.layer_norm_weight": layer("post_attention_layernorm.weight"),
           "decoder.layers.mlp.router.weight": layer("mlp.gate.weight"),
           "decoder.layers.mlp.experts.experts.linear_fc1.weight": layer("mlp.experts.gate_up_proj"),
           "decoder.layers.mlp.experts.experts.linear_fc2.weight": layer("mlp.experts.down_proj")}
    if cfg.model_type == "qwen3_moe":
        out["decoder.layers.self_attention.q_layernorm.weight"] = layer("self_attn.q_norm.weight")
        out["decoder.layers.self_attention.k_layernorm.weight"] = layer("self_attn.k_norm.weight")
    if cfg.model_type == "qwen2_moe":
        out["decoder.layers.self_attention.linear_qkv.bias"] = torch.stack([torch.cat([
            sd[f"model.layers.{i}.self_attn.q_proj.bias"].reshape(g, per * d),
            sd[f"model.layers.{i}.self_attn.k_proj.bias"].reshape(g, d),
            sd[f"model.layers.{i}.self_attn.v_proj.bias"].reshape(g, d)], 1).reshape(-1) for i in range(L)])
        out["decoder.layers.mlp.shared_experts.linear_fc1.weight"] = torch.cat(
            [layer("mlp.shared_expert.gate_proj.weight"), layer("mlp.shared_expert.up_proj.weight")], 1)
        out["decoder.layers.mlp.shared_experts.linear_fc2.weight"] = layer("mlp.shared_expert.down_proj.weight")
        out["decoder.layers.mlp.shared_experts.gate_weight"] = layer("mlp.shared_expert_gate.weight")
    return {prefix + k: v.clone() for k, v in out.items()}


trained = functools.partial(hf_steps.trained, vocab=VOCAB)
train_step = functools.partial(hf_steps.train_step, vocab=VOCAB)
logits = functools.partial(hf_steps.logits, vocab=VOCAB)
moments_by_name = hf_steps.moments_by_name


def megatron_checkpoint(path, model, opt=None, *, chained: bool = False, te_norm: bool = False):
    """A bcp checkpoint keyed as Megatron saves an MoE GPTModel with its fully_reshardable DistOpt state:
    `chained`, as two chained optimizers save it without chained_optim_avoid_prefix (dense state under
    chained_0., expert state under chained_1.); `te_norm`, the pre-MLP norm as Transformer Engine's spec
    names it."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    state = megatron_moe_layout(sd, model.config)
    if opt is not None:
        for name, by_param in moments_by_name(model, opt).items():
            state |= megatron_moe_layout(by_param, model.config, prefix=f"optimizer.state.{name}.")
        state |= megatron_moe_layout(sd, model.config, prefix="optimizer.state.param.")
    if chained:
        state = {(f"chained_{1 if '.experts.' in k else 0}." if k.startswith("optimizer.") else "") + k: v
                 for k, v in state.items()}
    if te_norm:
        state = {k.replace("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"): v for k, v in state.items()}
    bcp.save(str(path), state).wait()
    if opt is not None:  # Megatron's common state: the chained optimizers' param groups hold the step
        step = int(next(iter(opt.state.values()))["step"])
        groups = {i: {"optimizer": {"param_groups": [{"lr": 1e-2, "step": float(step)}]}} for i in (0, 1)}
        torch.save({"optimizer": groups}, os.path.join(path, "common.pt"))


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


# ----------------------------------------------------------------------------- one process, hand-made layouts

@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_moe_layout_loads_into_hf_with_optimizer_state(tmp_path, family):
    """Router, fused experts, q/k norms (Qwen3-MoE), shared expert and its gate and q/k/v biases
    (Qwen2-MoE): weights, logits, Adam moments and step; one more AdamW step goes the same way."""
    src = hf_model(hf_config(family))
    opt = trained(src)
    megatron_checkpoint(tmp_path, src, opt)
    dst = hf_model(hf_config(family), seed=1)
    dst_opt = torch.optim.AdamW(dst.parameters(), lr=1e-2)
    bcp.load(str(tmp_path), {"model": dst, "optimizer": dst_opt}, mapping=bcp.mapping.megatron_to_hf(dst.config))
    assert_same_training_state(src, opt, dst, dst_opt)
    train_step(src, opt, 1000)
    train_step(dst, dst_opt, 1000)
    assert torch.equal(logits(src), logits(dst))


def test_chained_optimizer_prefixes_and_transformer_engine_norm_name_are_found(tmp_path):
    """State saved by two chained optimizers without chained_optim_avoid_prefix (chained_0., chained_1.),
    and the pre-MLP norm under Transformer Engine's name, load as the plain layout does."""
    src = hf_model(hf_config("qwen2_moe"))
    opt = trained(src)
    megatron_checkpoint(tmp_path, src, opt, chained=True, te_norm=True)
    keys = bcp.inspect(str(tmp_path)).tensors
    assert "chained_1.optimizer.state.exp_avg.decoder.layers.mlp.experts.experts.linear_fc1.weight" in keys
    assert "decoder.layers.pre_mlp_layernorm.weight" in keys
    dst = hf_model(hf_config("qwen2_moe"), seed=1)
    dst_opt = torch.optim.AdamW(dst.parameters(), lr=1e-2)
    bcp.load(str(tmp_path), {"model": dst, "optimizer": dst_opt}, mapping=bcp.mapping.megatron_to_hf(dst.config))
    assert_same_training_state(src, opt, dst, dst_opt)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_moe_checkpoint_loads_into_megatron_layout_and_per_expert_linears(tmp_path, family):
    """hf_to_megatron lays the experts out as Megatron does (weights, moments, master copy, both names of
    the pre-MLP norm); and the per-expert layout (one nn.Linear per expert: earlier transformers, the Hub's
    files) takes the same numbers, each expert's rows of [gate; up]."""
    src = hf_model(hf_config(family))
    opt = trained(src)
    bcp.save(str(tmp_path / "hf"), {"model": src, "optimizer": opt}).wait()
    sd = {k: v.detach() for k, v in src.state_dict().items()}
    want = megatron_moe_layout(sd, src.config)
    for name, by_param in moments_by_name(src, opt).items():
        want |= megatron_moe_layout(by_param, src.config, prefix=f"optimizer.state.{name}.")
    want |= megatron_moe_layout(sd, src.config, prefix="optimizer.state.param.")
    te_norm = "decoder.layers.pre_mlp_layernorm.weight"
    want[te_norm] = want["decoder.layers.mlp.linear_fc1.layer_norm_weight"]
    target = {k: torch.full_like(v, -3.0) for k, v in want.items()}
    bcp.load(str(tmp_path / "hf"), target, mapping=bcp.mapping.hf_to_megatron(src.config, padded_vocab_size=PADDED))
    for k, v in want.items():
        if k.endswith(("word_embeddings.weight", "output_layer.weight")):  # padding rows come back zero
            assert torch.equal(target[k][:VOCAB], v[:VOCAB]) and not target[k][VOCAB:].any(), k
        else:
            assert torch.equal(target[k], v), k

    # Megatron -> the per-expert layout (a plain dict of tensors named as the Hub's files name them)
    bcp.save(str(tmp_path / "mg"), target).wait()
    m = bcp.mapping.megatron_to_hf(src.config, experts="per_expert", step=2)
    names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    moe = "block_sparse_moe" if family == "mixtral" else "mlp"
    assert f"model.layers.1.{moe}.experts.3.{names[0]}.weight" in m.targets
    per_expert = {"model": {k: torch.zeros(s) for k, s in m.targets.items()}}
    bcp.load(str(tmp_path / "mg"), per_expert, mapping=m.with_keys(target_keys=bcp.mapping.torch_scheme()),
             strict=False)
    got = per_expert["model"]
    for i in range(LAYERS):
        fused = sd[f"model.layers.{i}.mlp.experts.gate_up_proj"]
        assert torch.equal(got[f"model.layers.{i}.{moe}.gate.weight"], sd[f"model.layers.{i}.mlp.gate.weight"])
        for e in range(EXPERTS):
            p = f"model.layers.{i}.{moe}.experts.{e}."
            assert torch.equal(got[f"{p}{names[0]}.weight"], fused[e, :EXPERT_FFN])
            assert torch.equal(got[f"{p}{names[1]}.weight"], fused[e, EXPERT_FFN:])
            assert torch.equal(got[f"{p}{names[2]}.weight"], sd[f"model.layers.{i}.mlp.experts.down_proj"][e])


def test_inverse_of_the_inverse_is_the_moe_mapping():
    for family in FAMILIES:
        for experts in ("fused", "per_expert"):
            m = bcp.mapping.megatron_to_hf(hf_config(family), experts=experts)
            assert m.inverse().inverse() == m


@pytest.mark.parametrize("family, change, match", [
    ("mixtral", {"num_local_experts": 8},
     r"'decoder.layers.mlp.router.weight' has shape \(2, 4, 32\).*declares \(2, 8, 32\)"),
    ("qwen3_moe", {"moe_intermediate_size": 8},
     r"'decoder.layers.mlp.experts.experts.linear_fc1.weight' has shape \(2, 4, 32, 32\).*declares \(2, 4, 16, 32\)"),
    ("qwen2_moe", {"shared_expert_intermediate_size": 12},
     r"'decoder.layers.mlp.shared_experts.linear_fc1.weight' has shape \(2, 48, 32\).*declares \(2, 24, 32\)"),
    ("qwen3_moe", {"head_dim": 4}, r"'decoder.layers.self_attention.linear_qkv.weight' has shape"),
])
def test_wrong_moe_declarations_fail_loudly_and_load_nothing(tmp_path, family, change, match):
    src = hf_model(hf_config(family))
    megatron_checkpoint(tmp_path, src)
    dst = hf_model(hf_config(family), seed=1)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(bcp.MappingError, match=match):
        bcp.load(str(tmp_path), {"model": dst}, mapping=bcp.mapping.megatron_to_hf(hf_config(family, **change)))
    assert all(torch.equal(before[k], v) for k, v in dst.state_dict().items())


def test_moe_configs_with_dense_layers_are_declared_per_layer():
    """Dense MLPs among the MoE ones (Qwen's mlp_only_layers, decoder_sparse_step): Megatron's GPTModel saves
    such a model per layer (moe_layer_freq), which the mapping declares; a stacked layout of it is refused."""
    m = bcp.mapping.megatron_to_hf(hf_config("qwen3_moe", mlp_only_layers=[1]))
    assert m.sources["decoder.layers.1.mlp.linear_fc1.weight"] == (96, HIDDEN)  # [gate; up] of the dense FFN 48
    assert m.sources["decoder.layers.0.mlp.experts.experts.linear_fc1.weight"] == (EXPERTS, 2 * EXPERT_FFN, HIDDEN)
    assert "model.layers.1.mlp.gate_proj.weight" in m.targets and "model.layers.0.mlp.gate.weight" in m.targets
    with pytest.raises(bcp.MappingError, match=r"dense MLP layers \[1\].*per layer, not stacked"):
        bcp.mapping.megatron_to_hf(hf_config("qwen3_moe", mlp_only_layers=[1]), layout="stacked")
    with pytest.raises(bcp.MappingError, match=r"dense MLP layers \[0\]"):
        bcp.mapping.megatron_to_hf(hf_config("qwen2_moe", decoder_sparse_step=2), layout="stacked")
    with pytest.raises(bcp.MappingError, match="experts must be one of"):
        bcp.mapping.megatron_to_hf(hf_config("mixtral"), experts="stacked")


def _sharded_tensor(key, data, global_shape, offset, prepend=0):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    return ShardedTensor(key, data, data.dtype, tuple(data.shape), tuple(global_shape), tuple(offset),
                         axis_fragmentations=None, replica_id=0, prepend_axis_num=prepend)


def test_megatron_key_layouts_load_into_each_other(tmp_path):
    """bcp_integrations.megatron.load finds a requested tensor under the name the checkpoint holds it:
    a per-layer, per-expert half (singleton_local_shards) inside the stacked [L, E, 2F, H] tensor, behind
    another chain's prefix; a stacked box straddling gate and up from the saved halves; a request the
    saved tensor cannot hold is named with both keys."""
    pytest.importorskip("megatron.core")
    import bcp_integrations.megatron as bm
    from bcp_core.errors import ShapeMismatchError
    stacked = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    fc1 = torch.arange(2 * 4 * 6 * 3.0).reshape(2, 4, 6, 3)  # L=2 layers, E=4 experts, [gate; up] of 3 rows each
    bm.save({"a": _sharded_tensor(stacked, fc1, fc1.shape, (0, 0, 0, 0)),
             "b": _sharded_tensor(f"chained_1.optimizer.state.exp_avg.{stacked}", -fc1, fc1.shape, (0, 0, 0, 0))},
            tmp_path / "stacked").wait()
    up = torch.zeros(3, 3)  # layer 1, expert 2, the up half, asked as singleton_local_shards asks
    moment = torch.zeros(1, 3)  # layer 0, expert 3, row 2 of the gate half, without the chain prefix
    bm.load({"up": _sharded_tensor("decoder.layers.1.mlp.experts.experts.2.linear_fc1.weight_v", up, (3, 3), (0, 0)),
             "m": _sharded_tensor("optimizer.state.exp_avg.decoder.layers.0.mlp.experts.experts.3.linear_fc1.weight_w",
                                  moment, (3, 3), (2, 0))}, tmp_path / "stacked")
    assert torch.equal(up, fc1[1, 2, 3:]) and torch.equal(moment, -fc1[0, 3, 2:3])

    # saved per layer and expert, in halves; asked stacked, rows 2..4 of expert 1 of layer 0: gate row 2, up rows 0-1
    bm.save({f"{n}{i}{e}": _sharded_tensor(f"decoder.layers.{i}.mlp.experts.experts.{e}.linear_fc1.weight_{n}",
                                            fc1[i, e, 3 * (n == "v"):3 * (n == "v") + 3].clone(), (3, 3), (0, 0))
             for i in range(2) for e in range(4) for n in "wv"}, tmp_path / "halves").wait()
    rows = torch.zeros(3, 3)
    bm.load({"r": _sharded_tensor(stacked, rows, (2, 4, 6, 3), (0, 1, 2, 0), prepend=2)}, tmp_path / "halves")
    assert torch.equal(rows, fc1[0, 1, 2:5])

    with pytest.raises(ShapeMismatchError, match=rf"weight_v'.*is saved as '{stacked}'"):
        bm.load({"x": _sharded_tensor("decoder.layers.1.mlp.experts.experts.2.linear_fc1.weight_v", torch.zeros(4, 3),
                                      (4, 3), (0, 0))}, tmp_path / "stacked")


# ----------------------------------------------------------------------------- real Megatron-core MoE, 2 ranks

SEQ = 8
# the Megatron models: Qwen3-MoE-like (q/k norms), Mixtral-like, Qwen2-MoE-like (shared expert and its gate,
# q/k/v biases); the last trains with the allgather dispatcher, the others with alltoall
MEGATRON = {"qwen3_moe": dict(qk_norm=True), "mixtral": dict(dispatcher="allgather"),
            "qwen2_moe": dict(shared=True, qkv_bias=True)}


def tokens(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, SEQ), generator=g)


def _moe_gpt(family: str, ep: int, tp: int, pp: int = 1, etp: int | None = None):
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    kind = {"qk_norm": False, "shared": False, "qkv_bias": False, "dispatcher": "alltoall", **MEGATRON[family]}
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                 pipeline_model_parallel_size=pp, expert_tensor_parallel_size=etp,
                                 create_gloo_process_groups=True)
    torch.manual_seed(1234 + ps.get_pipeline_model_parallel_rank())
    cfg = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS, ffn_hidden_size=48,
        kv_channels=HEAD_DIM, tensor_model_parallel_size=tp, expert_model_parallel_size=ep, sequence_parallel=tp > 1,
        pipeline_model_parallel_size=pp, expert_tensor_parallel_size=etp,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        bias_activation_fusion=False, layernorm_epsilon=1e-5, hidden_dropout=0.0, attention_dropout=0.0,
        add_qkv_bias=kind["qkv_bias"], qk_layernorm=kind["qk_norm"], num_moe_experts=EXPERTS, moe_router_topk=2,
        moe_ffn_hidden_size=EXPERT_FFN, moe_aux_loss_coeff=0.01, moe_router_load_balancing_type="aux_loss",
        moe_token_dispatcher_type=kind["dispatcher"],
        moe_shared_expert_intermediate_size=SHARED_FFN if kind["shared"] else None,
        moe_shared_expert_gate=kind["shared"])
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False, qk_layernorm=kind["qk_norm"],
                                    normalization="RMSNorm")
    model = GPTModel(cfg, spec, vocab_size=PADDED, max_sequence_length=32, position_embedding_type="rope",
                     rotary_base=10000, share_embeddings_and_output_weights=False,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    with torch.no_grad():  # norms away from 1 and biases away from 0: a misplaced one shows in the logits
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_()
    return cfg, model


_distributed = megatron_distributed


def _run(ddp, batch: torch.Tensor, forward_only: bool):
    """One pass of Megatron's schedule: logits [batch, seq, vocab], or the loss; None on an earlier stage."""
    return megatron_pass(ddp, batch, forward_only, SEQ, VOCAB)


def _train(ddp, opt, seeds) -> list[float]:
    losses = []
    for s in seeds:
        ddp.zero_grad_buffer()
        opt.zero_grad()
        losses.append(_run(ddp, tokens(s), forward_only=False))
        opt.step()
    return losses


def _steps(opt) -> list[float]:
    members = getattr(opt, "chained_optimizers", [opt])
    return sorted({float(s["step"]) for m in members for s in m.optimizer.state.values()})


def _sharded(model, opt, *, singleton=False, avoid_prefix=True, loading=False):
    meta = {"singleton_local_shards": True} if singleton else None
    model_sd = model.sharded_state_dict(metadata=meta)
    opt_sd = opt.sharded_state_dict(model_sd, is_loading=loading, metadata={
        "distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": avoid_prefix,
        **(meta or {})})
    return {"model": model_sd, "optimizer": opt_sd}


def _save(model, opt, path, **layout) -> None:
    from megatron.core import dist_checkpointing as dcp
    os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    dcp.save(_sharded(model, opt, **layout), path, sharded_strategy=("bcp", 1))


def _fresh_state(opt) -> None:
    """Without Apex/TE (torch's Adam) DistributedOptimizer.state_dict reads the step from the inner optimizer's
    state, which a fresh one lacks; a load replaces all of it."""
    for member in getattr(opt, "chained_optimizers", [opt]):
        member.init_state_fn(member.optimizer, member.config)
        for st in member.optimizer.state.values():
            st["step"] = torch.tensor(0.0)


def _megatron_to_megatron(root, source, ep, tp, pp=1, etp=None, name=None, **request) -> dict:
    """The checkpoint `source` into a fresh Megatron model at EP=ep, TP=tp (PP, ETP) through
    dist_checkpointing.load (`request`: the layout asked for); saved again, stacked, for comparison; one
    more step."""
    from megatron.core import dist_checkpointing as dcp

    import bcp_integrations.megatron as bm
    family = source.split("_ep")[0]
    cfg, model = _moe_gpt(family, ep, tp, pp, etp)
    ddp, opt = _distributed(cfg, model)
    _fresh_state(opt)
    state = dcp.load(_sharded(model, opt, loading=True, **request), os.path.join(root, source))
    r = {"chain": len(opt.chained_optimizers)}
    try:  # what Megatron itself does with the loaded state (fails across a change of the chain)
        import copy
        opt.load_state_dict(copy.deepcopy(state["optimizer"]))
        r["megatron_own"] = "ok"
    except Exception as e:  # noqa: BLE001 - reported
        r["megatron_own"] = f"{type(e).__name__}: {e}"
    model.load_state_dict(state["model"])
    opt.load_state_dict(bm.chained_optimizer_state(opt, state["optimizer"]))
    r["steps"] = _steps(opt)
    r["logits"] = _run(ddp, tokens(99), forward_only=True)
    _save(model, opt, os.path.join(root, name or f"{source}_to_ep{ep}_tp{tp}"))
    r["next_loss"] = _train(ddp, opt, [50])[0]
    r["after"] = _steps(opt)
    return r


DOCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "megatron.md")
DOCS_MARKER = "<!-- the EP example: tests/test_mapping_moe.py runs this block as written -->"


def _docs_ep_example(root: str, source: str) -> dict:
    """docs/megatron.md's expert-parallel example, run as written (its one python block after DOCS_MARKER) with
    `model` and `opt` a fresh EP=1 model and its DistributedOptimizer (no state yet), `ckpt_dir` the EP=2
    checkpoint."""
    with open(DOCS) as f:
        block = f.read().split(DOCS_MARKER, 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    cfg, model = _moe_gpt(source.split("_ep")[0], 1, 1)
    ddp, opt = _distributed(cfg, model)
    exec(compile(block, DOCS, "exec"), {"model": model, "opt": opt, "ckpt_dir": os.path.join(root, source)})
    return {"steps": _steps(opt), "logits": _run(ddp, tokens(99), forward_only=True)}


def _checkpoint_moments(path: str, hf, hf_opt) -> tuple[list[str], int]:
    """The Adam moments a Megatron checkpoint holds (chained_<n>. prefixes or not) against the Hugging Face
    AdamW's, laid out as Megatron lays them by hand (megatron_moe_layout); padding rows have no counterpart."""
    import re

    from bcp_core.tools.read import open_checkpoint, read_tensor
    st, md = open_checkpoint(path)
    laid = {}
    for name, by_param in moments_by_name(hf, hf_opt).items():
        laid |= megatron_moe_layout(by_param, hf.config, prefix=f"optimizer.state.{name}.")
    bad, checked = [], 0
    for key in md.tensors:
        plain = re.sub(r"^chained_\d+\.", "", key)
        if not plain.startswith(("optimizer.state.exp_avg.", "optimizer.state.exp_avg_sq.")):
            continue
        if plain not in laid:
            bad.append(f"{key} has no counterpart")
            continue
        got, want = read_tensor(st, md, key), laid.pop(plain)
        if plain.endswith(("word_embeddings.weight", "output_layer.weight")):
            got, want = got[:VOCAB], want[:VOCAB]
        checked += got.numel()
        if not torch.equal(got, want):
            bad.append(f"{key}: max diff {float((got - want).abs().max())}")
    return bad + [f"{k} not in the checkpoint" for k in laid], checked


def _into_hf(root: str, family: str, source: str) -> tuple[dict, dict]:
    """The Megatron checkpoint into a Hugging Face model and a fresh AdamW on this process alone."""
    torch.manual_seed(5)
    hf = hf_model(hf_config(family), seed=5)
    return load_into_hf_alone(hf, os.path.join(root, source), tokens, _checkpoint_moments)


def logits_of(model) -> torch.Tensor:
    return hf_logits(model, tokens)


def _hf_to_megatron(root: str) -> dict:
    """A Qwen3MoeForCausalLM trained 2 AdamW steps and saved by bcp (both ranks hold it: a replicated save)
    into the Megatron model at EP=2 and its two chained DistributedOptimizers (state keys asked for with
    their chained_<n>. prefixes), through bm.load(mapping=)."""
    import bcp_integrations.megatron as bm
    hf = hf_model(hf_config("qwen3_moe"), seed=11)
    hf_opt = trained(hf)
    hf.eval()
    path = os.path.join(root, "hf_qwen3_moe")
    bcp.save(path, {"model": hf, "optimizer": hf_opt}).wait()
    cfg, model = _moe_gpt("qwen3_moe", 2, 1)
    ddp, opt = _distributed(cfg, model)
    _fresh_state(opt)
    # asked with chained_<n>. prefixes: the mapping names the state without them (layouts.py moves the request)
    loaded = bm.load(_sharded(model, opt, loading=True, avoid_prefix=False), path,
                     mapping=bcp.mapping.hf_to_megatron(hf.config))
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    r = {"logits_diff": float((_run(ddp, tokens(99), forward_only=True) - logits_of(hf)).abs().max()),
         "steps": _steps(opt)}
    _save(model, opt, path + "_to_megatron")
    r["bad"], r["checked"] = _checkpoint_moments(path + "_to_megatron", hf, hf_opt)
    _train(ddp, opt, [50])
    r["after"] = _steps(opt)
    return r


def _sharded_hf_target(wrap: str, path: str, ref: dict) -> dict:
    """The Qwen3-MoE checkpoint into the Hugging Face model under DDP (mapping="auto") or FSDP2 on both
    ranks: compared with the same load on one process (`ref`), then one more step on both."""
    return load_into_wrapped_hf(hf_model(hf_config("qwen3_moe"), seed=5), wrap, path, ref, tokens,
                                "model.layers.0.mlp.experts.gate_up_proj")


def _moe_job(rank, world_size, root):
    import warnings
    warnings.filterwarnings("ignore")
    import bcp_integrations.megatron  # noqa: F401 - registers ("bcp", 1)
    from _megatron_cpu import cuda_on_cpu

    out: dict = {"megatron": {}, "hf": {}}
    with cuda_on_cpu():
        for family, ep, tp, layout in (("qwen2_moe", 2, 1, {"avoid_prefix": False}),
                                       ("qwen2_moe", 1, 2, {"singleton": True}),
                                       ("qwen3_moe", 2, 1, {}), ("mixtral", 2, 1, {})):
            cfg, model = _moe_gpt(family, ep, tp)
            ddp, opt = _distributed(cfg, model)
            name = f"{family}_ep{ep}_tp{tp}"
            r = {"losses": _train(ddp, opt, [10, 11]), "chain": len(opt.chained_optimizers)}
            r["logits"] = _run(ddp, tokens(99), forward_only=True)
            _save(model, opt, os.path.join(root, name), **layout)
            if layout.get("singleton"):  # the reference for the load from it: the same state, stacked
                _save(model, opt, os.path.join(root, name + "_stacked"))
            r["next_loss"] = _train(ddp, opt, [50])[0]
            out["megatron"][name] = r
        # EP=2 (chained_0./chained_1. keys, stacked) -> EP=1 asking per expert, no prefixes
        out["megatron"]["ep2_to_ep1"] = _megatron_to_megatron(root, "qwen2_moe_ep2_tp1", 1, 1, singleton=True)
        # EP=1, TP=2 (per expert) -> EP=2 stacked, asking with chained_<n>. prefixes
        out["megatron"]["tp2_to_ep2"] = _megatron_to_megatron(root, "qwen2_moe_ep1_tp2", 2, 1, avoid_prefix=False)
        out["reverse"] = _hf_to_megatron(root)
        out["docs_example"] = _docs_ep_example(root, "qwen2_moe_ep2_tp1")
        from megatron.core import parallel_state as ps
        ps.destroy_model_parallel()
    refs = {}
    for family, source in (("qwen3_moe", "qwen3_moe_ep2_tp1"), ("mixtral", "mixtral_ep2_tp1"),
                           ("qwen2_moe", "qwen2_moe_ep2_tp1")):
        out["hf"][family], refs[family] = _into_hf(root, family, source)
    for wrap in ("ddp", "fsdp2"):
        out[wrap] = _sharded_hf_target(wrap, os.path.join(root, "qwen3_moe_ep2_tp1"), refs["qwen3_moe"])
    return out


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    pytest.importorskip("megatron.core")
    root = str(tmp_path_factory.mktemp("moe"))
    results = run_ranks(2, _moe_job, root, timeout=400)
    results[0]["root"] = root
    return results


def _same_checkpoints(a: str, b: str) -> tuple[list[str], int]:
    """Keys whose tensors differ between two checkpoints (chained_<n>. prefixes aside), and the count compared."""
    import re

    from bcp_core.tools.read import open_checkpoint, read_tensor
    (sa, ma), (sb, mb) = open_checkpoint(a), open_checkpoint(b)

    def plain(md):
        return {re.sub(r"^chained_\d+\.", "", k): k for k in md.tensors}
    pa, pb = plain(ma), plain(mb)
    assert pa.keys() == pb.keys(), sorted(set(pa) ^ set(pb))[:5]
    bad = [k for k in pa if not torch.equal(read_tensor(sa, ma, pa[k]), read_tensor(sb, mb, pb[k]))]
    return bad, len(pa)


@pytest.mark.parametrize("case, source, reference", [
    ("ep2_to_ep1", "qwen2_moe_ep2_tp1", "qwen2_moe_ep2_tp1"),  # chained_<n>. keys, stacked -> per expert
    ("tp2_to_ep2", "qwen2_moe_ep1_tp2", "qwen2_moe_ep1_tp2_stacked"),  # per expert -> stacked, chained_<n>.
])
def test_megatron_moe_reshards_across_expert_parallelism(moe_run, case, source, reference):
    """Through Megatron's own dist_checkpointing.load: the weights, main params and Adam moments of every
    tensor (router, experts, shared expert and its gate included) equal the saved ones exactly (the loaded
    state saved again, stacked, against the source's); the logits equal the source's; the step carries and
    one more step runs, with the loss the source had on that batch."""
    root = moe_run[0]["root"]
    bad, n = _same_checkpoints(os.path.join(root, reference), os.path.join(root, f"{source}_to_ep{case[-1]}_tp1"))
    assert not bad and n > 40, bad[:5]
    _assert_continues(moe_run, "megatron", source, case)


def _assert_continues(run, part, source, case):
    """The loaded model gives the source's logits, carries its step, and its next step has the source's loss
    (on the ranks of the last pipeline stage)."""
    for r in run:
        src, dst = r[part][source], r[part][case]
        assert dst["steps"] == [2.0] and dst["after"] == [3.0], dst
        if dst["logits"] is not None:
            assert float((src["logits"] - dst["logits"]).abs().max()) <= 1e-5
            assert abs(src["next_loss"] - dst["next_loss"]) <= 1e-5, (src["next_loss"], dst["next_loss"])


def test_the_docs_expert_parallel_example_runs_as_written(moe_run):
    """docs/megatron.md's example (EP=2 checkpoint, chained_<n>. keys, into a fresh EP=1 model and optimizer):
    the source's logits and step."""
    for r in moe_run:
        src, dst = r["megatron"]["qwen2_moe_ep2_tp1"], r["docs_example"]
        assert dst["steps"] == [2.0], dst
        assert float((src["logits"] - dst["logits"]).abs().max()) <= 1e-5


def test_megatron_alone_cannot_load_across_a_change_of_the_optimizer_chain(moe_run):
    """What Megatron does without bcp's regrouping: EP=2 saves two chained optimizers, EP=1 has one."""
    r = moe_run[0]["megatron"]
    assert r["qwen2_moe_ep2_tp1"]["chain"] == 2 and r["ep2_to_ep1"]["chain"] == 1
    assert r["ep2_to_ep1"]["megatron_own"].startswith("KeyError: 'optimizer'"), r["ep2_to_ep1"]["megatron_own"]
    assert r["tp2_to_ep2"]["megatron_own"] != "ok"


HF_CASES = {"qwen3_moe": "qwen3_moe_ep2_tp1", "mixtral": "mixtral_ep2_tp1", "qwen2_moe": "qwen2_moe_ep2_tp1"}


@pytest.mark.parametrize("family", list(HF_CASES))
def test_megatron_core_saves_the_moe_layout_the_mapping_declares(moe_run, family):
    """The MoE facts of docs/mapping.md, as megatron-core 0.16.1 writes them (EP=2, SequentialMLP)."""
    md = bcp.inspect(os.path.join(moe_run[0]["root"], HF_CASES[family]))
    shapes = {k: tuple(tm.shape) for k, tm in md.tensors.items() if not k.startswith(("optimizer.", "chained_"))}
    qkv_rows = (HEADS + 2 * GROUPS) * HEAD_DIM
    want = {"embedding.word_embeddings.weight": (PADDED, HIDDEN), "output_layer.weight": (PADDED, HIDDEN),
            "decoder.final_layernorm.weight": (HIDDEN,),
            "decoder.layers.self_attention.linear_qkv.weight": (LAYERS, qkv_rows, HIDDEN),
            "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (LAYERS, HIDDEN),
            "decoder.layers.self_attention.linear_proj.weight": (LAYERS, HIDDEN, HEADS * HEAD_DIM),
            "decoder.layers.mlp.linear_fc1.layer_norm_weight": (LAYERS, HIDDEN),  # the pre-MLP norm (local spec)
            "decoder.layers.mlp.router.weight": (LAYERS, EXPERTS, HIDDEN),
            "decoder.layers.mlp.experts.experts.linear_fc1.weight": (LAYERS, EXPERTS, 2 * EXPERT_FFN, HIDDEN),
            "decoder.layers.mlp.experts.experts.linear_fc2.weight": (LAYERS, EXPERTS, HIDDEN, EXPERT_FFN)}
    if family == "qwen3_moe":
        want["decoder.layers.self_attention.q_layernorm.weight"] = (LAYERS, HEAD_DIM)
        want["decoder.layers.self_attention.k_layernorm.weight"] = (LAYERS, HEAD_DIM)
    if family == "qwen2_moe":
        want["decoder.layers.self_attention.linear_qkv.bias"] = (LAYERS, qkv_rows)
        want["decoder.layers.mlp.shared_experts.linear_fc1.weight"] = (LAYERS, 2 * SHARED_FFN, HIDDEN)
        want["decoder.layers.mlp.shared_experts.linear_fc2.weight"] = (LAYERS, HIDDEN, SHARED_FFN)
        want["decoder.layers.mlp.shared_experts.gate_weight"] = (LAYERS, 1, HIDDEN)
    assert shapes == want


@pytest.mark.parametrize("family", list(HF_CASES))
def test_megatron_moe_checkpoint_loads_into_hf(moe_run, family):
    """Megatron EP=2 (two chained DistributedOptimizers) -> Qwen3MoeForCausalLM, MixtralForCausalLM,
    Qwen2MoeForCausalLM on one process: logits within 1e-5 of Megatron's, the AdamW moments equal to the
    DistributedOptimizer's saved state element for element, step 2, and one more AdamW step runs."""
    for r in moe_run:
        want = r["megatron"][HF_CASES[family]]["logits"]
        c = r["hf"][family]
        assert float(want.abs().max()) > 0.1
        assert float((c["logits"] - want).abs().max()) <= 1e-5
        assert not c["bad"] and c["checked"] > 10000, c["bad"][:5]
        assert c["steps"] == [2.0] and c["after"] == [3.0]
        assert c["states"] == c["params"]


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_megatron_moe_checkpoint_loads_into_ddp_and_fsdp2(moe_run, wrap):
    """The Qwen3-MoE load under DDP (mapping="auto") and FSDP2 (the fused experts sharded over the experts
    axis) equals the one-process load; the next AdamW step lands where one process lands."""
    for r in moe_run:
        c = r[wrap]
        assert c["sharded"] and c["logits_diff"] <= 1e-6 and not c["bad"], c
        assert c["steps"] == [2.0] and c["states"] == c["params"]
        assert c["after_step_diff"] <= 1e-6, c


def test_hf_moe_checkpoint_loads_into_megatron_ep2(moe_run):
    """Qwen3-MoE saved by bcp with AdamW -> Megatron EP=2 (router, experts, q/k norms; moments into both
    chained optimizers): logits within 1e-5, moments equal, step 2, and one more Megatron step runs."""
    for r in moe_run:
        c = r["reverse"]
        assert c["logits_diff"] <= 1e-5, c
        assert not c["bad"] and c["checked"] > 10000, c["bad"][:5]
        assert c["steps"] == [2.0] and c["after"] == [3.0], c


@pytest.mark.parametrize("family", list(HF_CASES))
def test_export_moe_to_hf_loads_with_from_pretrained(moe_run, family, tmp_path):
    """`bcp export --to hf --mapping megatron-to-hf`: the experts written one tensor per expert and
    projection (the Hub's layout), which from_pretrained loads into the fused parameters: Megatron's logits."""
    from safetensors import safe_open

    from bcp_core.tools.cli import main
    config = tmp_path / "config.json"
    hf_config(family).to_json_file(str(config))
    out = tmp_path / "hf"
    assert main(["export", os.path.join(moe_run[0]["root"], HF_CASES[family]), str(out), "--to", "hf",
                 "--mapping", "megatron-to-hf", "--config", str(config)]) == 0
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    moe = "block_sparse_moe" if family == "mixtral" else "mlp"
    down = "w2" if family == "mixtral" else "down_proj"
    assert f"model.layers.1.{moe}.experts.3.{down}.weight" in keys and f"model.layers.0.{moe}.gate.weight" in keys
    cls = {"mixtral": transformers.MixtralForCausalLM, "qwen3_moe": transformers.Qwen3MoeForCausalLM,
           "qwen2_moe": transformers.Qwen2MoeForCausalLM}[family]
    hf = cls.from_pretrained(str(out)).eval()
    assert float((logits_of(hf) - moe_run[0]["megatron"][HF_CASES[family]]["logits"]).abs().max()) <= 1e-5


def test_export_refuses_a_wrong_expert_count(moe_run, tmp_path):
    from bcp_core.errors import ToolError
    from bcp_core.tools.convert import export_checkpoint
    config = tmp_path / "config.json"
    hf_config("mixtral", num_local_experts=8).to_json_file(str(config))
    with pytest.raises(ToolError, match=r"router.weight' has shape \(2, 4, 32\).*declares \(2, 8, 32\)"):
        export_checkpoint(os.path.join(moe_run[0]["root"], "mixtral_ep2_tp1"), str(tmp_path / "out"),
                          mapping="megatron-to-hf", config=str(config))
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- slow: more layouts, one more launch

def _more_layouts_job(rank, world_size, root):
    """EP=2 (stacked, chained_<n>. keys) into PP=2, into TP=2 with ETP=1 and into EP=1 with TP=2; Megatron's
    dp_reshardable layout saved and loaded at EP=2 (only the DP degree may change with it, as Megatron has
    it)."""
    import warnings
    warnings.filterwarnings("ignore")
    import bcp_integrations.megatron  # noqa: F401 - registers ("bcp", 1)
    from _megatron_cpu import cuda_on_cpu
    from megatron.core import dist_checkpointing as dcp

    import bcp_integrations.megatron as bm
    out: dict = {}
    with cuda_on_cpu():
        cfg, model = _moe_gpt("qwen2_moe", 2, 1)
        ddp, opt = _distributed(cfg, model)
        r = {"losses": _train(ddp, opt, [10, 11]), "logits": _run(ddp, tokens(99), forward_only=True)}
        _save(model, opt, os.path.join(root, "qwen2_moe_ep2_tp1"), avoid_prefix=False)
        sharded = _sharded(model, opt)
        sharded["optimizer"] = opt.sharded_state_dict(sharded["model"], metadata={
            "distrib_optim_sharding_type": "dp_reshardable"})
        os.makedirs(os.path.join(root, "dp_reshardable"), exist_ok=True)
        torch.distributed.barrier()
        dcp.save(sharded, os.path.join(root, "dp_reshardable"), sharded_strategy=("bcp", 1))
        r["next_loss"] = _train(ddp, opt, [50])[0]
        out["qwen2_moe_ep2_tp1"] = r
        out["pp2"] = _megatron_to_megatron(root, "qwen2_moe_ep2_tp1", 1, 1, pp=2, name="to_pp2")
        out["tp2_etp1"] = _megatron_to_megatron(root, "qwen2_moe_ep2_tp1", 2, 2, etp=1, name="to_tp2_etp1")
        out["ep1_tp2"] = _megatron_to_megatron(root, "qwen2_moe_ep2_tp1", 1, 2, name="to_ep1_tp2")
        cfg, model = _moe_gpt("qwen2_moe", 2, 1)
        ddp, opt = _distributed(cfg, model)
        _fresh_state(opt)
        sharded = _sharded(model, opt, loading=True)
        sharded["optimizer"] = opt.sharded_state_dict(sharded["model"], is_loading=True, metadata={
            "distrib_optim_sharding_type": "dp_reshardable"})
        state = dcp.load(sharded, os.path.join(root, "dp_reshardable"))
        model.load_state_dict(state["model"])
        opt.load_state_dict(bm.chained_optimizer_state(opt, state["optimizer"]))
        d = {"steps": _steps(opt), "logits": _run(ddp, tokens(99), forward_only=True)}
        _save(model, opt, os.path.join(root, "dp_reshardable_loaded"))
        d["next_loss"] = _train(ddp, opt, [50])[0]
        d["after"] = _steps(opt)
        out["dp_reshardable"] = d
        from megatron.core import parallel_state as ps
        ps.destroy_model_parallel()
    return {"layouts": out}


@pytest.fixture(scope="module")
def more_layouts_run(tmp_path_factory):
    pytest.importorskip("megatron.core")
    root = str(tmp_path_factory.mktemp("moe_layouts"))
    results = run_ranks(2, _more_layouts_job, root, timeout=400)
    results[0]["root"] = root
    return results


@pytest.mark.slow
@pytest.mark.parametrize("case, saved", [("pp2", "to_pp2"), ("tp2_etp1", "to_tp2_etp1"), ("ep1_tp2", "to_ep1_tp2"),
                                         ("dp_reshardable", "dp_reshardable_loaded")])
def test_megatron_moe_reshards_into_pipeline_and_expert_tensor_parallelism(more_layouts_run, case, saved):
    """EP=2 -> PP=2, -> TP=2 with ETP=1 and -> EP=1 with TP=2 (fully_reshardable), and dp_reshardable at
    the same layout: every tensor exact (saved again, stacked), the source's logits and next loss, the step
    carried."""
    root = more_layouts_run[0]["root"]
    bad, n = _same_checkpoints(os.path.join(root, "qwen2_moe_ep2_tp1"), os.path.join(root, saved))
    assert not bad and n > 40, bad[:5]
    _assert_continues(more_layouts_run, "layouts", "qwen2_moe_ep2_tp1", case)


def test_auto_loads_into_a_model_holding_one_module_per_expert(moe_run):
    """mapping="auto" on a model whose experts are modules of their own (transformers before 5, or any
    model named so) picks the per-expert layout: each expert's gate, up and down weights are the rows of
    Megatron's stacked experts the fused load gives too."""
    from torch import nn

    cfg = hf_config("qwen3_moe")

    class Expert(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = nn.Linear(HIDDEN, EXPERT_FFN, bias=False)
            self.up_proj = nn.Linear(HIDDEN, EXPERT_FFN, bias=False)
            self.down_proj = nn.Linear(EXPERT_FFN, HIDDEN, bias=False)

    fused = hf_model(cfg, seed=5)
    per_expert = hf_model(cfg, seed=5)
    for layer in per_expert.model.layers:  # the same model, its experts one module each
        layer.mlp.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))
    path = os.path.join(moe_run[0]["root"], "qwen3_moe_ep2_tp1")
    bcp.load(path, {"model": fused}, mapping="auto")
    bcp.load(path, {"model": per_expert}, mapping="auto")
    for i in range(LAYERS):
        want, got = fused.model.layers[i].mlp.experts, per_expert.model.layers[i].mlp.experts
        for e in range(EXPERTS):
            assert torch.equal(got[e].gate_proj.weight, want.gate_up_proj[e, :EXPERT_FFN])
            assert torch.equal(got[e].up_proj.weight, want.gate_up_proj[e, EXPERT_FFN:])
            assert torch.equal(got[e].down_proj.weight, want.down_proj[e])
        assert torch.equal(per_expert.model.layers[i].mlp.gate.weight, fused.model.layers[i].mlp.gate.weight)
