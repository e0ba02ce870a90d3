"""DeepSeek-V3 between a real Megatron-core GPTModel and transformers' DeepseekV3ForCausalLM, Adam state both
ways (docs/mapping.md): multi-latent attention with its low-rank q/kv projections and their norms, MoE with a
shared expert, sigmoid routing with the expert bias and group-limited top-k, the first layer dense, one
multi-token prediction layer. One 2-rank job (gloo, megatron-core 0.16.1, Megatron's DDP and
DistributedOptimizer under recipes/_megatron_cpu.py) whose cases the tests share:

- Megatron EP=2 (two chained DistributedOptimizers, `fully_reshardable`), trained 2 steps and saved through
  ("bcp", 1), into DeepseekV3ForCausalLM on one process, under DDP (mapping="auto") and FSDP2; exported to
  safetensors that `from_pretrained` (and transformers' `MtpModel.from_pretrained` for the MTP layer) load;
- the same checkpoint into Megatron at EP=1 with TP=2, through dist_checkpointing.load;
- a DeepseekV3ForCausalLM trained 2 AdamW steps and saved by bcp into Megatron at EP=2 (no MTP layer: a
  transformers model holds none).

The hand-made layouts of tests/test_mapping_deepseek.py say what Megatron's tensors should hold.
"""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch

import bcp_core as bcp

transformers = pytest.importorskip("transformers")

from dist import RECIPES, run_ranks  # noqa: E402
from megatron_pass import megatron_pass  # noqa: E402
from sharded_hf import hf_logits, load_into_hf_alone, load_into_wrapped_hf  # noqa: E402
from test_mapping_deepseek import (DENSE_FFN, EXPERT_FFN, EXPERTS, HEADS, HIDDEN, KV_LORA, LAYERS, NOPE,  # noqa: E402
                                   PADDED, Q_LORA, ROPE, V_HEAD, VOCAB, ds_config, ds_model, megatron_ds_layout,
                                   moments_by_name, mtp_part, trained)

if RECIPES not in sys.path:
    sys.path.insert(0, RECIPES)  # recipes/_megatron_cpu.py

SEQ = 8


def tokens(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, SEQ), generator=g)


