"""megatron-core 0.19's HybridModel (GPTModel's successor) between Megatron layouts and Hugging Face, Adam state
both ways (docs/mapping.md): one sub-layer per layer number, in the order of its pattern. "*-*-" (attention,
MLP) is the Llama family's layer; "+-+E" (multi-latent attention, then a dense MLP in the first layer and MoE
with a shared expert and the expert bias in the second) DeepSeek-V3's with one dense first layer.

One 2-rank job on the 0.19.0 source tree (gloo, Megatron's DDP and DistributedOptimizer under
recipes/_megatron_cpu.py, whose `hybrid_local_spec` builds the stack from local modules saving Transformer
Engine's keys): "*-*-" trained at TP=2 and "+-+E" at EP=2 (two chained optimizers), saved through ("bcp", 1),
into LlamaForCausalLM (mapping="auto": the pattern read from the checkpoint's names) and
DeepseekV3ForCausalLM on one process; resharded through dist_checkpointing.load into "*-|*-" at PP=2 and
"+-+E" at EP=1 with TP=2; a DeepseekV3ForCausalLM saved by bcp into "+-+E" at EP=2. Slow tier: a launch on
the 0.19 tree (imports alone take tens of seconds on the 2-core machine); the default tier checks the same
layouts built by hand (tests/test_mapping_deepseek.py).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

import bcp_core as bcp
import megatron_releases

transformers = pytest.importorskip("transformers")

from dist import RECIPES, run_ranks  # noqa: E402
from megatron_pass import megatron_pass  # noqa: E402
from test_mapping_deepseek import (DENSE_FFN, EXPERT_FFN, EXPERTS, HEADS, HIDDEN, KV_LORA, NOPE, PADDED,  # noqa: E402
                                   Q_LORA, ROPE, V_HEAD, VOCAB, ds_config, ds_model, hybrid_llama_layout,
                                   megatron_ds_layout, moments_by_name, trained)

if RECIPES not in sys.path:
    sys.path.insert(0, RECIPES)  # recipes/_megatron_cpu.py

pytestmark = pytest.mark.slow
RELEASE = megatron_releases.params(need_tree=True, releases=("0.19.0",))
SEQ, HF_LAYERS = 8, 2


def tokens(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, SEQ), generator=g)


def llama_config():
    return transformers.LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=2,
                                    num_hidden_layers=HF_LAYERS, intermediate_size=DENSE_FFN, vocab_size=VOCAB,
                                    rms_norm_eps=1e-6, max_position_embeddings=32, tie_word_embeddings=False)


def deepseek_config():
    return ds_config(num_hidden_layers=HF_LAYERS, first_k_dense_replace=1)


def _hybrid(kind: str, tp: int = 1, pp: int = 1, ep: int = 1):
    """A HybridModel of `kind` "llama" ("*-*-") or "deepseek" ("+-+E"), at TP / PP ('|' between the stages) /
    EP, built as its Hugging Face config describes it."""
    import torch.nn.functional as F
    from _megatron_cpu import hybrid_local_spec
    from megatron.core import parallel_state as ps
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep, create_gloo_process_groups=True)
    torch.manual_seed(1234 + ps.get_pipeline_model_parallel_rank())
    common = dict(num_layers=2 * HF_LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=DENSE_FFN,
                  tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                  sequence_parallel=tp > 1 and kind == "deepseek", use_cpu_initialization=True,
                  params_dtype=torch.float32, pipeline_dtype=torch.float32, normalization="RMSNorm",
                  gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, bias_activation_fusion=False,
                  layernorm_epsilon=1e-6, hidden_dropout=0.0, attention_dropout=0.0, transformer_impl="local")
    if kind == "llama":
        cfg = TransformerConfig(num_query_groups=2, **common)
        pattern = "*-|*-" if pp > 1 else "*-*-"
    else:
        cfg = MLATransformerConfig(
            q_lora_rank=Q_LORA, kv_lora_rank=KV_LORA, qk_head_dim=NOPE, qk_pos_emb_head_dim=ROPE, v_head_dim=V_HEAD,
            rope_type="rope", qk_layernorm=True, num_moe_experts=EXPERTS, moe_router_topk=2,
            moe_ffn_hidden_size=EXPERT_FFN, moe_shared_expert_intermediate_size=EXPERT_FFN,
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_num_groups=2,
            moe_router_group_topk=1, moe_router_topk_scaling_factor=2.5, moe_aux_loss_coeff=0.01,
            moe_router_load_balancing_type="seq_aux_loss", moe_token_dispatcher_type="alltoall", **common)
        pattern = "+-|+E" if pp > 1 else "+-+E"
    model = HybridModel(cfg, hybrid_local_spec(cfg), vocab_size=PADDED, max_sequence_length=32,
                        hybrid_layer_pattern=pattern, position_embedding_type="rope",
                        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    with torch.no_grad():  # norms away from 1, router weights and expert biases spread: a misplaced one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("router.weight"):
                p.normal_(0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.uniform_(-0.1, 0.1)
    return cfg, model


def _run(ddp, batch: torch.Tensor, forward_only: bool):
    """One pass of Megatron's schedule: logits [batch, seq, vocab], or the loss; None on an earlier stage."""
    return megatron_pass(ddp, batch, forward_only, SEQ, VOCAB)


