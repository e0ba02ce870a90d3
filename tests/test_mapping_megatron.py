"""A real Megatron-core GPTModel checkpoint loads into a Hugging Face LlamaForCausalLM, and back.

One 2-rank job (gloo, Megatron's DDP and DistributedOptimizer under recipes/_megatron_cpu.py) builds a
tiny Llama-like GPTModel (local spec, RMSNorm, SwiGLU, GQA with 2 query groups for 4 heads, RoPE,
no biases, vocabulary 100 padded to 128 * TP), trains it 2 steps at TP=2 (tied and untied
embeddings), at PP=2 and at DP=2 (tied), and at TP=2 with q/k/v biases (a Qwen2, loaded into
Qwen2ForCausalLM), and saves it through `("bcp", 1)` twice: with Megatron's
own `fully_reshardable` optimizer layout, and with bcp's gather-free
`fully_reshardable_param_state` (the two must hold the same tensors). On every rank it loads the
gather-free one into a LlamaForCausalLM on its own (one process) with `megatron_to_hf`. Each rank
reports, per case, how far the Hugging Face logits are from Megatron's and whether the AdamW
moments equal the Megatron optimizer's own state for the part of each parameter this rank holds;
the tests assert on those reports.
"""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from dist import RECIPES, run_ranks  # noqa: E402
from megatron_pass import megatron_distributed, megatron_pass  # noqa: E402
from sharded_hf import load_into_wrapped_hf  # noqa: E402

if RECIPES not in sys.path:
    sys.path.insert(0, RECIPES)  # recipes/_megatron_cpu.py: Megatron's DDP and DistributedOptimizer on CPU

VOCAB, HIDDEN, HEADS, GROUPS, FFN, LAYERS, SEQ = 100, 32, 4, 2, 48, 2, 8
CASES = {"tp2_untied": (2, 1, False), "tp2_tied": (2, 1, True), "pp2_untied": (1, 2, False),
         "pp2_tied": (1, 2, True), "dp2_tied": (1, 1, True), "tp2_qwen2": (2, 1, False)}
QWEN2 = {"tp2_qwen2"}  # the same model with q/k/v biases (Megatron add_qkv_bias): a Qwen2


def hf_config(tied: bool, qwen2: bool = False):
    dims = dict(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=GROUPS, num_hidden_layers=LAYERS,
                intermediate_size=FFN, vocab_size=VOCAB, rms_norm_eps=1e-5, rope_theta=10000.0,
                max_position_embeddings=32, tie_word_embeddings=tied)
    if qwen2:
        return transformers.Qwen2Config(**dims)
    return transformers.LlamaConfig(**dims, attention_bias=False)


def hf_model(config):
    return (transformers.Qwen2ForCausalLM if config.model_type == "qwen2" else transformers.LlamaForCausalLM)(config)


def tokens(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, SEQ), generator=g)


# ----------------------------------------------------------------------------- rank side

def _gpt(tp: int, pp: int, tied: bool, qkv_bias: bool = False):
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 create_gloo_process_groups=True)
    torch.manual_seed(1234 + ps.get_pipeline_model_parallel_rank())
    cfg = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                            num_query_groups=GROUPS, ffn_hidden_size=FFN, tensor_model_parallel_size=tp,
                            pipeline_model_parallel_size=pp, use_cpu_initialization=True,
                            params_dtype=torch.float32, pipeline_dtype=torch.float32, normalization="RMSNorm",
                            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                            bias_activation_fusion=False, layernorm_epsilon=1e-5, hidden_dropout=0.0,
                            attention_dropout=0.0, add_qkv_bias=qkv_bias)
    model = GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=128 * tp,
                     max_sequence_length=32, position_embedding_type="rope", rotary_base=10000,
                     share_embeddings_and_output_weights=tied, pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage())
    with torch.no_grad():  # norms away from 1 and biases away from 0: a misplaced one shows in the logits
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_()
    return cfg, model


_distributed = megatron_distributed