def _ds_gpt(ep: int, tp: int = 1, mtp: bool = True):
    """A DeepSeek-V3-like GPTModel as ds_config() describes it (local spec; Transformer Engine's attention
    stood in for by recipes/_megatron_cpu.PlainAttention)."""
    import torch.nn.functional as F
    from _megatron_cpu import use_plain_attention
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                 create_gloo_process_groups=True)
    torch.manual_seed(1234)
    cfg = MLATransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=DENSE_FFN,
        q_lora_rank=Q_LORA, kv_lora_rank=KV_LORA, qk_head_dim=NOPE, qk_pos_emb_head_dim=ROPE, v_head_dim=V_HEAD,
        rope_type="rope", qk_layernorm=True, tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
        sequence_parallel=tp > 1, use_cpu_initialization=True, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, bias_activation_fusion=False, layernorm_epsilon=1e-6, hidden_dropout=0.0,
        attention_dropout=0.0, num_moe_experts=EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=EXPERT_FFN,
        moe_shared_expert_intermediate_size=EXPERT_FFN, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_num_groups=2, moe_router_group_topk=1,
        moe_router_topk_scaling_factor=2.5, moe_aux_loss_coeff=0.01, moe_router_load_balancing_type="seq_aux_loss",
        moe_layer_freq=[0] + [1] * (LAYERS - 1), mtp_num_layers=1 if mtp else None,
        moe_token_dispatcher_type="alltoall")
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    use_plain_attention(spec.layer_specs)
    mtp_spec = get_gpt_mtp_block_spec(cfg, spec.layer_specs[-1], use_transformer_engine=False) if mtp else None
    model = GPTModel(cfg, spec, vocab_size=PADDED, max_sequence_length=32, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False, mtp_block_spec=mtp_spec)
    with torch.no_grad():  # norms away from 1 and expert biases away from 0: a misplaced one shows in the logits
        for name, p in model.named_parameters():
            if "layernorm" in name or "norm.weight" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("router.weight"):
                p.normal_(0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.uniform_(-0.1, 0.1)
    return cfg, model


def _run(ddp, batch: torch.Tensor, forward_only: bool):
    """One pass of Megatron's schedule: the main head's logits [batch, seq, vocab] (the MTP layer left out:
    GPTModel runs it only with labels), or the loss of a training pass."""
    model = ddp.module
    mtp = model.mtp_process, model.config.mtp_num_layers
    if forward_only:
        model.mtp_process, model.config.mtp_num_layers = False, None
    try:
        return megatron_pass(ddp, batch, forward_only, SEQ, VOCAB)
    finally:
        model.mtp_process, model.config.mtp_num_layers = mtp


def _train(ddp, opt, seeds) -> list[float]:
    losses = []
    for s in seeds:
        ddp.zero_grad_buffer()
        opt.zero_grad()
        losses.append(_run(ddp, tokens(s), forward_only=False))
        opt.step()
    return losses


def _sharded(model, opt, *, loading=False, avoid_prefix=True):
    model_sd = model.sharded_state_dict()
    opt_sd = opt.sharded_state_dict(model_sd, is_loading=loading, metadata={
        "distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": avoid_prefix})
    return {"model": model_sd, "optimizer": opt_sd}


def _save(model, opt, path, **layout) -> None:
    from megatron.core import dist_checkpointing as dcp
    os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    dcp.save(_sharded(model, opt, **layout), path, sharded_strategy=("bcp", 1))


def _checkpoint_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a bcp checkpoint, chained_<n>. prefixes dropped."""
    from bcp_core.tools.read import open_checkpoint, read_tensor
    st, md = open_checkpoint(path)
    return {re.sub(r"^chained_\d+\.", "", k): read_tensor(st, md, k) for k in md.tensors}


def _against_layout(saved: dict, hf, hf_opt, mtp: bool = False) -> tuple[list[str], int]:
    """Megatron's saved weights and Adam moments against the Hugging Face model's and AdamW's, laid out by hand
    (weights; every moment per expert); padding rows have no counterpart, the MTP layer none in `hf`."""
    sd = {k: v.detach() for k, v in hf.state_dict().items()}
    want = megatron_ds_layout(sd, LAYERS)
    for name, by_param in moments_by_name(hf, hf_opt).items():
        want |= {k: v for k, v in megatron_ds_layout(by_param | {k: v for k, v in sd.items()
                                                                 if k.endswith("e_score_correction_bias")},
                                                     LAYERS, prefix=f"optimizer.state.{name}.").items()
                 if not k.endswith("expert_bias")}
    bad, checked = [], 0
    for k, w in want.items():
        if k not in saved:
            bad.append(f"{k} not in the checkpoint")
            continue
        got = saved[k]
        if k.endswith(("word_embeddings.weight", "output_layer.weight")):
            got, w = got[:VOCAB], w[:VOCAB]
        checked += got.numel()
        if not torch.equal(got, w):
            bad.append(f"{k}: max diff {float((got - w).abs().max())}")
    extra = [k for k in saved if k not in want and not k.startswith(("optimizer.state.param.", "mtp.")) and
             ".mtp." not in k]
    return bad + [f"{k} saved, not laid out" for k in extra], checked


def _into_hf(root: str, source: str) -> tuple[dict, dict]:
    """The Megatron checkpoint into DeepseekV3ForCausalLM and a fresh AdamW on this process alone."""
    hf = ds_model(ds_config(), seed=5)
    return load_into_hf_alone(hf, os.path.join(root, source), tokens,
                              lambda path, model, opt: _against_layout(_checkpoint_tensors(path), model, opt))


def logits_of(model) -> torch.Tensor:
    return hf_logits(model, tokens)


def _mtp_into_hf_names(root: str, source: str) -> dict:
    """The MTP layer's weights and Adam moments through megatron_to_hf(mtp_layers=1), as a plain dict in the
    files' names, against the checkpoint's mtp.layers.0 tensors."""
    cfg = ds_config(num_mtp_layers=1)
    m = bcp.mapping.megatron_to_hf(cfg, mtp_layers=1)
    mtp = {k: s for k, s in m.targets.items() if k.startswith(f"model.layers.{LAYERS}.")}
    target = {"model": {k: torch.zeros(s) for k, s in mtp.items()},
              "optimizer": {"state": {k: {"exp_avg": torch.zeros(s), "exp_avg_sq": torch.zeros(s)}
                                      for k, s in mtp.items() if not k.endswith("e_score_correction_bias")}}}
    path = os.path.join(root, source)
    bcp.load(path, target, mapping=m, strict=False)
    saved = _checkpoint_tensors(path)
    bad, checked = [], 0
    weights = mtp_part(target["model"], LAYERS)
    for k, v in weights.items():
        checked += v.numel()
        if not torch.equal(saved[k], v):
            bad.append(k)
    for name in ("exp_avg", "exp_avg_sq"):
        state = target["optimizer"]["state"]  # (the load also filled in what the checkpoint has beside the MTP)
        moments = {k: v for k, v in mtp_part({k: state[k][name] if k in state else target["model"][k] for k in mtp},
                                              LAYERS).items() if not k.endswith("expert_bias")}
        for k, v in moments.items():
            checked += v.numel()
            if not torch.equal(saved[f"optimizer.state.{name}.{k}"], v):
                bad.append(f"{name} {k}")
    return {"bad": bad, "checked": checked, "mtp_keys": len(weights)}


def _sharded_hf_target(wrap: str, path: str, ref: dict) -> dict:
    """The checkpoint into DeepseekV3ForCausalLM under DDP (mapping="auto") or FSDP2 on both ranks: compared
    with the same load on one process (`ref`), then one more step on both."""
    return load_into_wrapped_hf(ds_model(ds_config(), seed=5), wrap, path, ref, tokens,
                                "model.layers.1.mlp.experts.gate_up_proj")


def _steps(opt) -> list[float]:
    members = getattr(opt, "chained_optimizers", [opt])
    return sorted({float(s["step"]) for m in members for s in m.optimizer.state.values()})


def _megatron_to_megatron(root: str, source: str, ep: int, tp: int) -> dict:
    """The checkpoint into Megatron at EP=ep, TP=tp through dist_checkpointing.load (bcp regrouping the chain
    of optimizers); saved again for comparison; one more step."""
    from megatron.core import dist_checkpointing as dcp
    from test_mapping_moe import _distributed, _fresh_state

    import bcp_integrations.megatron as bm
    cfg, model = _ds_gpt(ep, tp)
    ddp, opt = _distributed(cfg, model)
    _fresh_state(opt)
    state = dcp.load(_sharded(model, opt, loading=True), os.path.join(root, source))
    model.load_state_dict(state["model"])
    opt.load_state_dict(bm.chained_optimizer_state(opt, state["optimizer"]))
    r = {"steps": _steps(opt), "logits": _run(ddp, tokens(99), forward_only=True)}
    _save(model, opt, os.path.join(root, f"{source}_to_ep{ep}_tp{tp}"))
    r["next_loss"] = _train(ddp, opt, [50])[0]
    r["after"] = _steps(opt)
    return r


def _hf_to_megatron(root: str) -> dict:
    """A DeepseekV3ForCausalLM trained 2 AdamW steps and saved by bcp (both ranks hold it: a replicated save)
    into Megatron at EP=2 (no MTP layer) and its two chained DistributedOptimizers, through
    bm.load(mapping=)."""
    from test_mapping_moe import _distributed, _fresh_state

    import bcp_integrations.megatron as bm
    hf = ds_model(ds_config(), seed=11)
    hf_opt = trained(hf)
    hf.eval()
    path = os.path.join(root, "hf_deepseek")
    bcp.save(path, {"model": hf, "optimizer": hf_opt}).wait()
    cfg, model = _ds_gpt(2, mtp=False)
    ddp, opt = _distributed(cfg, model)
    _fresh_state(opt)
    loaded = bm.load(_sharded(model, opt, loading=True, avoid_prefix=False), path,
                     mapping=bcp.mapping.hf_to_megatron(hf.config))
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    r = {"logits_diff": float((_run(ddp, tokens(99), forward_only=True) - logits_of(hf)).abs().max()),
         "scale": float(logits_of(hf).abs().max()), "steps": _steps(opt)}
    _save(model, opt, path + "_to_megatron")
    r["bad"], r["checked"] = _against_layout(_checkpoint_tensors(path + "_to_megatron"), hf, hf_opt)
    _train(ddp, opt, [50])
    r["after"] = _steps(opt)
    return r


def _deepseek_job(rank, world_size, root):
    import warnings
    warnings.filterwarnings("ignore")
    import bcp_integrations.megatron  # noqa: F401 - registers ("bcp", 1)
    from _megatron_cpu import cuda_on_cpu
    from test_mapping_moe import _distributed

    out: dict = {}
    with cuda_on_cpu():
        cfg, model = _ds_gpt(2)
        ddp, opt = _distributed(cfg, model)
        r = {"losses": _train(ddp, opt, [10, 11]), "chain": len(opt.chained_optimizers)}
        r["logits"] = _run(ddp, tokens(99), forward_only=True)
        _save(model, opt, os.path.join(root, "deepseek_ep2"), avoid_prefix=False)
        r["next_loss"] = _train(ddp, opt, [50])[0]
        out["source"] = r
        out["ep1_tp2"] = _megatron_to_megatron(root, "deepseek_ep2", 1, 2)
        out["reverse"] = _hf_to_megatron(root)
        from megatron.core import parallel_state as ps
        ps.destroy_model_parallel()
    out["hf"], ref = _into_hf(root, "deepseek_ep2")
    out["mtp"] = _mtp_into_hf_names(root, "deepseek_ep2")
    for wrap in ("ddp", "fsdp2"):
        out[wrap] = _sharded_hf_target(wrap, os.path.join(root, "deepseek_ep2"), ref)
    return out


@pytest.fixture(scope="module")
def deepseek_run(tmp_path_factory):
    pytest.importorskip("megatron.core")
    root = str(tmp_path_factory.mktemp("deepseek"))
    results = run_ranks(2, _deepseek_job, root, timeout=500)
    results[0]["root"] = root
    return results


def test_megatron_deepseek_checkpoint_loads_into_hf(deepseek_run):
    """Megatron EP=2 -> DeepseekV3ForCausalLM on one process: logits within 1e-5 of their scale, every Adam
    moment (per expert, the shared expert's, the latent projections' and their norms') equal to the
    DistributedOptimizer's saved state, the router's expert bias carried, step 2, one more AdamW step."""
    for r in deepseek_run:
        want = r["source"]["logits"]
        c = r["hf"]
        scale, diff = float(want.abs().max()), float((c["logits"] - want).abs().max())
        print(f"DeepseekV3ForCausalLM logits against Megatron's: max difference {diff:.1e}, scale {scale:.2f}")
        assert scale > 0.1 and diff <= 1e-5 * scale
        assert not c["bad"] and c["checked"] > 10000, c["bad"][:5]
        assert c["steps"] == [2.0] and c["after"] == [3.0]
        assert c["states"] == c["params"]


def test_megatron_saves_the_deepseek_layout_the_mapping_declares(deepseek_run):
    """The facts of docs/mapping.md as megatron-core 0.16.1 writes them: per-layer keys (the first layer
    dense), the latent projections' shapes, the experts on an axis of their own, the expert bias, the MTP
    layer's enorm / hnorm / eh_proj / final_layernorm around a decoder layer."""
    md = bcp.inspect(os.path.join(deepseek_run[0]["root"], "deepseek_ep2"))
    shapes = {k: tuple(tm.shape) for k, tm in md.tensors.items() if not k.startswith(("optimizer.", "chained_"))}
    want = {"embedding.word_embeddings.weight": (PADDED, HIDDEN), "output_layer.weight": (PADDED, HIDDEN),
            "decoder.final_layernorm.weight": (HIDDEN,), "mtp.layers.0.enorm.weight": (HIDDEN,),
            "mtp.layers.0.hnorm.weight": (HIDDEN,), "mtp.layers.0.eh_proj.weight": (HIDDEN, 2 * HIDDEN),
            "mtp.layers.0.final_layernorm.weight": (HIDDEN,)}
    for i, p in [(i, f"decoder.layers.{i}.") for i in range(LAYERS)] + [(LAYERS, "mtp.layers.0.transformer_layer.")]:
        want |= {f"{p}input_layernorm.weight": (HIDDEN,), f"{p}pre_mlp_layernorm.weight": (HIDDEN,),
                 f"{p}self_attention.linear_q_down_proj.weight": (Q_LORA, HIDDEN),
                 f"{p}self_attention.q_layernorm.weight": (Q_LORA,),
                 f"{p}self_attention.linear_q_up_proj.weight": (HEADS * (NOPE + ROPE), Q_LORA),
                 f"{p}self_attention.linear_kv_down_proj.weight": (KV_LORA + ROPE, HIDDEN),
                 f"{p}self_attention.kv_layernorm.weight": (KV_LORA,),
                 f"{p}self_attention.linear_kv_up_proj.weight": (HEADS * (NOPE + V_HEAD), KV_LORA),
                 f"{p}self_attention.linear_proj.weight": (HIDDEN, HEADS * V_HEAD)}
        if i == 0:
            want |= {f"{p}mlp.linear_fc1.weight": (2 * DENSE_FFN, HIDDEN),
                     f"{p}mlp.linear_fc2.weight": (HIDDEN, DENSE_FFN)}
        else:
            want |= {f"{p}mlp.router.weight": (EXPERTS, HIDDEN), f"{p}mlp.router.expert_bias": (EXPERTS,),
                     f"{p}mlp.experts.experts.linear_fc1.weight": (EXPERTS, 2 * EXPERT_FFN, HIDDEN),
                     f"{p}mlp.experts.experts.linear_fc2.weight": (EXPERTS, HIDDEN, EXPERT_FFN),
                     f"{p}mlp.shared_experts.linear_fc1.weight": (2 * EXPERT_FFN, HIDDEN),
                     f"{p}mlp.shared_experts.linear_fc2.weight": (HIDDEN, EXPERT_FFN)}
    assert shapes == want
    assert bcp.mapping.layout_of(md.tensors) == ("per_layer", 1)


def test_mtp_layer_weights_and_moments_into_hf_names(deepseek_run):
    """mtp.layers.0 (its norms and projection, MLA, experts, shared expert) as the files' layer L, weights and
    Adam moments equal to the saved ones."""
    c = deepseek_run[0]["mtp"]
    assert not c["bad"] and c["mtp_keys"] > 15 and c["checked"] > 5000, c["bad"][:5]


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_megatron_deepseek_checkpoint_loads_into_ddp_and_fsdp2(deepseek_run, wrap):
    """Under DDP (mapping="auto": the family from the config, the per-layer layout from the checkpoint's names)
    and FSDP2 (the fused experts sharded over the experts axis): the one-process load, and its next step."""
    for r in deepseek_run:
        c = r[wrap]
        assert c["sharded"] and c["logits_diff"] <= 1e-6 and not c["bad"], c
        assert c["steps"] == [2.0] and c["states"] == c["params"]
        assert c["after_step_diff"] <= 1e-6, c


def test_megatron_deepseek_reshards_across_expert_and_tensor_parallelism(deepseek_run):
    """EP=2 -> EP=1 with TP=2 (the latent up-projections split over TP) through dist_checkpointing.load:
    every tensor saved again equals the source's, the logits and the next loss are the source's."""
    root = deepseek_run[0]["root"]
    a, b = _checkpoint_tensors(os.path.join(root, "deepseek_ep2")), \
        _checkpoint_tensors(os.path.join(root, "deepseek_ep2_to_ep1_tp2"))
    assert a.keys() == b.keys() and len(a) > 100
    assert not [k for k in a if not torch.equal(a[k], b[k])]
    for r in deepseek_run:
        src, dst = r["source"], r["ep1_tp2"]
        assert dst["steps"] == [2.0] and dst["after"] == [3.0], dst
        assert float((src["logits"] - dst["logits"]).abs().max()) <= 1e-5 * float(src["logits"].abs().max())
        assert abs(src["next_loss"] - dst["next_loss"]) <= 1e-5 * abs(src["next_loss"])


def test_hf_deepseek_checkpoint_loads_into_megatron_ep2(deepseek_run):
    """DeepseekV3ForCausalLM saved by bcp with AdamW -> Megatron EP=2 (the expert bias from
    e_score_correction_bias; moments into both chained optimizers): logits within 1e-5 of their scale,
    moments equal, step 2, one more Megatron step."""
    for r in deepseek_run:
        c = r["reverse"]
        print(f"Megatron logits against DeepseekV3ForCausalLM's: max difference {c['logits_diff']:.1e}, "
              f"scale {c['scale']:.2f}")
        assert c["logits_diff"] <= 1e-5 * c["scale"], c
        assert not c["bad"] and c["checked"] > 10000, c["bad"][:5]
        assert c["steps"] == [2.0] and c["after"] == [3.0], c


def test_export_deepseek_loads_with_from_pretrained_and_mtp_model(deepseek_run, tmp_path):
    """`bcp export --to hf --mapping megatron-to-hf`: from_pretrained gives Megatron's logits, and transformers'
    MtpModel.from_pretrained reads the multi-token prediction layer (written as layer L) with Megatron's
    weights; a config declaring no MTP layer is refused before anything is written."""
    from transformers.modeling_layers import MtpModel

    from bcp_core.errors import ToolError
    from bcp_core.tools.cli import main
    from bcp_core.tools.convert import export_checkpoint
    root = deepseek_run[0]["root"]
    config = tmp_path / "config.json"
    ds_config(num_mtp_layers=1).to_json_file(str(config))
    out = tmp_path / "hf"
    assert main(["export", os.path.join(root, "deepseek_ep2"), str(out), "--to", "hf", "--mapping", "megatron-to-hf",
                 "--config", str(config)]) == 0
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(str(out)).eval()
    want = deepseek_run[0]["source"]["logits"]
    assert float((logits_of(hf) - want).abs().max()) <= 1e-5 * float(want.abs().max())
    # transformers finds the MTP layer in files by DeepseekV3's ignore pattern, written for the real model's 61
    # layers (model.layers.61.*): for this 3-layer model, the same pattern at its layer number
    hf._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{LAYERS}.*"]
    mtp = MtpModel.from_pretrained(hf)
    files = {}
    for n, t in mtp.state_dict().items():
        if n.startswith("layers.0."):
            n = n.removeprefix("layers.0.").removeprefix("mtp_block.").replace("post_norm.", "shared_head.norm.")
            files[f"model.layers.{LAYERS}.{n}"] = t
    saved = _checkpoint_tensors(os.path.join(root, "deepseek_ep2"))
    laid = mtp_part(files, LAYERS)
    assert len(laid) > 15 and all(torch.equal(saved[k], v) for k, v in laid.items())
    ds_config(num_mtp_layers=0).to_json_file(str(config))
    with pytest.raises(ToolError, match=r"declares 0 multi-token prediction layer.*holds 1"):
        export_checkpoint(os.path.join(root, "deepseek_ep2"), str(tmp_path / "out"), mapping="megatron-to-hf",
                          config=str(config))
    assert not (tmp_path / "out").exists()