def _train(ddp, opt, seeds) -> list:
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


def _sharded(model, opt, loading=False, avoid_prefix=True):
    model_sd = model.sharded_state_dict()
    return {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=loading, metadata={
        "distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": avoid_prefix})}


def _save(model, opt, path, **layout) -> None:
    from megatron.core import dist_checkpointing as dcp
    os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    dcp.save(_sharded(model, opt, **layout), path, sharded_strategy=("bcp", 1))


def _source(root: str, kind: str, **layout) -> dict:
    from test_mapping_moe import _distributed
    cfg, model = _hybrid(kind, **layout)
    ddp, opt = _distributed(cfg, model)
    r = {"losses": _train(ddp, opt, [10, 11]), "logits": _run(ddp, tokens(99), forward_only=True)}
    _save(model, opt, os.path.join(root, kind), avoid_prefix=False)
    r["next_loss"] = _train(ddp, opt, [50])[0]
    return r


def _resharded(root: str, kind: str, **layout) -> dict:
    """The `kind` checkpoint into a fresh HybridModel at `layout` through dist_checkpointing.load; saved again."""
    from megatron.core import dist_checkpointing as dcp
    from test_mapping_moe import _distributed

    import bcp_integrations.megatron as bm
    cfg, model = _hybrid(kind, **layout)
    ddp, opt = _distributed(cfg, model)
    state = dcp.load(_sharded(model, opt, loading=True), os.path.join(root, kind))
    model.load_state_dict(state["model"])
    opt.load_state_dict(bm.chained_optimizer_state(opt, state["optimizer"]))
    r = {"steps": _steps(opt), "logits": _run(ddp, tokens(99), forward_only=True)}
    _save(model, opt, os.path.join(root, f"{kind}_resharded"))
    r["next_loss"] = _train(ddp, opt, [50])[0]
    r["after"] = _steps(opt)
    return r


def _laid_out(kind: str, sd: dict) -> dict:
    return hybrid_llama_layout(sd, llama_config()) if kind == "llama" else megatron_ds_layout(sd, HF_LAYERS, "hybrid")


def _against_layout(path: str, kind: str, hf, hf_opt) -> tuple[list[str], int]:
    """The checkpoint's weights and Adam moments against the Hugging Face model's and AdamW's laid out by hand."""
    import re

    from bcp_core.tools.read import open_checkpoint, read_tensor
    st, md = open_checkpoint(path)
    saved = {re.sub(r"^chained_\d+\.", "", k): k for k in md.tensors}
    sd = {k: v.detach() for k, v in hf.state_dict().items()}
    want = _laid_out(kind, sd)
    buffers = {k: v for k, v in sd.items() if k.endswith("e_score_correction_bias")}
    for name, by_param in moments_by_name(hf, hf_opt).items():
        want |= {f"optimizer.state.{name}.{k}": v for k, v in _laid_out(kind, by_param | buffers).items()
                 if not k.endswith("expert_bias")}
    bad, checked = [], 0
    for k, w in want.items():
        if k not in saved:
            bad.append(f"{k} not in the checkpoint")
            continue
        got = read_tensor(st, md, saved[k])
        if k.endswith(("word_embeddings.weight", "output_layer.weight")):
            got, w = got[:VOCAB], w[:VOCAB]
        checked += got.numel()
        if not torch.equal(got, w):
            bad.append(f"{k}: max diff {float((got - w).abs().max())}")
    return bad + [f"{k} saved, not laid out" for k in saved if k not in want and ".param." not in k], checked


