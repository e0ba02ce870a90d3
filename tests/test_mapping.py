"""bcp_core.mapping on synthetic checkpoints, one process: the primitives, the Llama family against
tensors laid out by hand the way Megatron lays them out, inverses, box-level reads and errors.

The Megatron side here is built by plain torch ops written from the layout facts (docs/mapping.md),
independently of the mapping code; tests/test_integration_megatron.py checks the same facts on a
real Megatron-core GPTModel.
"""

from __future__ import annotations

import io

import pytest
import torch

import bcp_core as bcp
from bcp_core.mapping import Copy, Mapping, Region, qkv_split, rows, stack, torch_scheme, unstack
from bcp_core.shards import ObjectShard

transformers = pytest.importorskip("transformers")

CFG = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
           intermediate_size=48, vocab_size=100, rms_norm_eps=1e-5, max_position_embeddings=64,
           tie_word_embeddings=False)
PADDED = 128


def llama(seed=0, **over):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**{**CFG, **over})
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1, so a misplaced norm weight shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return model


def megatron_layout(sd: dict, cfg, padded: int = PADDED, prefix: str = "") -> dict:
    """The Megatron-core GPTModel tensors of a Hugging Face Llama state dict, by hand."""
    L, H, h = cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads
    g = cfg.num_key_value_heads
    d, per = H // h, h // g

    def layer(name):
        return [sd[f"model.layers.{i}.{name}"] for i in range(L)]

    qkv = [torch.cat([q.reshape(g, per * d, H), k.reshape(g, d, H), v.reshape(g, d, H)], 1).reshape(-1, H)
           for q, k, v in zip(layer("self_attn.q_proj.weight"), layer("self_attn.k_proj.weight"),
                              layer("self_attn.v_proj.weight"))]

    def pad(t):
        return torch.cat([t, torch.full((padded - t.shape[0], H), 7.0)])  # junk in the padding rows

    out = {"embedding.word_embeddings.weight": pad(sd["model.embed_tokens.weight"]),
           "decoder.layers.self_attention.linear_qkv.weight": torch.stack(qkv),
           "decoder.layers.self_attention.linear_qkv.layer_norm_weight": torch.stack(layer("input_layernorm.weight")),
           "decoder.layers.self_attention.linear_proj.weight": torch.stack(layer("self_attn.o_proj.weight")),
           "decoder.layers.mlp.linear_fc1.layer_norm_weight": torch.stack(layer("post_attention_layernorm.weight")),
           "decoder.layers.mlp.linear_fc1.weight": torch.stack([torch.cat([a, b]) for a, b in zip(
               layer("mlp.gate_proj.weight"), layer("mlp.up_proj.weight"))]),
           "decoder.layers.mlp.linear_fc2.weight": torch.stack(layer("mlp.down_proj.weight")),
           "decoder.final_layernorm.weight": sd["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["output_layer.weight"] = pad(sd["lm_head.weight"])
    if "model.layers.0.self_attn.q_proj.bias" in sd:  # Qwen2: q/k/v biases, ordered like the rows
        out["decoder.layers.self_attention.linear_qkv.bias"] = torch.stack([
            torch.cat([q.reshape(g, per * d), k.reshape(g, d), v.reshape(g, d)], 1).reshape(-1)
            for q, k, v in zip(layer("self_attn.q_proj.bias"), layer("self_attn.k_proj.bias"),
                               layer("self_attn.v_proj.bias"))])
    return {prefix + k: v.clone() for k, v in out.items()}


def trained(model, steps=2):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i in range(steps):
        torch.manual_seed(100 + i)
        tokens = torch.randint(0, model.config.vocab_size, (2, 12))
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad()
    return opt


def megatron_checkpoint(path, model, opt=None, padded=PADDED, step_in_common=True, extra=None):
    """A bcp checkpoint keyed as Megatron saves a GPTModel and its fully_reshardable DistOpt state;
    Megatron's common state (the step) in common.pt (`step_in_common=True`, megatron-core up to 0.18)
    or in the object `common_state` (`"object"`, 0.19+), or nowhere (False). `extra`: more tensors."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    state = megatron_layout(sd, model.config, padded) | (extra or {})
    if opt is not None:
        names = {id(p): n for n, p in model.named_parameters()}
        for name in ("exp_avg", "exp_avg_sq"):
            moments = {names[id(p)]: s[name] for p, s in opt.state.items()}
            state |= megatron_layout(moments, model.config, padded, f"optimizer.state.{name}.")
        state |= megatron_layout(sd, model.config, padded, "optimizer.state.param.")
    common = io.BytesIO()
    if opt is not None and step_in_common:  # Megatron's common state: the step in the param groups
        step = int(next(iter(opt.state.values()))["step"])
        torch.save({"optimizer": {"optimizer": {"param_groups": [{"lr": 1e-2, "step": step}]}}}, common)
    if step_in_common == "object" and opt is not None:
        state["common_state/shard_0_1"] = ObjectShard(common.getvalue(), (0,), (1,))
    bcp.save(str(path), state).wait()
    if step_in_common is True and opt is not None:
        (path / "common.pt").write_bytes(common.getvalue())


def logits(model, seed=7):
    torch.manual_seed(seed)
    tokens = torch.randint(0, model.config.vocab_size, (2, 10))
    with torch.no_grad():
        return model(input_ids=tokens).logits


def assert_same_training_state(src, opt, dst, dst_opt) -> None:
    """`dst` (loaded through a mapping) has `src`'s weights and logits, and `dst_opt` the Adam moments
    and step (2) of `opt`, parameter by parameter."""
    for (n, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
        assert torch.equal(a, b), n
    assert torch.equal(logits(src), logits(dst))
    by_name = dict(dst.named_parameters())
    for p, s in opt.state.items():
        name = next(n for n, q in src.named_parameters() if q is p)
        got = dst_opt.state[by_name[name]]
        assert torch.equal(got["exp_avg"], s["exp_avg"]) and torch.equal(got["exp_avg_sq"], s["exp_avg_sq"]), name
        assert float(got["step"]) == 2.0
    assert len(dst_opt.state) == len(opt.state)


# ----------------------------------------------------------------------------- the Llama family

@pytest.mark.parametrize("tied", [False, True])
def test_megatron_layout_loads_into_llama_with_optimizer_state(tmp_path, tied):
    src = llama(tie_word_embeddings=tied)
    opt = trained(src)
    megatron_checkpoint(tmp_path, src, opt)
    dst = llama(seed=1, tie_word_embeddings=tied)
    dst_opt = torch.optim.AdamW(dst.parameters(), lr=1e-2)
    bcp.load(str(tmp_path), {"model": dst, "optimizer": dst_opt}, mapping=bcp.mapping.megatron_to_hf(dst.config))
    assert_same_training_state(src, opt, dst, dst_opt)
    for m, o in ((src, opt), (dst, dst_opt)):  # one more step goes the same way from both
        trained_step(m, o)
    assert torch.equal(logits(src), logits(dst))


def trained_step(model, opt):
    torch.manual_seed(1000)
    tokens = torch.randint(0, model.config.vocab_size, (2, 12))
    model(input_ids=tokens, labels=tokens).loss.backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("tied", [False, True])
def test_hf_checkpoint_loads_into_megatron_layout_and_back(tmp_path, tied):
    """hf_to_megatron is the exact inverse: HF (saved by bcp, with AdamW) -> Megatron keys -> HF."""
    src = llama(tie_word_embeddings=tied)
    opt = trained(src)
    bcp.save(str(tmp_path / "hf"), {"model": src, "optimizer": opt}).wait()
    sd = {k: v.detach() for k, v in src.state_dict().items()}
    want = megatron_layout(sd, src.config, padded=PADDED)
    names = {id(p): n for n, p in src.named_parameters()}
    for name in ("exp_avg", "exp_avg_sq"):
        want |= megatron_layout({names[id(p)]: s[name] for p, s in opt.state.items()}, src.config, PADDED,
                                f"optimizer.state.{name}.")
    want |= megatron_layout(sd, src.config, PADDED, "optimizer.state.param.")
    target = {k: torch.full_like(v, -3.0) for k, v in want.items()}
    bcp.load(str(tmp_path / "hf"), target, mapping=bcp.mapping.hf_to_megatron(src.config, padded_vocab_size=PADDED))
    for k, v in want.items():
        rows_ = src.config.vocab_size
        if k.endswith(("word_embeddings.weight", "output_layer.weight")):  # padding rows come back zero
            assert torch.equal(target[k][:rows_], v[:rows_]) and not target[k][rows_:].any(), k
        else:
            assert torch.equal(target[k], v), k
    # ... and back: Megatron keys -> HF, through the inverse of the inverse
    bcp.save(str(tmp_path / "mg"), target).wait()
    back = llama(seed=3, tie_word_embeddings=tied)
    back_opt = torch.optim.AdamW(back.parameters(), lr=1e-2)
    bcp.load(str(tmp_path / "mg"), {"model": back, "optimizer": back_opt},
             mapping=bcp.mapping.hf_to_megatron(src.config, padded_vocab_size=PADDED).inverse().with_step(2))
    assert torch.equal(logits(src), logits(back))
    assert all(float(s["step"]) == 2.0 for s in back_opt.state.values()) and len(back_opt.state) == len(opt.state)


def test_qwen2_qkv_biases_follow_their_rows(tmp_path):
    """Qwen2 adds q/k/v biases: Megatron keeps them in linear_qkv.bias, [L, (h + 2g) * d], ordered per
    query group like the weight's rows. Megatron -> Qwen2ForCausalLM gives the same weights, biases,
    logits and Adam state; and hf_to_megatron lays the biases out as Megatron does."""
    def qwen2(seed):
        torch.manual_seed(seed)
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**CFG)).eval()
        with torch.no_grad():  # biases are zero at init: make them tell the groups apart
            for n, p in model.named_parameters():
                if n.endswith("bias") or "norm" in n:
                    p.uniform_(0.5, 1.5) if "norm" in n else p.normal_()
        return model

    src = qwen2(0)
    assert src.config.model_type == "qwen2" and src.model.layers[0].self_attn.q_proj.bias is not None
    opt = trained(src)
    megatron_checkpoint(tmp_path / "mg", src, opt)
    dst = qwen2(1)
    dst_opt = torch.optim.AdamW(dst.parameters(), lr=1e-2)
    bcp.load(str(tmp_path / "mg"), {"model": dst, "optimizer": dst_opt},
             mapping=bcp.mapping.megatron_to_hf(dst.config))
    assert_same_training_state(src, opt, dst, dst_opt)

    bcp.save(str(tmp_path / "hf"), {"model": src}).wait()
    want = megatron_layout({k: v.detach() for k, v in src.state_dict().items()}, src.config)
    target = {k: torch.zeros_like(v) for k, v in want.items()}
    bcp.load(str(tmp_path / "hf"), target, mapping=bcp.mapping.hf_to_megatron(src.config, padded_vocab_size=PADDED))
    assert torch.equal(target["decoder.layers.self_attention.linear_qkv.bias"],
                       want["decoder.layers.self_attention.linear_qkv.bias"])


def test_unpadded_target_vocabulary_reads_the_config_rows(tmp_path):
    """Without padded_vocab_size the Megatron target has the config's vocab_size rows."""
    src = llama()
    bcp.save(str(tmp_path), {"model": src}).wait()
    m = bcp.mapping.hf_to_megatron(src.config)
    target = {"embedding.word_embeddings.weight": torch.zeros(100, 32)}
    bcp.load(str(tmp_path), target, strict=False, mapping=m)
    assert torch.equal(target["embedding.word_embeddings.weight"], src.model.embed_tokens.weight.detach())


def test_a_rank_reads_only_the_rows_its_boxes_need(tmp_path):
    """A target holding rows of k_proj reads only the k rows of the matching groups of linear_qkv."""
    from bcp_core.shards import Box, ShardedView
    src = llama()
    megatron_checkpoint(tmp_path, src)
    md = bcp.inspect(str(tmp_path))
    mapped = bcp.mapping.megatron_to_hf(src.config).bind(md)
    k = torch.empty(16, 32)  # k_proj of layer 1 is (2 groups * 8, 32): this rank holds group 1's rows
    view = ShardedView((16, 32), torch.float32, [Box((8, 0), (8, 32), k[8:])])
    items = mapped.read_items("model.model.layers.1.self_attn.k_proj.weight", mapped.metadata.tensors[
        "model.model.layers.1.self_attn.k_proj.weight"], view)
    assert [(i.fqn, i.offsets, i.lengths) for i in items] == [
        ("decoder.layers.self_attention.linear_qkv.weight", (1, 32 + 16, 0), (1, 8, 32))]  # group 1 = rows 32..63


# ----------------------------------------------------------------------------- primitives

def test_primitives_stack_unstack_rows_and_inverse(tmp_path):
    a, b = torch.arange(12.).reshape(3, 4), torch.arange(12., 24.).reshape(3, 4)
    bcp.save(str(tmp_path), {"model": {"a": a, "b": b}}).wait()
    scheme = torch_scheme()
    copies = stack(["a", "b"], "ab", (3, 4)) + rows("top", [("a", 0, 0, 1), ("b", 2, 1, 1)], (4,))
    m = Mapping("test", {"a": (3, 4), "b": (3, 4)}, {"ab": (2, 3, 4), "top": (3, 4)}, tuple(copies), scheme, scheme)
    target = {"model": {"ab": torch.zeros(2, 3, 4), "top": torch.full((3, 4), 5.0)}}
    bcp.load(str(tmp_path), target, mapping=m)
    assert torch.equal(target["model"]["ab"], torch.stack([a, b]))
    assert torch.equal(target["model"]["top"], torch.stack([a[0], b[2], torch.zeros(4)]))  # uncovered: zero
    bcp.save(str(tmp_path / "s"), target).wait()
    back = {"model": {"a": torch.zeros(3, 4), "b": torch.zeros(3, 4)}}
    inv = Mapping("stack only", m.sources, {"ab": (2, 3, 4)}, tuple(stack(["a", "b"], "ab", (3, 4))),
                  scheme, scheme).inverse()
    bcp.load(str(tmp_path / "s"), back, mapping=inv)
    assert torch.equal(back["model"]["a"], a) and torch.equal(back["model"]["b"], b)
    assert unstack("ab", ["a", "b"], (3, 4)) == [c.inverse() for c in stack(["a", "b"], "ab", (3, 4))]


@pytest.mark.parametrize("tied", [False, True])
def test_inverse_of_the_inverse_is_the_mapping(tied):
    m = bcp.mapping.megatron_to_hf({**CFG, "tie_word_embeddings": tied})
    assert m.inverse() != m and m.inverse().inverse() == m
    assert m.inverse().unread == m.weights_only


def test_qkv_split_orders_rows_per_query_group():
    copies = qkv_split("qkv", "q", "k", "v", heads=4, groups=2, head_dim=1)
    # qkv rows: [q0 q1 k0 v0 | q2 q3 k1 v1]
    got = sorted((c.target.key, c.target.offsets[0], c.source.offsets[0], c.source.lengths[0]) for c in copies)
    assert got == [("k", 0, 2, 1), ("k", 1, 6, 1), ("q", 0, 0, 2), ("q", 2, 4, 2), ("v", 0, 3, 1), ("v", 1, 7, 1)]


# ----------------------------------------------------------------------------- errors

def test_declaration_errors_are_refused_at_once():
    with pytest.raises(bcp.MappingError, match="differ in shape"):
        Copy(Region("t", (0, 0), (2, 3)), Region("s", (0, 0), (3, 2)))
    with pytest.raises(bcp.MappingError, match="overlap"):
        Mapping("m", {"s": (4,)}, {"t": (4,)}, tuple(rows("t", [("s", 0, 0, 3), ("s", 0, 2, 2)])),
                torch_scheme(), torch_scheme())
    with pytest.raises(bcp.MappingError, match=r"'t'.*does not lie in its declared shape \(4,\)"):
        Mapping("m", {"s": (8,)}, {"t": (4,)}, tuple(rows("t", [("s", 0, 0, 5)])), torch_scheme(), torch_scheme())
    with pytest.raises(bcp.MappingError, match="not a multiple"):
        bcp.mapping.megatron_to_hf({**CFG, "num_key_value_heads": 3})


@pytest.mark.parametrize("change, match", [
    ({"num_attention_heads": 8}, r"linear_qkv.weight' has shape \(2, 64, 32\).*declares \(2, 48, 32\)"),
    ({"vocab_size": 130}, r"embedding.word_embeddings.weight' of shape \(128, 32\).*lengths \[130, 32\]"),
    ({"num_hidden_layers": 3}, r"linear_qkv.weight' has shape \(2, 64, 32\).*declares \(3, 64, 32\)"),
    ({"intermediate_size": 40}, r"linear_fc1.weight' has shape \(2, 96, 32\).*declares \(2, 80, 32\)"),
])
def test_wrong_declarations_fail_loudly_and_load_nothing(tmp_path, change, match):
    src = llama()
    megatron_checkpoint(tmp_path, src)
    dst = llama(seed=1)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(bcp.MappingError, match=match):
        bcp.load(str(tmp_path), {"model": dst}, mapping=bcp.mapping.megatron_to_hf({**CFG, **change}))
    assert all(torch.equal(before[k], v) for k, v in dst.state_dict().items())


def test_missing_layer_in_a_hf_checkpoint_is_named(tmp_path):
    src = llama()
    state = {k: v for k, v in src.state_dict().items() if not k.startswith("model.layers.1.")}
    bcp.save(str(tmp_path), {"model": state}).wait()
    with pytest.raises(bcp.MappingError, match=r"'model.model.layers.1.self_attn.q_proj.weight' is not in"):
        bcp.load(str(tmp_path), {}, mapping=bcp.mapping.hf_to_megatron(src.config))


def test_target_of_another_shape_is_named(tmp_path):
    src = llama()
    megatron_checkpoint(tmp_path, src)
    m = bcp.mapping.megatron_to_hf(src.config)
    with pytest.raises(bcp.MappingError, match=r"'model.model.norm.weight' is \(32,\) by the mapping, the target has "
                                               r"\(16,\)"):
        bcp.load(str(tmp_path), {"model": {"model": {"norm": {"weight": torch.zeros(16)}}}}, strict=False, mapping=m)


def test_step_counter_must_be_known(tmp_path):
    src = llama()
    opt = trained(src)
    megatron_checkpoint(tmp_path, src, opt, step_in_common=False)
    dst = llama(seed=1)
    state = {"model": dst, "optimizer": torch.optim.AdamW(dst.parameters())}
    with pytest.raises(bcp.MappingError, match="step"):
        bcp.load(str(tmp_path), state, mapping=bcp.mapping.megatron_to_hf(dst.config))
    bcp.load(str(tmp_path), state, mapping=bcp.mapping.megatron_to_hf(dst.config, step=2))
    assert all(float(s["step"]) == 2.0 for s in state["optimizer"].state.values())


def test_step_counter_from_the_common_state_object_before_common_pt_and_a_huge_common_pt_refused(tmp_path):
    """bcp keeps Megatron's common state in the checkpoint (the object `common_state`, the bytes of a
    torch.save file; every release since it moved into the commit): it is read before a common.pt
    beside it, which an earlier save may have left. A checkpoint whose step is only in common.pt (an
    earlier bcp's, up to megatron-core 0.18) refuses one too large to be a common state, unread."""
    src = llama()
    opt = trained(src)
    megatron_checkpoint(tmp_path / "object", src, opt, step_in_common="object")
    with open(tmp_path / "object" / "common.pt", "wb") as f:  # sparse: 64 GiB that are never read
        f.truncate(64 << 30)
    dst = llama(seed=1)
    dst_opt = torch.optim.AdamW(dst.parameters(), lr=1e-2)
    bcp.load(str(tmp_path / "object"), {"model": dst, "optimizer": dst_opt},
             mapping=bcp.mapping.megatron_to_hf(dst.config))
    assert_same_training_state(src, opt, dst, dst_opt)
    megatron_checkpoint(tmp_path / "file", src, opt, step_in_common=True)
    with open(tmp_path / "file" / "common.pt", "wb") as f:
        f.truncate(64 << 30)
    with pytest.raises(bcp.MetadataError, match="common.pt"):
        bcp.load(str(tmp_path / "file"), {"model": dst, "optimizer": dst_opt},
                 mapping=bcp.mapping.megatron_to_hf(dst.config))


def test_corrupt_source_fails_the_mapped_load_without_changing_the_target(tmp_path):
    src = llama()
    megatron_checkpoint(tmp_path, src)
    md = bcp.inspect(str(tmp_path))
    piece = md.tensors["decoder.layers.mlp.linear_fc2.weight"].pieces[0]
    path = tmp_path / md.files[piece.file]
    raw = bytearray(path.read_bytes())
    raw[piece.byte_offset + 5] ^= 0xFF
    path.write_bytes(bytes(raw))
    dst = llama(seed=1)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(bcp.ChecksumError, match="linear_fc2"):
        bcp.load(str(tmp_path), {"model": dst}, mapping=bcp.mapping.megatron_to_hf(dst.config))
    assert all(torch.equal(before[k], v) for k, v in dst.state_dict().items())


def test_auto_picks_megatron_to_hf_from_the_recorded_framework(tmp_path):
    src = llama()
    megatron_checkpoint(tmp_path, src)
    dst = llama(seed=1)
    with pytest.raises(bcp.KeyMismatchError):  # saved as "plain": auto means no mapping
        bcp.load(str(tmp_path), {"model": dst}, mapping="auto")
    with pytest.raises(bcp.MappingError, match="'auto'"):
        bcp.load(str(tmp_path), {"model": dst}, mapping="something")


def test_qwen3_loads_through_its_registry_entry(tmp_path):
    """docs/mapping.md's worked example: Qwen3 (dense) is one registry entry, Llama's layers with per-head q/k
    RMSNorms (`self_attention.{q,k}_layernorm.weight` [L, head_dim]); a layout built by hand loads into
    Qwen3ForCausalLM with its logits, and the inverse gives the layout back."""
    from bcp_core.mapping.families import QWEN3, family_of
    cfg = transformers.Qwen3Config(**{**CFG, "head_dim": 16})  # head_dim other than hidden / heads
    assert family_of(cfg) is QWEN3 and QWEN3.qk_norm
    torch.manual_seed(0)
    src = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in src.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    sd = {k: v.detach() for k, v in src.state_dict().items()}
    L, H, h, g, d = 2, 32, 4, 2, 16
    per = h // g

    def layer(name):
        return torch.stack([sd[f"model.layers.{i}.{name}"] for i in range(L)])

    def pad(t):
        return torch.cat([t, torch.full((PADDED - t.shape[0], H), 7.0)])

    qkv = torch.stack([torch.cat([sd[f"model.layers.{i}.self_attn.q_proj.weight"].reshape(g, per * d, H),
                                  sd[f"model.layers.{i}.self_attn.k_proj.weight"].reshape(g, d, H),
                                  sd[f"model.layers.{i}.self_attn.v_proj.weight"].reshape(g, d, H)], 1).reshape(-1, H)
                       for i in range(L)])
    want = {"embedding.word_embeddings.weight": pad(sd["model.embed_tokens.weight"]),
            "output_layer.weight": pad(sd["lm_head.weight"]), "decoder.final_layernorm.weight": sd["model.norm.weight"],
            "decoder.layers.self_attention.linear_qkv.weight": qkv,
            "decoder.layers.self_attention.linear_qkv.layer_norm_weight": layer("input_layernorm.weight"),
            "decoder.layers.self_attention.linear_proj.weight": layer("self_attn.o_proj.weight"),
            "decoder.layers.self_attention.q_layernorm.weight": layer("self_attn.q_norm.weight"),
            "decoder.layers.self_attention.k_layernorm.weight": layer("self_attn.k_norm.weight"),
            "decoder.layers.mlp.linear_fc1.layer_norm_weight": layer("post_attention_layernorm.weight"),
            "decoder.layers.mlp.linear_fc1.weight": torch.cat([layer("mlp.gate_proj.weight"),
                                                              layer("mlp.up_proj.weight")], 1),
            "decoder.layers.mlp.linear_fc2.weight": layer("mlp.down_proj.weight")}
    bcp.save(str(tmp_path / "mg"), {k: v.clone() for k, v in want.items()}).wait()
    dst = transformers.Qwen3ForCausalLM(cfg).eval()
    bcp.load(str(tmp_path / "mg"), {"model": dst}, mapping=bcp.mapping.megatron_to_hf(cfg))
    assert torch.equal(logits(src), logits(dst))
    bcp.save(str(tmp_path / "hf"), {"model": src}).wait()
    back = {k: torch.zeros_like(v) for k, v in want.items()}
    bcp.load(str(tmp_path / "hf"), back, mapping=bcp.mapping.hf_to_megatron(cfg, padded_vocab_size=PADDED))
    for k, v in want.items():
        n = CFG["vocab_size"] if k.endswith(("word_embeddings.weight", "output_layer.weight")) else None
        assert torch.equal(back[k][:n], v[:n]), k


# ----------------------------------------------------------------------------- a config that disagrees

def _megatron_framework() -> str:
    pytest.importorskip("megatron.core")
    import bcp_integrations.megatron  # noqa: F401 - registers framework "megatron" (what export and auto go by)
    return "megatron"


def test_untied_output_layer_with_a_tied_config_is_refused_before_anything_is_written(tmp_path):
    """A Megatron checkpoint with its own output layer (--untie-embeddings-and-output-weights) and a
    config saying tie_word_embeddings=true: the mapping would make lm_head the embedding and never read
    output_layer.weight. Load (explicit and auto) and export refuse it, naming the tensor; nothing of
    the target changes, no export directory appears."""
    from bcp_core.tools.cli import main
    import json
    src = llama()  # untied
    state = megatron_layout({k: v.detach() for k, v in src.state_dict().items()}, src.config)
    assert "output_layer.weight" in state
    bcp.save(str(tmp_path / "mg"), state, framework=_megatron_framework()).wait()
    dst = llama(seed=1, tie_word_embeddings=True)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    for mapping in (bcp.mapping.megatron_to_hf(dst.config), "auto"):
        with pytest.raises(bcp.MappingError, match=r"holds 1 model tensor .*: output_layer\.weight \(the config's "
                                                   r"tie_word_embeddings=true"):
            bcp.load(str(tmp_path / "mg"), {"model": dst}, mapping=mapping)
        assert all(torch.equal(before[k], v) for k, v in dst.state_dict().items())
    (tmp_path / "config.json").write_text(json.dumps({**CFG, "model_type": "llama", "tie_word_embeddings": True}))
    out = tmp_path / "hf"
    assert main(["-q", "export", str(tmp_path / "mg"), str(out), "--to", "hf", "--mapping", "megatron-to-hf",
                 "--config", str(tmp_path / "config.json")]) != 0
    assert not out.exists()
    # the config that agrees exports and loads
    (tmp_path / "config.json").write_text(json.dumps({**CFG, "model_type": "llama"}))
    assert main(["-q", "export", str(tmp_path / "mg"), str(out), "--to", "hf", "--mapping", "megatron-to-hf",
                 "--config", str(tmp_path / "config.json")]) == 0
    assert torch.equal(logits(src), logits(transformers.LlamaForCausalLM.from_pretrained(str(out)).eval()))


@pytest.mark.parametrize("extra, match", [
    ({"decoder.layers.self_attention.linear_qkv.bias": (2, 64)}, r"linear_qkv\.bias \(.*attention_bias=false"),
    ({"decoder.layers.self_attention.linear_proj.bias": (2, 32)}, r"linear_proj\.bias \(.*attention_bias=false"),
    ({"decoder.layers.mlp.linear_fc1.bias": (2, 96), "decoder.layers.mlp.linear_fc2.bias": (2, 32)},
     r"holds 2 model tensors .*linear_fc1\.bias, decoder\.layers\.mlp\.linear_fc2\.bias \(.*mlp_bias=false"),
    ({"decoder.layers.self_attention.q_layernorm.weight": (2, 8),
      "decoder.layers.self_attention.k_layernorm.weight": (2, 8)}, r"k_layernorm\.weight, .*q_layernorm\.weight \(a "
                                                                   r"Llama config declares no per-head q/k norms"),
    ({"decoder.layers.self_attention.linear_qkv._extra_state": (4,), "rotary_pos_emb.inv_freq": (4,),
      "mtp.layers.0.enorm.weight": (32,)}, None),  # left by design: these load
])
def test_model_tensors_the_config_does_not_read_are_refused(tmp_path, extra, match):
    """A tensor of the checkpoint's model that no copy of the mapping reads (a bias, a norm the config
    does not declare) is a MappingError naming it, before anything is read: loading without it would
    make another model. Optimizer state, extra state, rotary frequencies and multi-token prediction
    layers (a transformers model holds none) are no such tensors."""
    src = llama()
    opt = trained(src)
    megatron_checkpoint(tmp_path / "mg", src, opt, extra={k: torch.ones(s) for k, s in extra.items()})
    dst = llama(seed=1)
    dst_opt = torch.optim.AdamW(dst.parameters(), lr=1e-2)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    target = {"model": dst, "optimizer": dst_opt}
    if match is None:
        bcp.load(str(tmp_path / "mg"), target, mapping=bcp.mapping.megatron_to_hf(dst.config))
        assert_same_training_state(src, opt, dst, dst_opt)
        return
    with pytest.raises(bcp.MappingError, match="the config disagrees with the checkpoint.*" + match):
        bcp.load(str(tmp_path / "mg"), target, mapping=bcp.mapping.megatron_to_hf(dst.config))
    assert all(torch.equal(before[k], v) for k, v in dst.state_dict().items()) and not dst_opt.state


def test_hf_checkpoint_tensors_the_config_does_not_read_are_refused(tmp_path):
    """The other way: a Qwen2 checkpoint (q/k/v biases) into Megatron with a Llama config is refused,
    naming the biases; a tied Llama's saved lm_head (one tensor with the embedding) is no such tensor."""
    qwen2 = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**CFG))
    bcp.save(str(tmp_path / "q"), {"model": qwen2}).wait()
    with pytest.raises(bcp.MappingError, match=r"holds 6 model tensors .*model\.model\.layers\.0\.self_attn\.k_proj"
                                               r"\.bias"):
        bcp.load(str(tmp_path / "q"), {}, strict=False, mapping=bcp.mapping.hf_to_megatron(CFG))
    tied = llama(tie_word_embeddings=True)
    bcp.save(str(tmp_path / "t"), {"model": tied}).wait()
    assert "model.lm_head.weight" in bcp.inspect(str(tmp_path / "t")).tensors
    target = {"embedding.word_embeddings.weight": torch.zeros(100, 32)}
    bcp.load(str(tmp_path / "t"), target, strict=False, mapping=bcp.mapping.hf_to_megatron(tied.config))
    assert torch.equal(target["embedding.word_embeddings.weight"], tied.model.embed_tokens.weight.detach())