def _train(ddp, opt, batches) -> None:
    """One optimizer step per batch: zeroed gradients, a pipeline pass with backward, the step."""
    for batch in batches:
        ddp.zero_grad_buffer()
        opt.zero_grad()
        megatron_pass(ddp, batch, False, SEQ, VOCAB)
        opt.step()


def _megatron_moments(model, opt) -> dict:
    """{(key, global offsets, lengths): {state: tensor}} of this rank's parameters, from the
    DistributedOptimizer's own state (DP=1: each TP-local parameter whole), placed as Megatron's
    sharded state dict places them (factories built: SwiGLU's fc1 is two boxes)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from bcp_integrations.megatron.adapter import iter_leaves
    distopt = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt
    by_param = {}
    for _, sh in iter_leaves(model.sharded_state_dict()):
        if isinstance(sh, (ShardedTensor, ShardedTensorFactory)):
            by_param[id(sh.data)] = sh
    out = {}
    for p in model.parameters():
        sh = by_param[id(p)]
        states = distopt._get_main_param_and_optimizer_states(p)
        local = {k: v.detach().view(p.shape).clone() for k, v in states.items() if k in ("exp_avg", "exp_avg_sq")}
        parts = [sh] if isinstance(sh, ShardedTensor) else None
        if parts is None:  # the factory describes parts of the local tensor: build it over the states
            built = {k: sh.build_fn(sh.key, v, sh.replica_id, None) for k, v in local.items()}
            for i in range(len(built["exp_avg"])):
                b = built["exp_avg"][i]
                out[(b.key, tuple(b.global_offset), (1,) * b.prepend_axis_num + tuple(b.local_shape))] = {
                    k: built[k][i].data.clone() for k in built}
            continue
        out[(sh.key, tuple(sh.global_offset), (1,) * sh.prepend_axis_num + tuple(sh.local_shape))] = local
    return out


def _compare_moments(moments: dict, hf, hf_opt, padded: int) -> tuple[list[str], int]:
    """Megatron moments ({(key, offsets, lengths): {state: tensor}}) against the Hugging Face
    AdamW's, laid out as Megatron lays them by hand (test_mapping.megatron_layout); Megatron's
    padding rows, which have no counterpart, must be zero or are skipped (`zero_padding`)."""
    from test_mapping import megatron_layout
    names = {id(p): n for n, p in hf.named_parameters()}
    hf_moments = {k: {names[id(p)]: s[k] for p, s in hf_opt.state.items()} for k in ("exp_avg", "exp_avg_sq")}
    laid = {k: megatron_layout(v, hf.config, padded) for k, v in hf_moments.items()}
    bad, checked = [], 0
    for (key, off, ln), states in moments.items():
        for name, t in states.items():
            if key not in laid[name]:
                bad.append(f"{key} has no counterpart")
                continue
            box = tuple(slice(o, o + n) for o, n in zip(off, ln))
            want = laid[name][key][box].reshape(t.shape)
            if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
                rows = max(0, min(t.shape[0], VOCAB - off[0]))  # padding rows have no HF counterpart
                t, want = t[:rows], want[:rows]
            checked += t.numel()
            if not torch.equal(t, want):
                bad.append(f"{name} of {key} at {off}: max diff {float((t - want).abs().max())}")
    return bad, checked


def _saved_moments(path: str) -> dict:
    """The same, read whole from Megatron's own fully_reshardable checkpoint (DP > 1: a rank's
    optimizer holds only a slice; Megatron gathered the slices to save them)."""
    from bcp_core.tools.read import open_checkpoint, read_tensor
    st, md = open_checkpoint(path)
    out = {}
    for key, tm in md.tensors.items():
        for name in ("exp_avg", "exp_avg_sq"):
            prefix = f"optimizer.state.{name}."
            if key.startswith(prefix):
                out.setdefault((key[len(prefix):], (0,) * len(tm.shape), tuple(tm.shape)), {})[name] = \
                    read_tensor(st, md, key)
    return out


def _megatron_to_hf(rank, world_size, root):
    import warnings
    warnings.filterwarnings("ignore")
    from megatron.core import dist_checkpointing as dcp

    import bcp_core as bcp
    from bcp_integrations.megatron import fully_reshardable_param_state  # registers ("bcp", 1)
    from _megatron_cpu import cuda_on_cpu

    results = {}
    for case, (tp, pp, tied) in CASES.items():
        with cuda_on_cpu():
            cfg, model = _gpt(tp, pp, tied, qkv_bias=case in QWEN2)
            ddp, opt = _distributed(cfg, model)
            _train(ddp, opt, [tokens(10), tokens(11)])
            want = megatron_pass(ddp, tokens(99), True, SEQ, VOCAB)  # None off the last pipeline stage
            model_sd = model.sharded_state_dict()
            opt_sd = opt.sharded_state_dict(model_sd, metadata={"distrib_optim_sharding_type": "fully_reshardable"})
            path = os.path.join(root, case)  # Megatron's own fully_reshardable (gathered over DP)
            os.makedirs(path, exist_ok=True)
            torch.distributed.barrier()
            dcp.save({"model": model_sd, "optimizer": opt_sd}, path, sharded_strategy=("bcp", 1))
            distopt = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt
            # the same state written gather-free (SwiGLU's fc1 through its factory): the HF side loads this
            gather_free = path + "_gather_free"
            os.makedirs(gather_free, exist_ok=True)
            torch.distributed.barrier()
            model_sd = model.sharded_state_dict()  # dcp.save built the factories of the first in place
            opt_sd = opt.sharded_state_dict(model.sharded_state_dict(),
                                            metadata={"distrib_optim_sharding_type": "fully_reshardable"})
            opt_sd["param_state"] = fully_reshardable_param_state(distopt, model_sd)
            dcp.save({"model": model_sd, "optimizer": opt_sd}, gather_free, sharded_strategy=("bcp", 1))
            moments = _megatron_moments(model, opt) if tp * pp == 2 else _saved_moments(path)
        # every rank, on its own: a Hugging Face model and a fresh AdamW from the checkpoint
        torch.manual_seed(5)
        hf = hf_model(hf_config(tied, qwen2=case in QWEN2)).eval()
        hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-2, weight_decay=0.01)
        bcp.load(gather_free, {"model": hf, "optimizer": hf_opt}, mapping=bcp.mapping.megatron_to_hf(hf.config))
        with torch.no_grad():
            hf_logits = hf(input_ids=tokens(99)).logits
        r = {"framework": bcp.inspect(path).framework, "logits_diff": None, "megatron_logit_scale": None}
        if want is not None:
            r["logits_diff"] = float((hf_logits - want).abs().max())
            r["megatron_logit_scale"] = float(want.abs().max())
            r["megatron_logits"] = want.clone()
        bad, checked = _compare_moments(moments, hf, hf_opt, 128 * tp)
        r.update(bad=bad, checked=checked, steps=sorted({float(s["step"]) for s in hf_opt.state.values()}),
                 hf_states=len(hf_opt.state), hf_params=len(list(hf.parameters())),
                 megatron_step=sorted({float(s["step"]) for s in distopt.optimizer.state.values()}))
        trained = hf_opt.state[hf.model.embed_tokens.weight]["exp_avg"].clone()
        ref = {"logits": hf_logits, "moments": {n: {k: hf_opt.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq")}
                                                for n, p in hf.named_parameters()}}
        hf(input_ids=tokens(7), labels=tokens(7)).loss.backward()  # one more AdamW step runs
        hf_opt.step()
        r["continued"] = float(next(iter(hf_opt.state.values()))["step"]) == 3.0 and not torch.equal(
            trained, hf_opt.state[hf.model.embed_tokens.weight]["exp_avg"])
        ref["after_step"] = {n: p.detach().clone() for n, p in hf.named_parameters()}
        results[case] = r
        if case == "tp2_untied":
            refs = (gather_free, ref)
    results["reverse"] = _hf_to_megatron(root)
    from megatron.core import parallel_state as ps
    ps.destroy_model_parallel()
    for wrap in ("ddp", "fsdp2"):
        results[wrap] = _sharded_hf_target(wrap, *refs)
    return results


REVERSE = {"tp2_untied": (2, 1, False), "tp2_tied": (2, 1, True), "pp2_untied": (1, 2, False),
           "pp2_tied": (1, 2, True)}


def _hf_to_megatron(root: str) -> dict:
    """A LlamaForCausalLM trained 2 steps with torch's AdamW and saved by bcp (both ranks hold the
    same model: a replicated save), loaded into the GPTModel and its DistributedOptimizer at TP=2
    and PP=2 with `hf_to_megatron`: through `bcp_integrations.megatron.load` (TP=2) and through
    `BcpLoadShardedStrategy(mapping=...)` (PP=2); the optimizer state in the fully_reshardable layout."""
    import bcp_core as bcp
    import bcp_integrations.megatron as bm
    from _megatron_cpu import cuda_on_cpu
    from test_mapping import trained

    out = {}
    for case, (tp, pp, tied) in REVERSE.items():
        torch.manual_seed(11)
        hf = transformers.LlamaForCausalLM(hf_config(tied))
        with torch.no_grad():  # norms away from 1, so that a misplaced norm weight shows in the logits
            for name, p in hf.named_parameters():
                if "norm" in name:
                    p.uniform_(0.5, 1.5)
        hf_opt = trained(hf)
        path = os.path.join(root, f"hf_{case}")
        bcp.save(path, {"model": hf, "optimizer": hf_opt}).wait()
        with torch.no_grad():
            hf_logits = hf.eval()(input_ids=tokens(99)).logits
        m = bcp.mapping.hf_to_megatron(hf.config)
        with cuda_on_cpu():
            cfg, model = _gpt(tp, pp, tied)
            ddp, opt = _distributed(cfg, model)
            distopt = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt
            # Without Apex/TE (torch's Adam here) DistributedOptimizer.state_dict reads the step from
            # the inner optimizer's state, which a fresh one lacks; the load replaces all of it
            distopt.init_state_fn(distopt.optimizer, distopt.config)
            for st in distopt.optimizer.state.values():
                st["step"] = torch.tensor(0.0)
            sharded = {"model": model.sharded_state_dict()}
            sharded["optimizer"] = opt.sharded_state_dict(sharded["model"], is_loading=True, metadata={
                "distrib_optim_sharding_type": "fully_reshardable"})
            if pp == 1:
                loaded = bm.load(sharded, path, mapping=m)
            else:
                loaded = bm.BcpLoadShardedStrategy(mapping=m).load(sharded, path)
            model.load_state_dict(loaded["model"])
            opt.load_state_dict(loaded["optimizer"])
            want = megatron_pass(ddp, tokens(99), True, SEQ, VOCAB)  # None off the last pipeline stage
            moments = _megatron_moments(model, opt)
            steps = sorted({float(s["step"]) for s in distopt.optimizer.state.values()})
            _train(ddp, opt, [tokens(7)])  # one more step runs
            after = sorted({float(s["step"]) for s in distopt.optimizer.state.values()})
        r = {"logits_diff": None, "steps": steps, "after": after}
        if want is not None:
            r["logits_diff"] = float((hf_logits - want).abs().max())
        r["bad"], r["checked"] = _compare_moments(moments, hf, hf_opt, 128 * tp)
        out[case] = r
    return out


def _sharded_hf_target(wrap: str, path: str, ref: dict) -> dict:
    """The TP=2 checkpoint into a Hugging Face model under DDP or FSDP2 on both ranks, with a fresh
    AdamW, after Megatron made and destroyed its process groups: compared with the same load on one
    process (`ref`), then one more step on both. DDP loads with mapping="auto" (the checkpoint says
    Megatron saved it, the target is a Llama)."""
    torch.manual_seed(5)
    return load_into_wrapped_hf(transformers.LlamaForCausalLM(hf_config(False)).eval(), wrap, path, ref, tokens)


@pytest.fixture(scope="module")
def megatron_to_hf_run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("m2hf"))
    results = run_ranks(2, _megatron_to_hf, root, timeout=400)
    results[0]["root"] = root
    return results


@pytest.mark.parametrize("case", list(CASES))
def test_megatron_core_saves_the_layout_the_mapping_declares(megatron_to_hf_run, case):
    """The facts of docs/mapping.md, as megatron-core 0.16.1 writes them."""
    import bcp_core as bcp
    tp, pp, tied = CASES[case]
    path = os.path.join(megatron_to_hf_run[0]["root"], case)
    shapes = {k: tuple(tm.shape) for k, tm in bcp.inspect(path).tensors.items()}
    d = HIDDEN // HEADS
    want = {"embedding.word_embeddings.weight": (128 * tp, HIDDEN),  # padded to a multiple of 128 * TP
            "decoder.layers.self_attention.linear_qkv.weight": (LAYERS, (HEADS + 2 * GROUPS) * d, HIDDEN),
            "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (LAYERS, HIDDEN),  # local spec too
            "decoder.layers.self_attention.linear_proj.weight": (LAYERS, HIDDEN, HEADS * d),
            "decoder.layers.mlp.linear_fc1.layer_norm_weight": (LAYERS, HIDDEN),
            "decoder.layers.mlp.linear_fc1.weight": (LAYERS, 2 * FFN, HIDDEN),  # [gate; up], whole
            "decoder.layers.mlp.linear_fc2.weight": (LAYERS, HIDDEN, FFN),
            "decoder.final_layernorm.weight": (HIDDEN,)}
    if case in QWEN2:  # q/k/v biases: one row per row of the weight
        want["decoder.layers.self_attention.linear_qkv.bias"] = (LAYERS, (HEADS + 2 * GROUPS) * d)
    if not tied:
        want["output_layer.weight"] = (128 * tp, HIDDEN)
    model_keys = {k: v for k, v in shapes.items() if not k.startswith("optimizer.")}
    assert model_keys == want
    # DistributedOptimizer, fully_reshardable: every state in each parameter's global shape
    assert {k: v for k, v in shapes.items() if k.startswith("optimizer.")} == {
        f"optimizer.state.{s}.{k}": v for k, v in want.items() for s in ("param", "exp_avg", "exp_avg_sq")}
    from bcp_integrations.megatron.strategy import read_common_state
    common = read_common_state(path)  # the step: in the common state
    assert {g["step"] for g in common["optimizer"]["optimizer"]["param_groups"]} == {2}


@pytest.mark.parametrize("case", list(CASES))
def test_hf_logits_match_megatron(megatron_to_hf_run, case):
    diffs = [r[case]["logits_diff"] for r in megatron_to_hf_run if r[case]["logits_diff"] is not None]
    assert diffs, "no rank held Megatron's logits"
    assert all(r[case]["megatron_logit_scale"] > 0.1 for r in megatron_to_hf_run if r[case]["megatron_logit_scale"])
    assert max(diffs) <= 1e-5, diffs


@pytest.mark.parametrize("case", list(CASES))
def test_adam_moments_equal_megatrons_and_step_carries(megatron_to_hf_run, case):
    for r in megatron_to_hf_run:
        c = r[case]
        assert c["framework"] == "megatron"
        assert not c["bad"], c["bad"][:5]
        assert c["checked"] > 1000
        assert c["megatron_step"] == [2.0] and c["steps"] == [2.0]
        assert c["hf_states"] == c["hf_params"]  # every parameter got its state (tied: one tensor, one state)
        assert c["continued"]


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_megatron_checkpoint_loads_into_ddp_and_fsdp2(megatron_to_hf_run, wrap):
    """The same load into a Hugging Face model under DDP / FSDP2 on 2 ranks equals the one-process
    load: logits, moments (exactly), step; the next AdamW step lands where one process lands."""
    for r in megatron_to_hf_run:
        c = r[wrap]
        assert c["sharded"] and c["logits_diff"] <= 1e-6 and not c["bad"], c
        assert c["steps"] == [2.0] and c["states"] == 21
        assert c["after_step_diff"] <= 1e-6, c


@pytest.mark.parametrize("case", list(CASES))
def test_gather_free_optimizer_state_equals_megatrons_fully_reshardable(megatron_to_hf_run, case):
    """`fully_reshardable_param_state` (no gather; SwiGLU's fc1 cut at its [gate; up] factory parts,
    at DP=2 a rank's slice straddling the two) writes exactly the tensors Megatron's own
    fully_reshardable layout writes after gathering."""
    from bcp_core.tools.read import open_checkpoint, read_tensor
    path = os.path.join(megatron_to_hf_run[0]["root"], case)
    (st, md), (st2, md2) = open_checkpoint(path), open_checkpoint(path + "_gather_free")
    assert md.tensors.keys() == md2.tensors.keys()
    for key in md.tensors:
        assert torch.equal(read_tensor(st, md, key), read_tensor(st2, md2, key)), key
    if case == "dp2_tied":  # the DP slices were saved as several boxes each, where they fell
        fc1 = md2.tensors["optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight"]
        assert len(fc1.pieces) > 4, fc1.pieces


@pytest.mark.parametrize("case", list(REVERSE))
def test_hf_checkpoint_loads_into_megatron(megatron_to_hf_run, case):
    """The reverse: logits within 1e-5 of the Hugging Face model's, the DistributedOptimizer's
    moments equal to AdamW's element for element, step 2, and one more Megatron step runs."""
    diffs = [r["reverse"][case]["logits_diff"] for r in megatron_to_hf_run
             if r["reverse"][case]["logits_diff"] is not None]
    assert diffs and max(diffs) <= 1e-5, diffs
    for r in megatron_to_hf_run:
        c = r["reverse"][case]
        assert not c["bad"], c["bad"][:5]
        assert c["checked"] > 1000
        assert c["steps"] == [2.0] and c["after"] == [3.0], c


@pytest.mark.parametrize("case", ["tp2_untied", "pp2_tied"])
def test_export_to_hf_with_the_mapping_loads_with_from_pretrained(megatron_to_hf_run, case, tmp_path):
    """`bcp export PATH OUT --to hf --mapping megatron-to-hf --config CONFIG`: a directory that
    from_pretrained loads, with Megatron's logits (the tied model writes no lm_head)."""
    import json

    from safetensors import safe_open

    from bcp_core.tools.cli import main
    tied = CASES[case][2]
    config = tmp_path / "config.json"
    hf_config(tied).to_json_file(str(config))
    out = tmp_path / "hf"
    path = os.path.join(megatron_to_hf_run[0]["root"], case)
    assert main(["export", path, str(out), "--to", "hf", "--mapping", "megatron-to-hf", "--config",
                 str(config)]) == 0
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert ("lm_head.weight" in keys) != tied and len(keys) == 3 + 9 * LAYERS - tied
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] == tied
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        logits = hf(input_ids=tokens(99)).logits
    want = next(r[case]["megatron_logits"] for r in megatron_to_hf_run if r[case]["logits_diff"] is not None)
    assert float((logits - want).abs().max()) <= 1e-5


def test_export_with_a_mapping_refuses_a_wrong_config(megatron_to_hf_run, tmp_path):
    from bcp_core.errors import ToolError
    from bcp_core.tools.convert import export_checkpoint
    config = tmp_path / "config.json"
    transformers.LlamaConfig(**{**hf_config(False).to_dict(), "num_attention_heads": 8}).to_json_file(str(config))
    path = os.path.join(megatron_to_hf_run[0]["root"], "tp2_untied")
    with pytest.raises(ToolError, match=r"linear_qkv.weight' has shape \(2, 64, 32\).*declares \(2, 96, 32\)"):
        export_checkpoint(path, str(tmp_path / "out"), mapping="megatron-to-hf", config=str(config))
    assert not (tmp_path / "out").exists()


def test_auto_mapping_into_megatron_is_refused(megatron_to_hf_run):
    """Into Megatron, "auto" cannot pick: a sharded state dict does not say which family it is."""
    import bcp_core as bcp
    import bcp_integrations.megatron as bm
    path = os.path.join(megatron_to_hf_run[0]["root"], "hf_tp2_untied")
    with pytest.raises(bcp.MappingError, match="hf_to_megatron"):
        bm.load({}, path, mapping="auto")