def _into_hf(root: str, kind: str) -> dict:
    """The `kind` checkpoint into its Hugging Face model and a fresh AdamW on this process alone ("llama" with
    mapping="auto", "deepseek" with the pattern given)."""
    hf = transformers.LlamaForCausalLM(llama_config()) if kind == "llama" else ds_model(deepseek_config(), seed=5)
    hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-2, weight_decay=0.01)
    path = os.path.join(root, kind)
    mapping = "auto" if kind == "llama" else bcp.mapping.megatron_to_hf(hf.config, layout="+-+E")
    bcp.load(path, {"model": hf, "optimizer": hf_opt}, mapping=mapping)
    with torch.no_grad():
        r = {"logits": hf(input_ids=tokens(99)).logits.clone()}
    r["steps"] = sorted({float(s["step"]) for s in hf_opt.state.values()})
    r["states"], r["params"] = len(hf_opt.state), len(list(hf.parameters()))
    r["bad"], r["checked"] = _against_layout(path, kind, hf, hf_opt)
    hf(input_ids=tokens(7), labels=tokens(7)).loss.backward()
    hf_opt.step()
    r["after"] = sorted({float(s["step"]) for s in hf_opt.state.values()})
    return r


def _hf_to_hybrid(root: str) -> dict:
    """A DeepseekV3ForCausalLM trained 2 AdamW steps and saved by bcp into "+-+E" at EP=2."""
    from test_mapping_moe import _distributed

    import bcp_integrations.megatron as bm
    hf = ds_model(deepseek_config(), seed=11)
    hf_opt = trained(hf)
    hf.eval()
    path = os.path.join(root, "hf_deepseek")
    bcp.save(path, {"model": hf, "optimizer": hf_opt}).wait()
    cfg, model = _hybrid("deepseek", ep=2)
    ddp, opt = _distributed(cfg, model)
    loaded = bm.load(_sharded(model, opt, loading=True, avoid_prefix=False), path,
                     mapping=bcp.mapping.hf_to_megatron(hf.config, layout="+-+E"))
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    with torch.no_grad():
        want = hf(input_ids=tokens(99)).logits
    r = {"logits_diff": float((_run(ddp, tokens(99), forward_only=True) - want).abs().max()),
         "scale": float(want.abs().max()), "steps": _steps(opt)}
    _save(model, opt, path + "_to_hybrid")
    r["bad"], r["checked"] = _against_layout(path + "_to_hybrid", "deepseek", hf, hf_opt)
    _train(ddp, opt, [50])
    r["after"] = _steps(opt)
    return r


def _hybrid_job(rank, world_size, root, release):
    import warnings
    warnings.filterwarnings("ignore")
    megatron_releases.activate(release, need_tree=True)
    megatron_releases.check_active(release)
    import bcp_integrations.megatron  # noqa: F401 - routes dist_checkpointing to bcp
    from _megatron_cpu import cuda_on_cpu

    out: dict = {}
    with cuda_on_cpu():
        out["llama"] = _source(root, "llama", tp=2)
        out["llama_pp2"] = _resharded(root, "llama", pp=2)
        out["deepseek"] = _source(root, "deepseek", ep=2)
        out["deepseek_ep1_tp2"] = _resharded(root, "deepseek", tp=2)
        out["reverse"] = _hf_to_hybrid(root)
        from megatron.core import parallel_state as ps
        ps.destroy_model_parallel()
    out["hf_llama"] = _into_hf(root, "llama")
    out["hf_deepseek"] = _into_hf(root, "deepseek")
    return _portable(out)


def _portable(value):
    """`value` with every tensor a numpy array: megatron-core 0.19 pickles a tensor's storage through its own
    loader, which the test process (megatron-core 0.16.1) lacks."""
    if isinstance(value, torch.Tensor):
        return value.numpy()
    if isinstance(value, dict):
        return {k: _portable(v) for k, v in value.items()}
    return value


@pytest.fixture(scope="module", params=RELEASE)
def hybrid_run(request, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hybrid"))
    results = run_ranks(2, _hybrid_job, root, request.param, timeout=900)
    results[0]["root"] = root
    return results


def _close(a, b) -> bool:
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    diff, scale = float((a - b).abs().max()), float(b.abs().max())
    print(f"logits: max difference {diff:.1e}, scale {scale:.2f}")
    return diff <= 1e-5 * scale


def test_hybrid_saves_the_layout_the_mapping_declares(hybrid_run):
    """The checkpoints' names are what layout_of reads: the patterns, no multi-token prediction layer."""
    root = hybrid_run[0]["root"]
    assert bcp.mapping.layout_of(bcp.inspect(os.path.join(root, "llama")).tensors) == ("*-*-", 0)
    assert bcp.mapping.layout_of(bcp.inspect(os.path.join(root, "deepseek")).tensors) == ("+-+E", 0)


@pytest.mark.parametrize("kind", ["llama", "deepseek"])
def test_hybrid_checkpoint_loads_into_hf(hybrid_run, kind):
    """"*-*-" (TP=2) into LlamaForCausalLM with mapping="auto", "+-+E" (EP=2) into DeepseekV3ForCausalLM: logits
    within 1e-5 of their scale, every Adam moment (per expert) equal to the saved one, step 2, one more step."""
    for r in hybrid_run:
        c = r[f"hf_{kind}"]
        assert _close(c["logits"], r[kind]["logits"]) and float(abs(c["logits"]).max()) > 0.1
        assert not c["bad"] and c["checked"] > 5000, c["bad"][:5]
        assert c["steps"] == [2.0] and c["after"] == [3.0] and c["states"] == c["params"]


@pytest.mark.parametrize("kind, case", [("llama", "llama_pp2"), ("deepseek", "deepseek_ep1_tp2")])
def test_hybrid_reshards_across_tp_pp_and_ep(hybrid_run, kind, case):
    """"*-*-" TP=2 -> "*-|*-" PP=2, "+-+E" EP=2 -> EP=1 with TP=2, through dist_checkpointing.load: every tensor
    saved again equals the source's, the logits and the next loss are the source's, the step carried."""
    from bcp_core.tools.read import open_checkpoint, read_tensor
    root = hybrid_run[0]["root"]
    (sa, ma), (sb, mb) = (open_checkpoint(os.path.join(root, name)) for name in (kind, f"{kind}_resharded"))
    plain = {k.split(".", 1)[1] if k.startswith("chained_") else k: k for k in ma.tensors}
    other = {k.split(".", 1)[1] if k.startswith("chained_") else k: k for k in mb.tensors}
    assert plain.keys() == other.keys() and len(plain) > 30
    assert not [k for k in plain if not torch.equal(read_tensor(sa, ma, plain[k]), read_tensor(sb, mb, other[k]))]
    for r in hybrid_run:
        src, dst = r[kind], r[case]
        assert dst["steps"] == [2.0] and dst["after"] == [3.0], dst
        if dst["logits"] is not None:
            assert _close(dst["logits"], src["logits"])
            assert abs(dst["next_loss"] - src["next_loss"]) <= 1e-5 * abs(src["next_loss"])


def test_hf_deepseek_checkpoint_loads_into_hybrid_ep2(hybrid_run):
    """DeepseekV3ForCausalLM saved by bcp with AdamW -> "+-+E" at EP=2: logits within 1e-5 of their scale, the
    moments (both chained optimizers) equal, step 2, one more Megatron step."""
    for r in hybrid_run:
        c = r["reverse"]
        print(f"HybridModel logits against DeepseekV3ForCausalLM's: max difference {c['logits_diff']:.1e}, "
              f"scale {c['scale']:.2f}")
        assert c["logits_diff"] <= 1e-5 * c["scale"], c
        assert not c["bad"] and c["checked"] > 5000, c["bad"][:5]
        assert c["steps"] == [2.0] and c["after"] == [3.0], c


@pytest.mark.parametrize("kind", ["llama", "deepseek"])
def test_export_hybrid_loads_with_from_pretrained(hybrid_run, kind, tmp_path):
    """`bcp export --to hf --mapping megatron-to-hf` of a HybridModel checkpoint (the pattern read from its
    names): from_pretrained gives the HybridModel's logits."""
    from bcp_core.tools.cli import main
    config = tmp_path / "config.json"
    (llama_config() if kind == "llama" else deepseek_config()).to_json_file(str(config))
    out = tmp_path / "hf"
    assert main(["export", os.path.join(hybrid_run[0]["root"], kind), str(out), "--to", "hf", "--mapping",
                 "megatron-to-hf", "--config", str(config)]) == 0
    cls = transformers.LlamaForCausalLM if kind == "llama" else transformers.DeepseekV3ForCausalLM
    hf = cls.from_pretrained(str(out)).eval()
    with torch.no_grad():
        got = hf(input_ids=tokens(99)).logits
    assert _close(got, hybrid_run[0][kind]["logits"])
